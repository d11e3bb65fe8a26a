/*
 * Hybrid block format: the RAM tier's dirty blocks mirrored on another host
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * With mirror=NODE (typically an NBD export, with TLS, of a memory broker
 * region on another host) every block the RAM tier holds dirty in async
 * mode has a copy in NODE, laid out as a RAM region (hybrid-region.c)
 * whose header carries HYBRID_REGION_F_MIRROR: there a block counts only
 * when it is both valid and dirty.  An async write completes once the RAM
 * tier and the mirror hold it, so a host that dies loses no acknowledged
 * write: on the mirror's host, the image opened with the mirror's region
 * as its ram-file takes the counted blocks and writes them back.
 *
 *   block mirrored (counted):  write the request's bytes to its copy
 *   not mirrored:              write the whole block, then set its valid
 *                              and dirty bits (two sectors in parallel; a
 *                              crash between leaves one bit: not counted)
 *   written back + tier flush: no longer mirrored, valid bit cleared
 *
 * The bitmaps are written as sectors of the node's copy (mirror_bits), one
 * request at a time per sector, so the mirror never sees a sector go back
 * to an older state.  A mirror write that fails leaves the node degraded:
 * async writes then complete as in sync mode, the flusher writes back
 * everything, and the failed mirror leaves the graph (main-loop bottom
 * half); hybrid-set-mirror gives the node a new one, filled with the dirty
 * blocks.  docs/hybrid-format.rst has the whole crash story.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qapi/qapi-events-block-core.h"
#include "qemu/bitmap.h"
#include "qemu/error-report.h"
#include "qemu/memalign.h"
#include "qemu/units.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

/*
 * Bitmap bytes per request.  A block's first write to the mirror waits for
 * two of them (its valid and dirty bits, in parallel) after its data: at
 * 512 bytes they cost a 4 KiB write a seventh of its bytes on the link, not
 * twice as many again (4096).
 */
#define HYBRID_MIRROR_SECTOR    512

/* Bytes per prefill request: data, and zero blocks (no data sent) */
#define HYBRID_MIRROR_PREFILL       (1 * MiB)
#define HYBRID_MIRROR_PREFILL_ZERO  (64 * MiB)

static void mirror_detach_bh(void *opaque);

static unsigned long *mirror_valid(BDRVHybridState *s)
{
    return s->mirror_bits;
}

static unsigned long *mirror_dirty(BDRVHybridState *s)
{
    return s->mirror_bits + BITS_TO_LONGS(s->ram_blocks);
}

static uint64_t mirror_data_offset(BDRVHybridState *s)
{
    return hybrid_region_data_offset(s->ram_blocks);
}

/* The sector of the node's copy that holds block @idx's bit in bitmap
 * @which (0: valid, 1: dirty) */
static uint32_t mirror_sector(BDRVHybridState *s, int which, uint64_t idx)
{
    uint64_t byte = which * s->mirror_bitmap_bytes +
                    BIT_WORD(idx) * sizeof(unsigned long);

    return byte / HYBRID_MIRROR_SECTOR;
}

static const char *mirror_name(BDRVHybridState *s)
{
    return s->mirror_name;
}

/*
 * The mirror failed: from now on async writes complete as in sync mode
 * and everything dirty is written back (hybrid_may_defer_write).  Sticky;
 * the first error is kept and reported.
 */
static int mirror_fail(BDRVHybridState *s, int ret)
{
    if (ret < 0 && !s->mirror_error) {
        s->mirror_error = ret;
        trace_hybrid_mirror_failed(s, ret);
        error_report("hybrid: node '%s': mirror '%s' failed (%s); writes now "
                     "complete once the persistent tier holds them",
                     bdrv_get_node_name(s->bs), mirror_name(s), strerror(-ret));
        qapi_event_send_hybrid_mirror_degraded(bdrv_get_node_name(s->bs),
                                               mirror_name(s), strerror(-ret));
        s->writeback_drain = true;
        hybrid_flusher_kick(s);
        qemu_co_queue_restart_all(&s->mirror_queue);
        qemu_bh_schedule(s->mirror_detach_bh);
    }
    return ret;
}

/*
 * Until the mirror holds sector @sec of the node's copy as it is now: one
 * write of a sector at a time, each carrying every change made before it
 * started, so later changes coalesce into the next write.
 */
static int coroutine_fn GRAPH_RDLOCK mirror_commit(BDRVHybridState *s,
                                                   uint32_t sec)
{
    HybridMirrorSector *m = &s->mirror_sectors[sec];
    uint64_t want = m->gen;
    uint64_t off = (uint64_t)sec * HYBRID_MIRROR_SECTOR;
    uint64_t len = MIN(HYBRID_MIRROR_SECTOR, 2 * s->mirror_bitmap_bytes - off);

    while (m->done < want) {
        uint64_t gen;
        uint8_t *buf;
        int ret;

        if (s->mirror_error) {
            return s->mirror_error;
        }
        if (m->busy) {
            qemu_co_queue_wait(&s->mirror_queue, NULL);
            continue;
        }
        m->busy = true;
        gen = m->gen;
        buf = qemu_blockalign(s->mirror->bs, len);
        memcpy(buf, (uint8_t *)s->mirror_bits + off, len);
        ret = bdrv_co_pwrite(s->mirror, HYBRID_REGION_BITMAPS + off, len, buf, 0);
        qemu_vfree(buf);
        m->busy = false;
        if (ret == 0) {
            m->done = MAX(m->done, gen);
        }
        qemu_co_queue_restart_all(&s->mirror_queue);
        if (ret < 0) {
            return mirror_fail(s, ret);
        }
    }
    return 0;
}

