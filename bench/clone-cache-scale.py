#!/usr/bin/env python3
"""How the clone cache's cost grows (issue 40): index memory and restart
time against the cache's size and against the number of bases sharing it,
and the hit rate against the boot set's share of the cache.  Local files
only (no Ceph): every base is a raw file under --work-dir (default
/var/tmp), read through a clone-cache node of one qemu-storage-daemon and
its NBD export (unix socket), by a small NBD client in this file (so no
qemu-io start-up is in a timing).

Sizes axis (--sizes, MiB of cached 64 KiB blocks; default 64 256 1024
4096): one cache per size whose object size is chosen so that it holds
exactly that many blocks, filled full by reading one base through the node
(fill rate kept).  The base's data is written a --chunk-mib chunk at a
time, read through the node, then punched out of the file again (the node
has an explicit generation, so the base file may change under it): the
base never takes more disk than one chunk, and after the fill it is all
holes, so a read that returns the block's pattern came from the cache.
Every cache of the axis stays on disk until the axis is done, so the
restarts can be interleaved.

Bases axis (--bases, default 1 4 16; one cache of --bases-cache-mib,
default 1024): the same fill, the blocks split evenly over N bases (N file
nodes, N clone-cache nodes, N exports in one daemon).

For both axes, per point and round, four restart modes (--restarts times
each, default 2), each a fresh
daemon process timed from its exec (Popen) until the first read of a
cached block (block 0; of the last base on the bases axis) has completed
through NBD -- the index load happens in the clone-cache object's creation,
before the daemon serves:
  clean  the previous daemon quit (QMP quit, as SIGTERM), the cache file's
         pages still in the page cache
  crash  the previous daemon was SIGKILLed (the cache has no clean-shutdown
         marker: the same load path as clean, measured to show it)
  cold   as clean, then the cache file's pages dropped from the page cache
         (posix_fadvise DONTNEED on that file only; fincore's count of its
         resident bytes is kept): the restart after a host reboot
  empty  a new cache file of the same size (format, not load), first read a
         miss: the daemon's start without any index to load
After the first read: VmRSS and VmHWM of /proc/PID/status, and
query-clone-cache (the read must be a hit, and every filled entry must be
there again).

Hit-rate axis (--shares, % of the cache's capacity; default 10 50 100 110 125 150;
one cache of --hit-cache-mib, default 256): a base of twice the capacity,
full of distinct blocks; per share a fixed random set of block offsets
(the "boot set", seeded, in a fixed random order) read twice, 64 KiB at a
time, from an empty cache: the first pass warms, the second is measured
from the cache's own counters (query-clone-cache: hits, misses,
merged-misses, base-read-bytes, per block).  Reads wait for fill-pending to
drain every --pace-blocks blocks, so that fill-limit does not drop fills
(fills-dropped is reported; it should stay 0).

Repetitions are interleaved: --rounds rounds, the points of each axis
rotated from one round to the next (pooled_stats.rotated); means with a 95 %
Student t interval.  --quick: the smallest points (sizes 64; bases 1 4 on a
64 MiB cache; every share on a 64 MiB cache), one round, one restart.

Run it with the build's venv (build/venv/bin/python3: matplotlib for the
chart); --from-json JSON writes the report again from an earlier run's JSON
without measuring.  Writes docs/bench/clone-cache-scale.{md,json,png}
(--out, --name), with the
command line, the load average sampled at every measurement
(os.getloadavg) and the wall time.  Disk: the largest axis (sizes) holds
the sum of its sizes plus one chunk, 5.4 GiB with the defaults; every file
is removed at the end.
"""

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, 'python'))
import charts   # noqa: E402
import hvqmp    # noqa: E402
from pooled_stats import mean_ci, rotated   # noqa: E402

BUILD = os.environ.get('HYBRIDVM_BUILD', os.path.join(REPO, 'build'))
QSD = os.path.join(BUILD, 'bin', 'qemu-storage-daemon')
MiB = 1 << 20
BS = 64 * 1024                  # the cache's block size (the default)
MODES = ['clean', 'crash', 'cold', 'empty']

# the clone-cache file's geometry (block/clone-cache-file.c, cc_geometry)
SB_SIZE, MAX_BASES, BASE_REC, REC = 4096, 256, 512, 32


