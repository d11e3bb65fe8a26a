"""What can go wrong with a volume, one class per thing a caller acts on.

Every message names the volume and the value at fault and, where there is
one, the remedy.  The `hvvol` command prints the message and exits 1 (2 for
BadInput); the podman volume plugin (plugin.py) returns it as the request's Err.
"""


class VolumeError(Exception):
    """Base class: the operation was refused or failed; nothing was lost."""


class BadInput(VolumeError):
    """A name, size, path or option that is not acceptable (never acted on)."""


class NotFound(VolumeError):
    """No such volume, or its image or region is missing."""


class Exists(VolumeError):
    """A volume of that name already exists."""


class AlreadyMounted(VolumeError):
    """The volume is mounted already; `mountpoint` says where."""

    def __init__(self, msg, mountpoint):
        super().__init__(msg)
        self.mountpoint = mountpoint


class NotMounted(VolumeError):
    """The volume is not mounted (umount of a stopped volume)."""


class Busy(VolumeError):
    """Something still uses the volume or the mount point: `users` lists
    (pid, command, container id or None, how) of each."""

    def __init__(self, msg, users=()):
        super().__init__(msg)
        self.users = list(users)


class NoSpace(VolumeError):
    """The image's file system or the broker's pool cannot hold the volume."""


class DaemonError(VolumeError):
    """qemu-storage-daemon did not start, refused a request, or did not
    exit cleanly."""


class FlushFailed(VolumeError):
    """The RAM tier could not be written back: the daemon keeps running and
    holds every write; fix the cause and run umount again."""
