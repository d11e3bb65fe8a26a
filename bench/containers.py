#!/usr/bin/env python3
"""Containers on a hybrid volume against ext4 on the SSD and tmpfs (issue 37).

Stores, each a file system of the same size (--size, default 1 GiB), set up
once per run:
  hybrid-async  a hybrid volume (volume/hvvol.py: qemu-storage-daemon,
                hybrid node with a --ram-size RAM tier over a preallocated
                image on the build directory's disk, FUSE export, loop
                device with direct I/O, ext4), write-back mode async
  hybrid-sync   the same, mode sync
  ext4          ext4 on a loop device with --direct-io=on over a
                preallocated file on the same disk as the hybrid images
                ("ext4 on the SSD": the baseline of every ratio)
  ext4@aa       a second, identical ext4 store: the A/A control
  tmpfs         tmpfs (the RAM-only ceiling; loses everything on a crash)
  loop-tmpfs    ext4 on a loop device (direct I/O) over a file on tmpfs:
                tmpfs plus the ext4 + loop part of the volume's path
  fuse-tmpfs    ext4 on a loop device (direct I/O) over a qemu-storage-
                daemon FUSE export of a raw node over a file on tmpfs: the
                volume's whole path (daemon, FUSE, loop, ext4) with no
                hybrid driver, over RAM
so that fuse-tmpfs / loop-tmpfs is what FUSE and the daemon cost, and
loop-tmpfs / tmpfs what ext4 and the loop device cost.

Workloads, in interleaved rounds (the stores' order reversed every other
round), each store once per round:
  fio           one podman container with the store bind-mounted on /data
                runs five fio jobs one after the other (stonewall) on one
                256 MiB file: 4 KiB random read and write (libaio, QD32),
                128 KiB sequential read and write (libaio, QD32), and
                fsync-heavy 4 KiB random writes (psync, QD1, fsync after
                each write); all O_DIRECT (tmpfs takes O_DIRECT on this
                kernel); IOPS or MB/s and p99 completion latency (for the
                fsync job: p99 of the fsync calls) from fio's JSON
  redis         redis-server in a container (host network), AOF on the
                store with appendfsync always, driven from the host by
                redis-benchmark: SET then GET, -P 1, fixed request counts;
                ops/s and p99
  start         podman's whole storage (graphroot) on the store: `podman
                --root STORE/storage run --rm IMAGE true`, timed, N times
                (the image imported into each store once, before)

Statistics (bench/pooled_stats.py): per (store, workload) the mean with its
95 % Student t interval; the ratio of means to ext4 (and to tmpfs) with a
percentile bootstrap 95 % interval, every ratio oriented so that > 1 is
faster (a time ratio is baseline time / store time); the A/A ratio
ext4@aa / ext4; the verdict of each hybrid ratio against 1.12x.

Usage (root; the build's venv has matplotlib):
  build/venv/bin/python3 bench/containers.py [--rounds 4] [--fio-seconds 4]
  build/venv/bin/python3 bench/containers.py --quick   (1 round, 3 s jobs)
Writes docs/bench/containers.md, .json and .png (--out).
"""

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'tests'))
sys.path.insert(0, os.path.join(REPO, 'volume', 'tests'))
import charts   # noqa: E402
from pooled_stats import mean, mean_ci, ratio_ci, verdict   # noqa: E402
import privatens   # noqa: E402
from hvlib.podman import Podman, PodmanMissing   # noqa: E402
from volume import host, transport   # noqa: E402
from volume import hvvol as hvvol_mod   # noqa: E402
from volume.hvvol import Tools, Volumes   # noqa: E402

MiB = 1 << 20
GOAL = ('>=', 1.12)          # the design's 12 % over ext4 on the SSD
BASE = 'ext4'
AA = 'ext4@aa'
CEIL = 'tmpfs'
STORES = ['hybrid-async', 'hybrid-sync', 'ext4', 'ext4@aa', 'tmpfs', 'loop-tmpfs',
          'fuse-tmpfs']
HYBRIDS = ['hybrid-async', 'hybrid-sync']
FIO_FILE_MIB = 256
DEFAULT_OUT = os.path.join(REPO, 'docs', 'bench')

# (workload, fio options, metric): every job O_DIRECT on /data/fio.dat
FIO_JOBS = [
    ('fio randread 4K', dict(rw='randread', bs='4k', ioengine='libaio', iodepth=32), 'IOPS'),
    ('fio randwrite 4K', dict(rw='randwrite', bs='4k', ioengine='libaio', iodepth=32), 'IOPS'),
    ('fio seqread 128K', dict(rw='read', bs='128k', ioengine='libaio', iodepth=32), 'MB/s'),
    ('fio seqwrite 128K', dict(rw='write', bs='128k', ioengine='libaio', iodepth=32), 'MB/s'),
    ('fio fsync 4K', dict(rw='randwrite', bs='4k', ioengine='psync', iodepth=1, fsync=1),
     'IOPS'),
]
REDIS = [('redis SET', 'SET'), ('redis GET', 'GET')]
START = 'container start'
# workload -> (unit, higher is better)
WORKLOADS = {w: (m, True) for w, _, m in FIO_JOBS}
WORKLOADS.update({w: ('ops/s', True) for w, _ in REDIS})
WORKLOADS[START] = ('s', False)


def sh(*argv, timeout=300, check=True):
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f'{" ".join(map(str, argv))} failed ({p.returncode}): '
                           f'{(p.stderr or p.stdout).strip()[-1500:]}')
    return p


