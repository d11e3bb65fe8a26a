/* keyspace.c -- the whole-keyspace commands the filter rewrites (KEYS, SCAN,
 * DBSIZE) so that they see the arena too, the SCAN log, APPASSIST.ISCOLD. */

#include <ctype.h>

#include "hybridmem.h"
#include "glob.h"

/* APPASSIST.ISCOLD key: 1 if the key is in the arena (declares no key, so
 * the filter does not promote it). */
int hmIsColdCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
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

/* 1 if the client behind 'ctx' has a user (RedisModule_GetCurrentUserName
 * dereferences it). The master's client and a module's RM_Call have none:
 * they may run everything. RM_Call's "C" flag stops at once, with ENOTSUP,
 * when there is none; otherwise "W" stops a write command before it runs
 * or is checked against ACLs (ENOSPC). */
static int hasUser(RedisModuleCtx *ctx) {
    if (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_REPLICATED) return 0;
    errno = 0;
    RedisModuleCallReply *r = RedisModule_Call(ctx, "DEL", "CWc", "appassist:no-such-key");
    if (r) RedisModule_FreeCallReply(r);
    return errno != ENOTSUP;
}

/* 1 if the caller may run 'cmd' with these arguments (argv[0] is ours):
 * the command the filter rewrote into this one, checked as stock Redis
 * checks it before running it. Otherwise replies with stock Redis's error,
 * adds the refusal to the ACL LOG, and returns 0. Without this check, a
 * user allowed everything but KEYS/SCAN/DBSIZE ran them as these module
 * commands, which ACL rules do not name. */
static int aclAllowed(RedisModuleCtx *ctx, const char *cmd, RedisModuleString **argv, int argc) {
    if (!hasUser(ctx)) return 1;
    RedisModuleString *name = RedisModule_GetCurrentUserName(ctx);
    RedisModuleUser *user = RedisModule_GetModuleUserFromUserName(name);
    RedisModule_FreeString(ctx, name);
    RedisModuleString *stackv[8], **v = stackv;
    if (argc > 8) v = RedisModule_Alloc(sizeof(*v) * (size_t)argc);
    v[0] = RedisModule_CreateString(ctx, cmd, strlen(cmd));
    for (int i = 1; i < argc; i++) v[i] = argv[i];
    int ok = user && RedisModule_ACLCheckCommandPermissions(user, v, argc) == REDISMODULE_OK;
    if (!ok) {
        char msg[96];
        if (user) RedisModule_ACLAddLogEntry(ctx, user, v[0], REDISMODULE_ACL_LOG_CMD);
        snprintf(msg, sizeof(msg), "NOPERM this user has no permissions to run the '%s' command", cmd);
        RedisModule_ReplyWithError(ctx, msg);
    }
    RedisModule_FreeString(ctx, v[0]);
    if (v != stackv) RedisModule_Free(v);
    if (user) RedisModule_FreeModuleUser(user);
    return ok;
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
    KeyList *out;               /* collect here instead of replying */
} MatchCtx;

static void matchCb(void *priv, const ColdItem *it) {
    MatchCtx *m = priv;
    if (it->expire != ARENA_NO_EXPIRE && it->expire <= m->now) return;
    if (!m->all && !stringmatchlen(m->pat, (int)m->patlen, it->key, (int)it->klen, 0)) return;
    if (m->out)
        hmKeyListPush(m->out, RedisModule_CreateString(NULL, it->key, it->klen));
    else
        RedisModule_ReplyWithStringBuffer(m->ctx, it->key, it->klen);
    m->n++;
}

static void keyListFree(KeyList *l) {
    for (size_t i = 0; i < l->n; i++) RedisModule_FreeString(NULL, l->v[i]);
    RedisModule_Free(l->v);
    *l = (KeyList){0};
}

/* A whole-keyspace command met a cold item it could not read (a spilled
 * chunk): an error, never a short answer presented as complete. */
#define READ_ERROR_REPLY "ERR appassist: reading spilled cold items failed"

