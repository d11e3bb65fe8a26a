/*
 * Hybrid block format: QMP commands (query-hybrid, hybrid-set-mode) and
 * what they report and do
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qobject/qdict.h"
#include "qemu/bitmap.h"
#include "qemu/timer.h"
#include "qapi/qapi-commands-block-core.h"
#include "block/block_int.h"
#include "block/block-global-state.h"
#include "block/block-io.h"
#include "hybrid.h"
#include "visit-options.h"

/*
 * A reopen that changes only the mode: drained like blockdev-reopen, and
 * the node's options stay in step (a later reopen keeps the new mode).
 */
static int hybrid_set_mode(BlockDriverState *bs, HybridMode mode, Error **errp)
{
    QDict *opts = qdict_new();

    GLOBAL_STATE_CODE();
    qdict_put_str(opts, HYBRID_OPT_MODE, HybridMode_str(mode));
    return bdrv_reopen(bs, opts, true, errp);
}

static HybridInfo *hybrid_get_info(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;
    HybridInfo *info = g_new0(HybridInfo, 1);
    uint64_t used = hybrid_ram_used_bytes(s);
    uint64_t logical = s->dedup ? (s->nb_loaded << s->block_shift) : used;
    uint64_t reads = s->read_hits + s->read_misses;

    info->node_name = g_strdup(bdrv_get_node_name(bs));
    info->mode = s->mode;
    info->dedup = s->dedup;
    info->block_size = s->block_size;
    info->virtual_size = s->size;
    info->ram_size = s->ram_blocks << s->block_shift;
    info->ram_loaded = MIN(s->nb_loaded << s->block_shift, s->size);
    info->ram_used = used;
    info->metadata_bytes = hybrid_ram_metadata_bytes(s);
    info->metadata_per_block = s->ram_blocks ?
        (double)info->metadata_bytes / s->ram_blocks : 0;
    info->dedup_ratio = used ? (double)logical / used : 1.0;
    info->dirty_bytes = s->dirty_bytes;
    info->dirty_limit = s->dirty_limit;
    info->read_hits = s->read_hits;
    info->read_misses = s->read_misses;
    info->hit_rate = reads ? (double)s->read_hits / reads : 0;
    info->writes_ram = s->write_ram;
    info->writes_through = s->write_through;
    info->flushed_bytes = s->flushed_bytes;
    info->promoted_bytes = s->hot ?
        (uint64_t)g_hash_table_size(s->hot) << s->block_shift : 0;
    info->promote_limit = s->hot ? s->promote_blocks << s->block_shift : 0;
    info->promotions = s->promotions;
    info->demotions = s->demotions;
    info->restore_active = s->restore_workers > 0;
    info->restore_done = s->restore_done;
    info->restore_bytes = s->restore_bytes;
    /* With a backing file only the image's own blocks are restored */
    info->restore_total = MIN((s->alloc ? bitmap_count_one(s->alloc,
                                                           hybrid_ram_end(s))
                                        : hybrid_ram_end(s)) << s->block_shift,
                              s->size);
    if (s->restore_start_ns) {
        int64_t end = s->restore_done ? s->restore_end_ns :
                      qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
        info->restore_ms = (end - s->restore_start_ns) / SCALE_MS;
    }
    if (s->region) {
        info->region = g_new0(HybridRegionInfo, 1);
        info->region->file = g_strdup(s->ram_file);
        info->region->token = s->header.region_token;
        info->region->reused = s->region_reused;
        info->region->dirty_blocks_found = s->region_dirty_found;
        info->region->attach_us = s->region_attach_ns / SCALE_US;
    }
    if (s->mirror_name) {
        HybridMirrorInfo *m = g_new0(HybridMirrorInfo, 1);

        m->node_name = g_strdup(s->mirror_name);
        m->degraded = s->mirror_error != 0;
        if (s->mirror_error) {
            m->error = g_strdup(strerror(-s->mirror_error));
        }
        m->counted_blocks = s->mirror_counted;
        m->recovered = s->mirror_recovered;
        m->blocks_found = s->mirror_dirty_found;
        m->writes = s->mirror_writes;
        m->block_writes = s->mirror_block_writes;
        m->bytes = s->mirror_bytes;
        m->uncounted_blocks = s->mirror_uncounted;
        m->matched_blocks = s->mirror_matched;
        m->matched_writes = s->mirror_matched_writes;
        m->prefilling = s->mirror_prefilling;
        info->mirror = m;
    }
    if (s->flush_error) {
        info->error = g_strdup(strerror(-s->flush_error));
    } else if (s->restore_error) {
        info->error = g_strdup_printf("restore: %s",
                                      strerror(-s->restore_error));
    }
    return info;
}

HybridInfoList *qmp_query_hybrid(const char *node_name, Error **errp)
{
    HybridInfoList *head = NULL, **tail = &head;
    BlockDriverState *bs;

    GLOBAL_STATE_CODE();
    GRAPH_RDLOCK_GUARD_MAINLOOP();

    if (node_name) {
        bs = find_driver_node(node_name, &bdrv_hybrid, errp);
        if (!bs) {
            return NULL;
        }
        QAPI_LIST_APPEND(tail, hybrid_get_info(bs));
        return head;
    }
    for (bs = bdrv_next_all_states(NULL); bs; bs = bdrv_next_all_states(bs)) {
        if (bs->drv == &bdrv_hybrid) {
            QAPI_LIST_APPEND(tail, hybrid_get_info(bs));
        }
    }
    return head;
}

void qmp_hybrid_set_mirror(const char *node_name, const char *mirror,
                           Error **errp)
{
    BlockDriverState *bs, *mbs;

    GLOBAL_STATE_CODE();

    /* No graph lock: the node is drained around the change */
    bs = find_driver_node(node_name, &bdrv_hybrid, errp);
    if (!bs) {
        return;
    }
    mbs = bdrv_find_node(mirror);
    if (!mbs) {
        error_setg(errp, "Cannot find node '%s'", mirror);
        return;
    }
    hybrid_mirror_replace(bs, mbs, errp);
}

void qmp_hybrid_set_mode(const char *node_name, HybridMode mode,
                         Error **errp)
{
    BlockDriverState *bs;

    GLOBAL_STATE_CODE();

    /* No graph lock: the reopen drains the node */
    bs = find_driver_node(node_name, &bdrv_hybrid, errp);
    if (!bs) {
        return;
    }
    if (bdrv_is_read_only(bs)) {
        error_setg(errp, "Node '%s' is read-only", node_name);
        return;
    }
    hybrid_set_mode(bs, mode, errp);
}
