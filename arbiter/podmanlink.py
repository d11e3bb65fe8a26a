"""Containers by podman name or id: the arbiter finds their cgroups itself.

For a [container NAME] section with `podman = REF` the arbiter asks podman
(`podman container inspect -- REF`, the configuration's podman-command and
its global options, run with a timeout, never through a shell) for the
container's full id and its init process's pid, then reads that pid's
cgroups from /proc/PID/cgroup: the v1 blkio group (or, on a host with only
cgroup v2, the unified group) holds the I/O counters, and the v2 group,
where it has io.pressure, the stall time.  This works whatever podman's
cgroup manager (cgroupfs: /libpod_parent/libpod-ID; systemd:
/machine.slice/libpod-ID.scope) and whatever --cgroup-parent the container
was started with.  The group's path must name the container's full id (in
its last component, or in one above it: crun with systemd puts the
container in libpod-ID.scope/container): that holds off a pid that was
reused between podman's answer and the read of /proc (and a container run
with --cgroups=disabled, whose processes sit in some other group).

Everything podman says is bounded and checked: its output (at most
MAX_OUTPUT bytes, JSON, exactly one container, an id of 64 hex digits, a
pid in [1, PID_MAX] when running), the cgroup paths (absolute, at most
MAX_DEPTH components of [A-Za-z0-9_.@:+-] and '\\', never '.' or '..'),
and the directories they lead to must be under the cgroup mounts.

Waiting and restarts (the Watch thread): a container that does not exist
yet, is not running, or whose podman call failed is looked up again when
podman reports an event of it (`podman events`, a stream the Watch keeps
running: Events), and otherwise after a back-off (RETRY_MIN doubling to
RETRY_MAX, or to RETRY_MAX_EVENTS while the event stream runs), each change
of state logged once; one that is found is re-checked cheaply every
CHECK_S seconds and at each of its events (its pid still in the same group,
the group's directory the same inode), and looked up again at once when
that fails: a restarted container (a new pid, a new group directory whose
counters start at zero) is followed, one that stops or is removed is
reported (`container_errors`, the `container` events of the decision log),
never the end of the daemon.
"""

import json
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import threading
import time

from .sources import SourceError, read_small

MAX_OUTPUT = 1 << 20        # one container's inspect is ~10 KB
MAX_STDERR = 1 << 14
PID_MAX = 1 << 22           # the kernel's PID_MAX_LIMIT
MAX_DEPTH = 32
MAX_COMPONENT = 255
ID_RE = re.compile(r'[0-9a-f]{64}')
# podman's own rule for a name ([a-zA-Z0-9][a-zA-Z0-9_.-]*); an id or a
# prefix of one is hex, so it fits too
REF_RE = re.compile(r'^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}\Z')
COMPONENT_RE = re.compile(r'[A-Za-z0-9_.@:+\\-]{1,%d}' % MAX_COMPONENT)
# Lookups of a container that is not there: a podman inspect costs ~0.03 s
# of CPU here.  Podman's events say when one starts: while they come, the
# back-off only guards against a missed event.
RETRY_MIN, RETRY_MAX, RETRY_MAX_EVENTS = 0.5, 2.0, 30.0
CHECK_S = 0.5
EVENT_MIN_S = 0.2           # lookups of one container, at most one per this, on events

# podman's global options that the arbiter passes on (all take a value):
# where podman keeps its containers and how it reaches them on this host.
# --remote, --url, --connection, --identity, --ssh (another machine's
# podman: its pids are not this host's) and the rest are refused.
PODMAN_OPTIONS = {
    '--root': 'path', '--runroot': 'path', '--tmpdir': 'path', '--conmon': 'path',
    '--runtime': 'runtime', '--storage-driver': 'word', '--storage-opt': 'value',
    '--cgroup-manager': ('cgroupfs', 'systemd'),
    '--events-backend': ('file', 'journald', 'none'),
    '--namespace': 'word',
}
MAX_COMMAND_WORDS = 32
MAX_WORD = 4096
WORD_RE = re.compile(r'[A-Za-z0-9_.+-]{1,128}')
VALUE_RE = re.compile(r'[\x20-\x7e]{1,%d}' % MAX_WORD)     # one argument: spaces are fine
# the environment podman would take a remote service from
REMOTE_ENV = ('CONTAINER_HOST', 'CONTAINER_CONNECTION', 'CONTAINER_SSHKEY',
              'CONTAINER_PASSPHRASE')


