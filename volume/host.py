"""What the host's kernel says: processes, mounts, loop devices, and who
uses a file system.

Read from /proc and /sys, never from a tool's formatted output; every
reader tolerates a process that exits while it is being read.
"""

import os
import re
import stat
import subprocess
import time

_LIBPOD_RE = re.compile(r'libpod-(?:conmon-)?([0-9a-f]{64})')


# -- processes ---------------------------------------------------------------

def start_time(pid):
    """The process's start time in clock ticks since boot (field 22 of
    /proc/PID/stat), or None if there is no such process.  A pid and its
    start time name one process: pids are reused, this pair is not."""
    try:
        with open(f'/proc/{int(pid)}/stat') as f:
            text = f.read()
    except (OSError, ValueError):
        return None
    fields = text[text.rfind(')') + 2:].split()
    if len(fields) < 20 or fields[0] in ('Z', 'X'):
        return None
    return int(fields[19])


def alive(pid, start):
    """Whether the process pid that started at start still runs (not a
    zombie: a zombie has done all it will do)."""
    return pid is not None and start is not None and start_time(pid) == start


def wait_gone(pid, start, timeout):
    """Wait up to timeout s for the process to end; True if it did."""
    deadline = time.monotonic() + timeout
    while alive(pid, start):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def comm(pid):
    try:
        with open(f'/proc/{pid}/comm') as f:
            return f.read().strip()
    except OSError:
        return '?'


def container_of(pid):
    """The podman container id (short) a process runs in, or None."""
    try:
        with open(f'/proc/{pid}/cgroup') as f:
            m = _LIBPOD_RE.search(f.read())
    except OSError:
        return None
    return m.group(1)[:12] if m else None


def _pids():
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            yield int(entry)


# -- mounts ------------------------------------------------------------------

def _unescape(field):
    return re.sub(r'\\([0-7]{3})', lambda m: chr(int(m.group(1), 8)), field)


def mountinfo(pid='self'):
    """The mounts of a process's mount namespace: a list of dicts with id
    (the mount's id, unique across namespaces), dev (major, minor), root,
    target, fstype, source."""
    out = []
    try:
        with open(f'/proc/{pid}/mountinfo') as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(' - ')
        a, b = left.split(), right.split()
        if not sep or len(a) < 5 or len(b) < 2:
            continue
        major, _, minor = a[2].partition(':')
        out.append(dict(id=int(a[0]), dev=(int(major), int(minor)), root=_unescape(a[3]),
                        target=_unescape(a[4]), fstype=b[0], source=_unescape(b[1])))
    return out


def mount_at(path):
    """The mount on path in our namespace (the last one stacked there), or None."""
    found = None
    for m in mountinfo():
        if m['target'] == path:
            found = m
    return found


def mounted_targets(dev):
    """Where the file system of device number dev (major, minor) is mounted
    in our namespace."""
    return [m['target'] for m in mountinfo() if m['dev'] == tuple(dev)]


def users(dev, ignore_targets=()):
    """Who uses the file system whose device number is dev (major, minor):
    a list of (pid, command, container, how).  How: 'mount namespace' for
    every process of another mount namespace in which it is mounted (a
    container's bind mount), 'open file', 'cwd', 'root' or 'mapped file'
    for a process holding something on it.  ignore_targets: mounts of it in
    our own namespace that are expected (the volume's own mount point).

    Open files are matched by the mount id in /proc/PID/fdinfo, not by
    stat(): a stat of a file on a hung FUSE mount elsewhere would hang."""
    dev = tuple(dev)
    devno = os.makedev(*dev)
    maps_dev = f'{dev[0]:02x}:{dev[1]:02x}'
    own_ns = os.stat('/proc/self/ns/mnt').st_ino
    me = os.getpid()
    ns_has, mount_ids, pids = {}, set(), []
    for pid in _pids():
        try:
            ns = os.stat(f'/proc/{pid}/ns/mnt').st_ino
        except OSError:
            continue
        pids.append((pid, ns))
        if ns not in ns_has:
            mine = [m for m in mountinfo(pid) if m['dev'] == dev]
            mount_ids.update(m['id'] for m in mine)
            targets = [m['target'] for m in mine]
            if ns == own_ns:
                targets = [t for t in targets if t not in ignore_targets]
            ns_has[ns] = bool(targets)
    found = []
    for pid, ns in pids:
        if ns_has[ns] and ns != own_ns:
            found.append((pid, comm(pid), container_of(pid), 'mount namespace'))
            continue
        how = _holds(pid, devno, mount_ids, maps_dev)
        if how:
            found.append((pid, 'this very process' if pid == me else comm(pid),
                          container_of(pid), how))
    if ns_has.get(own_ns):
        found.append((0, 'mount', None, 'mounted elsewhere in this namespace: ' +
                      ', '.join(t for t in mounted_targets(dev) if t not in ignore_targets)))
    return found


def _holds(pid, devno, mount_ids, maps_dev):
    for link, how in (('cwd', 'cwd'), ('root', 'root')):
        try:
            if os.stat(f'/proc/{pid}/{link}').st_dev == devno:
                return how
        except OSError:
            pass
    try:
        fds = os.listdir(f'/proc/{pid}/fdinfo')
    except OSError:
        fds = []
    for fd in fds[:65536]:
        try:
            with open(f'/proc/{pid}/fdinfo/{fd}') as f:
                for line in f:
                    if line.startswith('mnt_id:'):
                        if int(line.split()[1]) in mount_ids:
                            return 'open file'
                        break
        except (OSError, ValueError, IndexError):
            pass
    try:
        with open(f'/proc/{pid}/maps') as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[3] == maps_dev:
                    return 'mapped file'
    except OSError:
        pass
    return None


def describe_users(found, limit=8):
    parts = []
    for pid, cmd, ctr, how in found[:limit]:
        if pid == 0:
            parts.append(how)
            continue
        who = f'pid {pid} ({cmd}' + (f', container {ctr}' if ctr else '') + ')'
        parts.append(f'{who}: {how}')
    more = len(found) - limit
    return '; '.join(parts) + (f'; and {more} more' if more > 0 else '')


# -- loop devices ------------------------------------------------------------

def loops_backed_by(path):
    """/dev/loopN devices whose backing file is path (the kernel's name for
    it, which may end in ' (deleted)')."""
    out = []
    try:
        entries = os.listdir('/sys/block')
    except OSError:
        return out
    for dev in entries:
        if not dev.startswith('loop'):
            continue
        try:
            with open(f'/sys/block/{dev}/loop/backing_file') as f:
                backing = f.read().rstrip('\n')
        except OSError:
            continue
        if backing == path or backing == path + ' (deleted)':
            out.append('/dev/' + dev)
    return sorted(out)


def loop_attached(loop):
    return os.path.exists(f'/sys/block/{os.path.basename(loop)}/loop/backing_file')


def loop_dio(loop):
    try:
        with open(f'/sys/block/{os.path.basename(loop)}/loop/dio') as f:
            return f.read().strip() == '1'
    except OSError:
        return False


def devno(path):
    """(major, minor) of a block device node."""
    st = os.stat(path)
    if not stat.S_ISBLK(st.st_mode):
        raise OSError(f'{path} is not a block device')
    return (os.major(st.st_rdev), os.minor(st.st_rdev))


def run(argv, timeout=120, check=False, input=None):
    """Run a tool; CompletedProcess with text output (stdin closed)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          check=check, input=input,
                          stdin=None if input is not None else subprocess.DEVNULL)


def meminfo(key):
    """A /proc/meminfo figure in bytes (0 if absent)."""
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                name, _, rest = line.partition(':')
                if name == key:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
