/* test_arena.c -- unit tests of the cold arena against a reference model.
 * Seeded: a failure names the seed and the step. */
#include "../arena.h"
#include "../siphash.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures;
#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    failures++; } } while (0)

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint64_t next(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return rng;
}

#define NKEYS 20000

/* present: 0 absent, 1 present, 2 present and lent (arenaBorrow). */
typedef struct { int present; uint32_t vlen; int64_t expire; unsigned char fill; uint32_t clock; } Model;
static Model model[NKEYS];

static size_t keyName(char *buf, int i) { return (size_t)sprintf(buf, "k%d", i); }

static void makeVal(char *buf, uint32_t vlen, unsigned char fill, int i) {
    for (uint32_t j = 0; j < vlen; j++) buf[j] = (char)(fill + j + (unsigned)i);
}

static void checkItem(ColdArena *a, int i) {
    char k[32], v[5000], want[5000];
    size_t kl = keyName(k, i);
    ColdRef ref;
    int r = arenaLookup(a, k, kl, &ref);
    CHECK(r == model[i].present);
    if (r < 1) return;
    ColdItem it;
    CHECK(arenaRead(a, ref, &it) == 0);
    CHECK(it.klen == kl && memcmp(it.key, k, kl) == 0);
    CHECK(it.vlen == model[i].vlen);
    CHECK(it.expire == model[i].expire);
    CHECK(it.clock == model[i].clock);
    makeVal(want, model[i].vlen, model[i].fill, i);
    memcpy(v, it.val, it.vlen);
    CHECK(memcmp(v, want, it.vlen) == 0);
    arenaItemRelease(&it);
}

typedef struct { uint64_t seen; int dup; unsigned char *mark; } IterCtx;

static void iterCb(void *priv, const ColdItem *it) {
    IterCtx *c = priv;
    char tmp[32];
    snprintf(tmp, sizeof(tmp), "%.*s", (int)it->klen - 1, it->key + 1);
    int i = atoi(tmp);
    if (c->mark[i]) c->dup++;
    if (it->clock != model[i].clock) c->dup++;      /* counted as a failure */
    c->mark[i] = 1;
    c->seen++;
}

static void checkIterate(ColdArena *a, unsigned step) {
    IterCtx c = {0, 0, calloc(NKEYS, 1)};
    uint64_t cur = 0;
    do {
        cur = arenaIterate(a, cur, step, iterCb, &c);
        CHECK(cur != UINT64_MAX);
    } while (cur && cur != UINT64_MAX);
    CHECK(c.dup == 0);
    CHECK(c.seen == arenaCount(a));
    for (int i = 0; i < NKEYS; i++) CHECK(c.mark[i] == (model[i].present == 1));
    free(c.mark);
}

static void randomOps(ColdArena *a, int n, int allow_insert) {
    char k[32], v[5000];
    for (int s = 0; s < n; s++) {
        int i = (int)(next() % NKEYS);
        size_t kl = keyName(k, i);
        if (!model[i].present && allow_insert) {
            uint32_t vlen = (uint32_t)(next() % 8 == 0 ? next() % 4096 : next() % 200);
            unsigned char fill = (unsigned char)next();
            int64_t expire = next() % 3 == 0 ? (int64_t)(next() % 100000) : ARENA_NO_EXPIRE;
            makeVal(v, vlen, fill, i);
            uint32_t clock = next() % 2 ? (uint32_t)next() : 0;
            CHECK(arenaInsertClock(a, k, kl, v, vlen, expire, clock) == 0);
            model[i] = (Model){1, vlen, expire, fill, clock};
        } else if (model[i].present && next() % 3 == 0) {
            /* lend, or take back; lending twice or returning what is not
             * lent changes nothing */
            int lend = model[i].present == 1;
            CHECK((lend ? arenaBorrow(a, k, kl) : arenaReturn(a, k, kl)) == 1);
            CHECK((lend ? arenaBorrow(a, k, kl) : arenaReturn(a, k, kl)) == 0);
            model[i].present = lend ? 2 : 1;
            /* the clock changes in place (a visit's way back); not in a
             * spilled chunk (no visits while spilled) */
            ColdRef ref;
            uint32_t clock = (uint32_t)next();
            CHECK(arenaLookup(a, k, kl, &ref) == model[i].present);
            int r = arenaSetClock(a, ref, clock);
            CHECK(r == 0 || (r == -1 && errno == EROFS && arenaHasSpilled(a)));
            if (r == 0) model[i].clock = clock;
        } else if (model[i].present) {
            CHECK(arenaDelete(a, k, kl) == 1);
            model[i].present = 0;
        } else {
            CHECK(arenaBorrow(a, k, kl) == 0);
            CHECK(arenaDelete(a, k, kl) == 0);
        }
    }
}