def log(msg):
    print(time.strftime('%H:%M:%S ') + msg, file=sys.stderr, flush=True)


def mounts_under(path):
    """Targets of mounts at or below path in this namespace, deepest first."""
    path = path.rstrip('/')
    ts = [m['target'] for m in host.mountinfo()
          if m['target'] == path or m['target'].startswith(path + '/')]
    return sorted(set(ts), key=len, reverse=True)


def umount_all_under(path):
    for t in mounts_under(path):
        if sh('umount', t, check=False).returncode != 0:
            sh('umount', '-l', t, check=False)


def make_ext4(dev, mnt):
    """ext4 as hvvol makes and mounts it (volume/hvvol.py)."""
    sh('mkfs.ext4', '-q', '-E', 'nodiscard', dev, timeout=600)
    os.makedirs(mnt, exist_ok=True)
    sh('mount', '-t', 'ext4', '-o', hvvol_mod.MOUNT_OPTIONS, dev, mnt)


def prealloc(path, size):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


# -- stores ---------------------------------------------------------------------

class Store:
    """A mounted file system of one kind; setup() mounts it on self.mnt,
    teardown() undoes whatever of setup() was done."""

    def __init__(self, name, bench):
        self.name = name
        self.b = bench
        self.mnt = os.path.join(bench.disk, 'mnt', name)
        self.info = {}
        self.pm = None              # podman with its storage on this store

    def teardown(self):
        umount_all_under(self.mnt)


class Tmpfs(Store):
    def setup(self):
        os.makedirs(self.mnt)
        sh('mount', '-t', 'tmpfs', '-o', f'size={self.b.size},mode=0755', 'tmpfs', self.mnt)
        self.info = dict(what='tmpfs', size=self.b.size)


class LoopExt4(Store):
    """ext4 on a loop device with direct I/O over a preallocated file in
    directory where (the build directory's disk, or tmpfs)."""

    def __init__(self, name, bench, where):
        super().__init__(name, bench)
        self.file = os.path.join(where, name.replace('@', '-') + '.img')
        self.loop = None

    def setup(self):
        prealloc(self.file, self.b.size)
        self.loop = sh('losetup', '--find', '--show', '--direct-io=on', self.file,
                       timeout=60).stdout.strip()
        make_ext4(self.loop, self.mnt)
        self.info = dict(what='ext4 on a loop device over a file', file=self.file,
                         loop=self.loop, dio=host.loop_dio(self.loop))

    def teardown(self):
        super().teardown()
        if self.loop in host.loops_backed_by(self.file):     # ours, still attached
            try:
                transport.FuseLoop(self.file).detach(self.loop)   # losetup -d, waited for
            except Exception as exc:            # noqa: BLE001 (go on cleaning)
                log(f'{self.name}: {exc}')
        if os.path.exists(self.file):
            os.unlink(self.file)


