"""Private libvirtd instances on one machine, for migration tests through virsh.

Each instance runs in its own mount namespace (`unshare -m --propagation private`)
with private copies of libvirt's directories bind-mounted over the system ones,
a distinct host UUID and its own migration port range (see PLATFORM.md).  The
mounts exist only inside the namespace, so they vanish with its last process;
stop() destroys the instance's domains, then its daemons, and kills any QEMU
left behind, so nothing outlives a test.

Each instance runs with libvirt's default security settings: QEMU as
libvirt-qemu under the DAC driver (no AppArmor/SELinux on this kernel), so
what QEMU opens by path must be reachable by that user: qemu_dir() makes the
directories the tests keep such files in (docs/libvirt.rst, "Security: DAC").
"""
import glob
import grp
import json
import os
import pwd
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from xml.sax.saxutils import escape, quoteattr

from .vm import Console

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What systemd gives libvirtd.service (and so its hooks) as PATH.
SERVICE_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'

# The parent of each libvirtd: a child subreaper (prctl PR_SET_CHILD_SUBREAPER)
# that reaps at once every process orphaned below it.  libvirtd daemonizes
# QEMU, so QEMU's parent is the nearest subreaper, else PID 1; the init of
# this machine reaps orphans a second or two late, and until then libvirt
# waits for the zombie (virProcessKillPainfully): 1-2 s of every `virsh
# destroy`, of every emulator probe (3.6-4.4 s without the reaper, 0.6-1.3 s
# with it) and of the source's Confirm phase of every migration (after the
# guest runs on the destination, before `virsh migrate` returns).  argv[1:] is
# the command (libvirtd); the reaper forwards SIGTERM/SIGINT to it and exits
# with its status.
REAPER = r"""
import ctypes, os, signal, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
    sys.exit('reaper: prctl(PR_SET_CHILD_SUBREAPER): ' + os.strerror(ctypes.get_errno()))
child = subprocess.Popen(sys.argv[1:])
def forward(sig, _frame):
    try:
        child.send_signal(sig)
    except ProcessLookupError:
        pass
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
code = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == child.pid:
        child.returncode = code = os.waitstatus_to_exitcode(status)
        break
sys.exit(code)
"""

BIND_DIRS = {  # system path -> name of the private copy
    '/etc/libvirt': 'etc',
    '/run/libvirt': 'run',
    '/var/lib/libvirt': 'lib',
    '/var/cache/libvirt': 'cache',
    '/var/log/libvirt': 'log',
    '/etc/hybridvm': 'hybridvm-etc',    # the hook's libvirt-hook.conf
}


# QEMU's DAC label under libvirt's defaults: Debian builds libvirt with
# qemu_user and qemu_group libvirt-qemu (the user's primary group is kvm,
# which QEMU keeps as a supplementary group).
QEMU_USER = 'libvirt-qemu'
QEMU_GROUP = 'libvirt-qemu'


class LibvirtError(Exception):
    pass


def qemu_ids():
    """(uid, gid) QEMU runs as under libvirt's defaults."""
    return pwd.getpwnam(QEMU_USER).pw_uid, grp.getgrnam(QEMU_GROUP).gr_gid


def qemu_dir(prefix='hv-lv-', parent=None):
    """A new directory (mkdtemp) that libvirt's QEMU may reach files in:
    root's, mode 0710, group QEMU_GROUP.  QEMU can pass through it but not
    list it, write in it or reach anything the files in it do not allow
    (what libvirt's DAC driver or our hook gives QEMU's user, it opens)."""
    d = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chown(d, 0, qemu_ids()[1])
    os.chmod(d, 0o710)
    return d


def libvirt_available():
    """None when libvirtd, virtlogd and virsh are installed, else the reason."""
    for tool in ('libvirtd', 'virtlogd', 'virsh', 'unshare'):
        if not shutil.which(tool, path=os.environ.get('PATH', '') + ':/usr/sbin:/sbin'):
            return f'{tool} is not installed'
    if os.geteuid() != 0:
        return 'private libvirtd instances need root (mount namespaces)'
    try:
        qemu_ids()
    except KeyError:
        return f'no user and group {QEMU_USER} for libvirt\'s QEMU (libvirt-daemon-system)'
    return None


