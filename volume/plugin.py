"""Podman's volume plugin for hybrid volumes (docs/containers.md).

Podman (and Docker) speak the Docker volume-plugin protocol: HTTP/1.1 POSTs
with JSON bodies over a Unix socket, one endpoint per call:

  /Plugin.Activate            -> {"Implements": ["VolumeDriver"]}
  /VolumeDriver.Create        {Name, Opts}  hvvol create (Opts: CREATE_OPTS)
  /VolumeDriver.Remove        {Name}        hvvol umount if the plugin mounted
                                            it and nothing uses it, then rm
                                            (the image goes with it)
  /VolumeDriver.Mount         {Name, ID}    hvvol mount on <run dir>/<name>/mnt,
                                            or the mount point it has already
  /VolumeDriver.Unmount       {Name, ID}    hvvol umount once no ID holds it
  /VolumeDriver.Path, .Get    {Name}        where it is mounted; its status
  /VolumeDriver.List, .Capabilities

Every reply holds "Err": "" or the message; a refusal is also a non-200
status (podman reads Err only then): 400 for bad input, 500 for a volume
that cannot do it (NotFound, Busy, FlushFailed...), 4xx for a request that
is not one (403 for a peer that is not root, 404 unknown endpoint, 405 not
a POST, 408 too slow, 413 too large, 431 headers too large, 501 chunked,
503 too many at once).

Mount and Unmount count references by ID: each ID counts once (podman 4
sends one fixed ID for all its containers and counts mounts itself; Docker
sends each container's), and the volume is unmounted when the last ID is
released.  The references live in this process only: the state is hvvol's.
After a restart, an Unmount finds no references and unmounts, and hvvol
itself refuses while a container or a process still uses the volume (it
looks in every mount namespace), so a lost count can fail an Unmount but
never pull a volume from under a container.  A volume mounted elsewhere
with `hvvol mount NAME DIR` is served as it is and never unmounted by the
plugin.

Every request is hostile until checked: one request per connection, its
head at most MAX_HEAD bytes, its body at most MAX_BODY bytes with a
Content-Length, all of it within the request timeout, at most
MAX_CONNECTIONS at once; names, IDs and options go through validate.py's
rules.  The socket's directory is root's 0700 and the socket 0600, and a
peer whose SO_PEERCRED uid is not 0 is refused anyway.
"""

import errno
import json
import os
import re
import signal
import socket
import stat
import struct
import sys
import threading
import time
import traceback

from .errors import AlreadyMounted, BadInput, Busy, NotMounted, VolumeError
from .hvvol import secure_dir
from .validate import CREATE_OPTIONS, check_name, check_path, shown

SOCKET = '/run/hybridvm/volume-plugin/hybridvm.sock'
MAX_HEAD = 64 << 10
MAX_BODY = 64 << 10
REQUEST_TIMEOUT = 10.0      # to read one request, head and body
MAX_CONNECTIONS = 32
MAX_IDS = 1024              # references held on one volume
DRAIN_TIMEOUT = 120         # at exit, for requests under way to finish
DRAIN_TIME = 2              # after a reply, for the rest of what the peer sends
DRAIN_BYTES = 1 << 20
LOCK_STRIPES = 64

CONTENT_TYPE = 'application/vnd.docker.plugins.v1.1+json'

# The create options a request may give: hvvol's, but for image (a path on
# the host chosen over a socket; adopt an existing image with `hvvol create
# NAME --image PATH`, and podman volume create then finds it).
CREATE_OPTS = tuple(o for o in CREATE_OPTIONS if o != 'image')
OPT_VALUE_MAX = 256
ID_RE = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z')

REASONS = {200: 'OK', 400: 'Bad Request', 403: 'Forbidden', 404: 'Not Found',
           405: 'Method Not Allowed', 408: 'Request Timeout', 411: 'Length Required',
           413: 'Payload Too Large', 431: 'Request Header Fields Too Large',
           500: 'Internal Server Error', 501: 'Not Implemented',
           503: 'Service Unavailable'}


