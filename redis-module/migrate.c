/* migrate.c -- APPASSIST.PREPARE / RESUME / ABORT / STATUS, shared by
 * clients and the host port: the arena dropped or spilled, the lazy drop
 * and the clearing of freed memory. */

#include <pthread.h>
#include <sched.h>

#include "hybridmem.h"
#include "zerofree.h"

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
 * with both for the guest's vCPUs (docs/redis-module.md, "Design history").
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
    return hm.cfg.zero_freed == TRI_YES || (hm.cfg.zero_freed == TRI_AUTO && !kernelZeroesFreedPages());
}

/* Turn clearing on or off per appassist.zero-freed. Turning it off ends the
 * window in which everything freed was cleared; turning it on starts one
 * only at the next peak reset (RESUME/ABORT), since pages freed before are
 * not zero. */
void hmZeroFreedApply(void) {
    int on = zeroFreedWanted() && zeroFreeInstalled();
    if (!on) hm.mig.zero_window = 0;
    zeroFreeEnable(on);
}

/* Wrap the allocator arenas that threads created since the last look
 * (zeroFreeAdopt). What such an arena purged before could not be cleared,
 * so the window in which everything freed was cleared ends; the next peak
 * reset (RESUME/ABORT) starts another. Runs from the timer about once a
 * second and before PREPARE answers. */
void hmZeroFreedAdopt(void) {
    static int warned;
    hm.mig.arenas_checked_us = hmNowUs();
    int n = zeroFreeAdopt();
    if (n == 0) return;
    if (n < 0 && !warned) {
        warned = 1;
        RedisModule_Log(hm.dctx, "warning", "appassist: a new allocator arena could not be "
                        "wrapped (%s): what it frees is not cleared", strerror(errno));
    }
    if (hm.mig.zero_window) {
        hm.mig.zero_window = 0;
        RedisModule_Log(hm.dctx, "verbose", "appassist: a new allocator arena: freed memory is "
                        "cleared again from the next RESUME or ABORT");
    }
}

int hmApplyZeroFreed(RedisModuleCtx *ctx, void *priv, RedisModuleString **err) {
    (void)ctx; (void)priv; (void)err;
    hmZeroFreedApply();
    return REDISMODULE_OK;
}

typedef struct UnmapJob {
    ArenaMapping *maps;
    size_t n;
    int zero;                   /* clear the pages before unmapping */
} UnmapJob;

/* Unmapping is kernel work that this kernel (voluntary preemption) gives
 * up only between page-table batches, SCHED_IDLE or not: a request that
 * arrives while the thread is inside munmap() waits for it. So the thread
 * unmaps RELEASE_PIECE at a time and rests RELEASE_REST times as long as
 * each piece took: at most a quarter of the vCPU, and a request waits for
 * one piece at most. Measured at 5 M items (1.2 GiB of arena, 3 GiB TCG
 * guest): unmapped in one go, 1.1 s in which Redis served 0.69x of its
 * rate before the migration; paced, the same work spread over ~4 s. */
#define RELEASE_PIECE   (256u << 10)
#define RELEASE_REST    3
#define RELEASE_REST_MAX_US 5000

/* paced: from the idle thread (see above); else as fast as it goes */
static void unmapJob(UnmapJob *job, int paced) {
    uint64_t t0 = hmNowUs();
    int zero = job->zero;
    for (size_t i = 0; zero && i < job->n; i++)
        zeroResident(job->maps[i].addr, job->maps[i].len);
    uint64_t t1 = hmNowUs();
    uint64_t work = paced ? arenaUnmapPaced(job->maps, job->n, RELEASE_PIECE, RELEASE_REST,
                                            RELEASE_REST_MAX_US)
                          : arenaUnmapPaced(job->maps, job->n, 0, 0, 0);
    free(job);
    __atomic_store_n(&hm.mig.last_clear_us, zero ? (long long)(t1 - t0) : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&hm.mig.last_unmap_us, (long long)work, __ATOMIC_RELAXED);
    __atomic_store_n(&hm.mig.last_unmap_wall_us, (long long)(hmNowUs() - t1), __ATOMIC_RELAXED);
}

/* The thread clears and unmaps at SCHED_IDLE: it only gets the CPU time
 * the server leaves, so no request waits behind it. Under TCG the guest's
 * one busy vCPU ran the clearing and the server in turns, and the server's
 * throughput during the migration fell to 0.40x of stock post-copy's
 * (docs/redis-module.md, "Design history"). A server kept busy without a
 * pause delays the clearing; the migration then sends what it reaches
 * before the thread does, as it would without the drop. */
static void *unmapThread(void *arg) {
    struct sched_param sp = {0};
    int idle = pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) == 0;
    __atomic_store_n(&hm.mig.last_clear_idle, idle, __ATOMIC_RELAXED);
    pthread_setname_np(pthread_self(), "appassist-drop");
    unmapJob(arg, 1);
    return NULL;
}

/* Clear (if job->zero) and unmap in the idle thread, or here if there is
 * no thread. Returns 1 if the thread took it. */
static int releaseLazily(UnmapJob *job) {
    pthread_t t;
    pthread_attr_t attr;
    int started;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    started = pthread_create(&t, &attr, unmapThread, job) == 0;
    pthread_attr_destroy(&attr);
    if (!started) unmapJob(job, 0);
    return started;
}

/* ------------------------------------------------------------ page lists
 *
 * With a page list (pagelist.h) the dropped arena is parked: kept mapped and
 * untouched while the host takes the list and migrates, so the guest spends
 * nothing on it during the migration. It goes back to the guest kernel
 *   - at RESUME (the destination, where the listed pages arrived as zero
 *     pages): unmapped without clearing, unless some present page could not
 *     be listed (shared with a child, say), when it is cleared first;
 *   - at ABORT (the source keeps its data): cleared and unmapped, as
 *     zero-freed promises;
 *   - when the host does not ask for the list within PREPARE's deadline
 *     (a QEMU without page lists), ends the list early (PAGES END before the
 *     last run), or no RESUME/ABORT comes within PARK_MAX_MS of the list:
 *     cleared and unmapped, wherever this process runs by then. Clearing
 *     after the host took the list is safe: a write to a listed page cancels
 *     its mark on the host. */

#define PARK_MAX_MS     60000

static void parkTimerStop(void) {
    if (hm.mig.park_timer_set) RedisModule_StopTimer(hm.dctx, hm.mig.park_timer, NULL);
    hm.mig.park_timer_set = 0;
}

static void parkRelease(int clear, const char *why) {
    UnmapJob *job = hm.mig.parked;
    parkTimerStop();
    if (!job) return;
    hm.mig.parked = NULL;
    pageListFree(&hm.mig.pages);
    hm.mig.pages_started = hm.mig.pages_served = 0;
    hm.mig.last_release = why;
    job->zero = clear;
    releaseLazily(job);
}

static void parkTimerFired(RedisModuleCtx *ctx, void *data) {
    (void)ctx;
    (void)data;
    hm.mig.park_timer_set = 0;
    parkRelease(1, hm.mig.pages_served ? "cleared: no RESUME or ABORT in time"
                                       : "cleared: the host did not take the page list");
}

static void parkTimerStart(long long ms) {
    parkTimerStop();
    hm.mig.park_timer = RedisModule_CreateTimer(hm.dctx, ms, parkTimerFired, NULL);
    hm.mig.park_timer_set = 1;
}

static int pageListWanted(const UnmapJob *job) {
    if (hm.cfg.page_list == TRI_NO || !hm.dctx) return 0;
    return pageListAvailable(job->maps, job->n);
}

