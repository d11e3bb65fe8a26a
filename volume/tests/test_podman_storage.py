"""Podman's whole storage on a hybrid volume (issue 37, item 1): its
graphroot (image layers, containers' writable layers, its database) on ext4
on the volume, so that layers live in the RAM tier, backed by the image.

A volume of 2 GiB with a 512 MiB RAM tier in async mode is mounted with
the library, a podman instance's root pointed into it (`--root`, what
`graphroot` in storage.conf sets; its runroot stays off the volume, as
storage.conf's /run/containers/storage does), the test image imported into
it, and containers run with the kernel's overlay over the volume's ext4:

- a container kept after it exits, with a file in its writable layer;
- a running container keeps the volume busy: hvvol umount is refused
  naming its conmon (which holds its log there) and podman's overlay mount;
- once no container runs, podman has nothing mounted on the volume and
  hvvol umount goes through (image clean); mounted again (a new daemon),
  the same storage has the image, runs containers, and the kept
  container's writable layer still holds its file; e2fsck is clean at the
  end.
"""

import json
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import privatens                                 # noqa: E402
from vollib import VolumeTest                     # noqa: E402
from volume import host                           # noqa: E402
from volume.errors import Busy                     # noqa: E402
from hvlib.podman import Podman, PodmanMissing     # noqa: E402

KEEP = 'cat /state 2>/dev/null; echo "run $(date +%s%N)" >> /state; redis-server --version'


class GraphrootTest(VolumeTest):

    def setUp(self):
        privatens.enter()
        super().setUp()
        self.containers = []
        self.pm = None

    def tearDown(self):
        if self.pm is not None and self.containers:
            self.pm.rm(*self.containers)
        super().tearDown()

    def podman(self, mp):
        """podman whose graphroot is on the volume; its runroot is not."""
        try:
            pm = Podman(root=os.path.join(mp, 'storage'))
        except PodmanMissing as exc:
            self.skipTest(str(exc))
        pm.runroot = os.path.join(self.tmp, 'runroot')
        return pm

    def name(self, tag):
        n = f'hvgr{os.getpid()}-{tag}'
        self.containers.append(n)
        return n

    def mounts_on(self, dev, mp):
        return [m['target'] for m in host.mountinfo()
                if m['target'].startswith(mp + '/') or (m['dev'] == tuple(dev) and
                                                        m['target'] != mp)]

    def umount_after_podman(self, name):
        """Unmount @name once podman's own processes are done with it:
        `podman rm` can return while the `podman container cleanup` that
        conmon started at the container's exit still holds a file of the
        store open (seen once in CI).  Anything else holding it, or podman
        for more than 30 s, is the refusal it is."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return self.vols.umount(name)
            except Busy as e:
                if time.monotonic() > deadline or \
                        any(u[1] != 'podman' for u in e.users):
                    raise
                time.sleep(0.2)

    def test_graphroot_on_a_volume(self):
        self.vols.create('store', {'size': '2G', 'ram-size': '512M', 'mode': 'async'})
        mp = self.mountpoint('containers')
        self.vols.mount('store', mp)
        dev = self.vols._state('store')['dev']
        self.pm = pm = self.podman(mp)
        image = pm.image()
        info = json.loads(pm.run('info', '--format', 'json').stdout)
        self.assertEqual(info['store']['graphDriverName'], 'overlay')
        self.assertEqual(info['store']['graphRoot'], os.path.join(mp, 'storage'))
        layers = os.path.join(mp, 'storage', 'overlay')
        self.assertEqual(os.stat(layers).st_dev, os.makedev(*dev), 'layers on the volume')
        used = int(subprocess.run(['du', '-sm', layers], capture_output=True, text=True,
                                  check=True).stdout.split()[0])
        self.assertGreater(used, 100, 'the image\'s layers are on the volume')

        keep = self.name('keep')
        first = pm.run('run', '--name', keep, '--network', 'none', image, 'sh', '-c',
                       KEEP).stdout.splitlines()
        self.assertEqual(len(first), 1, first)          # no /state yet; redis' version
        self.assertIn('Redis server', first[0])
        busy = self.name('busy')
        pm.run('run', '-d', '--name', busy, '--network', 'none', image, 'sleep', '600')
        state = pm.inspect(busy)['State']
        pid, conmon = state['Pid'], state['ConmonPid']
        root = [m for m in host.mountinfo(pid) if m['target'] == '/']
        self.assertEqual(root[-1]['fstype'], 'overlay', 'the kernel\'s overlay over ext4')
        with self.assertRaises(Busy) as e:
            self.vols.umount('store')
        # the container's own namespace has only the overlay (a device of
        # its own); its conmon holds its log on the volume, and the overlay
        # driver's home is bind-mounted on itself while a container runs.
        # (The message names the first few users: other mount namespaces
        # made while the volume was mounted hold it too, and may come first.)
        self.assertIn((conmon, 'conmon', 'open file'),
                      [(u[0], u[1], u[3]) for u in e.exception.users], str(e.exception))
        self.assertIn(f'mounted elsewhere in this namespace: {layers}',
                      [u[3] for u in e.exception.users if u[0] == 0][0])
        self.assertEqual(self.vols.status('store')['state'], 'mounted')

        pm.rm(busy)
        self.assertEqual(self.mounts_on(dev, mp), [], 'podman left nothing mounted')
        self.assertEqual(self.umount_after_podman('store'), {'recovered': False})
        self.assertTrue(self.image_clean(self.vols._config('store')['image']))

        self.vols.mount('store', mp)
        dev = self.vols._state('store')['dev']
        self.assertIn(image, pm.run('images', '--format', '{{.Repository}}').stdout)
        out = pm.run('start', '-a', keep).stdout.splitlines()
        self.assertEqual(len(out), 2, out)
        self.assertTrue(out[0].startswith('run '), 'the writable layer kept its file')
        out = pm.run('run', '--rm', '--network', 'none', image, 'sh', '-c',
                     'redis-server --version && ls /usr/bin/fio').stdout
        self.assertIn('/usr/bin/fio', out)
        pm.rm(keep)
        self.assertEqual(self.mounts_on(dev, mp), [])
        self.umount_after_podman('store')
        rc, out = self.fsck('store')
        self.assertEqual(rc, 0, out)


if __name__ == '__main__':
    unittest.main()
