/* pagelist.h -- the guest-physical pages behind dropped memory, for the host.
 *
 * After PREPARE dropped the cold arena, QEMU (migration/app-assist/pages.c)
 * may ask which guest-physical pages held it (APPASSIST.PAGES on the host
 * port): it then sends them as zero pages without reading them, so this
 * process needs neither to clear them nor to give them back to the guest
 * kernel during the migration. It keeps them mapped, untouched, until the
 * migration is over (RESUME or ABORT).
 *
 * The frames come from /proc/self/pagemap, which shows them only to a
 * process with CAP_SYS_ADMIN; only pages present and mapped by this process
 * alone are listed (after a fork a child may still read the others).
 * Reading it takes a while for a large arena (~0.18 us a page under TCG,
 * 64 ms for 1.3 GiB), and it runs in the server's event loop: so the
 * list is built a slice at a time, as the host asks for chunks, and the
 * server serves its clients between two slices.
 *
 * Wire format (docs/app-assist.md, "Page lists"): runs of 4 KiB frames, each
 * two LEB128 varints, the zigzag distance from the end of the previous run in
 * the same chunk (the first from frame 0) and the run's length minus one.
 */
#ifndef HYBRIDMEM_PAGELIST_H
#define HYBRIDMEM_PAGELIST_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "arena.h"

typedef struct PageRun {
    uint64_t first, count;      /* 4 KiB frames */
} PageRun;

typedef struct PageList {
    PageRun *runs;
    size_t n, cap;
    uint64_t frames;            /* listed */
    uint64_t unlisted;          /* present pages not listed (shared, no PFN) */
    size_t map, page;           /* where the scan goes on: mapping, page in it */
    int complete;               /* every mapping scanned */
    uint64_t scan_us;           /* time spent scanning, in all */
    uint64_t slice_max_us;      /* the longest slice */
    uint64_t slices;
} PageList;

/* 1 if pagemap shows this process the frame of a resident page of the
 * mappings (CAP_SYS_ADMIN), 0 if not or nothing is resident. */
int pageListAvailable(const ArenaMapping *maps, size_t n);

/* Go on listing the frames of the mappings' pages where the last call
 * stopped (a zeroed PageList starts), until the scan is complete or
 * 'budget_us' has passed (at least one batch of pages; 0: no limit). The
 * mappings must stay the same and mapped between calls. Returns 0, or -1
 * with 'err'. */
int pageListScan(PageList *pl, const ArenaMapping *maps, size_t n, uint64_t budget_us,
                 char *err, size_t errlen);

/* The chunk of the list from run 'cursor' (at most pl->n) for the host:
 * at most 'cap' bytes of runs into 'out', *runs gets how many and
 * *remaining how many are still to come (exact once the scan is complete,
 * else at least 1: the last run is held back until the scan has passed it,
 * so a run once sent never changes). Scans a slice of 'budget_us' first
 * unless the runs ready fill the chunk, and more slices only while none
 * could be sent (a chunk without runs ends the list). Returns the bytes
 * written, or -1 with 'err'. */
ssize_t pageListChunk(PageList *pl, const ArenaMapping *maps, size_t n, size_t cursor,
                      uint64_t budget_us, uint8_t *out, size_t cap, size_t *runs,
                      uint64_t *remaining, char *err, size_t errlen);

void pageListFree(PageList *pl);

#endif
