/*
 * Clone cache: the store's index, 2Q eviction and filler
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * The whole index lives in memory under one mutex: (base, block) entries
 * point at slots, slots hold content once (found by fingerprint, confirmed
 * byte by byte), and 2Q queues order the slots for eviction.  One filler
 * coroutine writes what the nodes read from their bases, in batches whose
 * write order keeps every record on disk true (docs/clone-cache-format.rst).
 */

#include "qemu/osdep.h"
#include "qemu/crc32c.h"
#include "qemu/error-report.h"
#include "qemu/guest-random.h"
#include "qemu/main-loop.h"
#include "qemu/iov.h"
#include "qemu/memalign.h"
#include "qemu/units.h"
#include "qapi/error.h"
#include "block/aio-wait.h"
#include "block/block-global-state.h"
#include "system/block-backend.h"
#include "content-fp.h"
#include "clone-cache.h"
#include "trace.h"

#define CC_BATCH            64
#define CC_SWEEP_STEP       4096    /* entries or slots per step under lock */

/* ---- 2Q queues and the ghost list ---- */

static CloneCacheSlotList *cc_queue(CloneCacheStore *s, uint8_t q,
                                    uint64_t **count)
{
    switch (q) {
    case CC_Q_A1IN:
        *count = &s->nb_a1in;
        return &s->a1in;
    case CC_Q_AM:
        *count = &s->nb_am;
        return &s->am;
    case CC_Q_FREE:
        *count = &s->nb_free;
        return &s->free_slots;
    default:
        *count = q == CC_Q_PINNED ? &s->nb_pinned : NULL;
        return NULL;
    }
}

static void cc_queue_remove(CloneCacheStore *s, CloneCacheSlot *sl)
{
    uint64_t *count;
    CloneCacheSlotList *list = cc_queue(s, sl->queue, &count);

    if (list) {
        QTAILQ_REMOVE(list, sl, link);
    }
    if (count) {
        (*count)--;
    }
    sl->queue = CC_Q_NONE;
}

void cc_queue_add(CloneCacheStore *s, CloneCacheSlot *sl, uint8_t q)
{
    uint64_t *count;
    CloneCacheSlotList *list = cc_queue(s, q, &count);

    assert(sl->queue == CC_Q_NONE);
    if (list) {
        QTAILQ_INSERT_TAIL(list, sl, link);
    }
    if (count) {
        (*count)++;
    }
    sl->queue = q;
}

/* A hit: an Am slot becomes the most recently used; A1in stays FIFO */
static void cc_touch(CloneCacheStore *s, CloneCacheSlot *sl)
{
    if (sl->queue == CC_Q_AM) {
        QTAILQ_REMOVE(&s->am, sl, link);
        QTAILQ_INSERT_TAIL(&s->am, sl, link);
    }
}

static void cc_ghost_add(CloneCacheStore *s, uint64_t key)
{
    uint64_t *k;

    if (g_hash_table_contains(s->ghost, &key)) {
        return;
    }
    while (g_queue_get_length(&s->ghost_fifo) >= MAX(s->nb_slots / 2, 1)) {
        k = g_queue_pop_head(&s->ghost_fifo);
        g_hash_table_remove(s->ghost, k);
        g_free(k);
    }
    k = g_new(uint64_t, 1);
    *k = key;
    g_queue_push_tail(&s->ghost_fifo, k);
    g_hash_table_add(s->ghost, k);
}

/* ---- index ---- */

void cc_fp_insert(CloneCacheStore *s, uint32_t i)
{
    CloneCacheSlot *sl = &s->slots[i];
    gpointer first = g_hash_table_lookup(s->fps, &sl->fp);

    sl->fp_next = first ? GPOINTER_TO_UINT(first) - 1 : CC_NONE;
    g_hash_table_insert(s->fps, &sl->fp, GUINT_TO_POINTER(i + 1));
}

static void cc_fp_remove(CloneCacheStore *s, uint32_t i)
{
    CloneCacheSlot *sl = &s->slots[i];
    uint32_t first = GPOINTER_TO_UINT(g_hash_table_lookup(s->fps, &sl->fp));
    uint32_t *pp, j;

    assert(first);
    if (first - 1 == i) {
        g_hash_table_remove(s->fps, &sl->fp);
        if (sl->fp_next != CC_NONE) {
            CloneCacheSlot *n = &s->slots[sl->fp_next];
            g_hash_table_insert(s->fps, &n->fp,
                                GUINT_TO_POINTER(sl->fp_next + 1));
        }
        return;
    }
    for (j = first - 1; s->slots[j].fp_next != i; j = s->slots[j].fp_next) {
        assert(s->slots[j].fp_next != CC_NONE);
    }
    pp = &s->slots[j].fp_next;
    *pp = sl->fp_next;
}

static bool cc_entry_stale(CloneCacheStore *s, CloneCacheEntry *en)
{
    return en->gen != s->bases[en->key >> CC_BLOCK_BITS].gen;
}

static void cc_entry_free(CloneCacheStore *s, uint32_t e)
{
    CloneCacheEntry *en = &s->entries[e];
    int b = en->key >> CC_BLOCK_BITS;

    if (g_hash_table_lookup(s->map, &en->key) == en) {
        g_hash_table_remove(s->map, &en->key);
    }
    if (cc_entry_stale(s, en)) {
        s->nb_stale_entries--;
    } else {
        s->bases[b].nb_entries--;
    }
    en->used = false;
    s->free_entries[s->nb_free_entries++] = e;
}

