/*
 * Clone cache: the cache file (records, format, load) and its QOM object
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * A user-creatable object ("-object clone-cache,id=...,filename=...,
 * size=...") shared by every clone-cache node of the process.  The cache
 * file holds a self-checking record for every base, slot and map entry,
 * so that a restart (clean or not) finds the cache warm and never trusts a
 * record it cannot check.  See docs/clone-cache-format.rst for the layout.
 */

#include "qemu/osdep.h"
#include "qemu/crc32c.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qemu/main-loop.h"
#include "qemu/units.h"
#include "qapi/error.h"
#include "qapi/visitor.h"
#include "qobject/qdict.h"
#include "qom/object_interfaces.h"
#include "block/block-global-state.h"
#include "system/block-backend.h"
#include "clone-cache.h"
#include "trace.h"

/* ---- records ---- */

/*
 * CRC-32C, the sums of the records and of every 4 KiB piece of data.  A hit
 * checks every piece it serves, so this is on the hit path: util/crc32c.c
 * goes through a table a byte at a time (about 4 us per 4 KiB on the build
 * machine, 2026-11-27), the SSE4.2 instruction 8 bytes at a time (about
 * 0.4 us).  Both give the same sums (block/tests/test_clone_cache.py checks
 * the file's against Python's); the instruction is used where the CPU has it.
 */
#if defined(__x86_64__) && defined(__GNUC__)
static uint32_t __attribute__((target("sse4.2")))
cc_crc_sse42(uint32_t crc, const uint8_t *p, size_t len)
{
    uint64_t c = crc;

    for (; len && ((uintptr_t)p & 7); len--) {
        c = __builtin_ia32_crc32qi(c, *p++);
    }
    for (; len >= 8; len -= 8, p += 8) {
        c = __builtin_ia32_crc32di(c, ldq_he_p(p));
    }
    for (; len; len--) {
        c = __builtin_ia32_crc32qi(c, *p++);
    }
    return c;
}
#endif

/* Continue a CRC-32C over @len more bytes (no inversion in or out) */
uint32_t cc_crc_update(uint32_t crc, const void *p, size_t len)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("sse4.2")) {
        return cc_crc_sse42(crc, p, len);
    }
#endif
    return crc32c(crc, p, len) ^ 0xffffffff;
}

uint32_t cc_crc(const void *p, size_t len)
{
    return cc_crc_update(0xffffffff, p, len) ^ 0xffffffff;
}

bool cc_all_zero(const void *p, size_t len)
{
    return buffer_is_zero(p, len);
}

void cc_slot_rec(CloneCacheStore *s, uint32_t i, bool valid,
                        CloneCacheSlotRec *r)
{
    CloneCacheSlot *sl = &s->slots[i];

    memset(r, 0, sizeof(*r));
    if (valid) {
        r->fp = cpu_to_le64(sl->fp);
        r->seq = cpu_to_le64(sl->seq);
        r->len = cpu_to_le32(sl->len);
        r->sums_crc = cpu_to_le32(cc_sums_crc(s, i));
        r->flags = cpu_to_le32(sl->pinned ? CC_SLOT_PINNED : 0);
    }
    r->crc = cpu_to_le32(cc_crc(r, offsetof(CloneCacheSlotRec, crc)));
}

int coroutine_fn cc_write_slot_rec(CloneCacheStore *s, uint32_t i,
                                          bool valid)
{
    CloneCacheSlotRec r;

    cc_slot_rec(s, i, valid, &r);
    return blk_co_pwrite(s->blk, s->slot_off + (uint64_t)i * CC_REC_SIZE,
                         sizeof(r), &r, 0);
}

/* One CRC-32C per 4 KiB piece of @len bytes (the last may be shorter) */
void cc_compute_sums(const uint8_t *data, uint32_t len, uint32_t *sums)
{
    uint32_t off;

    for (off = 0; off < len; off += CC_SUB) {
        *sums++ = cc_crc(data + off, MIN(CC_SUB, len - off));
    }
}

/*
 * The sums of a slot's bytes [start, end) into row[start / CC_SUB ...],
 * copied under the lock (the filler writes rows under it) so that a reader
 * checks outside it.
 */
