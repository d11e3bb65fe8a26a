/*
 * App-assisted migration: bounded parser for the guest applications' replies
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * hiredis 0.14.1 does the RESP framing.  Its own limits do not protect us:
 * 'maxbuf' only decides when an idle buffer is shrunk, a multi-bulk header
 * makes it calloc() whatever count the peer sent, and nesting is allowed
 * seven levels deep.  So we
 *   - count every byte fed for one reply and stop at AA_RESP_MAX_BYTES
 *     (bulk strings are buffered whole before they are handed over, so this
 *     also bounds a "$999999999" string);
 *   - build the reply objects ourselves (redisReplyObjectFunctions) and refuse
 *     arrays longer than AA_RESP_MAX_ELEMENTS, nested deeper than
 *     AA_RESP_MAX_DEPTH, and strings longer than AA_RESP_MAX_STRING; a refusal
 *     makes hiredis stop with an error, and it frees the partial tree through
 *     our freeObject;
 *   - accept exactly one shape per reply and check every type.
 * The guest only speaks RESP2 to us: hiredis 0.14.1 has no RESP3, so a RESP3
 * map ('%') is a protocol error like any other garbage.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "reply.h"

typedef struct AANode {
    int type;                   /* REDIS_REPLY_* */
    long long integer;
    char *str;                  /* NUL-terminated, at most AA_RESP_MAX_STRING */
    size_t len;
    int nelem;
    struct AANode **elem;       /* nelem entries, NULL until filled */
} AANode;

struct AARespParser {
    redisReader *reader;
    size_t fed;                 /* bytes fed since the last reset */
    int nodes;                  /* objects created for the current reply */
    bool done;                  /* a reply was returned: ignore the rest */
    AARespKind kind;            /* what the reply must be */
    char *page_data;            /* a PAGES reply's data, until reset */
    bool failed;                /* sticky until reset */
    char err[2 * AA_RESP_ERRLEN];     /* room for a format plus a message */
};

static void aa_set_error(AARespParser *p, const char *fmt, const char *arg)
{
    p->failed = true;
    snprintf(p->err, sizeof(p->err), fmt, arg ? arg : "");
}

static void node_free(void *obj)
{
    AANode *n = obj;
    int i;

    if (!n) {
        return;
    }
    for (i = 0; i < n->nelem; i++) {
        node_free(n->elem[i]);
    }
    free(n->elem);
    free(n->str);
    free(n);
}

static int task_depth(const redisReadTask *task)
{
    int depth = 0;

    while (task->parent) {
        depth++;
        task = task->parent;
    }
    return depth;
}

/*
 * Common part of every create callback: enforce the count and depth limits
 * and hook the new node into its parent.  Returns NULL to make hiredis fail.
 */
static AANode *node_new(const redisReadTask *task, int type)
{
    AARespParser *p = task->privdata;
    AANode *n;

    if (!p || p->nodes >= AA_RESP_MAX_ELEMENTS + 1) {
        return NULL;
    }
    if (task_depth(task) > AA_RESP_MAX_DEPTH) {
        return NULL;
    }
    n = calloc(1, sizeof(*n));
    if (!n) {
        return NULL;
    }
    n->type = type;
    p->nodes++;
    if (task->parent) {
        AANode *parent = task->parent->obj;

        if (!parent || parent->type != REDIS_REPLY_ARRAY ||
            task->idx < 0 || task->idx >= parent->nelem ||
            parent->elem[task->idx]) {
            free(n);
            return NULL;
        }
        parent->elem[task->idx] = n;
    }
    return n;
}

/*
 * The longest string allowed where @task stands: AA_RESP_MAX_PAGE_DATA for
 * the second element of a PAGES reply, AA_RESP_MAX_STRING anywhere else.
 */
static size_t max_string(const redisReadTask *task)
{
    AARespParser *p = task->privdata;

    if (p && p->kind == AA_RESP_KIND_PAGES && task->type == REDIS_REPLY_STRING &&
        task->parent && !task->parent->parent && task->idx == 1) {
        return AA_RESP_MAX_PAGE_DATA;
    }
    return AA_RESP_MAX_STRING;
}

