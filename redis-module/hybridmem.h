/* hybridmem.h -- the "appassist" Redis module's shared state, by concern,
 * and the functions its files call across each other (prefix hm).
 *
 * The files, and what they hold:
 *   hybridmem.c   global state, helpers, server events, INFO, OnLoad
 *   configs.c     appassist.* configs
 *   filter.c      the command filter, and visits of cold items
 *   promote.c     promotion (arena -> keyspace) and demotion (keyspace -> arena)
 *   pass.c        the demotion pass (which keys are cold), APPASSIST.DEMOTE
 *   compact.c     compaction of the hot keyspace, reclaim of arena holes,
 *                 APPASSIST.COMPACT
 *   background.c  who runs the background work and when (timer, bites),
 *                 the expiry sweep of the arena
 *   migrate.c     PREPARE / RESUME / ABORT / STATUS, lazy drop, zero-freed
 *   keyspace.c    KEYS, SCAN, DBSIZE over both tiers (with the caller's ACL
 *                 rights to them), the SCAN log, ISCOLD, UNREADABLE
 *   port.c        the host port (virtio-serial, or a pty/unix socket in tests)
 *   persist.c     RDB aux fields and the pure-AOF rewrite
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
 *   - Everything runs on Redis's main thread, except the lazy drop's unmap
 *     thread (migrate.c), which shares only hm.mig.last_clear_us,
 *     last_unmap_us, last_unmap_wall_us and last_clear_idle (atomics).
 */
#ifndef HYBRIDMEM_H
#define HYBRIDMEM_H

#include "redismodule.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "arena.h"
#include "pagelist.h"
#include "portproto.h"

#define HM_VERSION              1
#define HM_AUX_ENCVER           1
#define HM_ITEM_OVERHEAD        48      /* dictEntry+robj+sds headers, estimate */
#define HM_PASS_PAUSE_MS        1000    /* between two passes that demoted */
#define HM_IDLE_PASS_PAUSE_MS   5000    /* after a pass with nothing to demote */
#define HM_IDLE_PASS_PAUSE_MAX_MS 60000 /* ...doubling up to this (see hmDemoteSlice) */
#define HM_PASS_DUTY            25      /* pause >= 25x the pass's CPU: <= 4 % */
#define HM_FITS_RECHECK_MS      60000   /* see fits_below */
#define HM_IDLE_INTERVAL_MS     100     /* slice period with nothing in progress */
#define HM_ARENA_CHECK_MS       1000    /* look for new allocator arenas (hmZeroFreedAdopt) */
#define HM_MULTI_GRACE_US       (5 * 1000000ULL)
#define HM_SCAN_PHASE_BIT       (1ULL << 63)
#define HM_SCAN_GRACE_US        (60 * 1000000ULL) /* see hmScanLogNote */
#define HM_SCAN_LOG_MAX         65536   /* promotions logged for SCANs */
#define HM_PORT_INBUF           (2 * RESP_MAX_REQ)
#define HM_PORT_OUTBUF          (128 * 1024)   /* a PAGES chunk and more */
/* The data of one APPASSIST.PAGES reply: QEMU takes at most 60 KiB
 * (AA_RESP_MAX_PAGE_DATA in migration/app-assist/reply.h). */
