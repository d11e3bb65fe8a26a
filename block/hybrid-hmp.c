/*
 * Hybrid block format: HMP "info hybrid"
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qapi/qapi-commands-block-core.h"
#include "qobject/qdict.h"
#include "monitor/hmp.h"
#include "monitor/monitor.h"
#include "block/block-hmp-cmds.h"

void hmp_info_hybrid(Monitor *mon, const QDict *qdict)
{
    const char *node = qdict_get_try_str(qdict, "node");
    Error *err = NULL;
    HybridInfoList *list = qmp_query_hybrid(node, &err);
    HybridInfoList *e;

    if (hmp_handle_error(mon, err)) {
        return;
    }
    if (!list) {
        monitor_printf(mon, "No hybrid nodes\n");
    }
    for (e = list; e; e = e->next) {
        HybridInfo *i = e->value;

        monitor_printf(mon, "%s: mode %s, dedup %s, block %" PRIu32
                       " bytes, size %" PRIu64 "\n", i->node_name,
                       HybridMode_str(i->mode), i->dedup ? "on" : "off",
                       i->block_size, i->virtual_size);
        monitor_printf(mon, "  RAM tier: %" PRIu64 " of %" PRIu64
                       " bytes loaded, %" PRIu64 " bytes of data held, "
                       "dedup ratio %.2f, metadata %" PRIu64
                       " bytes (%.1f per block)\n",
                       i->ram_loaded, i->ram_size, i->ram_used,
                       i->dedup_ratio, i->metadata_bytes,
                       i->metadata_per_block);
        monitor_printf(mon, "  dirty %" PRIu64 " / %" PRIu64 " bytes, "
                       "written back %" PRIu64 " bytes\n",
                       i->dirty_bytes, i->dirty_limit, i->flushed_bytes);
        monitor_printf(mon, "  reads: %" PRIu64 " hits, %" PRIu64
                       " misses (hit rate %.1f%%); writes: %" PRIu64
                       " to RAM, %" PRIu64 " beyond the boundary\n",
                       i->read_hits, i->read_misses, i->hit_rate * 100,
                       i->writes_ram, i->writes_through);
        monitor_printf(mon, "  restore: %s, %" PRIu64 " of %" PRIu64
                       " bytes in %" PRId64 " ms\n",
                       i->restore_done ? "done" :
                       i->restore_active ? "running" : "paused",
                       i->restore_bytes, i->restore_total, i->restore_ms);
        if (i->error) {
            monitor_printf(mon, "  error: %s\n", i->error);
        }
    }
    qapi_free_HybridInfoList(list);
}
