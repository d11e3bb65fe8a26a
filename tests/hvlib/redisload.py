"""A host client that keeps reading a guest's Redis while it migrates: one
connection, GET of random hot keys in a loop, every request's latency kept;
it moves on to the next port (the destination's) when told the guest runs
there (follow()), or when the source stops answering.  Used by
scripts/demo.py and bench/app-assist.py."""

import random
import threading
import time


class RedisLoad:
    """Host load generator: GET random hot keys in a loop, one connection,
    recording (time, latency) per request; moves to the destination's port
    when the source stops answering."""

    def __init__(self, ports, keys):
        import redis
        self.redis = redis
        self.ports = list(ports)
        self.keys = keys
        self.samples = []       # (t, latency s)
        self.errors = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.target = 0         # the port the guest runs behind (follow())
        self.client = None

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
            client.connection_pool.disconnect()     # wakes the request in flight

    def run(self):
        rng = random.Random(1)
        idx = 0
        client = None
        key = t_first = None
        while not self.stop.is_set():
            if client is None or self.target > idx:
                if client is not None:
                    client.close()
                idx = max(idx, self.target)
                client = self.redis.Redis(host='127.0.0.1', port=self.ports[idx],
                                          socket_timeout=2, socket_connect_timeout=1)
                self.client = client
            if key is None:
                key = self.keys[rng.randrange(len(self.keys))]
                t_first = time.monotonic()
            try:
                client.get(key)
                self.samples.append((t_first, time.monotonic() - t_first))
                key = None
            except Exception as exc:  # noqa: BLE001 -- see below
                moved = self.target > idx
                # follow() closing the socket under a request can surface as
                # any error of the client library; otherwise only these.
                if not moved and not isinstance(exc, (self.redis.ConnectionError,
                                                      self.redis.TimeoutError)):
                    raise
                self.errors += 1
                client.close()
                client = None
                if not moved:
                    key = None
                    idx = min(idx + 1, len(self.ports) - 1) if self.errors > 1 else idx
                    time.sleep(0.05)
        if client:
            client.close()

    def figures(self, t_start, t_end):
        lat = sorted(d for t, d in self.samples if t_start <= t <= t_end)
        span = max(t_end - t_start, 1e-3)
        if not lat:
            return {'ops/s': 0, 'p50 (ms)': None, 'p99 (ms)': None, 'max (ms)': None}
        return {'ops/s': round(len(lat) / span),
                'p50 (ms)': round(1000 * lat[len(lat) // 2], 2),
                'p99 (ms)': round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
                'max (ms)': round(1000 * lat[-1], 1)}
