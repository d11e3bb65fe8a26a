#!/usr/bin/env python3
"""How the cost of a hybrid node grows with its image (issue 40): the time
from blockdev-add to the first read served, and to the end of the restore,
and the RAM the node costs, against the image's virtual size (1 to 64 GiB).

The images: one hybrid image per size (`qemu-img create -f hybrid -o
ram-size=R,mode=async`, 64 KiB blocks), a sparse file on the disk under
build/ (--dir), with --data (256 MiB) written into it in 1 MiB writes
spread evenly over the whole virtual size (write i at i * size / n, pattern
byte i % 255 + 1, through qemu-io, mode=sync, restore=off): the same
amount of data at every size, the rest holes.  The RAM tier is what a user
who must bound RAM would configure: ram-size = min(size, --cap), 4 GiB by
default, so up to the cap the whole disk is in RAM and beyond it the first
--cap bytes are.  Of the data, the part below the boundary is in the RAM
tier (all of it up to the cap, cap / size of it beyond).

Configurations (each a fresh qemu-storage-daemon with an NBD server and
nothing else; the node added over QMP once the daemon is up, so the
process's start is not in the figures).  The image file is opened with
cache.direct=on (O_DIRECT, what a VM's cache=none gives) except in
buffered:

  raw        the image file under a read-only `raw` node: the floor of the
             harness (QMP, export, NBD connect, one 4 KiB read)
  restore    hybrid, ram-size as above, RAM tier anonymous memory: a plain
             open, which starts the restore in the background and returns
             (the open does not wait for it)
  norestore  hybrid as restore with restore=off: the driver's open alone,
             nothing started in the background (the node then reads every
             block from the persistent tier until it is written)
  buffered   (sizes up to the cap only) restore with cache.direct=off,
             QEMU's default: the restore's reads go through the page cache,
             which fills with the holes' zero pages (so the other sizes
             are left out: their tiers would push 20 GiB through the
             cache of a shared 24 GiB host every round)
  region     hybrid as above with ram-file= a region file on /dev/shm
             (2 MiB + ram-size, sparse), current from a clean close of the
             same node, so it is taken as it is: no restore.  Each region
             is primed once before the rounds (one open that restores into
             it, then blockdev-del).
  whole      (--whole; sizes above the cap only) hybrid with ram-size = the
             whole image, the default when none is configured: what the cap
             saves

Per point: t0, blockdev-add (the node and its file child); block-export-add
(NBD, read-only); a minimal NBD client in this file connects over the unix
socket and reads 4 KiB of the last data write below the boundary, checked
against its pattern (first read: t0 to its reply); query-hybrid is polled
every 10 ms until restore-done (restored: t0 to the first poll that saw
it; the driver's own restore-ms beside it); then VmRSS, RssAnon, RssShmem
and VmHWM of the daemon (/proc/PID/status), against their values before
the blockdev-add, and query-hybrid's metadata-bytes, metadata-per-block and
ram-used; then the export and the node are deleted (close: the
blockdev-del) and the daemon quits.  With O_DIRECT the data blocks are
read from the disk at every open, and holes cost no disk read.

Rounds (--rounds, 3) are interleaved: each runs every point once, the
sizes in an order rotated from round to round and the configurations of
a size likewise (bench/pooled_stats.py).  Means over the rounds with
Student t 95 % intervals.  The 1-minute load average is sampled at every
point.

Usage: bench/hybrid-scale.py [--quick] [--rounds 3] [--sizes 1G,2G,...]
                             [--cap 4G] [--data 256M] [--whole]
                             [--notes FILE] [--out docs/bench]
--notes: a file (the reading of the figures) put after the first paragraph.
       bench/hybrid-scale.py --report-only docs/bench/hybrid-scale.json
                             [--notes FILE] [--out DIR]
--quick: 1, 2 and 4 GiB, one round, written to /tmp/hybrid-scale-quick
unless --out says otherwise.  Binaries from $HYBRIDVM_BUILD/bin (default
<repo>/build/bin), copied at start (a rebuild during the run does not
change what is measured).  Run it with build/venv/bin/python3 (matplotlib
for the chart).  Writes hybrid-scale.md, .json and .png in --out.  About
5 minutes with --whole on 2 shared cores (the whole restores are most of
it), half a minute with --quick.
"""

