#!/usr/bin/env python3
"""How the app-assisted migration's set-up grows with the item count (issue 40).

The set-up is what QEMU waits for in the migration's `setup` state before
the first RAM pass: APPASSIST.PREPARE (the module drops its cold arena and
purges the allocator) and then the page list (APPASSIST.PAGES <cursor> until
no runs remain, then APPASSIST.PAGES END), both on the virtio-serial port
(docs/app-assist.md, "Protocol" and "Page lists").  This charts its time
against the number of Redis items, two ways:

host   a real redis-server on this host with our module (hybridmem.so, its
       defaults), its app-assist port a unix socket this script listens on
       (the module connects to it as it opens /dev/virtio-ports/... in a
       guest).  The data set of bench/app-assist.py (its load_data: --size
       byte values, keys the item number in hex, every item demoted, the
       first --hot of them read back hot, one compaction pass), then the
       requests QEMU sends, byte for byte as hiredis formats them:
       `APPASSIST.PREPARE <deadline>`, `APPASSIST.PAGES 0`, `PAGES <n>`...
       until the reply's remaining-runs is 0, `APPASSIST.PAGES END`; each
       timed from request to reply (the host side decodes the chunk after
       its timing, as QEMU marks the runs after its reply arrived).  The
       module's own share: PREPARE's `time_us` (its reply) and the page
       list's pagemap reading (INFO appassist: page_list_us, slices); the
       rest of a round trip is encoding, the socket and this client.  Then
       APPASSIST.RESUME (as a destination does), and the server is killed.
       A fresh server for every point: PREPARE drops what it measures.
guest  bench/app-assist.py's `ours` configuration (a TCG guest, the same
       data set loaded through the guest's Redis, a real post-copy
       migration): QEMU's own prepare-time and pages-time from
       query-migrate, the module's time_us from the port's app-time, and
       the module's page-list counters.  Only the shapes that load in a
       few minutes under TCG (--guest, ITEMS:MEM).

Points are interleaved: --rounds rounds, the host's item counts in an order
rotated per round (pooled_stats.rotated), the guest shapes after them in
each round (every other round in reverse).  The A/A control: the smallest
host point run again in every round under the name `<items>@aa`, whose
ratio to the point shows the noise.  Means with 95 % Student t intervals;
a least-squares line through the host means (ms per million items) and the
increment per million items between neighbouring points, to say where the
cost is linear and where it is not.

Writes NAME.md, NAME.json and NAME.png into --out (default docs/bench,
NAME app-assist-setup-scale); the JSON is rewritten after every point, so
an interrupted run keeps what it measured; --report-only JSON redraws.
Needs root (the page list reads frames from /proc/self/pagemap, which
shows them only with CAP_SYS_ADMIN) and the module built
(`ninja -C build redis-module/hybridmem.so`).
"""
import argparse
import importlib.util
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(TOP, 'redis-module', 'tests'))
_spec = importlib.util.spec_from_file_location('app_assist', os.path.join(HERE, 'app-assist.py'))
aa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aa)

import charts  # noqa: E402
import saved_runs  # noqa: E402
from pooled_stats import mean_ci, ratio_ci, rotated  # noqa: E402
from hmlib import MODULE, Server, asmap, rss_of  # noqa: E402
from test_pagelist import decode  # noqa: E402
from test_port import Endpoint, encode  # noqa: E402

import redis  # noqa: E402

M = 1_000_000
MiB = 1 << 20
# What QEMU sends: app-assist-deadline's default (ms).
DEADLINE_MS = 3000

