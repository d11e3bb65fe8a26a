/*
 * App-assisted migration, destination: guest RAM is filled without huge
 * pages, and the zero pages that arrive for untouched RAM leave it untouched
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * With app-assist much of guest RAM arrives as zero pages (what the guest's
 * applications dropped), which the destination leaves unallocated; what
 * does travel -- the applications' hot data, the guest kernel, its page
 * cache -- is scattered over the guest's physical memory.  Backed by
 * transparent huge pages (QEMU asks for them on RAM blocks), each 4 KiB
 * page that arrives in an untouched 2 MiB area allocates and clears all
 * 2 MiB of it, so the destination clears nearly the whole of guest RAM
 * during the migration however much was dropped: with 3 M Redis items in a
 * 2 GiB guest, 1.8 s of the destination's CPU in clear_page in the stock and
 * the assisted migration alike, 71 % of the destination's CPU in the
 * assisted one, whose window is half as long -- CPU the guest's vCPU on the
 * source then lacks (docs/app-assist.md, "At every shape").  Without huge
 * pages only the pages that arrive are allocated.
 *
 * So an incoming migration with the app-assist capability asks for no huge
 * pages on guest RAM from its set-up (post-copy asks for none from its
 * switch-over anyway, userfaultfd needs it) and for them again when it ends,
 * as post-copy does at its end; khugepaged collapses the RAM in the
 * background afterwards.  RAM blocks with pages of their own size
 * (hugetlbfs) are left alone.
 *
 * Most of what such a migration sends is zero pages, and the precopy loader
 * handles each with ram_handle_zero(), which reads the page (buffer_is_zero)
 * before it decides not to write it: on RAM never touched that read faults
 * the shared zero page in and scans 4 KiB of it, page after page: with
 * 3 M Redis items in a 2 GiB guest, 38 % of the loading thread's samples,
 * on a destination that used three times a stock one's CPU while the
 * source's guest ran beside it on the same cores.  A page of
 * anonymous guest RAM that has not been received yet in this incoming
 * migration is still the kernel's fresh zero-filled memory, so a zero page
 * for it needs nothing done (multifd's receiver already relies on the same
 * fact: multifd_recv_zero_page_process()).  app_assist_incoming_leave_zero()
 * says when a block's RAM is such memory: while the capability is on and
 * the guest has not run here (RUN_STATE_INMIGRATE, in which even the ROM
 * loader writes nothing into RAM: rom_reset()), for RAM that is neither
 * a file or memfd (whose pages may hold data: a broker region, a restart
 * with cpr) nor shared, and not under COLO (whose secondary keeps running
 * state in RAM).  The loader asks only for a page it has not received: a
 * page received once and then zeroed on the source is cleared as usual.
 *
 * Post-copy needs one more thing.  The loader's read maps the shared zero
 * page, so a stock destination marks such a page received and nothing ever
 * faults on it; a page left alone has nothing mapped, and once post-copy
 * has registered guest RAM with userfaultfd the guest's first touch of it
 * faults.  The source sends only dirty pages, whatever the destination asks
 * for, so the fault thread must not ask: a page left alone keeps its
 * received bit clear and is recorded here (a bitmap per RAM block), and
 * postcopy_request_page() places a zero page for it locally, as it does
 * for pages a RamDiscardManager discarded.  A page the source still had
 * dirty at the switch-over is in its discard list, and ram_discard_range()
 * takes it off ours (app_assist_incoming_discard()): the source sends it.
 * Discards come before the fault thread starts and the loader records no
 * more pages after it, so the fault thread reads the bitmaps unlocked.
 */
#include "qemu/osdep.h"
#include "qemu/madvise.h"
#include "qemu/bitmap.h"
#include "qemu/rcu.h"
#include "exec/cpu-common.h"
#include "exec/ramblock.h"
#include "exec/target_page.h"
#include "migration/colo.h"
#include "migration/migration.h"
#include "migration/options.h"
#include "migration/ram.h"
#include "system/runstate.h"
#include "trace.h"

#include "app-assist.h"

static bool incoming_assisted;

/* RAMBlock * -> bitmap of its target pages left alone (zero, unmapped) */
static GHashTable *left_zero;

static void madvise_ram(int advice, const char *what)
{
    RAMBlock *rb;

    RCU_READ_LOCK_GUARD();
    RAMBLOCK_FOREACH_NOT_IGNORED(rb) {
        if (!rb->host || qemu_ram_pagesize(rb) != qemu_real_host_page_size()) {
            continue;
        }
        trace_app_assist_incoming_huge_pages(rb->idstr, what);
        qemu_madvise(rb->host, rb->max_length, advice);
    }
}

void app_assist_incoming_setup(void)
{
    if (!migrate_app_assist() || incoming_assisted) {
        return;
    }
    madvise_ram(QEMU_MADV_NOHUGEPAGE, "off");
    incoming_assisted = true;
}

void app_assist_incoming_cleanup(void)
{
    if (!incoming_assisted) {
        return;
    }
    madvise_ram(QEMU_MADV_HUGEPAGE, "on");
    g_clear_pointer(&left_zero, g_hash_table_destroy);
    incoming_assisted = false;
}

static unsigned long *left_zero_map(RAMBlock *rb)
{
    return left_zero ? g_hash_table_lookup(left_zero, rb) : NULL;
}

bool app_assist_incoming_leave_zero(RAMBlock *rb, ram_addr_t offset)
{
    unsigned long *bmap;

    if (!incoming_assisted || !runstate_check(RUN_STATE_INMIGRATE) ||
        rb->fd >= 0 || qemu_ram_is_shared(rb) ||
        qemu_ram_pagesize(rb) != qemu_target_page_size() ||
        migration_incoming_colo_enabled()) {
        return false;
    }
    if (!left_zero) {
        left_zero = g_hash_table_new_full(NULL, NULL, NULL, g_free);
    }
    bmap = left_zero_map(rb);
    if (!bmap) {
        bmap = bitmap_new(rb->max_length >> qemu_target_page_bits());
        g_hash_table_insert(left_zero, rb, bmap);
    }
    set_bit(offset >> qemu_target_page_bits(), bmap);
    return true;
}

bool app_assist_incoming_left_zero(RAMBlock *rb, ram_addr_t offset)
{
    unsigned long *bmap = left_zero_map(rb);

    if (!bmap || offset >= rb->max_length ||
        !test_bit(offset >> qemu_target_page_bits(), bmap)) {
        return false;
    }
    trace_app_assist_incoming_left_zero_fault(rb->idstr, offset);
    return true;
}

void app_assist_incoming_discard(RAMBlock *rb, uint64_t start, size_t length)
{
    unsigned long *bmap = left_zero_map(rb);
    unsigned int bits = qemu_target_page_bits();

    if (bmap && start < rb->max_length) {
        length = MIN(length, rb->max_length - start);
        bitmap_clear(bmap, start >> bits, length >> bits);
    }
}
