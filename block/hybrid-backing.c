/*
 * Hybrid block format: backing file, allocation bitmap, copy-on-write
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * An image with INCOMPAT_BACKING has an allocation bitmap (one bit per
 * block) and may name a backing image.  A block whose bit is clear was
 * never written to this image: it reads from the backing chain (zeros
 * without one), it is not restored into the RAM tier, and the first write
 * to it copies the whole block: backing data around the written span,
 * into RAM (then written back whole) or straight to the persistent tier.
 *
 * The crash story of a copy-on-write (docs/hybrid-format.rst, "Backing
 * file") is that of the data itself: a bit reaches the on-disk bitmap
 * only in a flush, after the block's whole copy was written and the
 * persistent tier flushed:
 *
 *   write the whole block (RAM or tier) -> set the bit in s->alloc
 *   flush: take alloc_new -> write back RAM -> flush the tier ->
 *          write the bitmap sectors of those bits (the block layer then
 *          flushes the tier again)
 *
 * So an on-disk bit is never ahead of its data; a crash before the flush
 * loses the copy (the block reads from the backing again), like any write
 * acknowledged after the last flush.  Bits are never cleared: nothing
 * makes a block unallocated again.
 *
 * The backing name and format live in one of two slots; a change writes
 * the other slot, flushes, then writes the header (one sector) that points
 * at it, so a crash leaves the old name or the new one.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qobject/qdict.h"
#include "qemu/bitmap.h"
#include "qemu/crc32c.h"
#include "qemu/cutils.h"
#include "qemu/iov.h"
#include "qemu/memalign.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "block/qdict.h"
#include "hybrid.h"
#include "trace.h"

/* ---- header extension ---- */

/* Bytes of the on-disk bitmap for @blocks blocks (whole sectors) */
static uint64_t hybrid_bitmap_bytes(uint64_t blocks)
{
    return ROUND_UP(blocks, HYBRID_BITMAP_SECTOR_BITS) / 8;
}

static bool ranges_overlap64(uint64_t a, uint64_t alen, uint64_t b,
                             uint64_t blen)
{
    return a < b + blen && b < a + alen;
}

/*
 * Validate the backing extension of header @h (CPU order, the base header
 * already checked): every offset and length is bounded before use.
 */
int hybrid_backing_check_header(const HybridHeader *h, Error **errp)
{
    uint64_t nb_blocks = DIV_ROUND_UP(h->virtual_size, h->block_size);
    uint64_t name_bytes = (uint64_t)h->backing_name_len + h->backing_fmt_len;
    uint64_t bm_bytes;

    if (h->backing_version != HYBRID_BACKING_VERSION) {
        error_setg(errp, "Unsupported hybrid image (backing extension "
                   "version %" PRIu32 " is not %d)", h->backing_version,
                   HYBRID_BACKING_VERSION);
        return -ENOTSUP;
    }
    if (h->backing_name_len > HYBRID_MAX_BACKING_NAME) {
        error_setg(errp, "Corrupt hybrid image (backing file name of %u "
                   "bytes is longer than %d)", h->backing_name_len,
                   HYBRID_MAX_BACKING_NAME);
        return -EINVAL;
    }
    if (h->backing_fmt_len > HYBRID_MAX_BACKING_FMT) {
        error_setg(errp, "Corrupt hybrid image (backing format name of %u "
                   "bytes is longer than %d)", h->backing_fmt_len,
                   HYBRID_MAX_BACKING_FMT);
        return -EINVAL;
    }
    if (h->backing_reserved || h->backing_reserved2) {
        error_setg(errp, "Corrupt hybrid image (reserved backing extension "
                   "fields are not zero)");
        return -EINVAL;
    }
    if (h->backing_name_offset < BDRV_SECTOR_SIZE ||
        h->backing_name_offset > h->data_offset ||
        name_bytes > h->data_offset - h->backing_name_offset) {
        error_setg(errp, "Corrupt hybrid image (backing file name at %"
                   PRIu64 ", %" PRIu64 " bytes, is not inside [%llu, %"
                   PRIu64 "))", h->backing_name_offset, name_bytes,
                   BDRV_SECTOR_SIZE, h->data_offset);
        return -EINVAL;
    }
    if (h->bitmap_blocks % HYBRID_BITMAP_SECTOR_BITS ||
        h->bitmap_blocks < nb_blocks ||
        h->bitmap_blocks > HYBRID_MAX_VIRTUAL_SIZE / HYBRID_MIN_BLOCK_SIZE) {
        error_setg(errp, "Corrupt hybrid image (allocation bitmap of %"
                   PRIu64 " blocks: not a multiple of %llu covering the %"
                   PRIu64 " blocks of the disk)", h->bitmap_blocks,
                   BDRV_SECTOR_SIZE * 8, nb_blocks);
        return -EINVAL;
    }
    bm_bytes = hybrid_bitmap_bytes(h->bitmap_blocks);
    if (h->bitmap_offset % BDRV_SECTOR_SIZE ||
        h->bitmap_offset < BDRV_SECTOR_SIZE ||
        h->bitmap_offset > h->data_offset ||
        bm_bytes > h->data_offset - h->bitmap_offset ||
        ranges_overlap64(h->bitmap_offset, bm_bytes, h->backing_name_offset,
                         name_bytes)) {
        error_setg(errp, "Corrupt hybrid image (allocation bitmap at %"
                   PRIu64 ", %" PRIu64 " bytes, is not sector-aligned "
                   "inside [%llu, %" PRIu64 ") apart from the name)",
                   h->bitmap_offset, bm_bytes, BDRV_SECTOR_SIZE,
                   h->data_offset);
        return -EINVAL;
    }
    return 0;
}

