/*
 * Clone cache: a host-shared, persistent, content-keyed read cache for the
 * read-only bases that many VM disks are cloned from.
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Two halves: the store (clone-cache-store.c), a user-creatable object
 * that owns the cache file, its index and the background filler; and the
 * block driver (clone-cache.c), a read-only filter over one base that
 * serves reads from the store and queues what it read from the base for
 * filling.  The on-disk layout and its crash story are in
 * docs/clone-cache-format.rst.
 */

#ifndef BLOCK_CLONE_CACHE_H
#define BLOCK_CLONE_CACHE_H

#include "qemu/queue.h"
#include "qemu/thread.h"
#include "qemu/coroutine.h"
#include "qom/object.h"
#include "qapi/qapi-types-block-core.h"
#include "block/graph-lock.h"

#define TYPE_CLONE_CACHE "clone-cache"
OBJECT_DECLARE_SIMPLE_TYPE(CloneCacheStore, CLONE_CACHE)

#define CC_MAGIC            "QCLNCCH1"
#define CC_VERSION          1
#define CC_SB_SIZE          4096
#define CC_MAX_BASES        256
#define CC_BASE_REC_SIZE    512
#define CC_BASE_ID_MAX      488
#define CC_REC_SIZE         32
#define CC_SUB              4096        /* data checked in 4 KiB pieces */
#define CC_NONE             UINT32_MAX
#define CC_BLOCK_BITS       56          /* entry key: base << 56 | block */

#define CC_MIN_BLOCK        4096
#define CC_MAX_BLOCK        (1 * MiB)
#define CC_DEFAULT_BLOCK    (64 * KiB)
#define CC_DEFAULT_FILL_LIMIT (32 * MiB)
#define CC_MAX_SLOTS        (1ULL << 31)

/* Superblock, little endian on disk (CC_SB_SIZE bytes, the rest zero) */
typedef struct QEMU_PACKED CloneCacheSuper {
    char     magic[8];
    uint32_t version;
    uint32_t block_size;
    uint64_t nb_slots;
    uint64_t nb_entries;
    uint64_t base_off;
    uint64_t slot_off;
    uint64_t entry_off;
    uint64_t sum_off;
    uint64_t data_off;
    uint64_t epoch;             /* bumped at every open: seq = epoch << 32 | n */
    uint32_t max_bases;
    uint32_t crc;               /* CRC-32C of the bytes before it */
} CloneCacheSuper;

/* One base (CC_BASE_REC_SIZE bytes); nonce 0 = unused */
typedef struct QEMU_PACKED CloneCacheBaseRec {
    uint64_t nonce;             /* new for every (id, generation) */
    uint64_t generation;
    uint32_t id_len;
    char     id[CC_BASE_ID_MAX];
    uint32_t crc;
} CloneCacheBaseRec;

/* One data slot (32 bytes); seq 0 = invalid */
typedef struct QEMU_PACKED CloneCacheSlotRec {
    uint64_t fp;                /* content fingerprint */
    uint64_t seq;               /* fill sequence, unique per content */
    uint32_t len;               /* bytes of data */
    uint32_t sums_crc;          /* CRC-32C of the slot's sum table row */
    uint32_t flags;             /* CC_SLOT_PINNED */
    uint32_t crc;
} CloneCacheSlotRec;

/* One map entry (32 bytes): (base, block) -> slot; nonce 0 = invalid */
typedef struct QEMU_PACKED CloneCacheEntryRec {
    uint64_t key;               /* base index << 56 | block index */
    uint64_t nonce;             /* the base record's nonce */
    uint64_t slot_seq;          /* the slot record's seq */
    uint32_t slot;
    uint32_t crc;
} CloneCacheEntryRec;

#define CC_SLOT_PINNED      1

typedef enum {
    CC_SLOT_FREE,               /* on-disk record is invalid */
    CC_SLOT_STALE,              /* unused; on-disk record may be valid */
    CC_SLOT_FILLING,            /* being written by the filler */
    CC_SLOT_VALID,
    /*
     * Out of service while readers still hold it: on no list, so the
     * filler cannot reuse it; the last reader makes it STALE and free.
     */
    CC_SLOT_RETIRED,
} CloneCacheSlotState;

typedef enum {
    CC_Q_NONE,
    CC_Q_A1IN,                  /* 2Q: seen once, FIFO */
    CC_Q_AM,                    /* 2Q: seen again, LRU */
    CC_Q_PINNED,                /* never evicted */
    CC_Q_FREE,
} CloneCacheQueue;

typedef struct CloneCacheSlot {
    uint64_t fp;                /* hash key of store->fps */
    uint64_t seq;
    uint32_t len;
    uint32_t sums_crc;          /* at open only: the record's, to check */
    uint32_t refcnt;            /* entries pointing here */
    uint32_t readers;           /* reading it now: never freed or reused */
    uint32_t first_entry;       /* entries pointing here, via ->next */
    uint32_t fp_next;           /* slots with the same fingerprint */
    uint8_t state;              /* CloneCacheSlotState */
    uint8_t queue;              /* CloneCacheQueue */
    bool pinned;
    QTAILQ_ENTRY(CloneCacheSlot) link;
} CloneCacheSlot;