def cache_size_for(nblocks, bs=BS):
    """The object's `size` whose geometry holds exactly @nblocks slots:
    the tables (a slot record, two entry records and a 4-byte CRC per 4 KiB
    piece, per slot) before the block-aligned data."""
    slot_off = SB_SIZE + MAX_BASES * BASE_REC
    sum_off = slot_off + 3 * nblocks * REC
    data_off = -(-(sum_off + nblocks * (bs // 4096) * 4) // bs) * bs
    return data_off + nblocks * bs


# -- files ---------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library('c'), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch(path, off, length):
    """Free [off, off + length) of @path, its size kept (reads give zeros)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if _libc.fallocate(fd, 3, off, length) != 0:   # PUNCH_HOLE | KEEP_SIZE
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
    finally:
        os.close(fd)


def drop_page_cache(path):
    """Drop @path's pages from the page cache (the file is clean: the
    daemon flushed it when it quit)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path):
    """fincore's count of @path's bytes in the page cache (None without
    fincore)."""
    try:
        out = subprocess.run(['fincore', '-b', '-n', '-o', 'RES', path], capture_output=True,
                             text=True, timeout=30).stdout.split()
        return int(out[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def disk_used(paths):
    """Bytes the files take on disk (holes not counted)."""
    n = 0
    for p in paths:
        try:
            n += os.stat(p).st_blocks * 512
        except FileNotFoundError:
            pass
    return n


def pattern(tag, block):
    """Block @block's content in the base tagged @tag: distinct for every
    (tag, block), so that no two blocks share a slot by content."""
    return struct.pack('<QQ', tag, block) * (BS // 16)


def write_blocks(path, tag, first, n):
    """Blocks first..first+n-1 of @path, each its pattern."""
    fd = os.open(path, os.O_WRONLY)
    try:
        step = 64
        for b in range(first, first + n, step):
            k = min(step, first + n - b)
            os.pwrite(fd, b''.join(pattern(tag, x) for x in range(b, b + k)), b * BS)
    finally:
        os.close(fd)


# -- NBD -----------------------------------------------------------------

class Nbd:
    """The least of an NBD client: fixed newstyle, NBD_OPT_EXPORT_NAME,
    simple replies, one request at a time."""

    def __init__(self, sock, name):
        self.s = sock
        magic, opt, flags = struct.unpack('>8sQH', self._recv(18))
        if magic != b'NBDMAGIC' or opt != 0x49484156454F5054:
            raise RuntimeError(f'not an NBD server: {magic!r} {opt:#x}')
        no_zeroes = bool(flags & 2)
        self.s.sendall(struct.pack('>I', 1 | (2 if no_zeroes else 0)))
        name = name.encode()
        self.s.sendall(struct.pack('>QII', 0x49484156454F5054, 1, len(name)) + name)
        self.size, _ = struct.unpack('>QH', self._recv(10 if no_zeroes else 134)[:10])
        self.handle = 0

    @classmethod
    def connect(cls, path, name, timeout=60):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(path)
        return cls(s, name)

    def _recv(self, n):
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.s.recv_into(view[got:])
            if not k:
                raise EOFError('NBD server closed the connection')
            got += k
        return buf

    def read(self, off, length):
        self.handle += 1
        self.s.sendall(struct.pack('>IHHQQI', 0x25609513, 0, 0, self.handle, off, length))
        magic, err, handle = struct.unpack('>IIQ', self._recv(16))
        if magic != 0x67446698 or handle != self.handle:
            raise RuntimeError(f'NBD: bad reply {magic:#x} {handle}')
        if err:
            raise OSError(err, f'NBD read of {length} at {off} failed')
        return self._recv(length)

    def close(self):
        self.s.close()


# -- the daemon ----------------------------------------------------------

class Daemon:
    """qemu-storage-daemon with one clone-cache object over @cache (object
    size @size) and, per base (name, path), a file node, a clone-cache node
    (explicit base-id and generation) and an NBD export on one unix
    socket; one QMP monitor, last on the command line."""

    def __init__(self, work, cache, size, bases):
        self.cache, self.size, self.bases = cache, size, bases
        self.sock = os.path.join(work, 'nbd.sock')
        self.qmp_path = os.path.join(work, 'qmp.sock')
        self.log_path = os.path.join(work, 'qsd.log')
        self.proc = self.qmp = None

    def argv(self):
        a = [QSD, '--object', json.dumps({
            'qom-type': 'clone-cache', 'id': 'cc0', 'filename': self.cache, 'size': self.size})]
        for name, path in self.bases:
            a += ['--blockdev', json.dumps({'driver': 'file', 'node-name': f'{name}-file',
                                            'filename': path, 'read-only': True}),
                  '--blockdev', json.dumps({'driver': 'clone-cache', 'node-name': name,
                                            'store': 'cc0', 'file': f'{name}-file',
                                            'read-only': True, 'base-id': name,
                                            'generation': 1})]
        a += ['--nbd-server', json.dumps({'addr': {'type': 'unix', 'path': self.sock}})]
        for name, _ in self.bases:
            a += ['--export', json.dumps({'type': 'nbd', 'id': name, 'node-name': name,
                                          'name': name, 'writable': False})]
        a += ['--chardev', f'socket,id=qmp0,path={self.qmp_path},server=on,wait=off',
              '--monitor', 'chardev=qmp0']
        return a

    def start(self, probe=None, timeout=120):
        """Start the daemon.  With @probe (export name, offset, expected
        bytes or None): return the seconds from exec until the socket took a
        connection and until the read of one block at offset through the
        export completed (checked against expected bytes)."""
        for p in (self.sock, self.qmp_path):
            if os.path.exists(p):
                os.unlink(p)
        argv = self.argv()
        log = open(self.log_path, 'a')
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.sock)
                break
            except OSError:
                s.close()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError('qemu-storage-daemon did not start: ' + self.tail_log())
            time.sleep(0.0005)
        t_listen = time.perf_counter() - t0
        t_read = None
        if probe:
            name, off, want = probe
            s.settimeout(timeout)
            nbd = Nbd(s, name)
            data = nbd.read(off, BS)
            t_read = time.perf_counter() - t0
            nbd.close()
            if want is not None and data != want:
                raise RuntimeError(f'{name}: block at {off} is not what was cached')
        else:
            s.close()
        self.qmp = hvqmp.QMP(self.qmp_path, timeout=60)
        while True:
            try:
                self.qmp.connect()
                break
            except hvqmp.QMPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError('no QMP: ' + self.tail_log()) from None
                time.sleep(0.005)
        return t_listen, t_read

    def tail_log(self):
        try:
            with open(self.log_path) as f:
                return f.read()[-2000:]
        except OSError:
            return ''

    def memory(self):
        """VmRSS and VmHWM of the daemon, bytes."""
        out = {}
        with open(f'/proc/{self.proc.pid}/status') as f:
            for line in f:
                k, _, v = line.partition(':')
                if k in ('VmRSS', 'VmHWM'):
                    out[k] = int(v.split()[0]) * 1024
        return out

    def info(self):
        [c] = self.qmp.cmd('query-clone-cache')
        return c

    def base_info(self, c, name):
        return next(b for b in c['bases'] if b['base-id'] == name)

    def drain(self, timeout=120):
        deadline = time.monotonic() + timeout
        while True:
            c = self.info()
            if not c['fill-pending']:
                return c
            if time.monotonic() > deadline:
                raise TimeoutError(f'fill-pending {c["fill-pending"]} after {timeout} s')
            time.sleep(0.002)

    def nbd(self, name):
        return Nbd.connect(self.sock, name)

    def quit(self):
        """QMP quit (what SIGTERM does); the cache is flushed and closed."""
        if self.proc and self.proc.poll() is None:
            try:
                self.qmp.cmd('quit')
            except hvqmp.QMPError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError('qemu-storage-daemon did not quit in 60 s')
        self._done()

    def kill(self):
        """SIGKILL: no close, no flush."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._done()

    def _done(self):
        if self.qmp:
            self.qmp.close()
        self.qmp = None
        self.proc = None


# -- the bench -----------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.work = tempfile.mkdtemp(prefix='cc-scale-', dir=args.work_dir)
        self.daemons = []
        self.sizes, self.bases, self.hits = [], [], []
        self.fills = []
        self.loads = []
        self.peak_disk = 0
        self.rnd_tag = random.Random(40)

    def load_sample(self):
        self.loads.append(os.getloadavg()[0])

    def daemon(self, cache, size, bases):
        d = Daemon(self.work, cache, size, bases)
        self.daemons.append(d)
        return d

    def note_disk(self):
        files = [os.path.join(self.work, f) for f in os.listdir(self.work)]
        self.peak_disk = max(self.peak_disk, disk_used(files))

    def cleanup(self):
        for d in self.daemons:
            try:
                d.kill()
            except Exception:   # noqa: BLE001 - cleanup goes on
                pass
        shutil.rmtree(self.work, ignore_errors=True)

    # - filling -

    def make_cache(self, label, nblocks, nbases):
        """A cache of exactly @nblocks slots, filled full by @nbases bases
        (nblocks // nbases blocks each); returns its description."""
        cache = os.path.join(self.work, f'{label}.cache')
        size = cache_size_for(nblocks)
        per = nblocks // nbases
        bases = []
        for i in range(nbases):
            path = os.path.join(self.work, f'{label}-base{i}.raw')
            with open(path, 'wb') as f:
                f.truncate(per * BS)
            bases.append((f'b{i}', path))
        tags = [self.rnd_tag.getrandbits(63) | 1 for _ in bases]
        d = self.daemon(cache, size, bases)
        d.start()
        c = d.info()
        if c['slots'] != nblocks:
            raise RuntimeError(f'{label}: {c["slots"]} slots, not {nblocks} (size {size})')
        chunk = self.args.chunk_mib * MiB // BS
        pace = self.args.pace_blocks
        t0 = time.perf_counter()
        for (name, path), tag in zip(bases, tags):
            nbd = d.nbd(name)
            for first in range(0, per, chunk):
                n = min(chunk, per - first)
                write_blocks(path, tag, first, n)
                for b in range(first, first + n, 64):
                    k = min(64, first + n - b)
                    data = nbd.read(b * BS, k * BS)
                    if data[:16] != pattern(tag, b)[:16]:
                        raise RuntimeError(f'{label}: base {name} block {b}: wrong data')
                    if (b - first + k) % pace == 0:
                        d.drain()
                d.drain()
                self.note_disk()
                punch(path, first * BS, n * BS)
            nbd.close()
        c = d.drain()
        secs = time.perf_counter() - t0
        mem = d.memory()
        entries = {b['base-id']: b['entries'] for b in c['bases']}
        dropped = sum(b['fills-dropped'] for b in c['bases'])
        if c['used'] != nblocks or sum(entries.values()) != per * nbases or dropped \
                or c['evictions'] or c['dedup-shared']:
            raise RuntimeError(f'{label}: not filled as meant: used {c["used"]} of '
                               f'{nblocks}, entries {entries}, fills dropped {dropped}, '
                               f'evictions {c["evictions"]}, shared {c["dedup-shared"]}')
        d.quit()
        f = dict(label=label, blocks=nblocks, bases=nbases, object_size=size,
                 file_bytes=os.path.getsize(cache), disk_bytes=disk_used([cache]),
                 fill_s=secs, fill_mb_s=nblocks * BS / MiB / secs,
                 filler_rss=mem['VmRSS'], filler_hwm=mem['VmHWM'])
        self.fills.append(f)
        self.load_sample()
        print(f'filled {label}: {nblocks} blocks over {nbases} base(s) in {secs:.1f} s '
              f'({f["fill_mb_s"]:.0f} MiB/s), filler RSS {mem["VmRSS"] / MiB:.1f} MiB',
              file=sys.stderr)
        return dict(label=label, cache=cache, size=size, bases=bases, tags=tags,
                    nblocks=nblocks, per=per)

    # - restarts -

    def restart(self, cc, mode):
        """One measurement of @cc's restart in @mode (see the docstring)."""
        name, path = cc['bases'][-1]
        tag = cc['tags'][-1]
        if mode == 'empty':
            cache = cc['cache'] + '.empty'
            d = self.daemon(cache, cc['size'], cc['bases'])
            resident = None
            probe = (name, 0, None)
        else:
            cache = cc['cache']
            prev = self.daemon(cache, cc['size'], cc['bases'])
            prev.start(probe=(name, 0, pattern(tag, 0)))
            if mode == 'crash':
                prev.kill()
            else:
                prev.quit()
            if mode == 'cold':
                drop_page_cache(cache)
            resident = resident_bytes(cache)
            d = self.daemon(cache, cc['size'], cc['bases'])
            probe = (name, 0, pattern(tag, 0))
        self.load_sample()
        t_listen, t_read = d.start(probe=probe)
        mem = d.memory()
        c = d.info()
        b = d.base_info(c, name)
        entries = sum(x['entries'] for x in c['bases'])
        d.quit()
        if mode == 'empty':
            os.unlink(cache)
            if b['misses'] != 1:
                raise RuntimeError(f'{cc["label"]} empty: first read not a miss: {b}')
        elif b['hits'] != 1 or b['misses'] or entries != cc['per'] * len(cc['bases']):
            raise RuntimeError(f'{cc["label"]} {mode}: first read not a hit, or entries '
                               f'lost ({entries} of {cc["per"] * len(cc["bases"])}): {b}')
        return dict(mode=mode, listen_ms=t_listen * 1e3, first_read_ms=t_read * 1e3,
                    rss=mem['VmRSS'], hwm=mem['VmHWM'], entries=entries,
                    cache_resident=resident, hit=mode != 'empty')

    def scale_axis(self, key, points, make):
        """Fill a cache per point (make(point)), then --rounds rounds of
        every (point, mode), rotated; the caches are removed after."""
        caches = {p: make(p) for p in points}
        pairs = [(p, m) for p in points for m in MODES]
        out = []
        for r in range(self.args.rounds):
            for p, m in rotated(pairs, r * max(1, len(pairs) // max(self.args.rounds, 1))):
                for _ in range(self.args.restarts):
                    row = self.restart(caches[p], m)
                    row.update({key: p, 'round': r, 'load1': os.getloadavg()[0]})
                    out.append(row)
                    print(f'{key}={p} {m:>5} round {r}: first read {row["first_read_ms"]:7.1f} '
                          f'ms, RSS {row["rss"] / MiB:6.1f} MiB', file=sys.stderr)
        for cc in caches.values():
            os.unlink(cc['cache'])
            for _, path in cc['bases']:
                os.unlink(path)
        return out

    def run_sizes(self):
        self.sizes = self.scale_axis(
            'size_mib', self.args.sizes,
            lambda mib: self.make_cache(f'size{mib}', mib * MiB // BS, 1))

    def run_bases(self):
        nblocks = self.args.bases_cache_mib * MiB // BS
        self.bases = self.scale_axis(
            'bases', self.args.bases,
            lambda n: self.make_cache(f'bases{n}', nblocks, n))

    # - hit rate -

    def run_hits(self):
        a = self.args
        cap = a.hit_cache_mib * MiB // BS
        nbase = 2 * cap
        base = os.path.join(self.work, 'hit-base.raw')
        tag = self.rnd_tag.getrandbits(63) | 1
        with open(base, 'wb') as f:
            f.truncate(nbase * BS)
        write_blocks(base, tag, 0, nbase)
        sets = {}
        for share in a.shares:
            k = round(share / 100 * cap)
            sets[share] = random.Random(1000 + share).sample(range(nbase), k)
        cache = os.path.join(self.work, 'hit.cache')
        size = cache_size_for(cap)
        for r in range(a.rounds):
            for share in rotated(a.shares, r):
                if os.path.exists(cache):
                    os.unlink(cache)
                d = self.daemon(cache, size, [('b0', base)])
                d.start()
                nbd = d.nbd('b0')
                self.load_sample()
                passes = []
                for p in range(2):
                    c0 = d.drain()
                    t0 = time.perf_counter()
                    for i, blk in enumerate(sets[share]):
                        data = nbd.read(blk * BS, BS)
                        if data[:16] != pattern(tag, blk)[:16]:
                            raise RuntimeError(f'hit base block {blk}: wrong data')
                        if (i + 1) % a.pace_blocks == 0:
                            d.drain()
                    secs = time.perf_counter() - t0
                    c1 = d.drain()
                    b0, b1 = d.base_info(c0, 'b0'), d.base_info(c1, 'b0')
                    delta = {k: b1[k] - b0[k] for k in
                             ('hits', 'misses', 'merged-misses', 'base-read-bytes',
                              'fills-dropped')}
                    delta['evictions'] = c1['evictions'] - c0['evictions']
                    delta['secs'] = secs
                    passes.append(delta)
                nbd.close()
                self.note_disk()
                d.quit()
                p2 = passes[1]
                reqs = p2['hits'] + p2['misses'] + p2['merged-misses']
                row = dict(share=share, round=r, blocks=len(sets[share]), capacity=cap,
                           hit_rate=p2['hits'] / reqs, base_read_mib=p2['base-read-bytes'] / MiB,
                           pass2_ms_per_block=p2['secs'] * 1e3 / len(sets[share]),
                           pass1=passes[0], pass2=p2, load1=os.getloadavg()[0])
                self.hits.append(row)
                print(f'share {share:3d} % round {r}: pass-2 hit rate {row["hit_rate"]:.3f}, '
                      f'base read {row["base_read_mib"]:.1f} MiB, evictions '
                      f'{p2["evictions"]}, dropped {passes[0]["fills-dropped"]}+'
                      f'{p2["fills-dropped"]}', file=sys.stderr)
        os.unlink(cache)
        os.unlink(base)

    def run(self):
        t0 = time.time()
        self.started = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))
        self.load_start = os.getloadavg()
        if 'sizes' in self.args.axes:
            self.run_sizes()
        if 'bases' in self.args.axes:
            self.run_bases()
        if 'hits' in self.args.axes:
            self.run_hits()
        self.load_end = os.getloadavg()
        self.wall = time.time() - t0

    # - report -

    def write(self):
        a = self.args
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, a.name)
        summary = self.summary()
        with open(stem + '.json', 'w') as f:
            json.dump(dict(args={k: v for k, v in vars(a).items()}, command=self.command(),
                           started=self.started, wall_s=self.wall, load_start=self.load_start,
                           load_end=self.load_end, load1_samples=self.loads,
                           peak_disk_bytes=self.peak_disk, fills=self.fills,
                           sizes=self.sizes, bases=self.bases, hits=self.hits,
                           summary=summary), f, indent=1)
        text = self.markdown(summary)
        with open(stem + '.md', 'w') as f:
            f.write(text)
        self.chart(stem + '.png', summary)
        print(text)

    def command(self):
        return (getattr(self, 'measured_by', None) or '').strip() or \
            ' '.join(['bench/clone-cache-scale.py'] + sys.argv[1:])

    @classmethod
    def from_json(cls, path, out, name):
        """A Bench holding the results of an earlier run, to report again."""
        with open(path) as f:
            j = json.load(f)
        b = cls.__new__(cls)
        b.args = argparse.Namespace(**dict(j['args'], out=out, name=name, from_json=None))
        b.measured_by = j['command']
        for k in ('started', 'load_start', 'load_end', 'fills', 'sizes', 'bases', 'hits'):
            setattr(b, k, j[k])
        b.wall, b.loads, b.peak_disk = j['wall_s'], j['load1_samples'], j['peak_disk_bytes']
        return b

    def summary(self):
        """Per axis and point: mean and 95 % half-width of each measure."""
        def agg(rows, key, points):
            out = {}
            for p in points:
                out[p] = {}
                for m in MODES:
                    rs = [r for r in rows if r[key] == p and r['mode'] == m]
                    if not rs:
                        continue
                    out[p][m] = {k: mean_ci([r[k] for r in rs]) for k in
                                 ('first_read_ms', 'listen_ms', 'rss', 'hwm')}
                    out[p][m]['n'] = len(rs)
            return out
        s = {'sizes': agg(self.sizes, 'size_mib', self.args.sizes),
             'bases': agg(self.bases, 'bases', self.args.bases), 'hits': {}}
        for share in self.args.shares:
            rs = [r for r in self.hits if r['share'] == share]
            if rs:
                s['hits'][share] = {k: mean_ci([r[k] for r in rs]) for k in
                                    ('hit_rate', 'base_read_mib', 'pass2_ms_per_block')}
                s['hits'][share]['n'] = len(rs)
                s['hits'][share]['evictions'] = mean_ci([r['pass2']['evictions'] for r in rs])
                s['hits'][share]['dropped'] = sum(r['pass1']['fills-dropped'] +
                                                  r['pass2']['fills-dropped'] for r in rs)
        return {k: {str(p): v for p, v in d.items()} for k, d in s.items()}

    @staticmethod
    def fmt(mh, scale=1.0, digits=1):
        m, h = mh
        if math.isnan(h):
            return f'{m * scale:.{digits}f}'
        return f'{m * scale:.{digits}f} ± {h * scale:.{digits}f}'

    def scale_table(self, s, key_label, points, fill_label):
        fmt = self.fmt
        lines = [f'| {key_label} | RSS after restart (MiB) | RSS, empty cache (MiB) | '
                 'RSS of the filling daemon (MiB) | start to first hit, clean (ms) | crash (ms) | '
                 'cold page cache (ms) | start to first read, empty cache (ms) | '
                 'fill (MiB/s) |', '|---' * 9 + '|']
        for p in points:
            row = s.get(str(p), {})
            f = next((x for x in self.fills if x['label'] == fill_label(p)), None)
            if not row:
                continue

            def g(m, k, sc=1.0, dg=1):
                return fmt(row[m][k], sc, dg) if m in row else '-'
            lines.append(f'| {p} | {g("clean", "rss", 1 / MiB)} | {g("empty", "rss", 1 / MiB)} | '
                         f'{f["filler_rss"] / MiB:.1f} | '
                         f'{g("clean", "first_read_ms")} | {g("crash", "first_read_ms")} | '
                         f'{g("cold", "first_read_ms")} | {g("empty", "first_read_ms")} | '
                         f'{f["fill_mb_s"]:.0f} |' if f else '| - |')
        return lines

    def markdown(self, s):
        a = self.args
        loads = self.loads or [0.0]
        L = ['# Clone cache: how cost grows (issue 40)', '',
             f'Measured {self.started} by `{self.command()}` (wall time {self.wall:.0f} s, '
             f'{a.rounds} round(s), points rotated between rounds, {a.restarts} restart(s) per '
             'point, mode and round; ± is the half-width of the '
             'Student t 95 % interval of the mean where there are repetitions).  One run on a '
             f'shared {os.cpu_count()}-core host; 1-minute load average '
             f'{self.load_start[0]:.2f} at the start, {self.load_end[0]:.2f} at the end, '
             f'{min(loads):.2f}-{max(loads):.2f} (mean {sum(loads) / len(loads):.2f}) over '
             f'{len(loads)} samples at the measurements.  Local files only: raw bases under '
             f'{a.work_dir}, one `qemu-storage-daemon`, 64 KiB cache blocks, reads through the '
             'node\'s NBD export (unix socket) by the script\'s own NBD client.  Largest disk '
             f'use seen: {self.peak_disk / 2**30:.2f} GiB.  See the script\'s docstring for '
             'the method.', '']
        if self.sizes:
            L += ['## Index memory and restart time against cache size', '',
                  'One base, the cache filled full (every slot used; the first-hit block is '
                  'served from the cache: the base is all holes by then).  "Start to first '
                  'hit" runs from the exec of `qemu-storage-daemon` to the completion of a '
                  '64 KiB read of a cached block through NBD; clean: after a QMP quit; crash: '
                  'after SIGKILL; cold: after a quit and the cache file dropped from the page '
                  'cache.  The empty column is a new cache file of the same size (format '
                  'instead of load; the read is a miss).', '']
            L += self.scale_table(s['sizes'], 'cached MiB', a.sizes, lambda p: f'size{p}')
            L += ['', self.fill_note('size'), self.resident_note(self.sizes), '']
        if self.bases:
            L += [f'## The same against the number of bases ({a.bases_cache_mib} MiB cache, '
                  'filled full, the blocks split evenly)', '',
                  'The first hit is read from the last base\'s export (the last opened).', '']
            L += self.scale_table(s['bases'], 'bases', a.bases, lambda p: f'bases{p}')
            L += ['', self.fill_note('bases'), self.resident_note(self.bases), '']
        if self.hits:
            cap = self.hits[0]['capacity']
            L += [f'## Hit rate against the boot set\'s share of the cache '
                  f'({a.hit_cache_mib} MiB, {cap} blocks)', '',
                  'A fixed random set of 64 KiB blocks of a base of twice the capacity, read '
                  'twice in the same random order from an empty cache; the second pass from '
                  'the cache\'s own counters (query-clone-cache: hits / (hits + misses + '
                  'merged-misses), per block).', '',
                  '| boot set (% of the cache) | blocks | pass-2 hit rate | pass-2 MiB read '
                  'from the base | pass-2 evictions | pass-2 ms per 64 KiB read | fills dropped '
                  '(both passes, all rounds) |', '|---' * 7 + '|']
            for share in a.shares:
                h = s['hits'].get(str(share))
                if not h:
                    continue
                blocks = round(share / 100 * cap)
                L.append(f'| {share} | {blocks} | {self.fmt(h["hit_rate"], 1, 3)} | '
                         f'{self.fmt(h["base_read_mib"])} | {self.fmt(h["evictions"], 1, 0)} | '
                         f'{self.fmt(h["pass2_ms_per_block"], 1, 3)} | {h["dropped"]} |')
            L.append('')
        L += self.marginal(s)
        L.append('')
        return '\n'.join(x for x in L if x is not None)

    @staticmethod
    def resident_note(rows):
        def most(mode):
            xs = [r['cache_resident'] for r in rows if r['mode'] == mode
                  and r['cache_resident'] is not None]
            return f'{min(xs) / MiB:.1f}-{max(xs) / MiB:.1f} MiB' if xs else \
                'not counted (no fincore)'
        return (f'The cache file in the page cache just before the timed start (fincore, '
                f'fewest-most of the runs, all sizes): clean '
                f'{most("clean")}, crash {most("crash")}, cold {most("cold")}.')

    def marginal(self, s):
        """What each step along an axis adds: per added cached block on the
        sizes axis, per added base on the bases axis (differences of the
        means)."""
        a = self.args
        L = []
        pts = [p for p in a.sizes if str(p) in s['sizes']]
        if len(pts) >= 2:
            d = s['sizes']
            L += ['## What each step adds (differences of the means)', '',
                  '| sizes step (MiB) | added blocks | RSS after restart, per added block '
                  '(bytes) | RSS of an empty cache, per added slot (bytes) | start to first '
                  'hit per added block, clean / crash / cold (µs) | start to first read, empty '
                  '(ms added) |', '|---' * 6 + '|']
            for p0, p1 in zip(pts, pts[1:]):
                nb = (p1 - p0) * MiB // BS

                def dif(m, k, p0=p0, p1=p1):
                    return d[str(p1)][m][k][0] - d[str(p0)][m][k][0]
                L.append(f'| {p0} → {p1} | {nb} | {dif("clean", "rss") / nb:.0f} | '
                         f'{dif("empty", "rss") / nb:.0f} | '
                         + ' / '.join(f'{dif(m, "first_read_ms") * 1e3 / nb:.2f}'
                                      for m in ('clean', 'crash', 'cold'))
                         + f' | {dif("empty", "first_read_ms"):+.1f} |')
            p0, p1 = pts[0], pts[-1]
            nb = (p1 - p0) * MiB // BS
            c = {m: (d[str(p1)][m]['first_read_ms'][0] - d[str(p0)][m]['first_read_ms'][0])
                 * 1e3 / nb for m in ('clean', 'crash', 'cold')}
            L += ['', f'From {p0} to {p1} MiB: RSS after a restart '
                  f'{(d[str(p1)]["clean"]["rss"][0] - d[str(p0)]["clean"]["rss"][0]) / nb:.0f} '
                  f'bytes per added cached block; start to first hit {c["clean"]:.2f} µs '
                  f'(clean), {c["crash"]:.2f} µs (crash), {c["cold"]:.2f} µs (cold) per added '
                  f'block; at {p1} MiB the full cache\'s daemon takes '
                  f'{(d[str(p1)]["clean"]["rss"][0] - d[str(p1)]["empty"]["rss"][0]) / MiB:.1f} '
                  f'MiB and its start to first hit '
                  f'{d[str(p1)]["clean"]["first_read_ms"][0] - d[str(p1)]["empty"]["first_read_ms"][0]:.1f}'
                  ' ms more than an empty cache of the same size.', '']
        pts = [p for p in a.bases if str(p) in s['bases']]
        if len(pts) >= 2:
            d = s['bases']
            L += ['| bases step | RSS after restart, per added base (KiB) | start to first '
                  'hit per added base, clean / crash / cold (ms) | start to first read per '
                  'added base, empty (ms) |', '|---' * 4 + '|']
            for p0, p1 in zip(pts, pts[1:]):
                nb = p1 - p0

                def dif(m, k, p0=p0, p1=p1):
                    return d[str(p1)][m][k][0] - d[str(p0)][m][k][0]
                L.append(f'| {p0} → {p1} | {dif("clean", "rss") / 1024 / nb:.0f} | '
                         + ' / '.join(f'{dif(m, "first_read_ms") / nb:.2f}'
                                      for m in ('clean', 'crash', 'cold'))
                         + f' | {dif("empty", "first_read_ms") / nb:.2f} |')
            L.append('')
        return L

    def fill_note(self, label):
        fs = [f for f in self.fills if f['label'].startswith(label)]
        return ('Cache files (object size, bytes on disk): ' + '; '.join(
            f'{f["label"]}: {f["object_size"] / MiB:.1f} MiB, {f["disk_bytes"] / MiB:.1f} MiB'
            for f in fs) + '.')

    def chart(self, path, s):
        plt = charts.pyplot()
        if not plt:
            return
        a = self.args
        panels = [x for x in ('sizes', 'bases', 'hits') if getattr(self, x)]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 5.2),
                                 squeeze=False)
        for ax, panel in zip(axes[0], panels):
            if panel == 'hits':
                pts = [p for p in a.shares if str(p) in s['hits']]
                m = [s['hits'][str(p)]['hit_rate'] for p in pts]
                ax.errorbar(pts, [x[0] * 100 for x in m],
                            yerr=[0 if math.isnan(x[1]) else x[1] * 100 for x in m],
                            marker='o', capsize=3)
                ax.set_xlabel('boot set, % of the cache\'s capacity')
                ax.set_ylabel('pass-2 hit rate (%)')
                ax.set_ylim(0, 105)
                ax.set_title(f'hit rate, {a.hit_cache_mib} MiB cache')
                ax.grid(alpha=0.3)
                continue
            pts = a.sizes if panel == 'sizes' else a.bases
            d = s[panel]
            for m, style in (('clean', 'o-'), ('crash', 's--'), ('cold', '^-'), ('empty', 'x:')):
                ys = [d[str(p)][m]['first_read_ms'] for p in pts if m in d[str(p)]]
                ax.errorbar(pts[:len(ys)], [y[0] for y in ys],
                            yerr=[0 if math.isnan(y[1]) else y[1] for y in ys],
                            fmt=style, capsize=3, label=f'start→first read, {m}')
            ax.set_ylabel('ms')
            ax.set_xscale('log', base=2)
            ax.set_xticks(pts)
            ax.set_xticklabels([str(p) for p in pts])
            ax.set_ylim(bottom=0)
            ax2 = ax.twinx()
            for m, col in (('clean', 'black'), ('empty', 'tab:gray')):
                ys = [d[str(p)][m]['rss'][0] / MiB for p in pts]
                ax2.plot(pts, ys, color=col, marker='D', lw=1, label=f'RSS, {m}')
            ax2.set_ylabel('RSS (MiB)')
            ax2.set_ylim(bottom=0)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=7, loc='upper center', ncol=2,
                      bbox_to_anchor=(0.5, -0.16))
            if panel == 'sizes':
                ax.set_xlabel('cached MiB (one base, cache full)')
                ax.set_title('against cache size')
            else:
                ax.set_xlabel(f'bases sharing a {a.bases_cache_mib} MiB cache (full)')
                ax.set_title('against number of bases')
            ax.grid(alpha=0.3)
        charts.save(fig, path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true',
                    help='the smallest points, one round (a check of the script)')
    ap.add_argument('--sizes', type=int, nargs='+', default=[64, 256, 1024, 4096],
                    help='MiB of cached blocks, one cache each (default 64 256 1024 4096)')
    ap.add_argument('--bases', type=int, nargs='+', default=[1, 4, 16])
    ap.add_argument('--bases-cache-mib', type=int, default=1024)
    ap.add_argument('--shares', type=int, nargs='+', default=[10, 50, 100, 110, 125, 150],
                    help="boot sets, % of the cache's capacity")
    ap.add_argument('--hit-cache-mib', type=int, default=256)
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--restarts', type=int, default=2,
                    help='restarts per point, mode and round (default 2)')
    ap.add_argument('--axes', default='sizes,bases,hits')
    ap.add_argument('--chunk-mib', type=int, default=128,
                    help='base data written (and punched out again) at a time')
    ap.add_argument('--pace-blocks', type=int, default=256,
                    help='reads between waits for fill-pending to drain')
    ap.add_argument('--work-dir', default='/var/tmp')
    ap.add_argument('--out', default=os.path.join(REPO, 'docs', 'bench'))
    ap.add_argument('--name', default='clone-cache-scale')
    ap.add_argument('--from-json', metavar='JSON',
                    help='no measurement: write the report (md, png, json) again from the '
                         'JSON of an earlier run')
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.bases, args.rounds, args.restarts = [64], [1, 4], 1, 1
        args.bases_cache_mib = args.hit_cache_mib = 64
    args.axes = [x for x in args.axes.split(',') if x]
    if not os.access(QSD, os.X_OK):
        sys.exit(f'clone-cache-scale: {QSD} not built (set HYBRIDVM_BUILD)')
    if args.from_json:
        b = Bench.from_json(args.from_json, args.out, args.name)
        b.write()
        return
    b = Bench(args)
    try:
        b.run()
        b.write()
    finally:
        b.cleanup()


if __name__ == '__main__':
    main()
