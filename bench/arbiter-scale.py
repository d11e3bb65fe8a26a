#!/usr/bin/env python3
"""The arbiter's reaction time and cost, and how they grow (issue 40,
target 5 and the arbiter's growth chart).

Target 5: "time from a container's burst to the first cut at most two
periods; over a 60 s contended run, the container's p99 within target in at
least 95 % of one-second windows; the daemon's own CPU at most 2 % of a
core at a 100 ms period."  Growth chart: "arbiter: CPU and reaction time
against 1-32 VMs and containers."

The pieces of bench/arbiter.py (arbiter/tests/scenario.py, arblib.py): a
loop device with direct I/O on a file of this machine's disk; the VM, a
TCG guest whose virtio-blk disk is that device behind throttle group tg0,
streaming 1 MiB O_DIRECT reads; the container, a podman container (runc,
cgroup v1 blkio) that the arbiter finds by its name.  Here the container
(the "burster") waits on a FIFO and, each time it is told, runs fio for a
given time: 4 KiB random reads at QD4, every completion's latency logged
with its time (fio's clat log, Unix-epoch milliseconds).  The arbiter runs
at a 100 ms period.

- Targets, each round: the container alone twice (the arbiter watching
  at an unreachable target, the VM idle), the VM alone and both between
  them.  The container's target: its p99 at most 2 x its solo p99 (the
  less of the two; 0.5 ms at least), as in bench/arbiter.py; in the 60 s
  runs the arbiter is told --target-x times its probe's solo p90 (the
  least of the two phases).  The bursts' points tell it BURST_TARGET_MS
  (0.05 ms, under any latency the probe sees: a burst is to be cut at
  once, and the arbiter's own delay is what is measured); the mid-target
  point the geometric mean of the probe's p90 with the VM alone and with
  both (the VM alone is under it: the burst has to move the probe).
- Reaction: with the VM streaming and every container idle (so the
  arbiter idles, the VM at its default limits), the burster starts a
  burst; the burst's start is its first request's submission (the first
  completions' times less their latencies, in fio's log), the first cut
  the moment the guest's throttle group stops being at its default
  (qom-get of its limits every --poll-ms through the bench's own
  monitor), and, apart, the time of the first `cut` in the decision log.
  In periods of 100 ms.  --bursts bursts of --burst-s seconds per point,
  each after the VM is back at its default.
- The 60 s contended run: the VM streaming and the burster running fio
  for --long-s seconds, with the arbiter (twice: the A/A pair) and without
  it (once); the container's p99 in each one-second window of its clat
  log (from its first request), against the target.  The daemon's CPU
  over the run.
- CPU: the daemon's utime + stime (/proc/PID/stat: every thread of the
  process), as % of one core, and per period; apart, its helpers' (the
  probe process, the watchdog, podman events, the podman inspects it
  ran): /proc of its live descendants and its reaped children's counts.
  At every point over --idle-s seconds with the VM streaming and the
  containers idle ("idle"), and over the bursts ("bursts").
- Growth: the arbiter managing N VMs and N containers, N in --counts
  (1 2 4 8 16 32).  VM 0 is the TCG guest; VMs 1..N-1 are stand-ins:
  qemu-system-x86_64 -M none, a BlockBackend disk0 on the same device
  behind a throttle group tg0 and a QMP monitor of the arbiter's own
  (arblib.StandInVM).  The arbiter reaches a stand-in exactly as it
  reaches the guest (attach, query-blockstats each period, qom-set of the
  group's limits), but nothing does I/O through it: two cores cannot run
  32 TCG guests, and an NBD export's I/O goes through a BlockBackend of
  its own that query-blockstats does not list.  Container 0 is the
  burster, containers 1..N-1 real podman containers running `sleep
  infinity` (no I/O), each found by its podman name.  The 31 stand-ins
  and 31 sleepers run throughout; a point's configuration names N of each.
- Rounds (--rounds): every point once per round, in an order rotated from
  round to round (bench/pooled_stats.py), the first point (N = 1) twice
  (the A/A control: the same configuration run twice) and once with the
  mid-target; then one 60 s run (arbitrated, uncontrolled, arbitrated
  again, ... by round).

QEMU comes from $HYBRIDVM_BUILD (default <repo>/build): on a machine where
other jobs rebuild the tree, point it at a copy of the build (its bin/,
guest/, qemu-src/python, and podman/ with the image's tar) so that the
binaries do not change under a run.

Writes arbiter-scale.{md,json,png} (--name) in --out (default docs/bench).
Needs root.  Usage:
  bench/arbiter-scale.py [--rounds 3] [--counts 1,2,4,8,16,32] [--out DIR]
  bench/arbiter-scale.py --report-only docs/bench/arbiter-scale.json \
      --notes docs/bench/arbiter-scale-notes.md      (and --name for the others)
  bench/arbiter-scale.py --quick        (a smoke run; /tmp/arbiter-scale-quick)
"""

import argparse
import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'arbiter', 'tests'))
import arblib as A          # noqa: E402
import scenario as S        # noqa: E402
import charts               # noqa: E402
from pooled_stats import linear_fit, mean, mean_ci, rotated   # noqa: E402
from procstat import tree_cpu_s                   # noqa: E402
from saved_runs import add_report_args, load_saved   # noqa: E402

PERIOD_MS = 100
# The growth points' target: the least the configuration takes, under any
# latency the probe sees here, so that a burst is to be cut as soon as the
# containers' counters show it: the arbiter's own delay is what is measured
BURST_TARGET_MS = 0.05
# the mid-target point only where the probe with the VM and the burst is this
# many times its latency with the VM alone (else no target lies between)
MID_MIN = 1.5