/*
 * Bytes of a guest write to the mirror's copy, at @off: from @qiov, or
 * zeroes when it is NULL
 */
static int coroutine_fn GRAPH_RDLOCK
mirror_put_bytes(BDRVHybridState *s, uint64_t off, uint32_t len,
                 QEMUIOVector *qiov, size_t qoff)
{
    s->mirror_bytes += len;
    return qiov ? bdrv_co_pwritev_part(s->mirror, off, len, qiov, qoff, 0)
                : bdrv_co_pwrite_zeroes(s->mirror, off, len, 0);
}

/*
 * One mirror request made beside the caller's own, in a coroutine of its
 * own: a bitmap sector (mirror_commit of @sec) or, with @bytes, a write's
 * bytes (mirror_put_bytes).
 */
typedef struct MirrorSideCo {
    BDRVHybridState *s;
    bool bytes;
    uint32_t sec;
    uint64_t off;
    uint32_t len;
    QEMUIOVector *qiov;
    size_t qoff;
    int ret;
    bool done;
    Coroutine *waiter;
} MirrorSideCo;

static void coroutine_fn mirror_side_entry(void *opaque)
{
    MirrorSideCo *c = opaque;

    GRAPH_RDLOCK_GUARD();
    c->ret = c->bytes ? mirror_put_bytes(c->s, c->off, c->len, c->qiov, c->qoff)
                      : mirror_commit(c->s, c->sec);
    c->done = true;
    if (c->waiter) {
        aio_co_wake(c->waiter);
    }
}

static void mirror_side_start(MirrorSideCo *c)
{
    aio_co_enter(bdrv_get_aio_context(c->s->bs),
                 qemu_coroutine_create(mirror_side_entry, c));
}

static int coroutine_fn mirror_side_join(MirrorSideCo *c)
{
    while (!c->done) {
        c->waiter = qemu_coroutine_self();
        qemu_coroutine_yield();
    }
    return c->ret;
}

/* Sectors @a and @b to the mirror, both in flight at once */
static int coroutine_fn GRAPH_RDLOCK mirror_commit2(BDRVHybridState *s,
                                                    uint32_t a, uint32_t b)
{
    MirrorSideCo c = { .s = s, .sec = b };
    int ret, ret2;

    if (a == b) {
        return mirror_commit(s, a);
    }
    mirror_side_start(&c);
    ret = mirror_commit(s, a);
    ret2 = mirror_side_join(&c);
    return ret < 0 ? ret : ret2;
}

/* Block @idx's copy in the mirror: the whole block as the RAM tier has it */
static int coroutine_fn GRAPH_RDLOCK mirror_put_block(BDRVHybridState *s,
                                                      uint64_t idx)
{
    const uint8_t *p = hybrid_ram_peek(s, idx);
    uint64_t off = mirror_data_offset(s) + (idx << s->block_shift);
    uint32_t len = hybrid_block_len(s, idx);

    s->mirror_block_writes++;
    s->mirror_bytes += len;
    if (!p) {
        return bdrv_co_pwrite_zeroes(s->mirror, off, len, 0);
    }
    return bdrv_co_pwrite(s->mirror, off, len, p, 0);
}

/* Count block @idx in the mirror (its copy is complete there) */
static int coroutine_fn GRAPH_RDLOCK mirror_mark(BDRVHybridState *s,
                                                 uint64_t idx)
{
    uint32_t a = mirror_sector(s, 0, idx), b = mirror_sector(s, 1, idx);
    int ret;

    if (!test_and_set_bit(idx, mirror_valid(s))) {
        s->mirror_sectors[a].gen++;
    }
    if (!test_and_set_bit(idx, mirror_dirty(s))) {
        s->mirror_sectors[b].gen++;
    }
    ret = mirror_commit2(s, a, b);
    if (ret == 0) {
        s->slots[idx].flags |= HYBRID_SLOT_MIRRORED;
        s->mirror_counted++;
    }
    return ret;
}

/* Block @idx whole into the mirror, then counted there */
static int coroutine_fn GRAPH_RDLOCK mirror_put_counted(BDRVHybridState *s,
                                                        uint64_t idx)
{
    int ret = mirror_put_block(s, idx);

    return ret < 0 ? ret : mirror_mark(s, idx);
}

/* Block @idx's copy in the mirror is no longer known to be the tier's */
static void mirror_unmatch(BDRVHybridState *s, HybridSlot *slot)
{
    if (slot->flags & HYBRID_SLOT_MATCHED) {
        slot->flags &= ~HYBRID_SLOT_MATCHED;
        s->mirror_matched--;
    }
}

/*
 * First write of block @idx since its copy in the mirror was found to be
 * the persistent tier's (MATCHED): the request's bytes and the block's
 * bits go at once, one round trip.  A crash that lands the bits without
 * the bytes leaves a counted copy equal to the persistent tier's block:
 * written back at a failover, it changes nothing (and the write was not
 * acknowledged).
 */
