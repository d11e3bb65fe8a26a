/*
 * hvmem broker catalogue (see catalog.h for the format and commit protocol).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <gio/gio.h>
#include <zlib.h>

#include "catalog.h"

static void item_free(gpointer p)
{
    HvmItem *it = p;

    g_free(it->name);
    g_free(it);
}

HvmRegion *hvm_region_new(const char *name, uint64_t id, uint64_t size,
                          uint32_t mode, uint32_t uid, uint32_t gid)
{
    HvmRegion *r = g_new0(HvmRegion, 1);

    r->name = g_strdup(name);
    r->id = id;
    r->size = size;
    r->mode = mode;
    r->uid = uid;
    r->gid = gid;
    r->items = g_ptr_array_new_with_free_func(item_free);
    return r;
}

void hvm_region_free(HvmRegion *r)
{
    if (r) {
        g_ptr_array_free(r->items, TRUE);
        g_free(r->name);
        g_free(r);
    }
}

HvmCatalog *hvm_catalog_new(void)
{
    HvmCatalog *cat = g_new0(HvmCatalog, 1);

    cat->regions = g_hash_table_new(g_str_hash, g_str_equal);
    cat->by_id = g_ptr_array_new();
    cat->next_id = 1;
    return cat;
}

/* Where a region with @id is, or goes, in cat->by_id */
static guint by_id_index(const HvmCatalog *cat, uint64_t id)
{
    guint lo = 0, hi = cat->by_id->len;

    while (lo < hi) {
        guint mid = lo + (hi - lo) / 2;
        const HvmRegion *m = g_ptr_array_index(cat->by_id, mid);

        if (m->id < id) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/*
 * New regions take the next id, so a create appends; every commit then
 * writes the regions in id order without sorting them.
 */
void hvm_catalog_add(HvmCatalog *cat, HvmRegion *r)
{
    guint n = cat->by_id->len;
    const HvmRegion *last = n ? g_ptr_array_index(cat->by_id, n - 1) : NULL;

    g_hash_table_insert(cat->regions, r->name, r);
    if (!last || last->id < r->id) {
        g_ptr_array_add(cat->by_id, r);
    } else {
        g_ptr_array_insert(cat->by_id, by_id_index(cat, r->id), r);
    }
}

void hvm_catalog_remove(HvmCatalog *cat, HvmRegion *r)
{
    guint i = by_id_index(cat, r->id);

    g_assert(i < cat->by_id->len && g_ptr_array_index(cat->by_id, i) == r);
    g_ptr_array_remove_index(cat->by_id, i);
    g_hash_table_remove(cat->regions, r->name);
}

void hvm_catalog_free(HvmCatalog *cat)
{
    GHashTableIter it;
    gpointer v;

    if (!cat) {
        return;
    }
    g_hash_table_iter_init(&it, cat->regions);
    while (g_hash_table_iter_next(&it, NULL, &v)) {
        hvm_region_free(v);
    }
    g_hash_table_destroy(cat->regions);
    g_ptr_array_free(cat->by_id, TRUE);
    g_free(cat);
}

uint64_t hvm_region_used(const HvmRegion *r)
{
    uint64_t used = 0;

    for (guint i = 0; i < r->items->len; i++) {
        used += ((HvmItem *)g_ptr_array_index(r->items, i))->size;
    }
    return used;
}

uint64_t hvm_region_items_end(const HvmRegion *r)
{
    HvmItem *last;

    if (!r->items->len) {
        return 0;
    }
    last = g_ptr_array_index(r->items, r->items->len - 1);
    return last->offset + last->size;
}

HvmItem *hvm_region_find_item(const HvmRegion *r, const char *name)
{
    for (guint i = 0; i < r->items->len; i++) {
        HvmItem *it = g_ptr_array_index(r->items, i);

        if (!strcmp(it->name, name)) {
            return it;
        }
    }
    return NULL;
}

HvmItem *hvm_region_alloc_item(HvmRegion *r, const char *name, uint64_t size,
                               int *err)
{
    uint64_t limit = r->size & ~(HVM_ITEM_ALIGN - 1);
    uint64_t pos = 0;
    guint i;
    HvmItem *it;

    if (hvm_region_find_item(r, name)) {
        *err = -EEXIST;
        return NULL;
    }
    if (r->items->len >= HVM_MAX_ITEMS) {
        *err = -ENOSPC;
        return NULL;
    }
    if (size == 0 || size > HVM_MAX_SIZE) {
        *err = -EINVAL;
        return NULL;
    }
    size = (size + HVM_ITEM_ALIGN - 1) & ~(HVM_ITEM_ALIGN - 1);
    /* Items are sorted by offset: the first gap of @size bytes wins. */
    for (i = 0; i <= r->items->len; i++) {
        uint64_t end = limit;

        if (i < r->items->len) {
            end = ((HvmItem *)g_ptr_array_index(r->items, i))->offset;
        }
        if (end >= pos && end - pos >= size) {
            break;
        }
        if (i < r->items->len) {
            it = g_ptr_array_index(r->items, i);
            pos = it->offset + it->size;
        }
    }
    if (i > r->items->len) {
        *err = -ENOSPC;
        return NULL;
    }
    it = g_new0(HvmItem, 1);
    it->name = g_strdup(name);
    it->offset = pos;
    it->size = size;
    g_ptr_array_insert(r->items, i, it);
    *err = 0;
    return it;
}

void hvm_region_insert_item(HvmRegion *r, const char *name, uint64_t offset,
                            uint64_t size)
{
    HvmItem *it = g_new0(HvmItem, 1);
    guint i = 0;

    it->name = g_strdup(name);
    it->offset = offset;
    it->size = size;
    while (i < r->items->len &&
           ((HvmItem *)g_ptr_array_index(r->items, i))->offset < offset) {
        i++;
    }
    g_ptr_array_insert(r->items, i, it);
}

int hvm_region_free_item(HvmRegion *r, const char *name)
{
    HvmItem *it = hvm_region_find_item(r, name);

    if (!it) {
        return -ENOENT;
    }
    g_ptr_array_remove(r->items, it);
    return 0;
}

/* CRC-32 (ISO-HDLC, zlib's): every mutation re-checksums the catalogue */
uint32_t hvm_crc32(uint32_t crc, const void *buf, size_t len)
{
    return crc32_z(crc, buf, len);
}

GByteArray *hvm_catalog_serialize(const HvmCatalog *cat)
{
    GByteArray *body = g_byte_array_new();
    GByteArray *out = g_byte_array_new();
    /* A stable order makes equal catalogues byte-identical. */
    const GPtrArray *list = cat->by_id;

    for (guint i = 0; i < list->len; i++) {
        HvmRegion *r = g_ptr_array_index(list, i);

        hvm_put_u16(body, strlen(r->name));
        hvm_put_u16(body, r->items->len);
        hvm_put_u32(body, r->mode);
        hvm_put_u32(body, r->uid);
        hvm_put_u32(body, r->gid);
        hvm_put_u64(body, r->id);
        hvm_put_u64(body, r->size);
        g_byte_array_append(body, (const uint8_t *)r->name, strlen(r->name));
        for (guint j = 0; j < r->items->len; j++) {
            HvmItem *it = g_ptr_array_index(r->items, j);

            hvm_put_u64(body, it->offset);
            hvm_put_u64(body, it->size);
            hvm_put_u16(body, strlen(it->name));
            hvm_put_u16(body, 0);
            hvm_put_u32(body, 0);
            g_byte_array_append(body, (const uint8_t *)it->name, strlen(it->name));
        }
    }
    hvm_put_u64(out, HVM_CAT_MAGIC);
    hvm_put_u32(out, HVM_CAT_VERSION);
    hvm_put_u32(out, list->len);
    hvm_put_u64(out, cat->next_id);
    hvm_put_u64(out, cat->generation);
    hvm_put_u32(out, body->len);
    hvm_put_u32(out, hvm_crc32(0, body->data, body->len));
    hvm_put_u32(out, hvm_crc32(0, out->data, out->len));
    hvm_put_u32(out, 0);
    g_byte_array_append(out, body->data, body->len);
    g_byte_array_free(body, TRUE);
    return out;
}

#define BAD(...) do { \
    g_set_error(errp, G_IO_ERROR, G_IO_ERROR_INVALID_DATA, __VA_ARGS__); \
    goto fail; \
} while (0)

static bool read_name(HvmReader *r, uint16_t len, char *dst)
{
    const uint8_t *p = hvm_get_bytes(r, len);

    if (!p || hvm_name_check((const char *)p, len)) {
        return false;
    }
    memcpy(dst, p, len);
    dst[len] = '\0';
    return true;
}

HvmCatalog *hvm_catalog_parse(const uint8_t *buf, size_t len, GError **errp)
{
    HvmCatalog *cat = hvm_catalog_new();
    GHashTable *ids = g_hash_table_new(g_int64_hash, g_int64_equal);
    HvmReader r;
    uint32_t version, nregions, body_len, body_crc, hdr_crc;
    char name[HVM_NAME_MAX + 1];

    hvm_reader_init(&r, buf, len);
    if (len < HVM_CAT_HDR_SIZE) {
        BAD("catalogue of %zu bytes is shorter than its header", len);
    }
    if (hvm_get_u64(&r) != HVM_CAT_MAGIC) {
        BAD("catalogue has a bad magic");
    }
    version = hvm_get_u32(&r);
    nregions = hvm_get_u32(&r);
    cat->next_id = hvm_get_u64(&r);
    cat->generation = hvm_get_u64(&r);
    body_len = hvm_get_u32(&r);
    body_crc = hvm_get_u32(&r);
    hdr_crc = hvm_get_u32(&r);
    if (hvm_get_u32(&r) != 0) {
        BAD("catalogue header's reserved field is not 0");
    }
    if (hdr_crc != hvm_crc32(0, buf, 40)) {
        BAD("catalogue header checksum mismatch");
    }
    if (version != HVM_CAT_VERSION) {
        BAD("catalogue version %u (this broker reads %d)", version,
            HVM_CAT_VERSION);
    }
    if (body_len != len - HVM_CAT_HDR_SIZE) {
        BAD("catalogue body is %zu bytes, header says %u",
            len - HVM_CAT_HDR_SIZE, body_len);
    }
    if (body_crc != hvm_crc32(0, buf + HVM_CAT_HDR_SIZE, body_len)) {
        BAD("catalogue body checksum mismatch");
    }
    if (nregions > HVM_MAX_REGIONS) {
        BAD("catalogue has %u regions (limit %d)", nregions, HVM_MAX_REGIONS);
    }
    for (uint32_t i = 0; i < nregions; i++) {
        uint16_t nl = hvm_get_u16(&r), nitems = hvm_get_u16(&r);
        uint32_t mode = hvm_get_u32(&r), uid = hvm_get_u32(&r);
        uint32_t gid = hvm_get_u32(&r);
        uint64_t id = hvm_get_u64(&r), size = hvm_get_u64(&r);
        HvmRegion *reg;
        uint64_t pos = 0;

        if (!read_name(&r, nl, name)) {
            BAD("catalogue region %u: truncated record or invalid name", i);
        }
        if (mode & ~HVM_MODE_MASK || size == 0 || size > HVM_MAX_SIZE ||
            id == 0 || id >= cat->next_id || nitems > HVM_MAX_ITEMS) {
            BAD("catalogue region '%s': mode, size, id or item count out of "
                "range", name);
        }
        if (g_hash_table_contains(cat->regions, name) ||
            g_hash_table_contains(ids, &id)) {
            BAD("catalogue region '%s': duplicate name or id", name);
        }
        reg = hvm_region_new(name, id, size, mode, uid, gid);
        hvm_catalog_add(cat, reg);
        g_hash_table_add(ids, &reg->id);
        for (uint16_t j = 0; j < nitems; j++) {
            HvmItem *it = g_new0(HvmItem, 1);
            uint16_t inl;

            it->offset = hvm_get_u64(&r);
            it->size = hvm_get_u64(&r);
            inl = hvm_get_u16(&r);
            hvm_get_u16(&r);
            hvm_get_u32(&r);
            g_ptr_array_add(reg->items, it);
            if (!read_name(&r, inl, name)) {
                it->name = g_strdup("");
                BAD("catalogue region '%s' item %u: truncated record or "
                    "invalid name", reg->name, j);
            }
            it->name = g_strdup(name);
            if (it->offset % HVM_ITEM_ALIGN || it->size % HVM_ITEM_ALIGN ||
                it->size == 0 || it->offset < pos ||
                it->size > reg->size || it->offset > reg->size - it->size) {
                BAD("catalogue region '%s' item '%s': extent out of order, "
                    "unaligned or outside the region", reg->name, it->name);
            }
            for (guint k = 0; k + 1 < reg->items->len; k++) {
                if (!strcmp(((HvmItem *)reg->items->pdata[k])->name, it->name)) {
                    BAD("catalogue region '%s': duplicate item '%s'",
                        reg->name, it->name);
                }
            }
            pos = it->offset + it->size;
        }
    }
    if (r.off != len) {
        BAD("catalogue has %zu trailing bytes", len - r.off);
    }
    g_hash_table_destroy(ids);
    return cat;

fail:
    g_hash_table_destroy(ids);
    hvm_catalog_free(cat);
    return NULL;
}

int hvm_catalog_save(HvmCatalog *cat, int dfd, const char *dir, GError **errp)
{
    GByteArray *buf;
    size_t off = 0;
    int fd, ret = 0;

    cat->generation++;
    buf = hvm_catalog_serialize(cat);
    fd = openat(dfd, "catalog.tmp",
                O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        ret = -errno;
        g_set_error(errp, G_IO_ERROR, g_io_error_from_errno(-ret),
                    "cannot create %s/catalog.tmp: %s", dir, g_strerror(-ret));
        goto out;
    }
    while (off < buf->len) {
        ssize_t n = write(fd, buf->data + off, buf->len - off);

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            ret = n < 0 ? -errno : -EIO;
            break;
        }
        off += n;
    }
    if (!ret && fsync(fd) < 0) {
        ret = -errno;
    }
    close(fd);
    if (!ret && renameat(dfd, "catalog.tmp", dfd, "catalog") < 0) {
        ret = -errno;
    }
    if (ret) {
        /* Nothing is changed: the old catalogue is still in place. */
        g_set_error(errp, G_IO_ERROR, g_io_error_from_errno(-ret),
                    "cannot write catalogue %s/catalog: %s", dir, g_strerror(-ret));
        unlinkat(dfd, "catalog.tmp", 0);
        goto out;
    }
    /*
     * Committed: from here the file system says the new catalogue, and so
     * must the caller's memory.  A failing directory fsync only means the
     * rename may not survive a host crash yet; reporting it as a failure
     * would have the caller undo in memory what disk already holds, and the
     * next start would then act on the other version (drop a created
     * region, delete the file of a destroyed one still in use).
     */
    if (fsync(dfd) < 0) {
        g_warning("catalogue %s/catalog committed, but cannot sync directory "
                  "%s: %s (the change may not survive a host crash)", dir, dir,
                  g_strerror(errno));
    }
out:
    g_byte_array_free(buf, TRUE);
    return ret;
}