/*
 * The extension's fixed fields, and a bitmap from HYBRID_BITMAP_OFFSET
 * taking all the room up to @h's data_offset.
 */
static void hybrid_backing_extension(HybridHeader *h)
{
    h->header_size = HYBRID_HEADER_SIZE_BACKING;
    h->incompat_features |= HYBRID_INCOMPAT_BACKING;
    h->backing_version = HYBRID_BACKING_VERSION;
    h->bitmap_offset = HYBRID_BITMAP_OFFSET;
    h->bitmap_blocks = QEMU_ALIGN_DOWN((h->data_offset - HYBRID_BITMAP_OFFSET)
                                       * 8, HYBRID_BITMAP_SECTOR_BITS);
}

/*
 * Lay out a new image's backing extension in @h (geometry already set):
 * name in slot A, the bitmap after slot B, data after the bitmap; the
 * bitmap takes all the room up to data_offset, so the disk may grow
 * until that is full.
 */
int hybrid_backing_layout(HybridHeader *h, const char *name,
                          const char *fmt, Error **errp)
{
    size_t name_len = strlen(name), fmt_len = fmt ? strlen(fmt) : 0;
    uint64_t nb_blocks = DIV_ROUND_UP(h->virtual_size, h->block_size);
    uint64_t bm_end;
    g_autofree char *slot = NULL;

    if (name_len > HYBRID_MAX_BACKING_NAME) {
        error_setg(errp, "Backing file name of %zu bytes is longer than %d",
                   name_len, HYBRID_MAX_BACKING_NAME);
        return -EINVAL;
    }
    if (fmt_len > HYBRID_MAX_BACKING_FMT) {
        error_setg(errp, "Backing format name '%s' is longer than %d bytes",
                   fmt, HYBRID_MAX_BACKING_FMT);
        return -EINVAL;
    }
    bm_end = HYBRID_BITMAP_OFFSET + hybrid_bitmap_bytes(nb_blocks);
    h->data_offset = ROUND_UP(MAX(bm_end, HYBRID_DATA_OFFSET),
                              HYBRID_DATA_OFFSET);
    hybrid_backing_extension(h);
    h->backing_name_len = name_len;
    h->backing_fmt_len = fmt_len;
    h->backing_name_offset = HYBRID_BACKING_SLOT_A;
    slot = g_strconcat(name, fmt ?: "", NULL);
    h->backing_name_crc = crc32c(0xffffffff, (uint8_t *)slot,
                                 name_len + fmt_len);
    return 0;
}

/* ---- open ---- */

