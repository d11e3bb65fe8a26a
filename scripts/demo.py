#!/usr/bin/env python3
"""The main job, end to end on this machine.

Boots the Redis guest (our module loaded, the app-assist port attached) under
our QEMU, loads it with items of which 70 % are cold, and migrates it to a
second QEMU process with post-copy over a link capped at 1 Gbit/s, twice:
stock, then app-assisted (the module drops its cold set and leaves what it
freed as zero pages; QEMU balloons whatever the module reports it did not
clear, then migrates).  Checks the items on the destination, prints both
migrations' figures (a row per figure, a column per migration) and writes
them as a chart, demo.png, next to the logs.

--libvirt does the same through two private libvirtd instances and
`virsh migrate --live --postcopy --postcopy-after-precopy`.  Its table keeps
libvirt's figures (`virsh domjobinfo --completed`: its Time elapsed starts at
libvirt's Begin phase, before the destination QEMU exists) apart from QEMU's
own (total time: the source QEMU's migration, from its MIGRATION events) and
from `virsh migrate`'s wall time (which also covers the source's clean-up);
docs/libvirt.rst says where the time between them goes.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
import hvlib  # noqa: E402

PORT_ARGS = ['-device', 'virtio-serial-pci,id=aaserial,bus=pci.0,addr=0x1d',
             '-chardev', 'app-assist,id=aa0',
             '-device', 'virtserialport,bus=aaserial.0,chardev=aa0,name=org.qemu.app-assist.0']


# Figures whose ratio assisted/stock means something (less is better for each
# but the Redis throughput, where more is).
RATIO_FIGURES = ('total time (ms)', 'transferred (MiB)',
                 'Redis ops/s during migration', 'Redis p99 during (ms)',
                 'virsh migrate (s)', 'time elapsed (ms)', 'data processed (MiB)')
# Figures the chart shows, in this order, when both runs have them as numbers.
CHART_FIGURES = ('total time (ms)', 'transferred (MiB)', 'setup time (ms)', 'downtime (ms)',
                 'post-copy page requests', 'Redis ops/s during migration', 'Redis p99 during (ms)',
                 'virsh migrate (s)', 'time elapsed (ms)', 'data processed (MiB)')


def number(value):
    """value as a float if it is a figure, else None ('-', 'completed', ...)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def table(runs):
    """runs: [(name, {figure: value})].  One row per figure (first-seen order),
    one column per run, and a last column with the ratio last run / first run
    for RATIO_FIGURES.  About 70 characters wide for the demo's figures."""
    names = [n for n, _ in runs]
    figures = list(dict.fromkeys(f for _, r in runs for f in r))
    head = ['figure', *names, f'{names[-1].split()[0]} / {names[0].split()[0]}']
    body = []
    for f in figures:
        values = [r.get(f, '-') for _, r in runs]
        first, last = number(values[0]), number(values[-1])
        ratio = f'{last / first:.2f}' if f in RATIO_FIGURES and first and last is not None else ''
        body.append([f, *(str(v) for v in values), ratio])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells):
        # Figures left-aligned, values right-aligned.
        return '  '.join([cells[0].ljust(widths[0])] +
                         [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]).rstrip()
    return '\n'.join([line(head), '  '.join('-' * w for w in widths)] + [line(r) for r in body])


def chart_figures(runs):
    """The CHART_FIGURES every run has as a number, in order."""
    return [f for f in CHART_FIGURES if all(number(r.get(f)) is not None for _, r in runs)]