class HTTPError(Exception):
    def __init__(self, status, msg):
        super().__init__(msg)
        self.status = status


class _Gone(Exception):
    """The peer closed before sending a whole request: nothing to answer."""


def _log(msg):
    try:
        sys.stderr.write(f'hvvol plugin: {msg}\n')
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


# -- requests -------------------------------------------------------------------

def check_id(value):
    """The mounting container's ID: podman's and Docker's are hex; missing
    or empty counts as the ID ''."""
    if value is None or value == '':
        return ''
    if not isinstance(value, str) or not ID_RE.match(value):
        raise BadInput(f'ID {shown(value)} is not a container ID: letters, digits, '
                       "'_', '.' and '-', at most 128")
    return value


def check_opts(opts, name):
    """The create options of a request: a mapping of at most len(CREATE_OPTS)
    known names to strings (what `podman volume create -o` sends)."""
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise BadInput(f'Opts {shown(opts)} is not a mapping of option names to values')
    if len(opts) > len(CREATE_OPTS):
        raise BadInput(f'{len(opts)} options: there are only {len(CREATE_OPTS)} '
                       f'({", ".join(CREATE_OPTS)})')
    for key, val in opts.items():
        if key == 'image':
            raise BadInput('option image is not taken from a plugin request: create the '
                           'volume with hvvol create NAME --image PATH, then podman volume '
                           'create --driver hybridvm NAME uses it')
        if key not in CREATE_OPTS:
            raise BadInput(f'unknown option {shown(key, 40)}: the options are '
                           + ', '.join(CREATE_OPTS))
        if not isinstance(val, str) or len(val) > OPT_VALUE_MAX:
            raise BadInput(f'option {key}: {shown(val)} is not a value (a string of at '
                           f'most {OPT_VALUE_MAX} characters)')
    if 'size' not in opts:
        raise BadInput(f'volume {name}: give its size, e.g. podman volume create '
                       f'--driver hybridvm -o size=1G {name}')
    return dict(opts)


def _field(req, key, required=True):
    if key not in req:
        if required:
            raise BadInput(f'the request has no {key}')
        return None
    return req[key]