static void *create_string(const redisReadTask *task, char *str, size_t len)
{
    size_t max = max_string(task);
    AANode *n;

    if (len > max &&
        task->type != REDIS_REPLY_ERROR && task->type != REDIS_REPLY_STATUS) {
        return NULL;
    }
    n = node_new(task, task->type);
    if (!n) {
        return NULL;
    }
    /* Error and status lines are kept truncated: they are only shown. */
    if (len > max) {
        len = max;
    }
    n->str = malloc(len + 1);
    if (!n->str) {
        /* n is already linked into its parent, which hiredis frees. */
        return task->parent ? NULL : (free(n), NULL);
    }
    memcpy(n->str, str, len);
    n->str[len] = '\0';
    n->len = len;
    return n;
}

static void *create_array(const redisReadTask *task, int elements)
{
    AARespParser *p = task->privdata;
    AANode *n;

    if (!p || elements < 0 || elements > AA_RESP_MAX_ELEMENTS ||
        p->nodes + elements > AA_RESP_MAX_ELEMENTS + 1) {
        return NULL;
    }
    n = node_new(task, REDIS_REPLY_ARRAY);
    if (!n) {
        return NULL;
    }
    if (elements > 0) {
        n->elem = calloc(elements, sizeof(*n->elem));
        if (!n->elem) {
            return task->parent ? NULL : (free(n), NULL);
        }
    }
    n->nelem = elements;
    return n;
}

static void *create_integer(const redisReadTask *task, long long value)
{
    AANode *n = node_new(task, REDIS_REPLY_INTEGER);

    if (n) {
        n->integer = value;
    }
    return n;
}

static void *create_nil(const redisReadTask *task)
{
    return node_new(task, REDIS_REPLY_NIL);
}

static redisReplyObjectFunctions aa_resp_functions = {
    .createString = create_string,
    .createArray = create_array,
    .createInteger = create_integer,
    .createNil = create_nil,
    .freeObject = node_free,
};

AARespParser *aa_resp_parser_new(void)
{
    AARespParser *p = calloc(1, sizeof(*p));

    if (!p) {
        return NULL;
    }
    p->reader = redisReaderCreateWithFunctions(&aa_resp_functions);
    if (!p->reader) {
        free(p);
        return NULL;
    }
    p->reader->privdata = p;
    return p;
}

void aa_resp_parser_free(AARespParser *p)
{
    if (p) {
        redisReaderFree(p->reader);
        free(p->page_data);
        free(p);
    }
}

void aa_resp_parser_reset(AARespParser *p)
{
    redisReader *fresh = redisReaderCreateWithFunctions(&aa_resp_functions);

    /* A reader that has failed cannot be cleared: make a new one. */
    if (fresh) {
        redisReaderFree(p->reader);
        p->reader = fresh;
        p->reader->privdata = p;
        p->failed = false;
        p->err[0] = '\0';
    } else {
        aa_set_error(p, "out of memory%s", NULL);
    }
    p->fed = 0;
    p->nodes = 0;
    p->done = false;
    p->kind = AA_RESP_KIND_FIELDS;
    free(p->page_data);
    p->page_data = NULL;
}

void aa_resp_parser_expect(AARespParser *p, AARespKind kind)
{
    p->kind = kind;
}

const char *aa_resp_error(const AARespParser *p)
{
    return p->err[0] ? p->err : "no error";
}

/* Copy at most AA_RESP_ERRLEN - 1 printable ASCII characters. */
static void copy_printable(char *dst, const char *src, size_t len)
{
    size_t i, j = 0;

    for (i = 0; i < len && j < AA_RESP_ERRLEN - 1; i++) {
        unsigned char c = src[i];
        dst[j++] = (c >= 0x20 && c < 0x7f) ? c : '?';
    }
    dst[j] = '\0';
}

/* Keys are compared after lowering case and mapping '_' to '-'. */
static void normalise_key(char *dst, size_t size, const AANode *n)
{
    size_t i;

    for (i = 0; i < n->len && i < size - 1; i++) {
        unsigned char c = n->str[i];
        dst[i] = c == '_' ? '-' : tolower(c);
    }
    dst[i] = '\0';
}

