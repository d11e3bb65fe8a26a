/* filter.c -- the command filter that makes cold items transparent, and
 * visits: a read of a cold item brings it into the keyspace for the
 * command and takes it back to the arena once the command has run. */

#include <ctype.h>

#include "hybridmem.h"

/* ------------------------------------------------------------ visits */

/* An access to a cold item is a visit: the item comes into the keyspace so
 * that the stock command runs on it, and goes back to the arena, with what
 * the command left in it, before the event loop sleeps (hmReadBackSettle).
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
 * (LRU idle HM_VISIT_IDLE_MS, or LFU counter 0) and the command's lookup
 * touches it. Another client's access to the same key in that round would
 * touch the clock too: so there are no visits while a MULTI is open (as
 * for demotion) or clients may be paused (notePause).
 *
 * A key still marked when the round ends was not touched: its command
 * looked it up with NOTOUCH (TTL, TYPE, EXISTS), or did not run at all
 * because Redis refused it after the filter (ACL, arity, OOM...), or is
 * queued in a MULTI. Without a MULTI open the item goes back as it was
 * and leaves no trace, so that a command refused to a client (a key
 * outside its ACL key patterns, a command it may not run) neither promotes
 * nor reveals the key; with one, it stays hot with a fresh clock, as a
 * promotion. Whether an item read twice stays hot is decided at the end
 * of the round too, once the command has run.
 *
 * Accesses are remembered in two generations of a bit set indexed by a
 * hash of the key (a false positive only promotes early), each generation
 * one window long: "seen" = set in either. */

#define HM_VISIT_IDLE_MS        (1LL << 32)     /* ~50 days */

/* FNV-1a of a key, folded: the seen set's bit and keyShare(). */
uint32_t hmKeyFnv(const char *key, size_t l) {
    const unsigned char *p = (const unsigned char *)key;
    uint32_t h = 2166136261u;
    while (l--) h = (h ^ *p++) * 16777619u;
    return h ^ (h >> 16);
}

/* 1 if the hot set is over its budget by more than an eighth: a second
 * access then visits too, and the item stays cold. An item read twice in
 * a window is not hotter than the hot set: under accesses spread over the
 * cold items, promoting it pushed the hot set over its budget, and every
 * promotion cost a demotion a pass later (docs/redis-module.md, "Design history"). The eighth leaves room
 * for turnover: while the hot set is over its budget the passes demote
 * what went idle, and new hot items take its place. */
static int hotFull(void) {
    return hm.pass.admit_budget > 0 && hm.pass.hot_est > hm.pass.admit_budget + hm.pass.admit_budget / 8;
}

/* 1 if an item brought in for a command may go back to the arena after
 * it: not while a command may be postponed (MULTI, a pause), nor outside
 * the normal state. */
static int lendAllowed(void) {
    return hmBackgroundAllowed() &&
           (hm.visit.paused_until_us == 0 || hmNowUs() >= hm.visit.paused_until_us);
}

/* 1 if a read goes back cold (a visit); otherwise an item whose command
 * ran stays hot (with demotion off, or promote-window-ms 0). */
static int visitMode(void) {
    return hm.cfg.demote && hm.cfg.promote_window_ms != 0;
}

/* 1 if the cold item accessed now is lent to the keyspace for its command
 * (see above): whether it stays hot is decided once the command has run
 * (hmReadBackSettle), so a command Redis refuses brings nothing in. */
int hmReadBackWanted(void) {
    return hm.bg.bites_on && !hm.replica && hm.visit.back.n < HM_READ_BACK_MAX && lendAllowed();
}

/* 1 if 'k' was read before within appassist.promote-window-ms (see above);
 * it is marked as read now. */