class FuseRaw(Store):
    """ext4 on a loop device (direct I/O) over a qemu-storage-daemon FUSE
    export of a raw node over a file on tmpfs: the volume's path with the
    same export and loop settings (transport.FuseLoop), no hybrid driver."""

    def __init__(self, name, bench):
        super().__init__(name, bench)
        self.raw = os.path.join(bench.shm, 'fuse-raw.img')
        self.tr = transport.FuseLoop(os.path.join(bench.shm, 'fuse-export'))
        self.proc = None
        self.loop = None

    def setup(self):
        prealloc(self.raw, self.b.size)
        self.tr.prepare()
        args = self.tr.export_args('e', 'n')
        export = ','.join(f'{k}={"on" if v is True else v}' for k, v in args.items())
        self.logf = open(os.path.join(self.b.shm, 'fuse-qsd.log'), 'w')
        self.proc = subprocess.Popen(
            [self.b.tools.qsd, '--blockdev',
             f'driver=raw,node-name=n,file.driver=file,file.filename={self.raw}',
             '--export', export], stdin=subprocess.DEVNULL, stdout=self.logf,
            stderr=self.logf, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.tr.exported():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError('fuse-tmpfs: qemu-storage-daemon did not export: ' +
                                   open(self.logf.name).read()[-1500:])
            time.sleep(0.02)
        self.loop, dio = self.tr.attach()
        make_ext4(self.loop, self.mnt)
        self.info = dict(what='ext4, loop, FUSE export of a raw node over a tmpfs file',
                         file=self.raw, loop=self.loop, dio=dio, qsd_pid=self.proc.pid)

    def teardown(self):
        super().teardown()
        if self.loop:
            try:
                self.tr.detach(self.loop)
            except Exception as exc:            # noqa: BLE001 (go on cleaning)
                log(f'fuse-tmpfs: {exc}')
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tr.exported():
            sh('umount', '-l', self.tr.export_file, check=False)
        for f in (self.raw, self.tr.export_file):
            if os.path.exists(f):
                os.unlink(f)


class Hybrid(Store):
    """A hybrid volume made and mounted by the hvvol library."""

    def __init__(self, name, bench, mode):
        super().__init__(name, bench)
        self.mode = mode
        self.vol = name
        self.made = False

    def setup(self):
        vols = self.b.vols
        vols.create(self.vol, {'size': str(self.b.size), 'ram-size': str(self.b.ram_size),
                               'mode': self.mode})
        self.made = True
        os.makedirs(self.mnt)
        st = vols.mount(self.vol, self.mnt)
        s = vols._state(self.vol)
        self.info = dict(what=f'hybrid volume, mode {self.mode}',
                         image=vols._config(self.vol)['image'], loop=s['loop'], dio=s['dio'],
                         transport=s['transport'], qsd_pid=s['pid'],
                         ram_size=self.b.ram_size, state=st.get('state'),
                         journal_mib=self.journal_mib())

    def query(self):
        q = self.b.vols._qmp(self.vol)
        try:
            return q.cmd('query-hybrid')[0]
        finally:
            q.close()

    def settle(self, timeout=60):
        """Until the background write-back is idle: nothing dirty, or the
        dirty bytes unchanged for a second (the flusher works between a
        high and a low mark; what is left below it waits for a flush)."""
        deadline = time.monotonic() + timeout
        last, same = None, 0
        while time.monotonic() < deadline:
            dirty = self.query()['dirty-bytes']
            same = same + 1 if dirty == last else 0
            if dirty == 0 or same >= 4:
                return dirty
            last = dirty
            time.sleep(0.25)
        return dirty

    def journal_mib(self):
        """Where ext4 put its journal on the device (MiB from its start):
        beyond the RAM tier, every journal write goes through to the image."""
        p = sh('debugfs', '-R', 'bmap <8> 0', self.b.vols._state(self.vol)['loop'],
               check=False)
        try:
            return int(p.stdout.split()[-1]) * 4096 / MiB
        except (ValueError, IndexError):
            return None

    def teardown(self):
        vols = self.b.vols
        for t in mounts_under(self.mnt):       # podman's leftovers, not the volume
            if t != self.mnt:
                sh('umount', '-l', t, check=False)
        if not self.made:
            return
        try:
            if vols._state(self.vol) is not None:
                vols.umount(self.vol)
        except Exception as exc:                # noqa: BLE001 (then by force)
            log(f'{self.name}: umount failed ({exc}); stopping it by force')
            self.force_down()
        try:
            vols.remove(self.vol)
        except Exception as exc:                # noqa: BLE001
            log(f'{self.name}: rm failed: {exc}')

    def force_down(self):
        """As volume/tests/vollib.py: the daemon this process started is
        killed, its mount, loop device and export removed."""
        vols = self.b.vols
        st = vols._state(self.vol)
        if st is None:
            return
        for pid in (st.get('pid'), st.get('wrapper_pid')):
            if pid and pid in hvvol_mod._CHILDREN and host.start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)
        if st.get('mountpoint'):
            sh('umount', '-l', st['mountpoint'], check=False)
        export = os.path.join(vols.run_dir, self.vol, 'export')
        for loop in host.loops_backed_by(export):
            sh('losetup', '-d', loop, check=False)
        sh('umount', '-l', export, check=False)
        for pid, child in list(hvvol_mod._CHILDREN.items()):
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                pass
            hvvol_mod._CHILDREN.pop(pid, None)
        vols._drop_state(self.vol)


# -- the benchmark ----------------------------------------------------------------

