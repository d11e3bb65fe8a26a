"""bench/app-assist-setup-scale.py's host path, at a small size: a real
redis-server with the module, its port a unix socket the benchmark speaks to
as QEMU does (PREPARE, PAGES 0.. until none remain, PAGES END): the list it
takes is the module's whole list, the figures are consistent; and the
report's reading of a series (flat, linear, not linear) says what the points
say."""

import argparse
import importlib.util
import os
import sys
import tempfile
import shutil
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import MODULE, REDIS_SERVER  # noqa: E402

TOP = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
SCRIPT = os.path.join(TOP, 'bench', 'app-assist-setup-scale.py')


def load_bench():
    spec = importlib.util.spec_from_file_location('setup_scale', SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fit(bench, pts):
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    a, b, r2 = bench.fit_line(xs, ys)
    steps = [{'from': x0, 'to': x1, 'ms per M': (y1 - y0) / (x1 - x0)}
             for (x0, y0), (x1, y1) in zip(pts, pts[1:])]
    return {'a': a, 'b': b, 'r2': r2, 'steps': steps, 'points': pts}


class SetupScaleBenchTest(unittest.TestCase):

    def setUp(self):
        self.bench = load_bench()

    def test_reading(self):
        """A constant series is flat, a line is linear with its slope, a
        series that bends at 5 M is two stretches, each with its cost."""
        b = self.bench
        flat = fit(b, [(1, 0.30), (2, 0.31), (5, 0.29), (10, 0.32), (20, 0.33)])
        self.assertTrue(b.shape_of(flat).startswith('flat'), b.shape_of(flat))
        line = fit(b, [(x, 3 + 3.5 * x) for x in (1, 2, 5, 10, 20)])
        self.assertTrue(b.shape_of(line).startswith('linear: 3.50 ms per million'),
                        b.shape_of(line))
        bent = fit(b, [(1, 4), (2, 8), (5, 20), (10, 200), (20, 600)])
        self.assertEqual(b.shape_of(bent), 'not linear throughout: 4.00 ms per million from '
                         '1 to 5 M; 38.00 ms per million from 5 to 20 M')

    def test_host_point(self):
        """One host point of 20,000 items: PREPARE drops the 14,000 cold ones
        and offers a list, the list taken chunk by chunk is the module's
        whole list (host_point checks the run count against INFO), and
        every figure is there and sane."""
        if os.geteuid() != 0:
            self.skipTest('the page list needs CAP_SYS_ADMIN (run as root)')
        if not os.path.exists(MODULE):
            self.skipTest('module not built: ninja -C build redis-module/hybridmem.so')
        if not os.path.exists(REDIS_SERVER):
            self.skipTest('redis-server not installed')
        work = tempfile.mkdtemp(prefix='setup-scale-test-')
        self.addCleanup(shutil.rmtree, work, True)
        args = argparse.Namespace(size=100, hot=0.3, deadline=3000)
        row = self.bench.host_point(20000, args, work, 'test')
        self.assertEqual(row['items dropped'], 14000)
        self.assertEqual(row['cold items'], 14000)
        self.assertEqual(row['page list offered'], 1)
        self.assertEqual(row['release'], 'parked')
        self.assertEqual(row['page list: unlisted'], 0)
        self.assertGreaterEqual(row['page list: chunks'], 1)
        self.assertEqual(row['page list: runs'], row['page list: module runs'])
        # 14,000 values of 100 bytes live in the listed pages, at least.
        self.assertGreaterEqual(row['pages listed (MiB)'] * (1 << 20), 14000 * 100)
        self.assertGreater(row['set-up: server CPU (ms)'], 0)
        self.assertAlmostEqual(row['set-up (ms)'], row['prepare (ms)'] + row['page list (ms)'])
        self.assertAlmostEqual(row['set-up: server CPU (ms)'],
                               row['prepare: server CPU (ms)'] + row['page list: server CPU (ms)'])
        self.assertGreater(row['peak RSS (MiB)'], 0)


if __name__ == '__main__':
    unittest.main()