#define HM_PAGES_CHUNK          (60 * 1024)
#define HM_BUCKETS              256     /* see idleBucket */
#define HM_SHARE_BINS           16      /* per bucket, by keyShare (see passEnd) */
#define HM_SHARE_BIN_SHIFT      12      /* 65536 / HM_SHARE_BINS */
#define HM_LRU_LAG_MS           200     /* see lruAgeMs */
#define HM_SWEEP_ITEMS          1024    /* arena items checked per slice */
#define HM_REHASH_STEP          512     /* arena slots moved per rehash step */
#define HM_BITE_MIN_US          20      /* shortest bite (see hmBgBite) */
#define HM_BITE_SHARE_DIV       2       /* bites: half the timer's share (see hmBgBite) */
#define HM_SWEEP_PAUSE_MS       1000    /* between two full expiry sweeps */
#define HM_EXPIRE_SPARE_MS      100     /* walks leave keys this close to expiring (hmScanApply) */
#define HM_CLOCK_LFU            (1u << 31) /* an item clock that holds an LFU counter (hmClockOf) */
#define HM_CLOCK_EPOCH_S        1700000000LL /* LRU item clocks count seconds from here */
#define HM_LFU_INIT             5       /* Redis's LFU_INIT_VAL */
#define HM_PINS_MAX             256     /* keys kept hot for blocked moves (hmPinned) */
#define HM_VOLATILE_CHECK_MS    1000    /* INFO keyspace asked while volatile_keys (hmVolatileKeys) */
#define HM_READ_BACK_MAX        4096    /* visited keys awaiting their way back (hmReadBackSettle) */
#define HM_SEEN_BITS            (1u << 20) /* per generation of the read filter (128 KiB) */
#define HM_RECLAIM_ITEMS        256     /* arena items looked at per reclaim step */
#define HM_RECLAIM_MIN_BYTES    (4ULL << 20) /* holes worth a reclaim at least */

#define DEFAULT_PORT_PATH       "/dev/virtio-ports/org.qemu.app-assist.0"
#define DEFAULT_SPILL_PATH      "appassist.spill"

typedef enum { POLICY_DROP = 0, POLICY_SPILL = 1, POLICY_NONE = 2 } Policy;
extern const char *const hm_policy_names[];     /* by Policy */

/* appassist.lazy-drop and appassist.zero-freed */
enum { TRI_AUTO, TRI_YES, TRI_NO };

typedef enum {
    ST_NORMAL = 0,      /* demotion running */
    ST_PREPARED,        /* migration in progress: demotion paused */
    ST_RESUMING,        /* reading spilled chunks back, in slices */
} State;
extern const char *const hm_state_names[];      /* by State */

typedef struct KeyList {
    RedisModuleString **v;
    size_t n, cap;
} KeyList;

/* ------------------------------------------------------------ state */

typedef struct HmConfig {               /* configs.c */
    long long planned_memory;   /* bytes, 0: maxmemory or physical RAM */
    long long hot_percent;
    long long min_idle_ms;
    long long slice_us;
    long long interval_ms;
    long long port_retry_ms;
    long long compact_percent;
    long long promote_window_ms; /* promote on the 2nd read within this; 0: on the 1st */
    long long page_list_slice_us; /* pagemap read per PAGES chunk; 0: the whole list */
    int policy;
    int demote;                 /* appassist.demote yes|no */
    int lazy_drop;              /* appassist.lazy-drop auto|yes|no */
    int zero_freed;             /* appassist.zero-freed auto|yes|no */
    int page_list;              /* appassist.page-list auto|yes|no */
    int debug_commands;         /* appassist.enable-debug-commands (load time) */
    RedisModuleString *port_path;
    RedisModuleString *spill_path;
} HmConfig;

typedef struct HmPass {                 /* pass.c: the demotion pass */
    RedisModuleScanCursor *cursor;
    uint64_t bytes[HM_BUCKETS][HM_SHARE_BINS];
    uint64_t items;
    uint64_t demoted;           /* items the current pass demoted */
    uint64_t idle_pause_ms;     /* pause after the last pass that demoted nothing */
    uint64_t hot_bytes, hot_items;
    long long hot_est;          /* hot bytes: the last pass's, + promoted - demoted since */
    long long admit_budget;     /* the hot budget at the last pass (see hotFull) */
    int threshold;              /* demote items in buckets >= threshold */
    uint32_t keep_at_threshold; /* ...but keep this share (of 65536) of bucket threshold */
    long long start_ms;         /* when the current pass began (see coldBucket) */
    long long threshold_at_ms;  /* when the pass that set the threshold began */
    long long age_ms, threshold_age_ms; /* their ages at this slice, in whole seconds */
    uint64_t next_us;
    uint64_t passes;
    uint64_t skipped;           /* everything fitted the budget */
    uint64_t cpu_us;            /* thread CPU of the running pass */
    /* After a pass that found the hot set within 'fits_budget' with room
     * to spare, no pass is needed until used_memory reaches fits_below
     * (used_memory then plus that room) or the budget changes; checked
     * again every HM_FITS_RECHECK_MS all the same. 0: no such pass. */
    long long fits_below, fits_budget;
    uint64_t fits_until_us;
} HmPass;

