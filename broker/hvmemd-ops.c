/*
 * hvmemd: what a request may do (quotas, the POSIX permission model of
 * docs/broker.md) and what it does to the catalogue and the pool.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <glib.h>

#include "hvmemd.h"

/* ---- accounting ---- */

/* Bytes in the pool, and bytes and regions of @uid (destroyed ones count). */
static void usage_of(Broker *b, uint32_t uid, uint64_t *total, uint64_t *by_uid,
                     unsigned *regions_of_uid)
{
    GHashTableIter it;
    gpointer v;
    unsigned n = 0;

    *total = *by_uid = 0;
    g_hash_table_iter_init(&it, b->cat->regions);
    while (g_hash_table_iter_next(&it, NULL, &v)) {
        HvmRegion *r = v;

        *total += r->size;
        *by_uid += r->uid == uid ? r->size : 0;
        n += r->uid == uid;
    }
    for (guint i = 0; i < b->zombies->len; i++) {
        HvmRegion *r = g_ptr_array_index(b->zombies, i);

        *total += r->size;
        *by_uid += r->uid == uid ? r->size : 0;
        n += r->uid == uid;
    }
    if (regions_of_uid) {
        *regions_of_uid = n;
    }
}

/*
 * [quota] for the uid, else --quota, else a quarter of the pool for every
 * uid but 0 (so that one user cannot take it all) and none for uid 0.
 */
static uint64_t quota_of(Broker *b, uint32_t uid)
{
    uint64_t *q = g_hash_table_lookup(b->quotas, GUINT_TO_POINTER(uid));

    if (q) {
        return *q;
    }
    if (b->quota_set) {
        return b->quota;
    }
    return uid ? MAX(b->capacity / 4, 1) : 0;
}

/* May @uid take @delta more bytes?  0 or -ENOSPC/-EDQUOT with @msg. */
static int admit(Broker *b, uint32_t uid, uint64_t delta, char *msg, size_t ml)
{
    uint64_t total, mine, quota = quota_of(b, uid);

    usage_of(b, uid, &total, &mine, NULL);
    if (delta > b->capacity - MIN(total, b->capacity)) {
        snprintf(msg, ml, "pool full: %" G_GUINT64_FORMAT " bytes asked, %"
                 G_GUINT64_FORMAT " of %" G_GUINT64_FORMAT " free",
                 delta, b->capacity - MIN(total, b->capacity), b->capacity);
        return -ENOSPC;
    }
    if (quota && delta > quota - MIN(mine, quota)) {
        snprintf(msg, ml, "quota of uid %u exceeded: %" G_GUINT64_FORMAT
                 " bytes asked, %" G_GUINT64_FORMAT " of %" G_GUINT64_FORMAT
                 " used", uid, delta, mine, quota);
        return -EDQUOT;
    }
    return 0;
}

/* ---- permissions: POSIX rules on the region's mode bits; uid 0 passes ---- */

bool hvmd_may(uint32_t uid, uint32_t gid, const gid_t *groups, int ngroups,
              HvmRegion *r, unsigned want)
{
    unsigned bits;
    bool in_group = gid == r->gid;

    for (int i = 0; i < ngroups && !in_group; i++) {
        in_group = groups[i] == r->gid;
    }
    if (uid == 0) {
        return true;
    }
    if (uid == r->uid) {
        bits = (r->mode >> 6) & 7;
    } else if (in_group) {
        bits = (r->mode >> 3) & 7;
    } else {
        bits = r->mode & 7;
    }
    return (bits & want) == want;
}

static bool may(Conn *c, HvmRegion *r, unsigned want)
{
    return hvmd_may(c->cred.uid, c->cred.gid, c->groups, c->ngroups, r, want);
}

static bool is_owner(Conn *c, HvmRegion *r)
{
    return c->cred.uid == 0 || c->cred.uid == r->uid;
}

