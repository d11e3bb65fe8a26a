"""Guest RAM in a memory broker region (issue 20, user 2), and a QEMU
restart that keeps it in place (cpr-transfer).

The test, in libvirt's place, asks a real hvmemd for a region, maps it
read-write (the region's lease) and boots the guest with
memory-backend-file,share=on on the descriptor, so the guest's memory is
the region: accounted by the broker, visible to whoever the broker lets
map it (a podman container through `hvmem podman-run`), and kept by the
broker when QEMU exits.  And two podman containers and a guest share one
region (issue 37, item 2): the guest sees it as an ivshmem device."""

import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from hvtest import HybridVMTest
from hvlib.podman import Podman, PodmanMissing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402

MiB = 1024 * 1024


class GuestRamInRegion(HybridVMTest):

    def setUp(self):
        self.pm = None
        self.containers = []
        self.holders = []
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

    def podman(self):
        """Real podman (hvlib.podman), or the test is cancelled."""
        if self.pm is None:
            try:
                self.pm = Podman()
                self.pm.image()
            except PodmanMissing as e:
                self.cancel(str(e))
        return self.pm

    def container_name(self):
        """A unique container name, removed in tearDown."""
        name = f'hvmem-guest-{uuid.uuid4().hex[:12]}'
        self.containers.append(name)
        return name

    def tearDown(self):
        B.stop_podman_runs(self.holders, self.pm, self.containers)
        super().tearDown()
        if self.c:
            self.c.close()
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        shutil.rmtree(self.sockdir, ignore_errors=True)

    def test_guest_ram_is_the_region(self):
        """The guest's memory is the region: a marker the guest writes in
        its RAM is read back through a read-only grant of the region and by
        a podman container that has the region bind-mounted (one that asks
        to write is refused: QEMU's manager holds the lease); the broker
        accounts it and keeps it (with the marker) after QEMU."""
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
            # a podman container gets the same memory bind-mounted
            # read-only while the guest runs; one asking to write is refused
            # (QEMU's manager holds the lease)
            pm = self.podman()
            name = self.container_name()
            r = subprocess.run(B.podman_run_argv(self.broker.sock, 'vm-ram', pm.argv(
                'run', '--rm', '--name', name, '--network', 'none', pm.image(),
                'grep', '-q', '-a', marker, '/run/hvmem/vm-ram')),
                capture_output=True, text=True, env=pm.env(), timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)   # grep's: found
            name = self.container_name()
            r = subprocess.run(B.podman_run_argv(self.broker.sock, 'vm-ram', pm.argv(
                'run', '--name', name, '--network', 'none', pm.image(), 'true'), rw=True),
                capture_output=True, text=True, env=pm.env(), timeout=120)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn('already has a read-write owner', r.stderr)
            self.assertNotEqual(pm.run('container', 'exists', name, check=False).returncode, 0)
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

    def test_containers_and_guest_share_a_region(self):
        """Two podman containers and a guest on one region: a read-write
        container's stores are seen as they happen by a read-only container
        beside it and by the guest, which has the region as an ivshmem
        device's memory (mapped read-only: the guest's stores do not reach
        it); a second read-write container is refused meanwhile, and the
        lease goes with the writer."""
        pm = self.podman()
        size = 4 * MiB                  # an ivshmem BAR: a power of two
        self.c.create('shared', size, 0o644)
        writer, reader = self.container_name(), self.container_name()
        for name, rw in ((writer, True), (reader, False)):
            p = subprocess.Popen(B.podman_run_argv(self.broker.sock, 'shared', pm.argv(
                'run', '--name', name, '--network', 'none', pm.image(), 'sleep', '600'),
                rw=rw), env=pm.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
            self.holders.append(p)
            B.wait_container_running(pm, name, p)
        _, fd = self.c.map('shared')    # read-only, for QEMU
        try:
            os.set_inheritable(fd, True)
            g = self.guest('ivshmem', mem='256M', redis=False, args=[
                '-object', f'memory-backend-file,id=shm0,size={size},'
                f'mem-path=/proc/self/fd/{fd},share=on,readonly=on',
                '-device', 'ivshmem-plain,memdev=shm0'])
            g.boot()
        finally:
            os.close(fd)
        # BAR 2 of the ivshmem device (1af4:1110) is the region
        bar = g.run('d=$(dirname $(grep -l 0x1110 /sys/bus/pci/devices/*/device)); '
                    'sed -n 3p $d/resource | cut -d" " -f1').strip()
        self.assertRegex(bar, r'^0x[0-9a-f]+$')

        def guest_reads(n):
            words = g.run(f'for i in $(seq 0 4 {n - 1}); do devmem $(({bar} + i)) 32; done')
            return b''.join(struct.pack('<I', int(w, 16)) for w in words.split())[:n]

        store = 'printf %s "$1" | dd of="$HVMEM_REGION_PATH" conv=notrunc status=none'
        load = 'head -c "$1" "$HVMEM_REGION_PATH"'
        for _ in range(2):
            marker = f'HV{uuid.uuid4().hex[:14]}'
            pm.run('exec', writer, 'sh', '-c', store, 'sh', marker)
            self.assertEqual(guest_reads(16), marker.encode())
            self.assertEqual(pm.run('exec', reader, 'sh', '-c', load, 'sh', '16').stdout,
                             marker)
        # the guest's stores are dropped (a read-only memory backend)
        g.run(f'devmem {bar} 32 0x41414141')
        self.assertEqual(guest_reads(16), marker.encode())
        self.assertEqual(pm.run('exec', reader, 'sh', '-c', load, 'sh', '16').stdout, marker)
        # the reader cannot write either
        r = pm.run('exec', reader, 'sh', '-c', store, 'sh', 'x', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('Read-only file system', r.stderr)

        name = self.container_name()
        r = subprocess.run(B.podman_run_argv(self.broker.sock, 'shared', pm.argv(
            'run', '--name', name, '--network', 'none', pm.image(), 'true'), rw=True),
            capture_output=True, text=True, env=pm.env(), timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f'already has a read-write owner (pid {self.holders[0].pid})', r.stderr)
        self.assertNotEqual(pm.run('container', 'exists', name, check=False).returncode, 0)

        pm.run('kill', writer)
        self.assertEqual(self.holders[0].wait(60), 137)
        B.wait_for(lambda: not self.c.lookup('shared')['flags'] & B.LEASED, timeout=5,
                   what='the lease to go with the writer')
        self.assertEqual(guest_reads(16), marker.encode())     # the memory stays
        g.shutdown()
