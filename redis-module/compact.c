/* compact.c -- compaction of the hot keyspace (jemalloc) after demotions
 * left holes, reclaim of the arena's holes, APPASSIST.COMPACT. */

#include <dlfcn.h>

#include "hybridmem.h"
#include "zerofree.h"

/* ------------------------------------------------------------ compaction */

/* Why: demotion deletes cold keys one by one. Their dictEntry, key sds and
 * value robj/sds go back to jemalloc, but hot and cold items were
 * interleaved in the allocator's slabs, so hardly any page becomes empty
 * and the process keeps the memory resident (docs/redis-module.md, "Design history"). A compaction
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
 * A purge from a slice returns everything jemalloc holds dirty at once,
 * however little the slice relocated (docs/redis-module.md, "Design history").
 * PREPARE purges (MEMORY PURGE). */

/* Give jemalloc's dirty pages back now (Redis's MEMORY PURGE). */
void hmMemoryPurge(RedisModuleCtx *ctx) {
    RedisModuleCallReply *r = RedisModule_Call(ctx, "MEMORY", "c", "PURGE");
    if (r) RedisModule_FreeCallReply(r);
}

static int tcacheSet(bool on) {
    return hm.compact.mallctl("thread.tcache.enabled", NULL, NULL, &on, sizeof(on));
}

/* Find jemalloc's mallctl in the server process; compaction stays off
 * (logged) under any other allocator. */
void hmCompactInit(RedisModuleCtx *ctx) {
    RedisModuleServerInfoData *info = RedisModule_GetServerInfo(ctx, "memory");
    const char *alloc = info ? RedisModule_ServerInfoGetFieldC(info, "mem_allocator") : NULL;
    int jemalloc = alloc && strncmp(alloc, "jemalloc", 8) == 0;
    if (info) RedisModule_FreeServerInfo(ctx, info);
    void *sym = NULL;
    if (jemalloc) {
        sym = dlsym(RTLD_DEFAULT, "mallctl");
        if (!sym) sym = dlsym(RTLD_DEFAULT, "je_mallctl");
    }
    *(void **)&hm.compact.mallctl = sym;
    bool on;
    size_t len = sizeof(on);
    if (hm.compact.mallctl && hm.compact.mallctl("thread.tcache.enabled", &on, &len, NULL, 0) != 0)
        hm.compact.mallctl = NULL;
    if (!hm.compact.mallctl) {
        RedisModule_Log(ctx, "notice", "appassist: allocator is not jemalloc with mallctl (%s): "
                        "no compaction after demotion, freed memory is not cleared",
                        jemalloc ? "no mallctl symbol" : "mem_allocator");
        return;
    }
    char why[160];
    if (zeroFreeInstall(hm.compact.mallctl, RedisModule_Alloc, RedisModule_Free, why, sizeof(why)) != 0)
        RedisModule_Log(ctx, "notice", "appassist: freed memory is not cleared: %s", why);
}

/* Called at the end of a demotion pass. A pass is due when both the bytes
 * demoted since the last pass and jemalloc's free bytes inside slabs in use
 * (allocator_frag_bytes = active - allocated) reach compact-percent of the
 * allocated bytes. Under promote/demote churn the promoted items refill the
 * holes, fragmentation stays low and no pass runs; a pass that could not
 * fix fragmentation (holes next to non-string keys) is not repeated until
 * as much has been demoted again. */
