/* hybridmem.c -- the "appassist" Redis module: hot/cold segregation of
 * string items with a cold arena of its own, transparent to clients, and the
 * guest half of app-assisted migration (APPASSIST.PREPARE/RESUME/ABORT/STATUS
 * over normal clients and over a virtio-serial port).
 *
 * Map of this file, top to bottom:
 *   configuration and global state
 *   helpers (memory figures, field lists rendered as RESP maps)
 *   promotion (arena -> keyspace) and demotion (keyspace -> arena)
 *   the command filter that makes cold items transparent
 *   compaction of the hot keyspace (jemalloc), after demotions left holes
 *   the background slice (demotion pass, rehash, expiry sweep, unspill)
 *   PREPARE / RESUME / ABORT / STATUS, shared by clients and the port
 *   rewritten whole-keyspace commands (KEYS, SCAN, DBSIZE)
 *   the host port (virtio-serial, or a pty/unix socket in tests)
 *   RDB aux persistence, server events, INFO, OnLoad
 *
 * Invariants:
 *   - Only database 0 is managed. A string key lives either in the keyspace
 *     (hot) or in the arena (cold), never in both; if both ever hold it, the
 *     keyspace wins (the cold copy is deleted when met).
 *   - Demotion, promotion and compaction (relocation of a hot key) are
 *     representation changes: they propagate nothing to replicas/AOF, fire
 *     no keyspace notification and do not touch WATCHed keys
 *     (REDISMODULE_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED).
 *   - Every access to a cold key through a command brings it into the
 *     keyspace before the command runs, so the command's reply is the stock
 *     reply by construction. A read is a visit (the item goes back to the
 *     arena once the command has run) unless the item was read recently;
 *     any other access promotes it.
 *   - All background work runs in time-bounded slices (appassist.slice-us).
 */

#include "redismodule.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "arena.h"
#include "glob.h"
#include "resp.h"
#include "zerofree.h"

#define HM_VERSION              1
#define HM_AUX_ENCVER           1
#define HM_ITEM_OVERHEAD        48      /* dictEntry+robj+sds headers, estimate */
#define HM_PASS_PAUSE_MS        1000    /* between two passes that demoted */
#define HM_IDLE_PASS_PAUSE_MS   5000    /* after a pass with nothing to demote */
#define HM_IDLE_PASS_PAUSE_MAX_MS 60000 /* ...doubling up to this (see demoteSlice) */
#define HM_PASS_DUTY            25      /* pause >= 25x the pass's CPU: <= 4 % */
#define HM_FITS_RECHECK_MS      60000   /* see fits_below */
#define HM_IDLE_INTERVAL_MS     100     /* slice period with nothing in progress */
#define HM_MULTI_GRACE_US       (5 * 1000000ULL)
#define HM_SCAN_PHASE_BIT       (1ULL << 63)
#define HM_SCAN_GRACE_US        (60 * 1000000ULL) /* see scanLogNote */
#define HM_SCAN_LOG_MAX         65536   /* promotions logged for SCANs */
#define HM_PORT_INBUF           (2 * RESP_MAX_REQ)
#define HM_PORT_OUTBUF          (64 * 1024)
#define HM_BUCKETS              256     /* see idleBucket */
#define HM_SHARE_BINS           16      /* per bucket, by keyShare (see passEnd) */
#define HM_SHARE_BIN_SHIFT      12      /* 65536 / HM_SHARE_BINS */
#define HM_LRU_LAG_MS           200     /* see lruAgeMs */
#define HM_SWEEP_ITEMS          1024    /* arena items checked per slice */
#define HM_REHASH_STEP          512     /* arena slots moved per rehash step */
#define HM_BITE_MIN_US          20      /* shortest bite (see bgBite) */
#define HM_BITE_SHARE_DIV       2       /* bites: half the timer's share (see bgBite) */
#define HM_SWEEP_PAUSE_MS       1000    /* between two full expiry sweeps */
#define HM_READ_BACK_MAX        4096    /* visited keys awaiting their way back (readBackSettle) */
#define HM_SEEN_BITS            (1u << 20) /* per generation of the read filter (128 KiB) */
#define HM_RECLAIM_ITEMS        256     /* arena items looked at per reclaim step */
#define HM_RECLAIM_MIN_BYTES    (4ULL << 20) /* holes worth a reclaim at least */

#define DEFAULT_PORT_PATH       "/dev/virtio-ports/org.qemu.app-assist.0"
#define DEFAULT_SPILL_PATH      "appassist.spill"

typedef enum { POLICY_DROP = 0, POLICY_SPILL = 1, POLICY_NONE = 2 } Policy;
static const char *policy_names[] = {"drop", "spill", "none"};
static const int policy_values[] = {POLICY_DROP, POLICY_SPILL, POLICY_NONE};

/* appassist.lazy-drop and appassist.zero-freed */
enum { TRI_AUTO, TRI_YES, TRI_NO };
static const char *tri_names[] = {"auto", "yes", "no"};
static const int tri_values[] = {TRI_AUTO, TRI_YES, TRI_NO};

typedef enum {
    ST_NORMAL = 0,      /* demotion running */
    ST_PREPARED,        /* migration in progress: demotion paused */
    ST_RESUMING,        /* reading spilled chunks back, in slices */
} State;
static const char *state_names[] = {"normal", "prepared", "resuming"};

/* ------------------------------------------------------------ state */

typedef struct KeyList {
    RedisModuleString **v;
    size_t n, cap;
} KeyList;

static struct {
    /* configuration */
    long long planned_memory;   /* bytes, 0: maxmemory or physical RAM */
    long long hot_percent;
    long long min_idle_ms;
    long long slice_us;
    long long interval_ms;
    long long port_retry_ms;
    long long compact_percent;
    int policy;
    int demote;                 /* appassist.demote yes|no */
    int lazy_drop;              /* appassist.lazy-drop auto|yes|no */
    int zero_freed;             /* appassist.zero-freed auto|yes|no */
    RedisModuleString *port_path;
    RedisModuleString *spill_path;

    RedisModuleCtx *dctx;       /* detached context: keyspace ops outside commands */
    ColdArena *arena;
    State state;
    RedisModuleTimerID timer;
    int loaded;                 /* OnLoad finished */

    /* demotion pass */
    RedisModuleScanCursor *cursor;
    uint64_t pass_bytes[HM_BUCKETS][HM_SHARE_BINS];
    uint64_t pass_items;
    uint64_t pass_demoted;      /* items the current pass demoted */
    uint64_t idle_pause_ms;     /* pause after the last pass that demoted nothing */
    uint64_t pass_hot_bytes, pass_hot_items;
    long long hot_est;          /* hot bytes: the last pass's, + promoted - demoted since */
    long long admit_budget;     /* the hot budget at the last pass (see hotFull) */
    long long promotions_refused;
    int threshold;              /* demote items in buckets >= threshold */
    uint32_t keep_at_threshold; /* ...but keep this share (of 65536) of bucket threshold */
    long long pass_start_ms;    /* when the current pass began (see coldBucket) */
    long long threshold_at_ms;  /* when the pass that set the threshold began */
    long long pass_age_ms, threshold_age_ms; /* their ages at this slice, in whole seconds */
    uint64_t next_pass_us;
    uint64_t passes;
    uint64_t skipped_passes;    /* everything fitted the budget */
    uint64_t pass_cpu_us;       /* thread CPU of the running pass */
    /* After a pass that found the hot set within 'fits_budget' with room
     * to spare, no pass is needed until used_memory reaches fits_below
     * (used_memory then plus that room) or the budget changes; checked
     * again every HM_FITS_RECHECK_MS all the same. 0: no such pass. */
    long long fits_below, fits_budget;
    uint64_t fits_until_us;
    RedisModuleString **pending; /* keys picked for demotion by the scan callback */
    size_t npending, cap_pending;

    /* compaction pass (see compactSlice) */
    int (*mallctl)(const char *, void *, size_t *, void *, size_t); /* NULL: off */
    RedisModuleScanCursor *ccursor;
    int compact_wanted;         /* a pass is due or running */
    uint64_t compact_pending;   /* bytes demoted since the last pass */
    int reclaiming;             /* arena holes being reclaimed (reclaimWanted) */
    long long reclaims, reclaim_moved;
    uint64_t reclaim_after_us;  /* after a failed step (ENOMEM): not before */
    uint64_t compact_t0;
    long long compact_rss0;
    long long compact_busy_us, compact_slice_max_us;
    long long compact_relocated;
    long long last_frag_bytes;  /* allocator_frag_bytes at the last check */

    int replica;                /* this server replicates a master */

    /* MULTI bookkeeping (see hmFilter) */
    long multi_open;
    uint64_t multi_seen_us;

    /* expiry sweep of the arena */
    uint64_t sweep_cursor;
    uint64_t next_sweep_us;

    /* who runs the background work (see sliceTimer, bgBite) */
    int bites_on;               /* subscribed to the event loop's BEFORE_SLEEP */
    uint64_t served;            /* commands seen by the filter */
    uint64_t served_at_tick, served_at_bite;
    uint64_t last_bite_us;
    long long slices, bites;
    uint64_t step_max_us;       /* longest slice or bite (wall) */
    uint64_t step_max_cpu_us;   /* ...in thread CPU time, after readBackSettle */
    uint64_t bg_cpu_us;         /* CPU time of all slices and bites */

    /* reads of cold items (see readBack) */
    long long promote_window_ms; /* promote on the 2nd read within this; 0: on the 1st */
    KeyList back;               /* keys visited in this round of the event loop */
    uint64_t *seen[2];          /* reads of cold keys, this and the previous window */
    uint64_t seen_since_us;     /* start of the current window */
    uint64_t paused_until_us;   /* clients may be paused (see notePause) */

    /* keys promoted while SCANs run (see scanLogNote) */
    struct ScanLogEntry *scan_log;
    size_t scan_log_n, scan_log_cap;
    int scan_log_sorted;        /* by pos, since the last append */
    uint64_t scan_seen_us;      /* last SCAN call on db 0; 0: none within the grace */
    long long scan_log_dropped;

    /* statistics */
    long long demotions, promotions, expired_promotions, demote_errors;
    long long visits;           /* accesses served by a visit (the item went back cold) */
    long long prepares, resumes, aborts;
    long long last_freed, last_items, last_time_us, last_rss_before, last_rss_after;
    int last_policy, last_complete, last_lazy;
    long long last_zeroed;
    /* Clearing of freed memory (zerofree.h) has been on since the window
     * of processPeakRss() began: everything given back since is zero. */
    int zero_window;
    long long dropped_items;
    long long compactions, relocations, compact_skipped;
    long long last_compact_relocated, last_compact_time_us, last_compact_busy_us;
    long long last_compact_slice_max_us;
    long long last_compact_rss_before, last_compact_rss_after;

    /* host port */
    int port_fd;
    int port_is_sock;
    int port_discarding;
    RedisModuleTimerID port_timer;
    int port_timer_set;
    char port_in[HM_PORT_INBUF];
    size_t port_inlen;
    RespBuf port_out;
    long long port_requests, port_errors, port_opens;
} hm;

/* ------------------------------------------------------------ helpers */

/* CPU time of this thread: a slice's length without the time the kernel
 * gave other processes (the build machines are shared). */
static uint64_t threadCpuUs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

static uint64_t nowUs(void) { return arenaNowUs(); }

static long long nowMs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static long long processRss(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long long size = 0, rss = 0;
    if (!f) return -1;
    if (fscanf(f, "%lld %lld", &size, &rss) != 2) rss = -1;
    fclose(f);
    return rss < 0 ? -1 : rss * sysconf(_SC_PAGESIZE);
}

/* Peak RSS (VmHWM) of this process, -1 if unknown. */
static long long processPeakRss(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[128];
    long long kb = -1;
    if (!f) return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %lld kB", &kb) == 1) break;
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

/* Start a new peak: VmHWM becomes the current RSS (Linux >= 4.0). */
static void processPeakReset(void) {
    int fd = open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (write(fd, "5", 1) != 1) {
        /* best effort: the next PREPARE then counts from the older peak */
    }
    close(fd);
}

static unsigned long long infoMemoryField(RedisModuleCtx *ctx, const char *field) {
    RedisModuleServerInfoData *info = RedisModule_GetServerInfo(ctx, "memory");
    int err = 0;
    unsigned long long v = 0;
    if (info) {
        v = RedisModule_ServerInfoGetFieldUnsigned(info, field, &err);
        RedisModule_FreeServerInfo(ctx, info);
    }
    return err ? 0 : v;
}

static long long plannedMemory(RedisModuleCtx *ctx) {
    if (hm.planned_memory > 0) return hm.planned_memory;
    unsigned long long mm = infoMemoryField(ctx, "maxmemory");
    if (mm) return (long long)mm;
    return (long long)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
}

static long long hotBudget(RedisModuleCtx *ctx) {
    return plannedMemory(ctx) / 100 * hm.hot_percent;
}

/* A reply built once and rendered either as a module reply (a map; RESP2
 * clients get a flat array) or as RESP bytes for the host port. */
typedef struct Field {
    const char *name;
    const char *s;      /* NULL: integer */
    long long i;
} Field;

typedef struct Fields {
    int n;
    const char *err;    /* non-NULL: the reply is this error */
    Field f[32];
} Fields;

static void addInt(Fields *fs, const char *name, long long v) {
    if (fs->n < 32) fs->f[fs->n++] = (Field){name, NULL, v};
}

static void addStr(Fields *fs, const char *name, const char *s) {
    if (fs->n < 32) fs->f[fs->n++] = (Field){name, s, 0};
}

static int replyFields(RedisModuleCtx *ctx, const Fields *fs) {
    if (fs->err) return RedisModule_ReplyWithError(ctx, fs->err);
    RedisModule_ReplyWithMap(ctx, fs->n);
    for (int i = 0; i < fs->n; i++) {
        RedisModule_ReplyWithSimpleString(ctx, fs->f[i].name);
        if (fs->f[i].s)
            RedisModule_ReplyWithSimpleString(ctx, fs->f[i].s);
        else
            RedisModule_ReplyWithLongLong(ctx, fs->f[i].i);
    }
    return REDISMODULE_OK;
}

/* The port speaks RESP2 (the host side uses hiredis 0.14, which has no
 * maps): a map is a flat array name, value, name, value... */
static int portRenderFields(RespBuf *b, const Fields *fs) {
    if (fs->err) return respAddError(b, fs->err);
    if (respAddMapLen(b, fs->n, 0) < 0) return -1;
    for (int i = 0; i < fs->n; i++) {
        if (respAddBulk(b, fs->f[i].name, strlen(fs->f[i].name)) < 0) return -1;
        if (fs->f[i].s) {
            if (respAddBulk(b, fs->f[i].s, strlen(fs->f[i].s)) < 0) return -1;
        } else if (respAddInt(b, fs->f[i].i) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ promotion */

/* Move 'key' from the arena back into db 0 of the keyspace. The expire goes
 * with it even when it is already in the past: Redis then expires the key on
 * the access that follows, with the stock "expired" notification and the
 * DEL propagated to replicas and AOF, exactly as if it had stayed hot.
 * Returns 1 if promoted, 0 if the key is not cold, -1 on error (the item
 * stays in the arena; logged).
 *
 * The filter calls this for every key of every command, and most keys are
 * hot: the keyspace is asked first. Its lookup is the one the command
 * makes next, so it costs a cache miss the command then does not pay,
 * while a miss on the arena's index came on top (perf, 90/10 mix: 10-13 %
 * of the server's CPU). A write-mode lookup counts no keyspace_hits/misses
 * and fires no "keymiss" event; like the command's own lookup it expires a
 * key whose TTL has passed. A replica only expires keys when its master
 * says so, so there the arena is asked first, as the keyspace wins
 * anyway. */
static RedisModuleKey *openIfAbsent(RedisModuleString *key) {
    RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, key, REDISMODULE_WRITE |
                                                           REDISMODULE_OPEN_KEY_NOTOUCH);
    if (RedisModule_KeyType(kh) == REDISMODULE_KEYTYPE_EMPTY) return kh;
    RedisModule_CloseKey(kh);
    return NULL;
}

static int readBackWanted(const char *k, size_t klen);
static void visitMark(RedisModuleKey *kh);
static void readBackSettle(void);
static void scanLogNote(const char *k, size_t klen, uint64_t pos);
static int scanRecent(void);

static void keyListPush(KeyList *l, RedisModuleString *s) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 64;
        l->v = RedisModule_Realloc(l->v, l->cap * sizeof(*l->v));
    }
    l->v[l->n++] = s;
}

/* Bring the cold item 'key' into the keyspace before a command runs on it.
 * 'visit': the command touches the key's access clock; then, unless the
 * item was accessed before within appassist.promote-window-ms, it is a
 * visit, not a promotion: the item goes back to the arena once the command
 * has run (readBackSettle). Returns 1 if the item was brought in, 0 if it
 * was not cold, -1 on error. */
static int promoteKey(RedisModuleString *key, int visit) {
    size_t klen;
    const char *k = RedisModule_StringPtrLen(key, &klen);
    RedisModuleCtx *ctx = hm.dctx;
    RedisModuleKey *kh = NULL;
    ColdRef ref;
    if (!hm.replica && !(kh = openIfAbsent(key))) return 0;
    int r = arenaLookup(hm.arena, k, klen, &ref);
    if (r <= 0) {
        if (r < 0)
            RedisModule_Log(hm.dctx, "warning", "appassist: lookup of a cold key failed: %s",
                            strerror(errno));
        if (kh) RedisModule_CloseKey(kh);
        return r;
    }
    if (r == 2 || (!kh && !(kh = openIfAbsent(key)))) {
        /* Keyspace wins (see the invariants at the top). A lent item
         * whose copy left the keyspace was deleted (or renamed, expired,
         * evicted) by a command of this round. */
        if (kh) RedisModule_CloseKey(kh);
        arenaDelete(hm.arena, k, klen);
        return 0;
    }
    ColdItem it;
    if (arenaRead(hm.arena, ref, &it) < 0) {
        RedisModule_CloseKey(kh);
        RedisModule_Log(ctx, "warning", "appassist: reading a cold item failed: %s",
                        strerror(errno));
        return -1;
    }
    RedisModuleString *val = RedisModule_CreateString(ctx, it.val, it.vlen);
    int64_t expire = it.expire;
    long long bytes = (long long)(klen + it.vlen + HM_ITEM_OVERHEAD);
    arenaItemRelease(&it);
    RedisModule_StringSet(kh, val);
    int expired = 0;
    if (expire != ARENA_NO_EXPIRE) {
        RedisModule_SetAbsExpire(kh, expire);
        expired = expire <= nowMs();
    }
    RedisModule_FreeString(ctx, val);
    if (visit && !expired && readBackWanted(k, klen)) {
        /* The arena keeps the item, lent: if the command leaves it as it
         * was, going back costs only the keyspace delete. */
        arenaBorrow(hm.arena, k, klen);
        visitMark(kh);
        keyListPush(&hm.back, RedisModule_CreateStringFromString(NULL, key));
        hm.visits++;
    } else {
        if (!expired) scanLogNote(k, klen, arenaCursorOf(hm.arena, ref));
        arenaDelete(hm.arena, k, klen);
        if (expired) hm.expired_promotions++;
        hm.promotions++;
        hm.hot_est += bytes;
    }
    RedisModule_CloseKey(kh);
    return 1;
}

/* Promote every cold item (SWAPDB touching db 0, pure-AOF rewrites). This is
 * O(cold items) and blocks; it only runs for rare administrative commands. */

static void collectCb(void *priv, const ColdItem *it) {
    keyListPush(priv, RedisModule_CreateString(hm.dctx, it->key, it->klen));
}

static void promoteAll(void) {
    readBackSettle();
    KeyList l = {0};
    uint64_t cur = 0;
    do {
        cur = arenaIterate(hm.arena, cur, 4096, collectCb, &l);
    } while (cur && cur != UINT64_MAX);
    for (size_t i = 0; i < l.n; i++) {
        promoteKey(l.v[i], 0);
        RedisModule_FreeString(hm.dctx, l.v[i]);
    }
    RedisModule_Free(l.v);
}

/* ------------------------------------------------------------ demotion */

/* Open 'key' for a representation change (demotion, relocation): a write
 * handle that does not touch LRU/LFU, with *expire filled. NULL (nothing
 * open) if the key is not a string or is logically expired: Redis's own
 * expiry deals with those. */
static RedisModuleKey *openLiveString(RedisModuleString *key, mstime_t *expire) {
    RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, key, REDISMODULE_READ | REDISMODULE_WRITE |
                                                           REDISMODULE_OPEN_KEY_NOTOUCH);
    if (RedisModule_KeyType(kh) != REDISMODULE_KEYTYPE_STRING) {
        RedisModule_CloseKey(kh);
        return NULL;
    }
    *expire = RedisModule_GetAbsExpire(kh);
    if (*expire != REDISMODULE_NO_EXPIRE && *expire <= nowMs()) {
        RedisModule_CloseKey(kh);
        return NULL;
    }
    return kh;
}

