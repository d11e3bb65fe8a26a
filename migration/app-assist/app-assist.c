/*
 * App-assisted migration: the set-up phase on the source, the resume on the
 * destination, and the undo when a migration fails or is cancelled
 *
 * Copyright (c) 2026 hybridvm contributors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Source, migration thread, before the first RAM pass (state SETUP, so the
 * time counts in setup-time):
 *   1. APPASSIST.PREPARE <deadline-ms> to every port with an application, in
 *      parallel; wait for the replies until the deadline.
 *   2. Balloon target = actual - sum(freed bytes that are not zero pages),
 *      clamped (each reply to the guest's RAM, the target to a floor);
 *      inflate; wait until the balloon reaches the target, stalls, or
 *      app-assist-balloon-wait runs out.  An application that left what it
 *      freed as zero pages (zeroed-bytes) needs no balloon at all.
 *   3. Return: the migration goes on.  The discarded pages read as zero and
 *      cost a few bytes each in the stream instead of a page.
 * Every wait is bounded and ends early on cancel.  Nothing here fails the
 * migration: a guest that does not cooperate only loses the assist, and
 * query-migrate's app-assist section says why.
 *
 * If the migration then fails or is cancelled (MIG_EVENT_PRECOPY_FAILED), the
 * balloon goes back to its size before the phase and the applications that
 * were sent PREPARE get APPASSIST.ABORT.
 *
 * Destination: the "app-assist" vmstate section (sent only when the phase
 * changed something) carries the balloon size to restore.  Once the incoming
 * migration has completed -- for post-copy, when all RAM has arrived -- and
 * the guest runs, the balloon is deflated to that size and the applications
 * get APPASSIST.RESUME.
 */
#include "qemu/osdep.h"
#include "qemu/error-report.h"
#include "qemu/main-loop.h"
#include "qemu/module.h"
#include "qemu/thread.h"
#include "qemu/timer.h"
#include "qemu/units.h"
#include "qapi/error.h"
#include "qapi/qapi-commands-machine.h"
#include "qapi/qapi-events-migration.h"
#include "qapi/qapi-visit-migration.h"
#include "qapi/clone-visitor.h"
#include "hw/boards.h"
#include "hw/virtio/virtio-balloon.h"
#include "qobject/qdict.h"
#include "qobject/qnum.h"
#include "qom/qom-qobject.h"
#include "migration/misc.h"
#include "migration/vmstate.h"
#include "migration/migration.h"
#include "migration/options.h"
#include "monitor/monitor.h"
#include "system/runstate.h"
#include "trace.h"

#include "app-assist.h"
#include "app-assist-int.h"

#define AA_POLL_MS              50
#define AA_BALLOON_STALL_MS     3000    /* no progress for this long: stop */
#define AA_MIN_GUEST_BYTES      (128 * MiB)
#define AA_INCOMING_POLL_MS     100
/*
 * virtio-serial tells a port's backend that the guest has it open again
 * from a QEMU_CLOCK_VIRTUAL timer after the VM starts on the destination
 * (virtio_serial_post_load_timer_cb): a check right after the start can
 * find every port closed (seen under load).  Wait this long for one.
 */
#define AA_INCOMING_OPEN_WAIT_MS 3000
#define AA_BALLOON_PAGE         4096    /* VIRTIO_BALLOON_PFN_SHIFT */
#define AA_AVAIL_MARGIN         (64 * MiB)  /* left available in the guest */
#define AA_STATS_WAIT_MS        3000    /* for a report newer than PREPARE */
#define AA_STATS_MAX_AGE_S      10      /* an older report bounds nothing */
/*
 * The guest acknowledges a batch of 256 balloon pages every few ms under
 * TCG (measured: 2026-11-21, see docs/app-assist.md): poll that often so
 * that the set-up phase ends within a few ms of the balloon's target.
 */
#define AA_BALLOON_POLL_MS      5

typedef struct AppAssistState {
    /* Everything is protected by the BQL, except @wake. */
    QemuSemaphore wake;             /* a port changed status */
    NotifierWithReturn notifier;    /* migration events, source side */
    AppAssistInfo *info;            /* last phase; NULL before the first */

    /* What to undo (source) or redo (destination); migrated. */
    bool prepared;                  /* some port was sent PREPARE */
    bool balloon_changed;           /* we set a balloon target */
    uint64_t balloon_restore;       /* balloon "actual" to go back to */

    QEMUTimer *incoming_timer;      /* destination: wait for the end */
    int64_t incoming_running_ms;    /* when the guest was first seen running */
} AppAssistState;

