/*
 * hvmem broker client library: one synchronous connection to hvmemd.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Every call sends one request and waits for its reply.  Failures set a
 * GError in HVM_ERROR whose code is the positive errno the broker returned
 * (ENOENT, EACCES, EBUSY, ENOSPC, EDQUOT, ...) and whose message is the
 * broker's.  A protocol or I/O failure poisons the connection (sticky):
 * every later call fails with the first error.
 *
 * The read-write lease taken by hvm_region_map(..., true, ...) belongs to
 * this connection: keep it open for as long as the mapping is written, and
 * it is released when the connection (or the process) goes away.
 */
#ifndef HVM_CLIENT_H
#define HVM_CLIENT_H

#include <glib.h>
#include <stdbool.h>

#include "proto.h"

#define HVM_ERROR (hvm_error_quark())
GQuark hvm_error_quark(void);

typedef struct HvmClient HvmClient;

/* Default socket path; HVMEM_SOCKET in the environment overrides it. */
const char *hvm_default_socket(void);

HvmClient *hvm_client_connect(const char *path, GError **errp);
void hvm_client_close(HvmClient *c);

bool hvm_region_create(HvmClient *c, const char *name, uint64_t size,
                       uint32_t mode, HvmRegionInfo *out, GError **errp);
bool hvm_region_lookup(HvmClient *c, const char *name, HvmRegionInfo *out,
                       GError **errp);
bool hvm_region_destroy(HvmClient *c, const char *name, GError **errp);
bool hvm_region_resize(HvmClient *c, const char *name, uint64_t size,
                       HvmRegionInfo *out, GError **errp);
bool hvm_region_chmod(HvmClient *c, const char *name, uint32_t mode,
                      GError **errp);
/* Region info and its items (*@items: HvmItemInfo array, caller frees). */
bool hvm_region_stat(HvmClient *c, const char *name, HvmRegionInfo *out,
                     GArray **items, GError **errp);
bool hvm_pool_stat(HvmClient *c, HvmPoolInfo *out, GError **errp);
/* The regions the caller may read (*@regions: HvmRegionInfo array). */
bool hvm_region_list(HvmClient *c, GArray **regions, GError **errp);

bool hvm_item_alloc(HvmClient *c, const char *region, const char *item,
                    uint64_t size, HvmItemInfo *out, GError **errp);
bool hvm_item_lookup(HvmClient *c, const char *region, const char *item,
                     HvmItemInfo *out, GError **errp);
bool hvm_item_free(HvmClient *c, const char *region, const char *item,
                   GError **errp);

/*
 * A descriptor for the region's file: O_RDWR with the read-write lease when
 * @rw, O_RDONLY otherwise.  Returns the fd (the caller owns it) or -1.
 */
int hvm_region_map(HvmClient *c, const char *name, bool rw, HvmRegionInfo *out,
                   GError **errp);
bool hvm_region_release(HvmClient *c, const char *name, GError **errp);

/*
 * The "IDENTITY:KEY" lines of the remote clients that may attach to an
 * export of region @name (read-write when @rw), for a PSK file; this
 * connection must have mapped it (@rw: holding its lease).  *@lines: a
 * NUL-terminated string array (g_strfreev()), possibly empty.
 */
bool hvm_region_export_keys(HvmClient *c, const char *name, bool rw,
                            char ***lines, GError **errp);

#endif
