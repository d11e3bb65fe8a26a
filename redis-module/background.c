/* background.c -- when the background work runs (the timer's slices and
 * the event loop's bites), what one step does, and the expiry sweep of
 * the arena. */

#include "hybridmem.h"

/* Background work that changes the keyspace's representation (demotion,
 * compaction) runs only in the normal state, on a master that is not
 * loading, and outside transactions. */
int hmBackgroundAllowed(void) {
    if (hm.state != ST_NORMAL) return 0;
    int flags = RedisModule_GetContextFlags(hm.dctx);
    if (flags & (REDISMODULE_CTX_FLAGS_SLAVE | REDISMODULE_CTX_FLAGS_LOADING)) return 0;
    /* A transaction queued while a key was hot must find it hot at EXEC:
     * pause while a MULTI seen by the filter has no EXEC/DISCARD yet. */
    if (hm.filter.multi_open > 0 && hmNowUs() - hm.filter.multi_seen_us < HM_MULTI_GRACE_US) return 0;
    if (hm.filter.multi_open > 0) hm.filter.multi_open = 0;
    return 1;
}

static int demotionAllowed(void) {
    return hm.cfg.demote && hmBackgroundAllowed();
}

/* Expired cold items are promoted (Redis then expires them with the stock
 * notification and propagation). Walks the arena at most HM_SWEEP_ITEMS
 * items per slice, one full cycle per HM_SWEEP_PAUSE_MS at most: like
 * Redis's active expire cycle it bounds when an expired item is reclaimed,
 * not whether a command sees it (an access promotes and expires at once). */
static void expiredCb(void *priv, const ColdItem *it) {
    long long now = *(long long *)((void **)priv)[1];
    if (it->expire != ARENA_NO_EXPIRE && it->expire <= now)
        hmKeyListPush(((void **)priv)[0], RedisModule_CreateString(hm.dctx, it->key, it->klen));
}

/* 1 if the sweep has work: a cycle under way or due. Nothing can expire:
 * no walk (it reads every item's index slot, a cache miss each
 * (docs/redis-module.md, "Design history")). */
static int sweepDue(uint64_t now_us) {
    if (arenaExpiring(hm.arena) == 0 || arenaHasSpilled(hm.arena)) return 0;
    return hm.sweep.cursor != 0 || now_us >= hm.sweep.next_us;
}

static void sweepSlice(uint64_t deadline) {
    if (!sweepDue(hmNowUs())) return;
    long long now = hmNowMs();
    unsigned budget = HM_SWEEP_ITEMS;
    while (budget && hmNowUs() < deadline) {
        budget = budget > 256 ? budget - 256 : 0;
        KeyList l = {0};
        void *priv[2] = {&l, &now};
        hm.sweep.cursor = arenaIterate(hm.arena, hm.sweep.cursor, 256, expiredCb, priv);
        for (size_t i = 0; i < l.n; i++) {
            /* Redis's active expire cycle deletes it from here on, with a
             * plain DEL to replicas and the AOF as for any key; deleted in
             * this slice, the DELs of a slice went out wrapped in
             * MULTI/EXEC. */
            hmPromoteKey(l.v[i], 0);
            RedisModule_FreeString(hm.dctx, l.v[i]);
        }
        RedisModule_Free(l.v);
        if (hm.sweep.cursor == 0 || hm.sweep.cursor == UINT64_MAX) {
            hm.sweep.cursor = 0;
            hm.sweep.next_us = hmNowUs() + HM_SWEEP_PAUSE_MS * 1000ULL;
            break;
        }
    }
}

static void sliceTimer(RedisModuleCtx *ctx, void *data);

static void armTimerIn(long long ms) {
    hm.bg.timer = RedisModule_CreateTimer(hm.dctx, ms, sliceTimer, NULL);
}

void hmArmTimer(void) {
    armTimerIn(hm.cfg.interval_ms);
}

