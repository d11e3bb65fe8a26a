/*
 * hvmemd: the memory broker daemon.  Named regions (files in a pool directory
 * on tmpfs, hugetlbfs or a DAX file system) with owners and mode bits,
 * 2 MiB-aligned items inside them, one read-write owner lease per region, a
 * durable catalogue.  This file: connections, start-up and main; what each
 * request may do and does: hvmemd-ops.c; the pool and state directories:
 * hvmemd-pool.c; protocol: proto.h; catalogue: catalog.h; prose and the
 * permission model: docs/broker.md.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Single-threaded: one GMainLoop serves the listening socket and every
 * connection, so no state below needs a lock.  Nothing blocks on a peer:
 * sockets are non-blocking, replies wait in a per-connection queue that is
 * written when the socket is writable (as Redis does), and a client that
 * does not read is dropped, never waited for.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>
#include <gio/gio.h>
#include <glib-unix.h>

#include "hvmemd.h"

#define HUGETLBFS_MAGIC_     0x958458f6
/*
 * A connection's unwritten replies: at most this many bytes (two of the
 * largest replies, a LIST of 4096 regions with long names) and this many
 * descriptors (map replies); a client past either does not read its
 * replies and is dropped.  Every descriptor counts against RLIMIT_NOFILE.
 */
#define OUT_MAX_BYTES        (2 * (HVM_HDR_SIZE + HVM_MAX_REPLY_BODY))
#define OUT_MAX_FDS          4

static Broker broker;

/* ---- connections ---- */

typedef struct OutMsg {
    GByteArray *buf;
    size_t off;         /* bytes of buf already written */
    int fd;             /* passed with the first byte, then closed; or -1 */
} OutMsg;

/*
 * One non-blocking sendmsg() of @len bytes (with @fd on the first byte, if
 * >= 0): the bytes written, or a negative errno (-EAGAIN: the socket is full).
 */