static void checkAll(ColdArena *a) {
    uint64_t n = 0, expiring = 0;
    for (int i = 0; i < NKEYS; i++) {
        checkItem(a, i);
        n += model[i].present == 1;
        expiring += model[i].present && model[i].expire != ARENA_NO_EXPIRE;
    }
    CHECK(arenaCount(a) == n);
    CHECK(arenaExpiring(a) == expiring);
}

/* ------------------------------------------------------ hash flooding */

/* SipHash against known answers: 2-4 against the published vectors (key
 * 00..0f, message 00 01 02 ...), 1-2 against Redis 7.0.15's src/siphash.c
 * on the same inputs. */
static void testSipHash(void) {
    static const struct { size_t len; uint64_t h24; } v24[] = {
        {0, 0x726fdb47dd0e0e31ULL}, {8, 0x93f5f5799a932462ULL},
        {15, 0xa129ca6149be45e5ULL},
    };
    static const struct { size_t len; uint64_t h12; } v12[] = {
        {0, 0xcea28b51565c12e2ULL}, {1, 0x94aaf38c34ce7ba6ULL},
        {7, 0xf03c4cbcf492b05aULL}, {8, 0x606845b4d093af74ULL},
        {15, 0xec8f61bc1c8966a6ULL}, {16, 0x1311f4dfe747a751ULL},
        {63, 0xff6d07afacbad6d9ULL},
    };
    uint8_t kb[16], msg[64];
    for (int i = 0; i < 16; i++) kb[i] = (uint8_t)i;
    for (int i = 0; i < 64; i++) msg[i] = (uint8_t)i;
    SipKey k = sipKeyFromBytes(kb);
    for (size_t i = 0; i < sizeof(v24) / sizeof(v24[0]); i++)
        CHECK(sipHash24(&k, msg, v24[i].len) == v24[i].h24);
    for (size_t i = 0; i < sizeof(v12) / sizeof(v12[0]); i++)
        CHECK(sipHash12(&k, msg, v12[i].len) == v12[i].h12);
}

/* Most index slots one lookup may read, for the tests below. Measured with
 * 1M keys "key:N" under 40 keys: at most 191 just before a table grows
 * (70 % full), 31 to 44 at 1M keys (48 % full). */
#define PROBE_BOUND 256

static void testKey(uint8_t key[ARENA_KEY_BYTES], uint64_t n) {
    for (unsigned i = 0; i < ARENA_KEY_BYTES; i++) key[i] = (uint8_t)(n * 131 + i * 7 + 1);
}

/* Many keys: the longest probe stays under PROBE_BOUND all along (checked
 * every 1024 inserts, through each growth of the index), and every key is
 * found. */
static void testProbeBound(void) {
    enum { N = 1000000 };
    uint8_t key[ARENA_KEY_BYTES];
    testKey(key, 1);
    ColdArena *a = arenaCreateKeyed(key);
    CHECK(a != NULL);
    char k[32];
    uint64_t longest = 0;
    ArenaStats st;
    for (int i = 0; i < N; i++) {
        CHECK(arenaInsert(a, k, (size_t)sprintf(k, "key:%d", i), "v", 1, -1) == 0);
        if (i % 1024 == 0) {
            arenaGetStats(a, &st);
            if (st.longest_probe > longest) longest = st.longest_probe;
        }
    }
    arenaGetStats(a, &st);
    if (st.longest_probe > longest) longest = st.longest_probe;
    printf("test_arena: %d keys, longest probe %llu slots (bound %d)\n",
           N, (unsigned long long)longest, PROBE_BOUND);
    CHECK(longest > 0 && longest < PROBE_BOUND);
    int missing = 0;
    ColdRef ref;
    for (int i = 0; i < N; i++)
        missing += arenaLookup(a, k, (size_t)sprintf(k, "key:%d", i), &ref) != 1;
    CHECK(missing == 0);
    arenaFree(a);
}

/* MurmurHash64A, the arena's hash before SipHash (seeded with a random
 * seed), to show that seeding it did not help. */
