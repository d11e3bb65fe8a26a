"""What a client must not be able to do through the module (issue 18): make
the server write through a path it does not own."""

import os
import sys
import unittest

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, aggressive  # noqa: E402


class SpillPathTest(ServerTestCase):

    def spilling_server(self, n=200):
        s = self.server(configs=dict(aggressive(), **{'on-prepare': 'spill'}))
        c = s.client()
        for i in range(n):
            c.set('k%d' % i, 'v%d' % i)
        self.demote_all(c, n)
        return s, c

    def assertNothingLost(self, c, n=200):
        self.assertEqual(c.info('appassist')['appassist_state'], 'normal')
        self.assertEqual(c.dbsize(), n)
        self.assertEqual(c.get('k7'), b'v7')

    def test_symlink_at_the_spill_path(self):
        """A symbolic link at the spill path: PREPARE fails, the file it
        points to is left as it was, nothing is lost."""
        s, c = self.spilling_server()
        victim = os.path.join(self.workdir, 'victim')
        with open(victim, 'w') as f:
            f.write('precious')
        os.symlink(victim, os.path.join(s.dir, 'spill'))
        with self.assertRaisesRegex(redis.ResponseError, 'spill file'):
            c.execute_command('APPASSIST.PREPARE')
        with open(victim) as f:
            self.assertEqual(f.read(), 'precious')
        self.assertNothingLost(c)
        self.assertHealthy(s)

    def test_dangling_symlink_at_the_spill_path(self):
        """A link to a file that does not exist: not created through it."""
        s, c = self.spilling_server()
        target = os.path.join(self.workdir, 'created')
        os.symlink(target, os.path.join(s.dir, 'spill'))
        with self.assertRaisesRegex(redis.ResponseError, 'spill file'):
            c.execute_command('APPASSIST.PREPARE')
        self.assertFalse(os.path.exists(target))
        self.assertNothingLost(c)
        self.assertHealthy(s)

    def test_other_file_at_the_spill_path(self):
        """A regular file that is not a spill file: not truncated, not
        written, PREPARE fails."""
        s, c = self.spilling_server()
        spill = os.path.join(s.dir, 'spill')
        with open(spill, 'w') as f:
            f.write('precious')
        with self.assertRaisesRegex(redis.ResponseError, 'spill file'):
            c.execute_command('APPASSIST.PREPARE')
        with open(spill) as f:
            self.assertEqual(f.read(), 'precious')
        self.assertNothingLost(c)
        self.assertHealthy(s)

    def test_stale_spill_file_is_replaced(self):
        """A spill file left behind by a server that was killed while
        spilled is replaced by the next one, which spills and reads back."""
        s, c = self.spilling_server()
        c.execute_command('APPASSIST.PREPARE')
        spill = os.path.join(s.dir, 'spill')
        self.assertTrue(os.path.exists(spill))
        s.stop()                                    # SIGKILL: the file stays
        self.assertTrue(os.path.exists(spill))
        s.start()
        c = s.client()
        for i in range(200):
            c.set('k%d' % i, 'v%d' % i)
        self.demote_all(c, 200)
        c.execute_command('APPASSIST.PREPARE')
        self.assertEqual(c.info('appassist')['appassist_state'], 'prepared')
        self.assertEqual(c.get('k7'), b'v7')
        c.execute_command('APPASSIST.RESUME')
        self.wait_for(lambda: c.info('appassist')['appassist_state'] == 'normal',
                      what='unspill')
        self.assertFalse(os.path.exists(spill))
        self.assertHealthy(s)


if __name__ == '__main__':
    unittest.main()