def chart(runs, path, title):
    """Write the CHART_FIGURES of runs ([(name, {figure: value})]) as a PNG, one
    panel per figure with a bar per run.  Returns path, or None (and says why)
    when there is nothing to draw or matplotlib is missing."""
    figures = chart_figures(runs)
    if not figures:
        print('demo: no figure to chart', file=sys.stderr)
        return None
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('demo: matplotlib missing (scripts/requirements.txt installs it): no chart', file=sys.stderr)
        return None
    names = [n for n, _ in runs]
    fig, axes = plt.subplots(1, len(figures), figsize=(2.4 * len(figures), 3.4), squeeze=False)
    for ax, f in zip(axes[0], figures):
        bars = ax.bar(range(len(runs)), [number(r[f]) for _, r in runs],
                      color=['tab:gray', 'tab:blue'][:len(runs)])
        ax.bar_label(bars, fmt='%g', fontsize=8)
        ax.set_xticks(range(len(runs)), [n.split()[0] for n in names], fontsize=8)
        ax.set_title(f, fontsize=9)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_qemu(args, mode, log_dir, data):
    assisted = mode == 'app-assisted'
    src = hvlib.Guest(f'{mode}-src', log_dir, mem=args.mem, module=True, args=PORT_ARGS)
    dst = hvlib.Guest(f'{mode}-dst', log_dir, mem=args.mem, module=True, args=PORT_ARGS,
                      incoming='defer')
    try:
        src.launch()
        src.wait_console(r'HV-READY redis', timeout=180)
        dst.launch()
        r = src.redis()
        hot, cold = hvlib.load_hot_cold(r, data, args.hot)
        r.close()
        # The database must not suffer: a host client reads hot keys all along,
        # following the guest to the destination
        load = hvlib.RedisLoad([src.redis_port, dst.redis_port], [k for k, _ in hot])
        load.thread.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        try:
            res = hvlib.migrate_postcopy(src, dst, precopy_seconds=args.precopy,
                                         bandwidth=args.bandwidth,
                                         capabilities=['app-assist'] if assisted else [],
                                         timeout=900, on_switch=load.follow)
            t1 = time.monotonic()
        finally:
            load.stop.set()
            load.thread.join(10)
        wrong_hot, wrong_cold = hvlib.count_wrong(dst.redis(), hot, cold, cold_dropped=assisted)
        balloon = dst.qmp('query-balloon')['actual']
        ok = (res.status == 'completed' and not wrong_hot and not wrong_cold
              and balloon == hvlib.vm.parse_mem(args.mem))
        return qemu_figures(res, assisted, wrong_hot, wrong_cold, load.figures(t0, t1)), ok
    finally:
        dst.shutdown()
        src.shutdown()


def qemu_figures(res, assisted, wrong_hot, wrong_cold, load=None):
    """One migration's figures ({name (unit): value}) from its hvlib.MigrationResult
    and the host client's figures over the migration (hvlib.RedisLoad.figures)."""
    aa = res.info.get('app-assist', {})
    load = load or {}
    return {**res.row(),
            'Redis ops/s during migration': load.get('ops/s', '-'),
            'Redis p99 during (ms)': load.get('p99 (ms)') or '-',
            'Redis requests failed during': load.get('failed', '-'),
            'freed by apps (MiB)': round(aa.get('freed-bytes', 0) / 2**20, 1) if assisted else '-',
            'of it zero pages (MiB)': round(aa.get('zeroed-bytes', 0) / 2**20, 1) if assisted else '-',
            'prepare (ms)': aa.get('prepare-time', '-') if assisted else '-',
            'balloon (ms)': aa.get('balloon-time', '-') if assisted else '-',
            'hot items wrong': wrong_hot, 'cold items wrong': wrong_cold}


