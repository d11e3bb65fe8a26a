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


if __name__ == '__main__':
    unittest.main()
