/*
 * Hybrid block format: the RAM tier
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * Two representations behind one interface:
 *
 * - plain (dedup=off): one anonymous mapping of ram_blocks * block_size
 *   bytes, block N at ram + N * block_size.  The kernel allocates pages on
 *   first touch, and blocks found to be all zero are handed back with
 *   MADV_DONTNEED, so zero blocks cost no RAM here either.  Restore reads
 *   straight into the mapping (no bounce buffer).
 *
 * - dedup (dedup=on): each slot points at a refcounted HybridChunk holding
 *   the block's content, or NULL for an all-zero block.  Chunks are found by
 *   a 64-bit fingerprint and confirmed with memcmp() over the whole block,
 *   so a fingerprint collision can never merge different data; that is why
 *   a fast non-cryptographic hash is enough (a cryptographic one costs far
 *   more CPU per block, docs/hybrid.md "Design measurements", and would
 *   still need trusting the hash).
 *   A chunk is modified in place when its refcount is 1 (the common case
 *   for guest writes), otherwise the writer gets a private copy first.
 *   In async mode a written chunk stays private (out of the table) until
 *   its block has been written back, so a burst of small writes to one
 *   block hashes it once, not once per write.  A write of the whole block
 *   fingerprints it right away, while its data is in the cache, and the
 *   table uses that fingerprint unless a partial write came after.
 *
 * Callers run in the node's AioContext and never yield inside these
 * functions, so no locking is needed beyond the slot BUSY protocol of
 * hybrid.c.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qemu/cutils.h"
#include "qemu/iov.h"
#include "qemu/madvise.h"
#include "qemu/memalign.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "hybrid.h"
#include "trace.h"

/*
 * Hand back the pages of a zero block: they read as zero afterwards.  A
 * shared region needs its file's pages freed (MADV_DONTNEED would only
 * drop this mapping of them).
 */
static void hybrid_ram_drop_pages(BDRVHybridState *s, uint8_t *p)
{
    if (s->region) {
        hybrid_region_drop_pages(s, p, s->block_size);
    } else {
        qemu_madvise(p, s->block_size, QEMU_MADV_DONTNEED);
    }
}

int hybrid_ram_init(BDRVHybridState *s, const char *ram_file, bool writable,
                    Error **errp)
{
    size_t bytes;

    if (s->ram_blocks > SIZE_MAX / sizeof(HybridSlot) ||
        s->ram_blocks > SIZE_MAX / s->block_size) {
        error_setg(errp, "ram-size %" PRIu64 " does not fit in the address "
                   "space", s->ram_size);
        return -EINVAL;
    }
    s->slots = g_try_new0(HybridSlot, s->ram_blocks);
    if (!s->slots && s->ram_blocks) {
        error_setg(errp, "Could not allocate RAM tier metadata for %" PRIu64
                   " blocks", s->ram_blocks);
        return -ENOMEM;
    }

    if (ram_file) {
        int ret = hybrid_region_open(s, ram_file, writable, errp);

        if (ret < 0) {
            g_free(s->slots);
            s->slots = NULL;
        }
        return ret;
    }
    if (s->dedup) {
        s->dedup_table = g_hash_table_new(g_int64_hash, g_int64_equal);
        return 0;
    }

    bytes = s->ram_blocks * s->block_size;
    if (bytes) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            error_setg_errno(errp, errno, "Could not reserve %zu bytes for "
                             "the RAM tier", bytes);
            g_free(s->slots);
            s->slots = NULL;
            return -ENOMEM;
        }
        s->ram = p;
    }
    return 0;
}

static void chunk_unref(BDRVHybridState *s, HybridChunk *c);

void hybrid_ram_unload_all(BDRVHybridState *s)
{
    uint64_t i;

    for (i = 0; i < s->ram_blocks; i++) {
        HybridSlot *slot = &s->slots[i];

        assert(!(slot->flags & (HYBRID_SLOT_BUSY | HYBRID_SLOT_LISTED)));
        if (slot->chunk) {
            chunk_unref(s, slot->chunk);
            slot->chunk = NULL;
        }
        slot->flags = 0;
    }
    /* A region keeps its content: hybrid_region_attach() judges it */
    if (s->ram && !s->region) {
        qemu_madvise(s->ram, s->ram_blocks * s->block_size,
                     QEMU_MADV_DONTNEED);
    }
    s->nb_loaded = 0;
    s->nb_nonzero = 0;
}

