/*
 * Clone cache: the block driver
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 *
 * A read-only filter over one base node:
 *
 *   -object clone-cache,id=cc0,filename=/ssd/clone.cache,size=8G
 *   -blockdev driver=clone-cache,node-name=base0,store=cc0,read-only=on,
 *             base-id=rbd/vdi@gold,generation=7,file=<base node>
 *
 * Reads are served from the store when it holds the block; a miss reads the
 * whole cache block(s) from the base, answers, and hands the data to the
 * store's filler, so no request waits for the cache to be written.  Misses
 * on a block whose base read is in flight wait for that read instead of
 * issuing their own.
 */

#include "qemu/osdep.h"
#include "qemu/units.h"
#include "qemu/cutils.h"
#include "qemu/error-report.h"
#include "qapi/error.h"
#include "qemu/memalign.h"
#include "qobject/qdict.h"
#include "block/block_int.h"
#include "block/block-io.h"
#include "block/aio_task.h"
#include "system/block-backend.h"
#include "content-fp.h"
#include "clone-cache.h"
#include "visit-options.h"
#include "trace.h"

#define CC_OPT_STORE        "store"
#define CC_OPT_BASE_ID      "base-id"
#define CC_OPT_GENERATION   "generation"
#define CC_OPT_COPY_OF      "copy-of"
#define CC_OPT_COPY_OF_GEN  "copy-of-generation"
#define CC_MAX_RUN          (4 * MiB)   /* largest single base read */

/* Our options, parsed with the QAPI visitor and taken out of @options */
static BlockdevOptions *cc_parse_options(QDict *options, Error **errp)
{
    BlockdevOptions *opts = visit_blockdev_options(options, "clone-cache",
                                                   errp);

    if (opts) {
        qdict_del(options, CC_OPT_STORE);
        qdict_del(options, CC_OPT_BASE_ID);
        qdict_del(options, CC_OPT_GENERATION);
        qdict_del(options, CC_OPT_COPY_OF);
        qdict_del(options, CC_OPT_COPY_OF_GEN);
    }
    return opts;
}

/* Mix @len bytes of @p into a generation, 56 bytes and the chain a time */
static uint64_t cc_gen_mix(uint64_t gen, const void *p, size_t len)
{
    uint8_t buf[64];    /* the fingerprint takes multiples of 32 bytes */
    size_t off = 0;

    do {
        size_t n = MIN(len - off, 56);

        memset(buf, 0, sizeof(buf));
        memcpy(buf, (const uint8_t *)p + off, n);
        stq_le_p(buf + 56, gen);
        gen = content_fingerprint(buf, sizeof(buf));
        off += n;
    } while (off < len);
    return gen;
}

/*
 * Without generation=, a base's generation is what names its data and
 * what a user cannot set back: for a file (or device), its device, inode,
 * size and change time (cp -p or rsync -t restore the modification time,
 * not the change time); for RBD, the cluster, pool, image id and snapshot
 * id (an image or snapshot made anew under the same name has other ids).
 * 0 for anything else: such bases should be given a generation.
 */
static uint64_t GRAPH_RDLOCK cc_default_generation(BlockDriverState *bs)
{
    for (; bs; ) {
        const char *fmt = bs->drv->format_name;
        BdrvChild *c;

        if (!strcmp(fmt, "file") || !strcmp(fmt, "host_device")) {
            struct stat st;
            uint64_t id[6];

            if (stat(bs->filename, &st) < 0) {
                return 0;
            }
            id[0] = st.st_dev;
            id[1] = st.st_ino;
            id[2] = st.st_size;
            id[3] = st.st_ctim.tv_sec;
            id[4] = st.st_ctim.tv_nsec;
            id[5] = st.st_rdev;
            return cc_gen_mix(1, id, sizeof(id));
        }
        if (!strcmp(fmt, "rbd")) {
            g_autoptr(ImageInfoSpecific) info =
                bdrv_get_specific_info(bs, NULL);
            ImageInfoSpecificRbd *r;
            uint64_t gen = 2;

            if (!info || info->type != IMAGE_INFO_SPECIFIC_KIND_RBD ||
                !info->u.rbd.data->image_id) {
                return 0;
            }
            r = info->u.rbd.data;
            gen = cc_gen_mix(gen, r->image_id, strlen(r->image_id));
            if (r->cluster_fsid) {
                gen = cc_gen_mix(gen, r->cluster_fsid, strlen(r->cluster_fsid));
            }
            gen = cc_gen_mix(gen, &r->pool_id, sizeof(r->pool_id));
            gen = cc_gen_mix(gen, &r->snapshot_id, sizeof(r->snapshot_id));
            return gen;
        }
        c = bdrv_filter_or_cow_child(bs);
        if (!c && !strcmp(fmt, "raw")) {
            c = bs->file;
        }
        bs = c ? c->bs : NULL;
    }
    return 0;
}

