"""The hook takes over a hybrid disk's mirror left by a host that died
(issue 39, failover): a real hvmemd holds the mirror region, real qemu-io
writes through the mirror and is killed (its host "died"); the hook, run as
libvirt runs it at `prepare begin`, finds the region by the image's region
token, writes its blocks back into the image, and the start goes on.  What
must not happen: a takeover while the region is still held (the mirror's
export), on an incoming migration's prepare (the source is alive), or
without the region.  The same takeover with the image in RBD (the hook reads
the header through qemu-img), the dead writer fenced first."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'broker', 'tests'))
sys.path.insert(0, os.path.join(HERE, '..', '..', 'block', 'tests'))
import brokerlib as B   # noqa: E402
import hybridlib as H   # noqa: E402
from test_hook import domain   # noqa: E402
sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
from hvlib.ceph import purge_for_class, start_for_class   # noqa: E402
from test_hook_broker import BrokerHookCase   # noqa: E402

MiB = 1 << 20
BLOCK = 64 * 1024
RAM = 4 * MiB
SIZE = 16 * MiB


def why_not():
    if not os.path.exists(B.HVMEMD):
        return f'{B.HVMEMD} not built'
    if not (H.have_binaries() and os.access(os.path.join(H.BIN, 'qemu-system-x86_64'), os.X_OK)):
        return f'QEMU not built in {H.BIN}'
    return None


def region_held(img):
    """The image's REGION feature and region token (docs/hybrid-format.rst)."""
    with open(img, 'rb') as f:
        hdr = f.read(80)
    return bool(struct.unpack_from('<Q', hdr, 16)[0] & 1), struct.unpack_from('<Q', hdr, 72)[0]


