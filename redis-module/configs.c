/* configs.c -- the appassist.* configs: registration, getters and setters. */

#include "hybridmem.h"

static const char *policy_names[] = {"drop", "spill", "none"};
static const int policy_values[] = {POLICY_DROP, POLICY_SPILL, POLICY_NONE};
static const char *tri_names[] = {"auto", "yes", "no"};
static const int tri_values[] = {TRI_AUTO, TRI_YES, TRI_NO};

static long long *numericConfig(const char *name) {
    if (!strcasecmp(name, "planned-memory")) return &hm.cfg.planned_memory;
    if (!strcasecmp(name, "hot-percent")) return &hm.cfg.hot_percent;
    if (!strcasecmp(name, "min-idle-ms")) return &hm.cfg.min_idle_ms;
    if (!strcasecmp(name, "slice-us")) return &hm.cfg.slice_us;
    if (!strcasecmp(name, "interval-ms")) return &hm.cfg.interval_ms;
    if (!strcasecmp(name, "port-retry-ms")) return &hm.cfg.port_retry_ms;
    if (!strcasecmp(name, "compact-percent")) return &hm.cfg.compact_percent;
    if (!strcasecmp(name, "promote-window-ms")) return &hm.cfg.promote_window_ms;
    if (!strcasecmp(name, "page-list-slice-us")) return &hm.cfg.page_list_slice_us;
    return NULL;
}

static long long getNumeric(const char *name, void *priv) {
    (void)priv;
    return *numericConfig(name);
}

static int setNumeric(const char *name, long long v, void *priv, RedisModuleString **err) {
    (void)priv;
    (void)err;
    *numericConfig(name) = v;
    /* a new budget takes effect with a fresh pass */
    hm.pass.next_us = 0;
    hm.pass.fits_below = 0;
    if (!strcasecmp(name, "hot-percent") || !strcasecmp(name, "planned-memory")) {
        hm.pass.threshold = hm.cfg.hot_percent == 0 ? 0 : HM_BUCKETS;
        hm.pass.keep_at_threshold = 0;
    }
    return REDISMODULE_OK;
}

static RedisModuleString *getString(const char *name, void *priv) {
    (void)priv;
    return !strcasecmp(name, "port-path") ? hm.cfg.port_path : hm.cfg.spill_path;
}

static int setString(const char *name, RedisModuleString *v, void *priv, RedisModuleString **err) {
    (void)priv;
    RedisModuleString **slot = !strcasecmp(name, "port-path") ? &hm.cfg.port_path : &hm.cfg.spill_path;
    if (slot == &hm.cfg.spill_path) {
        size_t l;
        RedisModule_StringPtrLen(v, &l);
        if (l == 0 || l >= PATH_MAX) {
            *err = RedisModule_CreateString(NULL, "spill-path must be a non-empty path", 35);
            return REDISMODULE_ERR;
        }
        if (arenaHasSpilled(hm.arena)) {
            *err = RedisModule_CreateString(NULL, "cannot change spill-path while items are spilled", 48);
            return REDISMODULE_ERR;
        }
    }
    if (*slot) RedisModule_FreeString(NULL, *slot);
    RedisModule_RetainString(NULL, v);
    *slot = v;
    return REDISMODULE_OK;
}

static int applyPort(RedisModuleCtx *ctx, void *priv, RedisModuleString **err) {
    (void)ctx;
    (void)priv;
    (void)err;
    if (hm.loaded) hmPortRestart();
    return REDISMODULE_OK;
}

static int getEnum(const char *name, void *priv) {
    (void)name;
    return *(int *)priv;
}

static int setEnum(const char *name, int v, void *priv, RedisModuleString **err) {
    (void)name;
    (void)err;
    *(int *)priv = v;
    return REDISMODULE_OK;
}

static int getBool(const char *name, void *priv) {
    (void)name;
    return *(int *)priv;
}