/*
 * A slot out of service goes on the free list once nobody reads it: a
 * reader between its lookup and its check must never find other data (or
 * other sums) in it.  Its on-disk record may still say valid (STALE), so
 * it is invalidated on disk before new data goes in.
 */
static void cc_slot_retire(CloneCacheStore *s, CloneCacheSlot *sl)
{
    if (sl->readers) {
        sl->state = CC_SLOT_RETIRED;
    } else {
        sl->state = CC_SLOT_STALE;
        cc_queue_add(s, sl, CC_Q_FREE);
    }
}

/* Let go of a reader reference taken under the lock (lock held) */
static void cc_slot_unref(CloneCacheStore *s, CloneCacheSlot *sl)
{
    assert(sl->readers > 0);
    if (--sl->readers == 0 && sl->state == CC_SLOT_RETIRED) {
        sl->state = CC_SLOT_STALE;
        cc_queue_add(s, sl, CC_Q_FREE);
    }
}

/*
 * Take a slot out of service: its entries go, and so does the slot (once
 * no reader holds it).  @ghost: remember the keys for 2Q admission.
 */
static void cc_slot_drop(CloneCacheStore *s, uint32_t i, bool ghost)
{
    CloneCacheSlot *sl = &s->slots[i];
    uint32_t e, next;

    assert(sl->state == CC_SLOT_VALID);
    for (e = sl->first_entry; e != CC_NONE; e = next) {
        next = s->entries[e].next;
        if (ghost) {
            cc_ghost_add(s, s->entries[e].key);
        }
        cc_entry_free(s, e);
    }
    sl->first_entry = CC_NONE;
    sl->refcnt = 0;
    cc_fp_remove(s, i);
    cc_queue_remove(s, sl);
    sl->pinned = false;
    cc_slot_retire(s, sl);
}

/* Drop one entry; its slot goes when nothing else points at it */
static void cc_entry_drop(CloneCacheStore *s, uint32_t e)
{
    CloneCacheEntry *en = &s->entries[e];
    CloneCacheSlot *sl = &s->slots[en->slot];
    uint32_t *pp;

    for (pp = &sl->first_entry; *pp != e; pp = &s->entries[*pp].next) {
        assert(*pp != CC_NONE);
    }
    *pp = en->next;
    cc_entry_free(s, e);
    if (--sl->refcnt == 0) {
        cc_slot_drop(s, sl - s->slots, false);
    }
}

static CloneCacheSlot *cc_victim(CloneCacheSlotList *list)
{
    CloneCacheSlot *sl;

    QTAILQ_FOREACH(sl, list, link) {
        if (!sl->readers) {
            return sl;
        }
    }
    return NULL;
}

/* 2Q: evict from A1in while it holds more than its quarter, else from Am */
static bool cc_evict_one(CloneCacheStore *s)
{
    CloneCacheSlot *sl = NULL;
    bool from_a1in = s->nb_a1in > s->nb_slots / 4 || !s->nb_am;

    sl = cc_victim(from_a1in ? &s->a1in : &s->am);
    if (!sl) {
        from_a1in = !from_a1in;
        sl = cc_victim(from_a1in ? &s->a1in : &s->am);
    }
    if (!sl) {
        return false;
    }
    trace_clone_cache_evict(s, sl - s->slots, from_a1in, sl->refcnt);
    cc_slot_drop(s, sl - s->slots, from_a1in);
    s->evictions++;
    return true;
}

/* The live entry of @key, or NULL; a stale one met is dropped */
static CloneCacheEntry *cc_entry_find(CloneCacheStore *s, uint64_t key)
{
    CloneCacheEntry *en = g_hash_table_lookup(s->map, &key);

    if (en && cc_entry_stale(s, en)) {
        cc_entry_drop(s, en - s->entries);
        return NULL;
    }
    return en;
}

bool clone_cache_has(CloneCacheStore *s, int base, uint64_t block)
{
    return cc_entry_find(s, clone_cache_key(base, block));
}

static uint32_t cc_alloc_entry(CloneCacheStore *s)
{
    if (!s->nb_free_entries && !cc_evict_one(s)) {
        return CC_NONE;
    }
    return s->free_entries[--s->nb_free_entries];
}

/* A slot for new data, and whether its record must be invalidated first */
static uint32_t cc_alloc_slot(CloneCacheStore *s, bool *stale)
{
    CloneCacheSlot *sl;

    if (!s->nb_free && !cc_evict_one(s)) {
        return CC_NONE;
    }
    sl = QTAILQ_FIRST(&s->free_slots);
    assert(!sl->readers);
    cc_queue_remove(s, sl);
    *stale = sl->state == CC_SLOT_STALE;
    sl->state = CC_SLOT_FILLING;
    return sl - s->slots;
}

uint32_t clone_cache_lookup(CloneCacheStore *s, int base, uint64_t block)
{
    CloneCacheEntry *en = cc_entry_find(s, clone_cache_key(base, block));
    CloneCacheSlot *sl;

    if (!en) {
        return CC_NONE;
    }
    sl = &s->slots[en->slot];
    assert(sl->state == CC_SLOT_VALID);
    cc_touch(s, sl);
    sl->readers++;
    return en->slot;
}

/*
 * Read the slot's bytes [start, end) (whole 4 KiB pieces, or up to the end
 * of a short last block) into @qiov at @qiov_offset and check them against
 * @sums.  Straight into the caller's buffers: no bounce, no copy.
 */