import argparse
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402
import charts   # noqa: E402
from sizes import parse_size   # noqa: E402
from pooled_stats import mean, mean_ci, rotated   # noqa: E402

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3
BLOCK = 64 * KiB                # the default block size
DATA_OFFSET = 65536             # HYBRID_DATA_OFFSET: block 0 in the file
WRITE = 1 * MiB                 # one data write
READ = 4 * KiB                  # the probe read
POLL = 0.01                     # query-hybrid poll interval, s
CONFIGS = ('raw', 'norestore', 'restore', 'buffered', 'region', 'whole')
STATUS_KEYS = ('VmRSS', 'RssAnon', 'RssFile', 'RssShmem', 'VmHWM', 'VmSize')


def human(n):
    for unit, m in (('GiB', GiB), ('MiB', MiB), ('KiB', KiB)):
        if n >= m and n % m == 0:
            return f'{n // m} {unit}'
    return f'{n} B'


def proc_status(pid):
    """The memory lines of /proc/PID/status, KiB."""
    out = {}
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            k, _, v = line.partition(':')
            if k in STATUS_KEYS:
                out[k] = int(v.split()[0])
    return out


def region_bytes(ram):
    """A region's size for a RAM tier of @ram bytes: hybrid_region_data_offset()
    (header page, three bitmaps, rounded up to 2 MiB) plus the blocks."""
    blocks = ram // BLOCK
    bitmap = (blocks + 63) // 64 * 8
    data = -(-(4096 + 3 * bitmap) // (2 * MiB)) * 2 * MiB
    return data + ram


# ---- a minimal NBD client: fixed newstyle, NBD_OPT_GO, simple replies ----

NBD_OPT_GO = 7
NBD_REP_ACK = 1
NBD_REP_MAGIC = 0x3e889045565a9
NBD_REQUEST_MAGIC = 0x25609513
NBD_SIMPLE_REPLY_MAGIC = 0x67446698
NBD_CMD_READ, NBD_CMD_DISC = 0, 2


def _recv(s, n):
    buf = b''
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f'NBD server closed the connection ({len(buf)}/{n})')
        buf += chunk
    return buf


