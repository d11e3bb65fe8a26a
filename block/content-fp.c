/*
 * The content fingerprint shared by hybrid's inline dedup (hybrid-ram.c)
 * and the clone cache (clone-cache-store.c).  A fingerprint only finds
 * candidates: both users compare the bytes before they share a block.
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "qemu/osdep.h"
#include "qemu/bswap.h"
#include "content-fp.h"

#define FP_PRIME1 0x9E3779B185EBCA87ULL
#define FP_PRIME2 0xC2B2AE3D27D4EB4FULL

static inline uint64_t fp_round(uint64_t acc, uint64_t w)
{
    acc += w * FP_PRIME2;
    acc = (acc << 31) | (acc >> 33);
    return acc * FP_PRIME1;
}

/*
 * xxh64-style fingerprint over whole 8-byte words (block sizes are powers
 * of two >= 4 KiB).  Four independent lanes keep the multiplier busy.
 */
uint64_t content_fingerprint(const uint8_t *buf, size_t len)
{
    uint64_t a = FP_PRIME1, b = FP_PRIME2, c = 0, d = -FP_PRIME1;
    size_t i;

    assert(len % 32 == 0);
    for (i = 0; i < len; i += 32) {
        a = fp_round(a, ldq_le_p(buf + i));
        b = fp_round(b, ldq_le_p(buf + i + 8));
        c = fp_round(c, ldq_le_p(buf + i + 16));
        d = fp_round(d, ldq_le_p(buf + i + 24));
    }
    a = ((a << 1) | (a >> 63)) + ((b << 7) | (b >> 57)) +
        ((c << 12) | (c >> 52)) + ((d << 18) | (d >> 46));
    a ^= a >> 33;
    a *= FP_PRIME2;
    a ^= a >> 29;
    return a ^ len;
}