static ssize_t send_some(int sock, const uint8_t *buf, size_t len, int fd)
{
    struct iovec iov = { (void *)buf, len };
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
    ssize_t n;

    if (fd >= 0) {
        struct cmsghdr *cm;

        memset(&u, 0, sizeof(u));
        mh.msg_control = u.buf;
        mh.msg_controllen = sizeof(u.buf);
        cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    do {
        n = sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        return errno == EWOULDBLOCK ? -EAGAIN : -errno;
    }
    return n ? n : -EIO;
}

static void out_msg_free(gpointer p)
{
    OutMsg *m = p;

    if (m->fd >= 0) {
        close(m->fd);
    }
    g_byte_array_free(m->buf, TRUE);
    g_free(m);
}

static void conn_close(Conn *c)
{
    Broker *b = c->b;
    GHashTableIter it;
    gpointer v;
    guint n;

    g_hash_table_iter_init(&it, c->attached);
    while (g_hash_table_iter_next(&it, &v, NULL)) {
        HvmRegion *r = v;

        if (r->lease == c) {
            g_message("region '%s': read-write lease of pid %u released "
                      "(connection closed)", r->name, r->lease_pid);
            r->lease = NULL;
            r->last_lease_pid = r->lease_pid;
            r->lease_pid = 0;
        }
        if (r->last_lease == c) {
            r->last_lease = NULL;
        }
        g_assert(r->attached > 0);
        if (--r->attached == 0 && r->destroyed) {
            g_ptr_array_remove_fast(b->zombies, r);
            hvmd_region_release_file(b, r);
        }
    }
    g_hash_table_destroy(c->attached);
    if (c->watch) {
        g_source_remove(c->watch);
    }
    if (c->out_watch) {
        g_source_remove(c->out_watch);
    }
    g_queue_clear_full(&c->out, out_msg_free);
    close(c->fd);
    n = GPOINTER_TO_UINT(g_hash_table_lookup(b->uid_conns,
                                             GUINT_TO_POINTER(c->cred.uid)));
    if (n > 1) {
        g_hash_table_insert(b->uid_conns, GUINT_TO_POINTER(c->cred.uid),
                            GUINT_TO_POINTER(n - 1));
    } else {
        g_hash_table_remove(b->uid_conns, GUINT_TO_POINTER(c->cred.uid));
    }
    g_hash_table_remove(b->conns, c);
    g_free(c->exported);
    g_free(c);
}

static gboolean conn_writable(gint fd, GIOCondition cond, gpointer opaque);

/*
 * Write as much of the queue as the socket takes now.  0, or a negative
 * errno when the connection must go.  While something is left, a writable
 * watch calls again; an empty queue's watch removes itself (conn_writable).
 */
static int conn_flush(Conn *c)
{
    OutMsg *m;

    while ((m = g_queue_peek_head(&c->out))) {
        ssize_t n = send_some(c->fd, m->buf->data + m->off,
                              m->buf->len - m->off, m->off ? -1 : m->fd);

        if (n == -EAGAIN) {
            break;
        }
        if (n < 0) {
            return n;
        }
        c->out_since = g_get_monotonic_time();
        if (m->fd >= 0) {
            close(m->fd);       /* the peer has its own copy now */
            m->fd = -1;
            c->out_fds--;
        }
        m->off += n;
        c->out_bytes -= n;
        if (m->off == m->buf->len) {
            out_msg_free(g_queue_pop_head(&c->out));
        }
    }
    if (!g_queue_is_empty(&c->out) && !c->out_watch) {
        c->out_watch = g_unix_fd_add(c->fd, G_IO_OUT | G_IO_HUP | G_IO_ERR,
                                     conn_writable, c);
    }
    return 0;
}

/*
 * Queue a reply (with @fd, which the queue then owns) and write what the
 * socket takes.  False when the connection must go: the socket failed, or
 * the client leaves more unread than the queue's bound.
 */
static bool conn_reply(Conn *c, uint16_t op, uint32_t seq, int status,
                       const char *msg, GByteArray *data, int fd)
{
    OutMsg *m = g_new0(OutMsg, 1);

    m->buf = g_byte_array_new();
    m->fd = fd;
    hvm_reply_encode(m->buf, op, seq, status, status ? msg : NULL,
                     data ? data->data : NULL, data ? data->len : 0);
    if (g_queue_is_empty(&c->out)) {
        c->out_since = g_get_monotonic_time();
    }
    g_queue_push_tail(&c->out, m);
    c->out_bytes += m->buf->len;
    c->out_fds += fd >= 0;
    if (conn_flush(c) < 0) {
        return false;
    }
    if (c->out_bytes > OUT_MAX_BYTES || c->out_fds > OUT_MAX_FDS) {
        g_warning("connection of pid %d uid %u dropped: %zu bytes and %u "
                  "descriptors of unread replies (limits %u and %u)",
                  c->cred.pid, c->cred.uid, c->out_bytes, c->out_fds,
                  (unsigned)OUT_MAX_BYTES, OUT_MAX_FDS);
        return false;
    }
    return true;
}

/*
 * Say why (an unsolicited reply) and hang up: read nothing more, close once
 * the queue is written (or dropped by reap_slow if it never is).
 */
static void conn_finish(Conn *c, int status, const char *msg)
{
    if (c->watch) {
        g_source_remove(c->watch);
        c->watch = 0;
    }
    c->closing = true;
    c->have = 0;
    if (!conn_reply(c, 0, 0, status, msg, NULL, -1) ||
        g_queue_is_empty(&c->out)) {
        conn_close(c);
    }
}

static gboolean conn_writable(gint fd, GIOCondition cond, gpointer opaque)
{
    Conn *c = opaque;

    if (conn_flush(c) < 0) {
        c->out_watch = 0;
        conn_close(c);
        return G_SOURCE_REMOVE;
    }
    if (g_queue_is_empty(&c->out)) {
        c->out_watch = 0;
        if (c->closing) {
            conn_close(c);
        }
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

typedef enum { CONN_OK, CONN_DROP, CONN_FINISH } ConnState;

/* Handle the complete requests in c->buf. */
static ConnState conn_process(Conn *c, int *status, const char **why)
{
    while (c->have >= HVM_HDR_SIZE) {
        HvmHeader h;
        HvmRequest q;
        char msg[HVM_MAX_MSG];
        GByteArray *data;
        bool ok;
        int ret, fd = -1;

        ret = hvm_header_decode(c->buf, &h, false, why);
        if (ret) {
            /* Framing cannot be trusted any more: say why and hang up. */
            *status = ret;
            return CONN_FINISH;
        }
        if (c->have < HVM_HDR_SIZE + h.length) {
            return CONN_OK;
        }
        data = g_byte_array_new();
        ret = hvm_request_decode(h.op, h.seq, c->buf + HVM_HDR_SIZE, h.length,
                                 &q, msg, sizeof(msg));
        if (!ret) {
            ret = hvmd_dispatch(c, &q, data, &fd, msg, sizeof(msg));
        }
        if (ret) {
            g_byte_array_set_size(data, 0);
        }
        ok = conn_reply(c, h.op, h.seq, ret, msg, data, fd);
        g_byte_array_free(data, TRUE);
        if (!ok) {
            return CONN_DROP;
        }
        memmove(c->buf, c->buf + HVM_HDR_SIZE + h.length,
                c->have - HVM_HDR_SIZE - h.length);
        c->have -= HVM_HDR_SIZE + h.length;
        c->partial_since = g_get_monotonic_time();
    }
    return CONN_OK;
}

static gboolean conn_ready(gint fd, GIOCondition cond, gpointer opaque)
{
    Conn *c = opaque;
    const char *why = NULL;
    int status = 0;
    ssize_t n;

    n = recv(fd, c->buf + c->have, sizeof(c->buf) - c->have, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        return G_SOURCE_CONTINUE;
    }
    if (n <= 0) {
        c->watch = 0;
        conn_close(c);
        return G_SOURCE_REMOVE;
    }
    if (c->have == 0) {
        c->partial_since = g_get_monotonic_time();
    }
    c->have += n;
    switch (conn_process(c, &status, &why)) {
    case CONN_OK:
        return G_SOURCE_CONTINUE;
    case CONN_DROP:
        c->watch = 0;
        conn_close(c);
        return G_SOURCE_REMOVE;
    case CONN_FINISH:
    default:
        c->watch = 0;
        conn_finish(c, status, why);
        return G_SOURCE_REMOVE;
    }
}

/*
 * Once a second: a connection sitting on a partial request for longer than
 * the timeout is told so and dropped, so that slow or stuck senders cannot
 * keep slots; one whose replies have not moved for as long is dropped (it
 * does not read).  Idle connections (nothing pending either way) stay: an
 * idle connection is how a client holds its lease.
 */
static gboolean reap_slow(gpointer opaque)
{
    Broker *b = opaque;
    gint64 limit = g_get_monotonic_time() - (gint64)b->request_timeout * G_USEC_PER_SEC;
    GPtrArray *slow = g_ptr_array_new(), *deaf = g_ptr_array_new();
    GHashTableIter it;
    gpointer v;
    char msg[96];

    g_hash_table_iter_init(&it, b->conns);
    while (g_hash_table_iter_next(&it, &v, NULL)) {
        Conn *c = v;

        if (!g_queue_is_empty(&c->out) && c->out_since < limit) {
            g_ptr_array_add(deaf, c);
        } else if (c->have && c->partial_since < limit) {
            g_ptr_array_add(slow, c);
        }
    }
    for (guint i = 0; i < deaf->len; i++) {
        Conn *c = g_ptr_array_index(deaf, i);

        g_warning("connection of pid %d uid %u dropped: its replies not read "
                  "for %u s (%zu bytes queued)", c->cred.pid, c->cred.uid,
                  b->request_timeout, c->out_bytes);
        conn_close(c);
    }
    snprintf(msg, sizeof(msg), "request not complete within %u s",
             b->request_timeout);
    for (guint i = 0; i < slow->len; i++) {
        conn_finish(g_ptr_array_index(slow, i), -ETIMEDOUT, msg);
    }
    g_ptr_array_free(slow, TRUE);
    g_ptr_array_free(deaf, TRUE);
    return G_SOURCE_CONTINUE;
}

/* Refuse a connection just accepted: its socket is empty, so one try does. */
static void refuse(int fd, int status, const char *msg)
{
    GByteArray *out = g_byte_array_new();

    hvm_reply_encode(out, 0, 0, status, msg, NULL, 0);
    send_some(fd, out->data, out->len, -1);
    g_byte_array_free(out, TRUE);
    close(fd);
}

/*
 * May @uid open one more connection?  NULL, or why not.  Every uid but 0
 * has at most --max-conns-per-uid, and all of them together leave the last
 * --reserved-conns slots to uid 0: no user can lock root (or, with the
 * per-uid limit, everyone else) out by opening idle connections.
 */
static const char *conn_limit(Broker *b, uid_t uid, char *msg, size_t ml)
{
    unsigned n = g_hash_table_size(b->conns);
    unsigned mine = GPOINTER_TO_UINT(g_hash_table_lookup(b->uid_conns,
                                                         GUINT_TO_POINTER(uid)));

    if (n >= b->max_conns) {
        snprintf(msg, ml, "too many connections (max %u)", b->max_conns);
    } else if (uid && n >= b->max_conns - b->reserved_conns) {
        snprintf(msg, ml, "too many connections (max %u, the last %u kept "
                 "for uid 0)", b->max_conns, b->reserved_conns);
    } else if (uid && mine >= b->max_conns_per_uid) {
        snprintf(msg, ml, "too many connections from uid %u (max %u per uid)",
                 (unsigned)uid, b->max_conns_per_uid);
    } else {
        return NULL;
    }
    return msg;
}

/* Accept (or refuse) one pending connection; false when none is pending. */
static bool accept_one(Broker *b, int lfd)
{
    struct ucred cred;
    socklen_t len;
    char msg[128];
    Conn *c;
    int fd;

    fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
        if ((errno == EMFILE || errno == ENFILE) && b->reserve_fd >= 0) {
            /* Out of descriptors: use the reserve to refuse one politely. */
            close(b->reserve_fd);
            fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd >= 0) {
                refuse(fd, -EMFILE, "broker out of file descriptors");
            }
            b->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
            return fd >= 0;
        }
        return false;
    }
    len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
        refuse(fd, -EPROTO, "no peer credentials");
        return true;
    }
    if (conn_limit(b, cred.uid, msg, sizeof(msg))) {
        refuse(fd, -EUSERS, msg);
        return true;
    }
    c = g_new0(Conn, 1);
    c->b = b;
    c->fd = fd;
    c->cred = cred;
    len = sizeof(c->groups);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, c->groups, &len) == 0) {
        c->ngroups = len / sizeof(gid_t);
    }
    g_queue_init(&c->out);
    c->attached = g_hash_table_new(NULL, NULL);
    g_hash_table_add(b->conns, c);
    g_hash_table_insert(b->uid_conns, GUINT_TO_POINTER(cred.uid),
                        GUINT_TO_POINTER(1 + GPOINTER_TO_UINT(
                            g_hash_table_lookup(b->uid_conns,
                                                GUINT_TO_POINTER(cred.uid)))));
    c->watch = g_unix_fd_add(fd, G_IO_IN | G_IO_HUP | G_IO_ERR, conn_ready, c);
    return true;
}

