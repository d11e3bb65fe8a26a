#!/usr/bin/env python3
"""Boot storm: N guests boot at once from clones of one base kept in Ceph
(issue 19, part 3), the design's boot-time figure.

The Ceph daemons (scripts/ceph-cluster.sh: one monitor, one OSD, cephx) run
in their own network namespace behind a veth pair shaped with tbf in both
directions, so every VM of the host shares one link to the cluster, at
--rates (default 1 Gbit/s and a "busy storage" 25 Mbit/s).  The base is the
test guest's root file system plus a boot read set (--bootset-mib of files
under /bootset that the guest's init reads before it says HV-BOOTED, as a
desktop reads its programs and libraries); it is imported as rbd/base and
snapshotted as base@gold (protected).

Configurations, N = --counts guests each, interleaved:
  rbd         each VM boots its own RBD clone of base@gold (rbd_cache off)
  rbd-aa      the same again: the A/A control
  rbd-cache   the same with librbd's cache on (cache=writeback)
  cor         a local qcow2 overlay per VM on base@gold, copy-on-read=on
  cc-cold     a local qcow2 overlay per VM backed by the host's clone-cache
              export of base@gold (one qemu-storage-daemon), cache empty
  cc-warm     the same, the cache filled by the cc-cold storm before it
  cc-restart  the same after the daemon was restarted (warm from disk)
  local       the base from a local file in the page cache: the CPU part of
              a boot under TCG (no storage wait at all)

Measured per storm: the time until the last guest prints HV-BOOTED (and
each guest's), and the bytes the cluster sent over the link (tbf's byte
counter on the namespace's side).  Also fio, 4 KiB random reads at QD32,
straight from RBD (fio's rbd engine) and through the warm cache's export
(fio's nbd engine), at the first rate.

Writes docs/bench/boot-storm.{md,json,png}.  Needs root (namespaces, tc).
"""

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, 'tests'))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402
from hvlib import Guest   # noqa: E402
from hvlib.ceph import CephCluster, unavailable   # noqa: E402
import charts   # noqa: E402
from pooled_stats import rotated   # noqa: E402
from shaped_link import Link   # noqa: E402

MiB = 1 << 20
NS, NET = 'hvstorm', '10.77.0'          # the link: hvstorm0 10.77.0.1 <-> hvstorm1 .2
CONFIGS = ['rbd', 'rbd-aa', 'rbd-cache', 'cor', 'cc-cold', 'cc-warm',
           'cc-restart', 'local']


def sh(*args, **kw):
    kw.setdefault('check', True)
    return subprocess.run([str(a) for a in args], capture_output=True,
                          text=True, **kw)


def make_base(guest_dir, work, bootset_mib, seed=19):
    """The guest's root file system, its init from this tree, plus /bootset:
    files of 16 KiB-1 MiB of incompressible data, bootset_mib in all."""
    tree = os.path.join(work, 'tree')
    os.makedirs(tree)
    sh('debugfs', '-R', f'rdump / {tree}', os.path.join(guest_dir, 'rootfs.ext4'))
    shutil.copy(os.path.join(REPO, 'tests', 'guest', 'init'), os.path.join(tree, 'init'))
    os.chmod(os.path.join(tree, 'init'), 0o755)
    rnd = random.Random(seed)
    left, i = bootset_mib * MiB, 0
    d = os.path.join(tree, 'bootset')
    while left > 0:
        n = min(left, rnd.choice([16, 32, 64, 128, 256, 512, 1024]) * 1024)
        sub = os.path.join(d, f'lib{i % 16:02d}')
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f'f{i:05d}.so'), 'wb') as f:
            f.write(rnd.randbytes(n))
        left -= n
        i += 1
    base = os.path.join(work, 'base.ext4')
    size = 64 + bootset_mib + os.path.getsize(os.path.join(guest_dir, 'rootfs.ext4')) // MiB
    sh('mkfs.ext4', '-q', '-F', '-d', tree, base, f'{size}M')
    shutil.rmtree(tree)
    return base