static int seenBefore(const char *k, size_t klen) {
    uint64_t now = hmNowUs(), window = (uint64_t)hm.cfg.promote_window_ms * 1000;
    if (!hm.visit.seen[0]) {
        hm.visit.seen[0] = RedisModule_Calloc(HM_SEEN_BITS / 64, sizeof(uint64_t));
        hm.visit.seen[1] = RedisModule_Calloc(HM_SEEN_BITS / 64, sizeof(uint64_t));
        hm.visit.seen_since_us = now;
    }
    if (now - hm.visit.seen_since_us >= window) {
        uint64_t *old = hm.visit.seen[1];
        hm.visit.seen[1] = hm.visit.seen[0];
        hm.visit.seen[0] = old;
        memset(old, 0, HM_SEEN_BITS / 8);
        if (now - hm.visit.seen_since_us >= 2 * window) memset(hm.visit.seen[1], 0, HM_SEEN_BITS / 8);
        hm.visit.seen_since_us = now;
    }
    uint32_t bit = hmKeyFnv(k, klen) & (HM_SEEN_BITS - 1);
    uint64_t mask = 1ULL << (bit & 63);
    size_t w = bit >> 6;
    int seen = ((hm.visit.seen[0][w] | hm.visit.seen[1][w]) & mask) != 0;
    hm.visit.seen[0][w] |= mask;
    return seen;
}

/* 1 if a client may have a MULTI open: its queued commands ran the filter
 * and have yet to run. Every MULTI passes the filter, which sets
 * multi_since_check; CLIENT LIST (flag x) then tells, and clears it when no
 * client is in one. Asked only when a visit ends untouched. */
static int multiOpen(void) {
    if (!hm.filter.multi_since_check) return 0;
    RedisModuleCallReply *r = RedisModule_Call(hm.dctx, "CLIENT", "c", "LIST");
    size_t len = 0;
    const char *s = r ? RedisModule_CallReplyStringPtr(r, &len) : NULL;
    int open = s == NULL;       /* cannot tell: assume one */
    for (const char *p = s, *end = s + len; p && p < end && !open;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *eol = nl ? nl : end;
        const char *f = memmem(p, (size_t)(eol - p), " flags=", 7);
        if (f)
            for (f += 7; f < eol && *f != ' '; f++)
                if (*f == 'x') open = 1;
        p = nl ? nl + 1 : end;
    }
    if (r) RedisModule_FreeCallReply(r);
    if (!open) hm.filter.multi_since_check = 0;
    return open;
}

/* Mark a visited key's access clock (see above). */
void hmVisitMark(RedisModuleKey *kh) {
    if (RedisModule_SetLFU(kh, 0) != REDISMODULE_OK) RedisModule_SetLRU(kh, HM_VISIT_IDLE_MS);
}

/* Give a visited key the clock of a fresh key: it stays hot. */
static void visitReset(RedisModuleKey *kh) {
    if (RedisModule_SetLFU(kh, HM_LFU_INIT) != REDISMODULE_OK) RedisModule_SetLRU(kh, 0);
}

/* 1 if a command read the key since hmVisitMark; otherwise visitReset. */
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

/* The clock of the lent item at 'ref' (hmClockOf; 0 if unreadable). */
static uint32_t lentClock(ColdRef ref) {
    ColdItem it;
    if (arenaRead(hm.arena, ref, &it) < 0) return 0;
    arenaItemRelease(&it);
    return it.clock;
}

/* The copy open as 'kh' of a lent item whose clock was 'clock' was read by
 * the round's commands (visitDone): give it the clock the key would have
 * had if it had stayed hot. LRU: the read's, as it is; LFU: the item's
 * counter with the reads counted in (from LFU_INIT_VAL, as a fresh key's,
 * for an item without one). */
static void visitClock(RedisModuleKey *kh, uint32_t clock) {
    long long freq;
    if (RedisModule_GetLFU(kh, &freq) == REDISMODULE_OK && freq >= 0) {
        uint32_t base = clock & HM_CLOCK_LFU ? clock : HM_CLOCK_LFU | HM_LFU_INIT;
        RedisModule_SetLFU(kh, hmClockAfterVisit(base, freq) & 0xff);
    }
}

/* Take the visited item back: unchanged, by deleting the keyspace copy and
 * taking the lent item at 'ref' back; changed, with the value and expire
 * the commands left. 'touched': the commands read the key (visitClock ran),
 * and the item takes the copy's clock; otherwise it keeps its own. Closes
 * 'kh'. */
