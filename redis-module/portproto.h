/* portproto.h -- a bounded RESP request parser and a small reply writer for the
 * host port (virtio-serial). Everything read from the port is hostile: sizes
 * are bounded before anything is copied, and a malformed request is reported
 * without consuming more than the buffer holds. No Redis dependency. */
#ifndef HYBRIDMEM_PORTPROTO_H
#define HYBRIDMEM_PORTPROTO_H

#include <stddef.h>
#include <stdint.h>

#define RESP_MAX_ARGS   8       /* APPASSIST.PREPARE <deadline> is 2 */
#define RESP_MAX_ARG    256     /* bytes per argument */
#define RESP_MAX_REQ    4096    /* bytes per request, framing included */

typedef struct RespRequest {
    int argc;
    const char *argv[RESP_MAX_ARGS];   /* NUL-terminated, point into store */
    size_t argl[RESP_MAX_ARGS];
    char store[RESP_MAX_REQ];
} RespRequest;

typedef enum RespParse {
    RESP_NEED_MORE = 0,         /* incomplete: keep the bytes, read more */
    RESP_OK = 1,                /* one request in *req, *consumed bytes used */
    RESP_ERROR = -1,            /* malformed or oversized: *err says why */
} RespParse;

/* Parse one request from buf[0..len): a RESP array of bulk strings
 * ("*2\r\n$4\r\nPING\r\n...") or an inline line ("APPASSIST.STATUS\r\n").
 * On RESP_ERROR the caller discards its buffer (there is no way to resync
 * inside a corrupted stream); *err is a static string. */
RespParse respParseRequest(const char *buf, size_t len, RespRequest *req,
                           size_t *consumed, const char **err);

/* Growable output buffer; functions return 0 or -1 (ENOMEM, or the buffer
 * would exceed 'limit' bytes). */
typedef struct RespBuf {
    char *p;
    size_t len, cap, limit;
} RespBuf;

void respBufInit(RespBuf *b, size_t limit);
void respBufFree(RespBuf *b);
void respBufConsume(RespBuf *b, size_t n);
int respAddArrayLen(RespBuf *b, long long n);
int respAddMapLen(RespBuf *b, long long n, int resp3);   /* RESP2: 2n array */
int respAddBulk(RespBuf *b, const char *s, size_t len);
int respAddInt(RespBuf *b, long long v);
int respAddSimple(RespBuf *b, const char *s);            /* "+s\r\n" */
int respAddError(RespBuf *b, const char *s);             /* "-s\r\n" */

#endif
