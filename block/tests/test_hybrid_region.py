"""The hybrid RAM tier in a memory broker region (ram-file=, issue 20).

Everything runs against a real hvmemd on a private pool: the test (playing
libvirt's part) creates a region, maps it read-write (taking the region's
lease) and hands the descriptor to qemu-io or qemu-storage-daemon, which
open it as ram-file=/proc/self/fd/N (qemu-system-x86_64 would take it
with -add-fd and /dev/fdset/N).

- SIGKILL of QEMU in async mode at random moments, many rounds: every
  write that was acknowledged, flushed or not, is there after the restart.
- A restart finds the tier ready: no restore, dirty blocks written back.
- A region that does not match the image (image written without it,
  region reused for another image, garbage) falls back to a restore; one
  holding another image's unwritten blocks, or an image whose newest
  writes are in another region, is refused with a message saying why.
- Leases: a second read-write owner is refused while QEMU runs and gets
  the region once QEMU has died; a read-only grant cannot be opened for
  writing by a non-root QEMU; the broker restarting under a running QEMU
  changes nothing for it.  HYBRIDVM_LONG=1 runs more kill rounds."""

import errno
import mmap
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'broker', 'tests'))
import hybridlib as H   # noqa: E402
import brokerlib as B   # noqa: E402

MiB = 1024 * 1024
SLOT = 4096
SIZE = 32 * MiB
# data starts 2 MiB into the region (header + bitmaps, huge-page aligned)
REGION_SIZE = SIZE + 2 * MiB
TRACE = ['--trace', 'hybrid_region_attach']
ATTACH_RE = re.compile(r'hybrid_region_attach .*reused (\d) loaded (\d+) '
                       r'dirty (\d+) token 0x([0-9a-f]+)')


