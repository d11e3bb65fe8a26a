/*
 * Hybrid block format: RAM tier in front of a persistent tier
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Internal interface shared by hybrid.c (driver: header, I/O, open/close),
 * hybrid-writeback.c (async write-back), hybrid-restore.c (restore while
 * serving), hybrid-promote.c (hot blocks beyond the boundary), hybrid-ram.c
 * (RAM tier) and hybrid-qmp.c (management).  The on-disk layout is specified in
 * docs/hybrid-format.rst of the hybridvm repository.
 */

#ifndef BLOCK_HYBRID_H
#define BLOCK_HYBRID_H

#include "qemu/bitops.h"
#include "qemu/queue.h"
#include "qemu/coroutine.h"
#include "qapi/qapi-types-block-core.h"
#include "content-fp.h"

/* ---- On-disk header (little endian, see docs/hybrid-format.rst) ---- */

#define HYBRID_MAGIC            "QHYBRID\0"
#define HYBRID_VERSION          1
#define HYBRID_HEADER_SIZE      72      /* version 1 base header */
#define HYBRID_HEADER_SIZE_EXT  80      /* with region_token */
#define HYBRID_HEADER_SIZE_BACKING 120  /* with the backing extension */
#define HYBRID_DATA_OFFSET      65536   /* default for new images */
#define HYBRID_MIN_BLOCK_SIZE   4096
#define HYBRID_MAX_BLOCK_SIZE   (2 * 1024 * 1024)
#define HYBRID_DEFAULT_BLOCK_SIZE 65536

/* Option names (runtime and creation) */
#define HYBRID_OPT_RAM_SIZE     "ram-size"
#define HYBRID_OPT_MODE         "mode"
#define HYBRID_OPT_DEDUP        "dedup"
#define HYBRID_OPT_DIRTY_LIMIT  "dirty-limit"
#define HYBRID_OPT_RESTORE      "restore"
#define HYBRID_OPT_RAW          "raw"
#define HYBRID_OPT_BLOCK_SIZE   "block-size"
#define HYBRID_OPT_PROMOTE_SIZE "promote-size"
#define HYBRID_OPT_RAM_FILE     "ram-file"
#define HYBRID_OPT_MIRROR_PREFILL "mirror-prefill"

/* The header's stored settings: creation options, and amend options */
#define HYBRID_HEADER_OPTIONS                                           \
    {                                                                   \
        .name = HYBRID_OPT_BLOCK_SIZE,                                  \
        .type = QEMU_OPT_SIZE,                                          \
        .help = "Block size (power of two, 4k..2M, default 64k; "       \
                "cannot change once created)",                          \
    },                                                                  \
    {                                                                   \
        .name = HYBRID_OPT_RAM_SIZE,                                    \
        .type = QEMU_OPT_SIZE,                                          \
        .help = "Default RAM tier size (default: the virtual size)",    \
    },                                                                  \
    {                                                                   \
        .name = HYBRID_OPT_MODE,                                        \
        .type = QEMU_OPT_STRING,                                        \
        .help = "Default write mode (sync, async)",                     \
    },                                                                  \
    {                                                                   \
        .name = HYBRID_OPT_DEDUP,                                       \
        .type = QEMU_OPT_BOOL,                                          \
        .help = "Default for inline dedup of the RAM tier",             \
    }

#define HYBRID_DEFAULT_DIRTY_LIMIT  (256 * MiB)
/* Largest virtual size we accept: block indices must fit in 32 bits. */
#define HYBRID_MAX_VIRTUAL_SIZE (1ULL << 50)

#define HYBRID_FLAG_DIRTY       (1ULL << 0)   /* not cleanly closed */
#define HYBRID_FLAGS_KNOWN      HYBRID_FLAG_DIRTY

/*
 * Blocks acknowledged to the guest may be held only in the RAM region
 * named by region_token (docs/hybrid-format.rst, "The RAM tier in a
 * region"): a reader without that region would see stale data.
 */
#define HYBRID_INCOMPAT_REGION  (1ULL << 0)
/*
 * The image has an allocation bitmap and may name a backing file
 * (hybrid-backing.c): a block whose bit is clear is not in the image and
 * reads from the backing chain.  A reader that ignored this would show the
 * persistent tier's zeros there instead.
 */