static int coroutine_fn cc_read_direct(CloneCacheStore *s, uint32_t slot,
                                       const uint32_t *sums, uint32_t start,
                                       uint32_t end, QEMUIOVector *qiov,
                                       size_t qiov_offset)
{
    int ret = blk_co_preadv_part(s->blk, s->data_off +
                                 (uint64_t)slot * s->block_size + start,
                                 end - start, qiov, qiov_offset, 0);

    if (ret == 0 && !cc_check_sums_qiov(sums, qiov, qiov_offset, start, end)) {
        ret = -EIO;
    }
    return ret;
}

/*
 * The same through a bounce buffer of the pieces that [offset, offset +
 * bytes) falls in, [start, end): the bytes asked for are copied into @qiov
 * once the pieces check.
 */
static int coroutine_fn cc_read_bounce(CloneCacheStore *s, uint32_t slot,
                                       const uint32_t *sums, uint32_t start,
                                       uint32_t end, uint32_t offset,
                                       uint32_t bytes, QEMUIOVector *qiov,
                                       size_t qiov_offset)
{
    uint8_t *buf = qemu_try_blockalign(blk_bs(s->blk), end - start);
    QEMUIOVector bq;
    int ret;

    if (!buf) {
        return -ENOMEM;
    }
    qemu_iovec_init_buf(&bq, buf, end - start);
    ret = cc_read_direct(s, slot, sums, start, end, &bq, 0);
    if (ret == 0) {
        qemu_iovec_from_buf(qiov, qiov_offset, buf + (offset - start), bytes);
    }
    qemu_vfree(buf);
    return ret;
}

/*
 * Read bytes [offset, offset + bytes) of a slot that clone_cache_lookup()
 * returned (and so holds a reader reference on) into @qiov at
 * @qiov_offset, check the 4 KiB pieces they fall in against the slot's
 * sums, and release it.  A range of whole pieces is read straight into
 * @qiov and checked there; any other through a bounce buffer of its
 * pieces.  Either way @qiov holds checked bytes when this returns 0, and
 * unchecked ones otherwise (the caller reads the base over them).
 *
 * The reference keeps the slot from being reused, and the slot's sequence
 * is checked again after the read: anything changed meanwhile (the slot
 * dropped, its base invalidated) is a miss, -EAGAIN.  -EIO when the data
 * cannot be trusted: the slot is dropped.  Either way the caller reads the
 * base instead.  A check that fails in @qiov is made again through a
 * bounce buffer before the slot is dropped: @qiov may be memory its owner
 * can change under the read (a guest's), which must not cost the other
 * readers of the slot their cached block.
 */
int coroutine_fn clone_cache_read_slot(CloneCacheStore *s, int base,
                                       uint32_t slot, uint32_t offset,
                                       uint32_t bytes, QEMUIOVector *qiov,
                                       size_t qiov_offset)
{
    CloneCacheSlot *sl = &s->slots[slot];
    uint32_t start = QEMU_ALIGN_DOWN(offset, CC_SUB), end;
    uint32_t sums[CC_MAX_BLOCK / CC_SUB];
    uint64_t seq, delay = qatomic_read(&s->read_delay_ns);
    bool same, direct;
    int ret;

    qemu_mutex_lock(&s->lock);
    assert(sl->readers && sl->state == CC_SLOT_VALID);
    seq = sl->seq;
    end = MIN(ROUND_UP(offset + bytes, CC_SUB), sl->len);
    cc_copy_sums(s, slot, start, end, sums);
    qemu_mutex_unlock(&s->lock);

    if (delay) {
        trace_clone_cache_read_delay(s, slot, delay);
        qemu_co_sleep_ns(QEMU_CLOCK_REALTIME, delay);
    }
    direct = start == offset && end == offset + bytes;
    trace_clone_cache_read_slot(s, slot, start, end, direct);
    ret = -EIO;
    if (direct) {
        ret = cc_read_direct(s, slot, sums, start, end, qiov, qiov_offset);
    }
    if (ret == -EIO) {
        ret = cc_read_bounce(s, slot, sums, start, end, offset, bytes, qiov,
                             qiov_offset);
    }

    qemu_mutex_lock(&s->lock);
    same = sl->state == CC_SLOT_VALID && sl->seq == seq;
    if (!same) {
        ret = -EAGAIN;
        trace_clone_cache_slot_changed(s, slot);
    } else if (ret < 0) {
        s->checksum_errors++;
        trace_clone_cache_bad_slot(s, slot, ret);
        cc_slot_drop(s, slot, false);
    } else if (ret == 0) {
        s->bases[base].st.hits++;
        s->bases[base].st.cache_read_bytes += end - start;
    }
    cc_slot_unref(s, sl);
    qemu_mutex_unlock(&s->lock);
    if (ret == -EIO) {
        error_report("clone-cache '%s': block in slot %" PRIu32 " fails its "
                     "checksum; it is discarded and read from the base",
                     s->filename, slot);
    }
    return ret;
}

/*
 * A block read from the base whose fill is not written yet: copy
 * [offset, offset + bytes) of it into @qiov.  The reader saves a base read
 * (it counts as a merged miss).  Lock held.
 */
bool clone_cache_read_pending(CloneCacheStore *s, int base, uint64_t block,
                              uint64_t offset, uint64_t bytes,
                              QEMUIOVector *qiov, size_t qiov_offset)
{
    uint64_t key = clone_cache_key(base, block);
    CloneCacheFill *f = g_hash_table_lookup(s->pending, &key);

    /* a fill read before its base was invalidated is not served */
    if (!f || f->nonce != s->bases[base].nonce || offset + bytes > f->len) {
        return false;
    }
    qemu_iovec_from_buf(qiov, qiov_offset, f->data + offset, bytes);
    return true;
}

