/*
 * Unit tests of the broker's request parser, name rules, extent allocator
 * and catalogue snapshot (../proto.c, ../catalog.c), run under ASan/UBSan.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
#include <glib.h>
#include <glib/gstdio.h>

#include "../catalog.h"
#include "../proto.h"
#include "../psk.h"

static GByteArray *encode(HvmOp op, const char *name, const char *item,
                          uint64_t size, uint32_t mode, uint32_t flags)
{
    GByteArray *b = g_byte_array_new();
    HvmRequest q = { .op = op, .seq = 7, .size = size, .mode = mode,
                     .flags = flags };

    g_strlcpy(q.name, name, sizeof(q.name));
    g_strlcpy(q.item, item, sizeof(q.item));
    hvm_request_encode(b, &q);
    return b;
}

static int decode(GByteArray *b, HvmRequest *q, char *err)
{
    HvmHeader h;
    const char *why;
    int ret = hvm_header_decode(b->data, &h, false, &why);

    if (ret) {
        return ret;
    }
    g_assert_cmpuint(h.length, ==, b->len - HVM_HDR_SIZE);
    return hvm_request_decode(h.op, h.seq, b->data + HVM_HDR_SIZE, h.length,
                              q, err, 256);
}

static void test_roundtrip(void)
{
    GByteArray *b = encode(HVM_OP_ALLOC, "vm1-ram", "hdr", 4096, 0, 0);
    HvmRequest q;
    char err[256];

    g_assert_cmpint(decode(b, &q, err), ==, 0);
    g_assert_cmpint(q.op, ==, HVM_OP_ALLOC);
    g_assert_cmpuint(q.seq, ==, 7);
    g_assert_cmpuint(q.size, ==, 4096);
    g_assert_cmpstr(q.name, ==, "vm1-ram");
    g_assert_cmpstr(q.item, ==, "hdr");
    g_byte_array_free(b, TRUE);
}

/* Remote clients' keys: identities, key text, the derivation's vector. */
static void test_psk(void)
{
    static const char *const good[] = { "hostA", "a", "host-1.example_2" };
    static const char *const bad[] = {
        "", "a:b", "a b", "a\nb", "h\xc3\xa9", "a/b",
        "0123456789012345678901234567890123456789012345678901234567890123x",
    };
    uint8_t key[HVM_PSK_KEY_MAX], k16[16];
    char out[HVM_PSK_DERIVED_HEX + 1];
    const char *why = NULL;
    g_autofree char *long_hex = g_strnfill(2 * HVM_PSK_KEY_MAX + 2, 'a');

    for (size_t i = 0; i < G_N_ELEMENTS(good); i++) {
        g_assert_null(hvm_psk_identity_check(good[i]));
    }
    for (size_t i = 0; i < G_N_ELEMENTS(bad); i++) {
        g_assert_nonnull(hvm_psk_identity_check(bad[i]));
    }
    g_assert_cmpuint(hvm_psk_key_parse(" 000102030405060708090a0b0c0d0e0f\n", 34,
                                       key, &why), ==, 16);
    g_assert_cmpmem(key, 16, "\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a"
                    "\x0b\x0c\x0d\x0e\x0f", 16);
    g_assert_cmpuint(hvm_psk_key_parse("0001", 4, key, &why), ==, 0);
    g_assert_cmpstr(why, ==, "shorter than 16 bytes (32 hex digits)");
    g_assert_cmpuint(hvm_psk_key_parse("000102030405060708090a0b0c0d0e0", 31, key,
                                       &why), ==, 0);
    g_assert_cmpuint(hvm_psk_key_parse("zz0102030405060708090a0b0c0d0e0f", 32, key,
                                       &why), ==, 0);
    g_assert_cmpuint(hvm_psk_key_parse("0001020304050607 08090a0b0c0d0e0f00", 35, key,
                                       &why), ==, 0);
    g_assert_cmpuint(hvm_psk_key_parse(long_hex, strlen(long_hex), key, &why), ==, 0);
    g_assert_cmpuint(hvm_psk_key_parse(long_hex, 2 * HVM_PSK_KEY_MAX, key, &why),
                     ==, HVM_PSK_KEY_MAX);
    /* Python: hmac.new(bytes(range(16)), b"hybridvm-broker-export-v1:m0", sha256) */
    for (int i = 0; i < 16; i++) {
        k16[i] = i;
    }
    hvm_psk_derive(k16, 16, "m0", out);
    g_assert_cmpstr(out, ==, "e729616f9dbdfaed87edfe231d56630429e667533ab1d50c2a2b7ee28edcaa82");
    hvm_psk_derive(k16, 16, "m1", out);
    g_assert_cmpstr(out, !=, "e729616f9dbdfaed87edfe231d56630429e667533ab1d50c2a2b7ee28edcaa82");
}