#define HYBRID_INCOMPAT_BACKING (1ULL << 1)
#define HYBRID_INCOMPAT_KNOWN   (HYBRID_INCOMPAT_REGION | \
                                 HYBRID_INCOMPAT_BACKING)

/* The backing extension (docs/hybrid-format.rst, "Backing file") */
#define HYBRID_BACKING_VERSION      1
#define HYBRID_MAX_BACKING_NAME     4095    /* bytes, as bs->backing_file */
#define HYBRID_MAX_BACKING_FMT      15      /* bytes, as bs->backing_format */
#define HYBRID_BACKING_SLOT_SIZE    8192    /* name + format, two slots */
#define HYBRID_BACKING_SLOT_A       4096
#define HYBRID_BACKING_SLOT_B       (HYBRID_BACKING_SLOT_A + \
                                     HYBRID_BACKING_SLOT_SIZE)
#define HYBRID_BITMAP_OFFSET        (HYBRID_BACKING_SLOT_B + \
                                     HYBRID_BACKING_SLOT_SIZE)
/* Bitmap capacity grows in sectors: 4096 blocks per 512 bytes */
#define HYBRID_BITMAP_SECTOR_BITS   (BDRV_SECTOR_SIZE * 8)

#define HYBRID_HDR_MODE_SYNC    0
#define HYBRID_HDR_MODE_ASYNC   1

typedef struct QEMU_PACKED HybridHeader {
    uint8_t  magic[8];          /*  0: HYBRID_MAGIC */
    uint32_t version;           /*  8: HYBRID_VERSION */
    uint32_t header_size;       /* 12: HYBRID_HEADER_SIZE */
    uint64_t incompat_features; /* 16: must be 0 in version 1 */
    uint64_t flags;             /* 24: HYBRID_FLAG_* */
    uint64_t virtual_size;      /* 32: bytes, multiple of 512 */
    uint64_t data_offset;       /* 40: block N at data_offset + N * bs */
    uint64_t ram_size;          /* 48: default RAM tier size, bytes */
    uint32_t block_size;        /* 56: power of two, 4 KiB .. 2 MiB */
    uint8_t  mode;              /* 60: HYBRID_HDR_MODE_* default */
    uint8_t  dedup;             /* 61: 0 or 1, default for dedup= */
    uint8_t  reserved[6];       /* 62: zero */
    uint32_t header_crc;        /* 68: crc32c of bytes [0, header_size), */
                                /*     this field 0 */
    /* header_size >= HYBRID_HEADER_SIZE_EXT only; otherwise read as 0 */
    uint64_t region_token;      /* 72: the RAM region bound to the image */
    /* header_size >= HYBRID_HEADER_SIZE_BACKING only (INCOMPAT_BACKING) */
    uint32_t backing_version;   /* 80: HYBRID_BACKING_VERSION */
    uint16_t backing_name_len;  /* 84: bytes, 0 (none) .. 4095 */
    uint8_t  backing_fmt_len;   /* 86: bytes, 0 .. 15 */
    uint8_t  backing_reserved;  /* 87: zero */
    uint64_t backing_name_offset; /* 88: name, then format, no NUL */
    uint32_t backing_name_crc;  /* 96: crc32c of name and format */
    uint32_t backing_reserved2; /* 100: zero */
    uint64_t bitmap_offset;     /* 104: allocation bitmap, 1 bit a block */
    uint64_t bitmap_blocks;     /* 112: its capacity, multiple of 4096 */
} HybridHeader;

QEMU_BUILD_BUG_ON(sizeof(HybridHeader) != HYBRID_HEADER_SIZE_BACKING);

/* ---- RAM tier ---- */

/* Content-addressed block (dedup=on only). */
typedef struct HybridChunk {
    uint64_t fp;                /* fingerprint, hash table key */
    uint32_t refcnt;            /* slots pointing here */
    bool interned;              /* in the table; else private (refcnt 1) */
    bool fp_valid;              /* private: fp is data's, taken hot */
    struct HybridChunk *next;   /* chain of chunks with an equal fp */
    uint8_t *data;              /* block_size bytes, just before the header */
} HybridChunk;

