/*
 * Hybrid block format: the RAM tier in a shared memory region
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * With ram-file=FILE (a memory broker region passed as /dev/fdset/N, or
 * any file on tmpfs, hugetlbfs or a DAX file system) the plain RAM tier is
 * that file mapped shared instead of anonymous memory, so it outlives the
 * QEMU process.  The region starts with a small header and two bitmaps:
 *
 *   0        region header (HybridRegionHeader, little endian)
 *   4096     valid bitmap: block N's content is in the region
 *            dirty bitmap: block N may differ from the persistent tier
 *            zero bitmap: block N is all zero, its pages freed
 *   data_off blocks, block N at data_off + N * block_size (2 MiB aligned)
 *
 * The bits are kept so that a process killed at any instruction leaves
 * them true: a block's dirty bit is set before its data in the region
 * changes, and cleared only after the persistent tier holds that data;
 * a block's valid bit is set only once its data is complete; its zero bit
 * is set after its pages were freed and cleared before data is written
 * into them (only a valid block's bits count).  So when the
 * header (token and geometry) matches the image at the next open, valid
 * blocks need no restore and dirty ones are written back: a QEMU crash
 * loses no acknowledged write, even in async mode.
 *
 * The image header names the region it is bound to (region_token); a new
 * binding gets a new random token, written to the image before the
 * region, and a read-write open without the region clears it.  While
 * acknowledged writes may exist only in the region, the image carries the
 * incompatible feature HYBRID_INCOMPAT_REGION (set with the DIRTY flag,
 * cleared with it), so that no reader uses the stale persistent tier by
 * mistake.  docs/hybrid-format.rst has the whole crash story.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qemu/bitops.h"
#include "qemu/crc32c.h"
#include "qemu/error-report.h"
#include "qemu/madvise.h"
#include "qemu/timer.h"
#include "qemu/units.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

#define HYBRID_REGION_MAGIC     "QHYBRAM\0"
#define HYBRID_REGION_VERSION   1
#define HYBRID_REGION_ALIGN     (2 * MiB)   /* of the data: huge pages */

typedef struct QEMU_PACKED HybridRegionHeader {
    uint8_t  magic[8];          /*  0: HYBRID_REGION_MAGIC */
    uint32_t version;           /*  8: HYBRID_REGION_VERSION */
    uint32_t header_size;       /* 12: sizeof(HybridRegionHeader) */
    uint64_t token;             /* 16: equals the image's region_token */
    uint64_t virtual_size;      /* 24: of the image */
    uint64_t ram_blocks;        /* 32: blocks in the tier */
    uint32_t block_size;        /* 40 */
    uint32_t flags;             /* 44: HYBRID_REGION_F_* */
    uint64_t bitmap_offset;     /* 48: HYBRID_REGION_BITMAPS */
    uint64_t data_offset;       /* 56: of block 0 */
    uint32_t header_crc;        /* 64: crc32c of the header, this field 0 */
    uint32_t reserved2;         /* 68: zero */
} HybridRegionHeader;

QEMU_BUILD_BUG_ON(sizeof(HybridRegionHeader) > HYBRID_REGION_BITMAPS);

uint64_t hybrid_region_bitmap_bytes(uint64_t blocks)
{
    return BITS_TO_LONGS(blocks) * sizeof(unsigned long);
}

uint64_t hybrid_region_data_offset(uint64_t blocks)
{
    return ROUND_UP(HYBRID_REGION_BITMAPS +
                    3 * hybrid_region_bitmap_bytes(blocks),
                    HYBRID_REGION_ALIGN);
}

static uint32_t region_header_crc(const HybridRegionHeader *le)
{
    HybridRegionHeader tmp = *le;

    tmp.header_crc = 0;
    return crc32c(0xffffffff, (const uint8_t *)&tmp, sizeof(tmp));
}

/*
 * A region's header (@buf, the first sizeof(HybridRegionHeader) bytes of
 * a region of @len bytes), checked as untrusted input: whoever held the
 * region before may have written anything.  Returns false when it is not
 * a region header this code wrote (never initialised, torn, foreign,
 * unknown flags); otherwise fills @r (its blocks bounded by @len).
 */
