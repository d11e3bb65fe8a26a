#!/usr/bin/env python3
"""Benchmark: app-assisted post-copy against the alternatives, Redis in the guest.

For each configuration a fresh source guest is booted, loaded with the same
data set (`--items` values of `--size` bytes, `--hot` of them hot), and
migrated to a fresh destination over tcp:127.0.0.1 with the bandwidth capped
(default 1 Gbit/s), while a load generator on the host GETs hot keys
(following the guest to the destination when the source stops answering).

Configurations (--configs, comma-separated):
  precopy       stock pre-copy
  precopy-fph   pre-copy, virtio-balloon free-page-hint=on
  postcopy      stock post-copy (postcopy-ram, switch after --precopy-seconds)
  design        the design's way: stock Redis, scan every key and delete the
                cold ones, MEMORY PURGE, balloon by the RSS that went away,
                then post-copy (the scan/delete/balloon time counts as set-up)
  ours          our module + app-assist capability, post-copy, defaults: the
                module clears what Redis frees (appassist.zero-freed auto)
                and drops its arena lazily, so what it gave back is zero
                pages and QEMU has nothing to balloon
  ours-nolist   ours with appassist.page-list no: the module clears and
                unmaps its dropped arena in a thread during the migration
                (how ours worked before page lists); ours gives QEMU the
                arena's guest-physical pages instead, which go as zero pages
                unread, and hands the arena back after RESUME
  ours-wholelist
                ours with appassist.page-list-slice-us 0: the module reads
                its whole page list from pagemap at the first chunk QEMU
                asks for, in Redis's event loop (how ours worked until
                2026-11-26 22:00 UTC); ours reads 2 ms of it per chunk
  ours-balloon  ours with appassist.zero-freed no: freed pages keep their
                data, QEMU inflates the balloon over them and waits for it
                (the balloon path; every configuration below runs with
                zero-freed no as well, except ours-iof)
  ours-fpr      our module + app-assist without ballooning, free-page
                reporting on the balloon instead
  ours-balloon-fpr
                ours-balloon with free-page reporting on as well (does it
                shorten the inflation?)
  ours-nowait   ours-balloon with app-assist-balloon-wait=0: the set-up phase ends
                after PREPARE and sets the balloon target; the guest inflates
                while the first RAM pass runs (pages it takes before the pass
                reaches them are not sent)
  postcopy-stock-redis
                stock post-copy of stock Redis 7.0 (no module): the fair
                baseline for the issue's goals (no module footprint)
  postcopy-stock-redis-fpr
                the same with free-page reporting on: the baseline for the
                configurations that have it
  ours-iof      ours in a guest booted with init_on_free=1 and without
                ballooning: the guest zeroes every page it frees, so what
                Redis gave back (arena, jemalloc purges) is sent as zero
                pages; set-up is PREPARE alone
  postcopy-stock-redis-iof
                stock post-copy of stock Redis in the same init_on_free=1
                guest: the baseline for ours-iof
  ours-nowait-lazy
                ours-nowait with the module's appassist.lazy-drop yes: the
                arena is unmapped by a thread after PREPARE has replied
  ours-ioa0     ours in a guest booted with init_on_alloc=0: the balloon's
                page allocations are not zeroed (Debian's kernel zeroes
                every allocation by default; under TCG that zeroing is most
                of the inflation's guest CPU time)
  ours-nowait-ioa0
                ours-nowait-lazy in the same init_on_alloc=0 guest
  ours-loadtuned
                ours measured with the settings the loader uses to demote fast
                (interval-ms 1, slice-us 1000, hot-percent 0, min-idle-ms 0)
                left in place, as runs before 2026-11-26 were; every other
                configuration gets the module's defaults back after loading
  postcopy-stock-redis-ioa0
                stock post-copy of stock Redis in the same init_on_alloc=0
                guest: the baseline for the two above
Writes a Markdown table and PNG charts into --out (docs/bench by default) and
the raw figures as JSON.  Only measured numbers go there.
"""
import argparse
import contextlib
import ctypes
import json
import os
import random
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOP, 'tests'))
sys.path.insert(0, os.path.join(TOP, 'tests', 'avocado'))

import hvlib  # noqa: E402
from hvlib.vm import free_port  # noqa: E402
import app_assist_pooled as pooled  # noqa: E402
import charts  # noqa: E402
import procstat  # noqa: E402

MiB = 1 << 20
PORT_NAME = 'org.qemu.app-assist.0'
LINK_PORTS = ('mkdir -p /dev/virtio-ports; for p in /sys/class/virtio-ports/vport*; do '
              'ln -sf /dev/${p##*/} /dev/virtio-ports/$(cat $p/name); done')
