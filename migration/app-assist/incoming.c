/*
 * App-assisted migration, destination: guest RAM is filled without huge pages
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
 */
#include "qemu/osdep.h"
#include "qemu/madvise.h"
#include "qemu/rcu.h"
#include "exec/cpu-common.h"
#include "exec/ramblock.h"
#include "migration/migration.h"
#include "migration/options.h"
#include "migration/ram.h"
#include "trace.h"

#include "app-assist.h"

static bool incoming_nohuge;

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
    if (!migrate_app_assist() || incoming_nohuge) {
        return;
    }
    madvise_ram(QEMU_MADV_NOHUGEPAGE, "off");
    incoming_nohuge = true;
}

void app_assist_incoming_cleanup(void)
{
    if (!incoming_nohuge) {
        return;
    }
    madvise_ram(QEMU_MADV_HUGEPAGE, "on");
    incoming_nohuge = false;
}
