/*
 * App-assisted migration: bounded parser for the guest applications' replies
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Everything here treats the input as hostile.  The parser depends only on
 * libc and hiredis (no QEMU headers) so that the fuzz target in tests/ links
 * the very same code.
 */
#ifndef APP_ASSIST_REPLY_H
#define APP_ASSIST_REPLY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Limits on one reply.  A PREPARE reply is a handful of key/value pairs. */
#define AA_RESP_MAX_BYTES       (64 * 1024) /* all framing included */
#define AA_RESP_MAX_ELEMENTS    64          /* array members, all levels */
#define AA_RESP_MAX_DEPTH       1           /* one flat array of scalars */
#define AA_RESP_MAX_STRING      256         /* a key or a value */
#define AA_RESP_ERRLEN          128
/* The one long string allowed: the data of an APPASSIST.PAGES reply. */
#define AA_RESP_MAX_PAGE_DATA   (60 * 1024)
/* Page lists count 4 KiB frames of guest-physical memory, below 2^52. */
#define AA_PAGE_SHIFT           12
#define AA_MAX_FRAME            (1ULL << 40)

/* What the request expects (set after each reset; FIELDS by default). */
typedef enum AARespKind {
    AA_RESP_KIND_FIELDS,    /* PREPARE: a flat key/value array */
    AA_RESP_KIND_PAGES,     /* PAGES: [remaining-runs, page-list data] */
} AARespKind;

typedef enum AARespState {
    AA_RESP_MORE,   /* no complete reply yet: feed more */
    AA_RESP_DONE,   /* a reply was parsed into the AAReply */
    AA_RESP_ERROR,  /* malformed, oversized or mistyped: see aa_resp_error() */
} AARespState;

/* A decoded reply to APPASSIST.PREPARE (or a status/error reply). */
typedef struct AAReply {
    bool is_error;                  /* "-ERR ..." from the application */
    bool is_status;                 /* "+OK" */
    char message[AA_RESP_ERRLEN];   /* error/status text, printable ASCII */
    bool has_freed_bytes, has_zeroed_bytes, has_items, has_used_memory;
    bool has_rss, has_time_us;
    uint64_t freed_bytes;
    uint64_t zeroed_bytes;          /* part of freed_bytes left as zero pages */
    uint64_t items;
    uint64_t used_memory;
    uint64_t rss;
    uint64_t time_us;
    /* PREPARE: the application will give the pages it dropped (PAGES). */
    bool has_page_list;
    uint64_t page_list;
    /* PAGES reply: runs still to come after this chunk, and its data
     * (owned by the parser, valid until its next reset). */
    bool is_pages;
    uint64_t pages_remaining;
    const uint8_t *pages;
    size_t pages_len;
} AAReply;

typedef struct AARespParser AARespParser;

/* Returns NULL only when memory is exhausted. */
AARespParser *aa_resp_parser_new(void);
void aa_resp_parser_free(AARespParser *p);

/* Forget any partial reply and any error: ready for the next request. */
void aa_resp_parser_reset(AARespParser *p);

/* The reply to come is of this kind (until the next reset). */
void aa_resp_parser_expect(AARespParser *p, AARespKind kind);

/*
 * Feed @len bytes.  On AA_RESP_DONE, *@out holds the reply and bytes after it
 * are ignored until the next reset.  AA_RESP_ERROR is sticky until reset.
 */
AARespState aa_resp_feed(AARespParser *p, const void *buf, size_t len,
                         AAReply *out);

/* Why the last feed failed (valid after AA_RESP_ERROR). */
const char *aa_resp_error(const AARespParser *p);

/*
 * The data of a PAGES reply: runs of 4 KiB guest-physical frames, each two
 * LEB128 varints, (a) the zigzag-encoded distance from the end of the
 * previous run in this chunk (the first run's from frame 0) to its first
 * frame, (b) its length minus one.  Calls @fn(@opaque, first, count) per run
 * in order; every run lies below AA_MAX_FRAME.  Returns the number of runs, or
 * -1 with *@err set (a truncated or over-long varint, a run outside the range,
 * @fn returning false).  Nothing is called for a chunk after its first error.
 */
typedef bool (*AAPageRunFn)(void *opaque, uint64_t first, uint64_t count);
long aa_pages_decode(const uint8_t *buf, size_t len, AAPageRunFn fn,
                     void *opaque, const char **err);

#endif