#define MURMUR_M 0xc6a4a7935bd1e995ULL
static uint64_t murmur64a(uint64_t seed, const void *key, size_t len) {
    const unsigned char *p = key;
    uint64_t h = seed ^ (len * MURMUR_M);
    for (size_t i = 0; i < len / 8; i++) {
        uint64_t k;
        memcpy(&k, p + i * 8, 8);
        k *= MURMUR_M; k ^= k >> 47; k *= MURMUR_M;
        h ^= k; h *= MURMUR_M;
    }
    p += len / 8 * 8;
    switch (len & 7) {
    case 7: h ^= (uint64_t)p[6] << 48; /* fall through */
    case 6: h ^= (uint64_t)p[5] << 40; /* fall through */
    case 5: h ^= (uint64_t)p[4] << 32; /* fall through */
    case 4: h ^= (uint64_t)p[3] << 24; /* fall through */
    case 3: h ^= (uint64_t)p[2] << 16; /* fall through */
    case 2: h ^= (uint64_t)p[1] << 8;  /* fall through */
    case 1: h ^= (uint64_t)p[0]; h *= MURMUR_M;
    }
    h ^= h >> 47; h *= MURMUR_M; h ^= h >> 47;
    return h;
}

/* The inverse of MurmurHash64A's per-word mix (k *= m; k ^= k >> 47;
 * k *= m): m is odd, so invertible mod 2^64, and a shift by 47 undoes
 * itself. */
static uint64_t murmurUnmix(uint64_t k) {
    uint64_t inv = MURMUR_M;        /* Newton: inv = m^-1 mod 2^64 */
    for (int i = 0; i < 6; i++) inv *= 2 - MURMUR_M * inv;
    k *= inv; k ^= k >> 47; k *= inv;
    return k;
}

/* 2^BITS keys of BITS * 16 bytes with one MurmurHash64A value under every
 * seed. Flipping the top bit of the mixed word before 'h *= m' flips only
 * the top bit of h after it (m is odd, so (x + 2^63) * m = x * m + 2^63),
 * whatever h was, and the next mixed word flipped in its top bit puts it
 * back: the two 16-byte blocks (A, B) and (A', B'), where A' and B' mix to
 * A's and B's mixed words with the top bit flipped, leave h unchanged for
 * any seed. Key j takes the primed pair at the positions of its set bits. */
#define FLOOD_BITS 12
#define FLOOD_KEYS (1 << FLOOD_BITS)
#define FLOOD_LEN (FLOOD_BITS * 16)
static void floodKey(unsigned char *out, unsigned j) {
    for (unsigned b = 0; b < FLOOD_BITS; b++) {
        uint64_t words[2];
        for (int w = 0; w < 2; w++) {
            uint64_t mixed = 0x9e3779b97f4a7c15ULL * (2 * b + w + 1);
            if (j >> b & 1) mixed ^= 1ULL << 63;
            words[w] = murmurUnmix(mixed);
        }
        memcpy(out + b * 16, words, 16);
    }
}

/* Keys that all collide under MurmurHash64A whatever its seed are spread
 * by the keyed hash: no probe chain holds them all (under the old hash
 * every insert walked one chain and the longest probe was FLOOD_KEYS). */
static void testFlood(void) {
    static unsigned char keys[FLOOD_KEYS][FLOOD_LEN];
    for (unsigned j = 0; j < FLOOD_KEYS; j++) floodKey(keys[j], j);
    /* The premise: distinct keys, one Murmur hash per seed, for three
     * seeds (one of them the arena's old default, 0). */
    static const uint64_t seeds[] = {0, 42, 0x0123456789abcdefULL};
    int collide = 1;
    for (size_t s = 0; s < 3; s++) {
        uint64_t h0 = murmur64a(seeds[s], keys[0], FLOOD_LEN);
        for (unsigned j = 1; j < FLOOD_KEYS; j++)
            collide &= murmur64a(seeds[s], keys[j], FLOOD_LEN) == h0;
    }
    CHECK(collide);
    CHECK(memcmp(keys[0], keys[1], FLOOD_LEN) != 0);
    CHECK(memcmp(keys[1], keys[2], FLOOD_LEN) != 0);

    for (uint64_t n = 0; n < 3; n++) {
        uint8_t key[ARENA_KEY_BYTES];
        testKey(key, n + 2);
        ColdArena *a = arenaCreateKeyed(key);
        CHECK(a != NULL);
        for (unsigned j = 0; j < FLOOD_KEYS; j++)
            CHECK(arenaInsert(a, (const char *)keys[j], FLOOD_LEN, "v", 1, -1) == 0);
        ArenaStats st;
        arenaGetStats(a, &st);
        CHECK(st.longest_probe < 64);
        int missing = 0;
        ColdRef ref;
        for (unsigned j = 0; j < FLOOD_KEYS; j++)
            missing += arenaLookup(a, (const char *)keys[j], FLOOD_LEN, &ref) != 1;
        CHECK(missing == 0);
        if (n == 0)
            printf("test_arena: %d keys colliding under MurmurHash64A, longest probe %llu\n",
                   FLOOD_KEYS, (unsigned long long)st.longest_probe);
        arenaFree(a);
    }
}