HvmCatalog *hvm_catalog_load(int dfd, const char *dir, GError **errp)
{
    g_autofree uint8_t *data = NULL;
    struct stat st;
    size_t off = 0;
    HvmCatalog *cat;
    int fd;

    fd = openat(dfd, "catalog", O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 && errno == ENOENT) {
        return hvm_catalog_new();
    }
    if (fd < 0 || fstat(fd, &st) < 0) {
        g_set_error(errp, G_IO_ERROR, g_io_error_from_errno(errno),
                    "%s/catalog: %s", dir, g_strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return NULL;
    }
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size > HVM_CAT_MAX_SIZE) {
        g_set_error(errp, G_IO_ERROR, G_IO_ERROR_INVALID_DATA,
                    "%s/catalog: not a regular file of at most %llu bytes",
                    dir, (unsigned long long)HVM_CAT_MAX_SIZE);
        close(fd);
        return NULL;
    }
    data = g_malloc(st.st_size + 1);
    while (off < (size_t)st.st_size) {
        ssize_t n = read(fd, data + off, st.st_size - off);

        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            g_set_error(errp, G_IO_ERROR, g_io_error_from_errno(n ? errno : EIO),
                        "%s/catalog: %s", dir,
                        n ? g_strerror(errno) : "shorter than its size");
            close(fd);
            return NULL;
        }
        off += n;
    }
    close(fd);
    cat = hvm_catalog_parse(data, off, errp);
    if (!cat) {
        g_prefix_error(errp, "%s/catalog: ", dir);
    }
    return cat;
}