/* Move string key 'key', open as 'kh' (openLiveString), from db 0 into the
 * arena and close 'kh'. Returns the bytes moved (key, value and the
 * estimated overhead), 0 if it was not moved. */
static uint64_t moveToArena(RedisModuleString *key, RedisModuleKey *kh, mstime_t expire) {
    size_t klen, vlen;
    const char *k = RedisModule_StringPtrLen(key, &klen);
    const char *v = RedisModule_StringDMA(kh, &vlen, REDISMODULE_READ);
    ColdRef ref;
    if (v == NULL || arenaLookup(hm.arena, k, klen, &ref) != 0 ||
        arenaInsert(hm.arena, k, klen, v, vlen,
                    expire == REDISMODULE_NO_EXPIRE ? ARENA_NO_EXPIRE : expire) < 0) {
        hm.demote_errors++;
        RedisModule_CloseKey(kh);
        return 0;
    }
    RedisModule_DeleteKey(kh);
    RedisModule_CloseKey(kh);
    return klen + vlen + HM_ITEM_OVERHEAD;
}

/* Demote 'key' (a pass picked it). Returns 1 if demoted. */
static int demoteKey(RedisModuleString *key) {
    mstime_t expire;
    RedisModuleKey *kh = openLiveString(key, &expire);
    uint64_t bytes = kh ? moveToArena(key, kh, expire) : 0;
    if (!bytes) return 0;
    hm.demotions++;
    hm.pass_demoted++;
    hm.hot_est = hm.hot_est > (long long)bytes ? hm.hot_est - (long long)bytes : 0;
    hm.compact_pending += bytes;
    return 1;
}

/* ------------------------------------------------------------ visits */

/* An access to a cold item is a visit: the item comes into the keyspace so
 * that the stock command runs on it, and goes back to the arena, with what
 * the command left in it, before the event loop sleeps (readBackSettle).
 * Only a second access within appassist.promote-window-ms promotes it.
 * Why: under accesses spread over the cold set (the 10 % of a 90/10 mix),
 * promoting at the first access made each one a promotion and, a pass
 * later, a demotion plus its share of a compaction pass, and the cold set
 * eroded while clients ran. Meanwhile the arena lends the item
 * (arenaBorrow): if the command left the copy as it was, the way back is
 * a keyspace delete; the allocations of the visit are freed at once, so
 * they leave no holes for compaction. The filter cannot serve a read from the
 * arena itself: that would mean rewriting GET into a module command, which
 * changes ACL checks, keyspace hit counts, commandstats and MONITOR.
 *
 * The filter runs before the command, which may then wait (queued in a
 * MULTI, postponed by CLIENT PAUSE): the item may only go back once the
 * command has run. So the visit marks the key's access clock as long ago
 * (LRU idle HM_VISIT_IDLE_MS, or LFU counter 0), the command's lookup
 * touches it (commands that look up with NOTOUCH promote instead), and a
 * key still marked when the round ends stays hot with a fresh clock, as a
 * promotion. Another client's access to the same key in that round would
 * touch the clock too: so there are no visits while a MULTI is open (as
 * for demotion) or clients may be paused (notePause).
 *
 * Accesses are remembered in two generations of a bit set indexed by a
 * hash of the key (a false positive only promotes early), each generation
 * one window long: "seen" = set in either. */

#define HM_VISIT_IDLE_MS        (1LL << 32)     /* ~50 days */
#define HM_LFU_INIT             5               /* Redis's LFU_INIT_VAL */

/* FNV-1a of a key, folded: the seen set's bit and keyShare(). */
static uint32_t keyFnv(const char *key, size_t l) {
    const unsigned char *p = (const unsigned char *)key;
    uint32_t h = 2166136261u;
    while (l--) h = (h ^ *p++) * 16777619u;
    return h ^ (h >> 16);
}

static int demotionAllowed(void);

/* 1 if the hot set is over its budget by more than an eighth: a second
 * access then visits too, and the item stays cold. An item read twice in
 * a window is not hotter than the hot set: under accesses spread over the
 * cold items, promoting it pushed the hot set over its budget, and every
 * promotion cost a demotion a pass later (the uniform benchmark promoted
 * the whole cold set, 210000 items, in one run). The eighth leaves room
 * for turnover: while the hot set is over its budget the passes demote
 * what went idle, and new hot items take its place. */
static int hotFull(void) {
    return hm.admit_budget > 0 && hm.hot_est > hm.admit_budget + hm.admit_budget / 8;
}

static int visitsAllowed(void) {
    return demotionAllowed() && (hm.paused_until_us == 0 || nowUs() >= hm.paused_until_us);
}

/* 1 if the cold item accessed now is a visit (see above). */
static int readBackWanted(const char *k, size_t klen) {
    if (hm.promote_window_ms == 0 || !hm.bites_on || hm.replica ||
        hm.back.n >= HM_READ_BACK_MAX || !visitsAllowed())
        return 0;
    uint64_t now = nowUs(), window = (uint64_t)hm.promote_window_ms * 1000;
    if (!hm.seen[0]) {
        hm.seen[0] = RedisModule_Calloc(HM_SEEN_BITS / 64, sizeof(uint64_t));
        hm.seen[1] = RedisModule_Calloc(HM_SEEN_BITS / 64, sizeof(uint64_t));
        hm.seen_since_us = now;
    }
    if (now - hm.seen_since_us >= window) {
        uint64_t *old = hm.seen[1];
        hm.seen[1] = hm.seen[0];
        hm.seen[0] = old;
        memset(old, 0, HM_SEEN_BITS / 8);
        if (now - hm.seen_since_us >= 2 * window) memset(hm.seen[1], 0, HM_SEEN_BITS / 8);
        hm.seen_since_us = now;
    }
    uint32_t bit = keyFnv(k, klen) & (HM_SEEN_BITS - 1);
    uint64_t mask = 1ULL << (bit & 63);
    size_t w = bit >> 6;
    int seen = ((hm.seen[0][w] | hm.seen[1][w]) & mask) != 0;
    hm.seen[0][w] |= mask;
    if (seen && hotFull()) {
        hm.promotions_refused++;
        return 1;
    }
    return !seen;
}

/* Mark a visited key's access clock (see above). */
static void visitMark(RedisModuleKey *kh) {
    if (RedisModule_SetLFU(kh, 0) != REDISMODULE_OK) RedisModule_SetLRU(kh, HM_VISIT_IDLE_MS);
}

/* Give a visited key the clock of a fresh key: it stays hot. */
static void visitReset(RedisModuleKey *kh) {
    if (RedisModule_SetLFU(kh, HM_LFU_INIT) != REDISMODULE_OK) RedisModule_SetLRU(kh, 0);
}

/* 1 if a command read the key since visitMark; otherwise visitReset. */
static int visitDone(RedisModuleKey *kh) {
    long long freq;
    mstime_t idle;
    if (RedisModule_GetLFU(kh, &freq) == REDISMODULE_OK && freq >= 0) {
        if (freq > 0) return 1;
    } else if (RedisModule_GetLRU(kh, &idle) == REDISMODULE_OK && idle >= 0 &&
               idle < HM_VISIT_IDLE_MS / 2) {
        return 1;
    }
    visitReset(kh);
    return 0;
}

/* 1 if the keyspace copy open as 'kh' still holds what the lent item at
 * 'ref' holds: the same value and expire. */
static int visitUnchanged(RedisModuleKey *kh, ColdRef ref, mstime_t expire) {
    size_t vlen;
    const char *v = RedisModule_StringDMA(kh, &vlen, REDISMODULE_READ);
    ColdItem it;
    if (!v || arenaRead(hm.arena, ref, &it) < 0) return 0;
    int same = it.vlen == vlen && memcmp(it.val, v, vlen) == 0 &&
               it.expire == (expire == REDISMODULE_NO_EXPIRE ? ARENA_NO_EXPIRE : expire);
    arenaItemRelease(&it);
    return same;
}

/* After the commands of this round of the event loop, the visited items go
 * back: unchanged, by deleting the keyspace copy and taking the lent item
 * back; changed, with the value and expire the commands left. A key the
 * round deleted, expired or turned into another type stays as it is (the
 * lent item goes). A key whose command has not run yet, or any key when
 * visits are not allowed now (a migration or a pause began), stays hot: a
 * promotion. Runs before anything walks the keyspace or the arena as a
 * whole (bites, the timer, PREPARE, DEMOTE, COMPACT, SWAPDB). */
static void readBackSettle(void) {
    int allowed = visitsAllowed();
    for (size_t i = 0; i < hm.back.n; i++) {
        RedisModuleString *key = hm.back.v[i];
        size_t klen;
        const char *k = RedisModule_StringPtrLen(key, &klen);
        mstime_t expire;
        ColdRef ref;
        RedisModuleKey *kh = openLiveString(key, &expire);
        int lent = arenaLookup(hm.arena, k, klen, &ref) == 2;
        if (!kh) {
            if (lent) arenaDelete(hm.arena, k, klen);
        } else if (lent && allowed && visitDone(kh)) {
            if (visitUnchanged(kh, ref, expire)) {
                RedisModule_DeleteKey(kh);
                RedisModule_CloseKey(kh);
                arenaReturn(hm.arena, k, klen);
            } else {
                /* The new version goes to the arena's end, ahead of
                 * every SCAN cursor; if it cannot, it stays hot. */
                uint64_t pos = arenaCursorOf(hm.arena, ref);
                arenaDelete(hm.arena, k, klen);
                if (!moveToArena(key, kh, expire)) scanLogNote(k, klen, pos);
            }
        } else {
            /* PREPARE dropped the arena, or the command is still to run. */
            visitReset(kh);
            if (lent) {
                scanLogNote(k, klen, arenaCursorOf(hm.arena, ref));
                arenaDelete(hm.arena, k, klen);
            }
            RedisModule_CloseKey(kh);
            hm.visits--;
            hm.promotions++;
        }
        RedisModule_FreeString(NULL, key);
    }
    hm.back.n = 0;
}

static void compactCheck(RedisModuleCtx *ctx);

/* The bucket of an LRU idle time in ms: 0 for none, else four per octave
 * (the two bits below the top one pick the quarter). Whole octaves were
 * too coarse: a hot range read 25 s ago and cold keys kept at the edge of
 * the budget, read 28 s ago, shared a bucket, and the pass that split it
 * by hash demoted part of the hot range (measured in the benchmark: 5115
 * promotions in runs on the hot range alone). */
static int idleBucket(mstime_t idle) {
    if (idle <= 0) return 0;
    int top = 63 - __builtin_clzll((unsigned long long)idle);
    int quarter = top >= 2 ? (int)((idle >> (top - 2)) & 3) : 0;
    int b = 1 + 4 * top + quarter;
    return b < HM_BUCKETS - 1 ? b : HM_BUCKETS - 1;
}

/* Redis's LRU clock, in ms, between 'then_ms' and 'now_ms' (wall clock),
 * never less than it really moved. The clock (server.lruclock) counts
 * whole seconds and serverCron updates it every 100 ms at hz 10, so early
 * in a second it may still show the last one; it stands still while a
 * command blocks (APPASSIST.DEMOTE passes the time it began). Erring
 * towards more makes keys look touched up to a second earlier than they
 * were, and keeps them hot for a pass; erring towards less could make the
 * whole hot set, used just before 'then_ms', look idle. */
static long long lruAgeMs(long long then_ms, long long now_ms) {
    return (now_ms / 1000 - (then_ms - HM_LRU_LAG_MS) / 1000) * 1000;
}

/* Coldness bucket of a key for the pass's histogram: idleBucket() of the
 * LRU idle time in ms, or, with an LFU maxmemory-policy, 255 minus Redis's
 * (decayed) logarithmic LFU counter; *decide is the bucket to hold against the
 * threshold. Idle times keep growing while nobody touches a key, so both
 * are taken back to a fixed moment: the histogram's to the start of the
 * pass (a pass spread over seconds of bites would otherwise rank the keys
 * it met before a load stopped as hotter than those it met after), the
 * decision's to the start of the pass that set the threshold. Without
 * that, a threshold set under load (everything touched in the last
 * second, over budget: bucket 1 and up goes) demoted the whole hot set
 * once the load stopped and a second had passed (measured: 299475 of
 * 300000 keys cold before the benchmark's next run). LFU counters are
 * taken as they are: they decay by lfu-decay-time minutes, not by the
 * second. */