static int coroutine_fn GRAPH_RDLOCK
mirror_put_matched(BDRVHybridState *s, uint64_t idx, uint64_t off,
                   uint32_t len, QEMUIOVector *qiov, size_t qoff)
{
    MirrorSideCo c = { .s = s, .bytes = true, .off = off, .len = len,
                       .qiov = qiov, .qoff = qoff };
    int ret, ret2;

    mirror_unmatch(s, &s->slots[idx]);
    s->mirror_matched_writes++;
    mirror_side_start(&c);
    ret = mirror_mark(s, idx);
    ret2 = mirror_side_join(&c);
    return ret < 0 ? ret : ret2;
}

/*
 * Put the async write of [boff, boff + len) of block @idx, which the RAM
 * tier took, in the mirror too; the write completes when this returns 0.
 * A counted block takes the request's bytes; a MATCHED one its bytes and
 * its bits at once; any other goes whole (the caller holds its BUSY, so no
 * older copy of it can land after a newer one), then its bits.  On
 * failure the node is degraded and the caller completes the write as in
 * sync mode.
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_mirror_write(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                    uint32_t len, QEMUIOVector *qiov, size_t qoff)
{
    HybridSlot *slot = &s->slots[idx];
    uint64_t off = mirror_data_offset(s) + (idx << s->block_shift) + boff;
    const char *how;
    int ret;

    if (!hybrid_mirror_active(s)) {
        return s->mirror_error;
    }
    if (slot->flags & HYBRID_SLOT_MIRRORED) {
        how = "bytes";
        s->mirror_writes++;
        ret = mirror_put_bytes(s, off, len, qiov, qoff);
    } else if (slot->flags & HYBRID_SLOT_MATCHED) {
        assert(slot->flags & HYBRID_SLOT_BUSY);
        how = "matched";
        s->mirror_writes++;
        ret = mirror_put_matched(s, idx, off, len, qiov, qoff);
    } else {
        assert(slot->flags & HYBRID_SLOT_BUSY);
        how = "whole";
        ret = mirror_put_counted(s, idx);
    }
    trace_hybrid_mirror_write(s, idx, boff, len, how, ret);
    return mirror_fail(s, ret);
}

/*
 * A write of block @idx that goes to the persistent tier itself (sync
 * mode, a write-back error pending) while the mirror serves: a counted
 * copy takes the bytes too (a failover would write an older one back over
 * them), a MATCHED one no longer is.  Returns as hybrid_mirror_write().
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_mirror_write_through(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                            uint32_t len, QEMUIOVector *qiov, size_t qoff)
{
    HybridSlot *slot = &s->slots[idx];

    if (!hybrid_mirror_active(s)) {
        return 0;
    }
    mirror_unmatch(s, slot);
    if (!(slot->flags & HYBRID_SLOT_MIRRORED)) {
        return 0;
    }
    return hybrid_mirror_write(s, idx, boff, len, qiov, qoff);
}

/* Block @idx was written back: uncount it after the next tier flush */
void hybrid_mirror_written_back(BDRVHybridState *s, uint64_t idx)
{
    if (s->mirror && (s->slots[idx].flags & HYBRID_SLOT_MIRRORED)) {
        set_bit(idx, s->mirror_written_back);
    }
}

/*
 * Blocks written back stop counting in the mirror once the persistent
 * tier is flushed (a completed write can still be in its cache, which a
 * dead host loses), unless written again meanwhile: the node first, so
 * that a new write sends the whole block again, then the valid bits.
 * Called when a write-back burst ends and after a guest flush.
 */
void coroutine_fn GRAPH_RDLOCK hybrid_mirror_clean(BDRVHybridState *s)
{
    g_autofree unsigned long *todo = NULL;
    g_autofree unsigned long *touched = NULL;
    uint64_t idx, n = 0;
    int ret;

    if (!hybrid_mirror_active(s) || s->mirror_cleaning ||
        find_first_bit(s->mirror_written_back, s->ram_blocks) >=
        s->ram_blocks) {
        return;
    }
    s->mirror_cleaning = true;
    todo = bitmap_new(s->ram_blocks);
    bitmap_copy(todo, s->mirror_written_back, s->ram_blocks);
    bitmap_zero(s->mirror_written_back, s->ram_blocks);

    ret = bdrv_co_flush(s->bs->file->bs);
    if (ret < 0) {
        /* Stay counted; the flusher's own error handling reports it */
        bitmap_or(s->mirror_written_back, s->mirror_written_back, todo,
                  s->ram_blocks);
        s->mirror_cleaning = false;
        return;
    }
    touched = bitmap_new(s->mirror_nb_sectors);
    for (idx = find_first_bit(todo, s->ram_blocks); idx < s->ram_blocks;
         idx = find_next_bit(todo, s->ram_blocks, idx + 1)) {
        HybridSlot *slot = &s->slots[idx];

        if (!(slot->flags & HYBRID_SLOT_MIRRORED)) {
            continue;
        }
        if (slot->flags & HYBRID_SLOT_BUSY) {
            /* Being written: look again after the next burst */
            set_bit(idx, s->mirror_written_back);
            continue;
        }
        if (slot->flags & HYBRID_SLOT_DIRTY) {
            continue;   /* written again: its next write-back comes back */
        }
        /* Its copy there is what the tier holds now */
        slot->flags = (slot->flags & ~HYBRID_SLOT_MIRRORED) |
                      HYBRID_SLOT_MATCHED;
        s->mirror_counted--;
        s->mirror_matched++;
        clear_bit(idx, mirror_valid(s));
        s->mirror_sectors[mirror_sector(s, 0, idx)].gen++;
        set_bit(mirror_sector(s, 0, idx), touched);
        n++;
    }
    for (uint32_t sec = find_first_bit(touched, s->mirror_nb_sectors);
         sec < s->mirror_nb_sectors;
         sec = find_next_bit(touched, s->mirror_nb_sectors, sec + 1)) {
        if (mirror_commit(s, sec) < 0) {
            break;
        }
    }
    s->mirror_uncounted += n;
    trace_hybrid_mirror_clean(s, n, s->mirror_counted);
    s->mirror_cleaning = false;
}