CONFIGS = ['precopy', 'precopy-fph', 'postcopy', 'postcopy-stock-redis', 'design', 'ours',
           'ours-nolist', 'ours-wholelist', 'ours-balloon', 'ours-nowait', 'ours-nowait-lazy', 'ours-fpr', 'ours-balloon-fpr',
           'postcopy-stock-redis-fpr', 'ours-iof', 'postcopy-stock-redis-iof', 'ours-ioa0',
           'ours-nowait-ioa0', 'postcopy-stock-redis-ioa0', 'ours-loadtuned']
STOCK_REDIS = ('design',) + tuple(c for c in CONFIGS if c.startswith('postcopy-stock-redis'))
OURS = [c for c in CONFIGS if c.startswith('ours')]
NOWAIT = ('ours-nowait', 'ours-nowait-lazy', 'ours-nowait-ioa0')
LAZY = ('ours-nowait-lazy', 'ours-nowait-ioa0')
# Configurations that keep freed pages' data (appassist.zero-freed no): the
# balloon and free-page-reporting experiments.
ZERO_OFF = ('ours-balloon', 'ours-nowait', 'ours-nowait-lazy', 'ours-fpr', 'ours-balloon-fpr',
            'ours-ioa0', 'ours-nowait-ioa0')
# Module settings a configuration changes from the defaults, before loading.
MODULE_SETTINGS = {**{c: {'zero-freed': 'no'} for c in ZERO_OFF},
                   'ours-nolist': {'page-list': 'no'},
                   'ours-wholelist': {'page-list-slice-us': 0}}
# The longest the synchronous compaction pass after loading may take (s).
COMPACT_BUDGET_S = 600
# How many of the window's slowest GETs a row keeps (for the JSON).
SLOWEST = 200
# The window after the migration that the load is measured in as well.
AFTER_S = 2.0
# Configurations that keep the loader's settings (a 1 ms interval of 1 ms
# slices) while they are measured; every other one gets the module's
# defaults back after loading, as a server in service has them.
LOAD_TUNED = ('ours-loadtuned',)
# The kind of guest is the configuration's suffix, and a configuration is
# compared with the stock baseline of the same kind: free-page reporting on
# the balloon (fpr), a guest that zeroes freed pages (iof) or one that does
# not zero allocated ones (ioa0).
GUEST_KINDS = ('-fpr', '-iof', '-ioa0')
GUEST_APPEND = {'-iof': 'init_on_free=1', '-ioa0': 'init_on_alloc=0'}


def guest_kind(config):
    return next((sfx for sfx in GUEST_KINDS if config.endswith(sfx)), '')


def log(msg):
    print(f'[{time.strftime("%H:%M:%S")}] {msg}', flush=True)


def guest_args(config, trace=None):
    args = ['-trace', trace, '-msg', 'timestamp=on'] if trace else []
    args += ['-device', 'virtio-serial-pci,id=vser0',
            '-chardev', 'app-assist,id=aa0',
            '-device', f'virtserialport,bus=vser0.0,chardev=aa0,name={PORT_NAME}']
    balloon = 'virtio-balloon-pci,id=balloon0'
    if config == 'precopy-fph':
        args += ['-object', 'iothread,id=bio0']
        balloon += ',free-page-hint=on,iothread=bio0'
    if guest_kind(config) == '-fpr':
        balloon += ',free-page-reporting=on'
    return args + ['-device', balloon]


Load = hvlib.RedisLoad


@contextlib.contextmanager
def thp_disabled(disable):
    """While set, processes started by this one have transparent huge pages
    off (PR_SET_THP_DISABLE is inherited across fork and exec); this
    process gets them back afterwards."""
    if not disable:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_thp_disable = 41
    if libc.prctl(pr_set_thp_disable, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), 'prctl(PR_SET_THP_DISABLE)')
    try:
        yield
    finally:
        libc.prctl(pr_set_thp_disable, 0, 0, 0, 0)