def postcopy_unavailable():
    """None when QEMU as libvirt-qemu can take a post-copy migration, else
    why not: the destination needs userfaultfd, which an unprivileged process
    gets with vm.unprivileged_userfaultfd = 1 (libvirt's
    qemu-postcopy-migration.sysctl; libvirt 9.0 gives QEMU no
    /dev/userfaultfd)."""
    try:
        with open('/proc/sys/vm/unprivileged_userfaultfd') as f:
            if f.read().strip() == '1':
                return None
    except OSError:
        return None  # a kernel without the knob lets everyone use it
    return ('post-copy with QEMU as libvirt-qemu needs vm.unprivileged_userfaultfd = 1 '
            '(scripts/setup-host.sh installs libvirt\'s qemu-postcopy-migration.sysctl)')


def random_ports():
    """A base for migration port ranges (base to base + 99) that tests and CI
    jobs running side by side are unlikely to share."""
    return random.randrange(20000, 60000, 100)


HOOK_CONF = 'libvirt-hook.conf'


def make_hooks_dir(parent, reserve, conf='', layout='plain'):
    """A new hooks directory under `parent`, for LibvirtHost's hooks_dir: our
    hook as `make install-hook` installs it (its library in a new prefix under
    `parent`), as /etc/libvirt/hooks/qemu ('plain') or as `make install` lays
    it out ('qemu.d': hooks/qemu.d/50-hybridvm), and beside it the hook's
    configuration, libvirt-hook.conf (LibvirtHost puts it in its private
    /etc/hybridvm): [memory] reserve = `reserve`, then `conf` (more
    sections, as text)."""
    d = tempfile.mkdtemp(prefix='hooks-', dir=parent)
    prefix = tempfile.mkdtemp(prefix='prefix-', dir=parent)
    subprocess.run(['make', '-s', '-C', REPO, 'install-hook', f'HOOKS_DIR={d}', f'PREFIX={prefix}',
                    f'SYSCONFDIR={prefix}/etc'], check=True, capture_output=True)
    if layout == 'plain':
        os.rename(os.path.join(d, 'qemu.d', '50-hybridvm'), os.path.join(d, 'qemu'))
        os.rmdir(os.path.join(d, 'qemu.d'))
    with open(os.path.join(d, HOOK_CONF), 'w') as f:
        f.write(f'[memory]\nreserve = {reserve}\n{conf}')
    return d