static AppAssistState aa_state;

void app_assist_wakeup(void)
{
    qemu_sem_post(&aa_state.wake);
}

int64_t aa_now_ms(void)
{
    return qemu_clock_get_ms(QEMU_CLOCK_REALTIME);
}

AppAssistInfo *aa_current_info(void)
{
    return aa_state.info;
}

void aa_wait_replies(MigrationState *s, int64_t end,
                     bool (*running)(MigrationState *s))
{
    for (;;) {
        int64_t now = aa_now_ms();
        AppAssistPort *port = NULL;
        bool waiting = false;

        bql_lock();
        while ((port = aa_port_next(port))) {
            if (now >= end || !running(s)) {
                aa_port_expire(port);
            }
            waiting |= aa_port_status(port) == APP_ASSIST_PORT_STATUS_WAITING;
        }
        bql_unlock();
        if (!waiting) {
            return;
        }
        qemu_sem_timedwait(&aa_state.wake, MIN(AA_POLL_MS, end - now));
    }
}

/* One QAPI event per real state change, always through here. */
static void aa_send_event(void)
{
    qapi_event_send_migration_app_assist(aa_state.info);
}

void aa_set_reason(const char *fmt, ...)
{
    AppAssistInfo *info = aa_state.info;
    g_autofree char *why = NULL;
    va_list ap;

    va_start(ap, fmt);
    why = g_strdup_vprintf(fmt, ap);
    va_end(ap);
    trace_app_assist_skip(why);
    /* Every distinct reason, in order; a phase has a handful at most. */
    if (!info->reason) {
        info->reason = g_steal_pointer(&why);
    } else if (!strstr(info->reason, why)) {
        char *both = g_strdup_printf("%s; %s", info->reason, why);

        g_free(info->reason);
        info->reason = both;
    }
}

static void aa_info_new(AppAssistStatus status)
{
    qapi_free_AppAssistInfo(aa_state.info);
    aa_state.info = g_new0(AppAssistInfo, 1);
    aa_state.info->status = status;
}

/* Per-port figures, from the ports' current state. */
static void aa_collect_ports(void)
{
    AppAssistInfo *info = aa_state.info;
    AppAssistPortInfoList **tail = &info->ports;
    uint64_t ram = current_machine->ram_size;
    AppAssistPort *port = NULL;

    qapi_free_AppAssistPortInfoList(info->ports);
    info->ports = NULL;
    info->apps_answered = 0;
    info->freed_bytes = 0;
    info->zeroed_bytes = 0;
    while ((port = aa_port_next(port))) {
        AppAssistPortInfo *pi = g_new0(AppAssistPortInfo, 1);
        const AAReply *r = aa_port_reply(port);

        pi->id = g_strdup(aa_port_id(port));
        pi->status = aa_port_status(port);
        if (pi->status == APP_ASSIST_PORT_STATUS_ANSWERED) {
            /* Sane clamping: no application frees more than the guest has. */
            pi->has_freed_bytes = true;
            pi->freed_bytes = MIN(r->freed_bytes, ram);
            pi->has_zeroed_bytes = r->has_zeroed_bytes;
            pi->zeroed_bytes = MIN(r->zeroed_bytes, pi->freed_bytes);
            pi->has_items = r->has_items;
            pi->items = r->items;
            pi->has_app_time = r->has_time_us;
            pi->app_time = r->time_us;
            info->apps_answered++;
            info->freed_bytes = MIN(info->freed_bytes + pi->freed_bytes, ram);
            info->zeroed_bytes = MIN(info->zeroed_bytes + pi->zeroed_bytes,
                                     info->freed_bytes);
        } else if (aa_port_error(port)[0]) {
            pi->error = g_strdup(aa_port_error(port));
        }
        QAPI_LIST_APPEND(tail, pi);
    }
}

/*
 * What the balloon is for: freed memory that still holds data.  Pages an
 * application left zero cost the migration a flag each; inflating over
 * them would only make the guest allocate and clear them again.
 */