static int coldBucket(RedisModuleKey *kh, int *idle_ok, int *decide) {
    long long freq;
    mstime_t idle;
    *idle_ok = 1;
    if (RedisModule_GetLFU(kh, &freq) == REDISMODULE_OK && freq >= 0) {
        *decide = HM_BUCKETS - 1 - (int)(freq > HM_BUCKETS - 1 ? HM_BUCKETS - 1 : freq);
        return *decide;
    }
    if (RedisModule_GetLRU(kh, &idle) != REDISMODULE_OK || idle < 0) return *decide = 0;
    *idle_ok = idle >= hm.min_idle_ms;
    /* A key touched since the moment is in bucket 0. */
    *decide = idleBucket(idle - hm.threshold_age_ms);
    return idleBucket(idle - hm.pass_age_ms);
}

/* A stable pseudo-random share of a key in [0, 65536) (FNV-1a): the same
 * keys of the threshold bucket stay hot pass after pass. */
static uint32_t keyShare(RedisModuleString *key) {
    size_t l;
    const char *p = RedisModule_StringPtrLen(key, &l);
    return keyFnv(p, l) & 0xffff;
}

static void scanCb(RedisModuleCtx *ctx, RedisModuleString *keyname,
                   RedisModuleKey *kh, void *priv) {
    (void)priv;
    RedisModuleKey *own = NULL;
    if (!kh) kh = own = RedisModule_OpenKey(ctx, keyname, REDISMODULE_READ | REDISMODULE_OPEN_KEY_NOTOUCH);
    if (RedisModule_KeyType(kh) == REDISMODULE_KEYTYPE_STRING) {
        size_t klen;
        RedisModule_StringPtrLen(keyname, &klen);
        uint64_t bytes = klen + RedisModule_ValueLength(kh) + HM_ITEM_OVERHEAD;
        int idle_ok, d;
        int b = coldBucket(kh, &idle_ok, &d);
        uint32_t share = keyShare(keyname);
        if (d >= hm.threshold && idle_ok && (d > hm.threshold || share >= hm.keep_at_threshold)) {
            if (hm.npending == hm.cap_pending) {
                hm.cap_pending = hm.cap_pending ? hm.cap_pending * 2 : 64;
                hm.pending = RedisModule_Realloc(hm.pending, hm.cap_pending * sizeof(*hm.pending));
            }
            RedisModule_RetainString(ctx, keyname);
            hm.pending[hm.npending++] = keyname;
        } else {
            hm.pass_bytes[b][share >> HM_SHARE_BIN_SHIFT] += bytes;
            hm.pass_items++;
        }
    }
    if (own) RedisModule_CloseKey(own);
}

/* End of a pass: the hot set is what fits in the budget, hottest first.
 * Of the bucket that crosses the budget only the share that does not fit
 * is demoted, by a stable hash of the key (keyShare): demoting the whole
 * bucket overshot by up to half the hot set (measured: a hot range exactly
 * the size of the budget, touched at once, was demoted entirely and read
 * back by promotions). The histogram bins each bucket by that hash too, and
 * the cut is placed between the keys actually there: after a cut, the keys
 * left in the bucket have hashes below it, and a cut computed as if hashes
 * in the bucket were uniform over [0, 65536) fell above all of them, pass
 * after pass (measured: 31221 idle keys, 5.1 MB over a 16.2 MB budget,
 * stayed hot through 8 passes that demoted nothing, while the hot set,
 * over its budget, refused promotions). Within the crossing bin the cut is
 * interpolated: off by at most a bin, 1/16 of the bucket. */
static void passEnd(RedisModuleCtx *ctx) {
    long long budget = hotBudget(ctx);
    uint64_t sum = 0;
    int thr = HM_BUCKETS;
    uint32_t keep = 0;
    for (int b = 0; b < HM_BUCKETS && thr == HM_BUCKETS; b++) {
        for (int i = 0; i < HM_SHARE_BINS; i++) {
            uint64_t bin = hm.pass_bytes[b][i];
            if (sum + bin > (uint64_t)budget) {
                thr = b;
                if (budget > 0 && (uint64_t)budget > sum)
                    keep = ((uint32_t)i << HM_SHARE_BIN_SHIFT) +
                           (uint32_t)(((uint64_t)budget - sum) * (1u << HM_SHARE_BIN_SHIFT) / bin);
                else
                    keep = (uint32_t)i << HM_SHARE_BIN_SHIFT;
                break;
            }
            sum += bin;
        }
    }
    /* Items used within the last LRU clock tick (bucket 0) stay hot unless
     * the budget is zero: demoting what is being read right now would only
     * make it bounce back. */
    if (thr == 0) { thr = 1; keep = 0; }
    if (budget <= 0) { thr = 0; keep = 0; }
    hm.threshold = thr;
    hm.keep_at_threshold = keep;
    hm.threshold_at_ms = hm.pass_start_ms;
    hm.fits_below = 0;
    if (thr == HM_BUCKETS && budget > 0) {
        hm.fits_below = (long long)infoMemoryField(ctx, "used_memory") + budget - (long long)sum;
        hm.fits_budget = budget;
        hm.fits_until_us = nowUs() + HM_FITS_RECHECK_MS * 1000ULL;
    }
    hm.pass_hot_bytes = 0;
    for (int b = 0; b < HM_BUCKETS; b++)
        for (int i = 0; i < HM_SHARE_BINS; i++) hm.pass_hot_bytes += hm.pass_bytes[b][i];
    hm.hot_est = (long long)hm.pass_hot_bytes;
    hm.admit_budget = budget;
    hm.pass_hot_items = hm.pass_items;
    memset(hm.pass_bytes, 0, sizeof(hm.pass_bytes));
    hm.pass_items = 0;
    hm.passes++;
    compactCheck(ctx);
}

/* Background work that changes the keyspace's representation (demotion,
 * compaction) runs only in the normal state, on a master that is not
 * loading, and outside transactions. */
static int backgroundAllowed(void) {
    if (hm.state != ST_NORMAL) return 0;
    int flags = RedisModule_GetContextFlags(hm.dctx);
    if (flags & (REDISMODULE_CTX_FLAGS_SLAVE | REDISMODULE_CTX_FLAGS_LOADING)) return 0;
    /* A transaction queued while a key was hot must find it hot at EXEC:
     * pause while a MULTI seen by the filter has no EXEC/DISCARD yet. */
    if (hm.multi_open > 0 && nowUs() - hm.multi_seen_us < HM_MULTI_GRACE_US) return 0;
    if (hm.multi_open > 0) hm.multi_open = 0;
    return 1;
}

static int demotionAllowed(void) {
    return hm.demote && backgroundAllowed();
}

/* Walk the keyspace with 'cursor' until it ends or 'deadline' passes: 'cb'
 * collects keys into hm.pending (a key cannot be changed inside the scan
 * callback), then 'fn' acts on each. Returns 1 if the walk has more. */
static int scanApply(RedisModuleScanCursor *cursor, RedisModuleScanCB cb,
                     int (*fn)(RedisModuleString *), uint64_t deadline) {
    int more = 1;
    while (more && nowUs() < deadline) {
        more = RedisModule_Scan(hm.dctx, cursor, cb, NULL);
        for (size_t i = 0; i < hm.npending; i++) {
            fn(hm.pending[i]);
            RedisModule_FreeString(hm.dctx, hm.pending[i]);
        }
        hm.npending = 0;
    }
    return more;
}

/* Run the demotion pass until 'deadline'; 'now_ms': see lruAgeMs. */
static void demoteSlice(uint64_t deadline, long long now_ms) {
    RedisModuleCtx *ctx = hm.dctx;
    if (!hm.cursor) {
        if (nowUs() < hm.next_pass_us) return;
        /* Nothing can be over budget while the whole of used_memory fits
         * in it: skip the pass (its keyspace walk would be pure overhead;
         * measured: 3-30 % more server CPU per request with 300k keys). */
        long long budget = hotBudget(ctx);
        long long used = (long long)infoMemoryField(ctx, "used_memory");
        /* The second test: measured, an idle server with 90k hot keys
         * (whose used_memory is above the budget by Redis's own overhead,
         * not by its keys) walked them every 5 s: 4 % of its CPU. */
        if (budget > 0 && (used < budget ||
                           (hm.fits_below && used < hm.fits_below &&
                            budget == hm.fits_budget && nowUs() < hm.fits_until_us))) {
            hm.threshold = HM_BUCKETS;
            hm.next_pass_us = nowUs() + HM_PASS_PAUSE_MS * 1000ULL;
            hm.skipped_passes++;
            if (used < budget) hm.hot_est = used;
            hm.admit_budget = budget;
            return;
        }
        hm.cursor = RedisModule_ScanCursorCreate();
        hm.pass_cpu_us = 0;
        hm.pass_demoted = 0;
        hm.pass_start_ms = now_ms;
    }
    hm.pass_age_ms = lruAgeMs(hm.pass_start_ms, now_ms);
    hm.threshold_age_ms = hm.threshold_at_ms ? lruAgeMs(hm.threshold_at_ms, now_ms) : 0;
    uint64_t c0 = threadCpuUs();
    int more = scanApply(hm.cursor, scanCb, demoteKey, deadline);
    hm.pass_cpu_us += threadCpuUs() - c0;
    if (!more) {
        RedisModule_ScanCursorDestroy(hm.cursor);
        hm.cursor = NULL;
        passEnd(ctx);
        /* Everything fits the budget: the pass only refreshes statistics,
         * so run it rarely. hot-percent 0 (tests) demotes continuously.
         * Under promote/demote churn (reads spread over cold keys) a pass
         * is due every second, and walking a large hot keyspace that often
         * cost 7 % of the server's CPU (perf, 90/10 mix, 100k hot keys):
         * the pause is also at least HM_PASS_DUTY times the pass's own
         * CPU time. Promotions meanwhile only overshoot the budget for
         * longer.
         *
         * A pass over the budget that demoted nothing could not: what is
         * over it is in use (touched within min-idle-ms, or the hot set
         * sits at the budget's edge with Redis's overhead on top). The
         * next one is likely to find the same, so the pause doubles from
         * HM_IDLE_PASS_PAUSE_MS up to HM_IDLE_PASS_PAUSE_MAX_MS until a
         * pass demotes again (measured: passes every 3 s that demoted
         * nothing were 3.4 s of CPU over the benchmark's runs on the hot
         * range, 5 % of the server's CPU there). When everything fits,
         * the pause stays short: fits_below skips the walks meanwhile,
         * and growth is noticed within HM_IDLE_PASS_PAUSE_MS. */
        uint64_t pause_ms;
        if (hm.threshold == 0) {
            pause_ms = 10;
        } else if (hm.pass_demoted || hm.threshold == HM_BUCKETS) {
            hm.idle_pause_ms = 0;
            pause_ms = hm.pass_demoted ? HM_PASS_PAUSE_MS : HM_IDLE_PASS_PAUSE_MS;
        } else {
            hm.idle_pause_ms = hm.idle_pause_ms ? hm.idle_pause_ms * 2 : HM_IDLE_PASS_PAUSE_MS;
            if (hm.idle_pause_ms > HM_IDLE_PASS_PAUSE_MAX_MS)
                hm.idle_pause_ms = HM_IDLE_PASS_PAUSE_MAX_MS;
            pause_ms = hm.idle_pause_ms;
        }
        uint64_t pause_us = pause_ms * 1000ULL;
        if (hm.threshold != 0 && pause_us < hm.pass_cpu_us * HM_PASS_DUTY)
            pause_us = hm.pass_cpu_us * HM_PASS_DUTY;
        hm.next_pass_us = nowUs() + pause_us;
    }
}

/* Expired cold items are promoted (Redis then expires them with the stock
 * notification and propagation). Walks the arena at most HM_SWEEP_ITEMS
 * items per slice, one full cycle per HM_SWEEP_PAUSE_MS at most: like
 * Redis's active expire cycle it bounds when an expired item is reclaimed,
 * not whether a command sees it (an access promotes and expires at once). */
static void expiredCb(void *priv, const ColdItem *it) {
    long long now = *(long long *)((void **)priv)[1];
    if (it->expire != ARENA_NO_EXPIRE && it->expire <= now)
        keyListPush(((void **)priv)[0], RedisModule_CreateString(hm.dctx, it->key, it->klen));
}

static void sweepSlice(uint64_t deadline) {
    /* Nothing can expire: no walk (it reads every item's index slot, a
     * cache miss each: 2-3 % of an idle server's CPU with 210k items). */
    if (arenaExpiring(hm.arena) == 0 || arenaHasSpilled(hm.arena)) return;
    if (hm.sweep_cursor == 0 && nowUs() < hm.next_sweep_us) return;
    long long now = nowMs();
    unsigned budget = HM_SWEEP_ITEMS;
    while (budget && nowUs() < deadline) {
        budget = budget > 256 ? budget - 256 : 0;
        KeyList l = {0};
        void *priv[2] = {&l, &now};
        hm.sweep_cursor = arenaIterate(hm.arena, hm.sweep_cursor, 256, expiredCb, priv);
        for (size_t i = 0; i < l.n; i++) {
            RedisModuleKey *kh;
            promoteKey(l.v[i], 0);
            /* Let Redis expire it now, as its active expire cycle would. */
            kh = RedisModule_OpenKey(hm.dctx, l.v[i], REDISMODULE_READ);
            RedisModule_CloseKey(kh);
            RedisModule_FreeString(hm.dctx, l.v[i]);
        }
        RedisModule_Free(l.v);
        if (hm.sweep_cursor == 0 || hm.sweep_cursor == UINT64_MAX) {
            hm.sweep_cursor = 0;
            hm.next_sweep_us = nowUs() + HM_SWEEP_PAUSE_MS * 1000ULL;
            break;
        }
    }
}

/* ------------------------------------------------------------ compaction */

/* Why: demotion deletes cold keys one by one. Their dictEntry, key sds and
 * value robj/sds go back to jemalloc, but hot and cold items were
 * interleaved in the allocator's slabs, so hardly any page becomes empty
 * and the process keeps the memory resident (measured with 1M items, 30 %
 * hot: the module then saved nothing against stock Redis). A compaction
 * pass relocates every hot string key (delete + re-add of the same key,
 * value, expire and LFU/LRU) with the thread cache off: jemalloc then
 * serves each allocation from the lowest non-full slab, so survivors pack
 * into the oldest slabs and the newer slabs empty out. Stock Redis's active
 * defrag does the same with a jemalloc patch Debian's system jemalloc lacks.
 *
 * A pass is due when the bytes demoted since the last one reach
 * appassist.compact-percent of used_memory; it runs in the background
 * slices like a demotion pass (no demotion meanwhile). It does not purge:
 * jemalloc gives the emptied pages back within its dirty decay time (10 s)
 * from its background thread (Redis's jemalloc-bg-thread, on by default),
 * as it does for every free, and as Redis's own active defrag relies on.
 * A purge from a slice returned everything jemalloc held dirty at once:
 * 1.7-7.3 ms of CPU for the first one of a pass, measured, however little
 * the slice had relocated. PREPARE purges (MEMORY PURGE). */

/* Give jemalloc's dirty pages back now (Redis's MEMORY PURGE). */
static void memoryPurge(RedisModuleCtx *ctx) {
    RedisModuleCallReply *r = RedisModule_Call(ctx, "MEMORY", "c", "PURGE");
    if (r) RedisModule_FreeCallReply(r);
}

static int tcacheSet(bool on) {
    return hm.mallctl("thread.tcache.enabled", NULL, NULL, &on, sizeof(on));
}

/* Find jemalloc's mallctl in the server process; compaction stays off
 * (logged) under any other allocator. */
