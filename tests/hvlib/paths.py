"""Where the build put things.  HYBRIDVM_BUILD overrides <repo>/build."""
import os
import sys


class MissingBuild(Exception):
    """A binary or guest image the caller needs has not been built."""


class BuildPaths:
    def __init__(self, build=None):
        top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.top = top
        self.build = os.path.abspath(build or os.environ.get('HYBRIDVM_BUILD')
                                     or os.path.join(top, 'build'))
        self.bin = os.path.join(self.build, 'bin')
        self.guest = os.path.join(self.build, 'guest')
        self.qemu_python = os.path.join(self.build, 'qemu-src', 'python')
        if os.path.isdir(self.qemu_python) and self.qemu_python not in sys.path:
            sys.path.insert(0, self.qemu_python)

    def binary(self, name):
        path = os.path.join(self.bin, name)
        if not os.access(path, os.X_OK):
            raise MissingBuild(f'{path} is missing: run "make" first')
        return path

    def guest_file(self, name):
        path = os.path.join(self.guest, name)
        if not os.path.isfile(path):
            raise MissingBuild(f'{path} is missing: run "make guest" first')
        return path
