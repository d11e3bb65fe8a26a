"""A hybrid image over a backing image (issue 23): blocks never written to
the image read through to the backing chain; the first write to a block
copies it (the backing bytes around the written span, whole blocks, in the
RAM tier and beyond it); restore loads only the image's own blocks;
qemu-img commit, rebase (-u and safe) and block-stream work; qemu-img
info/map show the chain; the header extension is validated (unknown
features and versions refused, hostile lengths refused); a guest boots
from a hybrid overlay over a read-only raw base."""

import hashlib
import json
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..', '..', 'tests'))
import hybridlib as H   # noqa: E402
from test_hybrid import crc32c   # noqa: E402
from test_hybrid_boot import READY, WHY, GuestDiskCase   # noqa: E402

KiB = 1024
MiB = 1024 * KiB
BS = 64 * KiB           # the default block size
SIZE = 4 * MiB

# Writes (offset, length, pattern) that start and end at and around block
# edges, in the RAM tier (ram-size=1M: blocks 0-15) and beyond it.
EDGE_WRITES = [
    (0, 512, 0x11),                         # first sector of block 0
    (BS - 512, 1024, 0x22),                 # across blocks 0 | 1
    (3 * BS + 4 * KiB, 4 * KiB, 0x33),      # inside block 3
    (5 * BS, BS, 0x44),                     # exactly block 5 (no copy)
    (16 * BS - 512, 1024, 0x55),            # across the RAM boundary
    (20 * BS + BS - 512, 512, 0x66),        # last sector of block 20
    (40 * BS + 512, 2 * BS, 0x77),          # blocks 40-42, beyond RAM
    (SIZE - 512, 512, 0x88),                # last sector of the disk
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(MiB), b''):
            h.update(chunk)
    return h.hexdigest()


def patch_header(path, changes, fix_crc=True):
    """Overwrite header fields {offset: bytes}; recompute header_crc over
    header_size bytes unless fix_crc is False."""
    with open(path, 'r+b') as f:
        h = bytearray(f.read(512))
        for off, val in changes.items():
            h[off:off + len(val)] = val
        if fix_crc:
            hsize = int.from_bytes(h[12:16], 'little')
            h[68:72] = b'\0' * 4
            crc = crc32c(bytes(h[:hsize])) ^ 0xffffffff   # QEMU's crc32c
            h[68:72] = crc.to_bytes(4, 'little')
        f.seek(0)
        f.write(h)


def u16(v):
    return v.to_bytes(2, 'little')


def u32(v):
    return v.to_bytes(4, 'little')


def u64(v):
    return v.to_bytes(8, 'little')