static uint64_t aa_balloon_bytes(void)
{
    return aa_state.info->freed_bytes - aa_state.info->zeroed_bytes;
}

static bool aa_still_setting_up(MigrationState *s)
{
    return qatomic_read(&s->state) == MIGRATION_STATUS_SETUP;
}

/* Step 1 (BQL not held on entry or exit). */
static void aa_prepare(MigrationState *s, uint32_t deadline_ms)
{
    g_autofree char *arg = g_strdup_printf("%u", deadline_ms);
    int64_t start = aa_now_ms(), end = start + deadline_ms;
    AppAssistPort *port = NULL;
    uint32_t contacted = 0;

    bql_lock();
    while ((port = aa_port_next(port))) {
        if (aa_port_request(port, "APPASSIST.PREPARE", arg, true)) {
            contacted++;
        }
    }
    aa_state.info->apps_contacted = contacted;
    aa_state.prepared = contacted > 0;
    bql_unlock();

    aa_wait_replies(s, end, aa_still_setting_up);

    bql_lock();
    aa_collect_ports();
    aa_state.info->prepare_time = aa_now_ms() - start;
    trace_app_assist_prepare_done(contacted, aa_state.info->apps_answered,
                                  aa_state.info->freed_bytes,
                                  aa_state.info->zeroed_bytes,
                                  aa_state.info->prepare_time);
    if (!aa_still_setting_up(s)) {
        aa_set_reason("migration cancelled during PREPARE");
    }
    if (!contacted) {
        aa_set_reason("no application has an app-assist port open");
    } else if (!aa_state.info->apps_answered) {
        aa_set_reason("no application answered PREPARE (see ports)");
    } else if (aa_state.info->apps_answered < contacted) {
        aa_set_reason("%u of %u applications did not answer PREPARE "
                      "(see ports)", contacted - aa_state.info->apps_answered,
                      contacted);
    }
    bql_unlock();
}

/*
 * The balloon's last statistics report (BQL held): in *@when its arrival
 * (wall-clock seconds, the balloon's own unit; 0 before the first), in
 * *@avail the guest's available memory (UINT64_MAX if not reported).
 * Returns false when the balloon does not poll statistics at all.
 */
static bool aa_guest_available(uint64_t *avail, int64_t *when)
{
    Object *balloon = object_resolve_path_type("", TYPE_VIRTIO_BALLOON, NULL);
    g_autoptr(QDict) dict = NULL;
    QObject *obj;
    QDict *stats;
    QNum *n;

    if (!balloon ||
        object_property_get_int(balloon, "guest-stats-polling-interval",
                                NULL) <= 0) {
        return false;
    }
    obj = object_property_get_qobject(balloon, "guest-stats", NULL);
    dict = qobject_to(QDict, obj);
    if (!dict) {
        qobject_unref(obj);
        return false;
    }
    *when = qdict_get_try_int(dict, "last-update", 0);
    stats = qdict_get_qdict(dict, "stats");
    n = stats ? qobject_to(QNum, qdict_get(stats, "stat-available-memory"))
              : NULL;
    /* Unreported statistics read as -1. */
    if (!n || !qnum_get_try_uint(n, avail)) {
        *avail = UINT64_MAX;
    }
    return true;
}

/*
 * Ask the guest for a statistics report now (BQL held): setting the polling
 * interval re-creates the balloon's timer, which fires at once, then every
 * interval as before.  The interval ends up unchanged.
 */
static void aa_request_stats(void)
{
    Object *balloon = object_resolve_path_type("", TYPE_VIRTIO_BALLOON, NULL);
    int64_t interval;

    if (!balloon) {
        return;
    }
    interval = object_property_get_int(balloon,
                                       "guest-stats-polling-interval", NULL);
    if (interval > 0) {
        object_property_set_int(balloon, "guest-stats-polling-interval", 0,
                                &error_abort);
        object_property_set_int(balloon, "guest-stats-polling-interval",
                                interval, &error_abort);
    }
}

/* What the guest must keep whatever the applications report. */
static uint64_t aa_balloon_floor(void)
{
    return MAX(AA_MIN_GUEST_BYTES, current_machine->ram_size / 8);
}

/*
 * The balloon target without statistics: 'actual' less the freed bytes
 * that still hold data, never below the floor.
 */
