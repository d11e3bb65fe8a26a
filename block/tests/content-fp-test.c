/*
 * content-fp-test [--bench MiB] -- every implementation of the content
 * fingerprint (block/content-fp.c) returns the portable one's value.
 *
 * The clone cache stores fingerprints in its file and hybrid's dedup finds
 * chunks by them, so a vectorized version must agree bit for bit.  This
 * program includes content-fp.c itself, so that it can call each static
 * implementation directly: the driver exports no test hook and no way to
 * force a path.  test_content_fp.py builds it with the flags QEMU built
 * content-fp.c with (build/qemu-build/compile_commands.json) and runs it.
 *
 * Checks: the portable function against values of the original code (so
 * that it cannot drift with the vector ones), then each implementation the
 * host can run against the portable one over lengths 0-64 KiB and 2 MiB,
 * random, zero, all-ones and sparse content, at every start offset mod 32,
 * and the dispatched content_fingerprint() likewise.  Prints one line per
 * implementation ("avx512: 123456 equal" or "avx512: not run (no CPU
 * support)") and exits 1 at the first difference.
 *
 * With --bench MiB [NAME]: GB/s (of thread CPU time: the rate while on a
 * CPU, less moved by other load) of each implementation (or only NAME's)
 * hashing 64 KiB blocks of one cache-resident buffer, and walking a
 * MiB-sized one from memory.
 *
 * Copyright (c) 2026 The hybridvm authors
 *
 * This work is licensed under the terms of the GNU GPL, version 2 or later.
 * See the COPYING file in the top-level directory.
 */

#include "../content-fp.c"

typedef struct FpImpl {
    const char *name;
    ContentFpFn fn;
    bool usable;
} FpImpl;

static FpImpl impls[] = {
    { "portable", content_fingerprint_portable, true },
#ifdef CONTENT_FP_X86
    { "avx512", content_fingerprint_avx512, false },
#endif
};

static uint64_t dispatched(const uint8_t *buf, size_t len)
{
    return content_fingerprint(buf, len);
}

static uint32_t lcg = 1;

static uint8_t next_byte(void)
{
    lcg = lcg * 1103515245u + 12345u;
    return lcg >> 16;
}

/* Values of the fingerprint before any vector version existed */
static void check_golden(void)
{
    static const struct {
        size_t len;
        bool zero;
        uint64_t fp;
    } golden[] = {
        { 0, false, 0x8c0b45fbc3b28ee2ULL },
        { 32, false, 0x21e24577468bce2dULL },
        { 4096, false, 0x9008f459f25a993fULL },
        { 65536, false, 0x2ce183a9d3837992ULL },
        { 4096, true, 0x19fc1e069bbea4bdULL },
    };
    uint8_t *b = g_malloc(65536);
    size_t i, j;

    for (i = 0; i < ARRAY_SIZE(golden); i++) {
        uint64_t got;

        lcg = 1;
        for (j = 0; j < 65536; j++) {
            b[j] = next_byte();
        }
        if (golden[i].zero) {
            memset(b, 0, golden[i].len);
        }
        got = content_fingerprint_portable(b, golden[i].len);
        if (got != golden[i].fp) {
            fprintf(stderr, "portable: len %zu%s: %016" PRIx64 ", the original "
                    "gives %016" PRIx64 "\n", golden[i].len,
                    golden[i].zero ? " (zeros)" : "", got, golden[i].fp);
            exit(1);
        }
    }
    g_free(b);
    printf("portable: %zu original values\n", ARRAY_SIZE(golden));
}

static void fill(uint8_t *b, size_t len, int kind)
{
    size_t i;

    switch (kind) {
    case 0:
        for (i = 0; i < len; i++) {
            b[i] = next_byte();
        }
        break;
    case 1:
        memset(b, 0, len);
        break;
    case 2:
        memset(b, 0xff, len);
        break;
    default:
        /* mostly zero, a random byte here and there (carries, lane mixes) */
        memset(b, 0, len);
        for (i = 0; i < len / 64 + 1 && len; i++) {
            b[(next_byte() << 8 | next_byte()) % len] = next_byte();
        }
    }
}

