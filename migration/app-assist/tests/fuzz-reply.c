/*
 * Fuzz target for the app-assist reply parser (../reply.c).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * A driver of tests/fuzz/fuzz-main.h, which says how to run it (standalone,
 * the CI test: aa-fuzz-reply [--seconds N] [--seed S]; or under libFuzzer).
 * Its random inputs are pure noise, RESP-shaped noise and mutations of valid
 * replies; standalone, half of them are fed in random-sized pieces, exactly
 * as bytes arrive from a virtio-serial port.
 * Invariants checked on every input: the parser never accepts more than
 * AA_RESP_MAX_BYTES, a DONE reply came from a complete input, an ERROR is
 * sticky, and a reset parser parses a valid reply again.
 */
#include <string.h>

#include "fuzz-main.h"
#include "../reply.h"

static const char valid[] =
    "*6\r\n$11\r\nfreed_bytes\r\n:4096\r\n$5\r\nitems\r\n:3\r\n"
    "$7\r\ntime_us\r\n:10\r\n";

/* Standalone: whether fuzz_generate() chose to feed its input in pieces. */
static int split_randomly;

/* Feed @data in pieces whose sizes come from @split (or fuzz_rnd()). */
static AARespState feed_pieces(AARespParser *p, const unsigned char *data,
                               size_t len, AAReply *out, int random_split)
{
    AARespState st = AA_RESP_MORE;
    size_t off = 0;

    while (off < len) {
        size_t n = random_split ? 1 + fuzz_rnd() % 64 : len - off;

        if (n > len - off) {
            n = len - off;
        }
        st = aa_resp_feed(p, data + off, n, out);
        off += n;
        if (st != AA_RESP_MORE) {
            AARespState again = aa_resp_feed(p, "x", 1, out);

            CHECK(again == st);     /* DONE and ERROR are sticky */
            break;
        }
    }
    return st;
}

static bool run_in_range(void *opaque, uint64_t first, uint64_t count)
{
    uint64_t *frames = opaque;

    CHECK(count >= 1 && first < AA_MAX_FRAME && count <= AA_MAX_FRAME - first);
    *frames += count;
    return *frames < (1ULL << 22) || (first & 1);   /* refuse some lists */
}

/* The same bytes as the reply to APPASSIST.PAGES, and its data decoded. */
static void one_pages_input(AARespParser *p, const unsigned char *data,
                            size_t len, int random_split)
{
    AAReply reply;
    AARespState st;

    aa_resp_parser_reset(p);
    aa_resp_parser_expect(p, AA_RESP_KIND_PAGES);
    st = feed_pieces(p, data, len, &reply, random_split);
    if (st == AA_RESP_DONE && reply.is_pages) {
        const char *err = NULL;
        uint64_t frames = 0;
        long runs;

        CHECK(reply.pages_len <= AA_RESP_MAX_PAGE_DATA);
        CHECK(reply.pages_len == 0 || reply.pages);
        runs = aa_pages_decode(reply.pages, reply.pages_len, run_in_range,
                               &frames, &err);
        CHECK(runs >= 0 || err);
        CHECK(runs <= (long)reply.pages_len / 2);
    }
}

static void one_input(AARespParser *p, const unsigned char *data, size_t len,
                      int random_split)
{
    AAReply reply;
    AARespState st;

    one_pages_input(p, data, len, random_split);

    aa_resp_parser_reset(p);
    st = feed_pieces(p, data, len, &reply, random_split);
    if (st == AA_RESP_DONE) {
        CHECK(len > 0);
        if (!reply.is_error && !reply.is_status) {
            CHECK(reply.has_freed_bytes);
        }
        CHECK(memchr(reply.message, '\0', sizeof(reply.message)));
    } else if (st == AA_RESP_ERROR) {
        CHECK(strlen(aa_resp_error(p)) > 0);
    }
    if (len > AA_RESP_MAX_BYTES + 64 && st == AA_RESP_MORE) {
        CHECK(!"more than the byte limit was accepted");
    }

    /* The same parser must still work after a reset. */
    aa_resp_parser_reset(p);
    st = aa_resp_feed(p, valid, sizeof(valid) - 1, &reply);
    CHECK(st == AA_RESP_DONE && reply.freed_bytes == 4096 && reply.items == 3);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    static AARespParser *p;

    if (!p) {
        p = aa_resp_parser_new();
        CHECK(p);
    }
    one_input(p, data, len, split_randomly);
    return 0;
}

static const char *const tokens[] = {
    "*", "$", ":", "+", "-", "%", "_", ",", "#", "\r\n", "\r", "\n", "0", "1",
    "-1", "-2", "2147483647", "2147483648", "4294967297", "9223372036854775807",
    "99999999999999999999", "64", "65", "freed_bytes", "freed-bytes", "items",
    "time_ms", "FREED_BYTES", "OK", "ERR busy", "*2\r\n", "*1000000\r\n",
    "$1000000000\r\n", "*-1\r\n", "$-1\r\n", ":-5\r\n",
};

static size_t gen(unsigned char *buf, size_t cap)
{
    size_t len = 0, i, n;

    switch (fuzz_rnd() % 5) {
    case 4: {                               /* a PAGES reply, random data */
        size_t dl = fuzz_rnd() % 2 ? fuzz_rnd() % 64
                                   : fuzz_rnd() % (AA_RESP_MAX_PAGE_DATA + 16);

        len = snprintf((char *)buf, cap, "*2\r\n:%u\r\n$%zu\r\n", fuzz_rnd() % 3, dl);
        if (len + dl + 2 > cap) {
            return len;
        }
        for (i = 0; i < dl; i++) {
            buf[len++] = fuzz_rnd() % 3 ? fuzz_rnd() : (fuzz_rnd() % 2 ? 0x80 : 0xff);
        }
        memcpy(buf + len, "\r\n", 2);
        return len + 2;
    }
    case 0:                                 /* noise */
        n = fuzz_rnd() % 512;
        for (i = 0; i < n && len < cap; i++) {
            buf[len++] = fuzz_rnd();
        }
        return len;
    case 1:                                 /* RESP-shaped noise */
        n = 1 + fuzz_rnd() % 40;
        for (i = 0; i < n; i++) {
            const char *t = tokens[fuzz_rnd() % (sizeof(tokens) / sizeof(tokens[0]))];
            size_t tl = strlen(t);

            if (len + tl > cap) {
                break;
            }
            memcpy(buf + len, t, tl);
            len += tl;
        }
        return len;
    case 2:                                 /* big: limit checks */
        n = AA_RESP_MAX_BYTES + fuzz_rnd() % 4096;
        if (n > cap) {
            n = cap;
        }
        memcpy(buf, "$70000\r\n", 8);
        memset(buf + 8, 'a', n - 8);
        return n;
    default:                                /* mutated valid reply */
        len = sizeof(valid) - 1;
        memcpy(buf, valid, len);
        n = 1 + fuzz_rnd() % 4;
        for (i = 0; i < n; i++) {
            switch (fuzz_rnd() % 3) {
            case 0:
                buf[fuzz_rnd() % len] = fuzz_rnd();
                break;
            case 1:
                len = fuzz_rnd() % len + 1;
                break;
            default:
                if (len < cap) {
                    size_t at = fuzz_rnd() % len;

                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = fuzz_rnd();
                    len++;
                }
            }
        }
        return len;
    }
}

size_t fuzz_generate(const uint8_t **data)
{
    static unsigned char buf[AA_RESP_MAX_BYTES + 8192];
    size_t len = gen(buf, sizeof(buf));

    split_randomly = fuzz_rnd() % 2;
    *data = buf;
    return len;
}
