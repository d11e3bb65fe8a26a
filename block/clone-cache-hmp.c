/*
 * Clone cache: HMP "info clone-cache"
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qapi/qapi-commands-block-core.h"
#include "monitor/hmp.h"
#include "monitor/monitor.h"
#include "block/block-hmp-cmds.h"

void hmp_info_clone_cache(Monitor *mon, const QDict *qdict)
{
    Error *err = NULL;
    CloneCacheInfoList *list = qmp_query_clone_cache(&err);
    CloneCacheInfoList *e;
    CloneCacheBaseInfoList *b;

    if (hmp_handle_error(mon, err)) {
        return;
    }
    if (!list) {
        monitor_printf(mon, "No clone caches\n");
    }
    for (e = list; e; e = e->next) {
        CloneCacheInfo *i = e->value;

        monitor_printf(mon, "%s: %s, %" PRIu64 " of %" PRIu64 " blocks of %"
                       PRIu32 " bytes used (%" PRIu64 " pinned), %" PRIu64
                       " evictions, %" PRIu64 " blocks shared by content\n",
                       i->id, i->filename, i->used, i->slots, i->block_size,
                       i->pinned, i->evictions, i->dedup_shared);
        monitor_printf(mon, "  fill pending %" PRIu64 " bytes, %" PRIu64
                       " fill errors, %" PRIu64 " checksum errors, %" PRIu64
                       " damaged records\n", i->fill_pending, i->fill_errors,
                       i->checksum_errors, i->discarded_records);
        for (b = i->bases; b; b = b->next) {
            CloneCacheBaseInfo *bi = b->value;
            uint64_t total = bi->hits + bi->misses + bi->merged_misses;

            monitor_printf(mon, "  base %s (generation %" PRIu64 ")%s%s%s: %"
                           PRIu64 " blocks; hits %" PRIu64 " misses %" PRIu64
                           " merged %" PRIu64 " (hit rate %.1f%%), base read %"
                           PRIu64 " bytes, filled %" PRIu64 " bytes, %" PRIu64
                           " fills dropped\n", bi->base_id, bi->generation,
                           bi->open ? " open as " : "",
                           bi->open ? bi->node_name : "",
                           bi->open ? "" : " closed", bi->entries, bi->hits,
                           bi->misses, bi->merged_misses,
                           total ? 100.0 * bi->hits / total : 0.0,
                           bi->base_read_bytes, bi->fill_bytes,
                           bi->fills_dropped);
        }
    }
    qapi_free_CloneCacheInfoList(list);
}