void cc_copy_sums(CloneCacheStore *s, uint32_t slot, uint32_t start,
                  uint32_t end, uint32_t *row)
{
    uint32_t first = start / CC_SUB, n = DIV_ROUND_UP(end, CC_SUB) - first;

    memcpy(row + first, &s->sums[(uint64_t)slot * s->spb + first],
           n * sizeof(*row));
}

/*
 * @buf holds a slot's bytes [start, end) at buf + start, @row the slot's
 * sums (cc_copy_sums()): are they all as written?
 */
bool cc_check_sums(const uint32_t *row, const uint8_t *buf, uint32_t start,
                   uint32_t end)
{
    uint32_t off;

    assert(start % CC_SUB == 0);
    for (off = start; off < end; off += CC_SUB) {
        if (cc_crc(buf + off, MIN(CC_SUB, end - off)) != row[off / CC_SUB]) {
            return false;
        }
    }
    return true;
}

/*
 * The same for a slot's bytes [start, end) held in @qiov from @qiov_offset
 * (a piece may straddle its buffers)
 */
bool cc_check_sums_qiov(const uint32_t *row, QEMUIOVector *qiov,
                        size_t qiov_offset, uint32_t start, uint32_t end)
{
    struct iovec *iov = qiov->iov;
    size_t skip = qiov_offset;
    uint32_t off = start, left = MIN(CC_SUB, end - start);
    uint32_t crc = 0xffffffff;

    assert(start % CC_SUB == 0 && qiov_offset + (end - start) <= qiov->size);
    while (skip >= iov->iov_len) {
        skip -= iov->iov_len;
        iov++;
    }
    while (off < end) {
        size_t n = MIN(iov->iov_len - skip, left);

        crc = cc_crc_update(crc, (uint8_t *)iov->iov_base + skip, n);
        skip += n;
        off += n;
        left -= n;
        if (!left) {
            if ((crc ^ 0xffffffff) != row[(off - 1) / CC_SUB]) {
                return false;
            }
            crc = 0xffffffff;
            left = MIN(CC_SUB, end - off);
        }
        if (skip == iov->iov_len) {
            iov++;
            skip = 0;
        }
    }
    return true;
}

static void cc_sums_le(CloneCacheStore *s, uint32_t i, uint32_t *le)
{
    uint32_t k;

    for (k = 0; k < s->spb; k++) {
        le[k] = cpu_to_le32(s->sums[(uint64_t)i * s->spb + k]);
    }
}

/* CRC of the slot's row of the sum table as stored (little endian) */
uint32_t cc_sums_crc(CloneCacheStore *s, uint32_t i)
{
    uint32_t le[CC_MAX_BLOCK / CC_SUB];

    cc_sums_le(s, i, le);
    return cc_crc(le, s->spb * 4);
}

int coroutine_fn cc_write_sums(CloneCacheStore *s, uint32_t i)
{
    uint32_t le[CC_MAX_BLOCK / CC_SUB];

    cc_sums_le(s, i, le);
    return blk_co_pwrite(s->blk, s->sum_off + (uint64_t)i * s->spb * 4,
                         s->spb * 4, le, 0);
}

int coroutine_fn cc_write_entry_rec(CloneCacheStore *s, uint32_t e,
                                           uint64_t key, uint64_t nonce,
                                           uint32_t slot, uint64_t seq)
{
    CloneCacheEntryRec r = {
        .key = cpu_to_le64(key),
        .nonce = cpu_to_le64(nonce),
        .slot_seq = cpu_to_le64(seq),
        .slot = cpu_to_le32(slot),
    };

    r.crc = cpu_to_le32(cc_crc(&r, offsetof(CloneCacheEntryRec, crc)));
    return blk_co_pwrite(s->blk, s->entry_off + (uint64_t)e * CC_REC_SIZE,
                         sizeof(r), &r, 0);
}