static gboolean accept_ready(gint lfd, GIOCondition cond, gpointer opaque)
{
    /* A bounded batch per wake-up, so that a flood cannot starve clients. */
    for (int i = 0; i < 64 && accept_one(opaque, lfd); i++) {
        continue;
    }
    return G_SOURCE_CONTINUE;
}

/* ---- start-up ---- */

bool hvmd_parse_uid(const char *s, uint32_t *uid, uint32_t *gid)
{
    struct passwd *pw;
    char *end;
    guint64 v;

    v = g_ascii_strtoull(s, &end, 10);
    if (*s && !*end && v < UINT32_MAX) {
        *uid = v;
        pw = getpwuid(v);
        *gid = pw ? pw->pw_gid : v;
        return true;
    }
    pw = getpwnam(s);
    if (!pw) {
        return false;
    }
    *uid = pw->pw_uid;
    *gid = pw->pw_gid;
    return true;
}

bool hvmd_parse_gid(const char *s, uint32_t *gid)
{
    struct group *gr;
    char *end;
    guint64 v = g_ascii_strtoull(s, &end, 10);

    if (*s && !*end && v < UINT32_MAX) {
        *gid = v;
        return true;
    }
    gr = getgrnam(s);
    if (gr) {
        *gid = gr->gr_gid;
    }
    return gr != NULL;
}

