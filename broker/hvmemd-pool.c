/*
 * hvmemd: the pool and state directories.  Before the broker trusts a
 * directory it checks it and every directory and symbolic link on the way to
 * it, as sshd (safe_path) and systemd (chase with CHASE_SAFE) do, and from
 * then on opens files relative to the checked descriptor, never through a
 * symbolic link.  One broker per directory: an instance lock.  At start the
 * catalogue and the pool's files are made to agree.  The rules are in
 * docs/broker.md, "Directories".
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <gio/gio.h>

#include "hvmemd.h"

#define MAX_SYMLINKS    40      /* as the kernel's path walk */

/* ---- checked directories ---- */

static bool fail(GError **errp, int err, const char *fmt, ...) G_GNUC_PRINTF(3, 4);

static bool fail(GError **errp, int err, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    g_propagate_error(errp, g_error_new_valist(G_IO_ERROR,
                                               g_io_error_from_errno(err), fmt, ap));
    va_end(ap);
    return false;
}

/*
 * A directory on the way (the pool's parents, or one a symbolic link leads
 * through): only root or the broker's uid may own it, and if group or
 * others may write it, it must be sticky (/tmp, /dev/shm): there nobody can
 * rename or remove what another user made.  Otherwise its owner, or anyone
 * who can write it, could put another directory in the pool's place.
 */
static bool check_on_way(const struct stat *st, const char *path, uid_t me,
                         GError **errp)
{
    if (st->st_uid != 0 && st->st_uid != me) {
        return fail(errp, EPERM, "%s: owned by uid %u, not by root or uid %u "
                    "(this broker's): that user could replace what is below it",
                    path, (unsigned)st->st_uid, (unsigned)me);
    }
    if ((st->st_mode & (S_IWGRP | S_IWOTH)) && !(st->st_mode & S_ISVTX)) {
        return fail(errp, EPERM, "%s: writable by group or others (mode %04o) "
                    "and not sticky: they could replace what is below it",
                    path, (unsigned)(st->st_mode & 07777));
    }
    return true;
}

/* The directory itself: the broker's own, and only the broker writes it. */
static bool check_final(const struct stat *st, const char *path, uid_t me,
                        GError **errp)
{
    if (st->st_uid != me) {
        return fail(errp, EPERM, "%s: owned by uid %u, not by uid %u (this "
                    "broker's): another user may have made it first and could "
                    "swap the files in it; remove it or choose another",
                    path, (unsigned)st->st_uid, (unsigned)me);
    }
    if (st->st_mode & (S_IWGRP | S_IWOTH)) {
        return fail(errp, EPERM, "%s: writable by group or others (mode %04o): "
                    "someone may have put files in it; make it 0700",
                    path, (unsigned)(st->st_mode & 07777));
    }
    return true;
}

/* Queue @path's components in front of @todo, in order. */
static void push_components(GQueue *todo, const char *path)
{
    g_auto(GStrv) parts = g_strsplit(path, "/", -1);

    for (int i = g_strv_length(parts) - 1; i >= 0; i--) {
        if (*parts[i] && strcmp(parts[i], ".")) {
            g_queue_push_head(todo, g_strdup(parts[i]));
        }
    }
}

/*
 * Walk @path from "/" one component at a time with O_PATH | O_NOFOLLOW
 * descriptors, each opened relative to the one before, so that what is
 * checked is what is used.  A directory is checked on the way when the walk
 * goes below it, the last one as the directory itself.  A symbolic link is
 * followed only if root or the broker's uid owns it (its directory being
 * checked already); ".." goes back to the directory walked before.  The
 * stack holds the descriptors of the directories walked, and their names for
 * messages; the first @checked of them passed check_on_way().
 */
