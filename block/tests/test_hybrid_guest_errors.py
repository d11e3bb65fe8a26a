"""Errors of the persistent tier reach a real guest per the device's
werror/rerror policy, and nothing the guest had flushed disappears.

The hybrid node sits on blkdebug over the image file; blkdebug fails every
request on the persistent tier that touches one chosen sector.  The guest
(busybox dd with O_DIRECT on /dev/vda) writes there, reads there, and writes
and flushes elsewhere.
"""
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402
from hybridlib import hvlib   # noqa: E402

MiB = 1 << 20
DATA_OFFSET = 65536           # docs/hybrid-format.rst: block 0 of a new image
BAD_WRITE = 1 * MiB           # guest offset whose persistent-tier sector fails on write
BAD_READ = 8 * MiB            # beyond the RAM tier: served by the persistent tier, fails on read
GOOD = 2 * MiB                # flushed before the errors, must survive them


def tier_sector(guest_offset):
    return (DATA_OFFSET + guest_offset) // 512


class HybridGuestErrors(H.GuestCase, unittest.TestCase):

    dir_prefix = 'hybrid-guest-err-'

    def guest(self, mode, werror, rerror='report'):
        image = os.path.join(self.dir, f'{mode}-{werror}.hybrid')
        subprocess.run([self.qemu_img, 'create', '-f', 'hybrid', '-o', f'ram-size=4M,mode={mode}',
                        image, '16M'], check=True, capture_output=True)
        dbg = ','.join([
            'driver=blkdebug', 'node-name=dbg', 'image=tier',
            # Rules become active once their event fired: every write to the
            # tier emits pwritev (the tests write before they read).
            'inject-error.0.event=pwritev', 'inject-error.0.iotype=write', 'inject-error.0.errno=5',
            f'inject-error.0.sector={tier_sector(BAD_WRITE)}', 'inject-error.0.once=off',
            'inject-error.1.event=pwritev', 'inject-error.1.iotype=read', 'inject-error.1.errno=5',
            f'inject-error.1.sector={tier_sector(BAD_READ)}', 'inject-error.1.once=off'])
        g = self.add_guest(f'{mode}-{werror}', redis=False, args=[
            '-blockdev', f'driver=file,node-name=tier,filename={image}',
            '-blockdev', dbg,
            '-blockdev', 'driver=hybrid,node-name=hyb,file=dbg',
            '-device', f'virtio-blk-pci,drive=hyb,werror={werror},rerror={rerror}'])
        g.launch()
        g.wait_console(r'HV-BOOTED', timeout=120)
        return g, image

    def dd_write(self, g, offset, pattern, sync):
        conv = ' conv=fsync' if sync else ''
        return f'yes {pattern} | dd of=/dev/vda bs=4096 count=1 seek={offset // 4096} oflag=direct' \
               f' iflag=fullblock{conv}'

    def host_read(self, image, offset):
        out = subprocess.run([self.paths.binary('qemu-io'), '-f', 'hybrid', '-c',
                              f'read -v {offset} 16', image], capture_output=True, text=True, check=True)
        return out.stdout

    def test_sync_report(self):
        """sync + werror/rerror=report: the failing write and the failing read
        return EIO to the guest; a flushed write elsewhere is on disk after."""
        g, image = self.guest('sync', 'report')
        g.run(self.dd_write(g, GOOD, 'good', sync=True))
        with self.assertRaisesRegex(hvlib.GuestError, 'exited with 1'):
            g.run(self.dd_write(g, BAD_WRITE, 'bad', sync=False))
        with self.assertRaisesRegex(hvlib.GuestError, 'exited with 1'):
            g.run(f'dd if=/dev/vda of=/dev/null bs=4096 count=1 skip={BAD_READ // 4096} iflag=direct')
        self.assertEqual(g.qmp('query-status')['status'], 'running')
        g.run('sync')
        g.shutdown()
        self.assertIn('good', self.host_read(image, GOOD).replace(' ', ''))

    def test_async_flush_reports(self):
        """async + werror=report: the write completes in RAM, the flush that
        must write it back fails and the guest's fsync gets EIO; the data the
        guest had flushed before is on disk."""
        g, image = self.guest('async', 'report')
        g.run(self.dd_write(g, GOOD, 'good', sync=True))
        g.run(self.dd_write(g, BAD_WRITE, 'bad', sync=False))  # acknowledged from RAM
        with self.assertRaisesRegex(hvlib.GuestError, 'exited with 1'):
            g.run(self.dd_write(g, BAD_WRITE, 'bad', sync=True))
        g.shutdown()
        self.assertIn('good', self.host_read(image, GOOD).replace(' ', ''))

    def test_sync_stop(self):
        """werror=stop: the failing write pauses the VM with BLOCK_IO_ERROR
        (action stop) instead of reaching the guest."""
        g, _ = self.guest('sync', 'stop')
        g.console_send(self.dd_write(g, BAD_WRITE, 'bad', sync=False))
        ev = g.vm.event_wait('BLOCK_IO_ERROR', timeout=60)
        self.assertIsNotNone(ev, 'no BLOCK_IO_ERROR event')
        self.assertEqual((ev['data']['action'], ev['data']['operation']), ('stop', 'write'))
        st = g.qmp('query-status')
        self.assertEqual((st['running'], st['status']), (False, 'io-error'))


if __name__ == '__main__':
    unittest.main()