class PodmanError(SourceError):
    """podman could not say where the container is.  kind: 'absent' (no
    such container), 'stopped' (it exists, not running), 'error' (podman
    failed, timed out or said something malformed)."""

    def __init__(self, msg, kind='error'):
        super().__init__(msg)
        self.kind = kind


def parse_command(raw):
    """The podman-command value: a list of words (shlex), the program
    ('podman' from PATH, or an absolute path) and global options of
    PODMAN_OPTIONS with their values.  ValueError says what is wrong."""
    if len(raw) > MAX_COMMAND_WORDS * 256:
        raise ValueError(f'longer than {MAX_COMMAND_WORDS * 256} characters')
    try:
        words = shlex.split(raw, comments=False, posix=True)
    except ValueError as e:
        raise ValueError(f'cannot split: {e}') from None
    if not words:
        raise ValueError('is empty')
    if len(words) > MAX_COMMAND_WORDS:
        raise ValueError(f'more than {MAX_COMMAND_WORDS} words')
    prog = words[0]
    if prog != 'podman' and not (os.path.isabs(prog) and VALUE_RE.fullmatch(prog)
                                 and '/../' not in prog + '/'):
        raise ValueError(f'{prog[:100]!r}: the program is podman (looked up in PATH) '
                         'or an absolute path')
    out = [prog]
    i = 1
    while i < len(words):
        w = words[i]
        opt, eq, val = w.partition('=')
        if opt not in PODMAN_OPTIONS:
            raise ValueError(f'{w[:100]!r}: not one of the global options the arbiter '
                             f'passes on ({", ".join(sorted(PODMAN_OPTIONS))})')
        if not eq:
            i += 1
            if i == len(words):
                raise ValueError(f'{opt} needs a value')
            val = words[i]
        kind = PODMAN_OPTIONS[opt]
        if not VALUE_RE.fullmatch(val) or val.startswith('-'):
            raise ValueError(f'{opt} {val[:100]!r}: not a value (printable ASCII, at most '
                             f'{MAX_WORD} characters, not an option)')
        if kind == 'path' and not os.path.isabs(val):
            raise ValueError(f'{opt} {val[:100]!r}: must be an absolute path')
        if kind == 'runtime' and not (os.path.isabs(val) or WORD_RE.fullmatch(val)):
            raise ValueError(f'{opt} {val[:100]!r}: a runtime\'s name or absolute path')
        if kind == 'word' and not WORD_RE.fullmatch(val):
            raise ValueError(f'{opt} {val[:100]!r}: not a name')
        if isinstance(kind, tuple) and val not in kind:
            raise ValueError(f'{opt} {val!r}: one of {", ".join(kind)}')
        out += [opt, val]
        i += 1
    return out


def env():
    return {k: v for k, v in os.environ.items() if k not in REMOTE_ENV}


def run_bounded(argv, timeout, max_out=MAX_OUTPUT):
    """argv (no shell) with stdin closed, in its own process group; returns
    (returncode, stdout bytes, stderr bytes).  PodmanError if it runs
    longer than timeout seconds or writes more than max_out bytes: the
    whole group is killed then."""
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env(), close_fds=True,
                             start_new_session=True)
    except OSError as e:
        raise PodmanError(f'{argv[0]}: {e.strerror}') from None
    bufs = {p.stdout: bytearray(), p.stderr: bytearray()}
    limits = {p.stdout: max_out, p.stderr: MAX_STDERR}
    deadline = time.monotonic() + timeout
    why = None
    with selectors.DefaultSelector() as sel:
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map() and why is None:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f'no answer within {timeout:g} s'
                break
            for key, _ in sel.select(left):
                d = os.read(key.fd, 65536)
                if not d:
                    sel.unregister(key.fileobj)
                    continue
                b = bufs[key.fileobj]
                if len(b) + len(d) > limits[key.fileobj]:
                    if key.fileobj is p.stdout:
                        why = f'more than {max_out} bytes of output'
                        break
                    d = d[:limits[key.fileobj] - len(b)]    # stderr: the start is kept
                b += d
    if why is None:
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            why = f'no exit within {timeout:g} s'
    if why is not None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    p.stdout.close()
    p.stderr.close()
    if why is not None:
        raise PodmanError(f'{argv[0]}: {why}')
    return rc, bytes(bufs[p.stdout]), bytes(bufs[p.stderr])


