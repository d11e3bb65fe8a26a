"""The test guest boots under TCG and Redis in it serves clients."""
import hvlib
from hvtest import HybridVMTest


class BootRedis(HybridVMTest):

    def test_redis_answers(self):
        """Boot the guest with Redis; PING, SET and GET through the host forward
        return the expected replies, and the console shows init's progress."""
        g = self.guest('boot').launch()
        g.wait_console(r'HV-READY redis', timeout=120)
        r = g.redis()
        self.assertTrue(r.ping())
        self.assertTrue(r.set('greeting', b'hello from the guest'))
        self.assertEqual(r.get('greeting'), b'hello from the guest')
        self.assertIsNone(r.get('no-such-key'))
        self.assertEqual(r.info('server')['redis_version'].split('.')[0], '7')
        # The shell on the serial console works too (used by later tests).
        g.wait_console(r'HV-BOOTED', timeout=30)
        out = g.run('cat /proc/cmdline')
        self.assertIn('hv.redis=1', out)
        self.assertEqual(g.run('echo $((6 * 7))').strip(), '42')
        with self.assertRaisesRegex(hvlib.GuestError, 'exited with 3'):
            g.run('(exit 3)', timeout=20)


class BootFromDisk(HybridVMTest):

    def test_ext4_root_disk(self):
        """Boot with build/guest/rootfs.ext4 on virtio-blk as the root filesystem:
        init switches to it, Redis starts from the disk, and a file written in
        the guest is on the disk after a clean reboot."""
        import shutil
        disk = self.workdir + '/root.raw'
        shutil.copy(self.paths.guest_file('rootfs.ext4'), disk)

        g = self.guest('disk1', root_disk=disk).launch()
        g.wait_console(r'HV-ROOT /dev/vda', timeout=120)
        g.wait_console(r'HV-ONDISK /dev/vda', timeout=60)
        g.wait_console(r'HV-READY redis', timeout=60)
        self.assertTrue(g.redis().set('k', b'v'))
        g.wait_console(r'HV-BOOTED', timeout=30)
        self.assertIn('/dev/vda / ext4', g.run('cat /proc/mounts'))
        g.run('echo persisted-$((40 + 2)) >/root/marker && sync')
        g.run('sync; mount -o remount,ro /')
        g.shutdown()

        g = self.guest('disk2', root_disk=disk).launch()
        g.wait_console(r'HV-ONDISK /dev/vda', timeout=120)
        g.wait_console(r'HV-BOOTED', timeout=60)
        self.assertEqual(g.run('cat /root/marker').strip(), 'persisted-42')
