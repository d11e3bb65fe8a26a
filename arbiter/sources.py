"""What the arbiter measures: the containers' completed I/O (their cgroup's
counters, v1 blkio or v2 io.stat), their stall time (v2 io.pressure), the
latency a container-path request sees on the device (a probe), and a VM
disk's IOPS and latency histogram (QEMU's blockstats).  Each reader is
bounded and turns a missing or malformed file into SourceError.
"""

import os
import subprocess
import sys
import threading

MAX_FILE = 1 << 20


class SourceError(Exception):
    pass


class ShapeError(SourceError):
    """A reply not of the shape QEMU's schema gives it (the wrong type at
    some level, a counter out of range): the peer is not QEMU, or not sane."""


READ_CHUNK = 1 << 16


def read_small(path):
    """The text of a file of at most MAX_FILE bytes (a cgroup's or /proc's),
    read in chunks of what it holds: each period reads a few of every
    container's, and one read of MAX_FILE + 1 bytes allocated (and freed)
    a 1 MiB buffer for a file of a few hundred bytes, four times the cost
    of the read itself (bench/arbiter-scale.py)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SourceError(f'{path}: {e.strerror}') from None
    chunks, size = [], 0
    try:
        while size <= MAX_FILE:
            d = os.read(fd, READ_CHUNK)
            if not d:
                break
            chunks.append(d)
            size += len(d)
    except OSError as e:
        raise SourceError(f'{path}: {e.strerror}') from None
    finally:
        os.close(fd)
    if size > MAX_FILE:
        raise SourceError(f'{path}: larger than {MAX_FILE} bytes')
    return b''.join(chunks).decode('ascii', 'replace')


def device_number(path):
    """'major:minor' of a block device."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SourceError(f'{path}: {e.strerror}') from None
    import stat
    if not stat.S_ISBLK(st.st_mode):
        raise SourceError(f'{path}: not a block device')
    return f'{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}'


def cgroup_io(cgroup, devno):
    """(operations, bytes) completed so far by the cgroup on the device:
    v1 blkio.throttle.io_serviced / io_service_bytes (the _recursive files:
    a container's own children count), or v2 io.stat."""
    v1 = os.path.join(cgroup, 'blkio.throttle.io_serviced_recursive')
    if os.path.exists(v1):
        ops = _v1_total(read_small(v1), devno)
        nbytes = _v1_total(read_small(os.path.join(
            cgroup, 'blkio.throttle.io_service_bytes_recursive')), devno)
        return ops, nbytes
    v2 = os.path.join(cgroup, 'io.stat')
    if os.path.exists(v2):
        for line in read_small(v2).splitlines():
            f = line.split()
            if f and f[0] == devno:
                kv = dict(x.split('=', 1) for x in f[1:] if '=' in x)
                try:
                    return (int(kv.get('rios', 0)) + int(kv.get('wios', 0)),
                            int(kv.get('rbytes', 0)) + int(kv.get('wbytes', 0)))
                except ValueError:
                    raise SourceError(f'{v2}: malformed line {line[:80]!r}') from None
        return 0, 0
    if not os.path.isdir(cgroup):
        raise SourceError(f'{cgroup}: cgroup is gone')
    raise SourceError(f'{cgroup}: neither blkio (v1) nor io (v2) statistics')


# cgroup v1's blk-throttle counts a group's I/O (io_serviced, bytes) only
# while the group has a rule on the device; a rule at this many IOPS holds
# nothing back (0 would remove it).
V1_NOOP_IOPS = 4294967294


def v1_enable_accounting(cgroup, devno):
    """Give a v1 blkio group a no-op rule on the device, in both
    directions, unless it has one.  Returns the files it wrote (to undo)."""
    done = []
    for d in ('read', 'write'):
        path = os.path.join(cgroup, f'blkio.throttle.{d}_iops_device')
        if not os.path.exists(path):
            return done
        if any(line.split()[:1] == [devno] for line in read_small(path).splitlines()):
            continue
        try:
            with open(path, 'w') as f:
                f.write(f'{devno} {V1_NOOP_IOPS}')
        except OSError as e:
            raise SourceError(f'{path}: {e.strerror}') from None
        done.append(path)
    return done


