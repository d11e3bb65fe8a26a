/*
 * Parse a block driver's options with the QAPI visitor, for hybrid and the
 * clone cache (block/visit-options.c)
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#ifndef BLOCK_VISIT_OPTIONS_H
#define BLOCK_VISIT_OPTIONS_H

#include "qapi/qapi-types-block-core.h"

BlockdevOptions *visit_blockdev_options(QDict *options, const char *driver,
                                        Error **errp);

#endif