class Bench:
    def __init__(self, a):
        self.a = a
        self.size = a.size_mib * MiB
        self.ram_size = a.ram_mib * MiB
        self.tools = Tools()
        self.disk = tempfile.mkdtemp(prefix='containers-bench-', dir=a.disk_dir)
        self.shm = tempfile.mkdtemp(prefix='cb-', dir='/dev/shm')   # podman: runroot <= 50 chars
        self.vols = Volumes(os.path.join(self.disk, 'vols'), os.path.join(self.shm, 'run'))
        self.stores = {}
        self.rows = []
        self.containers = []
        self.hybrid_stats = {}
        self.timing = {}
        self.tag = f'hvcb{os.getpid()}'

    # setup / cleanup

    def make_stores(self):
        kinds = {'hybrid-async': lambda n: Hybrid(n, self, 'async'),
                 'hybrid-sync': lambda n: Hybrid(n, self, 'sync'),
                 'ext4': lambda n: LoopExt4(n, self, self.disk),
                 'ext4@aa': lambda n: LoopExt4(n, self, self.disk),
                 'tmpfs': lambda n: Tmpfs(n, self),
                 'loop-tmpfs': lambda n: LoopExt4(n, self, self.shm),
                 'fuse-tmpfs': lambda n: FuseRaw(n, self)}
        # the workload containers' own podman (their root file systems are
        # on the build disk, the same for every store; only /data differs)
        self.pm = Podman(root=os.path.join(self.disk, 'podman'))
        self.pm.runroot = os.path.join(self.shm, 'podman.run')
        t0 = time.monotonic()
        self.image = self.pm.image()
        self.timing['import (workload podman)'] = time.monotonic() - t0
        for n in STORES:
            s = kinds[n](n)
            self.stores[n] = s
            t0 = time.monotonic()
            s.setup()
            self.timing[f'setup {n}'] = time.monotonic() - t0
            log(f'{n}: {s.info}')
            self.prepare(s)

    def prepare(self, s):
        """The fio file, written whole and synced; podman's storage with the
        image on the store, one container started and removed (untimed)."""
        sh('fio', '--name=layout', f'--filename={s.mnt}/fio.dat', f'--size={FIO_FILE_MIB}M',
           '--rw=write', '--bs=1M', '--direct=1', '--end_fsync=1', '--output-format=terse',
           timeout=600)
        pm = Podman(root=os.path.join(s.mnt, 'storage'))
        pm.runroot = os.path.join(self.shm, f'rr-{s.name.replace("@", "-")}')
        s.pm = pm
        t0 = time.monotonic()
        pm.image()
        pm.run('run', '--rm', '--network', 'none', self.image, 'true')
        sh('sync', '-f', s.mnt)
        self.timing[f'import {s.name}'] = time.monotonic() - t0

    def settle(self):
        """Before each measurement, the hybrid volumes' background write-back
        idle, so that what one store's run left to write back does not run
        during another store's figure."""
        t0 = time.monotonic()
        for n in HYBRIDS:
            self.stores[n].settle()
        self.timing['settling'] = self.timing.get('settling', 0) + time.monotonic() - t0

    def cleanup(self):
        for s in [self.stores[n] for n in reversed(STORES) if n in self.stores]:
            if s.pm is not None:
                s.pm.run('rm', '-a', '-f', '-t', '0', check=False)
        if getattr(self, 'pm', None) is not None:
            self.pm.run('rm', '-a', '-f', '-t', '0', check=False)
        for n in reversed(STORES):
            if n in self.stores:
                try:
                    self.stores[n].teardown()
                except Exception as exc:        # noqa: BLE001 (clean the rest)
                    log(f'teardown {n}: {exc}')
        for d in (self.disk, self.shm):
            umount_all_under(d)
            if mounts_under(d):
                log(f'left {d}: still mounted: {mounts_under(d)}')
            else:
                shutil.rmtree(d, ignore_errors=True)

    # workloads

    def record(self, rnd, store, workload, value, p99=None):
        self.rows.append(dict(round=rnd, store=store, workload=workload, value=value, p99=p99))

    def fio(self, rnd, s):
        name = f'{self.tag}-fio-{rnd}-{s.name.replace("@", "-")}'
        argv = ['run', '--rm', '--name', name, '--network', 'none', '-v', f'{s.mnt}:/data',
                self.image, 'fio', '--output-format=json', '--filename=/data/fio.dat',
                f'--size={FIO_FILE_MIB}M', '--direct=1', '--time_based',
                f'--runtime={self.a.fio_seconds}', '--ramp_time=1', '--randrepeat=0',
                '--norandommap']
        for w, opts, _ in FIO_JOBS:
            argv += [f'--name={w.split()[1]}-{w.split()[2]}', '--stonewall'] + \
                [f'--{k}={v}' for k, v in opts.items()]
        p = self.pm.run(*argv, timeout=60 + 5 * (self.a.fio_seconds + 2) * len(FIO_JOBS))
        out = json.loads(p.stdout[p.stdout.find('{'):])
        jobs = {j['jobname']: j for j in out['jobs']}
        for w, opts, metric in FIO_JOBS:
            j = jobs[f'{w.split()[1]}-{w.split()[2]}']
            if j['error']:
                raise RuntimeError(f'fio {w} on {s.name}: error {j["error"]}')
            d = j['read' if 'read' in opts['rw'] else 'write']
            v = d['iops'] if metric == 'IOPS' else d['bw_bytes'] / 1e6
            if opts.get('fsync'):
                pct = j.get('sync', {}).get('lat_ns', {}).get('percentile', {})
            else:
                pct = d['clat_ns'].get('percentile', {})
            p99 = pct.get('99.000000')
            self.record(rnd, s.name, w, v, p99 / 1000 if p99 else None)

    def redis(self, rnd, s):
        with socket.socket() as so:
            so.bind(('127.0.0.1', 0))
            port = so.getsockname()[1]
        d = os.path.join(s.mnt, f'redis-{rnd}')
        os.makedirs(d)
        name = f'{self.tag}-redis-{rnd}-{s.name.replace("@", "-")}'
        self.containers.append(name)
        try:
            self.pm.run('run', '-d', '--name', name, '--network', 'host', '-v', f'{d}:/data',
                        self.image, 'redis-server', '--bind', '127.0.0.1', '--port', str(port),
                        '--dir', '/data', '--appendonly', 'yes', '--appendfsync', 'always',
                        '--save', '', '--protected-mode', 'no')
            deadline = time.monotonic() + 60
            while sh('redis-cli', '-p', port, 'ping', check=False,
                     timeout=10).stdout.strip() != 'PONG':
                if time.monotonic() > deadline:
                    raise RuntimeError(f'redis on {s.name} did not answer: ' +
                                       self.pm.run('logs', name, check=False).stderr[-1000:])
                time.sleep(0.1)
            n = self.a.redis_requests
            p = sh('redis-benchmark', '-h', '127.0.0.1', '-p', port, '-t', 'set,get',
                   '-n', n, '-c', self.a.redis_clients, '-P', '1', '-d', '100',
                   '-r', '100000', '--csv', timeout=600)
            got = {}
            lines = [ln.replace('"', '').split(',') for ln in p.stdout.splitlines() if ln]
            head = lines[0]
            for ln in lines[1:]:
                got[ln[0]] = dict(zip(head[1:], map(float, ln[1:])))
            for w, test in REDIS:
                self.record(rnd, s.name, w, got[test]['rps'],
                            got[test]['p99_latency_ms'] * 1000)
        finally:
            self.pm.rm(name)
            self.containers.remove(name)
            shutil.rmtree(d, ignore_errors=True)

    def start(self, rnd, s):
        for _ in range(self.a.starts):
            t0 = time.monotonic()
            s.pm.run('run', '--rm', '--network', 'none', self.image, 'true')
            self.record(rnd, s.name, START, time.monotonic() - t0)

    def run(self):
        self.load_start = os.getloadavg()
        t0 = time.monotonic()
        self.make_stores()
        self.timing['setup'] = time.monotonic() - t0
        for rnd in range(self.a.rounds):
            order = STORES if rnd % 2 == 0 else STORES[::-1]
            for wl, fn in (('fio', self.fio), ('redis', self.redis), ('start', self.start)):
                for n in order:
                    self.settle()
                    t1 = time.monotonic()
                    fn(rnd, self.stores[n])
                    log(f'round {rnd + 1}/{self.a.rounds} {wl:5} {n:12} '
                        f'{time.monotonic() - t1:5.1f} s  ' + ', '.join(
                            f'{r["workload"].split(" ", 1)[1]}={r["value"]:.4g}'
                            for r in self.rows[-len(FIO_JOBS):]
                            if r['store'] == n and r['round'] == rnd and wl != 'start'))
            log(f'round {rnd + 1} done, {time.monotonic() - t0:.0f} s in')
        for n in HYBRIDS:
            q = self.stores[n].query()
            self.hybrid_stats[n] = {k: q[k] for k in (
                'ram-size', 'ram-used', 'read-hits', 'read-misses', 'hit-rate', 'writes-ram',
                'writes-through', 'flushed-bytes', 'dirty-bytes') if k in q}
        self.load_end = os.getloadavg()
        self.timing['total'] = time.monotonic() - t0
        self.store_info = {n: s.info for n, s in self.stores.items()}


