/*
 * Hybrid block format: async write-back
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Dirty spans of RAM blocks, the background flusher and guest flushes.
 * See "Crash consistency" in docs/hybrid-format.rst.
 */

#include "qemu/osdep.h"
#include "qemu/cutils.h"
#include "qemu/main-loop.h"
#include "qapi/error.h"
#include "qemu/units.h"
#include "qemu/timer.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

/* Concurrent write-back requests, at most */
#define HYBRID_FLUSH_WORKERS        8

/* Record that [lo, hi) of @slot's block must reach the child. */
void hybrid_slot_set_dirty(BDRVHybridState *s, HybridSlot *slot,
                           uint32_t lo, uint32_t hi)
{
    if (slot->flags & HYBRID_SLOT_DIRTY) {
        s->dirty_bytes -= slot->dirty_hi - slot->dirty_lo;
        slot->dirty_lo = MIN(slot->dirty_lo, lo);
        slot->dirty_hi = MAX(slot->dirty_hi, hi);
    } else {
        slot->flags |= HYBRID_SLOT_DIRTY;
        slot->dirty_lo = lo;
        slot->dirty_hi = hi;
    }
    s->dirty_bytes += slot->dirty_hi - slot->dirty_lo;

    /* Least recently written first: move to the tail on every write */
    if (slot->flags & HYBRID_SLOT_LISTED) {
        QTAILQ_REMOVE(&s->dirty_list, slot, dirty_next);
    }
    QTAILQ_INSERT_TAIL(&s->dirty_list, slot, dirty_next);
    slot->flags |= HYBRID_SLOT_LISTED;
}

/* One write-back request covers at most this much (a run of blocks) */
#define HYBRID_WRITEBACK_MAX_BYTES  (1 * MiB)

static uint32_t hybrid_writeback_max_blocks(BDRVHybridState *s)
{
    return MAX(1, HYBRID_WRITEBACK_MAX_BYTES >> s->block_shift);
}

/*
 * Extend a write-back that starts at locked block @idx over the blocks
 * after it, as long as each continues the previous one's dirty span (that
 * span reaches the end of its block, the next one starts at 0), has data
 * in RAM exactly when @idx has (zeroed blocks go as write-zeroes), and
 * nobody else holds it.  Takes BUSY on them (free: nothing yields in
 * between).  Returns the number of blocks in the run, @idx's included.  A
 * sequential writer's blocks then go to the child in a few large requests
 * instead of one per block.
 */
static uint32_t hybrid_writeback_extend(BDRVHybridState *s, uint64_t idx)
{
    uint32_t n = 1, max = hybrid_writeback_max_blocks(s);
    HybridSlot *prev = &s->slots[idx];
    bool data;

    if (!(prev->flags & HYBRID_SLOT_DIRTY)) {
        return 1;
    }
    data = hybrid_ram_peek(s, idx) != NULL;
    while (n < max && idx + n < s->ram_blocks &&
           prev->dirty_hi == s->block_size) {
        HybridSlot *slot = &s->slots[idx + n];

        if ((slot->flags & (HYBRID_SLOT_DIRTY | HYBRID_SLOT_BUSY |
                            HYBRID_SLOT_LOADED)) !=
            (HYBRID_SLOT_DIRTY | HYBRID_SLOT_LOADED) ||
            slot->dirty_lo != 0 ||
            (hybrid_ram_peek(s, idx + n) != NULL) != data) {
            break;
        }
        slot->flags |= HYBRID_SLOT_BUSY;
        prev = slot;
        n++;
    }
    return n;
}

