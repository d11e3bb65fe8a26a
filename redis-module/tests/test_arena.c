/* test_arena.c -- unit tests of the cold arena against a reference model.
 * Seeded: a failure names the seed and the step. */
#include "../arena.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
typedef struct { int present; uint32_t vlen; int64_t expire; unsigned char fill; } Model;
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
            CHECK(arenaInsert(a, k, kl, v, vlen, expire) == 0);
            model[i] = (Model){1, vlen, expire, fill};
        } else if (model[i].present && next() % 3 == 0) {
            /* lend, or take back; lending twice or returning what is not
             * lent changes nothing */
            int lend = model[i].present == 1;
            CHECK((lend ? arenaBorrow(a, k, kl) : arenaReturn(a, k, kl)) == 1);
            CHECK((lend ? arenaBorrow(a, k, kl) : arenaReturn(a, k, kl)) == 0);
            model[i].present = lend ? 2 : 1;
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

int main(void) {
    ColdArena *a = arenaCreate(42);
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
    char path[] = "/tmp/test_arena.XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
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
        arenaUnmap(maps, nmaps);
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
        ColdArena *b = arenaCreate(7);
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