bool hybrid_region_header_parse(BDRVHybridState *s, const void *buf,
                                uint64_t len, HybridRegionLook *r)
{
    const HybridRegionHeader *h = buf;
    uint64_t rb = le64_to_cpu(h->ram_blocks);
    uint32_t bsz = le32_to_cpu(h->block_size);
    uint64_t data = le64_to_cpu(h->data_offset);

    if (memcmp(h->magic, HYBRID_REGION_MAGIC, sizeof(h->magic)) ||
        le32_to_cpu(h->version) != HYBRID_REGION_VERSION ||
        le32_to_cpu(h->header_size) != sizeof(*h) ||
        le32_to_cpu(h->header_crc) != region_header_crc(h) ||
        le64_to_cpu(h->bitmap_offset) != HYBRID_REGION_BITMAPS ||
        (le32_to_cpu(h->flags) & ~HYBRID_REGION_F_MIRROR) ||
        rb > UINT32_MAX || bsz < HYBRID_MIN_BLOCK_SIZE ||
        bsz > HYBRID_MAX_BLOCK_SIZE || !is_power_of_2(bsz) ||
        data != hybrid_region_data_offset(rb) || data > len ||
        rb > (len - data) / bsz) {
        return false;
    }
    r->token = le64_to_cpu(h->token);
    r->blocks = rb;
    r->flags = le32_to_cpu(h->flags);
    r->same_geometry = rb == s->ram_blocks && bsz == s->block_size &&
                       le64_to_cpu(h->virtual_size) == s->size;
    return true;
}

/* The header of a region of this node's geometry into @buf */
void hybrid_region_header_fill(BDRVHybridState *s, void *buf, uint64_t token,
                               uint32_t flags)
{
    HybridRegionHeader h = {
        .magic = HYBRID_REGION_MAGIC,
        .version = cpu_to_le32(HYBRID_REGION_VERSION),
        .header_size = cpu_to_le32(sizeof(h)),
        .token = cpu_to_le64(token),
        .virtual_size = cpu_to_le64(s->size),
        .ram_blocks = cpu_to_le64(s->ram_blocks),
        .block_size = cpu_to_le32(s->block_size),
        .flags = cpu_to_le32(flags),
        .bitmap_offset = cpu_to_le64(HYBRID_REGION_BITMAPS),
        .data_offset = cpu_to_le64(hybrid_region_data_offset(s->ram_blocks)),
    };

    h.header_crc = cpu_to_le32(region_header_crc(&h));
    memcpy(buf, &h, sizeof(h));
}

static void region_header_write(BDRVHybridState *s, uint64_t token)
{
    hybrid_region_header_fill(s, s->region, token, 0);
}

/*
 * Blocks that are valid and dirty in a region laid out for @blocks, whose
 * bitmaps (the valid one first) are at @bitmaps.
 */
uint64_t hybrid_region_count_dirty(const void *bitmaps, uint64_t blocks)
{
    const unsigned long *valid = bitmaps;
    const unsigned long *dirty = valid + BITS_TO_LONGS(blocks);
    uint64_t n = 0, i;

    for (i = 0; i < BITS_TO_LONGS(blocks); i++) {
        unsigned long w = valid[i] & dirty[i];

        if (i == BITS_TO_LONGS(blocks) - 1 && blocks % BITS_PER_LONG) {
            w &= BIT_MASK(blocks % BITS_PER_LONG) - 1;
        }
        n += ctpopl(w);
    }
    return n;
}

/* Free the region's pages under [p, p + len); they read as zero. */
void hybrid_region_drop_pages(BDRVHybridState *s, uint8_t *p, uint64_t len)
{
    if (fallocate(s->region_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  p - s->region, len) < 0) {
        /* hugetlbfs below a huge page, or a file system without holes */
        memset(p, 0, len);
    }
}

/*
 * Open and map @filename (qemu_open(): /dev/fdset/N works) as the RAM
 * tier.  Checks everything that does not need the image's header state;
 * hybrid_region_attach() decides what the content is worth.
 */
