/* arena.c -- the cold arena; see arena.h for the layout and the contract. */

#include "arena.h"
#include "siphash.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NO_CHUNK        UINT32_MAX
#define MAX_CHUNKS      ((1u << 31) - 2)
#define SLOT_LENT       (1u << 31)      /* in Slot.chunk: lent (arenaBorrow) */
#define MIN_SLOTS       1024u
#define REHASH_STEP     64u     /* slots moved per insert/delete while rehashing */

/* The spill file starts with a header page: SPILL_MAGIC, then zeros; the
 * chunks follow, page-aligned for the page-cache drop. The header only says
 * whose the file is: the arena never reads it back. */
#define SPILL_HDR       4096
static const char SPILL_MAGIC[16] = "appassist-spill\n";

typedef struct Slot {
    uint32_t hash;      /* low 32 bits of the key hash */
    uint32_t chunk;     /* chunk id (meaningful when the slot's tag is live),
                         * | SLOT_LENT while the item is lent */
    uint32_t off;
} Slot;

static inline uint32_t slotChunk(const Slot *s) { return s->chunk & ~SLOT_LENT; }

/* Probing reads a byte array of tags first (like a Swiss table): a lookup
 * of a key that is not cold -- every command on a hot key -- then touches
 * one cache line of a table 12x smaller than the slots, which mostly stays
 * in cache, instead of missing on the slots (perf: that miss was 13 % of
 * the server's CPU with 210k cold items). A slot is only read on a tag
 * match. */
#define TAG_FREE        0u              /* never used: fresh mmap pages are zero */
#define TAG_DEAD        1u

typedef struct Table {
    uint8_t *tags;      /* mmap'd: cap tags, then the slots */
    Slot *slots;        /* inside the tags' mapping */
    uint64_t cap;       /* power of two, 0 when unused */
    uint64_t used;      /* live slots */
    uint64_t tombs;
    uint64_t maxdisp;   /* longest displacement of a slot ever put here */
} Table;

typedef struct Chunk {
    char *mem;          /* NULL: free id or spilled */
    uint32_t cap;       /* mapping size */
    uint32_t used;      /* appended bytes */
    uint32_t live_items;
    uint32_t spilled;   /* 1: contents at file_off in the spill file */
    uint64_t live_bytes;
    off_t file_off;
    uint32_t seq;       /* creation order, see 'order' (0: free id) */
} Chunk;

/* Iteration follows the order in which chunks were created, not their ids:
 * ids are recycled, so a chunk created during an iteration could take an id
 * the cursor had passed, and the items appended to it (moved by reclaim,
 * rewritten, demoted) would be missed. Sequence numbers only grow, and
 * everything is appended to the newest chunk, so an item that moves during
 * an iteration lands ahead of any cursor. */
#define MAX_SEQ         ((1u << 31) - 1)    /* cursor: seq << 32 | offset, bit 63 free */

struct ColdArena {
    SipKey key;                 /* the index hash's secret key */
    Table ht[2];                /* ht[1] used only while rehashing */
    uint64_t rehashidx;         /* next ht[0] slot to move */
    int rehashing;

    Chunk *chunks;              /* malloc'd table of chunk descriptors */
    uint32_t nchunks;           /* ids in use or free */
    uint32_t cur;               /* chunk being appended to, NO_CHUNK: none */
    uint32_t *free_ids;
    uint32_t nfree;

    /* Chunk ids by creation (NO_CHUNK: released), with their seqs,
     * ascending; compacted when half of it is released. */
    uint32_t *order, *order_seq;
    uint32_t norder, order_cap, order_dead;
    uint32_t next_seq;          /* last seq given; kept across drops */

    uint32_t reclaim;           /* chunk being emptied (arenaReclaimStep), NO_CHUNK: none */
    uint32_t reclaim_off;       /* next item in it */
    uint64_t dead_bytes;        /* in-memory chunks: bytes of deleted items */

    uint64_t items;
    uint64_t lent;              /* of which lent (arenaBorrow) */
    uint64_t expiring;          /* live items with an expire */
    uint64_t item_bytes;

    int spill_fd;               /* -1: none; flock'ed while open */
    char *spill_path;
    off_t spill_size;           /* file size, header included */
    uint32_t nspilled;

    /* arenaIterate() keeps the last spilled chunk it read. */
    char *iter_buf;
    uint32_t iter_buf_chunk;
};

uint64_t arenaNowUs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* ---------------------------------------------------------------- hashing */

/* The index hash: SipHash-1-2 under the arena's secret 128-bit key (see
 * siphash.h for why not a seeded MurmurHash). */
static inline uint64_t hashKey(const ColdArena *a, const char *key, size_t len) {
    return sipHash12(&a->key, key, len);
}

/* ----------------------------------------------------------- mappings */

static void *mapBytes(size_t len) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static size_t pageRound(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) & ~(pg - 1);
}

/* Tags of a table of 'cap' slots, rounded to a cache line (keeps the
 * slots aligned). */
static size_t tagBytes(uint64_t cap) {
    return (size_t)((cap + 63) & ~63ULL);
}

static uint64_t tableBytesFor(uint64_t cap) {
    return pageRound(tagBytes(cap) + cap * sizeof(Slot));
}

