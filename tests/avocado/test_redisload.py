"""The host load client of the demo and the app-assist benchmark
(hvlib.RedisLoad) against a real redis-server that is killed and started
again under it: the client never dies, counts every failed attempt as a gap
(figures()'s 'failed'), and serves again once the server is back.  And the
checks (hvlib.count_wrong) outlive a server that goes away and comes back.
No guest: a host redis-server stands for the guest's, on a TCP port as the
guests' are forwarded."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
import hvlib  # noqa: E402


class RedisLoadTest(unittest.TestCase):

    def setUp(self):
        self.server = shutil.which('redis-server')
        if not self.server:
            self.skipTest('redis-server is not installed')
        try:
            import redis  # noqa: F401
        except ImportError:
            self.skipTest('redis-py is not installed')
        self.dir = tempfile.mkdtemp(prefix='redisload-')
        self.port = hvlib.free_port()
        self.proc = None

    def tearDown(self):
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self):
        self.proc = subprocess.Popen(
            [self.server, '--port', str(self.port), '--bind', '127.0.0.1',
             '--save', '', '--appendonly', 'no', '--dir', self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(('127.0.0.1', self.port), 0.2).close()
                return
            except OSError:
                self.assertLess(time.monotonic(), deadline, 'redis-server did not start')
                time.sleep(0.05)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def served_since(self, load, t):
        return sum(1 for s, _ in list(load.samples) if s >= t)

    def wait_served(self, load, t, n=50, timeout=30):
        deadline = time.monotonic() + timeout
        while self.served_since(load, t) < n:
            self.assertTrue(load.thread.is_alive(), 'the load thread died')
            self.assertLess(time.monotonic(), deadline, 'no requests served')
            time.sleep(0.02)

    def test_server_killed_and_restarted_under_the_load(self):
        import redis
        self.start()
        r = redis.Redis(host='127.0.0.1', port=self.port)
        keys = [f'k{i}' for i in range(100)]
        r.mset({k: k for k in keys})
        r.close()
        load = hvlib.RedisLoad([self.port], keys)
        load.thread.start()
        try:
            self.wait_served(load, 0)
            for _ in range(3):
                self.kill()
                t_kill = time.monotonic()
                time.sleep(0.5)             # the client fails meanwhile
                self.assertTrue(load.thread.is_alive())
                self.start()
                self.wait_served(load, time.monotonic())
                f = load.figures(t_kill, time.monotonic())
                self.assertGreater(f['failed'], 0, f)
        finally:
            load.stop.set()
            load.thread.join(10)
        self.assertFalse(load.thread.is_alive())
        kinds = {k for _, k in load.failures}
        self.assertTrue(kinds, 'no failure recorded')
        # only the seconds around the kills have failures
        self.assertEqual(load.figures(0, 0)['failed'], 0)

    def test_follow_moves_a_request_in_flight(self):
        """follow() closes the socket under a request: any error the
        library raises then is a retry on the next port, never the end."""
        self.start()
        other = hvlib.free_port()
        proc2 = subprocess.Popen(
            [self.server, '--port', str(other), '--bind', '127.0.0.1', '--save', '',
             '--dir', self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(('127.0.0.1', other), 0.2).close()
                    break
                except OSError:
                    self.assertLess(time.monotonic(), deadline)
                    time.sleep(0.05)
            load = hvlib.RedisLoad([self.port, other], ['a', 'b'])
            load.thread.start()
            self.wait_served(load, 0)
            stop = threading.Event()

            def hammer():           # follow() at random moments, from another thread
                while not stop.is_set():
                    load.follow()
                    time.sleep(0.001)
            h = threading.Thread(target=hammer)
            h.start()
            time.sleep(1)
            stop.set()
            h.join()
            t = time.monotonic()
            self.wait_served(load, t)
            load.stop.set()
            load.thread.join(10)
            self.assertFalse(load.thread.is_alive())
        finally:
            proc2.kill()
            proc2.wait()

    def test_checks_outlive_a_server_that_comes_back(self):
        import redis
        self.start()
        r = redis.Redis(host='127.0.0.1', port=self.port, socket_timeout=2)
        hot = [(f'h{i}', f'v{i}'.encode()) for i in range(2000)]
        cold = [(f'c{i}', b'x') for i in range(100)]
        r.mset(dict(hot))
        self.kill()
        threading.Timer(1.5, self.start).start()    # back during the retries
        t = time.monotonic()
        wrong_hot, wrong_cold = hvlib.count_wrong(r, hot, cold, cold_dropped=True)
        # the server came back empty: every hot item is wrong, none raised
        self.assertEqual(wrong_hot, len(hot))
        self.assertEqual(wrong_cold, 0)
        self.assertGreater(time.monotonic() - t, 1.0)
        r.close()


if __name__ == '__main__':
    unittest.main()
