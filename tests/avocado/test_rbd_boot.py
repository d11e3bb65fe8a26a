"""A guest boots from an RBD clone of a protected base snapshot (issue 19,
part 1), on a real single-node Ceph cluster with cephx, as client.qemu.
Its writes go to the clone; the base snapshot stays as it was."""
import hashlib
import os
import shutil
import tempfile

from hvtest import HybridVMTest


class BootFromRbdClone(HybridVMTest):

    def setUp(self):
        super().setUp()
        from hvlib.ceph import CephCluster, unavailable
        why = unavailable(self.paths.binary('qemu-img'))
        if why:
            self.cancel(why)
        self.dir = tempfile.mkdtemp(prefix='ceph-boot-', dir=self.paths.build)
        self.ceph = CephCluster(self.dir, port=3301 + os.getpid() % 500 + 500)
        try:
            self.ceph.start()
        except Exception:
            self.ceph.purge()
            raise

    def tearDown(self):
        super().tearDown()
        self.ceph.purge()
        shutil.rmtree(self.dir, ignore_errors=True)

    def digest(self, spec):
        out = os.path.join(self.dir, 'export.raw')
        self.ceph.rbd('export', spec, out)
        with open(out, 'rb') as f:
            h = hashlib.sha256(f.read()).hexdigest()
        os.unlink(out)
        return h

    def test_boot_from_clone(self):
        rootfs = self.paths.guest_file('rootfs.ext4')
        self.ceph.rbd('import', rootfs, 'rbd/base')
        self.ceph.rbd('snap', 'create', 'rbd/base@gold')
        self.ceph.rbd('snap', 'protect', 'rbd/base@gold')
        self.ceph.rbd('clone', 'rbd/base@gold', 'rbd/vm1')
        gold = self.digest('rbd/base@gold')
        info = self.ceph.rbd('info', 'rbd/vm1').stdout
        self.assertIn('parent: rbd/base@gold', info)

        g = self.guest('rbd1', root_disk=self.ceph.filename('vm1'),
                       root_format='raw').launch()
        g.wait_console(r'HV-ROOT /dev/vda', timeout=120)
        g.wait_console(r'HV-ONDISK /dev/vda', timeout=60)
        g.wait_console(r'HV-BOOTED', timeout=60)
        g.run('echo from-the-clone > /root/marker && sync')
        g.run('sync; mount -o remount,ro /')
        g.shutdown()

        self.assertEqual(self.digest('rbd/base@gold'), gold,
                         'the protected base snapshot changed')
        self.assertNotEqual(self.digest('rbd/vm1'), gold,
                            'the guest\'s writes did not reach the clone')
        g = self.guest('rbd2', root_disk=self.ceph.filename('vm1'),
                       root_format='raw').launch()
        g.wait_console(r'HV-BOOTED', timeout=120)
        self.assertEqual(g.run('cat /root/marker').strip(), 'from-the-clone')
