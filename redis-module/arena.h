/* arena.h -- the cold arena: items (key, value, absolute expire) in large
 * mmap'd chunks, found through an open-addressing index of its own.
 *
 * Nothing here knows about Redis: the module (hybridmem.c) moves items in and
 * out, the unit tests (tests/test_arena.c) drive it directly.
 *
 * Layout. A chunk is one anonymous mapping (ARENA_CHUNK_SIZE, or bigger for a
 * single large item). Items are appended to the newest chunk:
 *
 *     u32 klen | u32 vlen | i64 expire_ms (-1: none) | u32 clock | key bytes | value bytes
 *
 * native byte order, no padding (headers are read with memcpy). 'clock' is
 * the module's record of the item's last access (an LRU time or an LFU
 * counter, see hmClockOf; 0: none), the one field that changes in place
 * (arenaSetClock). Items never change otherwise after they are written:
 * any access brings the item out of the arena. An item is live iff the index points at it; deleting only updates
 * the index and the chunk's live counters, and a chunk whose last live item
 * goes is unmapped at once. arenaReclaimStep moves the live items out of a
 * chunk with holes so that it can go.
 *
 * The index is a linear-probing table, keyed by SipHash-1-2 under a secret
 * per-arena key, of {hash32, chunk, offset} slots,
 * each with a byte of tag (free, tombstone, or 8 bits of the hash) in an
 * array in front that probing reads first, kept in its own mappings,
 * rehashed incrementally (two tables while rehashing,
 * a bounded number of slots moved per operation, like dict.c).
 *
 * Dropping (arenaDrop) unmaps every chunk and both index tables: O(chunks),
 * independent of the number of items. Spilling (arenaSpill) writes each
 * in-memory chunk to a file as a whole and unmaps it; the index stays in
 * memory and items in spilled chunks are read back with pread().
 */
#ifndef HYBRIDMEM_ARENA_H
#define HYBRIDMEM_ARENA_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define ARENA_CHUNK_SIZE        (1u << 20)      /* 1 MiB */
#define ARENA_ITEM_HDR          20u
#define ARENA_MAX_KEY           (1u << 20)      /* refuse bigger keys */
#define ARENA_MAX_VAL           (64u << 20)     /* refuse bigger values */
#define ARENA_NO_EXPIRE         ((int64_t)-1)
#define ARENA_KEY_BYTES         16u             /* the index hash's key */

typedef struct ColdArena ColdArena;

/* Where an item lives. Valid until the next mutating call on the arena. */
typedef struct ColdRef {
    uint32_t chunk;
    uint32_t off;
} ColdRef;

/* A read item. key/val point either into the chunk (in memory) or into
 * 'buf', a malloc'd copy read from the spill file; arenaItemRelease()
 * frees 'buf'. The pointers are valid until the next mutating call. */
typedef struct ColdItem {
    const char *key;
    const char *val;
    uint32_t klen, vlen;
    int64_t expire;
    uint32_t clock;             /* see the layout above */
    char *buf;
} ColdItem;

typedef struct ArenaStats {
    uint64_t items;             /* live items */
    uint64_t item_bytes;        /* live header+key+value bytes */
    uint64_t chunks;            /* chunks (in memory or spilled) */
    uint64_t chunks_mem;        /* chunks in memory */
    uint64_t mapped_bytes;      /* chunk + index mappings */
    uint64_t index_bytes;       /* index mappings */
    uint64_t spilled_bytes;     /* bytes in the spill file */
    uint64_t dead_bytes;        /* see arenaDeadBytes */
    uint64_t longest_probe;     /* most index slots one lookup reads in a
                                 * table (bound: see tableFind in arena.c) */
    int rehashing;
} ArenaStats;

/* Create an empty arena. The index hash is SipHash-1-2 keyed with 128 bits
 * drawn from the kernel's random pool here, so that clients cannot choose
 * keys that collide (hash flooding). NULL on allocation failure. */
