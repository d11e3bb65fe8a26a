"""One VM as the arbiter sees it: a thread that owns the VM's QMP
connection, samples the watched disk's counters and latency histogram when
asked, and applies the throttle group limits the control loop wants.  A VM
that hangs, goes away or answers garbage only stalls its own thread; the
loop sees its sample go stale and leaves it out.
"""

import threading
import time

from .qmp import QMP, QMPCommandError, QMPError
from .sources import HIST_NS, SourceError, vm_disk_sample

BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0


def group_path(group):
    return f'/objects/{group}'


def set_limits(qmp, group, limits):
    """Set a throttle group's limits (unset keys: no limit).  QEMU takes
    the whole ThrottleLimits; a 0 means "no limit" for every key."""
    qmp.cmd('qom-set', path=group_path(group), property='limits',
            value={k: int(v) for k, v in limits.items()})


def restore_defaults(conf, timeout, log=None):
    """Connect to every VM and put its default limits back (the watchdog
    and a clean exit).  Returns {vm: error or None}."""
    out = {}
    for vm in conf.vms:
        q = QMP(vm.qmp, timeout)
        try:
            q.connect()
            set_limits(q, vm.group, vm.default_limits())
            out[vm.name] = None
        except QMPError as e:
            out[vm.name] = str(e)
        finally:
            q.close()
        if log:
            log(dict(event='restore-default', vm=vm.name, limits=vm.default_limits(),
                     error=out[vm.name]))
    return out


class VMLink(threading.Thread):
    def __init__(self, conf, timeout, log):
        super().__init__(name=f'vm-{conf.name}', daemon=True)
        self.conf = conf
        self.qmp = QMP(conf.qmp, timeout)
        self.log = log
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stop_ev = threading.Event()
        self.sample_due = False
        self.sample = None          # (monotonic, ops, bytes, bins or None)
        self.want = None            # limits dict the loop wants
        self.applied = None
        self.state = 'connecting'
        self.error = None
        self.qdev = None
        self.histogram = False
        self.attached_limits = None
        self.adopt = False
        self.backoff = BACKOFF_MIN
        self.next_try = 0.0

    # called by the control loop
    def request_sample(self):
        self.sample_due = True
        self.wake.set()

    def request_limits(self, limits):
        with self.lock:
            self.want = dict(limits)
        self.wake.set()

    def stop(self):
        self.stop_ev.set()
        self.wake.set()
        self.join(timeout=self.qmp.timeout + 1)
        self.qmp.close()

    # the thread
    def run(self):
        while not self.stop_ev.is_set():
            self.wake.wait()
            self.wake.clear()
            if self.stop_ev.is_set():
                break
            try:
                self._step()
            except QMPCommandError as e:
                if self.state != 'error':
                    self.log(dict(event='vm-error', vm=self.conf.name, error=str(e)))
                self.state, self.error = 'error', str(e)
                with self.lock:
                    if self.want is not None:
                        self.applied = self.want    # not again every period
            except QMPError as e:
                self._failed(str(e))
            except SourceError as e:
                if self.state != 'error':
                    self.log(dict(event='vm-error', vm=self.conf.name, error=str(e)))
                self.state, self.error = 'error', str(e)
                if self.qdev is None:       # attach again, later
                    self.qmp.close()
                    self.next_try = time.monotonic() + self.backoff
                    self.backoff = min(BACKOFF_MAX, self.backoff * 2)

    def _failed(self, why):
        was = self.state
        self.qmp.close()
        self.state = 'absent' if 'cannot connect' in why else 'unresponsive'
        self.error = why
        self.next_try = time.monotonic() + self.backoff
        self.backoff = min(BACKOFF_MAX, self.backoff * 2)
        self.applied = None         # re-apply after reconnecting
        if was != self.state:
            self.log(dict(event='vm-' + self.state, vm=self.conf.name, error=why))

    def _step(self):
        if not self.qmp.connected:
            if time.monotonic() < self.next_try:
                return
            self.qmp.connect()
            self._attach()
            self.backoff = BACKOFF_MIN
        if self.sample_due:
            self.sample_due = False
            st = self.qmp.cmd('query-blockstats')
            qdev, ops, nbytes, bins = vm_disk_sample(st, self.qdev or self.conf.device)
            self.sample = (time.monotonic(), ops, nbytes, bins)
        with self.lock:
            want = self.want
        if want is not None and want != self.applied:
            set_limits(self.qmp, self.conf.group, want)
            self.applied = want
        if self.state != 'ok':
            self.log(dict(event='vm-ok', vm=self.conf.name, qdev=self.qdev,
                          histogram=self.histogram))
        self.state, self.error = 'ok', None

    def _attach(self):
        """Check the throttle group, find the disk, set its histogram.  On a
        re-attach the limits found are logged (a previous run's or the
        watchdog's) and kept until the loop decides."""
        try:
            cur = self.qmp.cmd('qom-get', path=group_path(self.conf.group), property='limits')
        except QMPCommandError as e:
            raise QMPError(f'{self.conf.qmp}: throttle group {self.conf.group!r}: {e.desc}') \
                from None
        self.attached_limits = cur
        self.adopt = True           # the loop takes these over (a re-attach)
        stats = self.qmp.cmd('query-blockstats')
        self.qdev = vm_disk_sample(stats, self.conf.device)[0]
        self.sample = None
        try:
            self.qmp.cmd('block-latency-histogram-set', id=self.qdev, boundaries=HIST_NS)
            self.histogram = True
        except QMPCommandError as e:
            # a disk with no guest device (a storage daemon's export): no
            # histogram, IOPS only
            self.histogram = False
            self.log(dict(event='no-histogram', vm=self.conf.name, error=e.desc))
        self.log(dict(event='attach', vm=self.conf.name, qdev=self.qdev, limits=cur))
