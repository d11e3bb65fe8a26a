"""Several "hosts" on one machine, for tests and benchmarks that need more
than one (issue 39: a hybrid disk's RAM tier mirrored to a second host).

    with Network('mirror') as net:
        a, b = net.host('a'), net.host('b')
        ceph = net.ceph()                     # optional, ~20 s
        net.link('a', 'b', rate='100mbit')    # tbf, both directions
        srv = b.popen(['hvmemd', ...])        # runs inside host b
        a.run(['hostname']).stdout            # 'a\n'; b is at b.addr
        net.cut('b'); net.restore('b')        # a partition, not an error
        b.kill()                              # every process of b, at once
        b.restart()                           # same name, address, disk

The fabric.  A network namespace of its own holds one bridge; every node
(a host, the Ceph namespace, and the machine itself) has one veth pair to
it, with an address in 10.99.N.0/24 (N free on this machine, picked under a
lock): the machine .1, Ceph .2, hosts .11 up in creation order.  The bridge
lives in its own namespace, not the machine's, so the machine's firewall
(bridged traffic passes the FORWARD chain of the bridge's namespace when
br_netfilter is built in, as here, and podman/docker set that to DROP) never
sees host-to-host traffic, and deleting that one namespace removes every
port.  The machine keeps a port because scripts/ceph-cluster.sh runs the
`ceph` CLI from the machine, and so tests can talk to hosts directly.

Names.  Namespaces are /run/netns/hvn-PREFIX-PID-K-NODE (PID: the owner
process, K: its K-th Network), the machine's port is hvnPIDxK (15
characters at most); the interfaces inside namespaces are eth0 and, in the
fabric, br0 and p-NODE, private to their namespace, so nothing collides
when two tests or CI lanes run side by side.  Leftovers of an owner that is
gone (a killed run) are removed when any Network starts: processes in
those namespaces, the namespaces, the port, the work directory.

Shaping.  link(a, b, rate) puts a tbf on the traffic from a to b at a's
eth0 and from b to a at b's: an htb root classifies by destination address
(u32) into one class per shaped peer whose leaf qdisc is the tbf; traffic to
unshaped peers takes htb's direct queue, unshaped.  (This kernel has htb,
tbf, u32 and nothing else of the sort: no prio, no netem, no tc actions.)
Shaping at the sender keeps TCP's small-queue back-pressure, so a shaped
link is slow but loses nothing.

Partitions.  cut(host) detaches the host's port from the bridge: both ends
stay up and keep their carrier, packets go nowhere.  A TCP connection
stalls (retransmitting) and carries on after restore(); a connect() times
out instead of failing at once: a partition, not a local error.  (Setting
the link down instead would show the host a lost carrier: a local fault,
not a partition somewhere beyond it.)
cut(a, b) cuts only a<->b, with iptables DROP rules in both namespaces'
INPUT chains (dropping on OUTPUT would give the sender EPERM).

Hosts.  A host is a network namespace plus a PID, mount, UTS and IPC
namespace.  Its init (this file run with `_init`, pid 1 of the PID
namespace, started by `unshare --pid --fork` inside the host's net
namespace) mounts the host's RAM: fresh tmpfs on /run, /dev/shm, /tmp (and
on the Network's work directory, so a host does not see other hosts'
files), and its disk: the host's files directory (Host.files, on the
machine's disk) bound on /var/lib/hybridvm and at its own path, plus the
Network's `shared` and `ceph` directories.  /sys is left as it is (as
nsenter --net leaves it, and for the same reason as ceph-cluster.sh: a new
sysfs would hide the cgroup mounts).  Processes enter with nsenter into
all five namespaces of the init, in the host's files directory unless
told otherwise (a test's own temporary directory under /tmp does not exist
in a host: put what hosts need in Host.files or Network.shared).
Killing a host is SIGKILL to its init: the kernel then kills every process
of the PID namespace in the same instant, before any of them can see
another one go.  A killed host loses its RAM (the tmpfs mounts vanish with
the mount namespace) and its kernel state (the network namespace is
deleted and made anew on restart, with the same address and MAC, so no
socket of the old host ever answers), and keeps its disk (Host.files).

If the owning process dies (even by SIGKILL), its hosts die too: the
unshare holding a host's init gets SIGKILL from the kernel when the thread
that started it ends (PR_SET_PDEATHSIG), and takes the init with it
(--kill-child).  So start hosts from the main thread, or from a thread
that outlives them.

Needs root, util-linux (nsenter, unshare), iproute2 (ip, tc), iptables for
pairwise cuts.
"""

