/*
 * What hybrid and the clone cache share as block drivers: options parsed
 * with the QAPI visitor, nodes found by name
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qapi/qapi-visit-block-core.h"
#include "qapi/qobject-input-visitor.h"
#include "qobject/qdict.h"
#include "block/qdict.h"
#include "block/block_int.h"
#include "visit-options.h"

/*
 * @options as a BlockdevOptions of @driver, as copy-before-write parses
 * its own; @options is left as it is (the caller takes out what it
 * consumed).  The 'file' and 'backing' children (and hybrid's 'mirror')
 * are opened with bdrv_open_child() and may be given in any syntax, so the
 * visitor sees a placeholder for 'file' and 'mirror' and nothing of
 * 'backing'.
 */
BlockdevOptions *visit_blockdev_options(QDict *options, const char *driver,
                                        Error **errp)
{
    g_autoptr(QDict) copy = qdict_clone_shallow(options);
    g_autoptr(QDict) mirror = NULL;
    BlockdevOptions *opts = NULL;
    Visitor *v;

    qdict_extract_subqdict(copy, NULL, "file.");
    qdict_put_str(copy, "file", "");
    qdict_extract_subqdict(copy, NULL, "backing.");
    qdict_del(copy, "backing");
    qdict_extract_subqdict(copy, &mirror, "mirror.");
    if (qdict_haskey(copy, "mirror") || qdict_size(mirror)) {
        qdict_put_str(copy, "mirror", "");
    }
    qdict_put_str(copy, "driver", driver);

    v = qobject_input_visitor_new_flat_confused(copy, errp);
    if (!v) {
        return NULL;
    }
    visit_type_BlockdevOptions(v, NULL, &opts, errp);
    visit_free(v);
    return opts;
}

/* The node @node_name, if @drv drives it; else NULL with @errp set */
BlockDriverState *find_driver_node(const char *node_name, BlockDriver *drv,
                                   Error **errp)
{
    BlockDriverState *bs = bdrv_find_node(node_name);

    if (!bs) {
        error_setg(errp, "Cannot find node '%s'", node_name);
        return NULL;
    }
    if (bs->drv != drv) {
        error_setg(errp, "Node '%s' is not a %s node (driver '%s')",
                   node_name, drv->format_name,
                   bs->drv ? bs->drv->format_name : "none");
        return NULL;
    }
    return bs;
}
