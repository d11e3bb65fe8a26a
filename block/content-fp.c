/*
 * The content fingerprint shared by hybrid's inline dedup (hybrid-ram.c)
 * and the clone cache (clone-cache-store.c).  A fingerprint only finds
 * candidates: both users compare the bytes before they share a block.
 *
 * The clone cache keeps these values in its file, so every implementation
 * below returns the same value as the portable one, bit for bit
 * (block/tests/content-fp-test.c checks it).  Which one runs is chosen once,
 * from the host's CPU features, as util/bufferiszero.c does.
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

/* A round given its product @wp = w * FP_PRIME2 */
static inline uint64_t fp_chain(uint64_t acc, uint64_t wp)
{
    acc += wp;
    acc = (acc << 31) | (acc >> 33);
    return acc * FP_PRIME1;
}

static inline uint64_t fp_round(uint64_t acc, uint64_t w)
{
    return fp_chain(acc, w * FP_PRIME2);
}

static inline uint64_t fp_finish(uint64_t a, uint64_t b, uint64_t c,
                                 uint64_t d, size_t len)
{
    a = ((a << 1) | (a >> 63)) + ((b << 7) | (b >> 57)) +
        ((c << 12) | (c >> 52)) + ((d << 18) | (d >> 46));
    a ^= a >> 33;
    a *= FP_PRIME2;
    a ^= a >> 29;
    return a ^ len;
}

/*
 * xxh64-style fingerprint over whole 8-byte words (block sizes are powers
 * of two >= 4 KiB).  Four independent lanes keep the multiplier busy: lane
 * k takes the words at 32 * i + 8 * k.
 */
static uint64_t content_fingerprint_portable(const uint8_t *buf, size_t len)
{
    uint64_t a = FP_PRIME1, b = FP_PRIME2, c = 0, d = -FP_PRIME1;
    size_t i;

    for (i = 0; i < len; i += 32) {
        a = fp_round(a, ldq_le_p(buf + i));
        b = fp_round(b, ldq_le_p(buf + i + 8));
        c = fp_round(c, ldq_le_p(buf + i + 16));
        d = fp_round(d, ldq_le_p(buf + i + 24));
    }
    return fp_finish(a, b, c, d, len);
}

/*
 * x86-64: the words of one round of the four lanes are the four 64-bit
 * elements of one 256-bit load (x86 is little-endian: they need no swap).
 * CONFIG_AVX2_OPT is off in our minimal configure, hence the compiler's
 * own test; the target attribute compiles the function for its ISA only,
 * and it is called only where cpuinfo says so.
 *
 * No AVX2 version: AVX2 has no 64 x 64 -> 64 multiply, and composed of
 * three vpmuludq it ran at 0.67x the portable rate on the build machine
 * (all four chains in one vector), 0.95x with only the data's products
 * in the vector unit (docs/hybrid.md, "Design measurements").
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CONTENT_FP_X86 1
#include <immintrin.h>
#include "host/cpuinfo.h"

/* AVX-512 DQ + VL on 256-bit vectors: vpmullq multiplies, vprolq rotates */
static uint64_t __attribute__((target("avx512f,avx512vl,avx512dq")))
content_fingerprint_avx512(const uint8_t *buf, size_t len)
{
    const __m256i p1 = _mm256_set1_epi64x(FP_PRIME1);
    const __m256i p2 = _mm256_set1_epi64x(FP_PRIME2);
    __m256i acc = _mm256_setr_epi64x(FP_PRIME1, FP_PRIME2, 0, -FP_PRIME1);
    uint64_t l[4];
    size_t i;

    for (i = 0; i < len; i += 32) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(buf + i));

        acc = _mm256_add_epi64(acc, _mm256_mullo_epi64(w, p2));
        acc = _mm256_mullo_epi64(_mm256_rol_epi64(acc, 31), p1);
    }
    _mm256_storeu_si256((__m256i *)l, acc);
    return fp_finish(l[0], l[1], l[2], l[3], len);
}
#endif

typedef uint64_t (*ContentFpFn)(const uint8_t *buf, size_t len);

/*
 * The implementation for this host: AVX-512 where the CPU has it (1.3x the
 * portable rate on the build machine, 18.6 against 14.3 GB/s: one vector
 * chain of add, vprolq and vpmullq; docs/hybrid.md "Design measurements";
 * measure with block/tests/content-fp-test.c --bench before changing the
 * choice), the portable code otherwise.
 */
static ContentFpFn content_fp_select(void)
{
#ifdef CONTENT_FP_X86
    unsigned info = cpuinfo_init();
    const unsigned avx512 = CPUINFO_AVX512F | CPUINFO_AVX512VL |
                            CPUINFO_AVX512DQ;

    if ((info & avx512) == avx512) {
        return content_fingerprint_avx512;
    }
#endif
    return content_fingerprint_portable;
}

static ContentFpFn content_fp_impl;

static void __attribute__((constructor)) content_fp_init(void)
{
    content_fp_impl = content_fp_select();
}

uint64_t content_fingerprint(const uint8_t *buf, size_t len)
{
    assert(len % 32 == 0);
    return content_fp_impl(buf, len);
}
