"""Async write-back of the hybrid format: what goes to the persistent tier
in how many requests, and when a writer waits at dirty-limit.

Contiguous dirty blocks are written back as one request of up to 1 MiB,
made from RAM itself (the trace event hybrid_writeback shows each request); a rewrite of data
that is still dirty adds nothing to write back and does not wait at
dirty-limit, while a write of new data does."""

import os
import re
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

KiB = 1024
MiB = 1024 * KiB
BLOCK = 64 * KiB
WB = re.compile(r'hybrid_writeback s \S+ block (\d+) offset (\d+) len (\d+) ret (-?\d+)')


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class WritebackRunTest(unittest.TestCase):

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('wb.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=32M',
                   self.img, '32M')

    def tearDown(self):
        self.tmp.cleanup()

    def writebacks(self, *cmds, opts=''):
        """Run qemu-io commands in async mode, then a flush; the write-back
        requests the trace shows, as (first block, offset, length)."""
        r = H.qemu_io('-t', 'writeback', '--trace', 'hybrid_writeback',
                      '--image-opts',
                      f'driver=hybrid,mode=async{opts},file.driver=file,'
                      f'file.filename={self.img}',
                      *[a for c in cmds + ('flush',) for a in ('-c', c)])
        self.assertNotIn('failed', r.stdout)
        got = [tuple(int(x) for x in m.groups()) for m in WB.finditer(r.stderr)]
        self.assertTrue(all(g[3] == 0 for g in got), got)
        return [g[:3] for g in got]

    def assert_reads(self, *pattern_ranges):
        cmds = [a for p, off, n in pattern_ranges
                for a in ('-c', f'read -P {p} {off} {n}')]
        out = H.qemu_io('-r', '-f', 'hybrid', *cmds, self.img).stdout
        self.assertNotIn('failed', out)
        self.assertNotIn('Pattern verification failed', out)

    def test_contiguous_blocks_go_back_in_one_request(self):
        got = self.writebacks('write -P 1 1M 1M', 'write -P 2 3M 64k')
        self.assertEqual(sorted(got), [(16, 0, MiB), (48, 0, BLOCK)])
        self.assert_reads((1, MiB, MiB), (2, 3 * MiB, BLOCK))

    def test_runs_are_split_at_1m_and_at_clean_blocks(self):
        got = self.writebacks('write -P 3 4M 3M',
                              'write -P 4 10M 64k', 'write -P 5 10368k 64k')
        self.assertEqual(sorted(got), [(64, 0, MiB), (80, 0, MiB), (96, 0, MiB),
                                       (160, 0, BLOCK), (162, 0, BLOCK)])
        self.assert_reads((3, 4 * MiB, 3 * MiB), (4, 10 * MiB, BLOCK),
                          (5, 10368 * KiB, BLOCK), (0, 10 * MiB + BLOCK, BLOCK))

    def test_partial_spans_at_both_ends(self):
        """A span from 4 KiB into the first block to 4 KiB short of the end
        of the last: one request of exactly the dirty bytes."""
        got = self.writebacks('write -P 6 8196k 1016k')
        self.assertEqual(got, [(128, 4 * KiB, MiB - 8 * KiB)])
        self.assert_reads((0, 8 * MiB, 4 * KiB), (6, 8196 * KiB, 1016 * KiB),
                          (0, 9 * MiB - 4 * KiB, 4 * KiB))

    def test_zeroed_blocks_go_as_write_zeroes_runs(self):
        """Blocks with no data in RAM (zeroed) make runs of their own, sent
        as write-zeroes; the data blocks after them, a run of their own."""
        H.qemu_io('-f', 'hybrid', '-c', 'write -P 9 12M 4M', self.img)
        got = self.writebacks('write -z 12M 128k', 'write -P 7 12416k 128k',
                              'write -z 14M 256k')
        self.assertEqual(sorted(got), [(192, 0, 2 * BLOCK), (194, 0, 2 * BLOCK),
                                       (224, 0, 4 * BLOCK)])
        self.assert_reads((0, 12 * MiB, 2 * BLOCK), (7, 12 * MiB + 2 * BLOCK, 2 * BLOCK),
                          (9, 12 * MiB + 4 * BLOCK, 2 * MiB - 4 * BLOCK),
                          (0, 14 * MiB, 256 * KiB), (9, 14 * MiB + 256 * KiB, 256 * KiB))

    def test_dedup_blocks_go_back_in_one_request(self):
        got = self.writebacks('write -P 1 1M 512k', opts=',dedup=on')
        self.assertEqual(got, [(16, 0, 512 * KiB)])
        self.assert_reads((1, MiB, 512 * KiB))


