/*
 * The main() the fuzz drivers share (fuzz-main.c), and what a driver defines.
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * A driver has libFuzzer's shape: LLVMFuzzerTestOneInput() checks its
 * invariants (CHECK) on one input, and fuzz_generate() makes one random input
 * for the standalone loop, drawing from fuzz_rnd().  It links with
 * fuzz-main.c, built one of two ways:
 *   - standalone (the meson tests): fuzz-main.c's main() runs
 *     `DRIVER [--seconds N] [--seed S]`, a loop of fuzz_generate() then
 *     LLVMFuzzerTestOneInput() for N seconds (10 by default, at least 300
 *     under make check-long, HYBRIDVM_LONG=1), reproducible from the seed it
 *     prints.  Built with -fsanitize=address,undefined so memory errors abort;
 *   - libFuzzer: build with -DHVM_LIBFUZZER -fsanitize=fuzzer,address; then
 *     libFuzzer's main() feeds LLVMFuzzerTestOneInput() and fuzz_generate()
 *     is never called.
 */
#ifndef HVM_FUZZ_MAIN_H
#define HVM_FUZZ_MAIN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* An invariant of every input: when it fails, say which and abort. */
#define CHECK(cond) do { \
    if (!(cond)) { \
        fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
        abort(); \
    } \
} while (0)

/* The next pseudo-random number: xorshift64*, reproducible from --seed. */
unsigned fuzz_rnd(void);

/* Defined by each driver: check one input; returns 0. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * Defined by each driver: make one random input (noise, or a valid input
 * mutated) from fuzz_rnd(), point *data at it and return its length.  The
 * bytes are the driver's, valid until the next call.
 */
size_t fuzz_generate(const uint8_t **data);

#endif