/*
 * Forget block @idx, which holds nothing owed to the persistent tier; the
 * caller holds BUSY.  Reads go to the persistent tier again.
 */
void hybrid_ram_unload(BDRVHybridState *s, uint64_t idx)
{
    HybridSlot *slot = &s->slots[idx];

    assert(!(slot->flags & (HYBRID_SLOT_DIRTY | HYBRID_SLOT_LISTED)));
    if (!(slot->flags & HYBRID_SLOT_LOADED)) {
        return;
    }
    hybrid_region_clear_valid(s, idx);
    hybrid_region_set_zero(s, idx, false);
    if (s->dedup) {
        if (slot->chunk) {
            chunk_unref(s, slot->chunk);
            slot->chunk = NULL;
        }
    } else if (!(slot->flags & HYBRID_SLOT_ZERO)) {
        hybrid_ram_drop_pages(s, hybrid_ram_plain_ptr(s, idx));
        s->nb_nonzero--;
    }
    slot->flags &= HYBRID_SLOT_BUSY;
    s->nb_loaded--;
}

void hybrid_ram_free(BDRVHybridState *s)
{
    if (s->slots) {
        hybrid_ram_unload_all(s);
    }
    if (s->region) {
        hybrid_region_close(s);
    } else if (s->ram) {
        munmap(s->ram, s->ram_blocks * s->block_size);
        s->ram = NULL;
    }
    if (s->dedup_table) {
        assert(g_hash_table_size(s->dedup_table) == 0);
        g_hash_table_destroy(s->dedup_table);
        s->dedup_table = NULL;
    }
    g_free(s->slots);
    s->slots = NULL;
}

/* ---- dedup chunk table ---- */

/*
 * A detached chunk with uninitialized data, or NULL.  One allocation: the
 * data first, aligned as the persistent tier wants its buffers (write-back
 * goes out of it directly), then the header.
 */
static HybridChunk *chunk_new(BDRVHybridState *s)
{
    uint8_t *p = qemu_try_memalign(bdrv_opt_mem_align(s->bs),
                                   s->block_size + sizeof(HybridChunk));
    HybridChunk *c;

    if (!p) {
        return NULL;
    }
    c = (HybridChunk *)(p + s->block_size);
    *c = (HybridChunk) { .data = p };
    return c;
}

static void chunk_free(HybridChunk *c)
{
    qemu_vfree(c->data);
}

static HybridChunk *chunk_find(BDRVHybridState *s, uint64_t fp,
                               const uint8_t *data)
{
    HybridChunk *c = g_hash_table_lookup(s->dedup_table, &fp);

    for (; c; c = c->next) {
        if (!memcmp(c->data, data, s->block_size)) {
            return c;
        }
    }
    return NULL;
}

static void chunk_insert(BDRVHybridState *s, HybridChunk *c)
{
    HybridChunk *head = g_hash_table_lookup(s->dedup_table, &c->fp);

    if (head) {
        /* Collision or not: chain behind the head, the key stays valid */
        c->next = head->next;
        head->next = c;
    } else {
        c->next = NULL;
        g_hash_table_insert(s->dedup_table, &c->fp, c);
    }
    c->interned = true;
    s->nb_chunks++;
}

static void chunk_remove(BDRVHybridState *s, HybridChunk *c)
{
    HybridChunk *head = g_hash_table_lookup(s->dedup_table, &c->fp);

    assert(head);
    if (head == c) {
        g_hash_table_remove(s->dedup_table, &c->fp);
        if (c->next) {
            g_hash_table_insert(s->dedup_table, &c->next->fp, c->next);
        }
    } else {
        HybridChunk *p = head;
        while (p->next != c) {
            p = p->next;
            assert(p);
        }
        p->next = c->next;
    }
    c->next = NULL;
    c->interned = false;
    s->nb_chunks--;
}

static void chunk_unref(BDRVHybridState *s, HybridChunk *c)
{
    assert(c->refcnt > 0);
    if (--c->refcnt == 0) {
        if (c->interned) {
            chunk_remove(s, c);
        } else {
            s->nb_private--;
        }
        chunk_free(c);
    }
}