static void region_info(HvmRegion *r, HvmRegionInfo *ri)
{
    memset(ri, 0, sizeof(*ri));
    ri->size = r->size;
    ri->used = hvm_region_used(r);
    ri->id = r->id;
    ri->mode = r->mode;
    ri->uid = r->uid;
    ri->gid = r->gid;
    ri->nitems = r->items->len;
    ri->attached = r->attached;
    ri->flags = (r->lease ? HVM_REGION_LEASED : 0) |
                (r->destroyed ? HVM_REGION_DESTROYED : 0);
    ri->lease_pid = r->lease ? r->lease_pid : 0;
    g_strlcpy(ri->name, r->name, sizeof(ri->name));
}

/* A region record for the reply */
static void region_reply(GByteArray *data, HvmRegion *r)
{
    HvmRegionInfo ri;

    region_info(r, &ri);
    hvm_region_encode(data, &ri);
}

int hvmd_save(Broker *b, char *msg, size_t ml)
{
    GError *err = NULL;
    int ret = hvm_catalog_save(b->cat, b->state_fd, b->state_dir, &err);

    if (ret) {
        snprintf(msg, ml, "catalogue not saved: %s", err->message);
        g_warning("%s", err->message);
        g_error_free(err);
    }
    return ret;
}

/* Free a region that is out of the catalogue and no longer attached. */
void hvmd_region_release_file(Broker *b, HvmRegion *r)
{
    g_autofree char *path = hvmd_region_path(b, r->id);
    int ret = hvmd_region_unlink(b, r->id);

    if (ret && ret != -ENOENT) {
        g_warning("cannot remove %s: %s", path, g_strerror(-ret));
    }
    g_message("region '%s' (id %" G_GUINT64_FORMAT ") freed", r->name, r->id);
    hvm_region_free(r);
}

/* ---- operations ---- */

#define FAIL(code, ...) do { \
    snprintf(msg, ml, __VA_ARGS__); \
    return (code); \
} while (0)

static HvmRegion *get_region(Broker *b, const char *name)
{
    return g_hash_table_lookup(b->cat->regions, name);
}

/*
 * The region table (HVM_MAX_REGIONS) is shared: a uid other than 0 may
 * hold --max-regions-per-uid regions, and all of them together not the last
 * HVMD_ROOT_REGIONS, so that one user cannot lock the others, or root, out.
 */
static int admit_region(Broker *b, uint32_t uid, char *msg, size_t ml)
{
    unsigned n = g_hash_table_size(b->cat->regions) + b->zombies->len, mine;
    uint64_t total, bytes;

    if (n >= HVM_MAX_REGIONS) {
        FAIL(-ENOSPC, "too many regions (limit %d)", HVM_MAX_REGIONS);
    }
    if (uid == 0) {
        return 0;
    }
    if (n >= HVM_MAX_REGIONS - HVMD_ROOT_REGIONS) {
        FAIL(-ENOSPC, "too many regions (limit %d, the last %d kept for uid 0)",
             HVM_MAX_REGIONS, HVMD_ROOT_REGIONS);
    }
    usage_of(b, uid, &total, &bytes, &mine);
    if (mine >= b->max_regions_per_uid) {
        FAIL(-EDQUOT, "too many regions for uid %u (max %u per uid)", uid,
             b->max_regions_per_uid);
    }
    return 0;
}

static int op_create(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                     size_t ml)
{
    Broker *b = c->b;
    uint64_t size = hvmd_round_up(q->size, b->align);
    HvmRegion *r;
    int fd, ret;

    if (get_region(b, q->name)) {
        FAIL(-EEXIST, "region '%s' exists", q->name);
    }
    ret = admit_region(b, c->cred.uid, msg, ml);
    if (ret) {
        return ret;
    }
    ret = admit(b, c->cred.uid, size, msg, ml);
    if (ret) {
        return ret;
    }
    r = hvm_region_new(q->name, b->cat->next_id++, size, q->mode, c->cred.uid,
                       c->cred.gid);
    fd = hvmd_region_open(b, r->id, O_RDWR | O_CREAT | O_EXCL, msg, ml);
    if (fd < 0) {
        hvm_region_free(r);
        return fd;
    }
    if (ftruncate(fd, size) < 0) {
        ret = -errno;
        close(fd);
        hvmd_region_unlink(b, r->id);
        hvm_region_free(r);
        FAIL(ret, "cannot size region '%s' to %" G_GUINT64_FORMAT ": %s",
             q->name, size, g_strerror(-ret));
    }
    close(fd);
    hvm_catalog_add(b->cat, r);
    ret = hvmd_save(b, msg, ml);
    if (ret) {
        /* Not committed: the catalogue on disk does not name it. */
        hvm_catalog_remove(b->cat, r);
        hvmd_region_unlink(b, r->id);
        hvm_region_free(r);
        return ret;
    }
    g_message("region '%s' created: %" G_GUINT64_FORMAT " bytes, mode %03o, "
              "uid %u, by pid %d", r->name, size, r->mode, r->uid, c->cred.pid);
    region_reply(data, r);
    return 0;
}