int cc_write_base_rec(CloneCacheStore *s, int b)
{
    CloneCacheBase *base = &s->bases[b];
    g_autofree CloneCacheBaseRec *r = g_new0(CloneCacheBaseRec, 1);

    if (base->id) {
        r->nonce = cpu_to_le64(base->nonce);
        r->generation = cpu_to_le64(base->generation);
        r->id_len = cpu_to_le32(strlen(base->id));
        memcpy(r->id, base->id, strlen(base->id));
    }
    r->crc = cpu_to_le32(cc_crc(r, offsetof(CloneCacheBaseRec, crc)));
    return blk_pwrite(s->blk, s->base_off + (uint64_t)b * CC_BASE_REC_SIZE,
                      sizeof(*r), r, 0);
}

/* ---- open: geometry, format, load ---- */

static void cc_geometry(CloneCacheStore *s)
{
    uint64_t bsz = s->block_size, n;

    s->spb = bsz / CC_SUB;
    s->base_off = CC_SB_SIZE;
    s->slot_off = s->base_off + CC_MAX_BASES * CC_BASE_REC_SIZE;
    n = (s->size - s->slot_off) / (bsz + 3 * CC_REC_SIZE + 4 * s->spb);
    n = MIN(n, CC_MAX_SLOTS);
    for (;;) {
        s->entry_off = s->slot_off + n * CC_REC_SIZE;
        s->sum_off = s->entry_off + 2 * n * CC_REC_SIZE;
        s->data_off = ROUND_UP(s->sum_off + n * s->spb * 4, bsz);
        if (!n || s->data_off + n * bsz <= s->size) {
            break;
        }
        n--;
    }
    s->nb_slots = n;
    s->nb_entries = 2 * n;
}

static void cc_super(CloneCacheStore *s, CloneCacheSuper *sb)
{
    memset(sb, 0, sizeof(*sb));
    memcpy(sb->magic, CC_MAGIC, sizeof(sb->magic));
    sb->version = cpu_to_le32(CC_VERSION);
    sb->block_size = cpu_to_le32(s->block_size);
    sb->nb_slots = cpu_to_le64(s->nb_slots);
    sb->nb_entries = cpu_to_le64(s->nb_entries);
    sb->base_off = cpu_to_le64(s->base_off);
    sb->slot_off = cpu_to_le64(s->slot_off);
    sb->entry_off = cpu_to_le64(s->entry_off);
    sb->sum_off = cpu_to_le64(s->sum_off);
    sb->data_off = cpu_to_le64(s->data_off);
    sb->max_bases = cpu_to_le32(CC_MAX_BASES);
    sb->epoch = cpu_to_le64(s->epoch);
    sb->crc = cpu_to_le32(cc_crc(sb, offsetof(CloneCacheSuper, crc)));
}

static int cc_write_super(CloneCacheStore *s, Error **errp)
{
    g_autofree uint8_t *buf = g_malloc0(CC_SB_SIZE);
    int ret;

    cc_super(s, (CloneCacheSuper *)buf);
    ret = blk_pwrite(s->blk, 0, CC_SB_SIZE, buf, 0);
    if (ret == 0) {
        ret = blk_flush(s->blk);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Cannot write the superblock of '%s'",
                         s->filename);
    }
    return ret;
}

/*
 * An empty cache: every record zero (invalid), every slot free.  The
 * superblock goes into the emptied file before it grows, so that a crash
 * leaves either an empty file or one with our magic: never a file of
 * zeros, which the next open would refuse as not ours.
 */
static int cc_format(CloneCacheStore *s, Error **errp)
{
    int ret = blk_truncate(s->blk, 0, true, PREALLOC_MODE_OFF, 0, errp);
    uint64_t i;

    s->epoch = 0;
    if (ret == 0) {
        blk_set_allow_write_beyond_eof(s->blk, true);
        ret = cc_write_super(s, errp);
        blk_set_allow_write_beyond_eof(s->blk, false);
    }
    if (ret == 0) {
        ret = blk_truncate(s->blk, s->size, true, PREALLOC_MODE_OFF, 0,
                           errp);
    }
    if (ret < 0) {
        return ret;
    }
    for (i = s->nb_entries; i-- > 0;) {
        s->free_entries[s->nb_free_entries++] = i;
    }
    for (i = 0; i < s->nb_slots; i++) {
        s->slots[i].first_entry = CC_NONE;
        s->slots[i].fp_next = CC_NONE;
        cc_queue_add(s, &s->slots[i], CC_Q_FREE);
    }
    return 0;
}

