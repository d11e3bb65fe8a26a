#!/usr/bin/env python3
"""4 KiB QD1 latency of a hybrid node in one process, against null-co, the
block layer's own floor (issue 40, target 2: p99 at most 1.5x null-co's).

One qemu-io process per run opens the node with --image-opts (and a
write-back cache, as a guest's disk has it: no FUA on every write) and issues
--ops single 4 KiB requests one after the other at random 4 KiB-aligned
offsets of a --size area: qemu-io times each request around the block
layer's call (its "ops/sec" line, microsecond clock), so neither NBD nor a
guest is in the figure; p50 and p99 over the run.  Writes first, then reads
of what was written.  Nodes:

  hybrid-async  hybrid raw=on over a raw file on /dev/shm (the tier costs no
                disk), 64 KiB blocks, mode=async, the area written whole
                before the timed requests: every write lands in a block the
                RAM tier holds (its steady state), every read is a hit
  hybrid-async-uring  the same, its tier file on io_uring (file.aio) instead
                of QEMU's thread pool
  null-co       null-co (read-zeroes=off): the block layer and qemu-io alone
  null-co@aa    the same again: the A/A control

Interleaved rounds (the order rotated from round to round); the ratios of
the hybrid node's p50 and p99 to null-co's (every null-co run, its A/A twin
included) with percentile bootstrap 95 % intervals, against the goal.
Writes docs/bench/hybrid-latency.{md,json,png}."""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402
import charts   # noqa: E402
from pooled_stats import mean_ci, ratio_ci, rotated, verdict   # noqa: E402
from saved_runs import add_report_args, load_saved   # noqa: E402

CONFIGS = ['hybrid-async', 'hybrid-async-uring', 'null-co', 'null-co@aa']
BASELINE = 'null-co'
GOAL = 1.5
OPS_RE = re.compile(r'and ([0-9.]+) ops/sec')


