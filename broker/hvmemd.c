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
 * connection, so no state below needs a lock.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
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
#define SEND_TIMEOUT_MS      1000    /* a client that does not read is dropped */

static Broker broker;

/* ---- connections ---- */

/* Send all of @buf (with @fd on the first byte, if >= 0) within the timeout. */
static int send_all(int sock, const uint8_t *buf, size_t len, int fd)
{
    gint64 deadline = g_get_monotonic_time() + SEND_TIMEOUT_MS * 1000;
    size_t off = 0;

    while (off < len) {
        struct iovec iov = { (void *)(buf + off), len - off };
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
        n = sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            off += n;
            fd = -1;
            continue;
        }
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0 && errno == EAGAIN) {
            struct pollfd p = { .fd = sock, .events = POLLOUT };
            gint64 left = (deadline - g_get_monotonic_time()) / 1000;

            if (left <= 0 || poll(&p, 1, left) <= 0) {
                return -ETIMEDOUT;
            }
            continue;
        }
        return n < 0 ? -errno : -EIO;
    }
    return 0;
}

static int reply(Conn *c, uint16_t op, uint32_t seq, int status,
                 const char *msg, GByteArray *data, int fd)
{
    GByteArray *out = g_byte_array_new();
    int ret;

    hvm_reply_encode(out, op, seq, status, status ? msg : NULL,
                     data ? data->data : NULL, data ? data->len : 0);
    ret = send_all(c->fd, out->data, out->len, fd);
    g_byte_array_free(out, TRUE);
    return ret;
}

static void conn_close(Conn *c)
{
    Broker *b = c->b;
    GHashTableIter it;
    gpointer v;

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
    close(c->fd);
    g_hash_table_remove(b->conns, c);
    g_free(c);
}

/* Handle the complete requests in c->buf; false when the connection must go. */
static bool conn_process(Conn *c)
{
    while (c->have >= HVM_HDR_SIZE) {
        HvmHeader h;
        HvmRequest q;
        const char *why;
        char msg[HVM_MAX_MSG];
        GByteArray *data;
        int ret, fd = -1;

        ret = hvm_header_decode(c->buf, &h, false, &why);
        if (ret) {
            /* Framing cannot be trusted any more: say why and hang up. */
            reply(c, 0, 0, ret, why, NULL, -1);
            return false;
        }
        if (c->have < HVM_HDR_SIZE + h.length) {
            return true;
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
        ret = reply(c, h.op, h.seq, ret, msg, data, fd);
        g_byte_array_free(data, TRUE);
        if (fd >= 0) {
            close(fd);
        }
        if (ret) {
            return false;
        }
        memmove(c->buf, c->buf + HVM_HDR_SIZE + h.length,
                c->have - HVM_HDR_SIZE - h.length);
        c->have -= HVM_HDR_SIZE + h.length;
        c->partial_since = g_get_monotonic_time();
    }
    return true;
}

static gboolean conn_ready(gint fd, GIOCondition cond, gpointer opaque)
{
    Conn *c = opaque;
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
    if (!conn_process(c)) {
        c->watch = 0;
        conn_close(c);
        return G_SOURCE_REMOVE;
    }
    return G_SOURCE_CONTINUE;
}

/*
 * Once a second: a connection sitting on a partial request for longer than
 * the timeout is dropped, so that slow or stuck senders cannot keep slots.
 * Idle connections (nothing pending) stay: an idle connection is how a
 * client holds its lease.
 */
static gboolean reap_slow(gpointer opaque)
{
    Broker *b = opaque;
    gint64 limit = g_get_monotonic_time() - (gint64)b->request_timeout * G_USEC_PER_SEC;
    GPtrArray *slow = g_ptr_array_new();
    GHashTableIter it;
    gpointer v;

    g_hash_table_iter_init(&it, b->conns);
    while (g_hash_table_iter_next(&it, &v, NULL)) {
        Conn *c = v;

        if (c->have && c->partial_since < limit) {
            g_ptr_array_add(slow, c);
        }
    }
    for (guint i = 0; i < slow->len; i++) {
        Conn *c = g_ptr_array_index(slow, i);
        char msg[96];

        snprintf(msg, sizeof(msg), "request not complete within %u s",
                 b->request_timeout);
        reply(c, 0, 0, -ETIMEDOUT, msg, NULL, -1);
        conn_close(c);
    }
    g_ptr_array_free(slow, TRUE);
    return G_SOURCE_CONTINUE;
}

static void refuse(int fd, int status, const char *msg)
{
    GByteArray *out = g_byte_array_new();

    hvm_reply_encode(out, 0, 0, status, msg, NULL, 0);
    send_all(fd, out->data, out->len, -1);
    g_byte_array_free(out, TRUE);
    close(fd);
}

/* Accept (or refuse) one pending connection; false when none is pending. */
static bool accept_one(Broker *b, int lfd)
{
    socklen_t len;
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
    if (g_hash_table_size(b->conns) >= b->max_conns) {
        char msg[128];

        snprintf(msg, sizeof(msg), "too many connections (max %u)",
                 b->max_conns);
        refuse(fd, -EUSERS, msg);
        return true;
    }
    c = g_new0(Conn, 1);
    c->b = b;
    c->fd = fd;
    len = sizeof(c->cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c->cred, &len) < 0) {
        g_free(c);
        refuse(fd, -EPROTO, "no peer credentials");
        return true;
    }
    len = sizeof(c->groups);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, c->groups, &len) == 0) {
        c->ngroups = len / sizeof(gid_t);
    }
    c->attached = g_hash_table_new(NULL, NULL);
    g_hash_table_add(b->conns, c);
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

