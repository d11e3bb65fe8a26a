"""A host client that keeps reading a guest's Redis while it migrates: one
connection, GET of random hot keys in a loop, every request's latency kept;
it moves on to the next port (the destination's) when told the guest runs
there (follow()), or when the source stops answering.  Used by
scripts/demo.py and bench/app-assist.py.

No error of the client library, the socket or the server ends it: each
failed attempt is recorded with its time and kind (a gap in the service,
which figures() reports as 'failed'), and the client reconnects with a
short pause.  A request is retried until it succeeds; its latency counts
from its first attempt."""

import random
import threading
import time


class RedisLoad:
    """Host load generator: GET random hot keys in a loop, one connection,
    recording (time, latency) per request and (time, kind) per failed
    attempt; moves to the destination's port when told (follow()) or when
    the source fails twice in a row."""

    RETRY_PAUSE = 0.05      # s between a failed attempt and the next

    def __init__(self, ports, keys):
        import redis
        self.redis = redis
        self.ports = list(ports)
        self.keys = keys
        self.samples = []       # (t, latency s) of requests served
        self.failures = []      # (t, kind) of failed attempts
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.target = 0         # the port the guest runs behind (follow())
        self.client = None

    @property
    def errors(self):
        """Failed attempts in all (each is also in self.failures)."""
        return len(self.failures)

    def follow(self):
        """The guest now runs behind the next port (the destination runs it,
        in post-copy or after a pre-copy): move there at once, as a client
        does whose server keeps its address when it migrates (here each QEMU
        forwards its own host port).  A request in flight on the stopped
        source is sent again there, its latency counted from its first
        attempt.  Without this the client noticed the move only by timing out
        twice on the stopped source (2 s each), and those seconds counted as
        no requests served.  (Call it once the destination runs: slirp's
        connection to a guest that does not run yet waits for a SYN
        retransmission, 2 s here.)"""
        self.target = min(self.target + 1, len(self.ports) - 1)
        client = self.client
        if client is not None:
            try:
                client.connection_pool.disconnect()     # wakes the request in flight
            except Exception:  # noqa: BLE001 -- the run loop sees the failure
                pass

    def _connect(self, idx):
        self.client = self.redis.Redis(host='127.0.0.1', port=self.ports[idx],
                                       socket_timeout=2, socket_connect_timeout=1)
        return self.client

    @staticmethod
    def _close(client):
        try:
            client.close()
        except Exception:  # noqa: BLE001 -- a broken client is dropped anyway
            pass

    def run(self):
        rng = random.Random(1)
        idx = 0
        client = None
        key = t_first = None
        failed_here = 0         # failed attempts in a row on this port
        while not self.stop.is_set():
            if client is None or self.target > idx:
                if client is not None:
                    self._close(client)
                if self.target > idx:
                    idx, failed_here = self.target, 0
                client = self._connect(idx)
            if key is None:
                key = self.keys[rng.randrange(len(self.keys))]
                t_first = time.monotonic()
            try:
                client.get(key)
            except Exception as exc:  # noqa: BLE001 -- every failure is a gap
                # A server killed or stopped under a request, follow()
                # closing the socket, a reply cut short: whatever the client
                # library raises, the request is retried.
                self.failures.append((time.monotonic(), type(exc).__name__))
                self._close(client)
                client = None
                if self.target <= idx:
                    failed_here += 1
                    # The source stops answering once the guest runs on the
                    # destination: move on after two failures in a row.
                    if failed_here >= 2 and idx < len(self.ports) - 1:
                        idx, failed_here = idx + 1, 0
                        self.target = max(self.target, idx)
                    self.stop.wait(self.RETRY_PAUSE)
                continue
            self.samples.append((t_first, time.monotonic() - t_first))
            key = None
            failed_here = 0
        if client is not None:
            self._close(client)

    def figures(self, t_start, t_end):
        """Requests served in [t_start, t_end] (by the time they were first
        sent): rate and latency; 'failed': attempts that failed then."""
        lat = sorted(d for t, d in list(self.samples) if t_start <= t <= t_end)
        failed = sum(1 for t, _ in list(self.failures) if t_start <= t <= t_end)
        span = max(t_end - t_start, 1e-3)
        if not lat:
            return {'ops/s': 0, 'p50 (ms)': None, 'p99 (ms)': None, 'max (ms)': None,
                    'failed': failed}
        return {'ops/s': round(len(lat) / span),
                'p50 (ms)': round(1000 * lat[len(lat) // 2], 2),
                'p99 (ms)': round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
                'max (ms)': round(1000 * lat[-1], 1),
                'failed': failed}