# (column, what it is) of a host point, in the report's order.
HOST_COLS = [
    ('set-up (ms)', 'PREPARE + page list, request to last reply'),
    ('set-up: server CPU (ms)', "the same, redis-server's main thread on a CPU"),
    ('prepare (ms)', 'PREPARE, request to reply'),
    ('prepare: server CPU (ms)', "PREPARE, the server's CPU time"),
    ('prepare: module (ms)', "PREPARE's own time_us"),
    ('page list (ms)', 'the PAGES round trips, summed'),
    ('page list: server CPU (ms)', "the page list, the server's CPU time"),
    ('page list: pagemap (ms)', "the module's pagemap reading (page_list_us)"),
    ('page list: chunks', 'PAGES replies with runs'),
    ('page list: longest slice (ms)', 'the longest pagemap slice'),
    ('pages listed (MiB)', 'frames listed x 4 KiB'),
    ('page list: runs', 'runs of frames'),
    ('page list: bytes', 'encoded bytes of all chunks'),
    ('freed (MiB)', "PREPARE's freed_bytes"),
    ('peak RSS (MiB)', "redis-server's VmHWM"),
    ('load (s)', 'load, demote, promote, compact'),
]
# (column of bench/app-assist.py's row or ours, what) of a guest point.
GUEST_COLS = [
    ('setup time (ms)', "QEMU's setup-time (whole set-up state)"),
    ('prepare (ms)', "QEMU's prepare-time"),
    ('prepare: module (ms)', "the port's app-time (the module's time_us)"),
    ('page list (ms)', "QEMU's pages-time"),
    ('page list: pagemap (ms)', "the module's pagemap reading"),
    ('page list: slices', 'pagemap slices'),
    ('page list: longest slice (ms)', 'the longest slice'),
    ('pages listed (MiB)', "QEMU's dropped-pages x 4 KiB"),
    ('total time (ms)', "the migration's total-time"),
]


def log(msg):
    aa.log(msg)


def label_of(items):
    return f'{items / M:g}M'


class HostRedis:
    """A redis-server with the module on this host, its port a unix socket
    we listen on; `redis()` gives clients, as a Guest's does for load_data."""

    def __init__(self, workdir, name):
        self.name = name
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, 'port.sock')
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.listener.settimeout(30)
        self.srv = Server(workdir, name, module=True, configs={'port-path': path})
        self.conn = self.ep = None

    def start(self):
        self.srv.start(timeout=30)
        self.conn, _ = self.listener.accept()
        self.ep = Endpoint(self.conn.fileno())
        return self

    def redis(self, timeout=None, socket_timeout=30, **kw):
        """A client (@timeout: load_data's wait for PING, not needed here)."""
        del timeout
        return redis.Redis(unix_socket_path=self.srv.sock, socket_timeout=socket_timeout, **kw)

    def close(self):
        self.srv.stop()
        for s in (self.conn, self.listener):
            if s:
                s.close()


def peak_rss(pid):
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            if line.startswith('VmHWM:'):
                return int(line.split()[1]) * 1024
    return None


def oncpu_ns(pid):
    """The time the main thread of process @pid (the one that serves Redis
    and the port) has spent on a CPU, in ns (/proc/PID/task/PID/schedstat):
    unlike the wall time, it does not grow while the thread waits for one."""
    with open(f'/proc/{pid}/task/{pid}/schedstat') as f:
        return int(f.read().split()[0])


def take_setup(ep, deadline_ms, pid):
    """PREPARE then the page list, as QEMU's aa_prepare() and aa_take_list()
    send them; each request timed to its reply, and the server's main thread's
    CPU time over each part.  Returns a dict of figures."""
    c0 = oncpu_ns(pid)
    t0 = time.monotonic()
    ep.send(encode('APPASSIST.PREPARE', deadline_ms))
    rep = ep.reply(timeout=deadline_ms / 1000)
    t1 = time.monotonic()
    c1 = oncpu_ns(pid)
    if isinstance(rep, Exception):
        raise RuntimeError(f'PREPARE refused: {rep}')
    rep = asmap(rep)
    out = {'prepare (ms)': 1000 * (t1 - t0),
           'prepare: module (ms)': rep[b'time_us'] / 1000,
           'freed (MiB)': rep[b'freed_bytes'] / MiB, 'items dropped': rep[b'items'],
           'page list offered': rep[b'page_list']}
    cursor = chunks = nbytes = frames = 0
    spent = 0.0
    if rep[b'page_list']:
        end = time.monotonic() + deadline_ms / 1000
        while True:
            s0 = time.monotonic()
            ep.send(encode('APPASSIST.PAGES', cursor))
            r = ep.reply(timeout=max(0.001, end - s0))
            spent += time.monotonic() - s0
            if isinstance(r, Exception):
                raise RuntimeError(f'PAGES {cursor} refused: {r}')
            remaining, data = r
            runs = decode(data)
            if remaining and not runs:
                raise RuntimeError('a PAGES reply without runs before the end')
            chunks += bool(runs)
            nbytes += len(data)
            frames += sum(n for _, n in runs)
            cursor += len(runs)
            if not remaining:
                break
        ep.send(encode('APPASSIST.PAGES', 'END'))     # no reply, as QEMU expects none
    c2 = oncpu_ns(pid)
    out['prepare: server CPU (ms)'] = (c1 - c0) / 1e6
    out['page list: server CPU (ms)'] = (c2 - c1) / 1e6
    out['set-up: server CPU (ms)'] = (c2 - c0) / 1e6
    out.update({'page list (ms)': 1000 * spent, 'page list: chunks': chunks,
                'page list: runs': cursor, 'page list: bytes': nbytes,
                'pages listed (MiB)': frames * 4096 / MiB})
    out['set-up (ms)'] = out['prepare (ms)'] + out['page list (ms)']
    return out