# -- statistics and report ----------------------------------------------------------

def values(rows, store, workload):
    return [r['value'] for r in rows if r['store'] == store and r['workload'] == workload]


def speed_ratio(rows, workload, store, base):
    """store against base, > 1 faster: a ratio of means with its bootstrap
    interval (for a time, base / store)."""
    a, b = values(rows, store, workload), values(rows, base, workload)
    if not a or not b:
        return None
    if WORKLOADS[workload][1]:
        p, lo, hi = ratio_ci(a, b)
    else:
        p, lo, hi = ratio_ci(b, a)
    return dict(ratio=p, lo=lo, hi=hi)


def summarize(rows):
    s = {}
    for w in WORKLOADS:
        for n in STORES:
            xs = values(rows, n, w)
            if not xs:
                continue
            m, h = mean_ci(xs)
            p99s = [r['p99'] for r in rows if r['store'] == n and r['workload'] == w
                    and r['p99'] is not None]
            e = dict(mean=m, ci=h, n=len(xs), p99=mean(p99s) if p99s else None,
                     vs_ext4=speed_ratio(rows, w, n, BASE) if n != BASE else None,
                     vs_tmpfs=speed_ratio(rows, w, n, CEIL) if n != CEIL else None)
            if n in HYBRIDS and e['vs_ext4']:
                e['verdict'] = verdict(e['vs_ext4']['lo'], e['vs_ext4']['hi'], GOAL) \
                    if min(len(xs), len(values(rows, BASE, w))) > 1 else \
                    'one sample: no interval, no verdict'

            s[f'{w}|{n}'] = e
        fuse = speed_ratio(rows, w, 'fuse-tmpfs', 'loop-tmpfs')
        loop = speed_ratio(rows, w, 'loop-tmpfs', CEIL)
        hyb = speed_ratio(rows, w, 'hybrid-async', 'fuse-tmpfs')
        s[f'{w}|decomposition'] = dict(fuse=fuse, loop=loop, hybrid=hyb)
    return s


def fmt(x, nd=None):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return '-'
    if nd is None:
        nd = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 1 else 3
    return f'{x:,.{nd}f}'


def fr(r):
    """A ratio with its interval (three significant digits)."""
    if not r:
        return '-'
    if r['lo'] == r['hi'] == r['ratio']:
        return f'{r["ratio"]:.3g}'
    return f'{r["ratio"]:.3g} [{r["lo"]:.3g}, {r["hi"]:.3g}]'


def share(dec, path):
    """FUSE's part of the FUSE path's cost (fuse-tmpfs against tmpfs), in log
    terms; only where both of its factors (ext4 + loop, FUSE + daemon) are
    below 1, so that it is a part."""
    if not (dec['fuse'] and dec['loop'] and path) or dec['fuse']['ratio'] >= 1 or \
            dec['loop']['ratio'] >= 1:
        return '-'
    return f'{100 * math.log(dec["fuse"]["ratio"]) / math.log(path["ratio"]):.0f} %'


