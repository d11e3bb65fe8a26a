/*
 * Hybrid block format: the on-disk header (byte order, validation, the
 * DIRTY flag's write) and image creation
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qapi/error.h"
#include "qapi/qapi-visit-block-core.h"
#include "qapi/qobject-input-visitor.h"
#include "qobject/qdict.h"
#include "qemu/cutils.h"
#include "qemu/crc32c.h"
#include "qemu/option.h"
#include "block/block-io.h"
#include "block/block_int.h"
#include "block/qdict.h"
#include "system/block-backend.h"
#include "hybrid.h"
#include "trace.h"

/* ---- header ---- */

static void hybrid_header_to_cpu(HybridHeader *h)
{
    h->version = le32_to_cpu(h->version);
    h->header_size = le32_to_cpu(h->header_size);
    h->incompat_features = le64_to_cpu(h->incompat_features);
    h->flags = le64_to_cpu(h->flags);
    h->virtual_size = le64_to_cpu(h->virtual_size);
    h->data_offset = le64_to_cpu(h->data_offset);
    h->ram_size = le64_to_cpu(h->ram_size);
    h->block_size = le32_to_cpu(h->block_size);
    h->header_crc = le32_to_cpu(h->header_crc);
    h->region_token = le64_to_cpu(h->region_token);
    h->backing_version = le32_to_cpu(h->backing_version);
    h->backing_name_len = le16_to_cpu(h->backing_name_len);
    h->backing_name_offset = le64_to_cpu(h->backing_name_offset);
    h->backing_name_crc = le32_to_cpu(h->backing_name_crc);
    h->backing_reserved2 = le32_to_cpu(h->backing_reserved2);
    h->bitmap_offset = le64_to_cpu(h->bitmap_offset);
    h->bitmap_blocks = le64_to_cpu(h->bitmap_blocks);
}

/* Convert to disk byte order and compute the checksum. */
void hybrid_header_to_le(const HybridHeader *cpu, HybridHeader *le)
{
    *le = *cpu;
    le->version = cpu_to_le32(cpu->version);
    le->header_size = cpu_to_le32(cpu->header_size);
    le->incompat_features = cpu_to_le64(cpu->incompat_features);
    le->flags = cpu_to_le64(cpu->flags);
    le->virtual_size = cpu_to_le64(cpu->virtual_size);
    le->data_offset = cpu_to_le64(cpu->data_offset);
    le->ram_size = cpu_to_le64(cpu->ram_size);
    le->block_size = cpu_to_le32(cpu->block_size);
    le->region_token = cpu_to_le64(cpu->region_token);
    le->backing_version = cpu_to_le32(cpu->backing_version);
    le->backing_name_len = cpu_to_le16(cpu->backing_name_len);
    le->backing_name_offset = cpu_to_le64(cpu->backing_name_offset);
    le->backing_name_crc = cpu_to_le32(cpu->backing_name_crc);
    le->backing_reserved2 = cpu_to_le32(cpu->backing_reserved2);
    le->bitmap_offset = cpu_to_le64(cpu->bitmap_offset);
    le->bitmap_blocks = cpu_to_le64(cpu->bitmap_blocks);
    le->header_crc = 0;
    le->header_crc = cpu_to_le32(crc32c(0xffffffff, (uint8_t *)le,
                                        cpu->header_size));
}

static bool hybrid_block_size_valid(uint64_t bsz)
{
    return bsz >= HYBRID_MIN_BLOCK_SIZE && bsz <= HYBRID_MAX_BLOCK_SIZE &&
           is_power_of_2(bsz);
}

/* The block-size option of raw=on and of image creation. */
int hybrid_check_block_size_opt(uint64_t bsz, Error **errp)
{
    if (!hybrid_block_size_valid(bsz)) {
        error_setg(errp, "block-size %" PRIu64 " is not a power of two "
                   "in [%d, %d]", bsz, HYBRID_MIN_BLOCK_SIZE,
                   HYBRID_MAX_BLOCK_SIZE);
        return -EINVAL;
    }
    return 0;
}