def attach_of(out):
    """(reused, loaded, dirty) from qemu-io's trace output."""
    m = ATTACH_RE.search(out)
    assert m, f'no hybrid_region_attach trace in {out!r}'
    return bool(int(m.group(1))), int(m.group(2)), int(m.group(3))


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
@unittest.skipUnless(os.path.exists(B.HVMEMD), f'{B.HVMEMD} not built')
class RegionTest(unittest.TestCase):

    def setUp(self):
        self.tmp = H.TempDir()
        os.chmod(self.tmp.path, 0o755)
        self.pool = tempfile.mkdtemp(prefix='hybrid-region-pool-',
                                     dir='/dev/shm')
        os.rmdir(self.pool)          # the broker creates it 0700
        self.broker = B.Broker(self.tmp.path, self.pool)
        self.broker.start()
        self.c = self.broker.client()
        self.fds = []
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            p.kill()
        for fd in self.fds:
            os.close(fd)
        self.c.close()
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        self.tmp.cleanup()

    # -- helpers --

    def region(self, name, size=REGION_SIZE, mode=0o600):
        """Create a region and map it read-write; the test holds the lease."""
        self.c.create(name, size, mode)
        _, fd = self.c.map(name, rw=True)
        self.fds.append(fd)
        return fd

    def image(self, name, mode='async', size=SIZE, ram=None):
        img = self.tmp(name)
        o = f'mode={mode}' + (f',ram-size={ram}' if ram else '')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', o, img, str(size))
        return img

    @staticmethod
    def opts(img, fd, extra=''):
        return (f'driver=hybrid,file.driver=file,file.filename={img},'
                f'ram-file=/proc/self/fd/{fd}{extra}')

    def qemu_io(self, img, fd, extra='', trace=True):
        io = H.QemuIo(self.opts(img, fd, extra), TRACE if trace else (),
                      pass_fds=[fd])
        self.procs.append(io)
        return io

    def first_output(self, io):
        """What qemu-io printed before its first prompt (the trace)."""
        return io.banner

    def open_fails(self, img, fd, extra=''):
        r = subprocess.run([H.binary('qemu-io'), '--image-opts',
                            self.opts(img, fd, extra), '-c', 'quit'],
                           capture_output=True, text=True, pass_fds=[fd],
                           timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout + r.stderr

    def image_bytes(self, img):
        return H.image_bytes(img, self.tmp('verify.raw'))

    @staticmethod
    def restored(q):
        """query-hybrid once the restore is done (with a ready region it
        ends before QMP is up, so there is no event to wait for)."""
        return q.wait_restored()[0]

    def close_cleanly(self, img, fd):
        """Open with the region and quit: the dirty blocks go back."""
        io = self.qemu_io(img, fd)
        out = self.first_output(io)
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        return attach_of(out)

    # -- crash --

    def test_sigkill_async_loses_no_acknowledged_write(self):
        """Async mode, no flushes: SIGKILL at random moments loses nothing
        that was acknowledged."""
        fd = self.region('tier')
        img = self.image('crash.hyb', ram='16M')
        rnd = random.Random(int(os.environ.get('HYBRID_SEED', '2020')))
        rounds = 30 if H.LONG else 6
        model = H.WriteModel(SIZE // SLOT, rnd, durable='ack')
        # a slow persistent tier and a small dirty limit keep write-back
        # in flight at the kill; half of the rounds never flush at all
        opts = (f'driver=hybrid,ram-file=/proc/self/fd/{fd},'
                'dirty-limit=512k,file.driver=throttle,'
                'file.throttle-group=tg0,file.file.driver=file,'
                f'file.file.filename={img}')
        obj = ['--object', 'throttle-group,id=tg0,x-iops-write=200']
        found = []
        for rnd_no in range(rounds):
            io = H.QemuIo(opts, obj + TRACE, pass_fds=[fd])
            self.procs.append(io)
            model.run(io, rnd.randint(40, 150),
                      flush_p=0.05 if rnd_no % 2 else 0.0)
            model.send_unacked(io, rnd.randint(0, 6))
            io.kill()
            self.procs.remove(io)
            # the next open takes the region as it is and writes back
            reused, _, dirty = self.close_cleanly(img, fd)
            self.assertTrue(reused, 'the region was not reused after a kill')
            found.append(dirty)
            model.check(self.image_bytes(img), f'round {rnd_no}: ')
            r = H.qemu_img('check', '-f', 'hybrid', img, check=False)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertTrue(all(found), 'a round left no dirty blocks in the '
                        f'region ({found}): it did not test the write-back '
                        'at open')
        print(f'{rounds} kills; dirty blocks found at each reopen: {found}',
              file=sys.stderr)

    # -- restart --

    def test_restart_finds_the_tier_ready(self):
        """The second start takes the region as it is: no restore."""
        fd = self.region('tier')
        img = self.image('ready.hyb', mode='sync')
        H.qemu_io('-f', 'hybrid', '-c', f'write -P 0x5a 0 {SIZE}', img)
        q = H.StorageDaemon(self.tmp, '--blockdev',
                            self.opts(img, fd, ',node-name=hy'),
                            pass_fds=[fd])
        self.procs.append(q)
        first = self.restored(q)
        q.stop()
        self.procs.remove(q)
        self.assertFalse(first['region']['reused'])
        self.assertEqual(first['restore-bytes'], SIZE)

        q = H.StorageDaemon(self.tmp, '--blockdev',
                            self.opts(img, fd, ',node-name=hy'),
                            pass_fds=[fd])
        self.procs.append(q)
        second = self.restored(q)
        q.stop()
        self.procs.remove(q)
        self.assertTrue(second['region']['reused'])
        self.assertEqual(second['restore-bytes'], 0)
        self.assertEqual(second['ram-loaded'], SIZE)
        self.assertEqual(second['region']['token'], first['region']['token'])
        info = H.img_info(img)['format-specific']['data']
        self.assertEqual(info['region-token'], first['region']['token'])
        self.assertFalse(info['region-held'])
        print(f'restore {first["restore-ms"]} ms, region '
              f'{second["restore-ms"]} ms', file=sys.stderr)
        # and it reads what was written
        io = self.qemu_io(img, fd)
        self.assertNotIn('failed', io.cmd(f'read -P 0x5a 0 {SIZE}'))

    def test_zero_blocks_stay_holes(self):
        """Zeroed blocks free the region's pages and come back as zero."""
        fd = self.region('tier')
        img = self.image('zero.hyb')
        io = self.qemu_io(img, fd)
        io.cmd(f'write -P 0x11 0 {4 * MiB}')
        io.cmd(f'write -z 0 {2 * MiB}')
        io.kill()
        self.procs.remove(io)
        st = os.fstat(fd)
        # 2 MiB of data left (+ header page); 4 MiB were written
        self.assertLess(st.st_blocks * 512, 3 * MiB)
        self.close_cleanly(img, fd)
        data = self.image_bytes(img)
        self.assertEqual(data[:2 * MiB], bytes(2 * MiB))
        self.assertEqual(data[2 * MiB:4 * MiB], b'\x11' * (2 * MiB))

    # -- mismatches --

    def bound(self, name='a.hyb', val=0x31):
        """An image bound to a fresh region, closed cleanly."""
        fd = self.region('tier-' + name)
        img = self.image(name)
        io = self.qemu_io(img, fd)
        self.assertNotIn('failed', io.cmd(f'write -P {val} 0 {MiB}'))
        self.assertEqual(io.quit(), 0)
        self.procs.remove(io)
        return img, fd

    def test_image_written_without_region_falls_back(self):
        img, fd = self.bound()
        H.qemu_io('-f', 'hybrid', '-c', f'write -P 0x77 0 {MiB}', img)
        io = self.qemu_io(img, fd)
        reused, _, _ = attach_of(self.first_output(io))
        self.assertFalse(reused, 'a region gone stale was reused')
        self.assertNotIn('failed', io.cmd(f'read -P 0x77 0 {MiB}'))

    def test_region_of_another_image_falls_back(self):
        img_a, fd = self.bound('a.hyb', 0x31)
        img_b = self.image('b.hyb')
        H.qemu_io('-f', 'hybrid', '-c', f'write -P 0x42 0 {MiB}', img_b)
        io = self.qemu_io(img_b, fd)
        reused, _, _ = attach_of(self.first_output(io))
        self.assertFalse(reused)
        self.assertNotIn('failed', io.cmd(f'read -P 0x42 0 {MiB}'))

    def test_garbage_header_falls_back(self):
        img, fd = self.bound()
        with mmap.mmap(fd, 4096) as m:
            m[:4096] = random.Random(7).randbytes(4096)
        io = self.qemu_io(img, fd)
        reused, _, _ = attach_of(self.first_output(io))
        self.assertFalse(reused)
        self.assertNotIn('failed', io.cmd(f'read -P 0x31 0 {MiB}'))

    def killed_with_dirty(self, name='held.hyb', val=0x66):
        """An image whose newest (acknowledged) writes are only in its
        region: written in async mode, then SIGKILLed."""
        fd = self.region('tier-' + name)
        img = self.image(name)
        io = self.qemu_io(img, fd)
        self.assertNotIn('failed', io.cmd(f'write -P {val} 0 {MiB}'))
        io.kill()
        self.procs.remove(io)
        return img, fd

    def test_held_image_needs_its_region(self):
        img, fd = self.killed_with_dirty()
        info = H.img_info(img)['format-specific']['data']
        self.assertTrue(info['region-held'])
        r = subprocess.run([H.binary('qemu-io'), '-f', 'hybrid', '-c', 'quit',
                            img], capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('newest writes are held in RAM region', r.stderr)
        # another region, valid and clean: refused (it is not the one)
        _, other = self.bound('other.hyb')
        out = self.open_fails(img, other)
        self.assertIn('attach that region', out)
        # with its own region it all comes back
        self.assertEqual(self.close_cleanly(img, fd)[2], MiB // 65536)
        self.assertEqual(self.image_bytes(img)[:MiB], b'\x66' * MiB)

    def test_unwritten_blocks_of_another_image_are_not_overwritten(self):
        img_a, fd = self.killed_with_dirty('a.hyb')
        img_b = self.image('b.hyb')
        out = self.open_fails(img_b, fd)
        self.assertIn('not yet written back to another image', out)
        # image A still gets everything back
        self.close_cleanly(img_a, fd)
        self.assertEqual(self.image_bytes(img_a)[:MiB], b'\x66' * MiB)

    def test_region_lost_with_the_host(self):
        """A held image and an empty region (the old one went with a host
        restart): a warning, and the persistent tier's content."""
        img, fd = self.killed_with_dirty()
        fresh = self.region('fresh')
        io = self.qemu_io(img, fresh)
        out = self.first_output(io)
        self.assertIn('not attached (gone with a host restart?)', out)
        self.assertNotIn('failed', io.cmd(f'read -P 0 0 {MiB}'))

    def test_bad_options(self):
        img = self.image('opts.hyb')
        small = self.region('small', 4 * MiB)
        self.assertIn('needs', self.open_fails(img, small))
        fd = self.region('tier')
        self.assertIn('dedup', self.open_fails(img, fd, ',dedup=on'))
        out = self.open_fails(img, fd, ',raw=on')
        self.assertIn('raw=off', out)
        r = subprocess.run([H.binary('qemu-io'), '-r', '--image-opts',
                            self.opts(img, fd), '-c', 'quit'],
                           capture_output=True, text=True, pass_fds=[fd],
                           timeout=60)
        self.assertIn('read-write node', r.stdout + r.stderr)
        r = subprocess.run([H.binary('qemu-io'), '--image-opts',
                            f'driver=hybrid,file.filename={img},'
                            'ram-file=/nonexistent/region', '-c', 'quit'],
                           capture_output=True, text=True, timeout=60)
        self.assertIn('ram-file', r.stdout + r.stderr)
        self.assertIn('No such file', r.stdout + r.stderr)

    # -- leases and rights --

    def test_one_read_write_owner(self):
        """hvmem map --rw holds the lease while QEMU runs; a second owner
        is refused until QEMU dies, then gets the region."""
        self.c.create('tier', REGION_SIZE, 0o600)
        img = self.image('lease.hyb')
        env = dict(os.environ, HVMEM_SOCKET=self.broker.sock)
        cmd = (f'exec {H.binary("qemu-io")} --image-opts '
               f'driver=hybrid,file.filename={img},'
               'ram-file=/proc/self/fd/$HVMEM_FD')
        p = subprocess.Popen([B.HVMEM, 'map', 'tier', '--rw', '--', 'sh', '-c',
                              cmd], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env)
        try:
            p.stdin.write(f'write -P 0x24 0 {MiB}\n'.encode())
            p.stdin.flush()
            B.wait_for(lambda: self.c.lookup('tier')['flags'] & B.LEASED,
                       what='the lease')
            c2 = self.broker.client()
            with self.assertRaises(B.BrokerError) as e:
                c2.map('tier', rw=True)
            self.assertEqual(e.exception.errno, errno.EBUSY)
            # QEMU dies: the lease goes with hvmem
            qemu = subprocess.run(['pgrep', '-P', str(p.pid)],
                                  capture_output=True, text=True).stdout.split()
            self.assertTrue(qemu, 'qemu-io is not running under hvmem')
            os.kill(int(qemu[0]), 9)
            p.wait(30)
            B.wait_for(lambda: not self.c.lookup('tier')['flags'] & B.LEASED,
                       what='the lease to go')
            _, fd = c2.map('tier', rw=True)
            self.fds.append(fd)
            c2.close()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdin.close()
            p.stdout.close()

    def test_read_only_grant_cannot_be_written(self):
        """A non-root QEMU with a read-only grant cannot open the region
        for writing; the broker refuses it a read-write one."""
        self.c.create('tier', REGION_SIZE, 0o644)
        img = self.image('ro.hyb')
        os.chmod(img, 0o666)
        env = dict(os.environ, HVMEM_SOCKET=self.broker.sock)
        cmd = (f'exec {H.binary("qemu-io")} --image-opts '
               f'driver=hybrid,file.filename={img},'
               'ram-file=/proc/self/fd/$HVMEM_FD -c quit')
        nobody = ['setpriv', f'--reuid={B.NOBODY}', f'--regid={B.NOBODY}',
                  '--clear-groups']
        r = subprocess.run(nobody + [B.HVMEM, 'map', 'tier', '--', 'sh', '-c',
                                     cmd], capture_output=True, text=True,
                           env=env, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('Permission denied', r.stdout + r.stderr)
        r = subprocess.run(nobody + [B.HVMEM, 'map', 'tier', '--rw', '--',
                                     'true'], capture_output=True, text=True,
                           env=env, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('denied', (r.stdout + r.stderr).lower())

    def test_broker_restart_under_running_qemu(self):
        fd = self.region('tier')
        img = self.image('restart.hyb')
        io = self.qemu_io(img, fd)
        self.assertNotIn('failed', io.cmd(f'write -P 0x13 0 {MiB}'))
        rid = self.c.lookup('tier')['id']
        self.c.close()
        self.broker.stop()
        self.assertNotIn('failed', io.cmd(f'write -P 0x14 {MiB} {MiB}'))
        self.assertNotIn('failed', io.cmd(f'read -P 0x13 0 {MiB}'))
        self.broker.start()
        self.c = self.broker.client()
        self.assertEqual(self.c.lookup('tier')['id'], rid)
        io.kill()
        self.procs.remove(io)
        self.close_cleanly(img, fd)
        data = self.image_bytes(img)
        self.assertEqual(data[:MiB], b'\x13' * MiB)
        self.assertEqual(data[MiB:2 * MiB], b'\x14' * MiB)

    def test_pool_exhaustion(self):
        self.c.close()
        self.broker.stop()
        self.broker.start(['--capacity', '16M'])
        self.c = self.broker.client()
        with self.assertRaises(B.BrokerError) as e:
            self.c.create('tier', REGION_SIZE)
        self.assertEqual(e.exception.errno, errno.ENOSPC)
        self.assertIn('pool full', e.exception.msg)


if __name__ == '__main__':
    unittest.main()
