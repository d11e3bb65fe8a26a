"""Guest RAM in a memory broker region (issue 20, user 2), and a QEMU
restart that keeps it in place (cpr-transfer).

The test, in libvirt's place, asks a real hvmemd for a region, maps it
read-write (the region's lease) and boots the guest with
memory-backend-file,share=on on the descriptor, so the guest's memory is
the region: accounted by the broker, visible to whoever the broker lets
map it, and kept by the broker when QEMU exits."""

import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
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
        its RAM is read back through a read-only grant of the region and by
        a container that has the region bind-mounted; the broker accounts
        it and keeps it (with the marker) after QEMU."""
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
            # a container (broker/hvmem-container) gets the same memory
            # bind-mounted read-only while the guest runs
            find = ("import mmap, os, sys; f = open(os.environ['HVMEM_REGION_PATH'], 'rb'); "
                    "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
                    "print('found' if m.find(sys.argv[1].encode()) >= 0 else 'absent')")
            r = subprocess.run([os.path.join(REPO, 'broker', 'hvmem-container'), '-s',
                                self.broker.sock, 'vm-ram', '--', B.SYSTEM_PYTHON, '-c',
                                find, marker], capture_output=True, text=True,
                               env=dict(os.environ, HVMEM=B.HVMEM), timeout=60)
            self.assertEqual(r.stdout.strip(), 'found', r.stdout + r.stderr)
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

    def test_cpr_restart_keeps_guest_ram_in_place(self):
        """QEMU 10.0's cpr-transfer: a new QEMU takes over the running
        guest, its RAM staying in the region (nothing copied); the guest
        carries on with what it had in memory.  The pause is measured."""
        size = 256 * MiB
        self.c.create('vm-ram', size, 0o600)
        _, fd = self.c.map('vm-ram', rw=True)
        os.set_inheritable(fd, True)
        ram = ['-object', 'memory-backend-file,id=ram0,size=256M,'
               f'mem-path=/proc/self/fd/{fd},share=on,prealloc=off',
               '-machine', 'memory-backend=ram0,aux-ram-share=on']
        try:
            # a second QMP monitor, on a plain socket the migrate thread
            # can use (QEMUMachine's QMP client belongs to this thread's
            # event loop; qemu.qmp's legacy client makes one of its own)
            qmp2 = os.path.join(self.sockdir, 'old-qmp.sock')
            old = self.guest('cpr-old', mem='256M', redis=False, args=ram + [
                '-chardev', f'socket,id=qmp2,path={qmp2},server=on,wait=off',
                '-mon', 'chardev=qmp2,mode=control'])
            old.launch()
            old.wait_console(r'HV-BOOTED', timeout=120)
            marker = f'HVCPR-{uuid.uuid4().hex}'
            old.run(f'echo {marker} > /tmp/marker && cat /tmp/marker')
            from qemu.qmp.legacy import QEMUMonitorProtocol  # where hvlib found QEMU's
            main_sock = os.path.join(self.sockdir, 'main.sock')
            cpr_sock = os.path.join(self.sockdir, 'cpr.sock')
            cpr = json.dumps({'channel-type': 'cpr', 'addr': {
                'transport': 'socket', 'type': 'unix', 'path': cpr_sock}})
            new = self.guest('cpr-new', mem='256M', redis=False,
                             args=ram + ['-incoming', cpr],
                             incoming=f'unix:{main_sock}')
            # New QEMU reads the cpr channel before it opens its monitor, so
            # its launch() returns only once the old one has sent it: the
            # migrate command goes from a thread.  (Not the other way round:
            # QEMU runs under setpriv --pdeathsig, which fires when the
            # *thread* that started it exits.)
            started = []

            def migrate():
                deadline = time.monotonic() + 60
                while not os.path.exists(cpr_sock):
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.02)
                mon = QEMUMonitorProtocol(qmp2)
                mon.connect()
                mon.settimeout(60)
                mon.cmd('migrate-set-parameters', mode='cpr-transfer')
                started.append(time.monotonic())
                mon.cmd('migrate', channels=[
                    {'channel-type': 'main', 'addr': {
                        'transport': 'socket', 'type': 'unix',
                        'path': main_sock}},
                    {'channel-type': 'cpr', 'addr': {
                        'transport': 'socket', 'type': 'unix',
                        'path': cpr_sock}}])
                mon.close()
            t = threading.Thread(target=migrate)
            t.start()
            try:
                new.launch()
            finally:
                t.join(120)
            self.assertTrue(started, 'the new QEMU made no cpr socket')
            t0 = started[0]
            while new.qmp('query-status')['status'] != 'running':
                self.assertLess(time.monotonic() - t0, 60, 'never ran')
                time.sleep(0.005)
            pause_ms = (time.monotonic() - t0) * 1000
            info = old.qmp('query-migrate')
            self.assertEqual(info['status'], 'completed', info)
            # RAM stayed in place: almost nothing went through the channel
            self.assertLess(info['ram']['transferred'], 16 * MiB, info)
            self.assertEqual(new.run('cat /tmp/marker').strip(), marker)
            self.log.info('cpr-transfer: migrate to running %.0f ms, '
                          'downtime %s ms, %d bytes of RAM sent', pause_ms,
                          info.get('downtime'), info['ram']['transferred'])
            print(f'cpr-transfer pause {pause_ms:.0f} ms, downtime '
                  f'{info.get("downtime")} ms', file=sys.stderr)
            old.shutdown()
            new.shutdown()
        finally:
            os.close(fd)