static void visitBack(RedisModuleString *key, RedisModuleKey *kh, ColdRef ref, mstime_t expire,
                      int touched) {
    size_t klen;
    const char *k = RedisModule_StringPtrLen(key, &klen);
    if (visitUnchanged(kh, ref, expire)) {
        uint32_t clock = touched ? hmClockOf(kh) : 0;
        RedisModule_DeleteKey(kh);
        RedisModule_CloseKey(kh);
        arenaReturn(hm.arena, k, klen);
        if (touched) arenaSetClock(hm.arena, ref, clock);
    } else {
        /* The new version goes to the arena's end, ahead of every SCAN
         * cursor; if it cannot, it stays hot. */
        uint64_t pos = arenaCursorOf(hm.arena, ref);
        if (!touched) hmClockRestore(kh, lentClock(ref));
        arenaDelete(hm.arena, k, klen);
        if (!hmMoveToArena(key, kh, expire)) hmScanLogNote(k, klen, pos);
    }
}

/* The visited item stays hot (a promotion); closes 'kh'. */
static void visitKeep(const char *k, size_t klen, RedisModuleKey *kh, int lent, ColdRef ref) {
    if (lent) {
        hmScanLogNote(k, klen, arenaCursorOf(hm.arena, ref));
        arenaDelete(hm.arena, k, klen);
    }
    hm.pass.hot_est += (long long)(klen + RedisModule_ValueLength(kh) + HM_ITEM_OVERHEAD);
    RedisModule_CloseKey(kh);
    hm.stats.promotions++;
}

/* After the commands of this round of the event loop, the visited items go
 * back (visitBack), unless read before within the window: those stay hot
 * unless the hot set is full (hotFull). A key the round deleted, expired or
 * turned into another type stays as it is (the lent item goes). An item
 * whose command did not touch it goes back as it was, but stays hot while
 * a MULTI is open (see above); any item stays hot when visits are not
 * allowed now (a migration or a pause began). Runs before anything walks
 * the keyspace or the arena as a whole (bites, the timer, PREPARE, DEMOTE,
 * COMPACT, SWAPDB). */
void hmReadBackSettle(void) {
    int allowed = lendAllowed(), visits = allowed && visitMode();
    for (size_t i = 0; i < hm.visit.back.n; i++) {
        RedisModuleString *key = hm.visit.back.v[i];
        size_t klen;
        const char *k = RedisModule_StringPtrLen(key, &klen);
        mstime_t expire;
        ColdRef ref;
        RedisModuleKey *kh = hmOpenLiveString(key, &expire);
        int lent = arenaLookup(hm.arena, k, klen, &ref) == 2;
        if (!kh) {
            /* deleted, expired or retyped by the round's commands */
            if (lent) arenaDelete(hm.arena, k, klen);
            if (visits) hm.stats.visits++;
            else hm.stats.promotions++;
        } else if (lent && allowed && visitDone(kh)) {
            int seen = visits && seenBefore(k, klen);
            if (seen && hotFull()) hm.stats.promotions_refused++;
            visitClock(kh, lentClock(ref));
            if (!visits || (seen && !hotFull())) {
                visitKeep(k, klen, kh, lent, ref);
            } else {
                visitBack(key, kh, ref, expire, 1);
                hm.stats.visits++;
            }
        } else if (lent && allowed && !multiOpen()) {
            visitBack(key, kh, ref, expire, 0);     /* untouched: see above */
        } else {
            /* PREPARE dropped the arena, or the command is still to run. */
            visitReset(kh);
            visitKeep(k, klen, kh, lent, ref);
        }
        RedisModule_FreeString(NULL, key);
    }
    hm.visit.back.n = 0;
}

/* ------------------------------------------------------------ command filter */

static RedisModuleString *hm_name_keys, *hm_name_scan, *hm_name_dbsize, *hm_name_unreadable;

int hmCmdIs(const char *c, size_t l, const char *name) {
    return strlen(name) == l && strncasecmp(c, name, l) == 0;
}

