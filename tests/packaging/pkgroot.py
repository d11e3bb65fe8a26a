"""A clean Debian 12 root for the package tests (not a test file itself).

`Root(work)` is a minbase bookworm tree unpacked under `work/root` from a
cached mmdebstrap tarball; `sh()` runs a command in it, first through a
chroot in a private mount namespace (apt installs there, with the host's
network), and once `boot()` ran, inside the root booted with systemd as
PID 1 under systemd-nspawn, as on a host (services, the journal,
libvirtd).  `script(cmd, unit=)` also applies a unit's sandbox by hand, for
daemons started from their ExecStart= without systemd."""

import glob
import os
import re
import shlex
import shutil
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get('HYBRIDVM_BUILD', os.path.join(REPO, 'build'))
CACHE = os.path.join(BUILD, 'pkgtest')
BASE_TAR = os.path.join(CACHE, 'bookworm-minbase.tar')
BASE_MAX_AGE = 24 * 3600
ENV = dict(os.environ, DEBIAN_FRONTEND='noninteractive', LC_ALL='C',
           PATH='/usr/sbin:/usr/bin:/sbin:/bin')


def skip_reason():
    if os.geteuid() != 0:
        return 'a clean root needs root (chroot, mounts)'
    for tool in ('mmdebstrap', 'dpkg-buildpackage', 'lintian', 'unshare', 'rst2man',
                 'systemd-nspawn', 'nsenter', 'losetup'):
        if not shutil.which(tool):
            return f'{tool} is not installed (scripts/setup-host.sh: systemd-container, ...)'
    if not os.path.exists(os.path.join(BUILD, 'qemu-src', 'VERSION')):
        return 'the tree is not built'
    return None


def base_root():
    """The cached minbase tarball (apt lists kept), made again after a day."""
    os.makedirs(CACHE, exist_ok=True)
    if os.path.exists(BASE_TAR) and time.time() - os.path.getmtime(BASE_TAR) < BASE_MAX_AGE:
        return BASE_TAR
    tmp = BASE_TAR[:-len('.tar')] + '.tmp.tar'    # mmdebstrap picks its output by the suffix
    r = subprocess.run(['mmdebstrap', '--variant=minbase', '--skip=cleanup/apt/lists',
                        'bookworm', tmp], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f'mmdebstrap failed:\n{r.stderr[-3000:]}')
    os.replace(tmp, BASE_TAR)
    return BASE_TAR


def build_debs(out, revision):
    """Our packages, Debian revision `revision`, into `out` (the script
    `make deb` runs): (the .deb paths, the version)."""
    r = subprocess.run([os.path.join(REPO, 'scripts', 'build-debs.sh'), out],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, HYBRIDVM_DEB_REVISION=str(revision),
                                BUILD_DIR=BUILD))
    if r.returncode != 0:
        raise AssertionError(f'build-debs.sh failed:\n{r.stdout}{r.stderr}')
    return (sorted(glob.glob(os.path.join(out, '*.deb'))),
            re.search(r'hybridvm (\S+)', r.stdout).group(1))


def parse_unit(path, instance=None):
    """{key: [values]} of a unit's [Service] (and other) sections, %i expanded."""
    keys = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        line = line.strip()
        if not line or line.startswith(('#', ';', '[')) or '=' not in line:
            continue
        k, v = line.split('=', 1)
        if instance is not None:
            v = v.replace('%i', instance)
        keys.setdefault(k.strip(), []).append(v.strip())
    return keys


