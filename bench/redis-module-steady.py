#!/usr/bin/env python3
"""Steady state of the appassist Redis module, no migration (issue 40,
target 1): throughput and p99 of GET, SET, INCR, MGET (10 keys) and GET at
pipeline 16 against stock Redis, goal >= 0.97x stock throughput and p99 <=
1.05x stock.

Host part: redis-benchmark (50 clients, 100-byte values) over a unix socket
against redis-server processes that all hold the same keys: 300000 `key:`
keys the benchmark reads and writes (redis-benchmark's `key:%012d`) and
300000 `cold:` keys it never touches. Configurations:
  stock         stock Redis 7.0
  stock@aa      stock again (the A/A control: its ratio to stock is the noise)
  module        Redis with the module at its defaults (on this host the
                hot budget, 30 % of RAM, holds everything: nothing is cold)
  module-cold   the module at its defaults with the `cold:` keys demoted
                to its arena before the `key:` keys were loaded (as the
                app-assist benchmark sets its guests up): every command
                runs the filter's cold-key check on a hot key
  NAME@before   with --before SO: the same as NAME with an older build of
                the module (the change's before and after in one run)
Rounds are interleaved (every configuration runs every test once per round,
in an order rotated per round, bench/pooled_stats.py); per test and
configuration the mean over rounds, ratios of means to stock with bootstrap
95 % intervals, and the server's CPU time per request (utime + stime of
redis-server / requests), the steadier figure on a shared machine.

Guest part (--guest): Redis in a 1 GiB TCG guest each (stock, stock@aa,
module, module-cold; hvlib.Guest), all booted and loaded first, then interleaved
windows of --window s in which the host client (tests/hvlib/redisload.py,
one connection, GET of random hot keys, as bench/app-assist.py's load
before its migration) reads one guest. The guests' Redis reports its own
CPU time (INFO cpu), from which the server CPU per GET.

Writes docs/bench/redis-module-steady.{md,json,png}.
Usage: build/venv/bin/python3 bench/redis-module-steady.py [--rounds 6] [--guest]
       [--before OLD.so] [--report-only docs/bench/redis-module-steady.json]
"""

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(TOP, 'tests'))

import charts  # noqa: E402
from pooled_stats import geo_mean_ci, mean, mean_ci, ratio_ci, rotated, verdict  # noqa: E402
from procstat import cpu_s  # noqa: E402
import saved_runs  # noqa: E402

# bench/redis-module.py's server, loader and benchmark helpers (one copy).
_spec = importlib.util.spec_from_file_location('redis_module_bench',
                                               os.path.join(HERE, 'redis-module.py'))
rmb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rmb)