enum {
    HYBRID_SLOT_LOADED  = 1 << 0,  /* RAM holds the block's current content */
    HYBRID_SLOT_BUSY    = 1 << 1,  /* child I/O for this block in progress */
    HYBRID_SLOT_DIRTY   = 1 << 2,  /* [dirty_lo, dirty_hi) not yet on child */
    HYBRID_SLOT_LISTED  = 1 << 3,  /* on s->dirty_list (dirty or flushing) */
    HYBRID_SLOT_ZERO    = 1 << 4,  /* plain mode: known zero, no pages */
    HYBRID_SLOT_MIRRORED = 1 << 5, /* counted in the mirror (valid, dirty) */
    HYBRID_SLOT_MATCHED = 1 << 6,  /* not counted, its copy there = child's */
};

/* A region's layout: its bitmaps start here (docs/hybrid-format.rst) */
#define HYBRID_REGION_BITMAPS   4096

/* A region header's flags */
#define HYBRID_REGION_F_MIRROR  (1u << 0)  /* count only valid+dirty blocks */

/* What a region's (or a mirror's) header says (hybrid-region.c) */
typedef struct HybridRegionLook {
    uint64_t token;
    uint64_t blocks;            /* its RAM blocks */
    uint32_t flags;             /* HYBRID_REGION_F_* */
    bool same_geometry;         /* laid out for this node */
} HybridRegionLook;

/* One sector of the mirror's bitmaps (hybrid-mirror.c) */
typedef struct HybridMirrorSector {
    bool busy;                  /* a write of it in flight */
    uint64_t gen;               /* changes made to the node's copy */
    uint64_t done;              /* changes the mirror is known to hold */
} HybridMirrorSector;

/*
 * One per block below the RAM boundary.  Everything here is protected by
 * running in the node's AioContext: no field changes across a yield unless
 * the slot is BUSY and the change is made by the BUSY holder.
 */
typedef struct HybridSlot {
    QTAILQ_ENTRY(HybridSlot) dirty_next;  /* least recently written first */
    HybridChunk *chunk;         /* dedup mode: content, NULL = zeros */
    uint32_t dirty_lo, dirty_hi;
    uint8_t flags;
} HybridSlot;

/*
 * A block beyond the storage boundary promoted into RAM because it turned
 * hot.  Never dirty: writes go through to the child and update the copy,
 * so demotion is just dropping it.
 */
typedef struct HybridHot {
    uint64_t idx;               /* hash table key */
    uint8_t *data;
    bool loading;               /* child read in flight, not yet usable */
    bool stale;                 /* written while loading: drop when loaded */
    QTAILQ_ENTRY(HybridHot) lru;
} HybridHot;

#define HYBRID_HEAT_SLOTS       4096
#define HYBRID_HEAT_PROMOTE     2   /* child reads of a block before promotion */

