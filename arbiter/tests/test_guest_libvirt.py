"""The arbiter driving a VM that libvirt manages: a private libvirtd, a
TCG guest defined with `virsh define` whose virtio disk is the
shared loop device, the guest streaming 1 MiB direct reads from it and a
podman container running fio on the same device (the arbiter given its
podman name).  The arbiter reaches the domain through
libvirt's API (arbiter/libvirtlink.py): the limits it sets are what
`virsh blkdeviotune --live` shows, the domain's persistent definition is
left alone, the watchdog's restore goes through libvirt too, and a domain
that stops or is not there is an error in `status`, not a crash, and is
taken up again when it runs."""

import os
import shutil
import signal
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arblib as A   # noqa: E402
from arblib import H   # noqa: E402
import hvlib   # noqa: E402
from hvlib.libvirt import (LibvirtHost, domain_xml, libvirt_available,   # noqa: E402
                           qemu_dir, serial_console)

# The arbiter as installed runs under the system's python3, where Debian's
# python3-libvirt is (the tests' venv does not see it).
SYSTEM_PY = '/usr/bin/python3'


def unavailable():
    why = A.unavailable() or libvirt_available()
    if why:
        return why
    r = subprocess.run([SYSTEM_PY, '-c', 'import libvirt'], capture_output=True)
    if r.returncode:
        return 'the libvirt Python bindings are not installed (apt-get install python3-libvirt)'
    return None


WHY = unavailable()
DOM = 'hvarb'


def iotune(host, disk='vda', *flags):
    """virsh blkdeviotune's figures of the disk, {name: value}."""
    out = host.virsh('blkdeviotune', DOM, disk, *flags).stdout
    res = {}
    for line in out.splitlines():
        k, _, v = line.partition(':')
        res[k.strip()] = v.strip()
    return res


