/* zerofree.c -- give memory back to the guest kernel as zero pages.
 * See zerofree.h for why. */
#include "zerofree.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* jemalloc 5's extent hooks (include/jemalloc/jemalloc_typedefs.h), the
 * stable public ABI of 'arena.<i>.extent_hooks'. Only the purge hooks are
 * called from here; the others are copied through untouched. */
typedef struct extent_hooks_s extent_hooks_t;
typedef bool (extent_purge_t)(extent_hooks_t *, void *addr, size_t size,
                              size_t offset, size_t length, unsigned arena_ind);
struct extent_hooks_s {
    void *alloc, *dalloc, *destroy, *commit, *decommit;
    extent_purge_t *purge_lazy;
    extent_purge_t *purge_forced;
    void *split, *merge;
};

/* Our hooks for one arena: jemalloc hands the hooks pointer back to every
 * hook, so the wrapper finds the original through it. */
typedef struct ZfHooks {
    extent_hooks_t hooks;       /* first: &ZfHooks == &hooks */
    extent_hooks_t *orig;
} ZfHooks;

static int zf_state;            /* 0 not tried, 1 installed, -1 failed */
static char zf_error[160];
static ZfHooks *zf_hooks;       /* one per arena; never freed (jemalloc keeps the pointers) */
static ZeroFreeMallctl zf_mallctl;
static unsigned zf_narenas, zf_hooked;
static int zf_enabled;          /* atomic */
static int zf_in_child;         /* set in a forked child, see zerofree.h */
static uint64_t zf_bytes, zf_purges;    /* atomic */

static size_t pageSize(void) {
    static size_t ps;
    if (!ps) {
        long v = sysconf(_SC_PAGESIZE);
        ps = v > 0 ? (size_t)v : 4096;
    }
    return ps;
}

size_t zeroResident(void *addr, size_t len) {
    const size_t ps = pageSize();
    unsigned char vec[512];
    char *p = addr, *end = p + len;
    size_t cleared = 0;

    while (p < end) {
        size_t npages = ((size_t)(end - p) + ps - 1) / ps;
        if (npages > sizeof(vec)) npages = sizeof(vec);
        size_t win = npages * ps;
        if ((size_t)(end - p) < win) win = (size_t)(end - p);
        if (mincore(p, win, vec) != 0) {
            if (errno == ENOMEM) break;     /* not mapped: nothing to clear */
            memset(vec, 1, npages);         /* unknown: clear it all */
        }
        for (size_t i = 0; i < npages;) {
            if (!(vec[i] & 1)) { i++; continue; }
            size_t j = i;
            while (j < npages && (vec[j] & 1)) j++;
            size_t from = i * ps, to = j * ps < win ? j * ps : win;
            memset(p + from, 0, to - from);
            cleared += to - from;
            i = j;
        }
        p += win;
    }
    return cleared;
}

/* Clear, then let the original hook purge. Any thread may get here. */
static bool zfPurge(extent_hooks_t *h, void *addr, size_t size, size_t offset,
                    size_t length, unsigned arena_ind, bool forced) {
    extent_hooks_t *orig = ((ZfHooks *)h)->orig;
    extent_purge_t *purge = forced ? orig->purge_forced : orig->purge_lazy;
    if (!purge) return true;    /* cannot happen: only present hooks are wrapped */
    if (__atomic_load_n(&zf_enabled, __ATOMIC_RELAXED) && !zf_in_child) {
        size_t n = zeroResident((char *)addr + offset, length);
        __atomic_fetch_add(&zf_bytes, n, __ATOMIC_RELAXED);
        __atomic_fetch_add(&zf_purges, 1, __ATOMIC_RELAXED);
    }
    return purge(orig, addr, size, offset, length, arena_ind);
}

static bool zfPurgeForced(extent_hooks_t *h, void *addr, size_t size, size_t offset,
                          size_t length, unsigned arena_ind) {
    return zfPurge(h, addr, size, offset, length, arena_ind, true);
}

static bool zfPurgeLazy(extent_hooks_t *h, void *addr, size_t size, size_t offset,
                        size_t length, unsigned arena_ind) {
    return zfPurge(h, addr, size, offset, length, arena_ind, false);
}

static void zfAtforkChild(void) {
    zf_in_child = 1;
}

static int zfFail(char *err, size_t errlen, const char *fmt, const char *what, int e) {
    snprintf(zf_error, sizeof(zf_error), fmt, what, e ? strerror(e) : "");
    zf_state = -1;
    if (err && errlen) snprintf(err, errlen, "%s", zf_error);
    return -1;
}

/* 1 if arena 'i' exists, as of the allocator's last statistics epoch. */
static int arenaInitialized(unsigned i) {
    char name[64];
    bool init = false;
    size_t sz = sizeof(init);
    snprintf(name, sizeof(name), "arena.%u.initialized", i);
    return zf_mallctl(name, &init, &sz, NULL, 0) == 0 && init;
}