class LibvirtHost:
    """One libvirtd instance: `uri` is what virsh -c takes.  Without
    migration_ports (lo, hi) it takes 50 ports from random_ports().  With
    `host` (an hvlib.hosts.Host) the daemons run inside that host (`root`
    must be where the host sees it, e.g. under host.files): killing the
    host kills them and their QEMUs, and pids (qemu_pids()) are the host's
    own numbering, which stop() never signals from here."""

    def __init__(self, name, root, migration_ports=None, hooks_dir=None, host=None):
        self.name = name
        self.host = host
        self.root = root
        if migration_ports is None:
            base = random_ports()
            migration_ports = (base, base + 49)
        self.migration_ports = migration_ports
        self.hooks_dir = hooks_dir
        self.host_uuid = str(uuid.uuid4())
        self.uri = f'qemu+unix:///system?socket={root}/run/libvirt-sock'
        self._proc = None
        self._log = None

    def _dir(self, key):
        return os.path.join(self.root, key)

    def _configure(self):
        os.makedirs(self.root, exist_ok=True)
        # The instance's own state (its /etc/libvirt above all): QEMU sees it
        # through the bind mounts, where libvirt lays it out for QEMU's user.
        os.chmod(self.root, 0o700)
        for src, key in BIND_DIRS.items():
            dst = self._dir(key)
            shutil.rmtree(dst, ignore_errors=True)
            if src == '/etc/libvirt' and os.path.isdir(src):
                shutil.copytree(src, dst, symlinks=True)
            else:
                os.makedirs(dst)
        etc = self._dir('etc')
        with open(os.path.join(etc, 'libvirtd.conf'), 'w') as f:
            f.write(f'auth_unix_rw = "none"\nauth_unix_ro = "none"\n'
                    f'unix_sock_group = "root"\nhost_uuid = "{self.host_uuid}"\n'
                    f'log_outputs = "3:file:/var/log/libvirt/libvirtd.log"\n')
        # libvirt's defaults otherwise: QEMU as libvirt-qemu, the DAC security
        # driver relabelling what it knows (remember_owner restores it), QEMU's
        # output through virtlogd (into the log/qemu/NAME.log the tests read).
        # The migration ports are what an instance needs of its own: two of
        # them (and other tests' pairs) on one host.
        lo, hi = self.migration_ports
        with open(os.path.join(etc, 'qemu.conf'), 'w') as f:
            f.write(f'migration_port_min = {lo}\nmigration_port_max = {hi}\n')
        hooks = os.path.join(etc, 'hooks')
        shutil.rmtree(hooks, ignore_errors=True)
        if self.hooks_dir:
            shutil.copytree(self.hooks_dir, hooks, symlinks=True,
                            ignore=shutil.ignore_patterns(HOOK_CONF))
            conf = os.path.join(self.hooks_dir, HOOK_CONF)
            if os.path.exists(conf):
                shutil.copy(conf, os.path.join(self._dir('hybridvm-etc'), HOOK_CONF))
        else:
            os.makedirs(hooks)

    def start(self, timeout=60):
        self._configure()
        for src in BIND_DIRS:
            os.makedirs(src, exist_ok=True)  # mount points must exist on the host
        binds = ' && '.join(f'mount --bind {self._dir(k)} {src}' for src, k in BIND_DIRS.items())
        # Pid files default to /run/*.pid, shared by all instances: keep them private.
        # (made again inside: a host's /run is its own)
        script = (f'set -e; mkdir -p {" ".join(BIND_DIRS)}; {binds}; virtlogd -d -p /run/libvirt/virtlogd.pid; '
                  'exec libvirtd -p /run/libvirt/libvirtd.pid')
        self._log = open(os.path.join(self.root, 'daemon.log'), 'ab')
        # The PATH systemd gives libvirtd.service, not ours: hooks run `#!/usr/bin/env python3`,
        # which on a PATH with a pyenv shim first costs 0.1 s more per call (4 calls on a
        # migration's destination, before the migration starts).
        env = dict(os.environ, PATH=SERVICE_PATH)
        # Under the reaper (REAPER), QEMU processes that libvirtd stops are reaped at once.
        popen = self.host.popen if self.host else subprocess.Popen
        self._proc = popen(
            ['setpriv', '--pdeathsig', 'KILL', sys.executable, '-c', REAPER,
             'setpriv', '--pdeathsig', 'KILL', 'unshare', '-m', '--propagation', 'private',
             'sh', '-c', script],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise LibvirtError(f'{self.name}: libvirtd exited ({self._proc.returncode}); '
                                   f'see {self.root}/daemon.log and {self._dir("log")}')
            if self.virsh('list', '--all', check=False, timeout=30).returncode == 0:
                return self
            if time.monotonic() > deadline:
                raise LibvirtError(f'{self.name}: libvirtd did not answer within {timeout}s')
            time.sleep(0.2)

    def virsh(self, *args, check=True, timeout=300):
        """Run virsh against this instance; with check, raise on failure (stderr in
        the message).  Returns the CompletedProcess."""
        cp = subprocess.run(['virsh', '-q', '-c', self.uri, *args], capture_output=True,
                            text=True, timeout=timeout)
        if check and cp.returncode != 0:
            raise LibvirtError(f'{self.name}: virsh {" ".join(args)}: {cp.stderr.strip()}')
        return cp

    def virsh_background(self, *args):
        """Start virsh against this instance and return at once: a Popen with
        text stdout and stderr pipes (communicate() collects them)."""
        return subprocess.Popen(['virsh', '-q', '-c', self.uri, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def capabilities_cache(self):
        """The instance's cache of probed emulators (one XML file each)."""
        return os.path.join(self._dir('cache'), 'qemu', 'capabilities')

    def probe_emulator(self, emulator, timeout=300):
        """Have libvirtd know `emulator`'s capabilities now (`virsh domcapabilities`
        probes it unless its cache holds a valid entry).  Returns the seconds it took."""
        t = time.monotonic()
        self.virsh('domcapabilities', '--emulatorbin', emulator, '--virttype', 'qemu',
                   timeout=timeout)
        return time.monotonic() - t

    def define(self, xml):
        """virsh define the domain `xml` (a string; written to domain.xml in
        the instance's root first)."""
        path = os.path.join(self.root, 'domain.xml')
        with open(path, 'w') as f:
            f.write(xml)
        return self.virsh('define', path)

    def qemu_pids(self):
        piddir = os.path.join(self._dir('run'), 'qemu')
        pids = []
        if os.path.isdir(piddir):
            for fn in os.listdir(piddir):
                # driver.pid is libvirtd's own (the QEMU driver's lock)
                if fn.endswith('.pid') and fn != 'driver.pid':
                    try:
                        pids.append(int(open(os.path.join(piddir, fn)).read().strip()))
                    except (OSError, ValueError):
                        pass
        return pids

    def stop(self):
        """Destroy every domain, stop the daemons, kill anything left; idempotent."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            cp = self.virsh('list', '--name', check=False, timeout=30)
            for dom in cp.stdout.split():
                self.virsh('destroy', dom, check=False, timeout=60)
        # a host's pids are not the machine's: its processes die with it
        leftovers = [] if self.host else self.qemu_pids()
        pidfile = os.path.join(self._dir('run'), 'virtlogd.pid')
        if os.path.exists(pidfile) and not self.host:
            try:
                leftovers.append(int(open(pidfile).read().strip()))
            except ValueError:
                pass
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)   # a host's too: pgids span PID namespaces
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc = None
        if self._log:
            self._log.close()
            self._log = None


class LibvirtPair:
    """Two instances, `src` and `dst`, under one short temporary root (unix socket
    paths must stay under 108 bytes).  stop() copies the daemons' logs (libvirtd,
    QEMU's per-domain logs) into `log_dir`, then removes the root."""

    def __init__(self, log_dir=None, hooks_dir=None, dst_hooks_dir=None):
        """hooks_dir: copied to both instances' /etc/libvirt/hooks (the destination
        takes dst_hooks_dir instead when given).  `root` is a qemu_dir()."""
        self.root = qemu_dir()
        self.log_dir = log_dir
        # Distinct migration port ranges per instance, and per pair: tests and
        # CI jobs may run pairs side by side.
        base = random_ports()
        self.src = LibvirtHost('src', os.path.join(self.root, 'a'), (base, base + 49), hooks_dir)
        self.dst = LibvirtHost('dst', os.path.join(self.root, 'b'), (base + 50, base + 99),
                               dst_hooks_dir or hooks_dir)

    def __enter__(self):
        try:
            self.src.start()
            self.dst.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def prime_emulator(self, emulator):
        """Have both instances know `emulator`'s capabilities before anything is
        timed.  A libvirtd that meets an emulator binary for the first time
        probes it (starts it and queries it: 3-4 s under TCG here); on the
        destination of a migration that first time falls inside the migration
        (its Prepare phase, counted in domjobinfo's Time elapsed).  A host that
        ran the binary before has it cached in /var/cache/libvirt/qemu/capabilities,
        checked against the binary's and libvirtd's ctime on every use.  The
        source probes; its cache entry is copied to the destination, which
        checks it and probes again only if it finds it stale (another libvirtd
        or binary).  Returns {side: seconds its `virsh domcapabilities` took}."""
        took = {'src': self.src.probe_emulator(emulator)}
        os.makedirs(self.dst.capabilities_cache(), exist_ok=True)
        for path in glob.glob(os.path.join(self.src.capabilities_cache(), '*.xml')):
            shutil.copy2(path, self.dst.capabilities_cache())
        took['dst'] = self.dst.probe_emulator(emulator)
        return took

    def stop(self):
        self.dst.stop()
        self.src.stop()
        if self.log_dir:
            for host in (self.src, self.dst):
                dest = os.path.join(self.log_dir, f'libvirt-{host.name}')
                shutil.copytree(host._dir('log'), dest, dirs_exist_ok=True)
                if os.path.exists(os.path.join(host.root, 'daemon.log')):
                    shutil.copy(os.path.join(host.root, 'daemon.log'), dest)
        shutil.rmtree(self.root, ignore_errors=True)


class MonitorEvents:
    """The QMP events of `domain` (None: of every domain, including those that
    arrive by migration) on `host`, with QEMU's own timestamps, while the
    context is open: `virsh qemu-monitor-event --loop` in the background.
    events: [(seconds since the epoch, event name, data)], in arrival order."""

    LINE = re.compile(r"^event (\S+) at (\d+)\.(\d+) for domain '.*?': (.*)$")

    def __init__(self, host, domain=None):
        self.host = host
        self.domain = domain
        self.events = []
        self._proc = None
        self._thread = None

    def __enter__(self):
        # virsh writes through stdio: line-buffer it so that events arrive as they happen.
        self._proc = subprocess.Popen(
            ['stdbuf', '-oL', 'virsh', '-q', '-c', self.host.uri, 'qemu-monitor-event', '--loop',
             *([self.domain] if self.domain else [])], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            m = self.LINE.match(line.strip())
            if m:
                try:
                    data = json.loads(m.group(4))
                except ValueError:
                    data = m.group(4)
                self.events.append((int(m.group(2)) + int(m.group(3)) / 1e6, m.group(1), data))

    def wait(self, name, data=None, timeout=60):
        """Wait until an event `name` (with `data` among its fields, if given) has
        arrived; return its timestamp, or None on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.first(name, data)
            if t is not None:
                return t
            time.sleep(0.02)
        return None

    def first(self, name, data=None):
        """The timestamp of the first event `name` (with `data`), or None."""
        for t, n, d in list(self.events):
            if n == name and (data is None or
                              (isinstance(d, dict) and all(d.get(k) == v for k, v in data.items()))):
                return t
        return None

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread:
            self._thread.join(5)


def serial_console(name, sock_dir, log_dir):
    """A serial console to type into, for domain `name`: (hvlib.Console, the
    domain_xml() arguments that give the domain that console).  Its socket
    is in `sock_dir` (keep it short: unix socket paths), its log in
    `log_dir`."""
    sock = os.path.join(sock_dir, f'{name}-serial.sock')
    log = os.path.join(log_dir, f'{name}-console.log')
    return Console(name, sock, log), {'console_sock': sock, 'console_log': log}


def with_broker_regions(xml, regions):
    """Domain `xml` with the <metadata> that names the memory broker regions
    the hook provisions (docs/broker.md): `regions` are dicts of <hv:region>
    attributes (name, size, and mode and lifetime when given)."""
    meta = ''.join('<hv:region ' + ' '.join(f'{k}={quoteattr(str(v))}' for k, v in r.items())
                   + '/>' for r in regions)
    return xml.replace('<devices>', '<metadata><hv:broker xmlns:hv='
                       f'"https://hybridvm.org/xmlns/broker/1">{meta}</hv:broker>'
                       '</metadata><devices>', 1)


def boot_files(paths, boot_dir):
    """The guest's kernel and initrd as copies in `boot_dir` (made once):
    (kernel, initrd).  libvirt's DAC driver gives the files a domain boots
    to QEMU's user while it runs and gives them back when it stops, keeping
    their owner in trusted.libvirt.security.* attributes; on copies, a
    libvirtd killed before it could give them back leaves the build's own
    files (which other tests read) as they were."""
    out = []
    for name in ('vmlinuz', 'initrd.img'):
        dst = os.path.join(boot_dir, name)
        if not os.path.exists(dst):
            tmp = dst + '.tmp'
            shutil.copyfile(paths.guest_file(name), tmp)
            os.chmod(tmp, 0o644)
            os.rename(tmp, dst)
        out.append(dst)
    return tuple(out)


def domain_xml(name, paths, mem_mib=512, redis_port=6379, console_log=None,
               console_sock=None, append='hv.redis=1', qemu_args=(), disks=(),
               hybrid_root=None, hybrid_opts='', block_disks=(), boot_dir=None, vnc=False):
    """Domain XML for the test guest under TCG with our QEMU as the emulator.

    libvirt 9.0 cannot express a slirp host forward for virtio-net with our
    options, nor a hybrid disk (it does not know the format), so those go
    through <qemu:commandline>.  `disks` are (path, format) pairs attached as
    virtio disks, then `block_disks` (host block devices: raw, cache='none',
    io='native'); `hybrid_root` is a hybrid image booted as the root disk
    (/dev/vda: it takes the first virtio-blk slot), with extra -blockdev
    options in `hybrid_opts` (e.g. 'mode=async').  With `console_sock` the
    serial console is a unix socket to type into, logged to `console_log`
    (see hvlib.Console); otherwise it is only logged.  With `boot_dir`
    (a qemu_dir()) the kernel and initrd are copies there (boot_files());
    with `vnc` the domain has a VNC display on 127.0.0.1 (port='-1': libvirt
    picks it; `virsh domdisplay` says which).
    """
    if boot_dir:
        kernel, initrd = boot_files(paths, boot_dir)
    else:
        kernel, initrd = paths.guest_file('vmlinuz'), paths.guest_file('initrd.img')
    cmdline = f'console=ttyS0 panic=-1 quiet loglevel=3 {append}'.strip()
    args = ['-L', '/usr/share/seabios', '-L', '/usr/share/qemu',
            '-netdev', f'user,id=hn0,hostfwd=tcp:127.0.0.1:{redis_port}-:6379',
            # Fixed slots, clear of the ones libvirt assigns to its own devices.
            '-device', 'virtio-net-pci,netdev=hn0,romfile=,bus=pci.0,addr=0x1f']
    if hybrid_root:
        if disks or block_disks:  # /dev/vda follows PCI order: keep the root disk the only one
            raise ValueError('hybrid_root cannot be combined with other disks')
        opts = f',{hybrid_opts}' if hybrid_opts else ''
        args += ['-blockdev', f'driver=hybrid,node-name=hroot,file.driver=file,'
                              f'file.filename={hybrid_root}{opts}',
                 '-device', 'virtio-blk-pci,drive=hroot,bus=pci.0,addr=0x1e']
        cmdline += ' hv.root=/dev/vda'
    args += list(qemu_args)
    qargs = '\n'.join(f'    <qemu:arg value={quoteattr(a)}/>' for a in args)
    disk_xml = '\n'.join(
        f"""    <disk type='file' device='disk'>
      <driver name='qemu' type='{fmt}'/>
      <source file={quoteattr(path)}/>
      <target dev='vd{chr(ord("a") + i)}' bus='virtio'/>
    </disk>""" for i, (path, fmt) in enumerate(disks))
    disk_xml += '\n'.join(
        f"""
    <disk type='block' device='disk'>
      <driver name='qemu' type='raw' cache='none' io='native'/>
      <source dev={quoteattr(dev)}/>
      <target dev='vd{chr(ord("a") + len(disks) + i)}' bus='virtio'/>
    </disk>""" for i, dev in enumerate(block_disks))
    if console_sock:
        serial = (f"""    <serial type='unix'>
      <source mode='bind' path={quoteattr(console_sock)}/>
      <log file={quoteattr(console_log)} append='off'/>
    </serial>""")
    elif console_log:
        serial = f"""    <serial type='file'><source path={quoteattr(console_log)}/></serial>"""
    else:
        serial = "    <serial type='pty'/>"
    if vnc:
        serial += "\n    <graphics type='vnc' port='-1' listen='127.0.0.1'/>"
    return f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{escape(name)}</name>
  <uuid>{uuid.uuid5(uuid.NAMESPACE_URL, 'hybridvm:' + name)}</uuid>
  <memory unit='MiB'>{mem_mib}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{escape(kernel)}</kernel>
    <initrd>{escape(initrd)}</initrd>
    <cmdline>{escape(cmdline)}</cmdline>
  </os>
  <features><acpi/></features>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{escape(paths.binary('qemu-system-x86_64'))}</emulator>
{disk_xml}
{serial}
    <memballoon model='virtio'/>
  </devices>
  <qemu:commandline>
{qargs}
  </qemu:commandline>
</domain>
"""