typedef struct BDRVHybridState {
    BlockDriverState *bs;

    /* Image geometry, from the header (or the child for raw=on) */
    HybridHeader header;        /* CPU byte order */
    bool raw;                   /* headerless: data at offset 0 */
    uint64_t size;
    uint64_t data_offset;
    uint32_t block_size;
    uint32_t block_shift;
    uint64_t nb_blocks;

    /* Options */
    HybridMode mode;
    bool dedup;
    uint64_t ram_size;
    uint64_t dirty_limit;

    /* RAM tier: blocks [0, ram_blocks) live here once LOADED */
    uint64_t ram_blocks;
    HybridSlot *slots;
    uint8_t *ram;               /* plain mode: ram_blocks * block_size */
    GHashTable *dedup_table;    /* dedup mode: &fp -> HybridChunk chain */
    uint64_t nb_chunks;         /* dedup mode: distinct non-zero blocks */
    uint64_t nb_private;        /* dedup mode: written, not yet interned */
    uint64_t nb_loaded;         /* LOADED slots */
    uint64_t nb_nonzero;        /* plain mode: LOADED && !ZERO slots */

    /* Promotion beyond the boundary (promote-size > 0) */
    uint64_t promote_blocks;    /* capacity */
    GHashTable *hot;            /* &idx -> HybridHot */
    QTAILQ_HEAD(, HybridHot) hot_lru;   /* least recently used first */
    uint8_t *heat;              /* approximate access counts, hashed */
    uint64_t heat_ops;
    uint64_t promotions, demotions;

    /* Waiters for any slot's BUSY bit to clear */
    CoQueue busy_queue;

    /* Async write-back */
    QTAILQ_HEAD(, HybridSlot) dirty_list;
    uint64_t dirty_bytes;
    CoQueue dirty_queue;        /* writers waiting for dirty_bytes < limit */
    int flush_workers;
    bool writeback_burst;       /* between the high and low watermark */
    int flush_error;            /* sticky: first write-back failure
                                 * (set through hybrid_set_flush_error) */
    QEMUBH *del_blocker_bh;     /* main loop: follows flush_error with... */
    Error *del_blocker;         /* ...a blockdev-del blocker (main loop) */
    bool quiesced;              /* inside a drained section */
    bool inactive;              /* BDRV_O_INACTIVE: no background I/O */

    /* Header dirty bit */
    CoMutex header_lock;
    bool header_dirty_on_disk;

    /* Restore */
    bool restore_enabled;
    int restore_workers;        /* running restore coroutines */
    CoQueue restore_queue;      /* waiters for restore_workers == 0 */
    bool restore_done;
    int restore_error;
    uint64_t restore_cursor;    /* next block index to restore */
    uint64_t restore_bytes;     /* bytes read by restore */
    int64_t restore_start_ns;
    int64_t restore_end_ns;

    /* RAM tier in a shared region (ram-file=), hybrid-region.c */
    char *ram_file;
    int region_fd;
    uint8_t *region;            /* the whole mapping; s->ram points inside */
    uint64_t region_len;
    unsigned long *region_valid;    /* bitmaps inside the mapping */
    unsigned long *region_dirty;
    unsigned long *region_zero;
    bool region_reused;         /* attach found the tier ready */
    uint64_t region_dirty_found;    /* dirty blocks found at attach */
    int64_t region_attach_ns;   /* time the attach took */
    bool writeback_drain;       /* write back all, regardless of watermarks */

    /* Mirror of the dirty blocks on another host (mirror=), hybrid-mirror.c */
    char *mirror_name;          /* its node's name: the node has a mirror */
    BdrvChild *mirror;          /* NULL once detached after a failure */
    QEMUBH *mirror_detach_bh;   /* main loop: detach a failed mirror */
    int mirror_error;           /* sticky: the mirror failed, degraded */
    unsigned long *mirror_bits; /* the mirror's valid, then dirty bitmap */
    uint64_t mirror_bitmap_bytes;   /* of one bitmap */
    HybridMirrorSector *mirror_sectors;
    uint32_t mirror_nb_sectors;
    CoQueue mirror_queue;       /* waiters for a sector write */
    unsigned long *mirror_written_back; /* to uncount after a tier flush */
    bool mirror_cleaning;
    bool mirror_recovered;      /* open found the mirror current */
    uint64_t mirror_dirty_found;    /* blocks it held at open */
    uint64_t mirror_counted;    /* blocks MIRRORED now */
    uint64_t mirror_writes, mirror_block_writes, mirror_bytes;
    uint64_t mirror_uncounted;
    uint64_t mirror_matched;    /* blocks MATCHED now */
    uint64_t mirror_matched_writes; /* first writes of MATCHED blocks */
    uint64_t mirror_prefill_cursor;
    bool mirror_prefill;        /* the mirror-prefill option */
    bool mirror_prefilling;
    bool mirror_retired;        /* degraded, and the image no longer bound */
    bool mirror_retiring;
    CoQueue mirror_retire_queue;    /* writers waiting for the retirement */

    /*
     * Backing file and allocation bitmap (hybrid-backing.c); alloc is NULL
     * for an image without INCOMPAT_BACKING (it holds every block).  All
     * of it runs in the node's AioContext.
     */
    unsigned long *alloc;       /* blocks the image holds: reads use it */
    unsigned long *alloc_disk;  /* what the on-disk bitmap says */
    uint64_t alloc_bits;        /* size of both, multiple of 4096 */
    GArray *alloc_new;          /* uint64_t: set in alloc, not on disk */
    GArray *cow_busy;           /* uint64_t: blocks being copied on write */
    CoQueue cow_queue;          /* waiters for a block to leave cow_busy */
    uint64_t cow_blocks;        /* statistics: blocks copied on write */
    uint64_t backing_reads;     /* block segments read from the backing */

    /* Statistics */
    uint64_t read_hits, read_misses;        /* block segments */
    uint64_t write_ram, write_through;      /* block segments */
    uint64_t flushed_bytes;
} BDRVHybridState;