def v1_disable_accounting(paths, devno):
    for path in paths:
        try:
            with open(path, 'w') as f:
                f.write(f'{devno} 0')
        except OSError:
            pass            # the group is gone: nothing to undo


def _v1_total(text, devno):
    for line in text.splitlines():
        f = line.split()
        if len(f) == 3 and f[0] == devno and f[1] == 'Total':
            try:
                return int(f[2])
            except ValueError:
                break
    return 0


def io_pressure_us(cgroup):
    """Total microseconds in which some task of the cgroup stalled on I/O
    (PSI, the 'some' line's total=)."""
    path = os.path.join(cgroup, 'io.pressure')
    if not os.path.isdir(cgroup):
        raise SourceError(f'{cgroup}: cgroup is gone')
    for line in read_small(path).splitlines():
        if line.startswith('some '):
            for kv in line.split()[1:]:
                if kv.startswith('total='):
                    try:
                        return int(kv[6:])
                    except ValueError:
                        break
    raise SourceError(f'{path}: no "some ... total=" line')


def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


class Probe(threading.Thread):
    """The latency a container-path request sees: 4 KiB O_DIRECT reads at
    random aligned offsets of the device, probe_iops a second, one at a
    time, made and timed by a process of its own at real-time priority
    (probe_worker.py says why); this thread keeps the last window_s seconds
    of its latencies, and starts it again (after 1 s) if it dies.  It reads
    only, and at 200/s costs 0.8 MB/s."""

    WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'probe_worker.py')
    MAX_LINE = 512

    def __init__(self, path, iops, window_s):
        super().__init__(name='probe', daemon=True)
        self.path, self.iops, self.window = path, iops, window_s
        self.samples = []           # (t, latency_s)
        self.lock = threading.Lock()
        self.error = None
        self.policy = None          # the worker's scheduling: fifo, nice-10, normal
        self.restarts = 0
        self.proc = None
        self.stop_ev = threading.Event()
        # The same checks the worker makes, so a bad device fails here.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            raise SourceError(f'{path}: cannot open for the latency probe: {e.strerror}') \
                from None
        os.close(fd)

    def spawn(self):
        return subprocess.Popen([sys.executable, '-I', self.WORKER, self.path, str(self.iops),
                                 str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, close_fds=True)

    def record(self, line):
        """One line of the worker's output; anything malformed is an error."""
        kind, _, rest = line.partition(' ')
        if kind == 'S':
            try:
                t, lat = (float(x) for x in rest.split())
            except ValueError:
                self.error = f'probe: malformed line {line[:80]!r}'
                return
            with self.lock:
                self.samples.append((t, lat))
                cut = t - self.window
                i = 0
                while i < len(self.samples) and self.samples[i][0] < cut:
                    i += 1
                if i:
                    del self.samples[:i]
            self.error = None
        elif kind == 'E':
            self.error = rest[:200]
        elif kind == 'P':
            self.policy = rest[:16]
        else:
            self.error = f'probe: malformed line {line[:80]!r}'

    def run(self):
        while not self.stop_ev.is_set():
            try:
                self.proc = self.spawn()
            except OSError as e:
                self.error = f'probe: cannot start {self.WORKER}: {e.strerror}'
                self.stop_ev.wait(1.0)
                continue
            for raw in iter(lambda: self.proc.stdout.readline(self.MAX_LINE), b''):
                self.record(raw.decode('ascii', 'replace').strip())
            self.proc.stdout.close()
            rc = self.proc.wait()
            if self.stop_ev.is_set():
                break
            self.restarts += 1
            if self.error is None:
                self.error = f'probe: its process exited ({rc})'
            self.stop_ev.wait(1.0)

    def window_stats(self, pct=99.0, since=None):
        """p50, p99 and the pct-th percentile (pct_ms) of the window, or of
        its samples taken at or after since (monotonic s), if given."""
        with self.lock:
            lat = [x for t, x in self.samples if since is None or t >= since]
        if not lat:
            return dict(samples=0, p50_ms=None, p99_ms=None, pct_ms=None)
        lat.sort()
        n = len(lat)
        return dict(samples=n, p50_ms=lat[min(n - 1, int(0.50 * n))] * 1e3,
                    p99_ms=lat[min(n - 1, int(0.99 * n))] * 1e3,
                    pct_ms=lat[min(n - 1, int(pct / 100 * n))] * 1e3)

    def stop(self):
        self.stop_ev.set()
        p = self.proc
        if p and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
        self.join(timeout=5)


# Latency histogram bins set on every VM disk (ns): log-spaced, 50 us..5 s.
HIST_NS = [int(x * 1000) for x in (
    50, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 7500, 10000, 15000,
    20000, 30000, 50000, 75000, 100000, 200000, 500000, 1000000, 2000000, 5000000)]


def hist_percentile(bins, q, bounds=HIST_NS):
    """The q-quantile (ms) of a histogram of len(bounds)+1 bins, linearly
    interpolated inside its bin; None if empty.  The last bin is open: its
    quantile is reported as its lower bound."""
    total = sum(bins)
    if total <= 0:
        return None
    want = q * total
    acc = 0
    for i, n in enumerate(bins):
        if n and acc + n >= want:
            lo = bounds[i - 1] if i > 0 else 0
            if i >= len(bounds):
                return lo / 1e6
            hi = bounds[i]
            return (lo + (hi - lo) * (want - acc) / n) / 1e6
        acc += n
    return bounds[-1] / 1e6


MAX_DISKS = 1024        # entries of query-blockstats looked at
MAX_NAME = 1024         # a disk's name (QEMU's qdev paths are far shorter)
COUNTER_MAX = 1 << 64   # QEMU's counters are 64-bit


def counter(v, what):
    """A 64-bit counter of QEMU's (bool, float and the rest are refused)."""
    if type(v) is not int:
        raise ShapeError(f'{what} is not an integer ({type(v).__name__})')
    if not 0 <= v < COUNTER_MAX:
        raise ShapeError(f'{what} is outside [0, 2^64)')
    return v


def vm_disk_sample(stats, device):
    """From query-blockstats' reply: the entry of 'device' (qdev id or
    BlockBackend name; the first if None) as (name, ops, bytes, histogram
    bins or None).  ShapeError for a reply QEMU would not give (the entries
    up to the disk's are checked, its statistics whole); SourceError if
    the disk is not there."""
    if not isinstance(stats, list):
        raise ShapeError('not a list')
    for e in stats[:MAX_DISKS]:
        if not isinstance(e, dict):
            raise ShapeError('an entry is not an object')
        names = [e.get(k) for k in ('qdev', 'device', 'node-name')]
        if any(n is not None and (not isinstance(n, str) or len(n) > MAX_NAME) for n in names):
            raise ShapeError(f'a disk name is not a string of at most {MAX_NAME} characters')
        qdev = names[0] or ''
        # a qdev id names the device; its BlockBackend hangs off a child of
        # it (a virtio proxy's virtio-backend): /machine/peripheral/ID/...
        if device is not None and device not in names and \
                not (qdev + '/').startswith(f'/machine/peripheral/{device}/'):
            continue
        name = next((n for n in names if n), None)
        if name is None:
            raise ShapeError('a disk without a name')
        s = e.get('stats')
        if not isinstance(s, dict):
            raise ShapeError(f'{name}: stats is not an object')
        ops = sum(counter(s.get(k), f'{name}: {k}') for k in ('rd_operations', 'wr_operations'))
        nbytes = sum(counter(s.get(k), f'{name}: {k}') for k in ('rd_bytes', 'wr_bytes'))
        bins = None
        for h in ('rd_latency_histogram', 'wr_latency_histogram'):
            hh = s.get(h)
            if hh is None:
                continue
            if not isinstance(hh, dict) or not isinstance(hh.get('bins'), list):
                raise ShapeError(f'{name}: {h} is not an object with a list of bins')
            if len(hh['bins']) != len(HIST_NS) + 1:
                continue            # bins set by someone else: not ours to read
            b = [counter(x, f'{name}: {h} bin') for x in hh['bins']]
            bins = b if bins is None else [x + y for x, y in zip(bins, b)]
        return name, ops, nbytes, bins
    raise SourceError(f'no disk {device!r} in query-blockstats' if device
                      else 'no disk in query-blockstats')