/* 1 while some background work is under way (not merely due). */
static int backgroundPending(void) {
    return hm.state == ST_RESUMING || arenaRehashing(hm.arena) || (hm.pass.cursor && demotionAllowed()) ||
           hm.compact.cursor ||
           (hm.reclaim.active && hmReclaimAllowed()) ||
           (hm.compact.wanted && hm.compact.mallctl) || hm.sweep.cursor != 0;
}

/* 1 if a bite would find work: some under way, or a demotion pass, an
 * expiry sweep or a reclaim due. A bite with nothing to do still read the
 * thread CPU clock three times (system calls, not vDSO): under TCG, at one
 * bite per request, that doubled the system calls of a GET. */
static int backgroundDue(uint64_t now) {
    return backgroundPending() || (now >= hm.pass.next_us && demotionAllowed()) ||
           sweepDue(now) || hmReclaimWanted();
}

/* The background work (unspill, arena rehash, a demotion or compaction
 * pass, expiry sweep, arena reclaim) until 'deadline'. Returns
 * backgroundPending(). */
static int backgroundWork(uint64_t deadline) {
    uint64_t t0 = hmNowUs(), c0 = hmThreadCpuUs();
    hmReadBackSettle();           /* the end of this round's commands, not a step */
    uint64_t c1 = hmThreadCpuUs();
    if (hm.state == ST_RESUMING) {
        int r = 1;
        while (r == 1 && hmNowUs() < deadline) r = arenaUnspillStep(hm.arena);
        if (r == 0) hm.state = ST_NORMAL;
        if (r < 0)
            RedisModule_Log(hm.dctx, "warning", "appassist: reading the spill file back failed: %s",
                            strerror(errno));
    }
    int rehash = 1;
    while (rehash && hmNowUs() < deadline) rehash = arenaRehashStep(hm.arena, HM_REHASH_STEP);
    if (hm.compact.wanted && hm.compact.mallctl && !hm.pass.cursor && hmBackgroundAllowed())
        hmCompactSlice(deadline);
    else if (demotionAllowed())
        hmDemoteSlice(deadline, hmNowMs());
    sweepSlice(deadline);
    if (hmNowUs() < deadline && hmReclaimWanted()) hmReclaimSlice(deadline);
    hmScanRecent();               /* frees the SCAN log once its grace is over */
    uint64_t us = hmNowUs() - t0;
    if (us > hm.bg.step_max_us) hm.bg.step_max_us = us;
    uint64_t c2 = hmThreadCpuUs();
    if (c2 - c1 > hm.bg.step_max_cpu_us) hm.bg.step_max_cpu_us = c2 - c1;
    hm.bg.cpu_us += c2 - c0;
    return backgroundPending();
}

/* The event loop's bites are subscribed only while they have something to
 * do: work under way or due, or a visit to settle at the end of the round.
 * Redis fires the event twice per round of its loop (before and after
 * sleeping), each time with a module context and a temporary client set up
 * and torn down around the callback: with nothing due that was ~1500
 * instructions per request at pipeline 1, more than the filter
 * (callgrind, docs/redis-module.md, "Design history"). The timer arms them
 * when work falls due and disarms them when none is; the filter arms them
 * when it lends an item. A callback must not unsubscribe itself (Redis
 * touches the listener after the call), so only the timer disarms. */
void hmBitesArm(void) {
    if (!hm.bg.bites_on || hm.bg.bites_armed) return;
    if (RedisModule_SubscribeToServerEvent(hm.dctx, RedisModuleEvent_EventLoop, hmBgBite) !=
        REDISMODULE_OK)
        return;
    hm.bg.bites_armed = 1;
    hm.bg.bite_arms++;
}

static void bitesDisarm(void) {
    if (hm.bg.bites_armed &&
        RedisModule_SubscribeToServerEvent(hm.dctx, RedisModuleEvent_EventLoop, NULL) == REDISMODULE_OK)
        hm.bg.bites_armed = 0;
}