@unittest.skipIf(why_not(), why_not())
class HookMirrorTest(BrokerHookCase):

    capacity = '64M'

    def setUp(self):
        super().setUp()
        os.unlink(self.image)
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', f'mode=async,ram-size={RAM}',
                   self.image, str(SIZE))
        self.xml = domain(emulator=H.binary('qemu-system-x86_64'), qemu_args=[
            '-blockdev', f'driver=hybrid,node-name=hd0,file.driver=file,'
                         f'file.filename={self.image}'])

    def host_dies_with_writes_in(self, region, blocks=6):
        """Writes through a mirror in `region` (mapped read-write, as the
        mirror host's export maps it) over a throttled tier, then SIGKILL:
        the region holds writes the image lacks."""
        c = self.broker.client()
        c.create(region, RAM + 2 * MiB)
        _, fd = c.map(region, rw=True)
        try:
            io = H.QemuIo(
                'driver=hybrid,mode=async,file.driver=throttle,file.throttle-group=tg0,'
                f'file.file.driver=file,file.file.filename={self.image},'
                f'mirror.driver=file,mirror.filename=/proc/self/fd/{fd}',
                ['--object', 'throttle-group,id=tg0,x-bps-write=4096'], pass_fds=(fd,))
            for i in range(blocks):
                out = io.cmd(f'write -P {0x30 + i} {i * BLOCK} {BLOCK}')
                self.assertNotRegex(out, H.FAILED_RE)
            io.kill()
        finally:
            os.close(fd)
            c.close()
        held, token = region_held(self.image)
        self.assertTrue(held, 'the writes were written back before the kill: nothing to test')
        return token

    def image_blocks(self, n):
        data = H.image_bytes(self.image, os.path.join(self.dir, 'verify.raw'))
        return [data[i * BLOCK:(i + 1) * BLOCK] for i in range(n)]

    def test_prepare_takes_the_mirror_over(self):
        self.host_dies_with_writes_in('g1-mirror')
        # without the region QEMU refuses the image (its tier is stale)
        with self.assertRaisesRegex(AssertionError, "newest writes are held in RAM region"):
            self.image_blocks(1)
        r = self.hook('prepare', 'begin', self.xml)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('mirror region g1-mirror taken over', self.log())
        self.assertFalse(region_held(self.image)[0])
        self.assertEqual(self.image_blocks(6), [bytes([0x30 + i]) * BLOCK for i in range(6)])
        # a second start finds nothing to take over
        r = self.hook('prepare', 'begin', self.xml)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.log().count('taken over'), 1)

    def test_not_while_the_region_is_held(self):
        """The export still runs (or the old writer): refused, nothing changed."""
        self.host_dies_with_writes_in('g1-mirror')
        c = self.broker.client()
        try:
            c.map('g1-mirror', rw=True)
            r = self.hook('prepare', 'begin', self.xml)
        finally:
            c.close()
        self.assertEqual(r.returncode, 1)
        self.assertRegex(r.stderr, r'region g1-mirror is held read-write by pid \d+')
        self.assertTrue(region_held(self.image)[0])

    def test_not_without_the_region(self):
        """Another host's broker, or no broker: refused, naming the token."""
        token = self.host_dies_with_writes_in('g1-mirror')
        c = self.broker.client()
        c.destroy('g1-mirror')
        c.create('other', 4 * MiB)      # a region, but not this image's
        c.close()
        r = self.hook('prepare', 'begin', self.xml)
        self.assertEqual(r.returncode, 1)
        self.assertIn(f'RAM region {token:016x}, which no region of the broker', r.stderr)
        self.write_config(broker=False)
        r = self.hook('prepare', 'begin', self.xml)
        self.assertEqual(r.returncode, 1)
        self.assertIn('no [broker] is configured here', r.stderr)
        self.assertTrue(region_held(self.image)[0])

    def test_not_a_region_another_user_wrote(self):
        """A user of the broker (nobody) makes a region with the mirror's
        header copied in (its token): the hook takes only root's regions, so
        it refuses the start instead of writing that user's blocks into the
        image; the image still says its writes are in the (gone) mirror."""
        self.host_dies_with_writes_in('g1-mirror')
        _, fd = self.c.map('g1-mirror')
        header = os.pread(fd, 4096, 0)
        os.close(fd)
        self.c.destroy('g1-mirror')
        os.chmod(self.sockdir, 0o711)
        workdir = tempfile.mkdtemp(prefix='hook-agent-')
        self.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
        os.chmod(workdir, 0o755)
        evil = B.Agent(workdir, self.broker.sock, uid=B.NOBODY)
        self.addCleanup(evil.close)
        evil.ok(op='call', method='create', name='forged', size=RAM + 2 * MiB, mode=0o644)
        evil.ok(op='map', name='forged', rw=True)
        evil.ok(op='write', name='forged', offset=0, hex=header.hex())
        evil.ok(op='unmap', name='forged')
        evil.ok(op='call', method='release', name='forged')    # its lease too: not held
        self.assertEqual(self.c.lookup('forged')['uid'], B.NOBODY)
        r = self.hook('prepare', 'begin', self.xml)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn('which no region of the broker', r.stderr)
        self.assertTrue(region_held(self.image)[0])

    def test_option_keys_cannot_smuggle_options(self):
        """The takeover runs qemu-io as root with the disk's options: a JSON
        key carrying "," and "=" (ram-file= naming a file of root's) is
        refused, and the file is untouched."""
        self.host_dies_with_writes_in('g1-mirror')
        victim = os.path.join(self.dir, 'root-file')
        with open(victim, 'wb') as f:
            f.write(b'root data')
        blockdev = json.dumps({'driver': 'hybrid', 'node-name': 'hd0', 'file': {
            'driver': 'file', 'filename': self.image, f'x,ram-file={victim},y': 'z'}})
        xml = domain(emulator=H.binary('qemu-system-x86_64'),
                     qemu_args=['-blockdev', blockdev.replace("'", '&apos;')])
        r = self.hook('prepare', 'begin', xml)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn('is not an option name', r.stderr)
        with open(victim, 'rb') as f:
            self.assertEqual(f.read(), b'root data')
        self.assertTrue(region_held(self.image)[0])

    def test_not_on_an_incoming_migration(self):
        """migrate begin, then prepare begin: the source runs and its mirror
        is current; the hook leaves both alone (QEMU's migration does it)."""
        self.host_dies_with_writes_in('g1-mirror')
        for op in ('migrate', 'prepare'):
            r = self.hook(op, 'begin', self.xml)
            self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn('taken over', self.log())
        self.assertTrue(region_held(self.image)[0])
        # once the domain has gone, the next start is a start again
        self.assertEqual(self.hook('release', 'end', self.xml).returncode, 0)
        r = self.hook('prepare', 'begin', self.xml)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('mirror region g1-mirror taken over', self.log())


