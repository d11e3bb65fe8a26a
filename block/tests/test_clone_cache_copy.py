"""A clone-cache base that is a full copy of another (issue 40, target 7):
`copy-of` names the origin's base, and the copy's reads are served from
the blocks the origin's readers cached -- nothing read from the copy's own
base while the origin's cache holds the block -- and only while that is
safe: a copy made from another generation of the origin, or an origin
invalidated since, shares nothing; the origin's generation cannot change
under an open copy; a copy-of that names no open base is refused.

File bases here (a full copy is `cp`); block/tests/test_rbd.py makes the
copy with `rbd deep cp` in a Ceph cluster and counts the cluster's bytes."""

import os
import random
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hybridlib as H   # noqa: E402
from test_clone_cache import BS, MiB, rand_bytes   # noqa: E402


class CopyOfTest(unittest.TestCase):

    def setUp(self):
        if not H.have_binaries():
            self.skipTest(f'QEMU tools not built in {H.BIN}')
        self.tmp = H.TempDir()
        self.qsd = None
        self.data = rand_bytes(random.Random(40), 4 * MiB)
        for name in ('gold', 'copy'):
            with open(self.tmp(name), 'wb') as f:
                f.write(self.data)

    def tearDown(self):
        if self.qsd:
            self.qsd.kill()
        self.tmp.cleanup()

    def args(self, copy_opts=',copy-of=gold', order=('gold', 'copy')):
        args = ['--object', f'clone-cache,id=cc0,filename={self.tmp("cc")},'
                'size=32M',
                '--nbd-server', f'addr.type=unix,addr.path={self.tmp("s")}']
        for name in order:
            extra = copy_opts if name == 'copy' else ''
            args += ['--blockdev', f'file,node-name=f-{name},'
                     f'filename={self.tmp(name)},read-only=on',
                     '--blockdev', f'clone-cache,node-name={name},store=cc0,'
                     f'file=f-{name},read-only=on,base-id={name}{extra}',
                     '--export', f'nbd,id=e-{name},node-name={name}']
        return args

    def start(self, *a, **kw):
        self.qsd = H.StorageDaemon(self.tmp, *self.args(*a, **kw))
        return self.qsd

    def log(self):
        self.qsd.log.seek(0)
        return self.qsd.log.read()

    def settle(self, what):
        deadline = time.monotonic() + 30
        while self.qsd.cmd('query-clone-cache')[0]['fill-pending']:
            self.assertLess(time.monotonic(), deadline, what)
            time.sleep(0.05)
        time.sleep(0.1)     # the last batch is published after it is written

    def read_all(self, name):
        out = self.tmp(f'{name}.read')
        H.qemu_img('convert', '-f', 'raw', '-O', 'raw',
                   f'nbd+unix:///{name}?socket={self.tmp("s")}', out)
        with open(out, 'rb') as f:
            data = f.read()
        os.unlink(out)
        return data

    def base(self, base_id):
        [c] = self.qsd.cmd('query-clone-cache')
        [b] = [b for b in c['bases'] if b['base-id'] == base_id]
        return b

    def warm_origin(self):
        self.assertEqual(self.read_all('gold'), self.data)
        self.settle('the origin\'s fills never ended')
        self.assertEqual(self.base('gold')['entries'], len(self.data) // BS)

    def test_a_copy_reads_nothing_from_its_base_once_the_origin_is_cached(self):
        self.start()
        self.warm_origin()
        self.assertEqual(self.read_all('copy'), self.data)
        copy = self.base('copy')
        self.assertEqual(copy['base-read-bytes'], 0)
        self.assertEqual(copy['misses'], 0)
        self.assertEqual(copy['hits'], len(self.data) // BS)
        # and after a restart, from the file
        self.qsd.stop()
        self.start()
        self.assertEqual(self.read_all('copy'), self.data)
        self.assertEqual(self.base('copy')['base-read-bytes'], 0)

    def test_blocks_the_origin_lacks_come_from_the_copy_base(self):
        self.start()
        # half the origin cached: the copy reads only the other half
        out = self.tmp('half')
        H.qemu_img('dd', '-f', 'raw', '-O', 'raw', 'bs=64k', 'count=32',
                   f'if=nbd+unix:///gold?socket={self.tmp("s")}', f'of={out}')
        self.settle('the origin\'s fills never ended')
        self.assertEqual(self.base('gold')['entries'], 32)
        self.assertEqual(self.read_all('copy'), self.data)
        self.assertEqual(self.base('copy')['base-read-bytes'],
                         len(self.data) - 32 * BS)

    def test_a_copy_of_another_generation_shares_nothing(self):
        self.start(',copy-of=gold,copy-of-generation=12345')
        self.warm_origin()
        gen = self.base('gold')['generation']
        self.assertNotEqual(gen, 12345)
        self.assertEqual(self.read_all('copy'), self.data)
        self.assertEqual(self.base('copy')['base-read-bytes'], len(self.data))
        self.assertIn('the copy was made from generation 12345 of base '
                      "'gold', which has generation %d now; nothing is "
                      'shared' % gen, self.log())
        # the origin's own generation given: shared (the copy's own blocks
        # invalidated first, or they would serve it)
        self.qsd.stop()
        self.start(',copy-of=gold,copy-of-generation=%d' % gen)
        self.qsd.cmd('clone-cache-invalidate', id='cc0', **{'base-id': 'copy'})
        self.assertEqual(self.read_all('copy'), self.data)
        self.assertEqual(self.base('copy')['base-read-bytes'], 0)

    def test_an_invalidated_origin_is_no_longer_shared(self):
        self.start()
        self.warm_origin()
        # the origin changes in place: the copy still has the old bytes
        with open(self.tmp('gold'), 'r+b') as f:
            f.write(b'\x5a' * BS)
        self.qsd.cmd('clone-cache-invalidate', id='cc0', **{'base-id': 'gold'})
        new = b'\x5a' * BS + self.data[BS:]
        self.assertEqual(self.read_all('gold'), new)    # cached anew
        self.settle('the origin\'s fills never ended')
        self.assertEqual(self.read_all('copy'), self.data)
        self.assertEqual(self.base('copy')['base-read-bytes'], len(self.data))

    def test_the_origin_cannot_change_generation_under_an_open_copy(self):
        self.start()
        r = self.qsd.qmp('blockdev-add', driver='clone-cache',
                          **{'node-name': 'gold2', 'store': 'cc0',
                             'file': 'f-gold', 'read-only': True,
                             'base-id': 'gold', 'generation': 7})
        self.assertIn("base 'gold' is open with generation", str(r['error']))

    def refused(self, *args):
        """qemu-storage-daemon exits at once with an error: its message."""
        r = subprocess.run([H.binary('qemu-storage-daemon')] + list(args),
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stdout)
        return r.stderr

    def test_bad_copy_of_is_refused(self):
        self.assertIn("copy-of base 'nosuch' is not open", self.refused(
            *self.args(',copy-of=nosuch')))
        # the origin must be open first: given after the copy, it is not
        self.assertIn("copy-of base 'gold' is not open", self.refused(
            *self.args(order=('copy', 'gold'))))
        self.assertIn('a base cannot be a copy of itself', self.refused(
            *self.args(',copy-of=copy')))
        self.assertIn('generation', self.refused(
            *self.args(',copy-of=gold,copy-of-generation=x')))


if __name__ == '__main__':
    unittest.main()
