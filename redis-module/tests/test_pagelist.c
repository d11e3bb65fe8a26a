/* test_pagelist.c -- the page list built a slice at a time (pagelist.h)
 * gives the host exactly the list built in one go: the frames this process's
 * pagemap shows for the present pages, each once, none for absent pages; a
 * run once sent never changes afterwards (the last run stays back until the
 * scan has passed it); chunks of any size decode back to the same frames.
 * Needs the frames in /proc/self/pagemap (CAP_SYS_ADMIN): skips (77)
 * without them. */
#include "../pagelist.h"

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int failures;
#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    failures++; } } while (0)

#define NMAPS 3
static const size_t map_pages[NMAPS] = { 5000, 16, 3100 };

static size_t ps;

/* Decode one chunk (the wire format of pagelist.h) onto 'runs' at '*n'. */
static void decodeChunk(const uint8_t *p, size_t len, PageRun *runs, size_t *n) {
    uint64_t prev_end = 0;
    size_t pos = 0;
    while (pos < len) {
        uint64_t v[2] = { 0, 0 };
        for (int k = 0; k < 2; k++)
            for (int shift = 0;; shift += 7) {
                uint8_t b = p[pos++];
                v[k] |= (uint64_t)(b & 0x7f) << shift;
                if (!(b & 0x80)) break;
            }
        int64_t delta = (int64_t)(v[0] >> 1) ^ -(int64_t)(v[0] & 1);
        runs[*n].first = prev_end + (uint64_t)delta;
        runs[*n].count = v[1] + 1;
        prev_end = runs[*n].first + runs[*n].count;
        (*n)++;
    }
}

static int cmpU64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The frames of 'runs', sorted. */
static uint64_t *framesOf(const PageRun *runs, size_t n, size_t *count) {
    size_t total = 0, k = 0;
    for (size_t i = 0; i < n; i++) total += runs[i].count;
    uint64_t *f = malloc((total ? total : 1) * sizeof(*f));
    for (size_t i = 0; i < n; i++)
        for (uint64_t j = 0; j < runs[i].count; j++) f[k++] = runs[i].first + j;
    qsort(f, total, sizeof(*f), cmpU64);
    *count = total;
    return f;
}

/* Take the list as QEMU does (cursor += runs until none remain), with
 * chunks of 'cap' bytes and a scan budget of 'budget_us' per chunk. */
static size_t takeList(const ArenaMapping *maps, PageRun *got, size_t cap, uint64_t budget_us,
                       PageList *pl) {
    uint8_t *chunk = malloc(cap);
    size_t cursor = 0, n = 0;
    char err[160];
    memset(pl, 0, sizeof(*pl));
    for (int guard = 0; guard < 1000000; guard++) {
        size_t runs;
        uint64_t remaining;
        ssize_t len = pageListChunk(pl, maps, NMAPS, cursor, budget_us, chunk, cap, &runs,
                                    &remaining, err, sizeof(err));
        if (len < 0) {
            fprintf(stderr, "%s\n", err);
            failures++;
            break;
        }
        CHECK(runs > 0 || remaining == 0);     /* a chunk without runs ends the list */
        /* A sent run never changes: the list's runs so far are the same. */
        decodeChunk(chunk, (size_t)len, got, &n);
        for (size_t i = cursor; i < cursor + runs; i++)
            CHECK(got[i].first == pl->runs[i].first && got[i].count == pl->runs[i].count);
        cursor += runs;
        CHECK(remaining == pl->n - cursor);
        if (!remaining) break;
    }
    free(chunk);
    CHECK(pl->complete && cursor == pl->n);
    for (size_t i = 0; i < n; i++)
        CHECK(got[i].first == pl->runs[i].first && got[i].count == pl->runs[i].count);
    return n;
}

