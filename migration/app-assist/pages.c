/*
 * App-assisted migration: the lists of pages the applications dropped
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * An application that dropped memory in PREPARE and answered "page-list 1"
 * can say which guest-physical pages held it.  The migration then sends those
 * pages as zero pages without reading them, so the application needs neither
 * to clear them (guest CPU, during the migration) nor to give them back to
 * the guest kernel before the pages are sent: it frees them once the
 * migration is over.
 *
 * Source, migration thread, after qemu_savevm_state_setup() (dirty logging
 * runs and the first bitmap sync is done) and before the first RAM pass:
 *   1. ram_app_assist_arm(): every later write to guest RAM shows in the
 *      dirty bitmap (with KVM's manual log protection, the log is cleared for
 *      all of RAM now instead of chunk by chunk);
 *   2. APPASSIST.PAGES <cursor> to each such port until it has sent all its
 *      runs (the application reads /proc/self/pagemap only now, after 1);
 *      each run is checked against the machine's memory map and only guest
 *      RAM that migrates is marked;
 *   3. APPASSIST.PAGES END: the application may stop waiting for requests.
 * A marked page is sent as a zero page the first time the migration sends
 * it; a page written after step 1 loses its mark at the next dirty-bitmap
 * sync (include/exec/ram_addr.h), so whatever the guest wrote there since
 * travels.  Pages written between the application's read of pagemap and the
 * list's arrival are among those, since the read comes after step 1.
 *
 * The list is the guest's word about its own memory: a wrong list can only
 * lose data inside that guest, like any write the application could make to
 * memory it can read in pagemap (which needs CAP_SYS_ADMIN in the guest).
 * It is still bounded: runs outside guest RAM are counted and ignored, a
 * port may not list more frames than the guest has, the whole step shares
 * app-assist-deadline, and cancel ends it.
 */
#include "qemu/osdep.h"
#include "qemu/main-loop.h"
#include "qemu/rcu.h"
#include "exec/address-spaces.h"
#include "exec/cpu-common.h"
#include "exec/memory.h"
#include "exec/target_page.h"
#include "hw/boards.h"
#include "migration/migration.h"
#include "migration/options.h"
#include "migration/ram.h"
#include "trace.h"

#include "app-assist.h"
#include "app-assist-int.h"

bool aa_pages_usable(void)
{
    ZeroPageDetection zpd = migrate_zero_page_detection();

    /*
     * Marked pages are sent by save_zero_page(), which the migration skips
     * without zero-page detection, with multifd's own detection, with RDMA,
     * and for mapped-ram files.
     */
    return qemu_target_page_size() == (1 << AA_PAGE_SHIFT) &&
           zpd != ZERO_PAGE_DETECTION_NONE &&
           (!migrate_multifd() || zpd == ZERO_PAGE_DETECTION_LEGACY) &&
           !migrate_rdma() && !migrate_mapped_ram() &&
           !migrate_background_snapshot();
}

typedef struct AAPagesCtx {
    uint64_t frames;        /* frames listed by this port so far */
    uint64_t max_frames;    /* the guest's RAM, in frames */
    uint64_t marked;
    uint64_t rejected;
} AAPagesCtx;

/* One run of frames from the guest (BQL held). */
static bool aa_mark_run(void *opaque, uint64_t first, uint64_t count)
{
    AAPagesCtx *ctx = opaque;
    hwaddr addr = first << AA_PAGE_SHIFT;
    uint64_t len = count << AA_PAGE_SHIFT;

    if (count > ctx->max_frames - ctx->frames) {
        return false;       /* more than the guest has */
    }
    ctx->frames += count;
    while (len) {
        MemoryRegionSection sec = memory_region_find(get_system_memory(),
                                                     addr, len);
        uint64_t size, skip;

        if (!sec.mr) {
            ctx->rejected += len >> AA_PAGE_SHIFT;
            break;
        }
        /* A hole before the section: not RAM. */
        skip = sec.offset_within_address_space - addr;
        size = MIN(int128_get64(sec.size), len - skip);
        ctx->rejected += skip >> AA_PAGE_SHIFT;
        if (memory_region_is_ram(sec.mr) && !memory_region_is_rom(sec.mr) &&
            !memory_region_is_ram_device(sec.mr) && !sec.mr->readonly &&
            !(sec.offset_within_region & ~TARGET_PAGE_MASK) &&
            !(size & ~TARGET_PAGE_MASK)) {
            void *host = memory_region_get_ram_ptr(sec.mr) +
                         sec.offset_within_region;
            ram_addr_t offset;
            RAMBlock *rb = qemu_ram_block_from_host(host, false, &offset);
            uint64_t n = rb ? ram_app_assist_drop(rb, offset,
                                                  size >> TARGET_PAGE_BITS)
                            : 0;

            ctx->marked += n;
            ctx->rejected += (size >> AA_PAGE_SHIFT) - n;
        } else {
            ctx->rejected += size >> AA_PAGE_SHIFT;
        }
        memory_region_unref(sec.mr);
        if (!size) {
            break;
        }
        addr += skip + size;
        len -= skip + size;
    }
    return true;
}

/* The port called @id, if it still exists (BQL held). */
static AppAssistPort *aa_port_find(const char *id)
{
    AppAssistPort *port = NULL;

    while ((port = aa_port_next(port))) {
        if (!strcmp(aa_port_id(port), id)) {
            return port;
        }
    }
    return NULL;
}