static int cc_open(BlockDriverState *bs, QDict *options, int flags,
                   Error **errp)
{
    BDRVCloneCacheState *s = bs->opaque;
    g_autoptr(BlockdevOptions) full = NULL;
    BlockdevOptionsCloneCache *opts;
    const char *base_id;
    uint64_t generation;
    int ret;

    GLOBAL_STATE_CODE();

    full = cc_parse_options(options, errp);
    if (!full) {
        return -EINVAL;
    }
    opts = &full->u.clone_cache;
    ret = bdrv_open_file_child(NULL, options, "file", bs, errp);
    if (ret < 0) {
        return ret;
    }
    ret = bdrv_apply_auto_read_only(bs, "clone-cache nodes are read-only "
                                    "(use read-only=on)", errp);
    if (ret < 0) {
        return ret;
    }
    s->store = clone_cache_store_find(opts->store, errp);
    if (!s->store) {
        return -EINVAL;
    }

    bdrv_graph_rdlock_main_loop();
    s->length = bdrv_getlength(bs->file->bs);
    bdrv_refresh_filename(bs->file->bs);
    base_id = opts->base_id ?: bs->file->bs->filename;
    generation = opts->has_generation ? opts->generation
                                      : cc_default_generation(bs->file->bs);
    bdrv_graph_rdunlock_main_loop();
    if (s->length < 0) {
        error_setg_errno(errp, -s->length, "Cannot get the base's length");
        return s->length;
    }
    if (!*base_id) {
        error_setg(errp, "clone-cache: the base has no filename; name it "
                   "with '" CC_OPT_BASE_ID "'");
        return -EINVAL;
    }
    s->nb_blocks = DIV_ROUND_UP(s->length, s->store->block_size);
    if (s->nb_blocks >> CC_BLOCK_BITS) {
        error_setg(errp, "clone-cache: the base is too large");
        return -EFBIG;
    }
    s->origin = -1;
    if (opts->copy_of) {
        Error *local_err = NULL;

        if (!strcmp(opts->copy_of, base_id)) {
            error_setg(errp, "clone-cache: a base cannot be a copy of itself");
            return -EINVAL;
        }
        s->origin = clone_cache_attach_origin(s->store, opts->copy_of,
                                              opts->has_copy_of_generation,
                                              opts->copy_of_generation,
                                              &s->origin_nonce, &local_err);
        if (s->origin == -ESTALE) {
            warn_report_err(local_err);     /* served, from its own base */
            s->origin = -1;
        } else if (s->origin < 0) {
            error_propagate(errp, local_err);
            return s->origin;
        }
    }
    s->base = clone_cache_attach(s->store, base_id, generation,
                                 bdrv_get_node_name(bs), errp);
    if (s->base < 0) {
        if (s->origin >= 0) {
            clone_cache_detach(s->store, s->origin);
        }
        return s->base;
    }
    s->inflight = g_hash_table_new_full(g_int64_hash, g_int64_equal, g_free,
                                        NULL);
    object_ref(OBJECT(s->store));
    return 0;
}

static void cc_close(BlockDriverState *bs)
{
    BDRVCloneCacheState *s = bs->opaque;

    assert(!g_hash_table_size(s->inflight) &&
           !qatomic_load_acquire(&s->prewarming));
    g_hash_table_destroy(s->inflight);
    g_free(s->rec_seen);
    if (s->rec_order) {
        g_array_free(s->rec_order, true);
    }
    clone_cache_detach(s->store, s->base);
    if (s->origin >= 0) {
        clone_cache_detach(s->store, s->origin);
    }
    object_unref(OBJECT(s->store));
}

/*
 * A filter's permissions, and the base must not change under the cache:
 * nobody in this process may write or resize it.  The cache reads whole
 * blocks whoever asks, so it needs consistent reads of its own.
 */