/* Find @q->name and check @want (4 read, 2 write) or ownership (want 0). */
static HvmRegion *checked(Conn *c, HvmRequest *q, unsigned want, int *ret,
                          char *msg, size_t ml)
{
    HvmRegion *r = get_region(c->b, q->name);

    if (!r) {
        snprintf(msg, ml, "no region '%s'", q->name);
        *ret = -ENOENT;
        return NULL;
    }
    if (want == 0 && !is_owner(c, r)) {
        snprintf(msg, ml, "%s of region '%s': uid %u is not its owner (uid %u)",
                 hvm_op_name(q->op), r->name, c->cred.uid, r->uid);
        *ret = -EPERM;
        return NULL;
    }
    if (want && !may(c, r, want)) {
        snprintf(msg, ml, "%s of region '%s': mode %03o gives uid %u gid %u "
                 "no %s permission", hvm_op_name(q->op), r->name, r->mode,
                 c->cred.uid, c->cred.gid, want & 2 ? "write" : "read");
        *ret = -EACCES;
        return NULL;
    }
    *ret = 0;
    return r;
}

static int op_lookup(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                     size_t ml)
{
    int ret;
    HvmRegion *r = checked(c, q, 4, &ret, msg, ml);

    if (r) {
        region_reply(data, r);
    }
    return ret;
}