/*
 * Check the superblock.  1: matches our geometry; 0: empty, or ours with
 * another geometry or damaged (start empty); -errno: not a cache file.
 * Only an empty file or one with our magic is ever (re)formatted: a file
 * of any other content, zeros included, may be someone's data.
 */
static int cc_check_super(CloneCacheStore *s, Error **errp)
{
    g_autofree uint8_t *buf = g_malloc0(CC_SB_SIZE);
    CloneCacheSuper *sb = (CloneCacheSuper *)buf, want;
    int64_t len = blk_getlength(s->blk);
    int ret;

    if (len < 0) {
        error_setg_errno(errp, -len, "Cannot get the length of '%s'",
                         s->filename);
        return len;
    }
    if (len == 0) {
        return 0;
    }
    ret = blk_pread(s->blk, 0, MIN(len, CC_SB_SIZE), buf, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Cannot read '%s'", s->filename);
        return ret;
    }
    if (len < sizeof(*sb) || memcmp(sb->magic, CC_MAGIC, sizeof(sb->magic))) {
        error_setg(errp, "'%s' is not a clone cache file (%" PRId64 " bytes "
                   "without a clone cache superblock); refusing to overwrite "
                   "it: give a new or empty file", s->filename, len);
        return -EINVAL;
    }
    if (le32_to_cpu(sb->crc) != cc_crc(sb, offsetof(CloneCacheSuper, crc))) {
        warn_report("clone-cache '%s': the superblock is damaged; the cache "
                    "starts empty", s->filename);
        return 0;
    }
    s->epoch = le64_to_cpu(sb->epoch);
    cc_super(s, &want);
    want.epoch = sb->epoch;
    want.crc = sb->crc;
    if (memcmp(&want, sb, sizeof(want))) {
        info_report("clone-cache '%s': size or block size changed; the cache "
                    "starts empty", s->filename);
        return 0;
    }
    return len == s->size ? 1 : 0;
}

static int cc_load_table(CloneCacheStore *s, uint64_t off, uint64_t count,
                         size_t rec_size,
                         void (*fn)(CloneCacheStore *, uint64_t, void *),
                         Error **errp)
{
    const uint64_t chunk = 1 * MiB / rec_size;
    g_autofree uint8_t *buf = g_malloc(chunk * rec_size);
    uint64_t i, j, n;
    int ret;

    for (i = 0; i < count; i += n) {
        n = MIN(chunk, count - i);
        ret = blk_pread(s->blk, off + i * rec_size, n * rec_size, buf, 0);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "Cannot read the index of '%s'",
                             s->filename);
            return ret;
        }
        for (j = 0; j < n; j++) {
            fn(s, i + j, buf + j * rec_size);
        }
    }
    return 0;
}

static void cc_load_base(CloneCacheStore *s, uint64_t i, void *p)
{
    CloneCacheBaseRec *r = p;
    uint32_t len = le32_to_cpu(r->id_len);

    if (cc_all_zero(r, sizeof(*r))) {
        return;
    }
    if (le32_to_cpu(r->crc) != cc_crc(r, offsetof(CloneCacheBaseRec, crc)) ||
        !r->nonce || !len || len > CC_BASE_ID_MAX ||
        memchr(r->id, 0, len)) {
        s->discarded_records++;
        return;
    }
    s->bases[i].id = g_strndup(r->id, len);
    s->bases[i].nonce = le64_to_cpu(r->nonce);
    s->bases[i].generation = le64_to_cpu(r->generation);
}

