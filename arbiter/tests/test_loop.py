"""The daemon's period against VMs whose figures change every period: each
decision is made on the VM's sample of its own period, not on the one
before.  The VMs are FakeQMP peers and the probe a stand-in (inproc.py):
a real QEMU's figures cannot be made to change at the moment a period
starts, and the lag this guards against is one period long."""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inproc import InProcess   # noqa: E402
from arbiter import policy     # noqa: E402

# histogram bins: (750 us, 1 ms] and (200 ms, 500 ms]
FAST_BIN, SLOW_BIN = 6, 20


class LoopTest(unittest.TestCase):
    def setUp(self):
        self.p = InProcess(extra_vm='slo-p99-ms = 50\n')
        self.addCleanup(self.p.close)
        self.peer = self.p.peers['vm0']
        # the attach and a first sample (no previous one: no rates yet)
        for _ in range(20):
            self.p.container_io(1000)
            self.p.arb.period()
            if self.p.arb.links['vm0'].state == 'ok' and self.peer.histogram:
                break
        self.assertEqual(self.p.arb.links['vm0'].state, 'ok')

    def test_decision_uses_this_periods_sample(self):
        """Period N's VM figures are new each period (mean request size
        4 KiB x N; every request of an odd period slow, over the VM's 50 ms
        SLO, of an even one fast), and the peer takes 50 ms to answer: the
        inputs logged with period N's decision are period N's, and so is
        the decision on the VM (an odd period spares it for its SLO, an
        even one cuts it: the containers are over their target)."""
        self.peer.delay = 0.05
        self.p.arb.period()             # the previous sample, taken with no I/O
        for n in range(1, 9):
            self.peer.add(100, 100 * 4096 * n, SLOW_BIN if n % 2 else FAST_BIN)
            self.p.container_io(1000)
            self.p.arb.period()
            rec = self.p.decisions()[-1]
            self.assertEqual(rec['action'], 'cut', rec)
            vm = rec['vms'].get('vm0')
            self.assertIsNotNone(vm, f'period {n}: no VM figures: {rec}')
            self.assertEqual(vm['bytes_per_op'], 4096 * n, f'period {n}: {rec}')
            note = rec.get('notes', {}).get('vm0', '')
            if n % 2:
                self.assertGreater(vm['p99_ms'], 200, f'period {n}: {rec}')
                self.assertTrue(note.startswith('over its SLO'), f'period {n}: {rec}')
            else:
                self.assertLessEqual(vm['p99_ms'], 1.0, f'period {n}: {rec}')
                self.assertFalse(note.startswith('over its SLO'), f'period {n}: {rec}')

    def test_a_late_sample_counts_next_period_marked_late(self):
        """A VM slower than the wait (half the period, at most 0.5 s) is
        left out of the period; its sample counts in the next one, marked
        late in the decision's inputs."""
        self.peer.delay = 0.7
        self.peer.add(100, 100 * 8192, FAST_BIN)
        self.p.container_io(1000)
        self.p.arb.period()
        self.assertNotIn('vm0', self.p.decisions()[-1]['vms'])
        self.p.container_io(1000)
        self.p.arb.period()
        vm = self.p.decisions()[-1]['vms'].get('vm0')
        self.assertIsNotNone(vm, self.p.decisions()[-1])
        self.assertEqual(vm['bytes_per_op'], 8192)
        self.assertIs(vm.get('late'), True)



class BurstTest(unittest.TestCase):
    """A container's burst after an idle spell (the VMs lifted to their
    default) is judged on the worse of the probe's window and its samples
    since the burst began: the window of a second is then mostly the idle
    spell's, with the VMs alone on the device, and where they kept the
    probe under the target a cut waited for the burst to fill a tenth of
    it (the 90th percentile): a period at least at 100 ms, more while the
    burst's latency was near the target.  A pause shorter than the lift
    does not count as a burst."""

    def setUp(self):
        self.p = InProcess(period_ms=1000, target_ms=5.0)
        self.addCleanup(self.p.close)
        self.peer = self.p.peers['vm0']
        self.probe = self.p.arb.probe
        for _ in range(20):
            self.period(0)
            if self.p.arb.links['vm0'].state == 'ok':
                break
        self.assertEqual(self.p.arb.links['vm0'].state, 'ok')

    def period(self, ctr_ops):
        """One period: the VM streams, the containers do ctr_ops I/Os;
        returns its decision and when it began and ended."""
        self.peer.add(100, 100 << 20)
        self.p.container_io(ctr_ops)
        t0 = time.monotonic()
        self.p.arb.period()
        return self.p.decisions()[-1], t0, time.monotonic()

    def window(self, start, before, old_ms, after, new_ms, n_new=15):
        """The probe's window: 200 samples at old_ms from start up to
        before, then n_new at new_ms after after."""
        self.probe.samples = [(start + (before - start) * i / 200, old_ms / 1e3)
                              for i in range(200)] + \
            [(after + (i + 1) / 1000, new_ms / 1e3) for i in range(n_new)]
        time.sleep((n_new + 2) / 1000)

    def test_burst_after_idle_is_cut_in_its_first_period(self):
        """The VMs alone: the probe at 2 ms (target 5 ms), the containers
        idle until the VMs are lifted.  The burst's first period: 15 samples
        at 20 ms, against 200 of the idle spell in the window: cut."""
        self.probe.samples = []
        for _ in range(policy.IDLE_PERIODS + 1):
            rec, t0, t1 = self.period(0)
        self.assertIn(rec['action'], ('idle', 'lift'), rec)
        self.window(t0 - 1, t0, 2.0, t1, 20.0)
        rec, _, _ = self.period(2000)
        self.assertEqual(rec['action'], 'cut', rec)
        self.assertEqual(rec['container']['probe_samples'], 15, rec)
        self.assertEqual(rec['container']['lat_ms'], 20.0, rec)
        # the next period's window still starts at the burst
        rec, _, _ = self.period(2000)
        self.assertEqual(rec['action'], 'cut', rec)
        self.assertEqual(rec['container']['probe_samples'], 15, rec)

    def test_burst_after_idle_is_judged_on_the_worse(self):
        """The VMs alone put the probe at 20 ms, over the target, while the
        containers idle; the burst's first samples are at 2 ms: the
        decision is the worse figure, the window's, a cut (as it was
        before bursts were judged on their own samples)."""
        self.probe.samples = []
        for _ in range(policy.IDLE_PERIODS + 1):
            rec, t0, t1 = self.period(0)
        self.assertIn(rec['action'], ('idle', 'lift'), rec)
        self.window(t0 - 1, t0, 20.0, t1, 2.0)
        rec, _, _ = self.period(2000)
        self.assertEqual(rec['action'], 'cut', rec)
        self.assertEqual(rec['container']['probe_samples'], 215, rec)
        self.assertEqual(rec['container']['lat_ms'], 20.0, rec)

    def test_short_pause_keeps_the_window(self):
        """Contended (the window's p90 over the target), a period without
        container I/O (fewer than the lift's), then I/O again with the
        last period's samples under the target: the decision is the whole
        window's, a cut."""
        self.probe.samples = []
        _, _, busy = self.period(2000)       # (a burst, if setUp's periods were a spell)
        rec, t0, t1 = self.period(0)
        self.assertEqual(rec['action'], 'idle', rec)
        self.window(busy, t0, 20.0, t1, 2.0)
        rec, _, _ = self.period(2000)
        self.assertEqual(rec['action'], 'cut', rec)
        self.assertEqual(rec['container']['probe_samples'], 215, rec)


if __name__ == '__main__':
    unittest.main()