void hmPagesReply(const char *arg, size_t len, RespBuf *out) {
    static uint8_t chunk[HM_PAGES_CHUNK];
    char num[24];
    char *end;
    char err[160];
    unsigned long long cursor;
    uint64_t remaining;
    ssize_t len_out;
    size_t runs;
    if (len == 3 && strncasecmp(arg, "end", 3) == 0) {
        /* No reply: the host is done asking. */
        if (hm.mig.parked && !hm.mig.pages_served)
            parkRelease(1, "cleared: the host ended the page list early");
        return;
    }
    if (len == 0 || len >= sizeof(num)) goto bad;
    memcpy(num, arg, len);
    num[len] = '\0';
    errno = 0;
    cursor = strtoull(num, &end, 10);
    if (*end || errno || num[0] == '-') goto bad;
    if (!hm.mig.parked) {
        /* Nothing kept for the host (no drop, or released already). */
        respAddArrayLen(out, 2);
        respAddInt(out, 0);
        respAddBulk(out, "", 0);
        return;
    }
    if (!hm.mig.pages_started && cursor != 0) goto bad;
    if (cursor > hm.mig.pages.n) goto bad;
    hm.mig.pages_started = 1;
    /* A slice of pagemap per chunk (appassist.page-list-slice-us): the event
     * loop waits for it as for a command. */
    len_out = pageListChunk(&hm.mig.pages, hm.mig.parked->maps, hm.mig.parked->n, (size_t)cursor,
                            (uint64_t)hm.cfg.page_list_slice_us, chunk, sizeof(chunk), &runs,
                            &remaining, err, sizeof(err));
    if (len_out < 0) {
        RedisModule_Log(hm.dctx, "warning", "appassist: page list: %s", err);
        parkRelease(1, "cleared: the page list could not be read");
        respAddError(out, "ERR appassist: the page list could not be read");
        return;
    }
    hm.mig.last_page_us = (long long)hm.mig.pages.scan_us;
    hm.mig.last_page_slice_max_us = (long long)hm.mig.pages.slice_max_us;
    hm.mig.last_page_slices = (long long)hm.mig.pages.slices;
    hm.mig.last_page_runs = (long long)hm.mig.pages.n;
    hm.mig.last_page_frames = (long long)hm.mig.pages.frames;
    hm.mig.last_page_unlisted = (long long)hm.mig.pages.unlisted;
    if (remaining == 0) {          /* the whole list served */
        hm.mig.pages_served = 1;
        parkTimerStart(PARK_MAX_MS);
    } else {
        parkTimerStart(hm.mig.park_deadline_ms);
    }
    respAddArrayLen(out, 2);
    respAddInt(out, (long long)remaining);
    respAddBulk(out, (const char *)chunk, (size_t)len_out);
    return;
bad:
    hm.port.errors++;
    respAddError(out, "ERR appassist: PAGES takes a run index from 0 to the list's length, or END");
}

/* Drop the arena; returns the bytes of mappings released (or being
 * released by the thread, or parked for a page list). *zeroed: the released
 * pages end up zero (or go as zero pages). */
static uint64_t dropArena(uint64_t *items, int *lazy, int *zeroed, int *listed,
                          long long deadline_ms) {
    int kernel = kernelZeroesFreedPages(), zero = zeroFreeEnabled();
    int want_lazy = hm.cfg.lazy_drop == TRI_YES || (hm.cfg.lazy_drop == TRI_AUTO && (kernel || zero));
    *lazy = 0;
    if (listed) *listed = 0;
    *zeroed = kernel;
    if (!want_lazy && !zero) return arenaDrop(hm.arena, items);
    UnmapJob *job = malloc(sizeof(*job));
    if (!job) return arenaDrop(hm.arena, items);
    job->zero = zero;
    *zeroed = kernel || zero;
    uint64_t freed = arenaDropDeferred(hm.arena, items, &job->maps, &job->n);
    if (!want_lazy || job->n == 0) {
        unmapJob(job, 0);
        return freed;
    }
    *lazy = 1;
    if (listed && zero && pageListWanted(job)) {
        hm.mig.parked = job;
        hm.mig.park_deadline_ms = deadline_ms > 0 ? deadline_ms : 3000;
        hm.mig.last_release = "parked";
        parkTimerStart(hm.mig.park_deadline_ms);
        *listed = 1;
        return freed;
    }
    hm.mig.last_release = zero ? "cleared" : "unmapped";
    *lazy = releaseLazily(job);
    return freed;
}