static uint64_t aa_balloon_target(uint64_t actual)
{
    uint64_t target = actual > aa_balloon_bytes() ? actual - aa_balloon_bytes()
                                                  : 0;

    return ROUND_UP(MAX(target, aa_balloon_floor()), AA_BALLOON_PAGE);
}

/*
 * What the balloon may take without statistics (BQL held).  Returns the
 * number of bytes to inflate by, 0 for none.
 */
static uint64_t aa_balloon_want(uint64_t actual)
{
    uint64_t target = aa_balloon_target(actual);

    return target < actual ? actual - target : 0;
}

/*
 * The guest's available memory to bound the balloon with (BQL not held), or
 * UINT64_MAX when there is no bound.  Waiting for a report newer than
 * PREPARE (@since) only matters when the balloon would take more than the
 * guest had available before: a report at most AA_STATS_MAX_AGE_S old that
 * already leaves room for @want bytes plus the margin bounds the target
 * without waiting (PREPARE only adds to what is available).  Otherwise ask
 * for a report as soon as one can be told apart from older ones (the
 * balloon stamps reports in whole seconds: once the second of @since is
 * over) and wait for it, up to AA_STATS_WAIT_MS; without one, go unbounded
 * as before (the floor still holds).
 */
static uint64_t aa_wait_guest_available(MigrationState *s, time_t since,
                                        uint64_t want)
{
    int64_t start = aa_now_ms(), end = start + AA_STATS_WAIT_MS;
    uint64_t avail = UINT64_MAX;
    int64_t when = 0;
    bool polled, asked = false;

    bql_lock();
    polled = aa_guest_available(&avail, &when);
    bql_unlock();
    if (!polled) {
        return UINT64_MAX;
    }
    if (when > 0 && time(NULL) - when <= AA_STATS_MAX_AGE_S &&
        avail != UINT64_MAX && avail >= want + AA_AVAIL_MARGIN) {
        trace_app_assist_stats(avail, when, 0);
        return avail;
    }
    for (;;) {
        bql_lock();
        polled = aa_guest_available(&avail, &when);
        if (polled && when <= since && !asked && time(NULL) > since) {
            aa_request_stats();
            asked = true;
        }
        bql_unlock();
        if (!polled) {
            return UINT64_MAX;
        }
        if (when > since) {
            /* UINT64_MAX if the guest does not report that statistic. */
            trace_app_assist_stats(avail, when, aa_now_ms() - start);
            return avail;
        }
        if (aa_now_ms() >= end || !aa_still_setting_up(s)) {
            trace_app_assist_stats(UINT64_MAX, 0, aa_now_ms() - start);
            return UINT64_MAX;
        }
        g_usleep(AA_BALLOON_POLL_MS * 1000);
    }
}

/* Step 2, setting the target (BQL held).  Returns the target, 0 for none. */
static uint64_t aa_balloon_inflate(uint64_t guest_avail)
{
    AppAssistInfo *info = aa_state.info;
    uint64_t min_bytes = aa_balloon_floor();
    g_autoptr(BalloonInfo) bi = NULL;
    Error *err = NULL;
    uint64_t target;

    bi = qmp_query_balloon(&err);
    if (!bi) {
        aa_set_reason("cannot balloon: %s", error_get_pretty(err));
        error_free(err);
        return 0;
    }
    info->balloon_initial = bi->actual;
    info->balloon_reached = bi->actual;
    if (!aa_balloon_bytes()) {
        return 0;
    }
    target = aa_balloon_target(bi->actual);
    /*
     * Where the guest reports its available memory after PREPARE, never
     * inflate into what it needs: an application may over-report.
     */
    if (guest_avail != UINT64_MAX &&
        bi->actual - MIN(target, bi->actual) + AA_AVAIL_MARGIN > guest_avail) {
        uint64_t room = guest_avail > AA_AVAIL_MARGIN ?
                        guest_avail - AA_AVAIL_MARGIN : 0;

        target = ROUND_UP(bi->actual - MIN(room, bi->actual), AA_BALLOON_PAGE);
        aa_set_reason("balloon limited by the guest's available memory "
                      "(%" PRIu64 " bytes)", guest_avail);
    }
    trace_app_assist_balloon_target(bi->actual, target, min_bytes);
    if (target >= bi->actual) {
        aa_set_reason("freed memory is below what the guest must keep "
                      "(%" PRIu64 " bytes)", min_bytes);
        return 0;
    }
    qmp_balloon(target, &err);
    if (err) {
        aa_set_reason("cannot balloon: %s", error_get_pretty(err));
        error_free(err);
        return 0;
    }
    if (!aa_state.balloon_changed) {
        aa_state.balloon_changed = true;
        aa_state.balloon_restore = bi->actual;
    }
    info->balloon_target = target;
    return target;
}

