/*
 * Unit tests for the app-assist reply parser (../reply.c).
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../reply.h"

static int failures;

#define EXPECT(cond) do { \
    if (!(cond)) { \
        fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #cond); \
        failures++; \
    } \
} while (0)

static AARespParser *p;

/* Feed @s whole (or byte by byte); return the state. */
static AARespState parse(const char *s, size_t len, int bytewise, AAReply *r)
{
    AARespState st = AA_RESP_MORE;
    size_t i;

    aa_resp_parser_reset(p);
    if (!bytewise) {
        return aa_resp_feed(p, s, len, r);
    }
    for (i = 0; i < len && st == AA_RESP_MORE; i++) {
        st = aa_resp_feed(p, s + i, 1, r);
    }
    return st;
}

#define PARSE(s, bw, r) parse(s, sizeof(s) - 1, bw, r)

static void test_module_reply(void)
{
    /* What redis-module/hybridmem.c sends on the port (RESP2 flat map). */
    static const char s[] =
        "*20\r\n$11\r\nfreed_bytes\r\n:73400320\r\n$5\r\nitems\r\n:42000\r\n"
        "$12\r\nzeroed_bytes\r\n:65536\r\n"
        "$11\r\nused_memory\r\n:1234567\r\n$3\r\nrss\r\n:7654321\r\n"
        "$10\r\nrss_before\r\n:99999999\r\n$7\r\ntime_us\r\n:3512\r\n"
        "$6\r\npolicy\r\n$4\r\ndrop\r\n$8\r\ncomplete\r\n:1\r\n"
        "$5\r\nstate\r\n$8\r\nprepared\r\n";
    int bw;

    for (bw = 0; bw < 2; bw++) {
        AAReply r;

        EXPECT(PARSE(s, bw, &r) == AA_RESP_DONE);
        EXPECT(r.has_freed_bytes && r.freed_bytes == 73400320);
        EXPECT(r.has_zeroed_bytes && r.zeroed_bytes == 65536);
        EXPECT(r.has_items && r.items == 42000);
        EXPECT(r.has_used_memory && r.used_memory == 1234567);
        EXPECT(r.has_rss && r.rss == 7654321);
        EXPECT(r.has_time_us && r.time_us == 3512);
        EXPECT(!r.is_error && !r.is_status);
    }
}

static void test_aliases_and_strings(void)
{
    AAReply r;

    EXPECT(PARSE("*4\r\n$11\r\nFREED-BYTES\r\n$4\r\n4096\r\n$7\r\ntime_ms\r\n:3\r\n",
                 0, &r) == AA_RESP_DONE);
    EXPECT(r.freed_bytes == 4096 && r.time_us == 3000);
    EXPECT(!r.has_zeroed_bytes && r.zeroed_bytes == 0);   /* older modules */
}

static void test_refusals(void)
{
    AAReply r;

    EXPECT(PARSE("-ERR busy\r\n", 0, &r) == AA_RESP_DONE);
    EXPECT(r.is_error && !strcmp(r.message, "ERR busy"));
    EXPECT(PARSE("-ERR \x01\xff\r\n", 0, &r) == AA_RESP_DONE);
    EXPECT(!strcmp(r.message, "ERR ??"));
    EXPECT(PARSE("+OK\r\n", 0, &r) == AA_RESP_DONE && r.is_status);
}