/*
 * Write the dirty spans of the @n blocks from @idx, which the caller holds
 * BUSY and which hybrid_writeback_extend() found contiguous, to the child
 * in one request, made from RAM itself: a guest write to a block under
 * write-back waits for its BUSY (hybrid_write_ram_block), as the kernel's
 * writes wait for a page under write-back on a device that wants stable
 * pages, and nothing else changes a block's RAM (or, with dedup, its
 * chunk) without holding BUSY.  On failure the spans are dirty again and
 * the error is returned.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_writeback_run(BDRVHybridState *s, uint64_t idx, uint32_t n)
{
    HybridSlot *first = &s->slots[idx];
    QEMUIOVector qiov;
    uint64_t host, len;
    uint32_t lo, hi = 0, i;
    bool zero = true;
    int ret;

    assert(first->flags & HYBRID_SLOT_BUSY);
    if (!(first->flags & HYBRID_SLOT_DIRTY)) {
        assert(n == 1);
        return 0;
    }
    lo = first->dirty_lo;
    host = hybrid_host_offset(s, (idx << s->block_shift) + lo);
    qemu_iovec_init(&qiov, n);
    for (i = 0; i < n; i++) {
        HybridSlot *slot = &s->slots[idx + i];
        uint32_t blo = i ? 0 : lo;
        const uint8_t *src = hybrid_ram_peek(s, idx + i);

        assert((slot->flags & HYBRID_SLOT_BUSY) &&
               (slot->flags & HYBRID_SLOT_DIRTY));
        hi = MIN(slot->dirty_hi, hybrid_block_len(s, idx + i));
        slot->flags &= ~HYBRID_SLOT_DIRTY;
        s->dirty_bytes -= slot->dirty_hi - slot->dirty_lo;
        if (hi <= blo || !src) {
            continue;
        }
        if (zero && !buffer_is_zero(src + blo, hi - blo)) {
            zero = false;
        }
        qemu_iovec_add(&qiov, (void *)(src + blo), hi - blo);
    }
    len = n > 1 || hi > lo ? ((uint64_t)(n - 1) << s->block_shift) + hi - lo : 0;
    if (len == 0) {
        ret = 0;
    } else if (zero) {
        /* No data in RAM, or only zeroes */
        ret = bdrv_co_pwrite_zeroes(s->bs->file, host, len, 0);
    } else {
        assert(qiov.size == len);
        ret = bdrv_co_pwritev(s->bs->file, host, len, &qiov, 0);
    }
    trace_hybrid_writeback(s, idx, lo, len, ret);
    qemu_iovec_destroy(&qiov);
    for (i = 0; i < n; i++) {
        HybridSlot *slot = &s->slots[idx + i];

        if (ret < 0) {
            hybrid_slot_set_dirty(s, slot, i ? 0 : lo,
                                  i + 1 < n ? s->block_size : MAX(hi, lo));
            continue;
        }
        if (!(slot->flags & HYBRID_SLOT_DIRTY)) {
            hybrid_region_clear_dirty(s, idx + i);
            hybrid_mirror_written_back(s, idx + i);
            QTAILQ_REMOVE(&s->dirty_list, slot, dirty_next);
            slot->flags &= ~HYBRID_SLOT_LISTED;
            /* Quiet now: worth hashing for dedup */
            hybrid_ram_intern(s, idx + i);
        }
    }
    if (ret < 0) {
        return ret;
    }
    s->flushed_bytes += len;
    return 0;
}

/* Unlock the @n blocks of a run from @idx */
static void coroutine_fn hybrid_writeback_unlock(BDRVHybridState *s,
                                                 uint64_t idx, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        hybrid_slot_unlock(s, &s->slots[idx + i]);
    }
}

/*
 * Write back the dirty span of block @idx, and of the dirty blocks that
 * continue it; the caller holds BUSY on @idx.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_writeback_from(BDRVHybridState *s, uint64_t idx)
{
    uint32_t n = hybrid_writeback_extend(s, idx);
    int ret = hybrid_writeback_run(s, idx, n);

    /* @idx itself stays locked for the caller */
    if (n > 1) {
        hybrid_writeback_unlock(s, idx + 1, n - 1);
    }
    return ret;
}

