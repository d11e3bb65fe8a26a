"""Base class for our functional tests: real QEMU guests, always reaped."""
import os
import sys

from avocado import Test

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
import hvlib  # noqa: E402  pylint: disable=wrong-import-position


class HybridVMTest(Test):
    """Starts guests through self.guest(); tearDown shuts every one of them down,
    whether the test passed, failed or errored.  Missing build outputs cancel
    the test with the reason instead of letting it pass silently."""

    timeout = 900

    def setUp(self):
        self.paths = hvlib.BuildPaths()
        self._guests = []
        try:
            self.paths.binary('qemu-system-x86_64')
            self.paths.guest_file('vmlinuz')
            self.paths.guest_file('initrd.img')
        except hvlib.MissingBuild as exc:
            self.cancel(str(exc))

    def guest(self, name, **kwargs):
        g = hvlib.Guest(name, self.logdir, paths=self.paths, **kwargs)
        self._guests.append(g)
        return g

    def tearDown(self):
        for g in reversed(getattr(self, '_guests', [])):
            g.shutdown()
