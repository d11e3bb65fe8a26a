/* promote.c -- promotion (arena -> keyspace) and demotion (keyspace ->
 * arena) of one item. */

#include "hybridmem.h"

/* ------------------------------------------------------------ access clocks */

/* A cold item keeps the access clock its key had (ColdItem.clock), so that
 * a key brought back into the keyspace has the idle time or LFU counter it
 * would have had if it had stayed: OBJECT IDLETIME/FREQ, DEBUG OBJECT and
 * the eviction policies see what stock Redis shows. Before, a promoted key
 * got a fresh clock, and one only visiting showed the visit's mark (an
 * idle time of 50 days; Redis's introspection-2.tcl "TOUCH alters the last
 * access time of a key" failed). An LRU clock is the second of the last
 * access, counted from HM_CLOCK_EPOCH_S, plus 1 (good until 2091); an LFU
 * clock is HM_CLOCK_LFU | the counter, whose decay stops while the item
 * is cold (as after a relocation, see compact.c). 0: none, the key gets a
 * fresh clock. */
uint32_t hmClockOf(RedisModuleKey *kh) {
    long long freq;
    mstime_t idle;
    if (RedisModule_GetLFU(kh, &freq) == REDISMODULE_OK && freq >= 0)
        return HM_CLOCK_LFU | (uint32_t)(freq > 255 ? 255 : freq);
    if (RedisModule_GetLRU(kh, &idle) != REDISMODULE_OK || idle < 0) return 0;
    long long at = hmNowMs() / 1000 - idle / 1000 - HM_CLOCK_EPOCH_S;
    return at >= 0 && at < (long long)HM_CLOCK_LFU - 1 ? (uint32_t)at + 1 : 0;
}

/* Give the key open as 'kh' the access clock 'clock' (hmClockOf). A clock
 * of the other policy (maxmemory-policy changed meanwhile) leaves it as it
 * is. */
void hmClockRestore(RedisModuleKey *kh, uint32_t clock) {
    if (clock == 0) return;
    if (clock & HM_CLOCK_LFU) {
        RedisModule_SetLFU(kh, clock & 0xff);
        return;
    }
    long long idle_s = hmNowMs() / 1000 - ((long long)clock - 1 + HM_CLOCK_EPOCH_S);
    RedisModule_SetLRU(kh, idle_s > 0 ? idle_s * 1000 : 0);
}

/* The LFU clock of an item whose key was read 'hits' times during a visit
 * (counted from the visit's mark, see hmVisitMark): Redis's LFULogIncr
 * applied as many times, with the default lfu-log-factor (10). Other
 * clocks: 0, a fresh one. */