def _pdeath():
    """A prefix that makes a child die with the daemon (setpriv's
    --pdeathsig: a long-lived podman events must not outlive a SIGKILLed
    daemon), where util-linux's setpriv is there."""
    return ['setpriv', '--pdeathsig', 'KILL', '--'] if shutil.which('setpriv') else []


def _printable(b, n=300):
    s = b.decode('utf-8', 'replace').strip()
    lines = [x for x in s.splitlines() if x.strip()]
    s = lines[-1] if lines else ''
    return ''.join(c if c.isprintable() else '?' for c in s)[:n]


def inspect(command, ref, timeout):
    """podman container inspect REF: dict(id, name, pid, status).  pid is
    None unless the container runs (or is paused)."""
    if not REF_RE.fullmatch(ref):
        raise PodmanError(f'{ref[:100]!r} is not a container name or id')
    rc, out, err = run_bounded(list(command) + ['container', 'inspect', '--', ref], timeout)
    if rc != 0:
        msg = _printable(err)
        if 'no such container' in msg.lower():
            raise PodmanError(f'podman: no such container {ref}', 'absent')
        raise PodmanError(f'podman container inspect {ref} failed ({rc}): {msg or "no message"}')
    try:
        j = json.loads(out)
    except (ValueError, RecursionError):
        raise PodmanError(f'podman container inspect {ref}: not JSON') from None
    if not isinstance(j, list) or len(j) != 1 or not isinstance(j[0], dict):
        raise PodmanError(f'podman container inspect {ref}: not a list of one container')
    c = j[0]
    cid, name, st = c.get('Id'), c.get('Name'), c.get('State')
    if not isinstance(cid, str) or not ID_RE.fullmatch(cid):
        raise PodmanError(f'podman container inspect {ref}: Id is not 64 hex digits')
    if not isinstance(name, str) or not (REF_RE.fullmatch(name) or name == ''):
        raise PodmanError(f'podman container inspect {ref}: Name is not a container name')
    if not isinstance(st, dict):
        raise PodmanError(f'podman container inspect {ref}: State is not an object')
    status, pid = st.get('Status'), st.get('Pid')
    running = st.get('Running') is True or status == 'paused'
    if not isinstance(status, str) or not WORD_RE.fullmatch(status):
        raise PodmanError(f'podman container inspect {ref}: State.Status is not a word')
    if type(pid) is not int:
        raise PodmanError(f'podman container inspect {ref}: State.Pid is not an integer')
    if running:
        if not 1 <= pid <= PID_MAX:
            raise PodmanError(f'podman container inspect {ref}: State.Pid {pid} is outside '
                              f'[1, {PID_MAX}] for a running container')
    else:
        pid = None
    return dict(id=cid, name=name, pid=pid, status=status)


def check_cgroup_path(path):
    """A cgroup path from /proc/PID/cgroup: absolute, plain components."""
    if len(path) > MAX_DEPTH * (MAX_COMPONENT + 1) or not path.startswith('/'):
        raise PodmanError(f'cgroup path {path[:100]!r} is not absolute')
    parts = path[1:].split('/') if path != '/' else []
    if len(parts) > MAX_DEPTH:
        raise PodmanError(f'cgroup path {path[:100]!r}: more than {MAX_DEPTH} levels')
    for c in parts:
        if c in ('.', '..') or not COMPONENT_RE.fullmatch(c):
            raise PodmanError(f'cgroup path {path[:200]!r}: component {c[:100]!r} is not '
                              'a plain name')
    return parts


def parse_proc_cgroup(text):
    """/proc/PID/cgroup: (blkio path or None, v2 path or None)."""
    blkio = v2 = None
    for line in text.splitlines():
        hid, sep, rest = line.partition(':')
        ctrls, sep2, path = rest.partition(':')
        if not sep or not sep2 or not hid.isdigit():
            raise PodmanError(f'malformed /proc cgroup line {line[:100]!r}')
        if hid == '0' and ctrls == '':
            v2 = path
        elif 'blkio' in ctrls.split(','):
            blkio = path
    return blkio, v2


def _unescape(s):
    return re.sub(r'\\([0-7]{3})', lambda m: chr(int(m.group(1), 8)), s)


