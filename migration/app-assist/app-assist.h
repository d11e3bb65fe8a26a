/*
 * App-assisted migration: the hooks QEMU's migration code calls
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#ifndef MIGRATION_APP_ASSIST_H
#define MIGRATION_APP_ASSIST_H

#include "qapi/qapi-types-migration.h"

/*
 * Migration thread, set-up phase, without the BQL: ask every app-assist port
 * to PREPARE, inflate the balloon by what the applications freed, and wait
 * (bounded) for it.  Never fails the migration; cancel stops the waits.
 */
void app_assist_source_run(MigrationState *s);

/*
 * Migration thread, after qemu_savevm_state_setup() (dirty logging on),
 * without the BQL: take the lists of pages the applications dropped, so that
 * the migration sends them as zero pages unread (pages.c).  Bounded by
 * app-assist-deadline; never fails the migration.
 */
void app_assist_source_pages(MigrationState *s);

/*
 * Destination, incoming RAM set-up and clean-up (incoming.c): with the
 * app-assist capability, guest RAM is filled without transparent huge pages
 * until the incoming migration ends.
 */
void app_assist_incoming_setup(void);
void app_assist_incoming_cleanup(void);

/*
 * Destination, zero pages for untouched RAM (incoming.c).  The precopy
 * loader, for a zero page at @offset of @rb not received yet in this
 * incoming migration: true if it may leave the page as it is (fresh
 * anonymous memory, still zero; its received bit must stay clear), which
 * is then recorded.  The post-copy fault path: whether a page it was not
 * sent was left so (place a zero page; do not ask the source).  The
 * post-copy discard of a range the source still has dirty: forget it.
 */
bool app_assist_incoming_leave_zero(RAMBlock *rb, ram_addr_t offset);
bool app_assist_incoming_left_zero(RAMBlock *rb, ram_addr_t offset);
void app_assist_incoming_discard(RAMBlock *rb, uint64_t start, size_t length);

/* query-migrate: add the app-assist section when there is one. */
void app_assist_fill_info(MigrationInfo *info);

/* HMP "info migrate". */
void app_assist_hmp_print(Monitor *mon, AppAssistInfo *info);

#endif