def ci(xs):
    """dict(mean, ci, n) of the values present (ci None for one)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    m, h = mean_ci(xs)
    return dict(mean=m, ci=None if math.isnan(h) else h, n=len(xs))


def fmt(c, digits=1, scale=1.0):
    if c is None:
        return '-'
    m = c['mean'] * scale
    return f'{m:.{digits}f}' + ('' if c['ci'] is None else f' ± {c["ci"] * scale:.{digits}f}')


def pctl(sorted_xs, q):
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


class Burster:
    """fio in a podman container of the tests' image, run each time it is
    told through a FIFO in a directory bind-mounted at /out: `go(S)` starts
    S seconds of 4 KiB random reads at QD4 on the device (O_DIRECT,
    libaio), fio's JSON and its clat log (one line per completion: Unix
    time in ms, latency in ns) written to /out/bI.*; `wait(I)` waits for
    burst I's end."""

    def __init__(self, tmp, name, dev, qd=4, bs='4k'):
        self.pm, self.name = A.podman(), name
        self.out = tmp(f'{name}-out')
        os.makedirs(self.out, exist_ok=True)
        self.fifo = os.path.join(self.out, 'go')
        os.mkfifo(self.fifo)
        fio = (f'fio --name=b --filename={dev} --direct=1 --ioengine=libaio --rw=randread '
               f'--bs={bs} --iodepth={qd} --time_based=1 --runtime=$s '
               '--disable_lat=1 --disable_slat=1 --write_lat_log=/out/b$i --log_unix_epoch=1 '
               '--output-format=json --output=/out/b$i.json')
        # fio --version before each wait: fio's pages in the page cache when
        # the burst starts, so that its start stalls on no read of the
        # host's disk (which the container's PSI would count)
        script = (f'i=0; while fio --version >/dev/null && read -r s < /out/go; do '
                  f'{fio} 2>/out/b$i.err; '
                  'echo $? >/out/b$i.tmp; mv /out/b$i.tmp /out/b$i.rc; i=$((i+1)); done')
        self.pm.rm(name)
        self.pm.run('run', '-d', '--name', name, '--network', 'none', '--device', dev,
                    '-v', f'{self.out}:/out', self.pm.image(), 'sh', '-c', script)
        self.n = 0

    def go(self, seconds):
        """Start a burst of @seconds; returns its number."""
        deadline = time.monotonic() + 10
        while True:
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:        # ENXIO: the shell is not reading yet
                if e.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        try:
            os.write(fd, f'{int(seconds)}\n'.encode())
        finally:
            os.close(fd)
        self.n += 1
        return self.n - 1

    def path(self, i, what):
        return os.path.join(self.out, f'b{i}{what}')

    def wait(self, i, timeout):
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path(i, '.rc')):
            if time.monotonic() > deadline:
                raise AssertionError(f'{self.name}: burst {i} still runs after {timeout} s')
            time.sleep(0.05)
        with open(self.path(i, '.rc')) as f:
            rc = f.read().strip()
        if rc != '0':
            with open(self.path(i, '.err')) as f:
                raise AssertionError(f'{self.name}: burst {i}: fio failed ({rc}): '
                                     f'{f.read()[-500:]}')

    def result(self, i):
        with open(self.path(i, '.json')) as f:
            return A.parse_fio(f.read())

    def clat(self, i):
        """[(completion time s, latency s)] of burst i, in time order, and
        the burst's start: its first submission (the earliest completion
        time less its latency, among the first 64)."""
        out = []
        with open(self.path(i, '_clat.1.log')) as f:
            for line in f:
                t, ns = line.split(',', 2)[:2]
                out.append((int(t) / 1e3, int(ns) / 1e9))
        out.sort()
        start = min(t - lat for t, lat in out[:64])
        return start, out

    def drop(self, i):
        """Remove burst i's files (a 60 s clat log is tens of MB)."""
        for what in ('_clat.1.log', '.json', '.rc', '.err'):
            try:
                os.unlink(self.path(i, what))
            except FileNotFoundError:
                pass

    def stop(self):
        self.pm.rm(self.name)


class LimitPoller(threading.Thread):
    """The guest's throttle group limits, read every @every seconds through
    the bench's own monitor (qom-get): each change (iops-total, bps-total)
    with the time it was seen, the midpoint between the reply that showed
    it and the one before."""

    def __init__(self, guest, every):
        super().__init__(name='limit-poller', daemon=True)
        self.guest, self.every = guest, every
        self.changes = []
        self.polls = 0
        self.stop_ev = threading.Event()
        self.error = None

    def run(self):
        last, t_last = None, None
        try:
            while not self.stop_ev.is_set():
                lim = self.guest.g.qmp('qom-get', path='/objects/tg0', property='limits')
                t = time.time()
                self.polls += 1
                v = (lim['iops-total'], lim['bps-total'])
                if v != last:
                    self.changes.append(((t + t_last) / 2 if t_last else t, v))
                    last = v
                t_last = t
                self.stop_ev.wait(self.every)
        except Exception as e:      # the trial is marked, the run goes on
            self.error = f'{type(e).__name__}: {e}'

    def stop(self):
        self.stop_ev.set()
        self.join(5)


class CPUMeter:
    """The daemon's CPU from now to read(), with its periods in the decision
    log over that time (the daemon is not asked anything)."""

    def __init__(self, d, n):
        self.d, self.n = d, n
        self.own, self.desc = tree_cpu_s(d.proc.pid)
        self.log0 = self.log_bytes()
        self.w0, self.t0 = time.monotonic(), time.time()

    def log_bytes(self):
        try:
            return os.path.getsize(self.d.log_path)
        except OSError:
            return None

    def read(self):
        own, desc = tree_cpu_s(self.d.proc.pid)
        own, desc = own - self.own, desc - self.desc
        wall, t1 = time.monotonic() - self.w0, time.time()
        recs = [r for r in self.d.records() if 'action' in r and self.t0 <= r['t'] < t1]
        periods = len(recs)
        gaps = [b['t'] - a['t'] for a, b in zip(recs, recs[1:])]
        late = sum(1 for r in recs for v in r.get('vms', {}).values() if v.get('late'))
        missing = sum(max(0, self.n - len(r.get('vms', {}))) for r in recs)
        log1 = self.log_bytes()
        return dict(wall_s=wall, own_s=own, helpers_s=desc, periods=periods,
                    log_bytes_per_period=(log1 - self.log0) / periods
                    if periods and log1 is not None and self.log0 is not None
                    and log1 >= self.log0 else None,
                    cpu_pct=100 * own / wall, helpers_pct=100 * desc / wall,
                    per_period_ms=1e3 * own / periods if periods else None,
                    period_ms=1e3 * mean(gaps) if gaps else None,
                    period_max_ms=1e3 * max(gaps) if gaps else None,
                    late=late, missing=missing)


