#!/usr/bin/env python3
"""Benchmark of the appassist Redis module (issue 4).

1. redis-benchmark GET/SET, pipeline 1 and 16, stock Redis vs Redis with the
   module, in two module set-ups: "module" (loaded, nothing cold: the cost of
   the command filter) and "module-70%cold" (planned memory so that ~70 % of
   the keys are cold: uniform random keys make every other access promote).
   Runs are interleaved and repeated; the median is reported.
2. PREPARE (drop) time and memory freed for N cold items (1M and 5M by
   default), against the design's way measured in the same run: a stock
   Redis with the same items, every key scanned inside the server (a Lua
   script per SCAN batch of 1000) and the cold ones (LFU counter never
   raised since loading) deleted, then MEMORY PURGE.

Writes docs/bench/redis-module.md (tables) and docs/bench/redis-module.png.
Usage: build/venv/bin/python bench/redis-module.py [--quick] [--cold 1000000,5000000]
"""

import argparse
import csv
import io
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import redis

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'redis-module', 'tests'))
from hmlib import pipe  # noqa: E402

TOP = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
MODULE = os.path.join(TOP, 'build', 'redis-module', 'hybridmem.so')
OUT_MD = os.path.join(TOP, 'docs', 'bench', 'redis-module.md')
OUT_PNG = os.path.join(TOP, 'docs', 'bench', 'redis-module.png')
OUT_JSON = os.path.join(TOP, 'docs', 'bench', 'redis-module.json')
ALPHA = b'0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'


def short_key(i):
    s = b''
    while True:
        s = ALPHA[i % 62:i % 62 + 1] + s
        i //= 62
        if i == 0:
            return s


class Srv:
    def __init__(self, workdir, name, module=False, configs=None):
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.sock = os.path.join(self.dir, 's.sock')
        argv = ['redis-server', '--port', '0', '--unixsocket', self.sock, '--dir', self.dir,
                '--save', '', '--appendonly', 'no', '--logfile', os.path.join(self.dir, 'log')]
        if module:
            argv += ['--loadmodule', MODULE, '--appassist.port-path', '']
            for k, v in (configs or {}).items():
                argv += ['--appassist.' + k, str(v)]
        self.proc = subprocess.Popen(argv)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.path.exists(self.sock) and self.client().ping():
                    return
            except redis.ConnectionError:
                pass
            time.sleep(0.02)
        raise RuntimeError('redis-server did not start')

    def client(self):
        return redis.Redis(unix_socket_path=self.sock, socket_timeout=600)

    def rss(self):
        with open('/proc/%d/statm' % self.proc.pid) as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def pipe_load(srv, keys, vlen, seed):
    """SET every key to one random value of `vlen` bytes."""
    val = random.Random(seed).randbytes(vlen)
    pipe(srv, ((b'SET', k, val) for k in keys))


def pipe_touch(srv, keys):
    """Read every key once (STRLEN touches the key like GET, small reply)."""
    pipe(srv, ((b'STRLEN', k) for k in keys))


def settle(srv):
    srv.client().execute_command('MEMORY', 'PURGE')
    time.sleep(0.5)
    return srv.rss()


# ------------------------------------------------------------- throughput

def cpu_s(pid):
    """utime + stime of a process, seconds."""
    with open('/proc/%d/stat' % pid) as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def redis_benchmark(srv, test, pipeline, n, keyspace):
    c0 = cpu_s(srv.proc.pid)
    out = subprocess.run(['redis-benchmark', '-s', srv.sock, '-t', test, '-n', str(n),
                          '-P', str(pipeline), '-r', str(keyspace), '-d', '100', '-c', '50',
                          '--csv', '-q'], check=True, capture_output=True, text=True).stdout
    cpu_us = (cpu_s(srv.proc.pid) - c0) * 1e6 / n
    rows = list(csv.DictReader(io.StringIO(out)))
    r = rows[0]
    return float(r['rps']), float(r['p99_latency_ms']), cpu_us


