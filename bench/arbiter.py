#!/usr/bin/env python3
"""VMs and containers on one device, with and without the arbiter (issue
21): the design's VM-vs-container figures.

One loop device with direct I/O on a file of the build directory's disk.
The VM: a TCG guest streaming 1 MiB O_DIRECT reads from its virtio-blk
disk (that device, behind throttle group tg0).  The container: a podman
container (rootful, runc: tests/hvlib/podman.py) running fio, 4 KiB random
reads at QD4; the arbiter finds it by its podman name.  Configurations,
interleaved in each of --rounds rounds:
  container solo, VM solo      each side alone (then the container alone
                               again: the probe's baseline is the least of
                               the two, Scenario.probe_baseline)
  contended, contended (A/A)   both, no control (twice: the A/A spread)
  arbitrated                   both, hvarbiter (its target: --target-x times
                               that baseline, the probe's p90; the
                               container's p99 is held to 2x its solo p99)
  static N MB/s                both, the VM's group fixed at N MB/s
  BFQ weights                  both, the device's scheduler BFQ, the
                               container's cgroup parent weight 1000,
                               QEMU's cgroup weight 100 (siblings)
  VM-path solo / contended     the VM load is fio (1 MiB, QD4) through a
                               qemu-storage-daemon (QEMU's block layer and
                               NBD), no guest CPU: the block layer alone
Also the CPU part of the guest's figure: the same guest reading a null-co
disk (no device at all), and the calibration (hvarbiter calibrate) whose
gap weighs the work figure: W = (container bytes + gap x VM bytes) / 4 KiB.

Writes docs/bench/arbiter.{md,json,png}.  Needs root.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'arbiter', 'tests'))
import arblib as A          # noqa: E402
import scenario as S        # noqa: E402
from arblib import H        # noqa: E402
from arbiter.model import Model   # noqa: E402
import charts   # noqa: E402
from pooled_stats import geo_mean_ci, in_run_order, mean_ci, rotated   # noqa: E402

MB = 1000 * 1000


def ci(xs):
    """mean_ci of the figures present: (None, None) if there are none, the
    half-width None for one."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m, h = mean_ci(xs)
    return m, None if math.isnan(h) else h


def bfq(dev, on):
    q = f'/sys/block/{os.path.basename(dev)}/queue/scheduler'
    with open(q) as f:
        cur = f.read()
    want = 'bfq' if on else 'none'
    if want not in cur:
        raise RuntimeError(f'{q}: no {want} ({cur.strip()})')
    with open(q, 'w') as f:
        f.write(want)


BFQ_CTR = '/hvbench-ctr'      # the container's --cgroup-parent in the BFQ phase


def move_to_cgroup(pid, path, weight=None):
    os.makedirs(path, exist_ok=True)
    if weight is not None:
        with open(os.path.join(path, 'blkio.bfq.weight'), 'w') as f:
            f.write(str(weight))
    with open(os.path.join(path, 'cgroup.procs'), 'w') as f:
        f.write(str(pid))