/* Step 2, waiting (BQL not held on entry or exit). */
static void aa_balloon(MigrationState *s, uint32_t wait_ms, time_t since)
{
    int64_t start = aa_now_ms(), end = start + wait_ms, progress = start;
    g_autoptr(BalloonInfo) bi = NULL;
    uint64_t target, last, avail, want;

    bql_lock();
    aa_state.info->status = APP_ASSIST_STATUS_BALLOONING;
    bi = qmp_query_balloon(NULL);
    want = bi ? aa_balloon_want(bi->actual) : 0;
    bql_unlock();
    avail = want ? aa_wait_guest_available(s, since, want) : UINT64_MAX;

    bql_lock();
    target = aa_balloon_inflate(avail);
    last = aa_state.info->balloon_reached;
    bql_unlock();
    if (!target) {
        return;
    }

    for (;;) {
        int64_t now = aa_now_ms();
        const char *why = NULL;

        bql_lock();
        qapi_free_BalloonInfo(bi);
        bi = qmp_query_balloon(NULL);
        if (bi) {
            aa_state.info->balloon_reached = bi->actual;
            if (bi->actual < last) {
                last = bi->actual;
                progress = now;
            }
        }
        if (!bi) {
            why = "the balloon device went away";
        } else if (bi->actual <= target) {
            why = "";
        } else if (!aa_still_setting_up(s)) {
            why = "migration cancelled while ballooning";
        } else if (!wait_ms) {
            why = "balloon inflating during the migration "
                  "(app-assist-balloon-wait=0)";
        } else if (now >= end) {
            why = "balloon did not reach its target in time";
        } else if (now - progress >= AA_BALLOON_STALL_MS) {
            why = "balloon stopped inflating before its target";
        }
        if (why && why[0]) {
            aa_set_reason("%s", why);
        }
        bql_unlock();
        if (why) {
            break;
        }
        g_usleep(AA_BALLOON_POLL_MS * 1000);
    }

    bql_lock();
    aa_state.info->balloon_time = aa_now_ms() - start;
    trace_app_assist_balloon_done(aa_state.info->balloon_reached, target,
                                  aa_state.info->balloon_time);
    bql_unlock();
}

void app_assist_source_run(MigrationState *s)
{
    uint32_t deadline = migrate_app_assist_deadline();
    uint32_t balloon_wait = migrate_app_assist_balloon_wait();
    bool balloon = migrate_app_assist_balloon();
    time_t prepared_at;

    bql_lock();
    aa_info_new(APP_ASSIST_STATUS_PREPARING);
    aa_state.prepared = false;
    aa_state.balloon_changed = false;
    trace_app_assist_source_start(aa_port_count(), deadline, balloon_wait,
                                  balloon);
    if (!aa_port_count()) {
        aa_set_reason("no app-assist port (-chardev app-assist + "
                      "virtserialport)");
    }
    bql_unlock();

    if (aa_port_count()) {
        aa_prepare(s, deadline);
    }
    prepared_at = time(NULL);

    if (!aa_balloon_bytes()) {
        /* Nothing to balloon away (none freed, or all of it zero pages). */
    } else if (!balloon) {
        bql_lock();
        aa_set_reason("ballooning disabled (app-assist-balloon=off)");
        bql_unlock();
    } else if (aa_still_setting_up(s)) {
        aa_balloon(s, balloon_wait, prepared_at);
    }

    bql_lock();
    if (!aa_state.prepared && !aa_state.balloon_changed) {
        aa_state.info->status = APP_ASSIST_STATUS_SKIPPED;
    } else {
        aa_state.info->status = APP_ASSIST_STATUS_COMPLETED;
    }
    aa_send_event();
    if (aa_state.info->reason) {
        warn_report("migration: app-assist: %s", aa_state.info->reason);
    }
    bql_unlock();
}