/*
 * Write-back runs in bursts between two watermarks: it starts when half of
 * dirty-limit is dirty and stops below a quarter, so that it does not
 * compete with the writers it is absorbing (and rewrites of hot blocks
 * coalesce in RAM).  Writers waiting at the limit, sync mode (after a
 * switch) and guest flushes override that; a flush writes everything
 * acknowledged before it in any case.
 */
static bool hybrid_flusher_should_run(BDRVHybridState *s)
{
    if (s->flush_error || QTAILQ_EMPTY(&s->dirty_list)) {
        s->writeback_burst = false;
        s->writeback_drain = false;
        return false;
    }
    if (!qemu_co_queue_empty(&s->dirty_queue)) {
        return true;
    }
    if (s->quiesced) {
        return false;
    }
    if (s->mode == HYBRID_MODE_SYNC || s->writeback_drain) {
        return true;
    }
    if (s->dirty_bytes >= s->dirty_limit / 2) {
        if (!s->writeback_burst) {
            trace_hybrid_writeback_burst(s, true, s->dirty_bytes,
                qemu_clock_get_ns(QEMU_CLOCK_REALTIME) / SCALE_MS);
        }
        s->writeback_burst = true;
    } else if (s->dirty_bytes < s->dirty_limit / 4) {
        if (s->writeback_burst) {
            trace_hybrid_writeback_burst(s, false, s->dirty_bytes,
                qemu_clock_get_ns(QEMU_CLOCK_REALTIME) / SCALE_MS);
        }
        s->writeback_burst = false;
    }
    return s->writeback_burst;
}

/* Oldest dirty slot nobody else is working on, or NULL. */
static HybridSlot *hybrid_flusher_pick(BDRVHybridState *s)
{
    HybridSlot *slot;

    QTAILQ_FOREACH(slot, &s->dirty_list, dirty_next) {
        if ((slot->flags & HYBRID_SLOT_DIRTY) &&
            !(slot->flags & HYBRID_SLOT_BUSY)) {
            return slot;
        }
    }
    return NULL;
}

/*
 * How many write-back requests may be in flight now.  One, as long as it
 * keeps up: each request is handed to the persistent tier's driver (for a
 * file, a thread of the pool), and on a host short of CPU eight at once
 * took the CPU from the writers in bursts (their requests wait for the
 * loop that serves them) and stalled that loop in the pool's wake-ups;
 * see docs/bench/hybrid-tail.md.  Past the high watermark the tier is
 * falling behind (a disk, a network): one more request in flight for each
 * eighth of the way to dirty-limit, all of them at the limit, when writers
 * wait, in sync mode and while draining.
 */
static int hybrid_flusher_allowed(BDRVHybridState *s)
{
    uint64_t hi = s->dirty_limit / 2;

    if (!qemu_co_queue_empty(&s->dirty_queue) ||
        s->mode == HYBRID_MODE_SYNC || s->writeback_drain ||
        s->dirty_bytes >= s->dirty_limit) {
        return HYBRID_FLUSH_WORKERS;
    }
    if (s->dirty_bytes <= hi) {
        return 1;
    }
    return 1 + (s->dirty_bytes - hi) * (HYBRID_FLUSH_WORKERS - 1) /
               (s->dirty_limit - hi);
}

static void coroutine_fn hybrid_flusher_entry(void *opaque)
{
    BDRVHybridState *s = opaque;
    BlockDriverState *bs = s->bs;
    HybridSlot *slot;

    GRAPH_RDLOCK_GUARD();

    while (s->flush_workers <= hybrid_flusher_allowed(s) &&
           hybrid_flusher_should_run(s) &&
           (slot = hybrid_flusher_pick(s)) != NULL) {
        int ret;

        hybrid_slot_lock(s, slot);
        ret = hybrid_writeback_from(s, slot - s->slots);
        hybrid_slot_unlock(s, slot);
        if (ret < 0 && !s->flush_error) {
            /* Sticky until a guest flush manages to write everything */
            hybrid_set_flush_error(s, ret);
            trace_hybrid_flush_error(s, ret);
        }
        qemu_co_queue_restart_all(&s->dirty_queue);
    }
    if (s->flush_workers == 1 && s->mirror) {
        /* The burst is over: what it wrote back leaves the mirror */
        hybrid_mirror_clean(s);
    }
    s->flush_workers--;
    qemu_co_queue_restart_all(&s->dirty_queue);
    bdrv_dec_in_flight(bs);
}

