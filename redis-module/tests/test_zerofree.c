/* test_zerofree.c -- zeroResident() on resident, untouched and unmapped
 * pages; the jemalloc purge hooks against the system's libjemalloc.so.2
 * (the one Debian's redis-server links; meson preloads it, as it cannot be
 * dlopen'ed for its static TLS): what jemalloc purges is zero by the time
 * the original purge runs, only while enabled, never in a forked child.
 * Skips (77) when jemalloc is not the process's allocator. Under ASan (which
 * brings its own malloc) only zeroResident() is tested. */
#include "../zerofree.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static int failures;
#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    failures++; } } while (0)

static size_t ps;

static size_t residentPages(void *addr, size_t len) {
    /* jemalloc offsets large blocks within their first page (cache_oblivious) */
    char *p = (char *)((uintptr_t)addr & ~(uintptr_t)(ps - 1));
    len += (size_t)((char *)addr - p);
    size_t n = (len + ps - 1) / ps, r = 0;
    unsigned char *vec = malloc(n);
    if (!vec || mincore(p, len, vec) != 0) { free(vec); return (size_t)-1; }
    for (size_t i = 0; i < n; i++) r += vec[i] & 1;
    free(vec);
    return r;
}

static bool allZero(const char *p, size_t len) {
    for (size_t i = 0; i < len; i++) if (p[i]) return false;
    return true;
}