def write_report(d, out):
    a = d['args']
    rows, s = d['rows'], d['summary']
    unit_p99 = {w: ('fsync p99 µs' if 'fsync' in w else 'p99 µs') for w in WORKLOADS}
    lines = [
        '# Containers on a hybrid volume, ext4 on the SSD and tmpfs', '',
        f'Measured {d["measured"]} by `{d["command"]}` ({a["rounds"]} interleaved round'
        f'{"s" if a["rounds"] > 1 else ""}, the stores\' order reversed every other round; '
        f'{d["timing"]["total"] / 60:.0f} min in all).  Machine: {d["machine"]}; load average '
        f'at the start {d["load_start"][0]:.2f} / {d["load_start"][1]:.2f} / '
        f'{d["load_start"][2]:.2f} (1/5/15 min), at the end {d["load_end"][0]:.2f} / '
        f'{d["load_end"][1]:.2f} / {d["load_end"][2]:.2f}: other engineers\' tests and a long '
        'migration benchmark ran meanwhile, which is why the run is pooled with an A/A '
        'control.', '',
        '## Stores', '',
        f'Every store is a {a["size_mib"]} MiB file system, made once for the run; the '
        'containers (podman 4, runc, rootful, the offline-made Debian 12 image of '
        '`tests/hvlib/podman.py`) bind-mount it on `/data`.', '',
        '| store | what it is |', '|---|---|',
        f'| hybrid-async | a hybrid volume (`volume/hvvol.py`): qemu-storage-daemon, hybrid '
        f'node with a {a["ram_mib"]} MiB RAM tier in front of a preallocated image on the '
        'build directory\'s disk, FUSE export, loop device with direct I/O, ext4; mode async |',
        '| hybrid-sync | the same, mode sync (a write completes when both tiers hold it) |',
        '| ext4 | ext4 on a loop device with `--direct-io=on` over a preallocated file on the '
        'same disk as the hybrid images ("ext4 on the SSD": the disk is this VM\'s virtio '
        'disk); the baseline of every ratio |',
        '| ext4@aa | a second ext4 store made the same way: the A/A control |',
        '| tmpfs | tmpfs: the RAM-only ceiling, which loses everything on a crash |',
        '| loop-tmpfs | ext4 on a loop device with direct I/O over a file on tmpfs: tmpfs plus '
        'the ext4 + loop part of the volume\'s path |',
        '| fuse-tmpfs | ext4 on a loop device with direct I/O over a qemu-storage-daemon FUSE '
        'export (the volume\'s export settings) of a `raw` node over a file on tmpfs: the '
        'volume\'s whole path without the hybrid driver, over RAM |', '',
        'Workloads (each store once per round; stores in interleaved order):', '',
        f'- **fio** in one container per store and round, five jobs one after the other '
        f'(`--stonewall`) on one {FIO_FILE_MIB} MiB file written beforehand: 4 KiB random '
        'read and write (libaio, QD32), 128 KiB sequential read and write (libaio, QD32), '
        'and fsync-heavy 4 KiB random writes (psync, QD1, `--fsync=1`: an fsync after each '
        f'write; its p99 is the fsync call\'s); {a["fio_seconds"]} s each after 1 s of ramp, '
        '`--direct=1` on every store (tmpfs takes O_DIRECT on this kernel, '
        f'{d["kernel"]}).  p99: fio\'s completion latency.',
        f'- **redis**: redis-server in a container (host network), `--appendonly yes '
        f'--appendfsync always`, its data directory on the store (a fresh one each run); '
        f'from the host `redis-benchmark -t set,get -n {a["redis_requests"]} -c '
        f'{a["redis_clients"]} -P 1 -d 100 -r 100000`: ops/s and p99 of each test.  (GETs '
        'write nothing, so they do not touch the store: their row is a control for the '
        'noise of a CPU-bound server.)',
        f'- **container start**: podman\'s whole storage (graphroot) on the store, the image '
        f'imported into it once before the rounds; `podman --root STORE/storage run --rm '
        f'--network none IMAGE true` timed, {a["starts"]} times per round (runroot on tmpfs '
        'for every store, as podman\'s default /run is).', '',
        'Before each measurement the hybrid volumes\' background write-back is left to go '
        'idle, so that what one store\'s run left dirty is not written back during another '
        'store\'s figure; a flush (fsync) inside a run still writes back everything dirty, '
        'and counts.', '',
        'Statistics (`bench/pooled_stats.py`): mean ± the 95 % Student t half-width over '
        'the samples (one per round; container start: one per start); ratios are ratios of '
        'means with a percentile bootstrap 95 % interval, oriented so that > 1 means faster '
        'than the baseline (for start time: baseline time / store time).  The verdict reads '
        'the 1.12x goal against the whole interval.  The A/A row (ext4@aa / ext4) shows how '
        'far two identical stores land apart in this run.', '']
    lines += ['## Against the issue: hybrid / ext4-on-SSD (goal >= 1.12x) and / tmpfs', '',
              '| workload | hybrid-async / ext4 | verdict | hybrid-sync / ext4 | verdict | '
              'A/A ext4@aa / ext4 | hybrid-async / tmpfs | hybrid-sync / tmpfs |',
              '|---|---:|---|---:|---|---:|---:|---:|']
    for w in WORKLOADS:
        ha, hs, aa = s[f'{w}|hybrid-async'], s[f'{w}|hybrid-sync'], s[f'{w}|{AA}']
        lines.append(f'| {w} | {fr(ha["vs_ext4"])} | {ha.get("verdict", "-")} | '
                     f'{fr(hs["vs_ext4"])} | {hs.get("verdict", "-")} | {fr(aa["vs_ext4"])} | '
                     f'{fr(ha["vs_tmpfs"])} | {fr(hs["vs_tmpfs"])} |')
    lines += ['', '![ratios to ext4 on the SSD and to tmpfs](containers.png)', '']
    lines += ['## What FUSE costs', '',
              'Three stores over RAM, each adding one layer of the volume\'s path (ratios of '
              'means, > 1: the first is faster):', '',
              '- **ext4 + loop** = loop-tmpfs / tmpfs: ext4 and a direct-I/O loop device over a '
              'tmpfs file, against tmpfs itself;',
              '- **FUSE + daemon** = fuse-tmpfs / loop-tmpfs: the same ext4 and loop device, '
              'over qemu-storage-daemon\'s FUSE export of a `raw` node over the tmpfs file '
              'instead of over the file directly: FUSE\'s cost, with the daemon\'s block layer '
              'and its file driver (a thread pool, `aio=threads`, as the hybrid image\'s file '
              'child has) in it;',
              '- **FUSE path over RAM** = fuse-tmpfs / tmpfs = ext4 + loop x FUSE + daemon: the '
              'ceiling for any node behind this path; **FUSE\'s part** of it = log(FUSE + '
              'daemon) / log(FUSE path), shown where both factors are below 1;',
              '- **hybrid / ceiling** = hybrid-async / fuse-tmpfs: the hybrid node (RAM tier, '
              'persistent tier on the disk) against the raw node on tmpfs behind the same '
              'path.  hybrid-async / tmpfs = FUSE path x hybrid / ceiling;',
              '- **FUSE path / ext4** = fuse-tmpfs / ext4: what a node over RAM behind this '
              'path reaches against ext4 on the SSD (below 1.12, no node behind it can meet '
              'the goal on this host).', '',
              '| workload | ext4 + loop | FUSE + daemon | FUSE path over RAM | FUSE\'s part | '
              'hybrid-async / tmpfs | hybrid / ceiling | FUSE path / ext4 |',
              '|---|---:|---:|---:|---:|---:|---:|---:|']
    for w in WORKLOADS:
        dec = s[f'{w}|decomposition']
        path = s[f'{w}|fuse-tmpfs']['vs_tmpfs']
        lines.append(f'| {w} | {fr(dec["loop"])} | {fr(dec["fuse"])} | {fr(path)} | '
                     f'{share(dec, path)} | {fr(s[f"{w}|hybrid-async"]["vs_tmpfs"])} | '
                     f'{fr(dec["hybrid"])} | {fr(s[f"{w}|fuse-tmpfs"]["vs_ext4"])} |')
    lines += ['', '## Every store and workload', '',
              '| workload | store | mean ± 95 % CI | unit | p99 (mean of runs) | vs ext4 | '
              'vs tmpfs |', '|---|---|---:|---|---:|---:|---:|']
    for w, (unit, _) in WORKLOADS.items():
        for n in STORES:
            e = s.get(f'{w}|{n}')
            if not e:
                continue
            p99 = '-' if e['p99'] is None else f'{fmt(e["p99"])} µs'
            if w == START:
                p99 = '-'
            lines.append(f'| {w} | {n} | {fmt(e["mean"])} ± {fmt(e["ci"])} | {unit} | {p99} '
                         f'| {"1 (baseline)" if n == BASE else fr(e["vs_ext4"])} | '
                         f'{"1" if n == CEIL else fr(e["vs_tmpfs"])} |')
    lines += ['', 'p99 of fio jobs: completion latency (fsync job: of the fsync calls); of '
              'redis: redis-benchmark\'s, per request.  An fsync on tmpfs does nothing, so '
              'the fsync rows against tmpfs compare with a store that keeps nothing.  "The '
              'SSD" is this VM\'s virtio disk, as fast as the hypervisor under it makes it '
              '(its caches included).', '']
    if d.get('hybrid_stats'):
        lines += ['## The hybrid volumes at the end of the run (query-hybrid)', '',
                  '| store | read hits | read misses | hit rate | writes to RAM | writes '
                  'through (beyond the RAM tier) | written back |', '|---|---:|---:|---:|---:|'
                  '---:|---:|']
        for n, q in d['hybrid_stats'].items():
            lines.append(f'| {n} | {q.get("read-hits")} | {q.get("read-misses")} | '
                         f'{q.get("hit-rate", 0):.3f} | {q.get("writes-ram")} | '
                         f'{q.get("writes-through")} | {q.get("flushed-bytes", 0) >> 20} MiB |')
        journal = [i.get('journal_mib') for n, i in d['stores'].items() if n in HYBRIDS]
        lines += ['', f'The RAM tier holds the first {a["ram_mib"]} MiB of the '
                  f'{a["size_mib"]} MiB device; ext4 places files anywhere on it, and what '
                  'lies beyond is read from and written to the persistent tier (the image '
                  'file; hvvol opens it without O_DIRECT, so such reads may come from the '
                  'host\'s page cache).' + (
                      f'  mkfs.ext4 put the journal at {journal[0]:.0f} MiB'
                      + (' (beyond the RAM tier: every journal write, and so every fsync, '
                         'goes through to the image file)' if journal[0] >= a['ram_mib']
                         else ' (inside the RAM tier)') + '.'
                      if journal and journal[0] is not None else ''), '']
    lines += ['## Setup', '', '| step | seconds |', '|---|---:|']
    lines += [f'| {k} | {v:.1f} |' for k, v in d['timing'].items()]
    lines += ['', 'Loop devices: ' + '; '.join(
        f'{n}: dio={i.get("dio")}' for n, i in d['stores'].items() if 'dio' in i) + '.', '']
    with open(os.path.join(out, 'containers.md'), 'w') as f:
        f.write('\n'.join(lines))
    print('\n'.join(lines))