/* ---- pinning ---- */

/*
 * Pin or unpin a slot in memory and on disk; the caller holds a reader
 * reference on it, which keeps its content while the record is written.
 * When the record cannot be written the slot goes back to what the disk
 * says.  Lock not held.
 */
static int coroutine_fn cc_set_pinned(CloneCacheStore *s, uint32_t slot,
                                      bool pin)
{
    CloneCacheSlot *sl = &s->slots[slot];
    uint64_t seq;
    int ret;

    qemu_mutex_lock(&s->lock);
    if (sl->state != CC_SLOT_VALID || sl->pinned == pin ||
        (pin && s->nb_pinned >= s->nb_slots / 2)) {
        qemu_mutex_unlock(&s->lock);
        return 0;
    }
    seq = sl->seq;
    cc_queue_remove(s, sl);
    sl->pinned = pin;
    cc_queue_add(s, sl, pin ? CC_Q_PINNED : CC_Q_AM);
    qemu_mutex_unlock(&s->lock);

    ret = cc_write_slot_rec(s, slot, true);
    if (ret < 0) {
        qemu_mutex_lock(&s->lock);
        if (sl->state == CC_SLOT_VALID && sl->seq == seq &&
            sl->pinned == pin) {
            cc_queue_remove(s, sl);
            sl->pinned = !pin;
            cc_queue_add(s, sl, sl->pinned ? CC_Q_PINNED : CC_Q_AM);
        }
        qemu_mutex_unlock(&s->lock);
        trace_clone_cache_pin_failed(s, slot, pin, ret);
    }
    return ret;
}

int coroutine_fn clone_cache_pin(CloneCacheStore *s, uint32_t slot, bool pin)
{
    int ret = pin ? cc_set_pinned(s, slot, true) : 0;

    qemu_mutex_lock(&s->lock);
    cc_slot_unref(s, &s->slots[slot]);
    qemu_mutex_unlock(&s->lock);
    return ret;
}

/* Whether a live entry of @base points at the slot (lock held) */
static bool cc_slot_serves(CloneCacheStore *s, CloneCacheSlot *sl, int base)
{
    uint32_t e;

    for (e = sl->first_entry; e != CC_NONE; e = s->entries[e].next) {
        CloneCacheEntry *en = &s->entries[e];

        if (en->key >> CC_BLOCK_BITS == base && !cc_entry_stale(s, en)) {
            return true;
        }
    }
    return false;
}

/*
 * Unpin the slots that serve @base: the slot table in steps of
 * CC_SWEEP_STEP under the lock, yielding between them, so that requests
 * never wait on a whole-table scan.
 */
int coroutine_fn clone_cache_unpin_base(CloneCacheStore *s, int base,
                                        Error **errp)
{
    g_autofree uint32_t *todo = g_new(uint32_t, CC_SWEEP_STEP);
    uint64_t i, j, failed = 0;
    uint32_t n, k;
    int ret = 0;

    for (i = 0; i < s->nb_slots; i += CC_SWEEP_STEP) {
        uint64_t end = MIN(i + CC_SWEEP_STEP, s->nb_slots);

        qemu_mutex_lock(&s->lock);
        for (n = 0, j = i; j < end; j++) {
            CloneCacheSlot *sl = &s->slots[j];

            if (sl->pinned && cc_slot_serves(s, sl, base)) {
                sl->readers++;          /* released below */
                todo[n++] = j;
            }
        }
        qemu_mutex_unlock(&s->lock);
        for (k = 0; k < n; k++) {
            if (cc_set_pinned(s, todo[k], false) < 0) {
                failed++;
            }
            qemu_mutex_lock(&s->lock);
            cc_slot_unref(s, &s->slots[todo[k]]);
            qemu_mutex_unlock(&s->lock);
        }
        aio_co_schedule(qemu_get_current_aio_context(), qemu_coroutine_self());
        qemu_coroutine_yield();
    }
    if (failed) {
        error_setg(errp, "clone-cache '%s': %" PRIu64 " pinned blocks could "
                   "not be unpinned (their records cannot be written); they "
                   "stay pinned", s->filename, failed);
        ret = -EIO;
    }
    return ret;
}

/* ---- the filler ---- */

static void coroutine_fn cc_filler(void *opaque);

/*
 * Queue a block read from a base for filling.  @nonce: the base's nonce
 * when the read began; a base invalidated since gets none of it.
 */
void clone_cache_queue_fill(CloneCacheStore *s, int base, uint64_t nonce,
                            uint64_t block, const uint8_t *data,
                            uint32_t len, bool pin)
{
    CloneCacheBase *b = &s->bases[base];
    CloneCacheFill *f;
    bool start = false;

    qemu_mutex_lock(&s->lock);
    if (g_hash_table_contains(s->pending, &(uint64_t){
                              clone_cache_key(base, block) })) {
        qemu_mutex_unlock(&s->lock);
        return;                 /* read twice before its fill was written */
    }
    if (s->fill_pending + len > s->fill_limit || !s->blk ||
        b->nonce != nonce) {
        b->st.fills_dropped++;
        qemu_mutex_unlock(&s->lock);
        trace_clone_cache_fill_dropped(s, base, block);
        return;
    }
    f = g_new0(CloneCacheFill, 1);
    f->key = clone_cache_key(base, block);
    f->nonce = nonce;
    f->len = len;
    f->pin = pin;
    f->data = qemu_blockalign(blk_bs(s->blk), len);
    memcpy(f->data, data, len);
    QSIMPLEQ_INSERT_TAIL(&s->fills, f, next);
    g_hash_table_insert(s->pending, &f->key, f);
    s->fill_pending += len;
    if (!s->filler_running) {
        s->filler_running = true;
        start = true;
    }
    qemu_mutex_unlock(&s->lock);

    if (start) {
        aio_co_enter(qemu_get_aio_context(),
                     qemu_coroutine_create(cc_filler, s));
    }
}