/* Commands whose only key is argv[1] (any argc), and those for which that
 * holds with argc == 2: the filter takes the key without asking Redis
 * (RedisModule_GetCommandKeys looks the command up and allocates: a tenth
 * of a pipelined GET (docs/redis-module.md, "Design history")). Must stay exact: a
 * command listed here with another key would run on that key cold. */
#define NAMELEN(s) s, sizeof(s) - 1
typedef struct { const char *name; size_t len; } CmdName;
static const CmdName one_key_cmds[] = {
    {NAMELEN("get")}, {NAMELEN("set")}, {NAMELEN("setnx")}, {NAMELEN("setex")},
    {NAMELEN("psetex")}, {NAMELEN("getset")}, {NAMELEN("getdel")},
    {NAMELEN("getex")}, {NAMELEN("incr")}, {NAMELEN("decr")}, {NAMELEN("incrby")},
    {NAMELEN("decrby")}, {NAMELEN("incrbyfloat")}, {NAMELEN("append")},
    {NAMELEN("strlen")}, {NAMELEN("getrange")}, {NAMELEN("setrange")},
    {NAMELEN("substr")}, {NAMELEN("ttl")}, {NAMELEN("pttl")}, {NAMELEN("expire")},
    {NAMELEN("pexpire")}, {NAMELEN("expireat")}, {NAMELEN("pexpireat")},
    {NAMELEN("persist")}, {NAMELEN("type")}, {NAMELEN("expiretime")},
    {NAMELEN("pexpiretime")},
};
static const CmdName one_key_if_argc2[] = {
    {NAMELEN("exists")}, {NAMELEN("del")}, {NAMELEN("unlink")}, {NAMELEN("touch")},
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
    if (hmCmdIs(c, l, "failover")) {
        ms = 60000;
        for (int i = 1; i < argc; i++) {
            const char *a = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, i), &l);
            if (hmCmdIs(a, l, "abort")) ms = 0;
            else if (hmCmdIs(a, l, "timeout") && i + 1 < argc)
                RedisModule_StringToLongLong(RedisModule_CommandFilterArgGet(f, i + 1), &ms);
        }
    } else if (argc >= 2) {
        const char *a = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, 1), &l);
        if (hmCmdIs(a, l, "unpause")) ms = 0;
        else if (hmCmdIs(a, l, "pause") && argc >= 3)
            RedisModule_StringToLongLong(RedisModule_CommandFilterArgGet(f, 2), &ms);
    }
    if (ms == 0) hm.visit.paused_until_us = 0;
    else if (ms > 0 && hmNowUs() + (uint64_t)ms * 1000 > hm.visit.paused_until_us)
        hm.visit.paused_until_us = hmNowUs() + (uint64_t)ms * 1000;
}

/* A cold item the command names could not be read (a spilled chunk): the
 * command must not run on the key as if it were missing. It becomes
 * appassist.unreadable, which answers with an error. */
static void refuseUnreadable(RedisModuleCommandFilterCtx *f) {
    RedisModule_RetainString(NULL, hm_name_unreadable);
    RedisModule_CommandFilterArgReplace(f, 0, hm_name_unreadable);
}

/* Bring in the keys of OBJECT and DEBUG, promoted rather than visiting:
 * they show the key's access clock (OBJECT IDLETIME/FREQ, DEBUG OBJECT),
 * which a visit marks (hmVisitMark), and the item's own clock comes with
 * a promotion (hmClockRestore). DEBUG declares no keys: its subcommands
 * that read one name it at argv[2] (DIGEST-VALUE: all the arguments from
 * there); DIGEST, a digest of the whole dataset, and POPULATE, which
 * creates the keys key:0..key:N-1 that do not exist, need every cold item
 * in the keyspace (O(cold items), as those commands are O(keys)). RELOAD
 * with MERGE marks the load to come as a merge (see persist.c's auxLoad).
 * Before, DEBUG DIGEST left the cold items out, and POPULATE overwrote
 * cold keys of those names (Redis's other.tcl, "Same dataset digest if
 * saving/reloading as AOF?", failed). */