static int replyReadError(RedisModuleCtx *ctx) {
    hm.stats.read_errors++;
    RedisModule_Log(hm.dctx, "warning", "appassist: reading spilled cold items failed: %s",
                    strerror(errno));
    return RedisModule_ReplyWithError(ctx, READ_ERROR_REPLY);
}

/* APPASSIST.UNREADABLE: what the filter turns a command into when a cold
 * item it names could not be read (internal; the failed read is logged). */
int hmUnreadableCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    hm.stats.read_errors++;
    return RedisModule_ReplyWithError(ctx, READ_ERROR_REPLY);
}

/* KEYS pattern, when something is cold: the stock reply plus matching cold
 * keys (db 0 only). */
int hmKeysCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 2) return wrongArity(ctx, "keys");
    if (!aclAllowed(ctx, "keys", argv, argc)) return REDISMODULE_OK;
    RedisModuleCallReply *r = RedisModule_Call(ctx, "KEYS", "s", argv[1]);
    if (!r || RedisModule_CallReplyType(r) != REDISMODULE_REPLY_ARRAY) {
        if (r) {
            RedisModule_ReplyWithCallReply(ctx, r);
            RedisModule_FreeCallReply(r);
            return REDISMODULE_OK;
        }
        return RedisModule_ReplyWithError(ctx, "ERR KEYS failed");
    }
    int db0 = RedisModule_GetSelectedDb(ctx) == 0;
    MatchCtx m = {ctx, NULL, 0, 0, hmNowMs(), 0, NULL};
    m.pat = RedisModule_StringPtrLen(argv[1], &m.patlen);
    m.all = m.patlen == 1 && m.pat[0] == '*';
    /* Spilled chunks can fail to read: collect the cold keys before
     * replying. In memory, reply as they come. */
    KeyList cold = {0};
    if (db0 && arenaHasSpilled(hm.arena)) {
        m.out = &cold;
        uint64_t cur = 0;
        do {
            cur = arenaIterate(hm.arena, cur, 1u << 20, matchCb, &m);
        } while (cur && cur != UINT64_MAX);
        if (cur == UINT64_MAX) {
            keyListFree(&cold);
            RedisModule_FreeCallReply(r);
            return replyReadError(ctx);
        }
    }
    long n = 0;
    RedisModule_ReplyWithArray(ctx, REDISMODULE_POSTPONED_LEN);
    forwardArray(ctx, r, &n);
    RedisModule_FreeCallReply(r);
    if (m.out) {
        for (size_t i = 0; i < cold.n; i++) RedisModule_ReplyWithString(ctx, cold.v[i]);
        n += (long)cold.n;
        keyListFree(&cold);
    } else if (db0) {
        uint64_t cur = 0;
        do {
            cur = arenaIterate(hm.arena, cur, 1u << 20, matchCb, &m);
        } while (cur && cur != UINT64_MAX);
        n += m.n;
    }
    RedisModule_ReplySetArrayLength(ctx, n);
    return REDISMODULE_OK;
}

int hmDbsizeCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1) return wrongArity(ctx, "dbsize");
    if (!aclAllowed(ctx, "dbsize", argv, argc)) return REDISMODULE_OK;
    long long n = (long long)RedisModule_DbSize(ctx);
    if (RedisModule_GetSelectedDb(ctx) == 0) n += (long long)arenaCount(hm.arena);
    return RedisModule_ReplyWithLongLong(ctx, n);
}

/* The start of Redis 7.0's struct redisCommand (server.h), up to its
 * flags, and module.c's struct RedisModuleCommand, which
 * RedisModule_GetCommand returns. */
struct hm_redisCommand70 {
    const char *declared_name, *summary, *complexity, *since;
    int doc_flags;
    const char *replaced_by, *deprecated_since;
    int group;
    void *history;
    const char **tips;
    void *proc;
    int arity;
    uint64_t flags;
};
struct hm_moduleCommand70 {
    void *module;
    RedisModuleCmdFunc func;
    struct hm_redisCommand70 *rediscmd;
};
#define HM_CMD_READONLY         (1ULL << 1)
#define HM_CMD_MODULE           (1ULL << 3)
#define HM_CMD_TOUCHES_ARBITRARY_KEYS (1ULL << 28)