def load_data(g, args, module, lazy=False, keep_tuning=False, settings=None):
    r = g.redis(timeout=120, socket_timeout=120)
    for k, v in (settings or {}).items():
        r.config_set(f'appassist.{k}', v)
    size, n = args.size, args.items
    rng = random.Random(7)
    blob = rng.randbytes(size + 4096)
    t0 = time.monotonic()
    # MSET of 1000 keys, 10 per round trip: Redis's per-command cost under
    # TCG made one SET per key the slowest part of a run.
    for i in range(0, n, 10_000):
        pipe = r.pipeline(transaction=False)
        for b in range(i, min(n, i + 10_000), 1000):
            pipe.mset({f'{j:x}': blob[j % 4096:j % 4096 + size]
                       for j in range(b, min(n, b + 1000))})
        pipe.execute()
    nhot = int(n * args.hot)
    log(f'{g.name}: loaded {n} items in {time.monotonic() - t0:.0f} s')
    if module:
        t0 = time.monotonic()
        tuning = {'hot-percent': 0, 'min-idle-ms': 0, 'interval-ms': 1, 'slice-us': 1000}
        defaults = {k: r.config_get(f'appassist.{k}')[f'appassist.{k}'] for k in tuning}
        for k, v in tuning.items():
            r.config_set(f'appassist.{k}', v)
        while r.info('appassist')['appassist_cold_items'] < n:
            r.execute_command('APPASSIST.DEMOTE', 1000)
        r.config_set('appassist.demote', 'no')
        log(f'{g.name}: demoted {n} items in {time.monotonic() - t0:.0f} s')
        t0 = time.monotonic()
        for i in range(0, nhot, 5000):
            r.mget([f'{j:x}' for j in range(i, min(nhot, i + 5000))])
        log(f'{g.name}: promoted {nhot} hot items in {time.monotonic() - t0:.0f} s')
        info = r.info('appassist')
        if info.get('appassist_compaction'):
            # Demotion leaves the keyspace fragmented; the module compacts it
            # in the background when a pass is due.  Migrate that steady
            # state: one pass now, synchronously (the command is there for
            # tests and benchmarks), whatever the background did before.
            rss0 = r.info('memory')['used_memory_rss']
            t1 = time.monotonic()
            # The pass's budget (ms) and a reply timeout past it: 5 M items
            # take half a minute under TCG, more on a busy host.
            rc = g.redis(socket_timeout=COMPACT_BUDGET_S + 60)
            moved = rc.execute_command('APPASSIST.COMPACT', COMPACT_BUDGET_S * 1000)
            rc.close()
            log(f'{g.name}: compaction pass {time.monotonic() - t1:.1f} s, {moved} keys '
                f'relocated, used_memory_rss {rss0} -> {r.info("memory")["used_memory_rss"]}')
            info = r.info('appassist')
        if not keep_tuning:
            for k, v in defaults.items():
                r.config_set(f'appassist.{k}', v)
        if lazy:
            r.config_set('appassist.lazy-drop', 'yes')
        mem = r.info('memory')
        log(f'{g.name}: {info["appassist_cold_items"]} cold items, '
            f'{info["appassist_cold_bytes"]} bytes in the arena, used_memory_rss '
            f'{mem["used_memory_rss"]}')
    else:
        log(f'{g.name}: used_memory_rss {r.info("memory")["used_memory_rss"]}')
    r.close()
    return [f'{j:x}' for j in range(nhot)]


def design_prepare(g, args):
    """The design's way: scan every key, delete the cold ones, purge, balloon
    by the RSS that went away.  Returns (seconds, freed bytes, balloon s)."""
    r = g.redis()
    nhot = int(args.items * args.hot)
    t0 = time.monotonic()
    rss0 = r.info('memory')['used_memory_rss']
    cursor = 0
    while True:
        cursor, keys = r.scan(cursor, count=5000)
        cold = [k for k in keys if int(k, 16) >= nhot]
        if cold:
            r.delete(*cold)
        if cursor == 0:
            break
    r.execute_command('MEMORY', 'PURGE')
    rss1 = r.info('memory')['used_memory_rss']
    t_scan = time.monotonic() - t0
    freed = max(0, rss0 - rss1)
    r.close()
    t1 = time.monotonic()
    actual = g.qmp('query-balloon')['actual']
    if freed >= 4 * MiB:
        target = actual - freed
        g.qmp('balloon', value=target)
        last, progress = actual, time.monotonic()
        while time.monotonic() - t1 < 15:
            cur = g.qmp('query-balloon')['actual']
            if cur <= target:
                break
            if cur < last:
                last, progress = cur, time.monotonic()
            elif time.monotonic() - progress > 3:
                break
            time.sleep(0.05)
    return t_scan, freed, time.monotonic() - t1


def migrate(src, dst, config, args, on_switch=None):
    postcopy = config not in ('precopy', 'precopy-fph')
    caps = []
    if postcopy:
        caps.append({'capability': 'postcopy-ram', 'state': True})
    if config.startswith('ours'):
        caps.append({'capability': 'app-assist', 'state': True})
    for g in (src, dst):
        if caps:
            g.qmp('migrate-set-capabilities', capabilities=caps)
    params = {'max-bandwidth': args.bandwidth, 'max-postcopy-bandwidth': args.bandwidth,
              'downtime-limit': 300}
    if config in ('ours-fpr', 'ours-iof'):
        params['app-assist-balloon'] = False
    if config in NOWAIT:
        params['app-assist-balloon-wait'] = 0
    src.qmp('migrate-set-parameters', **params)
    uri = f'tcp:127.0.0.1:{free_port()}'
    dst.qmp('migrate-incoming', uri=uri)
    t0 = time.monotonic()
    src.qmp('migrate', uri=uri)
    switched = False
    while True:
        info = src.qmp('query-migrate')
        st = info.get('status')
        if st == 'completed':
            break
        if st in ('failed', 'cancelled'):
            raise RuntimeError(f'{config}: migration {st}: {info.get("error-desc")}')
        # Like virsh migrate --postcopy-after-precopy: switch once the first
        # pass is done (second dirty sync), or after --precopy-seconds if set.
        first_pass_done = info.get('ram', {}).get('dirty-sync-count', 0) >= 2
        if (postcopy and not switched and st == 'active' and
                (first_pass_done if args.precopy_seconds is None else
                 time.monotonic() - t0 - info.get('setup-time', 0) / 1000 >= args.precopy_seconds)):
            src.qmp('migrate-start-postcopy')
            switched = True
        # The guest runs on the destination (post-copy): tell the load.
        if switched and on_switch and dst.qmp('query-status')['status'] == 'running':
            on_switch()
            on_switch = None
        if time.monotonic() - t0 > args.timeout:
            raise RuntimeError(f'{config}: migration not done after {args.timeout} s')
        time.sleep(0.02)
    t1 = time.monotonic()
    while dst.qmp('query-status')['status'] != 'running':
        time.sleep(0.05)
    if on_switch:
        on_switch()
    return info, switched, t0, t1