int hybrid_region_open(BDRVHybridState *s, const char *filename,
                       bool writable, Error **errp)
{
    uint64_t need = hybrid_region_data_offset(s->ram_blocks);
    struct stat st;
    void *p;
    int fd;

    if (s->dedup) {
        error_setg(errp, "ram-file cannot be used with dedup=on (the "
                   "deduplicated tier is not a flat array of blocks)");
        return -EINVAL;
    }
    if (s->raw) {
        error_setg(errp, "ram-file needs an image with a header (raw=off): "
                   "the header records which region holds the image's "
                   "newest data");
        return -EINVAL;
    }
    if (s->data_offset < HYBRID_HEADER_SIZE_EXT) {
        error_setg(errp, "ram-file needs %d header bytes before the data, "
                   "the image has %" PRIu64, HYBRID_HEADER_SIZE_EXT,
                   s->data_offset);
        return -EINVAL;
    }
    if (!writable) {
        error_setg(errp, "ram-file needs a read-write node (the region's "
                   "dirty blocks are written back at open)");
        return -EINVAL;
    }

    fd = qemu_open(filename, O_RDWR, errp);
    if (fd < 0) {
        error_prepend(errp, "ram-file: ");
        return -errno;
    }
    if (fstat(fd, &st) < 0) {
        int ret = -errno;

        error_setg_errno(errp, errno, "ram-file '%s'", filename);
        qemu_close(fd);
        return ret;
    }
    if (!S_ISREG(st.st_mode)) {
        error_setg(errp, "ram-file '%s' is not a regular file (a memory "
                   "region on tmpfs, hugetlbfs or DAX)", filename);
        qemu_close(fd);
        return -EINVAL;
    }
    if (s->ram_blocks > (UINT64_MAX - need) / s->block_size ||
        (uint64_t)st.st_size < need + s->ram_blocks * s->block_size) {
        error_setg(errp, "ram-file '%s' has %" PRId64 " bytes; a RAM tier "
                   "of %" PRIu64 " blocks of %" PRIu32 " bytes needs %"
                   PRIu64, filename, (int64_t)st.st_size, s->ram_blocks,
                   s->block_size,
                   s->ram_blocks > (UINT64_MAX - need) / s->block_size ?
                   UINT64_MAX : need + s->ram_blocks * s->block_size);
        qemu_close(fd);
        return -ENOSPC;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        error_setg(errp, "ram-file '%s' does not fit in the address space",
                   filename);
        qemu_close(fd);
        return -ENOMEM;
    }
    p = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int ret = -errno;

        error_setg_errno(errp, errno, "Could not map ram-file '%s'",
                         filename);
        qemu_close(fd);
        return ret;
    }
    s->ram_file = g_strdup(filename);
    s->region_fd = fd;
    s->region = p;
    s->region_len = st.st_size;
    s->region_valid = (unsigned long *)(s->region + HYBRID_REGION_BITMAPS);
    s->region_dirty = s->region_valid + BITS_TO_LONGS(s->ram_blocks);
    s->region_zero = s->region_dirty + BITS_TO_LONGS(s->ram_blocks);
    s->ram = s->region + need;
    return 0;
}

/* The image was resized: the region's header follows (same blocks). */
void hybrid_region_resized(BDRVHybridState *s)
{
    if (s->region) {
        region_header_write(s, s->header.region_token);
    }
}

void hybrid_region_close(BDRVHybridState *s)
{
    if (s->region) {
        munmap(s->region, s->region_len);
        qemu_close(s->region_fd);
        s->region = NULL;
        s->ram = NULL;
        s->region_valid = s->region_dirty = s->region_zero = NULL;
    }
    g_free(s->ram_file);
    s->ram_file = NULL;
}

/*
 * Take the region's content as the RAM tier: no restore for it.  In a
 * mirror (@mirror) only blocks both valid and dirty count: the others are
 * dropped.
 */
static void region_reuse(BDRVHybridState *s, bool mirror)
{
    uint64_t i;

    for (i = 0; i < s->ram_blocks; i++) {
        HybridSlot *slot = &s->slots[i];

        if (mirror && !test_bit(i, s->region_dirty)) {
            clear_bit(i, s->region_valid);
        }
        if (!test_bit(i, s->region_valid)) {
            clear_bit(i, s->region_dirty);
            continue;
        }
        slot->flags |= HYBRID_SLOT_LOADED;
        s->nb_loaded++;
        if (test_bit(i, s->region_zero)) {
            slot->flags |= HYBRID_SLOT_ZERO;
        } else {
            s->nb_nonzero++;
        }
        if (test_bit(i, s->region_dirty)) {
            hybrid_slot_set_dirty(s, slot, 0, hybrid_block_len(s, i));
            s->region_dirty_found++;
        }
    }
    if (s->region_dirty_found) {
        /* Write them back now rather than at the next watermark */
        s->writeback_drain = true;
    }
}

/* Forget the region's content: header first, so a crash leaves it unused. */
static void region_reset(BDRVHybridState *s)
{
    memset(s->region, 0, sizeof(HybridRegionHeader));
    memset(s->region_valid, 0, 3 * hybrid_region_bitmap_bytes(s->ram_blocks));
    hybrid_region_drop_pages(s, s->ram,
                             s->region_len - (s->ram - s->region));
}

/*
 * What binding a region (or a mirror: @what names it in messages) makes of
 * what it holds: @r its header (NULL: not a region of ours), @dirty its
 * blocks not yet written back.  Returns 1 to take it as it is, 0 to reset
 * it and bind it anew, or -errno with @errp set when either would throw
 * away acknowledged writes held in it or named by the image.
 * @reset_only: the persistent tier was written elsewhere (incoming
 * migration), the region cannot be current.
 */