static void promoteIntrospected(RedisModuleCommandFilterCtx *f, int argc, int debug) {
    if (argc < 3 && !(debug && argc >= 2)) return;
    size_t sl;
    const char *sub = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, 1), &sl);
    int from = 2, to = argc < 3 ? argc : 3;
    if (debug) {
        if (hmCmdIs(sub, sl, "reload")) {
            /* MERGE: loaded keys replace the ones there (persist.c) */
            for (int i = 2; i < argc; i++) {
                const char *o = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, i), &sl);
                if (hmCmdIs(o, sl, "merge")) hm.load_merges = 1;
            }
            return;
        }
        if (!arenaCount(hm.arena)) return;
        if (hmCmdIs(sub, sl, "digest") || hmCmdIs(sub, sl, "populate")) {
            if (hmPromoteAll() < 0) refuseUnreadable(f);
            return;
        }
        if (hmCmdIs(sub, sl, "digest-value")) to = argc;
        else if (!hmCmdIs(sub, sl, "object") && !hmCmdIs(sub, sl, "sdslen") &&
                 !hmCmdIs(sub, sl, "listpack") && !hmCmdIs(sub, sl, "quicklist") &&
                 !hmCmdIs(sub, sl, "htstats-key"))
            return;
    }
    int bad = 0;
    for (int i = from; i < to; i++) bad |= hmPromoteKey(RedisModule_CommandFilterArgGet(f, i), 0) < 0;
    if (bad) refuseUnreadable(f);
}

/* BLMOVE and BRPOPLPUSH that block push to their destination when an
 * element arrives, later, without the filter running again: a destination
 * that is cold then (a string: the push must fail with WRONGTYPE) was taken
 * for a missing key, a list was created beside the cold string and the
 * string was lost (Redis's list.tcl, "BRPOPLPUSH with wrong destination
 * type", failed now and then with demotion at its most aggressive). So
 * their keys are promoted rather than visited, and the destination is
 * pinned: demotion leaves it hot for the command's timeout (timeout 0: as
 * long as the pin stays; the oldest of HM_PINS_MAX goes first). */
static void pinKey(RedisModuleString *key, uint64_t until_us) {
    for (int i = 0; i < hm.filter.npins; i++) {
        if (RedisModule_StringCompare(hm.filter.pins[i].key, key) == 0) {
            if (until_us > hm.filter.pins[i].until_us) hm.filter.pins[i].until_us = until_us;
            return;
        }
    }
    if (hm.filter.npins == HM_PINS_MAX) {
        RedisModule_FreeString(NULL, hm.filter.pins[0].key);
        memmove(hm.filter.pins, hm.filter.pins + 1, sizeof(hm.filter.pins[0]) * (HM_PINS_MAX - 1));
        hm.filter.npins--;
    }
    hm.filter.pins[hm.filter.npins++] = (HmPin){RedisModule_CreateStringFromString(NULL, key), until_us};
}

/* 1 if 'key' is pinned (above): the demotion pass leaves it hot. */
int hmPinned(RedisModuleString *key) {
    uint64_t now = hmNowUs();
    for (int i = 0; i < hm.filter.npins; i++) {
        if (hm.filter.pins[i].until_us <= now) {
            RedisModule_FreeString(NULL, hm.filter.pins[i].key);
            hm.filter.pins[i--] = hm.filter.pins[--hm.filter.npins];
            continue;
        }
        if (RedisModule_StringCompare(hm.filter.pins[i].key, key) == 0) return 1;
    }
    return 0;
}

static void blockingMove(RedisModuleCommandFilterCtx *f, int argc) {
    if (argc < 4) return;
    double secs = 0;
    RedisModule_StringToDouble(RedisModule_CommandFilterArgGet(f, argc - 1), &secs);
    uint64_t until = secs > 0 && secs < 1e9 ? hmNowUs() + (uint64_t)((secs + 1) * 1e6) : UINT64_MAX;
    pinKey(RedisModule_CommandFilterArgGet(f, 2), until);
    if (arenaCount(hm.arena) && (hmPromoteKey(RedisModule_CommandFilterArgGet(f, 1), 0) < 0 ||
                                 hmPromoteKey(RedisModule_CommandFilterArgGet(f, 2), 0) < 0))
        refuseUnreadable(f);
}

