"""The daemon's period against VMs whose figures change every period: each
decision is made on the VM's sample of its own period, not on the one
before.  The VMs are FakeQMP peers and the probe a stand-in (inproc.py):
a real QEMU's figures cannot be made to change at the moment a period
starts, and the lag this guards against is one period long."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inproc import InProcess   # noqa: E402

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


if __name__ == '__main__':
    unittest.main()