/* hybrid-ram.c */
int hybrid_ram_init(BDRVHybridState *s, const char *ram_file, bool writable,
                    Error **errp);
void hybrid_ram_free(BDRVHybridState *s);
const uint8_t *hybrid_ram_peek(BDRVHybridState *s, uint64_t idx);
uint8_t *hybrid_ram_plain_ptr(BDRVHybridState *s, uint64_t idx);
int hybrid_ram_write(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                     QEMUIOVector *qiov, size_t qoff, uint32_t len,
                     bool defer_intern);
void hybrid_ram_intern(BDRVHybridState *s, uint64_t idx);
int hybrid_ram_fill(BDRVHybridState *s, uint64_t idx, const uint8_t *buf);
void hybrid_ram_loaded_plain(BDRVHybridState *s, uint64_t idx);
void hybrid_ram_unload(BDRVHybridState *s, uint64_t idx);
void hybrid_ram_unload_all(BDRVHybridState *s);
uint64_t hybrid_ram_used_bytes(BDRVHybridState *s);
uint64_t hybrid_ram_metadata_bytes(BDRVHybridState *s);

/* hybrid-region.c */
int hybrid_region_open(BDRVHybridState *s, const char *filename,
                       bool writable, Error **errp);
int GRAPH_RDLOCK hybrid_region_attach(BDRVHybridState *s, bool reset_only,
                                      Error **errp);
void hybrid_region_close(BDRVHybridState *s);
void hybrid_region_resized(BDRVHybridState *s);
void hybrid_region_drop_pages(BDRVHybridState *s, uint8_t *p, uint64_t len);
uint64_t hybrid_region_bitmap_bytes(uint64_t blocks);
uint64_t hybrid_region_data_offset(uint64_t blocks);
bool hybrid_region_header_parse(BDRVHybridState *s, const void *buf,
                                uint64_t len, HybridRegionLook *r);
void hybrid_region_header_fill(BDRVHybridState *s, void *buf, uint64_t token,
                               uint32_t flags);
uint64_t hybrid_region_count_dirty(const void *bitmaps, uint64_t blocks);
int hybrid_region_judge(BDRVHybridState *s, const char *what,
                        const HybridRegionLook *r, uint64_t dirty,
                        bool reset_only, Error **errp);
uint64_t GRAPH_RDLOCK hybrid_region_bind(BDRVHybridState *s,
                                         const char *what, Error **errp);

/* hybrid-mirror.c */
int GRAPH_RDLOCK hybrid_mirror_open(BDRVHybridState *s, QDict *options,
                                    bool writable, bool ram_file,
                                    Error **errp);
int GRAPH_RDLOCK hybrid_mirror_attach(BDRVHybridState *s, bool reset_only,
                                      Error **errp);
void coroutine_fn GRAPH_RDLOCK hybrid_mirror_resized(BDRVHybridState *s);
int hybrid_mirror_replace(BlockDriverState *bs, BlockDriverState *mbs,
                          Error **errp);
void hybrid_mirror_detach(BDRVHybridState *s);
void hybrid_mirror_close(BDRVHybridState *s);
int coroutine_fn GRAPH_RDLOCK
hybrid_mirror_write(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                    uint32_t len, QEMUIOVector *qiov, size_t qoff);
void hybrid_mirror_written_back(BDRVHybridState *s, uint64_t idx);
void coroutine_fn GRAPH_RDLOCK hybrid_mirror_clean(BDRVHybridState *s);
int coroutine_fn GRAPH_RDLOCK hybrid_mirror_retire(BDRVHybridState *s);
int coroutine_fn GRAPH_RDLOCK
hybrid_mirror_write_through(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                            uint32_t len, QEMUIOVector *qiov, size_t qoff);
void hybrid_mirror_prefill_kick(BDRVHybridState *s);

/* Does an async write of a block need its mirror copy before completing? */
static inline bool hybrid_mirror_active(BDRVHybridState *s)
{
    return s->mirror && !s->mirror_error;
}