class Storm:
    def __init__(self, args):
        self.args = args
        self.paths = H
        self.work = tempfile.mkdtemp(prefix='boot-storm-', dir=args.work_dir)
        self.guest_dir = os.path.join(H.BUILD, 'guest')
        self.link = Link(NS, NET)
        self.link.shape(args.rates[0])
        # On a busy link ten guests' reads queue for longer than the
        # tests' 20 s op timeout (at 10mbit a guest saw EIO at 52 s): here
        # only a cluster that is gone should be an error
        self.ceph = CephCluster(os.path.join(self.work, 'ceph'), port=3395,
                                addr=self.link.ns_ip, netns=NS, op_timeout=int(args.timeout))
        self.qsd = None
        self.results = []

    def setup(self):
        t0 = time.monotonic()
        self.ceph.start()
        self.base = make_base(self.guest_dir, self.work, self.args.bootset_mib)
        self.ceph.rbd('import', self.base, 'rbd/base')
        self.ceph.rbd('snap', 'create', 'rbd/base@gold')
        self.ceph.rbd('snap', 'protect', 'rbd/base@gold')
        print(f'set-up: cluster and base ({os.path.getsize(self.base) // MiB} MiB) in '
              f'{time.monotonic() - t0:.0f} s', file=sys.stderr)

    def cleanup(self):
        self.stop_daemon()
        try:
            self.ceph.purge()
        finally:
            self.link.teardown()
            shutil.rmtree(self.work, ignore_errors=True)

    # -- the host's clone-cache daemon --

    def start_daemon(self, fresh, image='base'):
        """The host's clone-cache daemon exporting rbd/IMAGE@gold as "gold"
        (librbd's own cache off: cache.direct=on)."""
        cache = os.path.join(self.work, 'clone.cache')
        if fresh and os.path.exists(cache):
            os.unlink(cache)
        self.sock = os.path.join(self.work, 'cc.sock')
        tmp = H.TempDir()
        self.qsd = H.StorageDaemon(
            tmp, '--object', f'clone-cache,id=cc0,filename={cache},size=2G',
            '--blockdev', self.ceph.blockdev(image) + ',node-name=base-rbd,'
            'snapshot=gold,read-only=on,cache.direct=on',
            '--blockdev', 'clone-cache,node-name=gold,store=cc0,file=base-rbd,'
            f'read-only=on,base-id=rbd/{image}@gold',
            '--nbd-server', f'addr.type=unix,addr.path={self.sock}',
            '--export', 'nbd,id=gold,node-name=gold')
        self.qsd_tmp = tmp

    def stop_daemon(self):
        if self.qsd:
            self.qsd.stop()
            self.qsd_tmp.cleanup()
            self.qsd = None

    def cache_stats(self):
        [c] = self.qsd.cmd('query-clone-cache')
        while c['fill-pending']:
            time.sleep(0.1)
            [c] = self.qsd.cmd('query-clone-cache')
        return c['bases'][0]

    # -- one storm --

    def disk(self, config, k):
        """-drive options of guest k's root disk in this configuration."""
        rbd_file = f'rbd:rbd/vm{k}:id=qemu:conf={self.ceph.conf}'
        if config in ('rbd', 'rbd-aa', 'rbd-cache'):
            self.ceph.rbd('clone', 'rbd/base@gold', f'rbd/vm{k}')
            cache = 'writeback' if config == 'rbd-cache' else 'none'
            return f'file={rbd_file},format=raw,cache={cache}'
        ov = os.path.join(self.work, f'vm{k}.qcow2')
        if config == 'local':
            backing = self.base
        elif config == 'cor':
            backing = 'json:' + json.dumps({'driver': 'raw', 'file': {
                'driver': 'rbd', 'pool': 'rbd', 'image': 'base', 'snapshot': 'gold',
                'conf': self.ceph.conf, 'user': 'qemu'}})
        else:
            backing = 'json:' + json.dumps({'driver': 'raw', 'file': {
                'driver': 'nbd', 'export': 'gold',
                'server': {'type': 'unix', 'path': self.sock}}})
        sh(H.binary('qemu-img'), 'create', '-q', '-f', 'qcow2', '-F', 'raw', '-u',
           '-b', backing, ov, str(os.path.getsize(self.base)))
        cor = ',copy-on-read=on' if config == 'cor' else ''
        return f'file={ov},format=qcow2,cache=none{cor}'

    def drop_disks(self, config, n):
        for k in range(n):
            if config.startswith('rbd'):
                self.ceph.rbd('rm', f'rbd/vm{k}', check=False)
            p = os.path.join(self.work, f'vm{k}.qcow2')
            if os.path.exists(p):
                os.unlink(p)

    def storm(self, config, n, rate):
        if config == 'cc-cold':
            self.stop_daemon()
            self.start_daemon(fresh=True)
        elif config == 'cc-restart':
            self.stop_daemon()
            self.start_daemon(fresh=False)
        if config == 'local':
            with open(self.base, 'rb') as f:            # into the page cache
                while f.read(8 * MiB):
                    pass
        drives = [self.disk(config, k) for k in range(n)]
        logdir = os.path.join(self.work, 'logs')
        guests = [Guest(f'{config}-{k}', logdir, mem='192M', redis=False, balloon=False,
                        append='hv.root=/dev/vda hv.bootread=/bootset hv.shell=0',
                        args=['-drive', f'if=none,id=root,{d}',
                              '-device', 'virtio-blk-pci,drive=root'])
                  for k, d in enumerate(drives)]
        before = self.link.sent_by_cluster()
        cc0 = self.cache_stats()['base-read-bytes'] if config.startswith('cc') else 0
        t0 = time.monotonic()
        times, bootread = [], []
        try:
            for g in guests:
                g.launch()
            pending = list(guests)
            deadline = t0 + self.args.timeout
            while pending:
                for g in list(pending):
                    text = g.console_text()
                    if 'HV-ERROR' in text or 'Kernel panic' in text:
                        raise RuntimeError(f'{g.name}: {text[-500:]}')
                    if 'HV-BOOTED' in text:
                        times.append(time.monotonic() - t0)
                        m = re.search(r'HV-BOOTREAD (\d+)', text)
                        bootread.append(int(m.group(1)) if m else 0)
                        pending.remove(g)
                if time.monotonic() > deadline:
                    raise RuntimeError(f'{config} N={n}: not booted after {self.args.timeout} s')
                time.sleep(0.05)
        finally:
            for g in guests:
                g.shutdown(timeout=5)
            self.drop_disks(config, n)
        r = dict(config=config, n=n, rate=rate, storm_s=max(times),
                 mean_s=statistics.mean(times), times=sorted(times),
                 cluster_bytes=self.link.sent_by_cluster() - before,
                 bootread_bytes=min(bootread))
        if config.startswith('cc'):
            st = self.cache_stats()
            r['cache_base_read_bytes'] = st['base-read-bytes'] - cc0
        print(f'{rate:>8} {config:>10} N={n:2d}: last boot {r["storm_s"]:6.1f} s, '
              f'mean {r["mean_s"]:6.1f} s, cluster sent {r["cluster_bytes"] / MiB:7.1f} MiB',
              file=sys.stderr)
        self.results.append(r)
        return r

    def run(self):
        a = self.args
        for rate in a.rates:
            self.link.shape(rate)
            for n in a.counts:
                # cc-warm and cc-restart follow cc-cold; the rest rotate
                order = rotated([c for c in a.configs if not c.startswith('cc')],
                                a.counts.index(n))
                cc = [c for c in ['cc-cold', 'cc-warm', 'cc-restart'] if c in a.configs]
                for c in order[:len(order) // 2] + cc + order[len(order) // 2:]:
                    if c in ('cc-warm', 'cc-restart') and 'cc-cold' not in a.configs:
                        continue
                    if c == 'local' and rate != a.rates[0]:
                        continue            # no link involved
                    self.storm(c, n, rate)
        self.link.shape(a.rates[0])
        self.fio_results = self.fio()

    def fio(self):
        """4 KiB random reads, QD32, over 256 MiB of random data (no holes
        for RBD to answer without data): straight from RBD with librbd's
        cache off, and through the warm cache's NBD export."""
        out = {}
        if not shutil.which('fio') or self.args.fio_seconds <= 0:
            return out
        data = os.path.join(self.work, 'fio.img')
        with open(data, 'wb') as f:
            for _ in range(256):
                f.write(os.urandom(MiB))
        self.ceph.rbd('import', data, 'rbd/fio')
        self.ceph.rbd('snap', 'create', 'rbd/fio@gold')
        os.unlink(data)
        self.stop_daemon()
        self.start_daemon(fresh=True, image='fio')
        common = ['--name=r', '--rw=randread', '--bs=4k', '--iodepth=32',
                  f'--runtime={self.args.fio_seconds}', '--time_based=1',
                  '--size=256M', '--output-format=json', '--randseed=7']
        jobs = {
            'rbd': ['--ioengine=rbd', '--clientname=qemu', '--pool=rbd',
                    '--rbdname=fio', '--direct=1'],
            'clone-cache (warm)': ['--ioengine=nbd',
                                   f'--uri=nbd+unix:///gold?socket={self.sock}'],
        }
        # one sequential pass fills the cache with the 256 MiB range read
        sh('fio', '--name=warm', '--rw=read', '--bs=1M', '--size=256M',
           '--ioengine=nbd', f'--uri=nbd+unix:///gold?socket={self.sock}',
           env=dict(os.environ, CEPH_CONF=self.ceph.conf), timeout=600)
        self.cache_stats()
        env = dict(os.environ, CEPH_CONF=self.ceph.conf, CEPH_ARGS='--rbd_cache=false')
        for name, opts in jobs.items():
            r = sh('fio', *common, *opts, env=env, timeout=600)
            j = json.loads(r.stdout[r.stdout.index('{'):])['jobs'][0]['read']
            out[name] = dict(iops=j['iops'], p50_us=j['clat_ns']['percentile']['50.000000'] / 1e3,
                             p99_us=j['clat_ns']['percentile']['99.000000'] / 1e3)
            print(f'fio {name}: {j["iops"]:.0f} IOPS', file=sys.stderr)
        return out

    # -- report --

    def write(self, out):
        res = self.results
        by = {(r['rate'], r['config'], r['n']): r for r in res}
        counts, rates = self.args.counts, self.args.rates
        lines = ['# Boot storm: N guests boot at once from clones of one base in Ceph',
                 '',
                 f'Measured {time.strftime("%Y-%m-%d %H:%M")} by `bench/boot-storm.py` '
                 f'({" ".join(sys.argv[1:]) or "defaults"}).  The base: the test guest\'s '
                 f'root file system plus a {self.args.bootset_mib} MiB boot read set that '
                 f'each guest reads before HV-BOOTED (it read '
                 f'{min(r["bootread_bytes"] for r in res) / MiB:.1f} MiB).  One Ceph OSD '
                 'and monitor in a network namespace behind a tbf-shaped veth pair '
                 'shared by every VM; guests under TCG on a 2-core machine; one storm '
                 'per cell (the rbd-aa row repeats rbd: the A/A spread).', '']
        for rate in rates:
            lines += [f'## Link {rate}', '',
                      '| configuration | ' + ' | '.join(f'N={n}: last boot (s)' for n in counts) +
                      ' | ' + ' | '.join(f'N={n}: MiB from cluster' for n in counts) + ' |',
                      '|---' * (1 + 2 * len(counts)) + '|']
            for c in self.args.configs:
                if not any((rate, c, n) in by for n in counts):
                    continue
                t = [f'{by[rate, c, n]["storm_s"]:.1f}' if (rate, c, n) in by else '-'
                     for n in counts]
                b = [f'{by[rate, c, n]["cluster_bytes"] / MiB:.1f}' if (rate, c, n) in by
                     else '-' for n in counts]
                lines.append(f'| {c} | ' + ' | '.join(t) + ' | ' + ' | '.join(b) + ' |')
            lines.append('')
        lines += ['## Against the targets', '']
        slow = rates[-1]
        nmax = max(counts)

        def get(c, n, rate=slow, key='storm_s'):
            r = by.get((rate, c, n))
            return r[key] if r else None

        rows = []
        if get('rbd', nmax) and get('cc-warm', nmax):
            rows.append((f'{nmax} boots at {slow}: no cache / warm cache',
                         f'{get("rbd", nmax) / get("cc-warm", nmax):.2f}x', '>= 3.4x'))
        if get('rbd', nmax) and get('rbd-aa', nmax):
            rows.append((f'A/A: rbd / rbd-aa, {nmax} boots at {slow}',
                         f'{get("rbd", nmax) / get("rbd-aa", nmax):.2f}x', 'about 1'))
        for c, lim in (('cc-warm', 1.1), ('cc-cold', 1.2)):
            one = get(c, 1, key='cluster_bytes')
            many = get(c, nmax, key='cluster_bytes')
            if one is not None and many is not None:
                ratio = f'{many / one:.2f}x' if one >= MiB else \
                    f'{many / MiB:.1f} MiB vs {one / MiB:.1f} MiB'
                rows.append((f'{c}: cluster bytes, N={nmax} / N=1', ratio, f'<= {lim}x'))
        if get('cc-restart', nmax) and get('cc-warm', nmax):
            rows.append((f'warm after restart / warm, {nmax} boots',
                         f'{get("cc-restart", nmax) / get("cc-warm", nmax):.2f}x', '<= 1.1x'))
        cpu = get('local', nmax, rates[0])
        if cpu:
            rows.append((f'CPU part: {nmax} boots from the page cache (no storage)',
                         f'{cpu:.1f} s', ''))
            if get('rbd', nmax) and get('cc-warm', nmax) and get('cc-warm', nmax) > cpu:
                rows.append((f'storage wait (last boot minus the CPU part), {nmax} boots '
                             f'at {slow}: no cache / warm cache',
                             f'{get("rbd", nmax) - cpu:.1f} s / {get("cc-warm", nmax) - cpu:.1f} s',
                             ''))
        lines += ['| measure | value | target |', '|---|---|---|']
        lines += [f'| {a} | {b} | {c} |' for a, b, c in rows]
        lines.append('')
        if self.fio_results:
            lines += [f'## fio: 4 KiB random reads, QD32, {self.args.fio_seconds} s, link {rates[0]}',
                      '', '| path | IOPS | p50 (us) | p99 (us) |', '|---|---|---|---|']
            lines += [f'| {k} | {v["iops"]:.0f} | {v["p50_us"]:.0f} | {v["p99_us"]:.0f} |'
                      for k, v in self.fio_results.items()]
            lines.append('')
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, self.args.name + '.md'), 'w') as f:
            f.write('\n'.join(lines))
        with open(os.path.join(out, self.args.name + '.json'), 'w') as f:
            json.dump(dict(args=vars(self.args), storms=res, fio=self.fio_results), f, indent=1)
        self.chart(os.path.join(out, self.args.name + '.png'), by)
        print('\n'.join(lines))

    def chart(self, path, by):
        plt = charts.pyplot()
        if not plt:
            return
        rates = self.args.rates
        fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.2), squeeze=False)
        for ax, rate in zip(axes[0], rates):
            for c in self.args.configs:
                pts = [(n, by[rate, c, n]['storm_s']) for n in self.args.counts
                       if (rate, c, n) in by]
                if pts:
                    ax.plot(*zip(*pts), marker='o', label=c)
            ax.set_title(f'link {rate}')
            ax.set_xlabel('guests booting at once')
            ax.set_ylabel('time until the last guest booted (s)')
            ax.set_xticks(self.args.counts)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        charts.save(fig, path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rates', default='1gbit,25mbit',
                    help='tbf rates of the link, comma-separated (first: also fio)')
    ap.add_argument('--counts', default='1,2,5,10')
    ap.add_argument('--configs', default=','.join(CONFIGS))
    ap.add_argument('--bootset-mib', type=int, default=24)
    ap.add_argument('--timeout', type=float, default=600, help='per storm (s)')
    ap.add_argument('--fio-seconds', type=int, default=15, help='0: no fio')
    ap.add_argument('--work-dir', default=H.BUILD,
                    help='where the cluster and images go (not tmpfs: BlueStore)')
    ap.add_argument('--out', default=os.path.join(REPO, 'docs', 'bench'))
    ap.add_argument('--name', default='boot-storm', help='stem of the files written')
    args = ap.parse_args()
    args.rates = args.rates.split(',')
    args.counts = [int(x) for x in args.counts.split(',')]
    args.configs = [c for c in args.configs.split(',') if c]
    bad = set(args.configs) - set(CONFIGS)
    if bad:
        ap.error(f'unknown configurations {sorted(bad)}; known: {CONFIGS}')
    if os.geteuid() != 0:
        ap.error('needs root (network namespace, tc)')
    why = unavailable(H.binary('qemu-img'))
    if why:
        sys.exit(f'boot-storm: {why}')
    s = Storm(args)
    try:
        s.setup()
        s.run()
        s.write(args.out)
    finally:
        s.cleanup()


if __name__ == '__main__':
    main()