typedef struct HmCompact {              /* compact.c: compaction of the hot keyspace */
    int (*mallctl)(const char *, void *, size_t *, void *, size_t); /* NULL: off */
    RedisModuleScanCursor *cursor;
    int wanted;                 /* a pass is due or running */
    uint64_t pending;           /* bytes demoted since the last pass */
    uint64_t t0;
    long long rss0;
    long long busy_us, slice_max_us;
    long long relocated;
    long long last_frag_bytes;  /* allocator_frag_bytes at the last check */
    long long passes, relocations, skipped;
    long long last_relocated, last_time_us, last_busy_us, last_slice_max_us;
    long long last_rss_before, last_rss_after;
} HmCompact;

typedef struct HmReclaim {              /* compact.c: arena holes */
    int active;                 /* holes being reclaimed (hmReclaimWanted) */
    long long runs, moved;
    uint64_t after_us;          /* after a failed step (ENOMEM): not before */
} HmReclaim;

typedef struct HmPin {                  /* filter.c: see hmPinned */
    RedisModuleString *key;
    uint64_t until_us;          /* UINT64_MAX: no timeout */
} HmPin;

typedef struct HmFilter {               /* filter.c */
    uint64_t served;            /* commands seen by the filter */
    int volatile_keys;          /* db 0 may hold a key with a TTL (hmVolatileKeys) */
    HmPin pins[HM_PINS_MAX];    /* keys blocked moves will write (hmPinned) */
    int npins;
    uint64_t volatile_checked_us;
    long multi_open;            /* MULTIs without EXEC/DISCARD yet (see hmFilter) */
    uint64_t multi_seen_us;
    int multi_since_check;      /* a MULTI passed since multiOpen() found none */
} HmFilter;

typedef struct HmVisit {                /* filter.c: reads of cold items (see hmReadBackWanted) */
    KeyList back;               /* keys visited in this round of the event loop */
    uint64_t *seen[2];          /* reads of cold keys, this and the previous window */
    uint64_t seen_since_us;     /* start of the current window */
    uint64_t paused_until_us;   /* clients may be paused (see notePause) */
} HmVisit;

typedef struct HmSweep {                /* background.c: expiry sweep of the arena */
    uint64_t cursor;
    uint64_t next_us;
} HmSweep;

typedef struct HmBackground {           /* background.c: who runs the work (sliceTimer, hmBgBite) */
    RedisModuleTimerID timer;
    int bites_on;               /* the server offers the event loop's BEFORE_SLEEP */
    int bites_armed;            /* subscribed to it now (hmBitesArm) */
    long long bite_arms;        /* times subscribed */
    uint64_t served_at_tick, served_at_bite;
    uint64_t last_bite_us;
    long long slices, bites;
    long long bites_idle;       /* bites skipped: nothing under way or due */
    uint64_t step_max_us;       /* longest slice or bite (wall) */
    uint64_t step_max_cpu_us;   /* ...in thread CPU time, after hmReadBackSettle */
    uint64_t cpu_us;            /* CPU time of all slices and bites */
} HmBackground;

