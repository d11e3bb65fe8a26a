#!/usr/bin/env python3
"""How the memory broker's control-plane cost grows (issue 40): create,
destroy, lookup and read-only map against the number of regions in the
catalogue, and lookup, read-only map and create+destroy against the number
of concurrent clients.

Regions axis (--regions, default 1 10 100 1000 4096): for each N a fresh
hvmemd on a tmpfs pool under /dev/shm (the catalogue in the pool, its
default), one client connection (the Python client of
broker/tests/brokerlib.py, so its overhead is in every figure).  N - 1
regions of --size are created first (the time is kept: "fill"); then
--creates times a probe region is created (the catalogue then holds N) and
destroyed (N - 1 again): every one of those commits the whole catalogue
(serialise, write catalog.tmp, fsync, rename, fsync the directory; see
bench/broker.py), so their latency is the commit's cost at N.  The Nth
region is then created and --ops lookups and --ops read-only maps are
issued, each of a region drawn at random from the N.  Beside them: the
daemon's RSS (VmRSS of /proc/PID/status) with N regions, the catalogue
file's size, the daemon's CPU time per operation (/proc/PID/schedstat) and,
at the table's limit (HVM_MAX_REGIONS, 4096), what one more create gets.

Clients axis (--clients, default 1 2 4 8 16 32 64): a fresh hvmemd with
--base-regions regions; for each operation, C processes (forked: the
client is Python, and threads would share one interpreter lock), each with
its own connection, issue it in a loop for --duration seconds, all started
together: lookup and read-only map of a region drawn at random, and
create+destroy of a region of the process's own (one pair is one
operation: two commits).  Throughput is all the operations completed over
the longest process's time; p50 and p99 of every operation of the run.

Rounds (--rounds) are interleaved: each round runs every point of both
axes once, in an order rotated from round to round (bench/pooled_stats.py),
so a drift of the shared machine's load falls on every point alike.  Means
over the rounds with Student t 95 % intervals.  The 1-min load average is
sampled at every point.

The benchmark runs as root: uid 0 is under none of the per-uid limits
(--max-regions-per-uid, --max-conns-per-uid, the regions and connections
kept for uid 0), so the daemon runs with its defaults; what bounds the
regions axis is the compiled-in table of 4096 regions, which no option
raises.  It must run as root so that the largest point is reachable: a
non-root uid stops at 256 regions by default (--max-regions-per-uid, at
most 4032).

Usage: bench/broker-scale.py [--quick] [--rounds 5] [--out docs/bench]
       bench/broker-scale.py --report-only docs/bench/broker-scale.json
--quick is a smoke run of a few seconds (3 small points per axis, 2 rounds)
that writes to /tmp/broker-scale-quick unless --out says otherwise.
Binaries from $HYBRIDVM_BUILD/broker (default <repo>/build/broker), copied at
start (a rebuild during the run does not change what is measured).  Writes
broker-scale.md, .json and .png in --out (the chart needs matplotlib, e.g.
build/venv/bin/python3).  About 5 minutes on 2 shared cores.
"""

import argparse
import json
import math
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402
import charts   # noqa: E402
from pooled_stats import mean, mean_ci, rotated   # noqa: E402

HVM_MAX_REGIONS = 4096          # broker/proto.h
REGION_OPS = ('create', 'destroy', 'lookup', 'map-ro')
CLIENT_OPS = ('lookup', 'map-ro', 'create+destroy')


def pct(sorted_lat, p):
    return sorted_lat[min(len(sorted_lat) - 1, int(len(sorted_lat) * p / 100))]


def lat_stats(lat):
    s = sorted(lat)
    return {'n': len(s), 'p50_us': pct(s, 50) * 1e6, 'p99_us': pct(s, 99) * 1e6,
            'mean_us': sum(s) / len(s) * 1e6, 'ops_s': len(s) / sum(s)}


def rss_kib(pid):
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1])
    return None