static void cc_load_slot(CloneCacheStore *s, uint64_t i, void *p)
{
    CloneCacheSlotRec *r = p;
    CloneCacheSlot *sl = &s->slots[i];
    uint32_t len = le32_to_cpu(r->len);

    sl->first_entry = CC_NONE;
    sl->fp_next = CC_NONE;
    if (cc_all_zero(r, sizeof(*r))) {
        sl->state = CC_SLOT_FREE;
        return;
    }
    sl->state = CC_SLOT_STALE;
    if (le32_to_cpu(r->crc) != cc_crc(r, offsetof(CloneCacheSlotRec, crc))) {
        s->discarded_records++;
        return;
    }
    if (!r->seq || !len || len > s->block_size || len % 512) {
        return;
    }
    sl->state = CC_SLOT_VALID;
    sl->fp = le64_to_cpu(r->fp);
    sl->seq = le64_to_cpu(r->seq);
    sl->len = len;
    sl->sums_crc = le32_to_cpu(r->sums_crc);   /* checked once sums load */
    sl->pinned = le32_to_cpu(r->flags) & CC_SLOT_PINNED;
}

/* A valid slot whose sum row does not match its record is in doubt */
static void cc_load_sums(CloneCacheStore *s, uint64_t i, void *p)
{
    CloneCacheSlot *sl = &s->slots[i];
    uint32_t *le = p, k;

    for (k = 0; k < s->spb; k++) {
        s->sums[i * s->spb + k] = le32_to_cpu(le[k]);
    }
    if (sl->state == CC_SLOT_VALID && cc_crc(le, s->spb * 4) != sl->sums_crc) {
        s->discarded_records++;
        sl->state = CC_SLOT_STALE;
    }
}

static void cc_load_entry(CloneCacheStore *s, uint64_t i, void *p)
{
    CloneCacheEntryRec *r = p;
    CloneCacheEntry *en = &s->entries[i];
    uint64_t key = le64_to_cpu(r->key);
    uint32_t slot = le32_to_cpu(r->slot);
    int b = key >> CC_BLOCK_BITS;
    CloneCacheSlot *sl;

    en->used = false;
    if (cc_all_zero(r, sizeof(*r))) {
        return;
    }
    if (le32_to_cpu(r->crc) != cc_crc(r, offsetof(CloneCacheEntryRec, crc))) {
        s->discarded_records++;
        return;
    }
    /* void unless it names a live base and the very content of its slot */
    if (!r->nonce || s->bases[b].nonce != le64_to_cpu(r->nonce) ||
        slot >= s->nb_slots) {
        return;
    }
    sl = &s->slots[slot];
    if (sl->state != CC_SLOT_VALID || sl->seq != le64_to_cpu(r->slot_seq) ||
        g_hash_table_contains(s->map, &key)) {
        return;
    }
    en->key = key;
    en->slot = slot;
    en->gen = s->bases[b].gen;
    en->used = true;
    en->next = sl->first_entry;
    sl->first_entry = i;
    sl->refcnt++;
    s->bases[b].nb_entries++;
    g_hash_table_insert(s->map, &en->key, en);
}

typedef struct CloneCacheSeqIdx {
    uint64_t seq;
    uint32_t slot;
} CloneCacheSeqIdx;

static int cc_cmp_seq(const void *a, const void *b)
{
    uint64_t x = ((const CloneCacheSeqIdx *)a)->seq;
    uint64_t y = ((const CloneCacheSeqIdx *)b)->seq;

    return x < y ? -1 : x > y;
}