def proc_cpu(pid):
    """CPU seconds of process @pid, threads that ended included (the
    migration thread ends with the migration), and of its live threads by
    name ('CPU 0/TCG', ...)."""
    return procstat.cpu_s(pid), procstat.thread_cpu(pid)


def cpu_during(src, dst, before, window_s):
    """Host CPU over the migration, in % of one core: the source's vCPU
    thread, the rest of the source (its migration thread, I/O, main loop),
    and the destination."""
    (s0, st0), (d0, _) = before
    s1, st1 = proc_cpu(src.pid)
    d1, _ = proc_cpu(dst.pid)
    vcpu = sum(v - st0.get(k, 0) for k, v in st1.items() if k.startswith('CPU '))
    pct = 100 / window_s
    return {'source vCPU': round(vcpu * pct), 'source other': round((s1 - s0 - vcpu) * pct),
            'destination': round((d1 - d0) * pct)}


def redis_state(g):
    """What the guest's Redis did besides serving (read at three moments,
    see run_config): CPU of its main thread and of all its threads (the
    rest is jemalloc's background purging, Redis's bio threads and the
    module's drop thread) and the bytes the module cleared as the allocator
    purged them (appassist.zero-freed)."""
    r = g.redis(timeout=30, socket_timeout=30)
    try:
        cpu = r.info('cpu')
        aa = r.info('appassist')     # empty for stock Redis
    finally:
        r.close()
    return {'t': time.monotonic(),
            'cpu_s': cpu['used_cpu_user'] + cpu['used_cpu_sys'],
            'main_s': cpu.get('used_cpu_user_main_thread', 0) + cpu.get('used_cpu_sys_main_thread', 0),
            'zeroed': aa.get('appassist_zero_freed_bytes', 0)}


def state_between(a, b):
    """Figures of redis_state() from a to b."""
    dt = max(b['t'] - a['t'], 1e-9)
    other = (b['cpu_s'] - b['main_s']) - (a['cpu_s'] - a['main_s'])
    return {'s': round(dt, 2),
            'main thread (% of the vCPU)': round(100 * (b['main_s'] - a['main_s']) / dt),
            'other threads (% of the vCPU)': round(100 * other / dt),
            'zero-freed (MiB)': round((b['zeroed'] - a['zeroed']) / MiB, 1)}