struct ScanLogEntry;
typedef struct HmScanLog {              /* keyspace.c: keys promoted while SCANs run */
    struct ScanLogEntry *log;
    size_t n, cap;
    int sorted;                 /* by pos, since the last append */
    uint64_t seen_us;           /* last SCAN call on db 0; 0: none within the grace */
    long long dropped;
    int deletes_expired;        /* appassist.scan deletes expired keys (hmScanMarkCommand) */
} HmScanLog;

typedef struct HmStats {                /* promote.c, filter.c */
    long long demotions, promotions, expired_promotions, demote_errors;
    long long visits;           /* accesses served by a visit (the item went back cold) */
    long long promotions_refused;
    long long read_errors;      /* commands refused because a cold item could not be read */
} HmStats;

typedef struct HmMigration {            /* migrate.c */
    long long prepares, resumes, aborts;
    long long last_freed, last_items, last_time_us, last_rss_before, last_rss_after;
    int last_policy, last_complete, last_lazy;
    long long last_zeroed;
    /* Clearing of freed memory (zerofree.h) has been on since the window
     * of hmProcessPeakRss() began: everything given back since is zero. */
    int zero_window;
    uint64_t arenas_checked_us;     /* last look for new allocator arenas */
    long long dropped_items;
    /* Wall time of the last drop's clear and unmap (written by the thread). */
    long long last_clear_us, last_unmap_us, last_unmap_wall_us;
    /* 1 if the last lazy drop's thread ran at SCHED_IDLE (atomic too). */
    int last_clear_idle;
    /* The dropped arena kept mapped for the host's page list (migrate.c):
     * released at RESUME/ABORT, or cleared and released when the host does
     * not take the list in time. */
    struct UnmapJob *parked;
    PageList pages;
    int pages_started, pages_served;
    RedisModuleTimerID park_timer;
    int park_timer_set;
    long long park_deadline_ms;
    long long last_page_runs, last_page_frames, last_page_unlisted, last_page_us;
    long long last_page_slice_max_us, last_page_slices;
    const char *last_release;   /* how the last dropped arena went back */
} HmMigration;

typedef struct HmPort {                 /* port.c */
    int fd;
    int discarding;
    RedisModuleTimerID timer;
    int timer_set;
    char in[HM_PORT_INBUF];
    size_t inlen;
    RespBuf out;
    long long requests, errors, opens;
} HmPort;

typedef struct HmState {
    RedisModuleCtx *dctx;       /* detached context: keyspace ops outside commands */
    ColdArena *arena;
    State state;
    int loaded;                 /* OnLoad finished */
    int replica;                /* this server replicates a master */
    int load_merges;            /* the next load is DEBUG RELOAD ... MERGE's (auxLoad) */
    KeyList pending;            /* keys a keyspace walk picked (see hmScanApply) */
    long long *pending_expire;  /* ...their absolute expires, by index */
    size_t pending_expire_cap;
    HmConfig cfg;
    HmPass pass;
    HmCompact compact;
    HmReclaim reclaim;
    HmFilter filter;
    HmVisit visit;
    HmSweep sweep;
    HmBackground bg;
    HmScanLog scan;
    HmStats stats;
    HmMigration mig;
    HmPort port;
} HmState;

extern HmState hm;

/* ------------------------------------------------------------ hybridmem.c */

uint64_t hmThreadCpuUs(void);
long long hmNowMs(void);
static inline uint64_t hmNowUs(void) { return arenaNowUs(); }
long long hmProcessRss(void);
long long hmProcessPeakRss(void);
void hmProcessPeakReset(void);
unsigned long long hmInfoMemoryField(RedisModuleCtx *ctx, const char *field);
long long hmHotBudget(RedisModuleCtx *ctx);
long long hmHotBudgetUsed(RedisModuleCtx *ctx, long long *used);
void hmKeyListPush(KeyList *l, RedisModuleString *s);

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

void hmFieldInt(Fields *fs, const char *name, long long v);
void hmFieldStr(Fields *fs, const char *name, const char *s);
int hmReplyFields(RedisModuleCtx *ctx, const Fields *fs);

/* ------------------------------------------------------------ configs.c */

