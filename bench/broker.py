#!/usr/bin/env python3
"""Benchmark the memory broker's control plane: create, lookup, map
(read-only and read-write) and destroy, one request at a time on one
connection (the Python client of broker/tests/brokerlib.py), ops/s and
p50/p99 latency.  Twice: the catalogue on the tmpfs pool (the default) and on
a disk directory (--disk-dir), since every mutating op commits the catalogue
(write, fsync, rename, fsync dir) before it replies.

Usage: bench/broker.py [--ops 2000] [--size 2M] [--disk-dir /var/tmp] [--out docs/bench]
Binaries from $HYBRIDVM_BUILD/broker (default <repo>/build/broker).
Writes docs/bench/broker.md, broker.json and broker.png.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402
import charts   # noqa: E402

OPS = ('create', 'lookup', 'map-ro', 'map-rw', 'destroy')


def pct(sorted_lat, p):
    return sorted_lat[min(len(sorted_lat) - 1, int(len(sorted_lat) * p / 100))]


def run_one(n, size, state_dir):
    work = tempfile.mkdtemp(prefix='hvmem-bench-')
    pool = tempfile.mkdtemp(prefix='hvmem-bench-', dir='/dev/shm')
    args = ['--state-dir', state_dir] if state_dir else []
    broker = B.Broker(work, pool, args)
    broker.start()
    c = broker.client()
    lat = {op: [] for op in OPS}
    names = [f'bench-{i}' for i in range(n)]
    try:
        t = time.perf_counter
        for name in names:
            t0 = t()
            c.create(name, size)
            lat['create'].append(t() - t0)
        for name in names:
            t0 = t()
            c.lookup(name)
            lat['lookup'].append(t() - t0)
        for name in names:
            t0 = t()
            _, fd = c.map(name)
            lat['map-ro'].append(t() - t0)
            os.close(fd)
        for name in names:
            t0 = t()
            _, fd = c.map(name, rw=True)
            lat['map-rw'].append(t() - t0)
            os.close(fd)
        # mapped regions stay attached to this connection: release them all
        # so destroy frees the file at once, as it does for most callers
        c.close()
        c = broker.client()
        for name in names:
            t0 = t()
            c.destroy(name)
            lat['destroy'].append(t() - t0)
    finally:
        c.close()
        broker.stop()
        shutil.rmtree(pool, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    out = {}
    for op, v in lat.items():
        s = sorted(v)
        out[op] = {'ops_s': len(v) / sum(v), 'p50_us': pct(s, 50) * 1e6,
                   'p99_us': pct(s, 99) * 1e6}
    return out


def chart(path, results):
    """ops/s and p99 of each op, a bar a catalogue location."""
    plt = charts.pyplot()
    if not plt:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], 'ops_s', 'operations per second'),
                           (axes[1], 'p99_us', 'p99 latency (µs)')):
        charts.grouped_bars(ax, OPS, [(label, [res[op][key] for op in OPS])
                                      for label, res in results.items()], 0.38)
        ax.set_title(title)
        ax.legend()
    axes[1].set_yscale('log')
    fig.suptitle('hvmemd control plane, one client, one request at a time')
    charts.save(fig, path, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--ops', type=int, default=2000)
    ap.add_argument('--size', default='2M')
    ap.add_argument('--disk-dir', default='/var/tmp')
    ap.add_argument('--out', default=os.path.join(REPO, 'docs', 'bench'))
    a = ap.parse_args()
    if not B.have_broker():
        sys.exit(f'{B.HVMEMD} not built (set HYBRIDVM_BUILD)')
    size = int(a.size[:-1]) << {'K': 10, 'M': 20, 'G': 30}[a.size[-1].upper()] \
        if a.size[-1].upper() in 'KMG' else int(a.size)
    disk_state = tempfile.mkdtemp(prefix='hvmem-bench-state-', dir=a.disk_dir)
    try:
        results = {
            'catalogue on tmpfs': run_one(a.ops, size, None),
            f'catalogue on {a.disk_dir}': run_one(a.ops, size, disk_state),
        }
    finally:
        shutil.rmtree(disk_state, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, 'broker.json'), 'w') as f:
        json.dump({'ops': a.ops, 'size': size, 'results': results}, f, indent=1)
    stamp = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    lines = [f'# broker control-plane benchmark ({stamp})', '',
             f'Measured by `bench/broker.py`: one hvmemd, one client connection (the Python '
             f'client in `broker/tests/brokerlib.py`, so client overhead is included), '
             f'{a.ops} regions of {a.size}, each op issued {a.ops} times one after '
             f'another; 2 shared cores (Debian 12). create, destroy commit the catalogue '
             f'(write, fsync, rename, fsync dir) before replying; map passes a descriptor '
             f'over SCM_RIGHTS. The commit rewrites the whole snapshot, so create and destroy '
             f'cost grows with the number of regions (here up to {a.ops}). '
             f'lookup and map never touch the catalogue: differences between the two runs '
             f'in those rows are other load on the shared machine (1-min load average '
             f'{os.getloadavg()[0]:.1f} at the end). '
             f'Re-measure after any change to the commit path.', '']
    for label, res in results.items():
        lines += [f'## {label}', '', '| op | ops/s | p50 µs | p99 µs |', '|---|---:|---:|---:|']
        for op in OPS:
            r = res[op]
            lines.append(f"| {op} | {r['ops_s']:.0f} | {r['p50_us']:.1f} | {r['p99_us']:.1f} |")
        lines.append('')
    with open(os.path.join(a.out, 'broker.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(os.path.join(a.out, 'broker.png'), results)
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
