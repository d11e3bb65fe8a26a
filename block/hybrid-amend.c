/*
 * Hybrid block format: changing an image (resize, amend) and measuring one
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Resize keeps the header the only truth about the virtual size, and keeps
 * it true across a crash at any point: growing extends the persistent tier
 * first and writes the header after; shrinking writes the header first and
 * cuts the tier after.  Either way a crash between the two leaves a header
 * describing a tier at least as long as it needs (docs/hybrid-format.rst,
 * "Resize").  The RAM tier keeps its geometry until the next open.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qemu/option.h"
#include "qapi/util.h"
#include "qapi/qapi-visit-block-core.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

/* Write the header (virtual size, defaults) and flush, under header_lock. */
static int coroutine_fn GRAPH_RDLOCK hybrid_update_header(BDRVHybridState *s)
{
    int ret;

    WITH_QEMU_LOCK_GUARD(&s->header_lock) {
        ret = hybrid_write_header(s, s->header.flags);
    }
    return ret;
}

/* The header's virtual size, written and flushed; unchanged on failure. */
static int coroutine_fn GRAPH_RDLOCK
hybrid_write_size(BDRVHybridState *s, uint64_t size, Error **errp)
{
    uint64_t old = s->header.virtual_size;
    int ret;

    s->header.virtual_size = size;
    ret = hybrid_update_header(s);
    if (ret < 0) {
        s->header.virtual_size = old;
        error_setg_errno(errp, -ret, "Could not write the new size to the "
                         "header");
    }
    return ret;
}

/*
 * Bytes of the new last block past @size read as zero in both tiers (a
 * later grow exposes them).  The caller holds nothing; the block layer
 * serialises the truncate against requests past the new end.
 */
static int coroutine_fn GRAPH_RDLOCK
hybrid_zero_tail(BDRVHybridState *s, uint64_t size)
{
    uint64_t idx = size >> s->block_shift;
    uint32_t boff = size & (s->block_size - 1);
    HybridSlot *slot = hybrid_slot(s, idx);
    int ret;

    if (!boff) {
        return 0;
    }
    ret = bdrv_co_pwrite_zeroes(s->bs->file, hybrid_host_offset(s, size),
                                s->block_size - boff, 0);
    if (ret < 0 || !slot) {
        return ret;
    }
    hybrid_slot_lock(s, slot);
    if (slot->flags & HYBRID_SLOT_LOADED) {
        const uint8_t *p = hybrid_ram_peek(s, idx);

        if (p && !buffer_is_zero(p + boff, s->block_size - boff)) {
            ret = hybrid_ram_write(s, idx, boff, NULL, 0,
                                   s->block_size - boff, false);
        }
    }
    hybrid_slot_unlock(s, slot);
    return ret;
}