/*
 * Take ownership of the detached chunk @c (refcnt 0, not in the table) and
 * return what the slot should point to: NULL for zeros, an existing equal
 * chunk, or @c itself now in the table.  @c is freed when not used.
 */
static HybridChunk *chunk_intern(BDRVHybridState *s, HybridChunk *c)
{
    HybridChunk *match;

    if (buffer_is_zero(c->data, s->block_size)) {
        chunk_free(c);
        return NULL;
    }
    if (!c->fp_valid) {
        c->fp = content_fingerprint(c->data, s->block_size);
    }
    c->fp_valid = false;
    match = chunk_find(s, c->fp, c->data);
    if (match) {
        trace_hybrid_dedup_hit(s, c->fp);
        match->refcnt++;
        chunk_free(c);
        return match;
    }
    c->refcnt = 1;
    chunk_insert(s, c);
    return c;
}

/* ---- interface ---- */

/* Content of a LOADED block, or NULL when it is all zero. */
const uint8_t *hybrid_ram_peek(BDRVHybridState *s, uint64_t idx)
{
    HybridSlot *slot = &s->slots[idx];

    assert(slot->flags & HYBRID_SLOT_LOADED);
    if (s->dedup) {
        return slot->chunk ? slot->chunk->data : NULL;
    }
    if (slot->flags & HYBRID_SLOT_ZERO) {
        return NULL;
    }
    return s->ram + idx * s->block_size;
}

/* Plain mode: where restore reads block @idx to. */
uint8_t *hybrid_ram_plain_ptr(BDRVHybridState *s, uint64_t idx)
{
    assert(!s->dedup);
    return s->ram + idx * s->block_size;
}

/* Plain mode: restore has just read block @idx into place. */
void hybrid_ram_loaded_plain(BDRVHybridState *s, uint64_t idx)
{
    HybridSlot *slot = &s->slots[idx];
    uint8_t *p = hybrid_ram_plain_ptr(s, idx);

    assert(!(slot->flags & HYBRID_SLOT_LOADED));
    slot->flags |= HYBRID_SLOT_LOADED;
    s->nb_loaded++;
    if (buffer_is_zero(p, s->block_size)) {
        slot->flags |= HYBRID_SLOT_ZERO;
        hybrid_ram_drop_pages(s, p);
        hybrid_region_set_zero(s, idx, true);
    } else {
        s->nb_nonzero++;
        hybrid_region_set_zero(s, idx, false);
    }
    hybrid_region_set_valid(s, idx);
}

/*
 * Set the whole content of a not yet LOADED block from @buf (NULL: zeros)
 * and mark it LOADED.
 */
int hybrid_ram_fill(BDRVHybridState *s, uint64_t idx, const uint8_t *buf)
{
    HybridSlot *slot = &s->slots[idx];

    assert(!(slot->flags & HYBRID_SLOT_LOADED));
    if (s->dedup) {
        if (buf && !buffer_is_zero(buf, s->block_size)) {
            uint64_t fp = content_fingerprint(buf, s->block_size);
            HybridChunk *c = chunk_find(s, fp, buf);

            if (c) {
                c->refcnt++;
            } else {
                c = chunk_new(s);
                if (!c) {
                    return -ENOMEM;
                }
                memcpy(c->data, buf, s->block_size);
                c->fp = fp;
                c->refcnt = 1;
                chunk_insert(s, c);
            }
            slot->chunk = c;
        }
    } else {
        uint8_t *p = hybrid_ram_plain_ptr(s, idx);

        if (buf && !buffer_is_zero(buf, s->block_size)) {
            hybrid_region_set_zero(s, idx, false);
            memcpy(p, buf, s->block_size);
            s->nb_nonzero++;
        } else {
            hybrid_ram_drop_pages(s, p);
            slot->flags |= HYBRID_SLOT_ZERO;
            hybrid_region_set_zero(s, idx, true);
        }
    }
    slot->flags |= HYBRID_SLOT_LOADED;
    s->nb_loaded++;
    /* Without @buf the caller is about to write the block: it says when */
    if (buf) {
        hybrid_region_set_valid(s, idx);
    }
    return 0;
}

/*
 * Write @len bytes at @boff into LOADED block @idx, from @qiov at @qoff,
 * or zeros when @qiov is NULL.  Never yields.
 */
