"""A cold item that cannot be read (its spilled chunk is gone) makes a
whole-keyspace command fail with an error, counted in INFO appassist's
read_errors, never a short answer presented as complete (issue 18, item 5).
The server stays healthy."""

import os
import sys
import unittest

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, aggressive, asmap  # noqa: E402

N = 2000
READ_ERROR = 'appassist: reading spilled cold items failed'


class ReadErrorTest(ServerTestCase):

    def spilled_and_truncated(self):
        """A server whose N items are all spilled, and a spill file emptied
        behind its back (the module keeps it open)."""
        s = self.server(configs=dict(aggressive(), **{'on-prepare': 'spill'}))
        c = s.client()
        for i in range(N):
            c.set('k%d' % i, 'v' * 100)
        self.demote_all(c, N)
        rep = asmap(c.execute_command('APPASSIST.PREPARE'))
        self.assertEqual(rep[b'complete'], 1)
        self.assertEqual(c.info('appassist')['appassist_arena_chunks_in_memory'], 0)
        spill = os.path.join(s.dir, 'spill')
        os.truncate(spill, 0)
        return s, c

    def read_errors(self, c):
        return c.info('appassist')['appassist_read_errors']

    def test_scan_fails(self):
        """SCAN's arena phase replies with an error instead of ending the
        iteration early."""
        s, c = self.spilled_and_truncated()
        cur, keys = c.scan(0, count=1000)
        self.assertEqual(keys, [])                  # nothing hot
        self.assertEqual(cur, 1 << 63)              # the arena phase is next
        with self.assertRaises(redis.ResponseError) as e:
            c.scan(cur, count=1000)
        self.assertIn(READ_ERROR, str(e.exception))
        self.assertEqual(self.read_errors(c), 1)
        self.assertHealthy(s)

    def test_keys_fails(self):
        """KEYS replies with an error, not with the keys it could read."""
        s, c = self.spilled_and_truncated()
        c.set('hot', 'x')
        with self.assertRaises(redis.ResponseError) as e:
            c.keys('*')
        self.assertIn(READ_ERROR, str(e.exception))
        with self.assertRaises(redis.ResponseError):
            c.keys('k1*')
        self.assertEqual(self.read_errors(c), 2)
        self.assertEqual(c.dbsize(), N + 1)         # counted, not read
        self.assertHealthy(s)

    def test_swapdb_fails(self):
        """SWAPDB promotes every cold item first; when it cannot read them
        the swap is refused with the error (and logged), not done with the
        items left behind in the arena."""
        s, c = self.spilled_and_truncated()
        c.set('hot', 'x')
        with self.assertRaises(redis.ResponseError) as e:
            c.swapdb(0, 1)
        self.assertIn(READ_ERROR, str(e.exception))
        self.assertEqual(self.read_errors(c), 1)
        with open(s.log) as f:
            self.assertIn('promoting every cold item failed', f.read())
        self.assertEqual(c.get('hot'), b'x')        # not swapped
        self.assertHealthy(s)

    def test_get_fails(self):
        """A command naming an unreadable cold key answers the error, not
        nil as if the key were missing."""
        s, c = self.spilled_and_truncated()
        for cmd in (('GET', 'k1'), ('MGET', 'k2', 'k3'), ('SET', 'k4', 'new'),
                    ('GETRANGE', 'k5', 0, 3), ('RENAME', 'k6', 'k7')):
            with self.assertRaises(redis.ResponseError) as e:
                c.execute_command(*cmd)
            self.assertIn(READ_ERROR, str(e.exception))
        self.assertEqual(self.read_errors(c), 5)
        self.assertIsNone(c.get('nosuchkey'))
        self.assertHealthy(s)


if __name__ == '__main__':
    unittest.main()