class Bench:
    def __init__(self, a):
        self.a = a
        self.tmp = H.TempDir()
        self.sc = S.Scenario(self.tmp, size_mib=a.size_mib, secs=a.seconds)
        self.rows = []

    def calibrate(self):
        path = self.tmp('model.json')
        subprocess.run([sys.executable, A.HVARBITER, 'calibrate', self.sc.loop.dev, '-o', path,
                        '--seconds', '3', '--qsd', H.binary('qemu-storage-daemon')],
                       check=True, capture_output=True, text=True, timeout=600)
        self.model = Model.load(path)
        print(self.model.table(), file=sys.stderr)
        return self.model.gap()

    def record(self, rnd, r, **extra):
        r = dict(r, round=rnd, **extra)
        self.rows.append(r)
        c, v = r['container'], r['vm']
        print(f'round {rnd} {r["phase"]:>26}: '
              + (f'container {c["iops"]:7.0f} IOPS p99 {c["p99_ms"]:6.2f} ms  ' if c else ' ' * 38)
              + (f'VM {v["bps"] / MB:6.1f} MB/s' if v else ''), file=sys.stderr)

    def round(self, rnd, gap):
        sc, a = self.sc, self.a
        solo = sc.solo_with_probe()
        self.record(rnd, solo, probe_ms=solo['probe_ms'])
        self.record(rnd, sc.phase('VM solo', container=False))
        # the probe's baseline: the least of two solo phases with another
        # between them (Scenario.probe_baseline); only the first counts in
        # the table's solo row
        again = sc.solo_with_probe('container solo again')
        self.record(rnd, again, probe_ms=again['probe_ms'])
        probe_ms = sc.probe_baseline(solo, again)
        # the container's p99 (fio's) against twice its solo figure; the
        # arbiter in its probe's terms (docs/arbiter.md, "Calibration")
        target = max(0.5, 2 * solo['container']['p99_ms'])
        arb_target = a.target_x * (probe_ms or solo['container']['p99_ms'])
        order = ['contended', 'arbitrated', 'contended (A/A)'] + \
            [f'static {m} MB/s' for m in a.statics] + ['BFQ weights']
        for name in rotated(order, rnd):
            if name == 'VM solo':
                self.record(rnd, sc.phase(name, container=False))
            elif name.startswith('contended'):
                self.record(rnd, sc.phase(name))
            elif name == 'arbitrated':
                d = sc.start_arbiter(arb_target, gap=gap)
                r = sc.phase(name, settle=3)
                st = d.status()
                sc.stop_arbiter()
                self.record(rnd, r, target_ms=target, arbiter_target_ms=arb_target, limit=st['vms'].get('vm0', {}).get('limit'),
                            actions=st.get('actions'))
            elif name.startswith('static'):
                sc.vm.set_limits(bps_total=int(name.split()[1]) * MB)
                self.record(rnd, sc.phase(name))
                sc.vm.set_limits()
            elif name == 'BFQ weights':
                # podman drops --blkio-weight here (runc's v1 blkio.weight
                # is CFQ's, gone from this kernel): the weight is set on a
                # parent group of the container's, a sibling of QEMU's
                # (BFQ weighs siblings against each other)
                bfq(sc.loop.dev, True)
                os.makedirs('/sys/fs/cgroup/blkio' + BFQ_CTR, exist_ok=True)
                with open(f'/sys/fs/cgroup/blkio{BFQ_CTR}/blkio.bfq.weight', 'w') as f:
                    f.write('1000')
                move_to_cgroup(sc.vm.g.pid, '/sys/fs/cgroup/blkio/hvbench-vm', 100)
                try:
                    sc.vm.stop_load()
                    sc.vm.start_load()
                    r = sc.phase(name, run_args=['--cgroup-parent', BFQ_CTR])
                finally:
                    move_to_cgroup(sc.vm.g.pid, '/sys/fs/cgroup/blkio')
                    os.rmdir('/sys/fs/cgroup/blkio/hvbench-vm')
                    if sc.fio:
                        sc.fio.stop()
                        sc.fio = None
                    A.remove_cgroup_tree(BFQ_CTR)
                    bfq(sc.loop.dev, False)
                self.record(rnd, r)
        return target

    def qsd_rounds(self, rnd):
        """The VM path through QEMU's block layer alone (no guest CPU): fio
        over NBD into a qemu-storage-daemon, alone and against the
        container.  No arbitrated phase: an export has no BlockBackend
        that query-blockstats lists, so the arbiter has no VM figures."""
        sc = self.sc
        sc.vm.stop_load()
        vm = A.VMPath(self.tmp, sc.loop.dev, name=f'qsd{rnd}')
        try:
            for name in ('VM-path solo', 'VM-path contended'):
                load = vm.load(self.a.seconds + (2 if name.endswith('contended') else 0),
                               qd=4, bs='1M')
                c = None
                if name.endswith('contended'):
                    time.sleep(1)
                    c = A.container(self.tmp, sc.ctr, sc.loop.dev, self.a.seconds).result()
                v = A.fio_result(load)
                self.record(rnd, dict(phase=name, container=c,
                                      vm=dict(bps=v['iops'] * (1 << 20), iops=v['iops'],
                                              p99_ms=v['p99_ms'])))
        finally:
            vm.stop()

    def cpu_part(self):
        """The guest's 1 MiB direct reads from a null-co disk: the rate its
        emulated CPU allows with no device behind it."""
        g = A.Guest('nullvm', self.tmp('logs'), mem='256M', redis=False, balloon=False, args=[
            '-blockdev', 'null-co,node-name=n,size=268435456,read-zeroes=off',
            '-device', 'virtio-blk-pci,drive=n,id=disk0'])
        g.boot()
        try:
            t0 = time.monotonic()
            out = g.run('dd if=/dev/vda of=/dev/null bs=1M count=256 iflag=direct 2>&1',
                        timeout=300)
            dt = time.monotonic() - t0
            return 256 * (1 << 20) / dt, out
        finally:
            g.shutdown()

    def run(self):
        gap = self.calibrate()
        self.gap = gap
        for rnd in range(self.a.rounds):
            target = self.round(rnd, gap)
            if self.a.vm_path:
                self.qsd_rounds(rnd)
        try:
            self.cpu_bps, _ = self.cpu_part()
        except Exception as e:          # the rounds' figures still get written
            print(f'CPU part: {e}', file=sys.stderr)
            self.cpu_bps = None

    def close(self):
        self.sc.close()
        self.tmp.cleanup()

    # -- report --

    def write(self, out, measured=None):
        a, gap = self.a, self.gap
        measured = measured or time.strftime('%Y-%m-%d %H:%M')
        names = in_run_order(self.rows, 'phase')
        lines = ['# VMs and containers on one device: the I/O arbiter', '',
                 f'Measured {measured} by `bench/arbiter.py` '
                 f'({" ".join(getattr(a, "argv", None) or []) or "defaults"}): {a.rounds} interleaved rounds of '
                 f'{a.seconds} s phases, mean +- 95 % CI.  A loop device (direct I/O) on a '
                 f'{a.size_mib} MiB file of this machine\'s disk; the VM: a TCG guest streaming '
                 '1 MiB O_DIRECT reads from its virtio-blk disk on that device; the container: '
                 'fio 4 KiB random reads at QD4 in a podman container (runc, cgroup v1 '
                 'blkio), which the arbiter finds by its name.  '
                 'Work W = (container bytes + gap x VM bytes) / 4 KiB a second, '
                 f'gap = {gap:.2f} (calibration below).  Target: the container\'s p99 at '
                 'most 2 x its solo p99 of the round (0.5 ms at least); the arbiter is told '
                 f'{a.target_x:g} x its probe\'s solo p90 (the least of the round\'s two solo phases).  The '
                 'VM-path rows drive 1 MiB reads at QD4 through a qemu-storage-daemon '
                 '(NBD) instead of the guest: the block layer without the guest\'s CPU.', '',
                 '| configuration | container IOPS | container p50 (ms) | container p99 (ms) '
                 '| VM MB/s | VM p99 (ms) | work (4 KiB/s) |', '|---' * 7 + '|']

        def cell(xs, f='{:.0f}', scale=1):
            m, h = ci([x * scale if x is not None else None for x in xs])
            if m is None:
                return '-'
            return f.format(m) + (f' +- {f.format(h)}' if h is not None else '')

        summary = {}
        for n in names:
            rs = [r for r in self.rows if r['phase'] == n]
            cs = [r['container'] for r in rs if r['container']]
            vs = [r['vm'] for r in rs if r['vm']]
            ws = [S.work(r, gap) for r in rs]
            summary[n] = dict(work=ci(ws), p99=ci([c['p99_ms'] for c in cs]),
                              iops=ci([c['iops'] for c in cs]),
                              vm=ci([v['bps'] for v in vs]))
            lines.append(f'| {n} | {cell([c["iops"] for c in cs]) if cs else "-"} | '
                         f'{cell([c["p50_ms"] for c in cs], "{:.2f}") if cs else "-"} | '
                         f'{cell([c["p99_ms"] for c in cs], "{:.2f}") if cs else "-"} | '
                         f'{cell([v["bps"] for v in vs], "{:.1f}", 1 / MB) if vs else "-"} | '
                         f'{cell([v["p99_ms"] for v in vs], "{:.1f}") if vs else "-"} | '
                         f'{cell(ws)} |')
        lines.append('')
        targets = [r['target_ms'] for r in self.rows if r['phase'] == 'arbitrated']
        lines += ['## Against the issue', '']
        rows = []
        s = summary
        if 'contended' in s and 'container solo' in s:
            rows.append(('container IOPS, contended / solo (the design\'s drop)',
                         f'{s["contended"]["iops"][0] / s["container solo"]["iops"][0]:.2f}x', '< 1'))
        if 'arbitrated' in s:
            rows.append(('container p99 arbitrated / target',
                         f'{s["arbitrated"]["p99"][0]:.2f} / {statistics.mean(targets):.2f} ms',
                         '<= 1'))
            arb = [r for r in self.rows if r['phase'] == 'arbitrated']
            within = sum(1 for r in arb if r['container']['p99_ms'] <= r['target_ms'])
            rows.append(('rounds with the arbitrated p99 within that round\'s target',
                         f'{within} of {len(arb)}', 'all'))
            ok = [n for n in s if n.startswith('static') and s[n]['p99'][0] is not None
                  and s[n]['p99'][0] <= statistics.mean(targets)]
            if ok:
                best = max(ok, key=lambda n: s[n]['work'][0])
                rows.append((f'work arbitrated / best static meeting the target ({best})',
                             f'{s["arbitrated"]["work"][0] / s[best]["work"][0]:.2f}x', '>= 1'))
            else:
                rows.append(('work, best static meeting the target', 'no static setting met it',
                             ''))
            # paired, round by round: the arbiter against the best static
            # setting that met that round's own target
            ratios = []
            for r in arb:
                st = [x for x in self.rows if x['round'] == r['round'] and
                      x['phase'].startswith('static') and
                      x['container']['p99_ms'] <= r['target_ms']]
                if st:
                    ratios.append(S.work(r, gap) / max(S.work(x, gap) for x in st))
            if ratios:
                gm, lo, hi = geo_mean_ci(ratios)
                band = '' if math.isnan(lo) else f' [{lo:.2f}, {hi:.2f}]'
                rows.append(('per round: work arbitrated / best static meeting that round\'s '
                             'target (geometric mean, 95 % CI; each round)',
                             f'{gm:.2f}x{band}; ' + ', '.join(f'{x:.2f}' for x in ratios),
                             '>= 1'))
        if 'contended (A/A)' in s:
            rows.append(('A/A: contended / contended again, container IOPS',
                         f'{s["contended"]["iops"][0] / s["contended (A/A)"]["iops"][0]:.2f}x',
                         'about 1'))
        if 'VM solo' in s and self.cpu_bps:
            rows.append(('CPU part: the guest alone on the device / on null-co (no device)',
                         f'{s["VM solo"]["vm"][0] / MB:.0f} / {self.cpu_bps / MB:.0f} MB/s', ''))
        lines += ['| measure | value | target |', '|---|---|---|']
        lines += [f'| {x} | {y} | {z} |' for x, y, z in rows]
        lines += ['', '## Calibration (hvarbiter calibrate, this device)', '', '```',
                  self.model.table(), '```', '']
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, 'arbiter.md'), 'w') as f:
            f.write('\n'.join(lines))
        with open(os.path.join(out, 'arbiter.json'), 'w') as f:
            json.dump(dict(args=vars(a), measured=measured, gap=gap, cpu_bps=self.cpu_bps,
                           rows=self.rows,
                           model=self.model.points), f, indent=1)
        self.chart(os.path.join(out, 'arbiter.png'), names, summary)
        print('\n'.join(lines))

    def chart(self, path, names, s):
        plt = charts.pyplot()
        if not plt:
            return
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        for ax, key, label, scale in ((axes[0], 'iops', 'container IOPS', 1),
                                      (axes[1], 'p99', 'container p99 (ms)', 1),
                                      (axes[2], 'vm', 'VM MB/s', 1 / MB)):
            # every panel has every row (the labels are the first's)
            vals = [(s[n][key][0] or 0) * scale for n in names]
            errs = [(s[n][key][1] or 0) * scale for n in names]
            ax.barh(names, vals, xerr=errs, color='#4c72b0')
            ax.set_xlabel(label)
            ax.invert_yaxis()
            ax.grid(axis='x', alpha=0.3)
        for ax in axes[1:]:
            ax.set_yticklabels([])
        charts.save(fig, path, dpi=110)