def nbd_read(path, export, offset, length, timeout=60):
    """Connect to the NBD server on unix socket @path, read @length bytes
    of @export at @offset, disconnect; the bytes."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        hello = _recv(s, 18)
        if hello[:16] != b'NBDMAGICIHAVEOPT':
            raise RuntimeError(f'not an NBD newstyle server: {hello!r}')
        s.sendall(struct.pack('>I', 1 | 2))     # FIXED_NEWSTYLE | NO_ZEROES
        name = export.encode()
        data = struct.pack('>I', len(name)) + name + struct.pack('>H', 0)
        s.sendall(b'IHAVEOPT' + struct.pack('>II', NBD_OPT_GO, len(data)) + data)
        while True:
            magic, _opt, typ, ln = struct.unpack('>QIII', _recv(s, 20))
            payload = _recv(s, ln)
            if magic != NBD_REP_MAGIC:
                raise RuntimeError(f'bad option reply magic {magic:#x}')
            if typ & (1 << 31):
                raise RuntimeError(f'NBD_OPT_GO refused ({typ:#x}): {payload!r}')
            if typ == NBD_REP_ACK:
                break
        s.sendall(struct.pack('>IHHQQI', NBD_REQUEST_MAGIC, 0, NBD_CMD_READ,
                              1, offset, length))
        magic, err, handle = struct.unpack('>IIQ', _recv(s, 16))
        if magic != NBD_SIMPLE_REPLY_MAGIC or handle != 1 or err:
            raise RuntimeError(f'read failed: magic {magic:#x} error {err}')
        out = _recv(s, length)
        s.sendall(struct.pack('>IHHQQI', NBD_REQUEST_MAGIC, 0, NBD_CMD_DISC,
                              2, 0, 0))
        return out
    finally:
        s.close()


# ---- the images ----

class Image:
    """One size: its hybrid image on the disk, its region on /dev/shm, and
    where its data is."""

    def __init__(self, args, size, disk, shm):
        self.size = size
        self.ram = min(size, args.cap_b)
        self.path = os.path.join(disk, f'{size // MiB}M.hyb')
        self.region = os.path.join(shm, f'{size // MiB}M.region')
        n = args.data_b // WRITE
        stride = size // n // BLOCK * BLOCK
        if stride < WRITE:
            raise SystemExit(f'--data {args.data} does not fit in {human(size)}')
        self.writes = [(i * stride, i % 255 + 1) for i in range(n)]
        in_ram = [w for w in self.writes if w[0] + WRITE <= self.ram]
        self.data_in_ram = len(in_ram) * WRITE
        # the probe: the last data write below the boundary (the restore,
        # front to back, reaches it last)
        self.probe_off, self.probe_pat = in_ram[-1] if in_ram else self.writes[0]

    def create(self):
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o',
                   f'ram-size={self.ram},mode=async', self.path, str(self.size))
        cmds = []
        for off, pat in self.writes:
            cmds += ['-c', f'write -q -P {pat} {off} {WRITE}']
        H.qemu_io('--image-opts',
                  f'driver=hybrid,mode=sync,restore=off,file.driver=file,'
                  f'file.filename={self.path}', *cmds, timeout=600)
        with open(self.region, 'wb') as f:
            f.truncate(region_bytes(self.ram))

    def meta(self):
        st = os.stat(self.path)
        r = os.stat(self.region)
        return {'size': self.size, 'ram_size': self.ram, 'path': self.path,
                'file_bytes': st.st_size, 'file_allocated': st.st_blocks * 512,
                'data_written': len(self.writes) * WRITE,
                'data_in_ram_tier': self.data_in_ram,
                'region_bytes': r.st_size, 'region_allocated': r.st_blocks * 512,
                'probe_offset': self.probe_off}

    def node(self, cfg):
        f = {'driver': 'file', 'filename': self.path,
             'cache': {'direct': cfg != 'buffered'}}
        if cfg == 'raw':
            return {'driver': 'raw', 'node-name': 'n', 'read-only': True,
                    'file': f}
        o = {'driver': 'hybrid', 'node-name': 'n', 'file': f,
             'ram-size': self.size if cfg == 'whole' else self.ram}
        if cfg == 'region':
            o['ram-file'] = self.region
        if cfg == 'norestore':
            o['restore'] = False
        return o


class Daemon:
    """A qemu-storage-daemon with an NBD server, in a directory of its own."""

    def __init__(self):
        self.tmp = H.TempDir()
        self.sock = self.tmp('nbd.sock')
        self.qsd = H.StorageDaemon(self.tmp, '--nbd-server',
                                   f'addr.type=unix,addr.path={self.sock}')
        self.pid = self.qsd.proc.pid

    def stop(self):
        try:
            self.qsd.stop()
        finally:
            self.tmp.cleanup()


def wait_restored(qsd, timeout=900):
    deadline = time.monotonic() + timeout
    while True:
        info = qsd.cmd('query-hybrid', **{'node-name': 'n'})[0]
        if info['restore-done'] or time.monotonic() > deadline:
            return info
        time.sleep(POLL)


def prime_region(img):
    """Open the node with its region once (it is reset, bound and filled by
    a restore) and close it cleanly: from then on the region is current."""
    d = Daemon()
    try:
        d.qsd.cmd('blockdev-add', **img.node('region'))
        info = wait_restored(d.qsd)
        if not info['restore-done'] or info.get('error'):
            raise RuntimeError(f'priming {img.region}: {info}')
        d.qsd.cmd('blockdev-del', **{'node-name': 'n'})
    finally:
        d.stop()
    return {'restore_ms': info['restore-ms'],
            'reused': info['region']['reused']}


def measure(img, cfg):
    """One point: see the module's docstring."""
    d = Daemon()
    qsd, pc = d.qsd, time.perf_counter
    try:
        before = proc_status(d.pid)
        t0 = pc()
        qsd.cmd('blockdev-add', **img.node(cfg))
        t_open = pc()
        qsd.cmd('block-export-add', type='nbd', id='e', name='n',
                **{'node-name': 'n'})
        t_export = pc()
        off = img.probe_off + (DATA_OFFSET if cfg == 'raw' else 0)
        data = nbd_read(d.sock, 'n', off, READ)
        t_read = pc()
        if data != bytes([img.probe_pat]) * READ:
            raise RuntimeError(f'{cfg} {human(img.size)}: read at {off} returned '
                               f'{data[:16]!r}..., not pattern {img.probe_pat}')
        r = {'open_ms': (t_open - t0) * 1e3, 'export_ms': (t_export - t_open) * 1e3,
             'first_read_ms': (t_read - t0) * 1e3,
             'read_ms': (t_read - t_export) * 1e3}
        if cfg != 'raw':
            first = qsd.cmd('query-hybrid', **{'node-name': 'n'})[0]
            r['first_read_from'] = 'ram' if first['read-hits'] else 'persistent'
            if cfg == 'norestore':
                info = first        # restore-done stays false
            else:
                info = first if first['restore-done'] else wait_restored(qsd)
                r['restored_ms'] = (pc() - t0) * 1e3
            if (cfg != 'norestore' and not info['restore-done']) or info.get('error'):
                raise RuntimeError(f'{cfg} {human(img.size)}: restore: {info}')
            r.update({k.replace('-', '_'): info[k] for k in (
                'restore-ms', 'restore-bytes', 'restore-total', 'ram-size',
                'ram-loaded', 'ram-used', 'metadata-bytes', 'metadata-per-block')})
            if 'region' in info:
                r['region_reused'] = info['region']['reused']
                r['region_attach_us'] = info['region']['attach-us']
                r['region_dirty_found'] = info['region']['dirty-blocks-found']
        after = proc_status(d.pid)
        r['status_before_kib'], r['status_after_kib'] = before, after
        for k in ('VmRSS', 'RssAnon', 'RssShmem', 'VmHWM'):
            r[f'{k}_mib'] = after[k] / 1024
            r[f'{k}_delta_mib'] = (after[k] - before[k]) / 1024
        # anonymous memory the node took beyond the blocks it holds in
        # anonymous memory (a region's are in its tmpfs file)
        r['anon_overhead_mib'] = r['RssAnon_delta_mib'] - (
            r['ram_used'] / MiB if cfg in ('restore', 'buffered', 'whole') else 0)
        qsd.cmd('block-export-del', id='e')
        qsd.wait_event('BLOCK_EXPORT_DELETED', 60)
        t_del = pc()
        qsd.cmd('blockdev-del', **{'node-name': 'n'})
        r['close_ms'] = (pc() - t_del) * 1e3
    finally:
        d.stop()
    if cfg == 'region':
        st = os.stat(img.region)
        r['region_allocated_mib'] = st.st_blocks * 512 / MiB
    return r


