"""The daemon as a process, with its watchdog: started from another
directory with a relative configuration path, its watchdog's state in
status and metrics, a watchdog that keeps dying.  Its device is a loop
device (the probe reads it); its VM a FakeQMP peer in the test's process,
so that a VM's limits are read back without a guest: what the watchdog
does to a real QEMU is test_guest_arbiter_ops.py's."""

import os
import shutil
import signal
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arblib as A   # noqa: E402
from fakeqmp import FakeQMP   # noqa: E402


def unavailable():
    if os.geteuid() != 0:
        return 'needs root (a loop device)'
    if not shutil.which('losetup'):
        return 'losetup is not installed'
    return None


WHY = unavailable()
DEFAULT = {'iops-total': 0, 'bps-total': 0}


@unittest.skipIf(WHY, WHY)
class DaemonTest(A.LoopTestCase):

    def setUp(self):
        self.state = self.id().rsplit('.', 1)[-1]
        self.peer = FakeQMP(self.tmp(f'{self.state}-vm0.qmp'))
        self.addCleanup(self.peer.close)

    def daemon(self, conf=None, cwd=None):
        conf = conf or A.config(self.tmp, self.loop.dev, [('vm0', self.peer.path)], [],
                                state=self.state)
        d = A.Daemon(conf, self.tmp, state=self.state, cwd=cwd)
        self.addCleanup(d.close)
        return d

    def metric(self, d, name):
        for ln in d.ask('metrics').splitlines():
            if ln.startswith(f'hvarbiter_{name} '):
                return float(ln.split()[1])
        self.fail(f'no hvarbiter_{name} in the metrics')

    def test_relative_config_path_from_another_cwd(self):
        """hvarbiter run with a relative configuration path, from another
        directory: the watchdog reads the same file (its real path), stays
        up (no restart) and, the daemon killed, restores the VM's
        defaults."""
        conf = A.config(self.tmp, self.loop.dev, [('vm0', self.peer.path)], [], state=self.state)
        cwd = os.path.join(self.tmp.path, f'{self.state}-cwd')
        os.mkdir(cwd)
        d = self.daemon(os.path.relpath(conf, cwd), cwd=cwd)
        d.wait(lambda s: s['vm_state']['vm0']['state'] == 'ok' and s.get('periods', 0) >= 5,
               what='vm0 attached')
        d.wait(lambda s: s['watchdog']['state'] == 'running', what='the watchdog ready')
        time.sleep(1.5)                 # 15 periods: one restart a period was the bug
        wd = d.status()['watchdog']
        self.assertEqual((wd['state'], wd['restarts'], wd['error']), ('running', 0, None), wd)
        self.assertEqual(d.watchdog_pid(), [wd['pid']])
        with self.peer.lock:                # as if a previous run had left it throttled
            self.peer.limits = {'iops-total': 77, 'bps-total': 0}
        d.proc.kill()
        d.proc.wait()
        A.wait_for(lambda: self.peer.limits, lambda x: x == DEFAULT, 15,
                   'the watchdog did not restore the default')
        self.assertTrue(any(r.get('event') == 'watchdog' for r in d.records()))

    def test_watchdog_state_in_status_and_metrics(self):
        """status and the metrics show the watchdog: running, its pid, no
        restart; killed, it is started again at once, its restart and
        the reason it died (a signal) shown."""
        d = self.daemon()
        st = d.wait(lambda s: s['watchdog']['state'] == 'running', what='the watchdog ready')
        wd = st['watchdog']
        self.assertEqual((wd['restarts'], wd['error']), (0, None), wd)
        self.assertEqual(d.watchdog_pid(), [wd['pid']])
        self.assertEqual(self.metric(d, 'watchdog_up'), 1)
        self.assertEqual(self.metric(d, 'watchdog_restarts_total'), 0)
        os.kill(wd['pid'], signal.SIGKILL)
        st = d.wait(lambda s: s['watchdog']['restarts'] == 1 and
                    s['watchdog']['state'] == 'running', what='the watchdog started again')
        wd2 = st['watchdog']
        self.assertNotEqual(wd2['pid'], wd['pid'])
        self.assertEqual(d.watchdog_pid(), [wd2['pid']])
        self.assertEqual(wd2['error'], 'killed by signal 9')
        self.assertEqual(self.metric(d, 'watchdog_up'), 1)
        self.assertEqual(self.metric(d, 'watchdog_restarts_total'), 1)
        died = [r for r in d.records() if r.get('event') == 'watchdog-died']
        self.assertEqual([(r['rc'], r['error']) for r in died], [(-9, 'killed by signal 9')])
        self.assertEqual(d.terminate(), 0)

    def test_a_watchdog_that_keeps_dying_is_an_error(self):
        """A watchdog that cannot start (its configuration made writable by
        others meanwhile: it refuses it) is an error in status and the
        metrics, with its reason, and is started again at a bounded rate
        (at once, then after 1, 2, 4 ... s), not every period; once it
        can start, it runs again."""
        d = self.daemon()
        wd = d.wait(lambda s: s['watchdog']['state'] == 'running',
                    what='the watchdog ready')['watchdog']
        os.chmod(d.conf, 0o666)
        self.addCleanup(os.chmod, d.conf, 0o644)
        os.kill(wd['pid'], signal.SIGKILL)
        t0 = time.monotonic()
        d.wait(lambda s: s['watchdog']['state'] == 'error', what='its death seen')
        states = set()
        while time.monotonic() - t0 < 5.0:
            states.add(d.status()['watchdog']['state'])
            time.sleep(0.05)
        st = d.status()
        wd = st['watchdog']
        self.assertEqual(wd['state'], 'error', wd)
        self.assertNotIn('running', states)
        self.assertIn('writable by group or others', wd['error'])
        self.assertIn('exited with status 1', wd['error'])
        # started at once, after 1 s, after 2 s (and next after 4 s): in 5 s,
        # 3 or 4 restarts (2 on a slow start) where one a period (100 ms) made 50
        self.assertGreaterEqual(wd['restarts'], 2, wd)
        self.assertLessEqual(wd['restarts'], 4, wd)
        self.assertEqual(self.metric(d, 'watchdog_up'), 0)
        self.assertEqual(self.metric(d, 'watchdog_restarts_total'), wd['restarts'])
        self.assertEqual(st['vm_state']['vm0']['state'], 'ok')     # the loop goes on
        os.chmod(d.conf, 0o644)
        wd = d.wait(lambda s: s['watchdog']['state'] == 'running', timeout=20,
                    what='the watchdog back')['watchdog']
        self.assertEqual(d.watchdog_pid(), [wd['pid']])
        died = [r for r in d.records() if r.get('event') == 'watchdog-died']
        self.assertEqual(len(died), wd['restarts'])
        self.assertEqual(d.terminate(), 0)


if __name__ == '__main__':
    unittest.main()
