"""hvctr-run refuses what would let one container reach another's cgroup
or a path outside hvctr/: names that are not plain words, and a name whose
group holds running processes."""

import os
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
HVCTR = os.path.join(os.path.dirname(HERE), 'hvctr-run')
V1 = '/sys/fs/cgroup/blkio'


def procs(group):
    try:
        with open(f'{group}/cgroup.procs') as f:
            return f.read().split()
    except OSError:
        return []


def run(*args):
    return subprocess.run([sys.executable, HVCTR, *args], capture_output=True, text=True,
                          timeout=60)


class HvctrRunTest(unittest.TestCase):
    def test_names_that_leave_hvctr_are_refused(self):
        for name in ('..', '.', '../../x', 'a/b', '', 'x' * 65, 'a b', '-x'):
            r = run('--name', name, '--', 'true')
            self.assertEqual(r.returncode, 2, (name, r.stderr))
            self.assertIn('--name', r.stderr, name)
        r = run('--name', 'ok', '--bfq-weight', '0', '--', 'true')
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn('--bfq-weight', r.stderr)

    @unittest.skipUnless(os.geteuid() == 0 and os.path.exists(f'{V1}/blkio.throttle.io_serviced'),
                         'needs root and the cgroup v1 blkio hierarchy')
    def test_a_running_container_cannot_be_taken_over(self):
        name = f'taken{os.getpid()}'
        owner = subprocess.Popen([sys.executable, HVCTR, '--name', name, '--no-namespaces',
                                  '--', 'sleep', '30'])
        group = f'{V1}/hvctr/{name}'
        try:
            deadline = time.monotonic() + 10
            while not procs(group):
                self.assertLess(time.monotonic(), deadline, 'the first container never started')
                time.sleep(0.05)
            r = run('--name', name, '--', 'true')
            self.assertNotEqual(r.returncode, 0)
            self.assertIn('a container of that name is running', r.stderr)
            self.assertIsNone(owner.poll())
            self.assertTrue(procs(group))
        finally:
            owner.terminate()
            owner.wait(20)
        self.assertFalse(os.path.exists(group))


if __name__ == '__main__':
    unittest.main()
