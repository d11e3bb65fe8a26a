"""The daemon's loop in the test's own process, for the host tests: the real
Arbiter (links, periods, decisions, status, metrics) driven one period at a
time, its VMs FakeQMP peers (fakeqmp.py says why), its probe a stand-in
whose latency the test sets, its container a directory with a cgroup v2
io.stat the test writes.  The device is never opened: its number is
given here, and the periods read the container's counters by it."""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from arbiter import daemon                  # noqa: E402
from arbiter.config import Config           # noqa: E402
from arbiter.sources import percentile      # noqa: E402
from fakeqmp import FakeQMP                 # noqa: E402

DEVNO = '7:99'


class FakeProbe:
    """Every sample at lat_ms; or, once a test sets samples (a list of
    (monotonic s, latency s), the window as the real probe keeps it), the
    percentiles of those of them taken at or after since."""
    policy, restarts, error = 'stand-in', 0, None

    def __init__(self, lat_ms):
        self.lat_ms = lat_ms
        self.samples = None

    def window_stats(self, pct, since=None):
        if self.samples is None:
            return dict(samples=200, p50_ms=self.lat_ms, p99_ms=self.lat_ms, pct_ms=self.lat_ms)
        lat = [x for t, x in self.samples if since is None or t >= since]
        if not lat:
            return dict(samples=0, p50_ms=None, p99_ms=None, pct_ms=None)
        return dict(samples=len(lat), p50_ms=percentile(lat, 0.5) * 1e3,
                    p99_ms=percentile(lat, 0.99) * 1e3, pct_ms=percentile(lat, pct / 100) * 1e3)

    def stop(self):
        pass


class InProcess:
    """An Arbiter over len(vms) FakeQMP peers and one container, its links
    running; close() stops them.  period_ms sets how long a period waits
    for the VMs' samples (half of it, at most 0.5 s)."""

    def __init__(self, vms=('vm0',), period_ms=1000, target_ms=5.0, lat_ms=10.0,
                 qmp_timeout_ms=1000, extra_vm=''):
        self.dir = tempfile.mkdtemp(prefix='arb-inproc-')
        self.cgroup = os.path.join(self.dir, 'ctr')
        os.mkdir(self.cgroup)
        self.ctr_ops = 0
        self.peers = {n: FakeQMP(os.path.join(self.dir, f'{n}.qmp')) for n in vms}
        text = (f'[arbiter]\nperiod-ms = {period_ms}\nstate-dir = {self.dir}/state\n'
                f'qmp-timeout-ms = {qmp_timeout_ms}\n\n'
                f'[device]\npath = /dev/arbiter-test-none\ntarget-latency-ms = {target_ms}\n\n'
                f'[container db]\ncgroup = {self.cgroup}\n\n')
        for n, p in self.peers.items():
            text += (f'[vm {n}]\nqmp = {p.path}\nthrottle-group = tg0\ndevice = disk0\n'
                     f'{extra_vm}\n')
        conf = os.path.join(self.dir, 'arb.conf')
        with open(conf, 'w') as f:
            f.write(text)
        os.chmod(conf, 0o644)
        real, daemon.device_number = daemon.device_number, lambda path: DEVNO
        try:
            self.arb = daemon.Arbiter(Config(conf))
        finally:
            daemon.device_number = real
        self.arb.probe = FakeProbe(lat_ms)
        self.records = []
        self.dlog = self.arb.log

        def log(rec):
            self.records.append(rec)
            self.dlog(rec)
        self.arb.log = self.log = log
        for link in self.arb.links.values():
            link.log = self.log
            link.start()

    def container_io(self, ops):
        """The container does ops more 4 KiB I/Os."""
        self.ctr_ops += ops
        with open(os.path.join(self.cgroup, 'io.stat'), 'w') as f:
            f.write(f'{DEVNO} rbytes={self.ctr_ops * 4096} wbytes=0 rios={self.ctr_ops} '
                    'wios=0 dbytes=0 dios=0\n')

    def decisions(self):
        return [r for r in self.records if 'action' in r]

    def close(self):
        for link in self.arb.links.values():
            link.stop()
        for p in self.peers.values():
            p.close()
        self.dlog.close()
        shutil.rmtree(self.dir, ignore_errors=True)
