"""The arbiter daemon: every period it measures the containers and the VMs,
runs the control law (policy.py) and sets the VMs' throttle group limits.

Letting go safely: on SIGTERM/SIGINT it puts every VM's default limits back
before it exits; against SIGKILL or a crash, a watchdog process (its own
session, holding the read end of a pipe whose write end only the daemon
holds) does the same when the pipe closes without the daemon's "done".  A
restarted daemon re-attaches to the running VMs and starts from the limits
it finds.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import policy
from .files import open_append, replace_file
from .model import Model
from .podmanlink import Watch as PodmanWatch
from .sources import (Probe, SourceError, cgroup_io, device_number, hist_percentile,
                      io_pressure_us, v1_disable_accounting, v1_enable_accounting)
from .vmlink import VMLink, restore_defaults

STATUS_MAX_REQUEST = 64
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DecisionLog:
    """JSON lines, one per decision or event, rotated at max_bytes (one
    old file kept)."""

    def __init__(self, path, max_bytes):
        self.path, self.max = path, max_bytes
        self.lock = threading.Lock()
        self.f = open_append(path)

    def __call__(self, rec):
        rec = dict(t=round(time.time(), 3), **rec)
        line = json.dumps(rec, separators=(',', ':')) + '\n'
        with self.lock:
            if self.f.tell() + len(line) > self.max:
                self.f.close()
                os.replace(self.path, self.path + '.1')
                self.f = open_append(self.path)
            self.f.write(line)

    def close(self):
        with self.lock:
            self.f.close()


class Watchdog:
    """The watchdog process (watchdog.py) as the daemon keeps it.  It
    says "ready" once it has read the configuration; its standard error
    is kept (its last KEEP bytes) for the reason it died.  A dead one is
    started again: at once after its first death, then after 1, 2, 4 ...
    60 s (RESTART_MIN, RESTART_MAX), at once again after one has run
    STABLE seconds.  States: 'starting' (not ready yet), 'running'
    (ready), 'error' (dead, or started again after a death and not ready
    yet); error keeps the last death's reason.  poll() and stop() are the
    loop's; status() may be called from any thread."""

    RESTART_MIN, RESTART_MAX, STABLE = 1.0, 60.0, 30.0
    KEEP = 2048

    def __init__(self, conf_path, log):
        self.conf_path, self.log = conf_path, log
        self.lock = threading.Lock()    # the fields status() reads
        self.proc = None
        self.w = self.out = self.err = None     # its stdin's write end, stdout, stderr
        self.said = self.errtext = b''
        self.ready = False
        self.started = 0.0
        self.restarts = 0
        self.error = None
        self.delay = 0.0                # before the next start after a death
        self.next_start = 0.0

    def start(self):
        """Start it (the pipe's write end stays ours: closing it without
        "done" is what sets it off)."""
        r, w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            ours = os.dup(2)    # its stderr once the daemon is gone: the daemon's
        except OSError:
            ours = os.open(os.devnull, os.O_WRONLY)
        try:
            proc = subprocess.Popen(
                [sys.executable, '-m', 'arbiter.watchdog', self.conf_path, str(ours)],
                stdin=r, stdout=out_w, stderr=err_w, pass_fds=(ours,), start_new_session=True,
                cwd=PACKAGE_PARENT)
        except OSError as e:
            for fd in (w, out_r, err_r):
                os.close(fd)
            self._died(f'cannot start: {e.strerror or e}', None)
            return
        finally:
            for fd in (r, out_w, err_w, ours):
                os.close(fd)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        with self.lock:
            self.proc, self.w, self.out, self.err = proc, w, out_r, err_r
            self.said, self.errtext, self.ready = b'', b'', False
            self.started = time.monotonic()

    def poll(self):
        """Once a period: read what it said, see whether it died, start it
        again when that is due."""
        now = time.monotonic()
        if self.proc is not None:
            self._read()
            rc = self.proc.poll()
            if rc is None:
                if now - self.started >= self.STABLE:
                    self.delay = 0.0
                return
            self._read()
            lines = self.errtext.decode('utf-8', 'replace').strip().splitlines()
            how = f'killed by signal {-rc}' if rc < 0 else f'exited with status {rc}'
            self._died(how + (f': {lines[-1][-300:]}' if lines else ''), rc)
        if now >= self.next_start:
            with self.lock:
                self.restarts += 1
            self.start()

    def _read(self):
        """What it wrote since the last period, bounded: 'ready' on its
        stdout, the last KEEP bytes of its stderr."""
        for fd, attr in ((self.out, 'said'), (self.err, 'errtext')):
            for _ in range(16):
                try:
                    d = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not d:
                    break
                setattr(self, attr, (getattr(self, attr) + d)[-self.KEEP:])
        if not self.ready and b'ready\n' in self.said:
            with self.lock:
                self.ready = True

    def _died(self, why, rc):
        self._close()
        with self.lock:
            self.proc, self.ready, self.error = None, False, why
        self.next_start = time.monotonic() + self.delay
        self.log(dict(event='watchdog-died', rc=rc, error=why, restart_in=self.delay))
        self.delay = min(self.RESTART_MAX, max(self.RESTART_MIN, 2 * self.delay))

    def _close(self):
        for attr in ('w', 'out', 'err'):
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)

    def stop(self, done):
        """Let it go.  With done it exits at once; without, it restores
        the defaults the daemon could not (one is started for that if
        none runs)."""
        if self.proc is None and not done:
            self.start()
        proc, w = self.proc, self.w
        if w is not None:
            try:
                if done:
                    os.write(w, b'done\n')
            except OSError:
                pass                    # it died meanwhile
        self._close()
        if done and proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # else the watchdog (its own session) goes on retrying the VMs that
        # did not answer; the daemon does not wait for it

    def status(self):
        with self.lock:
            alive = self.proc is not None
            state = ('running' if self.ready else 'error' if self.error
                     else 'starting' if alive else 'stopped')
            return dict(state=state, pid=self.proc.pid if alive else None,
                        restarts=self.restarts, error=self.error)


