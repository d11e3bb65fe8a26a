/*
 * hvmemd's internals shared by its files: hvmemd.c (connections, start-up,
 * main), hvmemd-ops.c (what a request may do and does) and hvmemd-pool.c
 * (the pool and state directories: checks, lock, region files).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#ifndef HVMEMD_H
#define HVMEMD_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <glib.h>

#include "catalog.h"
#include "proto.h"
#include "psk.h"

#define MAX_GROUPS           256
/* Regions only uid 0 may create once the table is this close to full. */
#define HVMD_ROOT_REGIONS    64

/* A remote client ([remote-client NAME] in the config; docs/broker.md). */
typedef struct HvmRemote {
    char *name;                 /* its PSK identity */
    uint32_t uid, gid;          /* whom it acts as on this broker */
    gid_t groups[MAX_GROUPS];   /* and the user's supplementary groups */
    int ngroups;
    uint8_t key[HVM_PSK_KEY_MAX];
    size_t klen;
} HvmRemote;

typedef struct Broker {
    char *pool_dir;
    char *state_dir;
    char *sock_path;
    int pool_fd;                /* the checked pool directory: files are */
    int state_fd;               /* opened relative to these (openat) */
    uint64_t capacity;
    uint64_t quota;             /* per uid, 0 = none; [quota] overrides */
    bool quota_set;             /* --quota given: it applies to uid 0 too */
    GHashTable *quotas;         /* uid -> uint64_t * */
    GPtrArray *remotes;         /* HvmRemote *, from the config */
    unsigned max_conns;
    unsigned max_conns_per_uid; /* uid 0 exempt */
    unsigned reserved_conns;    /* the last slots, for uid 0 only */
    unsigned max_regions_per_uid;   /* uid 0 exempt */
    GHashTable *uid_conns;      /* uid -> connections it has open */
    unsigned request_timeout;   /* seconds a partial request may wait */
    uint32_t align;
    HvmCatalog *cat;
    GPtrArray *zombies;         /* destroyed regions still attached */
    GHashTable *conns;          /* Conn * set */
    int listen_fd;
    int reserve_fd;             /* closed to accept() when out of fds */
    GMainLoop *loop;
} Broker;

typedef struct Conn {
    Broker *b;
    int fd;
    guint watch;                /* readable; 0 once closing */
    guint out_watch;            /* writable, while replies are queued */
    struct ucred cred;
    gid_t groups[MAX_GROUPS];
    int ngroups;
    uint8_t buf[HVM_HDR_SIZE + HVM_MAX_REQ_BODY];
    size_t have;
    gint64 partial_since;       /* monotonic us when c->buf became non-empty */
    GQueue out;                 /* OutMsg *: replies not yet written */
    size_t out_bytes;           /* their unwritten bytes */
    unsigned out_fds;           /* descriptors among them */
    gint64 out_since;           /* monotonic us of the queue's last progress */
    bool closing;               /* a last reply is queued: close when written */
    GHashTable *attached;       /* HvmRegion * this connection mapped */
    char *exported;             /* its last export-keys answer, as logged */
} Conn;

/*
 * hvmemd-pool.c.  Open directory @path (creating what is missing when
 * @create), checking it and every directory and symbolic link on the way
 * (docs/broker.md, "Directories"): a descriptor, or -1 with @errp set.
 */
int hvmd_open_dir(const char *path, bool create, GError **errp);
/* Take the instance lock of the directory @dfd (named @path) or say who has it. */
bool hvmd_lock_dir(int dfd, const char *path, GError **errp);
/* The region's file in the pool, for messages (g_free() it). */
char *hvmd_region_path(Broker *b, uint64_t id);
/*
 * Open the region's file relative to the pool descriptor, never through a
 * symbolic link; without O_CREAT it must be a regular file of the broker's.
 * A descriptor, or a negative errno with @msg.
 */
int hvmd_region_open(Broker *b, uint64_t id, int flags, char *msg, size_t ml);
int hvmd_region_unlink(Broker *b, uint64_t id);
/* Start-up: catalogue and pool files agree (false: refuse to start). */
bool hvmd_reconcile(Broker *b, bool *dirty, GError **errp);

static inline uint64_t hvmd_round_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

/* POSIX rules on @r's mode bits for these ids (4 read, 2 write); uid 0 passes. */
bool hvmd_may(uint32_t uid, uint32_t gid, const gid_t *groups, int ngroups,
              HvmRegion *r, unsigned want);

/* hvmemd.c: a user name or uid (and its primary group), a group name or gid. */
bool hvmd_parse_uid(const char *s, uint32_t *uid, uint32_t *gid);
bool hvmd_parse_gid(const char *s, uint32_t *gid);

/*
 * hvmemd-remote.c.  Parse [remote-client NAME] of config @file into
 * @b->remotes (false with @errp set: refuse to start).
 */
bool hvmd_remote_parse(Broker *b, GKeyFile *kf, const char *file,
                       const char *group, GError **errp);
/*
 * The reply data of export-keys: u32 count, then per remote client that
 * @want (4, or 6 for read-write) on @r admits: u16 length, "NAME:KEY" with
 * the key derived for @r's name.  Their names are appended to @who (the log).
 */
void hvmd_remote_keys(Broker *b, HvmRegion *r, unsigned want,
                      GByteArray *data, GString *who);
void hvmd_remote_free(gpointer p);

/* Save the catalogue: 0, or a negative errno with @msg (and a warning). */
int hvmd_save(Broker *b, char *msg, size_t ml);

/* Free a region that is out of the catalogue and no longer attached. */
void hvmd_region_release_file(Broker *b, HvmRegion *r);

/*
 * Carry out request @q of connection @c: 0 or a negative errno with @msg;
 * reply records go to @data, a descriptor to pass back to *@fd_out.
 */
int hvmd_dispatch(Conn *c, HvmRequest *q, GByteArray *data, int *fd_out,
                  char *msg, size_t ml);

#endif
