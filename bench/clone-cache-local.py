#!/usr/bin/env python3
"""The clone cache's local limit (issue 40, target 4): what a hit and a miss
cost against reading the base straight, with the cache file on the same
disk as the base.

A base of --size random bytes (default 1 GiB) in a file on the disk of
--work-dir; one qemu-storage-daemon per configuration exports its node over
NBD on a unix socket, and fio's nbd engine reads through the export:

  raw       the base file alone: file node, cache.direct=on (O_DIRECT),
            aio=io_uring: the baseline
  raw@aa    the same again, its own daemon: the A/A control (the spread
            between two copies of the same thing)
  cc-warm   a clone-cache node over that same file node, the cache file
            (direct=on) beside the base, every block of the base cached
            before the first round (read passes until `used` covers the
            base; fill-limit=256M so that a pass queues more): every read
            a hit
  cc-cold   the same over a cache of 16 slots, the smallest there is: every
            read a miss (a 64 KiB base read per cache block, queued for
            filling, filled and evicted again), so that a run does not warm
            it under itself

Shapes: 4 KiB random reads at QD32 (`4k-rand-qd32`, over the whole base),
1 MiB sequential reads at QD1 and QD4 (`1m-seq-qd1`, `1m-seq-qd4`), each
--runtime s after a 1 s ramp.  Rounds are interleaved: each round runs
every configuration once, in an order rotated from round to round
(bench/pooled_stats.py), all shapes in turn (their order rotated too).

Per configuration and shape: mean IOPS and MB/s with Student t 95 %
intervals; the targets as ratios of means with percentile bootstrap 95 %
intervals, read only when the whole interval decides:

  cc-warm / raw >= 0.8 (every shape), cc-cold / raw >= 0.9 (every shape)

beside the A/A row (raw@aa / raw).  With --before BINARY, cc-warm@before
and cc-cold@before are the same two run by that qemu-storage-daemon (the
code before a change) in the same rounds, and the report adds their ratios
to raw and cc-warm / cc-warm@before, cc-cold / cc-cold@before.  What each cache run did comes from
query-clone-cache (hits, misses, merged misses, fills dropped, per run).
The 1-minute load average is recorded with every run.

Usage: bench/clone-cache-local.py [--rounds 3] [--runtime 5] [--size 1G]
                                  [--work-dir /var/tmp] [--name NAME]
                                  [--binary QSD] [--before QSD]
                                  [--notes FILE] [--out docs/bench]
       bench/clone-cache-local.py --report-only docs/bench/clone-cache-local.json
Needs fio (with its nbd engine).  qemu-storage-daemon from --binary or
$HYBRIDVM_BUILD/bin (default <repo>/build/bin), copied at start (a rebuild during the run does not change
what is measured).  Writes NAME.md, .json and .png in --out (the chart needs
matplotlib, e.g. build/venv/bin/python3).  About 4 minutes with the defaults.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402  (sets up the path of qemu.qmp)
import charts   # noqa: E402
from sizes import parse_size   # noqa: E402
import provenance   # noqa: E402
from saved_runs import add_report_args, load_saved   # noqa: E402
from pooled_stats import geo_mean_ci, mean, mean_ci, ratio_ci, rotated, verdict   # noqa: E402

MiB = 1 << 20
CONFIGS = ['raw', 'raw@aa', 'cc-warm', 'cc-cold']
BEFORE = ['cc-warm@before', 'cc-cold@before']     # with --before
# name: (fio rw, block size, queue depth)
SHAPES = {'4k-rand-qd32': ('randread', '4k', 32),
          '1m-seq-qd1': ('read', '1M', 1),
          '1m-seq-qd4': ('read', '1M', 4)}
GOALS = {'cc-warm': ('>=', 0.8), 'cc-cold': ('>=', 0.9)}
BLOCK = 64 * 1024               # the cache's default block size
COLD_SIZE = '1216K'             # 16 slots of 64 KiB (docs/clone-cache-format.rst)


class Daemon:
    """One qemu-storage-daemon exporting node `n` on DIR/nbd.sock."""

    def __init__(self, bench, name):
        self.name = name
        self.dir = os.path.join(bench.work, name.replace('@', '-'))
        os.makedirs(self.dir)
        kind = name.split('@')[0]
        base = (f'file,node-name=f,filename={bench.base},read-only=on,'
                'cache.direct=on,aio=io_uring')
        args = ['--blockdev', base]
        node = 'f'
        if kind.startswith('cc-'):
            size = COLD_SIZE if kind == 'cc-cold' else \
                str(bench.size + bench.size // 32 + 16 * MiB)
            # fill-limit: the warm-up passes queue more (the hit path never
            # looks at it)
            args = ['--object', f'clone-cache,id=cc0,filename={self.dir}/cache,'
                    f'size={size},direct=on'
                    + (',fill-limit=256M' if kind == 'cc-warm' else '')] + args + \
                   ['--blockdev', 'clone-cache,node-name=n,store=cc0,file=f,'
                    'read-only=on,base-id=base']
            node = 'n'
        self.sock = os.path.join(self.dir, 'nbd.sock')
        args += ['--nbd-server', f'addr.type=unix,addr.path={self.sock}',
                 '--export', f'nbd,id=n,node-name={node},name=n']
        self.tmp = H.TempDir()
        saved = H.BIN
        H.BIN = bench.bin_dirs[name.endswith('@before')]    # the private copies
        try:
            self.qsd = H.StorageDaemon(self.tmp, *args)
        finally:
            H.BIN = saved
        self.cache = kind.startswith('cc-')

    @property
    def pid(self):
        return self.qsd.proc.pid

    def uri(self):
        return f'nbd+unix:///n?socket={self.sock}'

    def info(self):
        [c] = self.qsd.cmd('query-clone-cache')
        return c

    def settle(self, timeout=300):
        deadline = time.monotonic() + timeout
        while self.info()['fill-pending']:
            if time.monotonic() > deadline:
                raise RuntimeError(f'{self.name}: fills never ended')
            time.sleep(0.1)
        time.sleep(0.2)         # the last batch is published after it is written
        return self.info()

    def counters(self):
        c = self.info()
        b = c['bases'][0]
        return {k: b[k] for k in ('hits', 'misses', 'merged-misses',
                                  'fills', 'fills-dropped', 'base-read-bytes',
                                  'cache-read-bytes')} | \
            {'checksum-errors': c['checksum-errors'], 'used': c['used']}

    def stop(self):
        self.qsd.stop()
        self.tmp.cleanup()


class Bench:
    def __init__(self, args):
        self.args = args
        self.size = parse_size(args.size)

    @staticmethod
    def run(argv, **kw):
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                           timeout=kw.pop('timeout', 600), **kw)
        if r.returncode:
            raise RuntimeError(f'{argv}: exit {r.returncode}: {r.stderr.strip()[-2000:]}')
        return r

    def copy_binaries(self):
        self.bin_dirs = []
        self.binaries = {}
        for i, (n, src) in enumerate([
                ('qemu-storage-daemon', self.args.binary or H.binary('qemu-storage-daemon')),
                ('before', self.args.before)][:1 + bool(self.args.before)]):
            d = os.path.join(self.work, f'bin{i}')
            os.makedirs(d)
            self.bin_dirs.append(d)
            self.binaries[n] = provenance.copy_binary(
                src, os.path.join(d, 'qemu-storage-daemon'))

    def make_base(self):
        self.base = os.path.join(self.work, 'base.img')
        with open(self.base, 'wb') as f:
            for _ in range(self.size // MiB):
                f.write(os.urandom(MiB))
            f.flush()
            os.fsync(f.fileno())

    def fio(self, d, shape, runtime, ramp=1):
        rw, bs, qd = SHAPES[shape]
        r = self.run(['fio', '--name=job', '--ioengine=nbd', f'--uri={d.uri()}',
                      f'--rw={rw}', f'--bs={bs}', f'--iodepth={qd}', '--numjobs=1',
                      f'--size={self.size}', f'--runtime={runtime}', '--time_based',
                      f'--ramp_time={ramp}', '--output-format=json', '--randrepeat=0',
                      '--norandommap'], timeout=runtime + 120)
        text = r.stdout
        job = json.loads(text[text.find('{'):])['jobs'][0]
        if job['error']:
            raise RuntimeError(f'{d.name} {shape}: fio failed: {text[:2000]}')
        rd = job['read']
        p = rd['clat_ns']['percentile']
        return {'iops': round(rd['iops']), 'MBps': round(rd['bw_bytes'] / 1e6, 1),
                'p50_us': round(p['50.000000'] / 1000, 1),
                'p99_us': round(p['99.000000'] / 1000, 1)}

    def warm(self, d):
        """Read the whole base through @d until every block is cached (a
        pass queues at most fill-limit bytes ahead of the filler)."""
        want = -(-self.size // BLOCK)
        for n in range(1, 30):
            self.run(['fio', '--name=warm', '--ioengine=nbd', f'--uri={d.uri()}',
                      '--rw=read', '--bs=1M', '--iodepth=1', f'--size={self.size}'])
            used = d.settle()['used']
            if used >= want:
                return n
        raise RuntimeError(f'{d.name}: {used} of {want} blocks cached after {n} passes')

    def main(self):
        args = self.args
        t0 = time.monotonic()
        runs, meta = [], {}
        meta.update(provenance.tree('block'))
        self.work = tempfile.mkdtemp(prefix='cc-local-', dir=args.work_dir)
        meta['disk'] = subprocess.run(['df', '--output=source', self.work], capture_output=True,
                                      text=True).stdout.split()[-1]
        daemons = {}
        try:
            self.copy_binaries()
            self.make_base()
            print(f'base written ({time.monotonic() - t0:.0f} s)', flush=True)
            configs = configs_of(args)
            for c in configs:
                daemons[c] = Daemon(self, c)
            meta['warm_passes'] = self.warm(daemons['cc-warm'])
            meta['warm_counters'] = daemons['cc-warm'].counters()
            if 'cc-warm@before' in daemons:
                self.warm(daemons['cc-warm@before'])
            print(f'cc-warm filled in {meta["warm_passes"]} passes '
                  f'({time.monotonic() - t0:.0f} s)', flush=True)
            shapes = list(SHAPES)
            for rnd in range(args.rounds):
                for c in rotated(configs, rnd):
                    d = daemons[c]
                    for shape in rotated(shapes, rnd):
                        before = d.counters() if d.cache else None
                        r = self.fio(d, shape, args.runtime)
                        r.update(round=rnd, config=c, shape=shape,
                                 load=round(os.getloadavg()[0], 2))
                        if d.cache:
                            after = d.counters()
                            r['cache'] = {k: after[k] - before[k] for k in after
                                          if k != 'used'} | {'used': after['used']}
                        runs.append(r)
                        print(json.dumps(r), flush=True)
        finally:
            for d in daemons.values():
                d.stop()
            shutil.rmtree(self.work, ignore_errors=True)
        meta.update(binaries=self.binaries, binaries_changed=provenance.changed(self.binaries),
                    wall_s=round(time.monotonic() - t0))
        return runs, meta


def configs_of(args):
    return CONFIGS + (BEFORE if getattr(args, 'before', None) else [])


def per_round(runs, config, shape, metric):
    return {r['round']: r[metric] for r in runs if r['config'] == config and r['shape'] == shape}


def summarize(runs, configs):
    cells, ratios = {}, []
    pairs = [(c, 'raw') for c in ('raw@aa', 'cc-warm', 'cc-cold')]
    if 'cc-warm@before' in configs:
        pairs += [('cc-warm@before', 'raw'), ('cc-cold@before', 'raw'),
                  ('cc-warm', 'cc-warm@before'), ('cc-cold', 'cc-cold@before')]
    for shape in SHAPES:
        for c in configs:
            rs = [r for r in runs if r['config'] == c and r['shape'] == shape]
            if not rs:
                continue
            s = cells[f'{c}/{shape}'] = {}
            for k in ('iops', 'MBps', 'p50_us', 'p99_us'):
                m, h = mean_ci([r[k] for r in rs])
                s[k] = {'mean': m, 'ci': h}
            if 'cache' in rs[0]:
                tot = {k: sum(r['cache'][k] for r in rs) for k in rs[0]['cache'] if k != 'used'}
                blocks = tot['hits'] + tot['misses']
                s['cache'] = tot | {'hit_share': tot['hits'] / blocks if blocks else 0}
        for c, base in pairs:
            ra, rb = per_round(runs, c, shape, 'iops'), per_round(runs, base, shape, 'iops')
            keys = sorted(set(ra) & set(rb))
            if len(keys) < 2:
                continue
            xa, xb = [ra[k] for k in keys], [rb[k] for k in keys]
            p, lo, hi = ratio_ci(xa, xb)
            gm, glo, ghi = geo_mean_ci([x / y for x, y in zip(xa, xb)])
            goal = GOALS.get(c) if base == 'raw' else None
            ratios.append({'shape': shape, 'config': c, 'baseline': base,
                           'ratio': p, 'lo': lo, 'hi': hi,
                           'goal': goal, 'paired': gm, 'paired_lo': glo, 'paired_hi': ghi,
                           'verdict': verdict(lo, hi, goal) if goal else
                           ('A/A control: the interval holds 1' if lo <= 1 <= hi else
                            'A/A control: the interval misses 1 (copies differ)')
                           if c == 'raw@aa' else '-',
                           'paired_verdict': verdict(glo, ghi, goal) if goal else '-'})
    return {'cells': cells, 'ratios': ratios}


def fmt(s, k, digits=0):
    ci = s[k]['ci']
    ci = '?' if ci != ci else f'{ci:.{digits}f}'
    return f'{s[k]["mean"]:.{digits}f} ± {ci}'


def report(args, runs, meta, summary):
    out = args.out
    os.makedirs(out, exist_ok=True)
    when = meta.get('when') or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    meta['when'] = when
    res = {'args': {k: v for k, v in vars(args).items()
                    if k not in ('out', 'notes', 'report_only')},
           'meta': meta, 'runs': runs, **summary}
    with open(os.path.join(out, f'{args.name}.json'), 'w') as f:
        json.dump(res, f, indent=1)
    loads = [r['load'] for r in runs]
    configs = configs_of(args)
    lines = [f'# Clone cache, the local limit: hits and misses against the raw base '
             f'({when})', '',
             f'Measured by `bench/clone-cache-local.py --rounds {args.rounds} '
             f'--runtime {args.runtime} --size {args.size} --work-dir {args.work_dir} '
             f'--name {args.name}'
             + (f' --binary {args.binary}' if getattr(args, 'binary', None) else '')
             + (f' --before {args.before}' if getattr(args, 'before', None) else '')
             + f'` (issue 40, target 4).  A base of {args.size} of '
             f'random bytes in a file on {meta.get("disk", "?")}; one '
             'qemu-storage-daemon per configuration exports its node over NBD on '
             'a unix socket, and fio\'s nbd engine reads through the export, '
             f'{args.runtime} s per run after a 1 s ramp.  {args.rounds} rounds, '
             'each running every configuration once in an order rotated from '
             'round to round, every shape in turn (their order rotated too).', '',
             '* **raw**: the base file alone, `cache.direct=on` (O_DIRECT), '
             '`aio=io_uring`: the baseline;',
             '* **raw@aa**: the same again, its own daemon: the A/A control;',
             '* **cc-warm**: a clone-cache node over the same file node, the cache '
             'file beside the base (`direct=on`, 64 KiB blocks), every block of '
             f'the base cached before the first round ({meta.get("warm_passes", "?")} '
             'read passes; `fill-limit=256M` so that a pass queues more): every '
             'read a hit;',
             '* **cc-cold**: the same over a cache of 16 slots, the smallest there '
             'is: every read a miss (a 64 KiB base read per cache block, queued for '
             'filling, filled and evicted again), so that a run does not warm it '
             'under itself.'] + ([
             '* **cc-warm@before**, **cc-cold@before**: the same two run by the '
             f'qemu-storage-daemon of --before ({args.before}), the code before '
             'the change measured, in the same rounds.'] if 'cc-warm@before' in configs
             else []) + ['',
             'Shapes: 4 KiB random reads at QD32 over the whole base '
             '(`4k-rand-qd32`), 1 MiB sequential reads at QD1 and QD4.', '',
             f'2 cores shared with other work; 1-minute load average '
             f'{min(loads):.2f} to {max(loads):.2f} during the runs (mean '
             f'{mean(loads):.2f}).  Wall time {meta.get("wall_s", "?")} s.', '',
             'Per configuration and shape, the mean of the rounds and its 95 % '
             'interval (Student t); latencies are fio completion latencies.', '',
             '| shape | configuration | IOPS | MB/s | p50 µs | p99 µs | cache hits / blocks |',
             '|---|---|---:|---:|---:|---:|---:|']
    for shape in SHAPES:
        for c in configs:
            s = summary['cells'].get(f'{c}/{shape}')
            if not s:
                continue
            hs = (f'{s["cache"]["hit_share"] * 100:.1f} %' if 'cache' in s else '-')
            lines.append(f'| {shape} | {c} | ' + ' | '.join(
                fmt(s, k, 1 if k == 'MBps' else 0) for k in ('iops', 'MBps', 'p50_us', 'p99_us'))
                + f' | {hs} |')
    lines += ['', '## The targets', '',
              'IOPS (the same ratio as MB/s) against the baseline: the ratio of the means '
              'with a percentile bootstrap 95 % interval (rounds resampled '
              'independently), and paired by round (geometric mean of the per-round '
              'ratios, Student t 95 %).  A target is met or missed only when the '
              'whole interval says so; otherwise it is inside the noise.', '',
              '| shape | configuration / baseline | ratio of means [95 % CI] | verdict '
              '| paired [95 % CI] | verdict | target |',
              '|---|---|---:|---|---:|---|---|']
    for r in summary['ratios']:
        goal = f'{r["goal"][0]} {r["goal"][1]:g}' if r['goal'] else '-'
        lines.append(f'| {r["shape"]} | {r["config"]} / {r.get("baseline", "raw")} | '
                     f'{r["ratio"]:.2f} [{r["lo"]:.2f}, {r["hi"]:.2f}] | {r["verdict"]} | '
                     f'{r["paired"]:.2f} [{r["paired_lo"]:.2f}, {r["paired_hi"]:.2f}] | '
                     f'{r["paired_verdict"]} | {goal} |')
    lines += ['', '## What the cache did', '',
              'Summed over the rounds, from query-clone-cache around each run: '
              'cache blocks served as hits, missed (a base read), merged into a '
              'base read in flight, blocks filled and fills dropped (the fill '
              'backlog full), checksum errors.', '',
              '| shape | configuration | hits | misses | merged | fills | fills dropped '
              '| checksum errors |', '|---|---|---:|---:|---:|---:|---:|---:|']
    for shape in SHAPES:
        for c in [c for c in configs if c.startswith('cc-')]:
            s = summary['cells'].get(f'{c}/{shape}', {}).get('cache')
            if s:
                lines.append(f'| {shape} | {c} | {s["hits"]} | {s["misses"]} | '
                             f'{s["merged-misses"]} | {s["fills"]} | {s["fills-dropped"]} | '
                             f'{s["checksum-errors"]} |')
    lines += ['', f'![IOPS and the ratios]({args.name}.png)', '']
    if meta.get('binaries'):
        # runs saved before provenance.tree() named the paths it looked at
        lines += [provenance.report_line(dict({'tree_paths': ['block']}, **meta)), '']
    if args.notes and os.path.exists(args.notes):
        with open(args.notes) as f:
            lines += [f.read()]
    with open(os.path.join(out, f'{args.name}.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(os.path.join(out, f'{args.name}.png'), summary, configs)


def chart(path, summary, configs):
    plt = charts.pyplot()
    if not plt:
        return
    rs = summary['ratios']
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.42 * len(rs) + 2.2),
                                   gridspec_kw={'width_ratios': [1, 1.2]})
    shapes = list(SHAPES)
    series = [(c, [summary['cells'].get(f'{c}/{s}', {}).get('MBps', {}).get('mean', 0)
                   for s in shapes]) for c in configs]
    w = 0.8 / len(configs)
    charts.grouped_bars(ax1, shapes, series, w)
    for j, c in enumerate(configs):
        for i, s in enumerate(shapes):
            cell = summary['cells'].get(f'{c}/{s}')
            if cell and cell['MBps']['ci'] == cell['MBps']['ci']:
                ax1.errorbar([i + (j - (len(configs) - 1) / 2) * w], [cell['MBps']['mean']],
                             yerr=[cell['MBps']['ci']], fmt='none', ecolor='k', capsize=2)
    ax1.set_ylabel('MB/s read (mean, 95 % CI)')
    ax1.legend(fontsize=8)
    for i, r in enumerate(rs):
        charts.ratio_points(ax2, [i], [r], color='tab:red' if r['goal'] else 'tab:gray')
        if r['goal']:
            ax2.plot([r['goal'][1]] * 2, [i - 0.3, i + 0.3], 'k--', lw=1)
    charts.ratio_rows(ax2, [f'{r["shape"]}: {r["config"]} / {r.get("baseline", "raw")}'
                            for r in rs],
                      'ratio of mean IOPS (dashed: target)')
    charts.save(fig, path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--runtime', type=int, default=5)
    ap.add_argument('--size', default='1G', help='the base (a multiple of 1 MiB)')
    ap.add_argument('--work-dir', default='/var/tmp',
                    help='where the base and the cache files go (the disk measured)')
    ap.add_argument('--binary', help='the qemu-storage-daemon to measure '
                    '(default: the build\'s), e.g. a copy kept from before a change')
    ap.add_argument('--before', help='a second qemu-storage-daemon (the code before a '
                    'change): cc-warm@before and cc-cold@before run it in the same rounds')
    ap.add_argument('--name', default='clone-cache-local',
                    help='the report files in --out: NAME.md, .json, .png')
    add_report_args(ap)
    args = ap.parse_args()
    if args.report_only:
        saved = load_saved(args)
        report(args, saved['runs'], saved.get('meta', {}),
               summarize(saved['runs'], configs_of(args)))
        return
    if args.rounds < 2:
        ap.error('--rounds needs at least 2 for an interval')
    if not shutil.which('fio'):
        ap.error('needs fio')
    runs, meta = Bench(args).main()
    report(args, runs, meta, summarize(runs, configs_of(args)))


if __name__ == '__main__':
    main()