/* ---- prefill ---- */

/* A clean block the RAM tier holds, its copy in the mirror unknown */
static bool mirror_prefillable(HybridSlot *slot)
{
    return (slot->flags & (HYBRID_SLOT_LOADED | HYBRID_SLOT_BUSY |
                           HYBRID_SLOT_DIRTY | HYBRID_SLOT_LISTED |
                           HYBRID_SLOT_MIRRORED | HYBRID_SLOT_MATCHED)) ==
           HYBRID_SLOT_LOADED;
}

/*
 * Copy clean blocks into the mirror in the background, so that it holds
 * what the persistent tier holds (MATCHED) and a block's first write
 * sends its valid bit with its bytes (their dirty bits are set here).  Runs of blocks under BUSY, as many
 * bytes per request as HYBRID_MIRROR_PREFILL (zero blocks as write-zeroes,
 * HYBRID_MIRROR_PREFILL_ZERO); one request at a time, so that guest
 * writes keep most of the link.  Stops when drained (the end of the
 * drained section starts it again).
 */
static void coroutine_fn GRAPH_RDLOCK mirror_prefill_run(BDRVHybridState *s)
{
    while (s->mirror_prefill_cursor < s->ram_blocks &&
           hybrid_mirror_active(s) && !s->quiesced && !s->inactive) {
        uint64_t first = s->mirror_prefill_cursor, n = 0, max, off, len;
        bool zero;
        int ret;

        if (!mirror_prefillable(&s->slots[first])) {
            s->mirror_prefill_cursor++;
            continue;
        }
        zero = !hybrid_ram_peek(s, first);
        max = MAX((zero ? HYBRID_MIRROR_PREFILL_ZERO : HYBRID_MIRROR_PREFILL) >>
                  s->block_shift, 1);
        while (n < max && first + n < s->ram_blocks &&
               mirror_prefillable(&s->slots[first + n]) &&
               !hybrid_ram_peek(s, first + n) == zero) {
            s->slots[first + n].flags |= HYBRID_SLOT_BUSY;
            n++;
        }
        s->mirror_prefill_cursor = first + n;
        off = mirror_data_offset(s) + (first << s->block_shift);
        len = MIN(n << s->block_shift, s->size - (first << s->block_shift));
        ret = zero ? bdrv_co_pwrite_zeroes(s->mirror, off, len, 0)
                   : bdrv_co_pwrite(s->mirror, off, len,
                                    hybrid_ram_plain_ptr(s, first), 0);
        trace_hybrid_mirror_prefill(s, first, n, zero, ret);
        if (!zero && ret == 0) {
            s->mirror_bytes += len;
        }
        for (uint64_t i = 0; i < n; i++) {
            HybridSlot *slot = &s->slots[first + i];

            /* Under BUSY the block stayed clean: its copy is the tier's */
            if (ret == 0) {
                slot->flags |= HYBRID_SLOT_MATCHED;
                s->mirror_matched++;
            }
            hybrid_slot_unlock(s, slot);
        }
        if (ret < 0) {
            mirror_fail(s, ret);
            break;
        }
        /*
         * Their dirty bits too (not counted while the valid bit is clear),
         * so that a first write has one bitmap sector to write, not two
         */
        for (uint64_t i = 0; i < n; i++) {
            if (!test_and_set_bit(first + i, mirror_dirty(s))) {
                s->mirror_sectors[mirror_sector(s, 1, first + i)].gen++;
            }
        }
        for (uint32_t sec = mirror_sector(s, 1, first);
             sec <= mirror_sector(s, 1, first + n - 1); sec++) {
            if (mirror_commit(s, sec) < 0) {
                return;
            }
        }
    }
}

static void coroutine_fn mirror_prefill_entry(void *opaque)
{
    BDRVHybridState *s = opaque;
    BlockDriverState *bs = s->bs;

    WITH_GRAPH_RDLOCK_GUARD() {
        mirror_prefill_run(s);
    }
    s->mirror_prefilling = false;
    if (s->mirror_prefill_cursor >= s->ram_blocks) {
        trace_hybrid_mirror_prefilled(s, s->mirror_matched);
    }
    bdrv_dec_in_flight(bs);
}

/*
 * Start the prefill (node's AioContext): with a mirror that serves, once
 * the restore has loaded the tier (blocks it has not loaded are not taken).
 */
void hybrid_mirror_prefill_kick(BDRVHybridState *s)
{
    if (!s->mirror_prefill || !hybrid_mirror_active(s) || s->mirror_prefilling ||
        s->mirror_prefill_cursor >= s->ram_blocks || s->quiesced ||
        s->inactive || bdrv_is_read_only(s->bs) ||
        (s->restore_enabled && !s->restore_done)) {
        return;
    }
    s->mirror_prefilling = true;
    bdrv_inc_in_flight(s->bs);
    aio_co_enter(bdrv_get_aio_context(s->bs),
                 qemu_coroutine_create(mirror_prefill_entry, s));
}