class Bench:
    def __init__(self, a):
        self.a = a
        self.tmp = A.H.TempDir()
        self.sc = None
        self.standins, self.sleepers, self.burster = [], [], None
        self.points, self.trials, self.long_runs, self.bases = [], [], [], []
        self.seq = 0
        self.pm = A.podman()

    # -- set-up --

    def setup(self):
        a = self.a
        self.sc = S.Scenario(self.tmp, size_mib=a.size_mib, secs=a.solo_s)
        self.sc.vm.histogram()
        top = max(a.counts)
        t0 = time.monotonic()
        for i in range(1, top):
            self.standins.append(A.StandInVM(self.tmp, self.sc.loop.dev, f'vm{i}'))
        self.standin_s = time.monotonic() - t0
        t0 = time.monotonic()
        tag = os.getpid()
        for i in range(1, top):
            name = f'arbs-idle{i}-{tag}'
            self.pm.rm(name)
            self.pm.run('run', '-d', '--name', name, '--network', 'none', self.pm.image(),
                        'sleep', 'infinity')
            self.sleepers.append(name)
        self.sleeper_s = time.monotonic() - t0
        self.burster = Burster(self.tmp, f'arbs-burst-{tag}', self.sc.loop.dev)
        print(f'set-up: {top - 1} stand-ins in {self.standin_s:.1f} s, {top - 1} idle '
              f'containers in {self.sleeper_s:.1f} s', file=sys.stderr)

    def close(self):
        if self.burster:
            self.burster.stop()
        if self.sleepers:
            self.pm.rm(*self.sleepers)
        for s in self.standins:
            try:
                s.stop()
            except Exception as e:     # noqa: BLE001 -- the rest still go
                print(f'stand-in {s.name}: {e}', file=sys.stderr)
        if self.sc:
            self.sc.close()
        self.tmp.cleanup()

    def watched(self, name, container=True, vm=True):
        """A phase with the arbiter watching at a target it never reaches
        (it only measures): the phase's figures, and the median over its
        periods of the probe's latency at the target percentile."""
        sc = self.sc
        d = sc.start_arbiter(10000.0)
        try:
            r = sc.phase(name, container=container, vm=vm)
            lat = sorted(x['container']['lat_ms'] for x in d.records()
                         if x.get('action') and x['container'].get('lat_ms') is not None
                         and (x['container'].get('iops', 0) > 0 or not container))
        finally:
            sc.stop_arbiter()
        r['probe_ms'] = lat[len(lat) // 2] if lat else None
        return r

    def baseline(self, rnd):
        """The round's targets: the container alone twice (the VM idle),
        the VM alone and both (no arbiter acting) between them: the
        container's p99 target and the arbiter's (in its probe's terms),
        and the probe's latency with the VM alone and with both, for the
        mid-target point."""
        sc = self.sc
        solo = self.watched('container solo', vm=False)
        vm_only = self.watched('VM solo', container=False)
        contended = self.watched('contended')
        again = self.watched('container solo again', vm=False)
        sc.vm.start_load()
        # the least of two: the host's noise only ever adds to a latency
        probe_ms = sc.probe_baseline(solo, again)
        p99 = min(solo['container']['p99_ms'], again['container']['p99_ms'])
        self.base = dict(round=rnd, solo=solo, vm_only=vm_only, contended=contended, again=again,
                         probe_ms=probe_ms, target_ms=max(0.5, 2 * p99),
                         arbiter_target_ms=self.a.target_x * (probe_ms or p99))
        # the bursts' target: under any latency the probe sees
        self.base['burst_target_ms'] = BURST_TARGET_MS
        # between the probe's latency with the VM alone and with both: the
        # VM alone does not put the probe over it, the burst must
        if vm_only['probe_ms'] and contended['probe_ms'] and \
                contended['probe_ms'] > MID_MIN * vm_only['probe_ms']:
            self.base['mid_target_ms'] = math.sqrt(vm_only['probe_ms'] * contended['probe_ms'])
        for r in (solo, vm_only, contended, again):
            c = r['container']
            print(f'{r["phase"]:>22}: '
                  + (f'container {c["iops"]:7.0f} IOPS p99 {c["p99_ms"]:.2f} ms, ' if c else '')
                  + (f'probe p90 {r["probe_ms"]:.2f} ms' if r.get('probe_ms') else '')
                  + (f', VM {r["vm"]["bps"] / 1e6:.0f} MB/s' if r.get('vm') else ''),
                  file=sys.stderr)
        self.bases.append(self.base)
        print(f'round {rnd} targets: container p99 {self.base["target_ms"]:.2f} ms, '
              'arbiter (probe p90) '
              f'{self.base["arbiter_target_ms"]:.2f} ms, bursts '
              f'{self.base.get("burst_target_ms") or 0:.2f} ms, mid '
              f'{self.base.get("mid_target_ms") or 0:.2f} ms', file=sys.stderr)

    # -- the arbiter over N VMs and N containers --

    def start(self, n, target_ms=None):
        self.seq += 1
        state = f'p{self.seq}'
        vms = [('vm0', self.sc.vm.qmp_path)] + [(s.name, s.qmp_path)
                                                for s in self.standins[:n - 1]]
        ctrs = [self.burster.name] + self.sleepers[:n - 1]
        conf = A.config(self.tmp, self.sc.loop.dev, vms, ctrs,
                        target_ms=round(target_ms or self.base['arbiter_target_ms'], 4),
                        period_ms=PERIOD_MS, state=state, extra_device='gap = 1.0\n',
                        extra_vm='device = disk0\n')
        t0 = time.monotonic()
        d = A.Daemon(conf, self.tmp, state=state)
        d.target_ms = round(target_ms or self.base['arbiter_target_ms'], 4)
        try:
            d.wait(lambda s: len(s.get('vm_state', {})) == n
                   and all(v['state'] == 'ok' for v in s['vm_state'].values())
                   and all(c['state'] == 'found' for c in s.get('podman', {}).values()),
                   timeout=180, what=f'{n} VMs attached and {n} containers found')
        except BaseException:
            d.close()
            raise
        return d, time.monotonic() - t0

    def stop(self, d):
        try:
            d.terminate()
        finally:
            d.close()

    def guest_limits(self):
        lim = self.sc.vm.g.qmp('qom-get', path='/objects/tg0', property='limits')
        return lim['iops-total'], lim['bps-total']

    def cpu_window(self, d, n, seconds):
        """The daemon's CPU over @seconds as it runs (no request to it)."""
        meter = CPUMeter(d, n)
        time.sleep(seconds)
        return meter.read()

    def trial(self, d, n, rnd, k):
        """One burst: the VM at its default and the containers idle first."""
        a = self.a
        A.wait_for(self.guest_limits, lambda v: v == (0, 0), 30,
                   'the guest back at its default limits', check=d.check_alive)
        time.sleep(a.quiet_s)
        poller = LimitPoller(self.sc.vm, a.poll_ms / 1000)
        poller.start()
        time.sleep(0.05)
        trigger = time.time()
        i = self.burster.go(a.burst_s)
        try:
            self.burster.wait(i, a.burst_s + 60)
        finally:
            time.sleep(0.1)
            poller.stop()
        start, clat = self.burster.clat(i)
        res = self.burster.result(i)
        self.burster.drop(i)
        # the first cut after the trigger; one before the burst's first I/O
        # on the device was made on the container's I/O stall (PSI) as fio
        # started: 'early', left out of the reaction times and counted
        cuts = [(t, v) for t, v in poller.changes if v != (0, 0)]
        if poller.changes and poller.changes[0][1] != (0, 0):
            print(f'  N={n:2d} burst {k}: the guest was not at its default when it began',
                  file=sys.stderr)
        applied = next((t for t, v in cuts if t >= trigger), None)
        recs = [r for r in d.records() if r.get('action') == 'cut' and r['t'] >= trigger]
        decided = recs[0]['t'] if recs else None
        early = applied is not None and applied < start
        first = recs[0] if recs else {}
        before = [r for r in d.records() if 'action' in r and r['t'] < trigger]
        t = dict(n=n, round=rnd, k=k, trigger=trigger,
                 probe_before_ms=before[-1]['container'].get('lat_ms') if before else None,
                 target_ms=d.target_ms, start=start, applied=applied,
                 decided=decided, early=early, polls=poller.polls, poll_error=poller.error,
                 reaction_s=None if applied is None or early else applied - start,
                 decision_s=None if decided is None or early else decided - start,
                 start_s=start - trigger, pressure_at_cut=first.get('container', {}).get(
                     'pressure'),
                 probe_ms=first.get('container', {}).get('lat_ms'),
                 container_iops_at_cut=first.get('container', {}).get('iops'),
                 limit_at_cut=(cuts[0][1] if cuts else None),
                 burst=dict(iops=res['iops'], p99_ms=res['p99_ms'], n=len(clat)))
        self.trials.append(t)
        rp = t['reaction_s']
        print(f'  N={n:2d} burst {k}: reaction '
              + (f'{rp * 1e3:6.1f} ms ({rp * 1e3 / PERIOD_MS:.2f} periods)' if rp is not None
                 else 'no cut' if applied is None else
                 f'{(applied - start) * 1e3:.0f} ms (a cut before its first I/O)') +
              (f', decision {t["decision_s"] * 1e3:6.1f} ms' if t['decision_s'] else '') +
              (f', probe {t["probe_ms"]:.2f} ms' if t['probe_ms'] else '') +
              f', fio started {t["start_s"] * 1e3:.0f} ms after the trigger', file=sys.stderr)
        return t

    def point(self, n, label, rnd):
        target = self.base.get('mid_target_ms') if label.endswith('mid-target') \
            else self.base.get('burst_target_ms')
        d, ready_s = self.start(n, target)
        pid = d.proc.pid
        try:
            time.sleep(self.a.settle_s)
            idle = self.cpu_window(d, n, self.a.idle_s)
            meter = CPUMeter(d, n)
            trials = [self.trial(d, n, rnd, k) for k in range(self.a.bursts)]
            bursts = meter.read()
            rss = A.H.run('ps', '-o', 'rss=', '-p', str(pid)).stdout.strip()
        finally:
            self.stop(d)
        row = dict(n=n, label=label, round=rnd, ready_s=ready_s, idle=idle, bursts=bursts,
                   early=sum(1 for t in trials if t['early']),
                   no_cut=sum(1 for t in trials if t['applied'] is None),
                   target_ms=target or self.base['arbiter_target_ms'],
                   rss_kib=int(rss) if rss.isdigit() else None,
                   reactions=[t['reaction_s'] for t in trials],
                   decisions=[t['decision_s'] for t in trials],
                   load=os.getloadavg()[0])
        self.points.append(row)
        print(f'round {rnd} {label:>8}: ready {ready_s:.1f} s, CPU idle {idle["cpu_pct"]:.2f} % '
              f'({idle["per_period_ms"] or 0:.2f} ms/period, period {idle["period_ms"] or 0:.0f} '
              f'ms), bursts {bursts["cpu_pct"]:.2f} %, helpers {idle["helpers_pct"]:.2f} %',
              file=sys.stderr)
        return row

    def long_run(self, rnd, arbitrated):
        """The 60 s contended run (N = 1)."""
        a = self.a
        d = None
        label = 'arbitrated' if arbitrated else 'uncontrolled'
        if arbitrated:
            d, _ = self.start(1)
            time.sleep(a.settle_s)
        cpu = actions = None
        try:
            meter = CPUMeter(d, 1) if d else None
            t0 = time.time()
            self.sc.vm.histogram()
            v0 = self.sc.vm.sample()
            i = self.burster.go(a.long_s)
            self.burster.wait(i, a.long_s + 120)
            vm = S.vm_rates(v0, self.sc.vm.sample())
            if d:
                cpu = meter.read()
                actions = {}
                for r in d.records():
                    if 'action' in r and t0 <= r['t']:
                        actions[r['action']] = actions.get(r['action'], 0) + 1
        finally:
            if d:
                self.stop(d)
        start, clat = self.burster.clat(i)
        res = self.burster.result(i)
        self.burster.drop(i)
        wins = [[] for _ in range(int(a.long_s))]
        for t, lat in clat:
            k = int(t - start)
            if 0 <= k < len(wins):
                wins[k].append(lat)
        p99 = []
        for w in wins:
            w.sort()
            p99.append(pctl(w, 0.99) * 1e3 if len(w) >= 100 else None)
        target = self.base['target_ms']
        counted = [x for x in p99 if x is not None]
        within = sum(1 for x in counted if x <= target)
        run = dict(label=label, round=rnd, p99_ms=p99, target_ms=target,
                   within=within, windows=len(counted),
                   share=within / len(counted) if counted else None,
                   iops=res['iops'], fio_p99_ms=res['p99_ms'], cpu=cpu, vm=vm,
                   actions=actions, load=os.getloadavg()[0])
        self.long_runs.append(run)
        print(f'round {rnd} 60 s {label}: p99 within {target:.2f} ms in {within} of '
              f'{len(counted)} windows; fio p99 {res["p99_ms"]:.2f} ms, {res["iops"]:.0f} IOPS'
              + (f'; daemon CPU {cpu["cpu_pct"]:.2f} %' if cpu else ''), file=sys.stderr)
        return run

    def run(self):
        a = self.a
        self.t_begin = time.time()
        self.setup()
        base = [(n, f'N={n}') for n in a.counts] + [(a.counts[0], f'N={a.counts[0]} A/A')]
        if a.mid_target:
            base.append((a.counts[0], f'N={a.counts[0]} mid-target'))
        long_order = [True, False]
        for rnd in range(a.rounds):
            self.baseline(rnd)
            for n, label in rotated(base, rnd):
                if label.endswith('mid-target') and not self.base.get('mid_target_ms'):
                    print(f'round {rnd} {label}: no target between the probe\'s latency with '
                          'the VM alone and with both', file=sys.stderr)
                    continue
                self.point(n, label, rnd)
            if a.long_s:
                self.long_run(rnd, long_order[rnd % 2])
        self.t_end = time.time()

    # -- report --

    def data(self):
        end = getattr(self, 't_end', None) or time.time()
        return dict(args=vars(self.a), measured=time.strftime('%Y-%m-%d %H:%M',
                                                               time.localtime(self.t_begin)),
                    wall_s=end - self.t_begin, commit=commit(),
                    build=os.environ.get('HYBRIDVM_BUILD'),
                    bases=self.bases, points=self.points, trials=self.trials,
                    long_runs=self.long_runs, standin_s=self.standin_s,
                    sleeper_s=self.sleeper_s, loadavg_end=os.getloadavg())


def commit():
    r = subprocess.run(['git', '-C', REPO, 'rev-parse', '--short=12', 'HEAD'],
                       capture_output=True, text=True)
    return r.stdout.strip() or None


# -- the report, from the data alone (--report-only writes it again) --

def summarise(d):
    """Per label: the means and 95 % intervals over the rounds (CPU) and
    over every burst (reaction)."""
    out = {}
    for p in d['points']:
        e = out.setdefault(p['label'], dict(n=p['n'], rows=[]))
        e['rows'].append(p)
    for label, e in out.items():
        rows = e['rows']
        for state in ('idle', 'bursts'):
            for k in ('cpu_pct', 'helpers_pct', 'per_period_ms', 'period_ms', 'period_max_ms',
                      'log_bytes_per_period'):
                e[f'{state}_{k}'] = ci([r[state].get(k) for r in rows])
            e[f'{state}_late'] = sum(r[state]['late'] for r in rows)
            e[f'{state}_missing'] = sum(r[state]['missing'] or 0 for r in rows)
            e[f'{state}_periods'] = sum(r[state]['periods'] for r in rows)
        react = [x for r in rows for x in r['reactions']]
        e['reaction_periods'] = ci([x * 1e3 / PERIOD_MS for x in react if x is not None])
        e['decision_periods'] = ci([x * 1e3 / PERIOD_MS for r in rows for x in r['decisions']
                                    if x is not None])
        e['bursts'] = len(react)
        e['early'] = sum(r.get('early', 0) for r in rows)
        e['no_cut'] = sum(r.get('no_cut', 0) for r in rows)
        # a cut before the burst's first I/O is within two periods of it
        e['within2'] = e['early'] + sum(1 for x in react if x is not None
                                        and x * 1e3 <= 2 * PERIOD_MS)
        e['reaction_max'] = max((x for x in react if x is not None), default=None)
        e['ready_s'] = ci([r['ready_s'] for r in rows])
        e['rss_mib'] = ci([r['rss_kib'] / 1024 for r in rows if r['rss_kib']])
    return out


def growth_words(pts, unit, cis=None):
    """How a cost grows over [(n, value)] (n ascending, doubling): the line
    a + b n fitted to all the points, the increment per added VM and
    container on each segment, and the verdict: flat (the last within 1.3x
    of the first), linear (from n = 4 on, the segments' increments within
    1.6x of each other), faster or slower than linear, or, where the
    increments change sign, no trend beyond the 95 % intervals (cis, the
    half-widths of the points') or an uneven growth."""
    (n0, v0), (nl, vl) = pts[0], pts[-1]
    if v0 <= 0:
        return 'no figure'
    a, b = linear_fit([n for n, _ in pts], [v for _, v in pts])
    ratio = vl / v0
    slopes = [((na, nb), (vb - va) / (nb - na)) for (na, va), (nb, vb) in zip(pts, pts[1:])]
    txt = ', '.join(f'{x}-{y}: {s:+.3f}' for (x, y), s in slopes)
    fit = f'fitted {a:.2f} + {b:.3f} N {unit}'
    if ratio < 1.3:
        return f'flat: x{ratio:.2f} from {n0} to {nl} ({fit}; per added pair, {txt})'
    big = [s for (x, y), s in slopes if x >= 4]
    if big and min(big) > 0 and max(big) / min(big) <= 1.6:
        verdict = (f'linear from N = 4 on (the increment per added pair stays within '
                   f'{max(big) / min(big):.1f}x), a fixed part of {a:.2f} {unit} below it')
    elif big and min(big) > 0:
        verdict = ('faster than linear: the increment per added pair grows '
                   if big[-1] > big[0] else
                   'less than linear: the increment per added pair shrinks ') + \
            f'{big[-1] / big[0]:.1f}x between the segment from 4 and the last'
    elif cis and abs(vl - v0) <= (cis[0] or 0) + (cis[-1] or 0):
        verdict = (f'no trend beyond the intervals (the first {v0:.2f} ± {cis[0] or 0:.2f}, '
                   f'the last {vl:.2f} ± {cis[-1] or 0:.2f})')
    else:
        verdict = 'it grows, unevenly'
    return f'x{ratio:.2f} from {n0} to {nl}; {verdict} ({fit}; per added pair, {txt})'


def verdict(words):
    """growth_words' verdict in a word or two, for a chart's title."""
    if 'linear from' in words:
        return 'linear'
    if words.startswith('flat') or 'no trend' in words:
        return 'flat'
    return 'faster than linear' if 'faster' in words else 'not linear'


def growth_reading(d, s, counts, rows_n):
    """The Reading's lines on how the points grow with N."""
    lines = []
    cpts = [(n, e['idle_per_period_ms']['mean']) for n, e in zip(counts, rows_n)]
    a0, b0 = linear_fit([n for n, _ in cpts], [v for _, v in cpts])
    lines.append(f'- **Daemon CPU per period** (idle containers): {cpts[0][1]:.2f} ms at N = '
                 f'{counts[0]} ({rows_n[0]["idle_cpu_pct"]["mean"]:.2f} % of a core), '
                 f'{cpts[-1][1]:.2f} ms at N = {counts[-1]} '
                 f'({rows_n[-1]["idle_cpu_pct"]["mean"]:.2f} %): {growth_words(cpts, "ms")}.  '
                 f'On that line, the configuration\'s cap (256 VMs and 256 containers) would '
                 f'cost {a0 + 256 * b0:.0f} ms a period, {(a0 + 256 * b0) / PERIOD_MS * 100:.0f} % '
                 'of a core at a 100 ms period.')
    rpts = [(n, e['reaction_periods']['mean']) for n, e in zip(counts, rows_n)
            if e['reaction_periods']]
    rcis = [e['reaction_periods']['ci'] for e in rows_n if e['reaction_periods']]
    if rpts:
        lags = {}
        for t in d['trials']:
            if t['reaction_s'] is not None and t['decision_s'] is not None and \
                    not t['target_ms'] > BURST_TARGET_MS:
                lags.setdefault(t['n'], []).append((t['reaction_s'] - t['decision_s']) * 1e3)
        med = {n: sorted(v)[len(v) // 2] for n, v in lags.items()}
        lines.append(f'- **Reaction** (burst to the first cut in QEMU): {rpts[0][1]:.2f} periods '
                     f'at N = {counts[0]}, {rpts[-1][1]:.2f} at N = {counts[-1]}: '
                     f'{growth_words(rpts, "periods", rcis)}.  It is the wait for the next '
                     'period (0-1 period: the first period whose counters show the burst '
                     'decides, see *decision*) and then the cut\'s way to QEMU: from the '
                     'decision log\'s line to the guest\'s limits, median '
                     + ', '.join(f'{med[n]:.0f} ms at N = {n}' for n in counts if n in med)
                     + ' (every VM\'s thread is handed its cut at once, and they share one '
                     'interpreter lock and the host\'s two cores with the guest\'s TCG; the '
                     'limits are polled every 5 ms, 100-150 times a second under this load).')
    miss = [(n, e['idle_missing'] / max(1, n * e['idle_periods']) * 100,
             e['idle_late']) for n, e in zip(counts, rows_n)]
    def missed(r):
        return 100 * (r['idle']['missing'] or 0) / max(1, r['n'] * r['idle']['periods'])
    worst = max(rows_n[-1]['rows'], key=missed)
    others = [r for r in rows_n[-1]['rows'] if r is not worst]
    lines.append('- **VM samples left out** of a period (not in within the period\'s wait, half '
                 'the period: the VM is neither cut nor raised that period), over the idle '
                 'windows: ' + ', '.join(f'{m:.1f} % at N = {n}' for n, m, _ in miss) +
                 f'.  At N = {counts[-1]}, by round: '
                 + ', '.join(f'{missed(r):.1f} % at a load average of {r["load"]:.1f}'
                             for r in [worst] + others) + '.')
    rpts2 = [(n, e['ready_s']['mean']) for n, e in zip(counts, rows_n) if e['ready_s']]
    rcis2 = [e['ready_s']['ci'] for e in rows_n if e['ready_s']]
    lines.append(f'- **Start-up** (the daemon started to every VM attached and every container '
                 f'found through `podman container inspect`): {rpts2[0][1]:.1f} s at N = '
                 f'{counts[0]}, {rpts2[-1][1]:.1f} s at N = {counts[-1]}: '
                 f'{growth_words(rpts2, "s", rcis2)}: one `podman container inspect` for each '
                 'container, one after the other.')
    lpts = [(n, e['bursts_log_bytes_per_period']['mean'] / 1024) for n, e in zip(counts, rows_n)
            if e.get('bursts_log_bytes_per_period')]
    if lpts:
        top = lpts[-1][1] * 1024 * (1000 / PERIOD_MS)
        lines.append(f'- **Decision log**: {lpts[0][1]:.2f} KiB a period at N = {lpts[0][0]}, '
                     f'{lpts[-1][1]:.2f} KiB at N = {lpts[-1][0]}: {growth_words(lpts, "KiB")}.  '
                     f'At N = {lpts[-1][0]} and a 100 ms period that is {top / 1024:.0f} KiB/s: '
                     f'the default `log-max-bytes` (16 MiB, one old file kept) holds '
                     f'{2 * 16 * 1024 * 1024 / top / 60:.0f} minutes of decisions.')
    return lines


def report(d, out_dir, notes=None, name='arbiter-scale'):
    a = argparse.Namespace(**d['args'])
    s = summarise(d)
    counts = sorted({p['n'] for p in d['points']})
    labels = [f'N={n}' for n in counts] + [lb for lb in s if lb.endswith(('A/A', 'mid-target'))]
    mid = next((lb for lb in labels if lb.endswith('mid-target')), None)
    first = labels[0]
    aa = next((lb for lb in labels if lb.endswith('A/A')), None)
    arb = [r for r in d['long_runs'] if r['label'] == 'arbitrated']
    unc = [r for r in d['long_runs'] if r['label'] == 'uncontrolled']
    one = s[first]
    react1 = [x for lb in (first, aa) if lb for r in s[lb]['rows'] for x in r['reactions']]
    r1 = ci([x * 1e3 / PERIOD_MS for x in react1 if x is not None])
    within1 = sum(s[lb]['within2'] for lb in (first, aa) if lb)
    early1 = sum(s[lb]['early'] for lb in (first, aa) if lb)
    nocut1 = sum(s[lb]['no_cut'] for lb in (first, aa) if lb)
    cpu1 = ci([r[st]['cpu_pct'] for lb in (first, aa) if lb for r in s[lb]['rows']
               for st in ('idle',)])
    cpu_long = ci([r['cpu']['cpu_pct'] for r in arb if r.get('cpu')])
    loads = [p['load'] for p in d['points']] + [r['load'] for r in d['long_runs']]
    lines = [
        '# The arbiter: reaction time, cost, and how they grow', '',
        f'Measured {d["measured"]} by `bench/arbiter-scale.py` '
        f'({" ".join(d["args"].get("argv") or []) or "defaults"}) in {d["wall_s"] / 60:.0f} min, '
        f'commit {d.get("commit")}'
        + (f', QEMU from `{d["build"]}`' if d.get('build') else '') +
        f', on the 2-core build machine shared with other jobs (1-min load average '
        f'{min(loads):.1f}..{max(loads):.1f} over the points, median '
        f'{sorted(loads)[len(loads) // 2]:.1f}).  {a.rounds} interleaved rounds; every point '
        'once per round '
        'in an order rotated from round to round, N = 1 twice (the A/A control).  Mean ± the '
        'half-width of the Student t 95 % interval: over every burst for reaction times, over '
        'the rounds for CPU.', '',
        '**Set-up** (the pieces of `bench/arbiter.py`): a loop device with direct I/O on a '
        f'{a.size_mib} MiB file of this machine\'s disk; VM 0 a TCG guest whose virtio-blk disk '
        'is that device behind throttle group tg0, streaming 1 MiB O_DIRECT reads the whole '
        'time; the I/O container (the *burster*) a podman container (runc, cgroup v1 blkio) '
        'that runs fio when told (4 KiB random reads at QD4, O_DIRECT, every completion logged '
        'with its time); the arbiter at a **100 ms period**, finding every container by its '
        'podman name.', '',
        '**What stands in for a VM** at N > 1: VMs 1..N-1 are `qemu-system-x86_64 -M none` '
        'processes (`arblib.StandInVM`), each with a BlockBackend `disk0` on the same device '
        'behind a throttle group `tg0` of its own and a QMP monitor of the arbiter\'s own: the '
        'arbiter attaches to one, samples it every period (`query-blockstats`) and sets its '
        'limits (`qom-set` of `/objects/tg0`) exactly as it does a guest\'s.  They do no I/O: '
        '2 cores cannot run 32 TCG guests, and I/O driven through an NBD export (fio\'s nbd '
        'engine) goes through the export\'s own BlockBackend, which `query-blockstats` does not '
        'list, so the arbiter would see those VMs idle anyway.  A stand-in has no guest device, '
        'so no latency histogram (the arbiter logs `no-histogram` and keeps IOPS only) and a '
        f'smaller `query-blockstats` reply than the guest\'s.  Containers 1..N-1 are real '
        'podman containers running `sleep infinity` (no I/O).  All 31 stand-ins and 31 idle '
        'containers run through the whole benchmark; a point\'s configuration names N of '
        f'each.  Starting them took {d["standin_s"]:.0f} s and {d["sleeper_s"]:.0f} s.', '',
        '**Targets, each round** (the rule of `bench/arbiter.py`): the container alone twice '
        '(the VM idle), the VM alone and both between them, 5 s each, the arbiter watching at a '
        'target it never reaches.  The container\'s target: its p99 at most 2 x its solo p99 '
        '(the less of the two solo phases\'; 0.5 ms at least).  In the 60 s runs the arbiter '
        f'is told {a.target_x:g} x its probe\'s solo p90 (the least of the two solo phases\' '
        'medians over their periods).  The growth points (the bursts) tell it '
        f'{BURST_TARGET_MS:g} ms, the least the configuration takes and under any latency the '
        'probe sees here: a burst is to be cut as soon as the containers\' counters show it, '
        'and what is measured is the arbiter\'s own delay (sampling, deciding, setting the '
        'limits), not whether its probe tells the burst from the host\'s noise.  On a quiet host '
        'the first rule behaves alike (`docs/bench/arbiter.md`\'s quiet run: a solo p90 of '
        'about 0.2 ms, 0.56-0.70 ms with the VM, so a target of 0.3 ms that the VM alone '
        'exceeds); on a loaded host (earlier runs of this benchmark) a solo phase\'s p90 was at '
        'times as high as with the VM, which left bursts that the probe could not see' + (
            '.  The *mid-target* point tells it the geometric mean of the probe\'s p90 with the '
            f'VM alone and with both (where both is at least {MID_MIN:g} x the VM alone): the '
            'streaming VM alone does not put the probe over it, so a cut waits for the burst to '
            'move the probe\'s window.' if mid else
            '.  No round had a *mid-target* point (a target between the probe\'s p90 with the '
            f'VM alone and with both, where both is at least {MID_MIN:g} x the VM alone): with '
            'the container running the VM streams less, and the probe saw no more than with the '
            'VM alone.'), '',
        '| round | container solo IOPS, p99 (ms) | contended, no arbiter: IOPS, p99 (ms), VM '
        'MB/s | probe p90 (ms): solo, VM alone, both | container target (ms) | arbiter target, '
        '60 s runs (ms) | bursts (ms) | mid-target (ms) |', '|---' * 8 + '|',
    ] + [
        f'| {b["round"]} | {b["solo"]["container"]["iops"]:.0f}, '
        f'{b["solo"]["container"]["p99_ms"]:.2f}; {b["again"]["container"]["iops"]:.0f}, '
        f'{b["again"]["container"]["p99_ms"]:.2f} | {b["contended"]["container"]["iops"]:.0f}, '
        f'{b["contended"]["container"]["p99_ms"]:.2f}, {b["contended"]["vm"]["bps"] / 1e6:.0f} | '
        f'{b["solo"]["probe_ms"] or 0:.2f} / {b["again"]["probe_ms"] or 0:.2f}, '
        f'{b["vm_only"]["probe_ms"] or 0:.2f}, {b["contended"]["probe_ms"] or 0:.2f} | '
        f'{b["target_ms"]:.2f} | {b["arbiter_target_ms"]:.3f} | '
        f'{b.get("burst_target_ms") or 0:.3f} | '
        + (f'{b["mid_target_ms"]:.3f}' if b.get('mid_target_ms') else '-') + ' |'
        for b in d['bases']
    ] + [
        '',
        '## Against target 5', '',
        '| measure | value | target |', '|---|---|---|',
        f'| burst to first cut, N = 1 (every burst of the N = 1 points and their A/A), '
        f'periods of 100 ms | {fmt(r1, 2)} (n = {r1["n"] if r1 else 0}; max '
        f'{max((x for x in react1 if x is not None), default=0) * 10:.2f}) | <= 2 |',
        f'| bursts cut within 2 periods, N = 1 | {within1} of {len(react1)} ({early1} cut '
        f'before their first I/O, on the container\'s I/O stall as fio started; {nocut1} not '
        'cut) | all |',
    ]
    if mid:
        m = s[mid]
        lines.append(f'| burst to first cut, N = 1 mid-target (the VM alone under the target), '
                     f'periods | {fmt(m["reaction_periods"], 2)} (n = {m["bursts"]}, '
                     f'{m["within2"]} within 2, {m["no_cut"]} not cut) | <= 2 |')
    for r in arb + unc:
        lines.append(f'| 60 s contended, {r["label"]} (round {r["round"]}): one-second windows '
                     f'with the container\'s p99 <= {r["target_ms"]:.2f} ms | {r["within"]} of '
                     f'{r["windows"]} ({100 * r["share"]:.0f} %) | '
                     f'{">= 95 %" if r["label"] == "arbitrated" else "(reference)"} |')
    lines += [
        f'| daemon CPU, N = 1, VM streaming and the container idle, % of a core | {fmt(cpu1, 2)} '
        '| <= 2 |',
        f'| daemon CPU over the 60 s arbitrated runs, % of a core | {fmt(cpu_long, 2)} | <= 2 |',
        f'| daemon CPU at N = {counts[-1]} (idle containers), % of a core | '
        f'{fmt(s[f"N={counts[-1]}"]["idle_cpu_pct"], 2)} | (growth) |', '']
    if aa:
        ra = s[aa]
        lines += [
            f'A/A (N = {one["n"]} run twice in each round): CPU {fmt(one["idle_cpu_pct"], 2)} and '
            f'{fmt(ra["idle_cpu_pct"], 2)} % idle, {fmt(one["bursts_cpu_pct"], 2)} and '
            f'{fmt(ra["bursts_cpu_pct"], 2)} % over the bursts; reaction '
            f'{fmt(one["reaction_periods"], 2)} and {fmt(ra["reaction_periods"], 2)} periods.',
            '']
    lines += ['## The 60 s contended runs', '',
              '| run | windows within target | share | container IOPS | fio p99 over the run (ms) '
              '| worst window p99 (ms) | median window p99 (ms) | VM MB/s | daemon CPU % | '
              'helpers CPU % | decisions |', '|---' * 11 + '|']
    for r in d['long_runs']:
        ws = sorted(x for x in r['p99_ms'] if x is not None)
        cpu = r.get('cpu')
        acts = ', '.join(f'{k} {v}' for k, v in sorted((r.get('actions') or {}).items()))
        lines.append(f'| {r["label"]} (round {r["round"]}) | {r["within"]} of {r["windows"]} | '
                     f'{100 * r["share"]:.0f} % | {r["iops"]:.0f} | {r["fio_p99_ms"]:.2f} | '
                     f'{ws[-1]:.2f} | {ws[len(ws) // 2]:.2f} | {r["vm"]["bps"] / 1e6:.0f} | '
                     + (f'{cpu["cpu_pct"]:.2f} | {cpu["helpers_pct"]:.2f} | {acts} |' if cpu
                        else '- | - | - |'))
    lines += ['', '## Growth: N VMs and N containers', '',
              'CPU: the daemon process (all its threads) over '
              f'{a.idle_s} s with the VM streaming and every container idle (*idle*: each period '
              'samples every VM and container and decides `idle`), and over the bursts '
              '(*bursts*: cuts, holds, raises, lifts).  *helpers*: the probe process, the '
              'watchdog, `podman events` and the `podman inspect`s, apart.  *period*: the mean '
              'time between two decisions (100 ms when the loop keeps its period) and the '
              'longest.  *late*, *missing*: VM samples marked late, and VMs left out of a '
              'decision (no sample within the period\'s wait), over the idle windows of every '
              'round.  Reaction: burst start to the first change of the guest\'s limits '
              '(the first cut, as QEMU has it); *decision*: to the `cut` line in the decision log.',
              '',
              '| point | CPU idle % | ms per period | period ms (max) | late / missing | CPU '
              'bursts % | helpers % | reaction (periods) | decision (periods) | within 2 | '
              'ready s | RSS MiB | log KiB per period |', '|---' * 13 + '|']
    for lb in labels:
        e = s[lb]
        lines.append(
            f'| {lb} | {fmt(e["idle_cpu_pct"], 2)} | {fmt(e["idle_per_period_ms"], 2)} | '
            f'{fmt(e["idle_period_ms"], 0)} ({fmt(e["idle_period_max_ms"], 0)}) | '
            f'{e["idle_late"]} / {e["idle_missing"]} | {fmt(e["bursts_cpu_pct"], 2)} | '
            f'{fmt(e["idle_helpers_pct"], 2)} | {fmt(e["reaction_periods"], 2)} | '
            f'{fmt(e["decision_periods"], 2)} | {e["within2"]} of {e["bursts"]}'
            + (f' ({e["early"]} before)' if e['early'] else '') + ' | '
            f'{fmt(e["ready_s"], 1)} | {fmt(e["rss_mib"], 1)} | '
            f'{fmt(e["bursts_log_bytes_per_period"], 2, 1 / 1024)} |')
    lines += ['', '## Reading', '']
    rows_n = [s[f'N={n}'] for n in counts]
    if len(counts) > 1:
        lines += growth_reading(d, s, counts, rows_n)
    else:
        lines.append(f'- One point (N = {counts[0]}): no growth to read.')
    if mid:
        mt = [t for t in d['trials'] if t['target_ms'] > BURST_TARGET_MS]
        rs = [t['reaction_s'] * 1e3 / PERIOD_MS for t in mt if t['reaction_s'] is not None]
        pre = sum(1 for t in mt if (t.get('probe_before_ms') or 0) > t['target_ms'])
        lines.append(
            f'- **Mid-target** (the VM alone under the arbiter\'s target, by the baseline): '
            f'{len(mt)} bursts in {len(s[mid]["rows"])} round(s) (the other rounds had no target '
            f'between: with the VM and the container the probe was under {MID_MIN:g} x its '
            f'figure with the VM alone); first cut after {fmt(ci(rs), 2)} periods (each: '
            + ', '.join(f'{x:.2f}' for x in rs) + '), '
            f'{sum(1 for t in mt if t["applied"] is None)} '
            f'not cut; in {pre} of them the probe was over the target already before the burst.  '
            'Where the cut took seconds, the probe\'s latency since the burst began stayed '
            'under the target for seconds: the probe did not tell the burst from the host\'s '
            'noise, a matter of the signal, not of the window (the window restarts at the '
            'burst: `docs/arbiter.md`).')
    lines += ['', f'![CPU and reaction against N; the 60 s runs\' windows]({name}.png)', '']
    if notes:
        with open(notes) as f:
            lines += [f.read().rstrip(), '']
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f'{name}.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(os.path.join(out_dir, f'{name}.png'), d, s, counts)
    print('\n'.join(lines))


def chart(path, d, s, counts):
    plt = charts.pyplot()
    if not plt:
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))

    def line(ax, key, label, **kw):
        ys = [s[f'N={n}'][key] for n in counts]
        ax.errorbar(counts, [y['mean'] if y else float('nan') for y in ys],
                    yerr=[(y['ci'] or 0) if y else 0 for y in ys], marker='o', capsize=3,
                    label=label, **kw)

    ax = axes[0]
    line(ax, 'idle_cpu_pct', 'daemon, idle containers', color='tab:blue')
    line(ax, 'bursts_cpu_pct', 'daemon, over the bursts', color='tab:orange')
    line(ax, 'idle_helpers_pct', 'its helpers (probe, watchdog, podman)', color='grey', ls=':')
    fa, fb = linear_fit(counts, [s[f'N={n}']['idle_cpu_pct']['mean'] for n in counts])
    ax.plot([0, counts[-1]], [fa, fa + fb * counts[-1]], color='tab:blue', lw=0.8, ls='--',
            label=f'fit: {fa:.2f} + {fb:.3f} N %')
    ax.axhline(2.0, color='red', lw=0.8, ls='--', label='target 5: 2 % (at N = 1)')
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel('VMs and containers (N each)')
    ax.set_ylabel('% of one core')
    cw = growth_words([(n, s[f'N={n}']['idle_per_period_ms']['mean']) for n in counts], 'ms')
    ax.set_title(f'daemon CPU at a 100 ms period: {verdict(cw)} in N')
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    line(ax, 'reaction_periods', 'burst to first cut (QEMU\'s limits)', color='tab:blue')
    line(ax, 'decision_periods', 'burst to the cut decision (log)', color='tab:green', ls='--')
    ax.axhline(2.0, color='red', lw=0.8, ls='--', label='target 5: 2 periods')
    ax.set_xscale('log', base=2)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_ylim(bottom=0)
    ax.set_xlabel('VMs and containers (N each)')
    ax.set_ylabel('periods of 100 ms')
    rr = [s[f'N={n}']['reaction_periods'] for n in counts]
    if all(rr):
        rw = growth_words([(n, r['mean']) for n, r in zip(counts, rr)], 'periods',
                          [r['ci'] for r in rr])
        ax.set_title(f'reaction (burst to first cut): {verdict(rw)} in N')
    else:
        ax.set_title('reaction (burst to first cut)')
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[2]
    for r in d['long_runs']:
        ln, = ax.plot(range(len(r['p99_ms'])), r['p99_ms'], marker='.', lw=0.8,
                      label=f'{r["label"]} (round {r["round"]}): {r["within"]}/{r["windows"]} '
                      f'within {r["target_ms"]:.2f} ms (dashed)')
        ax.axhline(r['target_ms'], color=ln.get_color(), lw=0.8, ls='--')
    ax.set_yscale('log')
    ax.set_xlabel('second of the 60 s contended run')
    ax.set_ylabel('container p99 in the window (ms, log)')
    ax.set_title('60 s contended: p99 per one-second window')
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    charts.save(fig, path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--counts', default='1,2,4,8,16,32')
    ap.add_argument('--bursts', type=int, default=5, help='bursts per point')
    ap.add_argument('--burst-s', type=int, default=2)
    ap.add_argument('--quiet-s', type=float, default=1.0,
                    help='before a burst, once the VM is back at its default')
    ap.add_argument('--idle-s', type=float, default=10.0, help='the idle CPU window')
    ap.add_argument('--settle-s', type=float, default=2.0)
    ap.add_argument('--long-s', type=int, default=60)
    ap.add_argument('--solo-s', type=int, default=5)
    ap.add_argument('--poll-ms', type=float, default=5.0)
    ap.add_argument('--size-mib', type=int, default=512)
    ap.add_argument('--target-x', type=float, default=1.5)
    ap.add_argument('--no-mid-target', dest='mid_target', action='store_false',
                    help='no N = 1 point with a target the VM alone does not reach')
    ap.add_argument('--name', default='arbiter-scale',
                    help='the report\'s files: NAME.md, NAME.json, NAME.png in --out')
    ap.add_argument('--quick', action='store_true')
    add_report_args(ap)
    a = ap.parse_args()
    if a.report_only:
        out, name = a.out, a.name   # this call's, not the saved run's
        report(load_saved(a), out, a.notes, name)
        return
    a.argv = sys.argv[1:]
    # a SIGTERM unwinds (the finally below: containers, QEMUs, the loop device)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit('arbiter-scale: terminated'))
    if a.quick:
        a.rounds, a.counts, a.bursts, a.idle_s, a.long_s = 1, '1,4', 2, 3.0, 10
        if a.out == os.path.join(REPO, 'docs', 'bench'):
            a.out = '/tmp/arbiter-scale-quick'
    a.counts = [int(x) for x in str(a.counts).split(',') if x]
    why = A.unavailable()
    if why:
        sys.exit(f'arbiter-scale: {why}')
    b = Bench(a)
    try:
        b.run()
    finally:
        # what was measured is kept, a failed run's too
        if b.points:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f'{a.name}.json'), 'w') as f:
                json.dump(b.data(), f, indent=1)
        b.close()
    report(b.data(), a.out, a.notes, a.name)


if __name__ == '__main__':
    main()