static int tableInit(Table *t, uint64_t cap) {
    uint8_t *m = mapBytes(tableBytesFor(cap));
    if (!m) return -1;
    /* TAG_FREE is 0: a fresh anonymous mapping is an empty
     * table, no page is touched until used (a 16M-slot table costs no
     * memset). */
    t->tags = m;
    t->slots = (Slot *)(m + tagBytes(cap));
    t->cap = cap;
    t->used = t->tombs = t->maxdisp = 0;
    return 0;
}

static uint64_t tableBytes(const Table *t) {
    return t->cap ? tableBytesFor(t->cap) : 0;
}

static void tableRelease(Table *t) {
    if (t->cap) munmap(t->tags, tableBytes(t));
    memset(t, 0, sizeof(*t));
}

/* The tag of a hash: bits 24-31 (the index uses the low bits; rehashing
 * only has the 32 stored bits), moved off the two reserved values. */
static inline uint8_t hashTag(uint64_t h) {
    uint8_t tag = (uint8_t)(h >> 24);
    return tag < 2 ? tag + 2 : tag;
}

/* ----------------------------------------------------------- chunks */

static int readFull(int fd, void *buf, size_t len, off_t off) {
    char *p = buf;
    while (len) {
        ssize_t n = pread(fd, p, len, off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (n == 0) { errno = EIO; return -1; }
        p += n; len -= (size_t)n; off += n;
    }
    return 0;
}

static int writeFull(int fd, const void *buf, size_t len, off_t off) {
    const char *p = buf;
    while (len) {
        ssize_t n = pwrite(fd, p, len, off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n; len -= (size_t)n; off += n;
    }
    return 0;
}

/* The first position in 'order' whose seq is >= 'seq'. */
static uint32_t orderFind(const ColdArena *a, uint32_t seq) {
    uint32_t lo = 0, hi = a->norder;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (a->order_seq[mid] < seq) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Drop the released entries of 'order'; when the seqs run out, number the
 * chunks afresh (a cursor held across that, once per 2^31 chunks
 * created, may then miss or repeat items). */
static void orderCompact(ColdArena *a) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < a->norder; i++) {
        if (a->order[i] == NO_CHUNK) continue;
        a->order[n] = a->order[i];
        a->order_seq[n] = a->order_seq[i];
        n++;
    }
    a->norder = n;
    a->order_dead = 0;
    if (a->next_seq >= MAX_SEQ - 1) {
        for (uint32_t i = 0; i < n; i++)
            a->chunks[a->order[i]].seq = a->order_seq[i] = i + 1;
        a->next_seq = n;
    }
}

/* Append chunk 'id' to 'order' with the next seq. 0, or -1 (ENOMEM). */
static int orderAppend(ColdArena *a, uint32_t id) {
    if (a->order_dead > a->norder / 2 || a->next_seq >= MAX_SEQ - 1) orderCompact(a);
    if (a->norder == a->order_cap) {
        uint32_t ncap = a->order_cap ? a->order_cap * 2 : 16;
        uint32_t *no = realloc(a->order, (size_t)ncap * sizeof(uint32_t));
        if (!no) return -1;
        a->order = no;
        uint32_t *ns = realloc(a->order_seq, (size_t)ncap * sizeof(uint32_t));
        if (!ns) return -1;
        a->order_seq = ns;
        a->order_cap = ncap;
    }
    a->chunks[id].seq = ++a->next_seq;
    a->order[a->norder] = id;
    a->order_seq[a->norder] = a->next_seq;
    a->norder++;
    return 0;
}

/* Release chunk 'id' (no live item is left in it) and recycle its id. */
static void chunkRelease(ColdArena *a, uint32_t id) {
    Chunk *c = &a->chunks[id];
    if (c->mem) {
        a->dead_bytes -= c->used - c->live_bytes;
        munmap(c->mem, c->cap);
    }
    if (a->reclaim == id) a->reclaim = NO_CHUNK;
    if (c->spilled) a->nspilled--;
    if (a->iter_buf_chunk == id) a->iter_buf_chunk = NO_CHUNK;
    uint32_t pos = orderFind(a, c->seq);
    if (pos < a->norder && a->order_seq[pos] == c->seq) {
        a->order[pos] = NO_CHUNK;
        a->order_dead++;
    }
    memset(c, 0, sizeof(*c));
    if (a->cur == id) a->cur = NO_CHUNK;
    a->free_ids[a->nfree++] = id;
}

/* Return a chunk id with room for 'need' bytes, mapping a new chunk if the
 * current one is full. NO_CHUNK on failure (errno set). */
static uint32_t chunkFor(ColdArena *a, size_t need) {
    if (a->cur != NO_CHUNK) {
        Chunk *c = &a->chunks[a->cur];
        if ((size_t)c->cap - c->used >= need) return a->cur;
    }
    size_t cap = need > ARENA_CHUNK_SIZE ? pageRound(need) : ARENA_CHUNK_SIZE;
    uint32_t id;
    if (a->nfree) {
        id = a->free_ids[--a->nfree];
    } else {
        if (a->nchunks == MAX_CHUNKS) { errno = ENOMEM; return NO_CHUNK; }
        uint32_t n = a->nchunks + 1;
        if ((n & (n - 1)) == 0 || a->nchunks == 0) {
            /* grow the descriptor tables at powers of two */
            uint32_t ncap = n < 16 ? 16 : n * 2;
            Chunk *nc = realloc(a->chunks, (size_t)ncap * sizeof(Chunk));
            if (!nc) { errno = ENOMEM; return NO_CHUNK; }
            a->chunks = nc;
            uint32_t *nf = realloc(a->free_ids, (size_t)ncap * sizeof(uint32_t));
            if (!nf) { errno = ENOMEM; return NO_CHUNK; }
            a->free_ids = nf;
        }
        id = a->nchunks++;
    }
    Chunk *c = &a->chunks[id];
    memset(c, 0, sizeof(*c));
    c->mem = mapBytes(cap);
    if (!c->mem || orderAppend(a, id) < 0) {
        if (c->mem) munmap(c->mem, cap);
        memset(c, 0, sizeof(*c));
        a->free_ids[a->nfree++] = id;
        errno = ENOMEM;
        return NO_CHUNK;
    }
    c->cap = (uint32_t)cap;
    a->cur = id;
    return id;
}

/* Pointer to the bytes of chunk 'id' at [off, off+len), reading them from the
 * spill file into a malloc'd *buf when the chunk is spilled. NULL on error. */
static const char *chunkBytes(ColdArena *a, uint32_t id, uint32_t off,
                              size_t len, char **buf) {
    Chunk *c = &a->chunks[id];
    *buf = NULL;
    if ((uint64_t)off + len > c->used) { errno = EIO; return NULL; }
    if (c->mem) return c->mem + off;
    if (!c->spilled || a->spill_fd < 0) { errno = EIO; return NULL; }
    char *b = malloc(len ? len : 1);
    if (!b) { errno = ENOMEM; return NULL; }
    if (readFull(a->spill_fd, b, len, c->file_off + off) < 0) {
        int e = errno;
        free(b);
        errno = e;
        return NULL;
    }
    *buf = b;
    return b;
}

static void hdrDecode(const char *p, uint32_t *klen, uint32_t *vlen,
                      int64_t *expire) {
    memcpy(klen, p, 4);
    memcpy(vlen, p + 4, 4);
    memcpy(expire, p + 8, 8);
}

#define HDR_CLOCK_OFF 16u       /* the header's clock (see arena.h) */

int arenaRead(ColdArena *a, ColdRef ref, ColdItem *it) {
    char *hbuf;
    const char *h = chunkBytes(a, ref.chunk, ref.off, ARENA_ITEM_HDR, &hbuf);
    if (!h) return -1;
    hdrDecode(h, &it->klen, &it->vlen, &it->expire);
    memcpy(&it->clock, h + HDR_CLOCK_OFF, 4);
    free(hbuf);
    const char *p = chunkBytes(a, ref.chunk, ref.off + ARENA_ITEM_HDR,
                               (size_t)it->klen + it->vlen, &it->buf);
    if (!p) return -1;
    it->key = p;
    it->val = p + it->klen;
    return 0;
}

void arenaItemRelease(ColdItem *it) {
    free(it->buf);
    it->buf = NULL;
}

/* ----------------------------------------------------------- index */

/* Compare the key stored at (chunk, off) with 'key'. 1 equal, 0 not, -1 I/O
 * error. For in-memory chunks this is a plain memcmp. */
static int keyAt(ColdArena *a, uint32_t chunk, uint32_t off,
                 const char *key, size_t klen) {
    Chunk *c = &a->chunks[chunk];
    if (c->mem) {
        uint32_t kl;
        memcpy(&kl, c->mem + off, 4);
        return kl == klen && memcmp(c->mem + off + ARENA_ITEM_HDR, key, klen) == 0;
    }
    ColdItem it;
    if (arenaRead(a, (ColdRef){chunk, off}, &it) < 0) return -1;
    int eq = it.klen == klen && memcmp(it.key, key, klen) == 0;
    arenaItemRelease(&it);
    return eq;
}

/* The work of one lookup. A key is at most t->maxdisp slots past its home
 * slot (hash & mask), so tableFind reads at most maxdisp + 1 tags of each
 * table (two while rehashing), fewer when it meets a free tag; it reads a
 * slot only on a tag match (1 in 254 of the others), and compares keys only
 * when 32 bits of hash match too. What keeps maxdisp small is that nobody
 * can choose keys with one home: the hash is keyed with a secret (hashKey),
 * and a table is rebuilt before live slots and tombstones fill 70 % of it
 * (maybeGrow). Then the homes are uniform and linear probing's longest
 * displacement grows with the log of the table size: with 1M keys, at most
 * 191 slots just before a table grows, 31-44 after (docs/redis-module.md;
 * test_arena checks that 1M keys stay under 256). */

/* Find 'key' in table t; returns the slot index or UINT64_MAX. *err set on
 * an I/O error. */
static uint64_t tableFind(ColdArena *a, Table *t, uint64_t h,
                          const char *key, size_t klen, int *err) {
    if (!t->cap) return UINT64_MAX;
    uint64_t mask = t->cap - 1;
    uint8_t tag = hashTag(h);
    for (uint64_t i = h & mask, n = 0; n <= t->maxdisp; i = (i + 1) & mask, n++) {
        uint8_t ti = t->tags[i];
        if (ti == TAG_FREE) return UINT64_MAX;
        if (ti != tag) continue;
        Slot *s = &t->slots[i];
        if (s->hash != (uint32_t)h) continue;
        int eq = keyAt(a, slotChunk(s), s->off, key, klen);
        if (eq < 0) { *err = 1; return UINT64_MAX; }
        if (eq) return i;
    }
    return UINT64_MAX;
}

/* Place a slot into t (which has room: fill < cap). */
static void tablePut(Table *t, uint64_t h, uint32_t chunk, uint32_t off) {
    uint64_t mask = t->cap - 1;
    uint64_t i = h & mask, disp = 0;
    while (t->tags[i] != TAG_FREE && t->tags[i] != TAG_DEAD) {
        i = (i + 1) & mask;
        disp++;
    }
    if (disp > t->maxdisp) t->maxdisp = disp;
    if (t->tags[i] == TAG_DEAD) t->tombs--;
    t->slots[i] = (Slot){(uint32_t)h, chunk, off};
    t->tags[i] = hashTag(h);
    t->used++;
}

/* Rehashing needs the full hash of an entry that is already in the table;
 * the slot keeps only 32 bits, so it is recomputed from the stored key. To
 * avoid I/O for spilled chunks the 32 stored bits are used as the hash when
 * placing into the new table: both tables index with 'hash & mask', so the
 * low 32 bits are what matters as long as tables stay below 2^32 slots. */
int arenaRehashing(const ColdArena *a) { return a->rehashing; }

int arenaRehashStep(ColdArena *a, unsigned slots) {
    if (!a->rehashing) return 0;
    Table *o = &a->ht[0], *n = &a->ht[1];
    while (slots-- && a->rehashidx < o->cap) {
        uint64_t i = a->rehashidx++;
        Slot *s = &o->slots[i];
        if (o->tags[i] == TAG_FREE || o->tags[i] == TAG_DEAD) continue;
        tablePut(n, s->hash, s->chunk, s->off);
        /* A tombstone keeps later probe chains in ht[0] intact. */
        o->tags[i] = TAG_DEAD;
        o->used--;
        o->tombs++;
    }
    if (a->rehashidx < o->cap) return 1;
    tableRelease(o);
    a->ht[0] = *n;
    memset(n, 0, sizeof(*n));
    a->rehashing = 0;
    a->rehashidx = 0;
    return 0;
}

/* Start a rehash when the table that takes inserts is too full. New size:
 * the next power of two >= 2 * live items (load 0.25..0.5 afterwards). */
static int maybeGrow(ColdArena *a) {
    if (a->rehashing) {
        Table *n = &a->ht[1];
        /* The new table was sized for all items; it can only fill up if
         * inserts outrun the incremental moves, which REHASH_STEP prevents.
         * Finish the rehash synchronously in that unlikely case. */
        if ((n->used + n->tombs + 1) * 10 > n->cap * 9)
            while (arenaRehashStep(a, 1u << 20)) {}
        else
            return 0;
    }
    Table *t = &a->ht[0];
    if (!t->cap) return tableInit(t, MIN_SLOTS);
    if ((t->used + t->tombs + 1) * 10 <= t->cap * 7) return 0;
    uint64_t want = MIN_SLOTS;
    while (want < (t->used + 1) * 2 || want < (t->used + t->cap / 16)) want *= 2;
    if (want > (1ULL << 31)) { errno = ENOMEM; return -1; }
    if (tableInit(&a->ht[1], want) < 0) { errno = ENOMEM; return -1; }
    a->rehashing = 1;
    a->rehashidx = 0;
    return 0;
}

/* Locate key: returns 1 with *t and *slot set, 0 if absent, -1 on error. */
static int findSlot(ColdArena *a, const char *key, size_t klen,
                    Table **t, uint64_t *slot) {
    uint64_t h = hashKey(a, key, klen);
    int err = 0;
    for (int i = 0; i <= a->rehashing; i++) {
        uint64_t s = tableFind(a, &a->ht[i], h, key, klen, &err);
        if (err) return -1;
        if (s != UINT64_MAX) { *t = &a->ht[i]; *slot = s; return 1; }
    }
    return 0;
}

/* The index slot of the item written at (chunk 'id', 'off') with key 'key',
 * or NULL if that item is dead (deleted, or rewritten elsewhere). */
static Slot *liveSlot(ColdArena *a, uint32_t id, uint32_t off, const char *key, size_t klen) {
    Table *t;
    uint64_t s;
    if (findSlot(a, key, klen, &t, &s) != 1 || slotChunk(&t->slots[s]) != id ||
        t->slots[s].off != off)
        return NULL;
    return &t->slots[s];
}

int arenaLookup(ColdArena *a, const char *key, size_t klen, ColdRef *ref) {
    Table *t;
    uint64_t s;
    int r = findSlot(a, key, klen, &t, &s);
    if (r != 1) return r;
    *ref = (ColdRef){slotChunk(&t->slots[s]), t->slots[s].off};
    return t->slots[s].chunk & SLOT_LENT ? 2 : 1;
}

/* Room for an item of 'need' bytes at the end of the arena, counted live
 * in its chunk: returns where to write it, NULL on failure (errno set);
 * *id and *off get its chunk and offset for the index. */
static char *appendItem(ColdArena *a, size_t need, uint32_t *id, uint32_t *off) {
    *id = chunkFor(a, need);
    if (*id == NO_CHUNK) return NULL;
    Chunk *c = &a->chunks[*id];
    *off = c->used;
    c->used += (uint32_t)need;
    c->live_items++;
    c->live_bytes += need;
    return c->mem + *off;
}

int arenaInsert(ColdArena *a, const char *key, size_t klen,
                const char *val, size_t vlen, int64_t expire) {
    return arenaInsertClock(a, key, klen, val, vlen, expire, 0);
}

int arenaInsertClock(ColdArena *a, const char *key, size_t klen,
                     const char *val, size_t vlen, int64_t expire, uint32_t clock) {
    if (klen > ARENA_MAX_KEY || vlen > ARENA_MAX_VAL) { errno = E2BIG; return -1; }
    if (a->nspilled) { errno = EROFS; return -1; }
    if (a->rehashing) arenaRehashStep(a, REHASH_STEP);
    if (maybeGrow(a) < 0) return -1;
    size_t need = ARENA_ITEM_HDR + klen + vlen;
    uint32_t id, off;
    char *p = appendItem(a, need, &id, &off);
    if (!p) return -1;
    uint32_t kl = (uint32_t)klen, vl = (uint32_t)vlen;
    memcpy(p, &kl, 4);
    memcpy(p + 4, &vl, 4);
    memcpy(p + 8, &expire, 8);
    memcpy(p + HDR_CLOCK_OFF, &clock, 4);
    memcpy(p + ARENA_ITEM_HDR, key, klen);
    if (vlen) memcpy(p + ARENA_ITEM_HDR + klen, val, vlen);
    uint64_t h = hashKey(a, key, klen);
    tablePut(&a->ht[a->rehashing], h, id, off);
    a->items++;
    if (expire != ARENA_NO_EXPIRE) a->expiring++;
    a->item_bytes += need;
    return 0;
}

int arenaDelete(ColdArena *a, const char *key, size_t klen) {
    Table *t;
    uint64_t s;
    int r = findSlot(a, key, klen, &t, &s);
    if (r != 1) return r;
    Slot *sl = &t->slots[s];
    uint32_t id = slotChunk(sl);
    if (sl->chunk & SLOT_LENT) a->lent--;
    ColdItem it;
    /* The header gives the item size; in memory this is a memcpy. */
    uint64_t size = 0;
    Chunk *c = &a->chunks[id];
    int64_t expire;
    if (c->mem) {
        uint32_t kl, vl;
        memcpy(&kl, c->mem + sl->off, 4);
        memcpy(&vl, c->mem + sl->off + 4, 4);
        memcpy(&expire, c->mem + sl->off + 8, 8);
        size = ARENA_ITEM_HDR + (uint64_t)kl + vl;
    } else if (arenaRead(a, (ColdRef){id, sl->off}, &it) == 0) {
        size = ARENA_ITEM_HDR + (uint64_t)it.klen + it.vlen;
        expire = it.expire;
        arenaItemRelease(&it);
    } else {
        return -1;
    }
    t->tags[s] = TAG_DEAD;
    t->used--;
    t->tombs++;
    c->live_items--;
    c->live_bytes -= size;
    if (c->mem) a->dead_bytes += size;
    a->items--;
    if (expire != ARENA_NO_EXPIRE) a->expiring--;
    a->item_bytes -= size;
    if (c->live_items == 0 && (id != a->cur || c->spilled)) chunkRelease(a, id);
    if (a->rehashing) arenaRehashStep(a, REHASH_STEP);
    return 1;
}

static int setLent(ColdArena *a, const char *key, size_t klen, int lent) {
    Table *t;
    uint64_t s;
    int r = findSlot(a, key, klen, &t, &s);
    if (r != 1) return r;
    Slot *sl = &t->slots[s];
    if (!(sl->chunk & SLOT_LENT) == !lent) return 0;
    sl->chunk ^= SLOT_LENT;
    if (lent) a->lent++;
    else a->lent--;
    return 1;
}

int arenaSetClock(ColdArena *a, ColdRef ref, uint32_t clock) {
    Chunk *c = &a->chunks[ref.chunk];
    if (!c->mem) { errno = EROFS; return -1; }
    memcpy(c->mem + ref.off + HDR_CLOCK_OFF, &clock, 4);
    return 0;
}

int arenaBorrow(ColdArena *a, const char *key, size_t klen) {
    return setLent(a, key, klen, 1);
}

int arenaReturn(ColdArena *a, const char *key, size_t klen) {
    return setLent(a, key, klen, 0);
}

/* ----------------------------------------------------------- lifecycle */

ColdArena *arenaCreateKeyed(const uint8_t key[ARENA_KEY_BYTES]) {
    ColdArena *a = calloc(1, sizeof(*a));
    if (!a) return NULL;
    a->key = sipKeyFromBytes(key);
    a->cur = NO_CHUNK;
    a->reclaim = NO_CHUNK;
    a->spill_fd = -1;
    a->iter_buf_chunk = NO_CHUNK;
    return a;
}

/* A key from the kernel's random pool (getrandom waits for the pool to be
 * ready, a moment at a guest's boot). Should getrandom fail (ENOSYS), the
 * clock, pid and an address are hashed instead: weaker, but distinct per
 * process and per arena. */
ColdArena *arenaCreate(void) {
    uint8_t key[ARENA_KEY_BYTES];
    ssize_t n;
    do {
        n = getrandom(key, sizeof(key), 0);
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof(key)) {
        uint64_t mix[3] = {arenaNowUs(), (uint64_t)getpid(), (uint64_t)(uintptr_t)key};
        SipKey fixed = {0x736565646b657930ULL, (uint64_t)time(NULL)};
        uint64_t k0 = sipHash24(&fixed, mix, sizeof(mix));
        mix[0] ^= k0;
        uint64_t k1 = sipHash24(&fixed, mix, sizeof(mix));
        memcpy(key, &k0, 8);
        memcpy(key + 8, &k1, 8);
    }
    return arenaCreateKeyed(key);
}

/* 1 if 'path' names the file open as 'fd' (not something put in its place
 * since), 0 if not. */
static int samePath(int fd, const char *path) {
    struct stat fs, ps;
    return fstat(fd, &fs) == 0 && lstat(path, &ps) == 0 &&
           fs.st_dev == ps.st_dev && fs.st_ino == ps.st_ino;
}

static void spillClose(ColdArena *a) {
    if (a->spill_fd >= 0) {
        if (a->spill_path && samePath(a->spill_fd, a->spill_path)) unlink(a->spill_path);
        close(a->spill_fd);
    }
    a->spill_fd = -1;
    free(a->spill_path);
    a->spill_path = NULL;
    a->spill_size = 0;
}

/* Empty the arena. With 'maps', the mappings are handed to the caller
 * instead of being unmapped (if the list cannot be allocated they are
 * unmapped here, and *nmaps is 0). */
static uint64_t dropMappings(ColdArena *a, uint64_t *items,
                             ArenaMapping **maps, size_t *nmaps) {
    uint64_t freed = 0;
    ArenaMapping *m = NULL;
    size_t n = 0;
    if (maps) m = malloc(sizeof(*m) * ((size_t)a->nchunks + 2));
    if (items) *items = a->items - a->lent;
    for (uint32_t i = 0; i < a->nchunks; i++) {
        Chunk *c = &a->chunks[i];
        if (c->mem) {
            if (m) m[n++] = (ArenaMapping){c->mem, c->cap};
            else munmap(c->mem, c->cap);
            freed += c->cap;
        }
    }
    for (int t = 0; t < 2; t++) {
        uint64_t bytes = tableBytes(&a->ht[t]);
        if (bytes && m) {
            m[n++] = (ArenaMapping){a->ht[t].tags, bytes};
            memset(&a->ht[t], 0, sizeof(a->ht[t]));
        } else {
            tableRelease(&a->ht[t]);
        }
        freed += bytes;
    }
    free(a->chunks);
    free(a->free_ids);
    free(a->order);
    free(a->order_seq);
    free(a->iter_buf);
    spillClose(a);
    SipKey key = a->key;
    uint32_t next_seq = a->next_seq;
    memset(a, 0, sizeof(*a));
    a->key = key;
    a->next_seq = next_seq;
    a->cur = NO_CHUNK;
    a->reclaim = NO_CHUNK;
    a->spill_fd = -1;
    a->iter_buf_chunk = NO_CHUNK;
    if (maps) {
        *maps = m;
        *nmaps = n;
    }
    return freed;
}

uint64_t arenaDrop(ColdArena *a, uint64_t *items) {
    return dropMappings(a, items, NULL, NULL);
}

uint64_t arenaDropDeferred(ColdArena *a, uint64_t *items,
                           ArenaMapping **maps, size_t *nmaps) {
    return dropMappings(a, items, maps, nmaps);
}

static uint64_t nowUs(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

uint64_t arenaUnmapPaced(ArenaMapping *maps, size_t nmaps, size_t piece, unsigned rest,
                         unsigned rest_max_us) {
    uint64_t work = 0;
    for (size_t i = 0; i < nmaps; i++) {
        char *p = maps[i].addr;
        size_t left = maps[i].len;
        while (left) {
            size_t len = piece && left > piece ? piece : left;
            uint64_t t = nowUs();
            munmap(p, len);
            t = nowUs() - t;
            work += t;
            p += len;
            left -= len;
            if (rest && (left || i + 1 < nmaps)) {
                uint64_t us = t * rest < rest_max_us ? t * rest : rest_max_us;
                struct timespec ts = {0, (long)us * 1000};
                nanosleep(&ts, NULL);
            }
        }
    }
    free(maps);
    return work;
}

void arenaUnmap(ArenaMapping *maps, size_t nmaps) {
    arenaUnmapPaced(maps, nmaps, 0, 0, 0);
}

void arenaFree(ColdArena *a) {
    if (!a) return;
    arenaDrop(a, NULL);
    free(a);
}

uint64_t arenaCount(const ColdArena *a) { return a->items - a->lent; }
uint64_t arenaExpiring(const ColdArena *a) { return a->expiring; }

void arenaGetStats(const ColdArena *a, ArenaStats *st) {
    memset(st, 0, sizeof(*st));
    st->items = a->items - a->lent;
    st->item_bytes = a->item_bytes;
    for (uint32_t i = 0; i < a->nchunks; i++) {
        const Chunk *c = &a->chunks[i];
        if (c->mem) {
            st->chunks++;
            st->chunks_mem++;
            st->mapped_bytes += c->cap;
        } else if (c->spilled) {
            st->chunks++;
        }
    }
    st->index_bytes = tableBytes(&a->ht[0]) + tableBytes(&a->ht[1]);
    st->mapped_bytes += st->index_bytes;
    st->spilled_bytes = a->spill_fd >= 0 ? (uint64_t)(a->spill_size - SPILL_HDR) : 0;
    st->dead_bytes = a->dead_bytes;
    st->rehashing = a->rehashing;
    for (int t = 0; t <= a->rehashing; t++)
        if (a->ht[t].cap && a->ht[t].maxdisp + 1 > st->longest_probe)
            st->longest_probe = a->ht[t].maxdisp + 1;
}

/* ----------------------------------------------------------- spill */

/* Whether the file at 'path' is a spill file an arena left behind: a
 * regular file (not a link), owned by this user, starting with SPILL_MAGIC,
 * and not locked (an arena holds a flock on its spill file while it uses
 * it, in this process or another one configured with the same path).
 * 0 if so; -1 with errno ELOOP (a symbolic link), EBUSY (in use), EEXIST
 * (anything else: a file that is not ours is never removed). */
static int spillIsStale(const char *path) {
    struct stat ls, fs;
    if (lstat(path, &ls) < 0) return -1;
    if (S_ISLNK(ls.st_mode)) { errno = ELOOP; return -1; }
    if (!S_ISREG(ls.st_mode) || ls.st_uid != geteuid()) { errno = EEXIST; return -1; }
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return -1;
    char magic[sizeof(SPILL_MAGIC)];
    int r = -1, e = EEXIST;
    if (fstat(fd, &fs) == 0 && fs.st_dev == ls.st_dev && fs.st_ino == ls.st_ino &&
        readFull(fd, magic, sizeof(magic), 0) == 0 &&
        memcmp(magic, SPILL_MAGIC, sizeof(magic)) == 0) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) r = 0;
        else e = EBUSY;
    }
    close(fd);
    errno = e;
    return r;
}