/*
 * A failed mirror keeps counting the blocks it held when it failed, with
 * the copies they had then: a failover on its host would write them over
 * whatever the persistent tier got since, and a write completed in
 * degraded mode goes there.  So no such write completes before the old
 * mirror is retired: every dirty block written back, the tier flushed,
 * then the image's binding cleared (token 0, REGION off, flushed): from
 * then on the old mirror is refused as a stale region is, and until then
 * it still holds every write acknowledged before the failure.  One
 * retirement per failure; writers wait for it.  A failure is returned to
 * the writer (the persistent tier's error) and the next write tries again.
 */
int coroutine_fn GRAPH_RDLOCK hybrid_mirror_retire(BDRVHybridState *s)
{
    int ret;

    if (!s->mirror_name || !s->mirror_error || s->mirror_retired) {
        return 0;
    }
    if (s->mirror_retiring) {
        qemu_co_queue_wait(&s->mirror_retire_queue, NULL);
        return s->mirror_retired ? 0 : -EIO;
    }
    s->mirror_retiring = true;
    ret = hybrid_co_flush_to_os(s->bs);
    if (ret == 0) {
        ret = bdrv_co_flush(s->bs->file->bs);
    }
    if (ret == 0) {
        WITH_QEMU_LOCK_GUARD(&s->header_lock) {
            s->header.region_token = 0;
            s->header.incompat_features &= ~HYBRID_INCOMPAT_REGION;
            ret = hybrid_write_header(s, s->header.flags);
        }
    }
    s->mirror_retired = ret == 0;
    s->mirror_retiring = false;
    trace_hybrid_mirror_retired(s, ret);
    qemu_co_queue_restart_all(&s->mirror_retire_queue);
    return ret;
}

/*
 * The image was resized: the mirror's header follows (same blocks), or a
 * failover would find it laid out for another disk.
 */
void coroutine_fn GRAPH_RDLOCK hybrid_mirror_resized(BDRVHybridState *s)
{
    uint8_t *head;
    int ret;

    if (!hybrid_mirror_active(s)) {
        return;
    }
    head = qemu_blockalign0(s->mirror->bs, HYBRID_REGION_BITMAPS);
    hybrid_region_header_fill(s, head, s->header.region_token,
                              HYBRID_REGION_F_MIRROR);
    ret = bdrv_co_pwrite(s->mirror, 0, HYBRID_REGION_BITMAPS, head, 0);
    qemu_vfree(head);
    mirror_fail(s, ret);
}

/* ---- open, bind, close ---- */

/*
 * Can the node have the mirror @mbs (named @name)?  A plain RAM tier of an
 * image with a header and no backing file, read-write, and a mirror that
 * holds the tier.
 */
static int GRAPH_RDLOCK mirror_check(BDRVHybridState *s, BlockDriverState *mbs,
                                     bool writable, bool ram_file,
                                     Error **errp)
{
    const char *name = bdrv_get_node_name(mbs);
    uint64_t need;
    int64_t len;

    if (s->dedup || s->raw || s->alloc || ram_file) {
        error_setg(errp, "mirror needs a plain RAM tier in an image with a "
                   "header and no backing file, without ram-file (%s)",
                   s->dedup ? "dedup=on" : s->raw ? "raw=on" :
                   s->alloc ? "backing file" : "ram-file given");
        return -EINVAL;
    }
    if (s->data_offset < HYBRID_HEADER_SIZE_EXT) {
        error_setg(errp, "mirror needs %d header bytes before the data, the "
                   "image has %" PRIu64, HYBRID_HEADER_SIZE_EXT,
                   s->data_offset);
        return -EINVAL;
    }
    if (!writable) {
        error_setg(errp, "mirror needs a read-write node");
        return -EINVAL;
    }
    need = mirror_data_offset(s) + s->ram_blocks * s->block_size;
    len = bdrv_getlength(mbs);
    if (len < 0) {
        error_setg_errno(errp, -len, "Could not get the size of mirror '%s'",
                         name);
        return len;
    }
    if ((uint64_t)len < need) {
        error_setg(errp, "mirror '%s' has %" PRId64 " bytes; a RAM tier of %"
                   PRIu64 " blocks of %" PRIu32 " bytes needs %" PRIu64,
                   name, len, s->ram_blocks, s->block_size, need);
        return -ENOSPC;
    }
    return 0;
}

/* The node's copy of the mirror's bitmaps and the rest, once */
static void mirror_init_state(BDRVHybridState *s)
{
    if (s->mirror_bits) {
        return;
    }
    s->mirror_bitmap_bytes = hybrid_region_bitmap_bytes(s->ram_blocks);
    s->mirror_bits = g_malloc0(2 * s->mirror_bitmap_bytes);
    s->mirror_nb_sectors = DIV_ROUND_UP(2 * s->mirror_bitmap_bytes,
                                        HYBRID_MIRROR_SECTOR);
    s->mirror_sectors = g_new0(HybridMirrorSector, s->mirror_nb_sectors);
    s->mirror_written_back = bitmap_new(s->ram_blocks);
    qemu_co_queue_init(&s->mirror_queue);
    qemu_co_queue_init(&s->mirror_retire_queue);
    s->mirror_detach_bh = qemu_bh_new(mirror_detach_bh, s);
}