/* Wrap the purge hooks of arena 'i', which exists. Returns 0 or an errno. */
static int hookArena(unsigned i) {
    char name[64];
    extent_hooks_t *old = NULL;
    size_t sz = sizeof(old);
    snprintf(name, sizeof(name), "arena.%u.extent_hooks", i);
    int rc = zf_mallctl(name, &old, &sz, NULL, 0);
    if (rc != 0 || !old) return rc ? rc : EINVAL;
    ZfHooks *z = &zf_hooks[i];
    z->hooks = *old;
    z->orig = old;      /* before any purge can come through the wrapper */
    if (old->purge_forced) z->hooks.purge_forced = zfPurgeForced;
    if (old->purge_lazy) z->hooks.purge_lazy = zfPurgeLazy;
    extent_hooks_t *mine = &z->hooks;
    rc = zf_mallctl(name, NULL, NULL, &mine, sizeof(mine));
    if (rc != 0) {
        z->orig = NULL;
        return rc;
    }
    zf_hooked++;
    return 0;
}

/* Hook every arena that exists now and is not hooked yet; 'adopted' counts
 * them. Returns 0, or an errno with the arena's index in *bad. */
static int hookExisting(unsigned *adopted, unsigned *bad) {
    uint64_t epoch = 1;
    /* arena.<i>.initialized answers as of the last epoch: refresh it */
    zf_mallctl("epoch", NULL, NULL, &epoch, sizeof(epoch));
    for (unsigned i = 0; i < zf_narenas; i++) {
        if (zf_hooks[i].orig || !arenaInitialized(i)) continue;
        int rc = hookArena(i);
        if (rc != 0) { *bad = i; return rc; }
        if (adopted) (*adopted)++;
    }
    return 0;
}

int zeroFreeInstall(ZeroFreeMallctl mallctl, void *(*alloc)(size_t), void (*dealloc)(void *),
                    char *err, size_t errlen) {
    if (zf_state) {
        if (zf_state < 0 && err && errlen) snprintf(err, errlen, "%s", zf_error);
        return zf_state > 0 ? 0 : -1;
    }
    if (!mallctl) return zfFail(err, errlen, "%s%s", "no mallctl", 0);

    /* Without opt.retain jemalloc also gives memory back by munmap(), which
     * no hook sees before the pages are free: nothing could be promised. */
    bool retain = false;
    size_t sz = sizeof(retain);
    if (mallctl("opt.retain", &retain, &sz, NULL, 0) != 0 || !retain)
        return zfFail(err, errlen, "%s%s", "jemalloc's opt.retain is off (it unmaps freed memory)", 0);

    /* Allocations above opt.oversize_threshold go to a huge arena that
     * jemalloc creates on first use: create it now, so that it is hooked
     * from the start. Untouched, so nothing is resident. */
    size_t oversize = 0;
    sz = sizeof(oversize);
    if (mallctl("opt.oversize_threshold", &oversize, &sz, NULL, 0) == 0 &&
        oversize > 0 && oversize <= ((size_t)1 << 30) && alloc && dealloc) {
        void *volatile big = alloc(oversize);
        if (big) dealloc(big);
    }

    unsigned narenas = 0;
    sz = sizeof(narenas);
    int rc = mallctl("arenas.narenas", &narenas, &sz, NULL, 0);
    if (rc != 0) return zfFail(err, errlen, "%s: %s", "mallctl arenas.narenas", rc);
    zf_hooks = calloc(narenas, sizeof(*zf_hooks));
    if (!zf_hooks) return zfFail(err, errlen, "%s%s", "out of memory", 0);
    if (pthread_atfork(NULL, NULL, zfAtforkChild) != 0)
        return zfFail(err, errlen, "%s%s", "pthread_atfork failed", 0);
    zf_mallctl = mallctl;
    zf_narenas = narenas;

    /* Only the arenas that exist: asking for an arena's hooks with new
     * ones creates it, and every arena that exists is merged into the
     * allocator's statistics at each epoch (Redis's cron: ten times a
     * second). Hooking all of them made that merge 4 x CPUs arenas long
     * instead of the one or two a Redis uses. zeroFreeAdopt() takes the
     * others as threads bring them to life. */
    unsigned bad = 0;
    rc = hookExisting(NULL, &bad);
    if (rc != 0) {
        char name[64];
        snprintf(name, sizeof(name), "arena.%u.extent_hooks", bad);
        return zfFail(err, errlen, "%s: %s", name, rc);
    }
    zf_state = 1;
    return 0;
}

int zeroFreeAdopt(void) {
    unsigned adopted = 0, bad = 0;
    if (zf_state <= 0) return 0;
    int rc = hookExisting(&adopted, &bad);
    if (rc != 0) { errno = rc; return -1; }
    return (int)adopted;
}

unsigned zeroFreeArenas(void) {
    return zf_hooked;
}

int zeroFreeInstalled(void) {
    return zf_state > 0;
}

void zeroFreeEnable(int on) {
    __atomic_store_n(&zf_enabled, on && zf_state > 0, __ATOMIC_RELAXED);
}

int zeroFreeEnabled(void) {
    return __atomic_load_n(&zf_enabled, __ATOMIC_RELAXED);
}

void zeroFreeStats(uint64_t *bytes, uint64_t *purges) {
    if (bytes) *bytes = __atomic_load_n(&zf_bytes, __ATOMIC_RELAXED);
    if (purges) *purges = __atomic_load_n(&zf_purges, __ATOMIC_RELAXED);
}