def cpu_ns(pid):
    """CPU time of hvmemd's main thread (it serves every request; the other
    is glib's gmain), nanoseconds."""
    with open(f'/proc/{pid}/schedstat') as f:
        return int(f.read().split()[0])


def nthreads(pid):
    return len(os.listdir(f'/proc/{pid}/task'))


class Daemon:
    """A fresh hvmemd on its own pool (/dev/shm) and socket; stop() removes
    every file."""

    def __init__(self):
        self.work = tempfile.mkdtemp(prefix='hvmem-scale-')
        self.pool = tempfile.mkdtemp(prefix='hvmem-scale-', dir='/dev/shm')
        self.broker = B.Broker(self.work, self.pool, [])
        self.broker.start()
        self.pid = self.broker.proc.pid

    def stop(self):
        try:
            self.broker.stop()
        finally:
            shutil.rmtree(self.pool, ignore_errors=True)
            shutil.rmtree(self.work, ignore_errors=True)

    def catalog_bytes(self):
        return os.path.getsize(os.path.join(self.pool, 'catalog'))


def timed_phase(d, fn, count):
    """Run fn count times, each timed; (latencies, daemon CPU ns per op)."""
    t = time.perf_counter
    lat = []
    c0 = cpu_ns(d.pid)
    for i in range(count):
        t0 = t()
        fn(i)
        lat.append(t() - t0)
    return lat, (cpu_ns(d.pid) - c0) / count


def run_regions(n, a, rnd):
    """One point of the regions axis: a catalogue of n regions."""
    d = Daemon()
    c = None
    rng = random.Random(rnd * 100003 + n)
    out = {'axis': 'regions', 'regions': n, 'round': rnd}
    try:
        c = d.broker.client()
        out['rss0_kib'] = rss_kib(d.pid)
        names = [f'r{i:05d}' for i in range(n)]
        t0 = time.perf_counter()
        for name in names[:-1]:
            c.create(name, a.size_b)
        out['fill_s'] = time.perf_counter() - t0
        res, cpu = {}, {}

        def pair_create(i):
            c.create('probe', a.size_b)

        def pair_destroy(i):
            c.destroy('probe')
        # create then destroy the probe: each timed on its own
        lc, ld, cc, cd = [], [], 0, 0
        for _ in range(a.creates):
            lat, ns = timed_phase(d, pair_create, 1)
            lc += lat
            cc += ns
            lat, ns = timed_phase(d, pair_destroy, 1)
            ld += lat
            cd += ns
        res['create'], cpu['create'] = lat_stats(lc), cc / a.creates
        res['destroy'], cpu['destroy'] = lat_stats(ld), cd / a.creates
        c.create(names[-1], a.size_b)
        out['rss_kib'] = rss_kib(d.pid)
        out['catalog_bytes'] = d.catalog_bytes()
        out['pool'] = c.pool()['nregions']
        picks = [rng.choice(names) for _ in range(a.ops)]
        lat, cpu['lookup'] = timed_phase(d, lambda i: c.lookup(picks[i]), a.ops)
        res['lookup'] = lat_stats(lat)

        def map_ro(i):
            _, fd = c.map(picks[i])
            os.close(fd)
        lat, cpu['map-ro'] = timed_phase(d, map_ro, a.ops)
        res['map-ro'] = lat_stats(lat)
        out['rss_end_kib'] = rss_kib(d.pid)
        out['threads'] = nthreads(d.pid)
        if n >= HVM_MAX_REGIONS:
            try:
                c.create('one-too-many', a.size_b)
                out['over_limit'] = 'accepted'
            except B.BrokerError as e:
                out['over_limit'] = str(e)
        for op in res:
            res[op]['cpu_us'] = cpu[op] / 1e3
        out['ops'] = res
    finally:
        if c:
            c.close()
        d.stop()
    out['load1'] = os.getloadavg()[0]
    return out