static void test_field_rules(void)
{
    struct {
        HvmOp op;
        const char *name, *item;
        uint64_t size;
        uint32_t mode, flags;
        int expect;
    } cases[] = {
        { HVM_OP_CREATE, "a", "", 1, 0640, 0, 0 },
        { HVM_OP_CREATE, "a", "", 0, 0640, 0, -EINVAL },        /* no size */
        { HVM_OP_CREATE, "a", "", HVM_MAX_SIZE + 1, 0, 0, -EINVAL },
        { HVM_OP_CREATE, "a", "", 1, 0755, 0, -EINVAL },        /* x bits */
        { HVM_OP_CREATE, "a", "i", 1, 0600, 0, -EINVAL },       /* item */
        { HVM_OP_CREATE, "", "", 1, 0600, 0, -EINVAL },         /* no name */
        { HVM_OP_LOOKUP, "a", "", 1, 0, 0, -EINVAL },           /* size */
        { HVM_OP_LOOKUP, "a", "", 0, 0600, 0, -EINVAL },        /* mode */
        { HVM_OP_MAP, "a", "", 0, 0, HVM_MAP_RW, 0 },
        { HVM_OP_MAP, "a", "", 0, 0, 2, -EINVAL },
        { HVM_OP_LOOKUP, "a", "", 0, 0, HVM_MAP_RW, -EINVAL },  /* flags */
        { HVM_OP_ALLOC, "a", "", 1, 0, 0, -EINVAL },            /* no item */
        { HVM_OP_STAT, "", "", 0, 0, 0, 0 },                    /* the pool */
        { HVM_OP_LIST, "a", "", 0, 0, 0, -EINVAL },
        { HVM_OP_LIST, "", "", 0, 0, 0, 0 },
        { HVM_OP_EXPORT_KEYS, "a", "", 0, 0, HVM_MAP_RW, 0 },
        { HVM_OP_EXPORT_KEYS, "a", "", 0, 0, 0, 0 },
        { HVM_OP_EXPORT_KEYS, "", "", 0, 0, 0, -EINVAL },       /* no name */
        { HVM_OP_EXPORT_KEYS, "a", "", 1, 0, 0, -EINVAL },      /* size */
        { HVM_OP_EXPORT_KEYS, "a", "", 0, 0, 4, -EINVAL },      /* flags */
    };

    for (size_t i = 0; i < G_N_ELEMENTS(cases); i++) {
        GByteArray *b = encode(cases[i].op, cases[i].name, cases[i].item,
                               cases[i].size, cases[i].mode, cases[i].flags);
        HvmRequest q;
        char err[256] = "";

        g_test_message("case %zu: %s", i, hvm_op_name(cases[i].op));
        g_assert_cmpint(decode(b, &q, err), ==, cases[i].expect);
        if (cases[i].expect) {
            g_assert_cmpstr(err, !=, "");
        }
        g_byte_array_free(b, TRUE);
    }
}

static void test_names(void)
{
    char long_name[300];

    g_assert_null(hvm_name_check("vm-1.ram_tier", 13));
    g_assert_nonnull(hvm_name_check("a/b", 3));
    g_assert_nonnull(hvm_name_check("..", 2));
    g_assert_nonnull(hvm_name_check("a..b", 4));
    g_assert_nonnull(hvm_name_check(".", 1));
    g_assert_nonnull(hvm_name_check("a b", 3));
    g_assert_nonnull(hvm_name_check("a\0b", 3));
    g_assert_nonnull(hvm_name_check("a\x7f", 2));
    g_assert_nonnull(hvm_name_check("\xc3\xa9", 2));
    g_assert_nonnull(hvm_name_check("", 0));
    memset(long_name, 'x', sizeof(long_name));
    g_assert_null(hvm_name_check(long_name, 255));
    g_assert_nonnull(hvm_name_check(long_name, 256));
}

/*
 * The catalogue's CRC is CRC-32 (ISO-HDLC): its check value, chained over
 * pieces as one call, so catalogues written before the CRC came from zlib
 * still load.
 */
