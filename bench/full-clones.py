#!/usr/bin/env python3
"""Full clones of an RBD base (issue 40, target 7): N whole copies of a
protected snapshot, made through the host against made by the storage.

The cluster is boot-storm's (bench/boot-storm.py): scripts/ceph-cluster.sh
(one monitor, one BlueStore OSD, cephx) in a network namespace of its own
behind a veth pair shaped with tbf in both directions (bench/shaped_link.py),
at --rates (default 1 Gbit/s, boot-storm's first).  The base: --base-mib of
random bytes (incompressible, no zero block, so nothing is sparse) imported
as rbd/base, snapshotted and protected as rbd/base@gold.

Ways (configurations), each making N = --counts clones fc0..fc{N-1} at once,
as a provisioning tool making N desktops would (all N started together, the
time taken until the last is complete: a plain image with no parent):
  convert        qemu-img convert -O raw rbd:rbd/base@gold rbd:rbd/fcK, one
                 process per clone: every byte comes in over the link and
                 goes out again (the baseline)
  convert@aa     the same again: the A/A control
  clone+flatten  rbd clone, then rbd flatten, per clone: librbd on the host
                 copies the parent's objects into the clone (copy-up), so
                 the data crosses the link both ways too
  deep-cp        rbd deep cp rbd/base@gold rbd/fcK (the copy has the
                 snapshot too): librbd's deep copy, also on the host
  osd-copy       scripts/rbd-full-clone.sh -j --jobs: every data object copied
                 by the OSD itself (RADOS copy-from, `rados cp`), one request
                 per object from the host; then the object maps rebuilt
  mgr-flatten    rbd clone, then `ceph rbd task add flatten` per clone: the
                 manager's rbd_support module flattens in the cluster (needs
                 ceph-mgr; this script starts one in the namespace)

Measured per run: the wall time, and the bytes the link carried each way
(tbf's counters on both ends, as boot-storm reads them).  After each run the
last clone is checked inside the namespace (not over the link): no parent,
and its bytes' SHA-256 equal to the base's; then the clones are removed.
Rounds are interleaved, the configurations in an order rotated from round
to round and from N to N (bench/pooled_stats.py).

Usage: bench/full-clones.py [--rates 1gbit] [--counts 1,5,10] [--rounds 3]
       bench/full-clones.py --report-only docs/bench/full-clones.json
Writes docs/bench/NAME.{md,json,png}.  Needs root (namespace, tc).
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'tests'))
from hvlib.ceph import CephCluster, unavailable   # noqa: E402
from hvlib.paths import BuildPaths   # noqa: E402
import charts   # noqa: E402
from pooled_stats import geo_mean_ci, mean, mean_ci, ratio_ci, rotated, verdict   # noqa: E402
from saved_runs import add_report_args, load_saved   # noqa: E402
from shaped_link import Link   # noqa: E402

MiB = 1 << 20
NS, NET = 'hvfclone', '10.78.0'         # the link: hvfclone0 10.78.0.1 <-> hvfclone1 .2
PORT = 3396
BASELINE = 'convert'
CONFIGS = ['convert', 'convert@aa', 'clone+flatten', 'deep-cp', 'osd-copy', 'mgr-flatten']
HOST_SIDE = ('convert', 'convert@aa', 'clone+flatten', 'deep-cp')
# The clone-cache design: ten full clones made by the storage were more
# than 2x faster than copying them through the host
GOAL = ('<=', 0.5)
SCRIPT = os.path.join(REPO, 'scripts', 'rbd-full-clone.sh')


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = tempfile.mkdtemp(prefix='full-clones-', dir=args.work_dir)
        # the binary measured is a copy: a rebuild during the run changes nothing
        self.qemu_img = os.path.join(self.work, 'qemu-img')
        shutil.copy(BuildPaths().binary('qemu-img'), self.qemu_img)
        self.link = Link(NS, NET)
        self.link.shape(args.rates[0])
        self.ceph = CephCluster(os.path.join(self.work, 'ceph'), port=PORT,
                                addr=self.link.ns_ip, netns=NS, op_timeout=int(args.timeout))
        self.mgr = None
        self.runs = []

    # -- the cluster --

    def setup(self):
        t0 = time.monotonic()
        # the script's 4 GiB OSD cannot hold the base and ten clones with
        # BlueStore's own share; a bigger (sparse) one for the daemons only
        self.ceph.env['CEPH_ARGS'] = f'--bluestore-block-size={self.args.osd_gib << 30}'
        self.ceph.start()
        # concurrent clients of one name would fight over one admin socket
        self.ceph.env['CEPH_ARGS'] = '--admin-socket='
        if 'mgr-flatten' in self.args.configs:
            self.start_mgr()
        base = os.path.join(self.work, 'base.raw')
        h = hashlib.sha256()
        with open(base, 'wb') as f:
            for _ in range(self.args.base_mib):
                b = os.urandom(MiB)
                h.update(b)
                f.write(b)
        self.base_sha = h.hexdigest()
        self.ceph.rbd('import', '--no-progress', base, 'rbd/base', timeout=600)
        os.unlink(base)
        self.ceph.rbd('snap', 'create', 'rbd/base@gold')
        self.ceph.rbd('snap', 'protect', 'rbd/base@gold')
        du = self.ceph.rbd('du', '--format', 'json', 'rbd/base@gold').stdout
        used = json.loads(du)['images'][0]['used_size']
        if used != self.args.base_mib * MiB:
            raise RuntimeError(f'rbd/base@gold uses {used} bytes, not '
                               f'{self.args.base_mib} MiB: it is sparse')
        print(f'set-up: cluster, base ({self.args.base_mib} MiB) in '
              f'{time.monotonic() - t0:.0f} s', file=sys.stderr)

    def start_mgr(self):
        """A manager in the namespace, for `ceph rbd task add flatten` (the
        rbd_support module is always on)."""
        d = self.ceph.path
        data = os.path.join(d, 'mgr', 'ceph-x')
        os.makedirs(data)
        self.ceph.ceph('auth', 'get-or-create', 'mgr.x', 'mon', 'allow profile mgr',
                       'osd', 'allow *', 'mds', 'allow *',
                       '-o', os.path.join(data, 'keyring'))
        shutil.copy(os.path.join(data, 'keyring'), os.path.join(d, 'mgr.x.keyring'))
        pidf = os.path.join(d, 'run', 'mgr.x.pid')
        env = dict(self.ceph.env)
        env.pop('CEPH_ARGS', None)
        subprocess.run(['nsenter', f'--net=/run/netns/{NS}', 'ceph-mgr', '-i', 'x',
                        '--mgr-data', data, '--pid-file', pidf], env=env, check=True)
        deadline = time.monotonic() + 120
        while self.ceph.ceph('rbd', 'task', 'list', check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError('ceph-mgr: rbd_support did not answer in 120 s')
            time.sleep(1)
        self.mgr = pidf

    def cleanup(self):
        try:
            self.ceph.purge()           # its pid files include the manager's
        finally:
            self.link.teardown()
            shutil.rmtree(self.work, ignore_errors=True)

    def counters(self):
        return self.link.sent_by_cluster(), self.link.sent_by_host()

    # -- one run --

    def popen(self, argv):
        return subprocess.Popen(argv, env=self.ceph.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def wait_all(self, procs, what):
        deadline = time.monotonic() + self.args.timeout
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f'{what}: not done after {self.args.timeout} s')
            if p.returncode != 0:
                raise RuntimeError(f'{what}: {" ".join(p.args)} exited {p.returncode}: '
                                   f'{err.strip()[-800:]}')

    def make(self, config, n):
        names = [f'rbd/fc{k}' for k in range(n)]
        conf = self.ceph.conf
        if config in ('convert', 'convert@aa'):
            self.wait_all([self.popen([self.qemu_img, 'convert', '-O', 'raw',
                                       f'rbd:rbd/base@gold:id=qemu:conf={conf}',
                                       f'rbd:{d}:id=qemu:conf={conf}'])
                           for d in names], config)
        elif config == 'clone+flatten':
            self.wait_all([self.popen(['sh', '-ec', f'rbd clone rbd/base@gold {d}; '
                                       f'rbd flatten --no-progress {d}'])
                           for d in names], config)
        elif config == 'deep-cp':
            self.wait_all([self.popen(['rbd', 'deep', 'cp', '--no-progress',
                                       'rbd/base@gold', d]) for d in names], config)
        elif config == 'osd-copy':
            self.wait_all([self.popen([SCRIPT, '-j', str(self.args.jobs),
                                       'rbd/base@gold', *names])], config)
        elif config == 'mgr-flatten':
            self.wait_all([self.popen(['sh', '-ec', f'rbd clone rbd/base@gold {d}; '
                                       f'ceph rbd task add flatten {d} >/dev/null'])
                           for d in names], config)
            # done when no clone has a parent left (rbd info: C++, cheap; the
            # python `ceph rbd task list` would cost the shared CPU more)
            pending, deadline = list(names), time.monotonic() + self.args.timeout
            while pending:
                pending = [d for d in pending if 'parent' in json.loads(
                    self.ceph.rbd('info', '--format', 'json', d).stdout)]
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(f'{config}: {pending} not flat after '
                                       f'{self.args.timeout} s')
                if pending:
                    time.sleep(0.25)
        else:
            raise ValueError(config)

    def in_ns(self, cmd):
        """A shell command inside the namespace: the cluster over its
        loopback, not over the shaped link."""
        return subprocess.run(['nsenter', f'--net=/run/netns/{NS}', 'sh', '-ec', cmd],
                              env=self.ceph.env, capture_output=True, text=True,
                              timeout=600)

    def check(self, config, name):
        info = json.loads(self.ceph.rbd('info', '--format', 'json', name).stdout)
        if 'parent' in info:
            raise RuntimeError(f'{config}: {name} still has a parent: {info["parent"]}')
        r = self.in_ns(f'rbd export --no-progress {name} - | sha256sum')
        if r.returncode != 0 or r.stdout.split()[0] != self.base_sha:
            raise RuntimeError(f'{config}: {name} differs from the base '
                               f'({r.stdout.strip()} {r.stderr.strip()[-300:]})')

    def drop(self, n):
        names = ' '.join(f'rbd/fc{k}' for k in range(n))
        # deep-cp's copies have the snapshot (protected) too
        r = self.in_ns(f'for d in {names}; do (rbd snap unprotect $d@gold 2>/dev/null || true; '
                       f'rbd snap purge --no-progress $d; rbd rm --no-progress $d) & done; wait')
        left = set(self.ceph.rbd('ls', 'rbd').stdout.split()) - {'base'}
        if left:
            raise RuntimeError(f'clones left after removal: {sorted(left)} {r.stderr[-300:]}')

    def run_one(self, rnd, rate, n, config):
        before = self.counters()
        t0 = time.monotonic()
        self.make(config, n)
        wall = time.monotonic() - t0
        after = self.counters()
        load = os.getloadavg()[0]
        self.check(config, f'rbd/fc{n - 1}')
        self.drop(n)
        r = dict(round=rnd, rate=rate, n=n, config=config, wall_s=wall,
                 from_cluster=after[0] - before[0], to_cluster=after[1] - before[1],
                 load1=round(load, 2))
        print(f'r{rnd} {rate:>8} N={n:2d} {config:>13}: {wall:6.1f} s, link '
              f'{r["from_cluster"] / MiB:7.1f} MiB in, {r["to_cluster"] / MiB:7.1f} MiB out, '
              f'load {load:.1f}', file=sys.stderr)
        self.runs.append(r)
        self.save_partial()

    def save_partial(self):
        """The runs so far, in the JSON the report is written from: a run cut
        short can still be reported (--report-only)."""
        a = self.args
        self.meta.update(wall_s=round(time.monotonic() - self.t0), partial=True,
                         argv=sys.argv[1:])
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f'{a.name}.json'), 'w') as f:
            json.dump({'args': {k: v for k, v in vars(a).items()
                                if k not in ('out', 'notes', 'report_only')},
                       'meta': self.meta, 'runs': self.runs}, f, indent=1)

    def main(self):
        a = self.args
        self.meta = meta = {'when': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
                'head': subprocess.run(['git', '-C', REPO, 'rev-parse', 'HEAD'],
                                       capture_output=True, text=True).stdout.strip(),
                'load_start': os.getloadavg()[0], 'nproc': os.cpu_count()}
        self.t0 = t0 = time.monotonic()
        self.setup()
        k = 0
        for rate in a.rates:
            self.link.shape(rate)
            for rnd in range(a.rounds):
                for n in a.counts:
                    for c in rotated(a.configs, k):
                        self.run_one(rnd, rate, n, c)
                    k += 1
        meta['wall_s'] = round(time.monotonic() - t0)
        meta['load_end'] = os.getloadavg()[0]
        meta['partial'] = False
        return self.runs, meta


# -- the report --

def summarize(args, runs):
    cells, ratios = {}, []
    for rate in args.rates:
        for n in args.counts:
            for c in args.configs:
                rs = [r for r in runs if (r['rate'], r['n'], r['config']) == (rate, n, c)]
                if not rs:
                    continue
                m, h = mean_ci([r['wall_s'] for r in rs])
                cells[f'{rate} {n} {c}'] = {
                    'wall_s': m, 'ci': h, 'runs': len(rs),
                    'from_cluster': mean([r['from_cluster'] for r in rs]),
                    'to_cluster': mean([r['to_cluster'] for r in rs])}
            base = {r['round']: r['wall_s'] for r in runs
                    if (r['rate'], r['n'], r['config']) == (rate, n, BASELINE)}
            for c in args.configs:
                if c == BASELINE:
                    continue
                way = {r['round']: r['wall_s'] for r in runs
                       if (r['rate'], r['n'], r['config']) == (rate, n, c)}
                keys = sorted(set(way) & set(base))
                if len(keys) < 2:
                    continue
                xa, xb = [way[k] for k in keys], [base[k] for k in keys]
                p, lo, hi = ratio_ci(xa, xb)
                gm, glo, ghi = geo_mean_ci([x / y for x, y in zip(xa, xb)])
                goal = GOAL if c not in HOST_SIDE and n == max(args.counts) else None
                if c == 'convert@aa':
                    v = ('A/A: the interval holds 1' if lo <= 1 <= hi
                         else 'A/A: the interval misses 1')
                elif goal:
                    v = verdict(lo, hi, goal)
                else:
                    v = ('faster (the whole interval)' if hi < 1 else
                         'slower (the whole interval)' if lo > 1 else 'inside the noise')
                ratios.append(dict(rate=rate, n=n, config=c, ratio=p, lo=lo, hi=hi,
                                   paired=gm, paired_lo=glo, paired_hi=ghi,
                                   goal=goal, verdict=v))
    return {'cells': cells, 'ratios': ratios}


def describe():
    doc = __doc__
    return doc[doc.index('Ways (configurations)'):doc.index('Measured per run')].rstrip()


def report(args, runs, meta, summary):
    out = args.out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f'{args.name}.json'), 'w') as f:
        json.dump({'args': {k: v for k, v in vars(args).items()
                            if k not in ('out', 'notes', 'report_only')},
                   'meta': meta, 'runs': runs, **summary}, f, indent=1)
    loads = [r['load1'] for r in runs]
    cmd = ' '.join(['bench/full-clones.py'] + meta.get('argv', []))
    lines = [f'# Full clones of an RBD base: through the host or by the storage '
             f'({meta["when"]})', '',
             f'Measured by `{cmd}` (issue 40, target 7) on {meta.get("nproc", "?")} cores '
             f'shared with other work: 1-minute load average {min(loads):.1f} to '
             f'{max(loads):.1f} at the end of the runs ({meta["load_start"]:.1f} at the start); '
             f'{len(runs)} runs in {meta["wall_s"]} s'
             + (' (cut short: the rounds that finished)' if meta.get('partial') else '')
             + '.  Source: commit '
             f'{meta.get("head", "?")[:12]}.', '',
             'The cluster is the boot-storm one (bench/boot-storm.py, '
             'bench/shaped_link.py): scripts/ceph-cluster.sh, one monitor and one '
             'BlueStore OSD (a sparse file on the machine\'s disk, '
             f'{args.osd_gib} GiB), cephx on, in a network namespace behind a veth '
             f'pair shaped with tbf both ways at {" and ".join(args.rates)}; the host\'s '
             'clients (qemu-img, rbd, rados, ceph) reach it only over that link.  '
             f'The base: {args.base_mib} MiB of random bytes (incompressible, no zero '
             f'block: nothing sparse, `rbd du` checked), rbd/base@gold, protected, '
             f'{args.base_mib // 4} objects of 4 MiB.  All processes, the daemons too, '
             'share the same 2 cores: what the storage does "itself" here costs the '
             'same CPU as the host\'s copy, unlike on real storage servers.', '',
             f'N = {", ".join(map(str, args.counts))} clones per run, all started at '
             'once (a provisioning tool making N desktops does not wait for one to '
             'start the next; and the link, the OSD and the CPU are then shared as '
             'they would be).  Time: from the start until the last clone is complete '
             '(every command returned; for mgr-flatten, no clone with a parent left, polled every 0.25 s with `rbd info`), a plain '
             'image with no parent.  After each run, outside the time and the '
             'counters, the last clone is checked from inside the namespace (no '
             'parent; SHA-256 of its bytes = the base\'s), then the clones are '
             f'removed.  {args.rounds} rounds; in each, every N and every way once, '
             'in an order rotated from one N to the next.', '',
             '```', describe(), '```', '',
             'Means over the rounds with their Student t 95 % intervals; bytes are '
             'the means of tbf\'s counters (in: sent by the cluster\'s end; out: sent '
             'by the host\'s end).', '']
    for rate in args.rates:
        lines += [f'## Link {rate}', '',
                  '| way | N | time (s) | per clone (s) | MiB in | MiB out | '
                  'time / convert [95 % CI] | paired [95 % CI] | reading |',
                  '|---|---:|---:|---:|---:|---:|---:|---:|---|']
        for n in args.counts:
            for c in args.configs:
                s = summary['cells'].get(f'{rate} {n} {c}')
                if not s:
                    continue
                ci = '?' if s['ci'] != s['ci'] else f'{s["ci"]:.1f}'
                rr = next((r for r in summary['ratios']
                           if (r['rate'], r['n'], r['config']) == (rate, n, c)), None)
                rtxt = (f'{rr["ratio"]:.2f} [{rr["lo"]:.2f}, {rr["hi"]:.2f}]',
                        f'{rr["paired"]:.2f} [{rr["paired_lo"]:.2f}, {rr["paired_hi"]:.2f}]',
                        rr['verdict'] + (f' (goal {rr["goal"][0]} {rr["goal"][1]})'
                                         if rr['goal'] else '')) if rr else ('1', '1', 'baseline')
                lines.append(f'| {c} | {n} | {s["wall_s"]:.1f} ± {ci} | {s["wall_s"] / n:.2f} | '
                             f'{s["from_cluster"] / MiB:.1f} | {s["to_cluster"] / MiB:.1f} | '
                             + ' | '.join(rtxt) + ' |')
        lines.append('')
    lines += [f'![time per way and N]({args.name}.png)', '']
    if args.notes and os.path.exists(args.notes):
        with open(args.notes) as f:
            lines += [f.read()]
    with open(os.path.join(out, f'{args.name}.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(args, os.path.join(out, f'{args.name}.png'), summary)
    print('\n'.join(lines))


def chart(args, path, summary):
    plt = charts.pyplot()
    if not plt:
        return
    rates = args.rates
    fig, axes = plt.subplots(2, len(rates), figsize=(6.5 * len(rates), 8), squeeze=False)
    for j, rate in enumerate(rates):
        for c in args.configs:
            pts = [(n, summary['cells'][f'{rate} {n} {c}']) for n in args.counts
                   if f'{rate} {n} {c}' in summary['cells']]
            if not pts:
                continue
            ns = [n for n, _ in pts]
            axes[0][j].errorbar(ns, [s['wall_s'] for _, s in pts],
                                yerr=[0 if s['ci'] != s['ci'] else s['ci'] for _, s in pts],
                                marker='o', capsize=3, label=c)
            axes[1][j].plot(ns, [(s['from_cluster'] + s['to_cluster']) / MiB for _, s in pts],
                            marker='o', label=c)
        axes[0][j].set_title(f'link {rate}: time until all N clones are complete')
        axes[0][j].set_ylabel('s (mean, 95 % CI)')
        axes[1][j].set_title(f'link {rate}: bytes over the link, both ways')
        axes[1][j].set_ylabel('MiB')
        axes[1][j].set_yscale('log')
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xlabel('clones made at once (N)')
            ax.set_xticks(args.counts)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    charts.save(fig, path, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rates', default='1gbit', help='tbf rates, comma-separated')
    ap.add_argument('--counts', default='1,5,10')
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--configs', default=','.join(CONFIGS))
    ap.add_argument('--base-mib', type=int, default=256)
    ap.add_argument('--jobs', type=int, default=8,
                    help="osd-copy: objects copied at a time (rbd-full-clone.sh -j)")
    ap.add_argument('--osd-gib', type=int, default=16)
    ap.add_argument('--timeout', type=float, default=900, help='per run (s)')
    ap.add_argument('--work-dir', default=BuildPaths().build,
                    help='where the cluster goes (not tmpfs: BlueStore)')
    ap.add_argument('--name', default='full-clones', help='stem of the files written')
    add_report_args(ap)
    args = ap.parse_args()
    if args.report_only:
        saved = load_saved(args)
        report(args, saved['runs'], saved['meta'], summarize(args, saved['runs']))
        return
    args.rates = args.rates.split(',')
    args.counts = [int(x) for x in args.counts.split(',')]
    args.configs = [c for c in args.configs.split(',') if c]
    bad = set(args.configs) - set(CONFIGS)
    if bad:
        ap.error(f'unknown configurations {sorted(bad)}; known: {CONFIGS}')
    if BASELINE not in args.configs:
        ap.error(f'the baseline {BASELINE} must be among the configurations')
    if args.rounds < 2:
        ap.error('--rounds needs at least 2 for an interval')
    if os.geteuid() != 0:
        ap.error('needs root (network namespace, tc)')
    why = unavailable(BuildPaths().binary('qemu-img'))
    if why:
        sys.exit(f'full-clones: {why}')
    if 'mgr-flatten' in args.configs and not shutil.which('ceph-mgr'):
        sys.exit('full-clones: mgr-flatten needs ceph-mgr (apt-get install ceph-mgr), '
                 'or leave it out of --configs')
    b = Bench(args)
    try:
        runs, meta = b.main()
    finally:
        b.cleanup()
    meta['argv'] = sys.argv[1:]
    report(args, runs, meta, summarize(args, runs))


if __name__ == '__main__':
    main()
