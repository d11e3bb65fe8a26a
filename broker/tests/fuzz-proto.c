/*
 * Fuzz target for the broker's request parser and the decoders a client and
 * the catalogue loader run on untrusted bytes (../proto.c, ../catalog.c).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * A driver of tests/fuzz/fuzz-main.h, which says how to run it (standalone,
 * the meson test: broker-fuzz-proto [--seconds N] [--seed S]; or under
 * libFuzzer).  Its random inputs are pure noise and mutations of valid
 * requests, replies and catalogues.
 * Invariants checked on every input: an accepted request has names that pass
 * the name rules and re-encodes to the same bytes; an accepted header's
 * length is within the limit; decoders never read past their input.
 */
#include <errno.h>
#include <string.h>

#include "fuzz-main.h"
#include "../catalog.h"
#include "../proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    HvmHeader h;
    HvmRequest q;
    HvmReply rep;
    const char *why;
    char err[256];
    uint8_t *copy;

    if (len < HVM_HDR_SIZE) {
        return 0;
    }
    /* As the broker sees it: header, then exactly h.length body bytes. */
    if (hvm_header_decode(data, &h, false, &why) == 0) {
        CHECK(h.length <= HVM_MAX_REQ_BODY);
        if (len - HVM_HDR_SIZE >= h.length) {
            /* an exact-size heap copy lets ASan catch any over-read */
            copy = malloc(h.length ? h.length : 1);
            memcpy(copy, data + HVM_HDR_SIZE, h.length);
            if (hvm_request_decode(h.op, h.seq, copy, h.length, &q, err,
                                   sizeof(err)) == 0) {
                GByteArray *b = g_byte_array_new();

                CHECK(!q.name[0] || !hvm_name_check(q.name, strlen(q.name)));
                CHECK(!q.item[0] || !hvm_name_check(q.item, strlen(q.item)));
                hvm_request_encode(b, &q);
                CHECK(b->len == HVM_HDR_SIZE + h.length);
                CHECK(!memcmp(b->data + HVM_HDR_SIZE, copy, h.length));
                g_byte_array_free(b, TRUE);
            } else {
                CHECK(err[0]);
            }
            free(copy);
        }
    }
    /* As a client sees a reply body. */
    copy = malloc(len - HVM_HDR_SIZE + 1);
    memcpy(copy, data + HVM_HDR_SIZE, len - HVM_HDR_SIZE);
    if (hvm_reply_decode(copy, len - HVM_HDR_SIZE, &rep, &why) == 0) {
        HvmReader r;
        HvmRegionInfo ri;
        HvmItemInfo ii;

        CHECK(strlen(rep.msg) <= HVM_MAX_MSG);
        hvm_reader_init(&r, rep.data, rep.data_len);
        hvm_region_decode(&r, &ri);
        hvm_reader_init(&r, rep.data, rep.data_len);
        while (!r.err && r.off < r.len) {
            hvm_item_decode(&r, &ii);
        }
    }
    free(copy);
    /* As the loader sees a catalogue. */
    {
        GError *e = NULL;
        HvmCatalog *cat;

        copy = malloc(len);
        memcpy(copy, data, len);
        cat = hvm_catalog_parse(copy, len, &e);
        CHECK(!cat != !e);
        hvm_catalog_free(cat);
        g_clear_error(&e);
        free(copy);
    }
    return 0;
}

/* Standalone: a valid request, reply or catalogue to mutate. */
static GByteArray *seed_input(void)
{
    static const char *names[] = { "vm1", "a", "region.x", "z-9_q" };
    GByteArray *b = g_byte_array_new();
    unsigned kind = fuzz_rnd() % 3;

    if (kind == 0) {
        HvmRequest q = { .op = 1 + fuzz_rnd() % (HVM_OP__MAX - 1),
                         .seq = fuzz_rnd() };

        g_strlcpy(q.name, names[fuzz_rnd() % 4], sizeof(q.name));
        if (fuzz_rnd() % 2) {
            g_strlcpy(q.item, names[fuzz_rnd() % 4], sizeof(q.item));
        }
        q.size = fuzz_rnd() % 3 ? fuzz_rnd() : 0;
        q.mode = fuzz_rnd() % 2 ? 0640 : 0;
        q.flags = fuzz_rnd() % 4 == 0;
        hvm_request_encode(b, &q);
    } else if (kind == 1) {
        GByteArray *d = g_byte_array_new();
        HvmRegionInfo ri = { .size = fuzz_rnd(), .name = "r" };
        HvmItemInfo ii = { .offset = 0, .size = 2 << 20, .name = "i" };

        hvm_region_encode(d, &ri);
        hvm_item_encode(d, &ii);
        hvm_reply_encode(b, HVM_OP_STAT, fuzz_rnd(), 0, NULL, d->data, d->len);
        g_byte_array_free(d, TRUE);
    } else {
        HvmCatalog *cat = hvm_catalog_new();
        HvmRegion *r = hvm_region_new(names[fuzz_rnd() % 4], 1, 64 << 20,
                                      0600, 0, 0);
        GByteArray *s;
        int e;

        hvm_region_alloc_item(r, "hdr", 1, &e);
        hvm_catalog_add(cat, r);
        cat->next_id = 2;
        s = hvm_catalog_serialize(cat);
        g_byte_array_append(b, s->data, s->len);
        g_byte_array_free(s, TRUE);
        hvm_catalog_free(cat);
    }
    return b;
}

size_t fuzz_generate(const uint8_t **data)
{
    static GByteArray *b;

    if (b) {
        g_byte_array_free(b, TRUE);
    }
    if (fuzz_rnd() % 8 == 0) {
        /* noise with a valid magic and version half of the time */
        size_t n = fuzz_rnd() % 600;

        b = g_byte_array_sized_new(n);
        g_byte_array_set_size(b, n);
        for (size_t i = 0; i < n; i++) {
            b->data[i] = fuzz_rnd();
        }
        if (n >= 8 && fuzz_rnd() % 2) {
            memcpy(b->data, "HVMB\x01\x00", 6);
        }
    } else {
        unsigned muts = 1 + fuzz_rnd() % 4;

        b = seed_input();
        for (unsigned m = 0; m < muts && b->len; m++) {
            switch (fuzz_rnd() % 4) {
            case 0:
                b->data[fuzz_rnd() % b->len] = fuzz_rnd();
                break;
            case 1:
                b->data[fuzz_rnd() % b->len] ^= 1u << (fuzz_rnd() % 8);
                break;
            case 2:
                g_byte_array_set_size(b, fuzz_rnd() % (b->len + 1));
                break;
            default: {
                uint8_t x = fuzz_rnd();

                g_byte_array_append(b, &x, 1);
            }
            }
        }
    }
    *data = b->data;
    return b->len;
}