def run_config(config, args, logdir):
    # Our module is transparent to clients: every configuration runs it (it
    # holds the cold items in its arena) except the design's, which is stock
    # Redis deleting its cold keys itself.
    module = config not in STOCK_REDIS
    log(f'=== {config}')
    kw = dict(mem=args.mem, module=module, balloon=False, args=guest_args(config, args.trace),
              append=GUEST_APPEND.get(guest_kind(config), ''))
    src = hvlib.Guest(f'{config}-src', logdir, **kw)
    dst = None
    try:
        src.launch()
        src.wait_console(r'HV-READY redis', timeout=180)
        src.run(LINK_PORTS)
        hot = load_data(src, args, module, lazy=config in LAZY, keep_tuning=config in LOAD_TUNED,
                        settings=MODULE_SETTINGS.get(config))
        if module:
            r = src.redis()
            deadline = time.monotonic() + 30
            while r.info('appassist')['appassist_port_connected'] != 1:
                if time.monotonic() > deadline:
                    raise RuntimeError('the module did not open its port')
                time.sleep(0.2)
            r.close()
        pre = None
        if config == 'design':
            pre = design_prepare(src, args)
            log(f'design: scan+delete {pre[0]:.1f} s, RSS freed {pre[1]} bytes, '
                f'balloon {pre[2]:.1f} s')
        dst = hvlib.Guest(f'{config}-dst', logdir, incoming='defer', **kw)
        with thp_disabled(args.dest_thp == 'off'):
            dst.launch()
        st_idle = redis_state(src)
        load = Load([src.redis_port, dst.redis_port], hot)
        load.thread.start()
        time.sleep(1.0)
        t_before = time.monotonic()
        loadavg = round(os.getloadavg()[0], 2)
        t_switch = []

        def on_switch():
            t_switch.append(time.monotonic())
            load.follow()

        st_start = redis_state(src)
        cpu0 = (proc_cpu(src.pid), proc_cpu(dst.pid))
        info, switched, t0, t1 = migrate(src, dst, config, args, on_switch=on_switch)
        cpu = cpu_during(src, dst, cpu0, t1 - t0)
        st_end = redis_state(dst)
        # Two seconds after the migration: the module hands back the arena it
        # kept for the page list there (RESUME), so its cost shows here.
        time.sleep(AFTER_S)
        load.stop.set()
        load.thread.join(10)
        ram = info.get('ram', {})
        row = {
            'config': config,
            'measured': args.started,
            'transferred (MiB)': round(ram.get('transferred', 0) / MiB, 1),
            'total time (ms)': info.get('total-time'),
            'setup time (ms)': info.get('setup-time'),
            'downtime (ms)': info.get('downtime'),
            'switched to post-copy': switched,
            'post-copy requests': ram.get('postcopy-requests', 0),
            'ram': ram,     # query-migrate's whole RAM section, for the JSON
        }
        if pre:
            # The design prepares before the migration starts: count it.
            extra = round(1000 * (pre[0] + pre[2]))
            row['setup time (ms)'] += extra
            row['total time (ms)'] += extra
            row['freed (MiB)'] = round(pre[1] / MiB, 1)
            row['prepare (ms)'] = round(1000 * pre[0])
            row['balloon (ms)'] = round(1000 * pre[2])
        aa = info.get('app-assist')
        if aa:
            row['freed (MiB)'] = round(aa['freed-bytes'] / MiB, 1)
            row['zero pages (MiB)'] = round(aa.get('zeroed-bytes', 0) / MiB, 1)
            row['prepare (ms)'] = aa['prepare-time']
            row['balloon (ms)'] = aa['balloon-time']
            # The applications' own share of prepare (their time_us), the
            # rest is QEMU <-> guest transport and scheduling.
            times = [p['app-time'] for p in aa.get('ports', []) if 'app-time' in p]
            if times:
                row['prepare: app (ms)'] = round(max(times) / 1000)
            row['app-assist'] = aa
            if aa.get('zeroed-bytes'):
                # How long the guest took to clear and unmap the arena after
                # PREPARE replied (the migration was already running).
                r = dst.redis()
                i = r.info('appassist')
                row['arena clear / unmap (ms)'] = (
                    f"{i.get('appassist_last_prepare_clear_us', 0) / 1000:.0f} / "
                    f"{i.get('appassist_last_prepare_unmap_us', 0) / 1000:.0f}")
                row['arena released'] = i.get('appassist_last_prepare_release')
                if i.get('appassist_last_prepare_page_slices'):
                    row['page list: slices'] = i['appassist_last_prepare_page_slices']
                    row['page list: longest slice (ms)'] = round(
                        i['appassist_last_prepare_page_slice_max_us'] / 1000, 1)
                    # the module's whole pagemap reading, all slices
                    row['page list: pagemap (ms)'] = round(
                        i['appassist_last_prepare_page_list_us'] / 1000, 1)
                r.close()
            if 'dropped-pages' in aa:
                row['pages listed (MiB)'] = round(aa['dropped-pages'] * 4096 / MiB, 1)
                row['page list (ms)'] = aa.get('pages-time')
        before = load.figures(t_before - 1.0, t_before)
        during = load.figures(t0, t1)
        row['load before: ops/s'] = before['ops/s']
        row['load during: ops/s'] = during['ops/s']
        row['load during: p50 (ms)'] = during['p50 (ms)']
        row['load during: p99 (ms)'] = during['p99 (ms)']
        row['load during: max (ms)'] = during['max (ms)']
        # attempts that failed (a server gone under a request, a reply cut
        # short): each is a gap the client waited through, then retried
        row['load during: failed'] = during['failed']
        # The set-up (PREPARE, the page list) is in the first half second,
        # and so is its longest wait for Redis's event loop; what else lands
        # there shows too (docs/app-assist.md, "The page list a slice at a
        # time").
        row['load first 0.5 s: max (ms)'] = load.figures(t0, min(t1, t0 + 0.5))['max (ms)']
        # What the migration cost the database in all: the GETs the client
        # would have made over the migration at its rate just before, less
        # those it made.  A shorter migration that serves at a lower rate
        # can still cost fewer.
        row['load lost: GETs'] = round((before['ops/s'] - during['ops/s']) * (t1 - t0))
        after = load.figures(t1, t1 + AFTER_S)
        row['load after: ops/s'] = after['ops/s']
        row['load after: p99 (ms)'] = after['p99 (ms)']
        # GETs per 100 ms from 1 s before the migration to AFTER_S after it,
        # and when the load moved to the destination (its guest running: the
        # 'switch' of the JSON), for the JSON: where the time goes.
        start = t_before - 1.0
        buckets = [0] * int((t1 + AFTER_S - start) / 0.1 + 1)
        for t, _ in list(load.samples):
            if start <= t < t1 + AFTER_S:
                buckets[int((t - start) / 0.1)] += 1
        row['load timeline'] = {'start': round(start - t0, 2), 'per_100ms': buckets,
                                'switch': round(t_switch[0] - t0, 2) if t_switch else None,
                                'end': round(t1 - t0, 2)}
        # The slowest GETs of the window, when they ended (s from its start)
        # and how long they took (ms): which part of the migration makes
        # the tail that p99 reads.
        slow = sorted(((lat, t) for t, lat in list(load.samples) if t0 <= t < t1), reverse=True)
        row['load slowest'] = [(round(t - t0, 3), round(1000 * lat, 1)) for lat, t in slow[:SLOWEST]]
        # What the guest's Redis did besides serving, over the second of
        # load before the migration and over the migration (redis_state)
        row['redis before'] = state_between(st_idle, st_start)
        row['redis during'] = state_between(st_start, st_end)
        row['host load avg'] = loadavg
        # Where the 2 host cores went while the migration ran (% of a core)
        row['host CPU during (% of a core)'] = cpu
        log(f'{config}: {json.dumps({k: v for k, v in row.items() if k not in ("app-assist", "load timeline", "load slowest")})}')
        return row
    finally:
        for g in (dst, src):
            if g:
                g.shutdown()