static void test_crc32(void)
{
    const char *check = "123456789";

    g_assert_cmphex(hvm_crc32(0, check, 9), ==, 0xcbf43926);
    g_assert_cmphex(hvm_crc32(hvm_crc32(0, check, 4), check + 4, 5), ==,
                    0xcbf43926);
    g_assert_cmphex(hvm_crc32(0, NULL, 0), ==, 0);
}

/*
 * The file lists the regions by id whatever order they came in, so equal
 * catalogues are equal bytes; a parsed one keeps that order.
 */
static void test_catalog_order(void)
{
    HvmCatalog *a = hvm_catalog_new(), *b = hvm_catalog_new(), *back;
    static const uint64_t order_a[] = { 3, 1, 4, 2 }, order_b[] = { 1, 2, 3, 4 };
    static const uint64_t want[] = { 1, 2, 4 };
    HvmRegion *gone_a = NULL, *gone_b = NULL;
    GByteArray *ba, *bb;

    a->next_id = b->next_id = 5;
    for (int i = 0; i < 4; i++) {
        char name[8];
        HvmRegion *r;

        snprintf(name, sizeof(name), "r%" G_GUINT64_FORMAT, order_a[i]);
        hvm_catalog_add(a, r = hvm_region_new(name, order_a[i], 4096, 0600, 0, 0));
        gone_a = order_a[i] == 3 ? r : gone_a;
        snprintf(name, sizeof(name), "r%" G_GUINT64_FORMAT, order_b[i]);
        hvm_catalog_add(b, r = hvm_region_new(name, order_b[i], 4096, 0600, 0, 0));
        gone_b = order_b[i] == 3 ? r : gone_b;
    }
    hvm_catalog_remove(a, gone_a);
    hvm_catalog_remove(b, gone_b);
    hvm_region_free(gone_a);
    hvm_region_free(gone_b);
    ba = hvm_catalog_serialize(a);
    bb = hvm_catalog_serialize(b);
    g_assert_cmpmem(ba->data, ba->len, bb->data, bb->len);
    back = hvm_catalog_parse(ba->data, ba->len, NULL);
    g_assert_nonnull(back);
    g_assert_cmpuint(back->by_id->len, ==, 3);
    for (guint i = 0; i < back->by_id->len; i++) {
        const HvmRegion *r = g_ptr_array_index(back->by_id, i);

        g_assert_cmpuint(r->id, ==, want[i]);
        g_assert_true(g_hash_table_lookup(back->regions, r->name) == r);
    }
    g_byte_array_free(ba, TRUE);
    g_byte_array_free(bb, TRUE);
    hvm_catalog_free(a);
    hvm_catalog_free(b);
    hvm_catalog_free(back);
}

static void test_header(void)
{
    GByteArray *b = encode(HVM_OP_LOOKUP, "a", "", 0, 0, 0);
    HvmRequest q;
    char err[256];
    HvmHeader h;
    const char *why;

    b->data[0] ^= 1;                                /* magic */
    g_assert_cmpint(decode(b, &q, err), ==, -EPROTO);
    b->data[0] ^= 1;
    b->data[4] = 2;                                 /* version */
    g_assert_cmpint(decode(b, &q, err), ==, -EPROTONOSUPPORT);
    b->data[4] = 1;
    b->data[10] = 0x10;                             /* length 1 MiB */
    g_assert_cmpint(decode(b, &q, err), ==, -EMSGSIZE);
    b->data[10] = 0;
    b->data[7] = 0x80;                              /* a reply */
    g_assert_cmpint(hvm_header_decode(b->data, &h, false, &why), ==, -EPROTO);
    b->data[7] = 0;
    b->data[6] = 99;                                /* op */
    g_assert_cmpint(decode(b, &q, err), ==, -EOPNOTSUPP);
    b->data[6] = HVM_OP_LOOKUP;
    /* name_len larger than what follows */
    b->data[HVM_HDR_SIZE + 16] = 2;
    g_assert_cmpint(decode(b, &q, err), ==, -EINVAL);
    b->data[HVM_HDR_SIZE + 16] = 1;
    b->data[HVM_HDR_SIZE + 20] = 1;                 /* reserved */
    g_assert_cmpint(decode(b, &q, err), ==, -EINVAL);
    g_byte_array_free(b, TRUE);
}

