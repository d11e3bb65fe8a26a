/* pass.c -- the demotion pass: a walk of the keyspace that ranks string
 * keys by coldness and demotes what does not fit the hot budget;
 * APPASSIST.DEMOTE runs it on demand. */

#include "hybridmem.h"

/* The bucket of an LRU idle time in ms: 0 for none, else four per octave
 * (the two bits below the top one pick the quarter). Whole octaves were
 * too coarse: a hot range and cold keys at the budget's edge shared a
 * bucket (docs/redis-module.md, "Design history"). */
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
 * once the load stopped and a second had passed (docs/redis-module.md, "Design history"). LFU counters are
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
    *idle_ok = idle >= hm.cfg.min_idle_ms;
    /* A key touched since the moment is in bucket 0. */
    *decide = idleBucket(idle - hm.pass.threshold_age_ms);
    return idleBucket(idle - hm.pass.age_ms);
}

/* A stable pseudo-random share of a key in [0, 65536) (FNV-1a): the same
 * keys of the threshold bucket stay hot pass after pass. */
static uint32_t keyShare(RedisModuleString *key) {
    size_t l;
    const char *p = RedisModule_StringPtrLen(key, &l);
    return hmKeyFnv(p, l) & 0xffff;
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
        if (d >= hm.pass.threshold && idle_ok && (d > hm.pass.threshold || share >= hm.pass.keep_at_threshold)) {
            hmPendingPush(ctx, keyname, kh);
        } else {
            hm.pass.bytes[b][share >> HM_SHARE_BIN_SHIFT] += bytes;
            hm.pass.items++;
        }
    }
    if (own) RedisModule_CloseKey(own);
}

/* End of a pass: the hot set is what fits in the budget, hottest first.
 * Of the bucket that crosses the budget only the share that does not fit
 * is demoted, by a stable hash of the key (keyShare): demoting the whole
 * bucket overshot by up to half the hot set. The histogram bins each
 * bucket by that hash too, and the cut is placed between the keys actually
 * there: after a cut, the keys left in the bucket have hashes below it, and
 * a cut computed as if hashes in the bucket were uniform over [0, 65536)
 * fell above all of them, pass after pass (docs/redis-module.md, "Design history").
 * Within the crossing bin the cut is interpolated: off by at most a bin,
 * 1/16 of the bucket. */
