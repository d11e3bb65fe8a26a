"""restore_defaults() on its own (the watchdog's and a clean exit's last
act): every VM is restored at once, so one whose link hangs (a libvirt
connection being opened has no timeout of its own) neither holds back the
others nor the caller for longer than its bound.  The links are stand-ins:
this isolates the function; the real links are exercised by
test_guest_arbiter_ops.py and test_guest_libvirt.py."""

import os
import sys
import threading
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from arbiter import vmlink   # noqa: E402
from arbiter.qmp import LinkError   # noqa: E402


class FakeLink:
    hang = threading.Event()        # set at tear-down: the hung one lets go
    applied = {}

    def __init__(self, conf, timeout):
        self.conf, self.timeout = conf, timeout

    def connect(self):
        if self.conf.name == 'hung':
            FakeLink.hang.wait()
        if self.conf.name == 'gone':
            raise LinkError('gone: cannot connect: no such domain')

    def set_limits(self, limits):
        FakeLink.applied[self.conf.name] = limits

    def close(self):
        pass


def vm(name):
    return types.SimpleNamespace(name=name, default_limits=lambda: {'iops-total': 0,
                                                                    'bps-total': 0})


class RestoreDefaultsTest(unittest.TestCase):
    def setUp(self):
        self.saved = vmlink.open_link
        vmlink.open_link = FakeLink
        FakeLink.applied = {}
        FakeLink.hang.clear()

    def tearDown(self):
        FakeLink.hang.set()
        vmlink.open_link = self.saved

    def test_a_hung_vm_holds_back_no_other(self):
        conf = types.SimpleNamespace(vms=[vm('hung'), vm('a'), vm('gone'), vm('b')])
        logged = []
        t = time.monotonic()
        out = vmlink.restore_defaults(conf, 0.2, logged.append)
        took = time.monotonic() - t
        self.assertEqual(set(FakeLink.applied), {'a', 'b'})
        self.assertIsNone(out['a'])
        self.assertIsNone(out['b'])
        self.assertIn('cannot connect', out['gone'])
        self.assertIn('no answer within 2.6 s', out['hung'])
        self.assertLess(took, 2.6 + 1.0)
        self.assertEqual([r['vm'] for r in logged], ['hung', 'a', 'gone', 'b'])
        # the hung one answering late changes nothing already returned
        FakeLink.hang.set()
        time.sleep(0.1)
        self.assertIn('no answer', out['hung'])


if __name__ == '__main__':
    unittest.main()