def chart(d, path):
    plt = charts.pyplot()
    if not plt:
        return
    s = d['summary']
    left = [('hybrid-async', 'tab:red'), ('hybrid-sync', 'tab:orange'), (AA, 'tab:gray')]
    right = [('hybrid-async', 'tab:red'), ('fuse-tmpfs', 'tab:purple'),
             ('loop-tmpfs', 'tab:green'), (BASE, 'tab:gray')]
    ws = list(WORKLOADS)[::-1]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.42 * len(ws) * 4 + 1.5))
    for ax, stores, key, base, goal in ((axes[0], left, 'vs_ext4', 'ext4 on the SSD', True),
                                        (axes[1], right, 'vs_tmpfs', 'tmpfs', False)):
        labels = []
        y = 0
        for w in ws:
            for j, (n, color) in enumerate(stores):
                r = s[f'{w}|{n}'][key]
                if r:
                    charts.ratio_points(ax, [y], [r], color=color,
                                        label=n if w == ws[0] else None)
                labels.append(f'{w}: {n}')
                y += 1
        charts.ratio_rows(ax, labels, f'speed / {base} (ratio of means, 95 % bootstrap CI; '
                          'log scale)')
        ax.set_xscale('log')
        lo, hi = ax.get_xlim()
        ticks = [t for t in (0.001, 0.003, 0.01, 0.03, 0.1, 0.25, 0.5, 1, 2, 4, 8)
                 if lo <= t <= hi]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f'{t:g}' for t in ticks])
        ax.minorticks_off()
        if goal:
            ax.axvline(GOAL[1], color='k', ls='--', lw=1)
        for k in range(1, len(ws)):
            ax.axhline(k * len(stores) - 0.5, color='lightgrey', lw=0.6)
        ax.legend(fontsize=8, loc='lower left')
    axes[0].set_title('against ext4 on the SSD (dashed: the 1.12x goal)')
    axes[1].set_title('against tmpfs (the RAM-only ceiling)')
    charts.save(fig, path, dpi=80)