/* Read the backing file name and format into the block layer's fields. */
static int GRAPH_RDLOCK hybrid_backing_read_name(BDRVHybridState *s,
                                                 Error **errp)
{
    BlockDriverState *bs = s->bs;
    HybridHeader *h = &s->header;
    size_t n = h->backing_name_len, f = h->backing_fmt_len;
    g_autofree char *buf = g_malloc0(n + f + 1);
    uint32_t crc;
    int ret;

    ret = bdrv_pread(bs->file, h->backing_name_offset, n + f, buf, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not read the backing file name");
        return ret;
    }
    crc = crc32c(0xffffffff, (uint8_t *)buf, n + f);
    if (crc != h->backing_name_crc || memchr(buf, 0, n + f)) {
        error_setg(errp, "Corrupt hybrid image (backing file name checksum "
                   "0x%08" PRIx32 " does not match computed 0x%08" PRIx32
                   ", or the name holds a NUL)", h->backing_name_crc, crc);
        return -EINVAL;
    }
    pstrcpy(bs->backing_format, sizeof(bs->backing_format), buf + n);
    buf[n] = '\0';
    pstrcpy(bs->backing_file, sizeof(bs->backing_file), buf);
    pstrcpy(bs->auto_backing_file, sizeof(bs->auto_backing_file), buf);
    return 0;
}

/* Grow both in-memory bitmaps to @bits (they never shrink). */
static int hybrid_backing_widen(BDRVHybridState *s, uint64_t bits)
{
    size_t old = hybrid_bitmap_bytes(s->alloc_bits);
    size_t bytes = hybrid_bitmap_bytes(bits);
    unsigned long *a;

    if (bits <= s->alloc_bits) {
        return 0;
    }
    a = g_try_realloc(s->alloc, bytes);
    if (!a) {
        return -ENOMEM;
    }
    memset((char *)a + old, 0, bytes - old);
    s->alloc = a;
    a = g_try_realloc(s->alloc_disk, bytes);
    if (!a) {
        return -ENOMEM;     /* s->alloc is only longer than it needs be */
    }
    memset((char *)a + old, 0, bytes - old);
    s->alloc_disk = a;
    s->alloc_bits = bits;
    return 0;
}

/* Both in-memory bitmaps, cleared, for at least the disk's size. */
static int hybrid_backing_alloc_bitmaps(BDRVHybridState *s, Error **errp)
{
    uint64_t bits = ROUND_UP(MAX(s->nb_blocks, 1), HYBRID_BITMAP_SECTOR_BITS);

    if (hybrid_backing_widen(s, bits) < 0) {
        hybrid_backing_close(s);    /* no half-made bitmap stays behind */
        error_setg(errp, "Could not allocate the allocation bitmap (%"
                   PRIu64 " bytes)", hybrid_bitmap_bytes(bits));
        return -ENOMEM;
    }
    bitmap_zero(s->alloc, s->alloc_bits);
    bitmap_zero(s->alloc_disk, s->alloc_bits);
    if (!s->alloc_new) {
        s->alloc_new = g_array_new(false, false, sizeof(uint64_t));
        s->cow_busy = g_array_new(false, false, sizeof(uint64_t));
    }
    return 0;
}

/* (Re)load the allocation bitmap from disk into both in-memory copies. */
int GRAPH_RDLOCK hybrid_backing_load_bitmap(BDRVHybridState *s, Error **errp)
{
    uint64_t bits = ROUND_UP(MAX(s->nb_blocks, 1), HYBRID_BITMAP_SECTOR_BITS);
    uint64_t bytes = hybrid_bitmap_bytes(bits);
    g_autofree unsigned long *le = NULL;
    int ret;

    ret = hybrid_backing_alloc_bitmaps(s, errp);
    if (ret < 0) {
        return ret;
    }
    le = g_try_malloc(bytes);
    if (!le) {
        error_setg(errp, "Could not allocate %" PRIu64 " bytes", bytes);
        return -ENOMEM;
    }
    ret = bdrv_pread(s->bs->file, s->header.bitmap_offset, bytes, le, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not read the allocation bitmap");
        return ret;
    }
    bitmap_from_le(s->alloc, le, bits);
    /* Bits past the disk mean nothing (a hostile image may set them) */
    bitmap_clear(s->alloc, s->nb_blocks, bits - s->nb_blocks);
    bitmap_copy(s->alloc_disk, s->alloc, bits);
    g_array_set_size(s->alloc_new, 0);
    return 0;
}

static bool hybrid_backing_option_given(QDict *options)
{
    const QDictEntry *e;

    for (e = qdict_first(options); e; e = qdict_next(options, e)) {
        if (!strcmp(e->key, "backing") || strstart(e->key, "backing.", NULL)) {
            return true;
        }
    }
    return false;
}

/*
 * Called at open after the header was read.  @io: the open may do I/O
 * (not BDRV_O_NO_IO); only the name is needed otherwise.
 */