static void compactInit(RedisModuleCtx *ctx) {
    RedisModuleServerInfoData *info = RedisModule_GetServerInfo(ctx, "memory");
    const char *alloc = info ? RedisModule_ServerInfoGetFieldC(info, "mem_allocator") : NULL;
    int jemalloc = alloc && strncmp(alloc, "jemalloc", 8) == 0;
    if (info) RedisModule_FreeServerInfo(ctx, info);
    void *sym = NULL;
    if (jemalloc) {
        sym = dlsym(RTLD_DEFAULT, "mallctl");
        if (!sym) sym = dlsym(RTLD_DEFAULT, "je_mallctl");
    }
    *(void **)&hm.mallctl = sym;
    bool on;
    size_t len = sizeof(on);
    if (hm.mallctl && hm.mallctl("thread.tcache.enabled", &on, &len, NULL, 0) != 0)
        hm.mallctl = NULL;
    if (!hm.mallctl) {
        RedisModule_Log(ctx, "notice", "appassist: allocator is not jemalloc with mallctl (%s): "
                        "no compaction after demotion, freed memory is not cleared",
                        jemalloc ? "no mallctl symbol" : "mem_allocator");
        return;
    }
    char why[160];
    if (zeroFreeInstall(hm.mallctl, RedisModule_Alloc, RedisModule_Free, why, sizeof(why)) != 0)
        RedisModule_Log(ctx, "notice", "appassist: freed memory is not cleared: %s", why);
}

/* Called at the end of a demotion pass. A pass is due when both the bytes
 * demoted since the last pass and jemalloc's free bytes inside slabs in use
 * (allocator_frag_bytes = active - allocated) reach compact-percent of the
 * allocated bytes. Under promote/demote churn the promoted items refill the
 * holes, fragmentation stays low and no pass runs; a pass that could not
 * fix fragmentation (holes next to non-string keys) is not repeated until
 * as much has been demoted again. */
static void compactCheck(RedisModuleCtx *ctx) {
    if (!hm.mallctl || hm.compact_percent == 0 || hm.compact_wanted || hm.compact_pending == 0)
        return;
    (void)ctx;
    /* INFO's allocator_* figures are refreshed by serverCron; ask jemalloc
     * (a new epoch merges the arenas' stats: tens of us, once per pass). */
    uint64_t epoch = 1;
    size_t alloc = 0, active = 0, sz = sizeof(epoch);
    if (hm.mallctl("epoch", &epoch, &sz, &epoch, sz) != 0) return;
    sz = sizeof(size_t);
    if (hm.mallctl("stats.allocated", &alloc, &sz, NULL, 0) != 0 ||
        hm.mallctl("stats.active", &active, &sz, NULL, 0) != 0)
        return;
    unsigned long long frag = active > alloc ? active - alloc : 0;
    unsigned long long min = alloc / 100 * (unsigned long long)hm.compact_percent;
    hm.last_frag_bytes = (long long)frag;
    if (hm.compact_pending >= min && frag >= min) hm.compact_wanted = 1;
}

/* Values Redis keeps int-encoded cannot be re-created as such through the
 * module API (OBJECT ENCODING would change): leave them where they are.
 * Only values of at most 20 bytes can be. */
static int intEncoded(RedisModuleString *key) {
    RedisModuleCallReply *r = RedisModule_Call(hm.dctx, "OBJECT", "cs", "ENCODING", key);
    size_t l = 0;
    const char *e = r ? RedisModule_CallReplyStringPtr(r, &l) : NULL;
    int is_int = e == NULL || (l == 3 && memcmp(e, "int", 3) == 0);
    if (r) RedisModule_FreeCallReply(r);
    return is_int;
}

/* Relocate hot string key 'key': same name, value, expire and LFU counter
 * (or LRU idle time, to Redis's 1 s clock resolution) in new allocations.
 * The copy of the value is made before the old one is freed; the key and
 * dictEntry are re-added after. Nothing is propagated, notified or
 * signalled (see the invariants). Returns 1 if relocated. */
static int relocateKey(RedisModuleString *key) {
    RedisModuleCtx *ctx = hm.dctx;
    mstime_t expire;
    RedisModuleKey *kh = openLiveString(key, &expire);
    if (!kh) {
        hm.compact_skipped++;
        return 0;
    }
    if (RedisModule_ValueLength(kh) <= 20 && intEncoded(key)) {
        RedisModule_CloseKey(kh);
        hm.compact_skipped++;
        return 0;
    }
    long long freq = -1;
    mstime_t idle = -1;
    RedisModule_GetLFU(kh, &freq);
    if (freq < 0) RedisModule_GetLRU(kh, &idle);
    size_t vlen;
    /* DMA on a non-raw (embstr) value swaps in a raw copy first: transient,
     * the value is re-created below as Redis would (embstr up to 44 bytes). */
    const char *v = RedisModule_StringDMA(kh, &vlen, REDISMODULE_READ);
    if (!v) {
        RedisModule_CloseKey(kh);
        return 0;
    }
    RedisModuleString *copy = RedisModule_CreateString(ctx, v, vlen);
    RedisModule_DeleteKey(kh);
    RedisModule_StringSet(kh, copy);
    if (expire != REDISMODULE_NO_EXPIRE) RedisModule_SetAbsExpire(kh, expire);
    if (freq >= 0) RedisModule_SetLFU(kh, freq);
    else if (idle >= 0) RedisModule_SetLRU(kh, idle);
    RedisModule_CloseKey(kh);
    RedisModule_FreeString(ctx, copy);
    hm.relocations++;
    hm.compact_relocated++;
    return 1;
}

static void compactScanCb(RedisModuleCtx *ctx, RedisModuleString *keyname,
                          RedisModuleKey *kh, void *priv) {
    (void)priv;
    if (kh && RedisModule_KeyType(kh) != REDISMODULE_KEYTYPE_STRING) return;
    if (hm.npending == hm.cap_pending) {
        hm.cap_pending = hm.cap_pending ? hm.cap_pending * 2 : 64;
        hm.pending = RedisModule_Realloc(hm.pending, hm.cap_pending * sizeof(*hm.pending));
    }
    RedisModule_RetainString(ctx, keyname);
    hm.pending[hm.npending++] = keyname;
}

static void compactEnd(void) {
    RedisModule_ScanCursorDestroy(hm.ccursor);
    hm.ccursor = NULL;
    hm.compact_wanted = 0;
    hm.compactions++;
    hm.last_compact_relocated = hm.compact_relocated;
    hm.last_compact_time_us = (long long)(nowUs() - hm.compact_t0);
    hm.last_compact_busy_us = hm.compact_busy_us;
    hm.last_compact_slice_max_us = hm.compact_slice_max_us;
    hm.last_compact_rss_before = hm.compact_rss0;
    hm.last_compact_rss_after = processRss();
    RedisModule_Log(hm.dctx, "verbose", "appassist: compaction: %lld keys relocated in %lld ms "
                    "(%lld ms busy, longest slice %lld us), RSS %lld -> %lld KiB",
                    hm.last_compact_relocated, hm.last_compact_time_us / 1000,
                    hm.last_compact_busy_us / 1000, hm.last_compact_slice_max_us,
                    hm.last_compact_rss_before / 1024,
                    hm.last_compact_rss_after / 1024);
}

/* Run the compaction pass until 'deadline'. The thread cache is off only
 * inside the slice: a free followed by an allocation of the same size
 * would otherwise get the slot just freed back. */
static void compactSlice(uint64_t deadline) {
    RedisModuleCtx *ctx = hm.dctx;
    uint64_t t = nowUs(), cpu = threadCpuUs();
    if (!hm.ccursor) {
        hm.ccursor = RedisModule_ScanCursorCreate();
        hm.compact_pending = 0;
        hm.compact_t0 = t;
        hm.compact_rss0 = processRss();
        hm.compact_busy_us = 0;
        hm.compact_slice_max_us = 0;
        hm.compact_relocated = 0;
    }
    if (tcacheSet(false) != 0) {
        RedisModule_Log(ctx, "warning", "appassist: cannot turn jemalloc's thread cache off: "
                        "no compaction");
        hm.mallctl = NULL;
        RedisModule_ScanCursorDestroy(hm.ccursor);
        hm.ccursor = NULL;
        hm.compact_wanted = 0;
        return;
    }
    int more = scanApply(hm.ccursor, compactScanCb, relocateKey, deadline);
    tcacheSet(true);
    hm.compact_busy_us += (long long)(nowUs() - t);
    long long cpu_us = (long long)(threadCpuUs() - cpu);
    if (cpu_us > hm.compact_slice_max_us) hm.compact_slice_max_us = cpu_us;
    if (!more) compactEnd();
}

/* Abandon a running pass (PREPARE); it starts over after RESUME. */
static void compactAbandon(void) {
    if (!hm.ccursor) return;
    RedisModule_ScanCursorDestroy(hm.ccursor);
    hm.ccursor = NULL;          /* compact_wanted stays set */
}

static void sliceTimer(RedisModuleCtx *ctx, void *data);

static void armTimerIn(long long ms) {
    hm.timer = RedisModule_CreateTimer(hm.dctx, ms, sliceTimer, NULL);
}

static void armTimer(void) {
    armTimerIn(hm.interval_ms);
}

static int reclaimAllowed(void);

/* 1 while some background work is under way (not merely due). */
static int backgroundPending(void) {
    return hm.state == ST_RESUMING || arenaRehashing(hm.arena) || hm.cursor || hm.ccursor ||
           (hm.reclaiming && reclaimAllowed()) ||
           (hm.compact_wanted && hm.mallctl) || hm.sweep_cursor != 0;
}

/* Holes in the arena (arenaDeadBytes) are reclaimed once they exceed half
 * the live items' bytes (and HM_RECLAIM_MIN_BYTES), until they are down to
 * a quarter: the arena then maps at most 1.5x its items (plus the chunk
 * being appended to), and reclaiming copies at most two bytes per byte it
 * frees. Without it, writes spread over the cold items (each a write
 * visit: delete, and append the new version) left every chunk partly
 * live, and a chunk is unmapped only when its last item goes: measured,
 * four rounds of writes to a random half of 20000 cold items left the
 * arena at 2.0x its items.
 *
 * A client's SCAN holding an arena cursor between calls is not affected:
 * moved items go ahead of every cursor (see arenaIterate). Not while the
 * arena has spilled chunks (it takes no appends) or outside the normal
 * state. */
static int reclaimAllowed(void) {
    if (hm.state != ST_NORMAL || arenaHasSpilled(hm.arena) ||
        (RedisModule_GetContextFlags(hm.dctx) & REDISMODULE_CTX_FLAGS_LOADING))
        return 0;
    return nowUs() >= hm.reclaim_after_us;
}

static int reclaimWanted(void) {
    uint64_t dead = arenaDeadBytes(hm.arena), live = arenaLiveBytes(hm.arena);
    if (!hm.reclaiming && dead >= HM_RECLAIM_MIN_BYTES && dead > live / 2) {
        hm.reclaiming = 1;
        hm.reclaims++;
    } else if (hm.reclaiming && dead <= live / 4) {
        hm.reclaiming = 0;
    }
    return hm.reclaiming && reclaimAllowed();
}

static void reclaimSlice(uint64_t deadline) {
    uint64_t moved = 0;
    do {
        int r = arenaReclaimStep(hm.arena, HM_RECLAIM_ITEMS, &moved);
        if (r < 0) {
            RedisModule_Log(hm.dctx, "warning", "appassist: reclaiming arena holes failed: %s",
                            strerror(errno));
            hm.reclaim_after_us = nowUs() + 1000000;
            break;
        }
        if (r == 0) {
            hm.reclaiming = 0;
            break;
        }
    } while (nowUs() < deadline && reclaimWanted());
    hm.reclaim_moved += (long long)moved;
}

/* The background work (unspill, arena rehash, a demotion or compaction
 * pass, expiry sweep, arena reclaim) until 'deadline'. Returns
 * backgroundPending(). */
static int backgroundWork(uint64_t deadline) {
    uint64_t t0 = nowUs(), c0 = threadCpuUs();
    readBackSettle();           /* the end of this round's commands, not a step */
    uint64_t c1 = threadCpuUs();
    if (hm.state == ST_RESUMING) {
        int r = 1;
        while (r == 1 && nowUs() < deadline) r = arenaUnspillStep(hm.arena);
        if (r == 0) hm.state = ST_NORMAL;
        if (r < 0)
            RedisModule_Log(hm.dctx, "warning", "appassist: reading the spill file back failed: %s",
                            strerror(errno));
    }
    int rehash = 1;
    while (rehash && nowUs() < deadline) rehash = arenaRehashStep(hm.arena, HM_REHASH_STEP);
    if (hm.compact_wanted && hm.mallctl && !hm.cursor && backgroundAllowed())
        compactSlice(deadline);
    else if (demotionAllowed())
        demoteSlice(deadline, nowMs());
    sweepSlice(deadline);
    if (nowUs() < deadline && reclaimWanted()) reclaimSlice(deadline);
    scanRecent();               /* frees the SCAN log once its grace is over */
    uint64_t us = nowUs() - t0;
    if (us > hm.step_max_us) hm.step_max_us = us;
    uint64_t c2 = threadCpuUs();
    if (c2 - c1 > hm.step_max_cpu_us) hm.step_max_cpu_us = c2 - c1;
    hm.bg_cpu_us += c2 - c0;
    return backgroundPending();
}

/* The background timer. On an idle server it runs the work in slices of
 * appassist.slice-us every interval-ms. While clients are served, the
 * event loop's bites (bgBite) run it instead: one 250 us slice every 3 ms
 * delayed every request that arrived meanwhile by up to the whole slice,
 * the source of the p99 tail at pipeline 1 under promote/demote churn. */
static void sliceTimer(RedisModuleCtx *ctx, void *data) {
    (void)ctx;
    (void)data;
    int busy;
    if (hm.bites_on && hm.served != hm.served_at_tick) {
        hm.served_at_tick = hm.served;
        busy = backgroundPending();
    } else {
        busy = backgroundWork(nowUs() + (uint64_t)hm.slice_us);
        hm.slices++;
    }
    /* With no pass, rehash or sweep under way, wake up less often: a
     * timer every interval-ms was most of an idle server's CPU. A pass
     * that falls due starts at most HM_IDLE_INTERVAL_MS late. */
    uint64_t now = nowUs(), wake = now + HM_IDLE_INTERVAL_MS * 1000ULL;
    /* Only what falls due later: a pass that is already due but not
     * allowed (replica, MULTI, migration) must not keep the timer fast. */
    if (hm.demote && hm.next_pass_us > now && hm.next_pass_us < wake) wake = hm.next_pass_us;
    if (arenaExpiring(hm.arena) && hm.next_sweep_us > now && hm.next_sweep_us < wake)
        wake = hm.next_sweep_us;
    long long ms = (long long)((wake - now) / 1000);
    armTimerIn(busy || ms < hm.interval_ms ? hm.interval_ms : ms);
}

/* Before the event loop sleeps, after it served some commands: a bite of
 * the background work, as long as half the share of time of one slice per
 * interval (slice-us / interval-ms / 2) gives, counted from the end of the
 * previous bite. So the work spreads over every round of the loop (each
 * request waits a few tens of us more) instead of one long slice landing
 * on a few. Half: measured under promote/demote churn (90/10 mix, pipeline
 * 16), the timer's full share demoted half as much again, promotions
 * followed, and the server spent 5-10 % more CPU per request; with half,
 * as much as with the timer's slices. Shorter credits accumulate: a bite
 * has a fixed cost. */
static void bgBite(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)ctx;
    (void)e;
    (void)data;
    if (sub != REDISMODULE_SUBEVENT_EVENTLOOP_BEFORE_SLEEP || hm.served == hm.served_at_bite)
        return;
    if (hm.back.n) readBackSettle();
    uint64_t now = nowUs();
    uint64_t period = (uint64_t)hm.interval_ms * 1000;
    uint64_t credit = (now - hm.last_bite_us) * (uint64_t)hm.slice_us / (HM_BITE_SHARE_DIV * period);
    if (credit < HM_BITE_MIN_US) return;
    if (credit > (uint64_t)hm.slice_us) credit = (uint64_t)hm.slice_us;
    hm.served_at_bite = hm.served;
    backgroundWork(now + credit);
    hm.bites++;
    hm.last_bite_us = nowUs();
}

/* ------------------------------------------------------------ command filter */

static RedisModuleString *hm_name_keys, *hm_name_scan, *hm_name_dbsize;

static int cmdIs(const char *c, size_t l, const char *name) {
    return strlen(name) == l && strncasecmp(c, name, l) == 0;
}

/* Commands whose only key is argv[1] (any argc), and those for which that
 * holds with argc == 2: the filter takes the key without asking Redis
 * (RedisModule_GetCommandKeys looks the command up and allocates; measured
 * ~0.1 us per command, 10 % of a pipelined GET). Must stay exact: a
 * command listed here with another key would run on that key cold. */
