"""A hybrid node's dirty blocks mirrored on another host (mirror=, issue 39).

Here the mirror is a file node on this machine's tmpfs standing in for the
other host's memory region: these tests isolate the mirror's layout,
ordering and crash story (test_hybrid_mirror_hosts.py puts it on another
host, over NBD with TLS).  "The host dies" is a SIGKILL of qemu-io: the
test then uses nothing of the dead writer's memory, only the persistent
tier and the mirror, as the mirror's host would.

- SIGKILL at random moments in async mode, many rounds, then failover: the
  image opened with the mirror as its ram-file holds every acknowledged
  write; so with 32 writes in flight at each kill.  The same rounds
  without a mirror lose writes (the check can fail).
- QEMU dies and the host stays: reopened with mirror=, the node takes the
  mirror's blocks back.
- Blocks written back and flushed leave the mirror.
- A stale mirror (another image's, not yet written back) is refused, as
  ram-file and as mirror.
- A mirror that fails degrades the node: the event, query-hybrid, and
  writes that still complete and are in the persistent tier; and a
  failover cannot replay the failed mirror over them.
- Bad options: dedup, raw, ram-file together, a mirror too small.
HYBRIDVM_LONG=1 runs more kill rounds."""

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hybridlib as H   # noqa: E402

MiB = 1024 * 1024
SLOT = 4096
SIZE = 32 * MiB
RAM = 16 * MiB
BLOCK = 64 * 1024
# header and bitmaps take the first 2 MiB of a region (huge-page aligned)
MIRROR_SIZE = RAM + 2 * MiB
TRACE = ['--trace', 'hybrid_region_attach', '--trace', 'hybrid_mirror_attach',
         '--trace', 'hybrid_mirror_failed']
REGION_ATTACH_RE = re.compile(r'hybrid_region_attach .*reused (\d) loaded (\d+) '
                              r'dirty (\d+)')
MIRROR_ATTACH_RE = re.compile(r'hybrid_mirror_attach .*recovered (\d) blocks (\d+)')


# h0 over f0 with the mirror m0 of failing_mirror(): no prefill, whose
# writes would meet the failing sector before the test's own
FAILING_H0 = 'hybrid,node-name=h0,file=f0,mirror=m0,mode=async,mirror-prefill=off'