int hvmd_open_dir(const char *path, bool create, GError **errp)
{
    uid_t me = geteuid();
    g_autofree char *cwd = g_get_current_dir();
    GQueue todo = G_QUEUE_INIT;
    GArray *fds = g_array_new(FALSE, FALSE, sizeof(int));
    GPtrArray *names = g_ptr_array_new_with_free_func(g_free);
    unsigned links = 0, checked = 0;
    struct stat st;
    char *comp;
    int fd, dfd = -1;

    if (!g_path_is_absolute(path)) {
        push_components(&todo, path);
        path = cwd;         /* getcwd() gives a path without links */
    }
    push_components(&todo, path);
    fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        fail(errp, errno, "/: %s", g_strerror(errno));
        goto out;
    }
    g_array_append_val(fds, fd);
    g_ptr_array_add(names, g_strdup(""));

    while ((comp = g_queue_pop_head(&todo))) {
        int cur = g_array_index(fds, int, fds->len - 1);
        g_autofree char *here = g_strconcat(names->pdata[names->len - 1], "/",
                                            comp, NULL);
        g_autofree char *name = comp;

        if (!strcmp(name, "..")) {
            if (fds->len > 1) {
                close(g_array_index(fds, int, fds->len - 1));
                g_array_set_size(fds, fds->len - 1);
                g_ptr_array_set_size(names, names->len - 1);
                checked = MIN(checked, fds->len);
            }
            continue;
        }
        if (checked < fds->len) {
            const char *dir = names->len > 1 ? names->pdata[names->len - 1] : "/";

            if (fstat(cur, &st) < 0) {
                fail(errp, errno, "%s: %s", dir, g_strerror(errno));
                goto out;
            }
            if (!check_on_way(&st, dir, me, errp)) {
                goto out;
            }
            checked = fds->len;
        }
        fd = openat(cur, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT && create) {
            /* Made by us, 0700; if someone was faster, the checks see it. */
            if (mkdirat(cur, name, 0700) < 0 && errno != EEXIST) {
                fail(errp, errno, "cannot create %s: %s", here, g_strerror(errno));
                goto out;
            }
            fd = openat(cur, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        }
        if (fd < 0 || fstat(fd, &st) < 0) {
            fail(errp, errno, "%s: %s", here, g_strerror(errno));
            if (fd >= 0) {
                close(fd);
            }
            goto out;
        }
        if (S_ISLNK(st.st_mode)) {
            char target[PATH_MAX];
            ssize_t n = readlinkat(fd, "", target, sizeof(target) - 1);

            close(fd);
            if (st.st_uid != 0 && st.st_uid != me) {
                fail(errp, EPERM, "%s: a symbolic link owned by uid %u (only "
                     "root's and uid %u's are followed)", here,
                     (unsigned)st.st_uid, (unsigned)me);
                goto out;
            }
            if (n < 0 || n >= (ssize_t)sizeof(target) - 1) {
                fail(errp, n < 0 ? errno : ENAMETOOLONG, "%s: %s", here,
                     g_strerror(n < 0 ? errno : ENAMETOOLONG));
                goto out;
            }
            if (++links > MAX_SYMLINKS) {
                fail(errp, ELOOP, "%s: too many symbolic links", here);
                goto out;
            }
            target[n] = '\0';
            push_components(&todo, target);
            while (target[0] == '/' && fds->len > 1) {
                close(g_array_index(fds, int, fds->len - 1));
                g_array_set_size(fds, fds->len - 1);
                g_ptr_array_set_size(names, names->len - 1);
            }
            checked = MIN(checked, fds->len);
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            close(fd);
            fail(errp, ENOTDIR, "%s: not a directory", here);
            goto out;
        }
        g_array_append_val(fds, fd);
        g_ptr_array_add(names, g_steal_pointer(&here));
    }
    if (fds->len == 1) {
        fail(errp, EINVAL, "/ cannot be a broker's directory");
        goto out;
    }
    fd = g_array_index(fds, int, fds->len - 1);
    if (fstat(fd, &st) < 0) {
        fail(errp, errno, "%s: %s", (char *)names->pdata[names->len - 1],
             g_strerror(errno));
        goto out;
    }
    if (!check_final(&st, names->pdata[names->len - 1], me, errp)) {
        goto out;
    }
    dfd = openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        fail(errp, errno, "%s: %s", (char *)names->pdata[names->len - 1],
             g_strerror(errno));
    }
out:
    for (guint i = 0; i < fds->len; i++) {
        close(g_array_index(fds, int, i));
    }
    g_array_free(fds, TRUE);
    g_ptr_array_free(names, TRUE);
    g_queue_clear_full(&todo, g_free);
    return dfd;
}

/*
 * One broker per directory.  Two on one pool would each delete the files
 * the other's catalogue names, and the second would take the socket over.
 * The lock is a POSIX record lock (fcntl F_SETLK, a write lock on the whole
 * of "hvmemd.lock"): the kernel drops it when the process ends, however it
 * ends, and F_GETLK names the holder's pid.  A POSIX lock also goes when the
 * process closes *any* descriptor of the file, so the file is opened once
 * and its descriptor kept (deliberately leaked) for the process's life.
 */
bool hvmd_lock_dir(int dfd, const char *path, GError **errp)
{
    struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
    char pid[32];
    int fd, n;

    fd = openat(dfd, "hvmemd.lock", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW,
                0600);
    if (fd < 0) {
        return fail(errp, errno, "cannot open %s/hvmemd.lock: %s", path,
                    g_strerror(errno));
    }
    if (fcntl(fd, F_SETLK, &fl) < 0) {
        int err = errno;
        struct flock who = { .l_type = F_WRLCK, .l_whence = SEEK_SET };

        if (err != EAGAIN && err != EACCES) {
            close(fd);
            return fail(errp, err, "cannot lock %s/hvmemd.lock: %s", path,
                        g_strerror(err));
        }
        if (fcntl(fd, F_GETLK, &who) == 0 && who.l_type != F_UNLCK &&
            who.l_pid > 0) {
            snprintf(pid, sizeof(pid), "pid %d", (int)who.l_pid);
        } else {
            /* in another pid namespace, or it has just gone */
            snprintf(pid, sizeof(pid), "pid unknown here");
        }
        close(fd);
        return fail(errp, EBUSY, "%s is in use by another hvmemd (%s): it holds "
                    "the lock %s/hvmemd.lock", path, pid, path);
    }
    /* For people: the holder's pid (the lock itself is what counts). */
    n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
    if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, n, 0) != n) {
        g_warning("cannot write %s/hvmemd.lock: %s", path, g_strerror(errno));
    }
    return true;
}