import atexit
import ctypes
import fcntl
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

NETNS_DIR = '/run/netns'
LOCK = '/run/lock/hvnet.lock'
WORK_PARENT = '/var/tmp'     # on disk: BlueStore needs O_DIRECT, tmpfs has none
RAM_PATHS = ('/run', '/dev/shm', '/tmp')
DISK_PATH = '/var/lib/hybridvm'
NETNS_RE = re.compile(r'^hvn-[A-Za-z0-9_]+-(\d+)-(\d+)-[a-z0-9]+$')
PORT_RE = re.compile(r'^hvn(\d+)x(\d+)$')
WORKDIR_RE = re.compile(r'^hvnet-[A-Za-z0-9_]+-(\d+)-(\d+)-')
NAME_RE = re.compile(r'^[a-z][a-z0-9]{0,9}$')
RESERVED = ('ceph', 'fabric', 'shared', 'machine', 'logs')

_counter = itertools.count()


def program_dirs():
    """What a host must still see of the machine's RAM paths: the tree, its
    build and this Python (a clean clone under /tmp, as CI may make, would
    otherwise vanish under the host's fresh /tmp)."""
    build = os.path.abspath(os.environ.get('HYBRIDVM_BUILD', os.path.join(REPO, 'build')))
    out = []
    for p in (REPO, build, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))):
        p = os.path.realpath(p)
        if os.path.isdir(p) and any(p == r or p.startswith(r + '/') for r in RAM_PATHS) \
                and p not in out:
            out.append(p)
    return out


def sh(*args, check=True, timeout=60, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                       timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f'{" ".join(map(str, args))}: exit {r.returncode}: '
                           f'{r.stderr.strip()}')
    return r


def _alive(pid):
    return os.path.exists(f'/proc/{pid}')


def _ns_inode(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def pids_in_ns(kind, path):
    """Pids (machine's numbering) of the processes in namespace `path`
    (a /run/netns file or a /proc/PID/ns/KIND link) of type `kind`."""
    try:
        want = _ns_inode(path)
    except OSError:
        return []
    out = []
    for d in os.listdir('/proc'):
        if not d.isdigit():
            continue
        try:
            if _ns_inode(f'/proc/{d}/ns/{kind}') == want:
                out.append(int(d))
        except OSError:
            pass
    return out


def _kill_all(pids):
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(pids, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p) and _state(p) != 'Z']
        if not left:
            return []
        time.sleep(0.01)
    return left