static int op_destroy(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                      size_t ml)
{
    Broker *b = c->b;
    int ret;
    HvmRegion *r = checked(c, q, 0, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    hvm_catalog_remove(b->cat, r);
    ret = hvmd_save(b, msg, ml);
    if (ret) {
        hvm_catalog_add(b->cat, r);
        return ret;
    }
    r->destroyed = true;
    if (r->attached) {
        g_message("region '%s' destroyed; file kept for %u attached "
                  "connection(s)", r->name, r->attached);
        g_ptr_array_add(b->zombies, r);
    } else {
        hvmd_region_release_file(b, r);
    }
    return 0;
}

/* Set the region's file to @size bytes: 0 or a negative errno with @msg. */
static int set_file_size(Broker *b, HvmRegion *r, uint64_t size, char *msg,
                         size_t ml)
{
    int ret = 0, fd = hvmd_region_open(b, r->id, O_RDWR, msg, ml);

    if (fd < 0) {
        return fd;
    }
    if (ftruncate(fd, size) < 0) {
        ret = -errno;
        snprintf(msg, ml, "cannot resize the file of region '%s' to %"
                 G_GUINT64_FORMAT ": %s", r->name, size, g_strerror(-ret));
    }
    close(fd);
    return ret;
}

static int op_resize(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                     size_t ml)
{
    Broker *b = c->b;
    uint64_t size = hvmd_round_up(q->size, b->align), old;
    int ret;
    HvmRegion *r = checked(c, q, 0, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    old = r->size;
    if (size < old) {
        if (size < hvm_region_items_end(r)) {
            FAIL(-EBUSY, "region '%s' cannot shrink to %" G_GUINT64_FORMAT
                 ": its items reach %" G_GUINT64_FORMAT, r->name, size,
                 hvm_region_items_end(r));
        }
        if (r->attached) {
            FAIL(-EBUSY, "region '%s' cannot shrink while %u connection(s) "
                 "have it mapped", r->name, r->attached);
        }
        /* Shrink: commit first, then cut the file (start-up truncates too). */
        r->size = size;
        ret = hvmd_save(b, msg, ml);
        if (ret) {
            r->size = old;
            return ret;
        }
        if (set_file_size(b, r, size, msg, ml)) {
            g_warning("%s (start-up cuts it)", msg);
        }
    } else if (size > old) {
        ret = admit(b, r->uid, size - old, msg, ml);
        if (ret) {
            return ret;
        }
        /* Grow: extend the file first, then commit. */
        ret = set_file_size(b, r, size, msg, ml);
        if (ret) {
            return ret;
        }
        r->size = size;
        ret = hvmd_save(b, msg, ml);
        if (ret) {
            char msg2[HVM_MAX_MSG];

            r->size = old;
            if (set_file_size(b, r, old, msg2, sizeof(msg2))) {
                g_warning("%s (start-up cuts it)", msg2);
            }
            return ret;
        }
    }
    region_reply(data, r);
    return 0;
}

/* An item record for the reply */
static void item_reply(GByteArray *data, const HvmItem *it)
{
    HvmItemInfo ii = { .offset = it->offset, .size = it->size };

    g_strlcpy(ii.name, it->name, sizeof(ii.name));
    hvm_item_encode(data, &ii);
}

static int op_alloc(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                    size_t ml)
{
    HvmItem *it;
    int ret;
    HvmRegion *r = checked(c, q, 2, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    it = hvm_region_alloc_item(r, q->item, q->size, &ret);
    if (!it) {
        if (ret == -EEXIST) {
            FAIL(ret, "region '%s' has an item '%s'", r->name, q->item);
        }
        FAIL(ret, "region '%s' (%" G_GUINT64_FORMAT " bytes, %u items, %"
             G_GUINT64_FORMAT " used) has no free 2 MiB-aligned extent of %"
             G_GUINT64_FORMAT " bytes", r->name, r->size, r->items->len,
             hvm_region_used(r), q->size);
    }
    ret = hvmd_save(c->b, msg, ml);
    if (ret) {
        hvm_region_free_item(r, q->item);
        return ret;
    }
    item_reply(data, it);
    return 0;
}

static int op_item_lookup(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                          size_t ml)
{
    HvmItem *it;
    int ret;
    HvmRegion *r = checked(c, q, 4, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    it = hvm_region_find_item(r, q->item);
    if (!it) {
        FAIL(-ENOENT, "region '%s' has no item '%s'", r->name, q->item);
    }
    item_reply(data, it);
    return 0;
}

static int op_free(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                   size_t ml)
{
    HvmItem *it, saved;
    int ret;
    HvmRegion *r = checked(c, q, 2, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    it = hvm_region_find_item(r, q->item);
    if (!it) {
        FAIL(-ENOENT, "region '%s' has no item '%s'", r->name, q->item);
    }
    saved = *it;
    saved.name = g_strdup(it->name);
    hvm_region_free_item(r, q->item);
    ret = hvmd_save(c->b, msg, ml);
    if (ret) {
        /* The extent is still free: put the item back where it was. */
        hvm_region_insert_item(r, saved.name, saved.offset, saved.size);
    }
    g_free(saved.name);
    return ret;
}

static int op_chmod(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                    size_t ml)
{
    uint32_t old;
    int ret;
    HvmRegion *r = checked(c, q, 0, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    old = r->mode;
    r->mode = q->mode;
    ret = hvmd_save(c->b, msg, ml);
    if (ret) {
        r->mode = old;
        return ret;
    }
    region_reply(data, r);
    return 0;
}

static int op_stat(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                   size_t ml)
{
    Broker *b = c->b;
    HvmRegion *r;
    int ret;

    if (!q->name[0]) {
        HvmPoolInfo pi = {
            .capacity = b->capacity,
            .quota = quota_of(b, c->cred.uid),
            .nregions = g_hash_table_size(b->cat->regions),
            .nconns = g_hash_table_size(b->conns),
            .max_conns = b->max_conns,
            .align = b->align,
            .item_align = HVM_ITEM_ALIGN,
        };

        usage_of(b, c->cred.uid, &pi.used, &pi.caller_used, NULL);
        hvm_pool_encode(data, &pi);
        return 0;
    }
    r = checked(c, q, 4, &ret, msg, ml);
    if (!r) {
        return ret;
    }
    region_reply(data, r);
    for (guint i = 0; i < r->items->len; i++) {
        item_reply(data, g_ptr_array_index(r->items, i));
    }
    return 0;
}

static int op_list(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                   size_t ml)
{
    GHashTableIter it;
    gpointer v;
    uint32_t n = 0;
    size_t count_at = data->len;

    hvm_put_u32(data, 0);
    hvm_put_u32(data, 0);
    g_hash_table_iter_init(&it, c->b->cat->regions);
    while (g_hash_table_iter_next(&it, NULL, &v)) {
        if (!may(c, v, 4)) {
            continue;
        }
        region_reply(data, v);
        n++;
    }
    data->data[count_at] = n;
    data->data[count_at + 1] = n >> 8;
    data->data[count_at + 2] = n >> 16;
    data->data[count_at + 3] = n >> 24;
    return 0;
}

/*
 * Is the region's file open for writing anywhere?  1 yes, 0 no (or the
 * kernel cannot tell: *@err is then set), negative errno with @msg when the
 * file cannot be opened.  Releasing a lease (or closing the
 * connection that held it) takes back no descriptor: the last holder, or a
 * process it passed the descriptor to (hvmem map's COMMAND), may still
 * write.  The kernel counts every open-for-writing file description of the
 * inode, in any process, and a shared writable mapping keeps its file open:
 * a read lease (F_SETLEASE, F_RDLCK) is refused with EAGAIN exactly while
 * that count is not zero.  So take one on a read-only descriptor and drop it
 * at once.  Meanwhile an open for writing (only root could: the file is 0600
 * in a 0700 directory) waits for the release; the SIGIO that tells the lease
 * holder is ignored (main).  No pid is involved, so pid reuse cannot fool it.
 */
static int open_for_writing(Broker *b, HvmRegion *r, int *err, char *msg,
                            size_t ml)
{
    int ret = 0, fd = hvmd_region_open(b, r->id, O_RDONLY, msg, ml);

    if (fd < 0) {
        return fd;
    }
    if (fcntl(fd, F_SETLEASE, F_RDLCK) < 0) {
        ret = errno == EAGAIN;
        *err = errno == EAGAIN ? 0 : errno;
    } else if (fcntl(fd, F_SETLEASE, F_UNLCK) < 0) {
        g_warning("cannot drop the lease on region '%s': %s", r->name,
                  g_strerror(errno));
    }
    close(fd);
    return ret;
}

/*
 * May @c take @r's read-write lease?  Not while another connection holds it,
 * nor while someone can still write through a descriptor of an earlier one
 * (unless @c itself released it: it is that writer, or passed it on).
 */
static int may_lease(Conn *c, HvmRegion *r, char *msg, size_t ml)
{
    static bool warned;
    char who[96];
    int ret, err = 0;

    if (r->lease == c) {
        return 0;
    }
    if (r->lease) {
        FAIL(-EBUSY, "region '%s' already has a read-write owner (pid %u); "
             "map it read-only or wait until that process lets go",
             r->name, r->lease_pid);
    }
    if (r->last_lease == c) {
        return 0;
    }
    ret = open_for_writing(c->b, r, &err, msg, ml);
    if (ret < 0) {
        return ret;
    }
    if (err && !warned) {
        /* e.g. /proc/sys/fs/leases-enable is 0: grant on the release alone */
        g_warning("cannot tell whether region files are still open for "
                  "writing (F_SETLEASE: %s): read-write leases are granted "
                  "once released, whoever still holds a descriptor",
                  g_strerror(err));
        warned = true;
    }
    if (!ret) {
        return 0;
    }
    if (r->last_lease_pid) {
        snprintf(who, sizeof(who), "by its last read-write owner, pid %u, or "
                 "a process it passed the descriptor to", r->last_lease_pid);
    } else {
        snprintf(who, sizeof(who), "by a process that mapped it before this "
                 "broker started");
    }
    FAIL(-EBUSY, "region '%s' is still open for writing (%s); map it "
         "read-only, or wait until that process lets go", r->name, who);
}

static int op_map(Conn *c, HvmRequest *q, GByteArray *data, int *fd_out,
                  char *msg, size_t ml)
{
    bool rw = q->flags & HVM_MAP_RW;
    int ret, fd;
    HvmRegion *r = checked(c, q, rw ? 6 : 4, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    if (rw) {
        ret = may_lease(c, r, msg, ml);
        if (ret) {
            return ret;
        }
    }
    /* A reader gets O_RDONLY: mmap(PROT_WRITE, MAP_SHARED) on it is EACCES. */
    fd = hvmd_region_open(c->b, r->id, rw ? O_RDWR : O_RDONLY, msg, ml);
    if (fd < 0) {
        return fd;
    }
    if (!g_hash_table_contains(c->attached, r)) {
        g_hash_table_add(c->attached, r);
        r->attached++;
    }
    if (rw && !r->lease) {
        r->lease = c;
        r->lease_pid = c->cred.pid;
        g_message("region '%s': read-write lease to pid %d", r->name,
                  c->cred.pid);
    }
    region_reply(data, r);
    *fd_out = fd;
    return 0;
}

static int op_release(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                      size_t ml)
{
    int ret;
    HvmRegion *r = checked(c, q, 4, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    if (r->lease != c) {
        FAIL(-ENOLCK, "this connection holds no read-write lease on '%s'",
             r->name);
    }
    r->lease = NULL;
    r->last_lease = c;
    r->last_lease_pid = r->lease_pid;
    r->lease_pid = 0;
    return 0;
}

/*
 * The keys an export of the region takes from remote clients: only for the
 * connection that mapped it (read-write: holding the lease), and only of the
 * clients its mode bits admit as they would a local process of their user.
 */
static int op_export_keys(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                          size_t ml)
{
    bool rw = q->flags & HVM_MAP_RW;
    g_autoptr(GString) who = g_string_new(NULL);
    int ret;
    HvmRegion *r = checked(c, q, rw ? 6 : 4, &ret, msg, ml);

    if (!r) {
        return ret;
    }
    if (rw && r->lease != c) {
        FAIL(-ENOLCK, "export-keys of region '%s' for writing: this connection "
             "holds no read-write lease on it (map it read-write first)",
             r->name);
    }
    if (!g_hash_table_contains(c->attached, r)) {
        FAIL(-ENOLCK, "export-keys of region '%s': this connection has not "
             "mapped it (an export serves what its process mapped)", r->name);
    }
    g_string_printf(who, "region '%s': %s export keys to pid %d for ", r->name,
                    rw ? "read-write" : "read-only", c->cred.pid);
    hvmd_remote_keys(c->b, r, rw ? 6 : 4, data, who);
    if (g_strcmp0(who->str, c->exported)) {
        /* an exporter asks again and again: log what changed */
        g_message("%s", who->str);
        g_free(c->exported);
        c->exported = g_strdup(who->str);
    }
    return 0;
}

typedef int HvmdOp(Conn *c, HvmRequest *q, GByteArray *data, char *msg,
                   size_t ml);

/* Every op but HVM_OP_MAP, whose reply also carries a descriptor */
static HvmdOp *const ops[HVM_OP__MAX] = {
    [HVM_OP_CREATE] = op_create,
    [HVM_OP_LOOKUP] = op_lookup,
    [HVM_OP_DESTROY] = op_destroy,
    [HVM_OP_RESIZE] = op_resize,
    [HVM_OP_ALLOC] = op_alloc,
    [HVM_OP_ITEM_LOOKUP] = op_item_lookup,
    [HVM_OP_FREE] = op_free,
    [HVM_OP_CHMOD] = op_chmod,
    [HVM_OP_STAT] = op_stat,
    [HVM_OP_LIST] = op_list,
    [HVM_OP_RELEASE] = op_release,
    [HVM_OP_EXPORT_KEYS] = op_export_keys,
};

int hvmd_dispatch(Conn *c, HvmRequest *q, GByteArray *data, int *fd_out,
                    char *msg, size_t ml)
{
    if (q->op == HVM_OP_MAP) {
        return op_map(c, q, data, fd_out, msg, ml);
    }
    if ((unsigned)q->op < HVM_OP__MAX && ops[q->op]) {
        return ops[q->op](c, q, data, msg, ml);
    }
    FAIL(-EOPNOTSUPP, "unknown op %u", q->op);
}