def render(a):
    """The report of an earlier run, from its JSON (no measurement)."""
    with open(a.render) as f:
        d = json.load(f)
    b = Bench.__new__(Bench)
    b.a = argparse.Namespace(**d['args'])
    b.rows, b.gap, b.cpu_bps = d['rows'], d['gap'], d['cpu_bps']
    b.model = Model(None, d['model'], None)
    measured = d.get('measured')
    b.write(a.out, measured)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--seconds', type=int, default=5)
    ap.add_argument('--size-mib', type=int, default=512)
    ap.add_argument('--statics', default='8,32,64,128', help='MB/s, comma-separated')
    ap.add_argument('--target-x', type=float, default=1.5)
    ap.add_argument('--no-vm-path', dest='vm_path', action='store_false')
    ap.add_argument('--out', default=os.path.join(REPO, 'docs', 'bench'))
    ap.add_argument('--render', metavar='JSON',
                    help='write the table and chart again from a run\'s arbiter.json')
    a = ap.parse_args()
    if a.render:
        render(a)
        return
    a.argv = sys.argv[1:]
    a.statics = [int(x) for x in a.statics.split(',') if x]
    why = A.unavailable()
    if why:
        sys.exit(f'arbiter bench: {why}')
    b = Bench(a)
    try:
        b.run()
        b.write(a.out)
    finally:
        b.close()


if __name__ == '__main__':
    main()
