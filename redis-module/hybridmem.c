/* hybridmem.c -- the "appassist" Redis module: hot/cold segregation of
 * string items with a cold arena of its own, transparent to clients, and the
 * guest half of app-assisted migration (APPASSIST.PREPARE/RESUME/ABORT/STATUS
 * over normal clients and over a virtio-serial port).
 *
 * This file holds the global state, small helpers, the server events, INFO
 * and OnLoad; hybridmem.h maps the other files and states the invariants.
 */

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include "hybridmem.h"
#include "zerofree.h"

HmState hm;

const char *const hm_policy_names[] = {"drop", "spill", "none"};
const char *const hm_state_names[] = {"normal", "prepared", "resuming"};

/* ------------------------------------------------------------ helpers */

/* CPU time of this thread: a slice's length without the time the kernel
 * gave other processes (the build machines are shared). */
uint64_t hmThreadCpuUs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

long long hmNowMs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

long long hmProcessRss(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long long size = 0, rss = 0;
    if (!f) return -1;
    if (fscanf(f, "%lld %lld", &size, &rss) != 2) rss = -1;
    fclose(f);
    return rss < 0 ? -1 : rss * sysconf(_SC_PAGESIZE);
}

/* Peak RSS (VmHWM) of this process, -1 if unknown. */
long long hmProcessPeakRss(void) {
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
void hmProcessPeakReset(void) {
    int fd = open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (write(fd, "5", 1) != 1) {
        /* best effort: the next PREPARE then counts from the older peak */
    }
    close(fd);
}

unsigned long long hmInfoMemoryField(RedisModuleCtx *ctx, const char *field) {
    RedisModuleServerInfoData *info = RedisModule_GetServerInfo(ctx, "memory");
    int err = 0;
    unsigned long long v = 0;
    if (info) {
        v = RedisModule_ServerInfoGetFieldUnsigned(info, field, &err);
        RedisModule_FreeServerInfo(ctx, info);
    }
    return err ? 0 : v;
}

/* planned-memory, else maxmemory ('mm'), else physical RAM. */
static long long plannedMemory(unsigned long long mm) {
    if (hm.cfg.planned_memory > 0) return hm.cfg.planned_memory;
    if (mm) return (long long)mm;
    return (long long)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
}

long long hmHotBudget(RedisModuleCtx *ctx) {
    unsigned long long mm = hm.cfg.planned_memory > 0 ? 0 : hmInfoMemoryField(ctx, "maxmemory");
    return plannedMemory(mm) / 100 * hm.cfg.hot_percent;
}

/* The hot budget, and used_memory in *used, from one INFO memory: Redis
 * builds the whole section for each field asked (the demotion pass's
 * check once a second asked twice). */
long long hmHotBudgetUsed(RedisModuleCtx *ctx, long long *used) {
    RedisModuleServerInfoData *info = RedisModule_GetServerInfo(ctx, "memory");
    int err = 0;
    unsigned long long mm = 0, u = 0;
    if (info) {
        mm = RedisModule_ServerInfoGetFieldUnsigned(info, "maxmemory", &err);
        if (err) mm = 0;
        err = 0;
        u = RedisModule_ServerInfoGetFieldUnsigned(info, "used_memory", &err);
        if (err) u = 0;
        RedisModule_FreeServerInfo(ctx, info);
    }
    *used = (long long)u;
    return plannedMemory(mm) / 100 * hm.cfg.hot_percent;
}

void hmFieldInt(Fields *fs, const char *name, long long v) {
    if (fs->n < 32) fs->f[fs->n++] = (Field){name, NULL, v};
}

void hmFieldStr(Fields *fs, const char *name, const char *s) {
    if (fs->n < 32) fs->f[fs->n++] = (Field){name, s, 0};
}

int hmReplyFields(RedisModuleCtx *ctx, const Fields *fs) {
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

void hmKeyListPush(KeyList *l, RedisModuleString *s) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 64;
        l->v = RedisModule_Realloc(l->v, l->cap * sizeof(*l->v));
    }
    l->v[l->n++] = s;
}

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
        hmScanLogClear();
    }
}

static void onShutdown(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)ctx;
    (void)e;
    (void)sub;
    (void)data;
    hmPortClose(0);
    arenaFree(hm.arena);   /* unlinks the spill file */
    hm.arena = arenaCreate();
}

