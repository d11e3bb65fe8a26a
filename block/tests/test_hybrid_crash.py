"""Crash consistency and error injection for the hybrid format.

SIGKILL test: qemu-io writes verifiable 4 KiB patterns in async mode with
flushes in between and is killed at random moments; after every kill the
image must hold, for every 4 KiB slot, either the value of the last write
acknowledged before a completed flush or one written after it, never
anything else, and qemu-img check must be clean.  HYBRIDVM_LONG=1 runs
many more rounds."""

import os
import random
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

MiB = 1024 * 1024
SLOT = 4096
SIZE = 32 * MiB


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class HybridCrashTest(H.ToolTest):

    def verify(self, img, model):
        model.check(H.image_bytes(img, self.tmp('verify.raw')))
        r = H.qemu_img('check', '-f', 'hybrid', img, check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_sigkill_async(self):
        """No flushed write is lost across SIGKILLs in async mode."""
        img = self.tmp('crash.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o',
                   'ram-size=16M,mode=async', img, str(SIZE))
        rnd = random.Random(int(os.environ.get('HYBRID_SEED', '4242')))
        rounds = 40 if H.LONG else 5
        model = H.WriteModel(SIZE // SLOT, rnd, durable='flush')
        # A throttled persistent tier keeps the flusher behind the writers,
        # so flushes really have work to do when the process is killed.
        opts = (f'driver=hybrid,dirty-limit=512k,file.driver=throttle,'
                f'file.throttle-group=tg0,file.file.driver=file,'
                f'file.file.filename={img}')
        obj = ['--object', 'throttle-group,id=tg0,x-iops-write=300']
        for rnd_no in range(rounds):
            io = H.QemuIo(opts, obj)
            self.procs.append(io)
            model.run(io, rnd.randint(30, 120), flush_p=0.12)
            # a few writes that may or may not have happened at the kill
            model.send_unacked(io, rnd.randint(0, 8))
            io.kill()
            self.procs.remove(io)
            self.verify(img, model)
        # Informational: unflushed writes lost to the kills (allowed)
        print(f'{rounds} kills, {model.lost} unflushed writes lost',
              file=sys.stderr)


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class HybridErrorTest(unittest.TestCase):
    """blkdebug on the persistent tier: errors reach the caller, and what
    was flushed before the error stays."""

    def setUp(self):
        self.tmp = H.TempDir()
        self.img = self.tmp('err.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=4M',
                   self.img, '8M')

    def tearDown(self):
        self.tmp.cleanup()

    def opts(self, mode, errno, once=False):
        # fail writes that touch guest offset 1 MiB (data starts at 64 KiB)
        sector = (65536 + MiB) // 512
        return (f'driver=hybrid,mode={mode},file.driver=blkdebug,'
                f'file.image.driver=file,file.image.filename={self.img},'
                f'file.inject-error.0.event=pwritev,'
                f'file.inject-error.0.iotype=write,'
                f'file.inject-error.0.sector={sector},'
                f'file.inject-error.0.errno={errno},'
                f'file.inject-error.0.once={"on" if once else "off"}')

    def test_sync_eio(self):
        """sync: the failing write returns EIO, others succeed."""
        out = H.qemu_io('-t', 'writeback', '--image-opts', self.opts('sync', 5),
                        '-c', 'write -P 1 2M 64k',
                        '-c', 'write -P 2 1M 64k', check=False).stdout
        self.assertIn('write failed: Input/output error', out)
        out = H.qemu_io('-f', 'hybrid', '-c', 'read -P 1 2M 64k',
                        self.img).stdout
        self.assertNotIn('failed', out)

    def test_async_enospc_keeps_flushed(self):
        """async: the write is acknowledged, the flush reports ENOSPC, and
        the data flushed before is intact after reopen."""
        out = H.qemu_io('-t', 'writeback', '--image-opts', self.opts('async', 28),
                        '-c', 'write -P 3 2M 64k', '-c', 'flush',
                        '-c', 'write -P 4 1M 64k', '-c', 'flush',
                        check=False)
        # qemu-io prints nothing for a failed flush but exits with 1
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn('wrote 65536/65536 bytes at offset 1048576', out.stdout)
        self.assertIn('could not write back all data at close: No space '
                      'left on device', out.stderr)
        info = H.img_info(self.img)
        self.assertTrue(info['format-specific']['data']['dirty'])
        r = H.qemu_img('check', '-r', 'all', self.img)
        self.assertEqual(r.returncode, 0)
        self.assertFalse(H.img_info(self.img)['format-specific']['data']['dirty'])
        out = H.qemu_io('-r', '-f', 'hybrid', '-c', 'read -P 3 2M 64k',
                        self.img).stdout
        self.assertNotIn('failed', out)

    def test_async_error_in_a_run_redirties_the_whole_run(self):
        """async: 1 MiB of contiguous blocks goes back as one request; a
        one-shot EIO on it leaves every block of it dirty, and the next
        flush writes them all."""
        out = H.qemu_io('-t', 'writeback', '--trace', 'hybrid_writeback',
                        '--image-opts', self.opts('async', 5, once=True),
                        '-c', 'write -P 6 512k 1M', '-c', 'flush',
                        '-c', 'flush', check=False)
        self.assertIn('block 8 offset 0 len 1048576 ret -5', out.stderr)
        # written again, as one or more runs (the rest of the first flush
        # picks up the blocks after the failed one)
        ok = re.findall(r'block (\d+) offset 0 len (\d+) ret 0', out.stderr)
        self.assertEqual(sorted(int(b) for b, _ in ok)[0], 8, ok)
        self.assertEqual(sum(int(n) for _, n in ok), MiB, ok)
        self.assertNotIn('could not write back', out.stderr)
        out = H.qemu_io('-f', 'hybrid', '-c', 'read -P 6 512k 1M',
                        self.img).stdout
        self.assertNotIn('failed', out)

    def test_async_transient_error_recovers(self):
        """async: after a one-shot EIO, a later flush succeeds and the data
        is durable (the sticky error clears once everything is written)."""
        out = H.qemu_io('-t', 'writeback', '--image-opts', self.opts('async', 5, once=True),
                        '-c', 'write -P 5 1M 64k', '-c', 'flush',
                        '-c', 'flush', check=False)
        self.assertGreaterEqual(out.returncode, 0)
        self.assertNotIn('could not write back', out.stderr)
        out = H.qemu_io('-f', 'hybrid', '-c', 'read -P 5 1M 64k',
                        self.img).stdout
        self.assertNotIn('failed', out)


if __name__ == '__main__':
    unittest.main()
