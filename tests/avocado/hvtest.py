"""Base classes for our functional tests: real QEMU guests, always reaped;
private libvirtd instances, always stopped."""
import os
import shutil
import sys

from avocado import Test

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
import hvlib  # noqa: E402  pylint: disable=wrong-import-position
from hvlib.libvirt import LibvirtHost, libvirt_available, qemu_dir  # noqa: E402  pylint: disable=wrong-import-position


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


class LibvirtTest(HybridVMTest):
    """A test with private libvirtd instances (hvlib.libvirt), cancelled where
    they cannot run.  `root` is a short temporary directory (unix socket
    paths must stay under 108 bytes) that libvirt's QEMU, running as
    libvirt-qemu, can reach files in (hvlib.libvirt.qemu_dir(): keep the
    images and sockets a domain uses there, not in the test's workdir under
    /root), removed in tearDown; start_host()
    starts one instance, `host`, there, which stop_host() stops (tearDown at
    the latest: a subclass calls it first when the guests or the hook use
    daemons of its own)."""

    def setUp(self):
        self.host = None
        self.root = None
        super().setUp()
        reason = libvirt_available()
        if reason:
            self.cancel(reason)
        self.root = qemu_dir()

    def start_host(self, name, hooks_dir=None):
        self.host = LibvirtHost(name, os.path.join(self.root, 'lv'), hooks_dir=hooks_dir)
        return self.host.start()

    def stop_host(self):
        if self.host:
            self.host.stop()

    def tearDown(self):
        self.stop_host()
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
        super().tearDown()