/* SORT and SORT_RO read the keys their BY and GET patterns name, one per
 * element of the sorted key ('*' replaced by the element; no '*', "#" or a
 * hash field "->f": no string key), and Redis declares none of them: bring
 * in the cold ones (visits, so what the command does not read goes back as
 * it was). Before, a cold weight or GET key read as missing (Redis's
 * sort.tcl, "SORT BY key" and twelve more, failed with demotion at its most
 * aggressive). O(elements x patterns) index lookups, as SORT itself makes
 * as many keyspace lookups. The sorted key is opened for writing (no hit
 * or miss counted); like the lookups of promote.c's keyspace-first order,
 * that expires it if its TTL has passed, just before SORT would. Returns 1
 * if it refused the command (an item could not be read). */
typedef struct SortPatterns {
    const char *pre[16], *post[16];
    size_t prelen[16], postlen[16];
    int n;
    int bad;
} SortPatterns;

static void sortPromote(SortPatterns *sp, const char *e, size_t el) {
    for (int i = 0; i < sp->n; i++) {
        size_t len = sp->prelen[i] + el + sp->postlen[i];
        char stack[256], *buf = len <= sizeof(stack) ? stack : RedisModule_Alloc(len);
        memcpy(buf, sp->pre[i], sp->prelen[i]);
        memcpy(buf + sp->prelen[i], e, el);
        memcpy(buf + sp->prelen[i] + el, sp->post[i], sp->postlen[i]);
        RedisModuleString *k = RedisModule_CreateString(NULL, buf, len);
        sp->bad |= hmPromoteKey(k, 1) < 0;
        RedisModule_FreeString(NULL, k);
        if (buf != stack) RedisModule_Free(buf);
    }
}

static void sortScanCb(RedisModuleKey *key, RedisModuleString *field, RedisModuleString *value,
                       void *priv) {
    (void)key;
    (void)value;
    size_t el;
    const char *e = RedisModule_StringPtrLen(field, &el);
    sortPromote(priv, e, el);
}

