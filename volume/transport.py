"""How a volume's node reaches the kernel as a block device.

qemu-storage-daemon can export a node as a FUSE file, over NBD, and (with
the right build) through VDUSE; the kernel turns each into a block device
differently:

  ublk    a ublk server with io_uring: the best, needs a daemon that serves
          ublk (QEMU 10.0's qemu-storage-daemon has no ublk export)
  vduse   a virtio-blk device in user space (vduse-blk export + `vdpa dev add`)
  nbd     the NBD export on a Unix socket + the kernel's nbd client
  fuse    the FUSE export (the node as a regular file) + a loop device with
          direct I/O: works wherever FUSE and loop do, at the cost of the
          loop layer (each request crosses the kernel twice)

choose() is the one place that decides: it takes what the host offers
(probe()), what the daemon offers (its BlockExportType enum) and what this
program implements, and returns the best transport all three have, with the
reasons the better ones were passed over.  Only FUSE + loop is implemented:
the build machines have no nbd, ublk_drv or vduse module, so no other path
can be run here (volume/tests/test_validate.py tests the choice itself).
"""

import os
import threading
import time

from . import host
from .errors import Busy, DaemonError

# Best first.
PREFERENCE = ('ublk', 'vduse', 'nbd', 'fuse')

# The daemon's BlockExportType member each transport needs (ublk: QEMU has
# none yet, the daemon would have to grow one).
EXPORT_TYPE = {'ublk': 'ublk', 'vduse': 'vduse-blk', 'nbd': 'nbd', 'fuse': 'fuse'}

# The kernel modules behind each (loaded, or present to load).
MODULES = {'ublk': ('ublk_drv',), 'vduse': ('vduse', 'virtio_vdpa'), 'nbd': ('nbd',),
           'fuse': ('fuse', 'loop')}
DEVICE_NODES = {'ublk': ('/dev/ublk-control',), 'vduse': ('/dev/vduse/control',),
                'nbd': ('/dev/nbd0',), 'fuse': ('/dev/fuse', '/dev/loop-control')}


def _module_available(name, release=None):
    """Loaded or built in (/sys/module/NAME), or a module file for this
    kernel that modprobe could load."""
    if os.path.isdir(f'/sys/module/{name}'):
        return True
    release = release or os.uname().release
    base = f'/lib/modules/{release}'
    try:
        with open(f'{base}/modules.dep') as f:
            for line in f:
                mod = line.split(':', 1)[0]
                stem = os.path.basename(mod).split('.', 1)[0]
                if stem == name or stem == name.replace('_', '-'):
                    return True
    except OSError:
        pass
    try:
        with open(f'{base}/modules.builtin') as f:
            return any(os.path.basename(line.strip()).split('.', 1)[0] == name for line in f)
    except OSError:
        return False


def probe():
    """{transport: (available, reason)} for this host: its device nodes, or
    failing that its kernel modules."""
    out = {}
    for name in PREFERENCE:
        nodes = DEVICE_NODES[name]
        if all(os.path.exists(n) for n in nodes):
            out[name] = (True, 'present: ' + ', '.join(nodes))
            continue
        missing = [m for m in MODULES[name] if not _module_available(m)]
        if missing:
            out[name] = (False, 'no ' + ', '.join(n for n in nodes if not os.path.exists(n)) +
                         ' and no kernel module ' + ', '.join(missing))
        else:
            out[name] = (True, 'modules ' + ', '.join(MODULES[name]) + ' can be loaded')
    return out


def choose(host_caps, daemon_exports, implemented):
    """(transport, [(passed over, why), ...]): the first of PREFERENCE that
    the host has (host_caps: probe()'s mapping), the daemon can export
    (daemon_exports: its BlockExportType members) and this program
    implements.  None when there is none."""
    passed = []
    for name in PREFERENCE:
        ok, why = host_caps.get(name, (False, 'not probed'))
        if not ok:
            passed.append((name, f'host: {why}'))
        elif EXPORT_TYPE[name] not in daemon_exports:
            passed.append((name, f'qemu-storage-daemon has no {EXPORT_TYPE[name]} export'))
        elif name not in implemented:
            passed.append((name, 'hvvol does not implement it yet'))
        else:
            return name, passed
    return None, passed


class FuseLoop:
    """The node as a regular file (FUSE export) under a loop device with
    direct I/O: the loop device sends each request to the file with
    O_DIRECT, so there is no second page cache, and its flushes become
    fsync()s of the file, which the export turns into flushes of the node."""

    name = 'fuse'

    def __init__(self, export_file):
        self.export_file = export_file

    def export_args(self, export_id, node):
        return dict(type='fuse', id=export_id, **{'node-name': node},
                    mountpoint=self.export_file, writable=True,
                    **{'allow-other': 'off'})

    def prepare(self):
        """The regular file the export mounts over (it must exist)."""
        fd = os.open(self.export_file, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        os.close(fd)

    def exported(self):
        """Whether the FUSE export is mounted on the file now."""
        m = host.mount_at(self.export_file)
        return bool(m and m['fstype'].startswith('fuse'))

    def attach(self):
        """The loop device (path, direct I/O on) over the export file."""
        existing = host.loops_backed_by(self.export_file)
        if existing:
            return existing[0], host.loop_dio(existing[0])
        p = host.run(['losetup', '--find', '--show', '--direct-io=on', self.export_file],
                     timeout=60)
        if p.returncode != 0:
            raise DaemonError(f'losetup {self.export_file} failed: {p.stderr.strip()}')
        loop = p.stdout.strip()
        return loop, host.loop_dio(loop)

    def detach(self, loop, timeout=20):
        """Detach the loop device and wait until the kernel has let it go;
        Busy if something still holds it open."""
        if not host.loop_attached(loop):
            return
        p = host.run(['losetup', '-d', loop], timeout=60)
        if p.returncode != 0 and host.loop_attached(loop):
            raise Busy(f'losetup -d {loop} failed: {p.stderr.strip()}')
        deadline = time.monotonic() + timeout
        while host.loop_attached(loop):
            if time.monotonic() > deadline:
                raise Busy(f'{loop} is still attached {timeout} s after losetup -d: '
                           'a process holds it open (see fuser -v ' + loop + ')')
            time.sleep(0.05)

    def flush(self, timeout):
        """fsync() the export file: the export flushes the node (a hybrid
        flush writes back every dirty block, then flushes the persistent
        tier) and returns its error.  None on success, else the error text.
        In a thread, so that a hung daemon costs timeout s, not forever."""
        result = []

        def work():
            try:
                fd = os.open(self.export_file, os.O_RDWR | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                result.append(None)
            except OSError as exc:
                result.append(f'{exc.strerror} (errno {exc.errno})')

        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join(timeout)
        if not result:
            return f'no answer to fsync within {timeout} s'
        return result[0]

    def clean_dead_export(self):
        """Unmount a FUSE export whose daemon died (the file then answers
        ENOTCONN); nothing to do if it is not mounted."""
        if self.exported():
            p = host.run(['umount', self.export_file], timeout=60)
            if p.returncode != 0:
                p = host.run(['umount', '-l', self.export_file], timeout=60)
                if p.returncode != 0:
                    raise Busy(f'cannot unmount the dead export {self.export_file}: '
                               f'{p.stderr.strip()}')


IMPLEMENTED = {'fuse': FuseLoop}