bool clone_cache_fill_room(CloneCacheStore *s, uint64_t len)
{
    return s->blk && s->fill_pending + len <= s->fill_limit;
}

static void cc_fill_free(CloneCacheFill *f)
{
    qemu_vfree(f->data);
    g_free(f);
}

/* What the filler decided for one fill of a batch */
typedef struct CloneCacheFillPlan {
    uint32_t entry;             /* entry it will take */
    uint64_t seq;               /* seq of the slot it points to */
    bool ok;
    bool held;                  /* holds a reader on a slot in service */
} CloneCacheFillPlan;

/*
 * Choose where a fill goes.  Content already in the cache (same
 * fingerprint, length and bytes: a fingerprint is never trusted alone) is
 * shared; else a new slot.  Returns false to drop the fill.
 */
static bool coroutine_fn cc_fill_prepare(CloneCacheStore *s,
                                         CloneCacheFill **batch, int n,
                                         CloneCacheFillPlan *plan,
                                         bool *stale)
{
    CloneCacheFill *f = batch[n];
    uint64_t fp = content_fingerprint(f->data, f->len) & s->fp_mask;
    int b = f->key >> CC_BLOCK_BITS;
    uint32_t sums[CC_MAX_BLOCK / CC_SUB];
    uint8_t *buf = NULL;
    uint32_t i, first;
    int k;

    *stale = false;
    f->slot = CC_NONE;
    f->shared = false;
    qemu_mutex_lock(&s->lock);
    if (s->bases[b].nonce != f->nonce || cc_entry_find(s, f->key)) {
        goto fail;
    }
    /* the same content earlier in this batch */
    for (k = 0; k < n; k++) {
        CloneCacheFill *g = batch[k];

        if (g->slot != CC_NONE && !g->shared && s->slots[g->slot].fp == fp &&
            g->len == f->len && !memcmp(g->data, f->data, f->len)) {
            f->slot = g->slot;
            f->shared = true;
            plan->seq = s->slots[f->slot].seq;
            goto entry;
        }
    }
    /* the same content in the cache: read it back and compare */
    first = GPOINTER_TO_UINT(g_hash_table_lookup(s->fps, &fp));
    for (i = first ? first - 1 : CC_NONE; i != CC_NONE;
         i = s->slots[i].fp_next) {
        CloneCacheSlot *sl = &s->slots[i];
        uint64_t seq = sl->seq;
        bool same;

        if (sl->len != f->len) {
            continue;
        }
        sl->readers++;
        cc_copy_sums(s, i, 0, f->len, sums);
        qemu_mutex_unlock(&s->lock);
        buf = buf ? buf : qemu_blockalign(blk_bs(s->blk), f->len);
        same = blk_co_pread(s->blk,
                            s->data_off + (uint64_t)i * s->block_size,
                            f->len, buf, 0) == 0 &&
               cc_check_sums(sums, buf, 0, f->len) &&
               !memcmp(buf, f->data, f->len);
        qemu_mutex_lock(&s->lock);
        if (same && sl->state == CC_SLOT_VALID && sl->seq == seq) {
            f->slot = i;
            f->shared = true;
            plan->seq = seq;
            plan->held = true;      /* the reader is kept until published */
            goto entry;
        }
        if (sl->state != CC_SLOT_VALID) {
            cc_slot_unref(s, sl);
            break;                  /* dropped meanwhile: chain changed */
        }
        cc_slot_unref(s, sl);
        trace_clone_cache_fp_clash(s, i, fp);
    }
    /* only the filler fills: no other coroutine can take this content */
    f->slot = cc_alloc_slot(s, stale);
    if (f->slot == CC_NONE) {
        goto fail;
    }
    s->slots[f->slot].fp = fp;
    s->slots[f->slot].len = f->len;
    cc_compute_sums(f->data, f->len, &s->sums[(uint64_t)f->slot * s->spb]);
    s->slots[f->slot].seq = ++s->seq;
    /* decided now: the slot's record, written before publishing, says it */
    s->slots[f->slot].pinned = f->pin && s->nb_pinned < s->nb_slots / 2;
    plan->seq = s->slots[f->slot].seq;

entry:
    plan->entry = cc_alloc_entry(s);
    if (plan->entry != CC_NONE) {
        qemu_mutex_unlock(&s->lock);
        qemu_vfree(buf);
        return true;
    }
    if (plan->held) {
        cc_slot_unref(s, &s->slots[f->slot]);
        plan->held = false;
    } else if (!f->shared) {
        s->slots[f->slot].state = *stale ? CC_SLOT_STALE : CC_SLOT_FREE;
        cc_queue_add(s, &s->slots[f->slot], CC_Q_FREE);
        *stale = false;
    }
    f->slot = CC_NONE;
fail:
    s->bases[b].st.fills_dropped++;
    qemu_mutex_unlock(&s->lock);
    qemu_vfree(buf);
    return false;
}

