"""Functional test: the guest boots from a hybrid root disk (the ext4 root
image converted with qemu-img convert), in sync and in async mode, writes
data, shuts down, boots again and finds it."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402
from hybridlib import hvlib   # noqa: E402


def guest_ready():
    paths = hvlib.BuildPaths()
    try:
        paths.binary('qemu-system-x86_64')
        paths.guest_file('vmlinuz')
        paths.guest_file('initrd.img')
        paths.guest_file('rootfs.ext4')
    except hvlib.MissingBuild as exc:
        return False, str(exc)
    return True, ''


READY, WHY = guest_ready()


class GuestDiskCase(H.GuestCase):
    """Guests booting from a root disk of ours (a mixin for TestCase)."""

    dir_prefix = 'hybrid-boot-'

    def boot(self, name, disk, fmt):
        g = self.add_guest(name, root_disk=disk, root_format=fmt)
        g.launch()
        g.wait_console(r'HV-ROOT /dev/vda', timeout=180)
        g.wait_console(r'HV-ONDISK /dev/vda', timeout=120)
        g.wait_console(r'HV-BOOTED', timeout=120)
        return g

    def stop(self, g):
        g.run('sync; mount -o remount,ro /', timeout=60)
        g.shutdown()
        self.guests.remove(g)


@unittest.skipUnless(READY, f'guest not built: {WHY}')
class HybridBootTest(GuestDiskCase, unittest.TestCase):

    def test_boot_sync_then_async(self):
        """Boot in sync mode and write a marker; reboot in async mode (a
        runtime override), find it and write another; reboot in sync mode
        and find both.  qemu-img check is clean afterwards."""
        disk = os.path.join(self.dir, 'root.hyb')
        H.qemu_img('convert', '-O', 'hybrid', '-o', 'mode=sync,ram-size=128M',
                   self.paths.guest_file('rootfs.ext4'), disk)

        g = self.boot('hyb-sync', disk, 'hybrid')
        self.assertIn('/dev/vda / ext4', g.run('cat /proc/mounts'))
        g.run('echo sync-$((40 + 2)) >/root/m1 && sync')
        self.stop(g)

        g = self.boot('hyb-async', disk, 'hybrid,mode=async')
        self.assertEqual(g.run('cat /root/m1').strip(), 'sync-42')
        g.run('echo async-$((6 * 7)) >/root/m2 && sync')
        self.stop(g)

        g = self.boot('hyb-sync2', disk, 'hybrid')
        self.assertEqual(g.run('cat /root/m1').strip(), 'sync-42')
        self.assertEqual(g.run('cat /root/m2').strip(), 'async-42')
        self.stop(g)

        self.assertEqual(H.qemu_img('check', '-f', 'hybrid', disk).returncode, 0)
        info = H.img_info(disk)
        self.assertFalse(info['format-specific']['data']['dirty'])


if __name__ == '__main__':
    unittest.main()
