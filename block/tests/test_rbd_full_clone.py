"""scripts/rbd-full-clone.sh (issue 40, target 7): full copies of an RBD
snapshot made by the OSDs (RADOS copy-from per object), against a real
single-node cluster (scripts/ceph-cluster.sh), started once for the class.

- the copies hold the snapshot's bytes, zeros where it has none, have no
  parent, and only the objects the snapshot has are made;
- a base written after its snapshot is refused (copy-from copies an
  object's head), and no image is left behind;
- a failed copy removes the images it made;
- bad arguments are refused with exit status 2.
Skips, with the reason, where Ceph is missing."""

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
import hybridlib as H   # noqa: E402
from hvlib.ceph import purge_for_class, start_for_class   # noqa: E402

SCRIPT = os.path.join(H.REPO, 'scripts', 'rbd-full-clone.sh')
MiB = 1024 * 1024


class RbdFullCloneTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not H.have_binaries():
            raise unittest.SkipTest(f'QEMU tools not built in {H.BIN}')
        start_for_class(cls, H.binary('qemu-img'), H.BUILD,
                        3301 + (os.getpid() + 250) % 500)
        # a 20 MiB base with data in objects 0, 1 and 3 (4 MiB objects),
        # object 2 and 4 never written; object 1 only in part
        cls.data = {0: os.urandom(4 * MiB), 1: os.urandom(MiB), 3: os.urandom(4 * MiB)}
        raw = bytearray(20 * MiB)
        for o, b in cls.data.items():
            raw[o * 4 * MiB:o * 4 * MiB + len(b)] = b
        cls.raw_sha = hashlib.sha256(raw).hexdigest()
        cls.ceph.rbd('create', '--size', '20M', 'rbd/base')
        for o, b in cls.data.items():
            cls.write('rbd/base', o * 4 * MiB, b)
        cls.ceph.rbd('snap', 'create', 'rbd/base@gold')
        cls.ceph.rbd('snap', 'protect', 'rbd/base@gold')

    @classmethod
    def tearDownClass(cls):
        purge_for_class(cls)

    @classmethod
    def write(cls, image, offset, data):
        with tempfile.NamedTemporaryFile(dir=cls.dir) as f:
            f.write(data)
            f.flush()
            subprocess.run([H.binary('qemu-io'), '-f', 'raw', '-c',
                            f'write -s {f.name} {offset} {len(data)}',
                            f'rbd:{image}:conf={cls.ceph.conf}'],
                           check=True, capture_output=True, env=cls.ceph.env, timeout=60)

    def script(self, *args):
        return subprocess.run([SCRIPT, *args], capture_output=True, text=True,
                              env=self.ceph.env, timeout=300)

    def images(self):
        return set(self.ceph.rbd('ls', 'rbd').stdout.split())

    def sha(self, image):
        r = subprocess.run(f'rbd export --no-progress {image} - | sha256sum', shell=True,
                           capture_output=True, text=True, env=self.ceph.env, timeout=60)
        return r.stdout.split()[0]

    def test_copies(self):
        """Two copies at once: the snapshot's bytes, no parent, the same
        objects as the base (none where it has none), and an object map
        that says which."""
        r = self.script('-j', '3', 'rbd/base@gold', 'rbd/c1', 'rbd/c2')
        self.assertEqual(r.returncode, 0, r.stderr)
        for img in ('rbd/c1', 'rbd/c2'):
            info = json.loads(self.ceph.rbd('info', '--format', 'json', img).stdout)
            self.assertNotIn('parent', info)
            self.assertEqual(info['size'], 20 * MiB)
            self.assertEqual(info['flags'], [])                # object map not invalid
            self.assertEqual(self.sha(img), self.raw_sha)
            objs = sorted(o for o in self.ceph.run('rados', '-p', 'rbd', 'ls').stdout.split()
                          if o.startswith(info['block_name_prefix'] + '.'))
            self.assertEqual([int(o.rsplit('.', 1)[1], 16) for o in objs], [0, 1, 3])
            # the object map says so too (fast-diff answers from it; librbd
            # reads zeros for an object it says is missing once it holds
            # the exclusive lock, as a VM's writes make it)
            ext = json.loads(self.ceph.rbd('diff', '--whole-object', '--format', 'json', img).stdout)
            self.assertEqual(sorted({e['offset'] // (4 * MiB) for e in ext}), [0, 1, 3])
            self.ceph.rbd('rm', '--no-progress', img)

    def test_written_base_refused(self):
        """A base written after its snapshot: refused, nothing made."""
        self.ceph.rbd('create', '--size', '8M', 'rbd/moved')
        self.write('rbd/moved', 0, b'a' * 65536)
        self.ceph.rbd('snap', 'create', 'rbd/moved@s')
        self.write('rbd/moved', 0, b'b' * 65536)
        before = self.images()
        r = self.script('rbd/moved@s', 'rbd/m1')
        self.assertEqual(r.returncode, 1)
        self.assertIn('was written after @s', r.stderr)
        self.assertEqual(self.images(), before)

    def test_failed_copy_removes_images(self):
        """A copy that fails (here: `rados` failing, put first on PATH)
        removes the images the script made, and says so."""
        fake = tempfile.mkdtemp(dir=self.dir)
        with open(os.path.join(fake, 'rados'), 'w') as f:
            f.write('#!/bin/sh\necho "rados: injected failure" >&2\nexit 1\n')
        os.chmod(os.path.join(fake, 'rados'), 0o755)
        env = dict(self.ceph.env, PATH=fake + os.pathsep + os.environ['PATH'])
        before = self.images()
        r = subprocess.run([SCRIPT, 'rbd/base@gold', 'rbd/g1', 'rbd/g2'], capture_output=True,
                           text=True, env=env, timeout=300)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn('injected failure', r.stderr)
        self.assertIn('removing rbd/g1 rbd/g2', r.stderr)
        self.assertEqual(self.images(), before)

    def test_a_reader_cannot_make_copies(self):
        """Run as a client that may only read the pool (cephx caps `profile
        rbd-read-only`): the cluster refuses the copies, the script exits
        1, and nothing is left behind; the base is untouched."""
        keyring = os.path.join(self.dir, 'client.reader.keyring')
        self.ceph.ceph('auth', 'get-or-create', 'client.reader', 'mon', 'profile rbd',
                       'osd', 'profile rbd-read-only pool=rbd', '-o', keyring)
        env = dict(self.ceph.env, CEPH_ARGS=f'--id reader --keyring {keyring}')
        before = self.images()
        r = subprocess.run([SCRIPT, 'rbd/base@gold', 'rbd/stolen'], capture_output=True,
                           text=True, env=env, timeout=300)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn('Operation not permitted', r.stderr)
        self.assertEqual(self.images(), before)
        self.assertEqual(self.sha('rbd/base@gold'), self.raw_sha)

    def test_bad_arguments(self):
        """Usage errors exit 2 and make nothing."""
        before = self.images()
        for args in ([], ['rbd/base@gold'], ['rbd/base', 'rbd/x'], ['-j', '0', 'rbd/base@gold',
                     'rbd/x'], ['rbd/base@gold', 'x']):
            r = self.script(*args)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
        self.assertEqual(self.images(), before)


if __name__ == '__main__':
    unittest.main()