/* Its line in query-migrate (BQL held). */
static AppAssistPortInfo *aa_port_info(const char *id)
{
    AppAssistInfo *info = aa_current_info();
    AppAssistPortInfoList *l;

    for (l = info ? info->ports : NULL; l; l = l->next) {
        if (!strcmp(l->value->id, id)) {
            return l->value;
        }
    }
    return NULL;
}

static bool aa_still_migrating(MigrationState *s)
{
    int state = qatomic_read(&s->state);

    return state == MIGRATION_STATUS_SETUP || state == MIGRATION_STATUS_ACTIVE;
}

static void aa_port_end_pages(const char *id)
{
    AppAssistPort *port = aa_port_find(id);

    if (port && aa_port_guest_open(port)) {
        aa_port_request(port, "APPASSIST.PAGES", "END", false);
    }
}

/*
 * Take one port's list (BQL not held).  Returns NULL when it was taken
 * whole, else why not (a static string).
 */
static const char *aa_take_list(MigrationState *s, const char *id,
                                int64_t end, AAPagesCtx *ctx)
{
    uint64_t cursor = 0;

    for (;;) {
        g_autofree char *arg = g_strdup_printf("%" PRIu64, cursor);
        const char *argv[2] = { "APPASSIST.PAGES", arg };
        AppAssistPortStatus st;
        const char *err = NULL;
        const AAReply *r;
        AppAssistPort *port;
        uint64_t remaining = 0;
        long runs;

        bql_lock();
        port = aa_port_find(id);
        if (!port || !aa_port_request_argv(port, 2, argv, AA_RESP_KIND_PAGES,
                                           true)) {
            bql_unlock();
            return "the port went away";
        }
        bql_unlock();

        aa_wait_replies(s, end, aa_still_migrating);
        bql_lock();
        port = aa_port_find(id);
        st = port ? aa_port_status(port) : APP_ASSIST_PORT_STATUS_NO_APP;
        bql_unlock();
        if (st != APP_ASSIST_PORT_STATUS_ANSWERED) {
            return !aa_still_migrating(s) ? "migration cancelled" :
                   st == APP_ASSIST_PORT_STATUS_TIMEOUT ?
                   "no complete list before the deadline" :
                   st == APP_ASSIST_PORT_STATUS_REFUSED ?
                   "the application refused PAGES" :
                   "invalid PAGES reply";
        }

        bql_lock();
        port = aa_port_find(id);
        r = port ? aa_port_reply(port) : NULL;
        runs = r && r->is_pages ?
               aa_pages_decode(r->pages, r->pages_len, aa_mark_run, ctx, &err)
               : -1;
        if (r) {
            remaining = r->pages_remaining;
        }
        trace_app_assist_pages_chunk(id, cursor, runs, remaining, ctx->marked);
        bql_unlock();
        if (runs < 0) {
            return err ? err : "the port went away";
        }
        if (!remaining) {
            return NULL;
        }
        if (!runs) {
            return "a PAGES reply without runs before the end";
        }
        cursor += runs;
    }
}

void app_assist_source_pages(MigrationState *s)
{
    uint64_t max_frames = current_machine->ram_size >> AA_PAGE_SHIFT;
    int64_t start = aa_now_ms(), end;
    g_autoptr(GPtrArray) ids = g_ptr_array_new_with_free_func(g_free);
    AppAssistInfo *info;
    AppAssistPort *port = NULL;
    bool usable;
    guint i;

    bql_lock();
    info = aa_current_info();
    while (info && (port = aa_port_next(port))) {
        const AAReply *r = aa_port_reply(port);

        if (aa_port_status(port) == APP_ASSIST_PORT_STATUS_ANSWERED &&
            r->has_page_list && r->page_list) {
            g_ptr_array_add(ids, g_strdup(aa_port_id(port)));
        }
    }
    usable = ids->len && aa_pages_usable() && ram_app_assist_arm();
    if (ids->len && !usable) {
        for (i = 0; i < ids->len; i++) {
            aa_port_end_pages(g_ptr_array_index(ids, i));
        }
        aa_set_reason("page lists not used (zero-page detection off, "
                      "multifd's own, RDMA or mapped-ram)");
    }
    bql_unlock();
    if (!usable) {
        return;
    }

    end = start + migrate_app_assist_deadline();
    for (i = 0; i < ids->len; i++) {
        const char *id = g_ptr_array_index(ids, i);
        AAPagesCtx ctx = { .max_frames = max_frames };
        const char *why = aa_take_list(s, id, end, &ctx);
        AppAssistPortInfo *pi;

        bql_lock();
        aa_port_end_pages(id);
        info->has_dropped_pages = info->has_rejected_pages = true;
        info->dropped_pages += ctx.marked;
        info->rejected_pages += ctx.rejected;
        pi = aa_port_info(id);
        if (pi) {
            pi->has_dropped_pages = true;
            pi->dropped_pages = ctx.marked;
        }
        if (why) {
            aa_set_reason("page list of %s: %s (pages marked before it "
                          "still count)", id, why);
        }
        trace_app_assist_pages_done(id, ctx.marked, ctx.rejected,
                                    why ? why : "");
        bql_unlock();
    }
    bql_lock();
    info->has_pages_time = true;
    info->pages_time = aa_now_ms() - start;
    bql_unlock();
}
