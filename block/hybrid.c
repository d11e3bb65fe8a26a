/*
 * Hybrid block format: a RAM tier in front of a persistent tier
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Blocks [0, ram_blocks) are held in RAM once restored (the static storage
 * boundary); all blocks always have their durable copy on the 'file' child,
 * block N at data_offset + N * block_size.  There is no metadata in the
 * write path, so the crash story is short:
 *
 *   sync:  a write completes when RAM and the child both hold it.
 *   async: a write completes in RAM; the flusher copies dirty spans to the
 *          child, least recently written block first; a guest flush writes
 *          every span that was dirty when it started, then flushes the child.
 *   The header's DIRTY flag is set (and flushed) before the first write of
 *   an open and cleared only after a complete flush at close/inactivate.
 *
 * Slot ownership ("BUSY"): whoever issues child I/O for a RAM block (sync
 * write, flusher, restore, load on write) holds BUSY across that I/O, so
 * child writes of one block never overtake each other and restore never
 * reads a block while it is being written.  RAM updates themselves never
 * yield and need no lock.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qapi/qapi-events-block-core.h"
#include "qobject/qdict.h"
#include "qemu/cutils.h"
#include "qemu/crc32c.h"
#include "qemu/iov.h"
#include "qemu/memalign.h"
#include "qemu/module.h"
#include "qemu/option.h"
#include "qemu/error-report.h"
#include "qemu/timer.h"
#include "qemu/units.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "system/block-backend.h"
#include "hybrid.h"
#include "visit-options.h"
#include "trace.h"

/* ---- slot ownership ---- */

void coroutine_fn hybrid_slot_lock(BDRVHybridState *s, HybridSlot *slot)
{
    while (slot->flags & HYBRID_SLOT_BUSY) {
        qemu_co_queue_wait(&s->busy_queue, NULL);
    }
    slot->flags |= HYBRID_SLOT_BUSY;
}

void coroutine_fn hybrid_slot_unlock(BDRVHybridState *s, HybridSlot *slot)
{
    assert(slot->flags & HYBRID_SLOT_BUSY);
    slot->flags &= ~HYBRID_SLOT_BUSY;
    qemu_co_queue_restart_all(&s->busy_queue);
}

/* ---- I/O ---- */

/*
 * Read block @idx's current content into @buf (block_size bytes): from the
 * persistent tier, or from the backing chain when the image does not hold
 * the block (the first write to it copies it).
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_read_block(BDRVHybridState *s, uint64_t idx, uint8_t *buf)
{
    if (!hybrid_block_allocated(s, idx)) {
        return hybrid_backing_read_block(s, idx, buf);
    }
    return bdrv_co_pread(s->bs->file,
                         hybrid_host_offset(s, idx << s->block_shift),
                         hybrid_block_len(s, idx), buf, 0);
}

/*
 * Make block @idx LOADED; the caller holds BUSY.  When the caller will
 * overwrite the whole block there is nothing to read.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_load_block(BDRVHybridState *s, uint64_t idx, bool overwrite)
{
    uint8_t *buf;
    int ret;

    if (overwrite) {
        return hybrid_ram_fill(s, idx, NULL);
    }
    if (!s->dedup) {
        buf = hybrid_ram_plain_ptr(s, idx);
        ret = hybrid_read_block(s, idx, buf);
        if (ret < 0) {
            return ret;
        }
        hybrid_ram_loaded_plain(s, idx);
        return 0;
    }
    buf = qemu_try_blockalign0(s->bs->file->bs, s->block_size);
    if (!buf) {
        return -ENOMEM;
    }
    ret = hybrid_read_block(s, idx, buf);
    if (ret == 0) {
        ret = hybrid_ram_fill(s, idx, buf);
    }
    qemu_vfree(buf);
    return ret;
}

/* A run of blocks not in RAM: from the child, or from the backing chain */
static int coroutine_fn GRAPH_RDLOCK
hybrid_read_run(BDRVHybridState *s, bool backing, int64_t offset,
                int64_t bytes, QEMUIOVector *qiov, size_t qoff)
{
    if (backing) {
        return hybrid_backing_read(s, offset, bytes, qiov, qoff);
    }
    return bdrv_co_preadv_part(s->bs->file, hybrid_host_offset(s, offset),
                               bytes, qiov, qoff, 0);
}

/*
 * Requests from another AioContext.  The node's state is single-threaded
 * by design: all of it is touched in the node's AioContext (hybrid.h).  A
 * multiqueue device (virtio-blk's iothread-vq-mapping) submits from several
 * iothreads, so such a request moves to the node's context for its
 * duration and back to its own to complete, as bdrv_co_enter() and
 * bdrv_co_leave() do for callers outside the block layer.  The generic
 * layer counts it in flight first, so the node cannot change context under
 * it.  A request already at home costs a comparison.
 */
AioContext *coroutine_fn hybrid_co_go_home(BlockDriverState *bs)
{
    AioContext *here = qemu_get_current_aio_context();
    AioContext *home = bdrv_get_aio_context(bs);

    if (here == home) {
        return NULL;
    }
    trace_hybrid_foreign_request(bs, here, home);
    aio_co_reschedule_self(home);
    return here;
}