def throughput(workdir, quick):
    keyspace = 100000 if quick else 300000
    n = 200000 if quick else 1000000
    reps = 3 if quick else 5
    setups = {
        'stock': dict(module=False),
        'module': dict(module=True, configs={}),
        # ~30 % of the keyspace fits in the hot budget: ~70 % cold
        'module-70%cold': dict(module=True, configs={
            'planned-memory': keyspace * (100 + 16 + 48), 'hot-percent': 30,
            'min-idle-ms': 0}),
    }
    servers = {name: Srv(workdir, name, **kw) for name, kw in setups.items()}
    try:
        for s in servers.values():
            keys = [b'key:%012d' % i for i in range(keyspace)]    # redis-benchmark's -r keys
            pipe_load(s, keys, 100, 1)
        time.sleep(3)   # let the module's background passes classify
        results = {}
        for test in ('set', 'get'):
            for p in (1, 16):
                for rep in range(reps):
                    for name, s in servers.items():
                        results.setdefault((test, p, name), []).append(
                            redis_benchmark(s, test, p, n, keyspace))
        cold = {name: s.client().info('appassist').get('appassist_cold_items', 0)
                if name != 'stock' else 0 for name, s in servers.items()}
        promos = {name: s.client().info('appassist').get('appassist_promotions', 0)
                  if name != 'stock' else 0 for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    table = {}
    for (test, p, name), v in results.items():
        table[(test, p, name)] = tuple(statistics.median(x[i] for x in v) for i in range(3))
    return table, list(setups), cold, promos, n, keyspace


# ------------------------------------------------------------- prepare

def prepare_vs_design(workdir, ncold, vlen=100):
    nhot = int(ncold * 3 / 7)
    keys = [short_key(i) for i in range(ncold + nhot)]
    random.Random(ncold).shuffle(keys)
    hot, cold = keys[:nhot], keys[nhot:]
    res = {'cold': ncold, 'hot': nhot}

    # Ours.
    # Classification by Redis's LFU counters (no decay during the run): a
    # key read once after loading has counter 6, the others 5; the hot
    # budget is sized 10 % above the hot items' estimated bytes, so exactly
    # the unread keys are demoted.
    avg_klen = sum(len(k) for k in keys[:10000]) / 10000
    planned = int(nhot * (vlen + avg_klen + 48) * 1.1 / 0.3)
    m = Srv(workdir, 'mod-%d' % ncold, module=True,
            configs={'demote': 'no', 'hot-percent': 30, 'planned-memory': planned,
                     'min-idle-ms': 0})
    try:
        mc = m.client()
        mc.config_set('maxmemory-policy', 'allkeys-lfu')
        mc.config_set('lfu-decay-time', 0)
        pipe_load(m, hot, vlen, 1)
        pipe_load(m, cold, vlen, 2)
        res['rss_all_mod'] = settle(m)
        pipe_touch(m, hot)
        mc.config_set('appassist.demote', 'yes')
        t0 = time.monotonic()
        while mc.info('appassist')['appassist_cold_items'] < ncold:
            mc.execute_command('APPASSIST.DEMOTE', 5000)
            if time.monotonic() - t0 > 600:
                raise RuntimeError('demotion too slow')
        res['demote_s'] = time.monotonic() - t0
        mc.config_set('appassist.demote', 'no')
        if mc.info('appassist')['appassist_cold_items'] != ncold:
            raise RuntimeError('classification demoted %d items, expected %d'
                               % (mc.info('appassist')['appassist_cold_items'], ncold))
        rss0 = settle(m)
        t0 = time.monotonic()
        rep = mc.execute_command('APPASSIST.PREPARE')
        res['ours_wall_ms'] = (time.monotonic() - t0) * 1000
        rep = dict(zip(rep[::2], rep[1::2]))
        res['ours_us'] = rep[b'time_us']
        res['ours_freed_reported'] = rep[b'freed_bytes']
        rss1 = settle(m)
        res['ours_rss_fall'] = rss0 - rss1
        res['ours_rss_fall_from_all'] = res['rss_all_mod'] - rss1
        res['ours_rss_after'] = rss1
    finally:
        m.stop()

    # The design's way on stock Redis: scan every key inside the server and
    # delete the cold ones, then MEMORY PURGE. Cold = not read since loading
    # (LFU counter still at its initial 5), decided by the server itself in a
    # Lua script per SCAN batch, as the design's patched Redis did in C.
    s = Srv(workdir, 'stock-%d' % ncold)
    try:
        sc = s.client()
        sc.config_set('maxmemory-policy', 'allkeys-lfu')
        sc.config_set('lfu-decay-time', 0)
        pipe_load(s, hot, vlen, 1)
        res['rss_hot_stock'] = settle(s)
        pipe_load(s, cold, vlen, 2)
        pipe_touch(s, hot)
        rss0 = settle(s)
        res['rss_all_stock'] = rss0
        script = sc.register_script("""
            local r = redis.call('SCAN', ARGV[1], 'COUNT', 1000)
            local n = 0
            for _, k in ipairs(r[2]) do
                if redis.call('OBJECT', 'FREQ', k) <= 5 then
                    redis.call('DEL', k)
                    n = n + 1
                end
            end
            return {r[1], n}""")
        t0 = time.monotonic()
        cur, deleted = b'0', 0
        while True:
            cur, n = script(args=[cur])
            deleted += n
            if cur == b'0':
                break
        sc.execute_command('MEMORY', 'PURGE')
        res['design_ms'] = (time.monotonic() - t0) * 1000
        if deleted != ncold:
            raise RuntimeError('design way deleted %d, expected %d' % (deleted, ncold))
        rss1 = settle(s)
        res['design_rss_fall'] = rss0 - rss1
        res['stock_cost'] = res['rss_all_stock'] - res['rss_hot_stock']
    finally:
        s.stop()
    return res


# ------------------------------------------------------------- output

def mib(b):
    return '%.1f' % (b / 2**20)


def write(tp, setups, cold, promos, n, keyspace, prep, cpu, loadavg, when):
    os.makedirs(os.path.dirname(OUT_MD), exist_ok=True)
    L = []
    L.append('# Redis module benchmark (bench/redis-module.py)')
    L.append('')
    L.append('Measured on this machine (%s), redis-server %s: throughput %s, PREPARE %s. '
             'Re-run after any change to the filter, the arena or the PREPARE path.'
             % (cpu,
                subprocess.run(['redis-server', '--version'], capture_output=True,
                               text=True).stdout.split()[2], when['throughput'], when['prepare']))
    L.append('')
    if tp:
        L.append('## Throughput and p99 latency (redis-benchmark, 50 clients, 100-byte values, '
                 '%d requests, %d random keys, median of %d interleaved runs)'
                 % (n, keyspace, 3 if n < 1000000 else 5))
        L.append('')
        L.append('Targets: >= 0.9x stock throughput, p99 <= 1.1x stock. The machine is shared '
                 '(load average %s while measuring): wall-clock rps and p99 are noisy; the '
                 'server CPU time per request (utime+stime of redis-server / requests) is the '
                 'steadier figure.' % loadavg)
        L.append('')
        L.append('| test | pipeline | setup | rps | x stock | p99 ms | x stock | server CPU us/req | x stock |')
        L.append('|---|---|---|---|---|---|---|---|---|')
        for test in ('set', 'get'):
            for p in (1, 16):
                base = tp[(test, p, 'stock')]
                for name in setups:
                    rps, p99, cpu = tp[(test, p, name)]
                    L.append('| %s | %d | %s | %.0f | %.2f | %.3f | %.2f | %.2f | %.2f |'
                             % (test.upper(), p, name, rps, rps / base[0], p99,
                                p99 / base[1] if base[1] else float('nan'),
                                cpu, cpu / base[2] if base[2] else float('nan')))
        L.append('')
        L.append('Cold items at the end: %s; promotions during the runs: %s.'
                 % (', '.join('%s %d' % kv for kv in cold.items() if kv[0] != 'stock'),
                    ', '.join('%s %d' % kv for kv in promos.items() if kv[0] != 'stock')))
        L.append('')
    if prep:
        L.append('## PREPARE (drop) vs the design\'s way (in-server SCAN + DEL of the cold keys + MEMORY PURGE)')
        L.append('')
        L.append('100-byte values, 1-8 byte keys, 30 % hot. "RSS fall" is measured across the '
                 'operation; "stock cost" is stock RSS with all items minus stock RSS with the '
                 'hot items only.')
        L.append('')
        L.append('| cold items | stock cost MiB | PREPARE time ms | PREPARE RSS fall MiB | '
                 'RSS fall from all-loaded MiB (% of cost) | design time ms | design RSS fall MiB '
                 '(% of cost) | speed-up |')
        L.append('|---|---|---|---|---|---|---|---|')
        for r in prep:
            L.append('| %d | %s | %.1f | %s | %s (%.0f%%) | %.0f | %s (%.0f%%) | %.0fx |'
                     % (r['cold'], mib(r['stock_cost']), r['ours_us'] / 1000,
                        mib(r['ours_rss_fall']), mib(r['ours_rss_fall_from_all']),
                        100.0 * r['ours_rss_fall_from_all'] / r['stock_cost'],
                        r['design_ms'], mib(r['design_rss_fall']),
                        100.0 * r['design_rss_fall'] / r['stock_cost'],
                        r['design_ms'] / (r['ours_us'] / 1000)))
        L.append('')
        L.append('Demotion of the cold set before PREPARE (background work, not part of '
                 'PREPARE): %s.' % ', '.join('%d items in %.1f s' % (r['cold'], r['demote_s'])
                                             for r in prep))
        L.append('')
    L.append('![chart](redis-module.png)')
    L.append('')
    with open(OUT_MD, 'w') as f:
        f.write('\n'.join(L))

    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    ncols = (2 if tp else 0) + (1 if prep else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
    if ncols == 1:
        axes = [axes]
    ax_i = 0
    if tp:
        labels = ['%s P%d' % (t.upper(), p) for t in ('set', 'get') for p in (1, 16)]
        width = 0.8 / len(setups)
        for idx, title, ylabel, target in (
                (0, 'redis-benchmark throughput vs stock', 'rps / stock', 0.9),
                (2, 'server CPU per request vs stock', 'CPU us per request / stock', None)):
            ax = axes[ax_i]
            ax_i += 1
            for j, name in enumerate(setups):
                vals = [tp[(t, p, name)][idx] / tp[(t, p, 'stock')][idx]
                        for t in ('set', 'get') for p in (1, 16)]
                ax.bar([i + j * width for i in range(len(labels))], vals, width, label=name)
            if target:
                ax.axhline(target, color='red', linestyle='--', linewidth=1,
                           label='target %.1fx' % target)
            ax.set_xticks([i + width for i in range(len(labels))])
            ax.set_xticklabels(labels)
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.legend(fontsize=8)
    if prep:
        ax = axes[ax_i]
        xs = [r['cold'] for r in prep]
        ax.plot(xs, [r['ours_us'] / 1000 for r in prep], 'o-', label='APPASSIST.PREPARE drop')
        ax.plot(xs, [r['design_ms'] for r in prep], 's-', label='SCAN + DEL + MEMORY PURGE')
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('cold items')
        ax.set_ylabel('time (ms, log)')
        ax.set_title('Giving up the cold set')
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT_PNG, dpi=100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--quick', action='store_true', help='small sizes (a smoke run)')
    ap.add_argument('--cold', default=None, help='comma-separated cold item counts')
    ap.add_argument('--no-throughput', action='store_true')
    ap.add_argument('--no-prepare', action='store_true')
    ap.add_argument('--render-only', action='store_true',
                    help='rewrite the table and chart from the saved JSON, measure nothing')
    a = ap.parse_args()
    if not os.path.exists(MODULE):
        sys.exit('build the module first: ninja -C build redis-module/hybridmem.so')
    for tool in ('redis-server', 'redis-benchmark', 'redis-cli'):
        if not shutil.which(tool):
            sys.exit('%s not found (apt-get install redis-server redis-tools)' % tool)
    sizes = [int(x) for x in (a.cold or ('100000,300000' if a.quick else '1000000,5000000')).split(',')]
    cpu = '%d cores' % os.cpu_count()
    workdir = tempfile.mkdtemp(prefix='hmbench-')
    # A partial run (--no-throughput / --no-prepare) keeps the other part's
    # last measured results from the JSON file next to the table.
    saved = {}
    if os.path.exists(OUT_JSON):
        with open(OUT_JSON) as f:
            saved = json.load(f)
    try:
        if a.render_only:
            a.no_throughput = a.no_prepare = True
        if not a.no_throughput:
            tp, setups, cold, promos, n, keyspace = throughput(workdir, a.quick)
            saved['throughput'] = {'table': [[k[0], k[1], k[2]] + list(v) for k, v in tp.items()],
                                   'setups': setups, 'cold': cold, 'promos': promos,
                                   'n': n, 'keyspace': keyspace,
                                   'loadavg': open('/proc/loadavg').read().split()[0],
                                   'when': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}
        if not a.no_prepare:
            prep = []
            for c in sizes:
                prep.append(prepare_vs_design(workdir, c))
                print(prep[-1], flush=True)
            saved['prepare'] = prep
            saved['prepare_when'] = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
        os.makedirs(os.path.dirname(OUT_JSON), exist_ok=True)
        with open(OUT_JSON, 'w') as f:
            json.dump(saved, f, indent=1)
        t = saved.get('throughput')
        tp = {(r[0], r[1], r[2]): tuple(r[3:]) for r in t['table']} if t else None
        when = {'throughput': t.get('when', '2026-11-21 11:40 UTC') if t else None,
                'prepare': saved.get('prepare_when', '2026-11-21 11:07 UTC')}
        write(tp, t and t['setups'], t and t['cold'], t and t['promos'], t and t['n'],
              t and t['keyspace'], saved.get('prepare', []), cpu, t and t['loadavg'], when)
        print(open(OUT_MD).read())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == '__main__':
    main()
