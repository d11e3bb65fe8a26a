"""Run-time state changes of a hybrid node: inactivation and activation,
read-only opens, writes after a failed write-back, mode switches.
Binaries come from $HYBRIDVM_BUILD/bin."""

import os
import random
import struct
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

MiB = 1024 * 1024


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class HybridInactivateTest(unittest.TestCase):
    """A failed inactivation leaves the node active, restore included; a
    later one succeeds and activation restores again."""

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('ina.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=256M',
                   self.img, '320M')
        H.qemu_io('-f', 'hybrid', '-c', 'write -P 0x21 0 8M', self.img)
        # zeros written into the file's holes: the restore reads them (a
        # hole it restores without reading)
        with open(self.img, 'r+b') as f:
            data_offset = struct.unpack_from('<Q', f.read(48), 40)[0]
            f.seek(data_offset + 8 * MiB)
            for _ in range(248):
                f.write(bytes(MiB))
        # hybrid -> blkdebug (fails the first flush of the hybrid node)
        #        -> throttle (restore reads at 8 MiB/s, ~32 s for 256 MiB, until
        #             the test lifts the limit)
        #        -> file
        self.qsd = H.StorageDaemon(
            self.tmp, '--object', 'throttle-group,id=tg0,x-bps-read=8388608',
            '--blockdev', f'driver=file,node-name=f0,filename={self.img}',
            '--blockdev', 'driver=throttle,node-name=t0,throttle-group=tg0,'
            'file=f0',
            '--blockdev', 'driver=blkdebug,node-name=d0,image=t0,'
            'inject-error.0.event=flush_to_disk,inject-error.0.iotype=flush,'
            'inject-error.0.errno=5,inject-error.0.once=on',
            system=True)

    def tearDown(self):
        self.qsd.stop()
        self.tmp.cleanup()

    def io(self, cmd):
        out = self.qsd.cmd('human-monitor-command', **{
            'command-line': f'qemu-io h0 "{cmd}"'})
        self.assertNotIn('failed', out)
        return out

    def test_failed_inactivation_keeps_restoring(self):
        """The first inactivation fails (flush EIO): the node is still
        active, its restore runs to the end and writes keep working; the
        second inactivation succeeds, activation restores again, and the
        data written before, between and after is intact."""
        q = self.qsd
        q.cmd('blockdev-add', driver='hybrid', **{'node-name': 'h0'},
              file='d0', mode='async')
        self.io('write -P 0x22 1M 64k')
        r = q.qmp('blockdev-set-active', **{'node-name': 'h0'}, active=False)
        self.assertIn('error', r)
        self.assertIn('Failed to inactivate', r['error']['desc'])
        info = q.cmd('query-hybrid')[0]
        self.assertFalse(info['restore-done'],
                         'restore finished before the inactivation: the test '
                         'needs a slower persistent tier')
        q.cmd('qom-set', path='tg0', property='limits',
              value={'bps-read': 1 << 40})
        # Restore goes on (the old code stopped it for good)
        ev = q.wait_event('HYBRID_RESTORE_COMPLETED', timeout=30)
        self.assertEqual(ev['data']['bytes'], 256 * MiB)
        self.assertNotIn('error', ev['data'])
        self.assertEqual(q.cmd('query-hybrid')[0]['ram-loaded'], 256 * MiB)
        self.io('write -P 0x23 2M 64k')
        # The second inactivation writes everything back
        q.cmd('blockdev-set-active', **{'node-name': 'h0'}, active=False)
        self.assertEqual(q.cmd('query-hybrid')[0]['dirty-bytes'], 0)
        self.assertFalse(H.img_info(self.img)['format-specific']['data']
                         ['dirty'])
        q.cmd('blockdev-set-active', **{'node-name': 'h0'}, active=True)
        ev = q.wait_event('HYBRID_RESTORE_COMPLETED', timeout=30)
        self.assertEqual(ev['data']['bytes'], 256 * MiB)
        self.io('read -P 0x22 1M 64k')
        self.io('read -P 0x23 2M 64k')
        self.io('read -P 0x21 0 1M')
        self.io('read -P 0x21 3M 1M')
        self.io('read -P 0x21 5M 3M')
        self.io('read -P 0 8M 248M')
        self.io('write -P 0x24 4M 64k')
        q.stop()
        for pat, off, ln in (('0x21', 0, '1M'), ('0x22', '1M', '64k'),
                             ('0x23', '2M', '64k'), ('0x24', '4M', '64k'),
                             ('0x21', '5M', '3M'), ('0', '8M', '312M')):
            out = H.qemu_io('-r', '-f', 'hybrid', '-c',
                            f'read -P {pat} {off} {ln}', self.img).stdout
            self.assertNotIn('failed', out)

    def test_failed_activation_stays_inactive(self):
        """An activation that fails (header corrupted while inactive)
        leaves the node inactive: a drained section does not restart its
        restore (the old code did, and emitted HYBRID_RESTORE_COMPLETED
        while inactive); once the header is back, activation restores."""
        q = self.qsd
        q.cmd('blockdev-add', driver='hybrid', **{'node-name': 'h0'},
              file='d0', mode='async')
        self.io('write -P 0x22 1M 64k')
        r = q.qmp('blockdev-set-active', **{'node-name': 'h0'}, active=False)
        self.assertIn('error', r)               # blkdebug: first flush
        q.cmd('blockdev-set-active', **{'node-name': 'h0'}, active=False)
        self.assertFalse(q.cmd('query-hybrid')[0]['restore-done'],
                         'restore finished before the inactivation: the test '
                         'needs a slower persistent tier')
        q.cmd('qom-set', path='tg0', property='limits',
              value={'bps-read': 1 << 40})
        with open(self.img, 'r+b') as f:
            header = f.read(8)
            f.seek(0)
            f.write(b'XXXXXXXX')
        r = q.qmp('blockdev-set-active', **{'node-name': 'h0'}, active=True)
        self.assertIn('not in hybrid format', r['error']['desc'])
        # Any drained section of the node ends with the restore's kick
        q.qmp('blockdev-reopen', options=[{
            'driver': 'hybrid', 'node-name': 'h0', 'file': 'd0',
            'mode': 'async'}])
        with self.assertRaises(TimeoutError):
            q.wait_event('HYBRID_RESTORE_COMPLETED', timeout=3)
        self.assertFalse(q.cmd('query-hybrid')[0]['restore-active'])
        with open(self.img, 'r+b') as f:
            f.write(header)
        q.cmd('blockdev-set-active', **{'node-name': 'h0'}, active=True)
        ev = q.wait_event('HYBRID_RESTORE_COMPLETED', timeout=30)
        self.assertEqual(ev['data']['bytes'], 256 * MiB)
        self.io('read -P 0x22 1M 64k')
        self.io('read -P 0x21 0 1M')
        self.io('read -P 0x21 1088k 6080k')


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class HybridReadOnlyTest(unittest.TestCase):
    """Only nodes that serve writes restore their RAM tier; read-only
    openers read the persistent tier directly."""

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('ro.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=8M',
                   self.img, '16M')
        H.qemu_io('-f', 'hybrid', '-c', 'write -P 0x31 0 4M',
                  '-c', 'write -P 0x32 12M 1M', self.img)

    def tearDown(self):
        self.tmp.cleanup()

    def test_qemu_img_no_restore(self):
        """qemu-img info and convert (read-only opens) do not restore:
        no hybrid_restore_* trace event fires; convert copies the data."""
        r = H.qemu_img('-T', 'hybrid_restore*', 'info', self.img)
        self.assertNotIn('hybrid_restore', r.stderr)
        out = self.tmp('out.raw')
        r = H.qemu_img('-T', 'hybrid_restore*', 'convert', '-O', 'raw',
                       self.img, out)
        self.assertNotIn('hybrid_restore', r.stderr)
        H.qemu_img('compare', '-f', 'hybrid', '-F', 'raw', self.img, out)
        # A read-write open does restore
        r = H.qemu_io('-T', 'hybrid_restore*', '-f', 'hybrid',
                      '-c', 'read -P 0x31 0 4M', self.img)
        self.assertIn('hybrid_restore_read', r.stderr)

    def test_read_only_node_then_read_write(self):
        """A read-only blockdev-add gives no HYBRID_RESTORE_COMPLETED and
        reads correct data from the persistent tier; blockdev-reopen to
        read-write starts the restore, and the node serves writes."""
        q = H.StorageDaemon(self.tmp, '--blockdev',
                            f'driver=file,node-name=f0,filename={self.img},'
                            'read-only=on', system=True)
        try:
            q.cmd('blockdev-add', driver='hybrid', **{'node-name': 'h0',
                  'read-only': True}, file='f0')

            def io(cmd):
                out = q.cmd('human-monitor-command', **{
                    'command-line': f'qemu-io h0 "{cmd}"'})
                self.assertNotIn('failed', out)
            io('read -P 0x31 0 4M')
            io('read -P 0 4M 8M')
            io('read -P 0x32 12M 1M')
            info = q.cmd('query-hybrid')[0]
            # A restore would have read something by now: each qemu-io
            # above drained the node, waiting for its restore reads
            self.assertNotIn('HYBRID_RESTORE_COMPLETED',
                             [e['event'] for e in q.events])
            self.assertEqual((info['ram-loaded'], info['restore-bytes'],
                              info['restore-done'], info['read-hits']),
                             (0, 0, False, 0))
            self.assertGreater(info['read-misses'], 0)
            q.cmd('blockdev-reopen', options=[
                {'driver': 'file', 'node-name': 'f0', 'filename': self.img,
                 'read-only': False},
                {'driver': 'hybrid', 'node-name': 'h0', 'file': 'f0',
                 'read-only': False}])
            ev = q.wait_event('HYBRID_RESTORE_COMPLETED', timeout=30)
            self.assertEqual(ev['data']['bytes'], 8 * MiB)
            io('write -P 0x33 1M 64k')
            io('read -P 0x33 1M 64k')
            io('read -P 0x31 0 1M')
        finally:
            q.stop()
        out = H.qemu_io('-r', '-f', 'hybrid', '-c', 'read -P 0x33 1M 64k',
                        '-c', 'read -P 0x31 1088k 2880k', self.img).stdout
        self.assertNotIn('failed', out)


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class HybridWriteAfterErrorTest(unittest.TestCase):
    """After a failed write-back, async writes go through to the persistent
    tier until a flush succeeds (docs/hybrid-format.rst)."""

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('wae.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=4M',
                   self.img, '16M')

    def tearDown(self):
        self.tmp.cleanup()

    def on_disk(self, pattern, off, length):
        """Does the persistent tier itself hold @pattern there now?"""
        out = H.qemu_io('-U', '-r', '-f', 'raw', '-c',
                        f'read -P {pattern} {65536 + off} {length}',
                        self.img, check=False).stdout
        return 'Pattern verification failed' not in out

    def test_delete_refused_while_writes_are_unwritten(self):
        """A node whose write-back failed holds acknowledged writes that are
        nowhere else: blockdev-del is refused, naming the node and the
        error, until a flush writes everything; then it goes and the image
        holds the writes (without the blocker the RAM tier was dropped with
        only a log line)."""
        sector = (65536 + MiB) // 512
        q = H.StorageDaemon(
            self.tmp, '--blockdev',
            'driver=blkdebug,node-name=d0,image.driver=file,'
            f'image.filename={self.img},'
            f'inject-error.0.event=pwritev,inject-error.0.iotype=write,'
            f'inject-error.0.sector={sector},inject-error.0.errno=28,'
            f'inject-error.0.state=1,'
            # in state 2 this rule replaces the first one; it never fires
            f'inject-error.1.event=pwritev,inject-error.1.iotype=write,'
            f'inject-error.1.sector={(65536 + 15 * MiB) // 512},'
            f'inject-error.1.errno=28,inject-error.1.state=2,'
            f'set-state.0.event=pwritev_zero,set-state.0.state=1,'
            f'set-state.0.new_state=2',
            '--blockdev', 'driver=hybrid,node-name=h0,mode=async,file=d0',
            system=True)
        try:
            def io(cmd):
                return q.cmd('human-monitor-command', **{
                    'command-line': f'qemu-io h0 "{cmd}"'})
            io('write -P 0x41 1M 64k')      # acknowledged, in RAM
            io('flush')                     # the write-back fails: ENOSPC
            self.assertEqual(q.cmd('query-hybrid')[0].get('error'),
                             'No space left on device')
            r = q.qmp('blockdev-del', **{'node-name': 'h0'})
            self.assertIn('error', r)
            self.assertIn("node 'h0' holds writes that could not be written "
                          'back to its persistent tier (No space left on '
                          'device)', r['error']['desc'])
            # The tier recovers (blkdebug leaves state 1); a flush clears
            io('write -z 12M 64k')
            io('flush')
            self.assertIsNone(q.cmd('query-hybrid')[0].get('error'))
            deadline = time.monotonic() + 10
            while True:                     # the blocker goes in a BH
                r = q.qmp('blockdev-del', **{'node-name': 'h0'})
                if 'error' not in r or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            self.assertNotIn('error', r)
        finally:
            q.stop()
        out = H.qemu_io('-r', '-f', 'hybrid', '-c', 'read -P 0x41 1M 64k',
                        self.img).stdout
        self.assertNotIn('failed', out)

    def test_write_through_until_flush(self):
        """blkdebug fails writes at guest offset 1 MiB until a write-zeroes
        beyond the boundary lifts it.  A flush fails; then a write elsewhere
        is on disk when acknowledged, a write to the failing range reports
        EIO; once lifted, a flush succeeds, writes stay in RAM again, and
        everything acknowledged is on disk after close."""
        sector = (65536 + MiB) // 512
        o = (f'driver=hybrid,mode=async,file.driver=blkdebug,'
             f'file.image.driver=file,file.image.filename={self.img},'
             f'file.inject-error.0.event=pwritev,'
             f'file.inject-error.0.iotype=write,'
             f'file.inject-error.0.sector={sector},'
             f'file.inject-error.0.errno=5,file.inject-error.0.state=1,'
             # in state 2 this rule replaces the first one; it never fires
             f'file.inject-error.1.event=pwritev,'
             f'file.inject-error.1.iotype=write,'
             f'file.inject-error.1.sector={(65536 + 15 * MiB) // 512},'
             f'file.inject-error.1.errno=5,file.inject-error.1.state=2,'
             f'file.set-state.0.event=pwritev_zero,file.set-state.0.state=1,'
             f'file.set-state.0.new_state=2')
        io = H.QemuIo(o)
        try:
            self.assertIn('wrote 65536/65536', io.cmd('write -P 0x41 1M 64k'))
            self.assertFalse(self.on_disk('0x41', MiB, 65536))
            io.cmd('flush')                         # write-back fails
            self.assertFalse(self.on_disk('0x41', MiB, 65536))
            # A write elsewhere is durable when acknowledged
            self.assertIn('wrote 65536/65536', io.cmd('write -P 0x42 2M 64k'))
            self.assertTrue(self.on_disk('0x42', 2 * MiB, 65536))
            # A write to the failing range reports the tier's error
            self.assertIn('write failed: Input/output error',
                          io.cmd('write -P 0x43 1M 4k'))
            # Lift the error; writes still go through until a flush works
            self.assertIn('wrote', io.cmd('write -z 12M 64k'))
            self.assertIn('wrote 65536/65536', io.cmd('write -P 0x44 3M 64k'))
            self.assertTrue(self.on_disk('0x44', 3 * MiB, 65536))
            io.cmd('flush')                         # succeeds, clears
            self.assertTrue(self.on_disk('0x41', MiB + 4096, 61440))
            # Normal async operation again: acknowledged in RAM
            self.assertIn('wrote 65536/65536',
                          io.cmd('write -P 0x45 2112k 64k'))
            self.assertFalse(self.on_disk('0x45', 2112 * 1024, 65536))
            out = io.cmd('read -P 0x45 2112k 64k')
            self.assertNotIn('failed', out)
        finally:
            io.quit()       # exit status 1: a command (the EIO write) failed
        out = H.qemu_io('-r', '-f', 'hybrid',
                        '-c', 'read -P 0x43 1M 4k',
                        '-c', 'read -P 0x41 1028k 60k',
                        '-c', 'read -P 0x42 2M 64k',
                        '-c', 'read -P 0x45 2112k 64k',
                        '-c', 'read -P 0x44 3M 64k',
                        '-c', 'read -P 0 12M 64k', self.img).stdout
        self.assertNotIn('failed', out)
        self.assertFalse(H.img_info(self.img)['format-specific']['data']
                         ['dirty'])


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class HybridModeSwitchTest(unittest.TestCase):
    """Mode switches (hybrid-set-mode and blockdev-reopen) while the node
    runs in an iothread under write load keep every write."""

    REGIONS = (0, 20 * MiB, 40 * MiB)     # below, across, beyond 32 MiB
    REGION = 16 * MiB

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('sw.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=32M',
                   self.img, '64M')

    def tearDown(self):
        self.tmp.cleanup()

    def writes(self, seed, n):
        """n (pattern, offset, length) writes inside one region, the
        expected content of that region after them."""
        rnd = random.Random(seed)
        region = bytearray(self.REGION)
        out = []
        for i in range(n):
            ln = rnd.choice((512, 4096, 65536, 131072, 200704))
            off = rnd.randrange(0, self.REGION - ln, 512)
            pat = i % 254 + 1
            region[off:off + ln] = bytes([pat]) * ln
            out.append((pat, off, ln))
        return out, region

    def test_switch_under_load(self):
        """Three qemu-io writers over NBD (the export puts the node in
        iothread io0) while the main loop switches the mode 60+ times, by
        hybrid-set-mode and by blockdev-reopen (also changing dirty-limit);
        afterwards the image holds exactly the last write of every byte."""
        sock = self.tmp('nbd.sock')
        q = H.StorageDaemon(
            self.tmp, '--object', 'iothread,id=io0',
            '--blockdev', f'driver=file,node-name=f0,filename={self.img}',
            '--blockdev', 'driver=hybrid,node-name=h0,file=f0,mode=async,'
            'dirty-limit=1M',
            '--nbd-server', f'addr.type=unix,addr.path={sock}',
            '--export', 'type=nbd,id=e0,node-name=h0,writable=on,'
            'iothread=io0')
        expected = []
        writers = []
        try:
            for k, base in enumerate(self.REGIONS):
                ws, region = self.writes(k, 400)
                expected.append(region)
                cmds = []
                for pat, off, ln in ws:
                    cmds += ['-c', f'write -P {pat} {base + off} {ln}']
                writers.append(H.subprocess.Popen(
                    [H.binary('qemu-io'), '-f', 'raw', *cmds,
                     f'nbd+unix:///h0?socket={sock}'],
                    stdout=H.subprocess.PIPE, stderr=H.subprocess.STDOUT,
                    text=True))
            switches = 0
            deadline = time.monotonic() + 300
            while any(w.poll() is None for w in writers):
                self.assertLess(time.monotonic(), deadline, 'writers hang')
                mode = ('sync', 'async')[switches % 2]
                if switches % 4 < 2:
                    q.cmd('hybrid-set-mode', **{'node-name': 'h0',
                                                'mode': mode})
                else:
                    q.cmd('blockdev-reopen', options=[{
                        'driver': 'hybrid', 'node-name': 'h0', 'file': 'f0',
                        'mode': mode,
                        'dirty-limit': (1 + switches % 3) * MiB}])
                info = q.cmd('query-hybrid')[0]
                self.assertEqual(info['mode'], mode)
                self.assertIsNone(info.get('error'))
                switches += 1
            for w in writers:
                out = w.communicate()[0]
                self.assertEqual(w.returncode, 0, out[-2000:])
                self.assertNotIn('failed', out)
            self.assertGreaterEqual(switches, 60,
                                    'too few switches during the load')
            print(f'{switches} mode switches under load', file=sys.stderr)
        finally:
            for w in writers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
            q.stop()
        raw = self.tmp('sw.raw')
        H.qemu_img('convert', '-f', 'hybrid', '-O', 'raw', self.img, raw)
        with open(raw, 'rb') as f:
            data = f.read()
        for base, region in zip(self.REGIONS, expected):
            self.assertTrue(data[base:base + self.REGION] == region,
                            f'region at {base} differs')
        self.assertFalse(H.img_info(self.img)['format-specific']['data']
                         ['dirty'])

    def test_reopen_options(self):
        """hybrid-set-mode keeps the other options; blockdev-reopen changes
        mode and dirty-limit (an omitted one goes back to its default),
        names a bad dirty-limit, and refuses to change or reset any other
        option; the node keeps working after each refusal."""
        q = H.StorageDaemon(
            self.tmp, '--blockdev',
            f'driver=file,node-name=f0,filename={self.img}',
            '--blockdev', 'driver=hybrid,node-name=h0,file=f0,mode=async,'
            'dirty-limit=1M,promote-size=64k')
        try:
            def state():
                i = q.cmd('query-hybrid')[0]
                return i['mode'], i['dirty-limit']

            def reopen(**opts):
                return q.qmp('blockdev-reopen', options=[dict(
                    driver='hybrid', **{'node-name': 'h0'}, file='f0',
                    **opts)])
            q.cmd('hybrid-set-mode', **{'node-name': 'h0', 'mode': 'sync'})
            self.assertEqual(state(), ('sync', MiB))
            self.assertNotIn('error', reopen(mode='async', **{
                'dirty-limit': 2 * MiB, 'promote-size': 65536}))
            self.assertEqual(state(), ('async', 2 * MiB))
            self.assertNotIn('error', reopen(**{'promote-size': 65536}))
            self.assertEqual(state(), ('sync', 256 * MiB))   # defaults
            r = reopen(**{'dirty-limit': 1000, 'promote-size': 65536})
            self.assertIn('dirty-limit 1000 is smaller than the block size '
                          '65536', r['error']['desc'])
            self.assertEqual(state(), ('sync', 256 * MiB))
            r = reopen(**{'ram-size': MiB, 'promote-size': 65536})
            self.assertIn("Cannot change the option 'ram-size'",
                          r['error']['desc'])
            r = reopen(mode='async')
            self.assertIn("'promote-size' cannot be reset",
                          r['error']['desc'])
            self.assertEqual(state(), ('sync', 256 * MiB))
        finally:
            q.stop()


if __name__ == '__main__':
    unittest.main()