int hmRegisterConfigs(RedisModuleCtx *ctx);

/* ------------------------------------------------------------ filter.c */

int hmFilterInit(RedisModuleCtx *ctx);
int hmCmdIs(const char *c, size_t l, const char *name);
uint32_t hmKeyFnv(const char *key, size_t l);
int hmReadBackWanted(void);
int hmVolatileKeys(void);
int hmPinned(RedisModuleString *key);
void hmVisitMark(RedisModuleKey *kh);
void hmReadBackSettle(void);

/* ------------------------------------------------------------ promote.c */

int hmPromoteKey(RedisModuleString *key, int visit);
void hmCollectCb(void *priv, const ColdItem *it);
int hmPromoteAll(void);
uint32_t hmClockOf(RedisModuleKey *kh);
void hmClockRestore(RedisModuleKey *kh, uint32_t clock);
uint32_t hmClockAfterVisit(uint32_t clock, long long hits);
RedisModuleKey *hmOpenLiveString(RedisModuleString *key, mstime_t *expire);
uint64_t hmMoveToArena(RedisModuleString *key, RedisModuleKey *kh, mstime_t expire);
int hmDemoteKey(RedisModuleString *key);

/* ------------------------------------------------------------ pass.c */

void hmPendingPush(RedisModuleCtx *ctx, RedisModuleString *keyname, RedisModuleKey *kh);
int hmScanApply(RedisModuleScanCursor *cursor, RedisModuleScanCB cb,
                int (*fn)(RedisModuleString *), uint64_t deadline);
void hmPassAbandon(void);
int hmPassSkipIfFits(void);
void hmDemoteSlice(uint64_t deadline, long long now_ms);
int hmDemoteCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);

/* ------------------------------------------------------------ compact.c */

void hmMemoryPurge(RedisModuleCtx *ctx);
void hmCompactInit(RedisModuleCtx *ctx);
void hmCompactCheck(RedisModuleCtx *ctx);
void hmCompactSlice(uint64_t deadline);
void hmCompactAbandon(void);
int hmReclaimAllowed(void);
int hmReclaimWanted(void);
void hmReclaimSlice(uint64_t deadline);
int hmCompactCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);

/* ------------------------------------------------------------ background.c */

int hmBackgroundAllowed(void);
void hmArmTimer(void);
void hmBgBite(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data);
void hmBitesArm(void);

/* ------------------------------------------------------------ migrate.c */

void hmZeroFreedApply(void);
void hmZeroFreedAdopt(void);
int hmApplyZeroFreed(RedisModuleCtx *ctx, void *priv, RedisModuleString **err);
/* 'host': PREPARE came from the host port, which may then ask for the
 * dropped pages (APPASSIST.PAGES). */
void hmPrepareFields(RedisModuleCtx *ctx, Fields *fs, long long deadline_ms, int host);
void hmResumeFields(RedisModuleCtx *ctx, Fields *fs, int abort);
/* APPASSIST.PAGES <cursor>|END on the host port (migrate.c). */
void hmPagesReply(const char *arg, size_t len, RespBuf *out);
void hmStatusFields(RedisModuleCtx *ctx, Fields *fs);
int hmPrepareCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
int hmResumeCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
int hmAbortCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
int hmStatusCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);

/* ------------------------------------------------------------ keyspace.c */

int hmKeysCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
int hmDbsizeCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
int hmScanCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
int hmIsColdCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
int hmScanMarkCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn);
int hmUnreadableCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
void hmScanLogClear(void);
int hmScanRecent(void);
void hmScanLogNote(const char *k, size_t klen, uint64_t pos);

/* ------------------------------------------------------------ port.c */

void hmPortOpen(void);
void hmPortClose(int retry);
void hmPortRestart(void);

/* ------------------------------------------------------------ persist.c */

int hmPersistInit(RedisModuleCtx *ctx);
void hmOnPersistence(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data);

#endif