/* Give appassist.scan the flag stock SCAN has, CMD_TOUCHES_ARBITRARY_KEYS
 * ("may touch and lazy-expire arbitrary keys"): what a command deletes is
 * then propagated as it comes, one plain DEL per expired key, as stock SCAN
 * does; without it, Redis wraps two or more in MULTI/EXEC. The module API
 * has no string flag for it (7.0's commandFlagsFromString), so it is set
 * in the server's command table, after checking that what is there is the
 * command just registered ('fn', arity -1, readonly) laid out as in 7.0
 * (OnLoad refuses other series). If the check fails, SCAN leaves expired
 * keys to the active expire cycle, as before issue 35: logged, and INFO's
 * scan_deletes_expired says 0. Returns 1 if set. */
int hmScanMarkCommand(RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc fn) {
    struct hm_moduleCommand70 *mc = (struct hm_moduleCommand70 *)RedisModule_GetCommand(ctx, name);
    struct hm_redisCommand70 *rc = mc ? mc->rediscmd : NULL;
    uint64_t want = HM_CMD_MODULE | HM_CMD_READONLY;
    if (!rc || mc->func != fn || !rc->declared_name || strcmp(rc->declared_name, name) != 0 ||
        rc->arity != -1 || (rc->flags & want) != want || rc->flags >> 28) {
        RedisModule_Log(ctx, "warning", "appassist: %s is not laid out as in Redis 7.0; SCAN "
                        "leaves the expired keys it meets to the active expire cycle", name);
        return 0;
    }
    rc->flags |= HM_CMD_TOUCHES_ARBITRARY_KEYS;
    return 1;
}

/* A SCAN goes through the keyspace, then the arena (hmScanCommand). A cold
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

void hmScanLogClear(void) {
    for (size_t i = 0; i < hm.scan.n; i++) RedisModule_FreeString(NULL, hm.scan.log[i].key);
    RedisModule_Free(hm.scan.log);
    hm.scan.log = NULL;
    hm.scan.n = hm.scan.cap = 0;
}

/* 1 if a SCAN may be going on: one was served within the grace. */
int hmScanRecent(void) {
    if (hm.scan.seen_us && hmNowUs() - hm.scan.seen_us > HM_SCAN_GRACE_US) {
        hm.scan.seen_us = 0;
        hmScanLogClear();
    }
    return hm.scan.seen_us != 0;
}

/* Key 'k', a cold item at arena cursor 'pos', is leaving the arena for the
 * keyspace. */
void hmScanLogNote(const char *k, size_t klen, uint64_t pos) {
    if (!hmScanRecent()) return;
    if (hm.scan.n == HM_SCAN_LOG_MAX) {
        hm.scan.dropped++;
        return;
    }
    if (hm.scan.n == hm.scan.cap) {
        hm.scan.cap = hm.scan.cap ? hm.scan.cap * 2 : 64;
        hm.scan.log = RedisModule_Realloc(hm.scan.log, hm.scan.cap * sizeof(*hm.scan.log));
    }
    hm.scan.log[hm.scan.n++] = (ScanLogEntry){RedisModule_CreateString(NULL, k, klen), pos};
    hm.scan.sorted = 0;
}

static int scanLogCmp(const void *a, const void *b) {
    uint64_t x = ((const ScanLogEntry *)a)->pos, y = ((const ScanLogEntry *)b)->pos;
    return x < y ? -1 : x > y;
}

static const char *keyTypeName(int t);

/* Reply with the logged keys of arena cursors [from, to) (to 0: to the
 * end) that match and are still in the keyspace, of type 'type' if not
 * NULL. Returns how many. The log is sorted by position when a call needs
 * it after appends, so that a call costs its own range, not the whole log
 * (SCAN's COUNT is 10 by default). */
