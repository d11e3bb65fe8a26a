/*
 * Hybrid block format: promotion beyond the storage boundary
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Blocks beyond the RAM boundary that are read often get a read-only copy
 * in RAM (promote-size bytes, LRU); writes go through to the child and
 * update the copy, so demotion is just dropping it.
 */

#include "qemu/osdep.h"
#include "qemu/iov.h"
#include "qemu/memalign.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

static void hybrid_hot_drop(BDRVHybridState *s, HybridHot *h)
{
    g_hash_table_remove(s->hot, &h->idx);
    if (!h->loading) {
        QTAILQ_REMOVE(&s->hot_lru, h, lru);
    }
    qemu_vfree(h->data);
    g_free(h);
}

void hybrid_hot_drop_all(BDRVHybridState *s)
{
    GHashTableIter it;
    gpointer value;

    if (!s->hot) {
        return;
    }
    g_hash_table_iter_init(&it, s->hot);
    while (g_hash_table_iter_next(&it, NULL, &value)) {
        HybridHot *h = value;

        assert(!h->loading);
        QTAILQ_REMOVE(&s->hot_lru, h, lru);
        g_hash_table_iter_remove(&it);
        qemu_vfree(h->data);
        g_free(h);
    }
}

/* Count a child read of block @idx; true when it has turned hot. */
bool hybrid_heat(BDRVHybridState *s, uint64_t idx)
{
    uint32_t i = (idx * 0x9E3779B97F4A7C15ULL) >> 52;   /* 12 bits */

    if (++s->heat_ops % (HYBRID_HEAT_SLOTS * 16) == 0) {
        /* Decay, so that blocks hot long ago lose their claim */
        for (int j = 0; j < HYBRID_HEAT_SLOTS; j++) {
            s->heat[j] >>= 1;
        }
    }
    if (s->heat[i] < UINT8_MAX) {
        s->heat[i]++;
    }
    return s->heat[i] >= HYBRID_HEAT_PROMOTE;
}

/*
 * Bring block @idx (beyond the boundary) into RAM, demoting the least
 * recently used promoted block when full.
 */
void coroutine_fn GRAPH_RDLOCK
hybrid_promote(BDRVHybridState *s, uint64_t idx)
{
    HybridHot *h;
    int ret;

    if (g_hash_table_contains(s->hot, &idx)) {
        return;
    }
    if (g_hash_table_size(s->hot) >= s->promote_blocks) {
        h = QTAILQ_FIRST(&s->hot_lru);
        if (!h) {
            return;     /* all in flight */
        }
        trace_hybrid_demote(s, h->idx);
        hybrid_hot_drop(s, h);
        s->demotions++;
    }
    h = g_new0(HybridHot, 1);
    h->data = qemu_try_blockalign(s->bs->file->bs, s->block_size);
    if (!h->data) {
        g_free(h);
        return;
    }
    h->idx = idx;
    h->loading = true;
    g_hash_table_insert(s->hot, &h->idx, h);
    ret = bdrv_co_pread(s->bs->file, hybrid_host_offset(s, idx << s->block_shift),
                        hybrid_block_len(s, idx), h->data, 0);
    h->loading = false;
    QTAILQ_INSERT_TAIL(&s->hot_lru, h, lru);
    trace_hybrid_promote(s, idx, ret, h->stale);
    if (ret < 0 || h->stale) {
        hybrid_hot_drop(s, h);
        return;
    }
    s->promotions++;
}

/* Usable promoted copy of block @idx, or NULL. */
HybridHot *hybrid_hot_get(BDRVHybridState *s, uint64_t idx)
{
    HybridHot *h;

    if (!s->hot) {
        return NULL;
    }
    h = g_hash_table_lookup(s->hot, &idx);
    if (!h || h->loading) {
        return NULL;
    }
    QTAILQ_REMOVE(&s->hot_lru, h, lru);
    QTAILQ_INSERT_TAIL(&s->hot_lru, h, lru);
    return h;
}

/*
 * A write beyond the boundary is about to go to the child: keep promoted
 * copies equal to it (or mark loading ones stale).
 */
void hybrid_hot_write(BDRVHybridState *s, int64_t offset,
                      int64_t bytes, QEMUIOVector *qiov, size_t qoff)
{
    while (bytes > 0) {
        uint64_t idx = offset >> s->block_shift;
        uint32_t boff = offset & (s->block_size - 1);
        uint32_t len = MIN(bytes, s->block_size - boff);
        HybridHot *h = g_hash_table_lookup(s->hot, &idx);

        if (h && h->loading) {
            h->stale = true;
        } else if (h && qiov) {
            qemu_iovec_to_buf(qiov, qoff, h->data + boff, len);
        } else if (h) {
            memset(h->data + boff, 0, len);
        }
        offset += len;
        bytes -= len;
        qoff += len;
    }
}

/* The child write failed: promoted copies may differ from it now. */
void hybrid_hot_invalidate(BDRVHybridState *s, int64_t offset, int64_t bytes)
{
    uint64_t idx, last = (offset + bytes - 1) >> s->block_shift;

    for (idx = offset >> s->block_shift; idx <= last; idx++) {
        HybridHot *h = g_hash_table_lookup(s->hot, &idx);

        if (h && h->loading) {
            h->stale = true;
        } else if (h) {
            hybrid_hot_drop(s, h);
        }
    }
}