def _state(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _ppid(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return int(f.read().rsplit(')', 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _del_netns(name):
    path = os.path.join(NETNS_DIR, name)
    _kill_all(pids_in_ns('net', path))
    sh('ip', 'netns', 'del', name, check=False)


def sweep():
    """Remove what runs of this library left behind whose owner process is
    gone: processes in their namespaces, the namespaces, the machine's
    ports, the work directories.  Called by every Network at start."""
    if os.path.isdir(NETNS_DIR):
        dead = [n for n in os.listdir(NETNS_DIR)
                if (m := NETNS_RE.match(n)) and not _alive(int(m.group(1)))]
        victims = []
        for n in dead:
            victims += pids_in_ns('net', os.path.join(NETNS_DIR, n))
        _kill_all(victims)
        _wait_gone(victims, timeout=5)
        for n in dead:
            sh('ip', 'netns', 'del', n, check=False)
    for n in os.listdir('/sys/class/net'):
        m = PORT_RE.match(n)
        if m and not _alive(int(m.group(1))):
            sh('ip', 'link', 'del', n, check=False)
    for n in os.listdir(WORK_PARENT):
        m = WORKDIR_RE.match(n)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(WORK_PARENT, n), ignore_errors=True)


def _rate_bps(rate):
    """tc's rate syntax to bits/s (bit, kbit, mbit, gbit; bps... are bytes)."""
    m = re.fullmatch(r'(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?', rate.strip().lower())
    if not m:
        raise ValueError(f'rate {rate!r}: expected e.g. 100mbit')
    v = float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9, 't': 1e12}[m.group(2)]
    return v * 8 if m.group(3) == 'bps' else v


def _set_pdeathsig():
    """preexec_fn: SIGKILL when the parent thread ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)     # PR_SET_PDEATHSIG


class _Node:
    """A network namespace with one port on the fabric (eth0)."""

    def __init__(self, net, name, index):
        self.net = net
        self.name = name
        self.index = index
        self.addr = f'{net.prefix24}.{index}'
        self.netns = f'hvn-{net.prefix}-{net.id}-{name}'
        self.netns_path = os.path.join(NETNS_DIR, self.netns)
        self.port = f'p-{name}'
        self.mac = f'02:68:76:{net.subnet:02x}:{index:02x}:01'
        self.plugged = False

    def _plug(self):
        """Create the namespace and its port (same address and MAC every
        time: a rebooted host keeps its NIC)."""
        sh('ip', 'netns', 'add', self.netns)
        self.plugged = True
        f, n = self.net.fabric, self.netns
        sh('ip', '-n', n, 'link', 'set', 'lo', 'up')
        sh('ip', '-n', f, 'link', 'add', self.port, 'type', 'veth',
           'peer', 'name', 'eth0', 'netns', n)
        sh('ip', '-n', n, 'link', 'set', 'eth0', 'address', self.mac)
        sh('ip', '-n', n, 'addr', 'add', f'{self.addr}/24', 'dev', 'eth0')
        sh('ip', '-n', n, 'link', 'set', 'eth0', 'up')
        sh('ip', '-n', f, 'link', 'set', self.port, 'up')
        if self.name not in self.net._cut:
            self._attach()
        self._shape()
        for pair in self.net._pair_cuts:
            if self.name in pair:
                other, = pair - {self.name}
                self._drop_from(self.net.node(other).addr)

    def _unplug(self):
        if not self.plugged:
            return
        _kill_all(pids_in_ns('net', self.netns_path))
        # the port first, synchronously: a namespace is freed later, in the
        # background, and its veth with it, which would clash with the next
        # p-NAME of a restart
        sh('ip', '-n', self.net.fabric, 'link', 'del', self.port, check=False)
        sh('ip', 'netns', 'del', self.netns, check=False)
        self.plugged = False

    def _attach(self):
        sh('ip', '-n', self.net.fabric, 'link', 'set', self.port, 'master', 'br0')

    def _detach(self):
        sh('ip', '-n', self.net.fabric, 'link', 'set', self.port, 'nomaster')

    def _drop_from(self, addr, on=True):
        sh('nsenter', f'--net={self.netns_path}', 'iptables', '-w',
           '-I' if on else '-D', 'INPUT', '-s', f'{addr}/32', '-j', 'DROP')

    def _shape(self):
        """(Re)build eth0's qdiscs from the Network's links; a change drops
        what was queued (TCP retransmits it)."""
        n = self.netns
        sh('tc', '-n', n, 'qdisc', 'del', 'dev', 'eth0', 'root', check=False)
        peers = sorted((other, spec) for pair, spec in self.net._links.items()
                       if self.name in pair for other in pair - {self.name})
        if not peers:
            return
        sh('tc', '-n', n, 'qdisc', 'add', 'dev', 'eth0', 'root', 'handle', '1:', 'htb')
        for i, (other, (rate, burst)) in enumerate(peers, 1):
            # the class only sorts; the tbf below it is the bottleneck
            sh('tc', '-n', n, 'class', 'add', 'dev', 'eth0', 'parent', '1:',
               'classid', f'1:{i}', 'htb', 'rate', '40gbit', 'quantum', '60000')
            sh('tc', '-n', n, 'qdisc', 'add', 'dev', 'eth0', 'parent', f'1:{i}',
               'handle', f'{i + 10}:', 'tbf', 'rate', rate, 'burst', str(burst),
               'latency', '100ms')
            sh('tc', '-n', n, 'filter', 'add', 'dev', 'eth0', 'parent', '1:',
               'protocol', 'ip', 'prio', '1', 'u32', 'match', 'ip', 'dst',
               f'{self.net.node(other).addr}/32', 'flowid', f'1:{i}')

    def sent_to(self, other):
        """Bytes this node sent to `other` through the shaped link (tbf's
        counter; None when the pair is not shaped)."""
        peers = sorted(o for pair in self.net._links if self.name in pair
                       for o in pair - {self.name})
        if other not in peers:
            return None
        out = sh('tc', '-n', self.netns, '-s', 'qdisc', 'show', 'dev', 'eth0').stdout
        h = peers.index(other) + 11
        m = re.search(rf'qdisc tbf {h}: .*?Sent (\d+) bytes', out, re.S)
        return int(m.group(1)) if m else None

    def __repr__(self):
        return f'<{type(self).__name__} {self.name} {self.addr}>'


class HostProcess(subprocess.Popen):
    """A process inside a host: a Popen of the nsenter that started it (pid,
    wait(), returncode, pipes are nsenter's, which exits as its child did,
    or dies of the same signal), with send_signal/terminate/kill forwarded
    to the process itself (nsenter forwards nothing)."""

    def __init__(self, host, argv, cwd=None, **kw):
        self.host = host
        argv = [str(a) for a in argv]
        # nsenter's --wd opens the directory in the caller's mount namespace;
        # env -C changes to it inside the host
        super().__init__(host._enter_argv() + ['env', '-C', cwd or host.files, '--'] + argv,
                         **kw)
        self.argv = argv

    def _child(self, timeout=2.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(f'/proc/{self.pid}/task/{self.pid}/children') as f:
                    kids = f.read().split()
            except OSError:
                kids = []
            if kids:
                return int(kids[0])
            if self.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.002)

    @property
    def real_pid(self):
        """The process's pid in the machine's numbering (None once gone)."""
        return self._child()

    @property
    def ns_pid(self):
        """The process's pid inside its host."""
        pid = self._child()
        if pid is None:
            return None
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                if line.startswith('NSpid:'):
                    return int(line.split()[-1])

    def send_signal(self, sig):
        if self.poll() is not None:
            return
        pid = self._child()
        if pid is None:
            super().send_signal(sig)
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            if _ppid(pid) == self.pid:     # still nsenter's child, not a reused pid
                signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)


class Host(_Node):
    """One host: see the module's doc.  Attributes: name, addr, netns (for
    `ip netns`/nsenter --net, CEPH_NETNS), files (its disk, on the machine),
    pid (its init, machine numbering; None while down)."""

    def __init__(self, net, name, index):
        super().__init__(net, name, index)
        self.files = os.path.join(net.workdir, name)
        os.makedirs(self.files, exist_ok=True)
        self.pid = None
        self._init = None
        self._procs = []

    @property
    def up(self):
        return self._init is not None and self._init.poll() is None

    def _start(self):
        self._plug()
        cfg = dict(hostname=self.name,
                   tmpfs=list(RAM_PATHS) + [self.net.workdir],
                   binds=[[self.files, DISK_PATH]],
                   keep=[self.files, self.net.shared, self.net.ceph_dir] + program_dirs())
        log = open(os.path.join(self.net.logs, f'{self.name}-init.log'), 'ab')
        argv = ['nsenter', f'--net={self.netns_path}',
                'unshare', '--pid', '--fork', '--kill-child=SIGKILL', '--mount',
                '--uts', '--ipc', '--propagation', 'private',
                sys.executable, '-I', '-S', os.path.abspath(__file__), '_init',
                json.dumps(cfg)]
        self._init = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=log,
                                      preexec_fn=_set_pdeathsig)
        log.close()
        line = self._init.stdout.readline().decode()
        self._init.stdout.close()
        if not line.startswith('ready '):
            self._init.wait(10)
            with open(os.path.join(self.net.logs, f'{self.name}-init.log')) as f:
                err = f.read()[-2000:]
            self._init = None
            raise RuntimeError(f'host {self.name} did not start: {err}')
        self.pid = int(line.split()[1])
        self._procs = []

    def _enter_argv(self):
        if not self.up:
            raise RuntimeError(f'host {self.name} is down')
        return ['nsenter', f'--target={self.pid}', '--net', '--pid', '--mount',
                '--uts', '--ipc']

    def popen(self, argv, **kw):
        """subprocess.Popen's arguments; the process runs in the host, in
        cwd (default: the host's files directory; the caller's may not
        exist in the host)."""
        p = HostProcess(self, argv, **kw)
        self._procs.append(p)
        return p

    def run(self, argv, check=True, timeout=60, input=None, capture_output=True,
            text=True, **kw):
        """subprocess.run inside the host (output captured, text, by default);
        on timeout the process itself is killed."""
        if input is not None:
            kw['stdin'] = subprocess.PIPE
        if capture_output:
            kw.setdefault('stdout', subprocess.PIPE)
            kw.setdefault('stderr', subprocess.PIPE)
        with self.popen(argv, text=text, **kw) as p:
            try:
                out, err = p.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                raise
        r = subprocess.CompletedProcess(p.argv, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    def pids(self):
        """Pids (machine numbering) of every process of the host."""
        if self.pid is None:
            return []
        try:
            return pids_in_ns('pid', f'/proc/{self.pid}/ns/pid')
        except OSError:
            return []

    def kill(self, silent=True):
        """Every process of the host dies at once (SIGKILL to its PID
        namespace's init), then its kernel state goes (the net namespace).
        silent: cut the host's link first, so that peers see what they see
        when a machine loses power: nothing (no FIN, no RST), only
        silence until they time out or the host is back (restart()), whose
        kernel then answers their retransmissions with RST.  With
        silent=False the dying processes' sockets are closed as usual (FIN
        or RST reach the peers)."""
        if not self.plugged and self._init is None:
            return
        if silent and self.plugged and self.name not in self.net._cut:
            self._detach()
        if self._init is not None:
            if self._init.poll() is None and self.pid:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self._init.wait(30)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f'host {self.name}: init {self.pid} did not die')
        # nsenters exit as soon as their child is gone
        for p in self._procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self._init = None
        self.pid = None
        self._unplug()

    def restart(self):
        """A fresh host: killed first if up; same name, address, MAC and
        files; empty /run, /dev/shm, /tmp; new namespaces and init."""
        self.kill()
        self._start()
        return self