uint32_t hmClockAfterVisit(uint32_t clock, long long hits) {
    if (!(clock & HM_CLOCK_LFU)) return 0;
    uint32_t c = clock & 0xff;
    for (; hits > 0 && c < 255; hits--) {
        double base = c > HM_LFU_INIT ? c - HM_LFU_INIT : 0;
        if ((double)rand() / RAND_MAX < 1.0 / (base * 10 + 1)) c++;
    }
    return HM_CLOCK_LFU | c;
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
 * while a miss on the arena's index came on top (docs/redis-module.md, "Design history"). A write-mode lookup counts no keyspace_hits/misses
 * and fires no "keymiss" event, but like any lookup it expires a key whose
 * TTL has passed, and here that is before the command: a tracking
 * client's invalidation then came before the command's reply instead of
 * after it, and a command Redis refuses or queues expired the key all the
 * same (Redis's tracking.tcl, "Tracking invalidation message is not
 * interleaved with multiple keys response", failed). So the arena is
 * asked first while db 0 may hold a key with a TTL (hmVolatileKeys), as on
 * a replica, which only expires keys when its master says so; the keyspace
 * is then asked only for cold keys, which it does not hold. */
static int indexFirst(void) {
    return hm.replica || hmVolatileKeys();
}

static RedisModuleKey *openIfAbsent(RedisModuleString *key) {
    RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, key, REDISMODULE_WRITE |
                                                           REDISMODULE_OPEN_KEY_NOTOUCH);
    if (RedisModule_KeyType(kh) == REDISMODULE_KEYTYPE_EMPTY) return kh;
    RedisModule_CloseKey(kh);
    return NULL;
}

/* Bring the cold item 'key' into the keyspace before a command runs on it.
 * 'visit': the item is lent to the keyspace when that is allowed, and
 * hmReadBackSettle decides once the command has run: a visit (back to the
 * arena) unless it was read before within appassist.promote-window-ms, or
 * back as it was if the command did not run. Returns 1 if the item was
 * brought in, 0 if it was not cold, -1 on error. */
int hmPromoteKey(RedisModuleString *key, int visit) {
    size_t klen;
    const char *k = RedisModule_StringPtrLen(key, &klen);
    RedisModuleCtx *ctx = hm.dctx;
    RedisModuleKey *kh = NULL;
    ColdRef ref;
    int index_first = indexFirst();
    if (!index_first && !(kh = openIfAbsent(key))) return 0;
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
    uint32_t clock = it.clock;
    long long bytes = (long long)(klen + it.vlen + HM_ITEM_OVERHEAD);
    arenaItemRelease(&it);
    RedisModule_StringSet(kh, val);
    int expired = 0;
    if (expire != ARENA_NO_EXPIRE) {
        RedisModule_SetAbsExpire(kh, expire);
        hm.filter.volatile_keys = 1;          /* a key with a TTL in the keyspace */
        expired = expire <= hmNowMs();
    }
    RedisModule_FreeString(ctx, val);
    if (visit && !expired && hmReadBackWanted()) {
        /* The arena keeps the item, lent: if the command leaves it as it
         * was, going back costs only the keyspace delete. */
        arenaBorrow(hm.arena, k, klen);
        hmVisitMark(kh);
        hmKeyListPush(&hm.visit.back, RedisModule_CreateStringFromString(NULL, key));
        hmBitesArm();             /* the bite settles it before the loop sleeps */
    } else {
        hmClockRestore(kh, clock);
        if (!expired) hmScanLogNote(k, klen, arenaCursorOf(hm.arena, ref));
        arenaDelete(hm.arena, k, klen);
        if (expired) hm.stats.expired_promotions++;
        hm.stats.promotions++;
        hm.pass.hot_est += bytes;
    }
    RedisModule_CloseKey(kh);
    return 1;
}

/* Promote every cold item (SWAPDB touching db 0, pure-AOF rewrites). This is
 * O(cold items) and blocks; it only runs for rare administrative commands.
 * Returns -1 (logged) if some item could not be read: SWAPDB is then
 * refused (hmFilter); a pure-AOF rewrite cannot be, the log says what it
 * lacks. */

void hmCollectCb(void *priv, const ColdItem *it) {
    hmKeyListPush(priv, RedisModule_CreateString(hm.dctx, it->key, it->klen));
}

int hmPromoteAll(void) {
    hmReadBackSettle();
    KeyList l = {0};
    uint64_t cur = 0;
    int failed = 0;
    do {
        cur = arenaIterate(hm.arena, cur, 4096, hmCollectCb, &l);
    } while (cur && cur != UINT64_MAX);
    if (cur == UINT64_MAX) failed++;
    for (size_t i = 0; i < l.n; i++) {
        if (hmPromoteKey(l.v[i], 0) < 0) failed++;
        RedisModule_FreeString(hm.dctx, l.v[i]);
    }
    RedisModule_Free(l.v);
    if (failed) {
        RedisModule_Log(hm.dctx, "warning", "appassist: promoting every cold item failed: "
                        "%zu promoted, %llu left cold (unreadable)", l.n,
                        (unsigned long long)arenaCount(hm.arena));
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ demotion */

/* Open 'key' for a representation change (demotion, relocation): a write
 * handle that does not touch LRU/LFU, with *expire filled. NULL (nothing
 * open) if the key is not a string or is logically expired: Redis's own
 * expiry deals with those. */
RedisModuleKey *hmOpenLiveString(RedisModuleString *key, mstime_t *expire) {
    RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, key, REDISMODULE_READ | REDISMODULE_WRITE |
                                                           REDISMODULE_OPEN_KEY_NOTOUCH);
    if (RedisModule_KeyType(kh) != REDISMODULE_KEYTYPE_STRING) {
        RedisModule_CloseKey(kh);
        return NULL;
    }
    *expire = RedisModule_GetAbsExpire(kh);
    if (*expire != REDISMODULE_NO_EXPIRE && *expire <= hmNowMs()) {
        RedisModule_CloseKey(kh);
        return NULL;
    }
    return kh;
}

/* Move string key 'key', open as 'kh' (hmOpenLiveString), from db 0 into the
 * arena and close 'kh'. Returns the bytes moved (key, value and the
 * estimated overhead), 0 if it was not moved. */
uint64_t hmMoveToArena(RedisModuleString *key, RedisModuleKey *kh, mstime_t expire) {
    size_t klen, vlen;
    const char *k = RedisModule_StringPtrLen(key, &klen);
    const char *v = RedisModule_StringDMA(kh, &vlen, REDISMODULE_READ);
    ColdRef ref;
    if (v == NULL || arenaLookup(hm.arena, k, klen, &ref) != 0 ||
        arenaInsertClock(hm.arena, k, klen, v, vlen,
                         expire == REDISMODULE_NO_EXPIRE ? ARENA_NO_EXPIRE : expire,
                         hmClockOf(kh)) < 0) {
        hm.stats.demote_errors++;
        RedisModule_CloseKey(kh);
        return 0;
    }
    RedisModule_DeleteKey(kh);
    RedisModule_CloseKey(kh);
    return klen + vlen + HM_ITEM_OVERHEAD;
}

/* Demote 'key' (a pass picked it). Returns 1 if demoted. */
int hmDemoteKey(RedisModuleString *key) {
    mstime_t expire;
    if (hmPinned(key)) return 0;
    RedisModuleKey *kh = hmOpenLiveString(key, &expire);
    uint64_t bytes = kh ? hmMoveToArena(key, kh, expire) : 0;
    if (!bytes) return 0;
    hm.stats.demotions++;
    hm.pass.demoted++;
    hm.pass.hot_est = hm.pass.hot_est > (long long)bytes ? hm.pass.hot_est - (long long)bytes : 0;
    hm.compact.pending += bytes;
    return 1;
}