/*
 * Open the mirror child named by the mirror option, if any, and check that
 * it can hold the RAM tier; the binding is made by hybrid_mirror_attach().
 */
int GRAPH_RDLOCK hybrid_mirror_open(BDRVHybridState *s, QDict *options,
                                    bool writable, bool ram_file,
                                    Error **errp)
{
    ERRP_GUARD();
    int ret;

    GLOBAL_STATE_CODE();
    /*
     * Metadata to the block layer: written whatever the guest does (at
     * open, at write-back), and no one else may write it.
     */
    bdrv_graph_rdunlock_main_loop();
    s->mirror = bdrv_open_child(NULL, options, "mirror", s->bs, &child_of_bds,
                                BDRV_CHILD_METADATA, true, errp);
    bdrv_graph_rdlock_main_loop();
    if (*errp) {
        return -EINVAL;
    }
    if (!s->mirror) {
        return 0;
    }
    s->mirror_name = g_strdup(bdrv_get_node_name(s->mirror->bs));
    ret = mirror_check(s, s->mirror->bs, writable, ram_file, errp);
    if (ret < 0) {
        return ret;
    }
    mirror_init_state(s);
    return 0;
}

/*
 * Take the blocks a current mirror holds (a QEMU that died on this host)
 * into the RAM tier, dirty: they are written back at once and stay counted.
 * @bits: the mirror's valid and dirty bitmaps as read.
 */
static int GRAPH_RDLOCK mirror_recover(BDRVHybridState *s,
                                       const unsigned long *bits,
                                       Error **errp)
{
    const unsigned long *valid = bits, *dirty = bits + BITS_TO_LONGS(s->ram_blocks);
    uint8_t *buf;
    uint64_t idx;
    int ret;

    for (idx = 0; idx < s->ram_blocks; idx++) {
        HybridSlot *slot = &s->slots[idx];

        if (!test_bit(idx, valid) || !test_bit(idx, dirty)) {
            continue;
        }
        ret = bdrv_pread(s->mirror, mirror_data_offset(s) +
                         (idx << s->block_shift), hybrid_block_len(s, idx),
                         hybrid_ram_plain_ptr(s, idx), 0);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not read block %" PRIu64
                             " from mirror '%s'", idx, mirror_name(s));
            return ret;
        }
        hybrid_ram_loaded_plain(s, idx);
        hybrid_slot_set_dirty(s, slot, 0, hybrid_block_len(s, idx));
        slot->flags |= HYBRID_SLOT_MIRRORED;
        set_bit(idx, mirror_valid(s));
        set_bit(idx, mirror_dirty(s));
        s->mirror_counted++;
    }
    s->mirror_dirty_found = s->mirror_counted;
    if (s->mirror_counted) {
        s->writeback_drain = true;
    }
    /*
     * The mirror's bitmaps as the node's copy now says: stale valid bits
     * and the zero bitmap (a region that served a failover sets it) gone,
     * then the header marks it a mirror, whatever it was.
     */
    buf = g_malloc0(3 * s->mirror_bitmap_bytes);
    memcpy(buf, s->mirror_bits, 2 * s->mirror_bitmap_bytes);
    ret = bdrv_pwrite(s->mirror, HYBRID_REGION_BITMAPS,
                      3 * s->mirror_bitmap_bytes, buf, 0);
    g_free(buf);
    if (ret == 0) {
        uint8_t head[HYBRID_REGION_BITMAPS] = { 0 };

        hybrid_region_header_fill(s, head, s->header.region_token,
                                  HYBRID_REGION_F_MIRROR);
        ret = bdrv_pwrite(s->mirror, 0, sizeof(head), head, 0);
    }
    if (ret == 0) {
        ret = bdrv_flush(s->mirror->bs);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not write mirror '%s'",
                         mirror_name(s));
    }
    return ret;
}

/* The node's copy of the mirror's state: nothing counted yet */
static void mirror_forget(BDRVHybridState *s)
{
    memset(s->mirror_bits, 0, 2 * s->mirror_bitmap_bytes);
    memset(s->mirror_sectors, 0,
           s->mirror_nb_sectors * sizeof(*s->mirror_sectors));
    bitmap_zero(s->mirror_written_back, s->ram_blocks);
    for (uint64_t idx = 0; idx < s->ram_blocks; idx++) {
        s->slots[idx].flags &= ~(HYBRID_SLOT_MIRRORED | HYBRID_SLOT_MATCHED);
    }
    s->mirror_counted = 0;
    s->mirror_matched = 0;
    s->mirror_prefill_cursor = 0;
    s->mirror_recovered = false;
    s->mirror_dirty_found = 0;
}

/*
 * What the mirror holds: its first HYBRID_REGION_BITMAPS bytes and its
 * bitmaps into *@head (g_free), whether it is a region of ours (@look
 * filled), and its blocks not yet written back.
 */