/* The background timer. On an idle server it runs the work in slices of
 * appassist.slice-us every interval-ms. While clients are served, the
 * event loop's bites (hmBgBite) run it instead: one 250 us slice every 3 ms
 * delayed every request that arrived meanwhile by up to the whole slice,
 * the source of the p99 tail at pipeline 1 under promote/demote churn. */
static void sliceTimer(RedisModuleCtx *ctx, void *data) {
    (void)ctx;
    (void)data;
    int busy;
    /* A pass due on a server whose data fits the hot budget is a check of
     * used_memory and nothing more: made here, so that it arms no bites.
     * It armed them once a second at the module's defaults (the timer
     * disarmed them up to 100 ms later), and every round of the event loop
     * meanwhile paid for the subscription (see hmBitesArm). */
    if (!hm.pass.cursor && hmNowUs() >= hm.pass.next_us && demotionAllowed()) hmPassSkipIfFits();
    if (backgroundDue(hmNowUs())) hmBitesArm();
    if (hm.bg.bites_armed && hm.filter.served != hm.bg.served_at_tick) {
        hm.bg.served_at_tick = hm.filter.served;
        busy = backgroundPending();
    } else {
        busy = backgroundWork(hmNowUs() + (uint64_t)hm.cfg.slice_us);
        hm.bg.slices++;
    }
    /* With no pass, rehash or sweep under way, wake up less often: a
     * timer every interval-ms was most of an idle server's CPU. A pass
     * that falls due starts at most HM_IDLE_INTERVAL_MS late. */
    uint64_t now = hmNowUs(), wake = now + HM_IDLE_INTERVAL_MS * 1000ULL;
    if (now - hm.mig.arenas_checked_us >= HM_ARENA_CHECK_MS * 1000ULL) hmZeroFreedAdopt();
    if (!busy && hm.visit.back.n == 0 && !backgroundDue(now)) bitesDisarm();
    /* Only what falls due later: a pass that is already due but not
     * allowed (replica, MULTI, migration) must not keep the timer fast. */
    if (hm.cfg.demote && hm.pass.next_us > now && hm.pass.next_us < wake) wake = hm.pass.next_us;
    if (arenaExpiring(hm.arena) && hm.sweep.next_us > now && hm.sweep.next_us < wake)
        wake = hm.sweep.next_us;
    long long ms = (long long)((wake - now) / 1000);
    armTimerIn(busy || ms < hm.cfg.interval_ms ? hm.cfg.interval_ms : ms);
}

/* Before the event loop sleeps, after it served some commands: a bite of
 * the background work, as long as half the share of time of one slice per
 * interval (slice-us / interval-ms / 2) gives, counted from the end of the
 * previous bite. So the work spreads over every round of the loop (each
 * request waits a few tens of us more) instead of one long slice landing
 * on a few. Half: the timer's full share made bites demote more than the
 * passes needed, and promotions followed (docs/redis-module.md, "Design history"). Shorter
 * credits accumulate: a bite has a fixed cost. */
void hmBgBite(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)ctx;
    (void)e;
    (void)data;
    if (sub != REDISMODULE_SUBEVENT_EVENTLOOP_BEFORE_SLEEP || hm.filter.served == hm.bg.served_at_bite)
        return;
    if (hm.visit.back.n) hmReadBackSettle();
    uint64_t now = hmNowUs();
    uint64_t period = (uint64_t)hm.cfg.interval_ms * 1000;
    uint64_t credit = (now - hm.bg.last_bite_us) * (uint64_t)hm.cfg.slice_us / (HM_BITE_SHARE_DIV * period);
    if (credit < HM_BITE_MIN_US) return;
    hm.bg.served_at_bite = hm.filter.served;
    if (!backgroundDue(now)) {
        /* Nothing to do: no credit banked either */
        hm.bg.last_bite_us = now;
        hm.bg.bites_idle++;
        return;
    }
    if (credit > (uint64_t)hm.cfg.slice_us) credit = (uint64_t)hm.cfg.slice_us;
    backgroundWork(now + credit);
    hm.bg.bites++;
    hm.bg.last_bite_us = hmNowUs();
}
