/*
 * App-assisted migration: the "app-assist" character device backend
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * The host end of a virtio-serial port whose guest end an application (e.g.
 * Redis with our module) opens:
 *
 *   -device virtio-serial-pci
 *   -chardev app-assist,id=aa0
 *   -device virtserialport,chardev=aa0,name=org.qemu.app-assist.0
 *
 * Why a backend rather than a frontend plus an -object: the migration code
 * itself is the peer, so there is no host process or socket to connect to;
 * as a backend we see the guest open and close the port (chr_set_fe_open),
 * receive its bytes synchronously (chr_write) and feed it through the normal
 * flow control (qemu_chr_be_can_write / chr_accept_input).  Any number of
 * ports may exist; each is one application.
 *
 * Hostile input: bytes arriving while no request is outstanding are dropped
 * at once; a reply is bounded by the parser (reply.c) and a failed parse drops
 * everything until the next request.  Nothing the guest sends is buffered
 * beyond one bounded reply.  Output is a fixed buffer of a few commands.
 */
#include "qemu/osdep.h"
#include "chardev/char.h"
#include "qapi/error.h"
#include "qemu/module.h"
#include "qemu/queue.h"
#include "qom/object.h"
#include "trace.h"

#include <hiredis/hiredis.h>

#include "app-assist-int.h"

#define AA_OUT_MAX 512      /* bytes queued towards the guest */

OBJECT_DECLARE_SIMPLE_TYPE(AppAssistPort, CHARDEV_APP_ASSIST)

struct AppAssistPort {
    Chardev parent;

    /* Everything below is protected by the BQL. */
    bool guest_open;            /* the application has the port open */
    bool waiting;               /* a request wants a reply */
    AppAssistPortStatus status;
    AARespParser *parser;
    AAReply reply;
    char error[2 * AA_RESP_ERRLEN];
    uint8_t out[AA_OUT_MAX];    /* pending bytes to the guest */
    size_t out_len;
    QTAILQ_ENTRY(AppAssistPort) next;
};

static QTAILQ_HEAD(, AppAssistPort) aa_ports =
    QTAILQ_HEAD_INITIALIZER(aa_ports);
static int aa_nports;

AppAssistPort *aa_port_next(AppAssistPort *prev)
{
    return prev ? QTAILQ_NEXT(prev, next) : QTAILQ_FIRST(&aa_ports);
}

int aa_port_count(void)
{
    return aa_nports;
}

const char *aa_port_id(AppAssistPort *port)
{
    return CHARDEV(port)->label ?: "";
}

bool aa_port_guest_open(AppAssistPort *port)
{
    return port->guest_open;
}

AppAssistPortStatus aa_port_status(AppAssistPort *port)
{
    return port->status;
}

const AAReply *aa_port_reply(AppAssistPort *port)
{
    return &port->reply;
}

const char *aa_port_error(AppAssistPort *port)
{
    return port->error;
}

static void aa_port_finish(AppAssistPort *port, AppAssistPortStatus status,
                           const char *why)
{
    port->waiting = false;
    port->status = status;
    if (why) {
        snprintf(port->error, sizeof(port->error), "%s", why);
        trace_app_assist_port_fail(aa_port_id(port),
                                   AppAssistPortStatus_str(status), why);
    }
    app_assist_wakeup();
}

void aa_port_expire(AppAssistPort *port)
{
    if (port->waiting) {
        aa_port_finish(port, APP_ASSIST_PORT_STATUS_TIMEOUT,
                       "no complete reply before the deadline");
    }
}

/* Push queued bytes to the guest as far as its buffers allow. */
static void aa_port_flush(AppAssistPort *port)
{
    Chardev *chr = CHARDEV(port);
    int room;

    if (!port->out_len || !port->guest_open) {
        return;
    }
    room = qemu_chr_be_can_write(chr);
    if (room <= 0) {
        return;     /* chr_accept_input() calls us again */
    }
    room = MIN((size_t)room, port->out_len);
    qemu_chr_be_write(chr, port->out, room);
    memmove(port->out, port->out + room, port->out_len - room);
    port->out_len -= room;
}

bool aa_port_request(AppAssistPort *port, const char *cmd, const char *arg,
                     bool want_reply)
{
    const char *argv[2] = { cmd, arg };

    return aa_port_request_argv(port, arg ? 2 : 1, argv, AA_RESP_KIND_FIELDS,
                                want_reply);
}