/* Put a prepared fill in service, or give back what it took (lock held) */
static void cc_fill_publish(CloneCacheStore *s, CloneCacheFill *f,
                            CloneCacheFillPlan *plan)
{
    CloneCacheSlot *sl = &s->slots[f->slot];
    CloneCacheBase *base = &s->bases[f->key >> CC_BLOCK_BITS];
    CloneCacheEntry *en = &s->entries[plan->entry];
    bool ok;

    ok = plan->ok && base->nonce == f->nonce && sl->seq == plan->seq &&
         !cc_entry_find(s, f->key) &&
         sl->state == (f->shared ? CC_SLOT_VALID : CC_SLOT_FILLING);
    if (plan->held) {
        cc_slot_unref(s, sl);   /* after the check: it may free the slot */
    }
    if (!ok) {
        if (!f->shared && sl->state == CC_SLOT_FILLING) {
            /* its data or record may have reached the disk */
            sl->state = CC_SLOT_STALE;
            sl->pinned = false;
            cc_queue_add(s, sl, CC_Q_FREE);
        }
        s->free_entries[s->nb_free_entries++] = plan->entry;
        base->st.fills_dropped++;
        return;
    }
    if (!f->shared) {
        sl->state = CC_SLOT_VALID;
        sl->refcnt = 0;
        sl->first_entry = CC_NONE;
        cc_fp_insert(s, f->slot);
        if (sl->pinned) {
            cc_queue_add(s, sl, CC_Q_PINNED);
        } else {
            cc_queue_add(s, sl, g_hash_table_contains(s->ghost, &f->key)
                                ? CC_Q_AM : CC_Q_A1IN);
        }
        base->st.fills++;
        base->st.fill_bytes += f->len;
    } else {
        s->dedup_shared++;
        cc_touch(s, sl);
    }
    en->key = f->key;
    en->slot = f->slot;
    en->gen = base->gen;
    en->used = true;
    en->next = sl->first_entry;
    sl->first_entry = plan->entry;
    sl->refcnt++;
    base->nb_entries++;
    g_hash_table_insert(s->map, &en->key, en);
    trace_clone_cache_fill(s, f->key >> CC_BLOCK_BITS,
                           f->key & ((1ULL << CC_BLOCK_BITS) - 1), f->slot,
                           f->shared);
}

/*
 * Write one batch.  Order (docs/clone-cache-format.rst): records of reused slots
 * invalidated and flushed; data written and flushed; then slot and entry
 * records.  A slot record on disk therefore always describes data that is
 * on disk, and an entry only counts when its slot record's seq matches.
 */
static void coroutine_fn cc_fill_batch(CloneCacheStore *s,
                                       CloneCacheFill **batch, int n)
{
    CloneCacheFillPlan plan[CC_BATCH] = {};
    bool stale, any_stale = false, any_data = false;
    int i, ret = 0;

    for (i = 0; i < n; i++) {
        plan[i].ok = cc_fill_prepare(s, batch, i, &plan[i], &stale);
        if (stale) {
            any_stale = true;
            if (cc_write_slot_rec(s, batch[i]->slot, false) < 0) {
                plan[i].ok = false;
            }
        }
        any_data |= plan[i].ok && !batch[i]->shared;
    }
    if (any_stale) {
        ret = blk_co_flush(s->blk);
    }
    for (i = 0; i < n && ret == 0; i++) {
        if (plan[i].ok && !batch[i]->shared) {
            plan[i].ok = blk_co_pwrite(s->blk, s->data_off +
                                       (uint64_t)batch[i]->slot *
                                       s->block_size, batch[i]->len,
                                       batch[i]->data, 0) == 0;
        }
    }
    if (any_data && ret == 0) {
        ret = blk_co_flush(s->blk);
    }
    for (i = 0; i < n; i++) {
        CloneCacheFill *f = batch[i];

        if (f->slot == CC_NONE) {
            continue;
        }
        plan[i].ok = plan[i].ok && ret == 0 &&
                     (f->shared || (cc_write_sums(s, f->slot) == 0 &&
                                    cc_write_slot_rec(s, f->slot, true) == 0));
        if (plan[i].ok) {
            /* an entry record that fails to land is a miss after restart */
            cc_write_entry_rec(s, plan[i].entry, f->key, f->nonce, f->slot,
                               plan[i].seq);
        }
    }

    qemu_mutex_lock(&s->lock);
    for (i = 0; i < n; i++) {
        if (batch[i]->slot == CC_NONE) {
            continue;
        }
        if (!plan[i].ok) {
            s->fill_errors++;
        }
        cc_fill_publish(s, batch[i], &plan[i]);
    }
    qemu_mutex_unlock(&s->lock);
    if (s->fill_errors && !s->fill_error_reported) {
        s->fill_error_reported = true;
        warn_report("clone-cache '%s': writing the cache failed (%s); reads "
                    "are served from the base while it fails", s->filename,
                    ret < 0 ? strerror(-ret) : "a write failed");
    }
}