int hybrid_ram_write(BDRVHybridState *s, uint64_t idx, uint32_t boff,
                     QEMUIOVector *qiov, size_t qoff, uint32_t len,
                     bool defer_intern)
{
    HybridSlot *slot = &s->slots[idx];
    uint32_t bsz = s->block_size;

    assert(slot->flags & HYBRID_SLOT_LOADED);
    assert(boff + len <= bsz);

    if (!s->dedup) {
        uint8_t *p = hybrid_ram_plain_ptr(s, idx);

        if (!qiov && len == bsz) {
            if (!(slot->flags & HYBRID_SLOT_ZERO)) {
                hybrid_ram_drop_pages(s, p);
                slot->flags |= HYBRID_SLOT_ZERO;
                hybrid_region_set_zero(s, idx, true);
                s->nb_nonzero--;
            }
            return 0;
        }
        if (!qiov && (slot->flags & HYBRID_SLOT_ZERO)) {
            return 0;
        }
        if (slot->flags & HYBRID_SLOT_ZERO) {
            /* Pages were dropped and read back as zero: just start using */
            hybrid_region_set_zero(s, idx, false);
            slot->flags &= ~HYBRID_SLOT_ZERO;
            s->nb_nonzero++;
        }
        if (qiov) {
            qemu_iovec_to_buf(qiov, qoff, p + boff, len);
        } else {
            memset(p + boff, 0, len);
        }
        return 0;
    } else {
        HybridChunk *old = slot->chunk, *c;

        if (!qiov && (!old || len == bsz)) {
            if (old) {
                chunk_unref(s, old);
                slot->chunk = NULL;
            }
            return 0;
        }
        if (old && old->refcnt == 1) {
            /* Sole owner: make it private and modify in place */
            if (old->interned) {
                chunk_remove(s, old);
                s->nb_private++;
            }
            c = old;
        } else {
            c = chunk_new(s);
            if (!c) {
                return -ENOMEM;
            }
            if (old) {
                if (len < bsz) {
                    memcpy(c->data, old->data, bsz);
                }
                chunk_unref(s, old);
            } else if (len < bsz) {
                memset(c->data, 0, bsz);
            }
            c->refcnt = 1;
            c->interned = false;
            c->next = NULL;
            s->nb_private++;
        }
        if (qiov) {
            qemu_iovec_to_buf(qiov, qoff, c->data + boff, len);
        } else {
            memset(c->data + boff, 0, len);
        }
        /*
         * A whole block is fingerprinted now, while it is in the cache:
         * interning it after its write-back would read it from memory
         * again (docs/hybrid.md, "Design measurements").
         */
        c->fp_valid = qiov && len == bsz;
        if (c->fp_valid) {
            c->fp = content_fingerprint(c->data, bsz);
        }
        slot->chunk = c;
        if (!defer_intern) {
            hybrid_ram_intern(s, idx);
        }
        return 0;
    }
}

/*
 * Dedup mode: share block @idx's private chunk with an equal one, or put
 * it into the table (or drop it if it is all zero).
 */
void hybrid_ram_intern(BDRVHybridState *s, uint64_t idx)
{
    HybridSlot *slot = &s->slots[idx];
    HybridChunk *c = slot->chunk;

    if (!s->dedup || !c || c->interned) {
        return;
    }
    assert(c->refcnt == 1);
    c->refcnt = 0;
    s->nb_private--;
    slot->chunk = chunk_intern(s, c);
}

/* Host memory holding block data. */
uint64_t hybrid_ram_used_bytes(BDRVHybridState *s)
{
    if (s->dedup) {
        return (s->nb_chunks + s->nb_private) * s->block_size;
    }
    return s->nb_nonzero * s->block_size;
}

/* Host memory spent on bookkeeping (slots, chunk headers, hash table). */
uint64_t hybrid_ram_metadata_bytes(BDRVHybridState *s)
{
    uint64_t bytes = s->ram_blocks * sizeof(HybridSlot);

    if (s->dedup) {
        /* chunk header + GHashTable node (key, value, hash ~ 24 bytes) */
        bytes += s->nb_chunks * (sizeof(HybridChunk) + 24) +
                 s->nb_private * sizeof(HybridChunk);
    }
    return bytes;
}