class Root:
    """A clean root under `work`; `private_network` boots it with a network
    namespace of its own (only a loopback), so what runs in it (libvirt's
    guests, their port forwards) cannot meet the host's or another test's."""

    def __init__(self, work, private_network=False):
        self.work = work
        self.path = os.path.join(work, 'root')
        self.shm = os.path.join(work, 'shm')            # the chroot's /dev/shm
        self.archives = os.path.join(CACHE, 'archives')  # apt's download cache
        self.private_network = private_network
        os.makedirs(os.path.join(self.archives, 'partial'), exist_ok=True)
        os.makedirs(self.shm)
        os.chmod(self.shm, 0o1777)
        self.leader = None      # the booted root's PID 1 (boot())
        self.nspawn = None

    def unpack(self):
        os.makedirs(self.path)
        subprocess.run(['tar', '-C', self.path, '-xf', base_root()], check=True, timeout=300)

    def install(self, debs, extras=(), recommends=False):
        """apt-get install the .deb files `debs` and the packages `extras`."""
        os.makedirs(self.path + '/var/tmp/debs', exist_ok=True)
        for d in debs:
            shutil.copy(d, self.path + '/var/tmp/debs')
        names = ' '.join('/var/tmp/debs/' + os.path.basename(d) for d in debs)
        opt = '' if recommends else '--no-install-recommends '
        self.sh(f'apt-get install -y -q {opt}{names} {" ".join(extras)} && rm -f {names}',
                timeout=600)

    # -- the root, booted ------------------------------------------------------
    def boot(self):
        """Boot the root with systemd as PID 1 (systemd-nspawn; the host has
        no systemd of its own to register with) and wait until it is up."""
        log = open(os.path.join(self.work, 'boot.log'), 'wb')
        argv = ['systemd-nspawn', '-q', '-D', self.path, '--register=no', '--keep-unit',
                f'--bind={self.archives}:/var/cache/apt/archives']
        if self.private_network:
            argv.append('--private-network')
        self.nspawn = subprocess.Popen(argv + ['/lib/systemd/systemd', '--system'],
                                       stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 60
        while self.leader is None:
            if self.nspawn.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f'the root did not boot:\n{self.boot_log()}')
            self.leader = self.container_init()
            time.sleep(0.1)
        while True:
            state = self.sh('systemctl is-system-running --wait', check=False).stdout.strip()
            if state in ('running', 'degraded'):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f'the root is {state}:\n{self.boot_log()}')
            time.sleep(0.2)

    def container_init(self):
        """The pid of the container's systemd, below systemd-nspawn."""
        todo = [self.nspawn.pid]
        while todo:
            pid = todo.pop()
            try:
                with open(f'/proc/{pid}/comm') as f:
                    if f.read().strip() == 'systemd':
                        return pid
                for t in os.listdir(f'/proc/{pid}/task'):
                    with open(f'/proc/{pid}/task/{t}/children') as f:
                        todo += [int(x) for x in f.read().split()]
            except OSError:
                pass
        return None

    def boot_log(self):
        with open(os.path.join(self.work, 'boot.log'), errors='replace') as f:
            return f.read()[-3000:]

    def poweroff(self):
        if self.nspawn is None:
            return
        if self.leader is not None:
            self.sh('systemctl poweroff --no-block', check=False)
        self.leader = None
        try:
            self.nspawn.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.nspawn.kill()
            self.nspawn.wait()
        self.nspawn = None

    def main_pid(self, unit):
        return int(self.sh(f'systemctl show -P MainPID {unit}').stdout)

    # -- commands in the root ------------------------------------------------
    def script(self, cmd, unit=None):
        """A shell script that enters the root in a new mount namespace and
        runs `cmd` there; with `unit` (parse_unit's dict), as its [Service]
        says: directories made, ProtectSystem=strict (the root read-only but
        for ReadWritePaths= and those directories), PrivateTmp=, UMask=,
        NoNewPrivileges=, CapabilityBoundingSet=."""
        r = shlex.quote(self.path)
        pre = [f'R={r}']
        inner = cmd
        if unit:
            rw = []
            for key, base, mode_key in (('RuntimeDirectory', '/run', 'RuntimeDirectoryMode'),
                                        ('StateDirectory', '/var/lib', 'StateDirectoryMode'),
                                        ('LogsDirectory', '/var/log', 'LogsDirectoryMode')):
                for d in unit.get(key, []):
                    p = f'{base}/{d}'
                    mode = unit.get(mode_key, ['0755'])[0]
                    pre.append(f'mkdir -p "$R{p}" && chmod {mode} "$R{p}"')
                    rw.append(p)
            for p in ' '.join(unit.get('ReadWritePaths', [])).split():
                optional = p.startswith('-')
                p = p.lstrip('-')
                if optional and not os.path.exists(self.path + p):
                    continue
                rw.append(p)
            if unit.get('ProtectSystem') == ['strict']:
                pre.append('mount --bind "$R" "$R"')
                pre += [f'mount --bind "$R{p}" "$R{p}"' for p in rw]
                pre.append('mount -o remount,bind,ro "$R" "$R"')
            if unit.get('PrivateTmp') == ['yes']:
                pre.append('mount -t tmpfs -o mode=1777 private-tmp "$R/tmp"')
            caps = ' '.join(unit.get('CapabilityBoundingSet', [])).split()
            priv = ['setpriv']
            if caps:
                priv.append('--bounding-set=-all,' + ','.join(
                    '+' + c.lower().removeprefix('cap_') for c in caps))
            if unit.get('NoNewPrivileges') == ['yes']:
                priv.append('--no-new-privs')
            umask = unit.get('UMask', ['0022'])[0]
            inner = f'umask {umask}; exec {" ".join(priv)} -- {cmd}'
        pre += ['mount -t proc proc "$R/proc"',
                'mount -t sysfs sysfs "$R/sys"',
                f'mount --bind {shlex.quote(self.shm)} "$R/dev/shm"',
                f'mount --bind {shlex.quote(self.archives)} "$R/var/cache/apt/archives"',
                f'exec chroot "$R" /bin/sh -c {shlex.quote(inner)}']
        return ['unshare', '--mount', '--propagation', 'private', '--fork',
                'sh', '-ec', '\n'.join(pre)]

    def sh(self, cmd, check=True, timeout=300):
        """Run `cmd` (sh) in the root (in the booted system once boot() ran);
        its CompletedProcess."""
        argv = self.script(cmd) if self.leader is None else \
            ['nsenter', '-t', str(self.leader), '-m', '-u', '-i', '-n', '-p', '-r', '-w',
             '/bin/sh', '-c', cmd]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV)
        if check and r.returncode != 0:
            raise AssertionError(f'in the root: {cmd}\nexit {r.returncode}\n'
                                 f'{r.stdout[-4000:]}\n{r.stderr[-4000:]}')
        return r