int GRAPH_RDLOCK hybrid_backing_open(BlockDriverState *bs, bool raw,
                                     QDict *options, bool io, Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    int ret;

    qemu_co_queue_init(&s->cow_queue);
    if (raw) {
        if (hybrid_backing_option_given(options)) {
            error_setg(errp, "A raw=on hybrid node has no allocation bitmap, "
                       "so it cannot have a backing file");
            return -EINVAL;
        }
        return 0;
    }
    if (!(s->header.incompat_features & HYBRID_INCOMPAT_BACKING)) {
        /* It holds every block: a backing node given is never read */
        return 0;
    }
    ret = hybrid_backing_read_name(s, errp);
    if (ret < 0 || !io) {
        return ret;
    }
    return hybrid_backing_load_bitmap(s, errp);
}

void hybrid_backing_close(BDRVHybridState *s)
{
    g_free(s->alloc);
    g_free(s->alloc_disk);
    s->alloc = s->alloc_disk = NULL;
    s->alloc_bits = 0;
    if (s->alloc_new) {
        g_array_free(s->alloc_new, true);
        s->alloc_new = NULL;
    }
    if (s->cow_busy) {
        g_array_free(s->cow_busy, true);
        s->cow_busy = NULL;
    }
}

/* ---- reads ---- */

/*
 * Read [offset, offset + bytes) of the disk from the backing chain, for
 * blocks the image does not hold.  Past the backing image's end, and
 * without one, the disk reads as zeros (the block layer zero-fills reads
 * past a node's end).
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_read(BDRVHybridState *s, int64_t offset, int64_t bytes,
                    QEMUIOVector *qiov, size_t qoff)
{
    BdrvChild *backing = s->bs->backing;

    s->backing_reads++;
    trace_hybrid_backing_read(s, offset, bytes, !!backing);
    if (!backing) {
        qemu_iovec_memset(qiov, qoff, 0, bytes);
        return 0;
    }
    return bdrv_co_preadv_part(backing, offset, bytes, qiov, qoff, 0);
}

/* The backing chain's copy of block @idx, into @buf (block_size bytes) */
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_read_block(BDRVHybridState *s, uint64_t idx, uint8_t *buf)
{
    uint32_t len = hybrid_block_len(s, idx);
    QEMUIOVector qiov;

    memset(buf + len, 0, s->block_size - len);
    qemu_iovec_init_buf(&qiov, buf, len);
    return hybrid_backing_read(s, idx << s->block_shift, len, &qiov, 0);
}

/*
 * Bytes from @offset (in a block the image does not hold) up to the next
 * block it holds, at most @bytes: one block status answer.
 */
int64_t hybrid_backing_unallocated_run(BDRVHybridState *s, int64_t offset,
                                       int64_t bytes)
{
    uint64_t idx = offset >> s->block_shift;
    uint64_t end = find_next_bit(s->alloc, s->nb_blocks, idx);
    int64_t run = (int64_t)(end << s->block_shift) - offset;

    return MIN(run, bytes);
}

/* ---- copy-on-write ---- */

/* The block belongs to the image now; the next flush records it. */
void hybrid_backing_set_allocated(BDRVHybridState *s, uint64_t idx)
{
    if (s->alloc && !test_and_set_bit(idx, s->alloc)) {
        g_array_append_val(s->alloc_new, idx);
        s->cow_blocks++;
        trace_hybrid_backing_allocate(s, idx);
    }
}

static bool hybrid_cow_busy(BDRVHybridState *s, uint64_t idx)
{
    for (guint i = 0; i < s->cow_busy->len; i++) {
        if (g_array_index(s->cow_busy, uint64_t, i) == idx) {
            return true;
        }
    }
    return false;
}

/*
 * One copy-on-write at a time per block beyond the RAM boundary (two
 * writers into one unallocated block would each copy the backing data
 * over the other's bytes).  The set is as small as the writes in flight.
 */
static void coroutine_fn hybrid_cow_lock(BDRVHybridState *s, uint64_t idx)
{
    while (hybrid_cow_busy(s, idx)) {
        qemu_co_queue_wait(&s->cow_queue, NULL);
    }
    g_array_append_val(s->cow_busy, idx);
}

