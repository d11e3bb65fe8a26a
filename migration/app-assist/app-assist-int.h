/*
 * App-assisted migration: internals shared by the chardev and the phase logic
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#ifndef MIGRATION_APP_ASSIST_INT_H
#define MIGRATION_APP_ASSIST_INT_H

#include "qapi/qapi-types-migration.h"
#include "reply.h"

#define TYPE_CHARDEV_APP_ASSIST "chardev-app-assist"

/* The host end of one guest port: an app-assist character device. */
typedef struct AppAssistPort AppAssistPort;

/*
 * All of the following run with the BQL held, which also serialises them
 * with the frontend's calls into the chardev (virtio-serial runs under it).
 */
AppAssistPort *aa_port_next(AppAssistPort *prev);   /* NULL: the first one */
int aa_port_count(void);
const char *aa_port_id(AppAssistPort *port);
bool aa_port_guest_open(AppAssistPort *port);

/*
 * Send "@cmd [@arg]" formatted as RESP.  With @want_reply the port's status
 * becomes waiting until a reply, a failure or aa_port_expire().  Returns
 * false (status no-app or disconnected) when nothing could be sent.
 */
bool aa_port_request(AppAssistPort *port, const char *cmd, const char *arg,
                     bool want_reply);
/* The same with any number of arguments and a reply of kind @kind. */
bool aa_port_request_argv(AppAssistPort *port, int argc, const char **argv,
                          AARespKind kind, bool want_reply);
AppAssistPortStatus aa_port_status(AppAssistPort *port);
const AAReply *aa_port_reply(AppAssistPort *port);  /* status answered */
const char *aa_port_error(AppAssistPort *port);     /* other statuses */
void aa_port_expire(AppAssistPort *port);           /* waiting -> timeout */

/* Called by a port (BQL held) whenever its status changes. */
void app_assist_wakeup(void);

/* app-assist.c, for pages.c. */
AppAssistInfo *aa_current_info(void);       /* BQL held; NULL before a phase */
/*
 * BQL not held: wait until no port waits for a reply -- each one answers or
 * fails, or is expired at @end (ms, aa_now_ms()) or once @running(@s) is
 * false.
 */
void aa_wait_replies(MigrationState *s, int64_t end,
                     bool (*running)(MigrationState *s));
int64_t aa_now_ms(void);
void aa_set_reason(const char *fmt, ...) G_GNUC_PRINTF(1, 2);  /* BQL held */
/* PREPARE may offer page lists: the migration can send pages as zero
 * without reading them (see pages.c). */
bool aa_pages_usable(void);

#endif