/* The lengths tried: every multiple of 32 up to 4 KiB, then some larger */
static size_t nth_len(int n)
{
    static const size_t big[] = { 8192, 12288, 32768, 65536 - 32, 65536,
                                  2 * 1024 * 1024 };

    if (n <= 128) {
        return n * 32;
    }
    n -= 129;
    return n < ARRAY_SIZE(big) ? big[n] : 0;
}

static uint64_t check_one(const char *name, ContentFpFn fn)
{
    const size_t max = 2 * 1024 * 1024;
    uint8_t *area = g_malloc(max + 64);
    uint64_t n = 0;
    int kind, k, off;
    size_t len;

    lcg = 7;
    for (k = 0; (len = nth_len(k)) || k == 0; k++) {
        for (kind = 0; kind < 4; kind++) {
            for (off = 0; off < 32; off += len > 65536 ? 31 : 1) {
                uint8_t *b = area + off;
                uint64_t want, got;

                fill(b, len, kind);
                want = content_fingerprint_portable(b, len);
                got = fn(b, len);
                if (got != want) {
                    fprintf(stderr, "%s: len %zu, content %d, offset %d: "
                            "%016" PRIx64 ", portable %016" PRIx64 "\n",
                            name, len, kind, off, got, want);
                    exit(1);
                }
                n++;
            }
        }
    }
    g_free(area);
    return n;
}

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GB/s of @fn over 64 KiB blocks: of @buf (@len bytes) walked in order */
static double gbps(ContentFpFn fn, const uint8_t *buf, size_t len,
                   size_t total)
{
    const size_t bs = 65536;
    volatile uint64_t sink = 0;
    size_t done = 0, off = 0;
    double t0 = now_s();

    while (done < total) {
        sink ^= fn(buf + off, bs);
        off = (off + bs) % len;
        done += bs;
    }
    (void)sink;
    return total / (now_s() - t0) / 1e9;
}

static void bench(size_t mib, const char *only)
{
    size_t big = mib << 20, i;
    uint8_t *mem = g_malloc(big);
    double cache[ARRAY_SIZE(impls)] = { 0 }, dram[ARRAY_SIZE(impls)] = { 0 };
    int rep;

    for (i = 0; i < big; i++) {
        mem[i] = next_byte();
    }
    /* Three rounds, the implementations in turn in each; the best of each */
    for (rep = 0; rep < 3; rep++) {
        for (i = 0; i < ARRAY_SIZE(impls); i++) {
            if (only && strcmp(only, impls[i].name)) {
                impls[i].usable = false;
            }
            if (impls[i].usable) {
                cache[i] = MAX(cache[i], gbps(impls[i].fn, mem, 65536,
                                              1ULL << 30));
                dram[i] = MAX(dram[i], gbps(impls[i].fn, mem, big, big));
            }
        }
    }
    for (i = 0; i < ARRAY_SIZE(impls); i++) {
        if (impls[i].usable) {
            printf("bench %s: %.2f GB/s from cache (64 KiB), %.2f GB/s "
                   "from memory (%zu MiB)\n", impls[i].name, cache[i],
                   dram[i], mib);
        }
    }
    g_free(mem);
}

int main(int argc, char **argv)
{
    unsigned info = cpuinfo_init();
    size_t i;

#ifdef CONTENT_FP_X86
    impls[1].usable = (info & (CPUINFO_AVX512F | CPUINFO_AVX512VL |
                               CPUINFO_AVX512DQ)) ==
                      (CPUINFO_AVX512F | CPUINFO_AVX512VL | CPUINFO_AVX512DQ);
#endif
    (void)info;
    check_golden();
    for (i = 1; i < ARRAY_SIZE(impls); i++) {
        if (!impls[i].usable) {
            printf("%s: not run (no CPU support)\n", impls[i].name);
            continue;
        }
        printf("%s: %" PRIu64 " equal\n", impls[i].name,
               check_one(impls[i].name, impls[i].fn));
    }
    printf("dispatched: %" PRIu64 " equal\n",
           check_one("dispatched", dispatched));
    for (i = 0; i < ARRAY_SIZE(impls); i++) {
        if (impls[i].fn == content_fp_impl) {
            printf("selected: %s\n", impls[i].name);
        }
    }
    if (argc >= 3 && !strcmp(argv[1], "--bench")) {
        bench(strtoul(argv[2], NULL, 0), argc > 3 ? argv[3] : NULL);
    }
    return 0;
}