def cgroup_mounts(text):
    """/proc/self/mountinfo: {'blkio': (root, mountpoint), 'v2': (root,
    mountpoint)}, the first mount of each."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        try:
            sep = f.index('-')
        except ValueError:
            continue
        if len(f) < sep + 4 or sep < 5:
            continue
        fstype, supers = f[sep + 1], f[sep + 3].split(',')
        key = ('blkio' if fstype == 'cgroup' and 'blkio' in supers
               else 'v2' if fstype == 'cgroup2' else None)
        if key and key not in out:
            out[key] = (_unescape(f[3]), _unescape(f[4]))
    return out


def _dir_of(mount, path):
    """The directory of cgroup path in the mount (root, mountpoint)."""
    root, mnt = mount
    parts = check_cgroup_path(path)
    rparts = [] if root == '/' else root.strip('/').split('/')
    if parts[:len(rparts)] != rparts:
        raise PodmanError(f'cgroup {path[:200]} is outside the mount of {root[:100]} '
                          f'at {mnt[:100]}')
    return os.path.join(mnt, *parts[len(rparts):])


def _names(path, cid):
    """Whether a component of the cgroup path names the container's id."""
    return any(cid in c for c in check_cgroup_path(path))


def locate(found, proc_text, mountinfo_text):
    """The container's counter group (v1 blkio; on a host with v2 only,
    the unified group) and its v2 group for io.pressure (None if there is
    none, or it has no io.pressure), from its init's /proc/PID/cgroup and
    the mount table.  A group's path must name the container's id: the
    counter group's, or the container is refused; the v2 group's, or it is
    not used for io.pressure."""
    blkio, v2 = parse_proc_cgroup(proc_text)
    mounts = cgroup_mounts(mountinfo_text)
    cid = found['id']
    counters = pressure = None
    if blkio is not None and 'blkio' in mounts:
        counters, mount = blkio, mounts['blkio']
    elif v2 is not None and 'v2' in mounts:
        counters, mount = v2, mounts['v2']     # a v2-only host: io.stat
    if counters is None:
        raise PodmanError(f'container {cid[:12]}: no blkio (v1) or unified (v2) cgroup '
                          'mounted for it')
    if not _names(counters, cid):
        raise PodmanError(f'pid {found["pid"]} is in cgroup {counters[:200]}, which does '
                          f'not name container {cid[:12]} (it ended meanwhile, or runs '
                          'with --cgroups=disabled)')
    counters = _dir_of(mount, counters)
    if v2 is not None and 'v2' in mounts and _names(v2, cid):
        d = _dir_of(mounts['v2'], v2)
        if os.path.exists(os.path.join(d, 'io.pressure')):
            pressure = d
    return counters, pressure


class Found:
    """Where a container is: its id, name, init pid, counter group (v1
    blkio or v2), v2 group for io.pressure (or None), and the inode of the
    counter group's directory (a restart makes a new one)."""

    def __init__(self, ref, info, cgroup, pressure, ino):
        self.ref, self.id, self.name, self.pid = ref, info['id'], info['name'], info['pid']
        self.cgroup, self.pressure, self.ino = cgroup, pressure, ino

    def as_dict(self):
        return dict(podman=self.ref, id=self.id, name=self.name, pid=self.pid,
                    cgroup=self.cgroup, pressure=self.pressure)


def resolve(command, ref, timeout):
    """Found for the container podman knows as ref; PodmanError (kind
    'absent', 'stopped' or 'error') otherwise."""
    info = inspect(command, ref, timeout)
    if info['pid'] is None:
        raise PodmanError(f'container {ref} is not running (status {info["status"]})',
                          'stopped')
    try:
        proc = read_small(f'/proc/{info["pid"]}/cgroup')
    except SourceError:
        raise PodmanError(f'container {ref}: its pid {info["pid"]} is gone (it ended '
                          'meanwhile)', 'stopped') from None
    cgroup, pressure = locate(info, proc, read_small('/proc/self/mountinfo'))
    try:
        ino = os.stat(cgroup).st_ino
    except OSError as e:
        raise PodmanError(f'container {ref}: {cgroup}: {e.strerror}', 'stopped') from None
    return Found(ref, info, cgroup, pressure, ino)


def still_there(f):
    """Whether a container found earlier is still where it was: its init
    pid in a group whose path names its id, and its group the same
    directory."""
    try:
        blkio, v2 = parse_proc_cgroup(read_small(f'/proc/{f.pid}/cgroup'))
        return (any(p and f.id in p for p in (blkio, v2))
                and os.stat(f.cgroup).st_ino == f.ino)
    except (SourceError, OSError):
        return False


