/*
 * The standalone main() of the fuzz drivers (fuzz-main.h says how a driver
 * plugs in): argument parsing, the time-bounded loop over random inputs and
 * the closing line.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */
#include <string.h>
#include <time.h>

#include "fuzz-main.h"

static unsigned long long rng_state = 1;

unsigned fuzz_rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (unsigned)((rng_state * 2685821657736338717ULL) >> 32);
}

#ifndef HVM_LIBFUZZER
int main(int argc, char **argv)
{
    const char *name = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    double seconds = 10;
    unsigned long long seed = (unsigned long long)time(NULL), iters = 0;
    struct timespec t0, t;

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
            seconds = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 0);
        } else {
            fprintf(stderr, "usage: %s [--seconds N] [--seed S]\n", argv[0]);
            return 2;
        }
    }
    /* make check-long (HYBRIDVM_LONG=1) fuzzes for at least five minutes. */
    if (getenv("HYBRIDVM_LONG") && seconds < 300) {
        seconds = 300;
    }
    rng_state = seed ? seed : 1;    /* xorshift never leaves 0 */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        const uint8_t *data;
        size_t len = fuzz_generate(&data);

        LLVMFuzzerTestOneInput(data, len);
        iters++;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    printf("%s: %llu inputs in %.0f s, seed %llu: no invariant failed\n",
           name, iters, seconds, seed);
    return 0;
}
#endif