static int cc_load(CloneCacheStore *s, Error **errp)
{
    g_autofree CloneCacheSeqIdx *order = g_new(CloneCacheSeqIdx, s->nb_slots);
    uint64_t i, n = 0, e;
    int ret;

    ret = cc_load_table(s, s->base_off, CC_MAX_BASES, CC_BASE_REC_SIZE,
                        cc_load_base, errp);
    ret = ret ?: cc_load_table(s, s->slot_off, s->nb_slots, CC_REC_SIZE,
                               cc_load_slot, errp);
    ret = ret ?: cc_load_table(s, s->sum_off, s->nb_slots, s->spb * 4,
                               cc_load_sums, errp);
    ret = ret ?: cc_load_table(s, s->entry_off, s->nb_entries, CC_REC_SIZE,
                               cc_load_entry, errp);
    if (ret < 0) {
        return ret;
    }
    for (e = s->nb_entries; e-- > 0;) {
        if (!s->entries[e].used) {
            s->free_entries[s->nb_free_entries++] = e;
        }
    }
    for (i = 0; i < s->nb_slots; i++) {
        CloneCacheSlot *sl = &s->slots[i];

        if (sl->state == CC_SLOT_VALID && !sl->refcnt) {
            sl->state = CC_SLOT_STALE;
        }
        if (sl->state != CC_SLOT_VALID) {
            sl->pinned = false;
            cc_queue_add(s, sl, CC_Q_FREE);
            continue;
        }
        cc_fp_insert(s, i);
        order[n].seq = sl->seq;
        order[n++].slot = i;
    }
    /* what survived a restart was used: Am, least recently filled first */
    qsort(order, n, sizeof(*order), cc_cmp_seq);
    for (i = 0; i < n; i++) {
        CloneCacheSlot *sl = &s->slots[order[i].slot];

        cc_queue_add(s, sl, sl->pinned ? CC_Q_PINNED : CC_Q_AM);
    }
    if (s->discarded_records) {
        warn_report("clone-cache '%s': %" PRIu64 " damaged index records "
                    "were discarded (their blocks are misses)", s->filename,
                    s->discarded_records);
    }
    trace_clone_cache_load(s, n, s->nb_slots, s->discarded_records);
    return 0;
}

static void cc_close(CloneCacheStore *s)
{
    uint64_t *k;
    int b;

    if (s->blk) {
        clone_cache_quiesce(s);     /* the filler and the sweep */
        blk_flush(s->blk);
        blk_unref(s->blk);
        s->blk = NULL;
    }
    g_clear_pointer(&s->map, g_hash_table_destroy);
    g_clear_pointer(&s->fps, g_hash_table_destroy);
    g_clear_pointer(&s->ghost, g_hash_table_destroy);
    g_clear_pointer(&s->pending, g_hash_table_destroy);
    while ((k = g_queue_pop_head(&s->ghost_fifo))) {
        g_free(k);
    }
    g_clear_pointer(&s->slots, g_free);
    g_clear_pointer(&s->sums, g_free);
    g_clear_pointer(&s->entries, g_free);
    g_clear_pointer(&s->free_entries, g_free);
    for (b = 0; b < CC_MAX_BASES; b++) {
        g_clear_pointer(&s->bases[b].id, g_free);
        g_clear_pointer(&s->bases[b].node_name, g_free);
    }
}

