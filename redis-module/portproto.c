/* portproto.c -- bounded RESP request parser and reply writer; see portproto.h. */
#include "portproto.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Parse a decimal length terminated by CRLF at p (up to end). Returns the
 * pointer after CRLF, NULL if incomplete; sets *bad on malformed input. */
static const char *parseLen(const char *p, const char *end, long long *out,
                            int *bad) {
    long long v = 0;
    int digits = 0, neg = 0;
    if (p < end && *p == '-') { neg = 1; p++; }
    while (p < end && *p >= '0' && *p <= '9') {
        if (++digits > 9) { *bad = 1; return NULL; }
        v = v * 10 + (*p - '0');
        p++;
    }
    if (p == end) return NULL;
    if (!digits || *p != '\r') { *bad = 1; return NULL; }
    if (p + 1 == end) return NULL;
    if (p[1] != '\n') { *bad = 1; return NULL; }
    *out = neg ? -v : v;
    return p + 2;
}

static RespParse parseInline(const char *buf, size_t len, RespRequest *req,
                             size_t *consumed, const char **err) {
    const char *nl = memchr(buf, '\n', len < RESP_MAX_REQ ? len : RESP_MAX_REQ);
    if (!nl) {
        if (len >= RESP_MAX_REQ) { *err = "inline request too long"; return RESP_ERROR; }
        return RESP_NEED_MORE;
    }
    size_t linelen = (size_t)(nl - buf);
    if (linelen && buf[linelen - 1] == '\r') linelen--;
    char *store = req->store;
    size_t used = 0;
    req->argc = 0;
    size_t i = 0;
    while (i < linelen) {
        while (i < linelen && (buf[i] == ' ' || buf[i] == '\t')) i++;
        if (i == linelen) break;
        size_t s = i;
        while (i < linelen && buf[i] != ' ' && buf[i] != '\t') i++;
        size_t l = i - s;
        if (req->argc == RESP_MAX_ARGS) { *err = "too many arguments"; return RESP_ERROR; }
        if (l > RESP_MAX_ARG) { *err = "argument too long"; return RESP_ERROR; }
        for (size_t k = s; k < i; k++)
            if ((unsigned char)buf[k] < 0x20) { *err = "control character in inline request"; return RESP_ERROR; }
        memcpy(store + used, buf + s, l);
        store[used + l] = '\0';
        req->argv[req->argc] = store + used;
        req->argl[req->argc++] = l;
        used += l + 1;
    }
    *consumed = (size_t)(nl - buf) + 1;
    return RESP_OK;
}

RespParse respParseRequest(const char *buf, size_t len, RespRequest *req,
                           size_t *consumed, const char **err) {
    *err = NULL;
    req->argc = 0;
    if (len == 0) return RESP_NEED_MORE;
    if (buf[0] != '*') return parseInline(buf, len, req, consumed, err);

    const char *p = buf + 1, *end = buf + len;
    int bad = 0;
    long long n;
    p = parseLen(p, end, &n, &bad);
    if (bad) { *err = "invalid multibulk length"; return RESP_ERROR; }
    if (!p) {
        if (len > 32) { *err = "invalid multibulk length"; return RESP_ERROR; }
        return RESP_NEED_MORE;
    }
    if (n < 1 || n > RESP_MAX_ARGS) { *err = "invalid multibulk length"; return RESP_ERROR; }
    size_t used = 0;
    for (long long i = 0; i < n; i++) {
        if (p == end) goto more;
        if (*p != '$') { *err = "expected '$'"; return RESP_ERROR; }
        long long l;
        const char *q = parseLen(p + 1, end, &l, &bad);
        if (bad) { *err = "invalid bulk length"; return RESP_ERROR; }
        if (!q) {
            if (end - p > 32) { *err = "invalid bulk length"; return RESP_ERROR; }
            goto more;
        }
        if (l < 0 || l > RESP_MAX_ARG) { *err = "invalid bulk length"; return RESP_ERROR; }
        if ((size_t)(q - buf) + (size_t)l + 2 > RESP_MAX_REQ) { *err = "request too big"; return RESP_ERROR; }
        if ((size_t)(end - q) < (size_t)l + 2) goto more;
        if (q[l] != '\r' || q[l + 1] != '\n') { *err = "bulk not terminated by CRLF"; return RESP_ERROR; }
        memcpy(req->store + used, q, (size_t)l);
        req->store[used + l] = '\0';
        req->argv[i] = req->store + used;
        req->argl[i] = (size_t)l;
        used += (size_t)l + 1;
        p = q + l + 2;
    }
    req->argc = (int)n;
    *consumed = (size_t)(p - buf);
    return RESP_OK;
more:
    if (len >= RESP_MAX_REQ) { *err = "request too big"; return RESP_ERROR; }
    req->argc = 0;
    return RESP_NEED_MORE;
}

/* ----------------------------------------------------------- writer */

void respBufInit(RespBuf *b, size_t limit) {
    b->p = NULL;
    b->len = b->cap = 0;
    b->limit = limit;
}

void respBufFree(RespBuf *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

void respBufConsume(RespBuf *b, size_t n) {
    if (n >= b->len) { b->len = 0; return; }
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

static int reserve(RespBuf *b, size_t n) {
    if (n > b->limit || b->len > b->limit - n) { errno = ENOBUFS; return -1; }
    if (b->len + n <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) { errno = ENOMEM; return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int addRaw(RespBuf *b, const char *s, size_t n) {
    if (reserve(b, n) < 0) return -1;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

static int addPrefixed(RespBuf *b, char type, long long v) {
    char tmp[32];
    int n = snprintf(tmp, sizeof(tmp), "%c%lld\r\n", type, v);
    return addRaw(b, tmp, (size_t)n);
}

int respAddArrayLen(RespBuf *b, long long n) { return addPrefixed(b, '*', n); }
int respAddMapLen(RespBuf *b, long long n, int resp3) {
    return resp3 ? addPrefixed(b, '%', n) : addPrefixed(b, '*', n * 2);
}
int respAddInt(RespBuf *b, long long v) { return addPrefixed(b, ':', v); }

int respAddBulk(RespBuf *b, const char *s, size_t len) {
    if (addPrefixed(b, '$', (long long)len) < 0) return -1;
    if (addRaw(b, s, len) < 0) return -1;
    return addRaw(b, "\r\n", 2);
}

/* Simple strings and errors must not contain CR/LF: they are replaced. */
static int addLine(RespBuf *b, char type, const char *s) {
    size_t n = strlen(s);
    if (reserve(b, n + 3) < 0) return -1;
    b->p[b->len++] = type;
    for (size_t i = 0; i < n; i++)
        b->p[b->len++] = (s[i] == '\r' || s[i] == '\n') ? ' ' : s[i];
    b->p[b->len++] = '\r';
    b->p[b->len++] = '\n';
    return 0;
}

int respAddSimple(RespBuf *b, const char *s) { return addLine(b, '+', s); }
int respAddError(RespBuf *b, const char *s) { return addLine(b, '-', s); }