static long scanLogReply(RedisModuleCtx *ctx, uint64_t from, uint64_t to, const MatchCtx *m,
                         const char *type, size_t typelen) {
    if (!hm.scan.sorted) {
        qsort(hm.scan.log, hm.scan.n, sizeof(*hm.scan.log), scanLogCmp);
        hm.scan.sorted = 1;
    }
    size_t lo = 0, hi = hm.scan.n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (hm.scan.log[mid].pos < from) lo = mid + 1;
        else hi = mid;
    }
    long n = 0;
    for (size_t i = lo; i < hm.scan.n; i++) {
        const ScanLogEntry *e = &hm.scan.log[i];
        if (to && e->pos >= to) break;
        size_t kl;
        const char *k = RedisModule_StringPtrLen(e->key, &kl);
        if (!m->all && !stringmatchlen(m->pat, (int)m->patlen, k, (int)kl, 0)) continue;
        /* write mode: no keyspace hit or miss counted, as in openIfAbsent */
        RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, e->key, REDISMODULE_WRITE |
                                                                   REDISMODULE_OPEN_KEY_NOTOUCH);
        int kt = RedisModule_KeyType(kh);
        RedisModule_CloseKey(kh);
        const char *t = keyTypeName(kt);
        if (kt == REDISMODULE_KEYTYPE_EMPTY ||
            (type && (!t || strlen(t) != typelen || strncasecmp(t, type, typelen) != 0)))
            continue;
        RedisModule_ReplyWithString(ctx, e->key);
        n++;
    }
    return n;
}

/* SCAN's options, parsed the way scanGenericCommand does. Returns -1
 * after replying with its error. */
typedef struct ScanOpts {
    long long count;
    const char *pat, *type;     /* NULL: none */
    size_t patlen, typelen;
} ScanOpts;

static int parseScanOpts(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, ScanOpts *o) {
    *o = (ScanOpts){.count = 10};
    for (int i = 2; i < argc; i += 2) {
        size_t ol;
        const char *opt = RedisModule_StringPtrLen(argv[i], &ol);
        if (i + 1 >= argc) return RedisModule_ReplyWithError(ctx, "ERR syntax error"), -1;
        if (hmCmdIs(opt, ol, "count")) {
            if (RedisModule_StringToLongLong(argv[i + 1], &o->count) != REDISMODULE_OK)
                return RedisModule_ReplyWithError(ctx, "ERR value is not an integer or out of range"), -1;
            if (o->count < 1) return RedisModule_ReplyWithError(ctx, "ERR syntax error"), -1;
        } else if (hmCmdIs(opt, ol, "match")) {
            o->pat = RedisModule_StringPtrLen(argv[i + 1], &o->patlen);
        } else if (hmCmdIs(opt, ol, "type")) {
            o->type = RedisModule_StringPtrLen(argv[i + 1], &o->typelen);
        } else {
            return RedisModule_ReplyWithError(ctx, "ERR syntax error"), -1;
        }
    }
    return 0;
}

/* What the keyspace phase's walk keeps of the keys dictScan hands it. */
typedef struct KeyspaceWalk {
    const ScanOpts *o;
    size_t seen;                /* keys met: SCAN's COUNT counts them all */
    KeyList keys;               /* keys that matched MATCH, in the walk's order */
    long long *expires;         /* their absolute expires (by index in keys) */
    size_t expcap;
} KeyspaceWalk;

static const char *keyTypeName(int t) {
    switch (t) {
    case REDISMODULE_KEYTYPE_EMPTY: return "none";
    case REDISMODULE_KEYTYPE_STRING: return "string";
    case REDISMODULE_KEYTYPE_LIST: return "list";
    case REDISMODULE_KEYTYPE_HASH: return "hash";
    case REDISMODULE_KEYTYPE_SET: return "set";
    case REDISMODULE_KEYTYPE_ZSET: return "zset";
    case REDISMODULE_KEYTYPE_STREAM: return "stream";
    default: return NULL;       /* a module's type: asked with TYPE */
    }
}