#define NAMELEN(s) s, sizeof(s) - 1
typedef struct { const char *name; size_t len; int visit; } CmdName;
/* 'visit': a cold key the command names is visited, not promoted (see
 * readBackWanted); 0 for the commands that look the key up with NOTOUCH
 * (the visit could not tell that they ran: it would end as a promotion). */
static const CmdName one_key_cmds[] = {
    {NAMELEN("get"), 1}, {NAMELEN("set"), 1}, {NAMELEN("setnx"), 1}, {NAMELEN("setex"), 1},
    {NAMELEN("psetex"), 1}, {NAMELEN("getset"), 1}, {NAMELEN("getdel"), 1},
    {NAMELEN("getex"), 1}, {NAMELEN("incr"), 1}, {NAMELEN("decr"), 1}, {NAMELEN("incrby"), 1},
    {NAMELEN("decrby"), 1}, {NAMELEN("incrbyfloat"), 1}, {NAMELEN("append"), 1},
    {NAMELEN("strlen"), 1}, {NAMELEN("getrange"), 1}, {NAMELEN("setrange"), 1},
    {NAMELEN("substr"), 1}, {NAMELEN("ttl"), 0}, {NAMELEN("pttl"), 0}, {NAMELEN("expire"), 1},
    {NAMELEN("pexpire"), 1}, {NAMELEN("expireat"), 1}, {NAMELEN("pexpireat"), 1},
    {NAMELEN("persist"), 1}, {NAMELEN("type"), 0}, {NAMELEN("expiretime"), 0},
    {NAMELEN("pexpiretime"), 0},
};
static const CmdName one_key_if_argc2[] = {
    {NAMELEN("exists"), 0}, {NAMELEN("del"), 1}, {NAMELEN("unlink"), 1}, {NAMELEN("touch"), 1},
};

static const CmdName *inNames(const CmdName *t, size_t n, const char *c, size_t l) {
    int c0 = tolower((unsigned char)c[0]);
    for (size_t i = 0; i < n; i++)
        if (t[i].len == l && t[i].name[0] == c0 && strncasecmp(c, t[i].name, l) == 0)
            return &t[i];
    return NULL;
}

/* The table entry if argv[1] is the command's only key, else NULL. */
static const CmdName *firstArgIsOnlyKey(const char *c, size_t l, int argc) {
    if (argc < 2) return NULL;
    const CmdName *e = inNames(one_key_cmds, sizeof(one_key_cmds) / sizeof(one_key_cmds[0]), c, l);
    if (e || argc != 2) return e;
    return inNames(one_key_if_argc2, sizeof(one_key_if_argc2) / sizeof(one_key_if_argc2[0]), c, l);
}

/* CLIENT PAUSE and FAILOVER postpone commands after the filter ran; a
 * visit must not go back while another client's read touched the key and
 * the postponed command has yet to run (Redis 7.2+ does not rerun the
 * filter). So no visits until the pause ends: CLIENT PAUSE's timeout,
 * FAILOVER's (60 s when it gives none), or CLIENT UNPAUSE / FAILOVER ABORT. */
static void notePause(RedisModuleCommandFilterCtx *f, int argc) {
    size_t l;
    const char *c = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, 0), &l);
    long long ms = -1;
    if (cmdIs(c, l, "failover")) {
        ms = 60000;
        for (int i = 1; i < argc; i++) {
            const char *a = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, i), &l);
            if (cmdIs(a, l, "abort")) ms = 0;
            else if (cmdIs(a, l, "timeout") && i + 1 < argc)
                RedisModule_StringToLongLong(RedisModule_CommandFilterArgGet(f, i + 1), &ms);
        }
    } else if (argc >= 2) {
        const char *a = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, 1), &l);
        if (cmdIs(a, l, "unpause")) ms = 0;
        else if (cmdIs(a, l, "pause") && argc >= 3)
            RedisModule_StringToLongLong(RedisModule_CommandFilterArgGet(f, 2), &ms);
    }
    if (ms == 0) hm.paused_until_us = 0;
    else if (ms > 0 && nowUs() + (uint64_t)ms * 1000 > hm.paused_until_us)
        hm.paused_until_us = nowUs() + (uint64_t)ms * 1000;
}

/* Runs before every command (client, script, MULTI queueing, RM_Call of
 * other modules). Whole-keyspace commands are rewritten to module commands
 * that also see the arena; every key argument that is cold is brought into
 * the keyspace (promoted, or visited for a read) so the real command runs on
 * an ordinary key. The filter does not know the
 * client's selected DB (7.0 has no API for it): promotion always targets db
 * 0, which is harmless for a command on another DB. */
static void hmFilter(RedisModuleCommandFilterCtx *f) {
    int argc = RedisModule_CommandFilterArgsCount(f);
    hm.served++;
    if (argc < 1 || !hm.arena) return;
    size_t cl;
    const char *c = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, 0), &cl);
    switch (cl) {
    case 4:
        if (cmdIs(c, cl, "keys")) {
            if (arenaCount(hm.arena)) {
                RedisModule_RetainString(NULL, hm_name_keys);
                RedisModule_CommandFilterArgReplace(f, 0, hm_name_keys);
            }
            return;
        }
        if (cmdIs(c, cl, "scan")) {
            RedisModule_RetainString(NULL, hm_name_scan);
            RedisModule_CommandFilterArgReplace(f, 0, hm_name_scan);
            return;
        }
        if (cmdIs(c, cl, "exec")) { if (hm.multi_open > 0) hm.multi_open--; return; }
        if (cmdIs(c, cl, "mget")) {
            /* every argument is a key */
            if (arenaCount(hm.arena))
                for (int i = 1; i < argc; i++)
                    promoteKey(RedisModule_CommandFilterArgGet(f, i), 1);
            return;
        }
        break;
    case 5:
        if (cmdIs(c, cl, "multi")) { hm.multi_open++; hm.multi_seen_us = nowUs(); return; }
        break;
    case 6:
        if (cmdIs(c, cl, "dbsize")) {
            if (arenaCount(hm.arena)) {
                RedisModule_RetainString(NULL, hm_name_dbsize);
                RedisModule_CommandFilterArgReplace(f, 0, hm_name_dbsize);
            }
            return;
        }
        if (cmdIs(c, cl, "swapdb")) { if (arenaCount(hm.arena)) promoteAll(); return; }
        if (cmdIs(c, cl, "client")) { notePause(f, argc); return; }
        break;
    case 8:
        if (cmdIs(c, cl, "failover")) { notePause(f, argc); return; }
        break;
    case 7:
        if (cmdIs(c, cl, "discard")) { if (hm.multi_open > 0) hm.multi_open--; return; }
        break;
    }
    if (arenaCount(hm.arena) == 0) return;
    const CmdName *one = firstArgIsOnlyKey(c, cl, argc);
    if (one) {
        promoteKey(RedisModule_CommandFilterArgGet(f, 1), one->visit);
        return;
    }

    RedisModuleString *stackv[16], **argv = stackv;
    if (argc > 16) argv = RedisModule_Alloc(sizeof(*argv) * (size_t)argc);
    for (int i = 0; i < argc; i++) argv[i] = RedisModule_CommandFilterArgGet(f, i);
    int nkeys = 0;
    int *pos = RedisModule_GetCommandKeys(hm.dctx, argv, argc, &nkeys);
    for (int i = 0; pos && i < nkeys; i++) promoteKey(argv[pos[i]], 1);
    if (pos) RedisModule_Free(pos);
    if (argv != stackv) RedisModule_Free(argv);
}

/* ------------------------------------------------------------ migration */

/* Lazy drop (appassist.lazy-drop, like Redis's lazyfree): PREPARE empties
 * the arena at once and a detached thread unmaps its mappings, so the reply
 * does not wait for the kernel to free hundreds of MiB page by page (under
 * TCG that was most of PREPARE's time). Nothing refers to the mappings any
 * more; the pages are free in the guest moments later, while the host is
 * already migrating.
 *
 * It only pays when the freed pages end up zero, by the kernel
 * (init_on_free=1) or by this process (appassist.zero-freed): then a page
 * the migration reaches before the thread cleared it is the only loss.
 * When the balloon has to take the pages instead, they must be free before
 * the balloon and the first RAM pass get to them, and the thread competes
 * with both for the guest's vCPUs (measured: longer total migrations).
 * 'auto' is therefore: lazy iff the freed pages are cleared.
 *
 * Zeroing what the process frees (appassist.zero-freed, zerofree.c) makes
 * the balloon unnecessary for it: a free zero page costs the migration a
 * flag, and clearing happens when memory is freed (jemalloc purges, spread
 * over the server's life) or in the drop thread (the arena), not in the
 * migration's set-up. 'auto' is on unless the kernel clears freed pages
 * itself. */
static int kernelZeroesFreedPages(void) {
    static int known = -1;
    if (known >= 0) return known;
    char line[4096];
    FILE *f = fopen("/proc/cmdline", "r");
    known = 0;
    if (f) {
        if (fgets(line, sizeof(line), f)) {
            for (char *tok = strtok(line, " \n"); tok; tok = strtok(NULL, " \n"))
                if (strncmp(tok, "init_on_free=", 13) == 0)   /* kstrtobool's "true" */
                    known = strchr("1yY", tok[13]) ? tok[13] != '\0' : strcmp(tok + 13, "on") == 0;
        }
        fclose(f);
    }
    return known;
}

static int zeroFreedWanted(void) {
    return hm.zero_freed == TRI_YES || (hm.zero_freed == TRI_AUTO && !kernelZeroesFreedPages());
}

/* Turn clearing on or off per appassist.zero-freed. Turning it off ends the
 * window in which everything freed was cleared; turning it on starts one
 * only at the next peak reset (RESUME/ABORT), since pages freed before are
 * not zero. */
static void zeroFreedApply(void) {
    int on = zeroFreedWanted() && zeroFreeInstalled();
    if (!on) hm.zero_window = 0;
    zeroFreeEnable(on);
}

static int applyZeroFreed(RedisModuleCtx *ctx, void *priv, RedisModuleString **err) {
    (void)ctx; (void)priv; (void)err;
    zeroFreedApply();
    return REDISMODULE_OK;
}

typedef struct UnmapJob {
    ArenaMapping *maps;
    size_t n;
    int zero;                   /* clear the pages before unmapping */
} UnmapJob;

/* Wall time of the last drop's clear and unmap (written by the thread). */
static long long last_clear_us, last_unmap_us;

static void unmapJob(UnmapJob *job) {
    uint64_t t0 = nowUs();
    for (size_t i = 0; job->zero && i < job->n; i++)
        zeroResident(job->maps[i].addr, job->maps[i].len);
    uint64_t t1 = nowUs();
    arenaUnmap(job->maps, job->n);
    free(job);
    __atomic_store_n(&last_clear_us, (long long)(t1 - t0), __ATOMIC_RELAXED);
    __atomic_store_n(&last_unmap_us, (long long)(nowUs() - t1), __ATOMIC_RELAXED);
}

static void *unmapThread(void *arg) {
    unmapJob(arg);
    return NULL;
}

/* Drop the arena; returns the bytes of mappings released (or being
 * released by the thread). *zeroed: the released pages end up zero. */
static uint64_t dropArena(uint64_t *items, int *lazy, int *zeroed) {
    int kernel = kernelZeroesFreedPages(), zero = zeroFreeEnabled();
    int want_lazy = hm.lazy_drop == TRI_YES || (hm.lazy_drop == TRI_AUTO && (kernel || zero));
    *lazy = 0;
    *zeroed = kernel;
    if (!want_lazy && !zero) return arenaDrop(hm.arena, items);
    UnmapJob *job = malloc(sizeof(*job));
    if (!job) return arenaDrop(hm.arena, items);
    job->zero = zero;
    *zeroed = kernel || zero;
    uint64_t freed = arenaDropDeferred(hm.arena, items, &job->maps, &job->n);
    if (!want_lazy || job->n == 0) {
        unmapJob(job);
        return freed;
    }
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, unmapThread, job) != 0)
        unmapJob(job);          /* no thread: do it here */
    else
        *lazy = 1;
    pthread_attr_destroy(&attr);
    return freed;
}

static void prepareFields(RedisModuleCtx *ctx, Fields *fs, long long deadline_ms) {
    uint64_t t0 = nowUs();
    readBackSettle();
    long long rss0 = processRss();
    int64_t freed = 0;
    uint64_t items = 0;
    int complete = 1;
    int lazy = 0, arena_zeroed = 0;
    if (hm.cursor) {
        /* abandon the running demotion pass; demotion is paused */
        RedisModule_ScanCursorDestroy(hm.cursor);
        hm.cursor = NULL;
    }
    compactAbandon();
    if (hm.state == ST_RESUMING) hm.state = ST_PREPARED;
    switch (hm.policy) {
    case POLICY_DROP:
        items = arenaCount(hm.arena);
        freed = (int64_t)dropArena(NULL, &lazy, &arena_zeroed);
        hm.dropped_items += (long long)items;
        break;
    case POLICY_SPILL: {
        char path[PATH_MAX];
        size_t pl;
        const char *p = RedisModule_StringPtrLen(hm.spill_path, &pl);
        snprintf(path, sizeof(path), "%.*s", (int)pl, p);
        items = arenaCount(hm.arena);
        uint64_t deadline = deadline_ms > 0 ? t0 + (uint64_t)deadline_ms * 1000 : 0;
        freed = arenaSpill(hm.arena, path, deadline, &complete);
        if (freed < 0) {
            fs->err = "ERR appassist: writing the spill file failed";
            RedisModule_Log(ctx, "warning", "appassist: spill to %s failed: %s", path, strerror(errno));
            return;
        }
        break;
    }
    case POLICY_NONE:
        break;
    }
    /* Give the allocator's free pages back too (demoted items left them). */
    if (hm.policy != POLICY_NONE) memoryPurge(ctx);
    hm.state = ST_PREPARED;
    long long rss1 = processRss();
    /* What the host may balloon away is everything this process gave back
     * to the guest kernel, not only the arena: pages that jemalloc returned
     * after demotion and compaction are free in the guest but still hold
     * data, so a migration would send them. The peak RSS since the last
     * RESUME/ABORT (or start) minus the RSS now measures all of it; the
     * host clamps the balloon with the guest's own statistics. */
    int64_t dropped = freed;
    long long peak = processPeakRss();
    /* With a lazy drop, RSS still holds the arena the thread is unmapping. */
    long long given = peak > 0 && rss1 > 0 ? peak - rss1 + (lazy ? dropped : 0) : -1;
    if (hm.policy != POLICY_NONE && given > freed)
        freed = given;
    /* The part of it the guest now holds as zero pages: all of it when the
     * kernel clears freed pages or this process cleared everything it gave
     * back since the window began (spilled chunks are not cleared), else
     * what the arena drop cleared. The host balloons only the rest. */
    int64_t zeroed = arena_zeroed ? dropped : 0;
    if (kernelZeroesFreedPages())
        zeroed = freed;
    else if (hm.zero_window && zeroFreeEnabled())
        zeroed = freed - (hm.policy == POLICY_SPILL ? dropped : 0);
    if (zeroed < 0) zeroed = 0;
    hm.prepares++;
    hm.last_freed = freed;
    hm.last_items = (long long)items;
    hm.last_time_us = (long long)(nowUs() - t0);
    hm.last_rss_before = rss0;
    hm.last_rss_after = rss1;
    hm.last_policy = hm.policy;
    hm.last_complete = complete;
    hm.last_lazy = lazy;
    hm.last_zeroed = zeroed;
    addInt(fs, "freed_bytes", freed);
    addInt(fs, "zeroed_bytes", zeroed);
    addInt(fs, "dropped_bytes", dropped);
    addInt(fs, "peak_rss", peak);
    addInt(fs, "lazy", lazy);
    addInt(fs, "items", (long long)items);
    addInt(fs, "used_memory", (long long)infoMemoryField(ctx, "used_memory"));
    addInt(fs, "rss", rss1);
    addInt(fs, "rss_before", rss0);
    addInt(fs, "time_us", hm.last_time_us);
    addStr(fs, "policy", policy_names[hm.policy]);
    addInt(fs, "complete", complete);
    addStr(fs, "state", state_names[hm.state]);
}

/* RESUME (migration done, we run on the destination) and ABORT (migration
 * cancelled, we still run on the source) do the same thing: undo what
 * PREPARE did where it can be undone. Dropped items stay dropped (cache
 * semantics); spilled chunks are read back in background slices. */
