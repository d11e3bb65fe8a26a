"""The arbiter's configuration: an INI file, validated whole before anything
is touched.  Every value is bounded; an absurd one is an error that names
the section, the key and the range, never a silent default.  A relative
path in it is relative to the configuration file's directory (its real
path), never to the directory the daemon was started from: the daemon's
watchdog starts elsewhere and reads the same file.  See
arbiter/arbiter.conf.example for every key.
"""

import configparser
import os
import re
import stat
import urllib.parse

from .podmanlink import REF_RE as PODMAN_REF_RE, parse_command

MiB = 1 << 20
# QEMU's documentation of throttling: below about 2 MB/s a guest may fail
# to boot or time out its own I/O.  A floor under it is refused.
SAFE_MIN_BPS = 2 * 1000 * 1000
MAX_VMS = 256
MAX_CONTAINERS = 256
NAME_RE = re.compile(r'^[A-Za-z0-9_.-]{1,64}$')


class ConfigError(Exception):
    pass


def _size(text):
    m = re.fullmatch(r'\s*(\d+)\s*([KMGT]?)i?B?\s*', text, re.I)
    if not m:
        raise ValueError(f'not a size: {text!r}')
    return int(m.group(1)) << (10 * ' KMGT'.index((m.group(2) or ' ').upper()))


class Section:
    """Typed, bounded reads of one section; every key read is remembered so
    that unknown keys (typos) are reported."""

    def __init__(self, cp, name, base):
        self.cp, self.name, self.base, self.seen = cp, name, base, set()

    def _raw(self, key, default):
        self.seen.add(key)
        if self.cp.has_option(self.name, key):
            return self.cp.get(self.name, key).strip()
        return default

    def _bad(self, key, why):
        return ConfigError(f'[{self.name}] {key}: {why}')

    def num(self, key, default, lo, hi, kind=float, unit=''):
        raw = self._raw(key, None)
        if raw is None:
            return default
        try:
            v = kind(raw)
        except ValueError:
            raise self._bad(key, f'{raw!r} is not a number') from None
        if not (lo <= v <= hi) or v != v:
            raise self._bad(key, f'{raw} is outside [{lo:g}, {hi:g}]{unit}')
        return v

    def size(self, key, default, lo, hi):
        raw = self._raw(key, None)
        if raw is None:
            return default
        try:
            v = _size(raw)
        except ValueError as e:
            raise self._bad(key, str(e)) from None
        if not (lo <= v <= hi):
            raise self._bad(key, f'{raw} is outside [{lo}, {hi}] bytes')
        return v

    def path(self, key, default=None, required=False):
        raw = self._raw(key, default)
        if raw is None or raw == '':
            if required:
                raise self._bad(key, 'is required')
            return None
        if '\0' in raw or len(raw) > 4000:
            raise self._bad(key, f'{raw[:100]!r} is not a path')
        return os.path.join(self.base, raw)     # raw itself if absolute

    def text(self, key, default=None, required=False, pattern=NAME_RE):
        raw = self._raw(key, default)
        if raw is None or raw == '':
            if required:
                raise self._bad(key, 'is required')
            return None
        if not pattern.match(raw):
            raise self._bad(key, f'{raw!r} is not a valid name')
        return raw

    def unknown(self):
        return sorted(set(self.cp.options(self.name)) - self.seen)


# libvirt: a connection URI (printable, no spaces), a domain name (no '/'
# or control characters, as libvirt's own rule), a disk's target (vda)
LIBVIRT_URI_RE = re.compile(r'^[a-z][a-z0-9+.-]{0,31}://[\x21-\x7e]{0,1000}$')
DOMAIN_RE = re.compile(r'^[^\x00-\x1f\x7f/]{1,200}$')
DEVICE_RE = re.compile(r'^[A-Za-z0-9_./-]{1,128}$')


def local_libvirt_uri(uri):
    """Why a libvirt URI is refused, or None.  The arbiter throttles disks
    on this host's device, as root: only this host's QEMU driver is
    accepted (qemu:///system, qemu:///session, or qemu+unix with an
    absolute socket=), never a host name (another machine) nor a
    transport that runs a program (qemu+ext's command=, ssh's)."""
    u = urllib.parse.urlsplit(uri)
    if u.scheme not in ('qemu', 'qemu+unix'):
        return 'not a local QEMU URI (qemu:///system, qemu+unix:///system?socket=PATH)'
    if u.netloc:
        return 'names a host: the arbiter drives this host\'s VMs only'
    if u.path not in ('/system', '/session'):
        return 'the path must be /system or /session'
    try:
        q = urllib.parse.parse_qs(u.query, keep_blank_values=True, strict_parsing=bool(u.query))
    except ValueError:
        return 'malformed parameters'
    if set(q) - {'socket'} or len(q.get('socket', [])) > 1:
        return 'takes no parameter but one socket='
    if q and not os.path.isabs(q['socket'][0]):
        return 'socket= must be an absolute path'
    return None