def app_assist():
    """bench/app-assist.py, for its guests' devices (loaded on use: it
    needs QEMU's python package)."""
    spec = importlib.util.spec_from_file_location('app_assist_bench',
                                                  os.path.join(HERE, 'app-assist.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

NAME = 'redis-module-steady'
GOAL_RPS = ('>=', 0.97)
GOAL_P99 = ('<=', 1.05)
KEYS = 300000
VLEN = 100
CLIENTS = 50
# test name -> (redis-benchmark arguments after the common ones, requests)
TESTS = {
    'GET': (['-t', 'get'], 100000),
    'SET': (['-t', 'set'], 100000),
    'INCR': (['-t', 'incr'], 100000),
    'MGET10': (['MGET'] + ['key:__rand_int__'] * 10, 40000),
    'GET P16': (['-t', 'get', '-P', '16'], 400000),
}


def log(msg):
    print(f'[{time.strftime("%H:%M:%S")}] {msg}', flush=True)


def loadavg():
    return round(os.getloadavg()[0], 2)


# ------------------------------------------------------------- host

def demote_all(client):
    """Demote every key now (the loader's settings), then put the module's
    defaults back. Returns the cold item count."""
    tuning = {'hot-percent': 0, 'min-idle-ms': 0, 'interval-ms': 1, 'slice-us': 1000}
    defaults = {k: client.config_get(f'appassist.{k}')[f'appassist.{k}'] for k in tuning}
    for k, v in tuning.items():
        client.config_set(f'appassist.{k}', v)
    t0 = time.monotonic()
    calls = 0
    # The first passes may be skipped or only classify (see redis-module.py).
    while ((client.execute_command('APPASSIST.DEMOTE', 10000) > 0 or calls < 2) and
           time.monotonic() - t0 < 300):
        calls += 1
    for k, v in defaults.items():
        client.config_set(f'appassist.{k}', v)
    return client.info('appassist')['appassist_cold_items']


def start_host_servers(workdir, configs, before_so):
    servers = {}
    cold_keys = [b'cold:%d' % i for i in range(KEYS)]
    hot_keys = [b'key:%012d' % i for i in range(KEYS)]
    for name in configs:
        base = name.split('@')[0]
        module = base.startswith('module')
        so = before_so if name.endswith('@before') else rmb.MODULE
        old, rmb.MODULE = rmb.MODULE, so
        try:
            s = rmb.Srv(workdir, name.replace('@', '-'), module=module)
        finally:
            rmb.MODULE = old
        servers[name] = s
        rmb.pipe_load(s, cold_keys, VLEN, 2)
        if base == 'module-cold':
            n = demote_all(s.client())
            log(f'{name}: {n} cold items')
        rmb.pipe_load(s, hot_keys, VLEN, 1)
    return servers


def bench_run(srv, test):
    extra, n = TESTS[test]
    argv = ['redis-benchmark', '-s', srv.sock, '-n', str(n), '-r', str(KEYS), '-d', str(VLEN),
            '-c', str(CLIENTS), '--csv', '-q'] + extra
    c0 = cpu_s(srv.proc.pid)
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True,
                         preexec_fn=rmb.pinned(rmb.CLIENT_CPUS)).stdout
    cpu_us = (cpu_s(srv.proc.pid) - c0) * 1e6 / n
    rps, p99 = rmb.parse_csv(out)
    return {'rps': rps, 'p99_ms': p99, 'cpu_us': cpu_us}


def host_part(a, workdir):
    configs = ['stock', 'stock@aa', 'module', 'module-cold']
    if a.before:
        configs += ['module@before', 'module-cold@before']
    servers = start_host_servers(workdir, configs, a.before)
    runs = []
    try:
        for rnd in range(a.rounds):
            for test in rotated(TESTS, rnd):
                for name in rotated(configs, rnd):
                    rmb.quiet(servers)
                    r = bench_run(servers[name], test)
                    r.update(config=name, test=test, round=rnd, load=loadavg())
                    runs.append(r)
            log(f'host round {rnd + 1}/{a.rounds} done, load {loadavg()}')
        info = {n: {k: v for k, v in s.client().info('appassist').items()
                    if k in ('appassist_cold_items', 'appassist_background_bites',
                             'appassist_background_bites_idle', 'appassist_background_bite_arms',
                             'appassist_background_slices', 'appassist_skipped_passes',
                             'appassist_passes', 'appassist_background_cpu_us')}
                for n, s in servers.items() if n.startswith('module')}
    finally:
        for s in servers.values():
            s.stop()
    return {'configs': configs, 'runs': runs, 'module_info': info}


# ------------------------------------------------------------- guest

class OverlayPaths:
    """hvlib's build paths with the guest's initrd swapped for one that
    carries another build of the module (a cpio appended: the kernel unpacks
    both, the later file wins)."""

    def __init__(self, so, workdir):
        from hvlib.paths import BuildPaths
        self.base = BuildPaths()
        self.dir = os.path.join(workdir, 'guest-' + str(abs(hash(so))))
        os.makedirs(os.path.join(self.dir, 'tree', 'opt', 'hybridvm'), exist_ok=True)
        shutil.copy(so, os.path.join(self.dir, 'tree', 'opt', 'hybridvm', 'hybridmem.so'))
        cpio = subprocess.run('cd tree && find . | cpio -o -H newc --quiet | gzip -1',
                              shell=True, cwd=self.dir, stdout=subprocess.PIPE, check=True).stdout
        with open(os.path.join(self.dir, 'initrd.img'), 'wb') as out:
            with open(self.base.guest_file('initrd.img'), 'rb') as f:
                shutil.copyfileobj(f, out)
            out.write(cpio)

    def __getattr__(self, attr):
        return getattr(self.base, attr)

    def guest_file(self, name):
        if name == 'initrd.img':
            return os.path.join(self.dir, name)
        return self.base.guest_file(name)


def guest_load(g, module_cold, items, hot_share):
    """`items` keys of 100 bytes (hex names), the first hot_share of them
    hot; module-cold: the others demoted first (the module's loader
    settings, then its defaults back), as bench/app-assist.py's guests."""
    r = g.redis(timeout=120, socket_timeout=300)
    nhot = int(items * hot_share)
    blob = random.Random(7).randbytes(VLEN + 4096)

    def mset(lo, hi):
        for i in range(lo, hi, 10000):
            p = r.pipeline(transaction=False)
            for b in range(i, min(hi, i + 10000), 1000):
                p.mset({f'{j:x}': blob[j % 4096:j % 4096 + VLEN] for j in range(b, min(hi, b + 1000))})
            p.execute()
    t0 = time.monotonic()
    mset(nhot, items)
    if module_cold:
        demote_all(r)
    mset(0, nhot)
    info = r.info('appassist') if module_cold else {}
    log(f'{g.name}: loaded in {time.monotonic() - t0:.0f} s, '
        f'{info.get("appassist_cold_items", 0)} cold items')
    r.close()
    return [f'{j:x}' for j in range(nhot)]


def guest_cpu(client):
    c = client.info('cpu')
    return c['used_cpu_user'] + c['used_cpu_sys']


def guest_part(a, workdir):
    import hvlib
    aa = app_assist()
    configs = ['stock', 'stock@aa', 'module', 'module-cold']
    if a.before:
        configs += ['module@before', 'module-cold@before']
    logdir = os.path.join(workdir, 'guest-logs')
    guests, hot = {}, None
    try:
        for name in configs:
            base = name.split('@')[0]
            # app-assist.py's devices (the module's host port, a balloon)
            # in every guest, as in its runs before the migration.
            kw = dict(mem='1G', module=base.startswith('module'), balloon=False,
                      args=aa.guest_args('ours'))
            if name.endswith('@before'):
                kw['paths'] = OverlayPaths(a.before, workdir)
            g = hvlib.Guest(name.replace('@', '-'), logdir, **kw)
            guests[name] = g
            g.launch()
            g.wait_console(r'HV-READY redis', timeout=180)
            g.run(aa.LINK_PORTS)
            hot = guest_load(g, base == 'module-cold', a.items, 0.3)
        runs = []
        for rnd in range(a.guest_rounds):
            for name in rotated(configs, rnd):
                g = guests[name]
                client = g.redis()
                load = hvlib.RedisLoad([g.redis_port], hot)
                cpu0 = guest_cpu(client)
                load.thread.start()
                time.sleep(1.0)         # connected and warm
                t0 = time.monotonic()
                time.sleep(a.window)
                t1 = time.monotonic()
                load.stop.set()
                load.thread.join(10)
                cpu = guest_cpu(client) - cpu0
                served = len(load.samples)
                f = load.figures(t0, t1)
                runs.append({'config': name, 'round': rnd, 'ops': f['ops/s'],
                             'p99_ms': f['p99 (ms)'], 'cpu_us': cpu * 1e6 / max(served, 1),
                             'failed': f['failed'], 'load': loadavg()})
                client.close()
            log(f'guest round {rnd + 1}/{a.guest_rounds} done, load {loadavg()}')
    finally:
        for g in guests.values():
            g.shutdown()
    return {'configs': configs, 'runs': runs}


# ------------------------------------------------------------- report

def fmt_r(r):
    return '%.3f [%.3f, %.3f]' % r


def host_tables(h, L):
    runs, configs = h['runs'], h['configs']
    others = [c for c in configs if c != 'stock']

    def vals(cfg, test, key):
        return [r[key] for r in runs if r['config'] == cfg and r['test'] == test]
    L.append('| test | config | rps (mean ± 95 %) | x stock rps | p99 ms | x stock p99 | '
             'server CPU us/req | x stock CPU |')
    L.append('|---|---|---:|---:|---:|---:|---:|---:|')
    summary = []
    for test in TESTS:
        for cfg in configs:
            rps = mean_ci(vals(cfg, test, 'rps'))
            p99 = mean(vals(cfg, test, 'p99_ms'))
            cpu = mean(vals(cfg, test, 'cpu_us'))
            if cfg == 'stock':
                L.append('| %s | stock | %.0f ± %.0f | | %.3f | | %.2f | |' % (test, rps[0], rps[1], p99, cpu))
                continue
            rr = ratio_ci(vals(cfg, test, 'rps'), vals('stock', test, 'rps'))
            rp = ratio_ci(vals(cfg, test, 'p99_ms'), vals('stock', test, 'p99_ms'))
            rc = ratio_ci(vals(cfg, test, 'cpu_us'), vals('stock', test, 'cpu_us'))
            summary.append((test, cfg, rr, rp, rc))
            L.append('| %s | %s | %.0f ± %.0f | %s | %.3f | %s | %.2f | %s |'
                     % (test, cfg, rps[0], rps[1], fmt_r(rr), p99, fmt_r(rp), cpu, fmt_r(rc)))
    L.append('')
    L.append('Pooled over the %d tests: the geometric mean of each run\'s ratio to the stock '
             'run of the same test and round, with its 95 %% interval (%d pairs per configuration):'
             % (len(TESTS), sum(1 for r in runs if r['config'] == 'stock')))
    L.append('')
    L.append('| config | rps | p99 | server CPU per request |')
    L.append('|---|---:|---:|---:|')
    idx = {(r['config'], r['test'], r['round']): r for r in runs}
    for cfg in others:
        L.append('| %s | %s |' % (cfg, ' | '.join(
            fmt_r(geo_mean_ci([r[key] / idx[('stock', r['test'], r['round'])][key]
                               for r in runs if r['config'] == cfg]))
            for key in ('rps', 'p99_ms', 'cpu_us'))))
    L.append('')
    L.append('Verdicts (the whole bootstrap interval against the goal; stock@aa shows what '
             'the machine alone gives):')
    L.append('')
    L.append('| test | config | throughput >= 0.97x | p99 <= 1.05x |')
    L.append('|---|---|---|---|')
    for test, cfg, rr, rp, rc in summary:
        L.append('| %s | %s | %.2f: %s | %.2f: %s |' % (test, cfg, rr[0], verdict(rr[1], rr[2], GOAL_RPS),
                                                        rp[0], verdict(rp[1], rp[2], GOAL_P99)))
    L.append('')
    return summary


def guest_tables(gp, L):
    runs, configs = gp['runs'], gp['configs']

    def vals(cfg, key):
        return [r[key] for r in runs if r['config'] == cfg]
    L.append('| config | GETs/s (mean ± 95 %) | x stock | p99 ms | x stock p99 | '
             'guest Redis CPU us/GET | x stock CPU |')
    L.append('|---|---:|---:|---:|---:|---:|---:|')
    summary = []
    for cfg in configs:
        ops = mean_ci(vals(cfg, 'ops'))
        p99 = mean(vals(cfg, 'p99_ms'))
        cpu = mean(vals(cfg, 'cpu_us'))
        if cfg == 'stock':
            L.append('| stock | %.0f ± %.0f | | %.2f | | %.0f | |' % (ops[0], ops[1], p99, cpu))
            continue
        rr = ratio_ci(vals(cfg, 'ops'), vals('stock', 'ops'))
        rp = ratio_ci(vals(cfg, 'p99_ms'), vals('stock', 'p99_ms'))
        rc = ratio_ci(vals(cfg, 'cpu_us'), vals('stock', 'cpu_us'))
        summary.append((cfg, rr, rp, rc))
        L.append('| %s | %.0f ± %.0f | %s | %.2f | %s | %.0f | %s |'
                 % (cfg, ops[0], ops[1], fmt_r(rr), p99, fmt_r(rp), cpu, fmt_r(rc)))
    L.append('')
    for cfg, rr, rp, rc in summary:
        L.append('- %s: GETs/s %s (%s), p99 %s (%s).' % (cfg, fmt_r(rr), verdict(rr[1], rr[2], GOAL_RPS),
                                                      fmt_r(rp), verdict(rp[1], rp[2], GOAL_P99)))
    L.append('')
    return summary


def write_report(saved, out, notes, name=NAME):
    a = saved['args']
    L = ['# The module in steady state, no migration (bench/redis-module-steady.py, issue 40)', '']
    L.append('redis-server %s, 2 cores shared with other engineers\' builds and benchmarks. '
             'Goals: throughput >= 0.97x stock, p99 <= 1.05x stock. Configurations with '
             '`@before` run the module as built before the change of this run (`--before`), '
             'side by side with the current build. Every run records its 1-min load average '
             'in the JSON.' % saved.get('redis_version', '?'))
    L.append('')

    def run_line(part):
        r = saved[part].get('run') or {k: saved[k] for k in ('command', 'when', 'load_start', 'load_end')}
        L.append('Command: `%s`; measured %s; 1-min load average %s at the start, %s at the end.'
                 % (r['command'], r['when'], r['load_start'], r['load_end']))
        L.append('')
        return r
    h = saved.get('host')
    hs = gs = None
    if h:
        hr = run_line('host')
        L.insert(len(L) - 2, '## Host: redis-benchmark, %d rounds' % hr.get('rounds', a['rounds']))
        L.insert(len(L) - 2, '')
        L.append('50 clients over a unix socket, 100-byte values, `-r %d`; every server holds the '
                 '%d `key:` keys the tests use and %d `cold:` keys they never touch. module: the '
                 'module at its defaults (nothing cold: the hot budget, 30 %% of this host\'s '
                 'RAM, holds it all); module-cold: the `cold:` keys in its arena (demoted before '
                 'the `key:` keys were loaded), defaults otherwise. Servers on CPU %s, '
                 'redis-benchmark on the other. Mean over rounds; ratios of means with bootstrap '
                 '95 %% intervals. MGET10 is `MGET` of 10 random `key:` keys.'
                 % (KEYS, KEYS, KEYS, saved.get('server_cpus', '?')))
        L.append('')
        hs = host_tables(h, L)
        if h.get('module_info'):
            L.append('The modules\' background counters at the end: ' + '; '.join(
                '%s: %s' % (n, ', '.join('%s %s' % (k.replace('appassist_', ''), v)
                                         for k, v in i.items()))
                for n, i in h['module_info'].items()) + '.')
            L.append('')
    g = saved.get('guest')
    if g:
        gr = run_line('guest')
        L.insert(len(L) - 2, '## Guest: the host client against Redis in a TCG guest, %d rounds of %d s'
                 % (gr.get('rounds', a['guest_rounds']), gr.get('window', a['window'])))
        L.insert(len(L) - 2, '')
        L.append('One 1 GiB TCG guest per configuration, booted and loaded first (%d items of 100 '
                 'bytes, 30 %% of them hot; module-cold: the other 70 %% demoted first, as '
                 'bench/app-assist.py\'s guests), then windows in rotating order in which the '
                 'host client (hvlib.RedisLoad: one connection, GET of random hot keys through '
                 'the forwarded port) reads one guest while the others idle. Every guest has '
                 'bench/app-assist.py\'s devices (virtio-serial with the module\'s host port, a '
                 'balloon); no migration. Guest Redis CPU per '
                 'GET is INFO cpu\'s used_cpu_user + used_cpu_sys over the window / GETs.'
                 % gr.get('items', a['items']))
        L.append('')
        gs = guest_tables(g, L)
    if notes and os.path.exists(notes):
        L.append(open(notes).read())
    L.append('![chart](%s.png)' % name)
    L.append('')
    with open(os.path.join(out, name + '.md'), 'w') as f:
        f.write('\n'.join(L))
    plt = charts.pyplot()
    if not plt:
        return
    panels = [p for p in (('host throughput', hs, 2), ('host p99', hs, 3), ('host CPU/request', hs, 4),
                          ('guest GETs/s', gs, 1), ('guest p99', gs, 2)) if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.35 * max(len(p[1]) for p in panels) + 1.5))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (title, rows, idx) in zip(axes, panels):
        labels = ['%s %s' % r[:2] if rows is hs else r[0] for r in rows]
        rs = [dict(zip(('ratio', 'lo', 'hi'), r[idx])) for r in rows]
        charts.ratio_points(ax, range(len(rows)), rs)
        charts.ratio_rows(ax, labels, 'x stock')
        goal = GOAL_RPS[1] if 'p99' not in title and 'CPU' not in title else (GOAL_P99[1] if 'p99' in title else None)
        if goal:
            ax.axvline(goal, color='red', ls='--', lw=0.8)
        ax.set_title(title, fontsize=10)
    charts.save(fig, os.path.join(out, name + '.png'), dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rounds', type=int, default=6, help='host rounds')
    ap.add_argument('--no-host', action='store_true')
    ap.add_argument('--guest', action='store_true', help='the guest part as well')
    ap.add_argument('--guest-rounds', type=int, default=4)
    ap.add_argument('--window', type=int, default=8, help='guest window, s')
    ap.add_argument('--items', type=int, default=300000, help='guest items')
    ap.add_argument('--before', help='an older hybridmem.so, run as NAME@before')
    ap.add_argument('--name', default=NAME, help='the report\'s file names in --out (NAME.md, .json, .png)')
    saved_runs.add_report_args(ap)
    a = ap.parse_args()
    if a.report_only:
        saved = saved_runs.load_saved(a)
        write_report(saved, a.out, a.notes, a.name)
        print(open(os.path.join(a.out, a.name + '.md')).read())
        return
    if not os.path.exists(rmb.MODULE):
        sys.exit('build the module first: ninja -C build redis-module/hybridmem.so')
    if a.before:
        # A private copy: the build may replace the file while this runs.
        a.before = os.path.abspath(a.before)
    workdir = tempfile.mkdtemp(prefix='hmsteady-')
    saved = {'args': vars(a), 'command': ' '.join(['bench/redis-module-steady.py'] + sys.argv[1:]),
             'when': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), 'load_start': loadavg(),
             'server_cpus': ','.join(map(str, sorted(rmb.SERVER_CPUS or ()))),
             'redis_version': subprocess.run(['redis-server', '--version'], stdout=subprocess.PIPE,
                                             text=True).stdout.split()[2]}
    # A run of one part keeps the other's last results from the JSON at
    # --out, with that run's own command, date and load.
    old_json = os.path.join(a.out, a.name + '.json')
    if os.path.exists(old_json):
        with open(old_json) as f:
            prev = json.load(f)
        for part, skipped in (('host', a.no_host), ('guest', not a.guest)):
            if skipped and part in prev:
                saved[part] = prev[part]
    try:
        if a.before:
            priv = os.path.join(workdir, 'before.so')
            shutil.copy(a.before, priv)
            a.before = priv
        if not a.no_host:
            saved['host'] = host_part(a, workdir)
        if a.guest:
            saved['guest'] = guest_part(a, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    saved['load_end'] = loadavg()
    for part, ran in (('host', not a.no_host), ('guest', a.guest)):
        if ran:
            saved[part]['run'] = {k: saved[k] for k in ('command', 'when', 'load_start', 'load_end')}
            saved[part]['run']['rounds'] = a.rounds if part == 'host' else a.guest_rounds
            saved[part]['run'].update(window=a.window, items=a.items)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + '.json'), 'w') as f:
        json.dump(saved, f, indent=1)
    write_report(saved, a.out, a.notes, a.name)
    print(open(os.path.join(a.out, a.name + '.md')).read())


if __name__ == '__main__':
    main()