int coroutine_fn GRAPH_RDLOCK
hybrid_co_truncate(BlockDriverState *bs, int64_t offset, bool exact,
                   PreallocMode prealloc, BdrvRequestFlags flags, Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    uint64_t old_size = s->size, new_size = offset;
    uint64_t new_len = s->data_offset + ROUND_UP(new_size, s->block_size);
    uint64_t first, i;
    int ret;

    if (s->raw) {
        error_setg(errp, "A raw=on hybrid node takes its size from the "
                   "persistent tier: resize that instead");
        return -ENOTSUP;
    }
    if (s->alloc && (old_size % s->block_size || offset % s->block_size)) {
        /* a partial last block may read from the backing image */
        error_setg(errp, "A hybrid image with a backing file is resized by "
                   "whole blocks: %" PRIu64 " and %" PRId64 " must be "
                   "multiples of %" PRIu32, old_size, offset, s->block_size);
        return -ENOTSUP;
    }
    if (s->alloc && offset / s->block_size > s->header.bitmap_blocks) {
        error_setg(errp, "The allocation bitmap of this image has room for %"
                   PRIu64 " blocks (%" PRIu64 " bytes of disk), not %" PRIu64,
                   s->header.bitmap_blocks,
                   s->header.bitmap_blocks * s->block_size,
                   offset / s->block_size);
        return -ENOSPC;
    }
    if (prealloc != PREALLOC_MODE_OFF) {
        error_setg(errp, "Unsupported preallocation mode '%s' (the hybrid "
                   "format is always sparse)", PreallocMode_str(prealloc));
        return -ENOTSUP;
    }
    if (offset < 0 || offset % BDRV_SECTOR_SIZE ||
        new_size > HYBRID_MAX_VIRTUAL_SIZE) {
        error_setg(errp, "New size %" PRId64 " is not a multiple of %llu up "
                   "to %llu", offset, BDRV_SECTOR_SIZE,
                   HYBRID_MAX_VIRTUAL_SIZE);
        return -EINVAL;
    }
    if (new_size == old_size) {
        return 0;
    }
    if (new_size > old_size) {
        uint64_t old_end = s->data_offset + ROUND_UP(old_size, s->block_size);
        int64_t tier_len = bdrv_co_getlength(bs->file->bs);

        if (tier_len < 0) {
            error_setg_errno(errp, -tier_len, "Could not get the size of the "
                             "persistent tier");
            return tier_len;
        }
        ret = bdrv_co_truncate(bs->file, new_len, false, PREALLOC_MODE_OFF, 0,
                               errp);
        if (ret < 0) {
            return ret;
        }
        /*
         * A tier longer than the old layout (a shrink that crashed before
         * cutting it) holds old data where the disk now grows: zero it.
         */
        if (tier_len > old_end) {
            ret = bdrv_co_pwrite_zeroes(bs->file, old_end,
                                        MIN(tier_len, new_len) - old_end,
                                        BDRV_REQ_MAY_UNMAP);
            if (ret < 0) {
                error_setg_errno(errp, -ret, "Could not clear the persistent "
                                 "tier past the old end");
                return ret;
            }
        }
        if (s->alloc) {
            ret = hybrid_backing_grow(s, old_size / s->block_size,
                                      new_size / s->block_size, errp);
            if (ret < 0) {
                return ret;
            }
        }
        ret = hybrid_write_size(s, new_size, errp);
        if (ret < 0) {
            return ret;
        }
    } else {
        /*
         * Nothing owed to the persistent tier may lie past the new end, and
         * nothing past it may stay in RAM (a later grow must read zeros).
         * Waiting for a busy block (restore, write-back) may yield; the
         * block layer keeps guest requests past the new end away meanwhile.
         */
        first = DIV_ROUND_UP(new_size, s->block_size);
        for (i = (new_size >> s->block_shift); i < hybrid_ram_end(s); i++) {
            HybridSlot *slot = &s->slots[i];

            hybrid_slot_lock(s, slot);
            if (slot->flags & (HYBRID_SLOT_DIRTY | HYBRID_SLOT_LISTED)) {
                hybrid_slot_unlock(s, slot);
                error_setg(errp, "Cannot shrink: block %" PRIu64 " (offset %"
                           PRIu64 ") is not written back yet; flush first",
                           i, i << s->block_shift);
                return -EBUSY;
            }
            if (i >= first) {
                hybrid_ram_unload(s, i);
            }
            hybrid_slot_unlock(s, slot);
        }
        ret = hybrid_zero_tail(s, new_size);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not clear the tail of the "
                             "new last block");
            return ret;
        }
        if (s->hot) {
            hybrid_hot_invalidate(s, new_size, old_size - new_size);
        }
        ret = hybrid_write_size(s, new_size, errp);
        if (ret < 0) {
            return ret;
        }
        /* The header is the truth now: a longer tier is harmless */
        ret = bdrv_co_truncate(bs->file, new_len, false, PREALLOC_MODE_OFF,
                               0, NULL);
        if (ret < 0) {
            warn_report("hybrid: node '%s': could not cut the persistent "
                        "tier to %" PRIu64 " bytes: %s (the image is "
                        "consistent; the space stays used)",
                        bdrv_get_node_name(bs), new_len, strerror(-ret));
        }
    }
    s->size = new_size;
    s->nb_blocks = DIV_ROUND_UP(new_size, s->block_size);
    hybrid_region_resized(s);
    hybrid_mirror_resized(s);
    trace_hybrid_truncate(s, old_size, new_size);
    return 0;
}