class VMConf:
    """One VM: how the arbiter reaches it (a QMP socket of its own and the
    throttle group it drives, or a libvirt connection, the domain and the
    disk whose live <iotune> it drives), the disk whose latency it
    watches, the default limits (restored whenever the arbiter lets go),
    the floor and the VM's own latency SLO."""

    def __init__(self, s, name):
        self.name = name
        self.libvirt = s.text('libvirt', pattern=LIBVIRT_URI_RE)
        if self.libvirt:
            why = local_libvirt_uri(self.libvirt)
            if why:
                raise ConfigError(f'[vm {name}] libvirt: {self.libvirt!r}: {why}')
            if s.cp.has_option(s.name, 'qmp'):
                raise ConfigError(f'[vm {name}] qmp and libvirt: give one of them')
            self.qmp = None
            self.domain = s.text('domain', required=True, pattern=DOMAIN_RE)
            # libvirt's group_name: the disks given it share the limits
            self.group = s.text('throttle-group')
            self.device = s.text('device', required=True, pattern=DEVICE_RE)
        else:
            if not s.cp.has_option(s.name, 'qmp'):
                raise ConfigError(f'[vm {name}] qmp (a QMP socket) or libvirt (a URI) '
                                  'is required')
            self.qmp = s.path('qmp', required=True)
            self.domain = None
            self.group = s.text('throttle-group', required=True)
            self.device = s.text('device', pattern=DEVICE_RE)
        # 0: no limit.  QEMU's own bounds: THROTTLE_VALUE_MAX = 1e15.
        self.default_iops = s.num('default-iops', 0, 0, 10**9, int)
        self.default_bps = s.size('default-bps', 0, 0, 1 << 40)
        self.floor_iops = s.num('floor-iops', 10, 1, 10**7, int)
        self.floor_bps = s.size('floor-bps', 2 * MiB, SAFE_MIN_BPS, 1 << 40)
        for k, d, f in (('iops', self.default_iops, self.floor_iops),
                        ('bps', self.default_bps, self.floor_bps)):
            if d and d < f:
                raise ConfigError(f'[vm {name}] default-{k} {d} is below floor-{k} {f}')
        self.slo_p99_ms = s.num('slo-p99-ms', 100.0, 0.05, 60000.0, unit=' ms')

    def default_limits(self):
        return {'iops-total': self.default_iops, 'bps-total': self.default_bps}


class ContainerConf:
    """One container: its cgroup directory (v1 blkio or v2) and, for PSI,
    its v2 cgroup; or its podman name or id, whose cgroups the arbiter
    finds itself (podmanlink.py).  Its weight in the containers' IOPS."""

    def __init__(self, s, name):
        self.name = name
        has = [k for k in ('cgroup', 'podman') if s.cp.has_option(s.name, k)]
        if len(has) != 1:
            raise ConfigError(f'[container {name}] give one of cgroup (a cgroup directory) '
                              'and podman (a podman container\'s name or id)')
        if has == ['podman']:
            self.podman = s.text('podman', required=True, pattern=PODMAN_REF_RE)
            if s.cp.has_option(s.name, 'pressure'):
                raise ConfigError(f'[container {name}] pressure: not with podman (the '
                                  'container\'s v2 cgroup is found with it)')
            self.cgroup = self.pressure = None
        else:
            self.podman = None
            self.cgroup = s.path('cgroup', required=True)
            self.pressure = s.path('pressure')
        self.weight = s.num('weight', 1.0, 0.01, 100.0)