@unittest.skipIf(WHY, WHY)
class LibvirtArbiterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = H.TempDir()
        cls.loop = A.Loop(cls.tmp.path, 128)
        cls.root = qemu_dir()     # short (unix socket paths); QEMU (libvirt-qemu) boots from it
        cls.host = LibvirtHost('arb', os.path.join(cls.root, 'a'))
        try:
            cls.host.start()
            con, console_args = serial_console(DOM, cls.root, cls.tmp.path)
            cls.host.define(domain_xml(DOM, hvlib.BuildPaths(), mem_mib=256, append='',
                                       redis_port=hvlib.free_port(), **console_args,
                                       block_disks=[cls.loop.dev], boot_dir=cls.root))
            cls.host.virsh('start', DOM)
            cls.con = con
            cls.con.wait(r'HV-BOOTED', timeout=240)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, 'con', None):
            cls.con.close()
        cls.host.stop()
        shutil.rmtree(cls.root, ignore_errors=True)
        cls.loop.close()
        cls.tmp.cleanup()

    def daemon(self, target_ms=0.05, extra_vm='', state='state', domain=DOM, disk='vda'):
        ctr = f'arbv-{os.getpid()}'
        conf = A.config(self.tmp, self.loop.dev, [], [ctr], target_ms=target_ms,
                        extra_device='gap = 1\n', state=state)
        with open(conf, 'a') as f:
            f.write(f'[vm v]\nlibvirt = {self.host.uri}\ndomain = {domain}\ndevice = {disk}\n'
                    f'floor-iops = 10\n{extra_vm}')
        d = A.Daemon(conf, self.tmp, state=state, python=SYSTEM_PY)
        self.addCleanup(d.close)
        return d, ctr

    def load(self, on):
        if on:
            self.con.run('touch /tmp/go; (while [ -e /tmp/go ]; do '
                         'dd if=/dev/vda of=/dev/null bs=1M iflag=direct 2>/dev/null; done) & :')
        else:
            self.con.run('rm -f /tmp/go; wait', timeout=120)

    def start_cutting(self, d, ctr, seconds):
        """The guest streaming and a container over the (tiny) target for
        `seconds`: returns the container's fio once the daemon has applied
        a cut through libvirt."""
        self.load(True)
        self.addCleanup(self.load, False)
        p = A.container(self.tmp, ctr, self.loop.dev, seconds)
        self.addCleanup(p.stop)
        d.wait(lambda s: (s['vm_state']['v']['limits'] or {}).get('iops-total', 0) > 0,
               what='a cut applied through libvirt')
        return p

    def test_1_cuts_through_blkdeviotune_and_lets_go(self):
        d, ctr = self.daemon(extra_vm='throttle-group = arbgrp\n')
        d.wait(lambda s: s['vm_state']['v']['state'] == 'ok', what='the domain attached')
        self.assertFalse(d.status()['vm_state']['v']['histogram'])
        p = self.start_cutting(d, ctr, 8)
        try:
            live = iotune(self.host, 'vda', '--live')
            # the loop steps every period, virsh takes longer than one: the
            # live value is one the arbiter decided
            decided = [r['vms']['v']['limit'] for r in d.records()
                       if r.get('action') and (r['vms'].get('v') or {}).get('limit')]
            iops = int(live['total_iops_sec'])
            self.assertTrue(any(abs(iops - x) <= 1 for x in decided), (iops, decided[-10:]))
            self.assertGreater(int(live['total_bytes_sec']), 0)
            self.assertEqual(live['group_name'], 'arbgrp')
            # the persistent definition is the user's, untouched
            self.assertEqual(int(iotune(self.host, 'vda', '--config')['total_iops_sec']), 0)
            # the VM's latency is its mean (libvirt has no histogram)
            vms = [r['vms']['v'] for r in d.records() if r.get('action') and 'v' in r.get('vms', {})]
            self.assertTrue([m for m in vms if (m.get('mean_ms') or 0) > 0], vms[-5:])
            self.assertTrue(all(m.get('p99_ms') is None for m in vms))
            self.assertIn('hvarbiter_vm_mean_seconds{vm="v"}', d.ask('metrics'))
        finally:
            p.result(timeout=120)
        # containers idle: lifted, through libvirt as well
        d.wait(lambda s: (s['vm_state']['v']['limits'] or {}).get('iops-total', 1) == 0,
               what='the limits lifted')
        self.assertEqual(int(iotune(self.host, 'vda', '--live')['total_iops_sec']), 0)
        self.assertEqual(d.terminate(), 0)

    def test_2_watchdog_restores_through_libvirt(self):
        d, ctr = self.daemon(state='wd')
        p = self.start_cutting(d, ctr, 6)
        try:
            self.assertGreater(int(iotune(self.host, 'vda', '--live')['total_iops_sec']), 0)
            d.terminate(signal.SIGKILL)
            A.wait_for(lambda: int(iotune(self.host, 'vda', '--live')['total_iops_sec']),
                       lambda v: v == 0, 20, 'the watchdog restoring the default')
        finally:
            p.result(timeout=120)
        ev = [r.get('event') for r in d.records() if r.get('event') in ('watchdog', 'restore-default')]
        self.assertEqual(ev, ['watchdog', 'restore-default'])
        self.assertEqual([r['error'] for r in d.records() if r.get('event') == 'restore-default'],
                         [None])

    def test_3_a_domain_that_goes_away_and_bad_names(self):
        d, _ = self.daemon(state='gone')
        d.wait(lambda s: s['vm_state']['v']['state'] == 'ok', what='attached')
        # the domain stops under it: an error in status, the daemon goes on
        self.host.virsh('destroy', DOM)
        try:
            s = d.wait(lambda s: s['vm_state']['v']['state'] == 'absent', timeout=30,
                       what='the domain seen gone')
            self.assertIn('not running', s['vm_state']['v']['error'])
            d.check_alive()
        finally:
            self.host.virsh('start', DOM)       # the last test: no need to wait for its boot
        d.wait(lambda s: s['vm_state']['v']['state'] == 'ok', timeout=30,
               what='re-attached once the domain runs again')
        self.assertEqual(d.terminate(), 0)
        # a disk the domain does not have, and a domain that does not exist
        for state, kw, words in (('bad-disk', dict(disk='vdz'), 'vdz'),
                                 ('bad-dom', dict(domain='nosuchdomain'), 'nosuchdomain')):
            d, _ = self.daemon(state=state, **kw)
            s = d.wait(lambda s: s['vm_state']['v']['error'], what='the error reported')
            self.assertIn(words, s['vm_state']['v']['error'])
            d.check_alive()
            self.assertEqual(d.terminate(), 0)


if __name__ == '__main__':
    unittest.main()
