"""The contention scenario of the design, with real parts (used by
test_guest_arbiter.py and bench/arbiter.py): one loop device with direct
I/O; a TCG guest whose virtio-blk disk is that device behind throttle group
tg0, streaming 1 MiB O_DIRECT reads (a VM doing a backup or a scan); a
podman container running fio, 4 KiB random reads at QD4 on the same
device; the arbiter finds the container by its podman name.  Each phase measures the container with
fio's own figures and the VM from QEMU's blockstats over the same window.
"""

import os
import subprocess
import sys
import time

import arblib as A

from arbiter.sources import hist_percentile   # noqa: E402

MB = 1000 * 1000


def vm_rates(a, b):
    dt = b[0] - a[0]
    p99 = None
    if a[3] is not None and b[3] is not None:
        p99 = hist_percentile([y - x for x, y in zip(a[3], b[3])], 0.99)
    return dict(iops=(b[1] - a[1]) / dt, bps=(b[2] - a[2]) / dt, p99_ms=p99)


class Scenario:
    def __init__(self, tmp, size_mib=256, secs=4):
        self.tmp, self.secs = tmp, secs
        self.loop = A.Loop(tmp.path, size_mib)
        self.vm = None
        try:
            self.vm = A.GuestVM(tmp, self.loop.dev)
        except BaseException:
            self.loop.close()
            raise
        self.daemon = None
        self.runs = 0               # daemons started: each its own state directory
        self.ctr = f'arb-{os.getpid()}'
        self.fio = None

    def close(self):
        if self.fio:
            self.fio.stop()
        if self.daemon:
            self.daemon.close()
        if self.vm:
            self.vm.close()
        self.loop.close()

    def phase(self, name, container=True, vm=True, settle=0.0, run_args=()):
        """Run one phase; returns dict(container=fio figures or None,
        vm=rates or None).  run_args go to the container's podman run."""
        (self.vm.start_load if vm else self.vm.stop_load)()
        p = None
        if container:
            # with the container running through the settling time (the
            # arbiter acts on it), which fio leaves out of its figures
            p = self.fio = A.container(self.tmp, self.ctr, self.loop.dev, self.secs,
                                       run_args=run_args, ramp=settle)
        time.sleep(settle or (0.5 if vm else 0))
        self.vm.histogram()
        a = self.vm.sample()
        c = None
        if p:
            c = p.result(timeout=self.secs + settle + 120)
            self.fio = None
        else:
            time.sleep(self.secs)
        b = self.vm.sample()
        v = vm_rates(a, b) if vm else None
        return dict(phase=name, container=c, vm=v)

    def solo_with_probe(self, name='container solo'):
        """The container alone, with the arbiter watching (VMs idle, so it
        does nothing): the phase's figures and the median over its periods
        of the probe's latency at the target percentile, the scale the
        arbiter's target is set in."""
        d = self.start_arbiter(10000.0)
        try:
            r = self.phase(name, vm=False)
            lat = sorted(x['container']['lat_ms'] for x in d.records()
                         if x.get('action') and x['container'].get('lat_ms') is not None
                         and x['container'].get('iops', 0) > 0)
        finally:
            self.stop_arbiter()
        r['probe_ms'] = lat[len(lat) // 2] if lat else None
        return r

    def probe_baseline(self, *solos):
        """The probe's solo latency over several container-solo phases:
        the least of their medians.  The host's noise only ever adds to a
        latency, and it comes in spells that can cover a whole phase (one
        phase's median p90 0.47 ms where the phases around it gave 0.19-0.21
        ms, with fio's own p99 unchanged): a spell in one phase must not
        hand the arbiter a lax target."""
        got = [s['probe_ms'] for s in solos if s.get('probe_ms') is not None]
        return min(got) if got else None

    def start_arbiter(self, target_ms, gap=1.0, period_ms=100):
        """A daemon with a state directory (and decision log) of its own:
        a later phase's records (solo_with_probe's median) are never mixed
        with an earlier one's."""
        self.runs += 1
        state = f'state{self.runs}'
        conf = A.config(self.tmp, self.loop.dev, [('vm0', self.vm.qmp_path)], [self.ctr],
                        target_ms=target_ms, period_ms=period_ms, state=state,
                        extra_device=f'gap = {gap}\n', extra_vm='device = disk0\n')
        self.daemon = A.Daemon(conf, self.tmp, state=state)
        return self.daemon

    def stop_arbiter(self):
        rc = self.daemon.terminate()
        self.daemon.close()
        self.daemon = None
        return rc


def work(r, gap):
    c = r['container']['iops'] * 4096 if r['container'] else 0
    v = r['vm']['bps'] if r['vm'] else 0
    return (c + gap * v) / 4096


def run_cmd(*args):
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout
