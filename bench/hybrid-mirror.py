#!/usr/bin/env python3
"""A hybrid node's RAM tier mirrored on another host: what it costs (issue 39).

Two network-namespace hosts and a single-node Ceph cluster in its own
namespace (tests/hvlib/hosts.py), host a joined to host b and to Ceph by
links shaped to the same rate (--rate, tbf each way).  On host a, one
qemu-storage-daemon per configuration exports its node over an NBD unix
socket in the host's files directory, and fio's nbd engine (run in host a)
writes 4 KiB at random over the whole node, at QD1 and at QD32.  The
configurations, each over an RBD image of its own (--size, librbd's cache
off: cache.direct=on, so a write to RBD is a round trip to the OSD):

  local-async      hybrid mode=async, ram-size covering the image, no mirror
  mirrored-async   the same, with mirror= an NBD export over TLS (PSK) of a
                   /dev/shm file on host b (qemu-storage-daemon on b, as
                   block/tests/test_hybrid_mirror_hosts.py sets it up): an
                   async write completes once a's RAM tier and b hold it;
                   measured once its prefill is done (query-hybrid), so a
                   block's first write sends its bits with its bytes
  mirrored-whole   the same with mirror-prefill=off (its own export on b): a
                   block not written in this binding goes whole on its first
                   write, then its bits, two round trips (a block written
                   back and flushed since is matched: its bytes with its bit)
  mirrored-chacha  mirrored-async with the mirror's TLS session on ChaCha20-
                   Poly1305 (its own export on b; the client offers no AES
                   suite): what a QEMU configured with GnuTLS's plain NORMAL
                   negotiates over a PSK, the baseline of our build's
                   --tls-priority (scripts/build-qemu.sh)
  sync-rbd         hybrid mode=sync: a write completes once RBD holds it
  sync-rbd-aa      the same again, its own image and daemon: the A/A
                   control of the baseline of the IOPS target
  raw-rbd          the rbd node alone, no hybrid

Rounds are interleaved: each runs every configuration once, in an order
rotated from round to round, QD1 then QD32 (QD32 first in odd rounds).
After each run of a hybrid node the script flushes it through its export
(qemu-io's flush: a guest flush, which writes every dirty block back,
flushes RBD and takes the blocks out of the mirror) and waits until
query-hybrid says nothing is dirty and the mirror counts no block, so every
run starts from a clean node and none under the write-back of the one
before.  (Without a flush the flusher rests below half of dirty-limit.)  Each round first measures the round trip a<->b through
the shaped link: a TCP ping-pong in Python (64-byte and 4 KiB requests, a
16-byte answer, --pings exchanges each), median and p99.

Per configuration and QD: mean IOPS, p50, p99, p99.9 with Student t 95 %
intervals (bench/pooled_stats.py); the targets of the issue as ratios of
means with percentile bootstrap 95 % intervals, read only when the whole
interval decides:

  1. IOPS at QD1: mirrored-async / sync-rbd >= 5
  2. p99 (QD1 and QD32): mirrored-async / (RTT + 2 x local-async's p99)
     <= 1, RTT the round's median ping-pong (64 bytes), local-async's p99
     of the same round and QD

beside the A/A row (sync-rbd-aa / sync-rbd).  What went where comes from
query-hybrid (writes, bytes written back, the mirror's bytes and whole-block
copies) and the links' tbf counters.

Usage: bench/hybrid-mirror.py [--rounds 3] [--runtime 8] [--size 1G]
                              [--rate 1gbit] [--notes FILE] [--out docs/bench]
       bench/hybrid-mirror.py --report-only docs/bench/hybrid-mirror.json
Needs root (namespaces), Ceph (scripts/setup-host.sh) and fio.  Binaries
from $HYBRIDVM_BUILD/bin (default <repo>/build/bin), copied at start (a
rebuild during the run does not change what is measured).  Writes
docs/bench/hybrid-mirror.md, .json and .png.
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
sys.path.insert(0, os.path.join(REPO, 'tests'))
import hybridlib as H   # noqa: E402  (sets up the path of qemu.qmp)
import charts   # noqa: E402
from sizes import parse_size   # noqa: E402
import provenance   # noqa: E402
from saved_runs import add_report_args, load_saved   # noqa: E402
from pooled_stats import geo_mean_ci, mean, mean_ci, ratio_ci, rotated, verdict   # noqa: E402

MiB = 1024 * 1024
NAMES = ['local-async', 'mirrored-async', 'mirrored-whole', 'mirrored-chacha', 'sync-rbd',
         'sync-rbd-aa', 'raw-rbd']
# the mirrored configurations: their export on host b
MIRROR_EXPORTS = {'mirrored-async': 'm0', 'mirrored-whole': 'm1', 'mirrored-chacha': 'm2'}
# the prefilled mirrored configurations
PREFILLED = ('mirrored-async', 'mirrored-chacha')
# mirrored-chacha's client: GnuTLS's NORMAL without the AES suites, so that
# the session takes ChaCha20-Poly1305 whatever the server prefers
CHACHA_PRIORITY = 'NORMAL:-AES-256-GCM:-AES-128-GCM:-AES-256-CCM:-AES-128-CCM'
QDS = [1, 32]
MIRROR_PORT = 10809
PING_PORT = 7777
BOUND = 'RTT + 2x local-async'

# (metric, qd, node, baseline, goal); baseline BOUND: RTT + 2x local-async's
# p99 of the same round and QD
RATIOS = [
    ('iops', 1, 'mirrored-async', 'sync-rbd', ('>=', 5.0)),
    ('iops', 1, 'sync-rbd-aa', 'sync-rbd', None),
    ('p99_us', 1, 'mirrored-async', BOUND, ('<=', 1.0)),
    ('p99_us', 32, 'mirrored-async', BOUND, ('<=', 1.0)),
    ('p99_us', 1, 'sync-rbd-aa', 'sync-rbd', None),
    ('p99_us', 32, 'sync-rbd-aa', 'sync-rbd', None),
    ('iops', 32, 'sync-rbd-aa', 'sync-rbd', None),
    ('iops', 32, 'mirrored-async', 'sync-rbd', None),
    ('iops', 1, 'mirrored-async', 'local-async', None),
    ('iops', 32, 'mirrored-async', 'local-async', None),
    ('p99_us', 1, 'mirrored-async', 'local-async', None),
    ('p99_us', 32, 'mirrored-async', 'local-async', None),
    ('iops', 1, 'local-async', 'sync-rbd', None),
    ('iops', 1, 'sync-rbd', 'raw-rbd', None),
    ('iops', 1, 'mirrored-async', 'mirrored-whole', None),
    ('iops', 32, 'mirrored-async', 'mirrored-whole', None),
    ('iops', 1, 'mirrored-whole', 'sync-rbd', None),
    ('iops', 1, 'mirrored-async', 'mirrored-chacha', None),
    ('iops', 32, 'mirrored-async', 'mirrored-chacha', None),
    ('p99_us', 1, 'mirrored-async', 'mirrored-chacha', None),
    ('iops', 1, 'mirrored-chacha', 'sync-rbd', None),
    ('iops', 32, 'sync-rbd', 'raw-rbd', None),
]

PING_SERVER = r'''
import socket, struct, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(4)
def recvall(c, n):
    b = bytearray()
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            n, = struct.unpack('!I', recvall(c, 4))
            recvall(c, n)
            c.sendall(b'k' * 16)
    except (EOFError, OSError):
        c.close()
'''

PING_CLIENT = r'''
import json, socket, struct, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
n = int(sys.argv[3])
def recvall(k):
    b = bytearray()
    while len(b) < k:
        d = c.recv(k - len(b))
        if not d:
            raise EOFError
        b += d
out = {}
for size in (64, 4096):
    msg = struct.pack('!I', size) + b'p' * size
    ts = []
    for i in range(n + 20):
        t0 = time.perf_counter_ns()
        c.sendall(msg)
        recvall(16)
        if i >= 20:
            ts.append((time.perf_counter_ns() - t0) / 1000)
        time.sleep(0.002)
    out[size] = ts
print(json.dumps(out))
'''


def pct(xs, p):
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(p / 100 * len(xs)) - 1)]


class Daemon:
    """qemu-storage-daemon inside a host, with a QMP monitor on a unix
    socket in the host's files directory (the same path on the machine)."""

    def __init__(self, host, name, qsd, args, env=None):
        from qemu.qmp import ConnectError
        from qemu.qmp.legacy import QEMUMonitorProtocol
        self.host, self.name = host, name
        self.dir = os.path.join(host.files, name)
        os.makedirs(self.dir, exist_ok=True)
        self.qmp_sock = os.path.join(self.dir, 'qmp.sock')
        self.nbd_sock = os.path.join(self.dir, 'nbd.sock')
        self.log_path = os.path.join(self.dir, 'qsd.log')
        self.log = open(self.log_path, 'w+')
        self.proc = host.popen(
            [qsd, '--chardev', f'socket,id=qmp,path={self.qmp_sock},server=on,wait=off',
             '--mon', 'chardev=qmp,mode=control'] + list(args),
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.mon = None
        deadline = time.monotonic() + 60
        while True:
            if os.path.exists(self.qmp_sock):
                mon = QEMUMonitorProtocol(self.qmp_sock)
                try:
                    mon.connect()
                    self.mon = mon
                    break
                except (ConnectError, OSError):
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f'{name}: qemu-storage-daemon did not start: '
                                   + self.log_tail())
            time.sleep(0.05)
        self.mon.settimeout(120)

    def log_tail(self):
        self.log.flush()
        with open(self.log_path, errors='replace') as f:
            return f.read()[-3000:]

    def cmd(self, cmd, **args):
        r = self.mon.cmd_raw(cmd, args)
        self.mon.get_events()
        if 'error' in r:
            raise RuntimeError(f'{self.name}: {cmd} failed: {r["error"]}')
        return r['return']

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.mon:
            try:
                self.mon.close()
            except Exception:      # noqa: BLE001 - the daemon is gone
                pass
        self.log.close()