static void test_strict_types(void)
{
    AAReply r;

    /* negative, text, float, nil, nested array as the value */
    EXPECT(PARSE("*2\r\n$11\r\nfreed_bytes\r\n:-1\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*2\r\n$11\r\nfreed_bytes\r\n$3\r\n1e9\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*2\r\n$11\r\nfreed_bytes\r\n$0\r\n\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*2\r\n$11\r\nfreed_bytes\r\n$-1\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*2\r\n$11\r\nfreed_bytes\r\n*1\r\n:1\r\n", 0, &r) == AA_RESP_ERROR);
    /* 20 digits overflow */
    EXPECT(PARSE("*2\r\n$11\r\nfreed_bytes\r\n$20\r\n99999999999999999999\r\n", 0, &r)
           == AA_RESP_ERROR);
    /* odd count, integer key, missing freed-bytes, not an array */
    EXPECT(PARSE("*1\r\n$11\r\nfreed_bytes\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*2\r\n:1\r\n:2\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*2\r\n$5\r\nitems\r\n:2\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE(":5\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*0\r\n", 0, &r) == AA_RESP_ERROR);
    /* RESP3 map: not RESP2 */
    EXPECT(PARSE("%1\r\n$11\r\nfreed_bytes\r\n:1\r\n", 0, &r) == AA_RESP_ERROR);
    /* scale overflow */
    EXPECT(PARSE("*4\r\n$11\r\nfreed_bytes\r\n:1\r\n$7\r\ntime_ms\r\n:9223372036854775807\r\n",
                 0, &r) == AA_RESP_ERROR);
}

static void test_limits(void)
{
    static char big[AA_RESP_MAX_BYTES + 100];
    AAReply r;
    int n;

    /* element count */
    EXPECT(PARSE("*2000000000\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*65\r\n", 0, &r) == AA_RESP_ERROR);
    /* nesting */
    EXPECT(PARSE("*1\r\n*1\r\n*1\r\n:1\r\n", 0, &r) == AA_RESP_ERROR);
    /* long key */
    n = snprintf(big, sizeof(big), "*2\r\n$300\r\n%0300d\r\n:1\r\n", 0);
    EXPECT(parse(big, n, 0, &r) == AA_RESP_ERROR);
    /* a bulk string announced huge, and bytes beyond the byte limit */
    EXPECT(PARSE("$1000000000\r\n", 0, &r) == AA_RESP_MORE);
    memset(big, 'a', sizeof(big));
    EXPECT(aa_resp_feed(p, big, sizeof(big), &r) == AA_RESP_ERROR);
    EXPECT(strstr(aa_resp_error(p), "longer than"));
    /* many small pieces add up too */
    aa_resp_parser_reset(p);
    EXPECT(aa_resp_feed(p, "+", 1, &r) == AA_RESP_MORE);
    for (n = 0; n < AA_RESP_MAX_BYTES / 1024; n++) {
        aa_resp_feed(p, big, 1024, &r);
    }
    EXPECT(aa_resp_feed(p, big, 1, &r) == AA_RESP_ERROR);
    /* 64 elements is allowed */
    {
        char *s = big;
        int i;

        s += sprintf(s, "*64\r\n$11\r\nfreed_bytes\r\n:7\r\n");
        for (i = 2; i < 64; i += 2) {
            s += sprintf(s, "$3\r\nk%02d\r\n:1\r\n", i);
        }
        EXPECT(parse(big, s - big, 1, &r) == AA_RESP_DONE && r.freed_bytes == 7);
    }
}

static void test_sticky_and_reset(void)
{
    AAReply r;

    EXPECT(PARSE("garbage\r\n", 0, &r) == AA_RESP_ERROR);
    EXPECT(aa_resp_feed(p, "*2\r\n$5\r\nfreed\r\n:1\r\n", 19, &r) == AA_RESP_ERROR);
    EXPECT(PARSE("*2\r\n$5\r\nfreed\r\n:1\r\n", 0, &r) == AA_RESP_DONE);
    EXPECT(r.freed_bytes == 1);
    /* bytes after a complete reply are ignored */
    EXPECT(aa_resp_feed(p, "garbage", 7, &r) == AA_RESP_DONE);
}

/* The applications' side of the format (redis-module/pagelist.c does the
 * same): one run after @prev_end, into at least 20 bytes. */
static size_t put_varint(uint8_t *out, uint64_t v)
{
    size_t n = 0;

    do {
        out[n++] = (v & 0x7f) | (v > 0x7f ? 0x80 : 0);
        v >>= 7;
    } while (v);
    return n;
}

static size_t aa_pages_encode_run(uint8_t *out, uint64_t prev_end,
                                  uint64_t first, uint64_t count)
{
    int64_t delta = (int64_t)(first - prev_end);
    uint64_t zz = ((uint64_t)delta << 1) ^ (uint64_t)(delta >> 63);
    size_t n = put_varint(out, zz);

    return n + put_varint(out + n, count - 1);
}

/* Feed @len bytes of @s as a PAGES reply. */
static AARespState parse_pages(const char *s, size_t len, AAReply *r)
{
    aa_resp_parser_reset(p);
    aa_resp_parser_expect(p, AA_RESP_KIND_PAGES);
    return aa_resp_feed(p, s, len, r);
}

typedef struct Runs {
    uint64_t first[8], count[8];
    int n;
    int refuse_at;              /* refuse the run with this index (or -1) */
} Runs;

static bool collect(void *opaque, uint64_t first, uint64_t count)
{
    Runs *rs = opaque;

    if (rs->n == rs->refuse_at || rs->n == 8) {
        return false;
    }
    rs->first[rs->n] = first;
    rs->count[rs->n] = count;
    rs->n++;
    return true;
}

static void test_pages(void)
{
    /* Runs in any order, the way pagemap gives them: 5+3, 1+1, 2^40-1 +1. */
    static const uint64_t first[] = { 5, 1, (1ULL << 40) - 1 };
    static const uint64_t count[] = { 3, 1, 1 };
    uint8_t data[64];
    char msg[160];
    size_t len = 0, mlen;
    uint64_t prev = 0;
    const char *err = NULL;
    AAReply r;
    Runs rs = { .refuse_at = -1 };
    int i;

    for (i = 0; i < 3; i++) {
        len += aa_pages_encode_run(data + len, prev, first[i], count[i]);
        prev = first[i] + count[i];
    }
    mlen = snprintf(msg, sizeof(msg), "*2\r\n:7\r\n$%zu\r\n", len);
    memcpy(msg + mlen, data, len);
    memcpy(msg + mlen + len, "\r\n", 2);
    EXPECT(parse_pages(msg, mlen + len + 2, &r) == AA_RESP_DONE);
    EXPECT(r.is_pages && r.pages_remaining == 7 && r.pages_len == len);
    EXPECT(aa_pages_decode(r.pages, r.pages_len, collect, &rs, &err) == 3);
    for (i = 0; i < 3; i++) {
        EXPECT(rs.first[i] == first[i] && rs.count[i] == count[i]);
    }
    /* An empty list. */
    EXPECT(PARSE("*2\r\n:0\r\n$0\r\n\r\n", 0, &r) == AA_RESP_ERROR); /* fields */
    EXPECT(parse_pages("*2\r\n:0\r\n$0\r\n\r\n", 14, &r) == AA_RESP_DONE);
    EXPECT(r.is_pages && r.pages_len == 0 && r.pages_remaining == 0);
    /* Wrong shapes. */
    EXPECT(parse_pages("*2\r\n:-1\r\n$0\r\n\r\n", 15, &r) == AA_RESP_ERROR);
    EXPECT(parse_pages("*1\r\n:0\r\n", 8, &r) == AA_RESP_ERROR);
    EXPECT(parse_pages("*2\r\n$1\r\nx\r\n:0\r\n", 15, &r) == AA_RESP_ERROR);
    EXPECT(parse_pages("-ERR no\r\n", 9, &r) == AA_RESP_DONE && r.is_error);
    /* A long string is allowed only as the data of a PAGES reply. */
    {
        static char big[AA_RESP_MAX_PAGE_DATA + 64];
        size_t n = snprintf(big, sizeof(big), "*2\r\n:0\r\n$%d\r\n", 1000);

        memset(big + n, 0, 1000);
        memcpy(big + n + 1000, "\r\n", 2);
        EXPECT(parse_pages(big, n + 1002, &r) == AA_RESP_DONE);
        EXPECT(parse(big, n + 1002, 0, &r) == AA_RESP_ERROR);
        n = snprintf(big, sizeof(big), "*2\r\n:0\r\n$%d\r\n",
                     AA_RESP_MAX_PAGE_DATA + 1);
        EXPECT(parse_pages(big, n, &r) == AA_RESP_MORE ||
               aa_resp_feed(p, "", 0, &r) == AA_RESP_ERROR);
        memset(big + n, 0, sizeof(big) - n);
        EXPECT(aa_resp_feed(p, big + n, AA_RESP_MAX_PAGE_DATA + 3, &r) ==
               AA_RESP_ERROR);
        /* ... and not in the first element, nor nested. */
        n = snprintf(big, sizeof(big), "*2\r\n$300\r\n");
        EXPECT(parse_pages(big, n, &r) == AA_RESP_MORE);
        memset(big, 'x', 300);
        memcpy(big + 300, "\r\n:0\r\n", 7);
        EXPECT(aa_resp_feed(p, big, 307, &r) == AA_RESP_ERROR);
    }
    /* Hostile data: truncated, over-long varints, runs out of range. */
    {
        static const uint8_t trunc[] = { 0x80 };
        static const uint8_t half[] = { 0x02 };
        static const uint8_t eleven[] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                          0xff, 0xff, 0xff, 0xff, 0x01, 0x00 };
        static const uint8_t backwards[] = { 0x01, 0x00 };     /* -1 from 0 */
        uint8_t far[24];
        size_t n;

        rs.n = 0;
        EXPECT(aa_pages_decode(trunc, 1, collect, &rs, &err) == -1);
        EXPECT(aa_pages_decode(half, 1, collect, &rs, &err) == -1);
        EXPECT(aa_pages_decode(eleven, sizeof(eleven), collect, &rs, &err) == -1);
        EXPECT(aa_pages_decode(backwards, 2, collect, &rs, &err) == -1);
        n = aa_pages_encode_run(far, 0, 1ULL << 40, 1);
        EXPECT(aa_pages_decode(far, n, collect, &rs, &err) == -1);
        n = aa_pages_encode_run(far, 0, (1ULL << 40) - 1, 2);
        EXPECT(aa_pages_decode(far, n, collect, &rs, &err) == -1);
        n = aa_pages_encode_run(far, 0, 0, UINT64_MAX);
        EXPECT(aa_pages_decode(far, n, collect, &rs, &err) == -1);
        EXPECT(rs.n == 0);
        /* The callback's refusal stops the chunk. */
        rs.refuse_at = 1;
        n = aa_pages_encode_run(far, 0, 10, 1);
        n += aa_pages_encode_run(far + n, 11, 20, 1);
        EXPECT(aa_pages_decode(far, n, collect, &rs, &err) == -1 && rs.n == 1);
        EXPECT(err && strstr(err, "refused"));
    }
}

int main(void)
{
    p = aa_resp_parser_new();
    if (!p) {
        return 1;
    }
    test_module_reply();
    test_aliases_and_strings();
    test_refusals();
    test_strict_types();
    test_limits();
    test_sticky_and_reset();
    test_pages();
    aa_resp_parser_free(p);
    if (failures) {
        fprintf(stderr, "test-reply: %d failures\n", failures);
        return 1;
    }
    printf("test-reply: all passed\n");
    return 0;
}