/* ---- amend ---- */

QemuOptsList hybrid_amend_opts = {
    .name = "hybrid-amend-opts",
    .head = QTAILQ_HEAD_INITIALIZER(hybrid_amend_opts.head),
    .desc = {
        HYBRID_HEADER_OPTIONS,
        { /* end of list */ }
    },
};

/*
 * Change the header's stored defaults: what was given in @new (has_*).
 * Everything is checked before anything is written; the header is one
 * write.  The node may be in use (x-blockdev-amend): the DIRTY flag this
 * open set is kept, a DIRTY flag found at open (an unclean shutdown) is
 * refused.
 */
static int GRAPH_RDLOCK
hybrid_amend(BlockDriverState *bs, BlockdevAmendOptionsHybrid *new,
             Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    HybridHeader h = s->header, le;
    int ret;

    if (s->raw) {
        error_setg(errp, "A raw=on hybrid node has no header to amend");
        return -ENOTSUP;
    }
    if (!s->header_dirty_on_disk &&
        ((s->header.flags & HYBRID_FLAG_DIRTY) ||
         (s->header.incompat_features & HYBRID_INCOMPAT_REGION))) {
        error_setg(errp, "The image was not closed cleanly (or its newest "
                   "writes are in a RAM region): open it read-write and "
                   "close it cleanly, or run 'qemu-img check -r all', first");
        return -EBUSY;
    }
    if (new->has_mode) {
        h.mode = new->mode == HYBRID_MODE_ASYNC ? HYBRID_HDR_MODE_ASYNC
                                                : HYBRID_HDR_MODE_SYNC;
    }
    if (new->has_dedup) {
        h.dedup = new->dedup;
    }
    if (new->has_ram_size) {
        h.ram_size = new->ram_size;
        ret = hybrid_check_ram_blocks(h.ram_size >> s->block_shift,
                                      h.ram_size, s->block_size, errp);
        ret = ret ?: hybrid_check_ram_size(h.ram_size, s->block_size,
                                           s->header.virtual_size, errp);
        if (ret < 0) {
            return ret;
        }
    }
    h.flags = s->header.flags;
    hybrid_header_to_le(&h, &le);
    ret = bdrv_pwrite(bs->file, 0, h.header_size, &le, 0);
    if (ret == 0) {
        ret = bdrv_flush(bs->file->bs);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not write the hybrid header");
        return ret;
    }
    s->header = h;
    return 0;
}