def git_head():
    try:
        return subprocess.run(['git', '-C', REPO, 'rev-parse', 'HEAD'],
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return '?'


def run(args):
    t_start = time.time()
    meta = {'stamp': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
            'command': args.command, 'head': git_head(),
            'nproc': os.cpu_count(), 'load_start': os.getloadavg()}
    bindir = tempfile.mkdtemp(prefix='hybrid-scale-bin-')
    disk = tempfile.mkdtemp(prefix='hybrid-scale-', dir=args.dir)
    shm = tempfile.mkdtemp(prefix='hybrid-scale-', dir='/dev/shm')
    for b in ('qemu-img', 'qemu-io', 'qemu-storage-daemon'):
        shutil.copy2(H.binary(b), bindir)
    H.BIN = bindir
    rows = []
    try:
        images = {s: Image(args, s, disk, shm) for s in args.sizes_b}
        t = time.time()
        for img in images.values():
            img.create()
        meta['create_s'] = time.time() - t
        t = time.time()
        meta['prime'] = {str(s): prime_region(img) for s, img in images.items()}
        meta['prime_s'] = time.time() - t
        meta['images'] = {str(s): img.meta() for s, img in images.items()}
        print(json.dumps({'setup': meta}), flush=True)
        configs = ['raw', 'norestore', 'restore', 'buffered', 'region'] + \
            (['whole'] if args.whole else [])
        t = time.time()
        for rnd in range(args.rounds):
            for k, size in enumerate(rotated(args.sizes_b, rnd)):
                for cfg in rotated(configs, rnd + k):
                    if (cfg == 'whole' and size <= args.cap_b) or \
                            (cfg == 'buffered' and size > args.cap_b):
                        continue
                    r = measure(images[size], cfg)
                    r.update(round=rnd, size=size, config=cfg,
                             load1=os.getloadavg()[0])
                    rows.append(r)
                    print(json.dumps({k2: (round(v, 2) if isinstance(v, float) else v)
                                      for k2, v in r.items()
                                      if not k2.startswith('status')}), flush=True)
        meta['measure_s'] = time.time() - t
        meta['images_end'] = {str(s): img.meta() for s, img in images.items()}
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(bindir, ignore_errors=True)
    meta['load_end'] = os.getloadavg()
    meta['wall_s'] = time.time() - t_start
    return rows, meta


# ---- summary and report ----

METRICS = ('open_ms', 'first_read_ms', 'read_ms', 'restored_ms', 'restore_ms',
           'close_ms', 'VmRSS_mib', 'VmRSS_delta_mib', 'RssAnon_delta_mib',
           'RssShmem_delta_mib', 'VmHWM_mib', 'VmHWM_delta_mib', 'metadata_bytes',
           'metadata_per_block', 'ram_used', 'restore_bytes',
           'region_attach_us', 'region_allocated_mib', 'anon_overhead_mib')


def summarize(rows):
    out = {}
    for r in rows:
        out.setdefault(r['config'], {}).setdefault(r['size'], []).append(r)
    summ = {}
    for cfg, by_size in out.items():
        summ[cfg] = {}
        for size, rs in sorted(by_size.items()):
            e = {'n': len(rs)}
            for m in METRICS:
                xs = [r[m] for r in rs if r.get(m) is not None]
                if xs:
                    mu, h = mean_ci(xs)
                    e[m] = {'mean': mu, 'ci': h}
            if cfg != 'raw':
                e['first_read_from'] = sorted({r['first_read_from'] for r in rs})
            if cfg == 'region':
                e['reused'] = sum(1 for r in rs if r.get('region_reused'))
            summ[cfg][size] = e
    return summ


def fmt(e, digits=0, scale=1.0):
    if not e:
        return '-'
    m, h = e['mean'] * scale, e['ci'] * scale
    if math.isnan(h):
        return f'{m:.{digits}f}'
    return f'{m:.{digits}f} ± {h:.{digits}f}'


def per_doubling(summ, cfg, metric, lo, hi):
    """The growth factor of @metric's mean per doubling of the size, from
    size @lo to @hi: (m(hi) / m(lo)) ** (1 / log2(hi / lo)), or None."""
    s = summ.get(cfg, {})
    if lo not in s or hi not in s or metric not in s[lo] or metric not in s[hi] \
            or hi <= lo:
        return None
    a, b = s[lo][metric]['mean'], s[hi][metric]['mean']
    if a <= 0 or b <= 0:
        return None
    return (b / a) ** (1 / math.log2(hi / lo))


def growth_lines(summ, sizes, cap):
    below = [s for s in sizes if s <= cap]
    above = [s for s in sizes if s >= cap]
    lines = []
    checks = [('raw', 'first_read_ms', 'first read'),
              ('norestore', 'open_ms', 'blockdev-add'),
              ('norestore', 'first_read_ms', 'first read'),
              ('restore', 'open_ms', 'blockdev-add'),
              ('restore', 'first_read_ms', 'first read'),
              ('restore', 'restored_ms', 'restore done'),
              ('restore', 'VmRSS_delta_mib', 'ΔVmRSS'),
              ('restore', 'metadata_bytes', 'metadata-bytes'),
              ('restore', 'anon_overhead_mib', 'ΔRssAnon − tier'),
              ('buffered', 'restored_ms', 'restore done'),
              ('region', 'open_ms', 'blockdev-add'),
              ('region', 'first_read_ms', 'first read'),
              ('region', 'VmRSS_delta_mib', 'ΔVmRSS'),
              ('region', 'metadata_bytes', 'metadata-bytes'),
              ('region', 'anon_overhead_mib', 'ΔRssAnon − tier'),
              ('whole', 'restored_ms', 'restore done'),
              ('whole', 'metadata_bytes', 'metadata-bytes'),
              ('whole', 'anon_overhead_mib', 'ΔRssAnon − tier')]
    for cfg, m, label in checks:
        parts = []
        for rng, name in ((below, 'up to the cap'), (above, 'beyond the cap')):
            if cfg == 'whole' and name == 'up to the cap':
                continue
            if len(rng) >= 2:
                f = per_doubling(summ, cfg, m, rng[0], rng[-1])
                if f is not None:
                    parts.append(f'×{f:.2f} per doubling {name} '
                                 f'({human(rng[0])} → {human(rng[-1])})')
        if parts:
            lines.append(f'* {cfg}, {label}: ' + '; '.join(parts))
    return lines


def report(args, rows, meta, out_dir):
    summ = summarize(rows)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'hybrid-scale.json'), 'w') as f:
        json.dump({'args': {k: v for k, v in args.items() if k != 'notes'},
                   'meta': meta, 'rows': rows,
                   'summary': {c: {str(k): v for k, v in s.items()}
                               for c, s in summ.items()}}, f, indent=1)
    sizes = sorted({r['size'] for r in rows})
    cap = args['cap_b']
    loads = sorted(r['load1'] for r in rows)
    imgs = meta['images']
    configs = [c for c in CONFIGS if c in summ]
    lines = [
        f"# hybrid: how cost grows with the image ({meta['stamp']})", '',
        f"Measured by `{meta['command']}` in {meta['wall_s']:.0f} s of wall time "
        f"({meta['create_s']:.0f} s creating the images, {meta['prime_s']:.0f} s "
        f"priming the regions, {meta['measure_s']:.0f} s measuring), "
        f"{args['rounds']} interleaved round{'s' if args['rounds'] > 1 else ''} "
        f"(sizes in an order rotated per round), commit {meta['head'][:12]}; "
        f"{meta['nproc']} CPUs and the disk shared with other work.  1-minute load "
        f"average {meta['load_start'][0]:.2f} at the start, {loads[0]:.2f}..{loads[-1]:.2f} "
        f"over the points (median {loads[len(loads) // 2]:.2f}), "
        f"{meta['load_end'][0]:.2f} at the end: one run on a busy host.", '']
    if args.get('notes') and os.path.exists(args['notes']):
        with open(args['notes']) as f:
            lines += [f.read().rstrip(), '']
    lines += [
        '## What was measured', '',
        f"One hybrid image per size ({', '.join(human(s) for s in sizes)}), 64 KiB "
        f"blocks, a sparse file on the disk (ext4 under build/).  Into each, "
        f"{human(args['data_b'])} of data in {args['data_b'] // WRITE} writes of 1 MiB "
        f"spread evenly over the whole virtual size (write i at i × size / "
        f"{args['data_b'] // WRITE}, a pattern byte per write); the rest is holes.  "
        f"No image is filled: the machine has 2 cores, 24 GiB of RAM and a shared "
        f"disk.  ram-size = min(size, {human(cap)}): what a user bounding the RAM a "
        f"disk may take would configure; up to {human(cap)} the whole disk is in "
        f"RAM, beyond it the first {human(cap)}, which holds {human(cap)} / size "
        f"of the data.", '',
        '| size | ram-size | file allocated | data in the RAM tier | region file '
        '(allocated after the run) | region\'s first open: restore-ms |',
        '|---:|---:|---:|---:|---:|---:|']
    for s in sizes:
        i, e = imgs[str(s)], meta['images_end'][str(s)]
        lines.append(f"| {human(s)} | {human(i['ram_size'])} | "
                     f"{i['file_allocated'] / MiB:.0f} MiB | "
                     f"{i['data_in_ram_tier'] / MiB:.0f} MiB | "
                     f"{human(i['region_bytes'])} ({e['region_allocated'] / MiB:.0f} MiB) | "
                     f"{meta['prime'][str(s)]['restore_ms']} |")
    lines += [
        '', 'Configurations, each point in a fresh `qemu-storage-daemon` (an NBD '
        'server and nothing else), the node added with `blockdev-add` over QMP '
        'once the daemon is up (the process start is not in any figure):', '',
        '* **raw**: the image file under a read-only `raw` node, the floor of the '
        'harness: QMP, `block-export-add`, an NBD connection (a minimal Python '
        'client) and one 4 KiB read.',
        '* **norestore**: hybrid as restore below with `restore=off`: the '
        'driver\'s open alone, nothing started in the background.',
        '* **restore**: hybrid, RAM tier in anonymous memory: a plain open.  The '
        'image file with `cache.direct=on` (O_DIRECT, a VM\'s `cache=none`), as '
        'in every configuration but buffered.  The open starts the restore in '
        'the background (two workers, 4 MiB reads) and returns; the node serves reads at once (from the persistent tier where '
        'a block is not yet restored).',
        '* **buffered**: restore with `cache.direct=off` (QEMU\'s default), '
        'sizes up to the cap only: the restore reads through the page cache, '
        'which it fills with the zero pages of the holes (the larger sizes would '
        'push 20 GiB of them through the cache of this shared host every round).',
        '* **region**: hybrid with `ram-file=` a region file on /dev/shm '
        '(2 MiB + ram-size, sparse), current from a clean close of the same node '
        '(primed once before the rounds), so the open takes it as it is: no '
        'restore.']
    if 'whole' in summ:
        lines.append('* **whole**: hybrid with ram-size = the whole image (the '
                     'default when none is given), sizes above the cap only.')
    lines += [
        '', '*first read*: from sending `blockdev-add` to the reply of a 4 KiB NBD '
        'read of the last data write below the boundary (checked against its '
        'pattern), through `block-export-add` and the NBD handshake.  *restored*: '
        'from `blockdev-add` to the first `query-hybrid` (polled every 10 ms) '
        'that says `restore-done`; *restore-ms* is the driver\'s own.  The image '
        'data was just written (through the page cache); O_DIRECT reads bypass it.  Every '
        'value is the mean over the rounds ± the half-width of its Student t 95 % '
        'interval.', '',
        '## Open to serving', '',
        '| config | size | blockdev-add ms | first read ms | restored ms | '
        'restore-ms (driver) | restored bytes | first read served from | close ms |',
        '|---|---:|---:|---:|---:|---:|---:|---|---:|']
    for cfg in configs:
        for s in sizes:
            e = summ[cfg].get(s)
            if not e:
                continue
            rb = e.get('restore_bytes')
            rb = f"{rb['mean'] / MiB:.0f} MiB" if rb else '-'
            lines.append(
                f"| {cfg} | {human(s)} | {fmt(e.get('open_ms'), 1)} | "
                f"{fmt(e.get('first_read_ms'), 1)} | "
                f"{fmt(e.get('restored_ms'), 0)} | "
                f"{fmt(e.get('restore_ms'), 0)} | {rb} | "
                f"{', '.join(e.get('first_read_from', [])) or '-'} | "
                f"{fmt(e.get('close_ms'), 1)} |")
    lines += [
        '', '## RAM', '',
        'The daemon\'s /proc/PID/status once the node serves and its restore is '
        'done: VmRSS, and the change of VmRSS, RssAnon and RssShmem from just '
        'before the `blockdev-add` (a daemon with no node: about '
        f"{mean([r['status_before_kib']['VmRSS'] for r in rows]) / 1024:.0f} MiB); "
        'VmHWM is the daemon\'s peak.  *ram-used*: the RAM tier\'s non-zero blocks '
        '(query-hybrid); *metadata*: query-hybrid\'s metadata-bytes and '
        'metadata-per-block (the slot array, one per RAM block); *ΔRssAnon − tier*: '
        'the anonymous memory the node took beyond the RAM tier\'s blocks (for '
        'restore and whole ΔRssAnon − ram-used; for region, whose blocks are in '
        'the tmpfs file, ΔRssAnon).  For region, the '
        'tier lives in the tmpfs file, not in the process: *region allocated* is '
        'that file\'s allocated bytes after the point.', '',
        '| config | size | VmRSS MiB | ΔVmRSS MiB | ΔRssAnon MiB | ΔRssShmem MiB | '
        'VmHWM MiB | ram-used MiB | ΔRssAnon − tier MiB | metadata KiB | per block B | '
        'region allocated MiB |',
        '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for cfg in configs:
        for s in sizes:
            e = summ[cfg].get(s)
            if not e:
                continue
            lines.append(
                f"| {cfg} | {human(s)} | {fmt(e.get('VmRSS_mib'), 1)} | "
                f"{fmt(e.get('VmRSS_delta_mib'), 1)} | {fmt(e.get('RssAnon_delta_mib'), 1)} | "
                f"{fmt(e.get('RssShmem_delta_mib'), 1)} | {fmt(e.get('VmHWM_mib'), 1)} | "
                f"{fmt(e.get('ram_used'), 0, 1 / MiB)} | "
                f"{fmt(e.get('anon_overhead_mib'), 1)} | "
                f"{fmt(e.get('metadata_bytes'), 0, 1 / KiB)} | "
                f"{fmt(e.get('metadata_per_block'), 0)} | "
                f"{fmt(e.get('region_allocated_mib'), 0)} |")
    if 'region' in summ:
        n = sum(e['n'] for e in summ['region'].values())
        reused = sum(e['reused'] for e in summ['region'].values())
        att = [r['region_attach_us'] for r in rows if r['config'] == 'region']
        lines += ['', f"Region opens that took the region as it was (`region.reused`): "
                  f"{reused} of {n}; `region.attach-us` {min(att)}..{max(att)} µs."]
    lines += ['', '## Growth per doubling of the image', '',
              'From the means above: (mean at the largest / mean at the smallest) ^ '
              '(1 / doublings), over each range.  1.00 is flat, 2.00 linear in the '
              'size.', ''] + growth_lines(summ, sizes, cap)
    lines += ['', '![open to serving and RAM against image size](hybrid-scale.png)', '',
              'Bars: the 95 % intervals (on the log axes, one reaching below zero '
              'is cut at a tenth of the mean); dotted vertical line: the cap.', '']
    with open(os.path.join(out_dir, 'hybrid-scale.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(os.path.join(out_dir, 'hybrid-scale.png'), summ, sizes, cap)


def chart(path, summ, sizes, cap):
    plt = charts.pyplot()
    if not plt:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 6))
    gib = [s / GiB for s in sizes]

    def line(ax, cfg, metric, label, scale=1.0, **kw):
        s = summ.get(cfg, {})
        xs = [x for x, sz in zip(gib, sizes) if sz in s and metric in s[sz]]
        if not xs:
            return
        ys = [s[sz][metric]['mean'] * scale for sz in sizes if sz in s and metric in s[sz]]
        es = [0 if math.isnan(s[sz][metric]['ci']) else s[sz][metric]['ci'] * scale
              for sz in sizes if sz in s and metric in s[sz]]
        # on a log axis an interval reaching below zero is drawn down to
        # a tenth of the mean
        lo = [min(e, 0.9 * y) for e, y in zip(es, ys)]
        ax.errorbar(xs, ys, yerr=[lo, es], marker='o', capsize=3, label=label, **kw)

    line(ax1, 'raw', 'first_read_ms', 'raw: first read (harness floor)', color='grey')
    line(ax1, 'norestore', 'first_read_ms', 'norestore: first read', color='tab:purple')
    line(ax1, 'restore', 'first_read_ms', 'restore: first read', color='tab:blue')
    line(ax1, 'restore', 'restored_ms', 'restore: restore done', color='tab:blue', ls='--')
    line(ax1, 'buffered', 'restored_ms', 'buffered: restore done', color='tab:cyan',
         ls='--')
    line(ax1, 'region', 'first_read_ms', 'region: first read (restore done)',
         color='tab:green')
    line(ax1, 'whole', 'restored_ms', 'whole (ram-size = image): restore done',
         color='tab:red', ls='--')
    line(ax1, 'whole', 'first_read_ms', 'whole: first read', color='tab:red')
    ax1.set_xscale('log', base=2)
    ax1.set_xticks(gib, [f'{g:g}' for g in gib])
    ax1.set_yscale('log')
    ax1.set_xlabel('image size, GiB (log2)')
    ax1.set_ylabel('ms from blockdev-add (log)')
    ax1.set_title('open to serving')
    ax1.axvline(cap / GiB, color='k', lw=0.6, ls=':')
    ax1.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.14), ncol=2)

    line(ax2, 'restore', 'VmRSS_delta_mib', 'restore: ΔVmRSS', color='tab:blue')
    line(ax2, 'restore', 'ram_used', 'restore: ram-used (data in RAM)',
         scale=1 / MiB, color='tab:blue', ls=':')
    line(ax2, 'region', 'VmRSS_delta_mib', 'region: ΔVmRSS', color='tab:green')
    line(ax2, 'region', 'region_allocated_mib', 'region: tmpfs file allocated',
         color='tab:green', ls=':')
    line(ax2, 'restore', 'metadata_bytes', 'metadata-bytes (restore, region)',
         scale=1 / MiB, color='tab:orange')
    line(ax2, 'whole', 'metadata_bytes', 'whole: metadata-bytes', scale=1 / MiB,
         color='tab:red')
    line(ax2, 'whole', 'VmRSS_delta_mib', 'whole: ΔVmRSS', color='tab:red', ls='--')
    ax2.set_xscale('log', base=2)
    ax2.set_xticks(gib, [f'{g:g}' for g in gib])
    ax2.set_yscale('log')
    ax2.set_xlabel('image size, GiB (log2)')
    ax2.set_ylabel('MiB (log)')
    ax2.set_title('RAM: daemon RSS change and driver metadata')
    ax2.axvline(cap / GiB, color='k', lw=0.6, ls=':')
    ax2.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.14), ncol=2)
    charts.save(fig, path, dpi=80)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true',
                    help='1, 2, 4 GiB, one round (a smoke run)')
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--sizes', default='1G,2G,4G,8G,16G,32G,64G')
    ap.add_argument('--cap', default='4G', help='ram-size = min(size, CAP)')
    ap.add_argument('--data', default='256M', help='data written into each image')
    ap.add_argument('--whole', action='store_true',
                    help='also ram-size = the whole image, sizes above the cap')
    ap.add_argument('--dir', default=os.path.join(REPO, 'build'),
                    help='where the images go (the disk)')
    ap.add_argument('--notes', help='a file appended to the report')
    ap.add_argument('--out')
    ap.add_argument('--report-only', metavar='JSON')
    args = ap.parse_args()
    if args.report_only:
        with open(args.report_only) as f:
            saved = json.load(f)
        a = saved['args']
        a['notes'] = args.notes
        report(a, saved['rows'], saved['meta'],
               args.out or os.path.dirname(os.path.abspath(args.report_only)))
        return
    if args.quick:
        args.sizes, args.rounds = '1G,2G,4G', 1
    out = args.out or ('/tmp/hybrid-scale-quick' if args.quick
                       else os.path.join(REPO, 'docs', 'bench'))
    args.sizes_b = sorted(parse_size(s) for s in args.sizes.split(','))
    args.cap_b = parse_size(args.cap)
    args.data_b = parse_size(args.data)
    args.command = ' '.join(['bench/hybrid-scale.py'] + sys.argv[1:])
    rows, meta = run(args)
    report({k: v for k, v in vars(args).items() if k not in ('out', 'report_only')},
           rows, meta, out)
    print(f'wrote {out}/hybrid-scale.md', flush=True)


if __name__ == '__main__':
    main()