void coroutine_fn hybrid_co_go_back(AioContext *from)
{
    if (from) {
        aio_co_reschedule_self(from);
    }
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_do_read(BlockDriverState *bs, int64_t offset, int64_t bytes,
               QEMUIOVector *qiov, size_t qiov_offset)
{
    BDRVHybridState *s = bs->opaque;
    int64_t child_start = -1, child_len = 0;
    size_t child_qoff = 0;
    bool child_backing = false;
    int64_t promote = -1;
    int ret;

    HYBRID_ASSERT_HOME(bs);
    while (bytes > 0) {
        uint64_t idx = offset >> s->block_shift;
        uint32_t boff = offset & (s->block_size - 1);
        uint32_t len = MIN(bytes, s->block_size - boff);
        HybridSlot *slot = hybrid_slot(s, idx);
        HybridHot *h = slot ? NULL : hybrid_hot_get(s, idx);

        if (h) {
            qemu_iovec_from_buf(qiov, qiov_offset, h->data + boff, len);
            s->read_hits++;
            goto next;
        }
        if (!slot && s->hot && promote < 0 &&
            hybrid_block_allocated(s, idx) && hybrid_heat(s, idx)) {
            promote = idx;
        }
        if (slot && (slot->flags & HYBRID_SLOT_LOADED)) {
            const uint8_t *p;

            if (child_len) {
                ret = hybrid_read_run(s, child_backing, child_start,
                                      child_len, qiov, child_qoff);
                if (ret < 0) {
                    return ret;
                }
                child_len = 0;
            }
            /* The read above may have yielded: look again */
            if (slot->flags & HYBRID_SLOT_LOADED) {
                p = hybrid_ram_peek(s, idx);
                if (p) {
                    qemu_iovec_from_buf(qiov, qiov_offset, p + boff, len);
                } else {
                    qemu_iovec_memset(qiov, qiov_offset, 0, len);
                }
                s->read_hits++;
                goto next;
            }
        }
        /*
         * Not in RAM: the child is authoritative for this block, or the
         * backing chain if the image does not hold it
         */
        s->read_misses++;
        trace_hybrid_read_miss(s, idx);
        if (child_len && child_start + child_len == offset &&
            child_backing == !hybrid_block_allocated(s, idx)) {
            child_len += len;
        } else {
            if (child_len) {
                ret = hybrid_read_run(s, child_backing, child_start,
                                      child_len, qiov, child_qoff);
                if (ret < 0) {
                    return ret;
                }
            }
            child_start = offset;
            child_len = len;
            child_qoff = qiov_offset;
            child_backing = !hybrid_block_allocated(s, idx);
        }
next:
        offset += len;
        bytes -= len;
        qiov_offset += len;
    }
    if (child_len) {
        ret = hybrid_read_run(s, child_backing, child_start, child_len, qiov,
                              child_qoff);
        if (ret < 0) {
            return ret;
        }
    }
    if (promote >= 0) {
        hybrid_promote(s, promote);
    }
    return 0;
}

/*
 * Write (or zero, when @qiov is NULL) the part [boff, boff + len) of block
 * @idx, which is below the RAM boundary.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_write_ram_block(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                       uint32_t len, QEMUIOVector *qiov, size_t qoff,
                       BdrvRequestFlags flags)
{
    HybridSlot *slot = &s->slots[idx];
    bool sync = !hybrid_may_defer_write(s, slot, boff, boff + len);
    bool mirror = !sync && hybrid_mirror_active(s);
    bool locked = false, cow;
    int ret = 0;

    /*
     * BUSY on a loaded block in async mode: its write-back is being made
     * from RAM (hybrid_writeback_run), which must not change under it.  A
     * block the mirror does not count yet goes to it whole: its writers
     * take turns (hybrid_mirror_write).
     */
    if (sync || (slot->flags & (HYBRID_SLOT_BUSY | HYBRID_SLOT_LOADED)) !=
                HYBRID_SLOT_LOADED ||
        (mirror && !(slot->flags & HYBRID_SLOT_MIRRORED))) {
        int64_t t0 = (slot->flags & HYBRID_SLOT_BUSY) ?
                     qemu_clock_get_ns(QEMU_CLOCK_REALTIME) : 0;

        hybrid_slot_lock(s, slot);
        locked = true;
        if (t0) {
            trace_hybrid_busy_waited(s, idx, qemu_clock_get_ns(
                                     QEMU_CLOCK_REALTIME) - t0);
        }
    }
    /*
     * A block the image does not hold is never LOADED (restore skips it),
     * so we hold BUSY: the load copies it from the backing chain and the
     * whole block is owed to the persistent tier.
     */
    cow = !(slot->flags & HYBRID_SLOT_LOADED) &&
          !hybrid_block_allocated(s, idx);
    if (!(slot->flags & HYBRID_SLOT_LOADED)) {
        ret = hybrid_load_block(s, idx, boff == 0 && len == s->block_size);
        trace_hybrid_load_on_write(s, idx, ret);
        if (ret < 0) {
            goto out;
        }
    }
    /* A region must say "dirty" before its copy changes (a crash between) */
    hybrid_region_set_dirty(s, idx);
    ret = hybrid_ram_write(s, idx, boff, qiov, qoff, len, !sync);
    if (ret < 0) {
        goto out;
    }
    hybrid_region_set_valid(s, idx);
    s->write_ram++;
    if (cow) {
        qiov = NULL;
        boff = 0;
        len = hybrid_block_len(s, idx);
    }

    if (sync) {
        uint64_t host = hybrid_host_offset(s, (idx << s->block_shift) + boff);
        const uint8_t *p = cow ? hybrid_ram_peek(s, idx) : NULL;

        /* A mirror that fails here degrades the node; the tier still */
        hybrid_mirror_write_through(s, idx, boff, len, qiov, qoff);
        if (p) {
            ret = bdrv_co_pwrite(s->bs->file, host, len, p, 0);
        } else if (qiov) {
            ret = bdrv_co_pwritev_part(s->bs->file, host, len, qiov, qoff, 0);
        } else {
            ret = bdrv_co_pwrite_zeroes(s->bs->file, host, len,
                                        flags & BDRV_REQ_MAY_UNMAP);
        }
        if (ret < 0) {
            /* RAM holds the new data: keep it owed to the child */
            hybrid_slot_set_dirty(s, slot, boff, boff + len);
        } else if (!(slot->flags & HYBRID_SLOT_DIRTY)) {
            hybrid_region_clear_dirty(s, idx);
        }
    } else {
        hybrid_slot_set_dirty(s, slot, boff, boff + len);
        if (mirror && hybrid_mirror_write(s, idx, boff, len, qiov, qoff) < 0) {
            /* Degraded: this write completes as in sync mode */
            uint64_t host = hybrid_host_offset(s, (idx << s->block_shift) + boff);

            ret = qiov ? bdrv_co_pwritev_part(s->bs->file, host, len, qiov,
                                              qoff, 0)
                       : bdrv_co_pwrite_zeroes(s->bs->file, host, len,
                                               flags & BDRV_REQ_MAY_UNMAP);
        }
    }
    /*
     * Only now: a flush that took the bit before the child write completed
     * could record it ahead of the data.  Dirty, the block is written back
     * by any flush that takes the bit.
     */
    if (cow) {
        hybrid_backing_set_allocated(s, idx);
    }
out:
    if (locked) {
        hybrid_slot_unlock(s, slot);
    }
    if (!sync) {
        hybrid_flusher_kick(s);
    }
    if (ret == 0 && s->mirror_name && s->mirror_error) {
        /* Degraded: not before the old mirror can no longer be replayed */
        ret = hybrid_mirror_retire(s);
    }
    return ret;
}

