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
#include "qapi/qapi-commands-block-core.h"
#include "qapi/qapi-visit-block-core.h"
#include "qapi/qobject-input-visitor.h"
#include "qemu/memalign.h"
#include "qobject/qdict.h"
#include "block/block_int.h"
#include "block/block-io.h"
#include "block/qdict.h"
#include "system/block-backend.h"
#include "hybrid-fp.h"
#include "clone-cache.h"
#include "trace.h"

#define CC_OPT_STORE        "store"
#define CC_OPT_BASE_ID      "base-id"
#define CC_OPT_GENERATION   "generation"
#define CC_MAX_RUN          (4 * MiB)   /* largest single base read */

/* One base read that other misses may wait for */
typedef struct CloneCacheInflight {
    uint64_t first, nb;         /* blocks */
    uint8_t *buf;
    int ret;
    bool done;
    int refs;
    CoQueue waiters;
} CloneCacheInflight;

typedef struct BDRVCloneCacheState {
    CloneCacheStore *store;
    int base;                   /* index in store->bases */
    uint64_t nb_blocks;
    int64_t length;
    GHashTable *inflight;       /* block -> CloneCacheInflight (store lock) */

    /* boot-set trace (store lock) */
    unsigned long *rec_seen;    /* NULL when not recording */
    GArray *rec_order;          /* uint64_t blocks, first read first */
    bool prewarming;            /* atomic: set by QMP, cleared by the job */
} BDRVCloneCacheState;

/*
 * Parse our options with the QAPI visitor (as copy-before-write does).
 * The 'file' child is opened by bdrv_open_file_child() and may be given
 * in any syntax, so the visitor sees a placeholder for it.
 */