class Plugin:
    """The endpoints, over one hvvol.Volumes.  Thread-safe: operations on
    one volume are serialised here (and by hvvol's lock across processes)."""

    def __init__(self, vols):
        self.vols = vols
        self.refs = {}                 # volume name -> set of IDs that mounted it
        self._refs_lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(LOCK_STRIPES)]
        self.routes = {
            '/Plugin.Activate': self.activate,
            '/VolumeDriver.Capabilities': self.capabilities,
            '/VolumeDriver.Create': self.create,
            '/VolumeDriver.Remove': self.remove,
            '/VolumeDriver.Mount': self.mount,
            '/VolumeDriver.Unmount': self.unmount,
            '/VolumeDriver.Path': self.path,
            '/VolumeDriver.Get': self.get,
            '/VolumeDriver.List': self.list,
        }

    def _lock(self, name):
        return self._stripes[hash(name) % LOCK_STRIPES]

    def _own_mountpoint(self, name):
        return os.path.join(self.vols.run_dir, name, 'mnt')

    def handle(self, path, body):
        """(status, reply) for a POST of body (bytes) to path."""
        fn = self.routes.get(path)
        if fn is None:
            raise HTTPError(404, f'no endpoint {shown(path, 60)}: this plugin implements '
                            + ', '.join(sorted(self.routes)))
        req = {}
        if body.strip():
            try:
                req = json.loads(body.decode('utf-8'))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise HTTPError(400, f'the body is not JSON: {shown(str(exc), 120)}') from None
        if not isinstance(req, dict):
            raise HTTPError(400, f'the body is not a JSON object: {shown(req, 60)}')
        try:
            reply = fn(req)
        except BadInput as exc:
            return 400, {'Err': str(exc)}
        except VolumeError as exc:
            return 500, {'Err': str(exc)}
        reply.setdefault('Err', '')
        return 200, reply

    # -- endpoints --
    def activate(self, req):
        return {'Implements': ['VolumeDriver']}

    def capabilities(self, req):
        return {'Capabilities': {'Scope': 'local'}}

    def create(self, req):
        name = check_name(_field(req, 'Name'))
        opts = check_opts(req.get('Opts'), name)
        with self._lock(name):
            cfg = self.vols.create(name, opts)
        _log(f'created volume {name}: {cfg["image"]}, {cfg["size"]} bytes, RAM tier '
             f'{cfg["ram_size"]} bytes, {cfg["mode"]}')
        return {}

    def _status(self, name):
        st = self.vols.status(name)
        mp = st.get('mountpoint') if st['state'] == 'mounted' else None
        return st, mp or ''

    def get(self, req):
        name = check_name(_field(req, 'Name'))
        st, mp = self._status(name)
        status = {k: st.get(k) for k in ('state', 'image', 'size', 'ram_size', 'mode',
                                         'region', 'pid', 'notes') if st.get(k) is not None}
        with self._refs_lock:
            status['mounted_for'] = sorted(self.refs.get(name, ()))
        return {'Volume': {'Name': name, 'Mountpoint': mp, 'Status': status}}

    def list(self, req):
        out = []
        for name in self.vols.names():
            try:
                _, mp = self._status(name)
            except VolumeError:
                mp = ''
            out.append({'Name': name, 'Mountpoint': mp})
        return {'Volumes': out}

    def path(self, req):
        name = check_name(_field(req, 'Name'))
        return {'Mountpoint': self._status(name)[1]}

    def mount(self, req):
        name = check_name(_field(req, 'Name'))
        cid = check_id(req.get('ID'))
        with self._lock(name):
            with self._refs_lock:
                ids = self.refs.get(name, set())
                if cid not in ids and len(ids) >= MAX_IDS:
                    raise Busy(f'volume {name} is mounted for {len(ids)} IDs already: no more')
            try:
                st = self.vols.mount(name)
                mp, how = st['mountpoint'], 'mounted'
                if st.get('recovered'):
                    how += f' ({st["recovered"]})'
            except AlreadyMounted as exc:
                mp, how = exc.mountpoint, 'mounted already'
            with self._refs_lock:
                self.refs.setdefault(name, set()).add(cid)
                n = len(self.refs[name])
        _log(f'volume {name} {how} on {mp} for {shown(cid, 20)} ({n} IDs)')
        return {'Mountpoint': mp}

    def unmount(self, req):
        name = check_name(_field(req, 'Name'))
        cid = check_id(req.get('ID'))
        with self._lock(name):
            with self._refs_lock:
                ids = self.refs.get(name, set())
                held = cid in ids
                ids.discard(cid)
                if ids:
                    _log(f'volume {name} released by {shown(cid, 20)}: still mounted for '
                         f'{len(ids)} IDs')
                    return {}
                self.refs.pop(name, None)
            try:
                self._umount_own(name)
            except VolumeError:
                if held:        # still mounted for it
                    with self._refs_lock:
                        self.refs.setdefault(name, set()).add(cid)
                raise
        return {}

    def _umount_own(self, name):
        """hvvol umount, if the volume has a daemon and is not mounted
        where someone else put it; hvvol refuses while anything uses it."""
        st = self.vols.status(name)
        if st['state'] == 'stopped':
            return
        if st.get('mountpoint') and st['mountpoint'] != self._own_mountpoint(name):
            _log(f'volume {name} stays mounted on {st["mountpoint"]}: hvvol mount put it '
                 'there, not this plugin')
            return
        try:
            res = self.vols.umount(name)
        except NotMounted:
            return
        _log(f'volume {name} unmounted, written back and stopped' +
             (' (its dead daemon was cleaned up first)' if res.get('recovered') else ''))

    def remove(self, req):
        name = check_name(_field(req, 'Name'))
        with self._lock(name):
            self._umount_own(name)
            self.vols.remove(name)
            with self._refs_lock:
                self.refs.pop(name, None)
        _log(f'volume {name} removed, its image deleted')
        return {}