static int GRAPH_RDLOCK mirror_look(BDRVHybridState *s, const char *what,
                                    uint8_t **head, HybridRegionLook *look,
                                    bool *ok, uint64_t *dirty, Error **errp)
{
    int64_t len = bdrv_getlength(s->mirror->bs);
    uint64_t bytes;
    int ret;

    *head = g_malloc0(HYBRID_REGION_BITMAPS);
    *dirty = 0;
    ret = bdrv_pread(s->mirror, 0, HYBRID_REGION_BITMAPS, *head, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not read %s", what);
        return ret;
    }
    *ok = hybrid_region_header_parse(s, *head, len, look);
    if (!*ok) {
        return 0;
    }
    /* Laid out for its own number of blocks, which may not be ours */
    bytes = 2 * hybrid_region_bitmap_bytes(look->blocks);
    *head = g_realloc(*head, HYBRID_REGION_BITMAPS + bytes);
    ret = bdrv_pread(s->mirror, HYBRID_REGION_BITMAPS, bytes,
                     *head + HYBRID_REGION_BITMAPS, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not read %s", what);
        return ret;
    }
    *dirty = hybrid_region_count_dirty(*head + HYBRID_REGION_BITMAPS,
                                       look->blocks);
    return 0;
}

/* Empty the mirror (header first: a crash leaves it unused), bind it */
static int GRAPH_RDLOCK mirror_reset(BDRVHybridState *s, const char *what,
                                     Error **errp)
{
    uint8_t head[HYBRID_REGION_BITMAPS] = { 0 };
    uint64_t token;
    int ret;

    ret = bdrv_pwrite_zeroes(s->mirror, 0, mirror_data_offset(s), 0);
    if (ret == 0) {
        ret = bdrv_flush(s->mirror->bs);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not reset %s", what);
        return ret;
    }
    token = hybrid_region_bind(s, what, errp);
    if (!token) {
        return -EIO;
    }
    hybrid_region_header_fill(s, head, token, HYBRID_REGION_F_MIRROR);
    ret = bdrv_pwrite(s->mirror, 0, sizeof(head), head, 0);
    if (ret == 0) {
        ret = bdrv_flush(s->mirror->bs);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not write the header of %s", what);
        return ret;
    }
    trace_hybrid_mirror_attach(s, false, 0, token);
    return 0;
}

/*
 * Bind the mirror to the image (main loop, node active and read-write,
 * RAM tier empty), as a region is bound (hybrid_region_judge): a mirror
 * current for this image gives its blocks back (a QEMU that died on this
 * host); otherwise it is emptied, bound with a new token and marked a
 * mirror.  @reset_only: the persistent tier was written elsewhere (an
 * incoming migration).
 */
int GRAPH_RDLOCK hybrid_mirror_attach(BDRVHybridState *s, bool reset_only,
                                      Error **errp)
{
    g_autofree char *what = g_strdup_printf("mirror '%s'", mirror_name(s));
    g_autofree uint8_t *head = NULL;
    HybridRegionLook look;
    uint64_t dirty;
    bool ok;
    int ret;

    mirror_forget(s);
    ret = mirror_look(s, what, &head, &look, &ok, &dirty, errp);
    if (ret < 0) {
        return ret;
    }
    ret = hybrid_region_judge(s, what, ok ? &look : NULL, dirty, reset_only,
                              errp);
    if (ret < 0) {
        return ret;
    }
    if (ret == 0) {
        return mirror_reset(s, what, errp);
    }
    ret = mirror_recover(s, (unsigned long *)(head + HYBRID_REGION_BITMAPS),
                         errp);
    if (ret == 0) {
        s->mirror_recovered = true;
        trace_hybrid_mirror_attach(s, true, s->mirror_dirty_found, look.token);
    }
    return ret;
}

/*
 * May a node that serves take the mirror s->mirror (named @name) as a new
 * one (hybrid-set-mirror)?  Its RAM tier holds the newest data, so what
 * the mirror has is dropped, unless it is another image's unwritten
 * blocks.  Reads only.
 */
static int GRAPH_RDLOCK mirror_may_take(BDRVHybridState *s, const char *name,
                                        Error **errp)
{
    g_autofree char *what = g_strdup_printf("mirror '%s'", name);
    g_autofree uint8_t *head = NULL;
    HybridRegionLook look;
    uint64_t dirty;
    bool ok;
    int ret;

    ret = mirror_look(s, what, &head, &look, &ok, &dirty, errp);
    if (ret < 0) {
        return ret;
    }
    if (ok && dirty && look.token != s->header.region_token) {
        error_setg(errp, "%s holds %" PRIu64 " blocks not yet written back "
                   "to another image (region token %016" PRIx64 "); "
                   "refusing to overwrite them", what, dirty, look.token);
        return -EBUSY;
    }
    return 0;
}

/* Bind a new mirror to a node that serves (hybrid-set-mirror) */
static int GRAPH_RDLOCK mirror_bind(BDRVHybridState *s, Error **errp)
{
    g_autofree char *what = g_strdup_printf("mirror '%s'", mirror_name(s));
    int ret;

    mirror_forget(s);
    ret = mirror_reset(s, what, errp);
    if (ret == 0 && s->header_dirty_on_disk) {
        /*
         * The binding cleared REGION, which the first write of an open
         * sets (hybrid_mark_dirty): this open wrote already, and the
         * mirror is about to hold acknowledged writes.
         */
        HybridHeader le;

        s->header.incompat_features |= HYBRID_INCOMPAT_REGION;
        hybrid_header_to_le(&s->header, &le);
        ret = bdrv_pwrite(s->bs->file, 0, s->header.header_size, &le, 0);
        if (ret == 0) {
            ret = bdrv_flush(s->bs->file->bs);
        }
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not mark the image held by %s",
                             what);
        }
    }
    return ret;
}