static void coroutine_fn hybrid_cow_unlock(BDRVHybridState *s, uint64_t idx)
{
    for (guint i = 0; i < s->cow_busy->len; i++) {
        if (g_array_index(s->cow_busy, uint64_t, i) == idx) {
            g_array_remove_index_fast(s->cow_busy, i);
            break;
        }
    }
    qemu_co_queue_restart_all(&s->cow_queue);
}

/*
 * Write [boff, boff + len) of block @idx (beyond the RAM boundary, not
 * held by the image): the whole block goes to the persistent tier, the
 * backing chain's bytes around the new ones.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_backing_cow(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                   uint32_t len, QEMUIOVector *qiov, size_t qoff,
                   BdrvRequestFlags flags)
{
    uint64_t start = idx << s->block_shift;
    uint32_t blen = hybrid_block_len(s, idx);
    uint8_t *buf;
    int ret;

    hybrid_cow_lock(s, idx);
    if (hybrid_block_allocated(s, idx)) {
        /* Another writer copied it meanwhile */
        hybrid_cow_unlock(s, idx);
        return hybrid_write_through(s, start + boff, len, qiov, qoff, flags);
    }
    buf = qemu_try_blockalign(s->bs->file->bs, s->block_size);
    if (!buf) {
        ret = -ENOMEM;
        goto out;
    }
    if (boff == 0 && len >= blen) {
        memset(buf, 0, s->block_size);
    } else {
        ret = hybrid_backing_read_block(s, idx, buf);
        if (ret < 0) {
            goto out;
        }
    }
    if (qiov) {
        qemu_iovec_to_buf(qiov, qoff, buf + boff, len);
    } else {
        memset(buf + boff, 0, len);
    }
    if (buffer_is_zero(buf, blen)) {
        ret = bdrv_co_pwrite_zeroes(s->bs->file, hybrid_host_offset(s, start),
                                    blen, flags & BDRV_REQ_MAY_UNMAP);
    } else {
        ret = bdrv_co_pwrite(s->bs->file, hybrid_host_offset(s, start), blen,
                             buf, 0);
    }
    trace_hybrid_backing_cow(s, idx, boff, len, ret);
    if (ret == 0) {
        s->write_through++;
        hybrid_backing_set_allocated(s, idx);
    }
out:
    qemu_vfree(buf);
    hybrid_cow_unlock(s, idx);
    return ret;
}

/*
 * A write beyond the RAM boundary of an image with a bitmap: runs of
 * blocks it holds go through as one request, the others are copied.
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_write_through(BDRVHybridState *s, int64_t offset,
                             int64_t bytes, QEMUIOVector *qiov, size_t qoff,
                             BdrvRequestFlags flags)
{
    int64_t run_start = offset, run_len = 0;
    size_t run_qoff = qoff;
    int ret;

    while (bytes > 0) {
        uint64_t idx = offset >> s->block_shift;
        uint32_t boff = offset & (s->block_size - 1);
        uint32_t len = MIN(bytes, s->block_size - boff);

        if (hybrid_block_allocated(s, idx)) {
            if (!run_len) {
                run_start = offset;
                run_qoff = qoff;
            }
            run_len += len;
        } else {
            if (run_len) {
                ret = hybrid_write_through(s, run_start, run_len, qiov,
                                           run_qoff, flags);
                if (ret < 0) {
                    return ret;
                }
                run_len = 0;
            }
            ret = hybrid_backing_cow(s, idx, boff, len, qiov, qoff, flags);
            if (ret < 0) {
                return ret;
            }
        }
        offset += len;
        bytes -= len;
        qoff += len;
    }
    if (run_len) {
        return hybrid_write_through(s, run_start, run_len, qiov, run_qoff,
                                    flags);
    }
    return 0;
}

/* ---- flush: the bitmap follows the data ---- */

/* Take the bits to record in this flush (NULL: nothing to do). */
GArray *hybrid_backing_flush_begin(BDRVHybridState *s)
{
    GArray *snap;

    if (!s->alloc_new || !s->alloc_new->len) {
        return NULL;
    }
    snap = s->alloc_new;
    s->alloc_new = g_array_new(false, false, sizeof(uint64_t));
    return snap;
}