void hmPrepareFields(RedisModuleCtx *ctx, Fields *fs, long long deadline_ms, int host) {
    uint64_t t0 = hmNowUs();
    hmReadBackSettle();
    hmZeroFreedAdopt();
    long long rss0 = hmProcessRss();
    int64_t freed = 0;
    uint64_t items = 0;
    int complete = 1;
    int lazy = 0, arena_zeroed = 0, listed = 0;
    /* A drop still parked from a PREPARE that saw no RESUME or ABORT. */
    parkRelease(1, "cleared: a new PREPARE");
    hm.mig.last_page_runs = hm.mig.last_page_frames = hm.mig.last_page_unlisted = 0;
    hm.mig.last_page_us = hm.mig.last_page_slice_max_us = hm.mig.last_page_slices = 0;
    hmPassAbandon();            /* demotion is paused */
    hmCompactAbandon();
    if (hm.state == ST_RESUMING) hm.state = ST_PREPARED;
    switch (hm.cfg.policy) {
    case POLICY_DROP:
        items = arenaCount(hm.arena);
        freed = (int64_t)dropArena(NULL, &lazy, &arena_zeroed, host ? &listed : NULL, deadline_ms);
        hm.mig.dropped_items += (long long)items;
        break;
    case POLICY_SPILL: {
        char path[PATH_MAX];
        size_t pl;
        const char *p = RedisModule_StringPtrLen(hm.cfg.spill_path, &pl);
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
    if (hm.cfg.policy != POLICY_NONE) hmMemoryPurge(ctx);
    hm.state = ST_PREPARED;
    long long rss1 = hmProcessRss();
    /* What the host may balloon away is everything this process gave back
     * to the guest kernel, not only the arena: pages that jemalloc returned
     * after demotion and compaction are free in the guest but still hold
     * data, so a migration would send them. The peak RSS since the last
     * RESUME/ABORT (or start) minus the RSS now measures all of it; the
     * host clamps the balloon with the guest's own statistics. */
    int64_t dropped = freed;
    long long peak = hmProcessPeakRss();
    /* With a lazy drop, RSS still holds the arena the thread is unmapping. */
    long long given = peak > 0 && rss1 > 0 ? peak - rss1 + (lazy ? dropped : 0) : -1;
    if (hm.cfg.policy != POLICY_NONE && given > freed)
        freed = given;
    /* The part of it the guest now holds as zero pages: all of it when the
     * kernel clears freed pages or this process cleared everything it gave
     * back since the window began (spilled chunks are not cleared), else
     * what the arena drop cleared. The host balloons only the rest. */
    int64_t zeroed = arena_zeroed ? dropped : 0;
    if (kernelZeroesFreedPages())
        zeroed = freed;
    else if (hm.mig.zero_window && zeroFreeEnabled())
        zeroed = freed - (hm.cfg.policy == POLICY_SPILL ? dropped : 0);
    if (zeroed < 0) zeroed = 0;
    hm.mig.prepares++;
    hm.mig.last_freed = freed;
    hm.mig.last_items = (long long)items;
    hm.mig.last_time_us = (long long)(hmNowUs() - t0);
    hm.mig.last_rss_before = rss0;
    hm.mig.last_rss_after = rss1;
    hm.mig.last_policy = hm.cfg.policy;
    hm.mig.last_complete = complete;
    hm.mig.last_lazy = lazy;
    hm.mig.last_zeroed = zeroed;
    hmFieldInt(fs, "freed_bytes", freed);
    hmFieldInt(fs, "zeroed_bytes", zeroed);
    hmFieldInt(fs, "dropped_bytes", dropped);
    hmFieldInt(fs, "peak_rss", peak);
    hmFieldInt(fs, "lazy", lazy);
    hmFieldInt(fs, "page_list", listed);
    hmFieldInt(fs, "items", (long long)items);
    hmFieldInt(fs, "used_memory", (long long)hmInfoMemoryField(ctx, "used_memory"));
    hmFieldInt(fs, "rss", rss1);
    hmFieldInt(fs, "rss_before", rss0);
    hmFieldInt(fs, "time_us", hm.mig.last_time_us);
    hmFieldStr(fs, "policy", hm_policy_names[hm.cfg.policy]);
    hmFieldInt(fs, "complete", complete);
    hmFieldStr(fs, "state", hm_state_names[hm.state]);
}

/* RESUME (migration done, we run on the destination) and ABORT (migration
 * cancelled, we still run on the source) do the same thing: undo what
 * PREPARE did where it can be undone. Dropped items stay dropped (cache
 * semantics); spilled chunks are read back in background slices. */
void hmResumeFields(RedisModuleCtx *ctx, Fields *fs, int abort) {
    (void)ctx;
    if (hm.state == ST_PREPARED)
        hm.state = arenaHasSpilled(hm.arena) ? ST_RESUMING : ST_NORMAL;
    if (abort)
        parkRelease(1, "cleared at ABORT");
    else if (hm.mig.pages_served && hm.mig.pages.unlisted == 0)
        parkRelease(0, "unmapped at RESUME");
    else
        parkRelease(1, "cleared at RESUME");
    /* The host has taken back what the last PREPARE reported: count the
     * next one from here. */
    hmProcessPeakReset();
    hm.mig.zero_window = zeroFreeEnabled();
    if (abort) hm.mig.aborts++; else hm.mig.resumes++;
    hmFieldStr(fs, "state", hm_state_names[hm.state]);
    hmFieldInt(fs, "cold_items", (long long)arenaCount(hm.arena));
    hmFieldInt(fs, "dropped_items", hm.mig.dropped_items);
}

void hmStatusFields(RedisModuleCtx *ctx, Fields *fs) {
    ArenaStats st;
    arenaGetStats(hm.arena, &st);
    hmFieldStr(fs, "state", hm_state_names[hm.state]);
    hmFieldStr(fs, "policy", hm_policy_names[hm.cfg.policy]);
    hmFieldInt(fs, "hot_budget_bytes", hmHotBudget(ctx));
    hmFieldInt(fs, "hot_items", (long long)hm.pass.hot_items);
    hmFieldInt(fs, "hot_bytes", (long long)hm.pass.hot_bytes);
    hmFieldInt(fs, "cold_items", (long long)st.items);
    hmFieldInt(fs, "cold_bytes", (long long)st.item_bytes);
    hmFieldInt(fs, "arena_chunks", (long long)st.chunks);
    hmFieldInt(fs, "arena_chunks_in_memory", (long long)st.chunks_mem);
    hmFieldInt(fs, "arena_mapped_bytes", (long long)st.mapped_bytes);
    hmFieldInt(fs, "spilled_bytes", (long long)st.spilled_bytes);
    hmFieldInt(fs, "demotions", hm.stats.demotions);
    hmFieldInt(fs, "promotions", hm.stats.promotions);
    hmFieldInt(fs, "visits", hm.stats.visits);
    hmFieldInt(fs, "prepares", hm.mig.prepares);
    hmFieldInt(fs, "used_memory", (long long)hmInfoMemoryField(ctx, "used_memory"));
    hmFieldInt(fs, "rss", hmProcessRss());
}

static int parseDeadline(RedisModuleString **argv, int argc, long long *deadline) {
    *deadline = 0;
    if (argc < 2) return 0;
    if (RedisModule_StringToLongLong(argv[1], deadline) != REDISMODULE_OK ||
        *deadline < 0 || *deadline > 86400000LL)
        return -1;
    return 0;
}

int hmPrepareCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc > 2) return RedisModule_WrongArity(ctx);
    long long deadline;
    if (parseDeadline(argv, argc, &deadline) < 0)
        return RedisModule_ReplyWithError(ctx, "ERR deadline-ms must be an integer between 0 and 86400000");
    Fields fs = {0};
    hmPrepareFields(ctx, &fs, deadline, 0);
    return hmReplyFields(ctx, &fs);
}

int hmResumeCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RedisModule_WrongArity(ctx);
    Fields fs = {0};
    hmResumeFields(ctx, &fs, 0);
    return hmReplyFields(ctx, &fs);
}

int hmAbortCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RedisModule_WrongArity(ctx);
    Fields fs = {0};
    hmResumeFields(ctx, &fs, 1);
    return hmReplyFields(ctx, &fs);
}

int hmStatusCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return RedisModule_WrongArity(ctx);
    Fields fs = {0};
    hmStatusFields(ctx, &fs);
    return hmReplyFields(ctx, &fs);
}