def host_point(items, args, workdir, label):
    """One fresh server loaded with @items, its set-up taken and timed."""
    h = HostRedis(workdir, f'{label}-{time.monotonic_ns()}')
    try:
        h.start()
        t0 = time.monotonic()
        shape = argparse.Namespace(items=items, size=args.size, hot=args.hot)
        aa.load_data(h, shape, module=True)
        load_s = time.monotonic() - t0
        c = h.redis()
        deadline = time.monotonic() + 30
        while c.info('appassist')['appassist_port_connected'] != 1:
            if time.monotonic() > deadline:
                raise RuntimeError('the module did not open its port')
            time.sleep(0.1)
        before = c.info('appassist')
        mem = c.info('memory')
        loadavg = round(os.getloadavg()[0], 2)
        row = take_setup(h.ep, args.deadline, h.srv.proc.pid)
        i = c.info('appassist')
        row.update({
            'items': items, 'load (s)': load_s, 'host load avg': loadavg,
            'cold items': before['appassist_cold_items'],
            'used_memory_rss (MiB)': mem['used_memory_rss'] / MiB,
            'page list: pagemap (ms)': i['appassist_last_prepare_page_list_us'] / 1000,
            'page list: slices': i['appassist_last_prepare_page_slices'],
            'page list: longest slice (ms)': i['appassist_last_prepare_page_slice_max_us'] / 1000,
            'page list: unlisted': i['appassist_last_prepare_page_unlisted'],
            'page list: module runs': i['appassist_last_prepare_page_runs'],
            'release': i['appassist_last_prepare_release'],
        })
        if row['page list: module runs'] != row['page list: runs']:
            raise RuntimeError(f"took {row['page list: runs']} runs, the module has "
                               f"{row['page list: module runs']}")
        h.ep.send(encode('APPASSIST.RESUME'))
        h.ep.reply(timeout=30)
        row['peak RSS (MiB)'] = peak_rss(h.srv.proc.pid) / MiB
        row['RSS after RESUME (MiB)'] = rss_of(h.srv.proc.pid) / MiB
        c.close()
        return row
    finally:
        h.close()
        shutil.rmtree(h.dir, ignore_errors=True)


def guest_point(shape, args, logdir):
    """bench/app-assist.py's `ours` at @shape (ITEMS:MEM), one migration."""
    run_args = argparse.Namespace(mem=shape['mem'], items=shape['items'], size=args.size,
                                  hot=args.hot, bandwidth=args.bandwidth, precopy_seconds=None,
                                  timeout=args.timeout, trace=None, dest_thp='on',
                                  started=args.started)
    row = aa.run_config('ours', run_args, logdir)
    ports = (row.get('app-assist') or {}).get('ports') or []
    if ports and 'app-time' in ports[0]:
        row['prepare: module (ms)'] = ports[0]['app-time'] / 1000
    row['items'] = shape['items']
    return row


# ----------------------------------------------------------------- analysis

def points(runs, kind, label):
    return [r for r in runs if r.get('kind') == kind and r.get('label') == label
            and 'failed' not in r]


def stats(rows, col):
    xs = [r[col] for r in rows if r.get(col) is not None]
    if not xs:
        return None
    m, h = mean_ci(xs)
    return {'mean': m, 'ci95': h, 'n': len(xs), 'min': min(xs), 'max': max(xs)}


