/*
 * Hybrid block format: QMP commands
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qapi/qapi-commands-block-core.h"
#include "block/block_int.h"
#include "block/block-global-state.h"
#include "block/block-io.h"
#include "hybrid.h"

static BlockDriverState *hybrid_find_node(const char *node_name, Error **errp)
{
    BlockDriverState *bs = bdrv_find_node(node_name);

    if (!bs) {
        error_setg(errp, "Cannot find node '%s'", node_name);
        return NULL;
    }
    if (bs->drv != &bdrv_hybrid) {
        error_setg(errp, "Node '%s' is not a hybrid node (driver '%s')",
                   node_name, bs->drv ? bs->drv->format_name : "none");
        return NULL;
    }
    return bs;
}

HybridInfoList *qmp_query_hybrid(const char *node_name, Error **errp)
{
    HybridInfoList *head = NULL, **tail = &head;
    BlockDriverState *bs;

    GLOBAL_STATE_CODE();
    GRAPH_RDLOCK_GUARD_MAINLOOP();

    if (node_name) {
        bs = hybrid_find_node(node_name, errp);
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

void qmp_hybrid_set_mode(const char *node_name, HybridMode mode,
                         Error **errp)
{
    BlockDriverState *bs;

    GLOBAL_STATE_CODE();

    /* No graph lock: the reopen drains the node */
    bs = hybrid_find_node(node_name, errp);
    if (!bs) {
        return;
    }
    if (bdrv_is_read_only(bs)) {
        error_setg(errp, "Node '%s' is read-only", node_name);
        return;
    }
    hybrid_set_mode(bs, mode, errp);
}