/* Source: undo after a failed or cancelled migration (BQL held). */
static void aa_undo(void)
{
    AppAssistPort *port = NULL;
    int aborted = 0;

    if (aa_state.balloon_changed) {
        Error *err = NULL;

        qmp_balloon(aa_state.balloon_restore, &err);
        if (err) {
            warn_report_err(err);
        }
    }
    if (aa_state.prepared) {
        while ((port = aa_port_next(port))) {
            if (aa_port_guest_open(port) &&
                aa_port_request(port, "APPASSIST.ABORT", NULL, false)) {
                aborted++;
            }
        }
    }
    trace_app_assist_undo(aa_state.balloon_restore, aborted);
    if (aa_state.info) {
        aa_state.info->status = APP_ASSIST_STATUS_CANCELLED;
        aa_send_event();
    }
    aa_state.prepared = false;
    aa_state.balloon_changed = false;
}

static int aa_migration_notify(NotifierWithReturn *notifier,
                               MigrationEvent *e, Error **errp)
{
    switch (e->type) {
    case MIG_EVENT_PRECOPY_FAILED:
        if (aa_state.prepared || aa_state.balloon_changed) {
            aa_undo();
        }
        break;
    case MIG_EVENT_PRECOPY_DONE:
        /* The destination owns the undo now (it restores the balloon). */
        aa_state.prepared = false;
        aa_state.balloon_changed = false;
        break;
    default:
        break;
    }
    return 0;
}

static bool aa_any_port_open(void)
{
    AppAssistPort *port = NULL;

    while ((port = aa_port_next(port))) {
        if (aa_port_guest_open(port)) {
            return true;
        }
    }
    return false;
}

/*
 * The guest runs on the destination and, if applications are to be
 * resumed, one of their ports is open again or AA_INCOMING_OPEN_WAIT_MS
 * have passed since it started.
 */
static bool aa_incoming_ready(void)
{
    if (!runstate_is_running()) {
        return false;
    }
    if (!aa_state.incoming_running_ms) {
        aa_state.incoming_running_ms = aa_now_ms();
    }
    return !aa_state.prepared || !aa_port_count() || aa_any_port_open() ||
           aa_now_ms() - aa_state.incoming_running_ms >= AA_INCOMING_OPEN_WAIT_MS;
}

/* Destination: deflate and RESUME once the guest runs with all its RAM. */
static void aa_incoming_check(void *opaque)
{
    MigrationIncomingState *mis = migration_incoming_get_current();
    AppAssistPort *port = NULL;
    int resumed = 0;

    switch (mis->state) {
    case MIGRATION_STATUS_FAILED:
    case MIGRATION_STATUS_CANCELLED:
        /* The source undoes the phase on its side. */
        aa_state.prepared = aa_state.balloon_changed = false;
        aa_state.incoming_running_ms = 0;
        return;
    case MIGRATION_STATUS_COMPLETED:
        if (aa_incoming_ready()) {
            break;
        }
        /* fall through: wait */
    default:
        timer_mod(aa_state.incoming_timer,
                  aa_now_ms() + AA_INCOMING_POLL_MS);
        return;
    }

    aa_info_new(APP_ASSIST_STATUS_RESUMED);
    if (aa_state.balloon_changed) {
        g_autoptr(BalloonInfo) bi = qmp_query_balloon(NULL);
        Error *err = NULL;

        aa_state.info->balloon_reached = bi ? bi->actual : 0;
        aa_state.info->balloon_target = aa_state.balloon_restore;
        qmp_balloon(aa_state.balloon_restore, &err);
        if (err) {
            aa_set_reason("cannot deflate the balloon: %s",
                          error_get_pretty(err));
            error_free(err);
        }
    }
    if (aa_state.prepared) {
        while ((port = aa_port_next(port))) {
            if (aa_port_request(port, "APPASSIST.RESUME", NULL, false)) {
                resumed++;
            }
        }
        aa_state.info->apps_contacted = resumed;
        if (!resumed) {
            aa_set_reason("no application has an app-assist port open");
        }
    }
    aa_collect_ports();
    trace_app_assist_incoming_resume(aa_state.balloon_restore, resumed);
    aa_send_event();
    if (aa_state.info->reason) {
        warn_report("migration: app-assist: %s", aa_state.info->reason);
    }
    aa_state.prepared = aa_state.balloon_changed = false;
    aa_state.incoming_running_ms = 0;
}