/*
 * While write-back fails, the RAM tier holds acknowledged writes that exist
 * nowhere else (unless it is a region): closing the node then would drop
 * them (hybrid_close can only report it).  So blockdev-del is refused for
 * as long as the error stands; a flush that writes everything lifts it.
 * Op blockers are main-loop state and flush_error changes in the node's
 * AioContext: a bottom half in the main loop brings the blocker in line.
 */
static void hybrid_del_blocker_bh(void *opaque)
{
    BDRVHybridState *s = opaque;
    BlockDriverState *bs = s->bs;
    int err = qatomic_read(&s->flush_error);

    GLOBAL_STATE_CODE();
    if (err && !s->del_blocker) {
        error_setg(&s->del_blocker, "node '%s' holds writes that could not "
                   "be written back to its persistent tier (%s); deleting it "
                   "would lose them: make the tier writable again and flush "
                   "the node first", bdrv_get_node_name(bs), strerror(-err));
        bdrv_op_block(bs, BLOCK_OP_TYPE_DRIVE_DEL, s->del_blocker);
        trace_hybrid_del_blocked(s, err);
    } else if (!err && s->del_blocker) {
        bdrv_op_unblock(bs, BLOCK_OP_TYPE_DRIVE_DEL, s->del_blocker);
        error_free(s->del_blocker);
        s->del_blocker = NULL;
        trace_hybrid_del_unblocked(s);
    }
}

/* Any thread.  Records @ret (0 or -errno) as the write-back's state. */
void hybrid_set_flush_error(BDRVHybridState *s, int ret)
{
    int old = qatomic_xchg(&s->flush_error, ret);

    if (!old != !ret && s->del_blocker_bh) {
        qemu_bh_schedule(s->del_blocker_bh);
    }
}

void hybrid_writeback_init(BDRVHybridState *s)
{
    s->del_blocker_bh = qemu_bh_new(hybrid_del_blocker_bh, s);
}

/* Main loop, at close: the node goes, and its blocker with it */
void hybrid_writeback_cleanup(BDRVHybridState *s)
{
    if (s->del_blocker_bh) {
        qemu_bh_delete(s->del_blocker_bh);
        s->del_blocker_bh = NULL;
    }
    if (s->del_blocker) {
        bdrv_op_unblock(s->bs, BLOCK_OP_TYPE_DRIVE_DEL, s->del_blocker);
        error_free(s->del_blocker);
        s->del_blocker = NULL;
    }
}

void hybrid_flusher_kick(BDRVHybridState *s)
{
    int max = hybrid_flusher_allowed(s);

    while (s->flush_workers < max &&
           s->flush_workers < s->dirty_bytes / s->block_size + 1 &&
           hybrid_flusher_should_run(s)) {
        Coroutine *co = qemu_coroutine_create(hybrid_flusher_entry, s);

        s->flush_workers++;
        bdrv_inc_in_flight(s->bs);
        aio_co_enter(bdrv_get_aio_context(s->bs), co);
    }
}