static void coroutine_fn cc_filler(void *opaque)
{
    CloneCacheStore *s = opaque;
    CloneCacheFill *batch[CC_BATCH];
    int n, i;

    for (;;) {
        qemu_mutex_lock(&s->lock);
        for (n = 0; n < CC_BATCH && !QSIMPLEQ_EMPTY(&s->fills); n++) {
            batch[n] = QSIMPLEQ_FIRST(&s->fills);
            QSIMPLEQ_REMOVE_HEAD(&s->fills, next);
        }
        if (!n) {
            s->filler_running = false;
            qemu_mutex_unlock(&s->lock);
            aio_wait_kick();
            return;
        }
        qemu_mutex_unlock(&s->lock);

        cc_fill_batch(s, batch, n);

        qemu_mutex_lock(&s->lock);
        for (i = 0; i < n; i++) {
            s->fill_pending -= batch[i]->len;
            g_hash_table_remove(s->pending, &batch[i]->key);
            cc_fill_free(batch[i]);
        }
        qemu_mutex_unlock(&s->lock);
    }
}

/* Drop the fills not started, wait for the filler and the sweep (main loop) */
void clone_cache_quiesce(CloneCacheStore *s)
{
    CloneCacheFill *f;

    qemu_mutex_lock(&s->lock);
    s->closing = true;
    while ((f = QSIMPLEQ_FIRST(&s->fills))) {
        QSIMPLEQ_REMOVE_HEAD(&s->fills, next);
        s->fill_pending -= f->len;
        g_hash_table_remove(s->pending, &f->key);
        cc_fill_free(f);
    }
    qemu_mutex_unlock(&s->lock);
    AIO_WAIT_WHILE_UNLOCKED(NULL, qatomic_read(&s->filler_running) ||
                                  qatomic_read(&s->sweeping));
}

/* ---- bases ---- */

/*
 * Free the entries of invalidated bases (and the slots only they used), a
 * step of CC_SWEEP_STEP entries at a time under the lock, yielding to the
 * main loop between steps.  Until then they are invisible, not wrong.
 */
static void coroutine_fn cc_sweep(void *opaque)
{
    CloneCacheStore *s = opaque;
    uint64_t e = 0, swept = 0;

    qemu_mutex_lock(&s->lock);
    while (!s->closing && s->nb_stale_entries) {
        uint64_t end = MIN(e + CC_SWEEP_STEP, s->nb_entries);

        for (; e < end; e++) {
            if (s->entries[e].used && cc_entry_stale(s, &s->entries[e])) {
                cc_entry_drop(s, e);
                swept++;
            }
        }
        if (e == s->nb_entries) {
            e = 0;              /* invalidated again meanwhile: once more */
        }
        trace_clone_cache_sweep_step(s, e, s->nb_stale_entries);
        qemu_mutex_unlock(&s->lock);
        aio_co_schedule(qemu_get_aio_context(), qemu_coroutine_self());
        qemu_coroutine_yield();
        qemu_mutex_lock(&s->lock);
    }
    qatomic_set(&s->sweeping, false);
    qemu_mutex_unlock(&s->lock);
    trace_clone_cache_sweep_done(s, swept);
    aio_wait_kick();
}

/*
 * Give base @b a new nonce: its entries become stale at once (lock held).
 * The caller writes the base record; the sweep frees what they held.
 */
static void cc_base_renew(CloneCacheStore *s, int b)
{
    CloneCacheBase *base = &s->bases[b];
    bool start;

    s->nb_stale_entries += base->nb_entries;
    base->nb_entries = 0;
    base->gen++;
    do {
        qemu_guest_getrandom_nofail(&base->nonce, sizeof(base->nonce));
    } while (!base->nonce);
    memset(&base->st, 0, sizeof(base->st));

    start = s->nb_stale_entries && !s->sweeping && !s->closing;
    if (start) {
        /* scheduled, not entered: it takes the lock we hold */
        qatomic_set(&s->sweeping, true);
        aio_co_schedule(qemu_get_aio_context(),
                        qemu_coroutine_create(cc_sweep, s));
    }
}

/* Record base @b on disk: entries written before carry another nonce */
static int cc_base_record(CloneCacheStore *s, int b)
{
    int ret = cc_write_base_rec(s, b);

    return ret < 0 ? ret : blk_flush(s->blk);
}

int clone_cache_attach(CloneCacheStore *s, const char *base_id,
                       uint64_t generation, const char *node_name,
                       Error **errp)
{
    CloneCacheBase *base;
    int b, free_b = -1, victim = -1;

    if (!s->blk) {
        error_setg(errp, "clone-cache '%s' is not open", s->filename);
        return -EINVAL;
    }
    if (!*base_id || strlen(base_id) > CC_BASE_ID_MAX) {
        error_setg(errp, "base-id must be 1 to %d bytes", CC_BASE_ID_MAX);
        return -EINVAL;
    }
    qemu_mutex_lock(&s->lock);
    for (b = 0; b < CC_MAX_BASES; b++) {
        base = &s->bases[b];
        if (!base->id) {
            free_b = free_b < 0 ? b : free_b;
        } else if (!strcmp(base->id, base_id)) {
            break;
        } else if (!base->users && (victim < 0 ||
                   base->nb_entries < s->bases[victim].nb_entries)) {
            victim = b;
        }
    }
    if (b == CC_MAX_BASES) {
        b = free_b >= 0 ? free_b : victim;
        if (b < 0) {
            qemu_mutex_unlock(&s->lock);
            error_setg(errp, "clone-cache '%s' already serves %d bases",
                       s->filename, CC_MAX_BASES);
            return -ENOSPC;
        }
        base = &s->bases[b];
        if (base->id) {
            cc_base_renew(s, b);        /* the old base's entries go */
            g_free(base->id);
        }
        base->id = g_strdup(base_id);
        base->nonce = 0;
    }
    base = &s->bases[b];
    if (base->nonce && base->generation != generation) {
        if (base->users) {
            /*
             * One of them would have the other's reads cached as its own,
             * or drop the blocks the other is reading.
             */
            error_setg(errp, "clone-cache '%s': base '%s' is open with "
                       "generation %" PRIu64 " (node '%s'); a node with "
                       "generation %" PRIu64 " must wait until it closes",
                       s->filename, base_id, base->generation,
                       base->node_name, generation);
            qemu_mutex_unlock(&s->lock);
            return -EBUSY;
        }
        info_report("clone-cache '%s': base '%s' changed (generation %" PRIu64
                    " -> %" PRIu64 "); its %" PRIu64 " cached blocks are "
                    "dropped", s->filename, base_id, base->generation,
                    generation, base->nb_entries);
        base->nonce = 0;
    }
    if (!base->nonce) {
        cc_base_renew(s, b);
        base->generation = generation;
        qemu_mutex_unlock(&s->lock);
        /* entries carry the nonce: ones written before this are void */
        if (cc_base_record(s, b) < 0) {
            warn_report("clone-cache '%s': cannot record base '%s'; it is "
                        "cached for this run only", s->filename, base_id);
        }
        qemu_mutex_lock(&s->lock);
    }
    base->users++;
    g_free(base->node_name);
    base->node_name = g_strdup(node_name);
    qemu_mutex_unlock(&s->lock);
    trace_clone_cache_attach(s, b, base_id, generation);
    return b;
}