/*
 * The region's per-block bits (no-ops for an anonymous tier).  Dirty is
 * set before the block's data in the region changes and cleared once the
 * persistent tier holds it; valid is set once the data is complete.
 */
static inline void hybrid_region_set_dirty(BDRVHybridState *s, uint64_t idx)
{
    if (s->region) {
        set_bit(idx, s->region_dirty);
    }
}

static inline void hybrid_region_clear_dirty(BDRVHybridState *s, uint64_t idx)
{
    if (s->region) {
        clear_bit(idx, s->region_dirty);
    }
}

static inline void hybrid_region_set_valid(BDRVHybridState *s, uint64_t idx)
{
    if (s->region) {
        set_bit(idx, s->region_valid);
    }
}

static inline void hybrid_region_clear_valid(BDRVHybridState *s, uint64_t idx)
{
    if (s->region) {
        clear_bit(idx, s->region_valid);
    }
}

/* Set after the block's pages were freed, cleared before data goes in. */
static inline void hybrid_region_set_zero(BDRVHybridState *s, uint64_t idx,
                                          bool zero)
{
    if (s->region) {
        if (zero) {
            set_bit(idx, s->region_zero);
        } else {
            clear_bit(idx, s->region_zero);
        }
    }
}

/* ---- helpers shared by the driver's files ---- */

static inline HybridSlot *hybrid_slot(BDRVHybridState *s, uint64_t idx)
{
    return idx < s->ram_blocks ? &s->slots[idx] : NULL;
}

/* Bytes of block @idx that exist (the last block may be partial). */
static inline uint32_t hybrid_block_len(BDRVHybridState *s, uint64_t idx)
{
    uint64_t start = idx << s->block_shift;

    return MIN((uint64_t)s->block_size, s->size - start);
}

static inline uint64_t hybrid_host_offset(BDRVHybridState *s, uint64_t off)
{
    return s->data_offset + off;
}

/* hybrid-header.c */
void hybrid_header_to_le(const HybridHeader *cpu, HybridHeader *le);
int hybrid_check_block_size_opt(uint64_t bsz, Error **errp);
int hybrid_check_ram_size(uint64_t ram_size, uint64_t bsz,
                          uint64_t disk_size, Error **errp);
int hybrid_check_ram_blocks(uint64_t blocks, uint64_t ram_size,
                            uint64_t bsz, Error **errp);
int hybrid_header_check(const HybridHeader *le, HybridHeader *h,
                        Error **errp);
int GRAPH_RDLOCK hybrid_read_header(BdrvChild *file, int64_t child_len,
                                    HybridHeader *le);
int coroutine_fn GRAPH_RDLOCK
hybrid_write_header(BDRVHybridState *s, uint64_t flags);
int coroutine_fn GRAPH_RDLOCK hybrid_mark_dirty(BDRVHybridState *s);
extern QemuOptsList hybrid_create_opts;
int coroutine_fn GRAPH_UNLOCKED
hybrid_co_create(BlockdevCreateOptions *create_options, Error **errp);
int coroutine_fn GRAPH_UNLOCKED
hybrid_co_create_opts(BlockDriver *drv, const char *filename, QemuOpts *opts,
                      Error **errp);

/* hybrid.c */
extern BlockDriver bdrv_hybrid;
void coroutine_fn hybrid_slot_lock(BDRVHybridState *s, HybridSlot *slot);
void coroutine_fn hybrid_slot_unlock(BDRVHybridState *s, HybridSlot *slot);

/* hybrid-amend.c */
int coroutine_fn GRAPH_RDLOCK
hybrid_co_truncate(BlockDriverState *bs, int64_t offset, bool exact,
                   PreallocMode prealloc, BdrvRequestFlags flags, Error **errp);
extern QemuOptsList hybrid_amend_opts;
int GRAPH_RDLOCK
hybrid_amend_options(BlockDriverState *bs, QemuOpts *opts,
                     BlockDriverAmendStatusCB *status_cb, void *cb_opaque,
                     bool force, Error **errp);
int coroutine_fn GRAPH_RDLOCK
hybrid_co_amend(BlockDriverState *bs, BlockdevAmendOptions *opts, bool force,
                Error **errp);
BlockMeasureInfo *hybrid_measure(QemuOpts *opts, BlockDriverState *in_bs,
                                 Error **errp);

