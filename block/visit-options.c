/*
 * Parse a block driver's options with the QAPI visitor
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
#include "visit-options.h"

/*
 * @options as a BlockdevOptions of @driver, as copy-before-write parses
 * its own; @options is left as it is (the caller takes out what it
 * consumed).  The 'file' and 'backing' children are opened by the generic
 * code and may be given in any syntax, so the visitor sees a placeholder
 * for 'file' and nothing of 'backing'.
 */
BlockdevOptions *visit_blockdev_options(QDict *options, const char *driver,
                                        Error **errp)
{
    g_autoptr(QDict) copy = qdict_clone_shallow(options);
    BlockdevOptions *opts = NULL;
    Visitor *v;

    qdict_extract_subqdict(copy, NULL, "file.");
    qdict_put_str(copy, "file", "");
    qdict_extract_subqdict(copy, NULL, "backing.");
    qdict_del(copy, "backing");
    qdict_put_str(copy, "driver", driver);

    v = qobject_input_visitor_new_flat_confused(copy, errp);
    if (!v) {
        return NULL;
    }
    visit_type_BlockdevOptions(v, NULL, &opts, errp);
    visit_free(v);
    return opts;
}
