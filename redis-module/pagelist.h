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
 *
 * Wire format (docs/app-assist.md, "Page lists"): runs of 4 KiB frames, each
 * two LEB128 varints, the zigzag distance from the end of the previous run in
 * the same chunk (the first from frame 0) and the run's length minus one.
 */
#ifndef HYBRIDMEM_PAGELIST_H
#define HYBRIDMEM_PAGELIST_H

#include <stddef.h>
#include <stdint.h>

#include "arena.h"

typedef struct PageRun {
    uint64_t first, count;      /* 4 KiB frames */
} PageRun;

typedef struct PageList {
    PageRun *runs;
    size_t n, cap;
    uint64_t frames;            /* listed */
    uint64_t unlisted;          /* present pages not listed (shared, no PFN) */
} PageList;

/* 1 if pagemap shows this process the frame of a resident page of the
 * mappings (CAP_SYS_ADMIN), 0 if not or nothing is resident. */
int pageListAvailable(const ArenaMapping *maps, size_t n);

/* List the frames of the mappings' pages. Returns 0, or -1 with 'err'. */
int pageListBuild(PageList *pl, const ArenaMapping *maps, size_t n, char *err, size_t errlen);

/* Encode runs from 'cursor' into 'out' (at most 'cap' bytes); *runs gets how
 * many. Returns the bytes written. */
size_t pageListEncode(const PageList *pl, size_t cursor, uint8_t *out, size_t cap, size_t *runs);

void pageListFree(PageList *pl);

#endif
