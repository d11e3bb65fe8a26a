"""One VM as the arbiter sees it: a thread that owns the VM's link (a QMP
monitor of the arbiter's own, or libvirt), samples the watched disk's
counters and latency when asked, and applies the limits the control loop
wants.  A VM that hangs, goes away or answers garbage only stalls its own
thread: whatever a step raises is that VM's error (its state says which,
its figures are dropped, its link is made again with a back-off), never
the thread's end; the loop leaves a VM that is not 'ok' out.
"""

import threading
import time
import traceback

from .qmp import (QMP, LinkCommandError, LinkError, LinkProtocolError, QMPCommandError,
                  QMPError, QMPProtocolError)
from .sources import HIST_NS, ShapeError, SourceError, vm_disk_sample

BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0
THROTTLE_VALUE_MAX = 10 ** 15   # QEMU's bound on a throttle limit
MAX_ERROR = 500                 # characters of an error kept and shown


def group_path(group):
    return f'/objects/{group}'


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

    def _ask(self, name, parse, **args):
        """parse(what the command returns); a return parse finds not of
        the shape QEMU gives (ShapeError) drops the link."""
        ret = self.qmp.cmd(name, **args)
        try:
            return parse(ret)
        except ShapeError as e:
            self.qmp.close()
            raise QMPProtocolError(f'{self.conf.qmp}: {name}: malformed reply: {e}') from None

    def attach(self, log):
        """Check the throttle group, find the disk, set its histogram.
        Returns (disk, its current limits, whether it has a histogram)."""
        try:
            cur = self._ask('qom-get', throttle_limits, path=group_path(self.conf.group),
                            property='limits')
        except QMPCommandError as e:
            raise QMPError(f'{self.conf.qmp}: throttle group {self.conf.group!r}: {e.desc}') \
                from None
        qdev = self._ask('query-blockstats', lambda r: vm_disk_sample(r, self.conf.device)[0])
        try:
            self._ask('block-latency-histogram-set', empty, id=qdev, boundaries=HIST_NS)
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
        _, ops, nbytes, bins = self._ask('query-blockstats', lambda r: vm_disk_sample(r, disk))
        return ops, nbytes, bins, None

    def set_limits(self, limits):
        """Set the throttle group's limits (unset keys: no limit).  QEMU
        takes the whole ThrottleLimits; a 0 means "no limit" for every key."""
        self._ask('qom-set', empty, path=group_path(self.conf.group), property='limits',
                  value={k: int(v) for k, v in limits.items()})


def empty(ret):
    """What qom-set and block-latency-histogram-set return: an object."""
    if not isinstance(ret, dict):
        raise ShapeError(f'the return is a {type(ret).__name__}, not an object')


def throttle_limits(ret):
    """The limits the arbiter drives, from a throttle group's ThrottleLimits
    (qom-get ... limits: QEMU gives every member)."""
    if not isinstance(ret, dict):
        raise ShapeError(f'the limits are a {type(ret).__name__}, not an object')
    out = {}
    for k in ('iops-total', 'bps-total'):
        v = ret.get(k)
        if type(v) is not int or not 0 <= v <= THROTTLE_VALUE_MAX:
            raise ShapeError(f'{k} is not an integer in [0, {THROTTLE_VALUE_MAX}]')
        out[k] = v
    return out


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
        except Exception as e:      # a bug: this VM's error, not the caller's end
            done[vm.name] = f'internal error: {type(e).__name__}: {e}'[:MAX_ERROR]
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
            except LinkProtocolError as e:
                self._failed(str(e), 'error')
            except LinkError as e:
                why = str(e)
                self._failed(why, 'absent' if 'cannot connect' in why else 'unresponsive')
            except SourceError as e:
                self._refused(str(e))
            except Exception as e:          # what no check foresaw: this VM's error only
                self.log(dict(event='vm-bug', vm=self.conf.name,
                              traceback=traceback.format_exc(limit=8)[-4000:]))
                self._failed(f'internal error: {type(e).__name__}: {e}', 'error')

    def _refused(self, why):
        """The VM answered, with an error or with figures that lack the
        disk.  The link stays, unless the attach itself failed: then it is
        made again later (the disk may be plugged in meanwhile)."""
        why = why[:MAX_ERROR]
        if self.state != 'error':
            self.log(dict(event='vm-error', vm=self.conf.name, error=why))
        self._set_state('error', why)
        if self.qdev is None:
            self.link.close()
            self.next_try = time.monotonic() + self.backoff
            self.backoff = min(BACKOFF_MAX, self.backoff * 2)

    def _failed(self, why, state):
        """The link is dropped and made again after the back-off."""
        why = why[:MAX_ERROR]
        was = self.state
        self.link.close()
        self._set_state(state, why)
        self.next_try = time.monotonic() + self.backoff
        self.backoff = min(BACKOFF_MAX, self.backoff * 2)
        self.applied = None         # re-apply after reconnecting
        if was != self.state:
            self.log(dict(event='vm-' + self.state, vm=self.conf.name, error=why))

    def _step(self):
        """Connect if due, sample if asked, apply the limits wanted.  The
        sample is published with the state 'ok' once the whole step has
        gone through: a VM in error gives the loop no figures."""
        if not self.link.connected:
            if time.monotonic() < self.next_try:
                return
            self.link.connect()
            self._attach()
        with self.lock:
            due = self.seq
        sample = None
        if due != self.sample_seq:
            # the request is answered once the figures are in, never before:
            # the loop waits for them (the period's own, not the last one's)
            ops, nbytes, bins, lat_ns = self.link.sample(self.qdev)
            sample = (time.monotonic(), ops, nbytes, bins, lat_ns)
        with self.lock:
            want = self.want
        if want is not None and want != self.applied:
            self.link.set_limits(want)
            self.applied = want
        if self.state != 'ok':
            self.log(dict(event='vm-ok', vm=self.conf.name, qdev=self.qdev,
                          histogram=self.histogram))
        self.backoff = BACKOFF_MIN      # only once a whole step went through
        self._set_state('ok', None, sample, due)

    def _set_state(self, state, error, sample=None, seq=None):
        """The state, and with 'ok' the step's sample, if any; any other
        state drops the last sample."""
        with self.sampled:
            self.state, self.error = state, error
            if state != 'ok':
                self.sample = None
            elif sample is not None:
                self.sample, self.sample_seq = sample, seq
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