# -- HTTP over the socket ---------------------------------------------------------

def peer_cred(conn):
    """(pid, uid, gid) of the connected peer, as the kernel saw it at connect."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize('3i'))
    return struct.unpack('3i', raw)


def _recv(conn, deadline, timeout, n=65536):
    left = deadline - time.monotonic()
    if left > 0:
        conn.settimeout(left)
        try:
            return conn.recv(n)
        except socket.timeout:
            pass
    raise HTTPError(408, f'the request did not arrive in time (at most {timeout:g} s)')


def read_request(conn, timeout):
    """(method, path, body) of one HTTP/1.x request, bounded."""
    deadline = time.monotonic() + timeout
    buf = b''
    while True:
        end = buf.find(b'\r\n\r\n')
        if end >= 0:
            break
        if len(buf) > MAX_HEAD:
            raise HTTPError(431, f'the request head is larger than {MAX_HEAD} bytes')
        chunk = _recv(conn, deadline, timeout)
        if not chunk:
            raise _Gone()
        buf += chunk
    if end > MAX_HEAD:
        raise HTTPError(431, f'the request head is larger than {MAX_HEAD} bytes')
    head, rest = buf[:end].decode('latin-1'), buf[end + 4:]
    lines = head.split('\r\n')
    parts = lines[0].split(' ')
    if len(parts) != 3 or not parts[2].startswith('HTTP/1.'):
        raise HTTPError(400, f'not an HTTP/1.x request line: {shown(lines[0], 60)}')
    method, target = parts[0], parts[1]
    headers = {}
    for line in lines[1:]:
        key, sep, val = line.partition(':')
        if not sep or not key or key != key.strip():
            raise HTTPError(400, f'not a header line: {shown(line, 60)}')
        key, val = key.lower(), val.strip()
        if key in headers and headers[key] != val:
            raise HTTPError(400, f'header {key} given twice, differently')
        headers[key] = val
    if 'transfer-encoding' in headers:
        raise HTTPError(501, 'a body must come with its Content-Length '
                             f'(Transfer-Encoding {shown(headers["transfer-encoding"], 30)} '
                             'is not taken)')
    length = headers.get('content-length', '0')
    if not length.isdigit() or len(length) > 20:
        raise HTTPError(400, f'Content-Length {shown(length, 30)} is not a length')
    length = int(length)
    if length > MAX_BODY:
        raise HTTPError(413, f'the body has {length} bytes, at most {MAX_BODY}')
    if method != 'POST':
        raise HTTPError(405, f'method {shown(method, 20)}: the plugin takes POST only')
    if target.startswith('http://') or target.startswith('https://'):
        target = '/' + target.split('/', 3)[3] if target.count('/') >= 3 else '/'
    path = target.split('?', 1)[0]
    while len(rest) < length:
        chunk = _recv(conn, deadline, timeout)
        if not chunk:
            raise _Gone()
        rest += chunk
    return method, path, rest[:length]


def _reply_bytes(status, obj):
    body = json.dumps(obj).encode()
    head = (f'HTTP/1.1 {status} {REASONS.get(status, "")}\r\n'
            f'Content-Type: {CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n'
            'Connection: close\r\n\r\n').encode()
    return head + body


def send_reply(conn, status, obj):
    conn.settimeout(10)
    conn.sendall(_reply_bytes(status, obj))


def _close(conn, drain=True):
    """Close after the reply was sent: stop writing, then read what the peer
    still sends, bounded: closing a Unix socket with unread data makes the
    peer's next read fail with ECONNRESET, before it sees the reply."""
    try:
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + DRAIN_TIME
        got = 0
        while drain and got < DRAIN_BYTES and time.monotonic() < deadline:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += len(chunk)
    except OSError:
        pass
    conn.close()


