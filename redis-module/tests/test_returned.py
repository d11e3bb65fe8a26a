"""PREPARE reports everything the process gave back to the guest kernel, not
only the arena it drops: pages jemalloc returned after demotion are free in
the guest but still hold data a migration would send, so the host must be
allowed to balloon them away too."""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, aggressive, asmap  # noqa: E402


def kernel_zeroes_freed_pages():
    with open('/proc/cmdline') as f:
        return any(t.split('=', 1)[1] in ('1', 'y', 'Y', 'on')
                   for t in f.read().split() if t.startswith('init_on_free='))


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
            # The thread runs at SCHED_IDLE: the server's requests first.
            self.assertEqual(c.info('appassist')['appassist_last_prepare_drop_thread_idle'],
                             1 if lazy == 'yes' else 0)
            # The freed figure counts the arena being unmapped too.
            self.assertGreaterEqual(rep[b'freed_bytes'], dropped)
            c.execute_command('APPASSIST.RESUME')
            c.set('after', 'x')
            self.assertEqual(c.get('after'), b'x')
            self.assertHealthy(s)

    def test_lazy_drop_auto(self):
        """auto (default): lazy only when the freed pages end up zero, by the
        kernel (init_on_free=1 on its command line) or by the module
        (appassist.zero-freed); not when the balloon has to take them."""
        for zero in ('auto', 'no'):
            s = self.server(name='zero-' + zero,
                            configs=dict(aggressive(), demote='no', **{'zero-freed': zero}))
            c = s.client()
            self.assertEqual(c.config_get('appassist.lazy-drop')['appassist.lazy-drop'], 'auto')
            self.load_and_demote(c)
            rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
            self.assertEqual(rep[b'lazy'], 1 if zero == 'auto' or kernel_zeroes_freed_pages() else 0)
            c.execute_command('APPASSIST.RESUME')

    def test_zero_freed(self):
        """appassist.zero-freed (auto: on unless the kernel zeroes freed
        pages): jemalloc's purges go through the module's clearing hook and
        PREPARE reports all it gave back as zero pages (zeroed_bytes), so the
        host has nothing to balloon. Off: nothing is reported zero. Back on:
        only the arena it just cleared counts, until RESUME starts a new
        window (what was freed while off still holds data)."""
        if kernel_zeroes_freed_pages():
            self.skipTest('the kernel zeroes freed pages (init_on_free=1): zero-freed auto is off')
        s = self.server(configs=dict(aggressive(), demote='no'))
        c = s.client()
        info = c.info('appassist')
        self.assertEqual(c.config_get('appassist.zero-freed')['appassist.zero-freed'], 'auto')
        self.assertEqual((info['appassist_zero_freed_active'], info['appassist_zero_freed_window']),
                         (1, 1))
        self.load_and_demote(c)
        info = c.info('appassist')
        # Demotion emptied the keyspace's slabs: what MEMORY PURGE returned was cleared first.
        self.assertGreater(info['appassist_zero_freed_bytes'], self.N * 50)
        self.assertGreater(info['appassist_zero_freed_purges'], 0)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        self.assertGreater(rep[b'freed_bytes'], rep[b'dropped_bytes'] + self.N * 50)
        self.assertEqual(rep[b'zeroed_bytes'], rep[b'freed_bytes'])
        self.assertEqual(c.info('appassist')['appassist_last_prepare_zeroed_bytes'],
                         rep[b'freed_bytes'])
        c.execute_command('APPASSIST.RESUME')

        c.config_set('appassist.zero-freed', 'no')
        info = c.info('appassist')
        self.assertEqual((info['appassist_zero_freed_active'], info['appassist_zero_freed_window']),
                         (0, 0))
        cleared = info['appassist_zero_freed_bytes']
        c.flushall()
        self.load_and_demote(c)
        self.assertEqual(c.info('appassist')['appassist_zero_freed_bytes'], cleared)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        self.assertGreater(rep[b'freed_bytes'], 0)
        self.assertEqual((rep[b'zeroed_bytes'], rep[b'lazy']), (0, 0))
        c.execute_command('APPASSIST.RESUME')

        c.config_set('appassist.zero-freed', 'yes')
        self.assertEqual(c.info('appassist')['appassist_zero_freed_window'], 0)
        c.flushall()
        self.load_and_demote(c)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        self.assertGreater(rep[b'dropped_bytes'], 0)
        self.assertEqual(rep[b'zeroed_bytes'], rep[b'dropped_bytes'])
        self.assertEqual(rep[b'lazy'], 1)
        c.execute_command('APPASSIST.RESUME')
        self.assertEqual(c.info('appassist')['appassist_zero_freed_window'], 1)
        c.flushall()
        self.load_and_demote(c)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        self.assertEqual(rep[b'zeroed_bytes'], rep[b'freed_bytes'])
        c.execute_command('APPASSIST.RESUME')
        self.assertHealthy(s)

    def test_zero_freed_new_arena(self):
        """The clearing hooks go on the allocator's arenas that exist (not on
        all 4 x CPUs of them: each one that exists is merged into jemalloc's
        statistics at every one of Redis's ten epochs a second), and on an
        arena a thread creates later within about a second. What that arena
        purged before could not be cleared, so the window closes until
        RESUME opens the next one, and PREPARE claims no more than it may."""
        if kernel_zeroes_freed_pages():
            self.skipTest('the kernel zeroes freed pages (init_on_free=1): zero-freed auto is off')
        s = self.server(configs=dict(aggressive(), demote='no'))
        c = s.client()
        info = c.info('appassist')
        arenas = info['appassist_zero_freed_arenas']
        self.assertGreaterEqual(arenas, 1)
        self.assertLessEqual(arenas, 2)         # arena 0 and the huge arena
        self.assertEqual(info['appassist_zero_freed_window'], 1)
        # UNLINK of a set larger than 64 members is freed by Redis's lazyfree
        # thread, whose first allocation creates its arena
        c.sadd('big', *range(5000))
        c.unlink('big')
        deadline = time.monotonic() + 10
        while c.info('appassist')['appassist_zero_freed_arenas'] == arenas:
            self.assertLess(time.monotonic(), deadline, 'the new arena was not adopted')
            time.sleep(0.1)
        self.assertEqual(c.info('appassist')['appassist_zero_freed_window'], 0)
        self.load_and_demote(c)
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 5000))
        self.assertEqual(rep[b'zeroed_bytes'], rep[b'dropped_bytes'])
        c.execute_command('APPASSIST.RESUME')
        self.assertEqual(c.info('appassist')['appassist_zero_freed_window'], 1)
        self.assertHealthy(s)

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