static bool parse_uid(const char *s, uint32_t *uid, uint32_t *gid)
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

static bool parse_gid(const char *s, uint32_t *gid)
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
 * Static provisioning: [region NAME] size= mode= owner= group=, and
 * [quota] UID-or-user=SIZE.  A region the catalogue lacks is created; one
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

                if (!parse_uid(keys[k], &uid, &gid) || hvm_parse_size(v, q)) {
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
            if ((owner_s && !parse_uid(owner_s, &uid, &gid)) ||
                (group_s && !parse_gid(group_s, &gid))) {
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
                g_hash_table_insert(b->cat->regions, r->name, r);
                g_message("provisioned region '%s': %" G_GUINT64_FORMAT
                          " bytes, mode %03o, uid %u", name, size, mode, uid);
            }
            r->mode = mode;
            r->uid = uid;
            r->gid = gid;
            *dirty = true;
        } else {
            g_set_error(errp, G_KEY_FILE_ERROR, G_KEY_FILE_ERROR_GROUP_NOT_FOUND,
                        "%s: unknown group [%s] (expected [region NAME] or "
                        "[quota])", file, g);
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

int main(int argc, char **argv)
{
    Broker *b = &broker;
    g_autofree char *pool = NULL, *state = NULL, *sock = NULL, *config = NULL;
    g_autofree char *capacity_s = NULL, *quota_s = NULL, *sock_mode_s = NULL;
    int max_conns = 256;
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
          "default per-uid quota (default: none)", "SIZE" },
        { "max-conns", 0, 0, G_OPTION_ARG_INT, &max_conns,
          "maximum client connections (default 256)", "N" },
        { "request-timeout", 0, 0, G_OPTION_ARG_INT, &request_timeout,
          "seconds a started request may take to arrive (default 10)", "S" },
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
    b->zombies = g_ptr_array_new();
    b->conns = g_hash_table_new(NULL, NULL);
    if (max_conns < 1 || max_conns > 65536) {
        g_printerr("hvmemd: --max-conns %d out of range (1..65536)\n", max_conns);
        return 2;
    }
    b->max_conns = max_conns;
    if (request_timeout < 1 || request_timeout > 3600) {
        g_printerr("hvmemd: --request-timeout %d out of range (1..3600)\n",
                   request_timeout);
        return 2;
    }
    b->request_timeout = request_timeout;
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
    if (capacity_s) {
        if (hvm_parse_size(capacity_s, &b->capacity)) {
            g_printerr("hvmemd: --capacity %s is not a size\n", capacity_s);
            return 2;
        }
    } else {
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

    /* Every connection is one descriptor; keep a margin for the rest. */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < b->max_conns + 64) {
        rl.rlim_cur = MIN(rl.rlim_max, (rlim_t)b->max_conns + 64);
        setrlimit(RLIMIT_NOFILE, &rl);
        if (rl.rlim_cur < b->max_conns + 64) {
            b->max_conns = rl.rlim_cur > 128 ? rl.rlim_cur - 64 : rl.rlim_cur / 2;
            g_warning("RLIMIT_NOFILE %llu: at most %u connections",
                      (unsigned long long)rl.rlim_cur, b->max_conns);
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
