"""PREPARE reports everything the process gave back to the guest kernel, not
only the arena it drops: pages jemalloc returned after demotion are free in
the guest but still hold data a migration would send, so the host must be
allowed to balloon them away too."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, aggressive, asmap  # noqa: E402


def peak_rss(pid):
    with open('/proc/%d/status' % pid) as f:
        for line in f:
            if line.startswith('VmHWM:'):
                return int(line.split()[1]) * 1024
    raise AssertionError('no VmHWM')


class ReturnedMemoryTest(ServerTestCase):

    N = 200_000

    def load_and_demote(self, c):
        pipe = c.pipeline(transaction=False)
        for i in range(self.N):
            pipe.set('k%d' % i, b'v' * 100)
            if i % 10_000 == 9_999:
                pipe.execute()
        pipe.execute()
        # Everything was hot while loading (demotion off): the peak holds
        # the whole keyspace, as in a server that ran for a while.
        c.config_set('appassist.demote', 'yes')
        self.demote_all(c, self.N, timeout=60, batch=5000)
        c.config_set('appassist.demote', 'no')
        # Every item left the keyspace: its allocations are free in jemalloc;
        # a purge hands the emptied pages to the kernel.
        c.execute_command('MEMORY', 'PURGE')

    def test_drop_reports_returned_memory(self):
        s = self.server(configs=dict(aggressive(), demote='no'))
        c = s.client()
        self.load_and_demote(c)
        peak = peak_rss(s.proc.pid)
        rss0 = s.rss()
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        dropped, freed = rep[b'dropped_bytes'], rep[b'freed_bytes']
        # lazy-drop (default): a thread unmaps the arena after the reply.
        self.wait_for(lambda: rss0 - s.rss() >= 0.9 * dropped, timeout=10,
                      what='the arena unmapped')
        rss = s.rss()
        self.assertGreater(dropped, 0)
        # The keyspace's share came back before PREPARE; the reply counts it.
        self.assertGreater(freed, dropped + self.N * 50)
        self.assertLessEqual(abs(freed - (peak - rss)), 8 << 20)
        self.assertEqual(rep[b'peak_rss'] // 4096, peak // 4096)

        # RESUME starts a new peak: a second PREPARE with nothing new to give
        # reports (almost) nothing.
        c.execute_command('APPASSIST.RESUME')
        self.assertLessEqual(peak_rss(s.proc.pid) - s.rss(), 4 << 20)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        self.assertLessEqual(rep[b'freed_bytes'], 4 << 20)
        c.execute_command('APPASSIST.RESUME')
        self.assertHealthy(s)

    def test_lazy_drop(self):
        """appassist.lazy-drop yes (default): the reply comes before the arena
        is unmapped, a thread unmaps it moments later; no: unmapped before the
        reply. Either way the items are gone at once and the server serves."""
        for lazy in ('yes', 'no'):
            s = self.server(name='lazy-' + lazy,
                            configs=dict(aggressive(), demote='no', **{'lazy-drop': lazy}))
            c = s.client()
            self.assertEqual(c.config_get('appassist.lazy-drop')['appassist.lazy-drop'], lazy)
            self.load_and_demote(c)
            rss0 = s.rss()
            rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
            self.assertEqual(rep[b'lazy'], 1 if lazy == 'yes' else 0)
            dropped = rep[b'dropped_bytes']
            self.assertEqual(c.get('k1'), None)
            self.assertEqual(c.info('appassist')['appassist_cold_items'], 0)
            if lazy == 'no':
                self.assertGreaterEqual(rss0 - s.rss(), 0.9 * dropped)
            self.wait_for(lambda: rss0 - s.rss() >= 0.9 * dropped, timeout=10,
                          what='the arena unmapped')
            # The freed figure counts the arena being unmapped too.
            self.assertGreaterEqual(rep[b'freed_bytes'], dropped)
            c.execute_command('APPASSIST.RESUME')
            c.set('after', 'x')
            self.assertEqual(c.get('after'), b'x')
            self.assertHealthy(s)

    def test_lazy_drop_auto(self):
        """auto (default): lazy only when the kernel zeroes freed pages
        (init_on_free=1 on its command line)."""
        s = self.server(configs=dict(aggressive(), demote='no'))
        c = s.client()
        self.assertEqual(c.config_get('appassist.lazy-drop')['appassist.lazy-drop'], 'auto')
        self.load_and_demote(c)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        with open('/proc/cmdline') as f:
            zeroes = any(t.split('=', 1)[1] in ('1', 'y', 'Y', 'on')
                         for t in f.read().split() if t.startswith('init_on_free='))
        self.assertEqual(rep[b'lazy'], 1 if zeroes else 0)
        c.execute_command('APPASSIST.RESUME')

    def test_none_reports_nothing(self):
        s = self.server(configs=dict(aggressive(), demote='no', **{'on-prepare': 'none'}))
        c = s.client()
        self.load_and_demote(c)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        self.assertEqual(rep[b'freed_bytes'], 0)
        self.assertEqual(c.dbsize(), self.N)
        c.execute_command('APPASSIST.ABORT')


if __name__ == '__main__':
    unittest.main()