/* RAM blocks inside the disk (a shrink keeps the tier's geometry) */
static inline uint64_t hybrid_ram_end(BDRVHybridState *s)
{
    return MIN(s->ram_blocks, s->nb_blocks);
}

/* hybrid-backing.c */
int hybrid_backing_check_header(const HybridHeader *h, Error **errp);
int GRAPH_RDLOCK hybrid_backing_open(BlockDriverState *bs, bool raw,
                                     QDict *options, bool io, Error **errp);
int GRAPH_RDLOCK hybrid_backing_load_bitmap(BDRVHybridState *s,
                                            Error **errp);
void hybrid_backing_close(BDRVHybridState *s);
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_read(BDRVHybridState *s, int64_t offset, int64_t bytes,
                    QEMUIOVector *qiov, size_t qoff);
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_read_block(BDRVHybridState *s, uint64_t idx, uint8_t *buf);
void hybrid_backing_set_allocated(BDRVHybridState *s, uint64_t idx);
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_write_through(BDRVHybridState *s, int64_t offset,
                             int64_t bytes, QEMUIOVector *qiov, size_t qoff,
                             BdrvRequestFlags flags);
GArray *hybrid_backing_flush_begin(BDRVHybridState *s);
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_flush_end(BDRVHybridState *s, GArray *snap, int ret);
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_grow(BDRVHybridState *s, uint64_t old_nb, uint64_t new_nb,
                    Error **errp);
int64_t hybrid_backing_unallocated_run(BDRVHybridState *s, int64_t offset,
                                       int64_t bytes);
int coroutine_fn GRAPH_RDLOCK
hybrid_co_change_backing_file(BlockDriverState *bs, const char *backing_file,
                              const char *backing_fmt);
int hybrid_backing_layout(HybridHeader *h, const char *name,
                          const char *fmt, Error **errp);

/* Does the image hold block @idx (else it reads from the backing chain)? */
static inline bool hybrid_block_allocated(BDRVHybridState *s, uint64_t idx)
{
    return !s->alloc || (idx < s->alloc_bits && test_bit(idx, s->alloc));
}

/* hybrid.c, for hybrid-backing.c */
int coroutine_fn GRAPH_RDLOCK
hybrid_write_through(BDRVHybridState *s, int64_t offset, int64_t bytes,
                     QEMUIOVector *qiov, size_t qoff, BdrvRequestFlags flags);

/* hybrid-writeback.c */
void hybrid_slot_set_dirty(BDRVHybridState *s, HybridSlot *slot,
                           uint32_t lo, uint32_t hi);
void hybrid_flusher_kick(BDRVHybridState *s);
void hybrid_set_flush_error(BDRVHybridState *s, int ret);
void hybrid_writeback_init(BDRVHybridState *s);
void hybrid_writeback_cleanup(BDRVHybridState *s);
bool coroutine_fn hybrid_may_defer_write(BDRVHybridState *s, HybridSlot *slot,
                                         uint32_t lo, uint32_t hi);
int coroutine_fn GRAPH_RDLOCK hybrid_co_flush_to_os(BlockDriverState *bs);
/* A request from another AioContext runs in the node's (hybrid.c) */
#define HYBRID_ASSERT_HOME(bs) \
    assert(qemu_get_current_aio_context() == bdrv_get_aio_context(bs))
AioContext *coroutine_fn hybrid_co_go_home(BlockDriverState *bs);
void coroutine_fn hybrid_co_go_back(AioContext *from);

/* hybrid-restore.c */
void hybrid_restore_kick(BDRVHybridState *s);

/* hybrid-promote.c */
bool hybrid_heat(BDRVHybridState *s, uint64_t idx);
void coroutine_fn GRAPH_RDLOCK hybrid_promote(BDRVHybridState *s, uint64_t idx);
HybridHot *hybrid_hot_get(BDRVHybridState *s, uint64_t idx);
void hybrid_hot_write(BDRVHybridState *s, int64_t offset, int64_t bytes,
                      QEMUIOVector *qiov, size_t qoff);
void hybrid_hot_invalidate(BDRVHybridState *s, int64_t offset, int64_t bytes);
void hybrid_hot_drop_all(BDRVHybridState *s);

#endif /* BLOCK_HYBRID_H */