class Config:
    def __init__(self, path):
        path = self.path = os.path.realpath(path)
        base = os.path.dirname(path)
        cp = configparser.ConfigParser(interpolation=None, delimiters=('=',),
                                       comment_prefixes=('#', ';'), strict=True)
        cp.optionxform = str
        try:
            # O_NONBLOCK: a FIFO is refused below instead of hanging here
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ConfigError(f'{path}: not a regular file')
                if st.st_size > MiB:
                    raise ConfigError(f'{path}: larger than 1 MiB')
                # the daemon runs as root and writes where this file says
                if st.st_mode & 0o022:
                    raise ConfigError(f'{path}: writable by group or others '
                                      f'(mode {stat.S_IMODE(st.st_mode):04o}); refusing')
                f = open(fd, encoding='utf-8')
            except BaseException:
                os.close(fd)
                raise
            with f:
                cp.read_file(f)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f'{path}: {e}') from None
        except configparser.Error as e:
            raise ConfigError(f'{path}: {e.message if hasattr(e, "message") else e}') from None
        sections = []

        def sec(name):
            s = Section(cp, name, base)
            sections.append(s)
            return s

        a = sec('arbiter') if cp.has_section('arbiter') else None
        if a is None:
            raise ConfigError(f'{path}: no [arbiter] section')
        self.period_ms = a.num('period-ms', 200, 50, 10000, int, ' ms')
        self.state_dir = a.path('state-dir', '/run/hvarbiter')
        self.log = a.path('log')
        self.log_max = a.size('log-max-bytes', 16 * MiB, 64 * 1024, 1 << 34)
        self.metrics_file = a.path('metrics-file')
        self.qmp_timeout = a.num('qmp-timeout-ms', 1000, 10, 60000, int, ' ms') / 1000
        # podman and its global options (--root, --runroot ...) for the
        # containers given by podman name or id; split as a shell would
        # (shlex), never run through one
        raw = a._raw('podman-command', 'podman')
        try:
            self.podman_command = parse_command(raw)
        except ValueError as e:
            raise a._bad('podman-command', str(e)) from None
        self.podman_timeout = a.num('podman-timeout-ms', 10000, 100, 120000, int, ' ms') / 1000

        if not cp.has_section('device'):
            raise ConfigError(f'{path}: no [device] section')
        d = sec('device')
        self.device = d.path('path', required=True)
        self.model = d.path('model')
        # iocost's rlat/rpct: a latency at a percentile of the probe's reads
        raw = d._raw('target-latency-ms', None)
        if raw == 'auto':
            self.target_ms = None              # from the model (see model.py)
            if not self.model:
                raise ConfigError('[device] target-latency-ms = auto needs model =')
        else:
            self.target_ms = d.num('target-latency-ms', 5.0, 0.05, 10000.0, unit=' ms')
        self.target_pct = d.num('target-percentile', 90.0, 50.0, 99.9)
        self.target_pressure = d.num('target-pressure', 0.0, 0.0, 1.0)
        self.probe_iops = d.num('probe-iops', 200, 10, 5000, int)
        self.probe_window_ms = d.num('probe-window-ms', 1000, 100, 60000, int, ' ms')
        self.idle_iops = d.num('idle-iops', 20, 0, 10**7)
        self.gap = d.num('gap', 0.0, 0.0, 1000.0)   # 0: from the model, else 1

        self.vms, self.containers = [], []
        for name in cp.sections():
            kind, _, rest = name.partition(' ')
            if name in ('arbiter', 'device'):
                continue
            if kind not in ('vm', 'container') or not NAME_RE.match(rest):
                raise ConfigError(f'{path}: unknown section [{name}] '
                                  '(expected [arbiter], [device], [vm NAME], [container NAME])')
            s = sec(name)
            (self.vms if kind == 'vm' else self.containers).append(
                (VMConf if kind == 'vm' else ContainerConf)(s, rest))
        if len(self.vms) > MAX_VMS or len(self.containers) > MAX_CONTAINERS:
            raise ConfigError(f'{path}: at most {MAX_VMS} VMs and {MAX_CONTAINERS} containers')
        refs = {}
        for c in self.containers:
            if c.podman and refs.setdefault(c.podman, c.name) != c.name:
                raise ConfigError(f'[container {c.name}] podman: {c.podman} is '
                                  f'[container {refs[c.podman]}] already')
        for s in sections:
            bad = s.unknown()
            if bad:
                raise ConfigError(f'[{s.name}] unknown key{"s" if len(bad) > 1 else ""}: '
                                  + ', '.join(bad))
        if not self.log:
            self.log = os.path.join(self.state_dir, 'decisions.jsonl')
        self.socket = os.path.join(self.state_dir, 'arbiter.sock')