def run_libvirt(args, mode, log_dir, data):
    from hvlib.libvirt import LibvirtPair, MonitorEvents, domain_xml
    assisted = mode == 'app-assisted'
    qargs = PORT_ARGS + (['-global', 'migration.x-app-assist=on'] if assisted else [])
    mem_mib = hvlib.vm.parse_mem(args.mem) // 2**20
    with LibvirtPair(log_dir=os.path.join(log_dir, mode)) as pair:
        # Both daemons know our emulator before anything is timed, as on hosts that
        # ran it before: else the destination probes it inside the migration (1-4 s here).
        probed = pair.prime_emulator(pair_paths().binary('qemu-system-x86_64'))
        print(f'demo: libvirt probed the emulator in {probed["src"]:.1f} s (source; the '
              f'destination took its cache entry: {probed["dst"]:.1f} s)', flush=True)
        ports = {}
        for side in ('src', 'dst'):
            ports[side] = hvlib.free_port()
            with open(os.path.join(pair.root, f'{side}.xml'), 'w') as f:
                f.write(domain_xml('hvdemo', pair_paths(), mem_mib=mem_mib, redis_port=ports[side],
                                   console_log=os.path.join(log_dir, f'{mode}-{side}-console.log'),
                                   append='hv.redis=1 hv.module=1', qemu_args=qargs))
        pair.src.virsh('define', os.path.join(pair.root, 'src.xml'))
        pair.src.virsh('start', 'hvdemo')
        r = hvlib.redis_client(ports['src'], timeout=180, name='src')
        hot, cold = hvlib.load_hot_cold(r, data, args.hot)
        r.close()
        mibps = str(max(1, args.bandwidth // 2**20))  # virsh takes MiB/s
        switch = [] if args.virsh_switch == 'timed' else ['--postcopy-after-precopy']
        with MonitorEvents(pair.src, 'hvdemo') as events:
            time.sleep(0.3)  # virsh qemu-monitor-event has registered
            t = time.monotonic()
            proc = pair.src.virsh_background(
                'migrate', '--live', '--postcopy', *switch,
                '--bandwidth', mibps, '--postcopy-bandwidth', mibps,
                '--xml', os.path.join(pair.root, 'dst.xml'), 'hvdemo', pair.dst.uri,
                '--migrateuri', f'tcp://127.0.0.1:{hvlib.free_port()}',
                '--listen-address', '127.0.0.1')
            if args.virsh_switch == 'timed':
                switch_after(pair.src, events, proc, args.precopy)
            try:
                _, err = proc.communicate(timeout=900)
            except BaseException:
                proc.kill()
                proc.communicate()
                raise
            wall = time.monotonic() - t
            if proc.returncode != 0:
                raise hvlib.GuestError(f'virsh migrate failed: {err.strip()}')
            events.wait('MIGRATION', {'status': 'completed'}, timeout=10)
        with open(os.path.join(log_dir, f'{mode}-source-events.json'), 'w') as f:
            json.dump(events.events, f, indent=1)
        job = completed_job(pair)

        wrong_hot, wrong_cold = hvlib.count_wrong(hvlib.redis_client(ports['dst'], name='dst'), hot, cold,
                                                  cold_dropped=assisted)
        aa = json.loads(pair.dst.virsh('qemu-monitor-command', 'hvdemo',
                                       '{"execute": "query-migrate"}').stdout)['return'].get('app-assist', {})
        return (libvirt_figures(wall, job, aa, wrong_hot, wrong_cold, events=events.events),
                not wrong_hot and not wrong_cold)


def completed_job(pair, timeout=5):
    """`virsh domjobinfo --completed` of the migration: the destination's, else
    the source's.  After a post-copy, `virsh migrate` may return before the
    destination's libvirtd has handled the end of the migration (until then it
    has no completed job to show), and libvirt 9.0 may keep the figures on the
    source only."""
    deadline = time.monotonic() + timeout
    while True:
        job = pair.dst.virsh('domjobinfo', 'hvdemo', '--completed').stdout
        if 'Time elapsed' in job:
            return job
        if time.monotonic() > deadline:
            return pair.src.virsh('domjobinfo', 'hvdemo', '--completed', check=False).stdout
        time.sleep(0.2)


def switch_after(host, events, proc, seconds):
    """`virsh migrate-postcopy` once the source has been in pre-copy for `seconds`
    (as the QMP demo does), unless the migration is over by then."""
    if events.wait('MIGRATION', {'status': 'active'}, timeout=120) is None:
        return
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        if proc.poll() is not None or events.first('MIGRATION', {'status': 'device'}) is not None:
            return
        time.sleep(0.02)
    host.virsh('migrate-postcopy', 'hvdemo', check=False)


def qemu_event_figures(events):
    """From the source QEMU's events ([(time, name, data)], hvlib.libvirt.MonitorEvents):
    its total time (MIGRATION setup -> completed, which is what query-migrate's
    total-time measures; libvirt stops that QEMU as soon as it completes, so
    it cannot be asked) and when it switched to post-copy ('no' if pre-copy
    converged first), in ms from the start."""
    def first(status):
        return next((t for t, n, d in events or ()
                     if n == 'MIGRATION' and isinstance(d, dict) and d.get('status') == status), None)
    setup, done, post = first('setup'), first('completed'), first('postcopy-active')
    return {'total time (ms)': round((done - setup) * 1000) if setup and done else '-',
            'switched to post-copy at (ms)': (round((post - setup) * 1000) if setup and post
                                              else 'no' if setup and done else '-')}


def libvirt_figures(wall, job, aa, wrong_hot, wrong_cold, events=None):
    """One virsh migration's figures ({name (unit): value}): its wall time in s,
    `virsh domjobinfo --completed`'s text `job` (libvirt's view: its Time
    elapsed runs from the job's start on the source, so it includes libvirt's
    Begin and Prepare phases, the destination QEMU's start among them), the
    source QEMU's events `events` (qemu_event_figures: the migration's own
    time), the destination's app-assist status `aa` (from query-migrate)."""
    return {'virsh migrate (s)': round(wall, 1),
            'time elapsed (ms)': virsh_figure(job, 'Time elapsed'),
            **qemu_event_figures(events),
            'setup time (ms)': virsh_figure(job, 'Setup time'),
            'downtime (ms)': virsh_figure(job, 'Total downtime'),
            'data processed (MiB)': virsh_figure(job, 'Data processed'),
            'post-copy page requests': virsh_figure(job, 'Postcopy requests', unitless=True),
            'app-assist on destination': aa.get('status', '-'),
            'hot items wrong': wrong_hot, 'cold items wrong': wrong_cold}


def virsh_figure(job, name, unitless=False):
    """A figure of `virsh domjobinfo` ("Data processed: 1.234 GiB") as a number of
    ms (times) or MiB (sizes, which virsh scales to their magnitude), or as the
    integer it is with `unitless` ("Postcopy requests: 12"); '-' when virsh did
    not report it, the text as is when its unit is unknown."""
    if unitless:
        m = re.search(rf'^{name}:\s+(\d+)\s*$', job, re.M)
        return int(m.group(1)) if m else '-'
    m = re.search(rf'^{name}:\s+([0-9.]+)\s*(\S+)', job, re.M)
    if not m:
        return '-'
    value, unit = float(m.group(1)), m.group(2)
    if unit == 'ms':
        return int(value)
    scale = {'B': 2**-20, 'KiB': 2**-10, 'MiB': 1, 'GiB': 2**10, 'TiB': 2**20}.get(unit)
    return round(value * scale, 1) if scale else f'{m.group(1)} {unit}'


def shown(path):
    """path as the demo prints it: relative when it is under the current directory."""
    rel = os.path.relpath(path)
    return path if rel.startswith('..') else rel


_paths = None


def pair_paths():
    global _paths
    if _paths is None:
        _paths = hvlib.BuildPaths()
    return _paths


# What a shape costs, from measured runs (5 M items of 100 B: stock Redis
# 962 MB RSS, with our module 1010 MB, in a 3 GiB guest): per item its value
# and about 100 bytes of keys and structures, a quarter more while loading and
# demoting, and the guest's kernel, Redis and module besides.  The demo holds
# every item in this process too (key, value, tuple: about 160 bytes over the
# value) to check them on the destination.
GUEST_BASE = 256 << 20
GUEST_PER_ITEM = 100
HOST_PER_ITEM = 160
HOST_SPARE = 1 << 30
UNITS = {'': 1 << 20, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}     # QEMU's -m: MiB by default


def mem_bytes(text):
    m = re.fullmatch(r'(\d+)([MGT]?)(?:i?B)?', text.strip(), re.I)
    if not m:
        raise ValueError(f'--mem {text!r}: expected a size such as 1G or 3072M')
    return int(m.group(1)) * UNITS[m.group(2).upper()]


def mem_available():
    with open('/proc/meminfo') as f:
        for line in f:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) * 1024
    return None


def shape_error(args, available):
    """Why this machine cannot run the shape (a sentence), or None."""
    if args.items < 1 or not 0 < args.hot <= 1 or not 1 <= args.value_size <= 1 << 20 \
            or args.bandwidth < 1 or args.precopy < 0:
        return ('--items must be at least 1, --hot in (0, 1], --value-size 1 to 1048576, '
                '--bandwidth positive and --precopy not negative')
    try:
        mem = mem_bytes(args.mem)
    except ValueError as e:
        return str(e)
    gib = 1 << 30
    guest_need = GUEST_BASE + 5 * args.items * (args.value_size + GUEST_PER_ITEM) // 4
    if guest_need > mem:
        return (f'{args.items} items of {args.value_size} B need about {guest_need / gib:.1f} GiB '
                f'of guest RAM; --mem {args.mem} is {mem / gib:.1f} GiB: give --mem '
                f'{-(-guest_need // gib)}G or more, or fewer items')
    host_need = 2 * mem + args.items * (args.value_size + HOST_PER_ITEM) + HOST_SPARE
    if available is not None and host_need > available:
        per = 2 * (5 * (args.value_size + GUEST_PER_ITEM) // 4) + args.value_size + HOST_PER_ITEM
        most = max(0, (available - HOST_SPARE - 2 * GUEST_BASE) // per)
        return (f'two guests of {args.mem} and the demo\'s copy of the items need about '
                f'{host_need / gib:.1f} GiB; this host has {available / gib:.1f} GiB available '
                f'(the largest shape that fits: about {most} items of {args.value_size} B, '
                'with --mem just large enough for them)')
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mem', default='1G', help='guest RAM (default 1G)')
    ap.add_argument('--items', type=int, default=200000, help='Redis items (default 200000)')
    ap.add_argument('--value-size', type=int, default=100, help='bytes per value (default 100, as in the design)')
    ap.add_argument('--hot', type=float, default=0.3, help='hot fraction of the items (default 0.3)')
    ap.add_argument('--bandwidth', type=int, default=125_000_000, help='migration cap in bytes/s (1 Gbit/s)')
    ap.add_argument('--precopy', type=float, default=0.5, help='seconds of pre-copy before post-copy')
    ap.add_argument('--libvirt', action='store_true', help='migrate through libvirtd and virsh')
    ap.add_argument('--virsh-switch', choices=('after-precopy', 'timed'), default='after-precopy',
                    help='with --libvirt: switch to post-copy with --postcopy-after-precopy (after '
                         "the first pass; the default), or 'timed': `virsh migrate-postcopy` "
                         'after --precopy seconds, as without --libvirt')
    ap.add_argument('--log-dir', default=None)
    args = ap.parse_args()
    why = shape_error(args, mem_available())
    if why:
        ap.error(why)

    paths = pair_paths()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='demo-', dir=paths.build)
    os.makedirs(log_dir, exist_ok=True)
    print(f'demo: guest {args.mem}, {args.items} items of {args.value_size} B, {args.hot:.0%} hot, '
          f'link {args.bandwidth * 8 / 1e9:g} Gbit/s{", through libvirt" if args.libvirt else ""}; '
          f'logs in {shown(log_dir)}', flush=True)
    data = hvlib.make_items(args.items, args.value_size)
    runs, ok = [], True
    for mode in ('stock', 'app-assisted'):
        t = time.monotonic()
        row, good = (run_libvirt if args.libvirt else run_qemu)(args, mode, log_dir, data)
        runs.append((f'{mode} (virsh)' if args.libvirt else f'{mode} post-copy', row))
        ok = ok and good
        print(f'demo: {mode} run done in {time.monotonic() - t:.0f} s', flush=True)
    print()
    print(table(runs))
    print()
    png = chart(runs, os.path.join(log_dir, 'demo.png'),
                f'guest {args.mem}, {args.items} items of {args.value_size} B, {args.hot:.0%} hot, '
                f'link {args.bandwidth * 8 / 1e9:g} Gbit/s{", through libvirt" if args.libvirt else ""}')
    if png:
        print(f'demo: chart in {shown(png)}')
    if not ok:
        print('demo: FAILED (see the table and the logs)', file=sys.stderr)
        return 1
    print('demo: hot items intact on the destination; cold items dropped only with app-assist')
    return 0


if __name__ == '__main__':
    sys.exit(main())
