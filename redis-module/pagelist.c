/* pagelist.c -- the guest-physical pages behind dropped memory (pagelist.h). */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pagelist.h"

#define PM_PRESENT      (1ULL << 63)
#define PM_EXCLUSIVE    (1ULL << 56)
#define PM_PFN_MASK     ((1ULL << 55) - 1)
#define PM_BATCH        1024            /* entries per read: 8 KiB */
#define FRAME_SHIFT     12              /* the wire's 4 KiB frames */

static long pageSize(void) {
    static long ps;
    if (!ps) ps = sysconf(_SC_PAGESIZE);
    return ps;
}

/* Read the pagemap entries of [addr, addr + npages pages). */
static int readEntries(int fd, const void *addr, size_t npages, uint64_t *out) {
    off_t off = (off_t)((uintptr_t)addr / (uintptr_t)pageSize()) * 8;
    size_t want = npages * 8, got = 0;
    while (got < want) {
        ssize_t r = pread(fd, (char *)out + got, want - got, off + (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

int pageListAvailable(const ArenaMapping *maps, size_t n) {
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    int ok = 0;
    if (fd < 0) return 0;
    /* The first present page among the first 64 of each mapping decides:
     * without CAP_SYS_ADMIN pagemap shows it present with frame 0. */
    for (size_t i = 0; i < n; i++) {
        size_t pages = maps[i].len / (size_t)pageSize(), j;
        uint64_t e[64];
        if (pages > 64) pages = 64;
        if (readEntries(fd, maps[i].addr, pages, e) < 0) break;
        for (j = 0; j < pages && !(e[j] & PM_PRESENT); j++)
            ;
        if (j < pages) {
            ok = (e[j] & PM_PFN_MASK) != 0;
            break;
        }
    }
    close(fd);
    return ok;
}

static int addRun(PageList *pl, uint64_t first, uint64_t count) {
    if (pl->n && pl->runs[pl->n - 1].first + pl->runs[pl->n - 1].count == first) {
        pl->runs[pl->n - 1].count += count;
        return 0;
    }
    if (pl->n == pl->cap) {
        size_t cap = pl->cap ? pl->cap * 2 : 4096;
        PageRun *r = realloc(pl->runs, cap * sizeof(*r));
        if (!r) return -1;
        pl->runs = r;
        pl->cap = cap;
    }
    pl->runs[pl->n].first = first;
    pl->runs[pl->n].count = count;
    pl->n++;
    return 0;
}

int pageListScan(PageList *pl, const ArenaMapping *maps, size_t n, uint64_t budget_us,
                 char *err, size_t errlen) {
    uint64_t per = (uint64_t)pageSize() >> FRAME_SHIFT;     /* frames per page */
    uint64_t t0 = arenaNowUs(), took;
    uint64_t e[PM_BATCH];
    int fd;
    if (pl->complete) return 0;
    fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot read /proc/self/pagemap: %s", strerror(errno));
        return -1;
    }
    while (pl->map < n) {
        size_t pages = maps[pl->map].len / (size_t)pageSize();
        size_t batch = pages - pl->page < PM_BATCH ? pages - pl->page : PM_BATCH;
        if (batch && readEntries(fd, (char *)maps[pl->map].addr + pl->page * (size_t)pageSize(),
                                 batch, e) < 0) {
            snprintf(err, errlen, "reading /proc/self/pagemap failed: %s", strerror(errno));
            close(fd);
            return -1;
        }
        for (size_t j = 0; j < batch; j++) {
            uint64_t pfn = e[j] & PM_PFN_MASK;
            if (!(e[j] & PM_PRESENT)) continue;             /* nothing to send */
            if (!pfn || !(e[j] & PM_EXCLUSIVE)) {
                pl->unlisted++;
                continue;
            }
            if (addRun(pl, pfn * per, per) < 0) {
                snprintf(err, errlen, "out of memory for the page list");
                close(fd);
                return -1;
            }
            pl->frames += per;
        }
        pl->page += batch;
        if (pl->page >= pages) {
            pl->map++;
            pl->page = 0;
        }
        if (budget_us && arenaNowUs() - t0 >= budget_us) break;
    }
    close(fd);
    pl->complete = pl->map >= n;
    took = arenaNowUs() - t0;
    pl->scan_us += took;
    if (took > pl->slice_max_us) pl->slice_max_us = took;
    pl->slices++;
    return 0;
}

static size_t pageListClosed(const PageList *pl) {
    return pl->complete || pl->n == 0 ? pl->n : pl->n - 1;
}

static size_t putVarint(uint8_t *out, uint64_t v) {
    size_t n = 0;
    do {
        out[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}

/* Encode closed runs from 'cursor' into 'out' (at most 'cap' bytes); *runs
 * gets how many. Returns the bytes written. */
static size_t pageListEncode(const PageList *pl, size_t cursor, uint8_t *out, size_t cap,
                             size_t *runs) {
    uint64_t prev_end = 0;
    size_t len = 0, i, closed = pageListClosed(pl);
    for (i = cursor; i < closed && len + 20 <= cap; i++) {
        int64_t delta = (int64_t)(pl->runs[i].first - prev_end);
        uint64_t zz = ((uint64_t)delta << 1) ^ (uint64_t)(delta >> 63);
        len += putVarint(out + len, zz);
        len += putVarint(out + len, pl->runs[i].count - 1);
        prev_end = pl->runs[i].first + pl->runs[i].count;
    }
    *runs = i > cursor ? i - cursor : 0;
    return len;
}

ssize_t pageListChunk(PageList *pl, const ArenaMapping *maps, size_t n, size_t cursor,
                      uint64_t budget_us, uint8_t *out, size_t cap, size_t *runs,
                      uint64_t *remaining, char *err, size_t errlen) {
    size_t len;
    for (int scanned = 0;; scanned = 1) {
        len = pageListEncode(pl, cursor, out, cap, runs);
        if (pl->complete || cursor + *runs < pageListClosed(pl) || (*runs && scanned)) break;
        if (pageListScan(pl, maps, n, budget_us, err, errlen) < 0) return -1;
    }
    *remaining = pl->n - cursor - *runs;
    return (ssize_t)len;
}

void pageListFree(PageList *pl) {
    free(pl->runs);
    memset(pl, 0, sizeof(*pl));
}