static int promoteSortPatterns(RedisModuleCommandFilterCtx *f, int argc) {
    SortPatterns sp = {0};
    for (int i = 2; i + 1 < argc; i++) {
        size_t ol, pl;
        const char *opt = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, i), &ol);
        if (hmCmdIs(opt, ol, "limit")) { i += 2; continue; }
        if (hmCmdIs(opt, ol, "store")) { i++; continue; }
        if (!hmCmdIs(opt, ol, "by") && !hmCmdIs(opt, ol, "get")) continue;
        const char *pat = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, ++i), &pl);
        const char *star = memchr(pat, '*', pl);
        if (!star || sp.n == 16) continue;
        const char *arrow = memmem(star + 1, pl - (size_t)(star + 1 - pat), "->", 2);
        if (arrow && arrow + 2 < pat + pl) continue;         /* a hash field */
        sp.pre[sp.n] = pat;
        sp.prelen[sp.n] = (size_t)(star - pat);
        sp.post[sp.n] = star + 1;
        sp.postlen[sp.n] = pl - sp.prelen[sp.n] - 1;
        sp.n++;
    }
    if (sp.n == 0) return 0;
    RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, RedisModule_CommandFilterArgGet(f, 1),
                                             REDISMODULE_READ | REDISMODULE_WRITE |
                                             REDISMODULE_OPEN_KEY_NOTOUCH);
    int type = RedisModule_KeyType(kh);
    if (type == REDISMODULE_KEYTYPE_LIST) {
        long n = (long)RedisModule_ValueLength(kh);
        for (long i = 0; i < n; i++) {
            RedisModuleString *e = RedisModule_ListGet(kh, i);
            if (!e) break;
            size_t el;
            const char *ep = RedisModule_StringPtrLen(e, &el);
            sortPromote(&sp, ep, el);
            RedisModule_FreeString(NULL, e);
        }
    } else if (type == REDISMODULE_KEYTYPE_SET || type == REDISMODULE_KEYTYPE_ZSET) {
        RedisModuleScanCursor *c = RedisModule_ScanCursorCreate();
        while (RedisModule_ScanKey(kh, c, sortScanCb, &sp)) {}
        RedisModule_ScanCursorDestroy(c);
    }
    RedisModule_CloseKey(kh);
    if (sp.bad) refuseUnreadable(f);
    return sp.bad;
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
    hm.filter.served++;
    if (argc < 1 || !hm.arena) return;
    size_t cl;
    const char *c = RedisModule_StringPtrLen(RedisModule_CommandFilterArgGet(f, 0), &cl);
    switch (cl) {
    case 4:
        if (hmCmdIs(c, cl, "keys")) {
            if (arenaCount(hm.arena)) {
                RedisModule_RetainString(NULL, hm_name_keys);
                RedisModule_CommandFilterArgReplace(f, 0, hm_name_keys);
            }
            return;
        }
        if (hmCmdIs(c, cl, "scan")) {
            RedisModule_RetainString(NULL, hm_name_scan);
            RedisModule_CommandFilterArgReplace(f, 0, hm_name_scan);
            return;
        }
        if (hmCmdIs(c, cl, "exec")) { if (hm.filter.multi_open > 0) hm.filter.multi_open--; return; }
        if (hmCmdIs(c, cl, "mget")) {
            /* every argument is a key */
            int bad = 0;
            if (arenaCount(hm.arena))
                for (int i = 1; i < argc; i++)
                    bad |= hmPromoteKey(RedisModule_CommandFilterArgGet(f, i), 1) < 0;
            if (bad) refuseUnreadable(f);
            return;
        }
        break;
    case 5:
        if (hmCmdIs(c, cl, "debug")) {
            promoteIntrospected(f, argc, 1);
            return;
        }
        if (hmCmdIs(c, cl, "multi")) {
            hm.filter.multi_open++;
            hm.filter.multi_seen_us = hmNowUs();
            hm.filter.multi_since_check = 1;
            return;
        }
        break;
    case 6:
        if (hmCmdIs(c, cl, "dbsize")) {
            if (arenaCount(hm.arena)) {
                RedisModule_RetainString(NULL, hm_name_dbsize);
                RedisModule_CommandFilterArgReplace(f, 0, hm_name_dbsize);
            }
            return;
        }
        if (hmCmdIs(c, cl, "swapdb")) {
            if (arenaCount(hm.arena) && hmPromoteAll() < 0) refuseUnreadable(f);
            return;
        }
        if (hmCmdIs(c, cl, "client")) { notePause(f, argc); return; }
        if (hmCmdIs(c, cl, "blmove")) { blockingMove(f, argc); return; }
        if (hmCmdIs(c, cl, "object")) {
            if (arenaCount(hm.arena)) promoteIntrospected(f, argc, 0);
            return;
        }
        break;
    case 8:
        if (hmCmdIs(c, cl, "failover")) { notePause(f, argc); return; }
        break;
    case 10:
        if (hmCmdIs(c, cl, "brpoplpush")) { blockingMove(f, argc); return; }
        break;
    case 7:
        if (hmCmdIs(c, cl, "discard")) { if (hm.filter.multi_open > 0) hm.filter.multi_open--; return; }
        break;
    }
    if (arenaCount(hm.arena) == 0) return;
    if (((cl == 4 && hmCmdIs(c, cl, "sort")) || (cl == 7 && hmCmdIs(c, cl, "sort_ro"))) &&
        promoteSortPatterns(f, argc))
        return;
    const CmdName *one = firstArgIsOnlyKey(c, cl, argc);
    if (one) {
        if (hmPromoteKey(RedisModule_CommandFilterArgGet(f, 1), 1) < 0) refuseUnreadable(f);
        return;
    }

    RedisModuleString *stackv[16], **argv = stackv;
    if (argc > 16) argv = RedisModule_Alloc(sizeof(*argv) * (size_t)argc);
    for (int i = 0; i < argc; i++) argv[i] = RedisModule_CommandFilterArgGet(f, i);
    int nkeys = 0;
    int *pos = RedisModule_GetCommandKeys(hm.dctx, argv, argc, &nkeys);
    int bad = 0;
    for (int i = 0; pos && i < nkeys; i++) bad |= hmPromoteKey(argv[pos[i]], 1) < 0;
    if (pos) RedisModule_Free(pos);
    if (argv != stackv) RedisModule_Free(argv);
    if (bad) refuseUnreadable(f);
}