static void cc_child_perm(BlockDriverState *bs, BdrvChild *c,
                          BdrvChildRole role, BlockReopenQueue *reopen_queue,
                          uint64_t perm, uint64_t shared,
                          uint64_t *nperm, uint64_t *nshared)
{
    bdrv_default_perms(bs, c, role, reopen_queue, perm, shared,
                       nperm, nshared);
    *nperm |= BLK_PERM_CONSISTENT_READ;
    *nshared &= ~(BLK_PERM_WRITE | BLK_PERM_RESIZE);
}

static int64_t coroutine_fn GRAPH_RDLOCK cc_co_getlength(BlockDriverState *bs)
{
    return bdrv_co_getlength(bs->file->bs);
}

void cc_inflight_unref(CloneCacheInflight *f)
{
    if (--f->refs == 0) {
        qemu_vfree(f->buf);
        g_free(f);
    }
}

/*
 * Blocks [first, first + nb) missed and nobody reads them: read them from
 * the base as one request, wake whoever waited, and queue them for filling.
 * Called and returns with the store lock held.
 */
int coroutine_fn GRAPH_RDLOCK
cc_read_base(BlockDriverState *bs, CloneCacheInflight *f, bool pin)
{
    BDRVCloneCacheState *s = bs->opaque;
    CloneCacheStore *store = s->store;
    uint64_t bsz = store->block_size, i;
    int64_t off = f->first * bsz;
    int64_t len = MIN(f->nb * bsz, s->length - off);
    CloneCacheBaseStats *st = &store->bases[s->base].st;
    uint64_t nonce = store->bases[s->base].nonce;   /* before the read */

    for (i = 0; i < f->nb; i++) {
        uint64_t *key = g_new(uint64_t, 1);

        *key = f->first + i;
        g_hash_table_insert(s->inflight, key, f);
    }
    st->misses += f->nb;
    qemu_mutex_unlock(&store->lock);

    trace_clone_cache_miss(bs, f->first, f->nb);
    BLKDBG_CO_EVENT(bs->file, BLKDBG_READ_AIO);
    f->ret = bdrv_co_pread(bs->file, off, len, f->buf, 0);

    qemu_mutex_lock(&store->lock);
    for (i = 0; i < f->nb; i++) {
        uint64_t key = f->first + i;
        g_hash_table_remove(s->inflight, &key);
    }
    f->done = true;
    if (f->ret == 0) {
        st->base_read_bytes += len;
    }
    qemu_co_queue_restart_all(&f->waiters);
    qemu_mutex_unlock(&store->lock);

    if (f->ret == 0) {
        for (i = 0; i < f->nb; i++) {
            clone_cache_queue_fill(store, s->base, nonce, f->first + i,
                                   f->buf + i * bsz,
                                   MIN(bsz, len - i * bsz), pin);
        }
    }
    qemu_mutex_lock(&store->lock);
    return f->ret;
}

/* Note blocks [first, last] in the boot-set trace (store lock held) */
static void cc_record(BDRVCloneCacheState *s, uint64_t first, uint64_t last)
{
    uint64_t b;

    for (b = first; b <= last; b++) {
        if (!test_and_set_bit(b, s->rec_seen)) {
            g_array_append_val(s->rec_order, b);
        }
    }
}

bool cc_is_miss(BDRVCloneCacheState *s, uint64_t block)
{
    uint64_t key = clone_cache_key(s->base, block);

    return !clone_cache_has(s->store, s->base, block) &&
           !clone_cache_origin_has(s->store, s->origin, s->origin_nonce,
                                   block) &&
           !g_hash_table_contains(s->store->pending, &key) &&
           !g_hash_table_contains(s->inflight, &block);
}

/* One hit of a request: where it goes, and how its read went */
typedef struct CloneCacheHit {
    uint64_t block;
    uint32_t slot;              /* holds a reader reference until read */
    int64_t offset, bytes;      /* in the node */
    size_t qiov_offset;
    int ret;
} CloneCacheHit;

/* The read of one hit of a request over several blocks, beside the others */
typedef struct CloneCacheHitTask {
    AioTask task;
    BlockDriverState *bs;
    QEMUIOVector *qiov;
    CloneCacheHit *hit;
} CloneCacheHitTask;

#define CC_HIT_TASKS        16  /* hit reads in flight per request */

