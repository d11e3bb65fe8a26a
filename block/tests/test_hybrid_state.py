"""Run-time state changes of a hybrid node: inactivation and activation,
read-only opens, writes after a failed write-back, mode switches.
Binaries come from $HYBRIDVM_BUILD/bin."""

import os
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


if __name__ == '__main__':
    unittest.main()