/*
 * Static provisioning: [region NAME] size= mode= owner= group=,
 * [quota] UID-or-user=SIZE, and [remote-client NAME] (hvmemd-remote.c).  A region the catalogue lacks is created; one
 * it has keeps its data and size (never shrunk) and takes the file's mode
 * and owner; a larger size grows it.
 */
static bool provision(Broker *b, const char *file, bool *dirty, GError **errp)
{
    g_autoptr(GKeyFile) kf = g_key_file_new();
    g_auto(GStrv) groups = NULL;

    if (!g_key_file_load_from_file(kf, file, G_KEY_FILE_NONE, errp)) {
        g_prefix_error(errp, "%s: ", file);
        return false;
    }
    groups = g_key_file_get_groups(kf, NULL);
    for (int i = 0; groups[i]; i++) {
        const char *g = groups[i];

        if (!strcmp(g, "quota")) {
            g_auto(GStrv) keys = g_key_file_get_keys(kf, g, NULL, NULL);

            for (int k = 0; keys && keys[k]; k++) {
                g_autofree char *v = g_key_file_get_value(kf, g, keys[k], NULL);
                uint32_t uid, gid;
                uint64_t *q = g_new(uint64_t, 1);

                if (!hvmd_parse_uid(keys[k], &uid, &gid) || hvm_parse_size(v, q)) {
                    g_free(q);
                    g_set_error(errp, G_KEY_FILE_ERROR,
                                G_KEY_FILE_ERROR_INVALID_VALUE,
                                "%s: [quota] %s=%s: unknown user or bad size",
                                file, keys[k], v);
                    return false;
                }
                g_hash_table_insert(b->quotas, GUINT_TO_POINTER(uid), q);
            }
        } else if (g_str_has_prefix(g, "region ")) {
            const char *name = g + 7;
            g_autofree char *size_s = g_key_file_get_value(kf, g, "size", NULL);
            g_autofree char *mode_s = g_key_file_get_value(kf, g, "mode", NULL);
            g_autofree char *owner_s = g_key_file_get_value(kf, g, "owner", NULL);
            g_autofree char *group_s = g_key_file_get_value(kf, g, "group", NULL);
            const char *why = hvm_name_check(name, strlen(name));
            uint32_t uid = 0, gid = 0, mode = 0600;
            uint64_t size;
            char *end;
            HvmRegion *r;
            bool fresh;

            if (why) {
                g_set_error(errp, G_KEY_FILE_ERROR, G_KEY_FILE_ERROR_INVALID_VALUE,
                            "%s: [%s]: %s", file, g, why);
                return false;
            }
            if (!size_s || hvm_parse_size(size_s, &size) || !size ||
                size > HVM_MAX_SIZE) {
                g_set_error(errp, G_KEY_FILE_ERROR, G_KEY_FILE_ERROR_INVALID_VALUE,
                            "%s: [%s]: size= missing or invalid", file, g);
                return false;
            }
            if (mode_s) {
                mode = strtoul(mode_s, &end, 8);
                if (!*mode_s || *end || mode & ~HVM_MODE_MASK) {
                    g_set_error(errp, G_KEY_FILE_ERROR,
                                G_KEY_FILE_ERROR_INVALID_VALUE,
                                "%s: [%s]: mode=%s is not octal within 0666",
                                file, g, mode_s);
                    return false;
                }
            }
            if ((owner_s && !hvmd_parse_uid(owner_s, &uid, &gid)) ||
                (group_s && !hvmd_parse_gid(group_s, &gid))) {
                g_set_error(errp, G_KEY_FILE_ERROR, G_KEY_FILE_ERROR_INVALID_VALUE,
                            "%s: [%s]: unknown owner or group", file, g);
                return false;
            }
            size = hvmd_round_up(size, b->align);
            r = g_hash_table_lookup(b->cat->regions, name);
            fresh = !r;
            if (fresh) {
                r = hvm_region_new(name, b->cat->next_id++, size, mode, uid, gid);
            }
            if (fresh || size > r->size) {
                char msg[HVM_MAX_MSG];
                int fd = hvmd_region_open(b, r->id, O_RDWR |
                                          (fresh ? O_CREAT | O_EXCL : 0),
                                          msg, sizeof(msg));

                if (fd >= 0 && ftruncate(fd, size) < 0) {
                    snprintf(msg, sizeof(msg), "cannot size its file to %"
                             G_GUINT64_FORMAT ": %s", size, g_strerror(errno));
                    close(fd);
                    fd = -1;
                }
                if (fd < 0) {
                    g_set_error(errp, G_IO_ERROR, G_IO_ERROR_FAILED, "%s: [%s]: %s",
                                file, g, msg);
                    if (fresh) {
                        hvm_region_free(r);
                    }
                    return false;
                }
                close(fd);
                r->size = size;
            }
            if (fresh) {
                hvm_catalog_add(b->cat, r);
                g_message("provisioned region '%s': %" G_GUINT64_FORMAT
                          " bytes, mode %03o, uid %u", name, size, mode, uid);
            }
            r->mode = mode;
            r->uid = uid;
            r->gid = gid;
            *dirty = true;
        } else if (g_str_has_prefix(g, "remote-client ")) {
            if (!hvmd_remote_parse(b, kf, file, g, errp)) {
                return false;
            }
        } else {
            g_set_error(errp, G_KEY_FILE_ERROR, G_KEY_FILE_ERROR_GROUP_NOT_FOUND,
                        "%s: unknown group [%s] (expected [region NAME], "
                        "[quota] or [remote-client NAME])", file, g);
            return false;
        }
    }
    return true;
}