/* ------------------------------------------------------ the spill file */

static void writeFile(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

static int fileIs(const char *path, const char *text) {
    char buf[256] = "";
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    return n == strlen(text) && memcmp(buf, text, n) == 0;
}

static ColdArena *smallArena(int n) {
    ColdArena *a = arenaCreate();
    char k[32];
    for (int i = 0; i < n; i++) CHECK(arenaInsert(a, k, keyName(k, i), "value", 5, -1) == 0);
    return a;
}

/* The spill file is created: never opened through a symbolic link, never
 * over a file that is not a spill file (which is left as it was), nor over
 * the spill file of a live arena; a spill file left by a dead one is
 * replaced. The arena is unchanged by a refused spill. */
static void testSpillPath(void) {
    char dir[] = "/tmp/test_arena_spill.XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[64], victim[64], absent[64], moved[64];
    snprintf(path, sizeof(path), "%s/spill", dir);
    snprintf(victim, sizeof(victim), "%s/victim", dir);
    snprintf(absent, sizeof(absent), "%s/absent", dir);
    snprintf(moved, sizeof(moved), "%s/moved", dir);
    writeFile(victim, "precious");
    ColdArena *a = smallArena(100);
    ArenaStats st;
    int done = 0;

    CHECK(symlink(victim, path) == 0);          /* a link to a file */
    errno = 0;
    CHECK(arenaSpill(a, path, 0, &done) == -1 && errno == ELOOP);
    CHECK(fileIs(victim, "precious"));
    CHECK(unlink(path) == 0);
    CHECK(symlink(absent, path) == 0);          /* a dangling link */
    errno = 0;
    CHECK(arenaSpill(a, path, 0, &done) == -1 && errno == ELOOP);
    CHECK(access(absent, F_OK) != 0);
    CHECK(unlink(path) == 0);
    writeFile(path, "precious");                /* someone else's file */
    errno = 0;
    CHECK(arenaSpill(a, path, 0, &done) == -1 && errno == EEXIST);
    CHECK(fileIs(path, "precious"));
    CHECK(unlink(path) == 0);
    arenaGetStats(a, &st);
    CHECK(!arenaHasSpilled(a) && st.chunks_mem == 1 && arenaCount(a) == 100);

    /* A live arena's spill file is not taken over. */
    CHECK(arenaSpill(a, path, 0, &done) > 0 && done == 1);
    CHECK(arenaHasSpilled(a));
    ColdArena *b = smallArena(10);
    errno = 0;
    CHECK(arenaSpill(b, path, 0, &done) == -1 && errno == EBUSY);
    CHECK(!arenaHasSpilled(b));
    ColdRef ref;
    CHECK(arenaLookup(a, "k7", 2, &ref) == 1);  /* a's file still serves */
    /* Dropping an arena removes its file, not what has taken its name. */
    CHECK(rename(path, moved) == 0);
    writeFile(path, "precious");
    arenaDrop(a, NULL);
    CHECK(fileIs(path, "precious"));
    CHECK(unlink(path) == 0 && unlink(moved) == 0);

    /* A spill file left behind by a process that died is replaced. */
    pid_t pid = fork();
    if (pid == 0) {
        ColdArena *c = smallArena(10);
        _exit(arenaSpill(c, path, 0, &done) > 0 ? 0 : 1);
    }
    int ws = 0;
    CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    CHECK(access(path, F_OK) == 0);
    CHECK(arenaSpill(b, path, 0, &done) > 0 && done == 1);
    CHECK(arenaLookup(b, "k3", 2, &ref) == 1);
    int r;
    while ((r = arenaUnspillStep(b)) == 1) {}
    CHECK(r == 0 && access(path, F_OK) != 0);

    arenaFree(a);
    arenaFree(b);
    CHECK(unlink(victim) == 0 && rmdir(dir) == 0);
}

int main(void) {
    testSipHash();
    testSpillPath();
    testFlood();
    testProbeBound();

    uint8_t key[ARENA_KEY_BYTES];
    testKey(key, 42);
    ColdArena *a = arenaCreateKeyed(key);
    CHECK(a != NULL);

    /* Inserts, deletes and lookups through several incremental rehashes. */
    randomOps(a, 60000, 1);
    checkAll(a);
    while (arenaRehashStep(a, 100)) {}
    checkAll(a);
    checkIterate(a, 7);
    checkIterate(a, 100000);

    /* Reclaim: the deletes above left holes. Steps interleaved with more
     * operations (deletes of items ahead of and behind the step, inserts
     * into the chunk it moves items to, lending), then to the end: every
     * item, lent or not, reads back as before, and only the chunk being
     * appended to keeps holes. */
    {
        ArenaStats rs;
        uint64_t moved = 0;
        CHECK(arenaDeadBytes(a) > 0);
        for (int round = 0; round < 20; round++) {
            CHECK(arenaReclaimStep(a, 37, &moved) == 1);
            randomOps(a, 500, 1);
            checkAll(a);
        }
        int r, steps = 0;
        while ((r = arenaReclaimStep(a, 64, &moved)) == 1 && steps++ < 1000000) {}
        CHECK(r == 0);
        CHECK(moved > 0);
        arenaGetStats(a, &rs);
        CHECK(rs.dead_bytes == arenaDeadBytes(a));
        CHECK(rs.dead_bytes <= ARENA_CHUNK_SIZE);
        CHECK(rs.mapped_bytes - rs.index_bytes <= rs.item_bytes + 2 * ARENA_CHUNK_SIZE);
        CHECK(arenaLiveBytes(a) == rs.item_bytes);
        checkAll(a);
        checkIterate(a, 11);
    }

    /* Too big items are refused without side effects. */
    errno = 0;
    CHECK(arenaInsert(a, "big", 3, NULL, (size_t)ARENA_MAX_VAL + 1, -1) == -1 && errno == E2BIG);

    /* Spill: everything reads back from the file, nothing is in memory. */
    char dir[] = "/tmp/test_arena.XXXXXX", path[64];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof(path), "%s/spill", dir);
    ArenaStats st;
    arenaGetStats(a, &st);
    uint64_t chunks = st.chunks;
    int done = 0;
    int64_t freed = arenaSpill(a, path, 0, &done);
    CHECK(freed > 0 && done == 1);
    arenaGetStats(a, &st);
    CHECK(st.chunks_mem == 0 && st.chunks == chunks && st.spilled_bytes > 0);
    CHECK(arenaHasSpilled(a));
    checkAll(a);
    checkIterate(a, 13);
    /* No inserts while spilled; deletes work. */
    CHECK(arenaInsert(a, "new", 3, "v", 1, -1) == -1 && errno == EROFS);
    CHECK(arenaReclaimStep(a, 10, NULL) == -1 && errno == EROFS);
    randomOps(a, 2000, 0);
    checkAll(a);
    /* Read back in steps. */
    int r;
    while ((r = arenaUnspillStep(a)) == 1) {}
    CHECK(r == 0);
    CHECK(!arenaHasSpilled(a));
    CHECK(access(path, F_OK) != 0);     /* file unlinked */
    CHECK(rmdir(dir) == 0);
    checkAll(a);
    randomOps(a, 20000, 1);
    checkAll(a);

    /* Drop releases everything at once. */
    uint64_t items = 0, before = arenaCount(a);
    arenaGetStats(a, &st);
    uint64_t mapped = st.mapped_bytes;
    uint64_t dropped = arenaDrop(a, &items);
    CHECK(items == before);
    CHECK(dropped == mapped);
    CHECK(arenaCount(a) == 0);
    arenaGetStats(a, &st);
    CHECK(st.mapped_bytes == 0 && st.chunks == 0);
    memset(model, 0, sizeof(model));
    checkAll(a);
    /* The arena is usable after a drop. */
    randomOps(a, 5000, 1);
    checkAll(a);

    /* A deferred drop empties the arena at once and hands over exactly the
     * mappings a drop would have released; they stay readable until
     * arenaUnmap(), and the arena is usable meanwhile. */
    {
        ArenaMapping *maps = NULL;
        size_t nmaps = 0, sum = 0;
        before = arenaCount(a);
        arenaGetStats(a, &st);
        mapped = st.mapped_bytes;
        dropped = arenaDropDeferred(a, &items, &maps, &nmaps);
        CHECK(items == before && dropped == mapped);
        CHECK(arenaCount(a) == 0);
        CHECK(maps != NULL && nmaps == st.chunks_mem + (st.index_bytes ? 1 : 0) + (st.rehashing ? 1 : 0));
        for (size_t i = 0; i < nmaps; i++) {
            volatile char *p = maps[i].addr;
            (void)p[maps[i].len - 1];
            sum += maps[i].len;
        }
        CHECK(sum == mapped);
        memset(model, 0, sizeof(model));
        randomOps(a, 2000, 2);
        checkAll(a);
        /* Paced, a piece at a time: every page of every mapping goes (a
         * page still mapped answers msync), and the rests are taken. */
        void *first = maps[0].addr, *last = (char *)maps[nmaps - 1].addr + maps[nmaps - 1].len - 4096;
        struct timespec w0, w1;
        clock_gettime(CLOCK_MONOTONIC, &w0);
        uint64_t work = arenaUnmapPaced(maps, nmaps, 8192, 3, 5000);
        clock_gettime(CLOCK_MONOTONIC, &w1);
        uint64_t wall = (uint64_t)(w1.tv_sec - w0.tv_sec) * 1000000u +
                        (uint64_t)(w1.tv_nsec - w0.tv_nsec) / 1000;
        CHECK(msync(first, 4096, MS_ASYNC) == -1 && errno == ENOMEM);
        CHECK(msync(last, 4096, MS_ASYNC) == -1 && errno == ENOMEM);
        CHECK(work <= wall);
        CHECK(nmaps < 2 || sum <= 8192 || wall >= 2 * work);
        checkAll(a);
    }

    /* Deleting every item unmaps every chunk but the one being filled. */
    for (int i = 0; i < NKEYS; i++) {
        if (!model[i].present) continue;
        char k[32];
        size_t kl = keyName(k, i);
        CHECK(arenaDelete(a, k, kl) == 1);
        model[i].present = 0;
    }
    arenaGetStats(a, &st);
    CHECK(st.items == 0 && st.item_bytes == 0 && st.chunks <= 1);
    arenaFree(a);

    /* An iteration held across mutations returns every item present
     * throughout, however it moved. Here the first chunk is released (its
     * id is recycled for the next chunk), survivors are rewritten (deleted
     * and inserted again) and reclaim moves the rest, all while the cursor
     * stands in the middle of the arena. */
    {
        enum { N = 6000, GONE = 2100 };     /* 520-byte items, ~2016 a chunk */
        ColdArena *b = arenaCreate();     /* random key */
        char k[32], v[500];
        memset(v, 'x', sizeof(v));
        for (int i = 0; i < N; i++) CHECK(arenaInsert(b, k, keyName(k, i), v, 500, -1) == 0);
        IterCtx c = {0, 0, calloc(NKEYS, 1)};
        uint64_t cur = arenaIterate(b, 0, N / 2, iterCb, &c);
        CHECK(cur != 0 && cur != UINT64_MAX);
        for (int i = 0; i < N; i++)
            if (i < GONE || i % 2 == 0) CHECK(arenaDelete(b, k, keyName(k, i)) == 1);
        for (int i = GONE + 1; i < N; i += 6) {
            CHECK(arenaDelete(b, k, keyName(k, i)) == 1);
            CHECK(arenaInsert(b, k, keyName(k, i), v, 500, -1) == 0);
        }
        uint64_t moved = 0;
        while (arenaReclaimStep(b, 64, &moved) == 1) {}
        CHECK(moved > 0);
        while (cur && cur != UINT64_MAX) cur = arenaIterate(b, cur, 100, iterCb, &c);
        CHECK(cur == 0);
        int missed = 0;
        for (int i = GONE + 1; i < N; i += 2) missed += !c.mark[i];
        CHECK(missed == 0);
        free(c.mark);
        arenaFree(b);
    }

    if (failures) {
        fprintf(stderr, "test_arena: %d failures\n", failures);
        return 1;
    }
    printf("test_arena: ok\n");
    return 0;
}
