"""The clone cache (issue 19, part 2): a real qemu-storage-daemon holds a
clone-cache object and exports each base read-only over NBD on a unix
socket, as on a host; clients (qemu-img, qemu-io, a qcow2 overlay) read
through the export.

- every byte read through the cache equals the base's, cold, warm, after a
  clean restart, after SIGKILL in the middle of fills, after the cache
  file's data, index records or superblock are damaged (discarded, counted,
  never served);
- misses fill in the background; concurrent misses on a block are one base
  read (merged); identical blocks of two bases are stored once; forced
  fingerprint clashes (x-fingerprint-bits) never return another block;
- 2Q: a sequential scan does not flush a re-read hot set; pinning keeps a
  prewarmed boot set; record/prewarm through QMP;
- a base that changed (generation, or a rewritten file) loses its entries;
  a full cache file system (ENOSPC) leaves reads served from the base; a
  base read error reaches the client; hostile traces and options are
  refused with a clear message; a file that is not a cache is never
  overwritten; the cache file is created 0600; the overlay's writes never
  reach the base or the cache."""

import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hybridlib as H   # noqa: E402

KiB = 1024
MiB = 1024 * KiB
BS = 64 * KiB


def rand_bytes(rnd, n):
    return rnd.getrandbits(8 * n).to_bytes(n, 'little')