/* Create the spill file at 'path'. It must not exist: O_EXCL, so that the
 * path cannot make the server truncate or write through to another file (a
 * symbolic link there fails too). The one exception is a spill file left
 * behind by an arena that is gone (a crash: spillIsStale), which is removed
 * first. Returns the fd, flock'ed, with the header written; -1 with errno
 * on failure (EEXIST, ELOOP, EBUSY: see spillIsStale). */
static int spillCreate(const char *path) {
    int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int fd = open(path, flags, 0600);
    if (fd < 0 && errno == EEXIST) {
        if (spillIsStale(path) < 0) return -1;
        if (unlink(path) < 0) return -1;
        fd = open(path, flags, 0600);
    }
    if (fd < 0) return -1;
    char hdr[SPILL_HDR] = {0};
    memcpy(hdr, SPILL_MAGIC, sizeof(SPILL_MAGIC));
    if (flock(fd, LOCK_EX | LOCK_NB) < 0 || writeFull(fd, hdr, sizeof(hdr), 0) < 0) {
        int e = errno;
        unlink(path);
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

int64_t arenaSpill(ColdArena *a, const char *path, uint64_t deadline_us,
                   int *done) {
    int64_t freed = 0;
    *done = 0;
    if (a->spill_fd < 0) {
        char *p = strdup(path);
        if (!p) { errno = ENOMEM; return -1; }
        int fd = spillCreate(path);
        if (fd < 0) { int e = errno; free(p); errno = e; return -1; }
        a->spill_fd = fd;
        a->spill_path = p;
        a->spill_size = SPILL_HDR;
    }
    uint32_t first = UINT32_MAX, last = 0;
    off_t start = a->spill_size;
    for (uint32_t i = 0; i < a->nchunks; i++) {
        Chunk *c = &a->chunks[i];
        if (!c->mem) continue;
        if (deadline_us && arenaNowUs() > deadline_us) break;
        if (writeFull(a->spill_fd, c->mem, c->used, a->spill_size) < 0)
            return freed ? freed : -1;
        c->file_off = a->spill_size;
        a->spill_size += c->used;
        if (first == UINT32_MAX) first = i;
        last = i;
    }
    if (first == UINT32_MAX) {
        *done = 1;
        return 0;
    }
    /* Data on disk before the memory goes; then drop the file's pages from
     * the page cache, or the guest would still hold the bytes in memory. */
    if (fdatasync(a->spill_fd) < 0) return -1;
    posix_fadvise(a->spill_fd, start, a->spill_size - start, POSIX_FADV_DONTNEED);
    for (uint32_t i = first; i <= last; i++) {
        Chunk *c = &a->chunks[i];
        if (!c->mem) continue;
        if (c->file_off < start) continue;
        munmap(c->mem, c->cap);
        freed += c->cap;
        a->dead_bytes -= c->used - c->live_bytes;
        c->mem = NULL;
        c->spilled = 1;
        a->nspilled++;
        if (a->iter_buf_chunk == i) a->iter_buf_chunk = NO_CHUNK;
    }
    a->cur = NO_CHUNK;
    a->reclaim = NO_CHUNK;
    *done = 1;
    for (uint32_t i = 0; i < a->nchunks; i++)
        if (a->chunks[i].mem) { *done = 0; break; }
    return freed;
}

int arenaHasSpilled(const ColdArena *a) { return a->nspilled != 0; }

int arenaUnspillStep(ColdArena *a) {
    for (uint32_t i = 0; i < a->nchunks; i++) {
        Chunk *c = &a->chunks[i];
        if (!c->spilled) continue;
        char *mem = mapBytes(c->cap);
        if (!mem) { errno = ENOMEM; return -1; }
        if (readFull(a->spill_fd, mem, c->used, c->file_off) < 0) {
            int e = errno;
            munmap(mem, c->cap);
            errno = e;
            return -1;
        }
        c->mem = mem;
        c->spilled = 0;
        a->dead_bytes += c->used - c->live_bytes;
        a->nspilled--;
        break;
    }
    if (a->nspilled) return 1;
    spillClose(a);
    return 0;
}

/* ----------------------------------------------------------- reclaim */

uint64_t arenaDeadBytes(const ColdArena *a) { return a->dead_bytes; }
uint64_t arenaLiveBytes(const ColdArena *a) { return a->item_bytes; }

/* The in-memory chunk, other than the one being appended to, with the most
 * dead bytes: the most memory freed per byte copied. NO_CHUNK if none has
 * any. */
static uint32_t reclaimPick(const ColdArena *a) {
    uint32_t best = NO_CHUNK;
    uint64_t most = 0;
    for (uint32_t i = 0; i < a->nchunks; i++) {
        const Chunk *c = &a->chunks[i];
        if (!c->mem || i == a->cur || c->used - c->live_bytes <= most) continue;
        most = c->used - c->live_bytes;
        best = i;
    }
    return best;
}

int arenaReclaimStep(ColdArena *a, unsigned max, uint64_t *moved) {
    if (a->nspilled) { errno = EROFS; return -1; }
    if (a->reclaim == NO_CHUNK) {
        a->reclaim = reclaimPick(a);
        a->reclaim_off = 0;
        if (a->reclaim == NO_CHUNK) return 0;
    }
    uint32_t id = a->reclaim;
    while (max--) {
        Chunk *src = &a->chunks[id];
        if (a->reclaim_off >= src->used) {
            /* Every item it held is elsewhere now: nothing refers to it. */
            chunkRelease(a, id);
            return 1;
        }
        uint32_t off = a->reclaim_off, kl, vl;
        int64_t expire;
        hdrDecode(src->mem + off, &kl, &vl, &expire);
        uint32_t need = ARENA_ITEM_HDR + kl + vl;
        a->reclaim_off += need;
        Slot *sl = liveSlot(a, id, off, src->mem + off + ARENA_ITEM_HDR, kl);
        if (!sl) continue;                      /* dead: a hole */
        /* Never into the chunk being emptied: chunkFor appends to the
         * current chunk or maps a new one, and 'id' is neither. */
        uint32_t to, to_off;
        char *p = appendItem(a, need, &to, &to_off);
        if (!p) { a->reclaim_off = off; return -1; }
        src = &a->chunks[id];                   /* chunkFor may move the table */
        memcpy(p, src->mem + off, need);
        sl->chunk = to | (sl->chunk & SLOT_LENT);    /* appendItem leaves the index be */
        sl->off = to_off;
        src->live_items--;
        src->live_bytes -= need;
        a->dead_bytes += need;
        if (moved) (*moved)++;
        if (src->live_items == 0) {
            chunkRelease(a, id);            /* the rest of it is holes */
            return 1;
        }
    }
    return 1;
}

/* ----------------------------------------------------------- iteration */

uint64_t arenaCursorOf(const ColdArena *a, ColdRef ref) {
    return (uint64_t)a->chunks[ref.chunk].seq << 32 | ref.off;
}

/* Cursor: seq << 32 | offset of the next item; 0 = start/done. A chunk
 * released since (its seq is gone) continues with the next one. */
uint64_t arenaIterate(ColdArena *a, uint64_t cursor, unsigned max,
                      ArenaIterFn fn, void *priv) {
    uint32_t seq = (uint32_t)(cursor >> 32);
    uint32_t pos = orderFind(a, seq);
    uint32_t off = pos < a->norder && a->order_seq[pos] == seq ? (uint32_t)cursor : 0;
    while (pos < a->norder && max) {
        uint32_t id = a->order[pos];
        Chunk *c = id == NO_CHUNK ? NULL : &a->chunks[id];
        const char *base = c ? c->mem : NULL;
        if (c && !base && c->spilled) {
            if (a->iter_buf_chunk != id) {
                char *b = realloc(a->iter_buf, c->cap);
                if (!b) return UINT64_MAX;
                a->iter_buf = b;
                if (readFull(a->spill_fd, b, c->used, c->file_off) < 0) {
                    a->iter_buf_chunk = NO_CHUNK;
                    return UINT64_MAX;
                }
                a->iter_buf_chunk = id;
            }
            base = a->iter_buf;
        }
        if (!base || off >= c->used) {
            pos++;
            off = 0;
            continue;
        }
        while (off < c->used && max) {
            ColdItem it = {0};
            hdrDecode(base + off, &it.klen, &it.vlen, &it.expire);
            memcpy(&it.clock, base + off + HDR_CLOCK_OFF, 4);
            it.key = base + off + ARENA_ITEM_HDR;
            it.val = it.key + it.klen;
            uint32_t here = off;
            off += ARENA_ITEM_HDR + it.klen + it.vlen;
            max--;
            /* Live iff the index points here; lent items are skipped. */
            Slot *sl = liveSlot(a, id, here, it.key, it.klen);
            if (sl && !(sl->chunk & SLOT_LENT)) fn(priv, &it);
        }
    }
    if (pos >= a->norder) return 0;
    return (uint64_t)a->order_seq[pos] << 32 | off;
}