class Server:
    """The listening socket and one thread per connection."""

    def __init__(self, plugin, path, request_timeout=REQUEST_TIMEOUT):
        self.plugin = plugin
        self.path = check_path(path, 'plugin socket')
        self.request_timeout = request_timeout
        self.sock = None
        self.ino = None
        self.stopping = threading.Event()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.active = 0
        self.active_lock = threading.Lock()

    def bind(self):
        if len(self.path.encode()) > 107:
            raise BadInput(f'plugin socket {self.path} is {len(self.path.encode())} bytes '
                           'long: a Unix socket path holds at most 107')
        secure_dir(os.path.dirname(self.path), 'plugin socket directory')
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise BadInput(f'plugin socket {self.path} exists and is not a socket')
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(2)
            try:
                probe.connect(self.path)
                raise Busy(f'another plugin answers on {self.path} already')
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(self.path)        # a dead plugin's socket
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        self.sock = sock
        self.ino = os.lstat(self.path).st_ino

    def serve(self):
        self.sock.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self.stopping.is_set():
                    break
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    _log(f'accept: {exc.strerror}; waiting')
                    time.sleep(0.5)
                    continue
                raise
            if not self.slots.acquire(blocking=False):
                # answered here and closed at once: this thread accepts
                # the others and must not wait on this peer (one that had
                # sent a request may see a reset instead of the 503)
                try:
                    conn.setblocking(False)
                    conn.send(_reply_bytes(503, {'Err': f'the plugin serves {MAX_CONNECTIONS} '
                                                        'requests at once already: try '
                                                        'again'}))
                except OSError:
                    pass
                _close(conn, drain=False)
                continue
            with self.active_lock:
                self.active += 1
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn):
        what = '?'
        try:
            try:
                pid, uid, _ = peer_cred(conn)
                what = f'pid {pid} uid {uid}'
                if uid != 0:
                    raise HTTPError(403, f'only root may use this plugin (the peer, pid {pid}, '
                                         f'runs as uid {uid})')
                _, path, body = read_request(conn, self.request_timeout)
                what += f' {shown(path, 40)}'
                status, reply = self.plugin.handle(path, body)
            except HTTPError as exc:
                status, reply = exc.status, {'Err': str(exc)}
            except _Gone:
                return
            except Exception as exc:        # noqa: BLE001 (a bug must not kill the plugin)
                _log(f'{what}: internal error: {traceback.format_exc()}')
                status, reply = 500, {'Err': f'internal error in the plugin: {exc!r}'}
            # (podman asks for a volume before each create: no news)
            if status != 200 and not (what.endswith("'/VolumeDriver.Get'") and
                                      reply['Err'].endswith(' does not exist')):
                _log(f'{what}: {status}: {reply["Err"]}')
            try:
                send_reply(conn, status, reply)
            except OSError as exc:
                _log(f'{what}: the reply could not be sent: {exc.strerror or exc}')
        finally:
            _close(conn)
            with self.active_lock:
                self.active -= 1
            self.slots.release()

    def stop(self):
        """Stop accepting, remove the socket (if it is still ours) and wait
        for the requests under way.  Mounted volumes stay mounted."""
        self.stopping.set()
        if self.sock is not None:
            self.sock.close()
        try:
            if os.lstat(self.path).st_ino == self.ino:
                os.unlink(self.path)
        except OSError:
            pass
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while time.monotonic() < deadline:
            with self.active_lock:
                if self.active == 0:
                    return True
            time.sleep(0.05)
        return False


def run(vols, path=SOCKET, request_timeout=REQUEST_TIMEOUT):
    """Serve until SIGTERM or SIGINT; then let requests under way end."""
    if os.geteuid() != 0:
        raise BadInput('the plugin must run as root: it mounts file systems')
    server = Server(Plugin(vols), path, request_timeout)
    server.bind()

    def _stop(signum, frame):
        server.stopping.set()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    _log(f'listening on {server.path} (volumes in {vols.config_dir})')
    try:
        server.serve()
    finally:
        if not server.stop():
            _log(f'requests still under way after {DRAIN_TIMEOUT} s: exiting anyway '
                 '(hvvol\'s state lets the next command finish them)')
    _log('stopped; mounted volumes stay mounted')
