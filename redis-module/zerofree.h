/* zerofree.h -- give memory back to the guest kernel as zero pages.
 *
 * A page an application frees (munmap, or jemalloc purging it with
 * MADV_DONTNEED) keeps its old bytes in the guest until the guest reuses it,
 * unless the kernel clears freed pages itself (init_on_free=1). A migration
 * cannot tell a free guest page from a used one, so it sends those bytes;
 * a zero page costs it a flag. Ballooning the pages away works too, but the
 * guest must then allocate and (init_on_alloc) clear every page again, in the
 * middle of the migration's set-up.
 *
 * This unit clears what this process gives back, when it gives it back:
 *   - zeroResident() clears the resident pages of a range (mincore), so a
 *     caller about to unmap a mapping (the cold arena) frees zero pages;
 *   - zeroFreeInstall() wraps jemalloc's purge hooks (purge_forced, and
 *     purge_lazy for MADV_FREE) on every arena that exists so the allocator
 *     does the same for every page it returns, and zeroFreeAdopt() on the
 *     arenas threads create later. The wrapped hooks call the originals;
 *     nothing else in jemalloc's behaviour changes.
 *
 * The hooks stay installed for the life of the process (the module cannot be
 * unloaded: it exports a data type); zeroFreeEnable() turns the clearing on
 * and off. In a forked child (BGSAVE) nothing is cleared: the writes would
 * copy pages the parent still uses.
 */
#ifndef HYBRIDMEM_ZEROFREE_H
#define HYBRIDMEM_ZEROFREE_H

#include <stddef.h>
#include <stdint.h>

typedef int (*ZeroFreeMallctl)(const char *, void *, size_t *, void *, size_t);

/* Clear the resident pages of [addr, addr+len) (page-aligned). Returns the
 * bytes cleared. Pages that are not resident are not touched (clearing them
 * would fault in fresh pages only to free them). */
size_t zeroResident(void *addr, size_t len);

/* Wrap the purge hooks of every jemalloc arena that exists through
 * 'mallctl'; 'alloc' and 'dealloc' are the allocator's own (they create its
 * huge arena first). Arenas that do not exist yet are left uncreated (each
 * one created would be merged into the allocator's statistics at every
 * epoch). Returns 0, or -1 with a reason in 'err' (an arena that could not
 * be wrapped fails the whole install, and so does opt.retain off: jemalloc
 * would then also free memory by munmap(), past every hook). Call once;
 * later calls return the first result. Clearing starts disabled. */
int zeroFreeInstall(ZeroFreeMallctl mallctl, void *(*alloc)(size_t), void (*dealloc)(void *),
                    char *err, size_t errlen);
/* Wrap the arenas created since (a thread's first allocation creates one):
 * returns how many, 0 before a successful install, -1 (errno) if one could
 * not be wrapped. What such an arena purged before it was adopted was not
 * cleared: the caller decides what that means for its promises. */
int zeroFreeAdopt(void);
/* Arenas wrapped so far. */
unsigned zeroFreeArenas(void);
int zeroFreeInstalled(void);

/* Turn clearing on/off (thread-safe; no effect before a successful install). */
void zeroFreeEnable(int on);
int zeroFreeEnabled(void);

/* Bytes cleared by the hooks and purges seen while clearing was on. */
void zeroFreeStats(uint64_t *bytes, uint64_t *purges);

#endif