static void testZeroResident(void) {
    size_t npages = 1500;       /* more than one mincore window */
    char *m = mmap(NULL, npages * ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    size_t written = 0;
    for (size_t i = 0; i < npages; i++)
        if (i % 3 == 0 || (i >= 500 && i < 600)) { memset(m + i * ps, 0xab, ps); written++; }
    CHECK(zeroResident(m, npages * ps) == written * ps);
    bool ok = true;
    for (size_t i = 0; i < npages; i++) ok &= allZero(m + i * ps, ps);
    CHECK(ok);
    /* reading above faulted in the zero page only; untouched pages stayed out */
    char *fresh = mmap(NULL, 64 * ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(fresh != MAP_FAILED);
    fresh[5 * ps] = 1;
    CHECK(zeroResident(fresh, 64 * ps) == ps);
    CHECK(residentPages(fresh, 64 * ps) == 1);
    CHECK(fresh[5 * ps] == 0);
    munmap(fresh, 64 * ps);
    /* a range that is no longer mapped clears nothing and does not crash */
    munmap(m, npages * ps);
    CHECK(zeroResident(m, npages * ps) == 0);
}

/* jemalloc's hook ABI, as in zerofree.c */
typedef struct extent_hooks_s extent_hooks_t;
typedef bool (purge_t)(extent_hooks_t *, void *, size_t, size_t, size_t, unsigned);
struct extent_hooks_s {
    void *alloc, *dalloc, *destroy, *commit, *decommit;
    purge_t *purge_lazy, *purge_forced;
    void *split, *merge;
};
typedef struct { extent_hooks_t hooks; extent_hooks_t *orig; } Probe;
static Probe probes[256];
static size_t probe_calls, probe_dirty_pages;

/* Installed under zerofree's hooks: runs after them, before jemalloc's own
 * purge, and counts resident pages that still hold data. */
static bool probePurge(extent_hooks_t *h, void *addr, size_t size, size_t off, size_t len, unsigned ind) {
    extent_hooks_t *orig = ((Probe *)h)->orig;
    char *p = (char *)addr + off;
    unsigned char vec[1];
    probe_calls++;
    for (size_t i = 0; i < len; i += ps)
        if (mincore(p + i, ps, vec) == 0 && (vec[0] & 1) && !allZero(p + i, ps))
            probe_dirty_pages++;
    return orig->purge_forced(orig, addr, size, off, len, ind);
}

typedef int (*Mallctl)(const char *, void *, size_t *, void *, size_t);
static Mallctl je_mallctl;
static void *(*je_malloc)(size_t);
static void (*je_free)(void *);

static void churn(size_t n, size_t sz) {
    void **v = je_malloc(n * sizeof(*v));
    for (size_t i = 0; i < n; i++) { v[i] = je_malloc(sz); memset(v[i], 0x5a, sz); }
    for (size_t i = 0; i < n; i++) je_free(v[i]);
    je_free(v);
}

static void purgeAll(void) {
    CHECK(je_mallctl("arena.4096.purge", NULL, NULL, NULL, 0) == 0);   /* MALLCTL_ARENAS_ALL */
}

/* Arenas that exist (as of a fresh epoch); 'which' gets their flags. */
static unsigned existingArenas(unsigned narenas, bool *which) {
    uint64_t epoch = 1;
    unsigned n = 0;
    CHECK(je_mallctl("epoch", NULL, NULL, &epoch, sizeof(epoch)) == 0);
    for (unsigned i = 0; i < narenas && i < 256; i++) {
        char name[64];
        bool init = false;
        size_t sz = sizeof(init);
        snprintf(name, sizeof(name), "arena.%u.initialized", i);
        CHECK(je_mallctl(name, &init, &sz, NULL, 0) == 0);
        if (which) which[i] = init;
        n += init;
    }
    return n;
}

/* Put the probe under every arena that exists and has none yet (it must
 * be there before zerofree wraps the arena). */
static void probeArenas(unsigned narenas) {
    bool exists[256];
    existingArenas(narenas, exists);
    for (unsigned i = 0; i < narenas && i < 256; i++) {
        char name[64];
        extent_hooks_t *old, *mine = &probes[i].hooks;
        size_t sz = sizeof(old);
        if (!exists[i] || probes[i].orig) continue;
        snprintf(name, sizeof(name), "arena.%u.extent_hooks", i);
        CHECK(je_mallctl(name, &old, &sz, NULL, 0) == 0);
        probes[i].hooks = *old;
        probes[i].orig = old;
        probes[i].hooks.purge_forced = probePurge;
        CHECK(je_mallctl(name, NULL, NULL, &mine, sizeof(mine)) == 0);
    }
}

static void *churnThread(void *arg) {
    (void)arg;
    churn(4000, 1000);          /* a new thread: jemalloc gives it an arena */
    return NULL;
}

static void churnInThread(void) {
    pthread_t t;
    CHECK(pthread_create(&t, NULL, churnThread, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
}

static void testHooks(void) {
    je_mallctl = (Mallctl)dlsym(RTLD_DEFAULT, "mallctl");
    if (!je_mallctl) { printf("SKIP: jemalloc is not preloaded (libjemalloc2 missing?)\n"); exit(77); }
    je_malloc = malloc;         /* jemalloc's, interposed */
    je_free = free;

    /* the probe goes in first (huge arena created the same way zerofree does) */
    void *volatile big = je_malloc(16u << 20);
    je_free(big);
    unsigned narenas;
    size_t sz = sizeof(narenas);
    CHECK(je_mallctl("arenas.narenas", &narenas, &sz, NULL, 0) == 0);
    CHECK(narenas <= 256);
    probeArenas(narenas);
    unsigned before = existingArenas(narenas, NULL);
    CHECK(before >= 1 && before < narenas);

    char err[160] = "";
    CHECK(!zeroFreeInstalled());
    CHECK(zeroFreeAdopt() == 0);        /* nothing before an install */
    CHECK(zeroFreeInstall(je_mallctl, je_malloc, je_free, err, sizeof(err)) == 0);
    CHECK(zeroFreeInstalled());
    CHECK(!zeroFreeEnabled());
    /* only the arenas that existed are wrapped; none is created (each one
     * would be merged into the statistics at every epoch) */
    CHECK(existingArenas(narenas, NULL) == before);
    CHECK(zeroFreeArenas() == before);
    CHECK(zeroFreeAdopt() == 0);

    /* disabled: jemalloc purges what it held, with its data */
    uint64_t bytes, purges;
    churn(4000, 1000);
    probe_calls = probe_dirty_pages = 0;
    purgeAll();
    zeroFreeStats(&bytes, &purges);
    CHECK(bytes == 0 && purges == 0);
    CHECK(probe_calls > 0 && probe_dirty_pages > 0);

    /* enabled: small (slab) and huge extents reach the purge zeroed */
    zeroFreeEnable(1);
    CHECK(zeroFreeEnabled());
    churn(4000, 1000);
    char *huge = je_malloc(12u << 20);
    memset(huge, 0x77, 12u << 20);
    je_free(huge);
    probe_calls = probe_dirty_pages = 0;
    purgeAll();
    zeroFreeStats(&bytes, &purges);
    fprintf(stderr, "zeroed %llu bytes in %llu purges; probe saw %zu purges\n",
            (unsigned long long)bytes, (unsigned long long)purges, probe_calls);
    CHECK(bytes >= (12u << 20) + 3000u * 1000u);
    CHECK(purges > 0 && probe_calls > 0);
    CHECK(probe_dirty_pages == 0);
    /* ...and jemalloc's own purge still ran: the huge block left RSS */
    size_t res = residentPages(huge, 12u << 20);
    fprintf(stderr, "huge block: %zd pages resident after the purge\n", (ssize_t)res);
    CHECK(res != (size_t)-1 && res < 16);

    /* a forked child (BGSAVE) clears nothing: that would copy the parent's pages */
    pid_t pid = fork();
    if (pid == 0) {
        uint64_t b0, b1;
        zeroFreeStats(&b0, NULL);
        churn(4000, 1000);
        je_mallctl("arena.4096.purge", NULL, NULL, NULL, 0);
        zeroFreeStats(&b1, NULL);
        _exit(b1 == b0 ? 0 : 1);
    }
    int st = 0;
    CHECK(pid > 0 && waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);

    /* a thread's arena, created after the install, is adopted: what it
     * purges afterwards reaches jemalloc's purge zeroed too */
    purgeAll();
    churnInThread();
    CHECK(existingArenas(narenas, NULL) == before + 1);
    probeArenas(narenas);
    CHECK(zeroFreeAdopt() == 1);
    CHECK(zeroFreeArenas() == before + 1);
    CHECK(zeroFreeAdopt() == 0);
    uint64_t b0, b1;
    zeroFreeStats(&b0, NULL);
    churnInThread();            /* reuses the idle thread arena */
    probe_calls = probe_dirty_pages = 0;
    purgeAll();
    zeroFreeStats(&b1, NULL);
    fprintf(stderr, "thread arena: zeroed %llu bytes; probe saw %zu purges\n",
            (unsigned long long)(b1 - b0), probe_calls);
    CHECK(b1 - b0 >= 3000u * 1000u);
    CHECK(probe_calls > 0 && probe_dirty_pages == 0);

    zeroFreeEnable(0);
    CHECK(!zeroFreeEnabled());
    /* a second install returns the first result */
    CHECK(zeroFreeInstall(je_mallctl, je_malloc, je_free, err, sizeof(err)) == 0);
}

int main(void) {
    ps = (size_t)sysconf(_SC_PAGESIZE);
    testZeroResident();
#ifdef __SANITIZE_ADDRESS__
    /* ASan's malloc, not jemalloc: the hooks are tested by the UBSan build
     * (test_zerofree_jemalloc, see meson.build). */
    printf("hooks: not tested under ASan\n");
    (void)testHooks;
#else
    testHooks();
#endif
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