class Node:
    """One configuration: its RBD image and its daemon on host a."""

    def __init__(self, name, bench):
        self.name, self.b = name, bench
        self.hybrid = name != 'raw-rbd'
        self.mode = 'sync' if name.startswith('sync') else 'async'
        self.mirror = MIRROR_EXPORTS.get(name)
        self.prefill = name in PREFILLED
        self.image = name.replace('-', '')
        self.qsd = None
        self.counters = None
        self.prefill_s = None

    def create_image(self):
        b = self.b
        if self.hybrid:
            b.run([b.qemu_img, 'create', '-q', '-f', 'hybrid', '-o',
                   f'mode={self.mode},ram-size={b.size},block-size={b.block_size}',
                   b.ceph.filename(self.image), str(b.size)])
        else:
            b.ceph.rbd('create', '--size', f'{b.size // MiB}M', f'rbd/{self.image}')

    def start(self):
        b = self.b
        rbd = b.ceph.blockdev(self.image) + ',cache.direct=on'
        if self.hybrid:
            args = ['--blockdev', rbd + ',node-name=f']
            hyb = f'driver=hybrid,node-name=n,mode={self.mode},file=f'
            if self.mirror:
                prio = f',priority={CHACHA_PRIORITY}' if self.name == 'mirrored-chacha' else ''
                args += ['--object', f'tls-creds-psk,id=tls0,endpoint=client,'
                         f'dir={b.psk},username=hybrid{prio}']
                hyb += (f',mirror.driver=nbd,mirror.server.type=inet,'
                        f'mirror.server.host={b.hb.addr},mirror.server.port={MIRROR_PORT},'
                        f'mirror.export={self.mirror},mirror.tls-creds=tls0,'
                        f'mirror-prefill={"on" if self.prefill else "off"}')
            args += ['--blockdev', hyb]
        else:
            args = ['--blockdev', rbd + ',node-name=n']
        d = os.path.join(b.ha.files, self.name)
        args += ['--nbd-server', f'addr.type=unix,addr.path={d}/nbd.sock',
                 '--export', 'type=nbd,id=e,node-name=n,name=n,writable=on']
        env = None
        if self.mirror:
            self.tls_log = os.path.join(b.ha.files, self.name, 'tls.log')
            env = dict(os.environ, LD_PRELOAD=b.tls_shim, HYBRIDVM_TLS_LOG=self.tls_log)
        self.qsd = Daemon(b.ha, self.name, b.qsd, args, env=env)
        if self.hybrid:
            deadline = time.monotonic() + 600
            while not self.info()['restore-done']:
                if time.monotonic() > deadline:
                    raise TimeoutError(f'{self.name}: restore did not finish')
                time.sleep(0.1)
            if self.mirror and self.info()['mirror']['degraded']:
                raise RuntimeError(f'{self.name}: mirror degraded at start: '
                                   f'{self.info()["mirror"]}')
            if self.prefill:
                t0 = time.monotonic()
                self.wait_prefilled(t0 + 600)
                self.prefill_s = round(time.monotonic() - t0, 2)
            self.counters = self.snapshot()

    def info(self):
        return self.qsd.cmd('query-hybrid', **{'node-name': 'n'})[0]

    def prefilled(self):
        m = self.info()['mirror']
        if m['degraded']:
            raise RuntimeError(f'{self.name}: the mirror degraded: {m}')
        return not m['prefilling'] and \
            m['matched-blocks'] + m['counted-blocks'] == self.b.size // self.b.block_size

    def wait_prefilled(self, deadline):
        while not self.prefilled():
            if time.monotonic() > deadline:
                raise TimeoutError(f'{self.name}: the prefill did not end: '
                                   f'{self.info()["mirror"]}')
            time.sleep(0.1)

    def snapshot(self):
        i = self.info()
        s = {'writes_ram': i['writes-ram'], 'writes_through': i['writes-through'],
             'flushed': i['flushed-bytes'],
             'to_b': self.b.ha.sent_to('b') or 0,
             'to_ceph': self.b.ha.sent_to('ceph') or 0}
        if 'mirror' in i:
            m = i['mirror']
            s.update(m_bytes=m['bytes'], m_writes=m['writes'],
                     m_block_writes=m['block-writes'], m_degraded=m['degraded'],
                     m_counted=m['counted-blocks'], m_matched_writes=m['matched-writes'])
        return s

    def begin(self):
        """Counters before a run."""
        if self.hybrid:
            self.counters = self.snapshot()

    def settle(self, timeout):
        """A guest flush over the export (qemu-io): every dirty block
        written back, the tier flushed, the mirror's blocks uncounted; then
        wait until query-hybrid says nothing is dirty and the mirror counts
        no block.  Seconds the flush took, seconds in all, and whether it
        got there."""
        t0 = time.monotonic()
        r = self.b.ha.run([self.b.qemu_io, '-f', 'raw', '-c', 'flush',
                           f'nbd+unix:///n?socket={self.qsd.dir}/nbd.sock'],
                          check=False, timeout=timeout + 60)
        if r.returncode:
            raise RuntimeError(f'{self.name}: flush failed: {r.stdout} {r.stderr}')
        flush_s = time.monotonic() - t0
        while True:
            i = self.info()
            done = i['dirty-bytes'] == 0 and \
                ('mirror' not in i or i['mirror']['counted-blocks'] == 0) and \
                (not self.prefill or self.prefilled())
            if done or time.monotonic() - t0 > timeout:
                return round(flush_s, 2), round(time.monotonic() - t0, 2), done
            time.sleep(0.1)

    def profile(self, settle_timeout):
        """What the counters say about the run just done (and its settle)."""
        mid = self.snapshot()
        flush_s, settle_s, drained = self.settle(settle_timeout)
        new = self.snapshot()
        old, self.counters = self.counters, new
        p = {'writes': mid['writes_ram'] - old['writes_ram']
             + mid['writes_through'] - old['writes_through'],
             'written_back': new['flushed'] - old['flushed'],
             'to_b': new['to_b'] - old['to_b'],
             'to_ceph': new['to_ceph'] - old['to_ceph'],
             'run_to_b': mid['to_b'] - old['to_b'],
             'run_to_ceph': mid['to_ceph'] - old['to_ceph'],
             'flush_s': flush_s, 'settle_s': settle_s, 'drained': drained}
        secs = self.b.args.runtime + 1
        p['run_to_b_MBps'] = round(p['run_to_b'] / secs / 1e6, 2)
        p['run_to_ceph_MBps'] = round(p['run_to_ceph'] / secs / 1e6, 2)
        if 'm_bytes' in new:
            if new['m_degraded']:
                raise RuntimeError(f'{self.name}: the mirror degraded: '
                                   f'{self.info()["mirror"]} ' + self.qsd.log_tail())
            p.update(mirror_bytes=mid['m_bytes'] - old['m_bytes'],
                     mirror_writes=mid['m_writes'] - old['m_writes'],
                     mirror_block_writes=mid['m_block_writes'] - old['m_block_writes'],
                     mirror_matched_writes=mid['m_matched_writes'] - old['m_matched_writes'],
                     mirror_counted_at_end=mid['m_counted'])
        return p