static void cc_complete(UserCreatable *uc, Error **errp)
{
    CloneCacheStore *s = CLONE_CACHE(uc);
    g_autoptr(QDict) opts = qdict_new();
    int fd, ret;

    if (!s->filename) {
        error_setg(errp, "clone-cache: 'filename' is required");
        return;
    }
    if (!is_power_of_2(s->block_size) || s->block_size < CC_MIN_BLOCK ||
        s->block_size > CC_MAX_BLOCK) {
        error_setg(errp, "clone-cache: block-size must be a power of two "
                   "from %d to %d bytes", CC_MIN_BLOCK, (int)CC_MAX_BLOCK);
        return;
    }
    if (s->fp_bits < 1 || s->fp_bits > 64) {
        error_setg(errp, "clone-cache: x-fingerprint-bits must be 1 to 64");
        return;
    }
    s->fp_mask = s->fp_bits == 64 ? UINT64_MAX : (1ULL << s->fp_bits) - 1;
    if (s->size > INT64_MAX / 2) {
        error_setg(errp, "clone-cache: size is too large");
        return;
    }
    cc_geometry(s);
    if (s->nb_slots < 16) {
        error_setg(errp, "clone-cache: size %" PRIu64 " holds fewer than 16 "
                   "blocks of %" PRIu64 " bytes", s->size, s->block_size);
        return;
    }
    if (s->fill_limit < s->block_size) {
        error_setg(errp, "clone-cache: fill-limit must be at least one block");
        return;
    }

    /* the cache holds the bases' data: private to the daemon's user */
    fd = qemu_create(s->filename, O_RDWR | O_BINARY, 0600, errp);
    if (fd < 0) {
        return;
    }
    qemu_close(fd);
    qdict_put_str(opts, "driver", "file");
#ifdef CONFIG_LINUX_IO_URING
    /*
     * Every hit is a read of this file: through QEMU's thread pool, the
     * hand-offs and wake-ups took more than half of a warm daemon's time
     * (perf, 4 KiB random reads at QD32, 2026-11-27; docs/bench/
     * clone-cache-local.md).  io_uring falls back to the thread pool by
     * itself where the kernel refuses it.
     */
    qdict_put_str(opts, "aio", "io_uring");
#endif
    s->blk = blk_new_open(s->filename, NULL, g_steal_pointer(&opts),
                          BDRV_O_RDWR | BDRV_O_RESIZE |
                          (s->direct ? BDRV_O_NOCACHE : 0), errp);
    if (!s->blk) {
        return;
    }
    s->slots = g_new0(CloneCacheSlot, s->nb_slots);
    s->sums = g_new0(uint32_t, s->nb_slots * s->spb);
    s->entries = g_new0(CloneCacheEntry, s->nb_entries);
    s->free_entries = g_new(uint32_t, s->nb_entries);
    s->map = g_hash_table_new(g_int64_hash, g_int64_equal);
    s->fps = g_hash_table_new(g_int64_hash, g_int64_equal);
    s->ghost = g_hash_table_new(g_int64_hash, g_int64_equal);
    s->pending = g_hash_table_new(g_int64_hash, g_int64_equal);

    ret = cc_check_super(s, errp);
    if (ret == 0) {
        ret = cc_format(s, errp);
    } else if (ret > 0) {
        ret = cc_load(s, errp);
    }
    if (ret < 0) {
        goto fail;
    }
    /*
     * A new epoch for this run's sequence numbers: a fill that a crash
     * interrupted may have left an entry naming a seq that never became
     * durable; no seq of this run can equal it.
     */
    s->epoch++;
    s->seq = s->epoch << 32;
    if (cc_write_super(s, errp) < 0) {
        goto fail;
    }
    return;

fail:
    cc_close(s);
}

CloneCacheStore *clone_cache_store_find(const char *id, Error **errp)
{
    Object *obj = object_resolve_path_component(object_get_objects_root(),
                                                id);

    if (!obj || !object_dynamic_cast(obj, TYPE_CLONE_CACHE)) {
        error_setg(errp, "No clone-cache object with id '%s'", id);
        return NULL;
    }
    return CLONE_CACHE(obj);
}

static bool cc_can_be_deleted(UserCreatable *uc)
{
    CloneCacheStore *s = CLONE_CACHE(uc);
    int b;

    for (b = 0; b < CC_MAX_BASES; b++) {
        if (s->bases[b].users) {
            return false;
        }
    }
    return true;
}

/* ---- QOM ---- */

static void cc_set_filename(Object *obj, const char *value, Error **errp)
{
    CloneCacheStore *s = CLONE_CACHE(obj);

    g_free(s->filename);
    s->filename = g_strdup(value);
}

static char *cc_get_filename(Object *obj, Error **errp)
{
    return g_strdup(CLONE_CACHE(obj)->filename);
}

static bool cc_prop_frozen(CloneCacheStore *s, const char *name,
                           Error **errp)
{
    if (s->blk) {
        error_setg(errp, "clone-cache: '%s' cannot change once open", name);
        return true;
    }
    return false;
}

static void cc_prop_size(Object *obj, Visitor *v, const char *name,
                         void *opaque, Error **errp)
{
    CloneCacheStore *s = CLONE_CACHE(obj);
    uint64_t *field = (uint64_t *)((char *)s + (uintptr_t)opaque);
    uint64_t value;

    if (visit_type_size(v, name, &value, errp) &&
        !cc_prop_frozen(s, name, errp)) {
        *field = value;
    }
}

static void cc_prop_size_get(Object *obj, Visitor *v, const char *name,
                             void *opaque, Error **errp)
{
    CloneCacheStore *s = CLONE_CACHE(obj);
    uint64_t value = *(uint64_t *)((char *)s + (uintptr_t)opaque);

    visit_type_size(v, name, &value, errp);
}