static void keyspaceWalkCb(RedisModuleCtx *ctx, RedisModuleString *name, RedisModuleKey *kh,
                           void *priv) {
    KeyspaceWalk *w = priv;
    w->seen++;
    size_t kl;
    const char *k = RedisModule_StringPtrLen(name, &kl);
    const ScanOpts *o = w->o;
    if (o->pat && !(o->patlen == 1 && o->pat[0] == '*') &&
        !stringmatchlen(o->pat, (int)o->patlen, k, (int)kl, 0))
        return;
    if (w->keys.n == w->expcap) {
        w->expcap = w->expcap ? w->expcap * 2 : 16;
        w->expires = RedisModule_Realloc(w->expires, w->expcap * sizeof(*w->expires));
    }
    w->expires[w->keys.n] = RedisModule_GetAbsExpire(kh);
    RedisModule_RetainString(ctx, name);
    hmKeyListPush(&w->keys, name);
}

/* 1 if SCAN may delete the expired keys it meets, as stock SCAN does: this
 * server is a master (a replica only hides them, its master sends the
 * DELs) and appassist.scan propagates them as plain DELs (hmScanMarkCommand). */
static int scanDeletes(RedisModuleCtx *ctx) {
    return hm.scan.deletes_expired && !(RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_SLAVE);
}

/* 1 if 'type' (TYPE's argument) names the type of 'key', looked up as stock
 * SCAN looks it up: a read lookup that counts a keyspace hit or miss and,
 * on a master, deletes the key if it has expired (its type is then
 * "none"). *gone: the key is not there (any more). */
static int typeMatches(RedisModuleCtx *ctx, RedisModuleString *key, const ScanOpts *o, int *gone) {
    RedisModuleKey *kh = RedisModule_OpenKey(ctx, key, REDISMODULE_READ | REDISMODULE_OPEN_KEY_NOTOUCH);
    int kt = RedisModule_KeyType(kh);
    if (kh) RedisModule_CloseKey(kh);
    *gone = kt == REDISMODULE_KEYTYPE_EMPTY;
    const char *t = keyTypeName(kt);
    if (t) return strlen(t) == o->typelen && strncasecmp(t, o->type, o->typelen) == 0;
    RedisModuleCallReply *r = RedisModule_Call(ctx, "TYPE", "s", key);
    size_t tl = 0;
    const char *rt = r ? RedisModule_CallReplyStringPtr(r, &tl) : NULL;
    int same = rt && tl == o->typelen && strncasecmp(rt, o->type, tl) == 0;
    if (r) RedisModule_FreeCallReply(r);
    return same;
}

/* 1 if the hot key 'key' (absolute expire 'when') is past its expire.
 * Where SCAN deletes (scanDeletes) the key is opened for writing, which
 * makes Redis expire it as stock SCAN's expireIfNeeded does: deleted, the
 * "expired" event, expired_keys, a DEL to replicas and the AOF. Redis
 * decides by its own clock; 'now' only spares the lookup of keys that
 * cannot have expired. */
static int hotExpired(RedisModuleCtx *ctx, RedisModuleString *key, mstime_t when, long long now,
                      int deletes) {
    if (when == REDISMODULE_NO_EXPIRE || now < when) return 0;
    if (!deletes) return now > when;
    RedisModuleKey *kh = RedisModule_OpenKey(ctx, key, REDISMODULE_WRITE | REDISMODULE_OPEN_KEY_NOTOUCH);
    int gone = RedisModule_KeyType(kh) == REDISMODULE_KEYTYPE_EMPTY;
    RedisModule_CloseKey(kh);
    return gone;
}

/* The keyspace phase: the walk stock SCAN makes, the same dictScan steps
 * over the client's DB (COUNT keys, at most ten times COUNT buckets),
 * through RedisModule_Scan, then its filters in its order: MATCH, TYPE
 * (a read lookup), expired keys (deleted, on a master: see hotExpired).
 * Redis 7.0's RedisModuleScanCursor starts with the dictScan cursor
 * (module.c), which lets the walk start at the client's. */
