"""scripts/demo.py's output without a guest: the comparison table and the chart,
from figures built the way the demo builds them.  Host-only and about a second."""
import importlib.util
import os
import sys
import time

from avocado import Test

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(TOP, 'tests'))
import hvlib  # noqa: E402  pylint: disable=wrong-import-position


def load_demo():
    spec = importlib.util.spec_from_file_location('demo', os.path.join(TOP, 'scripts', 'demo.py'))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def result(status='completed', total=1466, setup=3, transferred_mib=166.0, requests=20, aa=None):
    return hvlib.MigrationResult(status=status, total_time_ms=total, setup_time_ms=setup, downtime_ms=2,
                                 transferred_bytes=int(transferred_mib * 2**20), postcopy_requests=requests,
                                 precopy_seconds=0.5, switched_to_postcopy=True,
                                 info={'app-assist': aa} if aa else {})


# `virsh domjobinfo --completed` as libvirt 9.0 prints it (sizes scaled by virsh).
JOB = """Job type:         Completed
Operation:        Incoming migration
Time elapsed:     5123         ms
Time elapsed w/o network: 5120 ms
Data processed:   1.234 GiB
Data remaining:   0.000 B
Total downtime:   50           ms
Setup time:       20           ms
"""


class DemoOutput(Test):

    timeout = 60

    def setUp(self):
        self.demo = load_demo()
        aa = {'freed-bytes': 60 * 2**20, 'zeroed-bytes': 60 * 2**20, 'prepare-time': 27, 'balloon-time': 0}
        self.qemu_runs = [
            ('stock post-copy', self.demo.qemu_figures(result(), False, 0, 0,
                                                       {'ops/s': 1806, 'p99 (ms)': 3.6,
                                                        'failed': 2})),
            ('app-assisted post-copy',
             self.demo.qemu_figures(result(total=1176, setup=29, transferred_mib=126.2, requests=11, aa=aa),
                                    True, 0, 0, {'ops/s': 1750, 'p99 (ms)': 4.1, 'failed': 0}))]
        self.libvirt_runs = [
            ('stock (virsh)', self.demo.libvirt_figures(6.14, JOB, {}, 0, 0)),
            ('app-assisted (virsh)', self.demo.libvirt_figures(5.02, JOB, {'status': 'completed'}, 0, 0))]

    def test_table_fits_100_columns(self):
        """Both modes' tables, with every figure the demo produces and figures far
        larger than a normal run's, are at most 100 characters wide, one row per
        figure with a value for each run."""
        big = [(name, {k: (123456789.9 if isinstance(v, (int, float)) else v) for k, v in figs.items()})
               for name, figs in self.qemu_runs]
        big[0][1]['status'] = 'postcopy-recover-setup'
        for runs in (self.qemu_runs, self.libvirt_runs, big):
            text = self.demo.table(runs)
            self.log.info('\n%s', text)
            lines = text.splitlines()
            self.assertLessEqual(max(len(line) for line in lines), 100, text)
            self.assertEqual(len(lines), 2 + len(runs[0][1]), text)
            for figure, value in runs[1][1].items():
                row = next(line for line in lines if line.startswith(figure + ' '))
                self.assertIn(str(value), row)

    def test_ratio_only_where_meaningful(self):
        """Total time, bytes transferred and the Redis client's throughput and
        p99 during the migration get the ratio assisted/stock; the other figures (status, counts, set-up time) get none."""
        rows = {line.split('  ')[0]: line for line in self.demo.table(self.qemu_runs).splitlines()[2:]}
        self.assertTrue(rows['total time (ms)'].endswith('0.80'), rows['total time (ms)'])
        self.assertTrue(rows['transferred (MiB)'].endswith('0.76'), rows['transferred (MiB)'])
        self.assertTrue(rows['status'].endswith('completed'), rows['status'])
        self.assertTrue(rows['setup time (ms)'].endswith('29'), rows['setup time (ms)'])
        self.assertTrue(rows['Redis ops/s during migration'].endswith('0.97'),
                        rows['Redis ops/s during migration'])
        self.assertTrue(rows['Redis p99 during (ms)'].endswith('1.14'), rows['Redis p99 during (ms)'])

    def test_virsh_units(self):
        """virsh's scaled sizes come out in MiB, its times in ms, a missing field as '-'."""
        self.assertEqual(self.demo.virsh_figure(JOB, 'Data processed'), 1263.6)
        self.assertEqual(self.demo.virsh_figure(JOB, 'Time elapsed'), 5123)
        self.assertEqual(self.demo.virsh_figure('Data processed: 512.5 KiB\n', 'Data processed'), 0.5)
        self.assertEqual(self.demo.virsh_figure(JOB, 'Memory bandwidth'), '-')

    def test_chart_written(self):
        """chart() writes a PNG for either mode and returns its path."""
        try:
            import matplotlib  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
        except ImportError:
            self.cancel('matplotlib is not installed (scripts/requirements.txt pins it)')
        # the database's rows are in the chart, not only in the table
        self.assertIn('Redis ops/s during migration', self.demo.chart_figures(self.qemu_runs))
        self.assertIn('Redis p99 during (ms)', self.demo.chart_figures(self.qemu_runs))
        rows = {line.split('  ')[0]: line for line in self.demo.table(self.qemu_runs).splitlines()[2:]}
        self.assertRegex(rows['Redis requests failed during'], r' 2 +0$')
        for mode, runs in (('qemu', self.qemu_runs), ('libvirt', self.libvirt_runs)):
            path = os.path.join(self.workdir, f'{mode}.png')
            self.assertEqual(self.demo.chart(runs, path, mode), path)
            with open(path, 'rb') as f:
                self.assertEqual(f.read(8), b'\x89PNG\r\n\x1a\n')
            self.assertGreater(os.path.getsize(path), 5000)

    def test_shape_checked_before_any_guest(self):
        """A shape the guest or the host cannot hold is refused at once, with the
        size to ask for; a bad argument is refused; a shape that fits passes."""
        import argparse  # pylint: disable=import-outside-toplevel

        def args(**kw):
            base = dict(mem='1G', items=200000, value_size=100, hot=0.3, bandwidth=125_000_000,
                        precopy=0.5)
            base.update(kw)
            return argparse.Namespace(**base)

        gib = 1 << 30
        self.assertIsNone(self.demo.shape_error(args(), 22 * gib))
        self.assertIsNone(self.demo.shape_error(args(mem='5G', items=10_000_000), 22 * gib))
        why = self.demo.shape_error(args(items=20_000_000), 22 * gib)
        self.assertRegex(why, r'need about 4\.9 GiB of guest RAM.*give --mem 5G')
        why = self.demo.shape_error(args(mem='20G', items=10_000_000), 22 * gib)
        self.assertRegex(why, r'this host has 22\.0 GiB available \(the largest shape that fits: '
                              r'about \d+ items')
        for bad in (dict(mem='1X'), dict(mem='-1G'), dict(hot=0), dict(hot=1.5), dict(items=0),
                    dict(value_size=0), dict(bandwidth=0), dict(precopy=-1)):
            self.assertIsNotNone(self.demo.shape_error(args(**bad), 22 * gib), bad)
        self.assertEqual(self.demo.mem_bytes('3072M'), 3 * gib)
        self.assertEqual(self.demo.mem_bytes('2048'), 2 * gib)    # QEMU's -m: MiB by default

    def test_demo_refuses_before_booting(self):
        """scripts/demo.py with a shape too large for its guest exits 2 with the
        reason in about a second: no guest is started, no log directory made."""
        import subprocess  # pylint: disable=import-outside-toplevel
        t = time.monotonic()
        p = subprocess.run([sys.executable, os.path.join(TOP, 'scripts', 'demo.py'), '--mem', '1G',
                            '--items', '20000000', '--log-dir', os.path.join(self.workdir, 'logs')],
                           capture_output=True, text=True, timeout=60, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn('give --mem 5G or more', p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.workdir, 'logs')))
        self.assertLess(time.monotonic() - t, 30)