def goals(name, o, bname, b, cold):
    """The issue's three goals for configuration `name` (row `o`) against the
    baseline `bname` (row `b`), as Markdown lines."""
    def met(ok):
        return 'met' if ok else 'NOT met'
    saved = (b['transferred (MiB)'] - o['transferred (MiB)']) * MiB
    ratio = o['total time (ms)'] / b['total time (ms)']
    assist = (o.get('prepare (ms)') or 0) + (o.get('balloon (ms)') or 0)
    share = assist / o['total time (ms)']
    return [
        f'**Goals, `{name}` against stock post-copy of stock Redis (`{bname}`, no module):**',
        '',
        f'- cold bytes never sent (goal >= 90 %): `{name}` transferred {o["transferred (MiB)"]} '
        f'MiB, the baseline {b["transferred (MiB)"]} MiB: {abs(saved) / MiB:.1f} MiB '
        f'{"less" if saved >= 0 else "more"}, saved = '
        f'{100 * saved / cold:.0f} % of the {cold / MiB:.1f} MiB of cold values -- '
        f'{met(saved >= 0.9 * cold)}.',
        f'- total time (goal <= 0.6x): {o["total time (ms)"]} vs {b["total time (ms)"]} ms = '
        f'{ratio:.2f}x -- {met(ratio <= 0.6)}.',
        f'- assist set-up (goal <= 5 % of total time): prepare {o.get("prepare (ms)")} ms + '
        f'balloon wait {o.get("balloon (ms)")} ms = {assist} ms = {100 * share:.1f} % of '
        f'{o["total time (ms)"]} ms -- {met(share <= 0.05)}.',
        '']


def summary(rows, args):
    """The issue's goals, computed against stock post-copy of stock Redis
    (`postcopy-stock-redis`: the fair baseline, no module), plus the other
    comparisons.  Only from measured rows; a missing row skips its lines."""
    base = {r['config']: r for r in rows if 'transferred (MiB)' in r}
    notes = []
    cold = args.items * (1 - args.hot) * args.size
    o = base.get('ours')
    b = base.get('postcopy-stock-redis')
    # ours-fpr does not balloon: it shows what free-page reporting does alone.
    for name in (c for c in OURS if c != 'ours-fpr'):
        bname = 'postcopy-stock-redis' + guest_kind(name)
        if base.get(name) and base.get(bname):
            notes += goals(name, base[name], bname, base[bname], cold)
    p = base.get('postcopy')
    if p and b:
        notes.append(f'- our module without the assist (`postcopy`) vs stock Redis: transferred '
                     f'{p["transferred (MiB)"]} vs {b["transferred (MiB)"]} MiB, total time '
                     f'{p["total time (ms)"] / b["total time (ms)"]:.2f}x (the module\'s own '
                     'footprint when nothing is dropped).')
    if p and o:
        notes.append(f'- ours vs our module without the assist: transferred {o["transferred (MiB)"]} '
                     f'vs {p["transferred (MiB)"]} MiB, total time '
                     f'{o["total time (ms)"] / p["total time (ms)"]:.2f}x; the module reported '
                     f'{o.get("freed (MiB)")} MiB freed.')
    for name in OURS[1:]:
        f = base.get(name)
        if f and o:
            notes.append(f'- `{name}` vs ours: transferred {f["transferred (MiB)"]} vs '
                         f'{o["transferred (MiB)"]} MiB, set-up {f["setup time (ms)"]} vs '
                         f'{o["setup time (ms)"]} ms (balloon {f.get("balloon (ms)")} vs '
                         f'{o.get("balloon (ms)")} ms), total time {f["total time (ms)"]} vs '
                         f'{o["total time (ms)"]} ms.')
    d = base.get('design')
    if d and o:
        notes.append(f'- the design\'s scan-and-delete took {d.get("prepare (ms)")} ms and freed '
                     f'{d.get("freed (MiB)")} MiB of RSS; ours prepared in {o.get("prepare (ms)")} ms '
                     f'and freed {o.get("freed (MiB)")} MiB.')
    return notes