/*
 * An unsigned value: a RESP integer >= 0, or a bulk string of 1-19 decimal
 * digits (some modules send numbers as strings).  Nothing else.
 */
static bool node_to_u64(const AANode *n, uint64_t *out)
{
    uint64_t v = 0;
    size_t i;

    if (n->type == REDIS_REPLY_INTEGER) {
        if (n->integer < 0) {
            return false;
        }
        *out = n->integer;
        return true;
    }
    if (n->type != REDIS_REPLY_STRING || n->len == 0 || n->len > 19) {
        return false;
    }
    for (i = 0; i < n->len; i++) {
        if (n->str[i] < '0' || n->str[i] > '9') {
            return false;
        }
        v = v * 10 + (n->str[i] - '0');
    }
    *out = v;
    return true;
}

typedef struct AAKey {
    const char *name;
    size_t offset_value;
    size_t offset_has;
    uint64_t scale;
} AAKey;

#define AA_KEY(n, field, scale) \
    { n, offsetof(AAReply, field), offsetof(AAReply, has_##field), scale }

/* The names APPASSIST.PREPARE uses (docs/app-assist.md), and aliases. */
static const AAKey aa_keys[] = {
    AA_KEY("freed-bytes", freed_bytes, 1),
    AA_KEY("bytes-freed", freed_bytes, 1),
    AA_KEY("freed", freed_bytes, 1),
    AA_KEY("zeroed-bytes", zeroed_bytes, 1),
    AA_KEY("items", items, 1),
    AA_KEY("items-affected", items, 1),
    AA_KEY("freed-items", items, 1),
    AA_KEY("used-memory", used_memory, 1),
    AA_KEY("rss", rss, 1),
    AA_KEY("used-memory-rss", rss, 1),
    AA_KEY("time-us", time_us, 1),
    AA_KEY("took-us", time_us, 1),
    AA_KEY("page-list", page_list, 1),
    AA_KEY("time-ms", time_us, 1000),
    AA_KEY("took-ms", time_us, 1000),
};

/* A PAGES reply: [remaining-runs, data]; the data is decoded by the caller. */
static bool interpret_pages(AARespParser *p, const AANode *root, AAReply *out)
{
    AANode *data;

    if (root->nelem != 2 || !root->elem[0] || !root->elem[1]) {
        aa_set_error(p, "a PAGES reply is not [remaining, data]%s", NULL);
        return false;
    }
    if (!node_to_u64(root->elem[0], &out->pages_remaining)) {
        aa_set_error(p, "remaining runs are not a non-negative integer%s",
                     NULL);
        return false;
    }
    data = root->elem[1];
    if (data->type != REDIS_REPLY_STRING) {
        aa_set_error(p, "page-list data is not a bulk string%s", NULL);
        return false;
    }
    /* Keep the data past node_free(): the parser owns it until reset. */
    free(p->page_data);
    p->page_data = data->str;
    data->str = NULL;
    out->is_pages = true;
    out->pages = (const uint8_t *)p->page_data;
    out->pages_len = data->len;
    return true;
}

static bool interpret(AARespParser *p, const AANode *root, AAReply *out)
{
    int i;

    memset(out, 0, sizeof(*out));
    switch (root->type) {
    case REDIS_REPLY_ERROR:
        out->is_error = true;
        copy_printable(out->message, root->str, root->len);
        return true;
    case REDIS_REPLY_STATUS:
        out->is_status = true;
        copy_printable(out->message, root->str, root->len);
        return true;
    case REDIS_REPLY_ARRAY:
        break;
    default:
        aa_set_error(p, "reply is not an array of key/value pairs%s", NULL);
        return false;
    }
    if (p->kind == AA_RESP_KIND_PAGES) {
        return interpret_pages(p, root, out);
    }

    if (root->nelem % 2) {
        aa_set_error(p, "reply has an odd number of elements%s", NULL);
        return false;
    }
    for (i = 0; i < root->nelem; i += 2) {
        const AANode *k = root->elem[i], *v = root->elem[i + 1];
        char key[40];
        size_t j;

        if (!k || !v || (k->type != REDIS_REPLY_STRING &&
                         k->type != REDIS_REPLY_STATUS)) {
            aa_set_error(p, "a key in the reply is not a string%s", NULL);
            return false;
        }
        normalise_key(key, sizeof(key), k);
        for (j = 0; j < sizeof(aa_keys) / sizeof(aa_keys[0]); j++) {
            const AAKey *ak = &aa_keys[j];
            uint64_t value;

            if (strcmp(key, ak->name)) {
                continue;
            }
            if (!node_to_u64(v, &value)) {
                aa_set_error(p, "value of '%s' is not a non-negative integer",
                             ak->name);
                return false;
            }
            if (value > UINT64_MAX / ak->scale) {
                aa_set_error(p, "value of '%s' is out of range", ak->name);
                return false;
            }
            *(uint64_t *)((char *)out + ak->offset_value) = value * ak->scale;
            *(bool *)((char *)out + ak->offset_has) = true;
            break;
        }
        /* Unknown keys are allowed (newer applications), and ignored. */
    }
    if (!out->has_freed_bytes) {
        aa_set_error(p, "reply has no 'freed-bytes'%s", NULL);
        return false;
    }
    return true;
}

AARespState aa_resp_feed(AARespParser *p, const void *buf, size_t len,
                         AAReply *out)
{
    void *reply = NULL;
    bool ok;

    if (p->failed) {
        return AA_RESP_ERROR;
    }
    if (p->done) {
        return AA_RESP_DONE;
    }
    if (len > AA_RESP_MAX_BYTES - p->fed) {
        aa_set_error(p, "reply longer than %s bytes", "65536");
        return AA_RESP_ERROR;
    }
    p->fed += len;
    if (len && redisReaderFeed(p->reader, buf, len) != REDIS_OK) {
        aa_set_error(p, "%s", p->reader->errstr);
        return AA_RESP_ERROR;
    }
    if (redisReaderGetReply(p->reader, &reply) != REDIS_OK) {
        if (p->reader->err == REDIS_ERR_OOM) {
            aa_set_error(p, "reply exceeds the limits on elements, nesting "
                         "or string length%s", NULL);
        } else {
            char msg[AA_RESP_ERRLEN];

            copy_printable(msg, p->reader->errstr, strlen(p->reader->errstr));
            aa_set_error(p, "malformed reply: %s", msg);
        }
        return AA_RESP_ERROR;
    }
    if (!reply) {
        return AA_RESP_MORE;
    }
    ok = interpret(p, reply, out);
    node_free(reply);
    if (!ok) {
        return AA_RESP_ERROR;
    }
    p->done = true;
    return AA_RESP_DONE;
}

/* ------------------------------------------------------------ page lists */

static bool get_varint(const uint8_t **pos, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    int shift;

    for (shift = 0; shift < 64; shift += 7) {
        uint8_t b;

        if (*pos == end) {
            return false;
        }
        b = *(*pos)++;
        if (shift == 63 && (b & 0x7e)) {
            return false;           /* more than 64 bits */
        }
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return true;
        }
    }
    return false;                   /* an eleventh byte */
}

long aa_pages_decode(const uint8_t *buf, size_t len, AAPageRunFn fn,
                     void *opaque, const char **err)
{
    const uint8_t *pos = buf, *end = buf + len;
    uint64_t prev_end = 0;
    long runs = 0;

    while (pos < end) {
        uint64_t zz, count_1, first;
        int64_t delta;

        if (!get_varint(&pos, end, &zz) || !get_varint(&pos, end, &count_1)) {
            *err = "truncated or over-long varint in the page list";
            return -1;
        }
        delta = (int64_t)(zz >> 1) ^ -(int64_t)(zz & 1);
        if (delta < 0 ? (uint64_t)-(delta + 1) >= prev_end
                      : (uint64_t)delta >= AA_MAX_FRAME - prev_end) {
            *err = "a run of the page list starts outside 0-2^40 frames";
            return -1;
        }
        first = prev_end + delta;
        if (count_1 >= AA_MAX_FRAME - first) {
            *err = "a run of the page list ends past 2^40 frames";
            return -1;
        }
        if (!fn(opaque, first, count_1 + 1)) {
            *err = "the page list was refused";
            return -1;
        }
        prev_end = first + count_1 + 1;
        runs++;
    }
    return runs;
}
