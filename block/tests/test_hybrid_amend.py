"""What qemu-img users expect of a format (issue 23): resize (offline, and
online with writes in flight; a crash between the tier and the header
updates leaves a consistent image), amend of the header's defaults (a dirty
image refused, what cannot change in place refused) and measure."""

import json
import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

MiB = 1024 * 1024
ODD = 100000256         # a multiple of 512, not of the 64 KiB block


def virtual_size(img):
    return H.img_info(img)['virtual-size']


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class ResizeTest(H.ToolTest):

    def setUp(self):
        super().setUp()
        self.img = self.tmp('r.hyb')

    def create(self, size, opts='mode=sync'):
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', opts, self.img,
                   str(size))

    def io(self, *cmds, check=True):
        args = []
        for c in cmds:
            args += ['-c', c]
        r = H.qemu_io('-f', 'hybrid', *args, self.img, check=False)
        out = r.stdout + r.stderr
        if check:
            self.assertNotIn('failed', out)
            self.assertNotIn('error', out.lower())
        return out

    def check_clean(self):
        r = H.qemu_img('check', '-f', 'hybrid', self.img, check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_grow_and_shrink_offline(self):
        self.create(64 * MiB)
        self.io(f'write -P 0x11 0 {64 * MiB}')
        H.qemu_img('resize', '-f', 'hybrid', self.img, '128M')
        self.assertEqual(virtual_size(self.img), 128 * MiB)
        self.io(f'read -P 0x11 0 {64 * MiB}', f'read -P 0 {64 * MiB} {64 * MiB}',
                f'write -P 0x22 {ODD - MiB} {2 * MiB}')
        self.check_clean()
        # shrinking needs --shrink (qemu-img's rule), then cuts at ODD
        r = H.qemu_img('resize', '-f', 'hybrid', self.img, str(ODD), check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('--shrink', r.stderr)
        H.qemu_img('resize', '-f', 'hybrid', '--shrink', self.img, str(ODD))
        self.assertEqual(virtual_size(self.img), ODD)
        self.check_clean()
        # grow again: what was past ODD reads as zero, at the block edge too
        H.qemu_img('resize', '-f', 'hybrid', self.img, '128M')
        self.io(f'read -P 0x11 0 {64 * MiB}', f'read -P 0x22 {ODD - MiB} {MiB}',
                f'read -P 0 {ODD} {MiB}')
        self.check_clean()

    def test_bad_sizes(self):
        self.create(64 * MiB)
        r = H.qemu_img('resize', '-f', 'hybrid', self.img, str(2 ** 51),
                       check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('up to', r.stderr)
        r = H.qemu_img('resize', '-f', 'hybrid', '--preallocation=full',
                       self.img, '128M', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('preallocation', r.stderr)

    def test_shrink_refused_past_dirty_blocks(self):
        """Async: a block not yet written back past the new end stops the
        shrink; after a flush it goes through."""
        self.create(64 * MiB, 'mode=async')
        io = H.QemuIo(f'driver=hybrid,file.driver=file,'
                      f'file.filename={self.img}')
        self.procs.append(io)
        io.cmd(f'write -P 0x33 {60 * MiB} {MiB}')
        out = io.cmd(f'truncate {32 * MiB}')
        self.assertIn('not written back yet', out)
        self.assertIn('flush first', out)
        io.cmd('flush')
        out = io.cmd(f'truncate {32 * MiB}')
        self.assertNotIn('error', out.lower(), out)
        io.quit()
        self.procs.remove(io)
        self.assertEqual(virtual_size(self.img), 32 * MiB)
        self.check_clean()

    def test_online_resize_with_requests_in_flight(self):
        """Grow and shrink while writes are in flight (qemu-io aio): every
        write lands, and what lies inside the disk reads back.  (An NBD
        export refuses a resize of its node, so no fio through NBD here;
        the guest test resizes a disk under a guest's I/O.)"""
        self.create(64 * MiB, 'mode=async')
        io = H.QemuIo(f'driver=hybrid,file.driver=file,'
                      f'file.filename={self.img}')
        self.procs.append(io)
        for i in range(64):
            io.send(f'aio_write -P {i + 1} {i * MiB} {MiB}')
        io.cmd(f'truncate {128 * MiB}')
        for i in range(64, 96):
            io.send(f'aio_write -P {i + 1} {i * MiB} {MiB}')
        io.cmd(f'truncate {112 * MiB}')     # past dirty blocks: refused
        io.cmd('aio_flush')
        out = io.cmd('flush')
        self.assertNotIn('failed', out)
        out = io.cmd(f'truncate {96 * MiB}')
        self.assertNotIn('rror', out)
        for i in range(96):
            out = io.cmd(f'read -P {i + 1} {i * MiB} {MiB}')
            self.assertNotIn('failed', out, f'MiB {i}')
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        self.assertEqual(virtual_size(self.img), 96 * MiB)
        self.check_clean()

    def killed_at(self, event, new_size):
        """qemu-io resizing, stopped by blkdebug at @event on the
        persistent tier and SIGKILLed there."""
        io = H.QemuIo(f'driver=hybrid,file.driver=blkdebug,'
                      f'file.image.filename={self.img}')
        self.procs.append(io)
        io.cmd(f'break {event} A')
        io.send(f'truncate {new_size}')
        time.sleep(0.5)
        io.kill()
        self.procs.remove(io)

    def test_crash_between_tier_and_header(self):
        """Grow killed at the header write: the old size, the data, a clean
        check; shrink killed after the header write, before the tier is
        cut: the new size, a clean check."""
        self.create(64 * MiB)
        self.io(f'write -P 0x44 0 {64 * MiB}')
        self.killed_at('pwritev', 128 * MiB)
        self.assertGreater(os.path.getsize(self.img), 128 * MiB,
                           'the tier was not grown before the kill')
        self.assertEqual(virtual_size(self.img), 64 * MiB)
        self.check_clean()
        self.io(f'read -P 0x44 0 {64 * MiB}')

        self.killed_at('pwritev_done', 32 * MiB)
        self.assertEqual(virtual_size(self.img), 32 * MiB)
        self.assertGreater(os.path.getsize(self.img), 64 * MiB,
                           'the tier was cut before the kill')
        self.check_clean()
        self.io(f'read -P 0x44 0 {32 * MiB}')
        H.qemu_img('resize', '-f', 'hybrid', self.img, '64M')
        self.io(f'read -P 0x44 0 {32 * MiB}', f'read -P 0 {32 * MiB} {32 * MiB}')


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class AmendMeasureTest(unittest.TestCase):

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('a.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', self.img, '64M')

    def tearDown(self):
        self.tmp.cleanup()

    def spec(self):
        return H.img_info(self.img)['format-specific']['data']

    def test_amend_defaults(self):
        H.qemu_img('amend', '-f', 'hybrid', '-o',
                   'mode=async,dedup=on,ram-size=16M', self.img)
        d = self.spec()
        self.assertEqual((d['mode'], d['dedup'], d['ram-size']),
                         ('async', True, 16 * MiB))
        H.qemu_img('amend', '-f', 'hybrid', '-o', 'mode=sync', self.img)
        d = self.spec()
        self.assertEqual((d['mode'], d['dedup'], d['ram-size']),
                         ('sync', True, 16 * MiB))
        r = H.qemu_img('check', '-f', 'hybrid', self.img, check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_amend_refusals(self):
        for opts, text in (('block-size=4096', 'cannot change in place'),
                           ('mode=fast', "Invalid mode 'fast'"),
                           ('size=1G', 'Invalid parameter'),
                           ('ram-size=1P', 'too large')):
            r = H.qemu_img('amend', '-f', 'hybrid', '-o', opts, self.img,
                           check=False)
            self.assertNotEqual(r.returncode, 0, opts)
            self.assertIn(text, r.stderr, opts)
        self.assertEqual(self.spec()['mode'], 'sync')

    def test_amend_of_a_dirty_image_refused(self):
        H.qemu_img('amend', '-f', 'hybrid', '-o', 'mode=async', self.img)
        io = H.QemuIo(f'driver=hybrid,file.driver=file,'
                      f'file.filename={self.img}')
        io.cmd(f'write -P 1 0 {MiB}')
        io.kill()
        self.assertTrue(self.spec()['dirty'])
        r = H.qemu_img('amend', '-f', 'hybrid', '-o', 'mode=sync', self.img,
                       check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('not closed cleanly', r.stderr)
        self.assertEqual(self.spec()['mode'], 'async')

    def test_x_blockdev_amend_on_a_node_in_use(self):
        """QMP x-blockdev-amend changes the stored defaults of a node that
        is open and written; the running mode does not change."""
        q = H.StorageDaemon(self.tmp, '--blockdev',
                            f'driver=hybrid,node-name=hy,file.driver=file,'
                            f'file.filename={self.img}')
        try:
            q.cmd('x-blockdev-amend', **{'job-id': 'am', 'node-name': 'hy',
                                         'options': {'driver': 'hybrid',
                                                     'mode': 'async',
                                                     'ram-size': 8 * MiB}})
            deadline = time.monotonic() + 30
            while True:
                jobs = q.cmd('query-jobs')
                if jobs and jobs[0]['status'] == 'concluded':
                    break
                self.assertLess(time.monotonic(), deadline, jobs)
                time.sleep(0.05)
            self.assertNotIn('error', jobs[0])
            q.cmd('job-dismiss', id='am')
            self.assertEqual(q.cmd('query-hybrid')[0]['mode'], 'sync')
        finally:
            q.stop()
        d = self.spec()
        self.assertEqual((d['mode'], d['ram-size']), ('async', 8 * MiB))

    def measure(self, *args):
        r = H.qemu_img('measure', '--output=json', '-O', 'hybrid', *args)
        return json.loads(r.stdout)

    def test_measure(self):
        m = self.measure('--size', '1G')
        self.assertEqual(m['fully-allocated'], 65536 + 1024 * MiB)
        self.assertEqual(m['required'], 65536)
        m = self.measure('-o', 'block-size=4096', '--size', '1000000512')
        self.assertEqual(m['fully-allocated'], 65536 + 1000001536)
        # from an image with data: what convert then really allocates
        raw = self.tmp('src.raw')
        with open(raw, 'wb') as f:
            f.truncate(256 * MiB)
            for off in (0, 100 * MiB + 4096, 255 * MiB):
                f.seek(off)
                f.write(os.urandom(MiB))
        m = self.measure('-f', 'raw', raw)
        self.assertEqual(m['fully-allocated'], 65536 + 256 * MiB)
        # three 1 MiB extents; the unaligned one touches 17 blocks of 64 KiB
        self.assertEqual(m['required'], 65536 + (16 + 17 + 16) * 65536)
        out = self.tmp('conv.hyb')
        H.qemu_img('convert', '-f', 'raw', '-O', 'hybrid', raw, out)
        used = os.stat(out).st_blocks * 512
        self.assertLessEqual(used, m['required'])
        r = H.qemu_img('measure', '-O', 'hybrid', '-o', 'block-size=3000',
                       '--size', '1G', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('power of two', r.stderr)


if __name__ == '__main__':
    unittest.main()