def write_report(rows, args, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'app-assist.json'), 'w') as f:
        json.dump({'args': vars(args), 'rows': rows}, f, indent=1)
    cols = ['config', 'transferred (MiB)', 'total time (ms)', 'setup time (ms)',
            'prepare (ms)', 'prepare: app (ms)', 'balloon (ms)', 'freed (MiB)', 'zero pages (MiB)',
            'arena clear / unmap (ms)', 'arena released', 'pages listed (MiB)', 'page list (ms)',
            'page list: slices', 'page list: longest slice (ms)', 'downtime (ms)',
            'switched to post-copy', 'post-copy requests', 'load before: ops/s', 'load during: ops/s',
            'load during: p50 (ms)', 'load during: p99 (ms)', 'load during: max (ms)',
            'load first 0.5 s: max (ms)', 'load lost: GETs',
            'load after: ops/s', 'load after: p99 (ms)',
            'host load avg', 'measured']
    lines = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
    for r in rows:
        lines.append('| ' + ' | '.join('' if r.get(c) is None else str(r.get(c))
                                       for c in cols) + ' |')
    notes = summary(rows, args)
    text = [f'# App-assisted post-copy: benchmark ({args.started})',
            '',
            f'Generated by `bench/app-assist.py` ({args.cmdline or "defaults"}, started '
            f'{args.started}'
            + ('; rows of the configurations not run then are kept from earlier runs, the '
               '`measured` column says when' if args.reuse else '') + '): '
            f'{args.mem} TCG guest, {args.items} Redis items of {args.size} bytes, '
            f'{int(100 * args.hot)} % hot, bandwidth {args.bandwidth * 8 / 1e9:.1f} Gbit/s, '
            'post-copy ' + (f'after {args.precopy_seconds} s of pre-copy'
                            if args.precopy_seconds is not None else
                            'after the first pre-copy pass (like virsh --postcopy-after-precopy)') +
            '. Every configuration but `design` and `postcopy-stock-redis*` runs our Redis '
            'module (cold items in its arena, one compaction pass after loading); those run '
            'stock Redis 7.0. One run per '
            'configuration on a shared 2-core machine under TCG (other engineers\' jobs ran '
            'too: the host load average over the last minute when each migration started is '
            'in the table): compare ratios, not absolute times. Load = one host client '
            'GETting hot keys (follows the guest to the destination).', '', *lines, '',
            *notes, '',
            '![transferred](app-assist-transferred.png) ![time](app-assist-time.png)', '']
    with open(os.path.join(out, 'app-assist.md'), 'w') as f:
        f.write('\n'.join(text))
    write_charts(rows, out)


def write_charts(rows, out):
    """app-assist-transferred.png and app-assist-time.png: the bytes sent
    and the total time (set-up stacked) of each measured configuration."""
    plt = charts.pyplot()
    if not plt:
        return
    rows = [r for r in rows if 'transferred (MiB)' in r]
    names = [r['config'] for r in rows]
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(names)), 3.5))
    ax.bar(names, [r['transferred (MiB)'] for r in rows], color='tab:blue')
    ax.set_ylabel('MiB transferred')
    plt.setp(ax.get_xticklabels(), rotation=25, ha='right')
    ax.set_title('Memory transferred')
    charts.save(fig, os.path.join(out, 'app-assist-transferred.png'), dpi=100)
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(names)), 3.5))
    setup = [r['setup time (ms)'] / 1000 for r in rows]
    rest = [(r['total time (ms)'] - r['setup time (ms)']) / 1000 for r in rows]
    ax.bar(names, setup, label='set-up', color='tab:orange')
    ax.bar(names, rest, bottom=setup, label='rest of migration', color='tab:blue')
    ax.set_ylabel('seconds')
    plt.setp(ax.get_xticklabels(), rotation=25, ha='right')
    ax.set_title('Total migration time (set-up stacked)')
    ax.legend()
    charts.save(fig, os.path.join(out, 'app-assist-time.png'), dpi=100)