int main(void) {
    ArenaMapping maps[NMAPS];
    size_t touched = 0;
    ps = (size_t)sysconf(_SC_PAGESIZE);
    for (int m = 0; m < NMAPS; m++) {
        maps[m].len = map_pages[m] * ps;
        maps[m].addr = mmap(NULL, maps[m].len, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (maps[m].addr == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        madvise(maps[m].addr, maps[m].len, MADV_NOHUGEPAGE);
    }
    /* The first mapping: all pages but a hole; the second: none; the third:
     * every other page. */
    for (size_t i = 0; i < map_pages[0]; i++)
        if (i < 1500 || i >= 1600) {
            ((volatile char *)maps[0].addr)[i * ps] = 1;
            touched++;
        }
    for (size_t i = 0; i < map_pages[2]; i += 2) {
        ((volatile char *)maps[2].addr)[i * ps] = 1;
        touched++;
    }
    if (!pageListAvailable(maps, NMAPS)) {
        printf("SKIP: /proc/self/pagemap shows no frames (needs CAP_SYS_ADMIN)\n");
        return 77;
    }

    /* The frames, as this test reads them from pagemap. */
    uint64_t *want = malloc(touched * sizeof(*want));
    size_t nwant = 0, frames_per = ps >> 12;
    int fd = open("/proc/self/pagemap", O_RDONLY);
    CHECK(fd >= 0);
    for (int m = 0; m < NMAPS; m++)
        for (size_t i = 0; i < map_pages[m]; i++) {
            uint64_t e = 0;
            off_t off = (off_t)(((uintptr_t)maps[m].addr / ps + i) * 8);
            CHECK(pread(fd, &e, 8, off) == 8);
            if (!(e >> 63)) continue;
            for (size_t f = 0; f < frames_per; f++)
                want[nwant++] = (e & ((1ULL << 55) - 1)) * frames_per + f;
        }
    close(fd);
    CHECK(nwant == touched * frames_per);
    qsort(want, nwant, sizeof(*want), cmpU64);

    PageRun *got = malloc(touched * sizeof(*got));
    PageList whole, sliced;
    size_t nwhole, nsliced, nf;

    /* In one go, in chunks big enough for the whole list. */
    nwhole = takeList(maps, got, 60 * 1024, 0, &whole);
    CHECK(whole.slices == 1);
    uint64_t *f = framesOf(got, nwhole, &nf);
    CHECK(nf == nwant && memcmp(f, want, nf * sizeof(*f)) == 0);
    CHECK(whole.frames == nwant && whole.unlisted == 0);
    free(f);

    /* A slice per chunk (a batch of pages each: 1 us is always over) and
     * chunks of a few runs: the same runs, in the same order. */
    nsliced = takeList(maps, got, 64, 1, &sliced);
    CHECK(sliced.slices >= 8);      /* 8116 pages, at most 1024 a slice */
    CHECK(nsliced == nwhole);
    for (size_t i = 0; i < nsliced && i < nwhole; i++)
        CHECK(sliced.runs[i].first == whole.runs[i].first &&
              sliced.runs[i].count == whole.runs[i].count);
    f = framesOf(got, nsliced, &nf);
    CHECK(nf == nwant && memcmp(f, want, nf * sizeof(*f)) == 0);
    free(f);
    CHECK(sliced.frames == whole.frames && sliced.unlisted == 0);

    /* Once complete, scanning again changes nothing. */
    char err[160];
    CHECK(pageListScan(&sliced, maps, NMAPS, 1, err, sizeof(err)) == 0);
    CHECK(sliced.n == nwhole);

    unsigned long long slices = (unsigned long long)sliced.slices;
    pageListFree(&whole);
    pageListFree(&sliced);
    CHECK(sliced.n == 0 && !sliced.complete && sliced.map == 0);
    free(got);
    free(want);
    for (int m = 0; m < NMAPS; m++) munmap(maps[m].addr, maps[m].len);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ok: %zu runs, %zu frames, %llu slices\n", nwhole, nwant, slices);
    return 0;
}