static int scanKeyspace(RedisModuleCtx *ctx, RedisModuleString **argv, int argc,
                        unsigned long cursor) {
    ScanOpts o;
    if (parseScanOpts(ctx, argv, argc, &o) < 0) return REDISMODULE_OK;
    KeyspaceWalk w = {.o = &o};
    RedisModuleScanCursor *sc = RedisModule_ScanCursorCreate();
    memcpy(sc, &cursor, sizeof(cursor));
    long long maxiterations = o.count * 10;
    int more;
    do {
        more = RedisModule_Scan(ctx, sc, keyspaceWalkCb, &w);
    } while (more && maxiterations-- && w.seen < (size_t)o.count);
    unsigned long next = 0;
    if (more) memcpy(&next, sc, sizeof(next));
    RedisModule_ScanCursorDestroy(sc);
    long long now = RedisModule_Milliseconds();
    int deletes = scanDeletes(ctx);
    KeyList keep = {0};
    for (size_t i = 0; i < w.keys.n; i++) {
        RedisModuleString *key = w.keys.v[i];
        int gone = 0;
        if (o.type && !typeMatches(ctx, key, &o, &gone)) continue;
        /* A key the type lookup deleted matches TYPE none, and stock SCAN
         * then finds nothing left to expire: it returns the name. */
        if (!(gone && deletes) && hotExpired(ctx, key, w.expires[i], now, deletes)) continue;
        RedisModule_RetainString(ctx, key);
        hmKeyListPush(&keep, key);
    }
    keyListFree(&w.keys);
    RedisModule_Free(w.expires);
    RedisModule_ReplyWithArray(ctx, 2);
    char buf[32];
    int bl;
    if (next == 0 && (arenaCount(hm.arena) || hm.scan.n))
        bl = snprintf(buf, sizeof(buf), "%llu", (unsigned long long)HM_SCAN_PHASE_BIT);
    else
        bl = snprintf(buf, sizeof(buf), "%lu", next);
    RedisModule_ReplyWithStringBuffer(ctx, buf, (size_t)bl);
    RedisModule_ReplyWithArray(ctx, (long)keep.n);
    for (size_t i = 0; i < keep.n; i++) RedisModule_ReplyWithString(ctx, keep.v[i]);
    keyListFree(&keep);
    return REDISMODULE_OK;
}

/* 1 if the arena phase keeps cold key 'key' (it matched MATCH): a live
 * item of a type TYPE allows. An expired one is, where SCAN deletes
 * (scanDeletes), brought into the keyspace and looked up as stock SCAN
 * looks an expired key up (TYPE's read lookup, or expireIfNeeded through a
 * write lookup), so Redis deletes it with the stock event, statistics and
 * DEL; Redis's clock decides, so a key it does not find expired yet stays,
 * now hot, and is returned. */
static int coldKept(RedisModuleCtx *ctx, RedisModuleString *key, const ScanOpts *o, long long now,
                    int deletes) {
    size_t kl;
    const char *k = RedisModule_StringPtrLen(key, &kl);
    ColdRef ref;
    ColdItem it;
    if (arenaLookup(hm.arena, k, kl, &ref) != 1 || arenaRead(hm.arena, ref, &it) < 0) return 0;
    int expired = it.expire != ARENA_NO_EXPIRE && it.expire <= now;
    arenaItemRelease(&it);
    int gone = 0;
    if (expired) {
        if (!deletes || hmPromoteKey(key, 0) != 1) return 0;
        if (o->type) {
            if (!typeMatches(ctx, key, o, &gone)) return 0;
            return gone || !hotExpired(ctx, key, 0, now, 1);
        }
        return !hotExpired(ctx, key, 0, now, 1);
    }
    return !o->type || (o->typelen == 6 && strncasecmp(o->type, "string", 6) == 0);
}

/* SCAN cursor [MATCH p] [COUNT n] [TYPE t]. Two phases: the keyspace, as
 * stock SCAN walks it with its cursors (scanKeyspace), then the arena in its
 * creation order, with bit 63 of the cursor set. Demoted keys move from the
 * keyspace to the arena, i.e. forward in the iteration, so they are still
 * returned; promoted keys come from the SCAN log (above). */
int hmScanCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc < 2) return wrongArity(ctx, "scan");
    if (!aclAllowed(ctx, "scan", argv, argc)) return REDISMODULE_OK;
    size_t cl;
    const char *cs = RedisModule_StringPtrLen(argv[1], &cl);
    int db0 = RedisModule_GetSelectedDb(ctx) == 0;
    if (!db0) {
        /* not ours: stock SCAN */
        RedisModuleCallReply *r = RedisModule_Call(ctx, "SCAN", "v", argv + 1, (size_t)(argc - 1));
        if (!r) return RedisModule_ReplyWithError(ctx, "ERR SCAN failed");
        RedisModule_ReplyWithCallReply(ctx, r);
        RedisModule_FreeCallReply(r);
        return REDISMODULE_OK;
    }
    /* The cursor as parseScanCursorOrReply reads it. */
    char *end;
    errno = 0;
    unsigned long cursor = strtoul(cs, &end, 10);
    if (isspace((unsigned char)cs[0]) || *end != '\0' || errno == ERANGE)
        return RedisModule_ReplyWithError(ctx, "ERR invalid cursor");
    int phase1 = cl > 0 && (cursor & HM_SCAN_PHASE_BIT) && cs[0] != '-' && cs[0] != '+';
    /* Visited keys go back first: a lent item is not iterated. */
    hmReadBackSettle();
    hmScanRecent();
    hm.scan.seen_us = hmNowUs();
    if (!phase1) return scanKeyspace(ctx, argv, argc, cursor);
    /* Arena phase. */
    ScanOpts so;
    if (parseScanOpts(ctx, argv, argc, &so) < 0) return REDISMODULE_OK;
    MatchCtx m = {ctx, so.pat, so.patlen, so.pat == NULL || (so.patlen == 1 && so.pat[0] == '*'),
                  hmNowMs(), 0, NULL};
    int deletes = scanDeletes(ctx);
    int strings = so.type == NULL || hmCmdIs(so.type, so.typelen, "string") ||
                  hmCmdIs(so.type, so.typelen, "none");
    uint64_t acur = cursor & ~HM_SCAN_PHASE_BIT;
    if (!strings && !(deletes && arenaExpiring(hm.arena))) {
        /* no cold item can match, nor has one to be deleted: finish the
         * iteration (logged keys of that type included) */
        RedisModule_ReplyWithArray(ctx, 2);
        RedisModule_ReplyWithSimpleString(ctx, "0");
        RedisModule_ReplyWithArray(ctx, REDISMODULE_POSTPONED_LEN);
        RedisModule_ReplySetArrayLength(ctx, scanLogReply(ctx, acur, 0, &m, so.type, so.typelen));
        return REDISMODULE_OK;
    }
    /* The reply's cursor comes first: collect keys, then reply. */
    KeyList l = {0};
    uint64_t next = arenaIterate(hm.arena, acur, (unsigned)(so.count > 100000 ? 100000 : so.count),
                                 hmCollectCb, &l);
    if (next == UINT64_MAX) {
        keyListFree(&l);
        return replyReadError(ctx);
    }
    RedisModule_ReplyWithArray(ctx, 2);
    char buf[32];
    int bl = snprintf(buf, sizeof(buf), "%llu",
                      next ? (unsigned long long)(next | HM_SCAN_PHASE_BIT) : 0ULL);
    RedisModule_ReplyWithStringBuffer(ctx, buf, (size_t)bl);
    long n = 0;
    RedisModule_ReplyWithArray(ctx, REDISMODULE_POSTPONED_LEN);
    for (size_t i = 0; i < l.n; i++) {
        size_t kl;
        const char *k = RedisModule_StringPtrLen(l.v[i], &kl);
        if ((m.all || stringmatchlen(m.pat, (int)m.patlen, k, (int)kl, 0)) &&
            coldKept(ctx, l.v[i], &so, m.now, deletes)) {
            RedisModule_ReplyWithString(ctx, l.v[i]);
            n++;
        }
    }
    keyListFree(&l);
    n += scanLogReply(ctx, acur, next, &m, so.type, so.typelen);
    RedisModule_ReplySetArrayLength(ctx, n);
    return REDISMODULE_OK;
}