/* Slot indices are 32 bits: @blocks RAM blocks of @bsz bytes must fit. */
int hybrid_check_ram_blocks(uint64_t blocks, uint64_t ram_size,
                            uint64_t bsz, Error **errp)
{
    if (blocks > UINT32_MAX) {
        error_setg(errp, "ram-size %" PRIu64 " is too large (at most %"
                   PRIu64 " blocks of %" PRIu64 " bytes)", ram_size,
                   (uint64_t)UINT32_MAX, bsz);
        return -EINVAL;
    }
    return 0;
}

/*
 * A ram-size the user gives must fit the disk: a larger one would promise
 * RAM the image never uses.  (A stored one may exceed the disk after a
 * shrink; the RAM tier is then the whole disk.)
 */
int hybrid_check_ram_size(uint64_t ram_size, uint64_t bsz,
                          uint64_t disk_size, Error **errp)
{
    if (ram_size > disk_size) {
        error_setg(errp, "ram-size %" PRIu64 " is larger than the disk (%"
                   PRIu64 " bytes): the RAM tier holds at most the whole "
                   "disk; give ram-size=%" PRIu64 " or less", ram_size,
                   disk_size, disk_size);
        return -EINVAL;
    }
    return hybrid_check_ram_blocks(ram_size / bsz, ram_size, bsz, errp);
}

/*
 * Validate a header as read from disk (@le, disk byte order) and convert it
 * into @h.  Every field is checked: the image is untrusted input.
 */