static void cc_prop_fp_bits(Object *obj, Visitor *v, const char *name,
                            void *opaque, Error **errp)
{
    CloneCacheStore *s = CLONE_CACHE(obj);
    uint8_t value;

    if (visit_type_uint8(v, name, &value, errp) &&
        !cc_prop_frozen(s, name, errp)) {
        s->fp_bits = value;
    }
}

/* Tests pause a hit after its lookup to force interleavings with it */
static void cc_prop_read_delay(Object *obj, Visitor *v, const char *name,
                               void *opaque, Error **errp)
{
    uint64_t value;

    if (visit_type_uint64(v, name, &value, errp)) {
        qatomic_set(&CLONE_CACHE(obj)->read_delay_ns,
                    MIN(value, 10 * NANOSECONDS_PER_SECOND));
    }
}

static void cc_prop_read_delay_get(Object *obj, Visitor *v, const char *name,
                                   void *opaque, Error **errp)
{
    uint64_t value = qatomic_read(&CLONE_CACHE(obj)->read_delay_ns);

    visit_type_uint64(v, name, &value, errp);
}

static void cc_set_direct(Object *obj, bool value, Error **errp)
{
    CloneCacheStore *s = CLONE_CACHE(obj);

    if (!cc_prop_frozen(s, "direct", errp)) {
        s->direct = value;
    }
}

static bool cc_get_direct(Object *obj, Error **errp)
{
    return CLONE_CACHE(obj)->direct;
}

static void cc_instance_init(Object *obj)
{
    CloneCacheStore *s = CLONE_CACHE(obj);

    s->block_size = CC_DEFAULT_BLOCK;
    s->fill_limit = CC_DEFAULT_FILL_LIMIT;
    s->fp_bits = 64;
    qemu_mutex_init(&s->lock);
    QTAILQ_INIT(&s->free_slots);
    QTAILQ_INIT(&s->a1in);
    QTAILQ_INIT(&s->am);
    QSIMPLEQ_INIT(&s->fills);
    g_queue_init(&s->ghost_fifo);
}

static void cc_instance_finalize(Object *obj)
{
    CloneCacheStore *s = CLONE_CACHE(obj);

    cc_close(s);
    g_free(s->filename);
    qemu_mutex_destroy(&s->lock);
}

static void cc_class_init(ObjectClass *klass, void *data)
{
    UserCreatableClass *ucc = USER_CREATABLE_CLASS(klass);

    ucc->complete = cc_complete;
    ucc->can_be_deleted = cc_can_be_deleted;
    object_class_property_add_str(klass, "filename", cc_get_filename,
                                  cc_set_filename);
    object_class_property_add(klass, "size", "size", cc_prop_size_get,
                              cc_prop_size, NULL,
                              (void *)offsetof(CloneCacheStore, size));
    object_class_property_add(klass, "block-size", "size", cc_prop_size_get,
                              cc_prop_size, NULL,
                              (void *)offsetof(CloneCacheStore, block_size));
    object_class_property_add(klass, "fill-limit", "size", cc_prop_size_get,
                              cc_prop_size, NULL,
                              (void *)offsetof(CloneCacheStore, fill_limit));
    object_class_property_add(klass, "x-fingerprint-bits", "uint8", NULL,
                              cc_prop_fp_bits, NULL, NULL);
    object_class_property_add_bool(klass, "direct", cc_get_direct,
                                   cc_set_direct);
    object_class_property_add(klass, "x-read-delay-ns", "uint64",
                              cc_prop_read_delay_get, cc_prop_read_delay,
                              NULL, NULL);
}

static const TypeInfo cc_type_info = {
    .name = TYPE_CLONE_CACHE,
    .parent = TYPE_OBJECT,
    .class_init = cc_class_init,
    .instance_size = sizeof(CloneCacheStore),
    .instance_init = cc_instance_init,
    .instance_finalize = cc_instance_finalize,
    .interfaces = (InterfaceInfo[]) {
        { TYPE_USER_CREATABLE },
        { }
    },
};

static void cc_register_types(void)
{
    type_register_static(&cc_type_info);
}

type_init(cc_register_types);
