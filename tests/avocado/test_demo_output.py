"""scripts/demo.py's output without a guest: the comparison table and the chart,
from figures built the way the demo builds them.  Host-only and about a second."""
import importlib.util
import os
import sys

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