int hybrid_region_judge(BDRVHybridState *s, const char *what,
                        const HybridRegionLook *r, uint64_t dirty,
                        bool reset_only, Error **errp)
{
    uint64_t image_token = s->header.region_token;
    bool held = s->header.incompat_features & HYBRID_INCOMPAT_REGION;

    if (!reset_only && r && image_token && r->token == image_token) {
        if (!r->same_geometry && dirty) {
            error_setg(errp, "%s holds %" PRIu64 " blocks not yet written "
                       "back, laid out for %" PRIu64 " RAM blocks; open the "
                       "image with the ram-size it had", what, dirty,
                       r->blocks);
            return -EINVAL;
        }
        if (r->same_geometry) {
            return 1;
        }
    }
    if (r && dirty && r->token != image_token && !image_token) {
        /* e.g. a mirror that failed, retired by writes made without it */
        error_setg(errp, "%s holds %" PRIu64 " blocks not yet written back "
                   "to another image, or to this one before it was written "
                   "without them (region token %016" PRIx64 "; the image is "
                   "bound to no region); refusing to overwrite them", what,
                   dirty, r->token);
        return -EBUSY;
    }
    if (r && dirty && r->token != image_token) {
        error_setg(errp, "%s holds %" PRIu64 " blocks not yet written back "
                   "to another image (region token %016" PRIx64 ", this "
                   "image's %016" PRIx64 "); refusing to overwrite them",
                   what, dirty, r->token, image_token);
        return -EBUSY;
    }
    if (held && !reset_only) {
        if (r) {
            error_setg(errp, "The image's newest writes are held in RAM "
                       "region %016" PRIx64 ", not in %s (region %016"
                       PRIx64 "); attach that region, or an empty one to "
                       "discard them", image_token, what, r->token);
            return -EBUSY;
        }
        warn_report("hybrid: node '%s': writes acknowledged after the last "
                    "flush were held in RAM region %016" PRIx64 ", which is "
                    "not attached (gone with a host restart?); continuing "
                    "from the persistent tier",
                    bdrv_get_node_name(s->bs), image_token);
    }
    return 0;
}

/*
 * A new binding: a new random token, written to the image (and flushed)
 * before the caller writes it into the region, so that a crash between
 * leaves a mismatch, never a false match.  Returns the token, 0 on
 * failure (@errp set).
 */
uint64_t GRAPH_RDLOCK hybrid_region_bind(BDRVHybridState *s,
                                         const char *what, Error **errp)
{
    uint64_t image_token = s->header.region_token, token;
    HybridHeader le;
    int ret;

    do {
        token = ((uint64_t)g_random_int() << 32) | g_random_int();
    } while (!token || token == image_token);

    s->header.region_token = token;
    s->header.header_size = MAX(s->header.header_size,
                                HYBRID_HEADER_SIZE_EXT);
    s->header.incompat_features &= ~HYBRID_INCOMPAT_REGION;
    hybrid_header_to_le(&s->header, &le);
    ret = bdrv_pwrite(s->bs->file, 0, s->header.header_size, &le, 0);
    if (ret == 0) {
        ret = bdrv_flush(s->bs->file->bs);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not bind %s to the image "
                         "(header write)", what);
        return 0;
    }
    return token;
}

/*
 * Bind the region to the image (main loop or coroutine, node active and
 * read-write, slots empty): hybrid_region_judge() decides whether its
 * content is taken or it is reset with a new token.
 */
static int GRAPH_RDLOCK region_attach(BDRVHybridState *s, bool reset_only,
                                      Error **errp)
{
    g_autofree char *what = g_strdup_printf("ram-file '%s'", s->ram_file);
    HybridRegionLook look;
    bool ok = hybrid_region_header_parse(s, s->region, s->region_len, &look);
    uint64_t dirty = 0, token;
    int ret;

    if (ok) {
        dirty = hybrid_region_count_dirty(s->region_valid, look.blocks);
    }
    s->region_dirty_found = 0;
    ret = hybrid_region_judge(s, what, ok ? &look : NULL, dirty, reset_only,
                              errp);
    if (ret < 0) {
        return ret;
    }
    if (ret > 0) {
        region_reuse(s, look.flags & HYBRID_REGION_F_MIRROR);
        if (look.flags & HYBRID_REGION_F_MIRROR) {
            /* A mirror taken over (failover) is this node's region now */
            region_header_write(s, look.token);
        }
        s->region_reused = true;
        trace_hybrid_region_attach(s, true, s->nb_loaded,
                                   s->region_dirty_found, look.token);
        return 0;
    }

    region_reset(s);
    token = hybrid_region_bind(s, what, errp);
    if (!token) {
        return -EIO;
    }
    region_header_write(s, token);
    s->region_reused = false;
    trace_hybrid_region_attach(s, false, 0, 0, token);
    return 0;
}

int GRAPH_RDLOCK hybrid_region_attach(BDRVHybridState *s, bool reset_only,
                                      Error **errp)
{
    int64_t start = qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
    int ret = region_attach(s, reset_only, errp);

    s->region_attach_ns = qemu_clock_get_ns(QEMU_CLOCK_REALTIME) - start;
    return ret;
}
