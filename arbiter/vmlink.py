"""One VM as the arbiter sees it: a thread that owns the VM's link (a QMP
monitor of the arbiter's own, or libvirt), samples the watched disk's
counters and latency when asked, and applies the limits the control loop
wants.  A VM that hangs, goes away or answers garbage only stalls its own
thread; the loop sees its sample go stale and leaves it out.
"""

import threading
import time

from .qmp import QMP, LinkCommandError, LinkError, QMPCommandError, QMPError
from .sources import HIST_NS, SourceError, vm_disk_sample

BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0


def group_path(group):
    return f'/objects/{group}'


def set_limits(qmp, group, limits):
    """Set a throttle group's limits (unset keys: no limit).  QEMU takes
    the whole ThrottleLimits; a 0 means "no limit" for every key."""
    qmp.cmd('qom-set', path=group_path(group), property='limits',
            value={k: int(v) for k, v in limits.items()})


class QMPLink:
    """A VM reached through a QMP monitor of the arbiter's own: the limits
    are its throttle group object's, the figures query-blockstats' with a
    latency histogram the arbiter sets on the disk."""

    def __init__(self, conf, timeout):
        self.conf = conf
        self.qmp = QMP(conf.qmp, timeout)
        self.timeout = timeout

    @property
    def connected(self):
        return self.qmp.connected

    def connect(self):
        self.qmp.connect()

    def close(self):
        self.qmp.close()

    def attach(self, log):
        """Check the throttle group, find the disk, set its histogram.
        Returns (disk, its current limits, whether it has a histogram)."""
        try:
            cur = self.qmp.cmd('qom-get', path=group_path(self.conf.group), property='limits')
        except QMPCommandError as e:
            raise QMPError(f'{self.conf.qmp}: throttle group {self.conf.group!r}: {e.desc}') \
                from None
        qdev = vm_disk_sample(self.qmp.cmd('query-blockstats'), self.conf.device)[0]
        try:
            self.qmp.cmd('block-latency-histogram-set', id=qdev, boundaries=HIST_NS)
            histogram = True
        except QMPCommandError as e:
            # a disk with no guest device (a storage daemon's export): no
            # histogram, IOPS only
            histogram = False
            log(dict(event='no-histogram', vm=self.conf.name, error=e.desc))
        return qdev, cur, histogram

    def sample(self, disk):
        """(operations, bytes, histogram bins or None, total latency in ns
        or None) of the disk so far."""
        _, ops, nbytes, bins = vm_disk_sample(self.qmp.cmd('query-blockstats'), disk)
        return ops, nbytes, bins, None

    def set_limits(self, limits):
        set_limits(self.qmp, self.conf.group, limits)


def open_link(conf, timeout):
    """The link a VM's configuration names (not connected yet)."""
    if conf.libvirt:
        from .libvirtlink import LibvirtLink
        return LibvirtLink(conf, timeout)
    return QMPLink(conf, timeout)


def restore_defaults(conf, timeout, log=None):
    """Connect to every VM and put its default limits back (the watchdog
    and a clean exit), all VMs at once: one that hangs (a QMP socket is
    bounded by the timeout, but a libvirt connection being opened is not)
    holds back no other.  Returns {vm: error or None}."""
    done = {}                   # a late thread writes here, never into out

    def one(vm):
        link = open_link(vm, timeout)
        try:
            link.connect()
            link.set_limits(vm.default_limits())
            done[vm.name] = None
        except LinkError as e:
            done[vm.name] = str(e)
        finally:
            link.close()

    threads = [threading.Thread(target=one, args=(vm,), daemon=True) for vm in conf.vms]
    for t in threads:
        t.start()
    wait = 3 * timeout + 2
    deadline = time.monotonic() + wait
    out = {}
    for vm, t in zip(conf.vms, threads):
        t.join(max(0.0, deadline - time.monotonic()))
        out[vm.name] = f'no answer within {wait:g} s' if t.is_alive() else done[vm.name]
        if log:
            log(dict(event='restore-default', vm=vm.name, limits=vm.default_limits(),
                     error=out[vm.name]))
    return out


