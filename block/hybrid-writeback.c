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
#include "qemu/memalign.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

/* Concurrent write-back requests */
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

/*
 * Write the dirty span of @slot to the child.  The caller holds BUSY.
 * On failure the span is dirty again and the error is returned.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_writeback_slot(BDRVHybridState *s, HybridSlot *slot, uint8_t *bounce)
{
    uint64_t idx = slot - s->slots;
    uint32_t lo, hi, len;
    const uint8_t *src;
    int ret;

    assert(slot->flags & HYBRID_SLOT_BUSY);
    if (!(slot->flags & HYBRID_SLOT_DIRTY)) {
        return 0;
    }
    lo = slot->dirty_lo;
    hi = MIN(slot->dirty_hi, hybrid_block_len(s, idx));
    slot->flags &= ~HYBRID_SLOT_DIRTY;
    s->dirty_bytes -= slot->dirty_hi - slot->dirty_lo;
    len = hi > lo ? hi - lo : 0;

    /* Snapshot: guest writes may change RAM while the child write runs */
    src = hybrid_ram_peek(s, idx);
    if (len == 0) {
        ret = 0;
    } else if (!src || buffer_is_zero(src + lo, len)) {
        ret = bdrv_co_pwrite_zeroes(s->bs->file,
                                    hybrid_host_offset(s, (idx << s->block_shift) + lo),
                                    len, 0);
    } else {
        memcpy(bounce, src + lo, len);
        ret = bdrv_co_pwrite(s->bs->file,
                             hybrid_host_offset(s, (idx << s->block_shift) + lo),
                             len, bounce, 0);
    }
    trace_hybrid_writeback(s, idx, lo, len, ret);
    if (ret < 0) {
        hybrid_slot_set_dirty(s, slot, lo, hi);
        return ret;
    }
    s->flushed_bytes += len;
    if (!(slot->flags & HYBRID_SLOT_DIRTY)) {
        hybrid_region_clear_dirty(s, idx);
        QTAILQ_REMOVE(&s->dirty_list, slot, dirty_next);
        slot->flags &= ~HYBRID_SLOT_LISTED;
        /* Quiet now: worth hashing for dedup */
        hybrid_ram_intern(s, idx);
    }
    return 0;
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
        s->writeback_burst = true;
    } else if (s->dirty_bytes < s->dirty_limit / 4) {
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

static void coroutine_fn hybrid_flusher_entry(void *opaque)
{
    BDRVHybridState *s = opaque;
    BlockDriverState *bs = s->bs;
    uint8_t *bounce;
    HybridSlot *slot;

    GRAPH_RDLOCK_GUARD();

    bounce = qemu_blockalign(bs, s->block_size);
    while (hybrid_flusher_should_run(s) &&
           (slot = hybrid_flusher_pick(s)) != NULL) {
        int ret;

        hybrid_slot_lock(s, slot);
        ret = hybrid_writeback_slot(s, slot, bounce);
        hybrid_slot_unlock(s, slot);
        if (ret < 0 && !s->flush_error) {
            /* Sticky until a guest flush manages to write everything */
            s->flush_error = ret;
            trace_hybrid_flush_error(s, ret);
        }
        qemu_co_queue_restart_all(&s->dirty_queue);
    }
    qemu_vfree(bounce);
    s->flush_workers--;
    qemu_co_queue_restart_all(&s->dirty_queue);
    bdrv_dec_in_flight(bs);
}

void hybrid_flusher_kick(BDRVHybridState *s)
{
    while (s->flush_workers < HYBRID_FLUSH_WORKERS &&
           s->flush_workers < s->dirty_bytes / s->block_size + 1 &&
           hybrid_flusher_should_run(s)) {
        Coroutine *co = qemu_coroutine_create(hybrid_flusher_entry, s);

        s->flush_workers++;
        bdrv_inc_in_flight(s->bs);
        aio_co_enter(bdrv_get_aio_context(s->bs), co);
    }
}

/* Write back every span that is dirty now */
static int coroutine_fn GRAPH_RDLOCK hybrid_flush_ram(BlockDriverState *bs)
{
    BDRVHybridState *s = bs->opaque;
    g_autofree uint64_t *todo = NULL;
    uint64_t n = 0, i, cap = 0;
    uint8_t *bounce;
    HybridSlot *slot;
    int ret = 0;

    QTAILQ_FOREACH(slot, &s->dirty_list, dirty_next) {
        cap++;
    }
    trace_hybrid_flush(s, cap, s->dirty_bytes);
    if (!cap) {
        s->flush_error = 0;
        return 0;
    }
    todo = g_new(uint64_t, cap);
    QTAILQ_FOREACH(slot, &s->dirty_list, dirty_next) {
        todo[n++] = slot - s->slots;
    }

    bounce = qemu_blockalign(bs, s->block_size);
    for (i = 0; i < n; i++) {
        int r;

        slot = &s->slots[todo[i]];
        /* Waits for an in-flight write-back of this block, if any */
        hybrid_slot_lock(s, slot);
        r = hybrid_writeback_slot(s, slot, bounce);
        hybrid_slot_unlock(s, slot);
        if (r < 0 && ret == 0) {
            ret = r;
        }
    }
    qemu_vfree(bounce);

    if (ret == 0) {
        s->flush_error = 0;
        hybrid_flusher_kick(s);
    } else {
        s->flush_error = ret;
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
    GArray *alloc = hybrid_backing_flush_begin(s);

    return hybrid_backing_flush_end(s, alloc, hybrid_flush_ram(bs));
}

/*
 * May an async-mode write complete in RAM only?  Not while a write-back
 * error is pending: until a flush writes everything back, new writes go
 * through to the persistent tier as in sync mode, so that nothing more is
 * acknowledged that could not be made durable, and each writer sees the
 * persistent tier's own answer (docs/hybrid-format.rst, "Crash
 * consistency").  Async writers wait here while too much is dirty.
 */
bool coroutine_fn hybrid_may_defer_write(BDRVHybridState *s)
{
    if (s->mode == HYBRID_MODE_SYNC) {
        return false;
    }
    while (!s->flush_error && s->dirty_bytes >= s->dirty_limit) {
        trace_hybrid_dirty_wait(s, s->dirty_bytes);
        hybrid_flusher_kick(s);
        qemu_co_queue_wait(&s->dirty_queue, NULL);
    }
    if (s->flush_error) {
        trace_hybrid_write_through_on_error(s, s->flush_error);
        return false;
    }
    return true;
}