void hmCompactCheck(RedisModuleCtx *ctx) {
    if (!hm.compact.mallctl || hm.cfg.compact_percent == 0 || hm.compact.wanted || hm.compact.pending == 0)
        return;
    (void)ctx;
    /* INFO's allocator_* figures are refreshed by serverCron; ask jemalloc
     * (a new epoch merges the arenas' stats: tens of us, once per pass). */
    uint64_t epoch = 1;
    size_t alloc = 0, active = 0, sz = sizeof(epoch);
    if (hm.compact.mallctl("epoch", &epoch, &sz, &epoch, sz) != 0) return;
    sz = sizeof(size_t);
    if (hm.compact.mallctl("stats.allocated", &alloc, &sz, NULL, 0) != 0 ||
        hm.compact.mallctl("stats.active", &active, &sz, NULL, 0) != 0)
        return;
    unsigned long long frag = active > alloc ? active - alloc : 0;
    unsigned long long min = alloc / 100 * (unsigned long long)hm.cfg.compact_percent;
    hm.compact.last_frag_bytes = (long long)frag;
    if (hm.compact.pending >= min && frag >= min) hm.compact.wanted = 1;
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
    RedisModuleKey *kh = hmOpenLiveString(key, &expire);
    if (!kh) {
        hm.compact.skipped++;
        return 0;
    }
    if (RedisModule_ValueLength(kh) <= 20 && intEncoded(key)) {
        RedisModule_CloseKey(kh);
        hm.compact.skipped++;
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
    hm.compact.relocations++;
    hm.compact.relocated++;
    return 1;
}

static void compactScanCb(RedisModuleCtx *ctx, RedisModuleString *keyname,
                          RedisModuleKey *kh, void *priv) {
    (void)priv;
    if (RedisModule_KeyType(kh) != REDISMODULE_KEYTYPE_STRING) return;
    hmPendingPush(ctx, keyname, kh);
}

static void compactEnd(void) {
    RedisModule_ScanCursorDestroy(hm.compact.cursor);
    hm.compact.cursor = NULL;
    hm.compact.wanted = 0;
    hm.compact.passes++;
    hm.compact.last_relocated = hm.compact.relocated;
    hm.compact.last_time_us = (long long)(hmNowUs() - hm.compact.t0);
    hm.compact.last_busy_us = hm.compact.busy_us;
    hm.compact.last_slice_max_us = hm.compact.slice_max_us;
    hm.compact.last_rss_before = hm.compact.rss0;
    hm.compact.last_rss_after = hmProcessRss();
    RedisModule_Log(hm.dctx, "verbose", "appassist: compaction: %lld keys relocated in %lld ms "
                    "(%lld ms busy, longest slice %lld us), RSS %lld -> %lld KiB",
                    hm.compact.last_relocated, hm.compact.last_time_us / 1000,
                    hm.compact.last_busy_us / 1000, hm.compact.last_slice_max_us,
                    hm.compact.last_rss_before / 1024,
                    hm.compact.last_rss_after / 1024);
}

/* Run the compaction pass until 'deadline'. The thread cache is off only
 * inside the slice: a free followed by an allocation of the same size
 * would otherwise get the slot just freed back. */
void hmCompactSlice(uint64_t deadline) {
    RedisModuleCtx *ctx = hm.dctx;
    uint64_t t = hmNowUs(), cpu = hmThreadCpuUs();
    if (!hm.compact.cursor) {
        hm.compact.cursor = RedisModule_ScanCursorCreate();
        hm.compact.pending = 0;
        hm.compact.t0 = t;
        hm.compact.rss0 = hmProcessRss();
        hm.compact.busy_us = 0;
        hm.compact.slice_max_us = 0;
        hm.compact.relocated = 0;
    }
    if (tcacheSet(false) != 0) {
        RedisModule_Log(ctx, "warning", "appassist: cannot turn jemalloc's thread cache off: "
                        "no compaction");
        hm.compact.mallctl = NULL;
        RedisModule_ScanCursorDestroy(hm.compact.cursor);
        hm.compact.cursor = NULL;
        hm.compact.wanted = 0;
        return;
    }
    int more = hmScanApply(hm.compact.cursor, compactScanCb, relocateKey, deadline);
    tcacheSet(true);
    hm.compact.busy_us += (long long)(hmNowUs() - t);
    long long cpu_us = (long long)(hmThreadCpuUs() - cpu);
    if (cpu_us > hm.compact.slice_max_us) hm.compact.slice_max_us = cpu_us;
    if (!more) compactEnd();
}

/* Abandon a running pass (PREPARE); it starts over after RESUME. */
void hmCompactAbandon(void) {
    if (!hm.compact.cursor) return;
    RedisModule_ScanCursorDestroy(hm.compact.cursor);
    hm.compact.cursor = NULL;          /* compact_wanted stays set */
}

/* Holes in the arena (arenaDeadBytes) are reclaimed once they exceed half
 * the live items' bytes (and HM_RECLAIM_MIN_BYTES), until they are down to
 * a quarter: the arena then maps at most 1.5x its items (plus the chunk
 * being appended to), and reclaiming copies at most two bytes per byte it
 * frees. Without it, writes spread over the cold items (each a write
 * visit: delete, and append the new version) leave every chunk partly
 * live, and a chunk is unmapped only when its last item goes (docs/redis-module.md, "Design history").
 *
 * A client's SCAN holding an arena cursor between calls is not affected:
 * moved items go ahead of every cursor (see arenaIterate). Not while the
 * arena has spilled chunks (it takes no appends) or outside the normal
 * state. */
int hmReclaimAllowed(void) {
    if (hm.state != ST_NORMAL || arenaHasSpilled(hm.arena) ||
        (RedisModule_GetContextFlags(hm.dctx) & REDISMODULE_CTX_FLAGS_LOADING))
        return 0;
    return hmNowUs() >= hm.reclaim.after_us;
}

int hmReclaimWanted(void) {
    uint64_t dead = arenaDeadBytes(hm.arena), live = arenaLiveBytes(hm.arena);
    if (!hm.reclaim.active && dead >= HM_RECLAIM_MIN_BYTES && dead > live / 2) {
        hm.reclaim.active = 1;
        hm.reclaim.runs++;
    } else if (hm.reclaim.active && dead <= live / 4) {
        hm.reclaim.active = 0;
    }
    return hm.reclaim.active && hmReclaimAllowed();
}

void hmReclaimSlice(uint64_t deadline) {
    uint64_t moved = 0;
    do {
        int r = arenaReclaimStep(hm.arena, HM_RECLAIM_ITEMS, &moved);
        if (r < 0) {
            RedisModule_Log(hm.dctx, "warning", "appassist: reclaiming arena holes failed: %s",
                            strerror(errno));
            hm.reclaim.after_us = hmNowUs() + 1000000;
            break;
        }
        if (r == 0) {
            hm.reclaim.active = 0;
            break;
        }
    } while (hmNowUs() < deadline && hmReclaimWanted());
    hm.reclaim.moved += (long long)moved;
}

/* APPASSIST.COMPACT [max-ms]: run a compaction pass synchronously until it
 * completes or max-ms (default 10000) passes, due or not, then purge what
 * it emptied (as MEMORY PURGE would) so that the caller sees the memory
 * given back at once instead of over jemalloc's decay time; for tests and
 * benchmarks. Replies with the number of keys relocated (so far). */
int hmCompactCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc > 2) return RedisModule_WrongArity(ctx);
    long long ms = 10000;
    if (argc == 2 && (RedisModule_StringToLongLong(argv[1], &ms) != REDISMODULE_OK || ms < 0))
        return RedisModule_ReplyWithError(ctx, "ERR max-ms must be a non-negative integer");
    if (!hm.compact.mallctl)
        return RedisModule_ReplyWithError(ctx, "ERR compaction needs jemalloc's mallctl");
    if (hm.state != ST_NORMAL)
        return RedisModule_ReplyWithError(ctx, "ERR compaction is paused until APPASSIST.RESUME");
    hmReadBackSettle();
    uint64_t deadline = hmNowUs() + (uint64_t)ms * 1000;
    long long passes = hm.compact.passes;
    hm.compact.wanted = 1;
    do {
        hmCompactSlice(hmNowUs() + (uint64_t)hm.cfg.slice_us < deadline ? hmNowUs() + (uint64_t)hm.cfg.slice_us
                                                                 : deadline);
    } while (hm.compact.passes == passes && hm.compact.mallctl && hmNowUs() < deadline);
    hmMemoryPurge(ctx);
    return RedisModule_ReplyWithLongLong(ctx, hm.compact.relocated);
}
