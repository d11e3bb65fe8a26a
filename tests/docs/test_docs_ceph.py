"""docs/ceph.md and docs/clone-cache.md run as written, against a real
single-node Ceph cluster (scripts/ceph-cluster.sh: cephx on, QEMU as
client.qemu).

Each doc's ```sh blocks run in document order as one `sh -eu` script
(tests/hvlib/docblocks.py), except those marked `<!-- not run: REASON -->`,
with the build's QEMU tools first on PATH.  A failing block fails the test,
naming its line and showing the output.

- docs/ceph.md makes, uses and purges its cluster itself: the test gives
  its CEPH_DIR a directory of its own (on ext4: BlueStore needs O_DIRECT)
  and CEPH_MON_PORT a free port, runs it from the top of the tree (the doc
  calls scripts/ceph-cluster.sh), and checks that the cluster is gone.
- docs/clone-cache.md runs against a cluster this test starts (CEPH_CONF),
  in a mount namespace of its own with tmpfs over /var/lib/hybridvm and
  /run/hybridvm, so the doc keeps the real install paths (the host keeps
  only the mount points, empty, if it had none).
Skips, saying why, where Ceph, QEMU's rbd driver or the build is missing,
or when not root (the mount namespace)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(TOP, 'tests'))
from hvlib import docblocks                                 # noqa: E402
from hvlib.ceph import SCRIPT, start_cluster, unavailable   # noqa: E402
from hvlib.paths import BuildPaths, MissingBuild            # noqa: E402

CEPH_MD = os.path.join(TOP, 'docs', 'ceph.md')
CLONE_CACHE_MD = os.path.join(TOP, 'docs', 'clone-cache.md')
# the install paths docs/clone-cache.md uses, each a tmpfs of the script's own
TMPFS = ('/var/lib/hybridvm', '/run/hybridvm')


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def tools_dir():
    """The build's QEMU tools (qemu-img, qemu-io, qemu-storage-daemon), or
    SkipTest saying what is missing."""
    paths = BuildPaths()
    try:
        qemu_img = paths.binary('qemu-img')
        for name in ('qemu-io', 'qemu-storage-daemon'):
            paths.binary(name)
    except MissingBuild as exc:
        raise unittest.SkipTest(str(exc))
    why = unavailable(qemu_img)
    if why:
        raise unittest.SkipTest(why)
    return paths.bin, paths.build


def doc_env(bindir, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith('CEPH_')}
    env['PATH'] = os.pathsep.join([bindir, env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')])
    env.update(extra)
    return env


class BlocksMarked(unittest.TestCase):

    def test_each_sh_block_runs_or_says_why(self):
        """Both docs have blocks to run; a block not run gives a reason (a
        sentence, not a word)."""
        for doc, least in ((CEPH_MD, 4), (CLONE_CACHE_MD, 4)):
            found = docblocks.blocks(doc)
            self.assertGreaterEqual(len(docblocks.runnable(doc)), least, doc)
            for b in found:
                if b.lang == 'sh' and b.not_run_reason is not None:
                    self.assertGreater(len(b.not_run_reason), 30, f'{doc}:{b.line}')


class CephDoc(unittest.TestCase):
    """docs/ceph.md: its cluster (started, used and purged by the doc) is
    this class's one cluster."""

    @classmethod
    def setUpClass(cls):
        cls.bin, build = tools_dir()
        # BlueStore needs O_DIRECT: the build directory (ext4), as test_rbd
        cls.tmp = tempfile.mkdtemp(prefix='docs-ceph-', dir=build)
        cls.ceph_dir = os.path.join(cls.tmp, 'ceph')
        cls.port = free_port()

    @classmethod
    def tearDownClass(cls):
        # the doc purges its cluster; after a failure half-way, we do
        if os.path.exists(cls.ceph_dir):
            subprocess.run([SCRIPT, 'purge', cls.ceph_dir], capture_output=True, timeout=120,
                           env=dict(os.environ, CEPH_MON_PORT=str(cls.port)))
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_ceph_md_runs_as_written(self):
        env = doc_env(self.bin, CEPH_DIR=self.ceph_dir, CEPH_MON_PORT=str(self.port))
        t0 = time.monotonic()
        p = docblocks.run(CEPH_MD, env=env, cwd=TOP, timeout=120)
        print(f'\n{os.path.relpath(CEPH_MD, TOP)}: {time.monotonic() - t0:.1f} s',
              file=sys.stderr)
        out = p.stdout + p.stderr
        self.assertIn(f'CEPH_CONF={self.ceph_dir}/ceph.conf', out)
        self.assertIn(f'QEMU_KEYRING={self.ceph_dir}/client.qemu.keyring', out)
        self.assertIn('file format: hybrid', out)           # qemu-img info over RBD
        self.assertIn('protocol type: rbd', out)
        self.assertNotIn('Pattern verification failed', out)
        self.assertEqual(out.count('read 1048576/1048576 bytes at offset 0'), 5, out)
        # Full clones: scripts/rbd-full-clone.sh's copy has the base's data,
        # zeros where the base has none, and no parent
        self.assertIn("rbd image 'vm2'", out)
        self.assertNotIn('parent:', out)
        self.assertIn('read 1048576/1048576 bytes at offset 1048576', out)
        # purged: no daemon, no data
        self.assertFalse(os.path.exists(self.ceph_dir))


class CloneCacheDoc(unittest.TestCase):
    """docs/clone-cache.md over an RBD snapshot in this class's cluster."""

    @classmethod
    def setUpClass(cls):
        cls.bin, build = tools_dir()
        if os.geteuid() != 0:
            raise unittest.SkipTest('needs root: the doc runs with tmpfs over '
                                    + ' and '.join(TMPFS) + ' in a mount namespace')
        cls.tmp = tempfile.mkdtemp(prefix='docs-clone-cache-', dir=build)
        cls.ceph = start_cluster(os.path.join(cls.tmp, 'ceph'), cls.tmp, free_port())

    @classmethod
    def tearDownClass(cls):
        cls.ceph.purge()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_clone_cache_md_runs_as_written(self):
        env = doc_env(self.bin, CEPH_CONF=self.ceph.conf)
        work = os.path.join(self.tmp, 'work')
        os.mkdir(work)
        t0 = time.monotonic()
        p = docblocks.run(CLONE_CACHE_MD, env=env, cwd=work, timeout=120, tmpfs=TMPFS)
        print(f'\n{os.path.relpath(CLONE_CACHE_MD, TOP)}: {time.monotonic() - t0:.1f} s',
              file=sys.stderr)
        out = p.stdout + p.stderr
        self.assertIn('Images are identical.', out)        # the overlay reads the snapshot
        self.assertIn('read 8388608/8388608 bytes at offset 0', out)
        self.assertIn('wrote 65536/65536 bytes at offset 0', out)
        self.assertIn('read 65536/65536 bytes at offset 0', out)
        self.assertNotIn('Pattern verification failed', out)
        # the base the doc made: a protected snapshot, unchanged by the VM's write
        info = self.ceph.rbd('snap', 'ls', 'rbd/vdi').stdout
        self.assertIn('gold', info)
        self.assertIn('protected: True', self.ceph.rbd('info', 'rbd/vdi@gold').stdout)


if __name__ == '__main__':
    unittest.main()
