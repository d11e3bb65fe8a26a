"""The containers' inputs as the arbiter reads them from a cgroup: v1
blkio counters, v2 io.stat, and io.pressure's stall total; files the
kernel would write, and files it would not (malformed, oversized, gone),
each a SourceError naming the file.  Temporary directories stand in for
cgroups: this isolates the parsers; the daemon reads real ones in
test_guest_arbiter_ops.py."""

import os
import shutil
import sys
import tempfile
import tracemalloc
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from arbiter.sources import (MAX_FILE, SourceError, cgroup_io, io_pressure_us,   # noqa: E402
                             read_small)

PRESSURE = ('some avg10=1.50 avg60=0.20 avg300=0.05 total=123456\n'
            'full avg10=0.00 avg60=0.00 avg300=0.00 total=789\n')


class SourcesTest(unittest.TestCase):
    def setUp(self):
        self.d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.d, True)

    def put(self, name, text):
        with open(os.path.join(self.d, name), 'w') as f:
            f.write(text)

    def test_pressure_total(self):
        self.put('io.pressure', PRESSURE)
        self.assertEqual(io_pressure_us(self.d), 123456)

    def test_pressure_bad_files(self):
        for text in ('', 'full avg10=0 total=5\n', 'some avg10=0 total=lots\n'):
            self.put('io.pressure', text)
            with self.assertRaises(SourceError) as cm:
                io_pressure_us(self.d)
            self.assertIn('io.pressure', str(cm.exception))
        self.put('io.pressure', 'some total=1 ' + 'x' * MAX_FILE)
        with self.assertRaisesRegex(SourceError, 'larger than'):
            io_pressure_us(self.d)
        with self.assertRaisesRegex(SourceError, 'cgroup is gone'):
            io_pressure_us(os.path.join(self.d, 'removed'))

    def test_v1_counters(self):
        self.put('blkio.throttle.io_serviced_recursive',
                 '7:0 Read 10\n7:0 Write 5\n7:0 Total 15\n8:0 Total 99\nTotal 114\n')
        self.put('blkio.throttle.io_service_bytes_recursive',
                 '7:0 Read 40960\n7:0 Total 61440\n8:0 Total 1\n')
        self.assertEqual(cgroup_io(self.d, '7:0'), (15, 61440))
        self.assertEqual(cgroup_io(self.d, '7:1'), (0, 0))     # no line: no I/O yet

    def test_v2_io_stat(self):
        self.put('io.stat', '7:0 rbytes=4096 wbytes=8192 rios=1 wios=2 dbytes=0 dios=0\n'
                            '8:0 rbytes=1 wbytes=1 rios=1 wios=1\n')
        self.assertEqual(cgroup_io(self.d, '7:0'), (3, 12288))
        self.put('io.stat', '7:0 rbytes=x wbytes=1 rios=1 wios=1\n')
        with self.assertRaisesRegex(SourceError, 'malformed line'):
            cgroup_io(self.d, '7:0')

    def test_a_small_file_costs_a_small_read(self):
        """Each period reads a few files of each container, of a few hundred
        bytes each: a read allocates about what the file holds, never a
        buffer of the MAX_FILE bound (a 1 MiB allocation and release for
        each one was most of what a period cost a container: 46 us a read
        against 11, measured 2026-11-27).  A file over the bound is still
        refused."""
        self.put('io.pressure', PRESSURE)
        path = os.path.join(self.d, 'io.pressure')
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        tracemalloc.reset_peak()
        self.assertEqual(read_small(path), PRESSURE)
        _, peak = tracemalloc.get_traced_memory()
        self.assertLess(peak, 128 * 1024)
        self.put('big', 'x' * (MAX_FILE + 1))
        with self.assertRaisesRegex(SourceError, 'larger than'):
            read_small(os.path.join(self.d, 'big'))
        self.put('exact', 'y' * MAX_FILE)
        self.assertEqual(len(read_small(os.path.join(self.d, 'exact'))), MAX_FILE)

    def test_neither_or_gone(self):
        with self.assertRaisesRegex(SourceError, 'neither blkio'):
            cgroup_io(self.d, '7:0')
        with self.assertRaisesRegex(SourceError, 'cgroup is gone'):
            cgroup_io(os.path.join(self.d, 'removed'), '7:0')


if __name__ == '__main__':
    unittest.main()