static void infoFunc(RedisModuleInfoCtx *ctx, int for_crash_report) {
    (void)for_crash_report;
    ArenaStats st;
    arenaGetStats(hm.arena, &st);
    RedisModule_InfoAddSection(ctx, "");
    RedisModule_InfoAddFieldCString(ctx, "state", (char *)hm_state_names[hm.state]);
    RedisModule_InfoAddFieldCString(ctx, "on_prepare", (char *)hm_policy_names[hm.cfg.policy]);
    RedisModule_InfoAddFieldULongLong(ctx, "hot_items", hm.pass.hot_items);
    RedisModule_InfoAddFieldULongLong(ctx, "hot_bytes", hm.pass.hot_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "cold_items", st.items);
    RedisModule_InfoAddFieldULongLong(ctx, "cold_bytes", st.item_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_chunks", st.chunks);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_chunks_in_memory", st.chunks_mem);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_mapped_bytes", st.mapped_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_index_bytes", st.index_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "spilled_bytes", st.spilled_bytes);
    RedisModule_InfoAddFieldULongLong(ctx, "arena_dead_bytes", st.dead_bytes);
    RedisModule_InfoAddFieldLongLong(ctx, "arena_reclaims", hm.reclaim.runs);
    RedisModule_InfoAddFieldLongLong(ctx, "arena_reclaim_moved", hm.reclaim.moved);
    RedisModule_InfoAddFieldLongLong(ctx, "demotion_threshold", hm.pass.threshold);
    RedisModule_InfoAddFieldULongLong(ctx, "passes", hm.pass.passes);
    RedisModule_InfoAddFieldULongLong(ctx, "skipped_passes", hm.pass.skipped);
    RedisModule_InfoAddFieldLongLong(ctx, "demotions", hm.stats.demotions);
    RedisModule_InfoAddFieldLongLong(ctx, "promotions", hm.stats.promotions);
    RedisModule_InfoAddFieldLongLong(ctx, "visits", hm.stats.visits);
    RedisModule_InfoAddFieldLongLong(ctx, "read_errors", hm.stats.read_errors);
    RedisModule_InfoAddFieldLongLong(ctx, "promotions_refused", hm.stats.promotions_refused);
    RedisModule_InfoAddFieldLongLong(ctx, "expired_promotions", hm.stats.expired_promotions);
    RedisModule_InfoAddFieldULongLong(ctx, "scan_log_items", hm.scan.n);
    RedisModule_InfoAddFieldLongLong(ctx, "scan_log_dropped", hm.scan.dropped);
    RedisModule_InfoAddFieldLongLong(ctx, "scan_deletes_expired", hm.scan.deletes_expired);
    RedisModule_InfoAddFieldLongLong(ctx, "prepares", hm.mig.prepares);
    RedisModule_InfoAddFieldLongLong(ctx, "resumes", hm.mig.resumes);
    RedisModule_InfoAddFieldLongLong(ctx, "aborts", hm.mig.aborts);
    RedisModule_InfoAddFieldLongLong(ctx, "dropped_items", hm.mig.dropped_items);
    RedisModule_InfoAddFieldLongLong(ctx, "compaction", hm.compact.mallctl != NULL && hm.cfg.compact_percent > 0);
    RedisModule_InfoAddFieldLongLong(ctx, "compaction_running", hm.compact.cursor != NULL);
    RedisModule_InfoAddFieldULongLong(ctx, "compaction_pending_bytes", hm.compact.pending);
    RedisModule_InfoAddFieldLongLong(ctx, "compaction_checked_frag_bytes", hm.compact.last_frag_bytes);
    RedisModule_InfoAddFieldLongLong(ctx, "compactions", hm.compact.passes);
    RedisModule_InfoAddFieldLongLong(ctx, "relocations", hm.compact.relocations);
    RedisModule_InfoAddFieldLongLong(ctx, "relocation_skips", hm.compact.skipped);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_relocated", hm.compact.last_relocated);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_time_us", hm.compact.last_time_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_busy_us", hm.compact.last_busy_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_slice_max_us", hm.compact.last_slice_max_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_rss_before", hm.compact.last_rss_before);
    RedisModule_InfoAddFieldLongLong(ctx, "last_compaction_rss_after", hm.compact.last_rss_after);
    RedisModule_InfoAddFieldLongLong(ctx, "background_slices", hm.bg.slices);
    RedisModule_InfoAddFieldLongLong(ctx, "background_bites", hm.bg.bites);
    RedisModule_InfoAddFieldLongLong(ctx, "background_bites_idle", hm.bg.bites_idle);
    RedisModule_InfoAddFieldLongLong(ctx, "background_bites_armed", hm.bg.bites_armed);
    RedisModule_InfoAddFieldLongLong(ctx, "background_bite_arms", hm.bg.bite_arms);
    RedisModule_InfoAddFieldULongLong(ctx, "background_step_max_us", hm.bg.step_max_us);
    RedisModule_InfoAddFieldULongLong(ctx, "background_step_max_cpu_us", hm.bg.step_max_cpu_us);
    RedisModule_InfoAddFieldULongLong(ctx, "background_cpu_us", hm.bg.cpu_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_freed_bytes", hm.mig.last_freed);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_items", hm.mig.last_items);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_time_us", hm.mig.last_time_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_rss_before", hm.mig.last_rss_before);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_rss_after", hm.mig.last_rss_after);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_complete", hm.mig.last_complete);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_lazy", hm.mig.last_lazy);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_zeroed_bytes", hm.mig.last_zeroed);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_clear_us",
                                     __atomic_load_n(&hm.mig.last_clear_us, __ATOMIC_RELAXED));
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_unmap_us",
                                     __atomic_load_n(&hm.mig.last_unmap_us, __ATOMIC_RELAXED));
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_unmap_wall_us",
                                     __atomic_load_n(&hm.mig.last_unmap_wall_us, __ATOMIC_RELAXED));
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_page_runs", hm.mig.last_page_runs);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_page_frames", hm.mig.last_page_frames);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_page_unlisted", hm.mig.last_page_unlisted);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_page_list_us", hm.mig.last_page_us);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_page_slices", hm.mig.last_page_slices);
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_page_slice_max_us", hm.mig.last_page_slice_max_us);
    RedisModule_InfoAddFieldCString(ctx, "last_prepare_release",
                                    hm.mig.last_release ? hm.mig.last_release : "none");
    RedisModule_InfoAddFieldLongLong(ctx, "last_prepare_drop_thread_idle",
                                     __atomic_load_n(&hm.mig.last_clear_idle, __ATOMIC_RELAXED));
    uint64_t zbytes, zpurges;
    zeroFreeStats(&zbytes, &zpurges);
    RedisModule_InfoAddFieldLongLong(ctx, "zero_freed_active", zeroFreeEnabled());
    RedisModule_InfoAddFieldLongLong(ctx, "zero_freed_window", hm.mig.zero_window);
    RedisModule_InfoAddFieldULongLong(ctx, "zero_freed_arenas", zeroFreeArenas());
    RedisModule_InfoAddFieldULongLong(ctx, "zero_freed_bytes", zbytes);
    RedisModule_InfoAddFieldULongLong(ctx, "zero_freed_purges", zpurges);
    RedisModule_InfoAddFieldLongLong(ctx, "port_connected", hm.port.fd >= 0);
    RedisModule_InfoAddFieldLongLong(ctx, "port_opens", hm.port.opens);
    RedisModule_InfoAddFieldLongLong(ctx, "port_requests", hm.port.requests);
    RedisModule_InfoAddFieldLongLong(ctx, "port_errors", hm.port.errors);
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