def failing_mirror(sector):
    """The mirror m0 over the file node mf, every write touching @sector
    failing with EIO (blkdebug)."""
    return (f'{{"driver": "blkdebug", "node-name": "m0", "image": "mf", "inject-error": '
            f'[{{"event": "pwritev", "errno": 5, "sector": {sector}, "once": false}}]}}')


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class MirrorTest(unittest.TestCase):

    def setUp(self):
        self.tmp = H.TempDir()
        # the "other host's" memory: tmpfs
        self.shm = tempfile.mkdtemp(prefix='hybrid-mirror-', dir='/dev/shm')
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            p.kill()
        shutil.rmtree(self.shm, ignore_errors=True)
        self.tmp.cleanup()

    # -- helpers --

    def mirror(self, name='m', size=MIRROR_SIZE):
        path = os.path.join(self.shm, name)
        with open(path, 'wb') as f:
            f.truncate(size)
        return path

    def image(self, name='d.hyb', extra=''):
        img = self.tmp(name)
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o',
                   f'mode=async,ram-size={RAM}{extra}', img, str(SIZE))
        return img

    @staticmethod
    def opts(img, mirror, extra='', throttled=False):
        tier = (f'file.driver=throttle,file.throttle-group=tg0,file.file.driver=file,'
                f'file.file.filename={img}' if throttled else
                f'file.driver=file,file.filename={img}')
        m = f',mirror.driver=file,mirror.filename={mirror}' if mirror else ''
        return f'driver=hybrid,mode=async,{tier}{m}{extra}'

    def daemon(self, *blockdevs, objects=()):
        """qemu-storage-daemon with the -object @objects and the -blockdev
        JSON/keyval @blockdevs, the hybrid node h0 among them, exported
        over NBD."""
        args = [x for o in objects for x in ('--object', o)] + \
            [x for b in blockdevs for x in ('--blockdev', b)]
        return H.StorageDaemon(
            self.tmp, *args,
            '--nbd-server', f'addr.type=unix,addr.path={self.tmp("nbd.sock")}',
            '--export', 'nbd,id=e0,node-name=h0,writable=on')

    def nbd_io(self):
        """qemu-io on the daemon's export, one connection throughout
        (closing it would flush)."""
        io = H.QemuIo('driver=nbd,server.type=unix,server.path='
                      f'{self.tmp("nbd.sock")},export=h0')
        self.procs.append(io)
        return io

    def qemu_io(self, opts, extra=()):
        io = H.QemuIo(opts, list(extra) + TRACE)
        self.procs.append(io)
        return io

    def fails_to_open(self, opts):
        r = subprocess.run([H.binary('qemu-io'), '--image-opts', opts, '-c', 'quit'],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout + r.stderr

    def image_bytes(self, img):
        return H.image_bytes(img, self.tmp('verify.raw'))

    def failover(self, img, mirror):
        """On the mirror's host: the image opened with the mirror as its
        RAM region, then closed (its blocks written back).  Returns
        (reused, dirty blocks found) from the trace."""
        io = H.QemuIo(f'driver=hybrid,file.driver=file,file.filename={img},'
                      f'ram-file={mirror}', TRACE)
        self.procs.append(io)
        m = REGION_ATTACH_RE.search(io.banner)
        self.assertTrue(m, io.banner)
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        return bool(int(m.group(1))), int(m.group(3))

    def killed_rounds(self, img, mirror, rounds, seed, failover=True, depth=None):
        """Rounds of random 4 KiB writes (some never acknowledged), each
        ended by SIGKILL; after each, the image as the other host finds it
        must hold every acknowledged write.  depth: that many asynchronous
        writes kept in flight, the kill coming under them
        (WriteModel.run_aio), else one at a time and a few sent
        unacknowledged.  Returns the dirty blocks each failover found and,
        with depth, each round's run_aio counts."""
        rnd = random.Random(seed)
        model = H.WriteModel(SIZE // SLOT, rnd, durable='ack')
        obj = ['--object', 'throttle-group,id=tg0,x-iops-write=200']
        # a slow persistent tier and a small dirty limit keep write-backs
        # (and the mirror's clean-ups) in flight at the kill
        opts = self.opts(img, mirror, ',dirty-limit=512k', throttled=True)
        found, aio = [], []
        for n in range(rounds):
            io = self.qemu_io(opts, obj)
            stats = model.round(io, 0.05 if n % 2 else 0.0, depth, ops=(40, 150))
            if stats:
                aio.append(stats)
            io.kill()
            self.procs.remove(io)
            if failover:
                reused, dirty = self.failover(img, mirror)
                self.assertTrue(reused, 'the mirror was not taken at failover')
                found.append(dirty)
            model.check(self.image_bytes(img), f'round {n}: ')
        return found, aio

    # -- the host dies --

    def host_loss(self, depth=None):
        """killed_rounds with a mirror and a failover after each kill;
        returns their run_aio counts."""
        img, mirror = self.image(), self.mirror()
        rounds = 30 if H.LONG else 6
        found, aio = self.killed_rounds(img, mirror, rounds,
                                        int(os.environ.get('HYBRID_SEED', '3939')),
                                        depth=depth)
        # rounds without flushes always leave blocks in the mirror (a
        # flushing one may have just written everything back)
        self.assertTrue(all(found[0::2]), f'a round without flushes left nothing '
                        f'in the mirror ({found}): it did not test the failover')
        print(f'{rounds} kills; dirty blocks each failover found: {found}',
              file=sys.stderr)
        return aio

    def test_host_loss_loses_no_acknowledged_write(self):
        """SIGKILL at random moments, then the image opened on the mirror's
        host: every acknowledged write, flushed or not, is there."""
        self.host_loss()

    def test_host_loss_many_in_flight(self):
        """The same with up to 32 writes in flight, the kill coming while
        they are."""
        aio = self.host_loss(depth=32)
        # the rounds without flushes fill the window (the dirty limit
        # holds writes back) and are killed with writes in flight
        self.assertTrue(H.loaded_kills(aio),
                        f'a round without flushes had fewer than 16 in flight, or none '
                        f'at the kill, or none had 32: {aio}')
        print('writes, max/mean in flight, in flight at the kill: '
              f'{[(a["writes"], a["max_in_flight"], a["mean_in_flight"], a["left"]) for a in aio]}',
              file=sys.stderr)

    def without_a_mirror_the_check_fails(self, depth=None):
        """killed_rounds with no mirror must fail its check."""
        img = self.image()
        with self.assertRaisesRegex(AssertionError, 'an acknowledged write was lost') as cm:
            self.killed_rounds(img, None, 3, 3939, failover=False, depth=depth)
        print(f'without a mirror: {cm.exception}', file=sys.stderr)

    def test_without_a_mirror_the_check_fails(self):
        """The same rounds with no mirror: acknowledged writes are lost (the
        persistent tier alone lacks them), and the check says so."""
        self.without_a_mirror_the_check_fails()

    def test_without_a_mirror_many_in_flight_the_check_fails(self):
        """So with 32 writes in flight."""
        self.without_a_mirror_the_check_fails(depth=32)

    def test_qemu_dies_host_stays(self):
        """Reopened with mirror=, the node takes the mirror's blocks back,
        writes them back and keeps mirroring."""
        img, mirror = self.image(), self.mirror()
        io = self.qemu_io(self.opts(img, mirror))
        for i in range(8):
            io.cmd(f'write -P {0x40 + i} {i * BLOCK} {BLOCK}')
        io.kill()
        self.procs.remove(io)
        io = self.qemu_io(self.opts(img, mirror))
        m = MIRROR_ATTACH_RE.search(io.banner)
        self.assertEqual((m.group(1), m.group(2)), ('1', '8'), io.banner)
        for i in range(8):
            self.assertIn('read 65536/65536', io.cmd(f'read -P {0x40 + i} {i * BLOCK} {BLOCK}'))
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        data = self.image_bytes(img)
        for i in range(8):
            self.assertEqual(data[i * BLOCK:(i + 1) * BLOCK], bytes([0x40 + i]) * BLOCK)

    # -- the mirror's bookkeeping --

    def test_written_back_blocks_leave_the_mirror(self):
        """After a flush the written-back blocks stop counting: the
        mirror's valid bitmap is empty, and a failover finds nothing.
        Without the prefill, a block's first write sends it whole."""
        img, mirror = self.image(), self.mirror()
        qsd = self.daemon('file,node-name=m0,filename=' + mirror,
                          'file,node-name=f0,filename=' + img,
                          'hybrid,node-name=h0,file=f0,mirror=m0,mode=async,'
                          'mirror-prefill=off')
        try:
            io = self.nbd_io()
            io.cmd(f'write -P 0x5a 0 {4 * BLOCK}')
            [info] = qsd.cmd('query-hybrid')
            self.assertEqual(info['mirror']['counted-blocks'], 4, info['mirror'])
            self.assertEqual(info['mirror']['block-writes'], 4)
            io.cmd('flush')
            [info] = qsd.cmd('query-hybrid')
            self.assertEqual(info['mirror']['counted-blocks'], 0, info['mirror'])
            self.assertEqual(info['mirror']['uncounted-blocks'], 4)
            self.assertFalse(info['mirror']['degraded'])
            with open(mirror, 'rb') as f:
                f.seek(4096)
                self.assertEqual(f.read(RAM // BLOCK // 8), bytes(RAM // BLOCK // 8),
                                 'valid bits left in the mirror after a flush')
        finally:
            qsd.kill()
        self.assertEqual(self.failover(img, mirror), (True, 0))
        self.assertEqual(self.image_bytes(img)[:4 * BLOCK], b'\x5a' * 4 * BLOCK)

    def prefilled(self, qsd):
        """query-hybrid's mirror once the prefill has run to its end."""
        deadline = time.monotonic() + 60
        while True:
            [m] = [i['mirror'] for i in qsd.cmd('query-hybrid')]
            if not m['prefilling'] and m['matched-blocks'] + m['counted-blocks'] == RAM // BLOCK:
                return m
            self.assertLess(time.monotonic(), deadline, f'the prefill did not end: {m}')
            time.sleep(0.05)

    def mirror_data(self, mirror):
        with open(mirror, 'rb') as f:
            f.seek(MIRROR_SIZE - RAM)
            return f.read(RAM)

    def test_prefill_matches_the_tier_and_first_writes_send_their_bits_with_them(self):
        """The prefill copies the tier's clean blocks into the mirror (its
        data area equals the image's), then a block's first write sends
        only its bytes with its bits (matched-writes, no whole-block
        copy); after a flush every copy there is the image's again, and a
        failover after a kill takes every write."""
        img, mirror = self.image(), self.mirror()
        io = self.qemu_io(f'driver=hybrid,file.driver=file,file.filename={img}')
        io.cmd(f'write -P 0x33 0 {64 * BLOCK}')
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        tier = self.image_bytes(img)[:RAM]
        qsd = self.daemon('file,node-name=m0,filename=' + mirror,
                          'file,node-name=f0,filename=' + img,
                          'hybrid,node-name=h0,file=f0,mirror=m0,mode=async')
        try:
            m = self.prefilled(qsd)
            self.assertEqual((m['matched-blocks'], m['counted-blocks']), (RAM // BLOCK, 0), m)
            self.assertEqual(self.mirror_data(mirror), tier,
                             "the prefilled mirror's data is not the image's")
            # the prefill sent the non-zero blocks' bytes only
            self.assertEqual(m['bytes'], 64 * BLOCK, m)
            io = self.nbd_io()
            io.cmd(f'write -P 0x5a {100 * BLOCK} {4 * BLOCK}')
            io.cmd(f'write -P 0x5b {10 * BLOCK + 4096} 4096')
            [m] = [i['mirror'] for i in qsd.cmd('query-hybrid')]
            self.assertEqual((m['matched-writes'], m['block-writes'], m['counted-blocks'],
                              m['matched-blocks'], m['bytes']),
                             (5, 0, 5, RAM // BLOCK - 5, 68 * BLOCK + 4096), m)
            block10 = self.mirror_data(mirror)[10 * BLOCK:11 * BLOCK]
            self.assertEqual(block10, b'\x33' * 4096 + b'\x5b' * 4096 + b'\x33' * (BLOCK - 8192))
            io.cmd('flush')
            [m] = [i['mirror'] for i in qsd.cmd('query-hybrid')]
            self.assertEqual((m['counted-blocks'], m['matched-blocks'], m['uncounted-blocks']),
                             (0, RAM // BLOCK, 5), m)
            io.cmd(f'write -P 0x5c {100 * BLOCK} 4096')     # matched again
        finally:
            qsd.kill()
        self.assertEqual(self.failover(img, mirror), (True, 1))
        data = self.image_bytes(img)
        self.assertEqual(data[100 * BLOCK:101 * BLOCK], b'\x5c' * 4096 + b'\x5a' * (BLOCK - 4096))
        self.assertEqual(data[101 * BLOCK:104 * BLOCK], b'\x5a' * 3 * BLOCK)
        self.assertEqual(data[10 * BLOCK + 4096:10 * BLOCK + 8192], b'\x5b' * 4096)
        self.assertEqual(data[:10 * BLOCK], b'\x33' * 10 * BLOCK)

    def test_bits_without_the_bytes_change_nothing(self):
        """What a matched first write relies on: a kill that lands a
        block's bits in the mirror but not its bytes (set here by hand in
        the killed writer's mirror) leaves a counted copy that is the
        image's own block: the failover takes it and the image is
        unchanged."""
        img, mirror = self.image(), self.mirror()
        io = self.qemu_io(f'driver=hybrid,file.driver=file,file.filename={img}')
        for i in range(16):
            io.cmd(f'write -P {0x20 + i} {i * BLOCK} {BLOCK}')
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        before = self.image_bytes(img)
        qsd = self.daemon('file,node-name=m0,filename=' + mirror,
                          'file,node-name=f0,filename=' + img,
                          'hybrid,node-name=h0,file=f0,mirror=m0,mode=async')
        try:
            self.prefilled(qsd)
        finally:
            qsd.kill()
        bitmap = RAM // BLOCK // 8
        with open(mirror, 'r+b') as f:
            for which in (0, 1):                    # valid, dirty: block 7
                f.seek(4096 + which * bitmap)
                f.write(bytes([0x80]))
        self.assertEqual(self.failover(img, mirror), (True, 1))
        self.assertEqual(self.image_bytes(img), before)

    def test_a_write_through_of_a_counted_block_reaches_the_mirror(self):
        """With a write-back error pending, writes go to the persistent tier
        (as in sync mode); a block the mirror still counts (its own
        write-back failed) takes such a write too, or a failover would write
        its older copy back over it."""
        img, mirror = self.image(), self.mirror()
        off = H.img_info(img)['format-specific']['data']['data-offset']
        # block 0's second 4 KiB cannot be written: its write-back fails,
        # a write of its first 4 KiB succeeds
        bad = ('{"driver": "blkdebug", "node-name": "f0", "image": "f1", "inject-error": '
               f'[{{"event": "pwritev", "errno": 5, "sector": {(off + 4096) // 512}, '
               '"once": false}]}')
        qsd = self.daemon('file,node-name=m0,filename=' + mirror,
                          'file,node-name=f1,filename=' + img, bad,
                          'hybrid,node-name=h0,file=f0,mirror=m0,mode=async')
        try:
            io = self.nbd_io()
            io.cmd(f'write -P 0x61 0 {BLOCK}')
            io.cmd('flush')     # its write-back fails
            deadline = time.monotonic() + 30
            while True:
                [info] = qsd.cmd('query-hybrid')
                if 'error' in info or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            self.assertIn('Input/output error', info.get('error', ''), info)
            self.assertEqual(info['mirror']['counted-blocks'], 1, info)
            self.assertNotRegex(io.cmd('write -P 0x62 0 4096'), H.FAILED_RE)
        finally:
            qsd.kill()
        self.assertEqual(self.failover(img, mirror), (True, 1))
        data = self.image_bytes(img)
        self.assertEqual(data[:BLOCK], b'\x62' * 4096 + b'\x61' * (BLOCK - 4096))

    def test_a_sync_write_unmatches_a_block(self):
        """A write in sync mode (hybrid-set-mode) changes the persistent
        tier without the mirror: the block's copy there is no longer the
        tier's, so its next first write in async mode goes whole, and a
        failover after a kill has both writes."""
        img, mirror = self.image(), self.mirror()
        qsd = self.daemon('file,node-name=m0,filename=' + mirror,
                          'file,node-name=f0,filename=' + img,
                          'hybrid,node-name=h0,file=f0,mirror=m0,mode=async')
        try:
            self.prefilled(qsd)
            io = self.nbd_io()
            for mode, pattern, offset in (('sync', 0x71, 0), ('async', 0x72, 8192)):
                r = qsd.qmp('hybrid-set-mode', **{'node-name': 'h0', 'mode': mode})
                self.assertNotIn('error', r)
                self.assertNotRegex(io.cmd(f'write -P {pattern} {3 * BLOCK + offset} 4096'),
                                    H.FAILED_RE)
            [m] = [i['mirror'] for i in qsd.cmd('query-hybrid')]
            self.assertEqual((m['block-writes'], m['matched-writes'], m['counted-blocks']),
                             (1, 0, 1), m)
        finally:
            qsd.kill()
        self.assertEqual(self.failover(img, mirror), (True, 1))
        data = self.image_bytes(img)
        self.assertEqual(data[3 * BLOCK:3 * BLOCK + 4096], b'\x71' * 4096)
        self.assertEqual(data[3 * BLOCK + 8192:3 * BLOCK + 12288], b'\x72' * 4096)

    def test_resized_image_keeps_its_mirror(self):
        """A resize while blocks are mirrored: the mirror's header follows
        the new size, and a failover after a kill takes it."""
        img, mirror = self.image(), self.mirror()
        io = self.qemu_io(self.opts(img, mirror))
        io.cmd(f'write -P 0x52 0 {2 * BLOCK}')
        self.assertNotRegex(io.cmd(f'truncate {SIZE + 16 * MiB}'), 'failed|error')
        io.cmd(f'write -P 0x53 {4 * BLOCK} {BLOCK}')
        io.kill()
        self.procs.remove(io)
        self.assertEqual(self.failover(img, mirror), (True, 3))
        data = self.image_bytes(img)
        self.assertEqual(len(data), SIZE + 16 * MiB)
        self.assertEqual(data[:2 * BLOCK], b'\x52' * 2 * BLOCK)
        self.assertEqual(data[4 * BLOCK:5 * BLOCK], b'\x53' * BLOCK)

    def test_stale_mirror_is_refused(self):
        """A mirror holding another image's unwritten blocks is refused, as
        ram-file (failover) and as mirror, and keeps them."""
        a, b, mirror = self.image('a.hyb'), self.image('b.hyb'), self.mirror()
        io = self.qemu_io(self.opts(a, mirror))
        io.cmd(f'write -P 0x61 0 {BLOCK}')
        io.kill()
        self.procs.remove(io)
        out = self.fails_to_open(f'driver=hybrid,file.driver=file,file.filename={b},'
                                 f'ram-file={mirror}')
        self.assertRegex(out, r"holds 1 blocks not yet written back to another image")
        out = self.fails_to_open(self.opts(b, mirror))
        self.assertRegex(out, r"mirror '.*' holds 1 blocks not yet written back to "
                              r"another image")
        self.assertEqual(self.failover(a, mirror), (True, 1))
        self.assertEqual(self.image_bytes(a)[:BLOCK], b'\x61' * BLOCK)

    # -- the mirror fails --

    def test_failing_mirror_degrades_the_node(self):
        """Writes to the mirror fail (blkdebug, from the 6th block's copy
        on): HYBRID_MIRROR_DEGRADED, query-hybrid says degraded, and every
        write still completes, in the persistent tier."""
        img, mirror = self.image(), self.mirror()
        sector = (2 * MiB + 5 * BLOCK) // 512
        qsd = self.daemon('file,node-name=mf,filename=' + mirror, failing_mirror(sector),
                          'file,node-name=f0,filename=' + img, FAILING_H0)
        try:
            uri = f'nbd+unix:///h0?socket={self.tmp("nbd.sock")}'
            out = H.qemu_io('-f', 'raw', '-c', f'write -P 0x33 0 {8 * BLOCK}',
                            '-c', f'write -P 0x34 {8 * BLOCK} {BLOCK}', uri).stdout
            self.assertNotIn('failed', out)
            ev = qsd.wait_event('HYBRID_MIRROR_DEGRADED', timeout=30)
            self.assertEqual(ev['data']['node-name'], 'h0')
            self.assertEqual(ev['data']['mirror'], 'm0')
            self.assertIn('Input/output error', ev['data']['error'])
            [info] = qsd.cmd('query-hybrid')
            self.assertTrue(info['mirror']['degraded'])
            self.assertIn('Input/output error', info['mirror']['error'])
        finally:
            qsd.kill()          # no clean close: the tier must hold them
        # the persistent tier itself, past the image's header
        off = H.img_info(img)['format-specific']['data']['data-offset']
        with open(img, 'rb') as f:
            f.seek(off)
            data = f.read(9 * BLOCK)
        self.assertEqual(data[:8 * BLOCK], b'\x33' * 8 * BLOCK)
        self.assertEqual(data[8 * BLOCK:9 * BLOCK], b'\x34' * BLOCK)

    def test_writes_after_the_mirror_failed_are_not_undone_by_a_failover(self):
        """The mirror fails while it counts blocks; a block it counts is
        written again, in degraded mode (the write completes in the
        persistent tier), and the host dies.  The old mirror must not be
        replayed over that write: the write completes only once everything
        dirty is written back and the image no longer bound to the old
        mirror, so a failover with it is refused, and the image opened with
        an empty region holds every acknowledged write.  (Before: the
        failover took the old mirror and wrote its older copy back.)"""
        img, mirror = self.image(), self.mirror()
        sector = (2 * MiB + 5 * BLOCK) // 512
        blockdevs = ['file,node-name=mf,filename=' + mirror, failing_mirror(sector),
                     'file,node-name=f1,filename=' + img,
                     '{"driver": "throttle", "node-name": "f0", "file": "f1", '
                     '"throttle-group": "tg0"}',
                     FAILING_H0]
        # a slow persistent tier: the blocks are still counted (not yet
        # written back) when the mirror fails
        qsd = self.daemon(*blockdevs, objects=['throttle-group,id=tg0,x-bps-write=131072'])
        try:
            io = self.nbd_io()
            for i in range(10, 18):
                io.cmd(f'write -P 0x60 {i * BLOCK} {BLOCK}')
            io.cmd(f'write -P 0x61 0 {BLOCK}')
            [info] = qsd.cmd('query-hybrid')
            self.assertEqual(info['mirror']['counted-blocks'], 9, info['mirror'])
            io.cmd(f'write -P 0x34 {5 * BLOCK} {BLOCK}')     # the mirror fails
            qsd.wait_event('HYBRID_MIRROR_DEGRADED', timeout=30)
            self.assertNotRegex(io.cmd(f'write -P 0x62 0 {BLOCK}'), H.FAILED_RE)
        finally:
            qsd.kill()          # the host dies
        self.procs.remove(io)
        out = self.fails_to_open(f'driver=hybrid,file.driver=file,file.filename={img},'
                                 f'ram-file={mirror}')
        self.assertRegex(out, r"holds \d+ blocks not yet written back to another image, "
                              r"or to this one before it was written without them")
        empty = self.mirror('empty')
        io = H.QemuIo(f'driver=hybrid,file.driver=file,file.filename={img},'
                      f'ram-file={empty}')
        self.procs.append(io)
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        data = self.image_bytes(img)
        self.assertEqual(data[:BLOCK], b'\x62' * BLOCK, 'the degraded write was undone')
        self.assertEqual(data[5 * BLOCK:6 * BLOCK], b'\x34' * BLOCK)
        self.assertEqual(data[10 * BLOCK:18 * BLOCK], b'\x60' * 8 * BLOCK)

    def set_mirror(self, qsd, node, mirror):
        """hybrid-set-mirror, once the failed mirror has left the graph."""
        deadline = time.monotonic() + 30
        while True:
            r = qsd.qmp('hybrid-set-mirror', **{'node-name': node, 'mirror': mirror})
            if 'error' not in r or 'try again' not in r['error']['desc'] or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.assertNotIn('error', r)
        [m] = [i['mirror'] for i in qsd.cmd('query-hybrid', **{'node-name': node})]
        return m

    def test_a_new_mirror_takes_the_dirty_blocks_only(self):
        """A node without a mirror gets one: filled with the blocks dirty
        then (not those written back), counted on from then on, and a
        failover after a kill takes every acknowledged write."""
        img, mirror = self.image(), self.mirror()
        qsd = self.daemon('file,node-name=f0,filename=' + img,
                          'hybrid,node-name=h0,file=f0,mode=async',
                          'file,node-name=m1,filename=' + mirror)
        try:
            io = self.nbd_io()
            io.cmd(f'write -P 0x60 0 {3 * BLOCK}')
            io.cmd('flush')                         # written back: not for the mirror
            for i in range(4):                      # dirty: four requests, one block each
                io.cmd(f'write -P {0x70 + i} {(4 + 2 * i) * BLOCK} {BLOCK}')
            m = self.set_mirror(qsd, 'h0', 'm1')
            self.assertEqual((m['node-name'], m['degraded']), ('m1', False), m)
            self.assertEqual((m['counted-blocks'], m['block-writes']), (4, 4), m)
            io.cmd(f'write -P 0x7f {20 * BLOCK} {BLOCK}')
            [m] = [i['mirror'] for i in qsd.cmd('query-hybrid')]
            # whole, or with its bits if the prefill has matched it
            self.assertEqual((m['counted-blocks'], m['block-writes'] + m['matched-writes']),
                             (5, 5), m)
        finally:
            qsd.kill()
        self.assertEqual(self.failover(img, mirror), (True, 5))
        data = self.image_bytes(img)
        self.assertEqual(data[:3 * BLOCK], b'\x60' * 3 * BLOCK)
        for i in range(4):
            off = (4 + 2 * i) * BLOCK
            self.assertEqual(data[off:off + BLOCK], bytes([0x70 + i]) * BLOCK, i)
        self.assertEqual(data[20 * BLOCK:21 * BLOCK], b'\x7f' * BLOCK)

    def test_a_failed_mirror_is_replaced(self):
        """After a mirror failed (the node degraded), hybrid-set-mirror
        gives it a new one: not degraded, writes counted in it, and a
        failover after a kill takes every acknowledged write."""
        img, mirror, new = self.image(), self.mirror(), self.mirror('new')
        sector = (2 * MiB + 5 * BLOCK) // 512
        qsd = self.daemon('file,node-name=mf,filename=' + mirror, failing_mirror(sector),
                          'file,node-name=f0,filename=' + img, FAILING_H0,
                          'file,node-name=m1,filename=' + new)
        try:
            io = self.nbd_io()
            for i in range(6):          # the 6th fails in the mirror
                self.assertNotRegex(io.cmd(f'write -P {0x70 + i} {i * BLOCK} {BLOCK}'),
                                    H.FAILED_RE)
            qsd.wait_event('HYBRID_MIRROR_DEGRADED', timeout=30)
            m = self.set_mirror(qsd, 'h0', 'm1')
            self.assertEqual((m['node-name'], m['degraded']), ('m1', False), m)
            self.assertEqual(m['block-writes'], m['counted-blocks'], m)
            io.cmd(f'write -P 0x76 {6 * BLOCK} {BLOCK}')
            [m2] = [i['mirror'] for i in qsd.cmd('query-hybrid')]
            self.assertEqual(m2['counted-blocks'], m['counted-blocks'] + 1, m2)
        finally:
            qsd.kill()
        self.assertTrue(self.failover(img, new)[0])
        data = self.image_bytes(img)
        for i in range(7):
            self.assertEqual(data[i * BLOCK:(i + 1) * BLOCK], bytes([0x70 + i]) * BLOCK, i)

    def test_set_mirror_refusals(self):
        """hybrid-set-mirror refuses a node with a working mirror, a node
        that is not hybrid, a missing node, a mirror too small, and a
        mirror holding another image's unwritten blocks (which stay)."""
        img, mirror, other = self.image(), self.mirror(), self.image('other.hyb')
        foreign = self.mirror('foreign')
        io = self.qemu_io(self.opts(other, foreign))
        io.cmd(f'write -P 0x61 0 {BLOCK}')
        io.kill()
        self.procs.remove(io)
        qsd = H.StorageDaemon(self.tmp, '--blockdev', 'file,node-name=m0,filename=' + mirror,
                              '--blockdev', 'file,node-name=f0,filename=' + img,
                              '--blockdev', 'hybrid,node-name=h0,file=f0,mirror=m0,mode=async',
                              '--blockdev', 'file,node-name=f1,filename=' + self.image('b.hyb'),
                              '--blockdev', 'hybrid,node-name=h1,file=f1,mode=async',
                              '--blockdev', f'file,node-name=small,filename={self.mirror("s", 4096)}',
                              '--blockdev', 'file,node-name=foreign,filename=' + foreign)
        try:
            for args, msg in (({'node-name': 'h0', 'mirror': 'small'}, "node 'h0' has a mirror, 'm0'"),
                              ({'node-name': 'f0', 'mirror': 'small'}, 'is not a hybrid node'),
                              ({'node-name': 'h0', 'mirror': 'nope'}, "Cannot find node 'nope'"),
                              ({'node-name': 'h1', 'mirror': 'small'},
                               "mirror 'small' has 4096 bytes"),
                              ({'node-name': 'h1', 'mirror': 'foreign'},
                               "mirror 'foreign' holds 1 blocks not yet written back to "
                               "another image")):
                r = qsd.qmp('hybrid-set-mirror', **args)
                self.assertIn(msg, r['error']['desc'])
            [info] = qsd.cmd('query-hybrid', **{'node-name': 'h1'})
            self.assertNotIn('mirror', info)
        finally:
            qsd.kill()
        self.assertEqual(self.failover(other, foreign), (True, 1))
        self.assertEqual(self.image_bytes(other)[:BLOCK], b'\x61' * BLOCK)

    # -- bad options --

    def test_bad_options(self):
        img, mirror = self.image(), self.mirror()
        for extra, msg in ((',dedup=on', 'dedup=on'),
                           (f',ram-file={self.mirror("r")}', 'ram-file given'),
                           (',mirror-prefill=maybe', "'mirror-prefill' expects")):
            self.assertIn(msg, self.fails_to_open(self.opts(img, mirror, extra)))
        small = self.mirror('small', MIRROR_SIZE - 4096)
        self.assertRegex(self.fails_to_open(self.opts(img, small)),
                         r"mirror '.*' has \d+ bytes; a RAM tier of 256 blocks of "
                         r"65536 bytes needs 18874368")
        raw = self.tmp('r.raw')
        H.qemu_img('create', '-q', '-f', 'raw', raw, str(SIZE))
        self.assertIn('raw=on', self.fails_to_open(
            f'driver=hybrid,raw=on,file.driver=file,file.filename={raw},'
            f'mirror.driver=file,mirror.filename={mirror}'))

    def test_user_timeout_is_taken_by_a_connecting_socket(self):
        """server.user-timeout (TCP_USER_TIMEOUT, qemu-patches/0016) is an
        option of an NBD client's inet address; what it does for a mirror
        whose host dies is tested in test_hybrid_mirror_hosts (the writes
        stall 3 s, not ~15 minutes)."""
        img = self.tmp('n.raw')
        H.qemu_img('create', '-q', '-f', 'raw', img, str(1 << 20))
        with socket.socket() as probe:
            probe.bind(('127.0.0.1', 0))
            port = probe.getsockname()[1]
        qsd = H.StorageDaemon(self.tmp, '--blockdev', f'file,node-name=n0,filename={img}',
                              '--nbd-server', f'addr.type=inet,addr.host=127.0.0.1,addr.port={port}',
                              '--export', 'nbd,id=e0,node-name=n0,writable=on')
        try:
            r = H.qemu_io('--image-opts', 'driver=nbd,server.type=inet,server.host=127.0.0.1,'
                          f'server.port={port},server.user-timeout=1000,export=n0',
                          '-c', 'write -P 7 0 4096', '-c', 'read -P 7 0 4096')
        finally:
            qsd.kill()
        self.assertIn('read 4096/4096', r.stdout)


if __name__ == '__main__':
    unittest.main()
