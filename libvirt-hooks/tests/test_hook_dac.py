"""The hook and libvirt's DAC driver: at `start begin` (libvirt has filled in
the domain's <seclabel model='dac'>) the files of hybrid disks, which libvirt
does not know, go to QEMU's label with their owner remembered in trusted
xattrs; `release end` gives them back once no domain holds them.  A QEMU
that could not reach a file or connect to a disk's unix socket is refused,
saying why; a domain not relabelled is left alone."""
import json
import os
import pwd
import socket
import stat
import struct
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hook import HookCase, domain   # noqa: E402

LABEL = (4242, 4243)            # no such user: the hook takes the ids as they are


def with_seclabel(xml, label='+4242:+4243', relabel='yes'):
    sl = (f"<seclabel type='dynamic' model='dac' relabel='{relabel}'>"
          f"<label>{label}</label><imagelabel>{label}</imagelabel></seclabel>")
    return xml.replace('</domain>', sl + '</domain>')


def xattrs(path):
    return {k: os.getxattr(path, k).decode() for k in os.listxattr(path)
            if k.startswith('trusted.hybridvm.')}


@unittest.skipUnless(os.geteuid() == 0, 'chown and trusted xattrs need root')
class HookDacTest(HookCase):

    def setUp(self):
        super().setUp()
        os.chmod(self.dir, 0o711)          # QEMU may pass, as through /var/lib/libvirt/images
        with open(self.image, 'wb') as f:  # a hybrid header: magic, version 1, sizes
            f.write(b'QHYBRID\0' + struct.pack('<II', 1, 72) + bytes(16)
                    + struct.pack('<QQQ', 1 << 30, 1 << 16, 64 << 20) + bytes(16))
        os.chown(self.image, 0, 0)
        os.chmod(self.image, 0o600)
        self.other_state = tempfile.mkdtemp(prefix='hook-dac-', dir=self.dir)

    def xml(self, **kw):
        return with_seclabel(domain(qemu_args=self.hybrid_args(), emulator=self.emulator), **kw)

    def owner(self, path=None):
        st = os.stat(path or self.image)
        return st.st_uid, st.st_gid

    def as_other_host(self, op, sub, xml):
        """The hook with another state directory: the other side of a migration."""
        keep = self.config
        self.config = os.path.join(self.other_state, 'hybridvm.conf')
        with open(self.config, 'w') as f:
            f.write(f'[state]\ndir = {self.other_state}/ledger\nlog = {self.dir}/hook.log\n')
        try:
            return self.hook(op, sub, xml)
        finally:
            self.config = keep

    def test_start_gives_the_image_to_qemu_and_release_gives_it_back(self):
        cp = self.hook('start', 'begin', self.xml())
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(self.owner(), LABEL)
        self.assertEqual(stat.S_IMODE(os.stat(self.image).st_mode), 0o600, 'the mode is left alone')
        self.assertEqual(xattrs(self.image), {'trusted.hybridvm.dac': '0:0',
                                              'trusted.hybridvm.ref_dac': '1'})
        self.assertIn(f"g1: start: {self.image} given to QEMU's DAC label 4242:4243", self.log())
        cp = self.hook('release', 'end', self.xml())
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(self.owner(), (0, 0))
        self.assertEqual(xattrs(self.image), {})
        self.assertIn(f'g1: release: {self.image} given back to 0:0', self.log())
        # a second release (libvirt may call it again) changes nothing
        os.chown(self.image, 7, 7)
        self.assertEqual(self.hook('release', 'end', self.xml()).returncode, 0)
        self.assertEqual(self.owner(), (7, 7))

    def test_both_sides_of_a_migration_hold_the_image(self):
        """Shared storage: the destination takes the image while the source
        runs; the source's release leaves it to the destination, whose
        release gives it back."""
        self.assertEqual(self.hook('start', 'begin', self.xml()).returncode, 0)
        cp = self.as_other_host('start', 'begin', self.xml())
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(xattrs(self.image)['trusted.hybridvm.ref_dac'], '2')
        self.hook('release', 'end', self.xml())
        self.assertEqual(self.owner(), LABEL)
        self.assertIn('still held by 1 domain(s)', self.log())
        self.as_other_host('release', 'end', self.xml())
        self.assertEqual(self.owner(), (0, 0))
        self.assertEqual(xattrs(self.image), {})

    def test_a_start_after_a_lost_release_does_not_count_twice(self):
        """libvirtd died with the domain: the next start of it on this host
        first gives back what the last one took."""
        self.hook('start', 'begin', self.xml())
        self.hook('start', 'begin', self.xml())
        self.assertEqual(xattrs(self.image)['trusted.hybridvm.ref_dac'], '1')
        self.hook('release', 'end', self.xml())
        self.assertEqual(self.owner(), (0, 0))

    def test_not_relabelled_left_alone(self):
        for kw in (dict(relabel='no'), dict(label='+0:+0')):
            cp = self.hook('start', 'begin', self.xml(**kw))
            self.assertEqual(cp.returncode, 0, cp.stderr)
            self.assertEqual(self.owner(), (0, 0), kw)
            self.assertEqual(xattrs(self.image), {})
        cp = self.hook('start', 'begin', domain(qemu_args=self.hybrid_args()))  # no <seclabel>
        self.assertEqual((cp.returncode, self.owner()), (0, (0, 0)))

    def test_names_in_the_label(self):
        cp = self.hook('start', 'begin', self.xml(label='nobody:+4243'))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(self.owner(), (pwd.getpwnam('nobody').pw_uid, 4243))
        self.hook('release', 'end', self.xml())
        for bad in ('nosuchuser-hv:+1', '+1', '+1:+2:+3', '+99999999999:+1', 'x' * 300):
            cp = self.hook('start', 'begin', self.xml(label=bad))
            self.assertEqual(cp.returncode, 1, bad)
            self.assertIn('refusing g1', cp.stderr)
        self.assertEqual(self.owner(), (0, 0))

    def test_refused_when_qemu_cannot_reach_the_image(self):
        os.chmod(self.dir, 0o700)
        cp = self.hook('start', 'begin', self.xml())
        self.assertEqual(cp.returncode, 1)
        self.assertIn(f'QEMU runs as 4242:4243 and cannot reach {self.image}: {self.dir} '
                      '(mode 0700, owner 0:0) does not let it pass', cp.stderr)
        self.assertEqual(self.owner(), (0, 0), 'nothing changed on a refusal')
        os.chown(self.dir, 0, 4243)
        os.chmod(self.dir, 0o710)             # the group QEMU runs as may pass
        self.assertEqual(self.hook('start', 'begin', self.xml()).returncode, 0)

    def test_refused_when_not_a_hybrid_image_or_not_a_file(self):
        with open(self.image, 'r+b') as f:
            f.write(b'NOTHYBRD')
        cp = self.hook('start', 'begin', self.xml())
        self.assertEqual(cp.returncode, 1)
        self.assertIn('is not a hybrid image', cp.stderr)
        cp = self.hook('start', 'begin', with_seclabel(domain(
            qemu_args=self.hybrid_args(path=self.dir), emulator=self.emulator)))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('is not a regular file', cp.stderr)
        self.assertEqual(self.owner(), (0, 0))

    def test_ram_file_path_taken_too(self):
        ram = os.path.join(self.dir, 'tier.ram')
        open(ram, 'wb').close()
        args = ['-blockdev', f'driver=hybrid,node-name=hd0,file.driver=file,'
                             f'file.filename={self.image},ram-file={ram}']
        cp = self.hook('start', 'begin', with_seclabel(domain(qemu_args=args)))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual((self.owner(), self.owner(ram)), (LABEL, LABEL))
        self.hook('release', 'end', '')
        self.assertEqual((self.owner(), self.owner(ram)), ((0, 0), (0, 0)))
        # a descriptor is QEMU's already: nothing to relabel
        args[1] = args[1].replace(f'ram-file={ram}', 'ram-file=/dev/fdset/3')
        self.hook('start', 'begin', with_seclabel(domain(qemu_args=args)))
        with open(os.path.join(self.dir, 'ledger', 'dac', 'g1.json')) as f:
            self.assertEqual([t['path'] for t in json.load(f)], [self.image])

    def test_nbd_socket_qemu_cannot_connect_to(self):
        sock_path = os.path.join(self.dir, 'cc.sock')
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(sock_path)
        self.addCleanup(srv.close)
        os.chmod(sock_path, 0o755)
        xml = with_seclabel(
            "<domain type='qemu'><name>g1</name><memory unit='MiB'>256</memory><devices>"
            "<disk type='file' device='disk'><source file='/x.qcow2'/><backingStore type='network'>"
            f"<source protocol='nbd' name='gold'><host transport='unix' socket='{sock_path}'/>"
            "</source></backingStore><target dev='vda'/></disk></devices></domain>")
        cp = self.hook('start', 'begin', xml)
        self.assertEqual(cp.returncode, 1)
        self.assertIn(f'cannot connect to {sock_path} (NBD export "gold"): the socket (mode '
                      '0755, owner 0:0) does not let it connect; run its daemon with a group '
                      'QEMU has', cp.stderr)
        os.chown(sock_path, 0, 4243)
        os.chmod(sock_path, 0o770)        # what hvcache@.service with Group= makes
        cp = self.hook('start', 'begin', xml)
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(self.owner(sock_path), (0, 4243), 'a socket is never relabelled')
        # QEMU also has its user's primary group (libvirt-qemu's is kvm on Debian)
        nobody = pwd.getpwnam('nobody')
        os.chown(sock_path, 0, nobody.pw_gid)
        self.assertEqual(self.hook('start', 'begin', xml).returncode, 1)
        cp = self.hook('start', 'begin', xml.replace('+4242:+4243', 'nobody:+4243'))
        self.assertEqual(cp.returncode, 0, cp.stderr)


if __name__ == '__main__':
    unittest.main()