class Bench:
    def __init__(self, args):
        self.args = args
        self.size = parse_size(args.size)
        self.block_size = parse_size(args.block_size)

    @staticmethod
    def run(argv, **kw):
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                           timeout=kw.pop('timeout', 300), **kw)
        if r.returncode:
            raise RuntimeError(f'{argv}: exit {r.returncode}: {r.stderr.strip()}')
        return r

    def copy_binaries(self):
        """Private copies: a rebuild under the run changes nothing."""
        d = os.path.join(self.net.shared, 'bin')
        os.makedirs(d)
        self.binaries = {}
        for n in ('qemu-storage-daemon', 'qemu-img', 'qemu-io'):
            self.binaries[n] = provenance.copy_binary(H.binary(n), os.path.join(d, n))
        self.qsd = os.path.join(d, 'qemu-storage-daemon')
        self.qemu_img = os.path.join(d, 'qemu-img')
        self.qemu_io = os.path.join(d, 'qemu-io')
        # the mirrored nodes' daemons log the TLS suite they settle on
        self.tls_shim = H.build_tls_shim(os.path.join(d, 'tls-session-shim.so'))

    def start_mirror_host(self):
        hb = self.hb
        self.psk = os.path.join(self.net.shared, 'psk')
        os.makedirs(self.psk)
        with open(os.path.join(self.psk, 'keys.psk'), 'w') as f:
            f.write(f'hybrid:{os.urandom(16).hex()}\n')
        exports = []
        for m in MIRROR_EXPORTS.values():
            hb.run(['truncate', '-s', str(self.size + 2 * MiB), f'/dev/shm/mirror-{m}'])
            exports += ['--blockdev', f'file,node-name={m},filename=/dev/shm/mirror-{m}',
                        '--export', f'nbd,id=e{m},node-name={m},writable=on']
        self.mirror_qsd = Daemon(hb, 'mirror', self.qsd, [
            '--object', f'tls-creds-psk,id=tls0,endpoint=server,dir={self.psk}',
            '--nbd-server', f'addr.type=inet,addr.host={hb.addr},'
                            f'addr.port={MIRROR_PORT},tls-creds=tls0'] + exports)
        self.ping_srv = hb.popen([sys.executable, '-c', PING_SERVER, hb.addr, PING_PORT],
                                 stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        for port in (MIRROR_PORT, PING_PORT):
            while self.ha.run([sys.executable, '-c', 'import socket; socket.create_connection('
                               f'("{hb.addr}", {port}), 1)'], check=False).returncode:
                if time.monotonic() > deadline:
                    raise RuntimeError(f'nothing listens on b:{port}')
                time.sleep(0.1)

    def tls_suites(self, nodes):
        """The TLS session description each mirrored node's daemon logged
        (tls-session-shim.c); raises if a node's session is not on the
        cipher its configuration names."""
        suites = {}
        for n in MIRROR_EXPORTS:
            with open(nodes[n].tls_log) as f:
                got = sorted(set(f.read().split()))
            want = 'CHACHA20-POLY1305' if n == 'mirrored-chacha' else 'AES-128-GCM'
            if not got or not all(g.endswith(f'-({want})') for g in got):
                raise RuntimeError(f'{n}: TLS sessions {got}, expected {want}')
            suites[n] = got
        return suites

    def osd_block(self):
        return os.path.join(self.ceph.path, 'osd', 'ceph-0', 'block')

    def ceph_size(self):
        """The OSD's BlueStore block file's size (bytes), or None."""
        try:
            return os.path.getsize(self.osd_block())
        except OSError:
            return None

    def ceph_used(self):
        """What the OSD's block file has allocated on the disk (BlueStore's
        high-water mark: it does not punch holes) and the cluster's health
        (ceph df says 0 B here: no mgr runs)."""
        try:
            used = os.stat(self.osd_block()).st_blocks * 512
        except OSError:
            used = None
        h = self.ceph.ceph('health', check=False, timeout=30)
        return {'block_allocated_bytes': used, 'health': h.stdout.strip()[:200]}

    def diagnose(self):
        """After a failure: what Ceph says, and the ends of its logs, to
        stderr (the Network's directory goes when it closes)."""
        try:
            for args in (('health', 'detail'), ('df',), ('osd', 'df')):
                r = self.ceph.ceph(*args, check=False, timeout=30)
                print(f'--- ceph {" ".join(args)}\n{r.stdout}{r.stderr}', file=sys.stderr)
            logdir = os.path.join(self.ceph.path, 'log')
            for fn in sorted(os.listdir(logdir)):
                if fn.startswith(('osd', 'ceph-osd')):
                    with open(os.path.join(logdir, fn), errors='replace') as f:
                        print(f'--- {fn}\n' + f.read()[-6000:], file=sys.stderr)
        except Exception as e:      # noqa: BLE001 - diagnostics only
            print(f'diagnose: {e}', file=sys.stderr)

    def ping(self, rnd):
        out = self.ha.run([sys.executable, '-c', PING_CLIENT, self.hb.addr, PING_PORT,
                           self.args.pings], timeout=120).stdout
        ts = json.loads(out)
        r = {'round': rnd}
        for size, xs in ts.items():
            r[f'rtt{size}_median_us'] = round(pct(xs, 50), 1)
            r[f'rtt{size}_p99_us'] = round(pct(xs, 99), 1)
        r['n'] = len(ts['64'])
        return r

    def fio(self, node, qd):
        args = self.args
        uri = f'nbd+unix:///n?socket={node.qsd.dir}/nbd.sock'
        r = self.ha.run(
            ['fio', '--name=job', '--ioengine=nbd', f'--uri={uri}',
             '--rw=randwrite', '--bs=4k', f'--iodepth={qd}', '--numjobs=1',
             f'--size={self.size}', f'--runtime={args.runtime}', '--time_based',
             '--ramp_time=1', '--output-format=json', '--randrepeat=0',
             '--norandommap'], check=False, timeout=args.runtime + 180)
        text = r.stdout
        if r.returncode or '{' not in text:
            raise RuntimeError(f'{node.name} QD{qd}: fio failed ({r.returncode}): '
                               f'{text[:1500]} {r.stderr[-1500:]} ' + node.qsd.log_tail())
        out = json.loads(text[text.find('{'):])
        job = out['jobs'][0]
        if job['error']:
            raise RuntimeError(f'{node.name} QD{qd}: fio failed: {text[:2000]}')
        w = job['write']
        p = w['clat_ns']['percentile']
        return {'iops': round(w['iops']),
                'p50_us': round(p['50.000000'] / 1000, 1),
                'p99_us': round(p['99.000000'] / 1000, 1),
                'p99.9_us': round(p['99.900000'] / 1000, 1),
                'max_us': round(w['clat_ns']['max'] / 1000, 1)}

    def main(self):
        from hvlib import hosts
        args = self.args
        t_start = time.monotonic()
        runs, pings, meta = [], [], {}
        meta.update(provenance.tree())
        with hosts.Network('hmir') as net:
            self.net = net
            self.copy_binaries()
            self.ha, self.hb = net.host('a'), net.host('b')
            # scripts/ceph-cluster.sh makes a 4 GiB OSD: five images written
            # at random filled it (RocksDB's share of it too) and BlueStore
            # aborted with ENOSPC.  A bigger one, through CEPH_ARGS (command
            # line beats ceph.conf) while the cluster is made; sparse file.
            saved = os.environ.get('CEPH_ARGS')
            os.environ['CEPH_ARGS'] = ((saved + ' ') if saved else '') + \
                f'--bluestore-block-size={parse_size(args.osd_size)}'
            try:
                self.ceph = net.ceph()
            finally:
                if saved is None:
                    del os.environ['CEPH_ARGS']
                else:
                    os.environ['CEPH_ARGS'] = saved
            meta['osd_size'] = self.ceph_size()
            net.link('a', 'b', rate=args.rate)
            net.link('a', 'ceph', rate=args.rate)
            print(f'network up, Ceph started ({time.monotonic() - t_start:.0f} s)', flush=True)
            self.start_mirror_host()
            nodes = {n: Node(n, self) for n in NAMES}
            for n in NAMES:
                nodes[n].create_image()
                nodes[n].start()
            print(f'daemons up ({time.monotonic() - t_start:.0f} s)', flush=True)
            try:
                for rnd in range(args.rounds):
                    pr = self.ping(rnd)
                    pings.append(pr)
                    print(json.dumps(pr), flush=True)
                    qds = args.qds if rnd % 2 == 0 else args.qds[::-1]
                    for n in rotated(NAMES, rnd):
                        node = nodes[n]
                        for qd in qds:
                            node.begin()
                            r = self.fio(node, qd)
                            r.update(round=rnd, node=n, qd=qd,
                                     load=round(os.getloadavg()[0], 2))
                            if node.hybrid:
                                r['profile'] = node.profile(args.settle)
                            runs.append(r)
                            print(json.dumps(r), flush=True)
                    meta.setdefault('ceph_used', []).append(self.ceph_used())
                meta['mirror_at_end'] = {n: nodes[n].info()['mirror'] for n in MIRROR_EXPORTS}
                meta['prefill_s'] = nodes['mirrored-async'].prefill_s
                meta['tls_suites'] = self.tls_suites(nodes)
            except BaseException:
                self.diagnose()
                raise
            finally:
                for node in nodes.values():
                    if node.qsd:
                        node.qsd.stop()
                self.mirror_qsd.stop()
                self.ping_srv.kill()
        meta.update(binaries=self.binaries, binaries_changed=provenance.changed(self.binaries),
                    wall_s=round(time.monotonic() - t_start))
        return runs, pings, meta


def per_round(runs, node, qd, metric):
    return {r['round']: r[metric] for r in runs if r['node'] == node and r['qd'] == qd}


def summarize(runs, pings):
    nodes = {}
    for n in NAMES:
        for qd in QDS:
            rs = [r for r in runs if r['node'] == n and r['qd'] == qd]
            if not rs:
                continue
            s = nodes[f'{n}@{qd}'] = {}
            for k in ('iops', 'p50_us', 'p99_us', 'p99.9_us'):
                m, h = mean_ci([r[k] for r in rs])
                s[k] = {'mean': m, 'ci': h}
            prs = [r['profile'] for r in rs if 'profile' in r]
            if prs:
                writes = sum(p['writes'] for p in prs)
                s['profile'] = {
                    'writes': writes,
                    'written_back_per_written': sum(p['written_back'] for p in prs)
                    / max(1, 4096 * writes),
                    'run_to_b_MBps': mean([p['run_to_b_MBps'] for p in prs]),
                    'run_to_ceph_MBps': mean([p['run_to_ceph_MBps'] for p in prs]),
                    'to_ceph_per_written': sum(p['to_ceph'] for p in prs)
                    / max(1, 4096 * writes),
                    'settle_s': mean([p['settle_s'] for p in prs]),
                    'drained': all(p['drained'] for p in prs)}
                if 'mirror_bytes' in prs[0]:
                    s['profile'].update(
                        mirror_bytes_per_write=sum(p['mirror_bytes'] for p in prs)
                        / max(1, writes),
                        block_copies_per_write=sum(p['mirror_block_writes'] for p in prs)
                        / max(1, writes),
                        matched_per_write=sum(p.get('mirror_matched_writes', 0) for p in prs)
                        / max(1, writes),
                        to_b_per_written=sum(p['to_b'] for p in prs) / max(1, 4096 * writes))
    rtt = {}
    for k in ('rtt64_median_us', 'rtt64_p99_us', 'rtt4096_median_us', 'rtt4096_p99_us'):
        m, h = mean_ci([p[k] for p in pings])
        rtt[k] = {'mean': m, 'ci': h}
    rtt_by_round = {p['round']: p['rtt64_median_us'] for p in pings}
    ratios = []
    for metric, qd, a, b, goal in RATIOS:
        ra = per_round(runs, a, qd, metric)
        if b == BOUND:
            loc = per_round(runs, 'local-async', qd, metric)
            rb = {k: rtt_by_round[k] + 2 * v for k, v in loc.items() if k in rtt_by_round}
        else:
            rb = per_round(runs, b, qd, metric)
        keys = sorted(set(ra) & set(rb))
        if len(keys) < 2:
            continue
        xa, xb = [ra[k] for k in keys], [rb[k] for k in keys]
        p, lo, hi = ratio_ci(xa, xb)
        gm, glo, ghi = geo_mean_ci([x / y for x, y in zip(xa, xb)])
        ratios.append({'metric': metric, 'qd': qd, 'node': a, 'baseline': b,
                       'ratio': p, 'lo': lo, 'hi': hi, 'goal': goal,
                       'baseline_mean': mean(xb),
                       'verdict': verdict(lo, hi, goal) if goal else
                       (('A/A control: the interval holds 1' if lo <= 1 <= hi else
                         'A/A control: the interval misses 1 (copies differ)')
                        if a.endswith('-aa') else '-'),
                       'paired': gm, 'paired_lo': glo, 'paired_hi': ghi,
                       'paired_verdict': verdict(glo, ghi, goal) if goal else '-'})
    return {'nodes': nodes, 'rtt': rtt, 'ratios': ratios}


def fmt(s, k, digits=0):
    ci = s[k]['ci']
    ci = '?' if ci != ci else f'{ci:.{digits}f}'
    return f'{s[k]["mean"]:.{digits}f} ± {ci}'


def report(args, runs, pings, meta, summary):
    out = args.out
    os.makedirs(out, exist_ok=True)
    when = meta.get('when') or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    meta['when'] = when
    res = {'args': {k: v for k, v in vars(args).items()
                    if k not in ('out', 'notes', 'report_only')},
           'meta': meta, 'pings': pings, 'runs': runs, **summary}
    with open(os.path.join(out, f'{args.name}.json'), 'w') as f:
        json.dump(res, f, indent=1)
    loads = [r['load'] for r in runs]
    rtt = summary['rtt']
    osd_gib = f'{meta["osd_size"] / (1 << 30):.0f}' if meta.get('osd_size') else '?'
    lines = [f'# hybrid: the RAM tier mirrored on another host, 4 KiB random '
             f'writes ({when})', '',
             f'Measured by `bench/hybrid-mirror.py --rounds {args.rounds} '
             f'--runtime {args.runtime} --size {args.size} --block-size {args.block_size} '
             f'--rate {args.rate}` '
             f'(issue 39).  Two network-namespace hosts and a single-node Ceph '
             f'cluster (scripts/ceph-cluster.sh: one monitor, one BlueStore OSD, a '
             f'sparse file on the machine\'s disk, raised from the script\'s 4 GiB to '
             f'{osd_gib} GiB through CEPH_ARGS: five images written at random filled '
             f'4 GiB and BlueStore aborted with ENOSPC) '
             f'in its own namespace (tests/hvlib/hosts.py); host a is joined to '
             f'host b and to Ceph by links shaped to {args.rate} each way (tbf; '
             f'no added delay: this kernel has no netem).  On host a one '
             f'qemu-storage-daemon per configuration exports its node over an '
             f'NBD unix socket; fio\'s nbd engine, also on host a, writes 4 KiB '
             f'at random over the whole {args.size} node at '
             f'{" and ".join(f"QD{q}" for q in getattr(args, "qds", QDS))}, '
             f'{args.runtime} s per run (+1 s ramp).  {args.rounds} rounds, each '
             f'running every configuration once in an order rotated from round '
             f'to round (QD1 then QD32; QD32 first in odd rounds); after each '
             f'run of a hybrid node the script flushes it through its export '
             f'(qemu-io: a guest flush, everything dirty written back, RBD '
             f'flushed, the blocks out of the mirror) and waits until '
             f'query-hybrid shows nothing dirty and no block in the mirror, so '
             f'every run starts from a clean node and none under the write-back '
             f'of the one before.', '',
             'Configurations, each over an RBD image of its own, created empty '
             '(librbd\'s cache off, `cache.direct=on`: a write to RBD is a '
             f'round trip to the OSD); hybrid images of {args.block_size} blocks, '
             f'`ram-size` = {args.size} (the whole image), default dirty-limit '
             '(256 MiB):', '',
             '* **local-async**: hybrid `mode=async` over the RBD image, no mirror;',
             '* **mirrored-async**: the same with `mirror=` an NBD export over TLS '
             '(PSK) of a `/dev/shm` file on host b (qemu-storage-daemon on b, as '
             'block/tests/test_hybrid_mirror_hosts.py sets it up): an async write '
             'completes once a\'s RAM tier and b hold it; measured once its '
             'prefill has ended (the tier\'s clean blocks copied to b: here all zero, '
             'sent as write-zeroes' + (f', {meta["prefill_s"]} s after the restore'
                                      if meta.get('prefill_s') is not None else '') +
             '), so a block\'s first write sends its bitmap bits with its bytes, one '
             'round trip;',
             '* **mirrored-whole**: the same with `mirror-prefill=off` and its own '
             'export on b: a block not yet written in this binding goes whole on its '
             'first write, then its bits, two round trips (as every first write did '
             'before the prefill); one written back and flushed since (by the settle '
             'after each run) is matched, its bytes sent with its bit;',
             '* **mirrored-chacha**: mirrored-async with the mirror\'s TLS session '
             'on ChaCha20-Poly1305 (its own export on b; its client offers no AES '
             'suite): the suite GnuTLS\'s plain NORMAL negotiates over a PSK, as a '
             'QEMU configured without our build\'s `--tls-priority` does '
             '(scripts/build-qemu.sh);',
             '* **sync-rbd**: hybrid `mode=sync`: a write completes once RBD holds it;',
             '* **sync-rbd-aa**: the same again, its own image and daemon: the '
             'A/A control, of sync-rbd because it is the baseline of the IOPS '
             'target (the spread between two copies of the same thing);',
             '* **raw-rbd**: the rbd node alone, no hybrid.', '',
             f'The link\'s round trip a<->b, a TCP ping-pong in Python through '
             f'the shaped link at the start of each round ({pings[0]["n"] if pings else "?"} '
             f'exchanges, a 16-byte answer; mean of the rounds ± 95 % '
             f'interval): 64-byte request median {fmt(rtt, "rtt64_median_us", 1)} µs, '
             f'p99 {fmt(rtt, "rtt64_p99_us", 1)} µs; 4 KiB request median '
             f'{fmt(rtt, "rtt4096_median_us", 1)} µs, p99 '
             f'{fmt(rtt, "rtt4096_p99_us", 1)} µs.  The p99 target takes the '
             f'64-byte median of the same round as "the link\'s round trip".', '',
             f'2 cores shared with other work (CI); 1-minute load average '
             f'{min(loads):.1f} to {max(loads):.1f} during the runs.  '
             f'Wall time {meta.get("wall_s", "?")} s.'
             + (f'  The OSD\'s block file had {meta["ceph_used"][-1]["block_allocated_bytes"] / (1 << 30):.1f} '
                f'GiB allocated at the end; health {meta["ceph_used"][-1]["health"]}.'
                if meta.get('ceph_used') and meta['ceph_used'][-1]['block_allocated_bytes'] else ''),
             '',
             'Per configuration and queue depth, the mean of the rounds and its '
             '95 % interval (Student t); latencies are fio completion latencies '
             'in µs.', '',
             '| configuration | QD | IOPS | p50 µs | p99 µs | p99.9 µs |',
             '|---|---:|---:|---:|---:|---:|']
    for qd in QDS:
        for n in NAMES:
            s = summary['nodes'].get(f'{n}@{qd}')
            if s:
                lines.append(f'| {n} | {qd} | ' + ' | '.join(
                    fmt(s, k) for k in ('iops', 'p50_us', 'p99_us', 'p99.9_us')) + ' |')
    lines += ['', '## The targets', '',
              'Ratios of the means with a percentile bootstrap 95 % interval '
              '(the rounds resampled independently), and paired by round: the '
              'geometric mean of the per-round ratios with its Student t 95 % '
              'interval.  A target is met or missed only when the whole interval '
              'says so; otherwise it is inside the noise.  '
              f'"{BOUND}" is, per round, the round\'s 64-byte median round trip '
              'plus twice local-async\'s p99 at the same QD (its mean is in the '
              'last column).', '',
              '| metric | QD | node / baseline | ratio of means [95 % CI] | verdict '
              '| paired [95 % CI] | verdict | target |',
              '|---|---:|---|---:|---|---:|---|---|']
    for r in summary['ratios']:
        goal = f'{r["goal"][0]} {r["goal"][1]:g}' if r['goal'] else '-'
        if r['baseline'] == BOUND:
            goal += f' (bound {r["baseline_mean"]:.0f} µs)'
        lines.append(f'| {r["metric"]} | {r["qd"]} | {r["node"]} / {r["baseline"]} | '
                     f'{r["ratio"]:.2f} [{r["lo"]:.2f}, {r["hi"]:.2f}] | '
                     f'{r["verdict"]} | {r["paired"]:.2f} '
                     f'[{r["paired_lo"]:.2f}, {r["paired_hi"]:.2f}] | '
                     f'{r["paired_verdict"]} | {goal} |')
    goals = [r for r in summary['ratios'] if r['goal']]
    if goals:
        lines += ['', 'Read (ratio of means, bootstrap interval):', '']
        for r in goals:
            what = (f'IOPS at QD{r["qd"]}, {r["node"]} / {r["baseline"]} '
                    f'{r["goal"][0]} {r["goal"][1]:g}' if r['metric'] == 'iops' else
                    f'p99 at QD{r["qd"]}, {r["node"]} within the round trip + 2x '
                    f'local-async\'s p99 ({r["ratio"] * r["baseline_mean"]:.0f} µs '
                    f'against {r["baseline_mean"]:.0f} µs)')
            lines.append(f'* {what}: ratio {r["ratio"]:.2f} '
                         f'[{r["lo"]:.2f}, {r["hi"]:.2f}]: **{r["verdict"]}**')
    lines += ['', '## Where the bytes went', '',
              'Summed over the rounds, from query-hybrid and the links\' tbf '
              'counters: the mirror\'s bytes, whole-block copies (a block\'s '
              'first write whose copy on b is not known to be the tier\'s is '
              f'copied whole, {args.block_size}, then its bitmap bits are set) and '
              'matched first writes (bytes and bits at once) per guest write; bytes a sent to '
              'b and to Ceph per byte written (including the settle after each '
              'run); mean link rate a->b and a->Ceph during the runs (over '
              f'{args.runtime} s + 1 s ramp); the settle time after a run (the '
              'flush, and the wait until the node shows it).', '',
              '| node | QD | writes | to mirror B/write | whole-block copies/write '
              '| matched first writes/write '
              '| a->b B/B written | a->Ceph B/B written | a->b MB/s | a->Ceph MB/s '
              '| settle s |',
              '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for qd in QDS:
        for n in NAMES:
            p = summary['nodes'].get(f'{n}@{qd}', {}).get('profile')
            if not p:
                continue
            lines.append(
                f'| {n} | {qd} | {p["writes"]} | '
                f'{p.get("mirror_bytes_per_write", 0):.0f} | '
                f'{p.get("block_copies_per_write", 0):.2f} | '
                f'{p.get("matched_per_write", 0):.2f} | '
                f'{p.get("to_b_per_written", 0):.2f} | {p["to_ceph_per_written"]:.2f} | '
                f'{p["run_to_b_MBps"]:.1f} | {p["run_to_ceph_MBps"]:.1f} | '
                f'{p["settle_s"]:.1f}{"" if p["drained"] else " (not drained)"} |')
    lines += ['', f'![IOPS and the ratios]({args.name}.png)', '']
    if meta.get('tls_suites'):
        lines += ['TLS sessions of the mirrors, as each daemon on host a logged them '
                  '(block/tests/tls-session-shim.c): ' + '; '.join(
                      f'{n} {", ".join(d)}' for n, d in meta['tls_suites'].items()) + '.', '']
    if meta.get('binaries'):
        lines += [provenance.report_line(meta), '']
    if args.notes and os.path.exists(args.notes):
        with open(args.notes) as f:
            lines += [f.read()]
    with open(os.path.join(out, f'{args.name}.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(os.path.join(out, f'{args.name}.png'), summary)


def chart(path, summary):
    plt = charts.pyplot()
    if not plt:
        return
    rs = summary['ratios']
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.42 * len(rs) + 1.8),
                                   gridspec_kw={'width_ratios': [1, 1.3]})
    series = []
    for qd in QDS:
        series.append((f'QD{qd}', [summary['nodes'].get(f'{n}@{qd}', {})
                                   .get('iops', {}).get('mean', 0) for n in NAMES]))
    charts.grouped_bars(ax1, NAMES, series, 0.38)
    for j, qd in enumerate(QDS):
        for i, n in enumerate(NAMES):
            s = summary['nodes'].get(f'{n}@{qd}')
            if s and s['iops']['ci'] == s['iops']['ci']:
                ax1.errorbar([i + (j - 0.5) * 0.38], [s['iops']['mean']],
                             yerr=[s['iops']['ci']], fmt='none', ecolor='k', capsize=2)
    ax1.set_yscale('log')
    ax1.set_ylabel('IOPS, 4 KiB random writes (mean, 95 % CI)')
    ax1.tick_params(axis='x', labelsize=8, rotation=20)
    ax1.legend(fontsize=8)
    for i, r in enumerate(rs):
        charts.ratio_points(ax2, [i], [r], color='tab:gray' if not r['goal']
                            else 'tab:red')
        if r['goal']:
            ax2.plot([r['goal'][1]] * 2, [i - 0.3, i + 0.3], 'k--', lw=1)
    charts.ratio_rows(ax2, [f'{r["metric"]} QD{r["qd"]}: {r["node"]} / {r["baseline"]}'
                            for r in rs], 'ratio of means (dashed: target)')
    ax2.set_xscale('log')
    charts.save(fig, path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--runtime', type=int, default=8)
    ap.add_argument('--size', default='1G')
    ap.add_argument('--block-size', default='64K',
                    help="the hybrid images' block size: a block's first write since "
                         'its write-back copies the whole block to the mirror')
    ap.add_argument('--name', default='hybrid-mirror',
                    help='the report files in --out: NAME.md, .json, .png')
    ap.add_argument('--rate', default='1gbit',
                    help='the links a<->b and a<->ceph (tc syntax)')
    ap.add_argument('--osd-size', default='16G',
                    help='the OSD\'s BlueStore block file (sparse; '
                    'scripts/ceph-cluster.sh makes 4G, too small for five images)')
    ap.add_argument('--pings', type=int, default=200,
                    help='round-trip exchanges per size per round')
    ap.add_argument('--settle', type=int, default=180,
                    help='at most this many s to wait for a hybrid node to '
                    'drain after a run (a flush over its export)')
    ap.add_argument('--qds', default='1,32', type=lambda v: [int(x) for x in v.split(',')],
                    help='queue depths, of 1 and 32 (a quick look: 1)')
    add_report_args(ap)
    args = ap.parse_args()
    if args.report_only:
        saved = load_saved(args)
        runs, pings, meta = saved['runs'], saved['pings'], saved.get('meta', {})
        report(args, runs, pings, meta, summarize(runs, pings))
        return
    if args.rounds < 2:
        ap.error('--rounds needs at least 2 for an interval')
    if os.geteuid() != 0:
        ap.error('needs root (network namespaces)')
    runs, pings, meta = Bench(args).main()
    report(args, runs, pings, meta, summarize(runs, pings))


if __name__ == '__main__':
    main()