def machine():
    try:
        model = open('/sys/block/vda/device/vendor').read().strip()
    except OSError:
        model = ''
    return (f'{os.cpu_count()} shared cores, {os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 30} '
            f'GiB RAM, Debian 12, kernel {platform.release()}, build directory on /dev/vda '
            f'(virtio disk{", " + model if model else ""})')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rounds', type=int, default=4)
    ap.add_argument('--fio-seconds', type=int, default=4, help='each fio job, after 1 s of ramp')
    ap.add_argument('--redis-requests', type=int, default=10000, help='SETs, then as many GETs')
    ap.add_argument('--redis-clients', type=int, default=10)
    ap.add_argument('--starts', type=int, default=6, help='container starts per store and round')
    ap.add_argument('--size-mib', type=int, default=1024)
    ap.add_argument('--ram-mib', type=int, default=512)
    ap.add_argument('--quick', action='store_true',
                    help='1 round, 3 s fio jobs, fewer requests: checks that it works')
    ap.add_argument('--disk-dir', default=os.path.join(REPO, 'build'))
    ap.add_argument('--out', default=DEFAULT_OUT,
                    help='where the report goes (default docs/bench; --quick: '
                    'build/containers-bench-quick)')
    ap.add_argument('--render', metavar='JSON', help='write the report again from a run\'s JSON')
    a = ap.parse_args()
    if a.render:
        with open(a.render) as f:
            d = json.load(f)
        d['summary'] = summarize(d['rows'])
        write_report(d, a.out)
        chart(d, os.path.join(a.out, 'containers.png'))
        return
    if a.quick:
        a.rounds, a.fio_seconds, a.redis_requests, a.starts = 1, 3, 5000, 3
        if a.out == DEFAULT_OUT:        # a check run does not overwrite the report
            a.out = os.path.join(a.disk_dir, 'containers-bench-quick')
    if os.geteuid() != 0:
        sys.exit('containers bench: needs root (loop devices, mounts, podman)')
    for tool in ('fio', 'redis-benchmark', 'redis-cli', 'losetup', 'mkfs.ext4'):
        if not shutil.which(tool):
            sys.exit(f'containers bench: {tool} is not installed')
    command = 'build/venv/bin/python3 bench/containers.py' + \
        ''.join(' ' + x for x in sys.argv[1:])

    def stop(signum, frame):
        raise KeyboardInterrupt(f'signal {signum}')
    signal.signal(signal.SIGTERM, stop)
    # our mounts are copied into no one else's mount namespace (and no one
    # else's namespace holds them when we unmount): volume/tests/privatens.py
    privatens.enter()
    try:
        b = Bench(a)
    except PodmanMissing as exc:
        sys.exit(f'containers bench: {exc}')
    try:
        b.run()
    except subprocess.CalledProcessError as exc:
        log(f'{" ".join(exc.cmd)} failed ({exc.returncode}): {(exc.stderr or "")[-2000:]}')
        raise
    finally:
        b.cleanup()
    d = dict(args=vars(a), command=command, measured=time.strftime('%Y-%m-%d %H:%M UTC',
                                                                    time.gmtime()),
             machine=machine(), kernel=platform.release(), load_start=b.load_start,
             load_end=b.load_end, timing=b.timing, stores=b.store_info,
             hybrid_stats=b.hybrid_stats, rows=b.rows)
    out = a.out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'containers.json'), 'w') as f:
        json.dump(d, f, indent=1)
    d['summary'] = summarize(b.rows)
    write_report(d, out)
    chart(d, os.path.join(out, 'containers.png'))
    log(f'written to {out}')


if __name__ == '__main__':
    main()