static void test_reply(void)
{
    GByteArray *b = g_byte_array_new();
    HvmRegionInfo ri = { .size = 1 << 21, .mode = 0640, .uid = 5,
                         .name = "r1" }, back;
    GByteArray *data = g_byte_array_new();
    HvmHeader h;
    HvmReply rep;
    HvmReader r;
    const char *why;

    hvm_region_encode(data, &ri);
    hvm_reply_encode(b, HVM_OP_LOOKUP, 3, 0, NULL, data->data, data->len);
    g_assert_cmpint(hvm_header_decode(b->data, &h, true, &why), ==, 0);
    g_assert_cmpuint(h.op, ==, HVM_OP_LOOKUP | HVM_OP_REPLY);
    g_assert_cmpint(hvm_reply_decode(b->data + HVM_HDR_SIZE, h.length, &rep,
                                     &why), ==, 0);
    hvm_reader_init(&r, rep.data, rep.data_len);
    g_assert_cmpint(hvm_region_decode(&r, &back), ==, 0);
    g_assert_cmpstr(back.name, ==, "r1");
    g_assert_cmpuint(back.mode, ==, 0640);
    g_assert_cmpuint(back.size, ==, 1 << 21);
    g_byte_array_free(b, TRUE);
    g_byte_array_free(data, TRUE);
}

#define MiB (1ull << 20)

static void test_alloc(void)
{
    HvmRegion *r = hvm_region_new("r", 1, 9 * MiB, 0600, 0, 0);
    HvmItem *a, *b, *c, *d;
    int err;

    /* 9 MiB holds four 2 MiB extents; the tail MiB is never handed out. */
    a = hvm_region_alloc_item(r, "a", 1, &err);
    g_assert_nonnull(a);
    g_assert_cmpuint(a->offset, ==, 0);
    g_assert_cmpuint(a->size, ==, 2 * MiB);
    b = hvm_region_alloc_item(r, "b", 3 * MiB, &err);
    g_assert_cmpuint(b->offset, ==, 2 * MiB);
    g_assert_cmpuint(b->size, ==, 4 * MiB);
    g_assert_null(hvm_region_alloc_item(r, "a", 1, &err));
    g_assert_cmpint(err, ==, -EEXIST);
    g_assert_null(hvm_region_alloc_item(r, "big", 4 * MiB, &err));
    g_assert_cmpint(err, ==, -ENOSPC);
    c = hvm_region_alloc_item(r, "c", 2 * MiB, &err);
    g_assert_cmpuint(c->offset, ==, 6 * MiB);
    g_assert_cmpint(hvm_region_free_item(r, "a"), ==, 0);
    g_assert_cmpint(hvm_region_free_item(r, "a"), ==, -ENOENT);
    /* first fit: the hole at 0 is reused */
    d = hvm_region_alloc_item(r, "d", 2 * MiB, &err);
    g_assert_cmpuint(d->offset, ==, 0);
    g_assert_cmpuint(hvm_region_used(r), ==, 8 * MiB);
    g_assert_cmpuint(hvm_region_items_end(r), ==, 8 * MiB);
    hvm_region_insert_item(r, "e", 8 * MiB, 0);
    g_assert_cmpstr(((HvmItem *)r->items->pdata[r->items->len - 1])->name, ==, "e");
    hvm_region_free(r);
}

static void test_catalog(void)
{
    HvmCatalog *cat = hvm_catalog_new(), *back;
    HvmRegion *r = hvm_region_new("vm1", 1, 64 * MiB, 0640, 1000, 100);
    GByteArray *buf, *buf2;
    GError *err = NULL;
    int e;

    hvm_catalog_add(cat, r);
    hvm_region_alloc_item(r, "hdr", 1, &e);
    hvm_region_alloc_item(r, "data", 10 * MiB, &e);
    cat->next_id = 2;
    buf = hvm_catalog_serialize(cat);
    back = hvm_catalog_parse(buf->data, buf->len, &err);
    g_assert_no_error(err);
    buf2 = hvm_catalog_serialize(back);
    g_assert_cmpmem(buf->data, buf->len, buf2->data, buf2->len);
    /* every single flipped byte is caught (CRC over header and body) */
    for (guint i = 0; i < buf->len; i++) {
        HvmCatalog *bad;

        buf->data[i] ^= 0x5a;
        bad = hvm_catalog_parse(buf->data, buf->len, &err);
        g_assert_null(bad);
        g_assert_nonnull(err);
        g_clear_error(&err);
        buf->data[i] ^= 0x5a;
    }
    /* truncation at every length */
    for (guint i = 0; i < buf->len; i++) {
        g_assert_null(hvm_catalog_parse(buf->data, i, &err));
        g_clear_error(&err);
    }
    g_byte_array_free(buf, TRUE);
    g_byte_array_free(buf2, TRUE);
    hvm_catalog_free(cat);
    hvm_catalog_free(back);
}