static int hybrid_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* Write back every span that is dirty now */
static int coroutine_fn GRAPH_RDLOCK hybrid_flush_ram(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;
    g_autofree uint64_t *todo = NULL;
    uint64_t n = 0, i, cap = 0;
    HybridSlot *slot;
    int ret = 0;

    QTAILQ_FOREACH(slot, &s->dirty_list, dirty_next) {
        cap++;
    }
    trace_hybrid_flush(s, cap, s->dirty_bytes);
    if (!cap) {
        hybrid_set_flush_error(s, 0);
        hybrid_mirror_clean(s);
        return 0;
    }
    todo = g_new(uint64_t, cap);
    QTAILQ_FOREACH(slot, &s->dirty_list, dirty_next) {
        todo[n++] = slot - s->slots;
    }
    /* In block order, so that contiguous blocks go out as one run */
    qsort(todo, n, sizeof(*todo), hybrid_cmp_u64);

    for (i = 0; i < n; i++) {
        int r;

        slot = &s->slots[todo[i]];
        /* Waits for an in-flight write-back of this block, if any */
        hybrid_slot_lock(s, slot);
        r = hybrid_writeback_from(s, todo[i]);
        hybrid_slot_unlock(s, slot);
        if (r < 0 && ret == 0) {
            ret = r;
        }
    }

    hybrid_set_flush_error(s, ret);
    if (ret == 0) {
        hybrid_mirror_clean(s);
        hybrid_flusher_kick(s);
    }
    qemu_co_queue_restart_all(&s->dirty_queue);
    return ret;
}

/*
 * Make every write acknowledged before this call durable on the child
 * (the child's own flush is done by the block layer after us); the
 * allocation bitmap records the blocks copied before the call, once their
 * data is durable (hybrid-backing.c).
 */
int coroutine_fn GRAPH_RDLOCK
hybrid_co_flush_to_os(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;
    AioContext *from = hybrid_co_go_home(bs);
    GArray *alloc = hybrid_backing_flush_begin(s);
    int ret = hybrid_backing_flush_end(s, alloc, hybrid_flush_ram(bs));

    hybrid_co_go_back(from);
    return ret;
}

/* Bytes a write of [lo, hi) would add to dirty_bytes in @slot's block */
static uint32_t hybrid_dirty_growth(HybridSlot *slot, uint32_t lo, uint32_t hi)
{
    if (!(slot->flags & HYBRID_SLOT_DIRTY)) {
        return hi - lo;
    }
    return MAX(slot->dirty_hi, hi) - MIN(slot->dirty_lo, lo) -
           (slot->dirty_hi - slot->dirty_lo);
}

/*
 * May an async-mode write of [lo, hi) of @slot's block complete in RAM
 * only?  Not while a write-back error is pending: until a flush writes
 * everything back, new writes go through to the persistent tier as in sync
 * mode, so that nothing more is acknowledged that could not be made
 * durable, and each writer sees the persistent tier's own answer
 * (docs/hybrid-format.rst, "Crash consistency").  Async writers wait here
 * while too much is dirty, unless the write falls inside the block's dirty
 * span: a rewrite of data not yet written back adds nothing to write back
 * (a sequential writer looping over a working set that fits dirty-limit
 * otherwise waited on the flusher at disk speed).
 */
bool coroutine_fn hybrid_may_defer_write(BDRVHybridState *s, HybridSlot *slot,
                                         uint32_t lo, uint32_t hi)
{
    int64_t t0 = 0;

    if (s->mode == HYBRID_MODE_SYNC) {
        return false;
    }
    while (!s->flush_error && s->dirty_bytes >= s->dirty_limit &&
           hybrid_dirty_growth(slot, lo, hi) > 0) {
        trace_hybrid_dirty_wait(s, s->dirty_bytes);
        if (!t0) {
            t0 = qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
        }
        hybrid_flusher_kick(s);
        qemu_co_queue_wait(&s->dirty_queue, NULL);
    }
    if (t0) {
        trace_hybrid_dirty_waited(s, qemu_clock_get_ns(QEMU_CLOCK_REALTIME) -
                                  t0, s->dirty_bytes);
    }
    if (s->flush_error) {
        trace_hybrid_write_through_on_error(s, s->flush_error);
        return false;
    }
    /* A failed mirror: acknowledge only what the persistent tier holds */
    return !(s->mirror_name && s->mirror_error);
}