/*
 * The base @base_id, open in this process, as the origin of a copy: one
 * more user of it (so that its generation cannot change under the copy)
 * and, in *@nonce, the nonce its entries carry now.  A copy made from
 * another generation than its current one (@has_generation) shares
 * nothing: -ESTALE, with the reason in @errp, and no user taken.
 */
int clone_cache_attach_origin(CloneCacheStore *s, const char *base_id,
                              bool has_generation, uint64_t generation,
                              uint64_t *nonce, Error **errp)
{
    CloneCacheBase *base;
    int b;

    qemu_mutex_lock(&s->lock);
    for (b = 0; b < CC_MAX_BASES; b++) {
        base = &s->bases[b];
        if (base->id && base->users && !strcmp(base->id, base_id)) {
            break;
        }
    }
    if (b == CC_MAX_BASES) {
        qemu_mutex_unlock(&s->lock);
        error_setg(errp, "clone-cache '%s': copy-of base '%s' is not open "
                   "(open its node first)", s->filename, base_id);
        return -ENOENT;
    }
    if (has_generation && base->generation != generation) {
        error_setg(errp, "clone-cache '%s': the copy was made from "
                   "generation %" PRIu64 " of base '%s', which has "
                   "generation %" PRIu64 " now; nothing is shared",
                   s->filename, generation, base_id, base->generation);
        qemu_mutex_unlock(&s->lock);
        return -ESTALE;
    }
    base->users++;
    *nonce = base->nonce;
    trace_clone_cache_attach_origin(s, b, base_id, base->generation);
    qemu_mutex_unlock(&s->lock);
    return b;
}

/*
 * Under s->lock: the slot serving @block of @origin for a copy of it,
 * while the origin's entries still carry @nonce (it was not invalidated
 * since the copy's node opened), or CC_NONE.
 */
uint32_t clone_cache_lookup_origin(CloneCacheStore *s, int origin,
                                   uint64_t nonce, uint64_t block)
{
    if (origin < 0 || s->bases[origin].nonce != nonce) {
        return CC_NONE;
    }
    return clone_cache_lookup(s, origin, block);
}

/* Under s->lock: whether the origin's cached blocks serve @block */
bool clone_cache_origin_has(CloneCacheStore *s, int origin, uint64_t nonce,
                            uint64_t block)
{
    return origin >= 0 && s->bases[origin].nonce == nonce &&
           clone_cache_has(s, origin, block);
}

void clone_cache_detach(CloneCacheStore *s, int b)
{
    qemu_mutex_lock(&s->lock);
    assert(s->bases[b].users > 0);
    s->bases[b].users--;
    qemu_mutex_unlock(&s->lock);
}

/*
 * The base changed in place (its generation cannot tell): its cached
 * blocks are void from now on, for every node that reads it; reads in
 * flight are not cached.  On disk once the base record is written.
 */
int clone_cache_invalidate(CloneCacheStore *s, const char *base_id,
                           Error **errp)
{
    uint64_t dropped;
    int b, ret;

    if (!s->blk) {
        error_setg(errp, "clone-cache '%s' is not open", s->filename);
        return -EINVAL;
    }
    qemu_mutex_lock(&s->lock);
    for (b = 0; b < CC_MAX_BASES; b++) {
        if (s->bases[b].id && !strcmp(s->bases[b].id, base_id)) {
            break;
        }
    }
    if (b == CC_MAX_BASES) {
        qemu_mutex_unlock(&s->lock);
        error_setg(errp, "clone-cache '%s' has no base '%s'", s->filename,
                   base_id);
        return -ENOENT;
    }
    dropped = s->bases[b].nb_entries;
    cc_base_renew(s, b);
    qemu_mutex_unlock(&s->lock);
    trace_clone_cache_invalidate(s, b, dropped);

    ret = cc_base_record(s, b);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "clone-cache '%s': cannot record that "
                         "base '%s' changed: its cached blocks are void until "
                         "the daemon restarts, and would be served after",
                         s->filename, base_id);
    }
    return ret;
}

