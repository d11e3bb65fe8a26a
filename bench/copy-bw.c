/*
 * copy-bw SRC_MIB CHUNK_KIB COUNT -- the single-thread memory copy that
 * bench/hybrid-bandwidth.py sets a RAM tier's reads against: COUNT copies
 * of CHUNK_KIB each, taken in order from a SRC_MIB buffer of random bytes
 * (wrapping at its end) into one CHUNK_KIB buffer, as `qemu-img bench -d 1
 * -s CHUNK -S CHUNK` reads a SRC_MIB image into its one request buffer.
 * memcpy() is glibc's, the one QEMU's qemu_iovec_from_buf() ends in.
 * Both buffers are written before the clock starts, so no copy faults.
 *
 * Prints one JSON line: {"bytes": .., "seconds": .., "cpu_seconds": ..,
 * "GBps": ..}: wall and process CPU time of the copies alone.
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double nowS(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: copy-bw SRC_MIB CHUNK_KIB COUNT\n");
        return 2;
    }
    size_t src = strtoull(argv[1], NULL, 0) << 20;
    size_t chunk = strtoull(argv[2], NULL, 0) << 10;
    uint64_t count = strtoull(argv[3], NULL, 0);
    if (!chunk || src < chunk || src % chunk) {
        fprintf(stderr, "copy-bw: SRC must be a multiple of CHUNK\n");
        return 2;
    }
    uint8_t *s = aligned_alloc(4096, src), *d = aligned_alloc(4096, chunk);
    if (!s || !d) {
        fprintf(stderr, "copy-bw: out of memory\n");
        return 1;
    }
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < src; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(s + i, &x, 8);
    }
    memset(d, 1, chunk);

    size_t off = 0;
    double t0 = nowS(CLOCK_MONOTONIC), c0 = nowS(CLOCK_PROCESS_CPUTIME_ID);
    for (uint64_t n = 0; n < count; n++) {
        memcpy(d, s + off, chunk);
        /* the copy has an observer: it cannot be dropped or merged */
        __asm__ volatile("" : : "r"(d) : "memory");
        off += chunk;
        if (off == src) {
            off = 0;
        }
    }
    double t = nowS(CLOCK_MONOTONIC) - t0, c = nowS(CLOCK_PROCESS_CPUTIME_ID) - c0;
    printf("{\"bytes\": %llu, \"seconds\": %.6f, \"cpu_seconds\": %.6f, "
           "\"GBps\": %.3f}\n", (unsigned long long)(count * chunk), t, c,
           count * chunk / t / 1e9);
    return 0;
}
