"""Who runs the background work: on an idle server the timer's slices
(slice-us every interval-ms); while clients are served, short bites before
the event loop sleeps, so no request waits behind a whole slice. Either way
demotion gets done: a server kept busy without a pause still demotes."""

import os
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, pipe  # noqa: E402

N = 20000


def configs():
    # Every item demoted at once, at the default slice and interval.
    return {'hot-percent': 0, 'min-idle-ms': 0, 'demote': 'no'}


class BackgroundTest(ServerTestCase):

    def load(self, srv):
        pipe(srv, ((b'SET', b'k%d' % i, b'v' * 100) for i in range(N)))

    def wait_all_cold(self, c, poll, what):
        """Poll (every `poll` s: each poll is a command served) until all N
        items are cold; INFO appassist then."""
        deadline = time.monotonic() + 60
        while self.info(c)['appassist_cold_items'] < N:
            self.assertLess(time.monotonic(), deadline, what)
            time.sleep(poll)
        return self.info(c)

    def test_idle_server_uses_slices(self):
        srv = self.server(configs=configs())
        self.load(srv)
        c = srv.client()
        before = self.info(c)
        c.config_set('appassist.demote', 'yes')
        # Poll rarely: every command counts as work being served.
        after = self.wait_all_cold(c, 0.5, 'demotion did not finish')
        self.assertGreater(after['appassist_background_slices'],
                           before['appassist_background_slices'])
        self.assertHealthy(srv)

    def test_busy_server_uses_bites(self):
        srv = self.server(configs=configs())
        self.load(srv)
        c = srv.client()
        stop = threading.Event()
        sent = [0]

        def hammer():
            # Pipelined PINGs, without a pause: the timer never finds the
            # server idle, so only the bites can make progress.
            so = socket.socket(socket.AF_UNIX)
            so.connect(srv.sock)
            batch = b'PING\r\n' * 64
            while not stop.is_set():
                so.sendall(batch)
                got = 0
                while got < 7 * 64:
                    got += len(so.recv(65536))
                sent[0] += 64
            so.close()

        t = threading.Thread(target=hammer)
        t.start()
        try:
            self.wait_for(lambda: sent[0] > 1000, what='the load to start')
            before = self.info(c)
            c.config_set('appassist.demote', 'yes')
            after = self.wait_all_cold(c, 0.05, 'demotion did not finish under load')
        finally:
            stop.set()
            t.join()
        bites = after['appassist_background_bites'] - before['appassist_background_bites']
        slices = after['appassist_background_slices'] - before['appassist_background_slices']
        self.assertGreater(bites, 0)
        self.assertGreater(bites, slices)
        self.assertGreater(after['appassist_background_cpu_us'],
                           before['appassist_background_cpu_us'])
        self.assertGreater(after['appassist_demotions'], before['appassist_demotions'])
        self.assertHealthy(srv)

    def test_bites_disarmed_with_nothing_to_do(self):
        """With nothing under way or due (demotion off, nothing expiring, no
        holes to reclaim), the module is not subscribed to the event loop at
        all: Redis sets up a context and a temporary client for every
        subscriber twice per round of its loop, ~1500 instructions per GET
        at pipeline 1 (callgrind). With work due, the bites run again."""
        srv = self.server(configs={'demote': 'no', 'interval-ms': 1, 'slice-us': 1000})
        self.load(srv)
        c = srv.client()
        self.wait_for(lambda: self.info(c)['appassist_background_bites_armed'] == 0,
                      what='the timer to disarm the bites')
        before = self.info(c)
        for _ in range(3000):
            c.get('k1')
        after = self.info(c)
        for k in ('bites', 'bites_idle', 'bite_arms'):
            self.assertEqual(after[f'appassist_background_{k}'], before[f'appassist_background_{k}'],
                             k)
        # Demotion on: a pass is due, the timer arms the bites, they do the work
        c.config_set('appassist.demote', 'yes')
        c.config_set('appassist.hot-percent', 0)
        c.config_set('appassist.min-idle-ms', 0)

        def working():
            # the timer's next tick (up to 100 ms away) sees the pass due
            for _ in range(200):
                c.get('k1')
            i = self.info(c)
            return (i['appassist_background_bite_arms'] > after['appassist_background_bite_arms'] and
                    i['appassist_background_bites'] > after['appassist_background_bites'])
        self.wait_for(working, what='the timer to arm the bites and the bites to work')
        self.assertHealthy(srv)

    def test_passes_that_fit_arm_no_bites(self):
        """At the defaults, on a server whose data fits the hot budget (30 %
        of this host's RAM), a pass falls due every second and is skipped
        after a look at used_memory. The timer makes that check itself:
        clients served meanwhile see no bites armed for it. Before, every
        skipped pass armed them for up to 100 ms."""
        srv = self.server()
        self.load(srv)
        c = srv.client()
        self.wait_for(lambda: self.info(c)['appassist_background_bites_armed'] == 0,
                      what='the timer to disarm the bites')
        before = self.info(c)
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            c.get('k1')         # a client served all along: bites would run
        after = self.info(c)
        self.assertGreaterEqual(after['appassist_skipped_passes'] -
                                before['appassist_skipped_passes'], 2)
        self.assertEqual(after['appassist_passes'], before['appassist_passes'])
        self.assertEqual(after['appassist_background_bite_arms'],
                         before['appassist_background_bite_arms'])
        self.assertEqual(after['appassist_cold_items'], 0)
        self.assertHealthy(srv)

    def test_demotion_off_mid_pass_leaves_nothing_under_way(self):
        """Demotion turned off in the middle of a pass ends the pass: its
        cursor left behind kept the background work "under way" for good, so
        every round of the event loop ran a bite that could do nothing."""
        srv = self.server(configs={**configs(), 'slice-us': 50, 'interval-ms': 10})
        self.load(srv)
        c = srv.client()
        c.config_set('appassist.demote', 'yes')
        self.wait_for(lambda: self.info(c)['appassist_demotions'] > 0, what='the pass to start')
        c.config_set('appassist.demote', 'no')
        self.assertLess(self.info(c)['appassist_cold_items'], N, 'the pass ended before the test')
        self.wait_for(lambda: self.info(c)['appassist_background_bites_armed'] == 0,
                      what='the timer to disarm the bites')
        before = self.info(c)
        for _ in range(1000):
            c.get('k1')
        after = self.info(c)
        self.assertEqual(after['appassist_background_bites'], before['appassist_background_bites'])
        # Back on, a new pass demotes the rest.
        c.config_set('appassist.demote', 'yes')
        self.wait_all_cold(c, 0.05, 'demotion did not finish after it was turned back on')
        self.assertHealthy(srv)

    def test_visit_settles_with_bites_disarmed(self):
        """A read of a cold item lends it to the keyspace for the command; it
        goes back before the loop sleeps even when the bites were disarmed:
        the filter arms them. Without that it stayed lent until the timer's
        next work (a command right after the read saw it hot)."""
        srv = self.server(configs=configs())
        self.load(srv)
        c = srv.client()
        self.demote_all(c, N)
        # Demotion on (reads are visits), but everything fits: passes are
        # skipped and nothing is due between them.
        c.config_set('appassist.hot-percent', 100)
        c.config_set('appassist.demote', 'yes')
        visits = self.info(c)['appassist_visits']
        for i in range(20):
            self.wait_for(lambda: self.info(c)['appassist_background_bites_armed'] == 0,
                          what='the timer to disarm the bites')
            self.assertEqual(c.get(f'k{i}'), b'v' * 100)
            self.assertEqual(c.execute_command('APPASSIST.ISCOLD', f'k{i}'), 1, i)
        self.assertEqual(self.info(c)['appassist_visits'], visits + 20)
        self.assertHealthy(srv)

    def test_passes_that_cannot_demote_back_off(self):
        """Over budget with everything in use (here: nothing idle for
        min-idle-ms), a pass demotes nothing, and the next would find the
        same: the pause between passes doubles from 5 s instead of a pass
        every second."""
        srv = self.server(configs={'planned-memory': 100000, 'hot-percent': 10,
                                   'min-idle-ms': 3600000})
        self.load(srv)
        c = srv.client()
        before = self.info(c)['appassist_passes']
        time.sleep(7)
        i = self.info(c)
        self.assertEqual(i['appassist_demotions'], 0)
        self.assertGreaterEqual(i['appassist_passes'] - before, 1)
        self.assertLessEqual(i['appassist_passes'] - before, 3)
        # Idle enough now: a pass (DEMOTE runs one at once) demotes.
        c.config_set('appassist.min-idle-ms', 0)
        c.execute_command('APPASSIST.DEMOTE', 5000)
        c.execute_command('APPASSIST.DEMOTE', 5000)
        self.assertGreater(self.info(c)['appassist_demotions'], 0)
        self.assertHealthy(srv)

    def steps_round(self, name, slice_us, n):
        """One server through demotion passes, a compaction pass, the
        expiry sweep, arena rehash and reclaim; its INFO appassist after."""
        # A hot budget of about half the items (key + value + 48 each).
        srv = self.server(name, configs={'planned-memory': n * 554 // 2 * 100 // 30,
                                         'hot-percent': 30, 'min-idle-ms': 0,
                                         'slice-us': slice_us, 'promote-window-ms': 100})
        c = srv.client()
        pipe(srv, ((b'SET', b'k%d' % i, b'v' * 500) + ((b'PX', b'3600000') if i % 3 == 0 else ())
                   for i in range(n)))
        self.wait_for(lambda: (lambda i: i['appassist_cold_items'] >= n * 2 // 5 and
                               i['appassist_compactions'] >= 1)(self.info(c)),
                      timeout=60, what='demotion and a compaction pass')
        p = c.pipeline(transaction=False)
        for k in range(n):
            p.execute_command('APPASSIST.ISCOLD', 'k%d' % k)
        cold = [k for k, r in enumerate(p.execute()) if r]
        # Rewrite three quarters of the cold items (write visits): with at
        # least 12000 of them, the holes (>= 4.6 MB) are then more than half
        # of what is live and over reclaim's 4 MiB floor. (Two thirds of
        # what was cold at the first third, under CI's load, stayed under
        # the floor.)
        part = [k for j, k in enumerate(cold) if j % 4]
        for lo in range(0, len(part), 1000):
            c.mset({'k%d' % k: b'w' * 500 for k in part[lo:lo + 1000]})
        i = self.info(c)
        self.wait_for(lambda: self.info(c)['appassist_arena_reclaim_moved'] > 0,
                      timeout=30, what='reclaim (%d cold, %d rewritten, %d dead bytes, %d live)'
                      % (len(cold), len(part), i['appassist_arena_dead_bytes'],
                         i['appassist_cold_bytes']))
        i = self.info(c)
        self.assertGreater(i['appassist_relocations'], 0,
                           {k: v for k, v in i.items() if 'compact' in k or 'reloc' in k or
                            k in ('appassist_cold_items', 'appassist_passes')})
        self.assertHealthy(srv)
        srv.stop()
        return i

    def test_steps_stay_short(self):
        """Every kind of background work -- demotion passes, compaction,
        the expiry sweep, arena rehash and reclaim -- runs in steps that
        hold the event loop for about a slice at most (thread CPU time,
        so that the machine's other load does not count).

        This virtual machine now and then charges a thread up to a few
        milliseconds for a single call that normally takes microseconds, with
        no page fault, as it does to a loop that does nothing (bench/cpu-gaps;
        see docs/redis-module.md). A step's CPU time is its slice plus what
        the platform charged meanwhile: at 1 ms slices the longest steps
        measured 1.0-1.1 ms on a quiet day and 1.6-2.3 ms on a busy one (the
        extra found inside single RedisModule_Scan calls of 1-3 keys). So 2 ms
        slices, up to three rounds on fresh servers, and one of them must stay
        within two slices (the busy day's noise added 0.2-0.7 ms to a 2 ms
        step: 2.2-2.7 ms in three rounds), and work that really ran on, like the compaction purge before (16 ms
        in test_compact), fails every round."""
        slice_us, n = 2000, 30000
        seen = []
        for r in range(3):
            i = self.steps_round('steps%d' % r, slice_us, n)
            seen.append(i['appassist_background_step_max_cpu_us'])
            if seen[-1] <= 2 * slice_us:
                break
        print('\nlongest step per round, us of thread CPU: %s' % seen)
        self.assertLessEqual(min(seen), 2 * slice_us, seen)


if __name__ == '__main__':
    unittest.main()