/* Read a hit straight into @qiov (the store checks it); no lock held */
static void coroutine_fn cc_read_hit(BlockDriverState *bs, CloneCacheHit *h,
                                     QEMUIOVector *qiov)
{
    BDRVCloneCacheState *s = bs->opaque;

    h->ret = clone_cache_read_slot(s->store, s->base, h->slot,
                                   h->offset % s->store->block_size, h->bytes,
                                   qiov, h->qiov_offset);
    if (h->ret == 0) {
        trace_clone_cache_hit(bs, h->block, h->slot);
    }
}

static int coroutine_fn cc_hit_task(AioTask *task)
{
    CloneCacheHitTask *t = container_of(task, CloneCacheHitTask, task);

    cc_read_hit(t->bs, t->hit, t->qiov);
    return 0;           /* a hit that failed is read from the base after */
}

/*
 * Serve [offset, end) of a request, store lock held (dropped and taken
 * again while it waits).  Each cache block is a hit (read from the cache
 * file and checked), a merged miss (served from a fill not written yet,
 * or a wait for a base read already in flight) or a miss (a run of
 * adjacent misses is one base read of whole blocks, or of only the bytes
 * asked for when none of them could be queued for filling).  Hits go in @hits (*@nb_hits of
 * them): the last block's is read here when no other is in flight, any
 * other is started in *@pool (made on first use) so that the hits of a
 * request are read side by side, and with its misses; the caller waits
 * for them.  @hits NULL: no lookups, every block a miss.
 */
static int coroutine_fn GRAPH_RDLOCK
cc_serve(BlockDriverState *bs, int64_t offset, int64_t end,
         QEMUIOVector *qiov, size_t qiov_offset, CloneCacheHit *hits,
         int *nb_hits, AioTaskPool **pool)
{
    BDRVCloneCacheState *s = bs->opaque;
    CloneCacheStore *store = s->store;
    CloneCacheBaseStats *st = &store->bases[s->base].st;
    const uint64_t bsz = store->block_size;
    int ret = 0;

    while (offset < end && ret == 0) {
        uint64_t block = offset / bsz;
        int64_t chunk = MIN((block + 1) * bsz, end) - offset;
        CloneCacheInflight *f;
        uint32_t slot = CC_NONE;

        if (hits) {
            slot = clone_cache_lookup(store, s->base, block);
        }
        if (hits && slot == CC_NONE) {
            slot = clone_cache_lookup_origin(store, s->origin,
                                             s->origin_nonce, block);
            if (slot != CC_NONE) {
                trace_clone_cache_origin_hit(bs, block, slot);
            }
        }
        if (slot != CC_NONE) {
            CloneCacheHit *h = &hits[(*nb_hits)++];

            *h = (CloneCacheHit) {
                .block = block, .slot = slot, .offset = offset,
                .bytes = chunk, .qiov_offset = qiov_offset,
            };
            qemu_mutex_unlock(&store->lock);
            if (offset + chunk == end && !*pool) {
                cc_read_hit(bs, h, qiov);
            } else {
                CloneCacheHitTask *t = g_new(CloneCacheHitTask, 1);

                *t = (CloneCacheHitTask) {
                    .task.func = cc_hit_task, .bs = bs, .qiov = qiov,
                    .hit = h,
                };
                *pool = *pool ?: aio_task_pool_new(CC_HIT_TASKS);
                aio_task_pool_start_task(*pool, &t->task);
            }
            qemu_mutex_lock(&store->lock);
            offset += chunk;
            qiov_offset += chunk;
            continue;
        }

        if (clone_cache_read_pending(store, s->base, block, offset % bsz,
                                     chunk, qiov, qiov_offset)) {
            st->merged++;
            trace_clone_cache_merged(bs, block);
            offset += chunk;
            qiov_offset += chunk;
            continue;
        }
        f = g_hash_table_lookup(s->inflight, &block);
        if (f) {
            f->refs++;
            st->merged++;
            trace_clone_cache_merged(bs, block);
            while (!f->done) {
                qemu_co_queue_wait(&f->waiters, &store->lock);
            }
        } else {
            uint64_t nb = 1;

            while ((block + nb) * bsz < end && nb * bsz < CC_MAX_RUN &&
                   cc_is_miss(s, block + nb)) {
                nb++;
            }
            if (!clone_cache_fill_room(store, bsz)) {
                /*
                 * Not one of these blocks would be queued for filling (the
                 * backlog is full): read only the bytes asked for, as
                 * straight from the base, not whole blocks for nothing.
                 */
                int64_t n = MIN((block + nb) * bsz, end) - offset;

                st->misses += nb;
                st->fills_dropped += nb;
                qemu_mutex_unlock(&store->lock);
                trace_clone_cache_miss_uncached(bs, block, nb);
                ret = bdrv_co_preadv_part(bs->file, offset, n, qiov,
                                          qiov_offset, 0);
                qemu_mutex_lock(&store->lock);
                if (ret == 0) {
                    st->base_read_bytes += n;
                }
                offset += n;
                qiov_offset += n;
                continue;
            }
            f = g_new0(CloneCacheInflight, 1);
            f->first = block;
            f->nb = nb;
            f->refs = 1;
            f->buf = qemu_try_blockalign(bs->file->bs, nb * bsz);
            if (!f->buf) {
                g_free(f);
                ret = -ENOMEM;
                break;
            }
            qemu_co_queue_init(&f->waiters);
            cc_read_base(bs, f, false);
        }
        ret = f->ret;
        if (ret == 0) {
            int64_t done = MIN((f->first + f->nb) * bsz, end) - offset;

            qemu_iovec_from_buf(qiov, qiov_offset,
                                f->buf + (offset - f->first * bsz), done);
            offset += done;
            qiov_offset += done;
        }
        cc_inflight_unref(f);
    }
    return ret;
}