/*
 * An entry whose gen is not its base's current gen is stale: invisible to
 * lookups, dropped when met and by the background sweep.  Invalidating a
 * base is thus O(1) under the lock; the sweep frees the slots in bounded
 * steps.  (gen wraps only after 2^32 invalidations, and every sweep visits
 * all entries long before that.)
 */
typedef struct CloneCacheEntry {
    uint64_t key;               /* hash key of store->map */
    uint32_t slot;
    uint32_t next;              /* next entry of the same slot */
    uint32_t gen;               /* the base's gen when it was added */
    bool used;
} CloneCacheEntry;

/* Statistics of one base, kept while the process runs */
typedef struct CloneCacheBaseStats {
    uint64_t hits, misses, merged, base_read_bytes, cache_read_bytes;
    uint64_t fill_bytes, fills, fills_dropped;
} CloneCacheBaseStats;

typedef struct CloneCacheBase {
    char *id;                   /* NULL = unused */
    uint64_t generation;
    uint64_t nonce;
    uint32_t gen;               /* bumped with the nonce: see CloneCacheEntry */
    uint64_t nb_entries;        /* live (not stale) entries */
    int users;                  /* open nodes */
    char *node_name;            /* last node that attached */
    CloneCacheBaseStats st;
} CloneCacheBase;

/* A block read from a base, waiting to be written to the cache */
typedef struct CloneCacheFill {
    uint64_t key;
    uint64_t nonce;
    uint32_t len;
    bool pin;
    uint8_t *data;
    uint32_t slot;              /* filler's choice */
    bool shared;                /* content found in an existing slot */
    QSIMPLEQ_ENTRY(CloneCacheFill) next;
} CloneCacheFill;

typedef QTAILQ_HEAD(, CloneCacheSlot) CloneCacheSlotList;

struct CloneCacheStore {
    Object parent_obj;

    /* properties */
    char *filename;
    uint64_t size;
    uint64_t block_size;
    uint64_t fill_limit;
    uint8_t fp_bits;            /* x-fingerprint-bits: tests force clashes */
    bool direct;
    uint64_t fp_mask;

    BlockBackend *blk;
    /*
     * Protects everything below: taken by the nodes' request coroutines
     * (any AioContext) and the filler, never held across a yield.
     */
    QemuMutex lock;

    uint64_t nb_slots, nb_entries;
    uint64_t base_off, slot_off, entry_off, sum_off, data_off;
    uint32_t spb;               /* 4 KiB pieces per block */
    uint32_t *sums;             /* spb CRC-32Cs per slot */
    uint64_t epoch;
    uint64_t seq;               /* last slot sequence handed out */
    CloneCacheSlot *slots;
    CloneCacheEntry *entries;
    CloneCacheBase bases[CC_MAX_BASES];
    GHashTable *map;            /* &entry->key -> entry */
    GHashTable *fps;            /* &slot->fp -> first slot of that fp */
    CloneCacheSlotList free_slots, a1in, am;
    uint64_t nb_free, nb_a1in, nb_am, nb_pinned;
    uint32_t *free_entries;     /* stack of unused entry indexes */
    uint64_t nb_free_entries;
    GHashTable *ghost;          /* 2Q A1out: keys recently evicted */
    GQueue ghost_fifo;

    QSIMPLEQ_HEAD(, CloneCacheFill) fills;
    GHashTable *pending;        /* &fill->key -> fill, until written */
    uint64_t fill_pending;      /* bytes queued */
    bool filler_running;
    uint64_t nb_stale_entries;  /* of invalidated bases, not swept yet */
    bool sweep_again;           /* a base was invalidated during a sweep */
    bool sweeping;              /* the sweep coroutine runs */
    bool closing;               /* the sweep stops */

    /* x-read-delay-ns (atomic, not under the lock): tests pause hits */
    uint64_t read_delay_ns;

    /* store-wide statistics */
    uint64_t evictions, fill_errors, checksum_errors, discarded_records;
    uint64_t dedup_shared;
    bool fill_error_reported;
};

/* clone-cache-file.c */
CloneCacheStore *clone_cache_store_find(const char *id, Error **errp);
uint32_t cc_crc(const void *p, size_t len);
uint32_t cc_crc_update(uint32_t crc, const void *p, size_t len);
bool cc_all_zero(const void *p, size_t len);
void cc_slot_rec(CloneCacheStore *s, uint32_t i, bool valid,
                 CloneCacheSlotRec *r);
int coroutine_fn cc_write_slot_rec(CloneCacheStore *s, uint32_t i,
                                   bool valid);