/* Listen on @path; *@ino is the socket file's, to remove only our own. */
static int listen_on(const char *path, unsigned mode, ino_t *ino, GError **errp)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    struct stat st;
    int fd;

    if (strlen(path) >= sizeof(sa.sun_path)) {
        g_set_error(errp, G_IO_ERROR, G_IO_ERROR_INVALID_ARGUMENT,
                    "socket path %s longer than %zu bytes", path,
                    sizeof(sa.sun_path) - 1);
        return -1;
    }
    strcpy(sa.sun_path, path);
    /* A stale socket of a broker that died (the pool lock says none runs). */
    if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode)) {
        unlink(path);
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
        chmod(path, mode) < 0 || listen(fd, 128) < 0 || lstat(path, &st) < 0) {
        g_set_error(errp, G_IO_ERROR, g_io_error_from_errno(errno),
                    "cannot listen on %s: %s", path, g_strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    *ino = st.st_ino;
    return fd;
}

static gboolean on_signal(gpointer opaque)
{
    g_main_loop_quit(opaque);
    return G_SOURCE_REMOVE;
}

/* Check and open the pool and state directories and take their locks. */
static bool open_dirs(Broker *b, GError **errp)
{
    struct stat ps, ss;

    b->pool_fd = hvmd_open_dir(b->pool_dir, true, errp);
    if (b->pool_fd < 0) {
        g_prefix_error(errp, "unsafe pool directory %s: ", b->pool_dir);
        return false;
    }
    b->state_fd = hvmd_open_dir(b->state_dir, true, errp);
    if (b->state_fd < 0) {
        g_prefix_error(errp, "unsafe state directory %s: ", b->state_dir);
        return false;
    }
    /* Clients only ever hold what the broker passes them. */
    if (fchmod(b->pool_fd, 0700) < 0 || fstat(b->pool_fd, &ps) < 0 ||
        fstat(b->state_fd, &ss) < 0) {
        g_set_error(errp, G_IO_ERROR, g_io_error_from_errno(errno), "%s: %s",
                    b->pool_dir, g_strerror(errno));
        return false;
    }
    if (!hvmd_lock_dir(b->pool_fd, b->pool_dir, errp)) {
        return false;
    }
    return (ps.st_dev == ss.st_dev && ps.st_ino == ss.st_ino) ||
           hvmd_lock_dir(b->state_fd, b->state_dir, errp);
}

/* An option in 1..@max, or @def when not given (-1). */
static bool opt_range(const char *name, int *v, int def, int max)
{
    if (*v == -1) {
        *v = def;
    }
    if (*v < 1 || *v > max) {
        g_printerr("hvmemd: --%s %d out of range (1..%d)\n", name, *v, max);
        return false;
    }
    return true;
}

int main(int argc, char **argv)
{
    Broker *b = &broker;
    g_autofree char *pool = NULL, *state = NULL, *sock = NULL, *config = NULL;
    g_autofree char *capacity_s = NULL, *quota_s = NULL, *sock_mode_s = NULL;
    int max_conns = 256, max_conns_per_uid = -1, reserved_conns = -1;
    int max_regions_per_uid = 256;
    int request_timeout = 10;
    GOptionEntry entries[] = {
        { "pool", 'p', 0, G_OPTION_ARG_FILENAME, &pool,
          "pool directory (tmpfs, hugetlbfs or DAX; default /dev/shm/hybridvm-broker)",
          "DIR" },
        { "state-dir", 0, 0, G_OPTION_ARG_FILENAME, &state,
          "where the catalogue lives (default: the pool directory)", "DIR" },
        { "socket", 's', 0, G_OPTION_ARG_FILENAME, &sock,
          "unix socket (default /run/hybridvm-broker.sock)", "PATH" },
        { "socket-mode", 0, 0, G_OPTION_ARG_STRING, &sock_mode_s,
          "socket file mode (default 0666: mode bits of regions decide)", "OCTAL" },
        { "config", 'c', 0, G_OPTION_ARG_FILENAME, &config,
          "static provisioning: [region NAME] size= mode= owner= group=, "
          "[quota] USER=SIZE", "FILE" },
        { "capacity", 0, 0, G_OPTION_ARG_STRING, &capacity_s,
          "bytes the pool may hand out (default: the file system's size)", "SIZE" },
        { "quota", 0, 0, G_OPTION_ARG_STRING, &quota_s,
          "per-uid quota, uid 0 included (default: a quarter of the capacity "
          "for every uid but 0)", "SIZE" },
        { "max-conns", 0, 0, G_OPTION_ARG_INT, &max_conns,
          "maximum client connections (default 256)", "N" },
        { "max-conns-per-uid", 0, 0, G_OPTION_ARG_INT, &max_conns_per_uid,
          "connections of one uid other than 0 (default: a quarter of "
          "--max-conns)", "N" },
        { "reserved-conns", 0, 0, G_OPTION_ARG_INT, &reserved_conns,
          "the last connections, kept for uid 0 (default: a sixteenth of "
          "--max-conns, at least 1)", "N" },
        { "max-regions-per-uid", 0, 0, G_OPTION_ARG_INT, &max_regions_per_uid,
          "regions of one uid other than 0 (default 256)", "N" },
        { "request-timeout", 0, 0, G_OPTION_ARG_INT, &request_timeout,
          "seconds a started request may take to arrive, and unread replies "
          "may wait (default 10)", "S" },
        { NULL }
    };
    g_autoptr(GOptionContext) ctx = g_option_context_new("- hybridvm memory broker");
    GError *err = NULL;
    struct statfs sfs;
    struct rlimit rl;
    struct stat st;
    unsigned sock_mode = 0666;
    ino_t sock_ino = 0;
    bool dirty = false;

    g_option_context_add_main_entries(ctx, entries, NULL);
    if (!g_option_context_parse(ctx, &argc, &argv, &err)) {
        g_printerr("hvmemd: %s\n", err->message);
        return 2;
    }
    b->pool_dir = pool ? g_strdup(pool) : g_strdup("/dev/shm/hybridvm-broker");
    b->state_dir = state ? g_strdup(state) : g_strdup(b->pool_dir);
    b->sock_path = sock ? g_strdup(sock) : g_strdup("/run/hybridvm-broker.sock");
    b->quotas = g_hash_table_new_full(NULL, NULL, NULL, g_free);
    b->remotes = g_ptr_array_new_with_free_func(hvmd_remote_free);
    b->zombies = g_ptr_array_new();
    b->conns = g_hash_table_new(NULL, NULL);
    b->uid_conns = g_hash_table_new(NULL, NULL);
    if (!opt_range("max-conns", &max_conns, 256, 65536) ||
        !opt_range("request-timeout", &request_timeout, 10, 3600) ||
        !opt_range("max-regions-per-uid", &max_regions_per_uid, 256,
                   HVM_MAX_REGIONS - HVMD_ROOT_REGIONS)) {
        return 2;
    }
    b->request_timeout = request_timeout;
    b->max_regions_per_uid = max_regions_per_uid;
    if (sock_mode_s) {
        char *end;

        sock_mode = strtoul(sock_mode_s, &end, 8);
        if (!*sock_mode_s || *end || sock_mode & ~0777u) {
            g_printerr("hvmemd: --socket-mode %s is not an octal mode\n",
                       sock_mode_s);
            return 2;
        }
    }
    if (quota_s && hvm_parse_size(quota_s, &b->quota)) {
        g_printerr("hvmemd: --quota %s is not a size\n", quota_s);
        return 2;
    }
    b->quota_set = quota_s != NULL;
    if (capacity_s && hvm_parse_size(capacity_s, &b->capacity)) {
        g_printerr("hvmemd: --capacity %s is not a size\n", capacity_s);
        return 2;
    }

    /*
     * Every connection is one descriptor, and its unread replies may hold
     * OUT_MAX_FDS more; keep a margin for the rest.
     */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 &&
        rl.rlim_cur < (rlim_t)max_conns * (1 + OUT_MAX_FDS) + 64) {
        rl.rlim_cur = MIN(rl.rlim_max, (rlim_t)max_conns * (1 + OUT_MAX_FDS) + 64);
        setrlimit(RLIMIT_NOFILE, &rl);
        if (rl.rlim_cur < (rlim_t)max_conns * (1 + OUT_MAX_FDS) + 64) {
            max_conns = MAX(rl.rlim_cur > 128 ? (rl.rlim_cur - 64) / (1 + OUT_MAX_FDS) : 1, 1);
            g_warning("RLIMIT_NOFILE %llu: at most %d connections",
                      (unsigned long long)rl.rlim_cur, max_conns);
        }
    }
    b->max_conns = max_conns;
    if (!opt_range("max-conns-per-uid", &max_conns_per_uid,
                   MAX(max_conns / 4, 1), max_conns)) {
        return 2;
    }
    b->max_conns_per_uid = max_conns_per_uid;
    if (reserved_conns == -1) {
        reserved_conns = max_conns > 1 ? MAX(max_conns / 16, 1) : 0;
    }
    if (reserved_conns < 0 || reserved_conns >= max_conns) {
        g_printerr("hvmemd: --reserved-conns %d out of range (0..%d)\n",
                   reserved_conns, max_conns - 1);
        return 2;
    }
    b->reserved_conns = reserved_conns;

    if (!open_dirs(b, &err)) {
        g_printerr("hvmemd: %s\n", err->message);
        return 1;
    }
    if (fstatfs(b->pool_fd, &sfs) < 0) {
        g_printerr("hvmemd: statfs %s: %s\n", b->pool_dir, g_strerror(errno));
        return 1;
    }
    /* hugetlbfs files grow in huge pages; tmpfs and DAX in base pages. */
    b->align = sfs.f_type == HUGETLBFS_MAGIC_ ? sfs.f_bsize : sysconf(_SC_PAGESIZE);
    if (!capacity_s) {
        b->capacity = (uint64_t)sfs.f_blocks * sfs.f_bsize;
    }

    b->cat = hvm_catalog_load(b->state_fd, b->state_dir, &err);
    if (!b->cat) {
        /* Never start over a catalogue we cannot read: it names live data. */
        g_printerr("hvmemd: %s\n", err->message);
        return 1;
    }
    if (!hvmd_reconcile(b, &dirty, &err)) {
        g_printerr("hvmemd: %s\n", err->message);
        return 1;
    }
    if (config && !provision(b, config, &dirty, &err)) {
        g_printerr("hvmemd: %s\n", err->message);
        return 1;
    }
    if (dirty) {
        char msg[HVM_MAX_MSG];

        if (hvmd_save(b, msg, sizeof(msg))) {
            g_printerr("hvmemd: %s\n", msg);
            return 1;
        }
    }

    b->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    b->listen_fd = listen_on(b->sock_path, sock_mode, &sock_ino, &err);
    if (b->listen_fd < 0) {
        g_printerr("hvmemd: %s\n", err->message);
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGIO, SIG_IGN);     /* lease breaks: see open_for_writing() */
    b->loop = g_main_loop_new(NULL, FALSE);
    g_unix_signal_add(SIGTERM, on_signal, b->loop);
    g_unix_signal_add(SIGINT, on_signal, b->loop);
    g_unix_fd_add(b->listen_fd, G_IO_IN, accept_ready, b);
    g_timeout_add_seconds(1, reap_slow, b);
    g_message("ready: socket %s, pool %s (%" G_GUINT64_FORMAT " bytes, "
              "align %u), %u regions, generation %" G_GUINT64_FORMAT,
              b->sock_path, b->pool_dir, b->capacity, b->align,
              g_hash_table_size(b->cat->regions), b->cat->generation);
    g_main_loop_run(b->loop);
    if (lstat(b->sock_path, &st) == 0 && st.st_ino == sock_ino) {
        unlink(b->sock_path);
    }
    g_message("stopped");
    return 0;
}
