"""virsh and the host's clone cache (issue 19, part 2): a real
qemu-storage-daemon holds the clone cache and an NBD server but no export;
a private libvirtd with our hook.  `virsh start` of a domain whose disk is a
qcow2 overlay with an NBD <backingStore> on the daemon's socket: the hook
adds the export of the base at prepare begin, the guest boots through it
(misses fill the cache), and a second domain, a linked clone of the same
base, boots from the cache: it reads far less from the base than the first.
Both guests' writes stay in their overlays; the base is unchanged.
QEMU runs as libvirt-qemu: libvirt gives it the overlays; the daemon's NBD
socket lets group kvm connect, as hvcache@.service with Group=kvm makes it."""
import grp
import hashlib
import json
import os
import subprocess
import sys
import time

from hvtest import LibvirtTest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402


def with_backing(xml, sock):
    """The overlay's disk gets an NBD backing store on the cache's socket."""
    return xml.replace(
        "      <target dev='vda' bus='virtio'/>",
        "      <backingStore type='network'><format type='raw'/>"
        "<source protocol='nbd' name='gold'>"
        f"<host transport='unix' socket='{sock}'/></source><backingStore/>"
        "</backingStore>\n      <target dev='vda' bus='virtio'/>", 1)


class VirshCloneCache(LibvirtTest):

    def setUp(self):
        super().setUp()
        self.tmp = lambda name: os.path.join(self.root, name)
        self.nbd = self.tmp('cc.sock')
        self.hook_qmp = self.tmp('hook.qmp')
        self.qsd = H.clone_cache_daemon(self.tmp, '512M')
        # QEMU runs as libvirt-qemu, whose primary group kvm it keeps: the socket lets
        # that group connect (hvcache@.service: Group=kvm, UMask=0007).  Its
        # QMP monitor stays root's: only the hook (root) uses it.
        os.chown(self.nbd, 0, grp.getgrnam('kvm').gr_gid)
        os.chmod(self.nbd, 0o660)

    def tearDown(self):
        self.stop_host()        # first: its guests read from the daemon
        self.qsd.kill()
        super().tearDown()

    def base_stats(self):
        [c] = self.qsd.cmd('query-clone-cache')
        return c['bases'][0]

    def boot(self, name, rootfs):
        import hvlib
        from hvlib.libvirt import domain_xml, serial_console
        overlay = self.tmp(f'{name}.qcow2')
        subprocess.run([self.paths.binary('qemu-img'), 'create', '-q', '-f', 'qcow2',
                        '-F', 'raw', '-u', '-b', f'nbd+unix:///gold?socket={self.nbd}',
                        overlay, str(os.path.getsize(rootfs))], check=True)
        con, console_args = serial_console(name, self.root, self.logdir)
        self.host.define(with_backing(domain_xml(name, self.paths, mem_mib=256,
                                                 redis_port=hvlib.free_port(),
                                                 append='hv.root=/dev/vda', **console_args,
                                                 disks=[(overlay, 'qcow2')], boot_dir=self.root),
                                      self.nbd))
        t0 = time.monotonic()
        self.host.virsh('start', name)
        con.wait(r'HV-ONDISK /dev/vda', timeout=180)
        con.wait(r'HV-BOOTED', timeout=180)
        took = time.monotonic() - t0
        con.run(f'echo {name} > /root/marker && sync')
        self.host.virsh('destroy', name)
        return took

    def test_virsh_start_adds_the_export_and_clones_boot_from_the_cache(self):
        from hvlib.libvirt import make_hooks_dir
        rootfs = self.paths.guest_file('rootfs.ext4')
        with open(rootfs, 'rb') as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        self.start_host('clone-cache', make_hooks_dir(
            self.root, '64M',
            f'[clone-cache]\nqmp = {self.hook_qmp}\nsocket = {self.nbd}\n'
            '[clone-cache base gold]\nblockdev = ' +
            json.dumps({'driver': 'file', 'filename': rootfs}) +
            '\nbase-id = gold\ngeneration = 1\n'))

        first = self.boot('desk1', rootfs)
        one = self.base_stats()
        self.assertEqual(one['base-id'], 'gold')
        self.assertGreater(one['misses'], 0)
        deadline = time.monotonic() + 60
        while self.qsd.cmd('query-clone-cache')[0]['fill-pending']:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.1)

        second = self.boot('desk2', rootfs)
        two = self.base_stats()
        read1 = one['base-read-bytes']
        read2 = two['base-read-bytes'] - read1
        self.log.info('boot 1: %.1f s, %d bytes from the base; boot 2 (clone): '
                      '%.1f s, %d bytes from the base, %d hits',
                      first, read1, second, read2, two['hits'] - one['hits'])
        self.assertGreater(two['hits'] - one['hits'], 0)
        self.assertLess(read2, read1 / 10)
        with open(rootfs, 'rb') as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), digest,
                             'the base changed')