ColdArena *arenaCreate(void);
/* The same with a given key: for tests, which need a reproducible index. */
ColdArena *arenaCreateKeyed(const uint8_t key[ARENA_KEY_BYTES]);
/* Free everything, closes and unlinks the spill file if there is one. */
void arenaFree(ColdArena *a);

/* Copy an item in. The key must not be in the arena already (the caller
 * checked). Returns 0, or -1 with errno: E2BIG (key/value too big), ENOMEM,
 * EROFS (the arena has spilled chunks and takes no new items). */
int arenaInsert(ColdArena *a, const char *key, size_t klen,
                const char *val, size_t vlen, int64_t expire);
/* The same with the item's clock (arenaInsert: 0). */
int arenaInsertClock(ColdArena *a, const char *key, size_t klen,
                     const char *val, size_t vlen, int64_t expire, uint32_t clock);
/* Set the clock of the item at 'ref' (a chunk in memory; -1 with EROFS
 * for a spilled one). Returns 0. */
int arenaSetClock(ColdArena *a, ColdRef ref, uint32_t clock);

/* Find a key. Returns 1 and fills *ref if present, 2 if present and lent
 * (arenaBorrow), 0 if absent, -1 on an I/O error reading a spilled chunk
 * (errno set). */
int arenaLookup(ColdArena *a, const char *key, size_t klen, ColdRef *ref);

/* Lend an item out (the module's visits: a copy of it is in the keyspace
 * for a moment) or take it back. A lent item stays where it is, but is
 * neither counted (arenaCount, stats) nor iterated (arenaIterate) until it
 * is returned or deleted. Return 1 if the item changed state, 0 if it is
 * absent or already in that state, -1 on error. */
int arenaBorrow(ColdArena *a, const char *key, size_t klen);
int arenaReturn(ColdArena *a, const char *key, size_t klen);

/* The arenaIterate cursor at which the item at 'ref' is visited: an item
 * is visited by the call whose [cursor, returned cursor) holds this (0
 * returned: to the end). */
uint64_t arenaCursorOf(const ColdArena *a, ColdRef ref);

/* Read the item at 'ref' into *it. 0 or -1 (errno) on I/O error. */
int arenaRead(ColdArena *a, ColdRef ref, ColdItem *it);
void arenaItemRelease(ColdItem *it);

/* Remove the key if present. Returns 1 if removed, 0 if absent, -1 on error. */
int arenaDelete(ColdArena *a, const char *key, size_t klen);

/* Number of live items that are not lent (O(1)). */
uint64_t arenaCount(const ColdArena *a);
/* Number of live items that have an expire (O(1)). */
uint64_t arenaExpiring(const ColdArena *a);
void arenaGetStats(const ColdArena *a, ArenaStats *st);

/* Move at most 'slots' index slots of an ongoing rehash. Returns 1 if more
 * work remains, 0 otherwise. */
int arenaRehashStep(ColdArena *a, unsigned slots);
/* 1 while an incremental rehash of the index is under way. */
int arenaRehashing(const ColdArena *a);

/* Unmap every chunk and the index (the spill file too). Returns the bytes of
 * mappings released; *items gets the number of items dropped. O(chunks). */
uint64_t arenaDrop(ColdArena *a, uint64_t *items);

/* Like arenaDrop, but the mappings are not unmapped: *maps (malloc'd,
 * *nmaps entries; NULL and 0 if the list could not be allocated, the
 * mappings are then unmapped at once) is handed to the caller, who passes it
 * to arenaUnmap() later, from any thread. The arena is empty and usable at
 * once; nothing in it refers to the mappings any more. */
typedef struct ArenaMapping {
    void *addr;
    size_t len;
} ArenaMapping;
uint64_t arenaDropDeferred(ColdArena *a, uint64_t *items,
                           ArenaMapping **maps, size_t *nmaps);