class Chain:
    """A raw base of random bytes and a Python model of the disk above it."""

    def __init__(self, tmp, name='base.raw', size=SIZE, seed=1):
        self.tmp = tmp
        self.base = tmp(name)
        rnd = random.Random(seed)
        self.model = bytearray(rnd.randbytes(size))
        with open(self.base, 'wb') as f:
            f.write(self.model)

    def apply(self, off, length, pattern):
        self.model[off:off + length] = bytes([pattern]) * length

    def ref(self, name='ref.raw'):
        path = self.tmp(name)
        with open(path, 'wb') as f:
            f.write(self.model)
        return path


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class BackingTest(H.ToolTest):

    def create(self, name, base, fmt='raw', opts=None, size=None):
        path = self.tmp(name)
        args = ['create', '-q', '-f', 'hybrid', '-b', base, '-F', fmt]
        if opts:
            args += ['-o', opts]
        args.append(path)
        if size:
            args.append(str(size))
        H.qemu_img(*args)
        return path

    def io(self, img, *cmds, opts='', check=True):
        args = []
        for c in cmds:
            args += ['-c', c]
        spec = f'driver=hybrid,file.filename={img}' + (',' + opts if opts
                                                        else '')
        r = H.qemu_io('--image-opts', spec, *args, check=False)
        out = r.stdout + r.stderr
        if check:
            self.assertEqual(r.returncode, 0, out)
            self.assertNotIn('failed', out)
            self.assertNotIn('Pattern verification', out)
        return out

    def assert_same(self, img, ref):
        r = H.qemu_img('compare', '-f', 'hybrid', '-F', 'raw', img, ref,
                       check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def assert_check_clean(self, img):
        r = H.qemu_img('check', '-f', 'hybrid', img, check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    # ---- create, info, map ----

    def test_create_info_map(self):
        """qemu-img create -b/-F takes the size from the base; info shows
        the backing file and format, --backing-chain both images; map
        shows unwritten blocks at depth 1 and written ones at depth 0."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base)
        info = H.img_info(ov)
        self.assertEqual(info['virtual-size'], SIZE)
        self.assertEqual(info['backing-filename'], c.base)
        self.assertEqual(info['backing-filename-format'], 'raw')
        chain = json.loads(H.qemu_img('info', '--output=json',
                                      '--backing-chain', ov).stdout)
        self.assertEqual([i['format'] for i in chain], ['hybrid', 'raw'])

        self.io(ov, f'write -P 0x5a {2 * BS} {BS}')
        m = json.loads(H.qemu_img('map', '--output=json', '-f', 'hybrid',
                                  ov).stdout)
        own = [e for e in m if e['depth'] == 0]
        self.assertEqual([(e['start'], e['length']) for e in own],
                         [(2 * BS, BS)])
        self.assertTrue(all(e['depth'] == 1 for e in m if e not in own))
        self.assertEqual(sum(e['length'] for e in m), SIZE)
        self.assert_check_clean(ov)

    def test_larger_than_base_and_bad_format(self):
        """A size larger than the base: the tail past the base reads as
        zeros; a bogus backing format is refused at creation."""
        c = Chain(self.tmp, size=MiB)
        ov = self.create('ov.hyb', c.base, size=2 * MiB)
        self.io(ov, f'read -P 0 {MiB} {MiB}')
        r = H.qemu_img('create', '-f', 'hybrid', '-b', c.base, '-F', 'nope',
                       self.tmp('bad.hyb'), check=False)
        self.assertNotEqual(r.returncode, 0)

    # ---- read-through and copy-on-write ----

    def edges(self, opts):
        c = Chain(self.tmp)
        base_sum = sha256(c.base)
        ov = self.create('ov.hyb', c.base, opts=opts)
        # Before any write the overlay is its base
        self.assert_same(ov, c.base)
        cmds = []
        for off, length, pat in EDGE_WRITES:
            cmds.append(f'write -P {pat:#x} {off} {length}')
            c.apply(off, length, pat)
        # Read back in the same open (from RAM or the tier) at the edges
        for off, length, pat in EDGE_WRITES:
            cmds.append(f'read -P {pat:#x} {off} {length}')
        self.io(ov, *cmds)
        ref = c.ref()
        # After reopen: from the tier (and restore), byte for byte
        self.assert_same(ov, ref)
        # Bytes right around each write are the base's: block edges
        out = self.tmp('out.raw')
        H.qemu_img('convert', '-f', 'hybrid', '-O', 'raw', ov, out)
        with open(out, 'rb') as f:
            data = f.read()
        for off, length, _ in EDGE_WRITES:
            start = off - off % BS
            end = min(SIZE, -(-(off + length) // BS) * BS)
            self.assertEqual(data[start:end], bytes(c.model[start:end]),
                             f'blocks around {off}+{length}')
        self.assertEqual(sha256(c.base), base_sum, 'the base was written')
        self.assert_check_clean(ov)
        return c, ov

    def test_cow_sync(self):
        """Sync mode, RAM tier of 1 MiB: partial writes at block edges copy
        the rest of each block from the base, in RAM and beyond it."""
        self.edges('mode=sync,ram-size=1M')

    def test_cow_async(self):
        """Async mode: the copied block is written back whole."""
        self.edges('mode=async,ram-size=1M')

    def test_cow_dedup(self):
        """Dedup RAM tier: the same."""
        self.edges('mode=async,ram-size=1M,dedup=on')

    def test_cow_no_ram(self):
        """No RAM tier at all (every block written through)."""
        self.edges('mode=sync,ram-size=0')

    def test_unflushed_copies_read_base_after_kill(self):
        """An async copy-on-write that no flush made durable is lost at a
        kill as a whole: the block reads as the base again, never as
        zeros or a half block; a flushed one survives."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base, opts='mode=async,ram-size=4M')
        q = H.QemuIo(f'driver=hybrid,file.filename={ov}')
        self.assertNotIn('failed', q.cmd(f'write -P 0x31 {BS + 512} 512'))
        self.assertNotIn('failed', q.cmd('flush'))
        c.apply(BS + 512, 512, 0x31)
        self.assertNotIn('failed', q.cmd(f'write -P 0x32 {7 * BS + 512} 512'))
        q.kill()
        self.assert_same(ov, c.ref())

    def test_zero_and_discard_do_not_expose_the_base(self):
        """write -z and discard on blocks of the base read back as zeros
        (the block becomes the image's own)."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base, opts='ram-size=1M')
        self.io(ov, f'write -z {BS + 4096} 4096', f'discard {30 * BS} {BS}',
                f'write -z -u {31 * BS} {BS}')
        c.apply(BS + 4096, 4096, 0)
        c.apply(30 * BS, BS, 0)
        c.apply(31 * BS, BS, 0)
        self.assert_same(ov, c.ref())

    def test_nbd_backing(self):
        """The base is an NBD export (qemu-storage-daemon); the overlay
        names it by URI."""
        c = Chain(self.tmp)
        sock = self.tmp('nbd.sock')
        d = H.StorageDaemon(
            self.tmp,
            '--blockdev', f'driver=file,filename={c.base},node-name=b0,'
                          'read-only=on',
            '--nbd-server', f'addr.type=unix,addr.path={sock}',
            '--export', 'type=nbd,id=e0,node-name=b0,name=base')
        self.procs.append(d)
        ov = self.create('ov.hyb', f'nbd+unix:///base?socket={sock}',
                         opts='ram-size=1M')
        self.io(ov, f'write -P 0x42 {BS - 512} 1024',
                f'write -P 0x43 {50 * BS + 100 * 512} 512')
        c.apply(BS - 512, 1024, 0x42)
        c.apply(50 * BS + 100 * 512, 512, 0x43)
        self.assert_same(ov, c.ref())

    # ---- restore ----

    def test_restore_loads_only_own_blocks(self):
        """A reopened overlay restores its own blocks only (3 of 64); reads
        of the others go to the base."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base, opts='mode=sync')
        for i in (2, 9, 33):
            self.io(ov, f'write -P {i} {i * BS + 4096} 512')
            c.apply(i * BS + 4096, 512, i)
        d = H.StorageDaemon(self.tmp, '--blockdev',
                            f'driver=hybrid,node-name=ov,file.driver=file,'
                            f'file.filename={ov}')
        self.procs.append(d)
        info = d.wait_restored('ov', timeout=30)[0]
        self.assertTrue(info['restore-done'])
        self.assertEqual(info['restore-bytes'], 3 * BS)
        self.assertEqual(info['ram-loaded'], 3 * BS)
        self.assertEqual(info['restore-total'], 3 * BS)
        d.stop()
        self.procs.remove(d)
        self.assert_same(ov, c.ref())

    # ---- commit, rebase, stream ----

    def test_commit(self):
        """qemu-img commit writes the overlay's blocks into the base."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base, opts='ram-size=1M')
        self.io(ov, f'write -P 0x61 {BS - 512} 1024',
                f'write -P 0x62 {40 * BS} 4096')
        c.apply(BS - 512, 1024, 0x61)
        c.apply(40 * BS, 4096, 0x62)
        H.qemu_img('commit', '-f', 'hybrid', ov)
        self.assertEqual(open(c.base, 'rb').read(), bytes(c.model))
        self.assert_same(ov, c.base)

    def test_rebase_unsafe_and_safe(self):
        """rebase -u only rewrites the name (blocks of the base now read
        from the new one); a safe rebase keeps the content, to another
        base and to none; several renames alternate the name slots."""
        c = Chain(self.tmp)
        other = Chain(self.tmp, 'other.raw', seed=2)
        ov = self.create('ov.hyb', c.base, opts='ram-size=1M')
        self.io(ov, f'write -P 0x71 {BS + 512} 512')
        c.apply(BS + 512, 512, 0x71)
        other.apply(BS + 512, 512, 0x71)

        # unsafe: the content follows the new base, except our block
        H.qemu_img('rebase', '-u', '-f', 'hybrid', '-b', other.base, '-F',
                   'raw', ov)
        self.assertEqual(H.img_info(ov)['backing-filename'], other.base)
        # our block 1 was copied from the first base: only its written
        # sector is the same in both models
        expect = bytearray(other.model)
        expect[BS:2 * BS] = c.model[BS:2 * BS]
        with open(self.tmp('exp.raw'), 'wb') as f:
            f.write(expect)
        self.assert_same(ov, self.tmp('exp.raw'))

        # back (unsafe) and then safe to the other base: content kept
        H.qemu_img('rebase', '-u', '-f', 'hybrid', '-b', c.base, '-F', 'raw',
                   ov)
        self.assert_same(ov, c.ref())
        H.qemu_img('rebase', '-f', 'hybrid', '-b', other.base, '-F', 'raw',
                   ov)
        self.assertEqual(H.img_info(ov)['backing-filename'], other.base)
        self.assert_same(ov, c.ref())

        # safe to no base at all
        H.qemu_img('rebase', '-f', 'hybrid', '-b', '', ov)
        info = H.img_info(ov)
        self.assertNotIn('backing-filename', info)
        os.unlink(other.base)
        self.assert_same(ov, c.ref('ref2.raw'))
        self.assert_check_clean(ov)

    def test_block_stream(self):
        """block-stream over QMP copies the base's blocks into the overlay
        and drops the backing link; the content is unchanged."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base, opts='mode=async,ram-size=1M')
        self.io(ov, f'write -P 0x81 {3 * BS - 512} 1024')
        c.apply(3 * BS - 512, 1024, 0x81)
        d = H.StorageDaemon(
            self.tmp,
            '--blockdev', f'driver=file,filename={c.base},node-name=base-file',
            '--blockdev', 'driver=raw,file=base-file,node-name=base,'
                          'read-only=on',
            '--blockdev', f'driver=file,filename={ov},node-name=ov-file',
            '--blockdev', 'driver=hybrid,file=ov-file,backing=base,'
                          'node-name=ov')
        self.procs.append(d)
        d.cmd('block-stream', **{'job-id': 's0', 'device': 'ov'})
        ev = d.wait_event('BLOCK_JOB_COMPLETED', timeout=120)
        self.assertNotIn('error', ev['data'])
        d.stop()
        self.procs.remove(d)
        self.assertNotIn('backing-filename', H.img_info(ov))
        os.unlink(c.base)
        self.assert_same(ov, c.ref())
        self.assert_check_clean(ov)

    # ---- the header extension ----

    def test_unknown_feature_and_version_refused(self):
        """An image with an incompatible feature bit this reader does not
        know, or a backing extension of another version, is refused with a
        message naming it (what an older reader does with ours)."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base)
        with open(ov, 'rb') as f:
            good = f.read(512)
        # known: REGION (1) and BACKING (2); 4 is unknown
        patch_header(ov, {16: u64(0x2 | 0x4)})
        r = H.qemu_img('info', '-f', 'hybrid', ov, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('incompatible features 0x4', r.stderr)

        patch_header(ov, {16: u64(0x2), 80: u32(2)})
        r = H.qemu_img('info', '-f', 'hybrid', ov, check=False)
        self.assertIn('backing extension version 2 is not 1', r.stderr)

        # a 120-byte header without the BACKING bit is inconsistent
        patch_header(ov, {16: u64(0), 80: u32(1)})
        r = H.qemu_img('info', '-f', 'hybrid', ov, check=False)
        self.assertIn('does not match the backing feature', r.stderr)

        with open(ov, 'r+b') as f:
            f.write(good)
        H.qemu_img('info', '-f', 'hybrid', ov)

    def test_hostile_extension_refused(self):
        """Lengths and offsets from the image are bounded: an over-long
        name, a name past data_offset, a name that does not match its
        checksum, a bitmap smaller than the disk or overlapping the name."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base)
        with open(ov, 'rb') as f:
            good = f.read(512)
        cases = [
            ({84: u16(5000)}, 'backing file name of 5000 bytes is longer '
                              'than 4095'),
            ({86: bytes([40])}, 'backing format name of 40 bytes'),
            ({88: u64(1 << 40)}, 'is not inside'),
            ({88: u64(0)}, 'is not inside'),
            ({112: u64(0)}, 'allocation bitmap of 0 blocks'),
            ({104: u64(4096)}, 'apart from the name'),
            ({104: u64(65536 - 512)}, 'allocation bitmap at'),
            ({96: u32(0x12345678)}, 'name checksum'),
        ]
        for changes, msg in cases:
            with open(ov, 'r+b') as f:
                f.write(good)
            patch_header(ov, changes)
            r = H.qemu_img('info', '-f', 'hybrid', ov, check=False)
            self.assertNotEqual(r.returncode, 0, changes)
            self.assertIn(msg, r.stderr, changes)
        # the header checksum itself still guards everything
        with open(ov, 'r+b') as f:
            f.write(good)
        patch_header(ov, {84: u16(5000)}, fix_crc=False)
        r = H.qemu_img('info', '-f', 'hybrid', ov, check=False)
        self.assertIn('header checksum', r.stderr)

    def test_resize_by_whole_blocks(self):
        """Grow and shrink of an overlay: blocks never written still read
        through below the old end; a grown area reads zeros even where the
        base is longer (after a shrink and a grow too: never the base's
        bytes) and is the image's own in the map; a size that is not whole
        blocks is refused, and so is a grow past the bitmap's room, before
        anything is written."""
        c = Chain(self.tmp)
        ov = self.create('ov.hyb', c.base, size=2 * MiB)
        self.io(ov, f'write -P 0x21 {BS} 512')
        c.apply(BS, 512, 0x21)
        H.qemu_img('resize', '-f', 'hybrid', ov, str(SIZE))
        c.apply(2 * MiB, SIZE - 2 * MiB, 0)
        self.assert_same(ov, c.ref())
        m = json.loads(H.qemu_img('map', '--output=json', '-f', 'hybrid',
                                  ov).stdout)
        for e in m:
            if e['start'] >= 2 * MiB:
                self.assertEqual(e['depth'], 0, e)
            elif e['start'] >= 2 * BS:
                self.assertEqual(e['depth'], 1, e)
        H.qemu_img('resize', '--shrink', '-f', 'hybrid', ov, str(MiB))
        H.qemu_img('resize', '-f', 'hybrid', ov, str(3 * MiB))
        c.model = c.model[:MiB] + bytearray(2 * MiB)
        self.assert_same(ov, c.ref('ref2.raw'))
        self.assert_check_clean(ov)
        before = sha256(ov)
        r = H.qemu_img('resize', '-f', 'hybrid', ov, str(3 * MiB + 512),
                       check=False)
        self.assertIn('is resized by whole blocks', r.stderr)
        r = H.qemu_img('resize', '-f', 'hybrid', ov, '1T', check=False)
        self.assertIn('allocation bitmap of this image has room for', r.stderr)
        self.assertEqual(sha256(ov), before)

    def test_image_without_bitmap(self):
        """An image created without a backing file holds every block: a
        backing node given at runtime is never read, and a rebase -u gives
        it the extension with every block allocated (content unchanged).
        raw=on refuses a backing node."""
        c = Chain(self.tmp)
        plain = self.tmp('plain.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', plain, str(SIZE))
        self.io(plain, f'write -P 0x21 {BS} 512')
        self.io(plain, 'read -P 0 0 512', f'read -P 0x21 {BS} 512',
                opts=f'backing.driver=raw,backing.file.filename={c.base}')
        H.qemu_img('rebase', '-u', '-f', 'hybrid', '-b', c.base, '-F', 'raw',
                   plain)
        self.assertEqual(H.img_info(plain)['backing-filename'], c.base)
        self.io(plain, 'read -P 0 0 512', f'read -P 0x21 {BS} 512')
        m = json.loads(H.qemu_img('map', '--output=json', '-f', 'hybrid',
                                  plain).stdout)
        self.assertTrue(all(e['depth'] == 0 for e in m), m)
        self.assert_check_clean(plain)

        r = H.qemu_io('--image-opts', f'driver=hybrid,raw=on,'
                      f'file.filename={c.base},backing.driver=raw,'
                      f'backing.file.filename={c.base}',
                      '-c', 'read 0 512', check=False)
        self.assertIn('cannot have a backing file', r.stdout + r.stderr)


@unittest.skipUnless(READY, f'guest not built: {WHY}')
class BackingBootTest(GuestDiskCase, unittest.TestCase):

    def test_boot_from_overlay_over_read_only_base(self):
        """The guest's root file system is a hybrid overlay (64 MiB RAM
        tier, async) over the build's raw rootfs.ext4, which QEMU opens
        read-only and which stays byte for byte the same; the guest writes
        a file, and a second boot (sync) finds it."""
        base = self.paths.guest_file('rootfs.ext4')
        base_sum = sha256(base)
        ov = os.path.join(self.dir, 'ov.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-b', base, '-F', 'raw',
                   '-o', 'mode=async,ram-size=64M', ov)

        g = self.boot('hyb-ov', ov, 'hybrid')
        nodes = g.qmp('query-named-block-nodes')
        ro = {n['file']: n['ro'] for n in nodes}
        self.assertTrue(ro[base], 'the base is not opened read-only')
        self.assertFalse(ro[ov])
        self.assertIn('/dev/vda / ext4', g.run('cat /proc/mounts'))
        g.run('echo overlay-$((40 + 2)) >/root/ov1 && sync')
        self.stop(g)

        g = self.boot('hyb-ov2', ov, 'hybrid,mode=sync')
        self.assertEqual(g.run('cat /root/ov1').strip(), 'overlay-42')
        self.stop(g)

        self.assertEqual(sha256(base), base_sum)
        r = H.qemu_img('check', '-f', 'hybrid', ov, check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        m = json.loads(H.qemu_img('map', '--output=json', '-f', 'hybrid',
                                  ov).stdout)
        own = sum(e['length'] for e in m if e['depth'] == 0)
        self.assertGreater(own, 0)
        self.assertLess(own, os.path.getsize(base) // 2,
                        'the overlay should hold only what the guest wrote')


if __name__ == '__main__':
    unittest.main()