class CloneCacheTest(unittest.TestCase):

    def setUp(self):
        if not H.have_binaries():
            self.skipTest(f'QEMU tools not built in {H.BIN}')
        self.tmp = H.TempDir()
        self.qsd = None
        self.rnd = random.Random(19)
        self.cache = self.tmp('clone.cache')

    def tearDown(self):
        if self.qsd:
            self.qsd.kill()
        self.tmp.cleanup()

    # -- helpers --

    def make_base(self, name, size=8 * MiB, data=None):
        path = self.tmp(name)
        with open(path, 'wb') as f:
            f.write(data if data is not None else rand_bytes(self.rnd, size))
        return path

    def start(self, bases, cache_opts='', throttle=None, system=False,
              size=16 * MiB, extra=(), env=None):
        """bases: list of (name, path, extra node options)."""
        args = list(extra) + [
            '--object', f'clone-cache,id=cc0,filename={self.cache},'
            f'size={size}{cache_opts}']
        if throttle:
            args += ['--object', 'throttle-group,id=tg,'
                     f'x-bps-read={throttle}']
        if not system:
            args += ['--nbd-server',
                     f'addr.type=unix,addr.path={self.tmp("nbd.sock")}']
        for name, path, extra in bases:
            child = f'f-{name}'
            args += ['--blockdev', f'file,node-name={child},filename={path},'
                     'read-only=on']
            if throttle:
                args += ['--blockdev', f'throttle,node-name=t-{name},'
                         f'throttle-group=tg,file={child},read-only=on']
                child = f't-{name}'
            args += ['--blockdev', f'clone-cache,node-name={name},store=cc0,'
                     f'file={child},read-only=on{extra}']
            if not system:
                args += ['--export', f'nbd,id=e-{name},node-name={name}']
        self.qsd = H.StorageDaemon(self.tmp, *args, system=system, env=env)
        return self.qsd

    def uri(self, name):
        return f'nbd+unix:///{name}?socket={self.tmp("nbd.sock")}'

    def read_all(self, name):
        out = self.tmp(f'{name}.read')
        H.qemu_img('convert', '-f', 'raw', '-O', 'raw', self.uri(name), out)
        with open(out, 'rb') as f:
            data = f.read()
        os.unlink(out)
        return data

    def io(self, name, *cmds, check=True):
        args = ['-r', '-f', 'raw']
        for c in cmds:
            args += ['-c', c]
        r = subprocess.run([H.binary('qemu-io')] + args + [self.uri(name)],
                           capture_output=True, text=True, timeout=120)
        out = r.stdout + r.stderr
        if check:
            self.assertEqual(r.returncode, 0, out)
            self.assertNotIn('failed', out)
        return out

    def info(self):
        [c] = self.qsd.cmd('query-clone-cache')
        return c

    def base(self, base_id):
        [b] = [b for b in self.info()['bases'] if b['base-id'] == base_id]
        return b

    def settle(self, timeout=30):
        deadline = time.monotonic() + timeout
        while self.info()['fill-pending']:
            self.assertLess(time.monotonic(), deadline, 'fills never ended')
            time.sleep(0.05)
        time.sleep(0.1)     # the last batch is published after it is written
        return self.info()

    def restart(self, *args, **kw):
        self.qsd.stop()
        return self.start(*args, **kw)

    # -- reading through the cache --

    def test_cold_then_warm_then_restart(self):
        path = self.make_base('base.img')
        want = open(path, 'rb').read()
        bases = [('b0', path, ',base-id=gold')]
        self.start(bases)
        self.assertEqual(self.read_all('b0'), want)
        c = self.settle()
        b = self.base('gold')
        nblocks = len(want) // BS
        self.assertEqual(b['misses'], nblocks)
        self.assertEqual(b['fills'], nblocks)
        self.assertEqual(b['entries'], nblocks)
        self.assertEqual(b['base-read-bytes'], len(want))
        self.assertEqual(c['used'], nblocks)
        self.assertTrue(b['open'])
        self.assertEqual(b['node-name'], 'b0')

        self.assertEqual(self.read_all('b0'), want)
        b = self.base('gold')
        self.assertEqual(b['hits'], nblocks)
        self.assertEqual(b['base-read-bytes'], len(want))   # not one more

        # warm after a clean restart: nothing read from the base
        self.restart(bases)
        self.assertEqual(self.base('gold')['entries'], nblocks)
        self.assertEqual(self.read_all('b0'), want)
        b = self.base('gold')
        self.assertEqual((b['hits'], b['misses'], b['base-read-bytes']),
                         (nblocks, 0, 0))
        self.assertEqual(stat.S_IMODE(os.stat(self.cache).st_mode), 0o600)

    def test_unaligned_reads_and_partial_last_block(self):
        size = 3 * MiB + 5 * 512            # the last block is partial
        path = self.make_base('odd.img', size=size)
        want = open(path, 'rb').read()
        self.start([('b0', path, '')])
        for _ in range(2):                  # cold, then warm
            for off, ln in [(0, 512), (BS - 512, 1024), (size - 2560, 2560),
                            (7 * 512, 3 * BS + 512), (size - BS - 512, BS)]:
                out = self.io('b0', f'read -v {off} {ln}')
                got = b''.join(
                    bytes.fromhex(m.group(1)) for m in
                    (re.match(r'^[0-9a-f]{8}:  ((?:[0-9a-f]{2} )+)', line)
                     for line in out.splitlines()) if m)
                self.assertEqual(got, want[off:off + ln], (off, ln))
            self.settle()
        self.assertEqual(self.read_all('b0'), want)
        self.assertGreater(self.info()['bases'][0]['hits'], 0)
        # a 512-byte hit reads (and checks) its 4 KiB piece, not the block
        before = self.info()['bases'][0]['cache-read-bytes']
        self.io('b0', f'read {BS + 5000} 512')
        self.assertEqual(self.info()['bases'][0]['cache-read-bytes'] - before,
                         4096)

    def test_concurrent_misses_merge_into_one_base_read(self):
        path = self.make_base('base.img', size=1 * MiB)
        # a slow base (256 KiB/s: a block every 250 ms) so that reads overlap
        self.start([('b0', path, ',base-id=slow')], throttle=256 * KiB)
        self.io('b0', *[f'aio_read {(i % 4) * BS} {BS}' for i in range(16)],
                'aio_flush')
        b = self.base('slow')
        # each block came from the base once; the other 12 reads waited for
        # that read, or took its data before or after it was cached
        self.assertEqual(b['misses'], 4, b)
        self.assertEqual(b['base-read-bytes'], 4 * BS)
        self.assertEqual(b['merged-misses'] + b['hits'], 12)
        self.assertGreaterEqual(b['merged-misses'], 6, b)

    def test_identical_blocks_of_two_bases_stored_once(self):
        data = rand_bytes(self.rnd, 4 * MiB)
        a = self.make_base('a.img', data=data)
        # a full clone: same content, another image
        b = self.make_base('b.img', data=data[:2 * MiB] +
                           rand_bytes(self.rnd, 2 * MiB))
        self.start([('a', a, ',base-id=A'), ('b', b, ',base-id=B')])
        self.assertEqual(self.read_all('a'), data)
        self.settle()
        self.assertEqual(self.read_all('b'), open(b, 'rb').read())
        c = self.settle()
        self.assertEqual(c['dedup-shared'], 2 * MiB // BS)
        self.assertEqual(c['used'], 6 * MiB // BS)     # not 8
        self.assertEqual(self.base('B')['entries'], 4 * MiB // BS)
        # both still read right from the shared slots, after a restart too
        self.restart([('a', a, ',base-id=A'), ('b', b, ',base-id=B')])
        self.assertEqual(self.read_all('b'), open(b, 'rb').read())
        self.assertEqual(self.read_all('a'), data)
        self.assertEqual(self.base('B')['misses'], 0)

    def test_fingerprint_clashes_never_return_another_block(self):
        # 2 bits of fingerprint: nearly every block clashes with another
        bases = []
        for i in range(2):
            bases.append((f'b{i}', self.make_base(f'{i}.img', size=2 * MiB),
                          f',base-id=B{i}'))
        opts = ',x-fingerprint-bits=2'
        self.start(bases, cache_opts=opts)
        for name, path, _ in bases:
            self.assertEqual(self.read_all(name), open(path, 'rb').read())
            self.settle()
        c = self.info()
        self.assertEqual(c['dedup-shared'], 0)
        self.assertEqual(c['used'], 4 * MiB // BS)
        self.restart(bases, cache_opts=opts)
        for name, path, _ in bases:
            self.assertEqual(self.read_all(name), open(path, 'rb').read())
        self.assertEqual(sum(b['misses'] for b in self.info()['bases']), 0)

    # -- eviction --

    def test_sequential_scan_does_not_flush_the_hot_set(self):
        # a 1 MiB cache of 4 KiB blocks (~217 slots) against 4 MiB scans
        path = self.make_base('base.img', size=10 * MiB)
        self.start([('b0', path, ',base-id=S')], size=1 * MiB,
                   cache_opts=',block-size=4096')
        slots = self.info()['slots']
        hot = [f'read {i * 4096} 4096' for i in range(16)]
        # the hot set is read between chunks of a scan: evicted from A1in
        # once, it comes back while remembered (A1out) and enters Am
        for i in range(8):
            self.io('b0', *hot)
            self.io('b0', f'read {1 * MiB + i * 256 * KiB} {256 * KiB}')
            self.settle()
        # then one long scan, four times the cache
        self.io('b0', f'read {4 * MiB} {4 * MiB}')
        c = self.settle()
        self.assertGreater(4 * MiB // 4096, 4 * slots)
        self.assertGreater(c['evictions'], 4 * MiB // 4096 - slots)
        before = self.base('S')['hits']
        self.io('b0', *hot)
        self.assertEqual(self.base('S')['hits'] - before, 16)

    def test_record_prewarm_and_pin_a_boot_set(self):
        path = self.make_base('base.img')
        bases = [('b0', path, ',base-id=boot')]
        self.start(bases)
        self.qsd.cmd('clone-cache-record', **{'node-name': 'b0'})
        boot = [3, 1, 7, 100, 3, 64]
        self.io('b0', *[f'read {b * BS} 512' for b in boot])
        trace = self.tmp('boot.trace')
        r = self.qsd.cmd('clone-cache-record-stop', filename=trace,
                         **{'node-name': 'b0'})
        self.assertEqual(r['blocks'], 5)           # first reads, no repeats
        self.assertEqual(stat.S_IMODE(os.stat(trace).st_mode), 0o600)
        # a fresh cache, prewarmed and pinned from the trace
        self.qsd.stop()
        os.unlink(self.cache)
        self.start(bases)
        self.qsd.cmd('clone-cache-prewarm', filename=trace, pin=True,
                     **{'node-name': 'b0'})
        deadline = time.monotonic() + 30
        while self.base('boot')['entries'] < 5:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.05)
        self.assertEqual(self.settle()['pinned'], 5)
        self.io('b0', *[f'read {b * BS} 512' for b in boot])
        b = self.base('boot')
        self.assertEqual((b['hits'], b['misses']), (6, 5))
        # pinned survives a restart, and unpin releases it
        self.restart(bases)
        self.assertEqual(self.info()['pinned'], 5)
        self.qsd.cmd('clone-cache-unpin', **{'node-name': 'b0'})
        self.assertEqual(self.info()['pinned'], 0)

    def log_text(self):
        with open(self.tmp('qsd.log')) as f:
            return f.read()

    def faulty_records_env(self):
        """An environment whose daemon fails writes to the cache's slot
        records while self.tmp('fault') exists (cc-faultinject.c)."""
        so = self.tmp('cc-faultinject.so')
        subprocess.run(['cc', '-shared', '-fPIC', '-O2', '-o', so,
                        os.path.join(HERE, 'cc-faultinject.c'), '-ldl'],
                       check=True)
        L = self.layout()
        return dict(os.environ, LD_PRELOAD=so, CC_FAULT_FLAG=self.tmp('fault'),
                    CC_FAULT_FILE=self.cache, CC_FAULT_LO=str(L['slot_off']),
                    CC_FAULT_HI=str(L['entry_off']))

    def test_pin_and_unpin_record_failures_keep_memory_as_disk(self):
        """A pin or unpin whose slot record cannot be written is undone in
        memory, so that memory says what the disk says (and a restart
        finds the same): prewarm stops with a message, unpin fails with
        an error naming the count."""
        path = self.make_base('base.img', size=1 * MiB)
        bases = [('b0', path, ',base-id=P')]
        self.start(bases)
        self.qsd.cmd('clone-cache-record', **{'node-name': 'b0'})
        self.read_all('b0')
        trace = self.tmp('boot.trace')
        self.qsd.cmd('clone-cache-record-stop', filename=trace,
                     **{'node-name': 'b0'})
        self.settle()
        self.qsd.stop()
        env = self.faulty_records_env()
        fault = self.tmp('fault')

        # pin fails: nothing pinned, in memory or after a restart
        self.start(bases, env=env)
        open(fault, 'w').close()
        self.qsd.cmd('clone-cache-prewarm', filename=trace, pin=True,
                     **{'node-name': 'b0'})
        deadline = time.monotonic() + 30
        while 'prewarming node' not in self.log_text():
            self.assertLess(time.monotonic(), deadline, 'prewarm never stopped')
            time.sleep(0.05)
        self.assertIn("prewarming node 'b0' stopped at block 0 of 16",
                      self.log_text())
        self.assertEqual(self.info()['pinned'], 0)
        os.unlink(fault)
        self.qsd.stop()
        self.start(bases, env=env)
        self.assertEqual(self.info()['pinned'], 0)

        # pinned for real, then unpin fails: still pinned, here and after
        self.qsd.cmd('clone-cache-prewarm', filename=trace, pin=True,
                     **{'node-name': 'b0'})
        deadline = time.monotonic() + 30
        while self.info()['pinned'] < 16:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.05)
        open(fault, 'w').close()
        r = self.qsd.qmp('clone-cache-unpin', **{'node-name': 'b0'})
        self.assertIn('16 pinned blocks could not be unpinned',
                      r['error']['desc'])
        self.assertEqual(self.info()['pinned'], 16)
        os.unlink(fault)
        self.qsd.stop()
        self.start(bases)
        self.assertEqual(self.info()['pinned'], 16)
        self.qsd.cmd('clone-cache-unpin', **{'node-name': 'b0'})
        self.assertEqual(self.info()['pinned'], 0)

    def test_a_miss_that_cannot_be_cached_reads_only_what_was_asked(self):
        """While the fill backlog is full (fill-limit), a miss reads only
        the bytes asked for from the base, not whole blocks that would not
        be cached; once it drains, a miss reads its whole block again.
        The filler is held with every write to the cache file waiting
        (cc-faultinject.c, CC_STALL_FLAG)."""
        path = self.make_base('base.img', size=1 * MiB)
        want = open(path, 'rb').read()
        bases = [('b0', path, ',base-id=F')]
        self.start(bases)
        self.qsd.stop()
        env = self.faulty_records_env()
        stall = env['CC_STALL_FLAG'] = self.tmp('stall')
        self.start(bases, cache_opts=f',fill-limit={BS}', env=env)
        open(stall, 'w').close()
        self.io('b0', 'read 0 4096')            # a whole block, then queued
        b = self.base('F')
        self.assertEqual((b['misses'], b['base-read-bytes']), (1, BS))
        self.io('b0', f'read {BS} 4096', f'read {3 * BS + 8192} 8192')
        b = self.base('F')
        self.assertEqual((b['misses'], b['fills-dropped'], b['base-read-bytes']),
                         (3, 2, BS + 4096 + 8192))
        self.assertEqual(self.read_all('b0'), want)
        os.unlink(stall)
        self.assertEqual(self.settle()['used'], 1)
        before = self.base('F')['base-read-bytes']
        self.io('b0', f'read {BS} 4096')
        self.assertEqual(self.base('F')['base-read-bytes'] - before, BS)

    def test_hostile_traces_are_refused(self):
        path = self.make_base('base.img', size=1 * MiB)
        self.start([('b0', path, '')])
        cases = {
            'garbage': b'\x00\xff' * 100,
            'wrong-geometry': b'clone-cache-trace 1 4096 256\n1\n',
            'out-of-range': b'clone-cache-trace 1 65536 16\n3\n16\n',
            'not-a-number': b'clone-cache-trace 1 65536 16\n3\nx\n',
            'negative': b'clone-cache-trace 1 65536 16\n-1\n',
        }
        for name, text in cases.items():
            p = self.tmp(name)
            with open(p, 'wb') as f:
                f.write(text)
            r = self.qsd.qmp('clone-cache-prewarm', filename=p,
                             **{'node-name': 'b0'})
            self.assertIn('error', r, name)
            self.assertRegex(r['error']['desc'],
                             'not a clone-cache trace|block size|line',
                             name)
        r = self.qsd.qmp('clone-cache-prewarm', filename=self.tmp('none'),
                         **{'node-name': 'b0'})
        self.assertIn('Cannot read trace', r['error']['desc'])
        r = self.qsd.qmp('clone-cache-record-stop', filename=self.tmp('t'),
                         **{'node-name': 'b0'})
        self.assertIn('not recording', r['error']['desc'])
        r = self.qsd.qmp('clone-cache-record', **{'node-name': 'f-b0'})
        self.assertIn('not a clone-cache node', r['error']['desc'])

    # -- faults --

    def test_sigkill_during_fills_never_serves_wrong_data(self):
        path = self.make_base('base.img', size=8 * MiB)
        want = open(path, 'rb').read()
        bases = [('b0', path, ',base-id=K')]
        for i in range(4):
            self.start(bases)
            p = subprocess.Popen(
                [H.binary('qemu-img'), 'convert', '-f', 'raw', '-O', 'raw',
                 self.uri('b0'), self.tmp('sink')],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.05 + 0.1 * i)
            self.qsd.proc.send_signal(signal.SIGKILL)
            p.wait(60)
            self.qsd.kill()
            self.qsd = None
            self.start(bases)
            self.assertEqual(self.read_all('b0'), want, f'round {i}')
            self.settle()
            self.qsd.stop()
            self.qsd = None

    def corrupt(self, offset, n=16):
        with open(self.cache, 'r+b') as f:
            f.seek(offset)
            old = f.read(n)
            f.seek(offset)
            f.write(bytes(b ^ 0x5a for b in old))

    def layout(self):
        """Offsets from the superblock (docs/clone-cache-format.rst)."""
        import struct
        with open(self.cache, 'rb') as f:
            sb = f.read(80)
        (magic, version, bsz, nslots, nent, base_off, slot_off, entry_off,
         sum_off, data_off) = struct.unpack('<8sIIQQQQQQQ', sb[:72])
        self.assertEqual(magic, b'QCLNCCH1')
        return dict(bsz=bsz, nslots=nslots, slot_off=slot_off,
                    entry_off=entry_off, sum_off=sum_off, data_off=data_off)

    def test_damaged_data_and_records_are_discarded_not_served(self):
        path = self.make_base('base.img', size=4 * MiB)
        want = open(path, 'rb').read()
        bases = [('b0', path, ',base-id=D')]
        self.start(bases)
        self.read_all('b0')
        self.settle()
        self.qsd.stop()
        L = self.layout()
        self.corrupt(L['data_off'] + 3 * L['bsz'] + 100)      # data of slot 3
        self.corrupt(L['slot_off'] + 5 * 32 + 4, 4)           # slot 5's record
        self.corrupt(L['entry_off'] + 9 * 32 + 8, 4)          # an entry
        self.corrupt(L['sum_off'] + 11 * (L['bsz'] // 4096) * 4 + 8, 4)  # sums
        self.start(bases)
        c = self.info()
        self.assertEqual(c['discarded-records'], 3)
        self.assertEqual(self.read_all('b0'), want)
        c = self.settle()
        self.assertEqual(c['checksum-errors'], 1)
        b = self.base('D')
        self.assertEqual(b['misses'], 4)                       # 4 blocks lost
        self.assertEqual(b['hits'], 4 * MiB // BS - 4)
        self.qsd.stop()
        self.assertIn('discarded', open(self.tmp('qsd.log')).read())

    def test_hits_read_into_the_request_are_checked_there(self):
        """A hit of whole 4 KiB pieces is read straight into the request's
        buffers (no bounce) and checked there: a damaged piece is still
        found, its slot dropped and the block read from the base; a hit of
        part of a piece goes through a bounce buffer."""
        path = self.patterned_base('base.img', 16, 1)
        bases = [('b0', path, ',base-id=Q')]
        self.start(bases)
        self.io('b0', *[f'read -P {b + 1} {b * BS} {BS}' for b in range(16)])
        self.assertEqual(self.settle()['used'], 16)
        self.qsd.stop()
        L = self.layout()
        self.corrupt(L['data_off'] + 3 * L['bsz'] + 2 * 4096 + 100)
        self.start(bases, extra=['--trace', 'clone_cache_read_slot'])
        self.io('b0', *[f'read -P {b + 1} {b * BS + k * 4096} 4096'
                        for b in range(16) for k in range(16)])
        c = self.settle()
        self.assertEqual(c['checksum-errors'], 1)
        b = self.base('Q')
        self.assertEqual(b['misses'] + b['merged-misses'] + b['hits'], 256)
        self.assertGreaterEqual(b['misses'], 1)
        log = self.log_text()
        self.assertIn('direct 1', log)
        self.assertNotIn('direct 0', log)
        self.io('b0', f'read -P 5 {4 * BS + 1000} 512')
        self.assertIn('direct 0', self.log_text())

    def test_requests_of_hits_and_misses_return_the_base_bytes(self):
        """A request over many cache blocks, some cached (one of them
        damaged) and some not, returns the base's bytes: its hits are read
        side by side, the damaged one and the misses from the base."""
        path = self.make_base('base.img', size=1 * MiB)
        want = open(path, 'rb').read()
        bases = [('b0', path, ',base-id=M')]
        self.start(bases)
        self.io('b0', *[f'read {b * BS} {BS}' for b in range(0, 16, 2)])
        self.assertEqual(self.settle()['used'], 8)
        self.qsd.stop()
        L = self.layout()
        self.corrupt(L['data_off'] + 3 * L['bsz'] + 5000)
        self.start(bases)
        self.assertEqual(self.read_all('b0'), want)
        c = self.settle()
        b = self.base('M')
        self.assertEqual(c['checksum-errors'], 1)
        self.assertEqual((b['hits'], b['misses']), (7, 9))
        # and once more, all of them hits now
        self.assertEqual(self.read_all('b0'), want)
        self.assertEqual(self.base('M')['hits'], 7 + 16)

    def test_sums_are_crc32c_as_the_format_says(self):
        """The sum table holds the CRC-32C of every 4 KiB piece
        (docs/clone-cache-format.rst), whichever way the daemon computes
        it (the CPU's instruction or a table)."""
        from test_hybrid import crc32c      # without the final xor
        path = self.make_base('base.img', size=4 * BS)
        data = open(path, 'rb').read()
        self.start([('b0', path, ',base-id=S')])
        self.read_all('b0')
        self.assertEqual(self.settle()['used'], 4)
        self.qsd.stop()
        L = self.layout()
        spb = L['bsz'] // 4096
        with open(self.cache, 'rb') as f:
            for slot in range(4):
                f.seek(L['data_off'] + slot * L['bsz'])
                block = f.read(L['bsz'])
                self.assertIn(block, [data[i:i + BS] for i in range(0, len(data), BS)])
                f.seek(L['sum_off'] + slot * spb * 4)
                row = f.read(spb * 4)
                for k in range(spb):
                    piece = block[k * 4096:(k + 1) * 4096]
                    self.assertEqual(int.from_bytes(row[k * 4:k * 4 + 4], 'little'),
                                     crc32c(piece) ^ 0xffffffff, (slot, k))

    def test_hits_are_read_with_io_uring(self):
        """The cache file is read with io_uring (where QEMU has it), not
        through the thread pool: a base left on the thread pool (aio
        default) shows which requests are the cache's."""
        path = self.make_base('base.img', size=1 * MiB)
        bases = [('b0', path, ',base-id=U')]
        self.start(bases)
        self.read_all('b0')
        self.assertEqual(self.settle()['used'], 16)
        self.qsd.stop()
        L = self.layout()
        self.start(bases, extra=['--trace', 'luring_co_submit'])
        self.io('b0', f'read 0 {BS}')
        self.assertEqual(self.base('U')['hits'], 1)
        reads = [int(m.group(1)) for m in re.finditer(
            r'luring_co_submit .* offset (\d+) nbytes 65536 type 1', self.log_text())]
        self.assertTrue(reads and all(r >= L['data_off'] for r in reads),
                        self.log_text()[-2000:])

    def test_damaged_superblock_starts_empty(self):
        path = self.make_base('base.img', size=1 * MiB)
        bases = [('b0', path, '')]
        self.start(bases)
        self.read_all('b0')
        self.settle()
        self.qsd.stop()
        self.corrupt(20, 4)
        self.start(bases)
        self.assertEqual(self.info()['used'], 0)
        self.assertEqual(self.read_all('b0'), open(path, 'rb').read())
        self.qsd.stop()
        self.assertIn('superblock is damaged', open(self.tmp('qsd.log')).read())

    def test_a_file_that_is_not_a_cache_is_never_overwritten(self):
        """Only a new or empty file, or a file that is already a clone
        cache, may become one: anything else is refused with a message
        naming it, and not one byte of it changes (also when its first
        4 KiB are zero, and through a symlink)."""
        base = self.make_base('b.img', size=1 * MiB)
        zero_head = bytes(4096) + b'precious data' * 1000
        cases = {'precious': b'precious data' * 1000,
                 'zero-head': zero_head,
                 'one-zero-page': bytes(4096)}
        for name, content in cases.items():
            victim = self.tmp(name)
            with open(victim, 'wb') as f:
                f.write(content)
            link = self.tmp(name + '.link')
            os.symlink(victim, link)
            for path in (victim, link):
                self.cache = path
                with self.assertRaisesRegex(
                        RuntimeError, f"'{re.escape(path)}' is not a clone "
                        "cache file.*refusing to overwrite it"):
                    self.start([('b0', base, '')])
                self.qsd = None
                self.assertEqual(open(victim, 'rb').read(), content, path)
        # an empty file is taken
        self.cache = self.tmp('empty')
        open(self.cache, 'wb').close()
        self.start([('b0', base, '')])
        self.assertEqual(self.read_all('b0'), open(base, 'rb').read())

    def refused(self, *args):
        """qemu-storage-daemon exits at once with an error: its message."""
        r = subprocess.run([H.binary('qemu-storage-daemon')] + list(args),
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stdout)
        return r.stderr

    def test_bad_options_are_refused(self):
        path = self.make_base('base.img', size=1 * MiB)
        obj = f'clone-cache,id=c,filename={self.cache},size=16M'
        for opts, msg in [(',block-size=3000', 'power of two'),
                          (',block-size=4M', 'power of two'),
                          (',x-fingerprint-bits=0', 'x-fingerprint-bits'),
                          (',fill-limit=1', 'fill-limit'),
                          (',size=64K', 'holds fewer than 16')]:
            self.assertIn(msg, self.refused('--object', obj + opts))
        base = ['--blockdev', f'file,node-name=f,filename={path},'
                'read-only=on']
        self.assertIn("No clone-cache object with id 'nope'", self.refused(
            *base, '--blockdev',
            'clone-cache,node-name=b,store=nope,file=f,read-only=on'))
        self.assertIn('clone-cache nodes are read-only', self.refused(
            '--object', obj, *base, '--blockdev',
            'clone-cache,node-name=b,store=c,file=f'))
        self.assertIn('base-id must be 1 to 488 bytes', self.refused(
            '--object', obj, *base, '--blockdev',
            'clone-cache,node-name=b,store=c,file=f,read-only=on,'
            'base-id=' + 'x' * 489))

    def test_generation_change_drops_the_base_entries(self):
        path = self.make_base('base.img', size=1 * MiB)
        self.start([('b0', path, ',base-id=G,generation=1')])
        self.read_all('b0')
        self.assertEqual(self.settle()['used'], 16)
        self.restart([('b0', path, ',base-id=G,generation=2')])
        self.assertEqual(self.base('G')['entries'], 0)
        self.assertEqual(self.base('G')['generation'], 2)
        # a file base without generation=: rewriting it voids its entries
        self.restart([('b0', path, '')])
        self.read_all('b0')
        self.settle()
        self.qsd.stop()
        new = rand_bytes(self.rnd, 1 * MiB)
        with open(path, 'wb') as f:
            f.write(new)
        self.start([('b0', path, '')])
        self.assertEqual(self.read_all('b0'), new)

    def test_a_replaced_base_with_its_old_mtime_is_not_served_stale(self):
        """cp -p and rsync -t restore a file's mtime, and a file rewritten
        in place keeps its inode and size: the default generation comes
        from what a user cannot restore (ctime, device, inode, size)."""
        path = self.make_base('base.img', size=1 * MiB)
        self.start([('b0', path, '')])
        self.read_all('b0')
        self.settle()
        self.qsd.stop()
        st = os.stat(path)
        new = rand_bytes(self.rnd, 1 * MiB)
        with open(path, 'r+b') as f:            # same inode, same size
            f.write(new)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        st2 = os.stat(path)
        self.assertEqual((st2.st_ino, st2.st_size, st2.st_mtime_ns),
                         (st.st_ino, st.st_size, st.st_mtime_ns))
        self.start([('b0', path, '')])
        self.assertEqual(self.read_all('b0'), new)

    def test_invalidate_a_base_changed_in_place_while_served(self):
        """A base changed in place while the daemon runs is not detected
        (documented); clone-cache-invalidate tells the cache, and reads
        then come from the base again, through every node of that base."""
        path = self.make_base('base.img', size=1 * MiB)
        old = open(path, 'rb').read()
        self.start([('b0', path, ',base-id=rbd/vdi@gold')])
        self.assertEqual(self.read_all('b0'), old)
        self.settle()
        new = rand_bytes(self.rnd, 1 * MiB)
        with open(path, 'r+b') as f:
            f.write(new)
        self.assertEqual(self.read_all('b0'), old)       # the known limit
        # the command as docs/clone-cache.md shows it, and its answer
        with open(os.path.join(HERE, '..', '..', 'docs', 'clone-cache.md')) as f:
            doc = f.read()
        block = re.search(r'```(?:text)?\n(\{"execute": "clone-cache-invalidate".*?)```',
                          doc, re.S).group(1).splitlines()
        req, want = json.loads(block[0]), json.loads(block[1])
        self.assertEqual(self.qsd.qmp(req['execute'], **req['arguments']), want)
        self.assertEqual(self.base('rbd/vdi@gold')['entries'], 0)
        self.assertEqual(self.read_all('b0'), new)
        self.settle()
        self.assertEqual(self.read_all('b0'), new)       # and cached anew
        self.assertEqual(self.base('rbd/vdi@gold')['entries'], 1 * MiB // BS)

    def test_hostile_invalidate_and_delay_are_refused(self):
        """What a QMP client gives the new command and property is checked:
        unknown objects and bases (a 64 KiB name, an object that is not a
        clone cache, a path) change nothing; the test-only delay takes only
        a number and is capped at 10 s; the daemon keeps serving."""
        path = self.make_base('base.img', size=1 * MiB)
        want = open(path, 'rb').read()
        self.start([('b0', path, ',base-id=H')])
        self.read_all('b0')
        self.settle()
        for args, msg in [(dict(id='nope', **{'base-id': 'H'}),
                           "No clone-cache object with id 'nope'"),
                          (dict(id='/objects/cc0', **{'base-id': 'H'}),
                           "No clone-cache object"),
                          (dict(id='cc0', **{'base-id': 'W'}),
                           "has no base 'W'"),
                          (dict(id='cc0', **{'base-id': 'x' * 65536}),
                           'has no base'),
                          (dict(id='cc0'), "'base-id' is missing")]:
            r = self.qsd.qmp('clone-cache-invalidate', **args)
            self.assertIn(msg, r['error']['desc'])
        self.assertEqual(self.base('H')['entries'], 1 * MiB // BS)
        for value in ('slow', 1.5, [1]):
            r = self.qsd.qmp('qom-set', path='/objects/cc0',
                             property='x-read-delay-ns', value=value)
            self.assertIn('error', r, value)
        # QEMU's input visitor takes -1 for a uint64 as 2^64 - 1: capped too
        for value in (3600 * 10**9, -1):
            self.qsd.cmd('qom-set', path='/objects/cc0',
                         property='x-read-delay-ns', value=value)
            self.assertEqual(self.qsd.cmd('qom-get', path='/objects/cc0',
                                          property='x-read-delay-ns'), 10**10)
        self.qsd.cmd('qom-set', path='/objects/cc0',
                     property='x-read-delay-ns', value=0)
        self.assertEqual(self.read_all('b0'), want)

    def test_a_second_generation_of_an_open_base_is_refused(self):
        """Two nodes may share a base-id only with one generation: a node
        with another would have the first node's reads cached as its own
        (or drop the blocks the first node is reading)."""
        path = self.make_base('base.img', size=1 * MiB)
        self.start([('b0', path, ',base-id=T,generation=1')])
        self.read_all('b0')
        self.settle()
        r = self.qsd.qmp('blockdev-add', driver='clone-cache',
                         **{'node-name': 'b1', 'store': 'cc0',
                            'file': 'f-b0', 'read-only': True,
                            'base-id': 'T', 'generation': 2})
        self.assertIn("base 'T' is open with generation 1 (node 'b0')",
                      r['error']['desc'])
        self.assertEqual(self.base('T')['entries'], 1 * MiB // BS)
        self.qsd.cmd('blockdev-add', driver='clone-cache',
                     **{'node-name': 'b1', 'store': 'cc0', 'file': 'f-b0',
                        'read-only': True, 'base-id': 'T', 'generation': 1})
        self.assertEqual(self.base('T')['entries'], 1 * MiB // BS)

    def test_invalidate_is_immediate_and_freed_in_bounded_steps(self):
        """Invalidating a base voids its entries at once (O(1) under the
        store lock) and a background sweep frees them a step of at most
        4096 entries at a time, yielding between steps, instead of one scan
        of the whole table under the lock that requests also take."""
        nblocks = 24 * MiB // 4096                  # 6144 entries: two steps
        path = self.make_base('base.img', size=24 * MiB)
        self.start([('b0', path, ',base-id=S')], size=64 * MiB,
                   cache_opts=',block-size=4096',
                   extra=['--trace', 'clone_cache_sweep_*'])
        self.read_all('b0')
        self.assertEqual(self.settle()['used'], nblocks)
        self.qsd.cmd('clone-cache-invalidate', id='cc0', **{'base-id': 'S'})
        self.assertEqual(self.base('S')['entries'], 0)   # void at once
        self.trace_seen('clone_cache_sweep_done')
        log = self.log_text()
        steps = [int(m) for m in re.findall(r'clone_cache_sweep_step .*'
                                            r'next entry (\d+)', log)]
        self.assertGreaterEqual(len(steps), 2, log[-2000:])
        self.assertTrue(all(0 < b - a <= 4096 for a, b in
                            zip([0] + steps, steps)), steps)
        self.assertIn(f'{nblocks} stale entries freed', log)
        self.assertEqual(self.info()['used'], 0)
        self.assertEqual(self.read_all('b0'), open(path, 'rb').read())

    # -- readers against the filler --

    def patterned_base(self, name, nblocks, first):
        """A base whose block i is filled with byte first + i (distinct
        blocks: no two share a slot)."""
        return self.make_base(name, data=b''.join(
            bytes([first + i]) * BS for i in range(nblocks)))

    def trace_seen(self, event, count=1, timeout=30):
        deadline = time.monotonic() + timeout
        while self.log_text().count(event) < count:
            self.assertLess(time.monotonic(), deadline, f'no {event}')
            time.sleep(0.02)

    def test_a_slot_being_read_is_never_reused(self):
        """A reader holds its slot: dropped under it (here: the base is
        invalidated), the slot stays off the free list until the reader
        lets go, and the reader sees the change and reads the base.
        Forced interleaving: a reader paused (x-read-delay-ns) after its
        lookup, while every slot of a full 16-slot cache is dropped and
        refilled with other blocks."""
        path = self.patterned_base('base.img', 32, 1)
        # 1216 KiB holds exactly 16 slots of 64 KiB (docs/clone-cache-format.rst)
        self.start([('b0', path, ',base-id=K')], size=1216 * KiB,
                   extra=['--trace', 'clone_cache_read_delay'])
        self.assertEqual(self.info()['slots'], 16)
        self.io('b0', *[f'read -P {i + 1} {i * BS} {BS}' for i in range(16)])
        self.assertEqual(self.settle()['used'], 16)
        self.qsd.cmd('qom-set', path='/objects/cc0',
                     property='x-read-delay-ns', value=3 * 10**9)
        r1 = subprocess.Popen(
            [H.binary('qemu-io'), '-r', '-f', 'raw', '-c', 'read -P 1 0 4k',
             self.uri('b0')], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.trace_seen('clone_cache_read_delay')
        self.qsd.cmd('qom-set', path='/objects/cc0',
                     property='x-read-delay-ns', value=0)
        self.qsd.cmd('clone-cache-invalidate', id='cc0', **{'base-id': 'K'})
        self.io('b0', *[f'read -P {i + 1} {i * BS} {BS}'
                        for i in range(16, 32)])
        c = self.settle()
        self.assertGreaterEqual(c['used'], 15)
        out = r1.communicate(timeout=60)[0]
        self.assertEqual(r1.returncode, 0, out)
        self.assertNotIn('fail', out)          # "Pattern verification failed"
        self.assertIn('read 4096/4096 bytes', out)

    def test_stress_readers_checksum_failures_and_invalidations(self):
        """Many readers on two nodes of one base-id and on a second base,
        a cache too small for them (evictions), cached blocks damaged
        under the readers (checksum failures drop slots others read) and
        the shared base invalidated again and again: every read returns
        the base's bytes."""
        nblocks = 48
        k = self.patterned_base('k.img', nblocks, 1)
        m = self.patterned_base('m.img', nblocks, 101)
        self.start([('b0', k, ',base-id=K'), ('b1', k, ',base-id=K'),
                    ('m0', m, ',base-id=M')], size=2 * MiB)
        L = self.layout()
        rnd = random.Random(35)

        def reader(r):
            node, first = [('b0', 1), ('b1', 1), ('m0', 101)][r % 3]
            cmds = []
            for _ in range(150):
                b = rnd.randrange(nblocks)
                off = rnd.randrange(0, BS, 4096)
                ln = min(rnd.choice([4096, 8192, BS]), BS - off)
                cmds += ['-c', f'read -P {first + b} {b * BS + off} {ln}']
            return subprocess.Popen(
                [H.binary('qemu-io'), '-r', '-f', 'raw'] + cmds +
                [self.uri(node)], stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)

        def check(p):
            out = p.communicate()[0]
            odd = [line for line in out.splitlines() if not re.match(
                r'(read \d+/\d+ bytes at offset \d+|[\d.]+ [KM]iB, 1 ops;)',
                line)]
            self.assertEqual((p.returncode, odd[:20]), (0, []))
            self.assertEqual(out.count('read '), 150)

        readers = [reader(r) for r in range(6)]
        rounds = runs = 0
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            rounds += 1
            self.qsd.cmd('qom-set', path='/objects/cc0',
                         property='x-read-delay-ns',
                         value=rnd.choice([0, 10**6, 5 * 10**6]))
            slot = rnd.randrange(L['nslots'])
            self.corrupt(L['data_off'] + slot * L['bsz'] +
                         rnd.randrange(BS - 16))
            if rounds % 4 == 0:
                self.qsd.cmd('clone-cache-invalidate', id='cc0',
                             **{'base-id': 'K'})
            for r, p in enumerate(readers):
                if p.poll() is not None:
                    check(p)
                    runs += 1
                    readers[r] = reader(r)
            time.sleep(0.02)
        for p in readers:
            check(p)
        c = self.settle()
        self.assertGreater(rounds, 40)
        self.assertGreater(runs, 6)
        self.assertGreater(c['checksum-errors'], 0)
        self.assertGreater(c['evictions'], 0)

    def test_full_cache_file_system_reads_from_the_base(self):
        mnt = self.tmp('small')
        os.mkdir(mnt)
        r = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs',
                            mnt], capture_output=True, text=True)
        if r.returncode:
            self.skipTest(f'cannot mount a small tmpfs: {r.stderr.strip()}')
        try:
            self.cache = os.path.join(mnt, 'c.cache')
            path = self.make_base('base.img', size=4 * MiB)
            want = open(path, 'rb').read()
            self.start([('b0', path, ',base-id=F')])
            for _ in range(2):
                self.assertEqual(self.read_all('b0'), want)
                c = self.settle()
            self.assertGreater(c['fill-errors'], 0)
            self.qsd.stop()
            self.assertIn('writing the cache failed',
                          open(self.tmp('qsd.log')).read())
            self.qsd = None
        finally:
            if self.qsd:
                self.qsd.kill()
                self.qsd = None
            subprocess.run(['umount', '-l', mnt])

    def test_base_read_error_reaches_the_client(self):
        path = self.make_base('base.img', size=1 * MiB)
        args = ['--object', f'clone-cache,id=cc0,filename={self.cache},'
                'size=16M', '--nbd-server',
                f'addr.type=unix,addr.path={self.tmp("nbd.sock")}',
                '--blockdev', f'file,node-name=f,filename={path},'
                'read-only=on',
                '--blockdev', '{"driver":"blkdebug","node-name":"dbg",'
                '"read-only":true,"image":"f","inject-error":'
                '[{"event":"read_aio","errno":5}]}',
                '--blockdev', 'clone-cache,node-name=b0,store=cc0,file=dbg,'
                'read-only=on', '--export', 'nbd,id=e,node-name=b0']
        self.qsd = H.StorageDaemon(self.tmp, *args)
        out = self.io('b0', 'read 0 4k', check=False)
        self.assertIn('Input/output error', out)
        self.assertEqual(self.info()['used'], 0)

    # -- users --

    def test_qcow2_overlay_on_the_export_keeps_writes_local(self):
        path = self.make_base('base.img', size=4 * MiB)
        want = open(path, 'rb').read()
        self.start([('b0', path, ',base-id=O')])
        ov = self.tmp('vm1.qcow2')
        H.qemu_img('create', '-f', 'qcow2', '-b', self.uri('b0'), '-F',
                   'raw', ov)
        H.qemu_io('-f', 'qcow2', '-c', 'write -P 0xab 64k 4k', ov)
        out = H.qemu_io('-f', 'qcow2', '-c', 'read -P 0xab 64k 4k', ov)
        self.assertNotIn('fail', out.stdout + out.stderr)
        self.assertEqual(open(path, 'rb').read(), want)
        self.assertEqual(self.read_all('b0'), want)

    def test_killed_daemon_the_vm_reconnects_and_is_served_warm(self):
        """A VM's overlay on the export: the daemon is SIGKILLed; a read
        issued while it is gone waits (NBD reconnect-delay) and completes
        once a new daemon serves the export, from the cache kept warm."""
        path = self.make_base('base.img', size=2 * MiB)
        want = open(path, 'rb').read()
        bases = [('b0', path, ',base-id=R')]
        self.start(bases)
        ov = self.tmp('vm.qcow2')
        backing = json.dumps({'driver': 'raw', 'file': {
            'driver': 'nbd', 'export': 'b0', 'reconnect-delay': 30,
            'server': {'type': 'unix', 'path': self.tmp('nbd.sock')}}})
        H.qemu_img('create', '-f', 'qcow2', '-b', 'json:' + backing, '-F',
                   'raw', ov)
        vm = H.QemuIo(f'driver=qcow2,file.filename={ov}')
        try:
            out = vm.cmd(f'read -v 0 {MiB}')
            self.assertNotIn('failed', out)
            self.settle()
            self.qsd.kill()
            self.qsd = None
            vm.send(f'read {MiB} {MiB}')           # waits for the server
            time.sleep(1)
            self.start(bases)
            out = vm._wait_prompt(60)
            self.assertIn(f'read {MiB}/{MiB} bytes', out)
            out = vm.cmd(f'read -v 0 {64 * KiB}')
            got = b''.join(
                bytes.fromhex(m.group(1)) for m in
                (re.match(r'^[0-9a-f]{8}:  ((?:[0-9a-f]{2} )+)', line)
                 for line in out.splitlines()) if m)
            self.assertEqual(got, want[:64 * KiB])
        finally:
            vm.kill()
        b = self.base('R')
        self.assertEqual(b['hits'], 1)                 # warm after restart
        self.assertEqual(b['misses'], MiB // BS)       # the second MiB

    def test_hmp_info_clone_cache(self):
        path = self.make_base('base.img', size=1 * MiB)
        self.start([('b0', path, ',base-id=hmp-base')], system=True)
        out = self.qsd.cmd('human-monitor-command',
                           **{'command-line': 'info clone-cache'})
        self.assertIn('cc0:', out)
        self.assertRegex(out, r'base hmp-base \(generation \d+\) open as b0: ')


if __name__ == '__main__':
    unittest.main()
