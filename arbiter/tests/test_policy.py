"""The control law on its own (policy.decide): steps scaled and clamped to
1-16 %, the hysteresis band, the floor, the default, the lift when the
containers go idle, the stall share (io.pressure) as an input, and a VM's
own SLO."""

import os
import sys
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from arbiter import policy   # noqa: E402


def vmconf(default_iops=0, floor_iops=10, slo=50.0):
    return types.SimpleNamespace(default_iops=default_iops, default_bps=0, floor_iops=floor_iops,
                                 floor_bps=2 << 20, slo_p99_ms=slo,
                                 default_limits=lambda: {'iops-total': default_iops,
                                                         'bps-total': 0})


class PolicyTest(unittest.TestCase):
    def setUp(self):
        self.st = {'a': policy.VMState(vmconf()), 'b': policy.VMState(vmconf(default_iops=4000))}
        self.idle = 0

    def step(self, cont_p99, cont_iops=1000, vm_iops=None, vm_p99=None, target=2.0,
             vm_mean=None, pressure=None, target_pressure=0):
        vm_iops = vm_iops or {'a': 3000, 'b': 3000}
        vm_in = {n: dict(iops=i, bytes_per_op=4096, p99_ms=(vm_p99 or {}).get(n),
                         mean_ms=(vm_mean or {}).get(n))
                 for n, i in vm_iops.items()}
        action, r, self.idle, notes = policy.decide(
            self.st, vm_in, dict(iops=cont_iops, lat_ms=cont_p99, pressure=pressure),
            target, target_pressure, 20, self.idle)
        return action, r, notes

    def test_cut_is_scaled_and_clamped(self):
        a, r, _ = self.step(2.2)            # 10 % over: 5 % step
        self.assertEqual(a, 'cut')
        self.assertAlmostEqual(r, 1.1)
        self.assertAlmostEqual(self.st['a'].limit, 3000 * 0.95)
        self.step(20.0)                     # far over: 16 % at most
        self.assertAlmostEqual(self.st['a'].limit, 3000 * 0.95 * 0.84)
        self.step(2.001)                    # just over: 1 % at least
        self.assertAlmostEqual(self.st['a'].limit, 3000 * 0.95 * 0.84 * 0.99)

    def test_hysteresis_band_holds(self):
        self.step(4.0)
        lim = self.st['a'].limit
        for p99 in (1.8, 2.0, 1.71):
            self.assertEqual(self.step(p99)[0], 'hold')
            self.assertEqual(self.st['a'].limit, lim)
        self.assertEqual(self.step(1.0)[0], 'raise')
        self.assertGreater(self.st['a'].limit, lim)

    def test_floor(self):
        for _ in range(100):
            self.step(10.0)
        # 2 MiB/s of the VM's 4 KiB requests
        self.assertEqual(self.st['a'].limit, 512)
        self.assertEqual(self.st['a'].limits(), {'iops-total': 512, 'bps-total': 2 << 20})
        self.assertIn('at floor', self.step(10.0)[2]['a'])

    def test_floor_for_large_requests(self):
        st = policy.VMState(vmconf())
        st.req_bytes = 1 << 20
        self.assertEqual(st.floor(), 10)            # floor-iops: 10 MiB/s here
        st.conf.floor_iops = 1
        self.assertEqual(st.floor(), 2)             # 2 MiB/s of 1 MiB requests

    def test_raise_returns_to_the_default(self):
        self.step(4.0)
        for _ in range(100):
            self.step(0.1)
        self.assertIsNone(self.st['a'].limit)       # unlimited again
        self.assertIsNone(self.st['b'].limit)
        self.assertEqual(self.st['b'].limits(), {'iops-total': 4000, 'bps-total': 0})

    def test_never_above_the_default(self):
        self.step(4.0, vm_iops={'a': 3000, 'b': 9000})
        self.assertLessEqual(self.st['b'].limit, 4000)

    def test_idle_containers_lift_after_three_periods(self):
        self.step(4.0)
        self.assertIsNotNone(self.st['a'].limit)
        self.assertEqual(self.step(None, cont_iops=0)[0], 'idle')
        self.assertEqual(self.step(None, cont_iops=5)[0], 'idle')
        self.assertIsNotNone(self.st['a'].limit)
        a, _, notes = self.step(None, cont_iops=0)
        self.assertEqual(a, 'lift')
        self.assertEqual(notes, {'a': 'lift', 'b': 'lift'})
        self.assertIsNone(self.st['a'].limit)
        self.assertEqual(self.step(9.0, cont_iops=0)[0], 'idle')   # idle wins over latency

    def test_vm_over_its_slo_is_not_cut(self):
        self.step(4.0)
        la, lb = self.st['a'].limit, self.st['b'].limit
        _, _, notes = self.step(4.0, vm_p99={'a': 80.0})
        self.assertGreater(self.st['a'].limit, la)          # raised a step
        self.assertLess(self.st['b'].limit, lb)             # the other one takes the cut
        self.assertIn('over its SLO', notes['a'])

    def test_libvirt_vm_slo_on_its_mean(self):
        """No histogram (libvirt): the SLO is checked on the mean latency,
        and a p99 where there is one wins over the mean."""
        self.step(4.0)
        la, lb = self.st['a'].limit, self.st['b'].limit
        _, _, notes = self.step(4.0, vm_mean={'a': 80.0, 'b': 5.0})
        self.assertGreater(self.st['a'].limit, la)
        self.assertLess(self.st['b'].limit, lb)
        self.assertIn('over its SLO (mean 80.0', notes['a'])
        la = self.st['a'].limit
        self.step(4.0, vm_p99={'a': 5.0}, vm_mean={'a': 80.0})
        self.assertLess(self.st['a'].limit, la)             # its p99 is within the SLO

    def test_pressure_is_an_input(self):
        """io.pressure: with target-pressure set, a stall share over it
        cuts even when the probe is within its target (r is the larger of
        the two ratios); unset, it is not looked at; and a container that
        stalls is not idle, whatever its counted I/O."""
        a, r, _ = self.step(1.0, pressure=0.3, target_pressure=0.1)
        self.assertEqual(a, 'cut')
        self.assertAlmostEqual(r, 3.0)
        self.setUp()
        a, r, _ = self.step(1.0, pressure=0.3)
        self.assertEqual(a, 'raise' if r < policy.LOW else 'hold')
        self.assertAlmostEqual(r, 0.5)
        self.setUp()
        for _ in range(policy.IDLE_PERIODS + 1):
            a, _, _ = self.step(None, cont_iops=0, pressure=0.05, target_pressure=0.1)
        self.assertEqual(a, 'raise')           # stalling: not idle; under target

    def test_unreachable_vm_left_alone(self):
        self.step(4.0, vm_iops={'a': 3000})
        self.assertIsNone(self.st['b'].limit)

    def test_no_latency_holds(self):
        self.assertEqual(self.step(None)[0], 'hold')

    def test_weighted_work(self):
        self.assertEqual(policy.weighted_work(4096000, 2048000, 2.0), 2000)


if __name__ == '__main__':
    unittest.main()