/* Fill a new mirror with the dirty blocks (coroutine, node drained) */
static int coroutine_fn GRAPH_RDLOCK mirror_fill(BDRVHybridState *s)
{
    for (uint64_t idx = 0; idx < s->ram_blocks; idx++) {
        int ret;

        if (!(s->slots[idx].flags & HYBRID_SLOT_DIRTY)) {
            continue;
        }
        ret = mirror_put_counted(s, idx);
        if (ret < 0) {
            return mirror_fail(s, ret);
        }
    }
    return 0;
}

typedef struct MirrorFillCo {
    BDRVHybridState *s;
    int ret;
    bool done;
} MirrorFillCo;

static void coroutine_fn mirror_fill_entry(void *opaque)
{
    MirrorFillCo *c = opaque;

    GRAPH_RDLOCK_GUARD();
    c->ret = mirror_fill(c->s);
    c->done = true;
    aio_wait_kick();
}

/*
 * hybrid-set-mirror: @mbs becomes the node's mirror (main loop), e.g. after
 * the one it had failed.  In a drained section, so that no write races
 * the filling: the mirror is attached, bound to the image (emptied, a new
 * token; one holding another image's unwritten blocks is refused) and
 * filled with the blocks dirty now; then async writes need it again.
 */
int hybrid_mirror_replace(BlockDriverState *bs, BlockDriverState *mbs,
                          Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    MirrorFillCo fill = { .s = s };
    BdrvChild *child;
    int ret;

    GLOBAL_STATE_CODE();
    if (s->mirror) {
        error_setg(errp, "node '%s' has a mirror, '%s'%s",
                   bdrv_get_node_name(bs), s->mirror_name,
                   s->mirror_error ? " (failed; try again in a moment)" : "");
        return -EBUSY;
    }
    bdrv_graph_rdlock_main_loop();
    ret = mirror_check(s, mbs, !bdrv_is_read_only(bs), s->ram_file, errp);
    bdrv_graph_rdunlock_main_loop();
    if (ret < 0) {
        return ret;
    }

    bdrv_drained_begin(bs);
    bdrv_graph_wrlock();
    bdrv_ref(mbs);
    child = bdrv_attach_child(bs, mbs, "mirror", &child_of_bds,
                              BDRV_CHILD_METADATA, errp);
    bdrv_graph_wrunlock();
    if (!child) {
        bdrv_drained_end(bs);
        return -EINVAL;
    }
    s->mirror = child;
    bdrv_graph_rdlock_main_loop();
    ret = mirror_may_take(s, bdrv_get_node_name(mbs), errp);
    bdrv_graph_rdunlock_main_loop();
    if (ret < 0) {
        /* Refused before anything changed: the node stays as it was */
        bdrv_graph_wrlock();
        bdrv_unref_child(bs, child);
        bdrv_graph_wrunlock();
        s->mirror = NULL;
        bdrv_drained_end(bs);
        return ret;
    }
    mirror_init_state(s);
    g_free(s->mirror_name);
    s->mirror_name = g_strdup(bdrv_get_node_name(mbs));
    s->mirror_error = 0;
    s->mirror_retired = false;
    /* query-hybrid's figures are this mirror's */
    s->mirror_writes = s->mirror_block_writes = s->mirror_bytes = 0;
    s->mirror_uncounted = s->mirror_matched_writes = 0;

    bdrv_graph_rdlock_main_loop();
    ret = mirror_bind(s, errp);
    bdrv_graph_rdunlock_main_loop();
    if (ret == 0) {
        aio_co_enter(bdrv_get_aio_context(bs),
                     qemu_coroutine_create(mirror_fill_entry, &fill));
        AIO_WAIT_WHILE_UNLOCKED(NULL, !fill.done);
        ret = fill.ret;
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not fill mirror '%s'",
                             s->mirror_name);
        }
    } else {
        mirror_fail(s, ret);
    }
    trace_hybrid_mirror_replaced(s, s->mirror_counted, ret);
    bdrv_drained_end(bs);
    return ret;
}

/*
 * A failed mirror leaves the graph (main loop): the block layer's flushes
 * go to every child that may be written, and a dead mirror's would fail
 * them all.  The node stays degraded: s->mirror_name still says it had one.
 */
void hybrid_mirror_detach(BDRVHybridState *s)
{
    BlockDriverState *bs = s->bs;

    GLOBAL_STATE_CODE();
    if (!s->mirror || !s->mirror_error) {
        return;
    }
    bdrv_drained_begin(bs);
    bdrv_graph_wrlock();
    bdrv_unref_child(bs, s->mirror);
    s->mirror = NULL;
    bdrv_graph_wrunlock();
    bdrv_drained_end(bs);
    trace_hybrid_mirror_detached(s);
}

static void mirror_detach_bh(void *opaque)
{
    BDRVHybridState *s = opaque;
    BlockDriverState *bs = s->bs;

    bdrv_ref(bs);
    hybrid_mirror_detach(s);
    bdrv_unref(bs);
}

void hybrid_mirror_close(BDRVHybridState *s)
{
    if (s->mirror_detach_bh) {
        qemu_bh_delete(s->mirror_detach_bh);
        s->mirror_detach_bh = NULL;
    }
    g_free(s->mirror_name);
    s->mirror_name = NULL;
    g_free(s->mirror_bits);
    g_free(s->mirror_sectors);
    g_free(s->mirror_written_back);
    s->mirror_bits = NULL;
    s->mirror_sectors = NULL;
    s->mirror_written_back = NULL;
}
