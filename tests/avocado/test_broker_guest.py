"""Guest RAM in a memory broker region (issue 20, user 2).

The test, in libvirt's place, asks a real hvmemd for a region, maps it
read-write (the region's lease) and boots the guest with
memory-backend-file,share=on on the descriptor, so the guest's memory is
the region: accounted by the broker, visible to whoever the broker lets
map it, and kept by the broker when QEMU exits."""

import mmap
import os
import shutil
import sys
import tempfile
import uuid

from hvtest import HybridVMTest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402

MiB = 1024 * 1024


class GuestRamInRegion(HybridVMTest):

    def setUp(self):
        super().setUp()
        if not os.path.exists(B.HVMEMD):
            self.cancel(f'{B.HVMEMD} not built')
        self.pool = tempfile.mkdtemp(prefix='guest-ram-pool-', dir='/dev/shm')
        os.rmdir(self.pool)
        # unix socket paths must stay under 108 bytes: a short private dir
        self.sockdir = tempfile.mkdtemp(prefix='hv-broker-')
        self.broker = B.Broker(self.sockdir, self.pool)
        self.c = None
        self.broker.start()
        self.c = self.broker.client()

    def tearDown(self):
        super().tearDown()
        if self.c:
            self.c.close()
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        shutil.rmtree(self.sockdir, ignore_errors=True)

    def test_guest_ram_is_the_region(self):
        """The guest's memory is the region: a marker the guest writes in
        its RAM is read back through a read-only grant of the region; the
        broker accounts it and keeps it (with the marker) after QEMU."""
        size = 256 * MiB
        self.c.create('vm-ram', size, 0o640)
        _, fd = self.c.map('vm-ram', rw=True)
        try:
            g = self.guest('ramreg', mem='256M', redis=False, args=[
                '-object', 'memory-backend-file,id=ram0,size=256M,'
                f'mem-path=/proc/self/fd/{fd},share=on,prealloc=off',
                '-machine', 'memory-backend=ram0'])
            # memory-backend-file opens mem-path with open(2), so not
            # /dev/fdset/N: the descriptor is inherited (QEMUMachine
            # launches with close_fds=False)
            os.set_inheritable(fd, True)
            g.launch()
            g.wait_console(r'HV-BOOTED', timeout=120)
            marker = f'HVRAM-{uuid.uuid4().hex}'
            # /tmp in the guest's initramfs lives in its RAM
            g.run(f'echo {marker} > /tmp/marker && cat /tmp/marker')
            pool = self.c.pool()
            self.assertGreaterEqual(pool['used'], size)
            # another connection, read-only, sees the guest's memory
            other = self.broker.client()
            _, ro = other.map('vm-ram')
            with mmap.mmap(ro, size, prot=mmap.PROT_READ) as m:
                self.assertGreaterEqual(m.find(marker.encode()), 0,
                                        'the marker is not in the region')
                with self.assertRaises(TypeError):
                    m[0:1] = b'x'       # read-only mapping
            with self.assertRaises(PermissionError):
                mmap.mmap(ro, size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(ro)
            other.close()
            g.shutdown()
        finally:
            os.close(fd)
        # QEMU is gone; the region (and what the guest left in it) stays
        info = self.c.lookup('vm-ram')
        self.assertEqual(info['size'], size)
        _, ro = self.c.map('vm-ram')
        with mmap.mmap(ro, size, prot=mmap.PROT_READ) as m:
            self.assertGreaterEqual(m.find(marker.encode()), 0)
        os.close(ro)