/* ------------------------------------------------------------ keys with a TTL */

/* 1 if db 0 may hold a key with a TTL: the filter then asks the arena
 * before the keyspace (see promote.c's indexFirst). Set by every generic
 * keyspace event on db 0 (EXPIRE, SET EX, GETEX, RESTORE, COPY, MOVE,
 * RENAME... give keys TTLs; the others cost a flag write), by loading a
 * dataset, and by the promotion of a cold item with one. Cleared when
 * INFO keyspace, asked at most every HM_VOLATILE_CHECK_MS while it is set,
 * shows none in db 0. Another module's RedisModule_SetExpire fires no
 * event: until the next check, a key it gave a TTL that has passed may be
 * expired by the filter's lookup, before its command. */
int hmVolatileKeys(void) {
    if (!hm.filter.volatile_keys) return 0;
    uint64_t now = hmNowUs();
    if (now - hm.filter.volatile_checked_us < HM_VOLATILE_CHECK_MS * 1000ULL) return 1;
    hm.filter.volatile_checked_us = now;
    RedisModuleServerInfoData *info = RedisModule_GetServerInfo(hm.dctx, "keyspace");
    const char *db0 = info ? RedisModule_ServerInfoGetFieldC(info, "db0") : NULL;
    const char *e = db0 ? strstr(db0, "expires=") : NULL;
    /* No db0 line: db 0 is empty. */
    if (info && (!db0 || (e && strtoll(e + 8, NULL, 10) == 0))) hm.filter.volatile_keys = 0;
    if (info) RedisModule_FreeServerInfo(hm.dctx, info);
    return hm.filter.volatile_keys;
}

static int onGenericEvent(RedisModuleCtx *ctx, int type, const char *event, RedisModuleString *key) {
    (void)type;
    (void)event;
    (void)key;
    if (RedisModule_GetSelectedDb(ctx) == 0) hm.filter.volatile_keys = 1;
    return REDISMODULE_OK;
}

static void onLoading(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
    (void)ctx;
    (void)e;
    (void)data;
    hm.filter.volatile_keys = 1;
    if (sub == REDISMODULE_SUBEVENT_LOADING_ENDED || sub == REDISMODULE_SUBEVENT_LOADING_FAILED)
        hm.load_merges = 0;
}

/* Register the filter (it sees every command but those of this module). */
int hmFilterInit(RedisModuleCtx *ctx) {
    hm.filter.volatile_keys = 1;        /* until INFO says otherwise */
    if (RedisModule_SubscribeToKeyspaceEvents(ctx, REDISMODULE_NOTIFY_GENERIC, onGenericEvent) !=
            REDISMODULE_OK ||
        RedisModule_SubscribeToServerEvent(ctx, RedisModuleEvent_Loading, onLoading) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    hm_name_keys = RedisModule_CreateString(NULL, "appassist.keys", 14);
    hm_name_scan = RedisModule_CreateString(NULL, "appassist.scan", 14);
    hm_name_dbsize = RedisModule_CreateString(NULL, "appassist.dbsize", 16);
    hm_name_unreadable = RedisModule_CreateString(NULL, "appassist.unreadable", 20);
    if (!RedisModule_RegisterCommandFilter(ctx, hmFilter, REDISMODULE_CMDFILTER_NOSELF))
        return REDISMODULE_ERR;
    return REDISMODULE_OK;
}
