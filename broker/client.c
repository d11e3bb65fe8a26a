/*
 * hvmem broker client library (see client.h).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client.h"
#include "psk.h"

struct HvmClient {
    int fd;
    uint32_t seq;
    GError *failed;         /* sticky: the first protocol or I/O error */
};

G_DEFINE_QUARK(hvm-error-quark, hvm_error)

const char *hvm_default_socket(void)
{
    const char *s = getenv("HVMEM_SOCKET");

    return s && *s ? s : "/run/hybridvm-broker.sock";
}

HvmClient *hvm_client_connect(const char *path, GError **errp)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    HvmClient *c;
    int fd;

    if (strlen(path) >= sizeof(sa.sun_path)) {
        g_set_error(errp, HVM_ERROR, ENAMETOOLONG, "socket path %s too long",
                    path);
        return NULL;
    }
    strcpy(sa.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        int e = errno;

        g_set_error(errp, HVM_ERROR, e, "cannot connect to the broker at %s: %s",
                    path, g_strerror(e));
        if (fd >= 0) {
            close(fd);
        }
        return NULL;
    }
    c = g_new0(HvmClient, 1);
    c->fd = fd;
    return c;
}

void hvm_client_close(HvmClient *c)
{
    if (c) {
        close(c->fd);
        g_clear_error(&c->failed);
        g_free(c);
    }
}

static bool fail(HvmClient *c, int code, const char *what, GError **errp)
{
    if (!c->failed) {
        c->failed = g_error_new(HVM_ERROR, code, "broker connection: %s", what);
    }
    g_propagate_error(errp, g_error_copy(c->failed));
    return false;
}

static bool read_full(HvmClient *c, void *buf, size_t len, int *fd_out)
{
    size_t off = 0;

    while (off < len) {
        struct iovec iov = { (char *)buf + off, len - off };
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } u;
        struct msghdr mh = {
            .msg_iov = &iov, .msg_iovlen = 1,
            .msg_control = u.buf, .msg_controllen = sizeof(u.buf),
        };
        ssize_t n = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC);
        struct cmsghdr *cm;

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return false;
        }
        for (cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
                int fd;

                memcpy(&fd, CMSG_DATA(cm), sizeof(int));
                if (fd_out && *fd_out < 0) {
                    *fd_out = fd;
                } else {
                    close(fd);
                }
            }
        }
        off += n;
    }
    return true;
}

/*
 * One round trip.  On success *@body holds the reply body (caller frees) and
 * @rep points into it; a broker error becomes a GError (connection kept).
 */
static bool call(HvmClient *c, HvmRequest *q, HvmReply *rep, uint8_t **body,
                 int *fd_out, GError **errp)
{
    GByteArray *out = g_byte_array_new();
    uint8_t hdr[HVM_HDR_SIZE];
    HvmHeader h;
    const char *why;
    size_t off = 0;
    int fd = -1;

    *body = NULL;
    if (c->failed) {
        g_byte_array_free(out, TRUE);
        g_propagate_error(errp, g_error_copy(c->failed));
        return false;
    }
    q->seq = ++c->seq;
    hvm_request_encode(out, q);
    while (off < out->len) {
        ssize_t n = send(c->fd, out->data + off, out->len - off, MSG_NOSIGNAL);

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            /* Refused at accept?  The broker's reason may still be readable. */
            break;
        }
        off += n;
    }
    g_byte_array_free(out, TRUE);
    if (!read_full(c, hdr, sizeof(hdr), &fd)) {
        return fail(c, ECONNRESET, "closed by the broker", errp);
    }
    if (hvm_header_decode(hdr, &h, true, &why)) {
        return fail(c, EPROTO, why, errp);
    }
    *body = g_malloc(h.length ? h.length : 1);
    if (!read_full(c, *body, h.length, &fd) ||
        hvm_reply_decode(*body, h.length, rep, &why)) {
        g_clear_pointer(body, g_free);
        if (fd >= 0) {
            close(fd);
        }
        return fail(c, EPROTO, "truncated or malformed reply", errp);
    }
    if (h.op == HVM_OP_REPLY) {
        /* Unsolicited: the broker refused us (too many connections...). */
        g_autofree char *m = g_strdup(rep->msg);

        g_clear_pointer(body, g_free);
        return fail(c, rep->status ? -rep->status : EPROTO, m, errp);
    }
    if (h.op != (q->op | HVM_OP_REPLY) || h.seq != q->seq) {
        g_clear_pointer(body, g_free);
        return fail(c, EPROTO, "reply does not match the request", errp);
    }
    if (rep->status) {
        g_set_error(errp, HVM_ERROR, -rep->status, "%s", rep->msg[0] ? rep->msg
                    : g_strerror(-rep->status));
        g_clear_pointer(body, g_free);
        if (fd >= 0) {
            close(fd);
        }
        return false;
    }
    if (fd_out) {
        *fd_out = fd;
    } else if (fd >= 0) {
        close(fd);
    }
    return true;
}