static gint cmp_u64(gconstpointer a, gconstpointer b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* Write the bitmap sectors of the bits in @snap (sorted). */
static int coroutine_fn GRAPH_RDLOCK
hybrid_backing_write_bitmap(BDRVHybridState *s, GArray *snap)
{
    const uint64_t longs = HYBRID_BITMAP_SECTOR_BITS / BITS_PER_LONG;
    g_autofree unsigned long *le = g_new(unsigned long, longs);
    uint64_t last = UINT64_MAX;
    int ret;

    for (guint i = 0; i < snap->len; i++) {
        uint64_t sec = g_array_index(snap, uint64_t, i) /
                       HYBRID_BITMAP_SECTOR_BITS;

        if (sec == last) {
            continue;
        }
        last = sec;
        bitmap_to_le(le, s->alloc_disk + sec * longs,
                     HYBRID_BITMAP_SECTOR_BITS);
        ret = bdrv_co_pwrite(s->bs->file, s->header.bitmap_offset +
                             sec * BDRV_SECTOR_SIZE, BDRV_SECTOR_SIZE, le, 0);
        if (ret < 0) {
            return ret;
        }
    }
    return 0;
}

/* Write sectors @first..@last of the bitmap, placed at @base, in one go. */
static int coroutine_fn GRAPH_RDLOCK
hybrid_backing_write_sectors(BDRVHybridState *s, uint64_t base,
                             uint64_t first, uint64_t last)
{
    const uint64_t longs = HYBRID_BITMAP_SECTOR_BITS / BITS_PER_LONG;
    uint64_t n = last - first + 1;
    g_autofree unsigned long *le = g_try_new(unsigned long, n * longs);

    if (!le) {
        return -ENOMEM;
    }
    bitmap_to_le(le, s->alloc_disk + first * longs,
                 n * HYBRID_BITMAP_SECTOR_BITS);
    return bdrv_co_pwrite(s->bs->file, base + first * BDRV_SECTOR_SIZE,
                          n * BDRV_SECTOR_SIZE, le, 0);
}

/*
 * After the RAM tier was written back (@ret its result): make the data
 * durable, then record the bits taken at flush_begin.  On failure they
 * stay owed to the next flush.
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_flush_end(BDRVHybridState *s, GArray *snap, int ret)
{
    if (!snap) {
        return ret;
    }
    if (ret == 0) {
        ret = bdrv_co_flush(s->bs->file->bs);
    }
    if (ret == 0) {
        g_array_sort(snap, cmp_u64);
        for (guint i = 0; i < snap->len; i++) {
            set_bit(g_array_index(snap, uint64_t, i), s->alloc_disk);
        }
        ret = hybrid_backing_write_bitmap(s, snap);
    }
    trace_hybrid_backing_flush(s, snap->len, ret);
    if (ret < 0) {
        g_array_append_vals(s->alloc_new, snap->data, snap->len);
    }
    g_array_free(snap, true);
    return ret;
}

/* ---- resize ---- */

/*
 * The disk grows from @old_nb to @new_nb whole blocks, which the caller
 * made read as zeros in the persistent tier.  They belong to the image: a
 * backing image longer than the old disk must not show through there
 * (the block layer's BDRV_REQ_ZERO_WRITE).  Their bits reach the on-disk
 * bitmap, after the tier is flushed and flushed themselves, before the
 * caller writes the new size: a crash before that leaves bits past the
 * disk's end, which are ignored.
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_backing_grow(BDRVHybridState *s, uint64_t old_nb, uint64_t new_nb,
                    Error **errp)
{
    int ret;

    assert(new_nb <= s->header.bitmap_blocks);     /* checked by the caller */
    ret = hybrid_backing_widen(s, ROUND_UP(new_nb, HYBRID_BITMAP_SECTOR_BITS));
    if (ret < 0) {
        error_setg(errp, "Could not allocate the allocation bitmap");
        return ret;
    }
    ret = bdrv_co_flush(s->bs->file->bs);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not flush the persistent tier");
        return ret;
    }
    bitmap_set(s->alloc, old_nb, new_nb - old_nb);
    bitmap_set(s->alloc_disk, old_nb, new_nb - old_nb);
    ret = hybrid_backing_write_sectors(s, s->header.bitmap_offset,
                                       old_nb / HYBRID_BITMAP_SECTOR_BITS,
                                       (new_nb - 1) / HYBRID_BITMAP_SECTOR_BITS);
    if (ret == 0) {
        ret = bdrv_co_flush(s->bs->file->bs);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not write the allocation bitmap");
    }
    return ret;
}

/* ---- rebase ---- */