/* Write blocks beyond the RAM boundary that the image holds. */
int coroutine_fn GRAPH_RDLOCK
hybrid_write_through(BDRVHybridState *s, int64_t offset, int64_t bytes,
                     QEMUIOVector *qiov, size_t qoff, BdrvRequestFlags flags)
{
    int ret;

    s->write_through++;
    if (s->hot) {
        hybrid_hot_write(s, offset, bytes, qiov, qoff);
    }
    if (qiov) {
        ret = bdrv_co_pwritev_part(s->bs->file, hybrid_host_offset(s, offset),
                                   bytes, qiov, qoff, 0);
    } else {
        ret = bdrv_co_pwrite_zeroes(s->bs->file, hybrid_host_offset(s, offset),
                                    bytes, flags & BDRV_REQ_MAY_UNMAP);
    }
    if (ret < 0 && s->hot) {
        hybrid_hot_invalidate(s, offset, bytes);
    }
    return ret;
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_co_preadv_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                      QEMUIOVector *qiov, size_t qiov_offset,
                      BdrvRequestFlags flags)
{
    AioContext *from = hybrid_co_go_home(bs);
    int ret = hybrid_do_read(bs, offset, bytes, qiov, qiov_offset);

    hybrid_co_go_back(from);
    return ret;
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_do_write_home(BlockDriverState *bs, int64_t offset, int64_t bytes,
                     QEMUIOVector *qiov, size_t qiov_offset,
                     BdrvRequestFlags flags)
{
    BDRVHybridState *s = bs->opaque;
    int ret;

    HYBRID_ASSERT_HOME(bs);
    ret = hybrid_mark_dirty(s);
    if (ret < 0) {
        return ret;
    }
    while (bytes > 0) {
        uint64_t idx = offset >> s->block_shift;
        uint32_t boff = offset & (s->block_size - 1);
        uint32_t len;

        if (idx >= s->ram_blocks) {
            /* Beyond the RAM boundary: straight to the persistent tier */
            if (s->alloc) {
                return hybrid_backing_write_through(s, offset, bytes, qiov,
                                                    qiov_offset, flags);
            }
            return hybrid_write_through(s, offset, bytes, qiov, qiov_offset,
                                        flags);
        }
        len = MIN(bytes, s->block_size - boff);
        ret = hybrid_write_ram_block(s, idx, boff, len, qiov, qiov_offset,
                                     flags);
        if (ret < 0) {
            return ret;
        }
        offset += len;
        bytes -= len;
        qiov_offset += len;
    }
    return 0;
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_do_write(BlockDriverState *bs, int64_t offset, int64_t bytes,
                QEMUIOVector *qiov, size_t qiov_offset, BdrvRequestFlags flags)
{
    AioContext *from = hybrid_co_go_home(bs);
    int ret = hybrid_do_write_home(bs, offset, bytes, qiov, qiov_offset,
                                   flags);

    hybrid_co_go_back(from);
    return ret;
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_co_pwritev_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                       QEMUIOVector *qiov, size_t qiov_offset,
                       BdrvRequestFlags flags)
{
    return hybrid_do_write(bs, offset, bytes, qiov, qiov_offset, flags);
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_co_pwrite_zeroes(BlockDriverState *bs, int64_t offset, int64_t bytes,
                        BdrvRequestFlags flags)
{
    return hybrid_do_write(bs, offset, bytes, NULL, 0, flags);
}

/*
 * Discard reads back as zeros: the RAM tier and the persistent tier must
 * agree on what a discarded block holds, before and after a restart.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_co_pdiscard(BlockDriverState *bs, int64_t offset, int64_t bytes)
{
    return hybrid_do_write(bs, offset, bytes, NULL, 0, BDRV_REQ_MAY_UNMAP);
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_do_block_status(BlockDriverState *bs, int64_t offset, int64_t bytes,
                       int64_t *pnum, int64_t *map, BlockDriverState **file)
{
    BDRVHybridState *s = bs->opaque;
    uint64_t idx = offset >> s->block_shift;
    HybridSlot *slot = hybrid_slot(s, idx);

    if (!hybrid_block_allocated(s, idx)) {
        /* Not in the image: the block layer asks the backing chain */
        *pnum = hybrid_backing_unallocated_run(s, offset, bytes);
        return 0;
    }
    if (slot && (slot->flags & HYBRID_SLOT_LOADED) &&
        (slot->flags & (HYBRID_SLOT_DIRTY | HYBRID_SLOT_BUSY))) {
        /* Newer than the child: only RAM knows */
        *pnum = MIN(bytes, s->block_size - (offset & (s->block_size - 1)));
        return BDRV_BLOCK_DATA |
               (hybrid_ram_peek(s, idx) ? 0 : BDRV_BLOCK_ZERO);
    }
    /* Child and RAM agree here; extend over blocks that also agree */
    *pnum = 0;
    while (*pnum < bytes) {
        uint64_t i = (offset + *pnum) >> s->block_shift;
        HybridSlot *sl = hybrid_slot(s, i);
        int64_t n;

        if (!hybrid_block_allocated(s, i)) {
            break;
        }
        if (!sl && !s->alloc) {
            *pnum = bytes;
            break;
        }
        if (sl && (sl->flags & HYBRID_SLOT_LOADED) &&
            (sl->flags & (HYBRID_SLOT_DIRTY | HYBRID_SLOT_BUSY))) {
            break;
        }
        n = s->block_size - ((offset + *pnum) & (s->block_size - 1));
        *pnum = MIN(bytes, *pnum + n);
    }
    *map = hybrid_host_offset(s, offset);
    *file = bs->file->bs;
    return BDRV_BLOCK_RAW | BDRV_BLOCK_OFFSET_VALID;
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_co_block_status(BlockDriverState *bs, bool want_zero, int64_t offset,
                       int64_t bytes, int64_t *pnum, int64_t *map,
                       BlockDriverState **file)
{
    AioContext *from = hybrid_co_go_home(bs);
    int ret = hybrid_do_block_status(bs, offset, bytes, pnum, map, file);

    hybrid_co_go_back(from);
    return ret;
}

static void hybrid_drain_begin(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;

    s->quiesced = true;
}

static void hybrid_drain_end_bh(void *opaque)
{
    BlockDriverState *bs = opaque;
    BDRVHybridState *s = bs->opaque;

    hybrid_restore_kick(s);
    hybrid_flusher_kick(s);
    hybrid_mirror_prefill_kick(s);
    bdrv_dec_in_flight(bs);
}

/*
 * Called from the thread that ends the drained section, which need not be
 * the node's (an iothread's node drained from the main loop): background
 * work must restart in the node's AioContext, where all other accesses to
 * its state run, so from another thread it goes through a bottom half.  A
 * new drained section waits for that (in flight); if it begins first, the
 * kicks find the node quiesced and do nothing.
 */
static void hybrid_drain_end(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;
    AioContext *ctx = bdrv_get_aio_context(bs);

    s->quiesced = false;
    if (!s->slots) {
        return;
    }
    bdrv_inc_in_flight(bs);
    if (qemu_get_current_aio_context() == ctx) {
        hybrid_drain_end_bh(bs);
    } else {
        aio_bh_schedule_oneshot(ctx, hybrid_drain_end_bh, bs);
    }
}

/* ---- open / close ---- */

/* Our options, parsed with the QAPI visitor; @options is left as it is */
static BlockdevOptionsHybrid *hybrid_visit_options(QDict *options,
                                                   Error **errp)
{
    BlockdevOptions *opts = visit_blockdev_options(options, "hybrid", errp);
    BlockdevOptionsHybrid *ret;

    if (!opts) {
        return NULL;
    }
    ret = g_new(BlockdevOptionsHybrid, 1);
    *ret = opts->u.hybrid;
    /* Steal the union member, then free the shell */
    memset(&opts->u.hybrid, 0, sizeof(opts->u.hybrid));
    opts->u.hybrid.file = ret->file;
    ret->file = NULL;
    qapi_free_BlockdevOptions(opts);
    return ret;
}

/* At open: parse, and take every option of ours out of @options */
static BlockdevOptionsHybrid *hybrid_parse_options(QDict *options,
                                                   Error **errp)
{
    BlockdevOptionsHybrid *ret = hybrid_visit_options(options, errp);

    if (!ret) {
        return NULL;
    }
    qdict_del(options, HYBRID_OPT_RAM_SIZE);
    qdict_del(options, HYBRID_OPT_MODE);
    qdict_del(options, HYBRID_OPT_DEDUP);
    qdict_del(options, HYBRID_OPT_DIRTY_LIMIT);
    qdict_del(options, HYBRID_OPT_RESTORE);
    qdict_del(options, HYBRID_OPT_RAW);
    qdict_del(options, HYBRID_OPT_BLOCK_SIZE);
    qdict_del(options, HYBRID_OPT_PROMOTE_SIZE);
    qdict_del(options, HYBRID_OPT_RAM_FILE);
    qdict_del(options, HYBRID_OPT_MIRROR_PREFILL);
    return ret;
}

/* The mode a node gets when the mode option is not given */
static HybridMode hybrid_default_mode(BDRVHybridState *s)
{
    return s->header.mode == HYBRID_HDR_MODE_ASYNC ? HYBRID_MODE_ASYNC
                                                   : HYBRID_MODE_SYNC;
}

static int hybrid_check_dirty_limit(BDRVHybridState *s, uint64_t limit,
                                    Error **errp)
{
    if (limit < s->block_size) {
        error_setg(errp, "dirty-limit %" PRIu64 " is smaller than the block "
                   "size %" PRIu32, limit, s->block_size);
        return -EINVAL;
    }
    return 0;
}

static int GRAPH_RDLOCK
hybrid_read_geometry(BlockDriverState *bs, BlockdevOptionsHybrid *o,
                     Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    int64_t child_len;
    int ret;

    child_len = bdrv_getlength(bs->file->bs);
    if (child_len < 0) {
        error_setg_errno(errp, -child_len, "Could not get the size of the "
                         "persistent tier");
        return child_len;
    }

    if (s->raw) {
        uint64_t bsz = o->has_block_size ? o->block_size
                                         : HYBRID_DEFAULT_BLOCK_SIZE;

        ret = hybrid_check_block_size_opt(bsz, errp);
        if (ret < 0) {
            return ret;
        }
        memset(&s->header, 0, sizeof(s->header));
        s->header.version = HYBRID_VERSION;
        s->header.block_size = bsz;
        s->header.virtual_size = QEMU_ALIGN_DOWN(child_len, BDRV_SECTOR_SIZE);
        s->header.ram_size = s->header.virtual_size;
        s->header.data_offset = 0;
    } else {
        HybridHeader le;

        if (o->has_block_size) {
            error_setg(errp, "block-size is stored in the image; it can only "
                       "be given with raw=on");
            return -EINVAL;
        }
        if (child_len < HYBRID_HEADER_SIZE) {
            error_setg(errp, "Image is not in hybrid format (persistent tier "
                       "has %" PRId64 " bytes, the header needs %d)",
                       child_len, HYBRID_HEADER_SIZE);
            return -EINVAL;
        }
        ret = hybrid_read_header(bs->file, child_len, &le);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not read the hybrid header");
            return ret;
        }
        ret = hybrid_header_check(&le, &s->header, errp);
        if (ret < 0) {
            return ret;
        }
    }
    s->size = s->header.virtual_size;
    s->data_offset = s->header.data_offset;
    s->block_size = s->header.block_size;
    s->block_shift = ctz32(s->block_size);
    s->nb_blocks = DIV_ROUND_UP(s->size, s->block_size);
    return 0;
}

static void hybrid_start_background(BDRVHybridState *s)
{
    hybrid_restore_kick(s);
    /* Dirty blocks a region brought back are written back at once */
    hybrid_flusher_kick(s);
    hybrid_mirror_prefill_kick(s);
}

static int hybrid_open(BlockDriverState *bs, QDict *options, int flags,
                       Error **errp)
{
    ERRP_GUARD();
    BDRVHybridState *s = bs->opaque;
    g_autoptr(BlockdevOptionsHybrid) o = NULL;
    int ret;

    s->bs = bs;
    o = hybrid_parse_options(options, errp);
    if (!o) {
        return -EINVAL;
    }
    ret = bdrv_open_file_child(NULL, options, "file", bs, errp);
    if (ret < 0) {
        return ret;
    }

    GRAPH_RDLOCK_GUARD_MAINLOOP();

    s->raw = o->has_raw && o->raw;
    ret = hybrid_read_geometry(bs, o, errp);
    if (ret < 0) {
        return ret;
    }
    ret = hybrid_backing_open(bs, s->raw, options, !(flags & BDRV_O_NO_IO),
                              errp);
    if (ret < 0) {
        goto fail;
    }
    if (s->alloc && o->ram_file) {
        error_setg(errp, "ram-file= is not supported yet for an image with "
                   "a backing file");
        ret = -ENOTSUP;
        goto fail;
    }

    s->mode = o->has_mode ? o->mode : hybrid_default_mode(s);
    s->dedup = o->has_dedup ? o->dedup : s->header.dedup;
    if (o->has_ram_size) {
        ret = hybrid_check_ram_size(o->ram_size, s->block_size,
                                    s->header.virtual_size, errp);
        if (ret < 0) {
            goto fail;
        }
    }
    s->ram_size = o->has_ram_size ? o->ram_size : s->header.ram_size;
    s->dirty_limit = o->has_dirty_limit ? o->dirty_limit
                                        : HYBRID_DEFAULT_DIRTY_LIMIT;
    s->restore_enabled = o->has_restore ? o->restore : true;
    ret = hybrid_check_dirty_limit(s, s->dirty_limit, errp);
    if (ret < 0) {
        goto fail;
    }
    s->ram_blocks = MIN(s->ram_size >> s->block_shift, s->nb_blocks);
    ret = hybrid_check_ram_blocks(s->ram_blocks, s->ram_size, s->block_size,
                                  errp);
    if (ret < 0) {
        goto fail;
    }

    s->mirror_prefill = !o->has_mirror_prefill || o->mirror_prefill;
    ret = hybrid_mirror_open(s, options, flags & BDRV_O_RDWR, o->ram_file,
                             errp);
    if (ret < 0) {
        goto fail;
    }
    if ((s->header.incompat_features & HYBRID_INCOMPAT_REGION) &&
        !o->ram_file && !s->mirror && !(flags & BDRV_O_NO_IO)) {
        error_setg(errp, "The image's newest writes are held in RAM region "
                   "%016" PRIx64 "; open it with ram-file= (or mirror=) "
                   "naming that region (or an empty one to discard them)",
                   s->header.region_token);
        ret = -EBUSY;
        goto fail;
    }
    ret = hybrid_ram_init(s, o->ram_file, flags & BDRV_O_RDWR, errp);
    if (ret < 0) {
        goto fail;
    }
    s->promote_blocks = o->has_promote_size ?
                        o->promote_size >> s->block_shift : 0;
    if (s->promote_blocks && s->ram_blocks < s->nb_blocks) {
        s->hot = g_hash_table_new(g_int64_hash, g_int64_equal);
        s->heat = g_new0(uint8_t, HYBRID_HEAT_SLOTS);
        QTAILQ_INIT(&s->hot_lru);
    }
    qemu_co_queue_init(&s->busy_queue);
    qemu_co_queue_init(&s->dirty_queue);
    qemu_co_queue_init(&s->restore_queue);
    s->inactive = flags & BDRV_O_INACTIVE;
    qemu_co_mutex_init(&s->header_lock);
    QTAILQ_INIT(&s->dirty_list);
    if (s->region && !s->inactive) {
        ret = hybrid_region_attach(s, false, errp);
        if (ret < 0) {
            hybrid_ram_free(s);
            goto fail;
        }
    }
    if (s->mirror && !s->inactive) {
        ret = hybrid_mirror_attach(s, false, errp);
        if (ret < 0) {
            hybrid_ram_free(s);
            goto fail;
        }
    }

    bs->total_sectors = s->size / BDRV_SECTOR_SIZE;
    bs->supported_zero_flags = BDRV_REQ_MAY_UNMAP;
    if (!s->raw) {
        /* a grow always reads as zeros, backing file or not */
        bs->supported_truncate_flags = BDRV_REQ_ZERO_WRITE;
    }

    trace_hybrid_open(s, s->size, s->block_size, s->ram_blocks, s->mode,
                      s->dedup, !!(s->header.flags & HYBRID_FLAG_DIRTY));

    hybrid_writeback_init(s);
    /* An inactive image (incoming migration) restores when activated */
    hybrid_start_background(s);
    return 0;

fail:
    hybrid_mirror_close(s);
    hybrid_backing_close(s);
    return ret;
}

/* Write everything back and clear the DIRTY flag.  Main loop only. */
static int GRAPH_RDLOCK hybrid_make_clean(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;
    HybridHeader le;
    int ret;

    ret = bdrv_flush(bs);
    if (ret < 0 || !QTAILQ_EMPTY(&s->dirty_list)) {
        return ret < 0 ? ret : -EIO;
    }
    /* Also clears a DIRTY flag left by an earlier unclean shutdown */
    if (s->raw || (!s->header_dirty_on_disk &&
                   !(s->header.flags & HYBRID_FLAG_DIRTY))) {
        return 0;
    }
    s->header.flags &= ~HYBRID_FLAG_DIRTY;
    s->header.incompat_features &= ~HYBRID_INCOMPAT_REGION;
    hybrid_header_to_le(&s->header, &le);
    ret = bdrv_pwrite(bs->file, 0, s->header.header_size, &le, 0);
    if (ret == 0) {
        ret = bdrv_flush(bs->file->bs);
    }
    if (ret == 0) {
        s->header_dirty_on_disk = false;
    }
    trace_hybrid_make_clean(s, ret);
    return ret;
}

/*
 * The node stays active (and its restore running) unless everything was
 * written back: the block layer keeps it active when this fails, and the
 * two must agree, or restore would never be started again.
 */
static int GRAPH_RDLOCK hybrid_inactivate(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;
    int ret;

    ret = hybrid_make_clean(bs);
    trace_hybrid_inactivate(s, ret);
    if (ret < 0) {
        return ret;
    }
    /* Restore stops at its next request; activation starts it over */
    s->inactive = true;
    return 0;
}

/*
 * Activation after incoming migration (or after a failed outgoing one):
 * another process may have written the persistent tier, so RAM starts
 * empty and is restored again.
 */
static void coroutine_fn GRAPH_RDLOCK
hybrid_co_invalidate_cache(BlockDriverState *bs, Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    HybridHeader le, h;
    int ret;

    assert(QTAILQ_EMPTY(&s->dirty_list));
    while (s->restore_workers) {
        qemu_co_queue_wait(&s->restore_queue, NULL);
    }
    /*
     * Everything that can fail comes first: on failure the block layer
     * keeps the node inactive, and so must we.
     */
    if (!s->raw) {
        ret = hybrid_read_header(bs->file, bdrv_co_getlength(bs->file->bs),
                                 &le);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not read the hybrid header");
            return;
        }
        if (hybrid_header_check(&le, &h, errp) < 0) {
            return;
        }
        if (h.virtual_size != s->size || h.block_size != s->block_size ||
            h.data_offset != s->data_offset) {
            error_setg(errp, "Hybrid image geometry changed while inactive");
            return;
        }
        s->header = h;
        s->header_dirty_on_disk = false;
        /* Another host may have written blocks of ours */
        if (s->alloc && hybrid_backing_load_bitmap(s, errp) < 0) {
            return;
        }
    }
    hybrid_hot_drop_all(s);
    hybrid_ram_unload_all(s);
    if (s->region && hybrid_region_attach(s, true, errp) < 0) {
        return;
    }
    if (s->mirror && hybrid_mirror_attach(s, true, errp) < 0) {
        return;
    }
    s->inactive = false;
    s->restore_cursor = 0;
    s->restore_bytes = 0;
    s->restore_done = false;
    s->restore_error = 0;
    s->restore_start_ns = 0;
    hybrid_start_background(s);
}