def worker(wid, op, sock, names, duration, ready, start, results):
    try:
        c = B.Client(sock)
        c.lookup(names[0])      # connected and answered: ready
        rng = random.Random(wid)
        t = time.perf_counter
        lat = []
        ready.put(wid)
        start.wait()
        t_begin = t()
        t_end = t_begin + duration
        i = 0
        while True:
            t0 = t()
            if t0 >= t_end:
                break
            if op == 'lookup':
                c.lookup(rng.choice(names))
            elif op == 'map-ro':
                _, fd = c.map(rng.choice(names))
                os.close(fd)
            else:
                name = f'w{wid}-{i}'
                c.create(name, 4096)
                c.destroy(name)
                i += 1
            lat.append(t() - t0)
        elapsed = t() - t_begin
        c.close()
        results.put((wid, None, lat, elapsed))
    except BaseException as e:       # reported by the parent
        results.put((wid, f'{type(e).__name__}: {e}', [], 0))


def run_clients(nc, a, rnd):
    """One point of the clients axis: nc concurrent connections, each
    operation in turn."""
    ctx = multiprocessing.get_context('fork')
    d = Daemon()
    out = {'axis': 'clients', 'clients': nc, 'round': rnd, 'ops': {}}
    try:
        c = d.broker.client()
        names = [f'b{i:05d}' for i in range(a.base_regions)]
        for name in names:
            c.create(name, a.size_b, mode=0o644)
        c.close()
        for op in rotated(CLIENT_OPS, rnd):
            ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
            procs = [ctx.Process(target=worker, args=(w, op, d.broker.sock, names,
                                                      a.duration, ready, start, results))
                     for w in range(nc)]
            try:
                for p in procs:
                    p.start()
                for _ in range(nc):
                    ready.get(timeout=60)
                c0 = cpu_ns(d.pid)
                w0 = time.perf_counter()
                start.set()
                time.sleep(a.duration / 2)
                rss = rss_kib(d.pid)
                got = [results.get(timeout=a.duration + 60) for _ in range(nc)]
                wall = time.perf_counter() - w0
                cpu = cpu_ns(d.pid) - c0
            finally:
                for p in procs:
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                        p.join()
            errs = [e for _, e, _, _ in got if e]
            if errs:
                raise RuntimeError(f'{op} with {nc} clients: {errs[0]}')
            lat = [x for _, _, ls, _ in got for x in ls]
            s = sorted(lat)
            longest = max(el for _, _, _, el in got)
            out['ops'][op] = {'n': len(s), 'p50_us': pct(s, 50) * 1e6,
                              'p99_us': pct(s, 99) * 1e6,
                              'ops_s': len(s) / longest,
                              'cpu_us': cpu / len(s) / 1e3,
                              'broker_cpu_pct': cpu / 1e9 / wall * 100,
                              'rss_kib': rss}
    finally:
        d.stop()
    out['load1'] = os.getloadavg()[0]
    return out


# ---------------------------------------------------------------- summary