class ThrottledTierCase(unittest.TestCase):
    """A hybrid node (async, dirty-limit LIMIT) in a qemu-storage-daemon,
    exported over NBD to a qemu-io, its persistent tier throttled to
    4 KiB/s: a 64 KiB write-back takes 16 s, so what is dirty stays dirty
    for the length of a test."""

    LIMIT = BLOCK

    def setUp(self):
        self.tmp = H.TempDir()
        img = self.tmp('tier.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=4M', img, '4M')
        sock = self.tmp('nbd.sock')
        self.qsd = H.StorageDaemon(
            self.tmp, '--object', 'throttle-group,id=tg0,x-bps-write=4096',
            '--blockdev', f'driver=hybrid,node-name=h,mode=async,'
            f'dirty-limit={self.LIMIT},file.driver=throttle,'
            f'file.throttle-group=tg0,file.file.driver=file,'
            f'file.file.filename={img}',
            '--nbd-server', f'addr.type=unix,addr.path={sock}',
            '--export', 'type=nbd,id=e,node-name=h,name=h,writable=on')
        self.io = H.QemuIo(f'driver=nbd,server.type=unix,server.path={sock},export=h')

    def tearDown(self):
        # a clean close would write back at 4 KiB/s
        self.io.kill()
        self.qsd.kill()
        self.tmp.cleanup()

    def info(self):
        return self.qsd.cmd('query-hybrid', **{'node-name': 'h'})[0]


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class DirtyLimitTest(ThrottledTierCase):
    """dirty-limit 64 KiB on the throttled tier."""

    def test_rewrite_of_dirty_data_does_not_wait(self):
        # New blocks, not adjacent (one write-back each), until dirty-limit
        # is reached: the write-backs in flight are stuck in the throttle.
        n = 0
        while self.info()['dirty-bytes'] < self.info()['dirty-limit']:
            self.assertLess(n, 12, self.info())
            out = self.io.cmd(f'write -P {n + 1} {2 * n * BLOCK} 64k', timeout=10)
            self.assertIn('wrote 65536/65536', out)
            n += 1
        dirty = self.info()['dirty-bytes']
        # The newest block is the last the flusher would pick: rewrites
        # inside it add nothing to write back and complete at once.
        last = 2 * (n - 1) * BLOCK
        t = time.monotonic()
        for i in range(16):
            out = self.io.cmd(f'write -P 0x55 {last + i * 4 * KiB} 4k', timeout=10)
            self.assertIn('wrote 4096/4096', out)
        self.assertLess(time.monotonic() - t, 5)
        self.assertEqual(self.info()['dirty-bytes'], dirty)
        # New data still waits for the write-back (16 s away)
        self.io.send(f'write -P 0x66 {2 * n * BLOCK} 4k')
        with self.assertRaises(TimeoutError):
            self.io._wait_prompt(2)
        self.assertEqual(self.info()['dirty-bytes'], dirty)


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class FlusherConcurrencyTest(ThrottledTierCase):
    """Past the high watermark (half of dirty-limit) one write-back request
    is in flight while the tier keeps up; more only as dirty data keeps
    growing towards the limit.  Eight at once took the CPU from the writers
    in bursts and stalled the loop serving them (docs/bench/hybrid-tail.md).
    The tier is throttled to 4 KiB/s: after the first request, a 64 KiB
    write-back takes 16 s, so a block taken by the flusher stays in flight
    for the length of the test, and dirty-bytes says how many it took."""

    LIMIT = 16 * BLOCK

    def dirty_blocks(self):
        time.sleep(0.5)     # the flusher's requests go out
        return self.info()['dirty-bytes'] // BLOCK

    def write_blocks(self, first, n):
        # not adjacent: one write-back request each
        for i in range(first, first + n):
            out = self.io.cmd(f'write -P {i + 1} {2 * i * BLOCK} 64k', timeout=10)
            self.assertIn('wrote 65536/65536', out)

    def test_one_request_until_the_tier_falls_behind(self):
        # Half the limit: the burst starts with one request in flight (the
        # first may pass the throttle at once, then the next is taken)
        self.write_blocks(0, 8)
        self.assertIn(self.dirty_blocks(), (6, 7))
        # Towards the limit: more requests, but not one per dirty block
        self.write_blocks(8, 7)
        dirty = self.dirty_blocks()
        self.assertGreaterEqual(dirty, 10)
        self.assertLess(dirty, 15 - 1)


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class StableDuringWritebackTest(unittest.TestCase):
    """Write-back is made from RAM itself: a write to a block whose
    write-back is in flight waits for it to complete, so the persistent
    tier never gets a mix of the old and new data of one request."""

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('st.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=4M', self.img, '4M')

    def tearDown(self):
        self.tmp.cleanup()

    def test_rewrite_waits_for_the_write_back_in_flight(self):
        # 16 KiB/s: after the first request, a 64 KiB write-back takes 4 s
        io = H.QemuIo(f'driver=hybrid,mode=async,dirty-limit=64k,'
                      f'file.driver=throttle,file.throttle-group=tg0,'
                      f'file.file.driver=file,file.file.filename={self.img}',
                      ['--object', 'throttle-group,id=tg0,x-bps-write=16384',
                       '--trace', 'hybrid_writeback'])
        try:
            io.cmd('write -P 1 0 64k')
            # half the limit dirty: the flusher takes block 2 at once
            io.cmd('write -P 2 128k 64k')
            out = io.cmd('write -P 3 132k 4k', timeout=30)
            wb = out.find('block 2 offset 0 len 65536 ret 0')
            self.assertGreaterEqual(wb, 0, out)
            self.assertLess(wb, out.index('wrote 4096/4096'), out)
            io.cmd('flush', timeout=60)
        finally:
            io.kill()
        out = H.qemu_io('-f', 'hybrid', '-c', 'read -P 2 128k 4k', '-c', 'read -P 3 132k 4k',
                        '-c', 'read -P 2 136k 56k', self.img).stdout
        self.assertNotIn('failed', out)


if __name__ == '__main__':
    unittest.main()