static void hybrid_close(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;

    hybrid_writeback_cleanup(s);
    /* A failed mirror whose bottom half has not run: its flush would fail */
    hybrid_mirror_detach(s);
    if (s->slots) {
        assert(!s->restore_workers && s->flush_workers == 0);
        if (bs->open_flags & BDRV_O_RDWR &&
            !(bs->open_flags & BDRV_O_INACTIVE)) {
            int ret;

            bdrv_graph_rdlock_main_loop();
            ret = hybrid_make_clean(bs);
            bdrv_graph_rdunlock_main_loop();
            if (ret < 0) {
                /* Nothing else we can do: the image stays marked dirty */
                error_report("hybrid: node '%s': could not write back all "
                             "data at close: %s",
                             bdrv_get_node_name(bs), strerror(-ret));
                QTAILQ_INIT(&s->dirty_list);
                for (uint64_t i = 0; i < s->ram_blocks; i++) {
                    s->slots[i].flags &= ~(HYBRID_SLOT_DIRTY |
                                           HYBRID_SLOT_LISTED);
                }
            }
        }
    }
    hybrid_hot_drop_all(s);
    if (s->hot) {
        g_hash_table_destroy(s->hot);
        s->hot = NULL;
    }
    g_free(s->heat);
    hybrid_ram_free(s);
    hybrid_mirror_close(s);
    hybrid_backing_close(s);
}