class VMLink(threading.Thread):
    def __init__(self, conf, timeout, log):
        super().__init__(name=f'vm-{conf.name}', daemon=True)
        self.conf = conf
        self.link = open_link(conf, timeout)
        self.log = log
        # protects want and the sample with its sequence; sampled is
        # notified when a sample comes in or the state leaves 'ok'
        self.lock = threading.Lock()
        self.sampled = threading.Condition(self.lock)
        self.wake = threading.Event()
        self.stop_ev = threading.Event()
        self.seq = 0                # the loop's last request for a sample
        self.sample = None          # (monotonic, ops, bytes, bins or None, ns or None)
        self.sample_seq = 0         # the request that sample answers
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
        """Ask for a sample; returns the request's number, for
        wait_sample() and latest()."""
        with self.lock:
            self.seq += 1
            seq = self.seq
        self.wake.set()
        return seq

    def wait_sample(self, seq, deadline):
        """Wait until the sample answering request seq is in, the link
        leaves 'ok' or the monotonic deadline passes; True if it is in."""
        with self.sampled:
            while self.sample_seq < seq and self.state == 'ok':
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.sampled.wait(left)
            return self.sample_seq >= seq

    def latest(self):
        """The last sample (None if none since the VM was attached) and
        the number of the request it answers."""
        with self.lock:
            return self.sample, self.sample_seq

    def request_limits(self, limits):
        with self.lock:
            self.want = dict(limits)
        self.wake.set()

    def stop(self):
        self.stop_ev.set()
        self.wake.set()
        self.join(timeout=self.link.timeout + 1)
        self.link.close()

    # the thread
    def run(self):
        while not self.stop_ev.is_set():
            self.wake.wait()
            self.wake.clear()
            if self.stop_ev.is_set():
                break
            try:
                self._step()
            except LinkCommandError as e:
                self._refused(str(e))
                with self.lock:
                    if self.want is not None:
                        self.applied = self.want    # not again every period
            except LinkError as e:
                self._failed(str(e))
            except SourceError as e:
                self._refused(str(e))

    def _refused(self, why):
        """The VM answered, with an error or with figures that lack the
        disk.  The link stays, unless the attach itself failed: then it is
        made again later (the disk may be plugged in meanwhile)."""
        if self.state != 'error':
            self.log(dict(event='vm-error', vm=self.conf.name, error=why))
        self._set_state('error', why)
        if self.qdev is None:
            self.link.close()
            self.next_try = time.monotonic() + self.backoff
            self.backoff = min(BACKOFF_MAX, self.backoff * 2)

    def _failed(self, why):
        was = self.state
        self.link.close()
        self._set_state('absent' if 'cannot connect' in why else 'unresponsive', why)
        self.next_try = time.monotonic() + self.backoff
        self.backoff = min(BACKOFF_MAX, self.backoff * 2)
        self.applied = None         # re-apply after reconnecting
        if was != self.state:
            self.log(dict(event='vm-' + self.state, vm=self.conf.name, error=why))

    def _step(self):
        if not self.link.connected:
            if time.monotonic() < self.next_try:
                return
            self.link.connect()
            self._attach()
            self.backoff = BACKOFF_MIN
        with self.lock:
            due = self.seq
        if due != self.sample_seq:
            # the request is answered once the figures are in, never before:
            # the loop waits for them (the period's own, not the last one's)
            ops, nbytes, bins, lat_ns = self.link.sample(self.qdev)
            with self.sampled:
                self.sample = (time.monotonic(), ops, nbytes, bins, lat_ns)
                self.sample_seq = due
                self.sampled.notify_all()
        with self.lock:
            want = self.want
        if want is not None and want != self.applied:
            self.link.set_limits(want)
            self.applied = want
        if self.state != 'ok':
            self.log(dict(event='vm-ok', vm=self.conf.name, qdev=self.qdev,
                          histogram=self.histogram))
        self._set_state('ok', None)

    def _set_state(self, state, error):
        with self.sampled:
            self.state, self.error = state, error
            self.sampled.notify_all()        # a loop waiting for a sample stops

    def _attach(self):
        """Find the disk and its limits.  On a re-attach the limits found
        are logged (a previous run's or the watchdog's) and kept until the
        loop decides."""
        self.qdev = None
        qdev, cur, self.histogram = self.link.attach(self.log)
        self.attached_limits = cur
        self.adopt = True           # the loop takes these over (a re-attach)
        with self.lock:
            self.sample = None
        self.qdev = qdev
        self.log(dict(event='attach', vm=self.conf.name, qdev=self.qdev, limits=cur))
