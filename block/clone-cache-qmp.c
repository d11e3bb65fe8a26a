/*
 * Clone cache: QMP commands (query-clone-cache, boot-set traces,
 * clone-cache-unpin, clone-cache-invalidate) and what they report and do
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qemu/units.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qemu/memalign.h"
#include "qapi/error.h"
#include "qapi/qapi-commands-block-core.h"
#include "qom/object.h"
#include "block/block_int.h"
#include "block/block-io.h"
#include "clone-cache.h"
#include "visit-options.h"
#include "trace.h"

/* ---- QMP ---- */

static int cc_info_one(Object *obj, void *opaque)
{
    CloneCacheInfoList ***tail = opaque;
    CloneCacheStore *s = (CloneCacheStore *)object_dynamic_cast(
        obj, TYPE_CLONE_CACHE);

    if (s && s->blk) {
        CloneCacheInfo *info = clone_cache_store_info(s);

        info->id = g_strdup(object_get_canonical_path_component(obj));
        QAPI_LIST_APPEND(*tail, info);
    }
    return 0;
}

CloneCacheInfoList *qmp_query_clone_cache(Error **errp)
{
    CloneCacheInfoList *head = NULL, **tail = &head;

    object_child_foreach(object_get_objects_root(), cc_info_one, &tail);
    return head;
}

CloneCacheInfo *clone_cache_store_info(CloneCacheStore *s)
{
    CloneCacheInfo *info = g_new0(CloneCacheInfo, 1);
    CloneCacheBaseInfoList **tail = &info->bases;
    int b;

    qemu_mutex_lock(&s->lock);
    info->filename = g_strdup(s->filename);
    info->size = s->size;
    info->block_size = s->block_size;
    info->slots = s->nb_slots;
    info->used = s->nb_slots - s->nb_free;
    info->pinned = s->nb_pinned;
    info->evictions = s->evictions;
    info->dedup_shared = s->dedup_shared;
    info->fill_pending = s->fill_pending;
    info->fill_errors = s->fill_errors;
    info->checksum_errors = s->checksum_errors;
    info->discarded_records = s->discarded_records;
    for (b = 0; b < CC_MAX_BASES; b++) {
        CloneCacheBase *base = &s->bases[b];
        CloneCacheBaseInfo *bi;

        if (!base->id) {
            continue;
        }
        bi = g_new0(CloneCacheBaseInfo, 1);
        bi->base_id = g_strdup(base->id);
        bi->generation = base->generation;
        bi->node_name = g_strdup(base->node_name);
        bi->open = base->users > 0;
        bi->entries = base->nb_entries;
        bi->hits = base->st.hits;
        bi->misses = base->st.misses;
        bi->merged_misses = base->st.merged;
        bi->base_read_bytes = base->st.base_read_bytes;
        bi->cache_read_bytes = base->st.cache_read_bytes;
        bi->fills = base->st.fills;
        bi->fill_bytes = base->st.fill_bytes;
        bi->fills_dropped = base->st.fills_dropped;
        QAPI_LIST_APPEND(tail, bi);
    }
    qemu_mutex_unlock(&s->lock);
    return info;
}

/* ---- boot-set traces ---- */

#define CC_TRACE_MAGIC      "clone-cache-trace 1"
#define CC_TRACE_MAX_BYTES  (256 * MiB)

void qmp_clone_cache_record(const char *node_name, Error **errp)
{
    BlockDriverState *bs = find_driver_node(node_name, &bdrv_clone_cache, errp);
    BDRVCloneCacheState *s;

    if (!bs) {
        return;
    }
    s = bs->opaque;
    qemu_mutex_lock(&s->store->lock);
    if (s->rec_seen) {
        error_setg(errp, "Node '%s' is already recording", node_name);
    } else {
        s->rec_seen = bitmap_new(s->nb_blocks);
        s->rec_order = g_array_new(false, false, sizeof(uint64_t));
    }
    qemu_mutex_unlock(&s->store->lock);
}