typedef struct HybridReopenState {
    HybridMode mode;
    uint64_t dirty_limit;
} HybridReopenState;

/*
 * mode and dirty-limit (hybrid_mutable_opts) may change, an omitted one
 * going back to its default; they are taken out of the options, and the
 * block layer refuses a change of any other.
 */
static int GRAPH_UNLOCKED
hybrid_reopen_prepare(BDRVReopenState *state, BlockReopenQueue *queue,
                      Error **errp)
{
    BDRVHybridState *s = state->bs->opaque;
    g_autofree HybridReopenState *r = g_new0(HybridReopenState, 1);
    g_autoptr(BlockdevOptionsHybrid) o = NULL;
    int ret;

    o = hybrid_visit_options(state->options, errp);
    if (!o) {
        return -EINVAL;
    }
    r->mode = o->has_mode ? o->mode : hybrid_default_mode(s);
    r->dirty_limit = o->has_dirty_limit ? o->dirty_limit
                                        : HYBRID_DEFAULT_DIRTY_LIMIT;
    ret = hybrid_check_dirty_limit(s, r->dirty_limit, errp);
    if (ret < 0) {
        return ret;
    }
    qdict_del(state->options, HYBRID_OPT_MODE);
    qdict_del(state->options, HYBRID_OPT_DIRTY_LIMIT);
    state->opaque = g_steal_pointer(&r);
    return 0;
}