bool aa_port_request_argv(AppAssistPort *port, int argc, const char **argv,
                          AARespKind kind, bool want_reply)
{
    const char *cmd = argv[0];
    char *buf = NULL;
    int len;

    if (!port->guest_open) {
        port->waiting = false;
        port->status = APP_ASSIST_PORT_STATUS_NO_APP;
        snprintf(port->error, sizeof(port->error),
                 "no application has the port open");
        return false;
    }
    len = redisFormatCommandArgv(&buf, argc, argv, NULL);
    if (len < 0 || (size_t)len > sizeof(port->out) - port->out_len) {
        /* The guest is not reading what we sent before. */
        redisFreeCommand(buf);
        aa_port_finish(port, APP_ASSIST_PORT_STATUS_TIMEOUT,
                       "the application does not read the port");
        return false;
    }
    memcpy(port->out + port->out_len, buf, len);
    port->out_len += len;
    redisFreeCommand(buf);

    trace_app_assist_port_send(aa_port_id(port), cmd, (int)port->out_len);
    aa_resp_parser_reset(port->parser);
    aa_resp_parser_expect(port->parser, kind);
    memset(&port->reply, 0, sizeof(port->reply));
    port->error[0] = '\0';
    port->waiting = want_reply;
    port->status = want_reply ? APP_ASSIST_PORT_STATUS_WAITING
                              : APP_ASSIST_PORT_STATUS_ANSWERED;
    aa_port_flush(port);
    return true;
}

/* The guest wrote to the port. */
static int aa_chr_write(Chardev *chr, const uint8_t *buf, int len)
{
    AppAssistPort *port = CHARDEV_APP_ASSIST(chr);
    AARespState st;

    if (!port->waiting) {
        trace_app_assist_port_discard(aa_port_id(port), len);
        return len;     /* consumed and dropped: never buffered */
    }
    st = aa_resp_feed(port->parser, buf, len, &port->reply);
    switch (st) {
    case AA_RESP_MORE:
        break;
    case AA_RESP_DONE:
        if (port->reply.is_error) {
            aa_port_finish(port, APP_ASSIST_PORT_STATUS_REFUSED,
                           port->reply.message);
        } else if (port->reply.is_status) {
            /* An "+OK" where a key/value reply was due. */
            aa_port_finish(port, APP_ASSIST_PORT_STATUS_INVALID,
                           "status reply instead of key/value pairs");
        } else {
            trace_app_assist_port_reply(aa_port_id(port),
                                        port->reply.freed_bytes,
                                        port->reply.items,
                                        port->reply.time_us);
            aa_port_finish(port, APP_ASSIST_PORT_STATUS_ANSWERED, NULL);
        }
        break;
    case AA_RESP_ERROR:
        aa_port_finish(port, APP_ASSIST_PORT_STATUS_INVALID,
                       aa_resp_error(port->parser));
        break;
    }
    return len;
}

/* The guest opened or closed its end of the port. */
static void aa_chr_set_fe_open(Chardev *chr, int fe_open)
{
    AppAssistPort *port = CHARDEV_APP_ASSIST(chr);

    trace_app_assist_port_open(aa_port_id(port), fe_open);
    port->guest_open = fe_open;
    if (!fe_open) {
        port->out_len = 0;      /* a new application starts afresh */
        if (port->waiting) {
            aa_port_finish(port, APP_ASSIST_PORT_STATUS_DISCONNECTED,
                           "the application closed the port before "
                           "answering");
        }
    }
}

/* The guest made buffers available. */
static void aa_chr_accept_input(Chardev *chr)
{
    aa_port_flush(CHARDEV_APP_ASSIST(chr));
}

static void aa_chr_open(Chardev *chr, ChardevBackend *backend,
                        bool *be_opened, Error **errp)
{
    AppAssistPort *port = CHARDEV_APP_ASSIST(chr);

    port->parser = aa_resp_parser_new();
    if (!port->parser) {
        error_setg(errp, "app-assist: cannot allocate the reply parser");
        return;
    }
    port->status = APP_ASSIST_PORT_STATUS_NO_APP;
    QTAILQ_INSERT_TAIL(&aa_ports, port, next);
    aa_nports++;
    /* The host end is always there: the guest may write at once. */
    *be_opened = true;
}

static void aa_chr_finalize(Object *obj)
{
    AppAssistPort *port = CHARDEV_APP_ASSIST(obj);

    if (port->parser) {
        QTAILQ_REMOVE(&aa_ports, port, next);
        aa_nports--;
        aa_resp_parser_free(port->parser);
    }
}

static void aa_chr_class_init(ObjectClass *oc, void *data)
{
    ChardevClass *cc = CHARDEV_CLASS(oc);

    cc->open = aa_chr_open;
    cc->chr_write = aa_chr_write;
    cc->chr_set_fe_open = aa_chr_set_fe_open;
    cc->chr_accept_input = aa_chr_accept_input;
}

static const TypeInfo aa_chr_type_info = {
    .name = TYPE_CHARDEV_APP_ASSIST,
    .parent = TYPE_CHARDEV,
    .instance_size = sizeof(AppAssistPort),
    .instance_finalize = aa_chr_finalize,
    .class_init = aa_chr_class_init,
};

static void aa_chr_register_types(void)
{
    type_register_static(&aa_chr_type_info);
}

type_init(aa_chr_register_types);