def parse_args(ap):
    """@ap's arguments, with the command line and the start time that the
    reports name."""
    args = ap.parse_args()
    args.cmdline = ' '.join(sys.argv[1:])
    args.started = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    return args


def load_saved(args, keep=('out', 'report_only')):
    """--report-only: the saved JSON, whose arguments replace @args' (but
    for those in @keep, the ones this run was given)."""
    with open(args.report_only) as f:
        saved = json.load(f)
    for k, v in saved['args'].items():
        if k not in keep:
            setattr(args, k, v)
    return saved


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mem', default='2G')
    ap.add_argument('--items', type=int, default=3_000_000)
    ap.add_argument('--size', type=int, default=100)
    ap.add_argument('--hot', type=float, default=0.3)
    ap.add_argument('--bandwidth', type=int, default=125_000_000, help='bytes/s')
    ap.add_argument('--precopy-seconds', type=float, default=None,
                    help='switch to post-copy after this long (default: after the first pass)')
    ap.add_argument('--timeout', type=float, default=900)
    ap.add_argument('--configs', default=','.join(CONFIGS))
    ap.add_argument('--out', default=os.path.join(TOP, 'docs', 'bench'))
    ap.add_argument('--logdir', default=None)
    ap.add_argument('--trace', default=None, metavar='PATTERN',
                    help="QEMU trace events for every guest, e.g. 'app_assist_*' (timestamped, "
                         'in <logdir>/<config>-src.log)')
    ap.add_argument('--dest-thp', choices=('on', 'off'), default='on',
                    help='off: start every destination QEMU with transparent huge pages '
                         'disabled for its process (prctl PR_SET_THP_DISABLE), to see what '
                         'clearing fresh huge pages there costs the host during the migration')
    ap.add_argument('--report-only', default=None, metavar='JSON',
                    help='rewrite the table and charts from a previous app-assist.json')
    ap.add_argument('--reuse', default=None,
                    help='a previous app-assist.json: keep its rows for configurations not run now')
    ap.add_argument('--repeat', type=int, default=1,
                    help='pooled mode: run the configurations this many times, interleaved '
                         '(every other round in reverse order), and write app-assist-pooled.md '
                         'with means, 95 %% confidence intervals and ratios against --baseline; '
                         'CONFIG@tag runs CONFIG again under another name (an A/A control)')
    ap.add_argument('--baseline', default='postcopy-stock-redis',
                    help='pooled mode: the configuration the ratios are against')
    ap.add_argument('--name', default='app-assist-pooled',
                    help='pooled mode: the report files NAME.md/.json/.png')
    args = parse_args(ap)
    if args.report_only:
        write_report(load_saved(args)['rows'], args, args.out)
        return
    build = os.environ.get('HYBRIDVM_BUILD') or os.path.join(TOP, 'build')
    logdir = args.logdir or os.path.join(build, 'bench', time.strftime('app-assist-%Y%m%d-%H%M%S'))
    log(f'logs in {logdir}')
    if args.repeat > 1:
        labels = args.configs.split(',')
        for label in labels:
            if label.split('@')[0] not in CONFIGS:
                ap.error(f'unknown configuration {label}')
        if args.baseline not in labels:
            ap.error(f'the baseline {args.baseline} is not among --configs')
        runs = []
        for rnd in range(args.repeat):
            for label in (labels if rnd % 2 == 0 else labels[::-1]):
                try:
                    row = run_config(label.split('@')[0], args, os.path.join(logdir, f'{rnd}'))
                except Exception as exc:  # noqa: BLE001 -- a failed run is reported, not pooled
                    log(f'{label} round {rnd}: FAILED: {exc!r}')
                    row = {'failed': str(exc)[:200]}
                row.update(config=label, round=rnd)
                runs.append(row)
                pooled.write_report(runs, args, args.out)
        log(f'report in {args.out}/{args.name}.md')
        return
    rows = []
    for config in args.configs.split(','):
        if config not in CONFIGS:
            ap.error(f'unknown configuration {config}')
        try:
            rows.append(run_config(config, args, logdir))
        except Exception as exc:  # one broken configuration must not hide the others
            log(f'{config}: FAILED: {exc!r}')
            rows.append({'config': f'{config} (failed: {str(exc)[:80]})'})
    if args.reuse:
        with open(args.reuse) as f:
            saved = json.load(f)
        old = saved['rows']
        prev = saved.get('args', {})
        args.reused_from = (f'{prev.get("started", "earlier")} '
                            f'({prev.get("cmdline") or "defaults"})')
        done = {r['config'] for r in rows}
        order = {c: i for i, c in enumerate(CONFIGS)}
        rows = sorted(rows + [r for r in old if r['config'] not in done],
                      key=lambda r: order.get(r['config'], 99))
    args.logdir = logdir
    write_report(rows, args, args.out)
    log(f'report in {args.out}/app-assist.md')


if __name__ == '__main__':
    main()