CloneCacheTrace *qmp_clone_cache_record_stop(const char *node_name,
                                             const char *filename,
                                             Error **errp)
{
    BlockDriverState *bs = find_driver_node(node_name, &bdrv_clone_cache, errp);
    BDRVCloneCacheState *s;
    g_autoptr(GString) out = g_string_new(NULL);
    g_autoptr(GArray) order = NULL;
    g_autofree unsigned long *seen = NULL;
    CloneCacheTrace *ret;
    uint64_t i, n;
    int fd;

    if (!bs) {
        return NULL;
    }
    s = bs->opaque;
    qemu_mutex_lock(&s->store->lock);
    order = s->rec_order;
    seen = s->rec_seen;
    s->rec_order = NULL;
    s->rec_seen = NULL;
    qemu_mutex_unlock(&s->store->lock);
    if (!order) {
        error_setg(errp, "Node '%s' is not recording", node_name);
        return NULL;
    }
    n = order->len;
    g_string_append_printf(out, CC_TRACE_MAGIC " %" PRIu64 " %" PRIu64 "\n",
                           s->store->block_size, s->nb_blocks);
    for (i = 0; i < n; i++) {
        g_string_append_printf(out, "%" PRIu64 "\n",
                               g_array_index(order, uint64_t, i));
    }
    fd = qemu_create(filename, O_WRONLY | O_TRUNC | O_BINARY, 0600, errp);
    if (fd < 0) {
        return NULL;
    }
    if (qemu_write_full(fd, out->str, out->len) != out->len ||
        qemu_fdatasync(fd) < 0) {
        error_setg_errno(errp, errno, "Cannot write '%s'", filename);
        qemu_close(fd);
        return NULL;
    }
    qemu_close(fd);
    ret = g_new0(CloneCacheTrace, 1);
    ret->blocks = n;
    return ret;
}

/* Parse and check a trace: the blocks, or NULL with @errp set */
static GArray *cc_trace_load(BDRVCloneCacheState *s, const char *filename,
                             Error **errp)
{
    g_autofree char *text = NULL;
    g_autoptr(GArray) blocks = g_array_new(false, false, sizeof(uint64_t));
    g_autoptr(GError) gerr = NULL;
    uint64_t bsz, nb, b;
    char *line, *save = NULL, *end;
    gsize len;
    int lineno = 1;

    if (!g_file_get_contents(filename, &text, &len, &gerr)) {
        error_setg(errp, "Cannot read trace '%s': %s", filename,
                   gerr->message);
        return NULL;
    }
    if (len > CC_TRACE_MAX_BYTES || strlen(text) != len) {
        error_setg(errp, "'%s' is not a clone-cache trace", filename);
        return NULL;
    }
    line = strtok_r(text, "\n", &save);
    if (!line || sscanf(line, CC_TRACE_MAGIC " %" SCNu64 " %" SCNu64, &bsz,
                        &nb) != 2) {
        error_setg(errp, "'%s' is not a clone-cache trace", filename);
        return NULL;
    }
    if (bsz != s->store->block_size || nb != s->nb_blocks) {
        error_setg(errp, "Trace '%s' was recorded with block size %" PRIu64
                   " over %" PRIu64 " blocks; this node has %" PRIu64
                   " over %" PRIu64, filename, bsz, nb, s->store->block_size,
                   s->nb_blocks);
        return NULL;
    }
    while ((line = strtok_r(NULL, "\n", &save))) {
        lineno++;
        if (qemu_strtou64(line, (const char **)&end, 10, &b) < 0 ||
            *end || b >= s->nb_blocks) {
            error_setg(errp, "Trace '%s', line %d: not a block of this base",
                       filename, lineno);
            return NULL;
        }
        g_array_append_val(blocks, b);
    }
    return g_steal_pointer(&blocks);
}

typedef struct CloneCachePrewarm {
    BlockDriverState *bs;
    GArray *blocks;
    bool pin;
} CloneCachePrewarm;