static void resumeFields(RedisModuleCtx *ctx, Fields *fs, int abort) {
    (void)ctx;
    if (hm.state == ST_PREPARED)
        hm.state = arenaHasSpilled(hm.arena) ? ST_RESUMING : ST_NORMAL;
    /* The host has taken back what the last PREPARE reported: count the
     * next one from here. */
    processPeakReset();
    hm.zero_window = zeroFreeEnabled();
    if (abort) hm.aborts++; else hm.resumes++;
    addStr(fs, "state", state_names[hm.state]);
    addInt(fs, "cold_items", (long long)arenaCount(hm.arena));
    addInt(fs, "dropped_items", hm.dropped_items);
}

static void statusFields(RedisModuleCtx *ctx, Fields *fs) {
    ArenaStats st;
    arenaGetStats(hm.arena, &st);
    addStr(fs, "state", state_names[hm.state]);
    addStr(fs, "policy", policy_names[hm.policy]);
    addInt(fs, "hot_budget_bytes", hotBudget(ctx));
    addInt(fs, "hot_items", (long long)hm.pass_hot_items);
    addInt(fs, "hot_bytes", (long long)hm.pass_hot_bytes);
    addInt(fs, "cold_items", (long long)st.items);
    addInt(fs, "cold_bytes", (long long)st.item_bytes);
    addInt(fs, "arena_chunks", (long long)st.chunks);
    addInt(fs, "arena_chunks_in_memory", (long long)st.chunks_mem);
    addInt(fs, "arena_mapped_bytes", (long long)st.mapped_bytes);
    addInt(fs, "spilled_bytes", (long long)st.spilled_bytes);
    addInt(fs, "demotions", hm.demotions);
    addInt(fs, "promotions", hm.promotions);
    addInt(fs, "visits", hm.visits);
    addInt(fs, "prepares", hm.prepares);
    addInt(fs, "used_memory", (long long)infoMemoryField(ctx, "used_memory"));
    addInt(fs, "rss", processRss());
}

static int parseDeadline(RedisModuleString **argv, int argc, long long *deadline) {
    *deadline = 0;
    if (argc < 2) return 0;
    if (RedisModule_StringToLongLong(argv[1], deadline) != REDISMODULE_OK ||
        *deadline < 0 || *deadline > 86400000LL)
        return -1;
    return 0;
}

static int PrepareCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc > 2) return RedisModule_WrongArity(ctx);
    long long deadline;
    if (parseDeadline(argv, argc, &deadline) < 0)
        return RedisModule_ReplyWithError(ctx, "ERR deadline-ms must be an integer between 0 and 86400000");
    Fields fs = {0};
    prepareFields(ctx, &fs, deadline);
    return replyFields(ctx, &fs);
}

static int ResumeCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RedisModule_WrongArity(ctx);
    Fields fs = {0};
    resumeFields(ctx, &fs, 0);
    return replyFields(ctx, &fs);
}

static int AbortCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RedisModule_WrongArity(ctx);
    Fields fs = {0};
    resumeFields(ctx, &fs, 1);
    return replyFields(ctx, &fs);
}

static int StatusCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RedisModule_WrongArity(ctx);
    Fields fs = {0};
    statusFields(ctx, &fs);
    return replyFields(ctx, &fs);
}

/* APPASSIST.DEMOTE [max-ms]: run the demotion pass synchronously until it
 * completes or max-ms (default 1000) passes; for tests and benchmarks. Uses
 * the current threshold (hot-percent 0: everything that is idle enough). */
static int DemoteCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc > 2) return RedisModule_WrongArity(ctx);
    long long ms = 1000;
    if (argc == 2 && (RedisModule_StringToLongLong(argv[1], &ms) != REDISMODULE_OK || ms < 0))
        return RedisModule_ReplyWithError(ctx, "ERR max-ms must be a non-negative integer");
    if (hm.state != ST_NORMAL)
        return RedisModule_ReplyWithError(ctx, "ERR demotion is paused until APPASSIST.RESUME");
    readBackSettle();
    long long before = hm.demotions;
    uint64_t deadline = nowUs() + (uint64_t)ms * 1000;
    uint64_t passes = hm.passes + hm.skipped_passes;
    hm.next_pass_us = 0;
    hm.fits_below = 0;
    long long now_ms = nowMs();
    while (hm.passes + hm.skipped_passes == passes && nowUs() < deadline)
        demoteSlice(deadline, now_ms);
    return RedisModule_ReplyWithLongLong(ctx, hm.demotions - before);
}

/* APPASSIST.COMPACT [max-ms]: run a compaction pass synchronously until it
 * completes or max-ms (default 10000) passes, due or not, then purge what
 * it emptied (as MEMORY PURGE would) so that the caller sees the memory
 * given back at once instead of over jemalloc's decay time; for tests and
 * benchmarks. Replies with the number of keys relocated (so far). */
static int CompactCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc > 2) return RedisModule_WrongArity(ctx);
    long long ms = 10000;
    if (argc == 2 && (RedisModule_StringToLongLong(argv[1], &ms) != REDISMODULE_OK || ms < 0))
        return RedisModule_ReplyWithError(ctx, "ERR max-ms must be a non-negative integer");
    if (!hm.mallctl)
        return RedisModule_ReplyWithError(ctx, "ERR compaction needs jemalloc's mallctl");
    if (hm.state != ST_NORMAL)
        return RedisModule_ReplyWithError(ctx, "ERR compaction is paused until APPASSIST.RESUME");
    readBackSettle();
    uint64_t deadline = nowUs() + (uint64_t)ms * 1000;
    long long passes = hm.compactions;
    hm.compact_wanted = 1;
    do {
        compactSlice(nowUs() + (uint64_t)hm.slice_us < deadline ? nowUs() + (uint64_t)hm.slice_us
                                                                 : deadline);
    } while (hm.compactions == passes && hm.mallctl && nowUs() < deadline);
    memoryPurge(ctx);
    return RedisModule_ReplyWithLongLong(ctx, hm.compact_relocated);
}

/* APPASSIST.ISCOLD key: 1 if the key is in the arena (declares no key, so
 * the filter does not promote it). */
static int IsColdCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 2) return RedisModule_WrongArity(ctx);
    size_t l;
    const char *k = RedisModule_StringPtrLen(argv[1], &l);
    ColdRef ref;
    return RedisModule_ReplyWithLongLong(ctx, arenaLookup(hm.arena, k, l, &ref) == 1);
}

/* ------------------------------------------------------------ whole keyspace */

static int wrongArity(RedisModuleCtx *ctx, const char *cmd) {
    char msg[96];
    snprintf(msg, sizeof(msg), "ERR wrong number of arguments for '%s' command", cmd);
    return RedisModule_ReplyWithError(ctx, msg);
}

static void forwardArray(RedisModuleCtx *ctx, RedisModuleCallReply *r, long *n) {
    size_t len = RedisModule_CallReplyLength(r);
    for (size_t i = 0; i < len; i++) {
        RedisModuleCallReply *e = RedisModule_CallReplyArrayElement(r, i);
        size_t sl;
        const char *s = RedisModule_CallReplyStringPtr(e, &sl);
        RedisModule_ReplyWithStringBuffer(ctx, s, sl);
        (*n)++;
    }
}

typedef struct MatchCtx {
    RedisModuleCtx *ctx;
    const char *pat;
    size_t patlen;
    int all;
    long long now;
    long n;
} MatchCtx;

static void matchCb(void *priv, const ColdItem *it) {
    MatchCtx *m = priv;
    if (it->expire != ARENA_NO_EXPIRE && it->expire <= m->now) return;
    if (!m->all && !stringmatchlen(m->pat, (int)m->patlen, it->key, (int)it->klen, 0)) return;
    RedisModule_ReplyWithStringBuffer(m->ctx, it->key, it->klen);
    m->n++;
}

/* KEYS pattern, when something is cold: the stock reply plus matching cold
 * keys (db 0 only). */
static int KeysCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 2) return wrongArity(ctx, "keys");
    RedisModuleCallReply *r = RedisModule_Call(ctx, "KEYS", "s", argv[1]);
    if (!r || RedisModule_CallReplyType(r) != REDISMODULE_REPLY_ARRAY) {
        if (r) {
            RedisModule_ReplyWithCallReply(ctx, r);
            RedisModule_FreeCallReply(r);
            return REDISMODULE_OK;
        }
        return RedisModule_ReplyWithError(ctx, "ERR KEYS failed");
    }
    long n = 0;
    RedisModule_ReplyWithArray(ctx, REDISMODULE_POSTPONED_LEN);
    forwardArray(ctx, r, &n);
    RedisModule_FreeCallReply(r);
    if (RedisModule_GetSelectedDb(ctx) == 0) {
        MatchCtx m = {ctx, NULL, 0, 0, nowMs(), 0};
        m.pat = RedisModule_StringPtrLen(argv[1], &m.patlen);
        m.all = m.patlen == 1 && m.pat[0] == '*';
        uint64_t cur = 0;
        do {
            cur = arenaIterate(hm.arena, cur, 1u << 20, matchCb, &m);
        } while (cur && cur != UINT64_MAX);
        n += m.n;
    }
    RedisModule_ReplySetArrayLength(ctx, n);
    return REDISMODULE_OK;
}

static int DbsizeCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return wrongArity(ctx, "dbsize");
    long long n = (long long)RedisModule_DbSize(ctx);
    if (RedisModule_GetSelectedDb(ctx) == 0) n += (long long)arenaCount(hm.arena);
    return RedisModule_ReplyWithLongLong(ctx, n);
}

/* A SCAN goes through the keyspace, then the arena (ScanCommand). A cold
 * key promoted meanwhile leaves the arena for the keyspace, maybe for a
 * bucket the keyspace cursor has passed: neither phase would return it,
 * although it was there all along. So while SCANs are served (a call on db
 * 0 within HM_SCAN_GRACE_US), every promotion is logged with the arena
 * cursor of the item it was, and the arena phase also returns the logged
 * keys whose place lies in the range a call covers. Cursors are the
 * client's, so nothing says when an iteration ends: the log goes when no
 * SCAN came for the grace. An iteration that waits longer than that
 * between two calls, or meets more than HM_SCAN_LOG_MAX promotions, can
 * miss such keys (scan_log_dropped counts the latter). */
typedef struct ScanLogEntry {
    RedisModuleString *key;
    uint64_t pos;               /* arenaCursorOf() of the item it was */
} ScanLogEntry;

static void scanLogClear(void) {
    for (size_t i = 0; i < hm.scan_log_n; i++) RedisModule_FreeString(NULL, hm.scan_log[i].key);
    RedisModule_Free(hm.scan_log);
    hm.scan_log = NULL;
    hm.scan_log_n = hm.scan_log_cap = 0;
}

/* 1 if a SCAN may be going on: one was served within the grace. */
static int scanRecent(void) {
    if (hm.scan_seen_us && nowUs() - hm.scan_seen_us > HM_SCAN_GRACE_US) {
        hm.scan_seen_us = 0;
        scanLogClear();
    }
    return hm.scan_seen_us != 0;
}

/* Key 'k', a cold item at arena cursor 'pos', is leaving the arena for the
 * keyspace. */
static void scanLogNote(const char *k, size_t klen, uint64_t pos) {
    if (!scanRecent()) return;
    if (hm.scan_log_n == HM_SCAN_LOG_MAX) {
        hm.scan_log_dropped++;
        return;
    }
    if (hm.scan_log_n == hm.scan_log_cap) {
        hm.scan_log_cap = hm.scan_log_cap ? hm.scan_log_cap * 2 : 64;
        hm.scan_log = RedisModule_Realloc(hm.scan_log, hm.scan_log_cap * sizeof(*hm.scan_log));
    }
    hm.scan_log[hm.scan_log_n++] = (ScanLogEntry){RedisModule_CreateString(NULL, k, klen), pos};
    hm.scan_log_sorted = 0;
}

static int scanLogCmp(const void *a, const void *b) {
    uint64_t x = ((const ScanLogEntry *)a)->pos, y = ((const ScanLogEntry *)b)->pos;
    return x < y ? -1 : x > y;
}

/* Reply with the logged keys of arena cursors [from, to) (to 0: to the
 * end) that match and are still in the keyspace. Returns how many. The log
 * is sorted by position when a call needs it after appends, so that a call
 * costs its own range, not the whole log (SCAN's COUNT is 10 by default). */
static long scanLogReply(RedisModuleCtx *ctx, uint64_t from, uint64_t to, const MatchCtx *m,
                         int strings_only) {
    if (!hm.scan_log_sorted) {
        qsort(hm.scan_log, hm.scan_log_n, sizeof(*hm.scan_log), scanLogCmp);
        hm.scan_log_sorted = 1;
    }
    size_t lo = 0, hi = hm.scan_log_n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (hm.scan_log[mid].pos < from) lo = mid + 1;
        else hi = mid;
    }
    long n = 0;
    for (size_t i = lo; i < hm.scan_log_n; i++) {
        const ScanLogEntry *e = &hm.scan_log[i];
        if (to && e->pos >= to) break;
        size_t kl;
        const char *k = RedisModule_StringPtrLen(e->key, &kl);
        if (!m->all && !stringmatchlen(m->pat, (int)m->patlen, k, (int)kl, 0)) continue;
        /* write mode: no keyspace hit or miss counted, as in openIfAbsent */
        RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, e->key, REDISMODULE_WRITE |
                                                                   REDISMODULE_OPEN_KEY_NOTOUCH);
        int type = RedisModule_KeyType(kh);
        RedisModule_CloseKey(kh);
        if (type == REDISMODULE_KEYTYPE_EMPTY ||
            (strings_only && type != REDISMODULE_KEYTYPE_STRING))
            continue;
        RedisModule_ReplyWithString(ctx, e->key);
        n++;
    }
    return n;
}

/* SCAN cursor [MATCH p] [COUNT n] [TYPE t]. Two phases: the stock SCAN over
 * the keyspace (cursors passed through unchanged), then the arena in its
 * creation order, with bit 63 of the cursor set. Demoted keys move from the
 * keyspace to the arena, i.e. forward in the iteration, so they are still
 * returned; promoted keys come from the SCAN log (above). */
