/*
 * What hybrid and the clone cache share as block drivers
 * (block/visit-options.c): their options parsed with the QAPI visitor, and
 * their nodes found by name for their QMP commands
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#ifndef BLOCK_VISIT_OPTIONS_H
#define BLOCK_VISIT_OPTIONS_H

#include "qapi/qapi-types-block-core.h"
#include "block/block-common.h"

BlockdevOptions *visit_blockdev_options(QDict *options, const char *driver,
                                        Error **errp);
BlockDriverState *find_driver_node(const char *node_name, BlockDriver *drv,
                                   Error **errp);

#endif