/*
 * The node is drained (bdrv_reopen_queue()): no request and no background
 * work runs in its AioContext, so the options can change from here even
 * when the node lives in an iothread.  The end of the drained section
 * restarts the flusher, which writes back what is owed after a switch to
 * sync mode.
 */
static void GRAPH_UNLOCKED hybrid_reopen_commit(BDRVReopenState *state)
{
    BDRVHybridState *s = state->bs->opaque;
    HybridReopenState *r = state->opaque;

    assert(s->quiesced);
    trace_hybrid_set_mode(s, s->mode, r->mode);
    s->mode = r->mode;
    s->dirty_limit = r->dirty_limit;
    g_free(r);
    state->opaque = NULL;
}

static void GRAPH_UNLOCKED hybrid_reopen_abort(BDRVReopenState *state)
{
    g_free(state->opaque);
    state->opaque = NULL;
}

/* ---- information, check ---- */

static int hybrid_probe(const uint8_t *buf, int buf_size,
                        const char *filename)
{
    if (buf_size >= 8 && !memcmp(buf, HYBRID_MAGIC, 8)) {
        return 100;
    }
    return 0;
}

static int64_t coroutine_fn GRAPH_RDLOCK
hybrid_co_getlength(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;

    return s->size;
}

static int coroutine_fn GRAPH_RDLOCK
hybrid_co_get_info(BlockDriverState *bs, BlockDriverInfo *bdi)
{
    BDRVHybridState *s = bs->opaque;

    bdi->cluster_size = s->block_size;
    bdi->is_dirty = !!(s->header.flags & HYBRID_FLAG_DIRTY);
    return 0;
}

