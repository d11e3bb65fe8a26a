#!/usr/bin/env python3
"""Benchmark the hybrid block format against baselines, block layer only.

Every node is exported by one qemu-storage-daemon over an NBD unix socket
and driven by fio's nbd engine (no guest).  Shapes follow CrystalDiskMark 5:
4 KiB random read/write at QD32 and 128 KiB sequential read/write at QD32,
with p50/p99 completion latency.  Writes are run with fio's
dedupe_percentage 0, 50 and 90 so a dedup device is not flattered by a
repeated buffer.  Also: restore throughput against dd of the same image
(both O_DIRECT), and RAM tier bytes for a cloned image with and without
dedup.

Usage: bench/hybrid.py [--size 512M] [--runtime 3] [--reps 2] [--out docs/bench]
       bench/hybrid.py --pooled N [...]
Binaries from $HYBRIDVM_BUILD/bin (default <repo>/build/bin).
Writes docs/bench/hybrid.md, hybrid.json and hybrid.png.

--pooled N runs only the large-block ratios of issue 22 (128 KiB reads
against null-co-data, 128 KiB writes against raw on tmpfs, dedup on against
off), N interleaved rounds with each round's order rotated, each ratio a
ratio of means with a bootstrap 95 % interval beside its A/A control (the
baseline against a second copy of itself); writes hybrid-pooled.md, .json
and .png.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402
import charts   # noqa: E402
from sizes import parse_size   # noqa: E402
from pooled_stats import mean, ratio_ci, rotated, verdict   # noqa: E402

MiB = 1024 * 1024


def sh(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True,
                          capture_output=True, text=True, **kw)


class Bench:
    def __init__(self, args):
        self.args = args
        self.size = parse_size(args.size)
        self.disk = tempfile.mkdtemp(prefix='hybrid-bench-',
                                     dir=args.disk_dir)
        self.shm = tempfile.mkdtemp(prefix='hybrid-bench-', dir='/dev/shm')
        self.sock = os.path.join(self.disk, 'nbd.sock')
        self.results = {'size': self.size, 'runtime': args.runtime,
                        'nodes': {}, 'restore': {}, 'clone_ram': {}}

    def p(self, name, shm=False):
        return os.path.join(self.shm if shm else self.disk, name)

    def cleanup(self):
        shutil.rmtree(self.disk, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)

    # ---- images ----

    def make_images(self):
        src = self.p('src.raw')
        # incompressible, non-repeating content: reads move real data
        with open(src, 'wb') as f:
            left = self.size
            while left:
                n = min(left, 64 * MiB)
                f.write(os.urandom(n))
                left -= n
        img = H.binary('qemu-img')
        sh(img, 'convert', '-O', 'raw', src, self.p('raw.img'))
        sh('cp', src, self.p('tmpfs.raw', shm=True))
        sh('cp', src, self.p('tmpfs-aa.raw', shm=True))
        sh(img, 'convert', '-O', 'qcow2', src, self.p('qcow2.img'))
        for name, o in (('sync', 'mode=sync'), ('async', 'mode=async'),
                        ('dedup', 'mode=async,dedup=on')):
            sh(img, 'convert', '-O', 'hybrid', '-o', o, src,
               self.p(f'{name}.hyb'))
        return src

    def nodes(self):
        d = 'cache.direct=on'
        return [
            ('hybrid-sync', f'driver=hybrid,node-name=NODE,mode=sync,'
             f'file.driver=file,file.filename={self.p("sync.hyb")},'
             f'file.{d}'),
            ('hybrid-async', f'driver=hybrid,node-name=NODE,mode=async,'
             f'file.driver=file,file.filename={self.p("async.hyb")},'
             f'file.{d}'),
            ('hybrid-dedup', f'driver=hybrid,node-name=NODE,mode=async,'
             f'dedup=on,file.driver=file,'
             f'file.filename={self.p("dedup.hyb")},file.{d}'),
            ('raw-direct', f'driver=raw,node-name=NODE,file.driver=file,'
             f'file.filename={self.p("raw.img")},file.{d}'),
            ('raw-pagecache', f'driver=raw,node-name=NODE,file.driver=file,'
             f'file.filename={self.p("raw.img")}'),
            ('qcow2', f'driver=qcow2,node-name=NODE,file.driver=file,'
             f'file.filename={self.p("qcow2.img")}'),
            ('null-co', f'driver=null-co,node-name=NODE,read-zeroes=on,'
             f'size={self.size}'),
            # reads reported as zero go out as NBD holes (no payload): this
            # one sends its (garbage) buffer, the ceiling for data reads
            ('null-co-data', f'driver=null-co,node-name=NODE,'
             f'read-zeroes=off,size={self.size}'),
            ('raw-tmpfs', f'driver=raw,node-name=NODE,file.driver=file,'
             f'file.filename={self.p("tmpfs.raw", shm=True)}'),
            # A/A control: the same baseline again, its own copy; how far
            # apart two identical nodes land in this run is the noise
            ('raw-tmpfs-aa', f'driver=raw,node-name=NODE,file.driver=file,'
             f'file.filename={self.p("tmpfs-aa.raw", shm=True)}'),
        ]

    def pooled_nodes(self):
        """The nodes of --pooled, with an A/A copy of the read ceiling."""
        nodes = dict(self.nodes())
        return [(n, nodes[n]) for n in ('hybrid-async', 'hybrid-dedup',
                                        'null-co-data', 'raw-tmpfs',
                                        'raw-tmpfs-aa')] + \
            [('null-co-data-aa', nodes['null-co-data'])]

    # ---- one node ----

    def start(self, *blockdevs):
        tmp = H.TempDir()
        qsd = H.StorageDaemon(tmp, '--nbd-server',
                              f'addr.type=unix,addr.path={self.sock}')
        qsd.tmpdir = tmp
        for bd in blockdevs:
            opts = dict(kv.split('=', 1) for kv in bd.split(','))
            qsd.cmd('blockdev-add', **to_qapi(opts))
        return qsd

    def stop(self, qsd):
        qsd.stop()
        qsd.tmpdir.cleanup()

    def wait_restore(self, qsd, node=None):
        info = qsd.wait_restored(node, timeout=600)
        if not all(i['restore-done'] for i in info):
            raise TimeoutError('restore did not finish')
        return info[0] if info else None

    def fio(self, node, rw, bs, dedupe=None):
        uri = f'nbd+unix:///{node}?socket={self.sock}'
        cmd = ['fio', '--name=job', '--ioengine=nbd', f'--uri={uri}',
               f'--rw={rw}', f'--bs={bs}', '--iodepth=32', '--numjobs=1',
               f'--size={self.size}', f'--runtime={self.args.runtime}',
               '--time_based', '--ramp_time=1', '--output-format=json',
               '--randrepeat=0', '--norandommap']
        if dedupe is not None:
            cmd += [f'--dedupe_percentage={dedupe}', '--refill_buffers']
        text = sh(*cmd).stdout
        # fio's nbd engine prints "fio: connected to NBD server" first
        out = json.loads(text[text.find('{'):])
        if out['jobs'][0]['error']:
            raise RuntimeError(f'fio failed: {text[:2000]}')
        job = out['jobs'][0]
        d = job['read' if 'read' in rw else 'write']
        pct = d['clat_ns'].get('percentile', {})
        return {'iops': round(d['iops']), 'MBps': round(d['bw_bytes'] / 1e6, 1),
                'p50_us': round(pct.get('50.000000', 0) / 1000, 1),
                'p99_us': round(pct.get('99.000000', 0) / 1000, 1)}

    SHAPES = [('randread-4k', 'randread', '4k', None),
              ('seqread-128k', 'read', '128k', None)] + \
        [(f'{n}-dd{d}', rw, bs, d) for d in (0, 50, 90)
         for n, rw, bs in (('randwrite-4k', 'randwrite', '4k'),
                           ('seqwrite-128k', 'write', '128k'))]

    def run_all(self, nodes):
        """All nodes in one daemon; shapes run node after node, the whole
        sweep repeated --reps times; the best run of each is kept, so a
        burst of load from other users of the machine hits every node
        alike instead of one."""
        names = [n for n, _ in nodes]
        qsd = self.start(*[bd.replace('NODE', n) for n, bd in nodes])
        try:
            for n in names:
                qsd.cmd('nbd-server-add', device=n, writable=True)
            self.wait_restore(qsd)
            res = {n: {} for n in names}
            for rep in range(self.args.reps):
                for col, rw, bs, dd in self.SHAPES:
                    for n in names:
                        r = self.fio(n, rw, bs, dd)
                        old = res[n].get(col)
                        if old is None or r['iops'] > old['iops']:
                            res[n][col] = r
                    print(rep, col, {n: res[n][col]['iops'] for n in names},
                          flush=True)
            for i in qsd.cmd('query-hybrid'):
                res[i['node-name']]['ram_used'] = i['ram-used']
                res[i['node-name']]['dedup_ratio'] = round(i['dedup-ratio'], 2)
        finally:
            self.stop(qsd)
        self.results['nodes'] = res

    # (shape of SHAPES, numerator, baseline, goal) of --pooled
    POOLED = [
        ('seqread-128k', 'hybrid-async', 'null-co-data', ('>=', 0.7)),
        ('seqread-128k', 'null-co-data-aa', 'null-co-data', None),
        ('seqwrite-128k-dd0', 'hybrid-async', 'raw-tmpfs', ('>=', 1.0)),
        ('seqwrite-128k-dd0', 'raw-tmpfs-aa', 'raw-tmpfs', None),
        ('seqwrite-128k-dd0', 'hybrid-dedup', 'hybrid-async', ('>=', 0.8)),
    ]

    def run_pooled(self, rounds):
        """Each round runs every (shape, node) once; the order of the nodes
        is rotated from round to round, so a drift in the machine's load
        falls on all of them alike."""
        shapes = {}
        for col, a, b, _ in self.POOLED:
            shape = next(sh for sh in self.SHAPES if sh[0] == col)
            nodes = shapes.setdefault(shape, [])
            nodes += [n for n in (a, b) if n not in nodes]
        qsd = self.start(*[bd.replace('NODE', n)
                           for n, bd in self.pooled_nodes()])
        mbps = {}
        try:
            for n, _ in self.pooled_nodes():
                qsd.cmd('nbd-server-add', device=n, writable=True)
            self.wait_restore(qsd)
            for rnd in range(rounds):
                for (col, rw, bs, dd), nodes in shapes.items():
                    for n in rotated(nodes, rnd):
                        r = self.fio(n, rw, bs, dd)
                        mbps.setdefault(col, {}).setdefault(n, []).append(
                            r['MBps'])
                    print(rnd, col, {n: mbps[col][n][-1] for n in nodes},
                          flush=True)
        finally:
            self.stop(qsd)
        ratios = []
        for col, a, b, goal in self.POOLED:
            p, lo, hi = ratio_ci(mbps[col][a], mbps[col][b])
            ratios.append({'shape': col, 'node': a, 'baseline': b,
                           'ratio': p, 'lo': lo, 'hi': hi, 'goal': goal,
                           'verdict': verdict(lo, hi, goal) if goal
                           else 'A/A control'})
        self.results['pooled'] = {'rounds': rounds, 'MBps': mbps,
                                  'ratios': ratios}

    def report_pooled(self):
        out = self.args.out
        os.makedirs(out, exist_ok=True)
        res = self.results['pooled']
        with open(os.path.join(out, 'hybrid-pooled.json'), 'w') as f:
            json.dump(self.results, f, indent=1)
        lines = [f'# hybrid benchmark, pooled large-block ratios '
                 f'({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})',
                 '',
                 f'Measured by `bench/hybrid.py --pooled {res["rounds"]}`: '
                 f'qemu-storage-daemon, NBD unix socket, fio nbd engine, QD32, '
                 f'{self.args.runtime} s per job (+1 s ramp), '
                 f'{self.size // MiB} MiB images of random data, 2 shared '
                 f'cores.  {res["rounds"]} rounds, each running every node '
                 f'once per shape in an order rotated from round to round.  '
                 f'MB/s: mean of the rounds; ratio of the means with a '
                 f'percentile bootstrap 95 % interval.  The A/A rows are the '
                 f'baseline against a second node identical to it: their '
                 f'spread is the noise.', '',
                 '| shape | node | MB/s | baseline | MB/s | ratio [95 % CI] '
                 '| goal | verdict |', '|---|---|---:|---|---:|---:|---|---|']
        for r in res['ratios']:
            m = res['MBps'][r['shape']]
            ma, mb = mean(m[r['node']]), mean(m[r['baseline']])
            goal = f'{r["goal"][0]} {r["goal"][1]}' if r['goal'] else '-'
            lines.append(f'| {r["shape"]} | {r["node"]} | {ma:.0f} | '
                         f'{r["baseline"]} | {mb:.0f} | {r["ratio"]:.2f} '
                         f'[{r["lo"]:.2f}, {r["hi"]:.2f}] | {goal} | '
                         f'{r["verdict"]} |')
        lines += ['', '![ratios](hybrid-pooled.png)', '']
        with open(os.path.join(out, 'hybrid-pooled.md'), 'w') as f:
            f.write('\n'.join(lines))
        self.chart_pooled(os.path.join(out, 'hybrid-pooled.png'))

    def chart_pooled(self, path):
        plt = charts.pyplot()
        if not plt:
            return
        rs = self.results['pooled']['ratios']
        fig, ax = plt.subplots(figsize=(8, 0.6 * len(rs) + 1.2))
        for i, r in enumerate(rs):
            charts.ratio_points(ax, [i], [r],
                                color='tab:gray' if not r['goal'] else 'tab:red')
            if r['goal']:
                ax.plot([r['goal'][1]] * 2, [i - 0.3, i + 0.3], 'k--', lw=1)
        charts.ratio_rows(ax, [f'{r["shape"]}: {r["node"]} / {r["baseline"]}' for r in rs],
                          'ratio of mean MB/s (dashed: goal)')
        charts.save(fig, path, dpi=80)

    # ---- restore vs dd, cloned image RAM ----

    def restore(self):
        img = self.p('sync.hyb')
        t = time.monotonic()
        sh('dd', f'if={img}', 'of=/dev/null', 'bs=4M', 'iflag=direct')
        dd_s = time.monotonic() - t
        qsd = self.start(f'driver=hybrid,node-name=NODE,file.driver=file,'
                         f'file.filename={img},file.cache.direct=on')
        try:
            ev = qsd.wait_event('HYBRID_RESTORE_COMPLETED', 600)
        finally:
            self.stop(qsd)
        size = os.path.getsize(img)
        r = {'dd_MBps': round(size / dd_s / 1e6, 1),
             'restore_MBps': round(ev['data']['bytes'] /
                                   max(ev['data']['duration-ms'], 1) / 1e3, 1)}
        r['ratio'] = round(r['restore_MBps'] / r['dd_MBps'], 2)
        self.results['restore'] = r
        print('restore', r, flush=True)

    def clone_ram(self, base):
        """An image holding a base image and a clone of it."""
        img = H.binary('qemu-img')
        base_size = os.path.getsize(base)
        clone = self.p('clone.hyb')
        sh(img, 'create', '-q', '-f', 'hybrid', clone, str(2 * base_size))
        o = f'driver=hybrid,file.driver=file,file.filename={clone}'
        for off in (0, base_size):
            sh(H.binary('qemu-io'), '-t', 'writeback', '--image-opts', o,
               '-c', f'write -s {base} {off} {base_size}')
        for dedup in ('off', 'on'):
            qsd = self.start(f'driver=hybrid,node-name=NODE,dedup={dedup},'
                             f'file.driver=file,file.filename={clone}')
            try:
                info = self.wait_restore(qsd)
            finally:
                self.stop(qsd)
            self.results['clone_ram'][f'dedup-{dedup}'] = {
                'virtual': 2 * base_size, 'ram_used': info['ram-used'],
                'metadata': info['metadata-bytes'],
                'metadata_per_block': round(info['metadata-per-block'], 1),
                'dedup_ratio': round(info['dedup-ratio'], 2)}
        print('clone', self.results['clone_ram'], flush=True)

    # ---- report ----

    def report(self):
        out = self.args.out
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, 'hybrid.json'), 'w') as f:
            json.dump(self.results, f, indent=1)
        n = self.results['nodes']
        cols = ['randread-4k', 'seqread-128k'] + \
            [f'{s}-dd{d}' for d in (0, 50, 90)
             for s in ('randwrite-4k', 'seqwrite-128k')]
        lines = [f'# hybrid benchmark ({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})',
                 '',
                 f'Measured by `bench/hybrid.py`: qemu-storage-daemon, NBD unix '
                 f'socket, fio nbd engine, QD32, {self.args.runtime} s per '
                 f'job (+1 s ramp), best of {self.args.reps} interleaved '
                 f'sweeps, {self.size // MiB} MiB images of random data, '
                 f'2 shared cores (Debian 12, TCG host).  IOPS, MB/s, '
                 f'p50/p99 completion latency in µs.  `ddN` = fio '
                 f'`dedupe_percentage=N`.', '']
        for c in cols:
            lines += [f'## {c}', '', '| node | IOPS | MB/s | p50 µs | p99 µs |',
                      '|---|---:|---:|---:|---:|']
            for name, r in n.items():
                x = r[c]
                lines.append(f'| {name} | {x["iops"]} | {x["MBps"]} | '
                             f'{x["p50_us"]} | {x["p99_us"]} |')
            lines.append('')
        t = n.get('raw-tmpfs', {})
        dct = n.get('raw-direct', {})

        def ratio(a, b, col):
            try:
                return round(n[a][col]['iops'] / b[col]['iops'], 2)
            except (KeyError, ZeroDivisionError):
                return None
        lines += ['## Targets', '', '| target | measured | goal |',
                  '|---|---:|---:|',
                  f'| hybrid-async random read / raw-tmpfs | '
                  f'{ratio("hybrid-async", t, "randread-4k")} | ≥ 0.8 |',
                  f'| hybrid-async random write / raw-tmpfs (dd0) | '
                  f'{ratio("hybrid-async", t, "randwrite-4k-dd0")} | ≥ 0.7 |',
                  f'| hybrid-sync random write / raw-direct (dd0) | '
                  f'{ratio("hybrid-sync", dct, "randwrite-4k-dd0")} | ≥ 0.9 |',
                  f'| restore / dd (O_DIRECT, 4 MiB) | '
                  f'{self.results["restore"].get("ratio")} | ≥ 0.8 |',
                  f'| hybrid-async 128K read / null-co (zeroes: NBD holes, '
                  f'no payload) | '
                  f'{ratio("hybrid-async", n.get("null-co", {}), "seqread-128k")}'
                  f' | ≥ 0.7 (issue 22) |',
                  f'| hybrid-async 128K read / null-co-data (payload sent) | '
                  f'{ratio("hybrid-async", n.get("null-co-data", {}), "seqread-128k")}'
                  f' | ≥ 0.7 |',
                  f'| hybrid-async 128K write / raw-tmpfs (dd0) | '
                  f'{ratio("hybrid-async", t, "seqwrite-128k-dd0")} | ≥ 1.0 |',
                  f'| A/A: raw-tmpfs-aa / raw-tmpfs, 128K write (dd0) | '
                  f'{ratio("raw-tmpfs-aa", t, "seqwrite-128k-dd0")} | 1.0 ± noise |',
                  f'| A/A: raw-tmpfs-aa / raw-tmpfs, 4K random write (dd0) | '
                  f'{ratio("raw-tmpfs-aa", t, "randwrite-4k-dd0")} | 1.0 ± noise |',
                  f'| hybrid-dedup 128K write / hybrid-async (dd0) | '
                  f'{ratio("hybrid-dedup", n.get("hybrid-async", {}), "seqwrite-128k-dd0")}'
                  f' | ≥ 0.8 |', '']
        r = self.results['restore']
        lines += ['## Restore', '',
                  f'restore {r.get("restore_MBps")} MB/s, dd {r.get("dd_MBps")} MB/s', '']
        lines += ['## RAM tier for a cloned image (base + identical clone)', '',
                  '| dedup | virtual bytes | RAM used | metadata | metadata/block | dedup ratio |',
                  '|---|---:|---:|---:|---:|---:|']
        for k, v in self.results['clone_ram'].items():
            lines.append(f'| {k} | {v["virtual"]} | {v["ram_used"]} | '
                         f'{v["metadata"]} | {v["metadata_per_block"]} | '
                         f'{v["dedup_ratio"]} |')
        with open(os.path.join(out, 'hybrid.md'), 'w') as f:
            f.write('\n'.join(lines) + '\n')
        self.chart(os.path.join(out, 'hybrid.png'), cols)

    def chart(self, path, cols):
        plt = charts.pyplot()
        if not plt:
            return
        n = self.results['nodes']
        names = list(n)
        fig, axes = plt.subplots(2, 4, figsize=(18, 8))
        for ax, c in zip(axes.flat, cols):
            vals = [n[k][c]['iops'] for k in names]
            ax.barh(names, vals, color=['tab:red' if k.startswith('hybrid')
                                        else 'tab:gray' for k in names])
            ax.set_title(c)
            ax.set_xlabel('IOPS')
            ax.tick_params(axis='y', labelsize=8)
        fig.suptitle('hybrid vs baselines (fio nbd, QD32)')
        charts.save(fig, path, dpi=80)


def to_qapi(opts):
    """Flat dotted key=value -> nested dict with typed leaves."""
    root = {}
    for k, v in opts.items():
        cur = root
        parts = k.split('.')
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        if v in ('on', 'off'):
            v = v == 'on'
        elif v.isdigit():
            v = int(v)
        cur[parts[-1]] = v
    return root


def add_fio_args(ap, size, reps):
    """The options of a bench that runs Bench.fio (bench/broker-hybrid.py
    too): the node's size, seconds per fio run, repetitions, where the
    report goes and where the images go."""
    ap.add_argument('--size', default=size)
    ap.add_argument('--runtime', type=int, default=3)
    ap.add_argument('--reps', type=int, default=reps)
    ap.add_argument('--out', default=os.path.join(REPO, 'docs', 'bench'))
    ap.add_argument('--disk-dir', default=os.path.join(REPO, 'build'))


def main():
    ap = argparse.ArgumentParser()
    add_fio_args(ap, size='512M', reps=2)
    ap.add_argument('--only', default='')
    ap.add_argument('--pooled', type=int, default=0, metavar='N',
                    help='only the large-block ratios, N interleaved rounds')
    args = ap.parse_args()
    if args.pooled == 1:
        ap.error('--pooled needs at least 2 rounds for an interval')
    b = Bench(args)
    try:
        src = b.make_images()
        if args.pooled:
            b.run_pooled(args.pooled)
            b.report_pooled()
            return
        b.run_all([(n, bd) for n, bd in b.nodes()
                   if not args.only or n in args.only.split(',')])
        b.restore()
        # "an OS image and its clone": the guest root file system if built
        rootfs = os.path.join(H.BUILD, 'guest', 'rootfs.ext4')
        b.clone_ram(rootfs if os.path.exists(rootfs) else src)
        b.report()
    finally:
        b.cleanup()


if __name__ == '__main__':
    main()