static int ScanCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2) return wrongArity(ctx, "scan");
    size_t cl;
    const char *cs = RedisModule_StringPtrLen(argv[1], &cl);
    char *end;
    errno = 0;
    unsigned long long cursor = strtoull(cs, &end, 10);
    int phase1 = cl > 0 && *end == '\0' && errno == 0 && (cursor & HM_SCAN_PHASE_BIT) &&
                 cs[0] != '-' && cs[0] != '+';
    int db0 = RedisModule_GetSelectedDb(ctx) == 0;
    if (db0) {
        /* Visited keys go back first: a lent item is not iterated. */
        readBackSettle();
        scanRecent();
        hm.scan_seen_us = nowUs();
    }
    if (!phase1 || !db0) {
        RedisModuleCallReply *r = RedisModule_Call(ctx, "SCAN", "v", argv + 1, (size_t)(argc - 1));
        if (!r) return RedisModule_ReplyWithError(ctx, "ERR SCAN failed");
        if (RedisModule_CallReplyType(r) != REDISMODULE_REPLY_ARRAY || !db0) {
            RedisModule_ReplyWithCallReply(ctx, r);
            RedisModule_FreeCallReply(r);
            return REDISMODULE_OK;
        }
        RedisModuleCallReply *c = RedisModule_CallReplyArrayElement(r, 0);
        size_t nl;
        const char *next = RedisModule_CallReplyStringPtr(c, &nl);
        RedisModule_ReplyWithArray(ctx, 2);
        if (nl == 1 && next[0] == '0' && (arenaCount(hm.arena) || hm.scan_log_n)) {
            char buf[32];
            int bl = snprintf(buf, sizeof(buf), "%llu", (unsigned long long)HM_SCAN_PHASE_BIT);
            RedisModule_ReplyWithStringBuffer(ctx, buf, (size_t)bl);
        } else {
            RedisModule_ReplyWithStringBuffer(ctx, next, nl);
        }
        long n = 0;
        RedisModule_ReplyWithArray(ctx, REDISMODULE_POSTPONED_LEN);
        forwardArray(ctx, RedisModule_CallReplyArrayElement(r, 1), &n);
        RedisModule_ReplySetArrayLength(ctx, n);
        RedisModule_FreeCallReply(r);
        return REDISMODULE_OK;
    }
    /* Arena phase: parse options the way scanGenericCommand does. */
    long long count = 10;
    const char *pat = NULL, *type = NULL;
    size_t patlen = 0, typelen = 0;
    for (int i = 2; i < argc; i += 2) {
        size_t ol;
        const char *o = RedisModule_StringPtrLen(argv[i], &ol);
        if (i + 1 >= argc) return RedisModule_ReplyWithError(ctx, "ERR syntax error");
        if (cmdIs(o, ol, "count")) {
            if (RedisModule_StringToLongLong(argv[i + 1], &count) != REDISMODULE_OK)
                return RedisModule_ReplyWithError(ctx, "ERR value is not an integer or out of range");
            if (count < 1) return RedisModule_ReplyWithError(ctx, "ERR syntax error");
        } else if (cmdIs(o, ol, "match")) {
            pat = RedisModule_StringPtrLen(argv[i + 1], &patlen);
        } else if (cmdIs(o, ol, "type")) {
            type = RedisModule_StringPtrLen(argv[i + 1], &typelen);
        } else {
            return RedisModule_ReplyWithError(ctx, "ERR syntax error");
        }
    }
    MatchCtx m = {ctx, pat, patlen, pat == NULL || (patlen == 1 && pat[0] == '*'), nowMs(), 0};
    int type_ok = type == NULL || cmdIs(type, typelen, "string");
    uint64_t acur = cursor & ~HM_SCAN_PHASE_BIT;
    RedisModule_ReplyWithArray(ctx, 2);
    if (!type_ok) {
        /* no cold item can match: finish the iteration */
        RedisModule_ReplyWithSimpleString(ctx, "0");
        RedisModule_ReplyWithArray(ctx, 0);
        return REDISMODULE_OK;
    }
    /* The reply's cursor comes first: collect keys, then reply. */
    KeyList l = {0};
    uint64_t next = arenaIterate(hm.arena, acur, (unsigned)(count > 100000 ? 100000 : count),
                                 collectCb, &l);
    if (next == UINT64_MAX) next = 0;
    char buf[32];
    int bl = snprintf(buf, sizeof(buf), "%llu",
                      next ? (unsigned long long)(next | HM_SCAN_PHASE_BIT) : 0ULL);
    RedisModule_ReplyWithStringBuffer(ctx, buf, (size_t)bl);
    long n = 0;
    RedisModule_ReplyWithArray(ctx, REDISMODULE_POSTPONED_LEN);
    for (size_t i = 0; i < l.n; i++) {
        size_t kl;
        const char *k = RedisModule_StringPtrLen(l.v[i], &kl);
        ColdRef ref;
        int keep = m.all || stringmatchlen(pat, (int)patlen, k, (int)kl, 0);
        if (keep && arenaLookup(hm.arena, k, kl, &ref) == 1) {
            ColdItem it;
            if (arenaRead(hm.arena, ref, &it) == 0) {
                if (it.expire != ARENA_NO_EXPIRE && it.expire <= m.now) keep = 0;
                arenaItemRelease(&it);
            }
        }
        if (keep) {
            RedisModule_ReplyWithString(ctx, l.v[i]);
            n++;
        }
        RedisModule_FreeString(hm.dctx, l.v[i]);
    }
    RedisModule_Free(l.v);
    n += scanLogReply(ctx, acur, next, &m, type != NULL);
    RedisModule_ReplySetArrayLength(ctx, n);
    return REDISMODULE_OK;
}

/* ------------------------------------------------------------ host port */

static void portClose(int retry);
static void portOpen(void);

static void portRetryTimer(RedisModuleCtx *ctx, void *data) {
    (void)ctx;
    (void)data;
    hm.port_timer_set = 0;
    portOpen();
}

static void portScheduleRetry(void) {
    if (hm.port_timer_set) return;
    hm.port_timer = RedisModule_CreateTimer(hm.dctx, hm.port_retry_ms, portRetryTimer, NULL);
    hm.port_timer_set = 1;
}

static void portFlush(void);

static void portWritable(int fd, void *ud, int mask) {
    (void)fd;
    (void)ud;
    (void)mask;
    portFlush();
}

/* Write what we can; keep the rest and wait for the fd to be writable. */
static void portFlush(void) {
    while (hm.port_out.len) {
        ssize_t n = write(hm.port_fd, hm.port_out.p, hm.port_out.len);
        if (n > 0) {
            respBufConsume(&hm.port_out, (size_t)n);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) {
            RedisModule_EventLoopAdd(hm.port_fd, REDISMODULE_EVENTLOOP_WRITABLE, portWritable, NULL);
            return;
        }
        portClose(1);     /* host went away */
        return;
    }
    RedisModule_EventLoopDel(hm.port_fd, REDISMODULE_EVENTLOOP_WRITABLE);
}

static void portExecute(const RespRequest *req, RespBuf *out) {
    Fields fs = {0};
    const char *c = req->argv[0];
    size_t cl = req->argl[0];
    hm.port_requests++;
    if (req->argc == 1 && cmdIs(c, cl, "ping")) {
        respAddSimple(out, "PONG");
        return;
    }
    if (cmdIs(c, cl, "appassist.prepare") && req->argc <= 2) {
        long long deadline = 0;
        if (req->argc == 2) {
            char *end;
            errno = 0;
            deadline = strtoll(req->argv[1], &end, 10);
            if (req->argl[1] == 0 || *end || errno || deadline < 0 || deadline > 86400000LL) {
                respAddError(out, "ERR deadline-ms must be an integer between 0 and 86400000");
                hm.port_errors++;
                return;
            }
        }
        prepareFields(hm.dctx, &fs, deadline);
    } else if (cmdIs(c, cl, "appassist.resume") && req->argc == 1) {
        resumeFields(hm.dctx, &fs, 0);
    } else if (cmdIs(c, cl, "appassist.abort") && req->argc == 1) {
        resumeFields(hm.dctx, &fs, 1);
    } else if (cmdIs(c, cl, "appassist.status") && req->argc == 1) {
        statusFields(hm.dctx, &fs);
    } else {
        hm.port_errors++;
        respAddError(out, "ERR unknown command or wrong number of arguments on the appassist port");
        return;
    }
    portRenderFields(out, &fs);
}

static void portReadable(int fd, void *ud, int mask) {
    (void)ud;
    (void)mask;
    for (;;) {
        char tmp[HM_PORT_INBUF];
        ssize_t n = read(fd, tmp, sizeof(tmp));
        if (n == 0) { portClose(1); return; }            /* EOF: host gone */
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN) { portClose(1); return; }   /* EIO: pty master closed */
            /* Nothing to read. A virtio port whose host side is gone
             * reports POLLHUP; epoll would wake us forever. */
            struct pollfd p = {fd, POLLIN, 0};
            if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)) && !(p.revents & POLLIN)) {
                portClose(1);
                return;
            }
            hm.port_discarding = 0;
            break;
        }
        if (hm.port_discarding) continue;
        size_t off = 0;
        while (off < (size_t)n) {
            size_t take = sizeof(hm.port_in) - hm.port_inlen;
            if (take > (size_t)n - off) take = (size_t)n - off;
            memcpy(hm.port_in + hm.port_inlen, tmp + off, take);
            hm.port_inlen += take;
            off += take;
            for (;;) {
                static RespRequest req;
                size_t used = 0;
                const char *err = NULL;
                RespParse pr = respParseRequest(hm.port_in, hm.port_inlen, &req, &used, &err);
                if (pr == RESP_NEED_MORE) {
                    if (hm.port_inlen == sizeof(hm.port_in)) {
                        pr = RESP_ERROR;
                        err = "request too big";
                    } else {
                        break;
                    }
                }
                if (pr == RESP_ERROR) {
                    char msg[128];
                    snprintf(msg, sizeof(msg), "ERR Protocol error: %s", err);
                    hm.port_errors++;
                    respAddError(&hm.port_out, msg);
                    hm.port_inlen = 0;
                    hm.port_discarding = 1;     /* drop the rest of this burst */
                    off = (size_t)n;
                    break;
                }
                memmove(hm.port_in, hm.port_in + used, hm.port_inlen - used);
                hm.port_inlen -= used;
                if (req.argc > 0) portExecute(&req, &hm.port_out);
            }
        }
        if (hm.port_fd < 0) return;
    }
    if (hm.port_fd >= 0 && hm.port_out.len) portFlush();
}

static void portClose(int retry) {
    if (hm.port_fd >= 0) {
        RedisModule_EventLoopDel(hm.port_fd, REDISMODULE_EVENTLOOP_READABLE | REDISMODULE_EVENTLOOP_WRITABLE);
        close(hm.port_fd);
        hm.port_fd = -1;
    }
    hm.port_inlen = 0;
    hm.port_discarding = 0;
    hm.port_out.len = 0;
    if (retry) portScheduleRetry();
}

/* Open the configured port. A missing device is not an error: retry later. */
static void portOpen(void) {
    if (hm.port_fd >= 0) return;
    size_t pl;
    const char *p = RedisModule_StringPtrLen(hm.port_path, &pl);
    if (pl == 0) return;                     /* disabled */
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%.*s", (int)pl, p);
    struct stat st;
    int fd = -1;
    if (stat(path, &st) == 0 && S_ISSOCK(st.st_mode)) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        if (strlen(path) < sizeof(sa.sun_path)) {
            strcpy(sa.sun_path, path);
            fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                close(fd);
                fd = -1;
            }
        }
    } else {
        fd = open(path, O_RDWR | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd >= 0 && isatty(fd)) {
            struct termios t;
            if (tcgetattr(fd, &t) == 0) {
                cfmakeraw(&t);
                tcsetattr(fd, TCSANOW, &t);
            }
        }
    }
    if (fd < 0) {
        portScheduleRetry();
        return;
    }
    hm.port_fd = fd;
    hm.port_opens++;
    if (RedisModule_EventLoopAdd(fd, REDISMODULE_EVENTLOOP_READABLE, portReadable, NULL) != REDISMODULE_OK) {
        RedisModule_Log(hm.dctx, "warning", "appassist: cannot watch port %s: %s", path, strerror(errno));
        portClose(1);
        return;
    }
    /* A virtio port without a host reads EOF at once and is retried every
     * port-retry-ms: only the first open is worth a notice. */
    RedisModule_Log(hm.dctx, hm.port_opens == 1 ? "notice" : "verbose",
                    "appassist: port %s open", path);
}

/* ------------------------------------------------------------ configs */

static long long *numericConfig(const char *name) {
    if (!strcasecmp(name, "planned-memory")) return &hm.planned_memory;
    if (!strcasecmp(name, "hot-percent")) return &hm.hot_percent;
    if (!strcasecmp(name, "min-idle-ms")) return &hm.min_idle_ms;
    if (!strcasecmp(name, "slice-us")) return &hm.slice_us;
    if (!strcasecmp(name, "interval-ms")) return &hm.interval_ms;
    if (!strcasecmp(name, "port-retry-ms")) return &hm.port_retry_ms;
    if (!strcasecmp(name, "compact-percent")) return &hm.compact_percent;
    if (!strcasecmp(name, "promote-window-ms")) return &hm.promote_window_ms;
    return NULL;
}

static long long getNumeric(const char *name, void *priv) {
    (void)priv;
    return *numericConfig(name);
}

static int setNumeric(const char *name, long long v, void *priv, RedisModuleString **err) {
    (void)priv;
    (void)err;
    *numericConfig(name) = v;
    /* a new budget takes effect with a fresh pass */
    hm.next_pass_us = 0;
    hm.fits_below = 0;
    if (!strcasecmp(name, "hot-percent") || !strcasecmp(name, "planned-memory")) {
        hm.threshold = hm.hot_percent == 0 ? 0 : HM_BUCKETS;
        hm.keep_at_threshold = 0;
    }
    return REDISMODULE_OK;
}

static RedisModuleString *getString(const char *name, void *priv) {
    (void)priv;
    return !strcasecmp(name, "port-path") ? hm.port_path : hm.spill_path;
}

static int setString(const char *name, RedisModuleString *v, void *priv, RedisModuleString **err) {
    (void)priv;
    RedisModuleString **slot = !strcasecmp(name, "port-path") ? &hm.port_path : &hm.spill_path;
    if (slot == &hm.spill_path) {
        size_t l;
        RedisModule_StringPtrLen(v, &l);
        if (l == 0 || l >= PATH_MAX) {
            *err = RedisModule_CreateString(NULL, "spill-path must be a non-empty path", 35);
            return REDISMODULE_ERR;
        }
        if (arenaHasSpilled(hm.arena)) {
            *err = RedisModule_CreateString(NULL, "cannot change spill-path while items are spilled", 48);
            return REDISMODULE_ERR;
        }
    }
    if (*slot) RedisModule_FreeString(NULL, *slot);
    RedisModule_RetainString(NULL, v);
    *slot = v;
    return REDISMODULE_OK;
}

static int applyPort(RedisModuleCtx *ctx, void *priv, RedisModuleString **err) {
    (void)ctx;
    (void)priv;
    (void)err;
    if (!hm.loaded) return REDISMODULE_OK;
    portClose(0);
    if (hm.port_timer_set) {
        RedisModule_StopTimer(hm.dctx, hm.port_timer, NULL);
        hm.port_timer_set = 0;
    }
    portOpen();
    return REDISMODULE_OK;
}

static int getEnum(const char *name, void *priv) {
    (void)name;
    return *(int *)priv;
}

static int setEnum(const char *name, int v, void *priv, RedisModuleString **err) {
    (void)name;
    (void)err;
    *(int *)priv = v;
    return REDISMODULE_OK;
}

static int getBool(const char *name, void *priv) {
    (void)name;
    return *(int *)priv;
}

static int setBool(const char *name, int v, void *priv, RedisModuleString **err) {
    (void)name;
    (void)err;
    *(int *)priv = v;
    return REDISMODULE_OK;
}

static int registerConfigs(RedisModuleCtx *ctx) {
    struct { const char *name; long long def, min, max; unsigned flags; } nums[] = {
        {"planned-memory", 0, 0, LLONG_MAX, REDISMODULE_CONFIG_MEMORY},
        {"hot-percent", 30, 0, 100, 0},
        {"min-idle-ms", 10000, 0, 86400000LL, 0},
        {"slice-us", 250, 50, 1000000, 0},
        {"interval-ms", 3, 1, 10000, 0},
        {"port-retry-ms", 200, 10, 3600000, 0},
        {"compact-percent", 10, 0, 100, 0},
        {"promote-window-ms", 1000, 0, 3600000, 0},
    };
    for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++)
        if (RedisModule_RegisterNumericConfig(ctx, nums[i].name, nums[i].def,
                nums[i].flags, nums[i].min, nums[i].max, getNumeric, setNumeric,
                NULL, NULL) == REDISMODULE_ERR)
            return REDISMODULE_ERR;
    if (RedisModule_RegisterEnumConfig(ctx, "on-prepare", POLICY_DROP, REDISMODULE_CONFIG_DEFAULT,
            policy_names, policy_values, 3, getEnum, setEnum, NULL, &hm.policy) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterEnumConfig(ctx, "lazy-drop", TRI_AUTO, REDISMODULE_CONFIG_DEFAULT,
            tri_names, tri_values, 3, getEnum, setEnum, NULL, &hm.lazy_drop) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterEnumConfig(ctx, "zero-freed", TRI_AUTO, REDISMODULE_CONFIG_DEFAULT,
            tri_names, tri_values, 3, getEnum, setEnum, applyZeroFreed, &hm.zero_freed) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterBoolConfig(ctx, "demote", 1, REDISMODULE_CONFIG_DEFAULT,
            getBool, setBool, NULL, &hm.demote) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterStringConfig(ctx, "port-path", DEFAULT_PORT_PATH, REDISMODULE_CONFIG_DEFAULT,
            getString, setString, applyPort, NULL) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterStringConfig(ctx, "spill-path", DEFAULT_SPILL_PATH, REDISMODULE_CONFIG_DEFAULT,
            getString, setString, NULL, NULL) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    return RedisModule_LoadConfigs(ctx);
}

/* ------------------------------------------------------------ RDB aux */

typedef struct SaveCtx {
    RedisModuleIO *rdb;
} SaveCtx;

static void saveCb(void *priv, const ColdItem *it) {
    SaveCtx *s = priv;
    RedisModule_SaveUnsigned(s->rdb, 1);
    RedisModule_SaveStringBuffer(s->rdb, it->key, it->klen);
    RedisModule_SaveStringBuffer(s->rdb, it->val, it->vlen);
    RedisModule_SaveSigned(s->rdb, it->expire);
}