/* qemu-img amend -o mode=...,dedup=...,ram-size=... */
int GRAPH_RDLOCK
hybrid_amend_options(BlockDriverState *bs, QemuOpts *opts,
                     BlockDriverAmendStatusCB *status_cb, void *cb_opaque,
                     bool force, Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    BlockdevAmendOptionsHybrid new = { 0 };
    const char *mode;
    int ret;

    if (qemu_opt_find(opts, HYBRID_OPT_BLOCK_SIZE) &&
        qemu_opt_get_size(opts, HYBRID_OPT_BLOCK_SIZE, 0) != s->block_size) {
        error_setg(errp, "block-size cannot change in place (every block "
                   "would move): convert the image with -o block-size=...");
        return -ENOTSUP;
    }
    mode = qemu_opt_get(opts, HYBRID_OPT_MODE);
    if (mode) {
        int m = qapi_enum_parse(&HybridMode_lookup, mode, -1, NULL);

        if (m < 0) {
            error_setg(errp, "Invalid mode '%s' (sync or async)", mode);
            return -EINVAL;
        }
        new.has_mode = true;
        new.mode = m;
    }
    if (qemu_opt_find(opts, HYBRID_OPT_DEDUP)) {
        new.has_dedup = true;
        new.dedup = qemu_opt_get_bool(opts, HYBRID_OPT_DEDUP, false);
    }
    if (qemu_opt_find(opts, HYBRID_OPT_RAM_SIZE)) {
        new.has_ram_size = true;
        new.ram_size = qemu_opt_get_size(opts, HYBRID_OPT_RAM_SIZE, 0);
    }
    ret = hybrid_amend(bs, &new, errp);
    if (ret == 0 && status_cb) {
        status_cb(bs, 1, 1, cb_opaque);
    }
    return ret;
}

/* x-blockdev-amend, the node possibly in use */
int coroutine_fn GRAPH_RDLOCK
hybrid_co_amend(BlockDriverState *bs, BlockdevAmendOptions *opts, bool force,
                Error **errp)
{
    BDRVHybridState *s = bs->opaque;
    int ret;

    assert(opts->driver == BLOCKDEV_DRIVER_HYBRID);
    qemu_co_mutex_lock(&s->header_lock);
    ret = hybrid_amend(bs, &opts->u.hybrid, errp);
    qemu_co_mutex_unlock(&s->header_lock);
    return ret;
}

/* ---- measure ---- */

BlockMeasureInfo *hybrid_measure(QemuOpts *opts, BlockDriverState *in_bs,
                                 Error **errp)
{
    uint64_t bsz = qemu_opt_get_size(opts, HYBRID_OPT_BLOCK_SIZE,
                                     HYBRID_DEFAULT_BLOCK_SIZE);
    uint64_t size, required = 0;
    BlockMeasureInfo *info;

    if (hybrid_check_block_size_opt(bsz, errp) < 0) {
        return NULL;
    }
    if (in_bs) {
        int64_t len = bdrv_getlength(in_bs);
        int64_t offset, pnum;

        if (len < 0) {
            error_setg_errno(errp, -len, "Unable to get image size");
            return NULL;
        }
        size = ROUND_UP(len, BDRV_SECTOR_SIZE);
        /* Every block that holds data is written; zero ones stay holes */
        for (offset = 0; offset < len; offset += pnum) {
            int ret = bdrv_block_status_above(in_bs, NULL, offset,
                                              len - offset, &pnum, NULL,
                                              NULL);
            if (ret < 0) {
                error_setg_errno(errp, -ret, "Unable to get block status");
                return NULL;
            }
            if (!(ret & BDRV_BLOCK_ZERO) &&
                (ret & (BDRV_BLOCK_DATA | BDRV_BLOCK_ALLOCATED)) ==
                (BDRV_BLOCK_DATA | BDRV_BLOCK_ALLOCATED)) {
                /* The whole block is written: count it, continue after */
                pnum = ROUND_UP(offset + pnum, bsz) - offset;
                required += offset % bsz + pnum;
            }
        }
    } else {
        size = ROUND_UP(qemu_opt_get_size(opts, BLOCK_OPT_SIZE, 0),
                        BDRV_SECTOR_SIZE);
    }
    if (size > HYBRID_MAX_VIRTUAL_SIZE) {
        error_setg(errp, "size %" PRIu64 " is larger than %llu", size,
                   HYBRID_MAX_VIRTUAL_SIZE);
        return NULL;
    }
    info = g_new0(BlockMeasureInfo, 1);
    info->fully_allocated = HYBRID_DATA_OFFSET + ROUND_UP(size, bsz);
    info->required = HYBRID_DATA_OFFSET + MIN(required, ROUND_UP(size, bsz));
    return info;
}