int hybrid_header_check(const HybridHeader *le, HybridHeader *h,
                        Error **errp)
{
    HybridHeader tmp = *le;
    uint32_t crc;

    if (memcmp(le->magic, HYBRID_MAGIC, sizeof(le->magic))) {
        error_setg(errp, "Image is not in hybrid format (bad magic)");
        return -EINVAL;
    }
    *h = *le;
    hybrid_header_to_cpu(h);
    if (h->version != HYBRID_VERSION) {
        error_setg(errp, "Unsupported hybrid image (version %" PRIu32
                   " is not %d)", h->version, HYBRID_VERSION);
        return -ENOTSUP;
    }
    if (h->header_size != HYBRID_HEADER_SIZE &&
        h->header_size != HYBRID_HEADER_SIZE_EXT &&
        h->header_size != HYBRID_HEADER_SIZE_BACKING) {
        error_setg(errp, "Unsupported hybrid image (header size %" PRIu32
                   " is not %d, %d or %d)", h->header_size,
                   HYBRID_HEADER_SIZE, HYBRID_HEADER_SIZE_EXT,
                   HYBRID_HEADER_SIZE_BACKING);
        return -ENOTSUP;
    }
    /* The caller may have read bytes of block 0 past a short header */
    if (h->header_size < HYBRID_HEADER_SIZE_BACKING) {
        size_t ext = offsetof(HybridHeader, backing_version);

        memset((uint8_t *)&tmp + ext, 0, sizeof(tmp) - ext);
        memset((uint8_t *)h + ext, 0, sizeof(*h) - ext);
    }
    if (h->header_size < HYBRID_HEADER_SIZE_EXT) {
        memset(&tmp.region_token, 0, sizeof(tmp.region_token));
        h->region_token = 0;
    }
    tmp.header_crc = 0;
    crc = crc32c(0xffffffff, (uint8_t *)&tmp, h->header_size);
    if (crc != h->header_crc) {
        error_setg(errp, "Corrupt hybrid image (header checksum 0x%08" PRIx32
                   " does not match computed 0x%08" PRIx32 ")",
                   h->header_crc, crc);
        return -EINVAL;
    }
    if (h->incompat_features & ~HYBRID_INCOMPAT_KNOWN) {
        error_setg(errp, "Unsupported hybrid image (incompatible features "
                   "0x%" PRIx64 ")",
                   (uint64_t)(h->incompat_features & ~HYBRID_INCOMPAT_KNOWN));
        return -ENOTSUP;
    }
    if ((h->incompat_features & HYBRID_INCOMPAT_REGION) &&
        (h->header_size < HYBRID_HEADER_SIZE_EXT || !h->region_token)) {
        error_setg(errp, "Corrupt hybrid image (region feature without a "
                   "region token)");
        return -EINVAL;
    }
    if (!!(h->incompat_features & HYBRID_INCOMPAT_BACKING) !=
        (h->header_size >= HYBRID_HEADER_SIZE_BACKING)) {
        error_setg(errp, "Corrupt hybrid image (header size %" PRIu32
                   " does not match the backing feature)", h->header_size);
        return -EINVAL;
    }
    if (h->flags & ~HYBRID_FLAGS_KNOWN) {
        error_setg(errp, "Unsupported hybrid image (unknown flags 0x%" PRIx64
                   ")", (uint64_t)(h->flags & ~HYBRID_FLAGS_KNOWN));
        return -ENOTSUP;
    }
    if (!hybrid_block_size_valid(h->block_size)) {
        error_setg(errp, "Unsupported hybrid image (block size %" PRIu32
                   " is not a power of two in [%d, %d])", h->block_size,
                   HYBRID_MIN_BLOCK_SIZE, HYBRID_MAX_BLOCK_SIZE);
        return -ENOTSUP;
    }
    if (h->virtual_size > HYBRID_MAX_VIRTUAL_SIZE ||
        h->virtual_size % BDRV_SECTOR_SIZE) {
        error_setg(errp, "Unsupported hybrid image (virtual size %" PRIu64
                   " is not a multiple of %llu up to %llu)", h->virtual_size,
                   BDRV_SECTOR_SIZE, HYBRID_MAX_VIRTUAL_SIZE);
        return -ENOTSUP;
    }
    if (h->data_offset < h->header_size ||
        h->data_offset % BDRV_SECTOR_SIZE ||
        h->data_offset > HYBRID_MAX_VIRTUAL_SIZE) {
        error_setg(errp, "Corrupt hybrid image (data offset %" PRIu64
                   " is not a multiple of %llu in [%" PRIu32 ", %llu])",
                   h->data_offset,
                   BDRV_SECTOR_SIZE, h->header_size,
                   HYBRID_MAX_VIRTUAL_SIZE);
        return -EINVAL;
    }
    if (h->mode > HYBRID_HDR_MODE_ASYNC || h->dedup > 1) {
        error_setg(errp, "Corrupt hybrid image (mode %u, dedup %u)",
                   h->mode, h->dedup);
        return -EINVAL;
    }
    if (h->incompat_features & HYBRID_INCOMPAT_BACKING) {
        return hybrid_backing_check_header(h, errp);
    }
    return 0;
}

/*
 * Read the header as it is on disk into @le: its extension too when the
 * persistent tier is long enough to hold one (hybrid_header_check() looks
 * at header_size and ignores what lies beyond it).  @child_len is the
 * persistent tier's length, or a negative errno.
 */
int GRAPH_RDLOCK hybrid_read_header(BdrvChild *file, int64_t child_len,
                                    HybridHeader *le)
{
    int64_t len;

    if (child_len < 0) {
        return child_len;
    }
    len = MIN(child_len, (int64_t)sizeof(*le));
    memset(le, 0, sizeof(*le));
    return bdrv_pread(file, 0, len, le, 0);
}

int coroutine_fn GRAPH_RDLOCK
hybrid_write_header(BDRVHybridState *s, uint64_t flags)
{
    HybridHeader le;
    int ret;

    s->header.flags = flags;
    hybrid_header_to_le(&s->header, &le);
    ret = bdrv_co_pwrite(s->bs->file, 0, s->header.header_size, &le, 0);
    if (ret < 0) {
        return ret;
    }
    return bdrv_co_flush(s->bs->file->bs);
}