static void passEnd(RedisModuleCtx *ctx) {
    long long budget = hmHotBudget(ctx);
    uint64_t sum = 0;
    int thr = HM_BUCKETS;
    uint32_t keep = 0;
    for (int b = 0; b < HM_BUCKETS && thr == HM_BUCKETS; b++) {
        for (int i = 0; i < HM_SHARE_BINS; i++) {
            uint64_t bin = hm.pass.bytes[b][i];
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
    hm.pass.threshold = thr;
    hm.pass.keep_at_threshold = keep;
    hm.pass.threshold_at_ms = hm.pass.start_ms;
    hm.pass.fits_below = 0;
    if (thr == HM_BUCKETS && budget > 0) {
        hm.pass.fits_below = (long long)hmInfoMemoryField(ctx, "used_memory") + budget - (long long)sum;
        hm.pass.fits_budget = budget;
        hm.pass.fits_until_us = hmNowUs() + HM_FITS_RECHECK_MS * 1000ULL;
    }
    hm.pass.hot_bytes = 0;
    for (int b = 0; b < HM_BUCKETS; b++)
        for (int i = 0; i < HM_SHARE_BINS; i++) hm.pass.hot_bytes += hm.pass.bytes[b][i];
    hm.pass.hot_est = (long long)hm.pass.hot_bytes;
    hm.pass.admit_budget = budget;
    hm.pass.hot_items = hm.pass.items;
    memset(hm.pass.bytes, 0, sizeof(hm.pass.bytes));
    hm.pass.items = 0;
    hm.pass.passes++;
    hmCompactCheck(ctx);
}

/* Add a key a walk's RedisModule_Scan callback picked (open as 'kh') to
 * hm.pending, with its expire. */
void hmPendingPush(RedisModuleCtx *ctx, RedisModuleString *keyname, RedisModuleKey *kh) {
    if (hm.pending.n == hm.pending_expire_cap) {
        hm.pending_expire_cap = hm.pending_expire_cap ? hm.pending_expire_cap * 2 : 64;
        hm.pending_expire = RedisModule_Realloc(hm.pending_expire,
                                                hm.pending_expire_cap * sizeof(*hm.pending_expire));
    }
    hm.pending_expire[hm.pending.n] = RedisModule_GetAbsExpire(kh);
    RedisModule_RetainString(ctx, keyname);
    hmKeyListPush(&hm.pending, keyname);
}

/* Walk the keyspace with 'cursor' until it ends or 'deadline' passes: 'cb'
 * collects keys into hm.pending (a key cannot be changed inside the scan
 * callback; hmPendingPush), then 'fn' acts on each. Returns 1 if the walk
 * has more.
 *
 * 'fn' opens the key, and any lookup of an expired key makes Redis delete
 * it there and then. So a key that has expired or expires within
 * HM_EXPIRE_SPARE_MS is left alone, judged from the expire the scan's
 * handle showed (it looked nothing up), just before 'fn'; the margin
 * covers the time to the lookup. Before, the demotion pass and compaction
 * deleted such keys: an active expire cycle that DEBUG SET-ACTIVE-EXPIRE 0
 * could not stop (stock Redis keeps them until they are accessed), its
 * DELs of a slice reaching replicas wrapped in MULTI/EXEC. */
int hmScanApply(RedisModuleScanCursor *cursor, RedisModuleScanCB cb,
                     int (*fn)(RedisModuleString *), uint64_t deadline) {
    int more = 1;
    while (more && hmNowUs() < deadline) {
        more = RedisModule_Scan(hm.dctx, cursor, cb, NULL);
        for (size_t i = 0; i < hm.pending.n; i++) {
            long long when = hm.pending_expire[i];
            if (when == REDISMODULE_NO_EXPIRE || when > hmNowMs() + HM_EXPIRE_SPARE_MS)
                fn(hm.pending.v[i]);
            RedisModule_FreeString(hm.dctx, hm.pending.v[i]);
        }
        hm.pending.n = 0;
    }
    return more;
}

/* Drop the pass under way, with what it counted so far: PREPARE (demotion
 * pauses) and demotion turned off. A cursor left behind kept the
 * background work "under way" for good: every bite ran a step that could
 * do nothing, and compaction, which waits for passes, never ran. */
void hmPassAbandon(void) {
    if (!hm.pass.cursor) return;
    RedisModule_ScanCursorDestroy(hm.pass.cursor);
    hm.pass.cursor = NULL;
    memset(hm.pass.bytes, 0, sizeof(hm.pass.bytes));
    hm.pass.items = 0;
}

/* A pass is due (none under way): 1 if it is skipped, because nothing can
 * be over budget while the whole of used_memory fits in it (its keyspace
 * walk would be pure overhead); the next one is then due in
 * HM_PASS_PAUSE_MS. The timer asks this before it looks for work for the
 * bites (see sliceTimer): a server whose data fits its budget -- the
 * module's steady state at its defaults -- otherwise armed them once a
 * second for a check of two INFO fields. */
int hmPassSkipIfFits(void) {
    long long used, budget = hmHotBudgetUsed(hm.dctx, &used);
    /* The second test: a server whose used_memory is above the budget by
     * Redis's own overhead, not by its keys, walked them for nothing every
     * pass (docs/redis-module.md, "Design history"). */
    if (budget > 0 && (used < budget ||
                       (hm.pass.fits_below && used < hm.pass.fits_below &&
                        budget == hm.pass.fits_budget && hmNowUs() < hm.pass.fits_until_us))) {
        hm.pass.threshold = HM_BUCKETS;
        hm.pass.next_us = hmNowUs() + HM_PASS_PAUSE_MS * 1000ULL;
        hm.pass.skipped++;
        if (used < budget) hm.pass.hot_est = used;
        hm.pass.admit_budget = budget;
        return 1;
    }
    return 0;
}

/* Run the demotion pass until 'deadline'; 'now_ms': see lruAgeMs. */
void hmDemoteSlice(uint64_t deadline, long long now_ms) {
    RedisModuleCtx *ctx = hm.dctx;
    if (!hm.pass.cursor) {
        if (hmNowUs() < hm.pass.next_us || hmPassSkipIfFits()) return;
        hm.pass.cursor = RedisModule_ScanCursorCreate();
        hm.pass.cpu_us = 0;
        hm.pass.demoted = 0;
        hm.pass.start_ms = now_ms;
    }
    hm.pass.age_ms = lruAgeMs(hm.pass.start_ms, now_ms);
    hm.pass.threshold_age_ms = hm.pass.threshold_at_ms ? lruAgeMs(hm.pass.threshold_at_ms, now_ms) : 0;
    uint64_t c0 = hmThreadCpuUs();
    int more = hmScanApply(hm.pass.cursor, scanCb, hmDemoteKey, deadline);
    hm.pass.cpu_us += hmThreadCpuUs() - c0;
    if (!more) {
        RedisModule_ScanCursorDestroy(hm.pass.cursor);
        hm.pass.cursor = NULL;
        passEnd(ctx);
        /* Everything fits the budget: the pass only refreshes statistics,
         * so run it rarely. hot-percent 0 (tests) demotes continuously.
         * Under promote/demote churn (reads spread over cold keys) a pass
         * is due every second, and walking a large hot keyspace that often
         * costs too much CPU (docs/redis-module.md, "Design history"):
         * the pause is also at least HM_PASS_DUTY times the pass's own
         * CPU time. Promotions meanwhile only overshoot the budget for
         * longer.
         *
         * A pass over the budget that demoted nothing could not: what is
         * over it is in use (touched within min-idle-ms, or the hot set
         * sits at the budget's edge with Redis's overhead on top). The
         * next one is likely to find the same, so the pause doubles from
         * HM_IDLE_PASS_PAUSE_MS up to HM_IDLE_PASS_PAUSE_MAX_MS until a
         * pass demotes again (docs/redis-module.md, "Design history"). When everything fits,
         * the pause stays short: fits_below skips the walks meanwhile,
         * and growth is noticed within HM_IDLE_PASS_PAUSE_MS. */
        uint64_t pause_ms;
        if (hm.pass.threshold == 0) {
            pause_ms = 10;
        } else if (hm.pass.demoted || hm.pass.threshold == HM_BUCKETS) {
            hm.pass.idle_pause_ms = 0;
            pause_ms = hm.pass.demoted ? HM_PASS_PAUSE_MS : HM_IDLE_PASS_PAUSE_MS;
        } else {
            hm.pass.idle_pause_ms = hm.pass.idle_pause_ms ? hm.pass.idle_pause_ms * 2 : HM_IDLE_PASS_PAUSE_MS;
            if (hm.pass.idle_pause_ms > HM_IDLE_PASS_PAUSE_MAX_MS)
                hm.pass.idle_pause_ms = HM_IDLE_PASS_PAUSE_MAX_MS;
            pause_ms = hm.pass.idle_pause_ms;
        }
        uint64_t pause_us = pause_ms * 1000ULL;
        if (hm.pass.threshold != 0 && pause_us < hm.pass.cpu_us * HM_PASS_DUTY)
            pause_us = hm.pass.cpu_us * HM_PASS_DUTY;
        hm.pass.next_us = hmNowUs() + pause_us;
    }
}

/* APPASSIST.DEMOTE [max-ms]: run the demotion pass synchronously until it
 * completes or max-ms (default 1000) passes; for tests and benchmarks. Uses
 * the current threshold (hot-percent 0: everything that is idle enough). */
int hmDemoteCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc > 2) return RedisModule_WrongArity(ctx);
    long long ms = 1000;
    if (argc == 2 && (RedisModule_StringToLongLong(argv[1], &ms) != REDISMODULE_OK || ms < 0))
        return RedisModule_ReplyWithError(ctx, "ERR max-ms must be a non-negative integer");
    if (hm.state != ST_NORMAL)
        return RedisModule_ReplyWithError(ctx, "ERR demotion is paused until APPASSIST.RESUME");
    hmReadBackSettle();
    long long before = hm.stats.demotions;
    uint64_t deadline = hmNowUs() + (uint64_t)ms * 1000;
    uint64_t passes = hm.pass.passes + hm.pass.skipped;
    hm.pass.next_us = 0;
    hm.pass.fits_below = 0;
    long long now_ms = hmNowMs();
    while (hm.pass.passes + hm.pass.skipped == passes && hmNowUs() < deadline)
        hmDemoteSlice(deadline, now_ms);
    return RedisModule_ReplyWithLongLong(ctx, hm.stats.demotions - before);
}