def ci(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    m, h = mean_ci(vals)
    return {'mean': m, 'ci': None if math.isnan(h) else h, 'n': len(vals)}


def summarize(rows, args):
    reg = {}
    for n in args['regions']:
        rs = [r for r in rows if r['axis'] == 'regions' and r['regions'] == n]
        if not rs:
            continue
        e = {'fill_s': ci([r['fill_s'] for r in rs]),
             'rss_kib': ci([r['rss_kib'] for r in rs]),
             'rss0_kib': ci([r['rss0_kib'] for r in rs]),
             'rss_end_kib': ci([r['rss_end_kib'] for r in rs]),
             'catalog_bytes': rs[0]['catalog_bytes'],
             'over_limit': rs[0].get('over_limit'), 'ops': {}}
        for op in REGION_OPS:
            e['ops'][op] = {k: ci([r['ops'][op][k] for r in rs])
                            for k in ('p50_us', 'p99_us', 'ops_s', 'cpu_us')}
        reg[n] = e
    cli = {}
    for nc in args['clients']:
        rs = [r for r in rows if r['axis'] == 'clients' and r['clients'] == nc]
        if not rs:
            continue
        cli[nc] = {op: {k: ci([r['ops'][op][k] for r in rs])
                        for k in ('p50_us', 'p99_us', 'ops_s', 'cpu_us',
                                  'broker_cpu_pct', 'rss_kib')}
                   for op in CLIENT_OPS}
    return {'regions': reg, 'clients': cli}


def fmt(c, digits=0, scale=1.0):
    if c is None:
        return '–'
    m = c['mean'] * scale
    if c['ci'] is None:
        return f'{m:.{digits}f}'
    return f"{m:.{digits}f} ± {c['ci'] * scale:.{digits}f}"


def growth_words(pts):
    """A sentence on how a cost grows over the points [(n, value)] (n
    ascending): flat, linear or faster, from the increments per region of
    the last two segments."""
    (n0, v0), (nl, vl) = pts[0], pts[-1]
    ratio = vl / v0
    if ratio < 1.3:
        return ratio, 'flat', None
    if len(pts) < 3:
        return ratio, 'grows', (vl - v0) / (nl - n0) * 1000
    (na, va), (nb, vb), (nc, vc) = pts[-3:]
    lo = (vb - va) / (nb - na)
    hi = (vc - vb) / (nc - nb)
    per_k = hi * 1000
    if lo <= 0 or hi <= 0:
        return ratio, 'grows, unevenly', per_k
    q = hi / lo
    if q > 1.6:
        return ratio, f'grows faster than linearly (the increment per region is {q:.1f}x ' \
                      f'larger between {nb} and {nc} than between {na} and {nb})', per_k
    if q < 1 / 1.6:
        return ratio, f'grows less than linearly (the increment per region is {1 / q:.1f}x ' \
                      f'smaller between {nb} and {nc} than between {na} and {nb})', per_k
    return ratio, f'grows linearly (the increment per region is within {max(q, 1 / q):.1f}x ' \
                  f'between {na}-{nb} and {nb}-{nc})', per_k


def reading(summary, args, meta, rows):
    reg, cli = summary['regions'], summary['clients']
    out = []
    ns = sorted(reg)
    if len(ns) >= 2:
        for op in REGION_OPS:
            pts = [(n, reg[n]['ops'][op]['p50_us']['mean']) for n in ns]
            ratio, words, per_k = growth_words(pts)
            cpts = [(n, reg[n]['ops'][op]['cpu_us']['mean']) for n in ns]
            cratio, cwords, cper_k = growth_words(cpts)
            s = (f'- **{op}**: p50 {pts[0][1]:.0f} µs at {ns[0]} region(s), '
                 f'{pts[-1][1]:.0f} µs at {ns[-1]} (x{ratio:.2f}): {words}')
            if per_k is not None and words != 'flat':
                s += f', +{per_k:.0f} µs per 1000 regions at the top'
            s += (f'. The daemon\'s own CPU time per op: {cpts[0][1]:.0f} → '
                  f'{cpts[-1][1]:.0f} µs (x{cratio:.2f}, {cwords.split(" (")[0]}).')
            out.append(s)
        r0, rl = reg[ns[0]], reg[ns[-1]]
        span = max(ns[-1] - ns[0], 1)
        out.append(f"- **RSS**: {r0['rss_kib']['mean'] / 1024:.1f} MiB with {ns[0]} "
                   f"region(s), {rl['rss_kib']['mean'] / 1024:.1f} MiB with {ns[-1]} "
                   f"(+{(rl['rss_kib']['mean'] - r0['rss_kib']['mean']) / span:.2f} "
                   f"KiB per region); after {args['ops']} read-only maps on one connection "
                   f"{rl['rss_end_kib']['mean'] / 1024:.1f} MiB. The catalogue file: "
                   f"{r0['catalog_bytes']} → {rl['catalog_bytes']} bytes "
                   f"({(rl['catalog_bytes'] - r0['catalog_bytes']) / span:.0f} "
                   f"bytes per region), rewritten whole by every create and destroy.")
        out.append(f"- **Filling** the catalogue one create at a time took "
                   f"{rl['fill_s']['mean']:.1f} s for {ns[-1] - 1} regions.")
        if rl.get('over_limit'):
            out.append(f"- **What breaks first** on this axis: the region table. With "
                       f"{ns[-1]} regions, one more create (as uid 0) gets `{rl['over_limit']}`; "
                       f"the limit is compiled in (HVM_MAX_REGIONS), no option raises it, so "
                       f"the 10000-region point of issue 40 cannot be run. Before it, nothing "
                       f"failed: the cost that grows is the commit's (create, destroy): "
                       f"at {ns[-1]} regions one client creates "
                       f"{rl['ops']['create']['ops_s']['mean']:.0f} regions/s.")
    cs = sorted(cli)
    if len(cs) >= 2:
        for op in CLIENT_OPS:
            th = [(n, cli[n][op]['ops_s']['mean']) for n in cs]
            best = max(th, key=lambda x: x[1])
            p99 = [(n, cli[n][op]['p99_us']['mean']) for n in cs]
            bc = [cli[n][op]['broker_cpu_pct']['mean'] for n in cs]
            cpu = mean([cli[n][op]['cpu_us']['mean'] for n in cs])
            top = (f'{th[-1][1]:.0f} ops/s with {th[-1][0]}' if best[0] == th[-1][0] else
                   f'at most {best[1]:.0f} ops/s (with {best[0]}), {th[-1][1]:.0f} ops/s '
                   f'with {th[-1][0]}')
            out.append(f'- **{op}** with concurrent clients: {th[0][1]:.0f} ops/s with '
                       f'{th[0][0]} (x{best[1] / th[0][1]:.2f} at best), {top}; p50 '
                       f"{cli[cs[0]][op]['p50_us']['mean']:.0f} → "
                       f"{cli[cs[-1]][op]['p50_us']['mean']:.0f} µs, p99 "
                       f'{p99[0][1]:.0f} → {p99[-1][1]:.0f} µs. The daemon was on a CPU '
                       f'{bc[0]:.0f} % of the time with {cs[0]} client(s), {max(bc):.0f} % at '
                       f'most, at {cpu:.0f} µs of its CPU time per op on average over the points '
                       f'(so one core of its own would allow about '
                       f'{round(1e6 / cpu, -2):.0f} ops/s).')
        bound, free = [], []
        for op in CLIENT_OPS:
            busy = max(cli[n][op]['broker_cpu_pct']['mean'] for n in cs)
            (bound if busy >= 85 else free).append(f'{op} ({busy:.0f} %)')
        s = (f'- **What bounds the clients axis**, by the daemon\'s busiest point (its CPU '
             f'time over the run\'s wall time; a single-threaded daemon has one core at most): ')
        if bound:
            s += (f"the daemon itself for {', '.join(bound)}: every create and destroy "
                  f'commits the catalogue on the one thread, so more clients queue behind it; ')
        if free:
            s += (f"the {meta['nproc']} shared CPUs for {', '.join(free)}: the daemon, every "
                  f'client (Python) and the host\'s other load compete for them. ')
        s += (f'Past the peak, clients add queueing (the p50 and p99 above), not throughput. '
              f'No connection was refused up to {cs[-1]} (uid 0; the default --max-conns '
              f'is 256).')
        out.append(s)
    lk = [r for r in rows if r['axis'] == 'regions']
    if lk:
        p50 = [r['ops']['lookup']['p50_us'] for r in lk]
        cpu = [r['ops']['lookup']['cpu_us'] for r in lk]
        out.append(f'- **Noise**: the per-round p50 of lookup on the regions axis ranged '
                   f'{min(p50):.0f}..{max(p50):.0f} µs, and the daemon\'s CPU time per lookup '
                   f'{min(cpu):.0f}..{max(cpu):.0f} µs, with the host\'s other load, not with '
                   f'the catalogue: that load slows even the daemon\'s own CPU time. Hence '
                   f'the wide intervals of lookup and map-ro; the growth of create and '
                   f'destroy is far outside them.')
    return out


def chart(path, summary):
    plt = charts.pyplot()
    if not plt:
        return
    reg, cli = summary['regions'], summary['clients']
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    ns = sorted(reg)
    colors = {}
    for op in REGION_OPS:
        for key, style in (('p50_us', '-o'), ('p99_us', ':^')):
            ys = [reg[n]['ops'][op][key]['mean'] for n in ns]
            es = [reg[n]['ops'][op][key]['ci'] or 0 for n in ns]
            # a log axis: an interval reaching below 0 is drawn down to y / 10
            lo = [min(e, 0.9 * y) for e, y in zip(es, ys)]
            line = ax.errorbar(ns, ys, yerr=[lo, es], fmt=style, capsize=3, ms=4,
                               color=colors.get(op),
                               label=f'{op} {key.split("_")[0]}')
            colors[op] = line[0].get_color()
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel('regions in the catalogue')
    ax.set_ylabel('latency (µs), one client')
    ax.set_title('latency vs catalogue size (p50 solid, p99 dotted)')
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    cs = sorted(cli)
    for op in CLIENT_OPS:
        ys = [cli[n][op]['ops_s']['mean'] for n in cs]
        es = [cli[n][op]['ops_s']['ci'] or 0 for n in cs]
        ax.errorbar(cs, ys, yerr=es, fmt='-o', capsize=3, ms=4, label=op)
    ax.set_xscale('log', base=2)
    ax.set_xticks(cs)
    ax.set_xticklabels([str(n) for n in cs])
    ax.set_ylim(bottom=0)
    ax.set_xlabel('concurrent client connections (processes)')
    ax.set_ylabel('operations per second, all clients')
    ax.set_title('throughput vs clients')
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle('hvmemd control plane: how cost grows (mean of rounds, 95 % CI)')
    charts.save(fig, path, dpi=90)


def report(args, rows, meta, out_dir):
    summary = summarize(rows, args)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'broker-scale.json'), 'w') as f:
        json.dump({'args': args, 'meta': meta, 'rows': rows,
                   'summary': {'regions': {str(k): v for k, v in summary['regions'].items()},
                               'clients': {str(k): v for k, v in summary['clients'].items()}}},
                  f, indent=1)
    loads = [r['load1'] for r in rows]
    la = meta.get('load_start'), meta.get('load_end')
    lines = [
        f"# broker control plane: how cost grows ({meta['stamp']})", '',
        f"Measured by `{meta['command']}` in {meta['wall_s']:.0f} s of wall time, "
        f"{args['rounds']} interleaved rounds (points in an order rotated per round), "
        f"commit {meta.get('head', '?')[:12]}; "
        f"{meta['nproc']} CPUs shared with other work. Machine load (1-min average) "
        f"{la[0][0]:.2f} at the start, {min(loads):.2f}..{max(loads):.2f} over the points "
        f"(median {sorted(loads)[len(loads) // 2]:.2f}), {la[1][0]:.2f} at the end: the "
        f"figures are of one run on a busy host, not of the broker alone.", '',
        f"hvmemd with its defaults (`hvmemd --pool /dev/shm/… --socket …`: the catalogue on "
        f"the tmpfs pool), run as root, so none of the per-uid limits "
        f"(`--max-regions-per-uid` 256, `--max-conns-per-uid` 64) applies and no option was "
        f"raised; the region table's compiled-in limit of {HVM_MAX_REGIONS} (the last 64 "
        f"kept for uid 0) caps the regions axis, so its largest point is {HVM_MAX_REGIONS}, "
        f"not 10000. Regions of {args['size']} ({args['size_b']} bytes). The client is the "
        f"Python one of `broker/tests/brokerlib.py`: its overhead is in every latency; "
        f"*daemon CPU* is hvmemd's own CPU time per operation, user and kernel "
        f"(`/proc/PID/schedstat` of its main thread, which serves every request; the "
        f"other is glib's idle `gmain`), the part that is the broker's. Every value is the mean "
        f"over the rounds ± the half-width of its Student t 95 % interval.", '',
        '## Reading', '',
    ] + reading(summary, args, meta, rows) + ['']
    reg = summary['regions']
    if reg:
        lines += ['## Against the number of regions (one client)', '',
                  f"At N regions: {args['creates']} creates of a probe region (the catalogue "
                  f"then holds N) each followed by its destroy (N - 1), then {args['ops']} "
                  f"lookups and {args['ops']} read-only maps of regions drawn at random from "
                  f"the N. A fresh daemon per point; *fill* is the time to create the first "
                  f"N - 1, one after the other. ops/s: one request at a time (1 / mean latency). "
                  f"VmRSS with the N regions, and again after the lookups and maps.", '',
                  '| regions | op | p50 µs | p99 µs | ops/s | daemon CPU µs/op |',
                  '|---:|---|---:|---:|---:|---:|']
        for n in sorted(reg):
            for op in REGION_OPS:
                o = reg[n]['ops'][op]
                lines.append(f"| {n} | {op} | {fmt(o['p50_us'])} | {fmt(o['p99_us'])} | "
                             f"{fmt(o['ops_s'])} | {fmt(o['cpu_us'], 1)} |")
        lines += ['', '| regions | hvmemd VmRSS MiB | after the maps MiB | catalogue bytes | '
                  'fill s |', '|---:|---:|---:|---:|---:|']
        for n in sorted(reg):
            e = reg[n]
            lines.append(f"| {n} | {fmt(e['rss_kib'], 2, 1 / 1024)} | "
                         f"{fmt(e['rss_end_kib'], 2, 1 / 1024)} | {e['catalog_bytes']} | "
                         f"{fmt(e['fill_s'], 2)} |")
        rss0 = ci([r['rss0_kib'] for r in rows if r['axis'] == 'regions'])
        lines += ['', f"A daemon with no region: VmRSS {fmt(rss0, 2, 1 / 1024)} MiB.", '']
    cli = summary['clients']
    if cli:
        lines += ['## Against the number of concurrent clients', '',
                  f"A daemon with {args['base_regions']} regions; C processes, a connection "
                  f"each, issue the operation in a loop for {args['duration']} s, started "
                  f"together. create+destroy is one operation (a create and the destroy of "
                  f"the same region: two catalogue commits). ops/s: every client's operations "
                  f"over the longest client's time. *daemon busy*: hvmemd's CPU time over the "
                  f"run's wall time (100 % = one core, all a single-threaded daemon can have).",
                  '', '| clients | op | ops/s | p50 µs | p99 µs | daemon CPU µs/op | '
                  'daemon busy % | VmRSS MiB |', '|---:|---|---:|---:|---:|---:|---:|---:|']
        for n in sorted(cli):
            for op in CLIENT_OPS:
                o = cli[n][op]
                lines.append(f"| {n} | {op} | {fmt(o['ops_s'])} | {fmt(o['p50_us'])} | "
                             f"{fmt(o['p99_us'])} | {fmt(o['cpu_us'], 1)} | "
                             f"{fmt(o['broker_cpu_pct'])} | {fmt(o['rss_kib'], 2, 1 / 1024)} |")
        lines.append('')
    lines += ['![latency vs regions, throughput vs clients](broker-scale.png)', '']
    with open(os.path.join(out_dir, 'broker-scale.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(os.path.join(out_dir, 'broker-scale.png'), summary)
    print('\n'.join(lines))


def size_bytes(s):
    u = s[-1].upper()
    return int(s[:-1]) << {'K': 10, 'M': 20, 'G': 30}[u] if u in 'KMG' else int(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true', help='a smoke run of a few seconds')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--regions', type=int, nargs='+', default=[1, 10, 100, 1000, 4096])
    ap.add_argument('--clients', type=int, nargs='+', default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument('--ops', type=int, default=3000,
                    help='lookups and read-only maps per point of the regions axis')
    ap.add_argument('--creates', type=int, default=300,
                    help='create/destroy pairs per point of the regions axis')
    ap.add_argument('--duration', type=float, default=1.5,
                    help='seconds of each operation at each point of the clients axis')
    ap.add_argument('--base-regions', type=int, default=100,
                    help='regions in the catalogue on the clients axis')
    ap.add_argument('--size', default='4K', help='size of every region')
    ap.add_argument('--out', help='default docs/bench (/tmp/broker-scale-quick with --quick)')
    ap.add_argument('--report-only', metavar='JSON',
                    help='write the report again from the rows of a JSON this wrote')
    a = ap.parse_args()
    if a.report_only:
        with open(a.report_only) as f:
            saved = json.load(f)
        out = a.out or os.path.dirname(os.path.abspath(a.report_only))
        report(saved['args'], saved['rows'], saved['meta'], out)
        return
    if a.quick:
        a.rounds, a.regions, a.clients = 2, [1, 10, 100], [1, 2, 4]
        a.ops, a.creates, a.duration = 200, 20, 0.3
    out = a.out or (os.path.join('/tmp', 'broker-scale-quick') if a.quick
                    else os.path.join(REPO, 'docs', 'bench'))
    if a.rounds < 2:
        ap.error('--rounds needs at least 2 for an interval')
    if max(a.regions) > HVM_MAX_REGIONS:
        ap.error(f'the broker holds at most {HVM_MAX_REGIONS} regions (HVM_MAX_REGIONS)')
    if os.geteuid() != 0:
        ap.error('run as root: uid 0 alone may fill the region table '
                 '(--max-regions-per-uid is at most 4032)')
    if not B.have_broker():
        sys.exit(f'{B.HVMEMD} not built (set HYBRIDVM_BUILD)')
    a.size_b = size_bytes(a.size)
    t_start = time.monotonic()
    meta = {'stamp': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
            'command': ' '.join([os.path.relpath(sys.executable, REPO)
                                 if sys.executable.startswith(REPO + '/') else sys.executable,
                                 'bench/broker-scale.py'] + sys.argv[1:]),
            'nproc': os.cpu_count(), 'load_start': os.getloadavg()}
    meta['head'] = subprocess.run(['git', '-C', REPO, 'rev-parse', 'HEAD'],
                                  capture_output=True, text=True).stdout.strip()
    bindir = tempfile.mkdtemp(prefix='hvmem-scale-bin-')
    rows = []
    try:
        shutil.copy2(B.HVMEMD, os.path.join(bindir, 'hvmemd'))
        B.HVMEMD = os.path.join(bindir, 'hvmemd')
        for rnd in range(a.rounds):
            for n in rotated(a.regions, rnd):
                r = run_regions(n, a, rnd)
                rows.append(r)
                print(json.dumps({k: r[k] for k in ('round', 'regions', 'load1', 'rss_kib')} |
                                 {op: round(v['p50_us']) for op, v in r['ops'].items()}),
                      flush=True)
            for nc in rotated(a.clients, rnd):
                r = run_clients(nc, a, rnd)
                rows.append(r)
                print(json.dumps({k: r[k] for k in ('round', 'clients', 'load1')} |
                                 {op: round(v['ops_s']) for op, v in r['ops'].items()}),
                      flush=True)
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
    meta['load_end'] = os.getloadavg()
    meta['wall_s'] = time.monotonic() - t_start
    args = {k: v for k, v in vars(a).items() if k not in ('out', 'report_only')}
    report(args, rows, meta, out)


if __name__ == '__main__':
    main()