class Events(threading.Thread):
    """`podman events` for containers, kept running: each event's container
    name and id go to on_event(name, id), which looks the container up
    again.  The stream is bounded (a line of at most MAX_LINE bytes, JSON
    of an object whose Name and ID are strings; anything else is skipped
    and counted), started again after it ends (1 s, doubling to 30 s; at
    once again after one ran 30 s) with its reason logged once per
    change, and dies with the daemon.  state: 'starting', 'running' (it has
    run 1 s, or said something), 'error' (it ended; why in error)."""

    MAX_LINE = 1 << 16
    STABLE_S = 30.0

    def __init__(self, command, on_event, log):
        super().__init__(name='podman-events', daemon=True)
        self.command, self.on_event, self.log = command, on_event, log
        self.lock = threading.Lock()
        self.state, self.error, self.restarts, self.skipped = 'starting', None, 0, 0
        self.proc = None
        self.stop_ev = threading.Event()

    def status(self):
        with self.lock:
            p = self.proc
            return dict(state=self.state, error=self.error, restarts=self.restarts,
                        skipped=self.skipped,
                        pid=p.pid if p is not None and p.poll() is None else None)

    def _state(self, state, error=None):
        with self.lock:
            changed = (state, error) != (self.state, self.error)
            self.state, self.error = state, error
        if changed and state != 'starting':
            self.log(dict(event='podman-events', state=state, error=error))

    def line(self, raw):
        try:
            j = json.loads(raw)
            name, cid = j.get('Name'), j.get('ID')
            if not isinstance(name, str) or not isinstance(cid, str):
                raise ValueError
        except (ValueError, AttributeError, RecursionError):
            with self.lock:
                self.skipped += 1
            return
        self.on_event(name[:256], cid[:256])

    def stream(self):
        """Run one podman events until it ends; returns why it ended."""
        argv = _pdeath() + list(self.command) + ['events', '--format', 'json',
                                                 '--filter', 'type=container']
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env(), close_fds=True,
                                 start_new_session=True)
        except OSError as e:
            return f'{argv[0]}: {e.strerror}'
        self.proc = p
        out, err = bytearray(), bytearray()
        started = time.monotonic()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(p.stdout, selectors.EVENT_READ)
                sel.register(p.stderr, selectors.EVENT_READ)
                while sel.get_map() and not self.stop_ev.is_set():
                    ready = sel.select(0.5)
                    if self.state != 'running' and time.monotonic() - started > 1.0:
                        self._state('running')
                    for key, _ in ready:
                        d = os.read(key.fd, 65536)
                        if not d:
                            sel.unregister(key.fileobj)
                        elif key.fileobj is p.stderr:
                            err = (err + d)[-MAX_STDERR:]
                        else:
                            out += d
                            *lines, rest = out.split(b'\n')
                            if max(map(len, lines + [rest])) > self.MAX_LINE:
                                return f'a line of more than {self.MAX_LINE} bytes'
                            out = bytearray(rest)
                            for ln in lines:
                                if ln.strip():
                                    self._state('running')
                                    self.line(bytes(ln))
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = p.wait()
            p.stdout.close()
            p.stderr.close()
            self.ran = time.monotonic() - started
        return f'podman events exited ({rc}): {_printable(bytes(err)) or "no message"}'

    def run(self):
        backoff = 1.0
        while not self.stop_ev.is_set():
            self.ran = 0.0
            try:
                why = self.stream()
            except Exception as e:      # a bug here must not end the events for good
                why = f'podman-events bug: {type(e).__name__}: {e}'[:500]
            if self.stop_ev.is_set():
                break
            with self.lock:
                self.restarts += 1
            self._state('error', why)
            backoff = 1.0 if self.ran > self.STABLE_S else backoff
            self.stop_ev.wait(backoff)
            backoff = min(30.0, backoff * 2)

    def stop(self):
        self.stop_ev.set()
        p = self.proc
        if p and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.join(timeout=2)


