#!/usr/bin/env python3
"""The main job, end to end on this machine.

Boots the Redis guest under our QEMU, loads it with items, migrates it to a
second QEMU process with stock post-copy over a link capped at 1 Gbit/s,
checks every item on the destination and prints the migration's figures.
"""
import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
import hvlib  # noqa: E402


def table(rows, columns):
    widths = [max(len(str(c)), *(len(str(r[c])) for r in rows)) for c in columns]
    line = '  '.join(str(c).ljust(w) for c, w in zip(columns, widths))
    out = [line, '  '.join('-' * w for w in widths)]
    for r in rows:
        out.append('  '.join(str(r[c]).ljust(w) for c, w in zip(columns, widths)))
    return '\n'.join(out)


def load(client, count, size, seed):
    rng = random.Random(seed)
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        pipe.set(f'item:{i}', rng.randbytes(size))
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


def verify(client, count, size, seed):
    rng = random.Random(seed)
    expected = [rng.randbytes(size) for _ in range(count)]
    bad = 0
    for i in range(0, count, 2000):
        keys = [f'item:{j}' for j in range(i, min(count, i + 2000))]
        got = client.mget(keys)
        bad += sum(1 for j, v in zip(range(i, i + len(keys)), got) if v != expected[j])
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--mem', default='1G', help='guest RAM (default 1G)')
    ap.add_argument('--items', type=int, default=200000, help='Redis items to load')
    ap.add_argument('--value-size', type=int, default=100, help='bytes per value (default 100, as in the design)')
    ap.add_argument('--bandwidth', type=int, default=125_000_000, help='migration cap in bytes/s (1 Gbit/s)')
    ap.add_argument('--log-dir', default=None)
    args = ap.parse_args()

    paths = hvlib.BuildPaths()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='demo-', dir=os.path.join(paths.build))
    print(f'demo: guest {args.mem}, {args.items} items of {args.value_size} B, '
          f'link {args.bandwidth * 8 / 1e9:g} Gbit/s; logs in {log_dir}', flush=True)
    src = hvlib.Guest('src', log_dir, mem=args.mem, paths=paths)
    dst = hvlib.Guest('dst', log_dir, mem=args.mem, paths=paths, incoming='defer')
    try:
        t = time.monotonic()
        src.launch()
        src.wait_console(r'HV-READY redis', timeout=180)
        boot_s = time.monotonic() - t
        dst.launch()
        r = src.redis()
        t = time.monotonic()
        load(r, args.items, args.value_size, seed=7)
        load_s = time.monotonic() - t
        used = r.info('memory')['used_memory']
        r.close()
        print(f'demo: guest booted in {boot_s:.1f} s; loaded {args.items} items in {load_s:.1f} s '
              f'(Redis used_memory {used / 2**20:.1f} MiB)', flush=True)

        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.5, bandwidth=args.bandwidth)
        bad = verify(dst.redis(), args.items, args.value_size, seed=7)
        row = {'migration': 'stock post-copy', **res.row(), 'items wrong on destination': bad}
        print()
        print(table([row], list(row)))
        print()
        if bad or res.status != 'completed':
            print('demo: FAILED', file=sys.stderr)
            return 1
        print('demo: all items read back correctly on the destination')
        return 0
    finally:
        dst.shutdown()
        src.shutdown()


if __name__ == '__main__':
    sys.exit(main())