static void req_init(HvmRequest *q, HvmOp op, const char *name,
                     const char *item)
{
    memset(q, 0, sizeof(*q));
    q->op = op;
    if (name) {
        g_strlcpy(q->name, name, sizeof(q->name));
    }
    if (item) {
        g_strlcpy(q->item, item, sizeof(q->item));
    }
}

/* Reject names the broker would: locally, with the same words. */
static bool check_names(const char *name, const char *item, GError **errp)
{
    const char *why;

    if (name && (why = hvm_name_check(name, strlen(name)))) {
        g_set_error(errp, HVM_ERROR, EINVAL, "invalid region name: %s", why);
        return false;
    }
    if (item && (why = hvm_name_check(item, strlen(item)))) {
        g_set_error(errp, HVM_ERROR, EINVAL, "invalid item name: %s", why);
        return false;
    }
    return true;
}

static bool region_call(HvmClient *c, HvmRequest *q, HvmRegionInfo *out,
                        int *fd_out, GError **errp)
{
    g_autofree uint8_t *body = NULL;
    HvmReply rep;
    HvmReader r;
    HvmRegionInfo tmp;

    if (!call(c, q, &rep, &body, fd_out, errp)) {
        return false;
    }
    hvm_reader_init(&r, rep.data, rep.data_len);
    if (hvm_region_decode(&r, out ? out : &tmp)) {
        if (fd_out && *fd_out >= 0) {
            close(*fd_out);
            *fd_out = -1;
        }
        return fail(c, EPROTO, "malformed region record", errp);
    }
    return true;
}

bool hvm_region_create(HvmClient *c, const char *name, uint64_t size,
                       uint32_t mode, HvmRegionInfo *out, GError **errp)
{
    HvmRequest q;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_CREATE, name, NULL);
    q.size = size;
    q.mode = mode;
    return region_call(c, &q, out, NULL, errp);
}

bool hvm_region_lookup(HvmClient *c, const char *name, HvmRegionInfo *out,
                       GError **errp)
{
    HvmRequest q;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_LOOKUP, name, NULL);
    return region_call(c, &q, out, NULL, errp);
}

bool hvm_region_resize(HvmClient *c, const char *name, uint64_t size,
                       HvmRegionInfo *out, GError **errp)
{
    HvmRequest q;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_RESIZE, name, NULL);
    q.size = size;
    return region_call(c, &q, out, NULL, errp);
}

bool hvm_region_chmod(HvmClient *c, const char *name, uint32_t mode,
                      GError **errp)
{
    HvmRequest q;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_CHMOD, name, NULL);
    q.mode = mode;
    return region_call(c, &q, NULL, NULL, errp);
}

static bool simple_call(HvmClient *c, HvmRequest *q, GError **errp)
{
    g_autofree uint8_t *body = NULL;
    HvmReply rep;

    return call(c, q, &rep, &body, NULL, errp);
}

bool hvm_region_destroy(HvmClient *c, const char *name, GError **errp)
{
    HvmRequest q;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_DESTROY, name, NULL);
    return simple_call(c, &q, errp);
}

bool hvm_region_release(HvmClient *c, const char *name, GError **errp)
{
    HvmRequest q;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_RELEASE, name, NULL);
    return simple_call(c, &q, errp);
}

bool hvm_region_stat(HvmClient *c, const char *name, HvmRegionInfo *out,
                     GArray **items, GError **errp)
{
    g_autofree uint8_t *body = NULL;
    HvmRequest q;
    HvmReply rep;
    HvmReader r;
    GArray *a;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_STAT, name, NULL);
    if (!call(c, &q, &rep, &body, NULL, errp)) {
        return false;
    }
    hvm_reader_init(&r, rep.data, rep.data_len);
    if (hvm_region_decode(&r, out)) {
        return fail(c, EPROTO, "malformed region record", errp);
    }
    a = g_array_new(FALSE, TRUE, sizeof(HvmItemInfo));
    while (r.off < r.len) {
        HvmItemInfo ii;

        if (hvm_item_decode(&r, &ii) || a->len >= HVM_MAX_ITEMS) {
            g_array_free(a, TRUE);
            return fail(c, EPROTO, "malformed item record", errp);
        }
        g_array_append_val(a, ii);
    }
    if (items) {
        *items = a;
    } else {
        g_array_free(a, TRUE);
    }
    return true;
}

bool hvm_pool_stat(HvmClient *c, HvmPoolInfo *out, GError **errp)
{
    g_autofree uint8_t *body = NULL;
    HvmRequest q;
    HvmReply rep;
    HvmReader r;

    req_init(&q, HVM_OP_STAT, NULL, NULL);
    if (!call(c, &q, &rep, &body, NULL, errp)) {
        return false;
    }
    hvm_reader_init(&r, rep.data, rep.data_len);
    if (hvm_pool_decode(&r, out)) {
        return fail(c, EPROTO, "malformed pool record", errp);
    }
    return true;
}