static BlockdevOptions *cc_parse_options(QDict *options, Error **errp)
{
    g_autoptr(QDict) copy = qdict_clone_shallow(options);
    BlockdevOptions *opts = NULL;
    Visitor *v;

    qdict_extract_subqdict(copy, NULL, "file.");
    qdict_put_str(copy, "file", "");
    qdict_put_str(copy, "driver", "clone-cache");
    v = qobject_input_visitor_new_flat_confused(copy, errp);
    if (!v) {
        return NULL;
    }
    visit_type_BlockdevOptions(v, NULL, &opts, errp);
    visit_free(v);
    if (opts) {
        qdict_del(options, CC_OPT_STORE);
        qdict_del(options, CC_OPT_BASE_ID);
        qdict_del(options, CC_OPT_GENERATION);
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
        gen = hybrid_fingerprint(buf, sizeof(buf));
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
    s->base = clone_cache_attach(s->store, base_id, generation,
                                 bdrv_get_node_name(bs), errp);
    if (s->base < 0) {
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

static void cc_inflight_unref(CloneCacheInflight *f)
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
static int coroutine_fn GRAPH_RDLOCK
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

static bool cc_is_miss(BDRVCloneCacheState *s, uint64_t block)
{
    uint64_t key = clone_cache_key(s->base, block);

    return !clone_cache_has(s->store, s->base, block) &&
           !g_hash_table_contains(s->store->pending, &key) &&
           !g_hash_table_contains(s->inflight, &block);
}

/*
 * Serve one request.  Each cache block it covers is a hit (read from the
 * cache file and checked), a merged miss (wait for a base read already in
 * flight) or a miss (a run of adjacent misses is one base read).
 */
static int coroutine_fn GRAPH_RDLOCK
cc_co_preadv_part(BlockDriverState *bs, int64_t offset, int64_t bytes,
                  QEMUIOVector *qiov, size_t qiov_offset,
                  BdrvRequestFlags flags)
{
    BDRVCloneCacheState *s = bs->opaque;
    CloneCacheStore *store = s->store;
    CloneCacheBaseStats *st = &store->bases[s->base].st;
    const uint64_t bsz = store->block_size;
    int64_t end = offset + bytes;
    uint8_t *buf = NULL;
    int ret = 0;

    qemu_mutex_lock(&store->lock);
    if (s->rec_seen) {
        cc_record(s, offset / bsz, (end - 1) / bsz);
    }
    while (offset < end && ret == 0) {
        uint64_t block = offset / bsz;
        int64_t chunk = MIN((block + 1) * bsz, end) - offset;
        CloneCacheInflight *f;
        uint32_t slot = clone_cache_lookup(store, s->base, block);

        if (slot != CC_NONE) {
            qemu_mutex_unlock(&store->lock);
            buf = buf ?: qemu_blockalign(bs, bsz);
            ret = clone_cache_read_slot(store, s->base, slot, buf,
                                        offset % bsz, chunk);
            qemu_mutex_lock(&store->lock);
            if (ret == 0) {
                st->hits++;
                trace_clone_cache_hit(bs, block, slot);
                qemu_iovec_from_buf(qiov, qiov_offset, buf + offset % bsz,
                                    chunk);
                offset += chunk;
                qiov_offset += chunk;
                continue;
            }
            ret = 0;                /* changed or not trusted: a miss */
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
    qemu_mutex_unlock(&store->lock);
    qemu_vfree(buf);
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

    .bdrv_open                  = cc_open,
    .bdrv_close                 = cc_close,
    .bdrv_child_perm            = cc_child_perm,
    .bdrv_refresh_limits        = cc_refresh_limits,

    .bdrv_co_getlength          = cc_co_getlength,
    .bdrv_co_preadv_part        = cc_co_preadv_part,

    .is_filter                  = true,
    .strong_runtime_opts        = cc_strong_runtime_opts,
};

static void bdrv_clone_cache_init(void)
{
    bdrv_register(&bdrv_clone_cache);
}

block_init(bdrv_clone_cache_init);

/* ---- QMP ---- */

static int cc_info_one(Object *obj, void *opaque)
{
    CloneCacheInfoList ***tail = opaque;
    CloneCacheStore *s = (CloneCacheStore *)object_dynamic_cast(
        obj, TYPE_CLONE_CACHE);

    if (s && s->blk) {
        CloneCacheInfo *info = clone_cache_store_info(s);

        info->id = g_strdup(object_get_canonical_path_component(obj));
        QAPI_LIST_APPEND(*tail, info);
    }
    return 0;
}

CloneCacheInfoList *qmp_query_clone_cache(Error **errp)
{
    CloneCacheInfoList *head = NULL, **tail = &head;

    object_child_foreach(object_get_objects_root(), cc_info_one, &tail);
    return head;
}

CloneCacheInfo *clone_cache_store_info(CloneCacheStore *s)
{
    CloneCacheInfo *info = g_new0(CloneCacheInfo, 1);
    CloneCacheBaseInfoList **tail = &info->bases;
    int b;

    qemu_mutex_lock(&s->lock);
    info->filename = g_strdup(s->filename);
    info->size = s->size;
    info->block_size = s->block_size;
    info->slots = s->nb_slots;
    info->used = s->nb_slots - s->nb_free;
    info->pinned = s->nb_pinned;
    info->evictions = s->evictions;
    info->dedup_shared = s->dedup_shared;
    info->fill_pending = s->fill_pending;
    info->fill_errors = s->fill_errors;
    info->checksum_errors = s->checksum_errors;
    info->discarded_records = s->discarded_records;
    for (b = 0; b < CC_MAX_BASES; b++) {
        CloneCacheBase *base = &s->bases[b];
        CloneCacheBaseInfo *bi;

        if (!base->id) {
            continue;
        }
        bi = g_new0(CloneCacheBaseInfo, 1);
        bi->base_id = g_strdup(base->id);
        bi->generation = base->generation;
        bi->node_name = g_strdup(base->node_name);
        bi->open = base->users > 0;
        bi->entries = base->nb_entries;
        bi->hits = base->st.hits;
        bi->misses = base->st.misses;
        bi->merged_misses = base->st.merged;
        bi->base_read_bytes = base->st.base_read_bytes;
        bi->cache_read_bytes = base->st.cache_read_bytes;
        bi->fills = base->st.fills;
        bi->fill_bytes = base->st.fill_bytes;
        bi->fills_dropped = base->st.fills_dropped;
        QAPI_LIST_APPEND(tail, bi);
    }
    qemu_mutex_unlock(&s->lock);
    return info;
}

/* ---- boot-set traces ---- */

#define CC_TRACE_MAGIC      "clone-cache-trace 1"
#define CC_TRACE_MAX_BYTES  (256 * MiB)

static BlockDriverState *cc_find_node(const char *node_name, Error **errp)
{
    BlockDriverState *bs = bdrv_find_node(node_name);

    if (!bs) {
        error_setg(errp, "Cannot find node '%s'", node_name);
        return NULL;
    }
    if (bs->drv != &bdrv_clone_cache) {
        error_setg(errp, "Node '%s' is not a clone-cache node", node_name);
        return NULL;
    }
    return bs;
}

void qmp_clone_cache_record(const char *node_name, Error **errp)
{
    BlockDriverState *bs = cc_find_node(node_name, errp);
    BDRVCloneCacheState *s;

    if (!bs) {
        return;
    }
    s = bs->opaque;
    qemu_mutex_lock(&s->store->lock);
    if (s->rec_seen) {
        error_setg(errp, "Node '%s' is already recording", node_name);
    } else {
        s->rec_seen = bitmap_new(s->nb_blocks);
        s->rec_order = g_array_new(false, false, sizeof(uint64_t));
    }
    qemu_mutex_unlock(&s->store->lock);
}

CloneCacheTrace *qmp_clone_cache_record_stop(const char *node_name,
                                             const char *filename,
                                             Error **errp)
{
    BlockDriverState *bs = cc_find_node(node_name, errp);
    BDRVCloneCacheState *s;
    g_autoptr(GString) out = g_string_new(NULL);
    g_autoptr(GArray) order = NULL;
    g_autofree unsigned long *seen = NULL;
    CloneCacheTrace *ret;
    uint64_t i, n;
    int fd;

    if (!bs) {
        return NULL;
    }
    s = bs->opaque;
    qemu_mutex_lock(&s->store->lock);
    order = s->rec_order;
    seen = s->rec_seen;
    s->rec_order = NULL;
    s->rec_seen = NULL;
    qemu_mutex_unlock(&s->store->lock);
    if (!order) {
        error_setg(errp, "Node '%s' is not recording", node_name);
        return NULL;
    }
    n = order->len;
    g_string_append_printf(out, CC_TRACE_MAGIC " %" PRIu64 " %" PRIu64 "\n",
                           s->store->block_size, s->nb_blocks);
    for (i = 0; i < n; i++) {
        g_string_append_printf(out, "%" PRIu64 "\n",
                               g_array_index(order, uint64_t, i));
    }
    fd = qemu_create(filename, O_WRONLY | O_TRUNC | O_BINARY, 0600, errp);
    if (fd < 0) {
        return NULL;
    }
    if (qemu_write_full(fd, out->str, out->len) != out->len ||
        qemu_fdatasync(fd) < 0) {
        error_setg_errno(errp, errno, "Cannot write '%s'", filename);
        qemu_close(fd);
        return NULL;
    }
    qemu_close(fd);
    ret = g_new0(CloneCacheTrace, 1);
    ret->blocks = n;
    return ret;
}

/* Parse and check a trace: the blocks, or NULL with @errp set */
static GArray *cc_trace_load(BDRVCloneCacheState *s, const char *filename,
                             Error **errp)
{
    g_autofree char *text = NULL;
    g_autoptr(GArray) blocks = g_array_new(false, false, sizeof(uint64_t));
    g_autoptr(GError) gerr = NULL;
    uint64_t bsz, nb, b;
    char *line, *save = NULL, *end;
    gsize len;
    int lineno = 1;

    if (!g_file_get_contents(filename, &text, &len, &gerr)) {
        error_setg(errp, "Cannot read trace '%s': %s", filename,
                   gerr->message);
        return NULL;
    }
    if (len > CC_TRACE_MAX_BYTES || strlen(text) != len) {
        error_setg(errp, "'%s' is not a clone-cache trace", filename);
        return NULL;
    }
    line = strtok_r(text, "\n", &save);
    if (!line || sscanf(line, CC_TRACE_MAGIC " %" SCNu64 " %" SCNu64, &bsz,
                        &nb) != 2) {
        error_setg(errp, "'%s' is not a clone-cache trace", filename);
        return NULL;
    }
    if (bsz != s->store->block_size || nb != s->nb_blocks) {
        error_setg(errp, "Trace '%s' was recorded with block size %" PRIu64
                   " over %" PRIu64 " blocks; this node has %" PRIu64
                   " over %" PRIu64, filename, bsz, nb, s->store->block_size,
                   s->nb_blocks);
        return NULL;
    }
    while ((line = strtok_r(NULL, "\n", &save))) {
        lineno++;
        if (qemu_strtou64(line, (const char **)&end, 10, &b) < 0 ||
            *end || b >= s->nb_blocks) {
            error_setg(errp, "Trace '%s', line %d: not a block of this base",
                       filename, lineno);
            return NULL;
        }
        g_array_append_val(blocks, b);
    }
    return g_steal_pointer(&blocks);
}

typedef struct CloneCachePrewarm {
    BlockDriverState *bs;
    GArray *blocks;
    bool pin;
} CloneCachePrewarm;

/* Cache (and pin) one block; the graph lock only while it is read */
static int coroutine_fn cc_prewarm_one(BlockDriverState *bs, uint64_t block,
                                       bool pin)
{
    BDRVCloneCacheState *s = bs->opaque;
    CloneCacheStore *store = s->store;
    CloneCacheInflight *f;
    uint32_t slot;
    int ret;

    GRAPH_RDLOCK_GUARD();
    qemu_mutex_lock(&store->lock);
    slot = clone_cache_lookup(store, s->base, block);
    if (slot != CC_NONE) {
        qemu_mutex_unlock(&store->lock);
        return clone_cache_pin(store, slot, pin);
    }
    if (!cc_is_miss(s, block)) {
        qemu_mutex_unlock(&store->lock);
        return 0;               /* a guest read has it in flight */
    }
    f = g_new0(CloneCacheInflight, 1);
    f->first = block;
    f->nb = 1;
    f->refs = 1;
    f->buf = qemu_try_blockalign(bs->file->bs, store->block_size);
    if (!f->buf) {
        g_free(f);
        qemu_mutex_unlock(&store->lock);
        return -ENOMEM;
    }
    qemu_co_queue_init(&f->waiters);
    ret = cc_read_base(bs, f, pin);
    cc_inflight_unref(f);
    qemu_mutex_unlock(&store->lock);
    return ret;
}

/*
 * Read the trace's blocks through the miss path, one block at a time (a
 * boot set is small; the fills are what matter), pinning those cached
 * already when asked.  A drained section (the node closing) ends it.
 */
static void coroutine_fn cc_prewarm_co(void *opaque)
{
    CloneCachePrewarm *p = opaque;
    BlockDriverState *bs = p->bs;
    BDRVCloneCacheState *s = bs->opaque;
    uint64_t i;
    int ret = 0;

    for (i = 0; i < p->blocks->len; i++) {
        uint64_t block = g_array_index(p->blocks, uint64_t, i);

        if (qatomic_read(&bs->quiesce_counter)) {
            break;
        }
        ret = cc_prewarm_one(bs, block, p->pin);
        if (ret < 0) {
            warn_report("clone-cache: prewarming node '%s' stopped at block "
                        "%" PRIu64 " of %u: %s", bdrv_get_node_name(bs), i,
                        p->blocks->len, strerror(-ret));
            break;
        }
    }
    trace_clone_cache_prewarm_done(bs, i, p->blocks->len);
    qatomic_store_release(&s->prewarming, false);
    g_array_free(p->blocks, true);
    g_free(p);
    bdrv_dec_in_flight(bs);
}

void qmp_clone_cache_prewarm(const char *node_name, const char *filename,
                             bool has_pin, bool pin, Error **errp)
{
    BlockDriverState *bs;
    BDRVCloneCacheState *s;
    CloneCachePrewarm *p;
    GArray *blocks;

    GLOBAL_STATE_CODE();
    bs = cc_find_node(node_name, errp);
    if (!bs) {
        return;
    }
    s = bs->opaque;
    if (qatomic_load_acquire(&s->prewarming)) {
        error_setg(errp, "Node '%s' is already prewarming", node_name);
        return;
    }
    blocks = cc_trace_load(s, filename, errp);
    if (!blocks) {
        return;
    }
    p = g_new0(CloneCachePrewarm, 1);
    p->bs = bs;
    p->blocks = blocks;
    p->pin = has_pin && pin;
    qatomic_set(&s->prewarming, true);
    bdrv_inc_in_flight(bs);
    aio_co_enter(bdrv_get_aio_context(bs),
                 qemu_coroutine_create(cc_prewarm_co, p));
}

/* A coroutine command: the slot table is scanned in steps */
void coroutine_fn qmp_clone_cache_unpin(const char *node_name, Error **errp)
{
    BlockDriverState *bs;
    BDRVCloneCacheState *s;

    GLOBAL_STATE_CODE();
    bs = cc_find_node(node_name, errp);
    if (!bs) {
        return;
    }
    bdrv_ref(bs);               /* the node may close while we yield */
    s = bs->opaque;
    clone_cache_unpin_base(s->store, s->base, errp);
    bdrv_co_unref(bs);
}

void qmp_clone_cache_invalidate(const char *id, const char *base_id,
                                Error **errp)
{
    CloneCacheStore *s = clone_cache_store_find(id, errp);

    if (s) {
        clone_cache_invalidate(s, base_id, errp);
    }
}
