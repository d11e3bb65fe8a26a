/*
 * hvmem: keys for exports of a region to other hosts (docs/broker.md,
 * "Remote clients").
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#ifndef HVMEM_EXPORT_H
#define HVMEM_EXPORT_H

#include <signal.h>
#include <stdbool.h>
#include <sys/types.h>
#include <glib.h>

#include "client.h"

/* Seconds between an exporter's questions to the broker. */
#define HVM_EXPORT_REFRESH_S    1

typedef struct HvmExportKeys HvmExportKeys;

/*
 * Keep DIR/keys.psk (a tls-creds-psk directory) holding the keys of the
 * remote clients the broker admits to an export of @region, which @c has
 * mapped.  @dir is created 0700, or must be this user's and 0700 already.
 * NULL with @errp set when the broker or the directory refuses.
 */
HvmExportKeys *hvm_export_keys_start(HvmClient *c, const char *region, bool rw,
                                     const char *dir, GError **errp);
/*
 * The signals hvm_export_keys_wait() takes: block them before the fork (and
 * restore the old mask in the child).
 */
void hvm_export_keys_sigset(sigset_t *set);
/*
 * Wait for @pid, asking the broker again every HVM_EXPORT_REFRESH_S seconds
 * and rewriting the file when the answer changes (a refusal writes no key:
 * nobody new attaches).  0 with its wait status in *@status once it exits,
 * or the number of a signal that asked hvmem to terminate first (SIGTERM,
 * SIGINT, SIGHUP).
 */
int hvm_export_keys_wait(HvmExportKeys *ek, pid_t pid, int *status);
/* Remove the file (and the directory when it was made here). */
void hvm_export_keys_stop(HvmExportKeys *ek);

/* hvmem psk: a remote client's own key file for an export, on its host. */
int hvm_psk_verb(int argc, char **argv);

#endif
