"""What the broker checks before it serves anyone: its pool and state
directories must be its own and out of other users' reach, every directory
above them too (the rule of docs/broker.md, "Directories"), region files are
opened relative to the checked directory and never through a symbolic link;
and one broker per pool and state directory (a lock names the first).

Another user is the real uid `nobody` (65534): these tests need root."""

import errno
import os
import shutil
import signal
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from brokerlib import NOBODY, Broker, BrokerTestCase  # noqa: E402

MiB = 1 << 20


class StartupTestCase(BrokerTestCase):

    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest('needs root to make directories owned by another uid')
        super().setUp()

    def tempdir(self, parent, mode=0o700, owner=0):
        d = tempfile.mkdtemp(prefix='hvmem-st-', dir=parent)
        self.addCleanup(shutil.rmtree, d, True)
        os.chmod(d, mode)
        os.chown(d, owner, owner)
        return d

    def other(self, pool, args=()):
        """A second broker with its own socket and log."""
        return Broker(self.tempdir(self.workdir, 0o755), pool, args)

    def refused(self, pool, args=(), words=()):
        """Start a broker on @pool: it must exit non-zero, its message
        holding every one of @words."""
        b = self.other(pool, args)
        rc = b.start(expect_fail=True, timeout=5)
        log = b.read_log()
        self.assertIsNotNone(rc, f'hvmemd still running on {pool}: {log}')
        self.assertNotEqual(rc, 0, log)
        for w in words:
            self.assertIn(w, log)
        return log

    def accepted(self, pool, args=()):
        b = self.other(pool, args)
        b.start()
        c = b.client()
        c.pool()
        c.close()
        b.stop()


class PoolDirectoryTest(StartupTestCase):

    def test_pool_made_first_by_another_user(self):
        """A pool or state directory that another uid made first (in sticky
        /dev/shm anyone may) is refused, naming the path and its owner: that
        user could swap region files and read what others write."""
        pool = self.tempdir('/dev/shm', 0o700, NOBODY)
        self.refused(pool, words=(f'{pool}: owned by uid {NOBODY}',
                                  'not by uid 0'))
        self.assertEqual(os.listdir(pool), [])
        state = self.tempdir(self.workdir, 0o700, NOBODY)
        fresh = os.path.join(self.tempdir('/dev/shm'), 'pool')
        self.refused(fresh, ['--state-dir', state],
                     words=(f'{state}: owned by uid {NOBODY}',))
        self.assertEqual(os.listdir(state), [])

    def test_writable_pool_refused(self):
        """The broker's own pool directory with group or other write
        permission is refused (someone may have put files in it)."""
        pool = self.tempdir('/dev/shm', 0o770)
        self.refused(pool, words=(pool, 'writable by group or others'))
        os.chmod(pool, 0o755)
        self.accepted(pool)
        self.assertEqual(os.stat(pool).st_mode & 0o777, 0o700)

    def test_unsafe_parents_refused(self):
        """Every directory above the pool must be owned by root or the
        broker's uid and not writable by group or others unless sticky."""
        parent = self.tempdir(self.workdir, 0o777)
        pool = os.path.join(parent, 'pool')
        self.refused(pool, words=(f'{parent}: writable by group or others',
                                  'not sticky'))
        self.assertFalse(os.path.exists(pool))
        os.chmod(parent, 0o1777)            # as /tmp and /dev/shm
        self.accepted(pool)
        nobodys = self.tempdir(self.workdir, 0o755, NOBODY)
        self.refused(os.path.join(nobodys, 'pool'),
                     words=(f'{nobodys}: owned by uid {NOBODY}',))
        deeper = self.tempdir(nobodys, 0o755)
        self.refused(os.path.join(deeper, 'pool'),
                     words=(f'{nobodys}: owned by uid {NOBODY}',))

    def test_symbolic_links(self):
        """A symbolic link on the way is followed only if root or the broker's
        uid owns it (another user's link in /dev/shm could point the pool at
        any directory); the directories it leads through are checked too."""
        target = self.tempdir(self.workdir, 0o755)
        link = os.path.join(self.tempdir('/dev/shm', 0o1777), 'pool')
        os.symlink(target, link)
        os.lchown(link, NOBODY, NOBODY)
        self.refused(link, words=(f'{link}: a symbolic link owned by uid {NOBODY}',))
        self.assertEqual(os.listdir(target), [])
        os.lchown(link, 0, 0)
        self.accepted(link)
        self.assertEqual(os.stat(target).st_mode & 0o777, 0o700)    # the pool
        self.assertIn('hvmemd.lock', os.listdir(target))
        # a link owned by root through a directory another user owns
        nobodys = self.tempdir(self.workdir, 0o755, NOBODY)
        os.symlink(os.path.join(nobodys, 'x'), os.path.join(self.workdir, 'via'))
        self.refused(os.path.join(self.workdir, 'via', 'pool'),
                     words=(f'{nobodys}: owned by uid {NOBODY}',))

    def test_region_file_replaced_by_a_link(self):
        """A region file that is no longer a regular file of the broker's (a
        symbolic link to something else) stops the start; what it points at
        is left alone (it used to be truncated to the region's size)."""
        info = self.c.create('r', MiB)
        self.c.close()
        self.broker.stop()
        victim = os.path.join(self.workdir, 'precious')
        with open(victim, 'w') as f:
            f.write('precious')
        path = self.broker.region_file(info['id'])
        os.unlink(path)
        os.symlink(victim, path)
        rc = self.broker.start(expect_fail=True, timeout=5)
        log = self.broker.read_log()
        self.assertIsNotNone(rc, log)
        self.assertNotEqual(rc, 0, log)
        self.assertIn(f'{path}: not a regular file', log)
        with open(victim) as f:
            self.assertEqual(f.read(), 'precious')
        os.unlink(path)
        self.broker.start()
        self.c = self.broker.client()
        self.assertEqual(self.c.list(), [])     # its file is gone: dropped


class SingleInstanceTest(StartupTestCase):

    def test_second_broker_on_the_same_pool_refused(self):
        """A second hvmemd on the same pool and socket exits non-zero naming
        the first one's pid; the first keeps its socket and answers.  The
        same for a second one sharing only the state directory."""
        self.c.create('r', MiB)
        pid = self.broker.proc.pid
        second = self.other(self.pool)
        second.sock = self.broker.sock
        rc = second.start(expect_fail=True, timeout=5)
        log = second.read_log()
        self.assertIsNotNone(rc, 'second hvmemd did not exit: ' + log)
        self.assertNotEqual(rc, 0, log)
        self.assertIn(f'{self.pool} is in use by another hvmemd (pid {pid})', log)
        self.assertTrue(os.path.exists(self.broker.sock))
        self.assertHealthy()
        self.assertEqual([r['name'] for r in self.c.list()], ['r'])
        fresh = os.path.join(self.tempdir('/dev/shm'), 'pool')
        self.refused(fresh, ['--state-dir', self.pool],
                     words=(f'{self.pool} is in use by another hvmemd (pid {pid})',))
        self.assertHealthy()
        # once the first is gone, the next one starts
        self.c.close()
        self.broker.stop(signal.SIGKILL)
        self.broker.start()
        self.c = self.broker.client()
        self.assertEqual([r['name'] for r in self.c.list()], ['r'])


if __name__ == '__main__':
    unittest.main()