bool hvm_region_list(HvmClient *c, GArray **regions, GError **errp)
{
    g_autofree uint8_t *body = NULL;
    HvmRequest q;
    HvmReply rep;
    HvmReader r;
    uint32_t n;
    GArray *a;

    req_init(&q, HVM_OP_LIST, NULL, NULL);
    if (!call(c, &q, &rep, &body, NULL, errp)) {
        return false;
    }
    hvm_reader_init(&r, rep.data, rep.data_len);
    n = hvm_get_u32(&r);
    hvm_get_u32(&r);
    if (r.err || n > HVM_MAX_REGIONS) {
        return fail(c, EPROTO, "malformed region list", errp);
    }
    a = g_array_new(FALSE, TRUE, sizeof(HvmRegionInfo));
    for (uint32_t i = 0; i < n; i++) {
        HvmRegionInfo ri;

        if (hvm_region_decode(&r, &ri)) {
            g_array_free(a, TRUE);
            return fail(c, EPROTO, "malformed region list", errp);
        }
        g_array_append_val(a, ri);
    }
    *regions = a;
    return true;
}

static bool item_call(HvmClient *c, HvmRequest *q, HvmItemInfo *out,
                      GError **errp)
{
    g_autofree uint8_t *body = NULL;
    HvmReply rep;
    HvmReader r;
    HvmItemInfo tmp;

    if (!call(c, q, &rep, &body, NULL, errp)) {
        return false;
    }
    hvm_reader_init(&r, rep.data, rep.data_len);
    if (hvm_item_decode(&r, out ? out : &tmp)) {
        return fail(c, EPROTO, "malformed item record", errp);
    }
    return true;
}

bool hvm_item_alloc(HvmClient *c, const char *region, const char *item,
                    uint64_t size, HvmItemInfo *out, GError **errp)
{
    HvmRequest q;

    if (!check_names(region, item, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_ALLOC, region, item);
    q.size = size;
    return item_call(c, &q, out, errp);
}

bool hvm_item_lookup(HvmClient *c, const char *region, const char *item,
                     HvmItemInfo *out, GError **errp)
{
    HvmRequest q;

    if (!check_names(region, item, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_ITEM_LOOKUP, region, item);
    return item_call(c, &q, out, errp);
}

bool hvm_item_free(HvmClient *c, const char *region, const char *item,
                   GError **errp)
{
    HvmRequest q;

    if (!check_names(region, item, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_FREE, region, item);
    return simple_call(c, &q, errp);
}

int hvm_region_map(HvmClient *c, const char *name, bool rw, HvmRegionInfo *out,
                   GError **errp)
{
    HvmRequest q;
    int fd = -1;

    if (!check_names(name, NULL, errp)) {
        return -1;
    }
    req_init(&q, HVM_OP_MAP, name, NULL);
    q.flags = rw ? HVM_MAP_RW : 0;
    if (!region_call(c, &q, out, &fd, errp)) {
        return -1;
    }
    if (fd < 0) {
        fail(c, EPROTO, "map reply carried no descriptor", errp);
    }
    return fd;
}

bool hvm_region_export_keys(HvmClient *c, const char *name, bool rw,
                            char ***lines, GError **errp)
{
    g_autofree uint8_t *body = NULL;
    g_autoptr(GPtrArray) a = g_ptr_array_new_with_free_func(g_free);
    HvmRequest q;
    HvmReply rep;
    HvmReader r;
    uint32_t n;

    if (!check_names(name, NULL, errp)) {
        return false;
    }
    req_init(&q, HVM_OP_EXPORT_KEYS, name, NULL);
    q.flags = rw ? HVM_MAP_RW : 0;
    if (!call(c, &q, &rep, &body, NULL, errp)) {
        return false;
    }
    hvm_reader_init(&r, rep.data, rep.data_len);
    n = hvm_get_u32(&r);
    if (r.err || n > HVM_MAX_REMOTES) {
        return fail(c, EPROTO, "malformed export keys", errp);
    }
    for (uint32_t i = 0; i < n; i++) {
        uint16_t len = hvm_get_u16(&r);
        const uint8_t *p = hvm_get_bytes(&r, len);
        char *line;

        if (r.err || len > HVM_PSK_IDENTITY_MAX + 1 + HVM_PSK_DERIVED_HEX) {
            return fail(c, EPROTO, "malformed export keys", errp);
        }
        line = g_strndup((const char *)p, len);
        g_ptr_array_add(a, line);
        /* one line of the PSK file each: IDENTITY:HEX, nothing else */
        if (strlen(line) != len || strchr(line, '\n') || !strchr(line, ':')) {
            return fail(c, EPROTO, "malformed export keys", errp);
        }
    }
    if (r.off != r.len) {
        return fail(c, EPROTO, "malformed export keys", errp);
    }
    g_ptr_array_add(a, NULL);
    *lines = (char **)g_ptr_array_free(g_steal_pointer(&a), FALSE);
    return true;
}