/*
 * The rename is the commit point: when the directory fsync after it fails,
 * hvm_catalog_save() reports success (and warns), so that the caller keeps
 * in memory what the disk already says.  The failure is injected by handing
 * it an O_PATH descriptor of the directory: openat() and renameat() work
 * relative to one, fsync() on one fails with EBADF.
 */
static void test_commit_point(void)
{
    g_autofree char *dir = g_dir_make_tmp("hvm-cat-XXXXXX", NULL);
    g_autofree char *path = g_build_filename(dir, "catalog", NULL);
    g_autofree char *tmp = g_build_filename(dir, "catalog.tmp", NULL);
    HvmCatalog *cat = hvm_catalog_new(), *back;
    HvmRegion *r = hvm_region_new("r", 1, 4 * MiB, 0600, 0, 0);
    GByteArray *mem, *disk;
    GError *err = NULL;
    int dfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);

    g_assert_cmpint(dfd, >=, 0);
    g_assert_cmpint(fsync(dfd), ==, -1);
    hvm_catalog_add(cat, r);
    cat->next_id = 2;
    g_test_expect_message(NULL, G_LOG_LEVEL_WARNING,
                          "*committed, but cannot sync directory*");
    g_assert_cmpint(hvm_catalog_save(cat, dfd, dir, &err), ==, 0);
    g_test_assert_expected_messages();
    g_assert_no_error(err);
    /* what the next start reads is what memory holds */
    back = hvm_catalog_load(dfd, dir, &err);
    g_assert_no_error(err);
    mem = hvm_catalog_serialize(cat);
    disk = hvm_catalog_serialize(back);
    g_assert_cmpmem(mem->data, mem->len, disk->data, disk->len);
    g_assert_nonnull(g_hash_table_lookup(back->regions, "r"));
    /* a failure before the rename changes nothing and says so */
    g_assert_cmpint(g_unlink(path), ==, 0);
    g_assert_cmpint(g_mkdir(path, 0700), ==, 0);    /* rename() over it fails */
    g_assert_cmpint(hvm_catalog_save(cat, dfd, dir, &err), <, 0);
    g_assert_nonnull(err);
    g_clear_error(&err);
    g_assert_false(g_file_test(tmp, G_FILE_TEST_EXISTS));
    g_rmdir(path);
    g_byte_array_free(mem, TRUE);
    g_byte_array_free(disk, TRUE);
    hvm_catalog_free(cat);
    hvm_catalog_free(back);
    close(dfd);
    g_rmdir(dir);
}

static void test_sizes(void)
{
    uint64_t v;

    g_assert_cmpint(hvm_parse_size("4096", &v), ==, 0);
    g_assert_cmpuint(v, ==, 4096);
    g_assert_cmpint(hvm_parse_size("64M", &v), ==, 0);
    g_assert_cmpuint(v, ==, 64 * MiB);
    g_assert_cmpint(hvm_parse_size("2GiB", &v), ==, 0);
    g_assert_cmpuint(v, ==, 2048 * MiB);
    g_assert_cmpint(hvm_parse_size("1x", &v), ==, -EINVAL);
    g_assert_cmpint(hvm_parse_size("-1", &v), ==, -EINVAL);
    g_assert_cmpint(hvm_parse_size("99999999999T", &v), ==, -EINVAL);
    g_assert_cmpint(hvm_parse_size("", &v), ==, -EINVAL);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/broker/proto/roundtrip", test_roundtrip);
    g_test_add_func("/broker/proto/field-rules", test_field_rules);
    g_test_add_func("/broker/proto/names", test_names);
    g_test_add_func("/broker/catalog/crc32", test_crc32);
    g_test_add_func("/broker/catalog/order", test_catalog_order);
    g_test_add_func("/broker/proto/header", test_header);
    g_test_add_func("/broker/proto/reply", test_reply);
    g_test_add_func("/broker/catalog/alloc", test_alloc);
    g_test_add_func("/broker/catalog/snapshot", test_catalog);
    g_test_add_func("/broker/catalog/commit-point", test_commit_point);
    g_test_add_func("/broker/proto/sizes", test_sizes);
    g_test_add_func("/broker/psk", test_psk);
    return g_test_run();
}