def pct(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def image_opts(config, tier, size):
    if config.startswith('null-co'):
        return f'driver=null-co,size={size},read-zeroes=off'
    return ('driver=hybrid,raw=on,mode=async,block-size=65536,'
            f'file.driver=file,file.filename={tier}'
            + (',file.aio=io_uring' if config.endswith('-uring') else ''))


def run_one(config, tier, a, rnd):
    """Latencies (µs) of --ops writes, then of --ops reads, in one qemu-io."""
    size = a.size_mib << 20
    offs = [rnd.randrange(size // 4096) * 4096 for _ in range(a.ops)]
    cmds = [f'write -P 7 0 {size}', 'flush']   # the area in RAM, written back (not timed)
    cmds += [f'write -P {1 + i % 200} {o} 4k' for i, o in enumerate(offs)]
    cmds += [f'read {o} 4k' for o in offs]
    with tempfile.NamedTemporaryFile('w', suffix='.qemu-io', delete=False) as f:
        f.write('\n'.join(cmds) + '\nquit\n')
        script = f.name
    try:
        with open(script) as stdin:
            # -t writeback: a guest's disk with a write-back cache (QEMU's and
            # libvirt's default); qemu-io's own default is writethrough, where
            # every write is FUA and an async node writes it back first
            r = subprocess.run([H.binary('qemu-io'), '-t', 'writeback', '--image-opts',
                                image_opts(config, tier, size)], stdin=stdin,
                               capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(script)
    rates = [float(x) for x in OPS_RE.findall(r.stdout)]
    if r.returncode or len(rates) != 1 + 2 * a.ops:   # flush prints no rate
        raise RuntimeError(f'{config}: qemu-io exit {r.returncode}, {len(rates)} timings: '
                           f'{(r.stderr or r.stdout)[-500:]}')
    lat = [1e6 / x for x in rates[1:]]
    return {'write': lat[:a.ops], 'read': lat[a.ops:]}


def measure(a):
    work = tempfile.mkdtemp(prefix='hv-lat-', dir='/dev/shm')
    tier = os.path.join(work, 'tier.raw')
    H.qemu_img('create', '-f', 'raw', tier, f'{a.size_mib}M')
    rnd = random.Random(40)
    runs = []
    try:
        for rd in range(a.rounds):
            for c in rotated(CONFIGS, rd):
                lat = run_one(c, tier, a, rnd)
                row = {'round': rd, 'config': c, 'load1': os.getloadavg()[0]}
                for op, xs in lat.items():
                    row[op] = {'p50': pct(xs, 0.50), 'p99': pct(xs, 0.99),
                               'mean': sum(xs) / len(xs)}
                runs.append(row)
                print(json.dumps(row), flush=True)
    finally:
        os.unlink(tier)
        os.rmdir(work)
    return runs


def summarize(runs):
    out = {}
    for op in ('write', 'read'):
        for m in ('p50', 'p99'):
            vals = {c: [r[op][m] for r in runs if r['config'] == c] for c in CONFIGS}
            base = vals[BASELINE] + vals[BASELINE + '@aa']
            cell = {c: mean_ci(v) for c, v in vals.items()}
            ratios = {c: ratio_ci(vals[c], base if c != BASELINE + '@aa'
                                  else vals[BASELINE]) for c in CONFIGS if c != BASELINE}
            out[f'{op}-{m}'] = {'values': cell, 'ratios': ratios}
    return out


def report(a, runs, meta, s):
    loads = [r['load1'] for r in runs]
    lines = [
        f'# hybrid: 4 KiB QD1 latency in one process against null-co ({meta["date"]})', '',
        f'Measured by `{meta["command"]}` (issue 40, target 2) on 2 cores shared with other '
        f'work: 1-minute load average {min(loads):.2f} to {max(loads):.2f} over the runs.  '
        f'{a.rounds} interleaved rounds, each running every node once in an order rotated '
        f'from round to round; per run {a.ops} writes then {a.ops} reads of 4 KiB at random '
        f'aligned offsets of a {a.size_mib} MiB area, one at a time, each timed by qemu-io '
        'around the block layer\'s call; `qemu-io -t writeback` (a write-back cache, as a '
        'guest\'s disk has by default: without it every write is FUA, and an async node '
        'writes a FUA write back before completing it).', '',
        '* **hybrid-async**: `driver=hybrid,raw=on,mode=async,block-size=65536` over a raw '
        'file on /dev/shm, the area written whole first (not timed): writes land in blocks '
        'the RAM tier holds, reads are hits;',
        '* **hybrid-async-uring**: the same with `file.aio=io_uring` (the write-backs '
        'submitted to io_uring instead of QEMU\'s thread pool);',
        '* **null-co**: `driver=null-co,read-zeroes=off`: the block layer and qemu-io alone;',
        '* **null-co@aa**: the same again, the A/A control.', '',
        'Mean over the rounds of each run\'s p50 and p99, with its 95 % interval (Student t), '
        'in microseconds; ratios of the means to null-co\'s (every null-co run, the A/A twin '
        'included; the A/A against null-co alone) with a percentile bootstrap 95 % interval.  '
        'A goal is met or missed only when the whole interval says so.', '',
        '| op | percentile | ' + ' | '.join(CONFIGS) + ' | hybrid-async / null-co | '
        'hybrid-async-uring / null-co | null-co@aa / null-co | goal | verdict |',
        '|---|---|' + '---:|' * (len(CONFIGS) + 3) + '---|---|']
    for key, v in s.items():
        op, m = key.split('-')
        cells = [f'{v["values"][c][0]:.2f} ± {v["values"][c][1]:.2f}' for c in CONFIGS]
        r, lo, hi = v['ratios']['hybrid-async']
        ru, ulo, uhi = v['ratios']['hybrid-async-uring']
        ra, alo, ahi = v['ratios']['null-co@aa']
        goal = f'<= {GOAL}' if m == 'p99' else '-'
        ver = verdict(lo, hi, ('<=', GOAL)) if m == 'p99' else '-'
        lines.append(f'| {op} | {m} | ' + ' | '.join(cells) +
                     f' | {r:.2f} [{lo:.2f}, {hi:.2f}] | {ru:.2f} [{ulo:.2f}, {uhi:.2f}] | '
                     f'{ra:.2f} [{alo:.2f}, {ahi:.2f}] | {goal} | {ver} |')
    w = s['write-p99']['values']['hybrid-async'][0]
    rd = s['read-p99']['values']['hybrid-async'][0]
    lines += ['', f'In microseconds: a 4 KiB async write into the RAM tier completes at p99 in '
              f'{w:.1f} µs and a read from it in {rd:.1f} µs here, qemu-io\'s call through the '
              'block layer included (null-co\'s figures are that part alone); the kernel\'s '
              'write caches publish 4-7 µs for a write (dm-writecache, dm-pcache on DAX), '
              'measured on other machines without a user-space block layer in the way.', '',
              '![p50 and p99 against null-co](hybrid-latency.png)', '']
    return '\n'.join(lines)


def chart(path, s):
    plt = charts.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.4))
    ax.set_xscale('log')
    labels, ys, rs = [], [], []
    for key, v in s.items():
        for c in ('hybrid-async', 'hybrid-async-uring', 'null-co@aa'):
            labels.append(f'{key} {c}')
            r, lo, hi = v['ratios'][c]
            rs.append({'ratio': r, 'lo': lo, 'hi': hi})
    ys = list(range(len(labels)))
    charts.ratio_points(ax, ys, rs)
    ax.axvline(GOAL, color='tab:red', ls='--', lw=1, label=f'goal (p99) {GOAL}x')
    charts.ratio_rows(ax, labels, 'ratio to null-co (95 % interval)')
    ax.legend(loc='lower right', fontsize=8)
    charts.save(fig, path, 110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--ops', type=int, default=4000)
    ap.add_argument('--size-mib', type=int, default=64)
    add_report_args(ap)
    a = ap.parse_args()
    if a.report_only:
        saved = load_saved(a)
        runs, meta = saved['runs'], saved['meta']
    else:
        if a.rounds < 2:
            ap.error('--rounds needs at least 2 for an interval')
        meta = {'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
                'command': 'bench/hybrid-latency.py ' + ' '.join(sys.argv[1:])}
        runs = measure(a)
    s = summarize(runs)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, 'hybrid-latency.json'), 'w') as f:
        json.dump({'args': {k: v for k, v in vars(a).items()
                            if k not in ('out', 'report_only', 'notes')},
                   'meta': meta, 'runs': runs}, f, indent=1)
    text = report(a, runs, meta, s)
    if a.notes and os.path.exists(a.notes):
        with open(a.notes) as f:
            text += '\n' + f.read()
    with open(os.path.join(a.out, 'hybrid-latency.md'), 'w') as f:
        f.write(text)
    chart(os.path.join(a.out, 'hybrid-latency.png'), s)


if __name__ == '__main__':
    main()