/* APPASSIST.PREPARE may drop the cold set, as FLUSHALL drops the dataset.
 * Redis 7.0 gives module commands no ACL categories (admin puts built-in
 * commands in @admin and @dangerous, not module ones; a module can set
 * categories from 7.2 on), so +@all -@dangerous would leave PREPARE
 * allowed. It therefore takes the rights to run FLUSHALL (@dangerous
 * @write @keyspace @slow) as well as its own: a user denied @dangerous is
 * denied PREPARE, with stock's NOPERM text and an ACL LOG entry. No user
 * (AOF, the server itself) passes; the host port calls the code under this
 * and is not a Redis client. */
static int prepareCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    RedisModuleString *name = RedisModule_GetCurrentUserName(ctx);
    if (name) {
        RedisModuleUser *user = RedisModule_GetModuleUserFromUserName(name);
        RedisModule_FreeString(ctx, name);
        RedisModuleString *flushall = RedisModule_CreateString(ctx, "flushall", 8);
        int ok = user && RedisModule_ACLCheckCommandPermissions(user, &flushall, 1) == REDISMODULE_OK;
        if (!ok && user) {
            RedisModuleString *cmd = RedisModule_CreateString(ctx, "appassist.prepare", 17);
            RedisModule_ACLAddLogEntry(ctx, user, cmd, REDISMODULE_ACL_LOG_CMD);
            RedisModule_FreeString(ctx, cmd);
        }
        RedisModule_FreeString(ctx, flushall);
        if (user) RedisModule_FreeModuleUser(user);
        if (!ok)
            return RedisModule_ReplyWithError(ctx, "NOPERM this user has no permissions to run "
                                                   "the 'appassist.prepare' command");
    }
    return hmPrepareCommand(ctx, argv, argc);
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
    /* keyspace.c's SCAN walk starts RedisModule_Scan at the client's cursor
     * by writing the first field of 7.0's RedisModuleScanCursor, which is
     * private to module.c: refuse any other series rather than guess. */
    int ver = RedisModule_GetServerVersion ? RedisModule_GetServerVersion() : 0;
    if ((ver >> 8) != 0x0700) {
        RedisModule_Log(ctx, "warning", "appassist: built and checked for Redis 7.0.x only "
                        "(this server is %d.%d.%d)", ver >> 16, (ver >> 8) & 0xff, ver & 0xff);
        return REDISMODULE_ERR;
    }
    /* HANDLE_IO_ERRORS: a short or corrupt read in aux_load returns an error
     * that auxLoad checks after every load, instead of a panic. */
    RedisModule_SetModuleOptions(ctx, REDISMODULE_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED |
                                      REDISMODULE_OPTIONS_HANDLE_IO_ERRORS);

    memset(&hm, 0, sizeof(hm));
    hm.port.fd = -1;
    hm.pass.threshold = HM_BUCKETS;
    respBufInit(&hm.port.out, HM_PORT_OUTBUF);
    hm.arena = arenaCreate();      /* keys its index hash with getrandom() */
    if (!hm.arena) return REDISMODULE_ERR;

    if (hmPersistInit(ctx) == REDISMODULE_ERR) return REDISMODULE_ERR;

    if (hmRegisterConfigs(ctx) == REDISMODULE_ERR) {
        RedisModule_Log(ctx, "warning", "appassist: bad configuration");
        return REDISMODULE_ERR;
    }
    if (hm.cfg.hot_percent == 0) hm.pass.threshold = 0;
    hm.pass.keep_at_threshold = 0;

    if (createCommand(ctx, "appassist.prepare", prepareCommand, "admin",
                      "Give up the cold set per appassist.on-prepare before a migration", -1) ||
        createCommand(ctx, "appassist.resume", hmResumeCommand, "admin",
                      "Migration finished: resume normal operation", 1) ||
        createCommand(ctx, "appassist.abort", hmAbortCommand, "admin",
                      "Migration cancelled: resume normal operation", 1) ||
        createCommand(ctx, "appassist.status", hmStatusCommand, "readonly",
                      "Hot/cold statistics and migration state", 1) ||
        createCommand(ctx, "appassist.iscold", hmIsColdCommand, "readonly fast",
                      "1 if the key is in the cold arena", 2) ||
        createCommand(ctx, "appassist.keys", hmKeysCommand, "readonly",
                      "KEYS over the keyspace and the cold arena (internal)", -1) ||
        createCommand(ctx, "appassist.scan", hmScanCommand, "readonly",
                      "SCAN over the keyspace and the cold arena (internal)", -1) ||
        createCommand(ctx, "appassist.dbsize", hmDbsizeCommand, "readonly fast",
                      "DBSIZE counting cold items (internal)", -1) ||
        createCommand(ctx, "appassist.unreadable", hmUnreadableCommand, "readonly fast",
                      "Refuses a command whose cold items could not be read (internal)", -1))
        return REDISMODULE_ERR;
    hm.scan.deletes_expired = hmScanMarkCommand(ctx, "appassist.scan", hmScanCommand);
    /* Test helpers: only with appassist.enable-debug-commands yes. */
    if (hm.cfg.debug_commands &&
        (createCommand(ctx, "appassist.demote", hmDemoteCommand, "admin",
                       "Run a demotion pass now (tests, benchmarks)", -1) ||
         createCommand(ctx, "appassist.compact", hmCompactCommand, "admin",
                       "Run a compaction pass now (tests, benchmarks)", -1)))
        return REDISMODULE_ERR;

    if (hmFilterInit(ctx) == REDISMODULE_ERR) return REDISMODULE_ERR;
    RedisModule_RegisterInfoFunc(ctx, infoFunc);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_FlushDB, onFlush);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_ReplicationRoleChanged, onRoleChanged);
    hm.replica = !!(RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_SLAVE);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_Persistence, hmOnPersistence);
    RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_Shutdown, onShutdown);
    /* A server that does not offer the event: the timer keeps all the work. */
    hm.bg.bites_on = RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_EventLoop, hmBgBite) ==
                     REDISMODULE_OK;
    hm.bg.bites_armed = hm.bg.bites_on;     /* the timer disarms them when nothing is due */

    hm.dctx = RedisModule_GetDetachedThreadSafeContext(ctx);
    hmCompactInit(ctx);
    hmZeroFreedApply();
    if (zeroFreeEnabled()) {
        /* What was freed before now was not cleared: start the window here. */
        hmProcessPeakReset();
        hm.mig.zero_window = 1;
    }
    hm.loaded = 1;
    hmArmTimer();
    hmPortOpen();
    return REDISMODULE_OK;
}
