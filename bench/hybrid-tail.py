#!/usr/bin/env python3
"""The tail of async 4 KiB random writes at QD32 (issue 40, target 2).

One qemu-storage-daemon per node (nothing shared between them: not the main
loop, not the thread pool), each exporting its node over an NBD unix
socket; fio's nbd engine writes 4 KiB at random at QD32 over the whole
node.  The nodes:

  raw-tmpfs        raw over a file on tmpfs: the baseline of the goal
  raw-tmpfs-aa     the same again, its own copy and daemon: the A/A control
  hybrid-async     hybrid raw=on, 64 KiB blocks, mode=async, its persistent
                   tier a raw file on tmpfs (the issue's setup)
  hybrid-before    (--before QSD) the same node in another build of
                   qemu-storage-daemon, e.g. the one before a change
  hybrid-disk      (--disk) hybrid-async with its tier a raw file on the
                   disk under build/ (page cache)

Rounds are interleaved: each runs every node once, in an order rotated from
round to round.  Per node: mean p50, p99 and IOPS with Student t intervals;
against raw-tmpfs, ratios of means with percentile bootstrap 95 % intervals
(bench/pooled_stats.py), read against the goal (p99 at most 1.5x raw-tmpfs)
only when the whole interval says so, beside the A/A row.

The profile of each hybrid run comes from the daemon itself: trace events
hybrid_dirty_waited (a write waited at dirty-limit, and how long),
hybrid_busy_waited (a write waited for its block's write-back) and
hybrid_writeback_burst (the flusher's watermarks), written to a file per
daemon, and query-hybrid's counters (bytes written back per byte written).

Usage: bench/hybrid-tail.py [--rounds 5] [--runtime 12] [--size 1G]
                            [--before PATH] [--disk] [--notes FILE]
                            [--out docs/bench]
       bench/hybrid-tail.py --report-only docs/bench/hybrid-tail.json [...]
Binaries from $HYBRIDVM_BUILD/bin (default <repo>/build/bin).  Writes
docs/bench/hybrid-tail.md, .json and .png.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402
import charts   # noqa: E402
from sizes import parse_size   # noqa: E402
from saved_runs import add_report_args, load_saved   # noqa: E402
from pooled_stats import geo_mean_ci, mean, mean_ci, ratio_ci, rotated, verdict   # noqa: E402

MiB = 1024 * 1024
TRACE_EVENTS = ('hybrid_dirty_waited', 'hybrid_busy_waited',
                'hybrid_writeback_burst')
DIRTY_WAITED = re.compile(r'hybrid_dirty_waited s \S+ waited (\d+) ns')
BUSY_WAITED = re.compile(r'hybrid_busy_waited s \S+ block \d+ waited (\d+) ns')
BURST_ON = re.compile(r'hybrid_writeback_burst s \S+ burst 1 ')

# (metric, node, baseline, goal)
RATIOS = [
    ('p99_us', 'hybrid-async', 'raw-tmpfs', ('<=', 1.5)),
    ('p99_us', 'raw-tmpfs-aa', 'raw-tmpfs', None),
    ('p99_us', 'hybrid-before', 'raw-tmpfs', None),
    ('p99_us', 'hybrid-disk', 'raw-tmpfs', None),
    ('p99_us', 'hybrid-async', 'hybrid-before', None),
    ('p50_us', 'hybrid-async', 'raw-tmpfs', None),
    ('p50_us', 'raw-tmpfs-aa', 'raw-tmpfs', None),
    ('iops', 'hybrid-async', 'raw-tmpfs', ('>=', 1.0)),
    ('iops', 'raw-tmpfs-aa', 'raw-tmpfs', None),
    ('iops', 'hybrid-before', 'raw-tmpfs', None),
    ('iops', 'hybrid-async', 'hybrid-before', None),
    ('iops', 'hybrid-disk', 'raw-tmpfs', None),
]


class Node:
    """One node in a daemon of its own."""

    def __init__(self, name, image, hybrid, prog=None):
        self.name, self.image, self.hybrid = name, image, hybrid
        self.prog = prog or H.binary('qemu-storage-daemon')
        self.tmp = H.TempDir()
        self.sock = self.tmp('nbd.sock')
        self.trace = self.tmp('trace.log')
        self.trace_pos = 0
        self.counters = None

    def start(self):
        args = ['--blockdev', f'driver=file,node-name=f,filename={self.image}']
        if self.hybrid:
            with open(self.tmp('events'), 'w') as f:
                f.write('\n'.join(TRACE_EVENTS) + '\n')
            args = ['--trace', f'events={self.tmp("events")},file={self.trace}'] + \
                args + ['--blockdev', 'driver=hybrid,node-name=n,raw=on,'
                        'block-size=65536,mode=async,file=f']
        else:
            args += ['--blockdev', 'driver=raw,node-name=n,file=f']
        args += ['--nbd-server', f'addr.type=unix,addr.path={self.sock}',
                 '--export', 'type=nbd,id=e,node-name=n,name=n,writable=on']
        # hybridlib starts the daemon it names; this one may be another build
        binary = H.binary
        H.binary = lambda name: self.prog if name == 'qemu-storage-daemon' \
            else binary(name)
        try:
            self.qsd = H.StorageDaemon(self.tmp, *args)
        finally:
            H.binary = binary
        if self.hybrid:
            info = self.qsd.wait_restored('n', timeout=600)
            if not info[0]['restore-done']:
                raise TimeoutError(f'{self.name}: restore did not finish')
            self.counters = self.hybrid_counters()

    def stop(self):
        self.qsd.kill()
        self.tmp.cleanup()

    def hybrid_counters(self):
        i = self.qsd.cmd('query-hybrid', **{'node-name': 'n'})[0]
        return {'flushed': i['flushed-bytes'], 'writes': i['writes-ram'],
                'dirty': i['dirty-bytes'], 'limit': i['dirty-limit']}

    def profile(self):
        """What the trace and the counters say about the run just done."""
        with open(self.trace) as f:
            f.seek(self.trace_pos)
            text = f.read()
            self.trace_pos = f.tell()
        dirty = [int(x) / 1e6 for x in DIRTY_WAITED.findall(text)]
        busy = [int(x) / 1e6 for x in BUSY_WAITED.findall(text)]
        old, new = self.counters, self.hybrid_counters()
        self.counters = new
        writes = new['writes'] - old['writes']
        return {'writes': writes,
                'dirty_waits': len(dirty), 'dirty_wait_ms': round(sum(dirty), 1),
                'dirty_wait_max_ms': round(max(dirty, default=0), 1),
                'busy_waits': len(busy), 'busy_wait_ms': round(sum(busy), 1),
                'busy_wait_max_ms': round(max(busy, default=0), 1),
                'bursts': len(BURST_ON.findall(text)),
                'written_back_per_written': round(
                    (new['flushed'] - old['flushed']) / max(1, writes * 4096), 2),
                'dirty_at_end': new['dirty'], 'dirty_limit': new['limit']}


def fio(node, args):
    uri = f'nbd+unix:///n?socket={node.sock}'
    text = subprocess.run(
        ['fio', '--name=job', '--ioengine=nbd', f'--uri={uri}',
         '--rw=randwrite', '--bs=4k', f'--iodepth={args.qd}', '--numjobs=1',
         f'--size={args.size}', f'--runtime={args.runtime}', '--time_based',
         '--ramp_time=1', '--output-format=json', '--randrepeat=0',
         '--norandommap'], check=True, capture_output=True, text=True).stdout
    # fio's nbd engine prints "fio: connected to NBD server" first
    out = json.loads(text[text.find('{'):])
    job = out['jobs'][0]
    if job['error']:
        raise RuntimeError(f'fio failed: {text[:2000]}')
    w = job['write']
    pct = w['clat_ns']['percentile']
    return {'iops': round(w['iops']),
            'p50_us': round(pct['50.000000'] / 1000, 1),
            'p99_us': round(pct['99.000000'] / 1000, 1),
            'p99.9_us': round(pct['99.900000'] / 1000, 1),
            'max_us': round(w['clat_ns']['max'] / 1000, 1)}


def make_images(args, names):
    shm = tempfile.mkdtemp(prefix='hybrid-tail-', dir='/dev/shm')
    disk = tempfile.mkdtemp(prefix='hybrid-tail-', dir=args.disk_dir)
    src = os.path.join(shm, 'src.raw')
    size = parse_size(args.size)
    with open(src, 'wb') as f:
        left = size
        while left:
            n = min(left, 64 * MiB)
            f.write(os.urandom(n))
            left -= n
    images = {}
    for n in names:
        images[n] = os.path.join(disk if n == 'hybrid-disk' else shm, n + '.raw')
        shutil.copyfile(src, images[n])
    os.unlink(src)
    return images, (shm, disk)


def run(args):
    names = ['raw-tmpfs', 'raw-tmpfs-aa', 'hybrid-async']
    if args.before:
        names.append('hybrid-before')
    if args.disk:
        names.append('hybrid-disk')
    images, dirs = make_images(args, names)
    nodes = {n: Node(n, images[n], n.startswith('hybrid'),
                     args.before if n == 'hybrid-before' else None)
             for n in names}
    runs = []
    try:
        for n in names:
            nodes[n].start()
        for rnd in range(args.rounds):
            for n in rotated(names, rnd):
                r = fio(nodes[n], args)
                r.update(round=rnd, node=n, load=round(os.getloadavg()[0], 2))
                if nodes[n].hybrid:
                    r['profile'] = nodes[n].profile()
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for n in nodes.values():
            if hasattr(n, 'qsd'):
                n.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return names, runs


def summarize(names, runs):
    per = {n: [r for r in runs if r['node'] == n] for n in names}
    nodes = {}
    for n, rs in per.items():
        nodes[n] = {}
        for k in ('p50_us', 'p99_us', 'iops', 'p99.9_us'):
            m, h = mean_ci([r[k] for r in rs])
            nodes[n][k] = {'mean': m, 'ci': h}
        if rs and 'profile' in rs[0]:
            pr = [r['profile'] for r in rs]
            writes = sum(p['writes'] for p in pr)
            waits = sum(p['dirty_waits'] for p in pr)
            nodes[n]['profile'] = {
                'writes': writes, 'dirty_waits': waits,
                'dirty_wait_frac': waits / max(1, writes),
                'dirty_wait_ms': round(sum(p['dirty_wait_ms'] for p in pr), 1),
                'dirty_wait_max_ms': max(p['dirty_wait_max_ms'] for p in pr),
                'busy_waits': sum(p['busy_waits'] for p in pr),
                'busy_wait_ms': round(sum(p['busy_wait_ms'] for p in pr), 1),
                'busy_wait_max_ms': max(p['busy_wait_max_ms'] for p in pr),
                'bursts': sum(p['bursts'] for p in pr),
                'written_back_per_written': round(mean(
                    [p['written_back_per_written'] for p in pr]), 2)}
    ratios = []
    for metric, a, b, goal in RATIOS:
        if a not in per or b not in per:
            continue
        p, lo, hi = ratio_ci([r[metric] for r in per[a]],
                             [r[metric] for r in per[b]])
        # Paired by round: the two ran within a minute of each other, so
        # the load of the host that round falls on both
        by_round = {r['round']: r[metric] for r in per[b]}
        gm, glo, ghi = geo_mean_ci([r[metric] / by_round[r['round']]
                                    for r in per[a]])
        ratios.append({'metric': metric, 'node': a, 'baseline': b,
                       'ratio': p, 'lo': lo, 'hi': hi, 'goal': goal,
                       'verdict': verdict(lo, hi, goal) if goal else
                       ('A/A control' if a.endswith('-aa') else '-'),
                       'paired': gm, 'paired_lo': glo, 'paired_hi': ghi,
                       'paired_verdict': verdict(glo, ghi, goal) if goal
                       else '-'})
    return {'nodes': nodes, 'ratios': ratios}


def report(args, names, runs, summary):
    out = args.out
    os.makedirs(out, exist_ok=True)
    res = {'args': {k: v for k, v in vars(args).items()
                    if k not in ('out', 'notes', 'report_only')},
           'runs': runs, **summary}
    with open(os.path.join(out, 'hybrid-tail.json'), 'w') as f:
        json.dump(res, f, indent=1)
    loads = [r['load'] for r in runs]
    lines = [f'# hybrid: the async 4 KiB random-write tail at QD{args.qd} '
             f'({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})', '',
             f'Measured by `bench/hybrid-tail.py --rounds {args.rounds} '
             f'--runtime {args.runtime}{" --before QSD" if args.before else ""}'
             f'{" --disk" if args.disk else ""}`: one qemu-storage-daemon '
             f'per node, NBD unix socket, fio nbd engine, 4 KiB random '
             f'writes at QD{args.qd} over {args.size} images of random data, '
             f'{args.runtime} s per run (+1 s ramp).  {args.rounds} rounds, '
             f'each running every node once in an order rotated from round '
             f'to round.  Hybrid: `raw=on,block-size=65536,mode=async`, '
             f'default dirty-limit (256 MiB), its persistent tier a raw file '
             f'on tmpfs (hybrid-disk: on the disk under build/, page cache).  '
             f'2 shared cores; 1-minute load average {min(loads):.1f} to '
             f'{max(loads):.1f} during the runs (other users of the host).',
             '', 'Per node, the mean of the rounds and its 95 % interval '
             '(Student t); latencies are fio completion latencies in µs.', '',
             '| node | IOPS | p50 µs | p99 µs | p99.9 µs |',
             '|---|---:|---:|---:|---:|']
    for n in names:
        s = summary['nodes'][n]
        lines.append(f'| {n} | ' + ' | '.join(
            f'{s[k]["mean"]:.0f} ± {s[k]["ci"]:.0f}'
            for k in ('iops', 'p50_us', 'p99_us', 'p99.9_us')) + ' |')
    lines += ['', 'Ratios: of the means, with a percentile bootstrap 95 % '
              'interval (the rounds resampled independently); and paired by '
              'round, the geometric mean of the per-round ratios with its '
              'Student t 95 % interval (the load of each round falls on both '
              'sides).  A goal is met or missed only when the whole interval '
              'says so.', '',
              '| metric | node / baseline | ratio of means [95 % CI] | '
              'verdict | paired [95 % CI] | verdict | goal |',
              '|---|---|---:|---|---:|---|---|']
    for r in summary['ratios']:
        goal = f'{r["goal"][0]} {r["goal"][1]}' if r['goal'] else '-'
        lines.append(f'| {r["metric"]} | {r["node"]} / {r["baseline"]} | '
                     f'{r["ratio"]:.2f} [{r["lo"]:.2f}, {r["hi"]:.2f}] | '
                     f'{r["verdict"]} | {r["paired"]:.2f} '
                     f'[{r["paired_lo"]:.2f}, {r["paired_hi"]:.2f}] | '
                     f'{r["paired_verdict"]} | {goal} |')
    lines += ['', '## Where a hybrid write waited', '',
              'Summed over the rounds, from the daemon\'s trace events and '
              'query-hybrid (written back per written: bytes the flusher '
              'wrote to the persistent tier per byte the guest wrote).', '',
              '| node | writes | waited at dirty-limit | their total / max wait '
              '| waited for a write-back | total / max | bursts | written '
              'back per written |', '|---|---:|---:|---:|---:|---:|---:|---:|']
    for n in names:
        p = summary['nodes'][n].get('profile')
        if p:
            lines.append(f'| {n} | {p["writes"]} | {p["dirty_waits"]} '
                         f'({100 * p["dirty_wait_frac"]:.2g} %) | '
                         f'{p["dirty_wait_ms"]:.0f} / {p["dirty_wait_max_ms"]:.1f} ms | '
                         f'{p["busy_waits"]} | {p["busy_wait_ms"]:.0f} / '
                         f'{p["busy_wait_max_ms"]:.1f} ms | {p["bursts"]} | '
                         f'{p["written_back_per_written"]} |')
    lines += ['', '![ratios](hybrid-tail.png)', '']
    if args.notes and os.path.exists(args.notes):
        with open(args.notes) as f:
            lines += [f.read()]
    with open(os.path.join(out, 'hybrid-tail.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(os.path.join(out, 'hybrid-tail.png'), summary['ratios'])


def chart(path, rs):
    plt = charts.pyplot()
    if not plt:
        return
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rs) + 1.4))
    for i, r in enumerate(rs):
        charts.ratio_points(ax, [i], [r], color='tab:gray' if not r['goal']
                            else 'tab:red')
        if r['goal']:
            ax.plot([r['goal'][1]] * 2, [i - 0.3, i + 0.3], 'k--', lw=1)
    charts.ratio_rows(ax, [f'{r["metric"]}: {r["node"]} / {r["baseline"]}'
                           for r in rs], 'ratio of means (dashed: goal)')
    charts.save(fig, path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--runtime', type=int, default=12)
    ap.add_argument('--size', default='1G')
    ap.add_argument('--qd', type=int, default=32)
    ap.add_argument('--before', metavar='QSD',
                    help='another qemu-storage-daemon binary: its hybrid '
                    'node is run as hybrid-before')
    ap.add_argument('--disk', action='store_true',
                    help='also hybrid-disk (its tier under --disk-dir)')
    ap.add_argument('--disk-dir', default=os.path.join(REPO, 'build'))
    add_report_args(ap)
    args = ap.parse_args()
    if args.report_only:
        runs = load_saved(args)['runs']
        names = list(dict.fromkeys(r['node'] for r in runs))
        report(args, names, runs, summarize(names, runs))
        return
    if args.rounds < 2:
        ap.error('--rounds needs at least 2 for an interval')
    names, runs = run(args)
    report(args, names, runs, summarize(names, runs))


if __name__ == '__main__':
    main()