def shape_of(fit):
    """Where a fitted column is linear and where not, as a phrase: flat when
    the line's rise over the range is less than its mean (less than a
    doubling over a range of 20x the items) or than 0.5 ms; else the range
    cut into stretches over which each step between neighbouring points
    costs within 1.5x of the stretch's mean per million items: one stretch
    is linear, more say where the cost per item changes."""
    pts, b = fit['points'], fit['b']
    ys = [y for _, y in pts]
    rise = b * (pts[-1][0] - pts[0][0])
    if abs(rise) < max(sum(ys) / len(ys), 0.5):
        return f'flat ({min(ys):.2f}-{max(ys):.2f} ms over the range)'
    groups = []
    for st in fit['steps']:
        g = groups[-1] if groups else None
        if g and all(x > 0 for x in g['rates'] + [st['ms per M']]):
            rates = g['rates'] + [st['ms per M']]
            if max(rates) / min(rates) <= 1.5:
                g['rates'], g['to'] = rates, st['to']
                continue
        groups.append({'from': st['from'], 'to': st['to'], 'rates': [st['ms per M']]})
    if len(groups) == 1:
        return (f'linear: {b:.2f} ms per million items, every step within 1.5x of the others '
                f'(r² {fit["r2"]:.3f})')
    return 'not linear throughout: ' + '; '.join(
        f"{sum(g['rates']) / len(g['rates']):.2f} ms per million from {g['from']:g} to "
        f"{g['to']:g} M" for g in groups)