static int setBool(const char *name, int v, void *priv, RedisModuleString **err) {
    (void)name;
    (void)err;
    *(int *)priv = v;
    return REDISMODULE_OK;
}

/* Demotion turned off: the pass under way ends here (hmPassAbandon). */
static int applyDemote(RedisModuleCtx *ctx, void *priv, RedisModuleString **err) {
    (void)ctx;
    (void)priv;
    (void)err;
    if (!hm.cfg.demote) hmPassAbandon();
    return REDISMODULE_OK;
}

int hmRegisterConfigs(RedisModuleCtx *ctx) {
    struct { const char *name; long long def, min, max; unsigned flags; } nums[] = {
        {"planned-memory", 0, 0, LLONG_MAX, REDISMODULE_CONFIG_MEMORY},
        {"hot-percent", 30, 0, 100, 0},
        {"min-idle-ms", 10000, 0, 86400000LL, 0},
        {"slice-us", 250, 50, 1000000, 0},
        {"interval-ms", 3, 1, 10000, 0},
        {"port-retry-ms", 200, 10, 3600000, 0},
        {"compact-percent", 10, 0, 100, 0},
        {"promote-window-ms", 1000, 0, 3600000, 0},
        {"page-list-slice-us", 2000, 0, 1000000, 0},
    };
    for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++)
        if (RedisModule_RegisterNumericConfig(ctx, nums[i].name, nums[i].def,
                nums[i].flags, nums[i].min, nums[i].max, getNumeric, setNumeric,
                NULL, NULL) == REDISMODULE_ERR)
            return REDISMODULE_ERR;
    if (RedisModule_RegisterEnumConfig(ctx, "on-prepare", POLICY_DROP, REDISMODULE_CONFIG_DEFAULT,
            policy_names, policy_values, 3, getEnum, setEnum, NULL, &hm.cfg.policy) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterEnumConfig(ctx, "lazy-drop", TRI_AUTO, REDISMODULE_CONFIG_DEFAULT,
            tri_names, tri_values, 3, getEnum, setEnum, NULL, &hm.cfg.lazy_drop) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterEnumConfig(ctx, "zero-freed", TRI_AUTO, REDISMODULE_CONFIG_DEFAULT,
            tri_names, tri_values, 3, getEnum, setEnum, hmApplyZeroFreed, &hm.cfg.zero_freed) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterEnumConfig(ctx, "page-list", TRI_AUTO, REDISMODULE_CONFIG_DEFAULT,
            tri_names, tri_values, 3, getEnum, setEnum, NULL, &hm.cfg.page_list) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterBoolConfig(ctx, "demote", 1, REDISMODULE_CONFIG_DEFAULT,
            getBool, setBool, applyDemote, &hm.cfg.demote) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    /* Like Redis's enable-debug-command: the test helpers APPASSIST.DEMOTE
     * and APPASSIST.COMPACT exist only if this is yes at load time (OnLoad
     * registers them, or not, once; a command cannot be added later). */
    if (RedisModule_RegisterBoolConfig(ctx, "enable-debug-commands", 0, REDISMODULE_CONFIG_IMMUTABLE,
            getBool, setBool, NULL, &hm.cfg.debug_commands) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    /* The paths name files the server opens (the spill file it creates and
     * writes, the port it opens read-write): protected like Redis's own dir
     * and dbfilename, set at load time or where enable-protected-configs
     * allows it, not by any client with CONFIG rights. */
    if (RedisModule_RegisterStringConfig(ctx, "port-path", DEFAULT_PORT_PATH, REDISMODULE_CONFIG_PROTECTED,
            getString, setString, applyPort, NULL) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterStringConfig(ctx, "spill-path", DEFAULT_SPILL_PATH, REDISMODULE_CONFIG_PROTECTED,
            getString, setString, NULL, NULL) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    return RedisModule_LoadConfigs(ctx);
}