/* Cache (and pin) one block; the graph lock only while it is read */
static int coroutine_fn cc_prewarm_one(BlockDriverState *bs, uint64_t block,
                                       bool pin)
{
    BDRVCloneCacheState *s = bs->opaque;
    CloneCacheStore *store = s->store;
    CloneCacheInflight *f;
    uint32_t slot;
    int ret;

    GRAPH_RDLOCK_GUARD();
    qemu_mutex_lock(&store->lock);
    slot = clone_cache_lookup(store, s->base, block);
    if (slot != CC_NONE) {
        qemu_mutex_unlock(&store->lock);
        return clone_cache_pin(store, slot, pin);
    }
    if (!cc_is_miss(s, block)) {
        qemu_mutex_unlock(&store->lock);
        return 0;               /* a guest read has it in flight */
    }
    f = g_new0(CloneCacheInflight, 1);
    f->first = block;
    f->nb = 1;
    f->refs = 1;
    f->buf = qemu_try_blockalign(bs->file->bs, store->block_size);
    if (!f->buf) {
        g_free(f);
        qemu_mutex_unlock(&store->lock);
        return -ENOMEM;
    }
    qemu_co_queue_init(&f->waiters);
    ret = cc_read_base(bs, f, pin);
    cc_inflight_unref(f);
    qemu_mutex_unlock(&store->lock);
    return ret;
}

/*
 * Read the trace's blocks through the miss path, one block at a time (a
 * boot set is small; the fills are what matter), pinning those cached
 * already when asked.  A drained section (the node closing) ends it.
 */
static void coroutine_fn cc_prewarm_co(void *opaque)
{
    CloneCachePrewarm *p = opaque;
    BlockDriverState *bs = p->bs;
    BDRVCloneCacheState *s = bs->opaque;
    uint64_t i;
    int ret = 0;

    for (i = 0; i < p->blocks->len; i++) {
        uint64_t block = g_array_index(p->blocks, uint64_t, i);

        if (qatomic_read(&bs->quiesce_counter)) {
            break;
        }
        ret = cc_prewarm_one(bs, block, p->pin);
        if (ret < 0) {
            warn_report("clone-cache: prewarming node '%s' stopped at block "
                        "%" PRIu64 " of %u: %s", bdrv_get_node_name(bs), i,
                        p->blocks->len, strerror(-ret));
            break;
        }
    }
    trace_clone_cache_prewarm_done(bs, i, p->blocks->len);
    qatomic_store_release(&s->prewarming, false);
    g_array_free(p->blocks, true);
    g_free(p);
    bdrv_dec_in_flight(bs);
}

void qmp_clone_cache_prewarm(const char *node_name, const char *filename,
                             bool has_pin, bool pin, Error **errp)
{
    BlockDriverState *bs;
    BDRVCloneCacheState *s;
    CloneCachePrewarm *p;
    GArray *blocks;

    GLOBAL_STATE_CODE();
    bs = find_driver_node(node_name, &bdrv_clone_cache, errp);
    if (!bs) {
        return;
    }
    s = bs->opaque;
    if (qatomic_load_acquire(&s->prewarming)) {
        error_setg(errp, "Node '%s' is already prewarming", node_name);
        return;
    }
    blocks = cc_trace_load(s, filename, errp);
    if (!blocks) {
        return;
    }
    p = g_new0(CloneCachePrewarm, 1);
    p->bs = bs;
    p->blocks = blocks;
    p->pin = has_pin && pin;
    qatomic_set(&s->prewarming, true);
    bdrv_inc_in_flight(bs);
    aio_co_enter(bdrv_get_aio_context(bs),
                 qemu_coroutine_create(cc_prewarm_co, p));
}

/* A coroutine command: the slot table is scanned in steps */
void coroutine_fn qmp_clone_cache_unpin(const char *node_name, Error **errp)
{
    BlockDriverState *bs;
    BDRVCloneCacheState *s;

    GLOBAL_STATE_CODE();
    bs = find_driver_node(node_name, &bdrv_clone_cache, errp);
    if (!bs) {
        return;
    }
    bdrv_ref(bs);               /* the node may close while we yield */
    s = bs->opaque;
    clone_cache_unpin_base(s->store, s->base, errp);
    bdrv_co_unref(bs);
}

void qmp_clone_cache_invalidate(const char *id, const char *base_id,
                                Error **errp)
{
    CloneCacheStore *s = clone_cache_store_find(id, errp);

    if (s) {
        clone_cache_invalidate(s, base_id, errp);
    }
}
