/*
 * Hybrid block format: restore while serving
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Fills the RAM tier from the persistent tier in the background after open
 * or activation; see "Restore while serving" in docs/hybrid-format.rst.
 */

#include "qemu/osdep.h"
#include "qapi/qapi-events-block-core.h"
#include "qemu/memalign.h"
#include "qemu/timer.h"
#include "qemu/units.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

/* Restore reads this much per request; also the dedup bounce buffer size */
#define HYBRID_RESTORE_CHUNK        (4 * MiB)
/* Concurrent restore reads (each HYBRID_RESTORE_CHUNK) */
#define HYBRID_RESTORE_WORKERS      2

/*
 * How many whole blocks from @first (at most @max) the persistent tier
 * knows to read as zeros (a hole of a sparse file, an unallocated range of
 * RBD): they are restored without being read.  0 when it cannot tell.
 */
static uint64_t coroutine_fn GRAPH_RDLOCK
restore_zero_blocks(BDRVHybridState *s, uint64_t first, uint64_t max)
{
    uint64_t off = first << s->block_shift;
    int64_t bytes = MIN(max << s->block_shift, s->size - off), pnum;
    int ret;

    ret = bdrv_co_block_status(s->bs->file->bs, hybrid_host_offset(s, off),
                               bytes, &pnum, NULL, NULL);
    if (ret < 0 || !(ret & BDRV_BLOCK_ZERO)) {
        return 0;
    }
    /* the image's last block may end before a whole block */
    return off + pnum >= s->size ? DIV_ROUND_UP(pnum, s->block_size)
                                 : pnum >> s->block_shift;
}

static void coroutine_fn GRAPH_RDLOCK hybrid_restore_run(BDRVHybridState *s)
{
    uint64_t per_req = HYBRID_RESTORE_CHUNK >> s->block_shift;
    uint8_t *bounce = NULL;

    if (s->dedup) {
        bounce = qemu_try_blockalign(s->bs->file->bs, HYBRID_RESTORE_CHUNK);
        if (!bounce) {
            s->restore_error = -ENOMEM;
            return;
        }
    }
    while (s->restore_cursor < hybrid_ram_end(s) && !s->quiesced &&
           !s->inactive) {
        uint64_t first = s->restore_cursor, n = 0, i, off, zero;
        uint64_t len;
        uint8_t *buf;
        int ret;

        /* Only blocks the image holds: the others read from its backing */
        if ((s->slots[first].flags & HYBRID_SLOT_LOADED) ||
            !hybrid_block_allocated(s, first)) {
            s->restore_cursor++;
            continue;
        }
        /*
         * Asked before the blocks are taken: a write that loads one of them
         * meanwhile makes it LOADED, which the run below leaves alone.
         */
        zero = restore_zero_blocks(s, first, per_req);
        /* A run of unloaded blocks; wait for a busy first block */
        hybrid_slot_lock(s, &s->slots[first]);
        if (s->slots[first].flags & HYBRID_SLOT_LOADED) {
            hybrid_slot_unlock(s, &s->slots[first]);
            continue;
        }
        n = 1;
        while (n < (zero ?: per_req) && first + n < hybrid_ram_end(s) &&
               hybrid_block_allocated(s, first + n) &&
               !(s->slots[first + n].flags &
                 (HYBRID_SLOT_LOADED | HYBRID_SLOT_BUSY))) {
            s->slots[first + n].flags |= HYBRID_SLOT_BUSY;
            n++;
        }
        /* The other worker continues after this run */
        s->restore_cursor = first + n;
        if (zero) {
            for (i = 0; i < n; i++) {
                ret = hybrid_ram_fill(s, first + i, NULL);
                if (ret == 0) {
                    hybrid_region_set_valid(s, first + i);
                }
                hybrid_slot_unlock(s, &s->slots[first + i]);
            }
            trace_hybrid_restore_zero(s, first, n);
            s->restore_bytes += MIN(n << s->block_shift,
                                    s->size - (first << s->block_shift));
            continue;
        }
        off = first << s->block_shift;
        len = MIN(n << s->block_shift, s->size - off);
        buf = s->dedup ? bounce : hybrid_ram_plain_ptr(s, first);
        ret = bdrv_co_pread(s->bs->file, hybrid_host_offset(s, off), len,
                            buf, 0);
        trace_hybrid_restore_read(s, first, n, ret);
        for (i = 0; i < n; i++) {
            HybridSlot *slot = &s->slots[first + i];

            if (ret == 0) {
                if (s->dedup) {
                    if (len < (n << s->block_shift)) {
                        memset(bounce + len, 0, (n << s->block_shift) - len);
                    }
                    ret = hybrid_ram_fill(s, first + i,
                                          bounce + (i << s->block_shift));
                } else {
                    hybrid_ram_loaded_plain(s, first + i);
                }
            }
            hybrid_slot_unlock(s, slot);
        }
        if (ret < 0) {
            s->restore_error = ret;
            break;
        }
        s->restore_bytes += len;
    }
    qemu_vfree(bounce);
}

/* The last restore worker has stopped: finished, failed or paused. */
static void hybrid_restore_stopped(BDRVHybridState *s)
{
    if (s->restore_done) {
        return;
    }
    if (s->restore_cursor >= hybrid_ram_end(s) || s->restore_error) {
        s->restore_done = true;
        s->restore_end_ns = qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
        trace_hybrid_restore_done(s, s->restore_bytes, s->restore_error);
        qapi_event_send_hybrid_restore_completed(
            bdrv_get_node_name(s->bs), s->restore_bytes,
            (s->restore_end_ns - s->restore_start_ns) / SCALE_MS,
            s->restore_error ? strerror(-s->restore_error) : NULL);
        hybrid_mirror_prefill_kick(s);
    }
}

static void coroutine_fn hybrid_restore_entry(void *opaque)
{
    BDRVHybridState *s = opaque;
    BlockDriverState *bs = s->bs;

    GRAPH_RDLOCK_GUARD();
    hybrid_restore_run(s);
    if (--s->restore_workers == 0) {
        hybrid_restore_stopped(s);
    }
    qemu_co_queue_restart_all(&s->restore_queue);
    bdrv_dec_in_flight(bs);
}

/*
 * Two workers keep two large reads in flight, so that the page faults of
 * filling fresh RAM overlap with the next read (docs/hybrid.md, "Design
 * measurements").
 */
void hybrid_restore_kick(BDRVHybridState *s)
{
    Coroutine *co[HYBRID_RESTORE_WORKERS];
    int i;

    /*
     * Only a node that serves writes needs its RAM tier: a read-only one
     * (qemu-img info/convert, a read-only export) reads the persistent
     * tier directly.  Reopening it read-write drains it, and the end of
     * that drained section starts the restore.
     */
    if (!s->restore_enabled || s->restore_done || s->restore_workers ||
        s->quiesced || s->inactive || bdrv_is_read_only(s->bs)) {
        return;
    }
    if (!s->restore_start_ns) {
        s->restore_start_ns = qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
    }
    /* Count them all first: a worker may finish inside aio_co_enter() */
    for (i = 0; i < HYBRID_RESTORE_WORKERS; i++) {
        co[i] = qemu_coroutine_create(hybrid_restore_entry, s);
        s->restore_workers++;
        bdrv_inc_in_flight(s->bs);
    }
    for (i = 0; i < HYBRID_RESTORE_WORKERS; i++) {
        aio_co_enter(bdrv_get_aio_context(s->bs), co[i]);
    }
}