/* ---- region files ---- */

static void region_name(uint64_t id, char *buf, size_t len)
{
    snprintf(buf, len, "r-%" G_GUINT64_FORMAT, id);
}

char *hvmd_region_path(Broker *b, uint64_t id)
{
    return g_strdup_printf("%s/r-%" G_GUINT64_FORMAT, b->pool_dir, id);
}

int hvmd_region_open(Broker *b, uint64_t id, int flags, char *msg, size_t ml)
{
    char name[32];
    struct stat st;
    int fd, ret;

    region_name(id, name, sizeof(name));
    fd = openat(b->pool_fd, name, flags | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        ret = -errno;
        snprintf(msg, ml, "cannot open %s/%s: %s", b->pool_dir, name,
                 g_strerror(-ret));
        return ret;
    }
    if (!(flags & O_CREAT) &&
        (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid())) {
        snprintf(msg, ml, "%s/%s: not a regular file of uid %u", b->pool_dir,
                 name, (unsigned)geteuid());
        close(fd);
        return -EPERM;
    }
    return fd;
}

int hvmd_region_unlink(Broker *b, uint64_t id)
{
    char name[32];

    region_name(id, name, sizeof(name));
    return unlinkat(b->pool_fd, name, 0) < 0 ? -errno : 0;
}

/* ---- start-up ---- */

bool hvmd_reconcile(Broker *b, bool *dirty, GError **errp)
{
    GHashTable *ids = g_hash_table_new(g_int64_hash, g_int64_equal);
    GPtrArray *gone = g_ptr_array_new();
    GHashTableIter it;
    gpointer v;
    DIR *d;
    struct dirent *de;
    bool ok = false;
    int dfd;

    g_hash_table_iter_init(&it, b->cat->regions);
    while (g_hash_table_iter_next(&it, NULL, &v)) {
        HvmRegion *r = v;
        g_autofree char *path = hvmd_region_path(b, r->id);
        char name[32], msg[256];
        struct stat st;

        region_name(r->id, name, sizeof(name));
        if (fstatat(b->pool_fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            if (errno != ENOENT) {
                fail(errp, errno, "%s: %s", path, g_strerror(errno));
                goto out;
            }
            g_warning("region '%s' (id %" G_GUINT64_FORMAT "): %s is gone "
                      "(host rebooted or pool cleared?): dropped from the "
                      "catalogue", r->name, r->id, path);
            g_ptr_array_add(gone, r);
            continue;
        }
        if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
            /* Only root or the broker's uid can have put it there. */
            fail(errp, EPERM, "%s: not a regular file of uid %u (mode %06o, "
                 "uid %u): the pool was changed behind the broker's back; move "
                 "it away to start (region '%s' is then dropped)", path,
                 (unsigned)geteuid(), (unsigned)st.st_mode, (unsigned)st.st_uid,
                 r->name);
            goto out;
        }
        if ((uint64_t)st.st_size != r->size) {
            int fd = hvmd_region_open(b, r->id, O_RDWR, msg, sizeof(msg));

            g_warning("region '%s': file has %lld bytes, catalogue says %"
                      G_GUINT64_FORMAT ": file set to the catalogue's size",
                      r->name, (long long)st.st_size, r->size);
            if (fd < 0 || ftruncate(fd, r->size) < 0) {
                g_warning("cannot resize %s: %s", path,
                          fd < 0 ? msg : g_strerror(errno));
            }
            if (fd >= 0) {
                close(fd);
            }
        }
        g_hash_table_add(ids, &r->id);
    }
    for (guint i = 0; i < gone->len; i++) {
        HvmRegion *r = g_ptr_array_index(gone, i);

        hvm_catalog_remove(b->cat, r);
        hvm_region_free(r);
        *dirty = true;
    }
    /* Files no catalogue entry names: a crash between create and commit,
     * or a destroyed region whose last client was attached at shutdown. */
    dfd = dup(b->pool_fd);
    d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (!d) {
        fail(errp, errno, "cannot read %s: %s", b->pool_dir, g_strerror(errno));
        if (dfd >= 0) {
            close(dfd);
        }
        goto out;
    }
    while ((de = readdir(d))) {
        guint64 id;
        char *end;

        if (strncmp(de->d_name, "r-", 2)) {
            continue;
        }
        id = g_ascii_strtoull(de->d_name + 2, &end, 10);
        if (*end || g_hash_table_contains(ids, &id)) {
            continue;
        }
        g_message("removing %s/%s: in no catalogue entry", b->pool_dir,
                  de->d_name);
        if (unlinkat(b->pool_fd, de->d_name, 0) < 0) {
            g_warning("cannot remove %s/%s: %s", b->pool_dir, de->d_name,
                      g_strerror(errno));
        }
    }
    closedir(d);
    ok = true;
out:
    g_ptr_array_free(gone, TRUE);
    g_hash_table_destroy(ids);
    return ok;
}