def fit_line(xs, ys):
    """Least squares y = a + b x: (a, b, r2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / ss if ss else 1.0
    return a, b, r2


def analyse(runs, args):
    res = {'host': {}, 'guest': {}, 'fits': {}, 'aa': {}}
    for label in dict.fromkeys(r['label'] for r in runs if r.get('kind') == 'host'):
        rows = points(runs, 'host', label)
        if rows:
            res['host'][label] = {'items': rows[0]['items'],
                                  'stats': {c: stats(rows, c) for c, _ in HOST_COLS}}
    for label in dict.fromkeys(r['label'] for r in runs if r.get('kind') == 'guest'):
        rows = points(runs, 'guest', label)
        if rows:
            res['guest'][label] = {'items': rows[0]['items'], 'mem': rows[0].get('mem'),
                                   'stats': {c: stats(rows, c) for c, _ in GUEST_COLS}}
    base = [k for k in res['host'] if '@' not in k]
    for col in ('set-up (ms)', 'set-up: server CPU (ms)', 'prepare (ms)',
                'prepare: server CPU (ms)', 'prepare: module (ms)', 'page list (ms)',
                'page list: server CPU (ms)', 'page list: pagemap (ms)'):
        pts = sorted((res['host'][k]['items'] / M, res['host'][k]['stats'][col]['mean'])
                     for k in base if res['host'][k]['stats'].get(col))
        if len(pts) >= 3:
            a, b, r2 = fit_line([x for x, _ in pts], [y for _, y in pts])
            steps = [{'from': x0, 'to': x1, 'ms per M': (y1 - y0) / (x1 - x0)}
                     for (x0, y0), (x1, y1) in zip(pts, pts[1:])]
            res['fits'][col] = {'a': a, 'b': b, 'r2': r2, 'steps': steps,
                                'points': pts}
            res['fits'][col]['reading'] = shape_of(res['fits'][col])
    for label in res['host']:
        if '@' in label:
            twin = label.split('@')[0]
            res['aa'][label] = {}
            for col in ('set-up (ms)', 'set-up: server CPU (ms)'):
                a = [r[col] for r in points(runs, 'host', label) if col in r]
                b = [r[col] for r in points(runs, 'host', twin) if col in r]
                if len(a) >= 2 and len(b) >= 2:
                    p, lo, hi = ratio_ci(a, b)
                    res['aa'][label][col] = {'ratio': p, 'lo': lo, 'hi': hi}
    return res


def fmt(s, nd=1):
    if not s:
        return ''
    if s['n'] < 2 or math.isnan(s['ci95']):
        return f"{s['mean']:.{nd}f}"
    return f"{s['mean']:.{nd}f} ± {s['ci95']:.{nd}f}"


def write_report(runs, args):
    os.makedirs(args.out, exist_ok=True)
    res = analyse(runs, args)
    with open(os.path.join(args.out, f'{args.name}.json'), 'w') as f:
        json.dump({'args': vars(args), 'runs': runs, 'results': res}, f, indent=1, default=str)
    failed = [r for r in runs if 'failed' in r]
    loads = [r['host load avg'] for r in runs if 'host load avg' in r]
    lines = [f'# App-assisted migration: set-up against the item count ({args.started})', '',
             f'Generated by `bench/app-assist-setup-scale.py {args.cmdline}` '
             '(docs: the script\'s docstring).  Items of '
             f'{args.size} bytes, {int(round(100 * args.hot))} % hot, the data set of '
             '`bench/app-assist.py` (every item demoted, the hot ones read back, one compaction '
             f'pass); PREPARE sent with the deadline QEMU sends by default ({args.deadline} ms).  '
             f'{len({r["round"] for r in runs if r.get("kind") == "host"})} interleaved rounds '
             'with the host points (in an order rotated per round), '
             f'{len({r["round"] for r in runs if r.get("kind") == "guest"})} with the guest '
             'points (after the host points of their round).  '
             'Mean ± half-width of the 95 % Student t interval over the rounds.', '',
             f'Runs: {len(runs)} ({len(failed)} failed'
             + (': ' + '; '.join(f"{r['kind']} {r['label']} round {r['round']}: "
                                 f"{r['failed'][:100]}" for r in failed) if failed else '')
             + ').' + (f'  Host load average (1 min, 2 cores) when each set-up started: '
                       f'{min(loads):.2f}-{max(loads):.2f}.' if loads else ''), '']
    if res['host']:
        lines += ['## On the host (redis-server with the module, the port a unix socket)', '',
                  '| items | n | ' + ' | '.join(c for c, _ in HOST_COLS) + ' |',
                  '|---|---:|' + '---:|' * len(HOST_COLS)]
        for label, r in sorted(res['host'].items(), key=lambda kv: (kv[1]['items'], kv[0])):
            n = max((s['n'] for s in r['stats'].values() if s), default=0)
            lines.append(f'| {label} | {n} | ' + ' | '.join(
                fmt(r['stats'].get(c), 0 if c in ('page list: runs', 'page list: bytes',
                                                  'page list: chunks') else 1)
                for c, _ in HOST_COLS) + ' |')
        lines += ['', 'Columns: ' + '; '.join(f'*{c}*: {w}' for c, w in HOST_COLS) + '.', '']
        for label, qs in res['aa'].items():
            for col, q in qs.items():
                lines.append(f'A/A control: `{label}` *{col}* against `{label.split("@")[0]}`: '
                             f'{q["ratio"]:.2f}x [{q["lo"]:.2f}, {q["hi"]:.2f}] (bootstrap 95 %).')
        lines.append('')
        for col, fit in res['fits'].items():
            steps = ', '.join(f"{s['from']:g}->{s['to']:g} M: {s['ms per M']:.2f}"
                              for s in fit['steps'])
            lines.append(f'- *{col}*: {fit["reading"]}.  Least-squares line {fit["a"]:.2f} + '
                         f'{fit["b"]:.2f} ms per M items (r² {fit["r2"]:.4f}); increment per M '
                         f'between neighbours: {steps} ms.')
        lines.append('')
    if res['guest']:
        lines += ['## In a TCG guest (`bench/app-assist.py` `ours`, a real post-copy migration)',
                  '',
                  '| items | guest | n | ' + ' | '.join(c for c, _ in GUEST_COLS) + ' |',
                  '|---|---|---:|' + '---:|' * len(GUEST_COLS)]
        for label, r in sorted(res['guest'].items(), key=lambda kv: kv[1]['items']):
            n = max((s['n'] for s in r['stats'].values() if s), default=0)
            lines.append(f"| {label} | {r['mem']} | {n} | " + ' | '.join(
                fmt(r['stats'].get(c)) for c, _ in GUEST_COLS) + ' |')
        lines += ['', 'Columns: ' + '; '.join(f'*{c}*: {w}' for c, w in GUEST_COLS) + '.', '']
        gs = sorted(res['guest'].values(), key=lambda r: r['items'])
        for col in ('setup time (ms)', 'prepare (ms)', 'prepare: module (ms)', 'page list (ms)',
                    'page list: pagemap (ms)'):
            pts = [(r['items'] / M, r['stats'][col]['mean']) for r in gs if r['stats'].get(col)]
            if len(pts) >= 2:
                lines.append(f'- guest *{col}*: ' + ', '.join(
                    f'{x0:g}->{x1:g} M: {(y1 - y0) / (x1 - x0):+.2f} ms per million items'
                    for (x0, y0), (x1, y1) in zip(pts, pts[1:])) + '.')
        for label, r in sorted(res['guest'].items(), key=lambda kv: kv[1]['items']):
            h = res['host'].get(label)
            for col, hcol in (('page list: pagemap (ms)', 'page list: pagemap (ms)'),
                              ('prepare: module (ms)', 'prepare: module (ms)'),
                              ('page list (ms)', 'page list (ms)')):
                g, hs = r['stats'].get(col), h and h['stats'].get(hcol)
                if g and hs and hs['mean']:
                    lines.append(f'- {label}: guest *{col}* {g["mean"]:.1f} ms against the '
                                 f'host\'s {hs["mean"]:.1f} ms: {g["mean"] / hs["mean"]:.1f}x.')
        lines.append('')
    if args.notes and os.path.exists(args.notes):
        with open(args.notes) as f:
            lines += [f.read().rstrip(), '']
    lines += [f'![set-up against items]({args.name}.png)', '']
    with open(os.path.join(args.out, f'{args.name}.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(res, runs, args)


def chart(res, runs, args):
    """NAME.png: set-up time against items, linear axes: the host's parts
    (a line per part through its means, every run a dot, the fitted line
    dashed) and, in a second panel, the guest's beside the host's; log-log
    (a straight line of slope 1 is linear), the 95 % intervals as error bars
    where a point has 3 runs or more, cut at 0.1x the mean below."""
    def yerr(pts):
        hs = [0 if s['n'] < 3 or math.isnan(s['ci95']) else s['ci95'] for _, s in pts]
        return [[min(h, 0.9 * s['mean']) for h, (_, s) in zip(hs, pts)], hs]

    plt = charts.pyplot()
    if not plt or not (res['host'] or res['guest']):
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    base = {k: v for k, v in res['host'].items() if '@' not in k}
    for i, (col, what) in enumerate((('set-up (ms)', 'set-up (PREPARE + page list), wall'),
                                     ('set-up: server CPU (ms)', "set-up, the server's CPU time"),
                                     ('page list: pagemap (ms)', "the module's pagemap reading"),
                                     ('prepare (ms)', 'PREPARE, wall'))):
        pts = sorted((v['items'] / M, v['stats'][col]) for v in base.values()
                     if v['stats'].get(col))
        if not pts:
            continue
        ax.errorbar([x for x, _ in pts], [s['mean'] for _, s in pts], yerr=yerr(pts),
                    marker='o', capsize=3, color=f'C{i}', label=what)
        dots = [(r['items'] / M, r[col]) for r in runs
                if r.get('kind') == 'host' and '@' not in r['label'] and col in r]
        ax.scatter([x for x, _ in dots], [y for _, y in dots], s=10, alpha=0.4, color=f'C{i}')
        fit = res['fits'].get(col)
        if fit and col in ('set-up (ms)', 'set-up: server CPU (ms)'):
            xs = [min(x for x, _ in pts), max(x for x, _ in pts)]
            ax.plot(xs, [fit['a'] + fit['b'] * x for x in xs], '--', color=f'C{i}', lw=0.8,
                    label=f"fit: {fit['a']:.1f} + {fit['b']:.2f} ms/M (r² {fit['r2']:.3f})")
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('Redis items (millions)')
    ax.set_ylabel('ms')
    ax.set_title('On the host: set-up against items', fontsize=10)
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, (kind, col, what) in enumerate((
            ('guest', 'setup time (ms)', "guest: QEMU's setup-time"),
            ('guest', 'page list (ms)', "guest: QEMU's pages-time"),
            ('guest', 'prepare (ms)', "guest: QEMU's prepare-time"),
            ('host', 'set-up (ms)', 'host: set-up, wall'),
            ('host', 'set-up: server CPU (ms)', "host: set-up, the server's CPU time"))):
        src = res[kind] if kind == 'guest' else base
        pts = sorted((v['items'] / M, v['stats'][col]) for v in src.values()
                     if v['stats'].get(col))
        if not pts:
            continue
        ax.errorbar([x for x, _ in pts], [s['mean'] for _, s in pts], yerr=yerr(pts),
                    marker='o', capsize=3, color=f'C{i}', label=what,
                    linestyle='--' if kind == 'host' else '-')
        dots = [(r['items'] / M, r[col]) for r in runs
                if r.get('kind') == kind and '@' not in r['label'] and col in r]
        ax.scatter([x for x, _ in dots], [y for _, y in dots], s=10, alpha=0.4, color=f'C{i}')
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('Redis items (millions)')
    ax.set_ylabel('ms')
    ax.set_title('In a TCG guest (real migrations) and on the host', fontsize=10)
    ax.legend(fontsize=7)
    charts.save(fig, os.path.join(args.out, f'{args.name}.png'), dpi=100)


# --------------------------------------------------------------------- main

def parse_guest(text):
    out = []
    for part in filter(None, (text or '').split(',')):
        items, mem = part.split(':')
        out.append({'items': int(items), 'mem': mem})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--items', default='1000000,2000000,5000000,10000000,20000000',
                    help='host points, comma-separated item counts')
    ap.add_argument('--guest', default='1000000:1G,5000000:3G',
                    help="guest points ITEMS:MEM, comma-separated ('' for none)")
    ap.add_argument('--guest-rounds', type=int, default=None,
                    help='rounds with the guest points (default: every round)')
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--no-aa', action='store_true', help='no A/A control')
    ap.add_argument('--size', type=int, default=100)
    ap.add_argument('--hot', type=float, default=0.3)
    ap.add_argument('--deadline', type=int, default=DEADLINE_MS,
                    help="PREPARE's deadline-ms and the page list's (QEMU's app-assist-deadline)")
    ap.add_argument('--bandwidth', type=int, default=125_000_000, help='guest runs: bytes/s')
    ap.add_argument('--timeout', type=float, default=900, help='guest runs: migration timeout')
    ap.add_argument('--name', default='app-assist-setup-scale')
    ap.add_argument('--logdir', default=None)
    ap.add_argument('--add-to', metavar='JSON', default=None,
                    help="a previous run's JSON: keep its runs and add these rounds to them")
    saved_runs.add_report_args(ap)
    args = aa.parse_args(ap)
    if args.report_only:
        saved = saved_runs.load_saved(args)
        write_report(saved['runs'], args)
        return
    if os.geteuid() != 0:
        ap.error('run as root: the page list reads frames from /proc/self/pagemap')
    if not os.path.exists(MODULE):
        ap.error(f'{MODULE} missing: ninja -C build redis-module/hybridmem.so')
    host = [int(x) for x in filter(None, args.items.split(','))]
    guest = parse_guest(args.guest)
    build = os.environ.get('HYBRIDVM_BUILD') or os.path.join(TOP, 'build')
    logdir = args.logdir or os.path.join(build, 'bench',
                                         time.strftime('app-assist-setup-scale-%Y%m%d-%H%M%S'))
    os.makedirs(logdir, exist_ok=True)
    log(f'logs in {logdir}')
    runs = []
    first_round = 0
    if args.add_to:
        with open(args.add_to) as f:
            runs = json.load(f)['runs']
        first_round = 1 + max((r['round'] for r in runs), default=-1)
    order = [('host', n, label_of(n)) for n in host]
    if host and not args.no_aa:
        order.append(('host', min(host), label_of(min(host)) + '@aa'))
    workdir = tempfile.mkdtemp(prefix='setup-scale-', dir='/var/tmp')
    try:
        for rnd in range(first_round, first_round + args.rounds):
            todo = rotated(order, rnd)
            if args.guest_rounds is None or rnd - first_round < args.guest_rounds:
                g = [('guest', s, label_of(s['items'])) for s in guest]
                todo += g if rnd % 2 == 0 else g[::-1]
            for kind, what, label in todo:
                log(f'round {rnd}: {kind} {label}')
                try:
                    if kind == 'host':
                        row = host_point(what, args, workdir, label.replace('@', '-'))
                    else:
                        row = guest_point(what, args, os.path.join(logdir, str(rnd), label))
                        row['mem'] = what['mem']
                except Exception as exc:  # noqa: BLE001 -- a failed point is reported, not pooled
                    log(f'FAILED: {exc!r}')
                    row = {'failed': str(exc)[:300],
                           'items': what if kind == 'host' else what['items']}
                row.update(kind=kind, label=label, round=rnd)
                if 'failed' not in row:
                    log(f"{kind} {label}: " + json.dumps(
                        {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                         if k not in ('app-assist', 'ram', 'load timeline', 'load slowest')}))
                runs.append(row)
                write_report(runs, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    log(f'report in {args.out}/{args.name}.md')


if __name__ == '__main__':
    main()