@unittest.skipIf(why_not(), why_not())
class HookMirrorRbdTest(BrokerHookCase):
    """The same takeover when the persistent tier is an RBD image (the
    failover the mirror is for: the image in Ceph, reachable from the
    mirror's host): the hook reads the header through qemu-img beside the
    emulator and writes the region back into RBD."""

    capacity = '64M'

    @classmethod
    def setUpClass(cls):
        start_for_class(cls, H.binary('qemu-img'), H.BUILD,
                        3301 + (os.getpid() + 125) % 500)

    @classmethod
    def tearDownClass(cls):
        purge_for_class(cls)

    def info(self, opts):
        r = H.qemu_img('info', '-U', '--output=json', '--image-opts', opts, check=False)
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)['format-specific']['data']

    def test_prepare_takes_the_mirror_over_from_rbd(self):
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', f'mode=async,ram-size={RAM}',
                   self.ceph.filename('g1disk'), str(SIZE))
        tier = self.ceph.blockdev('g1disk', prefix='file.')
        opts = 'driver=hybrid,' + tier
        c = self.broker.client()
        c.create('g1-mirror', RAM + 2 * MiB)
        _, fd = c.map('g1-mirror', rw=True)
        try:
            io = H.QemuIo(
                'driver=hybrid,mode=async,file.driver=throttle,file.throttle-group=tg0,'
                + self.ceph.blockdev('g1disk', prefix='file.file.') +
                f',mirror.driver=file,mirror.filename=/proc/self/fd/{fd}',
                ['--object', 'throttle-group,id=tg0,x-bps-write=4096'], pass_fds=(fd,))
            for i in range(4):
                self.assertNotRegex(io.cmd(f'write -P {0x50 + i} {i * BLOCK} {BLOCK}'),
                                    H.FAILED_RE)
            io.kill()
        finally:
            os.close(fd)
            c.close()
        # the dead writer fenced, as docs/hybrid.md says (here only its own
        # client: the hook's qemu-io runs from the same address)
        status = json.loads(self.ceph.rbd('status', '--format', 'json', 'rbd/g1disk').stdout)
        for w in status.get('watchers', []):
            self.ceph.ceph('osd', 'blocklist', 'add', w['address'])
        self.assertTrue(self.info(opts)['region-held'],
                        'the writes were written back before the kill: nothing to test')
        xml = domain(emulator=H.binary('qemu-system-x86_64'),
                     qemu_args=['-blockdev', f'node-name=hd0,ram-size={RAM},' + opts])
        r = self.hook('prepare', 'begin', xml)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('mirror region g1-mirror taken over', self.log())
        self.assertFalse(self.info(opts).get('region-held'))
        out = os.path.join(self.dir, 'verify.raw')
        H.qemu_img('convert', '-O', 'raw', '--image-opts', opts, out)
        with open(out, 'rb') as f:
            data = f.read(4 * BLOCK)
        self.assertEqual(data, b''.join(bytes([0x50 + i]) * BLOCK for i in range(4)))


if __name__ == '__main__':
    unittest.main()
