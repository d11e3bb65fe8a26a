/*
 * Fuzz target for the broker's request parser and the decoders a client and
 * the catalogue loader run on untrusted bytes (../proto.c, ../catalog.c).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Two ways to run it:
 *   - libFuzzer: build with -DHVM_LIBFUZZER -fsanitize=fuzzer,address;
 *   - standalone (the meson test): fuzz-proto [--seconds N] [--seed S] runs a
 *     time-bounded loop of pure noise and of mutations of valid requests,
 *     replies and catalogues.  Built with -fsanitize=address,undefined so
 *     memory errors abort.
 * Invariants checked on every input: an accepted request has names that pass
 * the name rules and re-encodes to the same bytes; an accepted header's
 * length is within the limit; decoders never read past their input.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../catalog.h"
#include "../proto.h"

#define CHECK(cond) do { \
    if (!(cond)) { \
        fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
        abort(); \
    } \
} while (0)

static unsigned long long rng_state;

static unsigned rnd(void)
{
    /* xorshift64*: reproducible from --seed */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (unsigned)((rng_state * 2685821657736338717ULL) >> 32);
}

static void one_input(const uint8_t *data, size_t len)
{
    HvmHeader h;
    HvmRequest q;
    HvmReply rep;
    const char *why;
    char err[256];
    uint8_t *copy;

    if (len < HVM_HDR_SIZE) {
        return;
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
}

#ifdef HVM_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    one_input(data, size);
    return 0;
}
#else

/* A valid request, reply or catalogue to mutate. */
static GByteArray *seed_input(void)
{
    static const char *names[] = { "vm1", "a", "region.x", "z-9_q" };
    GByteArray *b = g_byte_array_new();
    unsigned kind = rnd() % 3;

    if (kind == 0) {
        HvmRequest q = { .op = 1 + rnd() % (HVM_OP__MAX - 1), .seq = rnd() };

        g_strlcpy(q.name, names[rnd() % 4], sizeof(q.name));
        if (rnd() % 2) {
            g_strlcpy(q.item, names[rnd() % 4], sizeof(q.item));
        }
        q.size = rnd() % 3 ? rnd() : 0;
        q.mode = rnd() % 2 ? 0640 : 0;
        q.flags = rnd() % 4 == 0;
        hvm_request_encode(b, &q);
    } else if (kind == 1) {
        GByteArray *d = g_byte_array_new();
        HvmRegionInfo ri = { .size = rnd(), .name = "r" };
        HvmItemInfo ii = { .offset = 0, .size = 2 << 20, .name = "i" };

        hvm_region_encode(d, &ri);
        hvm_item_encode(d, &ii);
        hvm_reply_encode(b, HVM_OP_STAT, rnd(), 0, NULL, d->data, d->len);
        g_byte_array_free(d, TRUE);
    } else {
        HvmCatalog *cat = hvm_catalog_new();
        HvmRegion *r = hvm_region_new(names[rnd() % 4], 1, 64 << 20, 0600, 0, 0);
        GByteArray *s;
        int e;

        hvm_region_alloc_item(r, "hdr", 1, &e);
        g_hash_table_insert(cat->regions, r->name, r);
        cat->next_id = 2;
        s = hvm_catalog_serialize(cat);
        g_byte_array_append(b, s->data, s->len);
        g_byte_array_free(s, TRUE);
        hvm_catalog_free(cat);
    }
    return b;
}

int main(int argc, char **argv)
{
    double seconds = 10;
    unsigned long long seed = (unsigned long long)time(NULL);
    unsigned long iters = 0;
    struct timespec t0, t;

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
            seconds = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 0);
        } else {
            fprintf(stderr, "usage: %s [--seconds N] [--seed S]\n", argv[0]);
            return 2;
        }
    }
    /* make check-long (HYBRIDVM_LONG=1) fuzzes for at least five minutes. */
    if (getenv("HYBRIDVM_LONG") && seconds < 300) {
        seconds = 300;
    }
    rng_state = seed ? seed : 1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        GByteArray *b;

        if (rnd() % 8 == 0) {
            /* noise with a valid magic and version half of the time */
            size_t n = rnd() % 600;

            b = g_byte_array_sized_new(n);
            g_byte_array_set_size(b, n);
            for (size_t i = 0; i < n; i++) {
                b->data[i] = rnd();
            }
            if (n >= 8 && rnd() % 2) {
                memcpy(b->data, "HVMB\x01\x00", 6);
            }
        } else {
            unsigned muts = 1 + rnd() % 4;

            b = seed_input();
            for (unsigned m = 0; m < muts && b->len; m++) {
                switch (rnd() % 4) {
                case 0:
                    b->data[rnd() % b->len] = rnd();
                    break;
                case 1:
                    b->data[rnd() % b->len] ^= 1u << (rnd() % 8);
                    break;
                case 2:
                    g_byte_array_set_size(b, rnd() % (b->len + 1));
                    break;
                default: {
                    uint8_t x = rnd();

                    g_byte_array_append(b, &x, 1);
                }
                }
            }
        }
        one_input(b->data, b->len);
        g_byte_array_free(b, TRUE);
        iters++;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    printf("fuzz-proto: %lu inputs in %.0f s, seed %llu, no invariant failed\n",
           iters, seconds, seed);
    return 0;
}
#endif