static bool aa_vmstate_needed(void *opaque)
{
    return aa_state.prepared || aa_state.balloon_changed;
}

static int aa_post_load(void *opaque, int version_id)
{
    trace_app_assist_incoming_loaded(aa_state.balloon_restore);
    if (aa_state.balloon_changed &&
        aa_state.balloon_restore > current_machine->ram_size) {
        /* From the stream: clamp like anything else we are told. */
        aa_state.balloon_restore = current_machine->ram_size;
    }
    if (!aa_state.incoming_timer) {
        aa_state.incoming_timer = timer_new_ms(QEMU_CLOCK_REALTIME,
                                               aa_incoming_check, NULL);
    }
    timer_mod(aa_state.incoming_timer, aa_now_ms() + AA_INCOMING_POLL_MS);
    return 0;
}

static const VMStateDescription vmstate_app_assist = {
    .name = "app-assist",
    .version_id = 1,
    .minimum_version_id = 1,
    .needed = aa_vmstate_needed,
    .post_load = aa_post_load,
    .fields = (const VMStateField[]) {
        VMSTATE_BOOL(prepared, AppAssistState),
        VMSTATE_BOOL(balloon_changed, AppAssistState),
        VMSTATE_UINT64(balloon_restore, AppAssistState),
        VMSTATE_END_OF_LIST()
    },
};

/*
 * Registered in every QEMU, ports or not: a destination started without
 * app-assist ports (or without the capability) must still accept the
 * section from an assisted source -- an unknown section fails the whole
 * incoming migration.  It then restores the balloon and says that no
 * application could be resumed.  The section is only sent when the phase
 * changed something (.needed), so other streams are unchanged.
 */
static void app_assist_init(void)
{
    qemu_sem_init(&aa_state.wake, 0);
    migration_add_notifier(&aa_state.notifier, aa_migration_notify);
    vmstate_register(NULL, 0, &vmstate_app_assist, &aa_state);
}
migration_init(app_assist_init);

void app_assist_fill_info(MigrationInfo *info)
{
    if (aa_state.info) {
        info->app_assist = QAPI_CLONE(AppAssistInfo, aa_state.info);
    }
}

void app_assist_hmp_print(Monitor *mon, AppAssistInfo *info)
{
    AppAssistPortInfoList *p;

    monitor_printf(mon, "app-assist: %s\n",
                   AppAssistStatus_str(info->status));
    if (info->reason) {
        monitor_printf(mon, "  reason: %s\n", info->reason);
    }
    monitor_printf(mon, "  apps contacted/answered: %u/%u\n",
                   info->apps_contacted, info->apps_answered);
    monitor_printf(mon, "  freed: %" PRIu64 " kbytes (zero pages: %" PRIu64
                   " kbytes)\n", info->freed_bytes >> 10,
                   info->zeroed_bytes >> 10);
    monitor_printf(mon, "  balloon initial/target/reached: %" PRIu64 "/%"
                   PRIu64 "/%" PRIu64 " MiB\n", info->balloon_initial >> 20,
                   info->balloon_target >> 20, info->balloon_reached >> 20);
    monitor_printf(mon, "  prepare time: %" PRIu64 " ms, balloon time: %"
                   PRIu64 " ms\n", info->prepare_time, info->balloon_time);
    if (info->has_dropped_pages) {
        monitor_printf(mon, "  dropped pages (sent as zero unless written): %"
                       PRIu64 ", not RAM: %" PRIu64 ", in %" PRIu64 " ms\n",
                       info->dropped_pages, info->rejected_pages,
                       info->pages_time);
    }
    for (p = info->ports; p; p = p->next) {
        monitor_printf(mon, "  port %s: %s", p->value->id,
                       AppAssistPortStatus_str(p->value->status));
        if (p->value->has_freed_bytes) {
            monitor_printf(mon, ", freed %" PRIu64 " kbytes",
                           p->value->freed_bytes >> 10);
        }
        if (p->value->has_dropped_pages) {
            monitor_printf(mon, ", %" PRIu64 " pages listed",
                           p->value->dropped_pages);
        }
        if (p->value->error) {
            monitor_printf(mon, " (%s)", p->value->error);
        }
        monitor_printf(mon, "\n");
    }
}