/* Cold items are saved after the keyspace (encoding version 1): per item
 * 1, key, value, expire (ms, -1 none); then 0. No count up front, so an
 * I/O error reading spilled items still ends a well-formed field (the
 * missing items are logged). Runs in the fork child for BGSAVE, in-process
 * for SAVE and DEBUG RELOAD. */
static void auxSave(RedisModuleIO *rdb, int when) {
    (void)when;
    SaveCtx s = {rdb};
    uint64_t cur = 0;
    do {
        cur = arenaIterate(hm.arena, cur, 1u << 20, saveCb, &s);
    } while (cur && cur != UINT64_MAX);
    RedisModule_SaveUnsigned(rdb, 0);
    if (cur == UINT64_MAX)
        RedisModule_LogIOError(rdb, "warning", "appassist: reading spilled cold items failed: "
                               "the RDB lacks some cold items");
}

/* Loaded data is hostile: no allocation sized by the count, I/O checked
 * after every load, values validated before they enter the arena. */
static int auxLoad(RedisModuleIO *rdb, int encver, int when) {
    (void)when;
    if (encver != HM_AUX_ENCVER) {
        RedisModule_LogIOError(rdb, "warning", "appassist: unknown aux encoding version %d", encver);
        return REDISMODULE_ERR;
    }
    RedisModuleCtx *ctx = RedisModule_GetContextFromIO(rdb);
    for (;;) {
        uint64_t more = RedisModule_LoadUnsigned(rdb);
        if (RedisModule_IsIOError(rdb) || more > 1) return REDISMODULE_ERR;
        if (more == 0) break;
        size_t kl, vl;
        char *k = RedisModule_LoadStringBuffer(rdb, &kl);
        if (RedisModule_IsIOError(rdb)) return REDISMODULE_ERR;
        char *v = RedisModule_LoadStringBuffer(rdb, &vl);
        if (RedisModule_IsIOError(rdb)) { RedisModule_Free(k); return REDISMODULE_ERR; }
        int64_t expire = RedisModule_LoadSigned(rdb);
        int rc = REDISMODULE_OK;
        if (RedisModule_IsIOError(rdb) || expire < -1) {
            rc = REDISMODULE_ERR;
        } else {
            RedisModuleString *key = RedisModule_CreateString(ctx, k, kl);
            ColdRef ref;
            if (RedisModule_KeyExists(hm.dctx, key) || arenaLookup(hm.arena, k, kl, &ref) != 0) {
                RedisModule_LogIOError(rdb, "warning", "appassist: duplicate cold key in RDB");
                rc = REDISMODULE_ERR;
            } else if (arenaInsert(hm.arena, k, kl, v, vl, expire) < 0) {
                RedisModule_LogIOError(rdb, "warning", "appassist: cannot load cold item: %s", strerror(errno));
                rc = REDISMODULE_ERR;
            }
            RedisModule_FreeString(ctx, key);
        }
        RedisModule_Free(k);
        RedisModule_Free(v);
        if (rc != REDISMODULE_OK) return rc;
    }
    return REDISMODULE_OK;
}

/* The type exists only for its aux fields; no key ever holds it. */
static void *typeLoad(RedisModuleIO *rdb, int encver) {
    (void)rdb;
    (void)encver;
    return NULL;
}
static void typeSave(RedisModuleIO *rdb, void *value) { (void)rdb; (void)value; }
static void typeFree(void *value) { (void)value; }

/* ------------------------------------------------------------ events, INFO */

static void onRoleChanged(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)ctx;
    (void)e;
    (void)data;
    hm.replica = sub == REDISMODULE_EVENT_REPLROLECHANGED_NOW_REPLICA;
}

static void onFlush(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)ctx;
    (void)e;
    RedisModuleFlushInfo *fi = data;
    if (sub == REDISMODULE_SUBEVENT_FLUSHDB_START && (fi->dbnum == -1 || fi->dbnum == 0)) {
        arenaDrop(hm.arena, NULL);
        scanLogClear();
    }
}

/* A pure AOF rewrite (aof-use-rdb-preamble no) writes the keyspace only:
 * no aux data. The start event runs in the rewriting child (or in-process
 * for a synchronous rewrite) just before the keyspace is written, so the
 * cold items are promoted there and the rewritten AOF holds them. In the
 * child this only touches its copy-on-write copy of the data. */
static void onPersistence(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)e;
    (void)data;
    if (sub != REDISMODULE_SUBEVENT_PERSISTENCE_AOF_START &&
        sub != REDISMODULE_SUBEVENT_PERSISTENCE_SYNC_AOF_START)
        return;
    if (arenaCount(hm.arena) == 0) return;
    int preamble = 1;
    RedisModuleCallReply *r = RedisModule_Call(ctx, "CONFIG", "cc", "GET", "aof-use-rdb-preamble");
    if (r && RedisModule_CallReplyType(r) == REDISMODULE_REPLY_ARRAY &&
        RedisModule_CallReplyLength(r) == 2) {
        size_t l;
        const char *v = RedisModule_CallReplyStringPtr(RedisModule_CallReplyArrayElement(r, 1), &l);
        preamble = !(l == 2 && strncasecmp(v, "no", 2) == 0);
    }
    if (r) RedisModule_FreeCallReply(r);
    if (!preamble) promoteAll();
}

static void onShutdown(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)ctx;
    (void)e;
    (void)sub;
    (void)data;
    portClose(0);
    arenaFree(hm.arena);   /* unlinks the spill file */
    hm.arena = arenaCreate(0);
}

static void infoFunc(RedisModuleInfoCtx *ctx, int for_crash_report) {
    (void)for_crash_report;
    ArenaStats st;
    arenaGetStats(hm.arena, &st);
    RedisModule_InfoAddSection(ctx, "");
    RedisModule_InfoAddFieldCString(ctx, "state", (char *)state_names[hm.state]);
    RedisModule_InfoAddFieldCString(ctx, "on_prepare", (char *)policy_names[hm.policy]);
    RedisModule_InfoAddFieldULongLong(ctx, "hot_items", hm.pass_hot_items);
    RedisModule_InfoAddFieldULongLong(ctx, "hot_bytes", hm.pass_hot_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "cold_items", st.items);
    RedisModule_InfoAddFieldULongLong(ctx, "cold_bytes", st.item_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_chunks", st.chunks);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_chunks_in_memory", st.chunks_mem);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_mapped_bytes", st.mapped_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_index_bytes", st.index_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "spilled_bytes", st.spilled_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_dead_bytes", st.dead_bytes);
    RedisModule_InfoAddFieldLongLong(ctx, "arena_reclaims", hm.reclaims);
    RedisModule_InfoAddFieldLongLong(ctx, "arena_reclaim_moved", hm.reclaim_moved);
    RedisModule_InfoAddFieldLongLong(ctx, "demotion_threshold", hm.threshold);
    RedisModule_InfoAddFieldULongLong(ctx, "passes", hm.passes);
    RedisModule_InfoAddFieldULongLong(ctx, "skipped_passes", hm.skipped_passes);
    RedisModule_InfoAddFieldLongLong(ctx, "demotions", hm.demotions);
    RedisModule_InfoAddFieldLongLong(ctx, "promotions", hm.promotions);
    RedisModule_InfoAddFieldLongLong(ctx, "visits", hm.visits);
    RedisModule_InfoAddFieldLongLong(ctx, "promotions_refused", hm.promotions_refused);
    RedisModule_InfoAddFieldLongLong(ctx, "expired_promotions", hm.expired_promotions);
    RedisModule_InfoAddFieldULongLong(ctx, "scan_log_items", hm.scan_log_n);
    RedisModule_InfoAddFieldLongLong(ctx, "scan_log_dropped", hm.scan_log_dropped);
    RedisModule_InfoAddFieldLongLong(ctx, "prepares", hm.prepares);
    RedisModule_InfoAddFieldLongLong(ctx, "resumes", hm.resumes);
    RedisModule_InfoAddFieldLongLong(ctx, "aborts", hm.aborts);
    RedisModule_InfoAddFieldLongLong(ctx, "dropped_items", hm.dropped_items);
    RedisModule_InfoAddFieldLongLong(ctx, "compaction", hm.mallctl != NULL && hm.compact_percent > 0);
    RedisModule_InfoAddFieldLongLong(ctx, "compaction_running", hm.ccursor != NULL);
    RedisModule_InfoAddFieldULongLong(ctx, "compaction_pending_bytes", hm.compact_pending);
    RedisModule_InfoAddFieldLongLong(ctx, "compaction_checked_frag_bytes", hm.last_frag_bytes);
    RedisModule_InfoAddFieldLongLong(ctx, "compactions", hm.compactions);
    RedisModule_InfoAddFieldLongLong(ctx, "relocations", hm.relocations);
    RedisModule_InfoAddFieldLongLong(ctx, "relocation_skips", hm.compact_skipped);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_relocated", hm.last_compact_relocated);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_time_us", hm.last_compact_time_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_busy_us", hm.last_compact_busy_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_slice_max_us", hm.last_compact_slice_max_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_rss_before", hm.last_compact_rss_before);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_rss_after", hm.last_compact_rss_after);
    RedisModule_InfoAddFieldLongLong(ctx, "background_slices", hm.slices);
    RedisModule_InfoAddFieldLongLong(ctx, "background_bites", hm.bites);
    RedisModule_InfoAddFieldULongLong(ctx, "background_step_max_us", hm.step_max_us);
    RedisModule_InfoAddFieldULongLong(ctx, "background_step_max_cpu_us", hm.step_max_cpu_us);
    RedisModule_InfoAddFieldULongLong(ctx, "background_cpu_us", hm.bg_cpu_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_freed_bytes", hm.last_freed);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_items", hm.last_items);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_time_us", hm.last_time_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_rss_before", hm.last_rss_before);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_rss_after", hm.last_rss_after);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_complete", hm.last_complete);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_lazy", hm.last_lazy);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_zeroed_bytes", hm.last_zeroed);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_clear_us",
                                     __atomic_load_n(&last_clear_us, __ATOMIC_RELAXED));
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_unmap_us",
                                     __atomic_load_n(&last_unmap_us, __ATOMIC_RELAXED));
    uint64_t zbytes, zpurges;
    zeroFreeStats(&zbytes, &zpurges);
    RedisModule_InfoAddFieldLongLong(ctx, "zero_freed_active", zeroFreeEnabled());
    RedisModule_InfoAddFieldLongLong(ctx, "zero_freed_window", hm.zero_window);
    RedisModule_InfoAddFieldULongLong(ctx, "zero_freed_bytes", zbytes);
    RedisModule_InfoAddFieldULongLong(ctx, "zero_freed_purges", zpurges);
    RedisModule_InfoAddFieldLongLong(ctx, "port_connected", hm.port_fd >= 0);
    RedisModule_InfoAddFieldLongLong(ctx, "port_opens", hm.port_opens);
    RedisModule_InfoAddFieldLongLong(ctx, "port_requests", hm.port_requests);
    RedisModule_InfoAddFieldLongLong(ctx, "port_errors", hm.port_errors);
}

/* ------------------------------------------------------------ OnLoad */

static int createCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn,
                         const char *flags, const char *summary, int arity) {
    if (RedisModule_CreateCommand(ctx, name, fn, flags, 0, 0, 0) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    RedisModuleCommand *cmd = RedisModule_GetCommand(ctx, name);
    RedisModuleCommandInfo info = {
        .version = REDISMODULE_COMMAND_INFO_VERSION,
        .summary = summary,
        .since = "1.0.0",
        .arity = arity,
    };
    return RedisModule_SetCommandInfo(cmd, &info);
}

__attribute__((visibility("default")))
int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (RedisModule_Init(ctx, "appassist", HM_VERSION, REDISMODULE_APIVER_1) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (argc != 0) {
        RedisModule_Log(ctx, "warning", "appassist: takes no module arguments; use appassist.* configs");
        return REDISMODULE_ERR;
    }
    if (!RedisModule_EventLoopAdd || !RedisModule_RegisterCommandFilter || !RedisModule_LoadConfigs) {
        RedisModule_Log(ctx, "warning", "appassist: needs Redis >= 7.0");
        return REDISMODULE_ERR;
    }
    /* HANDLE_IO_ERRORS: a short or corrupt read in aux_load returns an error
     * that auxLoad checks after every load, instead of a panic. */
    RedisModule_SetModuleOptions(ctx, REDISMODULE_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED |
                                      REDISMODULE_OPTIONS_HANDLE_IO_ERRORS);

    memset(&hm, 0, sizeof(hm));
    hm.port_fd = -1;
    hm.threshold = HM_BUCKETS;
    respBufInit(&hm.port_out, HM_PORT_OUTBUF);
    uint64_t seed = 0;
    if (getrandom(&seed, sizeof(seed), 0) != sizeof(seed)) seed = (uint64_t)nowUs() ^ (uint64_t)getpid();
    hm.arena = arenaCreate(seed);
    if (!hm.arena) return REDISMODULE_ERR;

    RedisModuleTypeMethods tm = {
        .version = REDISMODULE_TYPE_METHOD_VERSION,
        .rdb_load = typeLoad,
        .rdb_save = typeSave,
        .free = typeFree,
        .aux_load = auxLoad,
        .aux_save = auxSave,
        .aux_save_triggers = REDISMODULE_AUX_AFTER_RDB,
    };
    if (RedisModule_CreateDataType(ctx, "appassist", HM_AUX_ENCVER, &tm) == NULL) {
        RedisModule_Log(ctx, "warning", "appassist: cannot register the aux data type");
        return REDISMODULE_ERR;
    }

    if (registerConfigs(ctx) == REDISMODULE_ERR) {
        RedisModule_Log(ctx, "warning", "appassist: bad configuration");
        return REDISMODULE_ERR;
    }
    if (hm.hot_percent == 0) hm.threshold = 0;
    hm.keep_at_threshold = 0;

    if (createCommand(ctx, "appassist.prepare", PrepareCommand, "admin",
                      "Give up the cold set per appassist.on-prepare before a migration", -1) ||
        createCommand(ctx, "appassist.resume", ResumeCommand, "admin",
                      "Migration finished: resume normal operation", 1) ||
        createCommand(ctx, "appassist.abort", AbortCommand, "admin",
                      "Migration cancelled: resume normal operation", 1) ||
        createCommand(ctx, "appassist.status", StatusCommand, "readonly",
                      "Hot/cold statistics and migration state", 1) ||
        createCommand(ctx, "appassist.demote", DemoteCommand, "admin",
                      "Run a demotion pass now (tests, benchmarks)", -1) ||
        createCommand(ctx, "appassist.compact", CompactCommand, "admin",
                      "Run a compaction pass now (tests, benchmarks)", -1) ||
        createCommand(ctx, "appassist.iscold", IsColdCommand, "readonly fast",
                      "1 if the key is in the cold arena", 2) ||
        createCommand(ctx, "appassist.keys", KeysCommand, "readonly",
                      "KEYS over the keyspace and the cold arena (internal)", -1) ||
        createCommand(ctx, "appassist.scan", ScanCommand, "readonly",
                      "SCAN over the keyspace and the cold arena (internal)", -1) ||
        createCommand(ctx, "appassist.dbsize", DbsizeCommand, "readonly fast",
                      "DBSIZE counting cold items (internal)", -1))
        return REDISMODULE_ERR;

    hm_name_keys = RedisModule_CreateString(NULL, "appassist.keys", 14);
    hm_name_scan = RedisModule_CreateString(NULL, "appassist.scan", 14);
    hm_name_dbsize = RedisModule_CreateString(NULL, "appassist.dbsize", 16);
    if (!RedisModule_RegisterCommandFilter(ctx, hmFilter, REDISMODULE_CMDFILTER_NOSELF))
        return REDISMODULE_ERR;
    RedisModule_RegisterInfoFunc(ctx, infoFunc);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_FlushDB, onFlush);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_ReplicationRoleChanged, onRoleChanged);
    hm.replica = !!(RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_SLAVE);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_Persistence, onPersistence);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_Shutdown, onShutdown);
    /* A server that does not offer the event: the timer keeps all the work. */
    hm.bites_on = RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_EventLoop, bgBite) ==
                  REDISMODULE_OK;

    hm.dctx = RedisModule_GetDetachedThreadSafeContext(ctx);
    compactInit(ctx);
    zeroFreedApply();
    if (zeroFreeEnabled()) {
        /* What was freed before now was not cleared: start the window here. */
        processPeakReset();
        hm.zero_window = 1;
    }
    hm.loaded = 1;
    armTimer();
    portOpen();
    return REDISMODULE_OK;
}