/* Set the DIRTY flag on disk before the first write of this open. */
int coroutine_fn GRAPH_RDLOCK hybrid_mark_dirty(BDRVHybridState *s)
{
    int ret = 0;

    if (s->raw || s->header_dirty_on_disk) {
        return 0;
    }
    WITH_QEMU_LOCK_GUARD(&s->header_lock) {
        if (!s->header_dirty_on_disk) {
            if (s->region || s->mirror_name) {
                /* Acknowledged writes may now exist only in the region */
                s->header.incompat_features |= HYBRID_INCOMPAT_REGION;
            } else {
                /* Whatever region was bound no longer holds the newest */
                s->header.region_token = 0;
            }
            ret = hybrid_write_header(s, s->header.flags | HYBRID_FLAG_DIRTY);
            if (ret == 0) {
                s->header_dirty_on_disk = true;
            }
            trace_hybrid_mark_dirty(s, ret);
        }
    }
    return ret;
}

/* ---- create ---- */

int coroutine_fn GRAPH_UNLOCKED
hybrid_co_create(BlockdevCreateOptions *create_options, Error **errp)
{
    ERRP_GUARD();
    BlockdevCreateOptionsHybrid *o;
    BlockDriverState *bs_file = NULL;
    BlockBackend *blk = NULL;
    HybridHeader h, le;
    uint64_t bsz, size, data_offset = HYBRID_DATA_OFFSET;
    int ret;

    assert(create_options->driver == BLOCKDEV_DRIVER_HYBRID);
    o = &create_options->u.hybrid;

    bsz = o->has_block_size ? o->block_size : HYBRID_DEFAULT_BLOCK_SIZE;
    ret = hybrid_check_block_size_opt(bsz, errp);
    if (ret < 0) {
        return ret;
    }
    size = o->size;
    if (size > HYBRID_MAX_VIRTUAL_SIZE || size % BDRV_SECTOR_SIZE) {
        error_setg(errp, "size %" PRIu64 " is not a multiple of %llu up to %llu",
                   size, BDRV_SECTOR_SIZE, HYBRID_MAX_VIRTUAL_SIZE);
        return -EINVAL;
    }
    if (o->has_ram_size) {
        ret = hybrid_check_ram_blocks(o->ram_size / bsz, o->ram_size, bsz,
                                      errp);
        ret = ret ?: hybrid_check_ram_size(o->ram_size, bsz, size, errp);
        if (ret < 0) {
            return ret;
        }
    }

    memset(&h, 0, sizeof(h));
    memcpy(h.magic, HYBRID_MAGIC, sizeof(h.magic));
    h.version = HYBRID_VERSION;
    h.header_size = HYBRID_HEADER_SIZE;
    h.virtual_size = size;
    h.data_offset = data_offset;
    h.ram_size = o->has_ram_size ? o->ram_size : size;
    h.block_size = bsz;
    h.mode = (o->has_mode && o->mode == HYBRID_MODE_ASYNC) ?
             HYBRID_HDR_MODE_ASYNC : HYBRID_HDR_MODE_SYNC;
    h.dedup = o->has_dedup && o->dedup;
    if (o->backing_file) {
        ret = hybrid_backing_layout(&h, o->backing_file,
                                    o->has_backing_fmt ?
                                    BlockdevDriver_str(o->backing_fmt) : NULL,
                                    errp);
        if (ret < 0) {
            return ret;
        }
        data_offset = h.data_offset;
    } else if (o->has_backing_fmt) {
        error_setg(errp, "backing-fmt is only valid with backing-file");
        return -EINVAL;
    }
    hybrid_header_to_le(&h, &le);

    bs_file = bdrv_co_open_blockdev_ref(o->file, errp);
    if (!bs_file) {
        return -EIO;
    }
    blk = blk_co_new_with_bs(bs_file, BLK_PERM_WRITE | BLK_PERM_RESIZE,
                             BLK_PERM_ALL, errp);
    if (!blk) {
        ret = -EPERM;
        goto out;
    }
    blk_set_allow_write_beyond_eof(blk, true);

    /* Size first: a header on a too small device must not be written */
    ret = blk_co_truncate(blk, data_offset + ROUND_UP(size, bsz), false,
                          PREALLOC_MODE_OFF, 0, errp);
    if (ret < 0) {
        error_prepend(errp, "Could not size the persistent tier to %" PRIu64
                      " bytes: ", data_offset + ROUND_UP(size, bsz));
        goto out;
    }
    ret = blk_co_pwrite_zeroes(blk, 0, data_offset, 0);
    if (ret == 0 && o->backing_file) {
        /* The name (slot A) before the header that points at it */
        g_autofree char *slot = g_strconcat(o->backing_file,
            o->has_backing_fmt ? BlockdevDriver_str(o->backing_fmt) : "",
            NULL);

        ret = blk_co_pwrite(blk, h.backing_name_offset, strlen(slot), slot,
                            0);
    }
    if (ret == 0) {
        ret = blk_co_pwrite(blk, 0, h.header_size, &le, 0);
    }
    if (ret == 0) {
        ret = blk_co_flush(blk);
    }
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not write the hybrid header");
    }
