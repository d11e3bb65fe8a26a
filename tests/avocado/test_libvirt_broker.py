"""virsh and the memory broker (issue 20, user 4): a private libvirtd with our
hook configured for a real hvmemd.  `virsh start` provisions the broker
regions the domain names in its metadata; a domain whose regions do not fit
in the pool is refused with the hook's reason; `virsh destroy` (release end)
destroys the regions the domain named with lifetime="domain".  QEMU runs
as libvirt-qemu and never opens a region by path (the pool is root's, 0700):
it receives one as a descriptor through libvirt's monitor (add-fd), and uses
it as /dev/fdset/N."""
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile

from hvtest import LibvirtTest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402

MiB = 1 << 20


class VirshBroker(LibvirtTest):

    def setUp(self):
        super().setUp()
        if not os.path.exists(B.HVMEMD):
            self.cancel(f'{B.HVMEMD} not built')
        self.pool = tempfile.mkdtemp(prefix='lv-broker-pool-', dir='/dev/shm')
        os.rmdir(self.pool)
        self.broker = B.Broker(self.root, self.pool, ['--capacity', '128M'])
        self.broker.start()

    def tearDown(self):
        self.stop_host()        # first: its hook talks to the broker
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        super().tearDown()

    def test_virsh_start_provisions_and_destroy_releases(self):
        from hvlib.libvirt import domain_xml, make_hooks_dir, with_broker_regions
        import hvlib
        self.start_host('broker', make_hooks_dir(
            self.root, '64M', f'[broker]\nsocket = {self.broker.sock}\nhvmem = {B.HVMEM}\n'))
        c = self.broker.client()
        self.host.define(with_broker_regions(
            domain_xml('hvb1', self.paths, mem_mib=256, redis_port=hvlib.free_port(), append='',
                       boot_dir=self.root),
            [dict(name='hvb1-scratch', size='32M', lifetime='domain'),
             dict(name='hvb1-tier', size='16M', lifetime='persistent')]))
        self.host.virsh('start', 'hvb1')
        self.assertEqual(sorted(r['name'] for r in c.list()),
                         ['hvb1-scratch', 'hvb1-tier'])
        # a second domain asking for more than the pool has left is refused
        self.host.define(with_broker_regions(
            domain_xml('hvb2', self.paths, mem_mib=256, redis_port=hvlib.free_port(), append='',
                       boot_dir=self.root),
            [dict(name='hvb2-ram', size='96M', lifetime='domain')]))
        r = self.host.virsh('start', 'hvb2', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('cannot hold the domain', r.stderr)
        self.host.virsh('destroy', 'hvb1')
        B.wait_for(lambda: sorted(x['name'] for x in c.list()) == ['hvb1-tier'],
                   what='release end to destroy hvb1-scratch')
        c.close()

    def add_fd(self, dom, fd, opaque, wrap=()):
        """Hand QEMU the descriptor `fd` through libvirt's monitor (QMP add-fd
        with `virsh qemu-monitor-command --pass-fds`, one descriptor a call);
        `wrap` is a command that runs virsh with the descriptor in $HVMEM_FD
        (hvmem map).  Returns the fdset QEMU put it in."""
        cmd = json.dumps({'execute': 'add-fd', 'arguments': {'opaque': opaque}})
        virsh = ['virsh', '-q', '-c', self.host.uri, 'qemu-monitor-command', dom, '--pass-fds']
        if wrap:
            argv = [*wrap, 'sh', '-c', 'exec "$@" "$HVMEM_FD" "$0"', cmd, *virsh]
        else:
            argv = [*virsh, str(fd), cmd]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                           pass_fds=() if wrap else (fd,))
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)['return']['fdset-id']

    def qmp(self, dom, cmd, **args):
        out = self.host.virsh('qemu-monitor-command', dom,
                              json.dumps({'execute': cmd, 'arguments': args})).stdout
        return json.loads(out)['return']

    def test_a_region_reaches_libvirts_qemu_as_a_descriptor(self):
        """The hook creates the domain's region; the domain starts paused;
        root maps the region read-write (`hvmem map --rw`, the lease) and
        passes the descriptor to QEMU through libvirt (add-fd), as it does
        the hybrid image; a hybrid disk with its RAM tier in the region
        (ram-file=/dev/fdset/N) is added, the guest runs and writes to it.
        The region holds what the guest wrote; while QEMU holds it no other
        read-write owner is granted; QEMU runs as libvirt-qemu throughout."""
        from hvlib.libvirt import (domain_xml, make_hooks_dir, qemu_ids, serial_console,
                                   with_broker_regions)
        import hvlib
        self.start_host('broker', make_hooks_dir(
            self.root, '64M', f'[broker]\nsocket = {self.broker.sock}\nhvmem = {B.HVMEM}\n'))
        image = os.path.join(self.root, 'data.hybrid')
        subprocess.run([self.paths.binary('qemu-img'), 'create', '-q', '-f', 'hybrid',
                        '-o', 'ram-size=16M,mode=sync', image, '64M'], check=True)
        con, console_args = serial_console('hvb3', self.root, self.logdir)
        self.host.define(with_broker_regions(
            domain_xml('hvb3', self.paths, mem_mib=256, redis_port=hvlib.free_port(), append='',
                       boot_dir=self.root, **console_args),
            [dict(name='hvb3-tier', size='18M', lifetime='domain')]))   # 16M + 2M of header
        self.host.virsh('start', '--paused', 'hvb3')
        [pid] = self.host.qemu_pids()
        with open(f'/proc/{pid}/status') as f:
            uid = [line.split()[1:] for line in f if line.startswith('Uid')][0]
        self.assertEqual(uid, [str(qemu_ids()[0])] * 4)

        fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
        try:
            image_set = self.add_fd('hvb3', fd, 'hybrid image')
        finally:
            os.close(fd)
        tier_set = self.add_fd('hvb3', None, 'broker region hvb3-tier',
                               wrap=[B.HVMEM, '-s', self.broker.sock, 'map', 'hvb3-tier', '--rw',
                                     '--'])
        self.qmp('hvb3', 'blockdev-add', driver='hybrid', **{'node-name': 'tier0'},
                 **{'ram-file': f'/dev/fdset/{tier_set}'},
                 file={'driver': 'file', 'filename': f'/dev/fdset/{image_set}'})
        self.qmp('hvb3', 'device_add', driver='virtio-blk-pci', drive='tier0', id='vdtier',
                 bus='pci.0', addr='0x1c')
        self.host.virsh('resume', 'hvb3')
        con.wait(r'HV-BOOTED', timeout=240)
        con.run('printf HV-REGION-MARKER-%d 42 > /dev/vda && sync')

        [info] = self.qmp('hvb3', 'query-hybrid', **{'node-name': 'tier0'})
        self.log.info('query-hybrid: %s', info)
        self.assertEqual(info['region']['file'], f'/dev/fdset/{tier_set}')

        c = self.broker.client()
        try:
            # QEMU holds it read-write: nobody else gets it so
            with self.assertRaises(B.BrokerError) as cm:
                c.map('hvb3-tier', rw=True)
            self.assertEqual(cm.exception.errno, errno.EBUSY, str(cm.exception))
            _, rfd = c.map('hvb3-tier')
            try:
                region = os.pread(rfd, 18 << 20, 0)
            finally:
                os.close(rfd)
        finally:
            c.close()
        self.assertEqual(region[:8], b'QHYBRAM\0')
        self.assertIn(b'HV-REGION-MARKER-42', region)
        self.host.virsh('destroy', 'hvb3')