/* munmap() every mapping of the list and free the list. */
void arenaUnmap(ArenaMapping *maps, size_t nmaps);
/* The same, @piece bytes at a time (0: each mapping whole), resting @rest
 * times as long as each munmap() took (at most @rest_max_us) before the
 * next: for a background thread whose unmapping must not hold up the
 * server. Returns the microseconds spent inside munmap(). */
uint64_t arenaUnmapPaced(ArenaMapping *maps, size_t nmaps, size_t piece, unsigned rest,
                         unsigned rest_max_us);

/* Write in-memory chunks to 'path', flush them to disk, drop them from the
 * page cache and unmap them. Stops early when 'deadline_us'
 * (CLOCK_MONOTONIC, 0: none) passes. Returns the bytes unmapped, or -1 with
 * errno (the arena is unchanged for the chunk that failed). *done is 1 when
 * no in-memory chunk is left.
 * The first call creates the file, which must not exist (O_EXCL, and a
 * symbolic link is refused): errno EEXIST for an existing file, ELOOP for
 * a link, EBUSY for the spill file of a live arena. Only a spill file left
 * behind by a dead arena (regular, owned by this user, with the spill
 * header, not locked) is replaced. The file is removed when the last chunk
 * is read back (arenaUnspillStep) or the arena is dropped, unless something
 * else has taken its name meanwhile. */
int64_t arenaSpill(ColdArena *a, const char *path, uint64_t deadline_us,
                   int *done);

/* Read one spilled chunk back into memory. Returns 1 if more spilled chunks
 * remain, 0 if none is left (the spill file is then closed and unlinked),
 * -1 on error (errno). */
int arenaUnspillStep(ColdArena *a);
int arenaHasSpilled(const ColdArena *a);

/* Bytes of deleted items in the chunks in memory: a deleted item leaves a
 * hole, and its chunk is unmapped only when its last live item goes. A
 * write to a cold item (the module's write visits) deletes it and appends
 * the new version, so under writes spread over the cold set the holes
 * outgrow the live items. O(1). */
uint64_t arenaDeadBytes(const ColdArena *a);
/* Bytes of the live items, headers included (lent ones too). O(1). */
uint64_t arenaLiveBytes(const ColdArena *a);

/* Reclaim holes: move the live items of the in-memory chunk with the most
 * dead bytes (not the one being appended to) to the end, as appends, and
 * unmap it once it is empty. Each call looks at most 'max' items of that
 * chunk and adds the items it moved to *moved. Returns 1 if it did
 * something (call again while more is wanted), 0 if no chunk has a hole,
 * -1 with errno: EROFS (spilled chunks: no appends), ENOMEM. Lent items
 * move too and stay lent. A moved item lands ahead of every iteration
 * cursor: an iteration running meanwhile may visit it twice, never miss
 * it (see arenaIterate). */
int arenaReclaimStep(ColdArena *a, unsigned max, uint64_t *moved);

/* Iteration over live items in a stable order (the order in which their
 * chunks were created, then offset): pass cursor 0 first; returns the next
 * cursor (0 when done), which has bit 63 clear. 'fn' gets each live item
 * that is not lent and must not modify the arena (collect keys, act
 * afterwards); 'max' bounds the number of items visited (live or dead).
 * Items inserted during an iteration may or may not be visited; items
 * present from start to end are visited at least once: exactly once
 * unless they were moved meanwhile (arenaReclaimStep, or deleted and
 * inserted again), which only ever puts them ahead of the cursor.
 * Returns the cursor, or UINT64_MAX on I/O error. */
typedef void (*ArenaIterFn)(void *priv, const ColdItem *it);
uint64_t arenaIterate(ColdArena *a, uint64_t cursor, unsigned max,
                      ArenaIterFn fn, void *priv);

/* Monotonic clock in microseconds. */
uint64_t arenaNowUs(void);

#endif