/*
 * Serve one request (cc_serve()).  A hit is read straight into @qiov and
 * checked there; one that changed meanwhile or fails its check is read
 * from the base once every hit is in.
 */
static int coroutine_fn GRAPH_RDLOCK
cc_co_preadv_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                  QEMUIOVector *qiov, size_t qiov_offset,
                  BdrvRequestFlags flags)
{
    BDRVCloneCacheState *s = bs->opaque;
    CloneCacheStore *store = s->store;
    const uint64_t bsz = store->block_size;
    int64_t end = offset + bytes;
    uint64_t nb_blocks = (end - 1) / bsz - offset / bsz + 1;
    CloneCacheHit one, *hits = nb_blocks > 1 ? g_new(CloneCacheHit, nb_blocks)
                                             : &one;
    AioTaskPool *pool = NULL;
    int nb_hits = 0, i, ret;

    qemu_mutex_lock(&store->lock);
    if (s->rec_seen) {
        cc_record(s, offset / bsz, (end - 1) / bsz);
    }
    ret = cc_serve(bs, offset, end, qiov, qiov_offset, hits, &nb_hits, &pool);
    qemu_mutex_unlock(&store->lock);
    if (pool) {
        aio_task_pool_wait_all(pool);
        aio_task_pool_free(pool);
    }
    qemu_mutex_lock(&store->lock);
    for (i = 0; i < nb_hits && ret == 0; i++) {
        CloneCacheHit *h = &hits[i];

        if (h->ret) {           /* changed or not trusted: a miss */
            ret = cc_serve(bs, h->offset, h->offset + h->bytes, qiov,
                           h->qiov_offset, NULL, NULL, NULL);
        }
    }
    qemu_mutex_unlock(&store->lock);
    if (hits != &one) {
        g_free(hits);
    }
    return ret;
}

static void cc_refresh_limits(BlockDriverState *bs, Error **errp)
{
    /* a base read is whole cache blocks: keep requests inside a run */
    bs->bl.max_transfer = CC_MAX_RUN;
}

static const char *const cc_strong_runtime_opts[] = {
    CC_OPT_STORE,
    CC_OPT_BASE_ID,
    CC_OPT_GENERATION,

    NULL
};

BlockDriver bdrv_clone_cache = {
    .format_name                = "clone-cache",
    .instance_size              = sizeof(BDRVCloneCacheState),
    .is_filter                  = true,
    .strong_runtime_opts        = cc_strong_runtime_opts,

    /* open, close */
    .bdrv_open                  = cc_open,
    .bdrv_close                 = cc_close,
    .bdrv_child_perm            = cc_child_perm,
    .bdrv_refresh_limits        = cc_refresh_limits,

    /* I/O */
    .bdrv_co_preadv_part        = cc_co_preadv_part,

    /* information */
    .bdrv_co_getlength          = cc_co_getlength,
};

static void bdrv_clone_cache_init(void)
{
    bdrv_register(&bdrv_clone_cache);
}

block_init(bdrv_clone_cache_init);