/*
 * Give an image created without a backing file its extension, with every
 * block allocated (it holds them all): the bitmap (flushed) first, then
 * the header with BACKING and an empty name, so a crash leaves the old
 * image.  The room is what the layout left before data_offset.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_backing_add_bitmap(BDRVHybridState *s)
{
    HybridHeader h = s->header;
    uint64_t bits = ROUND_UP(MAX(s->nb_blocks, 1), HYBRID_BITMAP_SECTOR_BITS);
    int ret;

    if (s->data_offset < HYBRID_BITMAP_OFFSET + hybrid_bitmap_bytes(bits)) {
        return -ENOSPC;
    }
    hybrid_backing_extension(&h);
    h.backing_name_len = 0;
    h.backing_fmt_len = 0;
    h.backing_name_offset = HYBRID_BACKING_SLOT_B;
    h.backing_name_crc = crc32c(0xffffffff, NULL, 0);
    if (hybrid_backing_check_header(&h, NULL) < 0) {
        return -ENOTSUP;
    }
    if (hybrid_backing_alloc_bitmaps(s, NULL) < 0) {
        return -ENOMEM;
    }
    bitmap_set(s->alloc, 0, s->nb_blocks);
    bitmap_copy(s->alloc_disk, s->alloc, s->alloc_bits);
    /* The rest of the capacity is zero already (created so) */
    ret = hybrid_backing_write_sectors(s, HYBRID_BITMAP_OFFSET, 0,
                                       bits / HYBRID_BITMAP_SECTOR_BITS - 1);
    if (ret == 0) {
        ret = bdrv_co_flush(s->bs->file->bs);
    }
    if (ret < 0) {
        goto fail;
    }
    WITH_QEMU_LOCK_GUARD(&s->header_lock) {
        HybridHeader old = s->header;

        h.flags = s->header.flags;
        s->header = h;
        ret = hybrid_write_header(s, s->header.flags);
        if (ret < 0) {
            s->header = old;
        }
    }
    if (ret == 0) {
        return 0;
    }
fail:
    hybrid_backing_close(s);
    return ret;
}

/*
 * Write the new name into the slot the header does not use, flush, then
 * point the header at it (docs/hybrid-format.rst, "Backing file").
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_co_change_backing_file(BlockDriverState *bs, const char *backing_file,
                              const char *backing_fmt)
{
    BDRVHybridState *s = bs->opaque;
    HybridHeader old;
    size_t n = backing_file ? strlen(backing_file) : 0;
    size_t f = backing_fmt ? strlen(backing_fmt) : 0;
    g_autofree char *slot = NULL;
    uint64_t off;
    int ret;

    if (s->raw) {
        return n ? -ENOTSUP : 0;
    }
    if (n > HYBRID_MAX_BACKING_NAME || f > HYBRID_MAX_BACKING_FMT) {
        return -EINVAL;
    }
    if (!(s->header.incompat_features & HYBRID_INCOMPAT_BACKING)) {
        if (!n) {
            return 0;
        }
        ret = hybrid_backing_add_bitmap(s);
        if (ret < 0) {
            return ret;
        }
    }
    off = s->header.backing_name_offset == HYBRID_BACKING_SLOT_A ?
          HYBRID_BACKING_SLOT_B : HYBRID_BACKING_SLOT_A;
    if (off + HYBRID_BACKING_SLOT_SIZE > s->header.bitmap_offset) {
        return -ENOTSUP;
    }
    slot = g_strconcat(backing_file ?: "", backing_fmt ?: "", NULL);
    ret = bdrv_co_pwrite(bs->file, off, n + f, slot, 0);
    if (ret == 0) {
        ret = bdrv_co_flush(bs->file->bs);
    }
    if (ret < 0) {
        return ret;
    }
    old = s->header;
    WITH_QEMU_LOCK_GUARD(&s->header_lock) {
        s->header.backing_name_offset = off;
        s->header.backing_name_len = n;
        s->header.backing_fmt_len = f;
        s->header.backing_name_crc = crc32c(0xffffffff, (uint8_t *)slot,
                                            n + f);
        ret = hybrid_write_header(s, s->header.flags);
        if (ret < 0) {
            s->header.backing_name_offset = old.backing_name_offset;
            s->header.backing_name_len = old.backing_name_len;
            s->header.backing_fmt_len = old.backing_fmt_len;
            s->header.backing_name_crc = old.backing_name_crc;
        }
    }
    trace_hybrid_backing_change(s, backing_file ?: "", ret);
    return ret;
}