static ImageInfoSpecific * GRAPH_RDLOCK
hybrid_get_specific_info(BlockDriverState *bs, Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    ImageInfoSpecific *spec = g_new0(ImageInfoSpecific, 1);
    ImageInfoSpecificHybrid *h = g_new0(ImageInfoSpecificHybrid, 1);

    *h = (ImageInfoSpecificHybrid) {
        .version = s->header.version,
        .block_size = s->block_size,
        .data_offset = s->data_offset,
        .ram_size = s->header.ram_size,
        .mode = s->header.mode == HYBRID_HDR_MODE_ASYNC ? HYBRID_MODE_ASYNC
                                                        : HYBRID_MODE_SYNC,
        .dedup = s->header.dedup,
        .dirty = !!(s->header.flags & HYBRID_FLAG_DIRTY),
        .raw = s->raw,
        .has_region_token = !!s->header.region_token,
        .region_token = s->header.region_token,
        .has_region_held = !!s->header.region_token,
        .region_held = !!(s->header.incompat_features &
                          HYBRID_INCOMPAT_REGION),
    };
    spec->type = IMAGE_INFO_SPECIFIC_KIND_HYBRID;
    spec->u.hybrid.data = h;
    return spec;
}

/*
 * Nothing in the layout can be inconsistent except the header (checked at
 * open) and the persistent tier's length.  A DIRTY flag only means that
 * writes acknowledged after the last flush of an async-mode run may be
 * lost, which the format allows; repair clears it.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_co_check(BlockDriverState *bs, BdrvCheckResult *res,
                BdrvCheckMode fix)
{
    BDRVHybridState *s = bs->opaque;
    uint64_t need = s->data_offset + ROUND_UP(s->size, s->block_size);
    int64_t len = bdrv_co_getlength(bs->file->bs);
    int ret;

    if (len < 0) {
        res->check_errors++;
        return len;
    }
    res->image_end_offset = need;
    if (!s->raw && len < need) {
        if (fix & BDRV_FIX_ERRORS) {
            ret = bdrv_co_truncate(bs->file, need, false, PREALLOC_MODE_OFF,
                                   0, NULL);
            if (ret < 0) {
                res->corruptions++;
                res->check_errors++;
            } else {
                res->corruptions_fixed++;
            }
        } else {
            fprintf(stderr, "ERROR persistent tier is %" PRId64 " bytes, the "
                    "layout needs %" PRIu64 "\n", len, need);
            res->corruptions++;
        }
    }
    if (!s->raw && (s->header.flags & HYBRID_FLAG_DIRTY) &&
        (fix & BDRV_FIX_LEAKS) && !s->header_dirty_on_disk &&
        !bdrv_is_read_only(bs)) {
        ret = hybrid_write_header(s, s->header.flags & ~HYBRID_FLAG_DIRTY);
        if (ret < 0) {
            res->check_errors++;
        } else {
            res->leaks_fixed++;
        }
    }
    return 0;
}

static void GRAPH_RDLOCK
hybrid_refresh_limits(BlockDriverState *bs, Error **errp)
{
    bs->bl.request_alignment = BDRV_SECTOR_SIZE;
}

static int GRAPH_RDLOCK hybrid_has_zero_init(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;

    return s->raw ? 0 : bdrv_has_zero_init(bs->file->bs);
}

static const char *const hybrid_mutable_opts[] = {
    HYBRID_OPT_MODE,
    HYBRID_OPT_DIRTY_LIMIT,

    NULL
};

static const char *const hybrid_strong_runtime_opts[] = {
    HYBRID_OPT_RAW,
    HYBRID_OPT_BLOCK_SIZE,

    NULL
};

BlockDriver bdrv_hybrid = {
    .format_name                = "hybrid",
    .instance_size              = sizeof(BDRVHybridState),
    .is_format                  = true,
    .supports_backing           = true,
    .create_opts                = &hybrid_create_opts,
    .strong_runtime_opts        = hybrid_strong_runtime_opts,
    .mutable_opts               = hybrid_mutable_opts,

    /* open, close, create */
    .bdrv_probe                 = hybrid_probe,
    .bdrv_open                  = hybrid_open,
    .bdrv_close                 = hybrid_close,
    .bdrv_reopen_prepare        = hybrid_reopen_prepare,
    .bdrv_reopen_commit         = hybrid_reopen_commit,
    .bdrv_reopen_abort          = hybrid_reopen_abort,
    .bdrv_child_perm            = bdrv_default_perms,
    .bdrv_co_create             = hybrid_co_create,
    .bdrv_co_create_opts        = hybrid_co_create_opts,
    .bdrv_has_zero_init         = hybrid_has_zero_init,
    .bdrv_refresh_limits        = hybrid_refresh_limits,

    /* I/O */
    .bdrv_co_preadv_part        = hybrid_co_preadv_part,
    .bdrv_co_pwritev_part       = hybrid_co_pwritev_part,
    .bdrv_co_pwrite_zeroes      = hybrid_co_pwrite_zeroes,
    .bdrv_co_pdiscard           = hybrid_co_pdiscard,
    .bdrv_co_flush_to_os        = hybrid_co_flush_to_os,
    .bdrv_co_block_status       = hybrid_co_block_status,

    /* background work and migration */
    .bdrv_drain_begin           = hybrid_drain_begin,
    .bdrv_drain_end             = hybrid_drain_end,
    .bdrv_inactivate            = hybrid_inactivate,
    .bdrv_co_invalidate_cache   = hybrid_co_invalidate_cache,
    .bdrv_co_truncate           = hybrid_co_truncate,
    .bdrv_measure               = hybrid_measure,
    .amend_opts                 = &hybrid_amend_opts,
    .bdrv_amend_options         = hybrid_amend_options,
    .bdrv_co_amend              = hybrid_co_amend,
    .bdrv_co_change_backing_file = hybrid_co_change_backing_file,

    /* information */
    .bdrv_co_getlength          = hybrid_co_getlength,
    .bdrv_co_get_info           = hybrid_co_get_info,
    .bdrv_get_specific_info     = hybrid_get_specific_info,
    .bdrv_co_check              = hybrid_co_check,
};

static void bdrv_hybrid_init(void)
{
    bdrv_register(&bdrv_hybrid);
}

block_init(bdrv_hybrid_init);