out:
    blk_co_unref(blk);
    bdrv_co_unref(bs_file);
    return ret;
}

QemuOptsList hybrid_create_opts = {
    .name = "hybrid-create-opts",
    .head = QTAILQ_HEAD_INITIALIZER(hybrid_create_opts.head),
    .desc = {
        {
            .name = BLOCK_OPT_SIZE,
            .type = QEMU_OPT_SIZE,
            .help = "Virtual disk size"
        },
        HYBRID_HEADER_OPTIONS,
        {
            .name = BLOCK_OPT_BACKING_FILE,
            .type = QEMU_OPT_STRING,
            .help = "File name of a base image"
        },
        {
            .name = BLOCK_OPT_BACKING_FMT,
            .type = QEMU_OPT_STRING,
            .help = "Image format of the base image"
        },
        { /* end of list */ }
    }
};

int coroutine_fn GRAPH_UNLOCKED
hybrid_co_create_opts(BlockDriver *drv, const char *filename, QemuOpts *opts,
                      Error **errp)
{
    g_autoptr(QDict) qdict = NULL;
    BlockdevCreateOptions *create_options = NULL;
    BlockDriverState *bs_file = NULL;
    Visitor *v;
    int ret;

    static const QDictRenames opt_renames[] = {
        { BLOCK_OPT_BACKING_FILE,       "backing-file" },
        { BLOCK_OPT_BACKING_FMT,        "backing-fmt" },
        { NULL, NULL },
    };

    qdict = qemu_opts_to_qdict_filtered(opts, NULL, &hybrid_create_opts,
                                        true);
    if (!qdict_rename_keys(qdict, opt_renames, errp)) {
        return -EINVAL;
    }
    ret = bdrv_co_create_file(filename, opts, errp);
    if (ret < 0) {
        goto done;
    }
    bs_file = bdrv_co_open(filename, NULL, NULL,
                           BDRV_O_RDWR | BDRV_O_RESIZE | BDRV_O_PROTOCOL, errp);
    if (!bs_file) {
        ret = -EIO;
        goto done;
    }

    qdict_put_str(qdict, "driver", "hybrid");
    qdict_put_str(qdict, "file", bs_file->node_name);

    v = qobject_input_visitor_new_flat_confused(qdict, errp);
    if (!v) {
        ret = -EINVAL;
        goto done;
    }
    visit_type_BlockdevCreateOptions(v, NULL, &create_options, errp);
    visit_free(v);
    if (!create_options) {
        ret = -EINVAL;
        goto done;
    }
    /* Silently round up the size, like the other formats */
    create_options->u.hybrid.size =
        ROUND_UP(create_options->u.hybrid.size, BDRV_SECTOR_SIZE);

    ret = hybrid_co_create(create_options, errp);
done:
    qapi_free_BlockdevCreateOptions(create_options);
    bdrv_co_unref(bs_file);
    return ret;
}