int coroutine_fn cc_write_sums(CloneCacheStore *s, uint32_t i);
void cc_compute_sums(const uint8_t *data, uint32_t len, uint32_t *sums);
uint32_t cc_sums_crc(CloneCacheStore *s, uint32_t i);
void cc_copy_sums(CloneCacheStore *s, uint32_t slot, uint32_t start,
                  uint32_t end, uint32_t *row);
bool cc_check_sums(const uint32_t *row, const uint8_t *buf, uint32_t start,
                   uint32_t end);
bool cc_check_sums_qiov(const uint32_t *row, QEMUIOVector *qiov,
                        size_t qiov_offset, uint32_t start, uint32_t end);
int coroutine_fn cc_write_entry_rec(CloneCacheStore *s, uint32_t e,
                                    uint64_t key, uint64_t nonce,
                                    uint32_t slot, uint64_t seq);
int cc_write_base_rec(CloneCacheStore *s, int b);

/* clone-cache-store.c */
void cc_queue_add(CloneCacheStore *s, CloneCacheSlot *sl, uint8_t q);
void cc_fp_insert(CloneCacheStore *s, uint32_t i);
void clone_cache_quiesce(CloneCacheStore *s);
int clone_cache_attach(CloneCacheStore *s, const char *base_id,
                       uint64_t generation, const char *node_name,
                       Error **errp);
void clone_cache_detach(CloneCacheStore *s, int base);
int clone_cache_attach_origin(CloneCacheStore *s, const char *base_id,
                              bool has_generation, uint64_t generation,
                              uint64_t *nonce, Error **errp);
/* Under s->lock: as clone_cache_lookup(), clone_cache_has() for a copy */
uint32_t clone_cache_lookup_origin(CloneCacheStore *s, int origin,
                                   uint64_t nonce, uint64_t block);
bool clone_cache_origin_has(CloneCacheStore *s, int origin, uint64_t nonce,
                            uint64_t block);
int clone_cache_invalidate(CloneCacheStore *s, const char *base_id,
                           Error **errp);
/* Under s->lock: the slot serving (base, block), or CC_NONE */
uint32_t clone_cache_lookup(CloneCacheStore *s, int base, uint64_t block);
int coroutine_fn clone_cache_read_slot(CloneCacheStore *s, int base,
                                       uint32_t slot, uint32_t offset,
                                       uint32_t bytes, QEMUIOVector *qiov,
                                       size_t qiov_offset);
bool clone_cache_read_pending(CloneCacheStore *s, int base, uint64_t block,
                              uint64_t offset, uint64_t bytes,
                              QEMUIOVector *qiov, size_t qiov_offset);
/* Under s->lock: whether a live entry serves (base, block) */
bool clone_cache_has(CloneCacheStore *s, int base, uint64_t block);
/* Under s->lock: whether a fill of @len bytes would be queued now */
bool clone_cache_fill_room(CloneCacheStore *s, uint64_t len);
void clone_cache_queue_fill(CloneCacheStore *s, int base, uint64_t nonce,
                            uint64_t block, const uint8_t *data,
                            uint32_t len, bool pin);
CloneCacheInfo *clone_cache_store_info(CloneCacheStore *s);
/* Pin (or only release) a slot returned by clone_cache_lookup() */
int coroutine_fn clone_cache_pin(CloneCacheStore *s, uint32_t slot,
                                 bool pin);
int coroutine_fn clone_cache_unpin_base(CloneCacheStore *s, int base,
                                        Error **errp);

/* clone-cache.c: a node's state, shared with its QMP (clone-cache-qmp.c) */

/* One base read that other misses may wait for */
typedef struct CloneCacheInflight {
    uint64_t first, nb;         /* blocks */
    uint8_t *buf;
    int ret;
    bool done;
    int refs;
    CoQueue waiters;
} CloneCacheInflight;

typedef struct BDRVCloneCacheState {
    CloneCacheStore *store;
    int base;                   /* index in store->bases */
    int origin;                 /* copy-of's index, or -1 */
    uint64_t origin_nonce;      /* its nonce when this node opened */
    uint64_t nb_blocks;
    int64_t length;
    GHashTable *inflight;       /* block -> CloneCacheInflight (store lock) */

    /* boot-set trace (store lock) */
    unsigned long *rec_seen;    /* NULL when not recording */
    GArray *rec_order;          /* uint64_t blocks, first read first */
    bool prewarming;            /* atomic: set by QMP, cleared by the job */
} BDRVCloneCacheState;

extern BlockDriver bdrv_clone_cache;
void cc_inflight_unref(CloneCacheInflight *f);
/* Under the store lock: whether nothing serves or fetches @block yet */
bool cc_is_miss(BDRVCloneCacheState *s, uint64_t block);
int coroutine_fn GRAPH_RDLOCK
cc_read_base(BlockDriverState *bs, CloneCacheInflight *f, bool pin);

static inline uint64_t clone_cache_key(int base, uint64_t block)
{
    return ((uint64_t)base << CC_BLOCK_BITS) | block;
}

#endif