class Watch(threading.Thread):
    """Finds the podman containers of the configuration and follows them
    (module docstring).  get(name) gives (Found or None, generation, why
    not); the generation changes whenever the container is found anew."""

    def __init__(self, conf, log):
        super().__init__(name='podman', daemon=True)
        self.command, self.timeout, self.log = conf.podman_command, conf.podman_timeout, log
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stop_ev = threading.Event()
        self.entries = {c.name: dict(ref=c.podman, found=None, gen=0, state='starting',
                                     error='not looked up yet', due=0.0, backoff=RETRY_MIN,
                                     checked=0.0, tried=0.0, kicked=False)
                        for c in conf.containers if c.podman}
        self.events = Events(self.command, self.on_event, log)

    def start(self):
        super().start()
        self.events.start()

    def on_event(self, name, cid):
        """podman reported an event of a container: if it is one of ours
        (by name, id or id prefix), look at it again now."""
        hit = False
        with self.lock:
            for e in self.entries.values():
                f = e['found']
                if e['ref'] == name or cid.startswith(e['ref']) or (f and f.id == cid):
                    e['due'] = e['checked'] = 0.0
                    e['kicked'] = hit = True
        if hit:
            self.wake.set()

    def get(self, name):
        with self.lock:
            e = self.entries[name]
            return e['found'], e['gen'], e['error']

    def recheck(self, name):
        """The daemon could not read the group: look again now."""
        with self.lock:
            e = self.entries[name]
            e['checked'] = 0.0
        self.wake.set()

    def status(self):
        with self.lock:
            return {n: dict(dict(state=e['state'], podman=e['ref'], error=e['error']),
                            **(e['found'].as_dict() if e['found'] else {}))
                    for n, e in self.entries.items()}

    def stop(self):
        self.stop_ev.set()
        self.wake.set()
        self.events.stop()
        self.join(timeout=1)        # a podman call under way is not waited for

    def _set(self, name, found=None, err=None, via=None):
        with self.lock:
            e = self.entries[name]
            before = (e['state'], e['found'] and (e['found'].id, e['found'].pid), e['error'])
            if found is not None:
                e['found'], e['error'], e['state'] = found, None, 'found'
                e['gen'] += 1
                e['backoff'] = RETRY_MIN
                e['checked'] = time.monotonic()
            else:
                e['found'], e['error'] = None, str(err)
                e['state'] = 'waiting' if err.kind in ('absent', 'stopped') else 'error'
                e['due'] = time.monotonic() + e['backoff']
                e['backoff'] = min(RETRY_MAX_EVENTS, e['backoff'] * 2)
            after = (e['state'], found and (found.id, found.pid), e['error'])
        if after != before:
            # via: what made the arbiter look (a podman event, a retry, the
            # found container's group no longer its own)
            rec = dict(event='container', container=name, state=after[0], via=via)
            rec.update(found.as_dict() if found else dict(podman=e['ref'], error=e['error']))
            self.log(rec)

    def step(self):
        """One pass: look up the containers that are due, check the
        found ones; returns the seconds until the next is due."""
        now = time.monotonic()
        nxt = CHECK_S
        # without podman's events, a container not there is looked for
        # every RETRY_MAX at least
        events = self.events.state == 'running'
        for name in list(self.entries):
            if self.stop_ev.is_set():
                break
            with self.lock:
                e = dict(self.entries[name])
                self.entries[name]['kicked'] = False
            f = e['found']
            if f is not None:
                if now - e['checked'] < CHECK_S:
                    nxt = min(nxt, CHECK_S - (now - e['checked']))
                    continue
                if still_there(f):
                    with self.lock:
                        self.entries[name]['checked'] = now
                    continue
                via = 'check'
            else:
                due = max(e['due'] if events else min(e['due'], e['tried'] + RETRY_MAX),
                          e['tried'] + EVENT_MIN_S)
                if now < due:
                    nxt = min(nxt, due - now)
                    with self.lock:
                        self.entries[name]['kicked'] |= e['kicked']
                    continue
                via = 'event' if e['kicked'] else 'retry'
            with self.lock:
                self.entries[name]['tried'] = now
            try:
                self._set(name, found=resolve(self.command, e['ref'], self.timeout), via=via)
            except PodmanError as err:
                self._set(name, err=err, via=via)
        return max(0.01, nxt)

    def run(self):
        while not self.stop_ev.is_set():
            try:
                wait = self.step()
            except Exception as e:      # a bug here must not end the lookups for good
                self.log(dict(event='podman-bug', error=f'{type(e).__name__}: {e}'[:500]))
                wait = RETRY_MAX
            self.wake.wait(wait)
            self.wake.clear()
