/* persist.c -- persistence of cold items: RDB aux fields (after the
 * keyspace) and the promotion before a pure-AOF rewrite. */

#include "hybridmem.h"

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
 * after every load, values validated before they enter the arena. A key
 * already there, hot or cold, is an error, unless the load is DEBUG
 * RELOAD's with MERGE (hm.load_merges): as Redis does for the keys of the
 * keyspace then, the loaded item replaces it. Before, a cold key refused
 * the merge (Redis's functions.tcl, "FUNCTION - test debug reload with
 * nosave and noflush", failed whenever its key was cold). */
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
            if (hm.load_merges) {
                RedisModuleKey *kh = RedisModule_OpenKey(hm.dctx, key, REDISMODULE_WRITE);
                RedisModule_DeleteKey(kh);
                RedisModule_CloseKey(kh);
                arenaDelete(hm.arena, k, kl);
            }
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

int hmPersistInit(RedisModuleCtx *ctx) {
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
    return REDISMODULE_OK;
}

/* A pure AOF rewrite (aof-use-rdb-preamble no) writes the keyspace only:
 * no aux data. The start event runs in the rewriting child (or in-process
 * for a synchronous rewrite) just before the keyspace is written, so the
 * cold items are promoted there and the rewritten AOF holds them. In the
 * child this only touches its copy-on-write copy of the data. */
void hmOnPersistence(RedisModuleCtx *ctx, RedisModuleEvent e, uint64_t sub, void *data) {
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
    if (!preamble) hmPromoteAll();
}