class Network:
    """The fabric, its hosts and optionally a Ceph cluster: see the module's
    doc.  prefix: a word in namespace names (letters, digits, _); workdir:
    where hosts' files, the shared and ceph directories and logs go
    (default: a new directory under /var/tmp, removed at close unless
    keep=True; a given one is kept)."""

    def __init__(self, prefix='hv', workdir=None, keep=False):
        if not re.fullmatch(r'[A-Za-z0-9_]{1,16}', prefix):
            raise ValueError(f'prefix {prefix!r}: letters, digits, _ only')
        self.prefix = prefix
        self.id = f'{os.getpid()}-{next(_counter)}'
        self.nodes = {}
        self.hosts = {}
        self._links = {}
        self._cut = set()
        self._pair_cuts = set()
        self._ceph = None
        self._ceph_node = None
        self._fabric_made = False
        self.uplink = None
        self.subnet = None
        self._own_workdir = workdir is None
        self.keep = keep or not self._own_workdir
        if workdir is None:
            workdir = tempfile.mkdtemp(prefix=f'hvnet-{prefix}-{self.id}-', dir=WORK_PARENT)
        self.workdir = os.path.abspath(workdir)
        self.shared = os.path.join(self.workdir, 'shared')
        self.ceph_dir = os.path.join(self.workdir, 'ceph')
        self.logs = os.path.join(self.workdir, 'logs')
        for d in (self.shared, self.ceph_dir, self.logs):
            os.makedirs(d, exist_ok=True)
        self.fabric = f'hvn-{prefix}-{self.id}-fabric'
        self.closed = False
        atexit.register(self.close)
        try:
            self._make_fabric()
        except BaseException:
            self.close()
            raise

    def _make_fabric(self):
        os.makedirs(os.path.dirname(LOCK), exist_ok=True)
        with open(LOCK, 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep()
            used = sh('ip', '-4', '-o', 'addr', 'show').stdout + \
                sh('ip', '-4', 'route', 'show', 'table', 'all').stdout
            start = os.getpid() % 200
            for i in range(254):
                n = (start + i) % 254 + 1
                if f'10.99.{n}.' not in used:
                    break
            else:
                raise RuntimeError('no free 10.99.N.0/24 on this machine')
            self.subnet = n
            self.prefix24 = f'10.99.{n}'
            sh('ip', 'netns', 'add', self.fabric)
            self._fabric_made = True
            f = self.fabric
            sh('ip', '-n', f, 'link', 'set', 'lo', 'up')
            sh('ip', '-n', f, 'link', 'add', 'br0', 'type', 'bridge', 'stp_state', '0')
            sh('ip', '-n', f, 'link', 'set', 'br0', 'up')
            self.uplink = f'hvn{os.getpid()}x{self.id.split("-")[1]}'
            sh('ip', '-n', f, 'link', 'add', 'p-machine', 'type', 'veth',
               'peer', 'name', self.uplink, 'netns', str(os.getpid()))
            sh('ip', 'addr', 'add', f'{self.prefix24}.1/24', 'dev', self.uplink)
            sh('ip', 'link', 'set', self.uplink, 'up')
            sh('ip', '-n', f, 'link', 'set', 'p-machine', 'master', 'br0', 'up')
        self.machine_addr = f'{self.prefix24}.1'

    def node(self, name):
        """A host or 'ceph' by name (a node object passes through)."""
        if isinstance(name, _Node):
            return name
        if name not in self.nodes:
            raise KeyError(f'no node {name!r}')
        return self.nodes[name]

    def host(self, name):
        """A new host, started."""
        if not NAME_RE.match(name) or name in RESERVED:
            raise ValueError(f'host name {name!r}: [a-z][a-z0-9]{{0,9}}, not {RESERVED}')
        if name in self.nodes:
            raise ValueError(f'host {name} exists')
        h = Host(self, name, 11 + len(self.hosts))
        self.nodes[name] = self.hosts[name] = h
        h._start()
        return h

    def link(self, a, b, rate=None, burst=None):
        """Shape a<->b to `rate` (tc syntax: '100mbit'; None: unshaped)
        each way; burst (bytes) defaults to 10 ms at the rate, 64 KiB at
        least (a TSO segment must fit)."""
        a, b = self.node(a), self.node(b)
        if a is b:
            raise ValueError('a link joins two nodes')
        key = frozenset((a.name, b.name))
        if rate is None:
            self._links.pop(key, None)
        else:
            burst = burst or max(64 << 10, int(_rate_bps(rate) / 8 / 100))
            self._links[key] = (rate, burst)
        for n in (a, b):
            if n.plugged:
                n._shape()

    def cut(self, a, b=None):
        """Partition: a from everyone (b None) or a from b only."""
        a = self.node(a)
        if b is None:
            if a.name not in self._cut:
                self._cut.add(a.name)
                if a.plugged:
                    a._detach()
            return
        b = self.node(b)
        key = frozenset((a.name, b.name))
        if key not in self._pair_cuts:
            self._pair_cuts.add(key)
            for x, y in ((a, b), (b, a)):
                if x.plugged:
                    x._drop_from(y.addr)

    def restore(self, a, b=None):
        """Undo cut(a) or cut(a, b)."""
        a = self.node(a)
        if b is None:
            if a.name in self._cut:
                self._cut.discard(a.name)
                if a.plugged:
                    a._attach()
            return
        b = self.node(b)
        key = frozenset((a.name, b.name))
        if key in self._pair_cuts:
            self._pair_cuts.discard(key)
            for x, y in ((a, b), (b, a)):
                if x.plugged:
                    x._drop_from(y.addr, on=False)

    def ceph(self, port=3301, op_timeout=20):
        """The single-node Ceph cluster (scripts/ceph-cluster.sh) in a
        namespace of its own, node 'ceph' at .2, started (the first call;
        later calls return it).  Its directory (ceph.conf, keyrings) is
        visible in every host at the same path.  Raises unittest.SkipTest
        with hvlib.ceph's reason when Ceph is not installed."""
        if self._ceph:
            return self._ceph
        sys.path.insert(0, os.path.dirname(HERE))
        from hvlib.ceph import CephCluster, unavailable
        from hvlib.paths import BuildPaths
        qemu_img = os.path.join(BuildPaths().bin, 'qemu-img')
        if not os.access(qemu_img, os.X_OK):
            raise unittest.SkipTest(f'{qemu_img} is missing: run "make" first')
        why = unavailable(qemu_img)
        if why:
            raise unittest.SkipTest(why)
        node = _Node(self, 'ceph', 2)
        self.nodes['ceph'] = self._ceph_node = node
        node._plug()
        # the cluster writes into ceph_dir, which hosts see; start it there
        cluster = CephCluster(self.ceph_dir, port=port, op_timeout=op_timeout,
                              addr=node.addr, netns=node.netns)
        self._ceph = cluster
        cluster.start()
        return cluster

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Kill every host, stop Ceph, remove namespaces, ports and (unless
        kept) the work directory.  Raises if something stayed."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        errors = []
        for h in self.hosts.values():
            try:
                h.kill(silent=False)
            except Exception as e:      # noqa: BLE001 - go on tearing down
                errors.append(f'host {h.name}: {e}')
        if self._ceph:
            try:
                self._ceph.stop()
            except Exception as e:      # noqa: BLE001
                errors.append(f'ceph: {e}')
        for n in self.nodes.values():
            n._unplug()
        if self._fabric_made:
            if self.uplink:
                sh('ip', 'link', 'del', self.uplink, check=False)
            _del_netns(self.fabric)
        if self._own_workdir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        left = [n for n in os.listdir(NETNS_DIR)] if os.path.isdir(NETNS_DIR) else []
        left = [n for n in left if n.startswith(f'hvn-{self.prefix}-{self.id}-')]
        if left:
            errors.append(f'namespaces left: {left}')
        if errors:
            raise RuntimeError('Network.close: ' + '; '.join(errors))


# --- the init of a host (pid 1 of its PID namespace) ---

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND = 2, 4, 8, 4096
MNT_DETACH = 2


def _unescape(path):
    return re.sub(r'\\([0-7]{3})', lambda m: chr(int(m.group(1), 8)), path)


def _init_main(cfg):
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(src, dst, fstype, flags, data=None):
        enc = (lambda s: s.encode() if s is not None else None)
        if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f'mount {src} on {dst}: {os.strerror(e)}')

    # our pid on the machine: the machine's /proc is still the one mounted
    with open('/proc/self/status') as f:
        outer = next(line.split()[1] for line in f if line.startswith('NSpid:'))
    socket.sethostname(cfg['hostname'])
    # what stays visible, held before anything covers it
    binds = [(os.open(src, os.O_PATH | os.O_DIRECTORY), dst) for src, dst in cfg['binds']]
    binds += [(os.open(p, os.O_PATH | os.O_DIRECTORY), p) for p in cfg['keep']]
    with open('/proc/self/mountinfo') as f:
        mounted = [_unescape(line.split()[4]) for line in f]
    for p in sorted(cfg['tmpfs'], key=lambda p: p.count('/')):
        # drop the copies of the machine's mounts there (they would pin
        # /run/netns files and other tests' mounts for as long as we live)
        under = [m for m in mounted if m == p or m.startswith(p.rstrip('/') + '/')]
        for m in sorted(under, key=len, reverse=True):
            libc.umount2(m.encode(), MNT_DETACH)
        os.makedirs(p, exist_ok=True)
        mode = '1777' if p in ('/tmp', '/dev/shm') else '755'
        mount('tmpfs', p, 'tmpfs', MS_NOSUID | MS_NODEV, f'mode={mode}')
    for fd, dst in binds:
        os.makedirs(dst, exist_ok=True)
        mount(f'/proc/self/fd/{fd}', dst, None, MS_BIND)
        os.close(fd)
    mount('proc', '/proc', 'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir('/')
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    os.write(1, f'ready {outer}\n'.encode())
    null = os.open('/dev/null', os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    # reap the orphans that come to us, forever; SIGKILL from the machine
    # ends it (pid 1 ignores everything else from inside)
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        signal.sigwait({signal.SIGCHLD})


if __name__ == '__main__' and sys.argv[1:2] == ['_init']:
    _init_main(json.loads(sys.argv[2]))
