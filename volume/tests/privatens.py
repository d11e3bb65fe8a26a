"""A mount namespace of the test process's own (not a test file itself).

A volume's mount is copied into every mount namespace made while it is
mounted (`unshare -m`, a container, libvirtd's namespace...), and on a host
whose mounts are private, as these are, the copy stays until that namespace
ends: hvvol then rightly refuses to unmount the volume, naming whoever holds
it.  Other engineers' and the other CI lane's tests make such namespaces at
any moment; tests that mount volumes and need to unmount them on time enter
a namespace of their own first, so their mounts (and the podman containers
and plugin they start, which inherit it) are never copied into anyone
else's."""

import ctypes
import os
import subprocess

CLONE_NEWNS = 0x00020000
_entered = False


def enter():
    """Move this process into a new mount namespace whose mounts
    propagate nowhere (once per process)."""
    global _entered
    if _entered:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f'unshare(CLONE_NEWNS): {os.strerror(err)}')
    subprocess.run(['mount', '--make-rprivate', '/'], check=True, capture_output=True)
    _entered = True