class Arbiter:
    def __init__(self, conf):
        self.conf = conf
        os.makedirs(conf.state_dir, mode=0o700, exist_ok=True)
        st = os.stat(conf.state_dir)
        if st.st_mode & 0o022:
            raise SystemExit(f'hvarbiter: {conf.state_dir} is writable by others; refusing')
        self.log = DecisionLog(conf.log, conf.log_max)
        self.devno = device_number(conf.device)
        self.model = Model.load(conf.model) if conf.model else None
        self.target_ms = conf.target_ms
        if self.target_ms is None:
            self.target_ms = self.model.auto_target_ms()
        self.gap = conf.gap or (self.model.gap() if self.model else 1.0)
        self.states = {v.name: policy.VMState(v) for v in conf.vms}
        self.links = {v.name: VMLink(v, conf.qmp_timeout, self.log) for v in conf.vms}
        self.used = {}              # vm -> last sample used
        self.cont_prev = {}         # container -> (t, ops, bytes, pressure_us)
        self.cont_err = {}
        self.accounting = {}        # container -> rule files we wrote
        self.cont_gen = {}          # podman container -> generation its figures are of
        self.cont_up = {}           # container -> its group read in the last period
        # the podman containers' groups, found and followed by a thread
        self.podman = PodmanWatch(conf, self.log) if any(c.podman for c in conf.containers) \
            else None
        self.idle_count = 0
        self.last_read = None       # when the last period read the containers (monotonic)
        self.burst_since = None     # a burst's start after an idle spell (monotonic), for a window
        self.periods = 0
        self.actions = {}
        self.snapshot = {}
        self.stop_ev = threading.Event()
        self.watchdog = Watchdog(conf.path, self.log)

    # -- life cycle --

    def run(self):
        self.probe = Probe(self.conf.device, self.conf.probe_iops,
                           self.conf.probe_window_ms / 1000)
        self.watchdog.start()
        self.probe.start()
        if self.podman:
            self.podman.start()
        for link in self.links.values():
            link.start()
        self.server = threading.Thread(target=self.serve, name='status', daemon=True)
        self.server.start()
        self.log(dict(event='start', pid=os.getpid(), target_ms=self.target_ms,
                      target_percentile=self.conf.target_pct,
                      gap=self.gap, period_ms=self.conf.period_ms,
                      vms=[v.name for v in self.conf.vms],
                      containers=[c.name for c in self.conf.containers]))
        period = self.conf.period_ms / 1000
        nxt = time.monotonic()
        while not self.stop_ev.is_set():
            self.watchdog.poll()
            self.period()
            nxt += period
            now = time.monotonic()
            if nxt < now:
                nxt = now
            self.stop_ev.wait(nxt - now)
        self.shutdown()

    def shutdown(self):
        for link in self.links.values():
            link.stop()
        self.probe.stop()
        if self.podman:
            self.podman.stop()
        for wrote in self.accounting.values():
            v1_disable_accounting(wrote, self.devno)
        res = restore_defaults(self.conf, self.conf.qmp_timeout, self.log)
        self.watchdog.stop(all(e is None for e in res.values()))
        self.log(dict(event='stop'))
        self.log.close()
        try:
            os.unlink(self.conf.socket)
        except OSError:
            pass

    # -- one period --

    def containers(self, now):
        ops = nbytes = 0
        stall = []
        up = {}
        for c in self.conf.containers:
            cgroup, pressure = c.cgroup, c.pressure
            up[c.name] = False
            if c.podman:
                found, gen, why = self.podman.get(c.name)
                if found is None:
                    # not there yet, stopped or removed: no I/O, reported
                    # (the podman thread logs each change of its state)
                    self.cont_err[c.name] = why
                    self.cont_prev.pop(c.name, None)
                    continue
                if self.cont_gen.get(c.name) != gen:
                    # found anew (a restart): a new group, counters from zero
                    self.cont_gen[c.name] = gen
                    self.cont_prev.pop(c.name, None)
                cgroup, pressure = found.cgroup, found.pressure
            try:
                if c.name not in self.cont_prev:
                    wrote = v1_enable_accounting(cgroup, self.devno)
                    if wrote:
                        self.accounting[c.name] = wrote
                        self.log(dict(event='accounting', container=c.name, rules=wrote))
                o, b = cgroup_io(cgroup, self.devno)
                p = io_pressure_us(pressure) if pressure else None
            except SourceError as e:
                if self.cont_err.get(c.name) != str(e):
                    self.log(dict(event='container-error', container=c.name, error=str(e)))
                self.cont_err[c.name] = str(e)
                self.cont_prev.pop(c.name, None)
                if c.podman:
                    self.podman.recheck(c.name)
                continue
            self.cont_err.pop(c.name, None)
            up[c.name] = True
            prev = self.cont_prev.get(c.name)
            self.cont_prev[c.name] = (now, o, b, p)
            if not prev:
                continue
            dt = now - prev[0]
            if dt <= 0:
                continue
            ops += max(0, o - prev[1]) * c.weight / dt
            nbytes += max(0, b - prev[2]) / dt
            if p is not None and prev[3] is not None:
                stall.append(max(0, p - prev[3]) / 1e6 / dt)
        self.cont_up = up
        cont = dict(iops=ops, bps=nbytes, pressure=max(stall) if stall else None)
        # A burst after an idle spell long enough for the VMs to be lifted
        # is judged on the worse of the window and the probe's samples
        # since the last period, until the window holds only the burst's:
        # the window of a second is the spell's then (the VMs alone on the
        # device), and where the VMs alone kept the probe under the target
        # the first cut waited for the burst to fill a tenth of it (the
        # 90th percentile): 100 ms of its samples at least, a period at
        # 100 ms, more while its latency was near the target.
        if not policy.containers_idle(cont, self.conf.idle_iops) and \
                self.idle_count >= policy.IDLE_PERIODS:
            self.burst_since = self.last_read
        elif self.burst_since is not None and \
                now - self.burst_since > self.conf.probe_window_ms / 1000:
            self.burst_since = None
        self.last_read = now
        pr = self.probe.window_stats(self.conf.target_pct)
        if self.burst_since is not None:
            new = self.probe.window_stats(self.conf.target_pct, since=self.burst_since)
            if new['pct_ms'] is not None and (pr['pct_ms'] is None
                                              or new['pct_ms'] > pr['pct_ms']):
                pr = new
        return dict(iops=ops, bps=nbytes, lat_ms=pr['pct_ms'], p50_ms=pr['p50_ms'],
                    p99_ms=pr['p99_ms'], probe_samples=pr['samples'],
                    probe_error=self.probe.error, pressure=cont['pressure'])

    def vms(self, now, seqs):
        """Each VM's rates since the sample used in its last period.  A
        sample is used once; one that answers an earlier period's request
        (it came after that period had decided) is marked late."""
        out = {}
        for name, link in self.links.items():
            s, seq = link.latest()
            prev = self.used.get(name)
            if s is None or now - s[0] > 3 * self.conf.period_ms / 1000:
                continue                    # stale: unreachable or hung
            self.used[name] = s
            if prev is None or s[0] <= prev[0] or s[1] < prev[1]:
                continue                    # first sample, or QEMU restarted
            dt = s[0] - prev[0]
            ops, nbytes = s[1] - prev[1], s[2] - prev[2]
            p99 = mean = None
            if s[3] is not None and prev[3] is not None:
                p99 = hist_percentile([max(0, a - b) for a, b in zip(s[3], prev[3])], 0.99)
            if s[4] is not None and prev[4] is not None and ops > 0:
                mean = max(0, s[4] - prev[4]) / ops / 1e6     # libvirt: total ns only
            out[name] = dict(iops=ops / dt, bps=nbytes / dt,
                             bytes_per_op=nbytes / ops if ops else None, p99_ms=p99,
                             mean_ms=mean)
            if seq != seqs[name]:
                out[name]['late'] = True
        return out

    def adopt(self, name, link):
        """A VM (re-)attached: go on from the limits it has, if a previous
        run left it throttled, rather than jump back to the default."""
        link.adopt = False
        st = self.states[name]
        cur = link.attached_limits or {}
        iops = cur.get('iops-total', 0) if isinstance(cur, dict) else 0
        if isinstance(iops, int) and iops > 0 and iops != st.conf.default_iops:
            st.limit = float(max(iops, st.conf.floor_iops))
            link.request_limits(st.limits())
            self.log(dict(event='adopt', vm=name, limit=st.limit))

    def period(self):
        seqs = {name: link.request_sample() for name, link in self.links.items()}
        # the links sample in parallel; this period's samples are waited
        # for (a VM that is not 'ok' is not) for a fraction of the period
        deadline = time.monotonic() + min(0.5, self.conf.period_ms / 2000)
        for name, link in self.links.items():
            link.wait_sample(seqs[name], deadline)
        for name, link in self.links.items():
            if link.adopt:
                self.adopt(name, link)
        now = time.monotonic()
        cont = self.containers(now)
        vm_in = self.vms(now, seqs)
        before = {n: st.limit for n, st in self.states.items()}
        action, ratio, self.idle_count, notes = policy.decide(
            self.states, vm_in, cont, self.target_ms, self.conf.target_pressure,
            self.conf.idle_iops, self.idle_count)
        self.periods += 1
        self.actions[action] = self.actions.get(action, 0) + 1
        for name, st in self.states.items():
            if name in vm_in and (st.limit != before[name] or self.links[name].want is None):
                self.links[name].request_limits(st.limits())
        work = policy.weighted_work(cont['bps'], sum(v['bps'] for v in vm_in.values()),
                                    self.gap)
        rec = dict(action=action, ratio=_r(ratio), container=_rd(cont), work=round(work, 1),
                   vms={n: dict(_rd(m), limit=_r(self.states[n].limit)) for n, m in vm_in.items()})
        if notes:
            rec['notes'] = notes
        self.log(rec)
        self.snapshot = dict(rec, periods=self.periods, target_ms=self.target_ms,
                             target_percentile=self.conf.target_pct,
                             gap=self.gap)
        if self.conf.metrics_file:
            self.write_metrics_file()

    # -- status and metrics --

    def status(self):
        s = dict(self.snapshot)
        s['vm_state'] = {n: dict(state=l.state, error=l.error, qdev=l.qdev,
                                 histogram=l.histogram, limits=l.applied,
                                 default=self.states[n].conf.default_limits())
                         for n, l in self.links.items()}
        s['container_errors'] = dict(self.cont_err)
        if self.podman:
            s['podman'] = self.podman.status()
            s['podman_events'] = self.podman.events.status()
        s['actions'] = dict(self.actions)
        s['probe'] = dict(policy=self.probe.policy, restarts=self.probe.restarts,
                          error=self.probe.error)
        s['watchdog'] = self.watchdog.status()
        return s

    def metrics(self):
        s = self.snapshot
        c = s.get('container', {})
        lines = []

        def g(name, help_, samples, kind='gauge'):
            lines.append(f'# HELP hvarbiter_{name} {help_}')
            lines.append(f'# TYPE hvarbiter_{name} {kind}')
            for labels, v in samples:
                if v is None:
                    continue
                lab = ','.join(f'{k}="{x}"' for k, x in labels.items())
                lines.append(f'hvarbiter_{name}{{{lab}}} {v:.9g}' if lab
                             else f'hvarbiter_{name} {v:.9g}')

        g('periods_total', 'Control periods run', [({}, self.periods)], 'counter')
        g('decisions_total', 'Decisions by action',
          [({'action': a}, n) for a, n in sorted(self.actions.items())], 'counter')
        q = f'{self.conf.target_pct / 100:g}'
        g('container_latency_seconds', 'Probe read latency on the device (container path)',
          [({'quantile': k}, c.get(f'{v}_ms') and c[f'{v}_ms'] / 1e3)
           for k, v in (('0.5', 'p50'), (q, 'lat'), ('0.99', 'p99')) if k != q or v == 'lat'])
        g('container_target_latency_seconds', 'Container latency target at target-percentile',
          [({'quantile': q}, self.target_ms / 1e3)])
        g('container_iops', 'Containers\' completed I/O per second', [({}, c.get('iops'))])
        g('container_up', 'The container\'s cgroup was read in the last period',
          [({'container': n}, 1 if up else 0) for n, up in sorted(self.cont_up.items())])
        g('container_io_pressure_ratio', 'Share of time some container task stalled on I/O',
          [({}, c.get('pressure'))])
        g('weighted_work', 'Container plus gap times VM I/O, in 4 KiB I/Os a second',
          [({}, s.get('work'))])
        vms = s.get('vms', {})
        g('vm_iops', 'VM disk I/O per second', [({'vm': n}, m.get('iops')) for n, m in vms.items()])
        g('vm_p99_seconds', 'VM disk p99 latency (QEMU histogram)',
          [({'vm': n}, m.get('p99_ms') and m['p99_ms'] / 1e3) for n, m in vms.items()])
        g('vm_mean_seconds', 'VM disk mean latency (libvirt: no histogram)',
          [({'vm': n}, m.get('mean_ms') and m['mean_ms'] / 1e3) for n, m in vms.items()])
        g('vm_limit_iops', 'IOPS limit set by the arbiter (0: the VM\'s default)',
          [({'vm': n}, st.limit or 0) for n, st in self.states.items()])
        g('vm_up', 'The arbiter reaches the VM',
          [({'vm': n}, 1 if l.state == 'ok' else 0) for n, l in self.links.items()])
        wd = self.watchdog.status()
        g('watchdog_up', 'The watchdog runs and has read the configuration',
          [({}, 1 if wd['state'] == 'running' else 0)])
        g('watchdog_restarts_total', 'Times the watchdog was started again after it died',
          [({}, wd['restarts'])], 'counter')
        return '\n'.join(lines) + '\n'

    def write_metrics_file(self):
        try:
            replace_file(self.conf.metrics_file, self.metrics())
        except OSError as e:
            self.log(dict(event='metrics-file-error', error=str(e)))

    def serve(self):
        path = self.conf.socket
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            srv.bind(path)
        finally:
            os.umask(old)
        srv.listen(8)
        srv.settimeout(0.5)
        while not self.stop_ev.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            with conn:
                conn.settimeout(1.0)
                try:
                    req = b''
                    while b'\n' not in req and len(req) <= STATUS_MAX_REQUEST:
                        d = conn.recv(STATUS_MAX_REQUEST + 1)
                        if not d:
                            break
                        req += d
                    cmd = req.split(b'\n')[0].strip().decode('ascii', 'replace')
                    if len(req) > STATUS_MAX_REQUEST:
                        out = 'error: request too long\n'
                    elif cmd == 'status':
                        out = json.dumps(self.status(), indent=1) + '\n'
                    elif cmd == 'metrics':
                        out = self.metrics()
                    else:
                        out = 'error: unknown request (status, metrics)\n'
                    conn.sendall(out.encode())
                    # the reply before the close: unread input would make
                    # the close a reset that can overtake it
                    conn.shutdown(socket.SHUT_WR)
                    for _ in range(16):
                        if not conn.recv(65536):
                            break
                except OSError:
                    pass
        srv.close()


def _r(x, nd=2):
    return None if x is None else round(x, nd)


def _rd(d):
    return {k: (_r(v) if isinstance(v, float) else v) for k, v in d.items()}


def run(conf):
    a = Arbiter(conf)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: a.stop_ev.set())
    a.run()
