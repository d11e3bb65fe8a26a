"""The podman volume plugin (`hvvol plugin`, volume/plugin.py), issue 37
item 1: the protocol straight on its socket, then real podman through it.

- the protocol: create, get, list, mount for two IDs (one volume, one
  mount), unmount per ID, path, remove (the image goes); a volume that
  `hvvol mount` put elsewhere is served where it is and left mounted; an
  Unmount while a process uses the volume is refused naming it; a plugin
  restarted with a mounted volume (it knows no IDs) unmounts it at the
  next Unmount;
- hostile requests: traversal and garbage in Name, ID and Opts, absurd
  sizes, unknown options, image paths, non-JSON, deep nesting, a huge
  body, huge headers, chunked bodies, other methods and paths, a client
  too slow, a flood of connections, a client that is not root (refused by
  the socket's directory, and by SO_PEERCRED when it gets through): each
  a clear error, nothing created, the plugin still answers;
- the socket: its directory 0700 and the socket 0600; a directory open to
  others, a file in the socket's place and a second plugin are refused;
  a dead plugin's socket is replaced; SIGTERM removes the socket and
  leaves mounted volumes mounted;
- podman 4.3 through the plugin (containers.conf [engine.volume_plugins]):
  `podman volume create --driver hybridvm -o size=... -o ram-size=... -o
  mode=async`, a container writes, a second reads every file back; bad
  options refused through podman; two containers at once on one volume;
  `podman volume rm` refused while one uses it (podman's own check) and
  the plugin's Remove refused too; rm deletes the image (a re-created
  volume of the same name is empty); a host process on the volume when
  the last container goes (podman reports the refusal, the volume stays
  mounted, podman volume unmount later); the plugin killed and restarted under
  a running container; the plugin down at `podman volume rm` (podman
  forgets the volume, hvvol keeps it, and a create adopts it with its
  data).
"""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import privatens                                 # noqa: E402
from vollib import HVVOL, VolumeTest, wait_for                      # noqa: E402
from volume.plugin import MAX_BODY, MAX_CONNECTIONS, MAX_HEAD        # noqa: E402
from hvlib.podman import Podman, PodmanMissing                       # noqa: E402

REQUEST_TIMEOUT = 2     # the plugin's, in these tests (a slow client waits this long)
PODMAN_ID = '2f73349cfc4630255319c6c8dfc1b46a8996ace9d14d8e07563b165915918ec2'


def http(sock_path, raw, timeout=60, send_more=b''):
    """Send raw bytes (then send_more, ignoring a peer that stopped
    reading) and read the reply: (status, JSON object or the raw body)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
        s.sendall(raw)
        if send_more:
            try:
                s.sendall(send_more)
            except OSError:
                pass
        data = b''
        while True:
            chunk = s.recv(65536)       # a reset here is a failure: the reply was lost
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b'\r\n\r\n')
    status = int(head.split(b' ')[1]) if head.startswith(b'HTTP/1.1 ') else None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def post(path, body):
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return (f'POST {path} HTTP/1.1\r\nHost: plugin\r\n'
            f'Content-Type: application/vnd.docker.plugins.v1.1+json\r\n'
            f'Content-Length: {len(body)}\r\n\r\n').encode() + body


class PluginTest(VolumeTest):
    """A plugin process on a socket of this test's own, over its volumes."""

    def setUp(self):
        privatens.enter()
        super().setUp()
        self.sock = os.path.join(self.tmp, 'plugin', 'hybridvm.sock')
        self.plugin = None
        self.plugin_logs = []
        self.start_plugin()

    def tearDown(self):
        self.stop_plugin()
        super().tearDown()

    def start_plugin(self, sock=None, check=True):
        sock = sock or self.sock
        log = open(os.path.join(self.tmp, f'plugin{len(self.plugin_logs)}.log'), 'w+')
        self.plugin_logs.append(log)
        proc = subprocess.Popen([HVVOL, '--dir', self.conf, '--run-dir', self.run_dir,
                                 'plugin', '--socket', sock, '--request-timeout',
                                 str(REQUEST_TIMEOUT)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        if not check:
            return proc
        self.plugin = proc
        wait_for(lambda: proc.poll() is not None or 'listening on' in self.plugin_log(),
                 30, 'the plugin to listen')
        self.assertIsNone(proc.poll(), self.plugin_log())
        return proc

    def plugin_log(self, i=-1):
        f = self.plugin_logs[i]
        f.seek(0)
        return f.read()

    def stop_plugin(self, sig=signal.SIGTERM):
        proc, self.plugin = self.plugin, None
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(sig)
        try:
            return proc.wait(150)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def call(self, endpoint, obj=None, **kw):
        body = b'' if obj is None else obj
        return http(self.sock, post('/' + endpoint, body), **kw)

    def ok(self, endpoint, obj=None):
        status, reply = self.call(endpoint, obj)
        self.assertEqual(status, 200, reply)
        self.assertEqual(reply['Err'], '')
        return reply


class ProtocolTest(PluginTest):

    def test_lifecycle(self):
        """Activate, Capabilities, Create, Get, List, Mount for two IDs,
        Unmount per ID, Path, Remove: the volume is mounted once, unmounted
        when the last ID lets go, and Remove deletes its image."""
        self.assertEqual(self.ok('Plugin.Activate')['Implements'], ['VolumeDriver'])
        self.assertEqual(self.ok('VolumeDriver.Capabilities')['Capabilities'],
                         {'Scope': 'local'})
        self.ok('VolumeDriver.Create', {'Name': 'v1', 'Opts': {
            'size': '64M', 'ram-size': '16M', 'mode': 'async', 'block-size': '64K',
            'dirty-limit': '8M', 'prealloc': 'off', 'fs': 'ext4'}})
        cfg = self.vols._config('v1')
        self.assertEqual((cfg['size'], cfg['ram_size'], cfg['mode'], cfg['dirty_limit']),
                         (64 << 20, 16 << 20, 'async', 8 << 20))
        status, reply = self.call('VolumeDriver.Create', {'Name': 'v1', 'Opts': {'size': '64M'}})
        self.assertEqual(status, 500)
        self.assertIn('exists already', reply['Err'])
        vol = self.ok('VolumeDriver.Get', {'Name': 'v1'})['Volume']
        self.assertEqual((vol['Name'], vol['Mountpoint'], vol['Status']['state']),
                         ('v1', '', 'stopped'))
        self.assertEqual(self.ok('VolumeDriver.List')['Volumes'],
                         [{'Name': 'v1', 'Mountpoint': ''}])
        mp = self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'a1'})['Mountpoint']
        self.assertEqual(mp, os.path.join(self.run_dir, 'v1', 'mnt'))
        pid = self.vols.status('v1')['pid']
        with open(os.path.join(mp, 'f'), 'w') as f:
            f.write('kept\n')
        self.assertEqual(self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'b2'})['Mountpoint'],
                         mp)
        self.assertEqual(self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'a1'})['Mountpoint'],
                         mp)
        self.assertEqual(self.vols.status('v1')['pid'], pid, 'one daemon, one mount')
        self.assertEqual(self.ok('VolumeDriver.Get', {'Name': 'v1'})['Volume']['Status']
                         ['mounted_for'], ['a1', 'b2'])
        self.assertEqual(self.ok('VolumeDriver.Path', {'Name': 'v1'})['Mountpoint'], mp)
        self.ok('VolumeDriver.Unmount', {'Name': 'v1', 'ID': 'a1'})
        self.assertEqual(self.vols.status('v1')['state'], 'mounted', 'b2 still holds it')
        self.ok('VolumeDriver.Unmount', {'Name': 'v1', 'ID': 'b2'})
        self.assertEqual(self.vols.status('v1')['state'], 'stopped')
        self.assertTrue(self.image_clean(cfg['image']))
        self.assertEqual(self.ok('VolumeDriver.Path', {'Name': 'v1'})['Mountpoint'], '')
        self.ok('VolumeDriver.Unmount', {'Name': 'v1', 'ID': 'b2'})     # again: nothing to do
        mp = self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'c3'})['Mountpoint']
        with open(os.path.join(mp, 'f')) as f:
            self.assertEqual(f.read(), 'kept\n')
        self.ok('VolumeDriver.Unmount', {'Name': 'v1', 'ID': 'c3'})
        self.ok('VolumeDriver.Remove', {'Name': 'v1'})
        self.assertFalse(os.path.exists(cfg['image']))
        self.assertEqual(self.vols.names(), [])
        status, reply = self.call('VolumeDriver.Get', {'Name': 'v1'})
        self.assertEqual((status, reply['Err']), (500, 'volume v1 does not exist'))
        status, reply = self.call('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'a1'})
        self.assertEqual((status, reply['Err']), (500, 'volume v1 does not exist'))

    def test_unmount_refused_while_used(self):
        """A process with a file open on the volume: Unmount is refused
        naming it, the volume stays mounted for the ID; once the file is
        closed the next Unmount goes through; Remove likewise."""
        self.ok('VolumeDriver.Create', {'Name': 'v1', 'Opts': {'size': '64M'}})
        mp = self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'a1'})['Mountpoint']
        holder = subprocess.Popen(['sh', '-c', f'exec 3>{mp}/held; echo open; exec sleep 600'],
                                  stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(holder.stdout.readline(), 'open\n')
            for endpoint in ('VolumeDriver.Unmount', 'VolumeDriver.Remove'):
                status, reply = self.call(endpoint, {'Name': 'v1', 'ID': 'a1'})
                self.assertEqual(status, 500, reply)
                self.assertIn(f'pid {holder.pid} (sleep): open file', reply['Err'])
                self.assertEqual(self.vols.status('v1')['state'], 'mounted')
            self.assertEqual(self.ok('VolumeDriver.Get', {'Name': 'v1'})['Volume']['Status']
                             ['mounted_for'], ['a1'])
        finally:
            holder.kill()
            holder.wait()
            holder.stdout.close()
        self.ok('VolumeDriver.Unmount', {'Name': 'v1', 'ID': 'a1'})
        self.assertEqual(self.vols.status('v1')['state'], 'stopped')
        self.assertTrue(os.path.exists(os.path.join(self.conf, 'v1', 'disk.hyb')))

    def test_volume_mounted_by_hvvol(self):
        """A volume that `hvvol mount` put on a directory of its own: Mount
        answers that directory, Unmount leaves it mounted there, Remove is
        refused; hvvol umount and rm still work."""
        self.hvvol('create', 'v1', '--size', '64M')
        mp = self.mountpoint('srv')
        self.hvvol('mount', 'v1', mp)
        self.assertEqual(self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'a1'})['Mountpoint'],
                         mp)
        self.ok('VolumeDriver.Unmount', {'Name': 'v1', 'ID': 'a1'})
        self.assertEqual(self.vols.status('v1')['state'], 'mounted')
        self.assertIn('stays mounted on ' + mp, self.plugin_log())
        status, reply = self.call('VolumeDriver.Remove', {'Name': 'v1'})
        self.assertEqual(status, 500)
        self.assertIn(f'in use at {mp}', reply['Err'])
        self.hvvol('umount', 'v1')
        self.ok('VolumeDriver.Remove', {'Name': 'v1'})

    def test_restart_with_mounted_volume(self):
        """The plugin killed with a volume mounted for an ID: the volume
        stays mounted; a new plugin replaces the dead socket, answers
        Mount with the mount point, and the next Unmount (an ID it never
        saw) unmounts: the plugin keeps no state of its own."""
        self.ok('VolumeDriver.Create', {'Name': 'v1', 'Opts': {'size': '64M',
                                                               'mode': 'async'}})
        mp = self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': PODMAN_ID})['Mountpoint']
        with open(os.path.join(mp, 'f'), 'w') as f:
            f.write('before\n')
        self.stop_plugin(signal.SIGKILL)
        self.assertTrue(stat.S_ISSOCK(os.lstat(self.sock).st_mode), 'a dead socket is left')
        self.assertEqual(self.vols.status('v1')['state'], 'mounted')
        self.start_plugin()
        self.assertEqual(self.ok('VolumeDriver.Path', {'Name': 'v1'})['Mountpoint'], mp)
        self.ok('VolumeDriver.Unmount', {'Name': 'v1', 'ID': PODMAN_ID})
        self.assertEqual(self.vols.status('v1')['state'], 'stopped')
        mp = self.ok('VolumeDriver.Mount', {'Name': 'v1', 'ID': 'x'})['Mountpoint']
        with open(os.path.join(mp, 'f')) as f:
            self.assertEqual(f.read(), 'before\n')
        # SIGTERM: the socket goes, the volume stays mounted
        self.assertEqual(self.stop_plugin(), 0)
        self.assertFalse(os.path.exists(self.sock))
        self.assertEqual(self.vols.status('v1')['state'], 'mounted')
        self.assertIn('mounted volumes stay mounted', self.plugin_log())


class HostileTest(PluginTest):

    def assert_refused(self, endpoint, obj, status, *words):
        got, reply = self.call(endpoint, obj)
        self.assertEqual(got, status, f'{endpoint} {obj!r:.80}: {reply!r:.300}')
        self.assertIsInstance(reply, dict, reply)
        for w in words:
            self.assertIn(w, reply['Err'], f'{obj!r:.80}')
        return reply['Err']

    def assert_untouched(self):
        self.assertEqual(self.vols.names(), [])
        self.assertEqual(sorted(os.listdir(self.conf)), [])
        self.assertEqual([f for f in os.listdir(self.run_dir) if not f.endswith('.lock')], [])
        self.ok('Plugin.Activate')

    def test_names_and_ids(self):
        """Traversal, absolute paths, NUL, newlines, 100 000 characters,
        non-strings in Name and ID: 400 naming the rule; nothing created
        anywhere (not in /tmp either)."""
        names = ['../x', '../../tmp/hvvol-escape', '/etc', 'a/b', '.', '..', '', ' x',
                 'x\0y', 'x\ny', '-x', 'x' * 65, 'x' * 60000, 5, None, ['v'], {'a': 1},
                 True, 'é']
        for name in names:
            for endpoint in ('Create', 'Remove', 'Mount', 'Unmount', 'Path', 'Get'):
                self.assert_refused('VolumeDriver.' + endpoint,
                                    {'Name': name, 'ID': 'a', 'Opts': {'size': '64M'}},
                                    400, 'volume name')
        for cid in ('../x', '/x', 'a b', 'x' * 129, 7, ['a'], 'a\0'):
            for endpoint in ('Mount', 'Unmount'):
                self.assert_refused('VolumeDriver.' + endpoint, {'Name': 'v1', 'ID': cid},
                                    400, 'is not a container ID')
        self.assert_refused('VolumeDriver.Create', {'Opts': {'size': '64M'}}, 400, 'no Name')
        self.assert_refused('VolumeDriver.Create', {'Name': 'x' * 100000}, 413, 'at most')
        self.assertFalse(os.path.exists('/tmp/hvvol-escape'))
        self.assert_untouched()

    def test_options(self):
        """Unknown options, an image path, absurd sizes, a RAM tier beyond
        the volume, modes, values that are not strings, too many options,
        Opts that is not a mapping, no size: 400 naming the option."""
        cases = [
            ({'size': '64M', 'foo': 'bar'}, 'unknown option', "'foo'"),
            ({'size': '64M', '../../etc': 'x'}, 'unknown option'),
            ({'size': '64M', 'image': '/etc/passwd'}, 'hvvol create NAME --image'),
            ({'size': '64M', 'image': '/tmp/x.hyb'}, 'not taken from a plugin request'),
            ({'size': '1E'}, 'is not a size'),
            ({'size': '99999999999999999999P'}, 'out of range'),
            ({'size': '1P'}, 'out of range', '64TiB'),
            ({'size': '0'}, 'out of range'),
            ({'size': '-1'}, 'is not a size'),
            ({'size': '1' * 300}, 'is not a value'),
            ({'size': 'NaN'}, 'is not a size'),
            ({'size': 1 << 30}, 'is not a value'),
            ({'size': ['1G']}, 'is not a value'),
            ({'size': '64M', 'ram-size': '1G'}, 'larger than the volume'),
            ({'size': '64M', 'mode': 'writeback'}, 'not sync or async'),
            ({'size': '64M', 'block-size': '3000'}, 'block-size'),
            ({'size': '64M', 'dirty-limit': '1K'}, 'dirty-limit'),
            ({'size': '64M', 'fs': 'xfs;reboot'}, 'fs'),
            ({'size': '64M', 'prealloc': 'maybe'}, 'on/off'),
            ({'size': '64M', 'region': '../r'}, 'not a region name'),
            ({'ram-size': '64M'}, 'give its size', '-o size=1G v1'),
            ({}, 'give its size'),
            ({str(i): 'x' for i in range(50)}, '50 options'),
            ('size=64M', 'not a mapping'),
            (['size', '64M'], 'not a mapping'),
        ]
        for opts, *words in cases:
            self.assert_refused('VolumeDriver.Create', {'Name': 'v1', 'Opts': opts}, 400,
                                *words)
        self.assertFalse(os.path.exists('/tmp/x.hyb'))
        # a size no disk here holds, preallocated: refused by the free-space check
        self.assert_refused('VolumeDriver.Create', {'Name': 'v1', 'Opts': {'size': '64T'}},
                            500, 'MiB free', 'prealloc=off')
        self.assert_untouched()

    def test_malformed_requests(self):
        """Not JSON, not an object, invalid UTF-8, nesting 60 000 deep, a
        body over the limit (declared or sent), a head over the limit,
        chunked, no CRLFs, other methods, unknown endpoints, a path with
        traversal: each its status and message."""
        cases = [
            (post('/VolumeDriver.Create', b'{"Name": "v1", '), 400, 'not JSON'),
            (post('/VolumeDriver.Create', b'garbage'), 400, 'not JSON'),
            (post('/VolumeDriver.Create', b'[1, 2]'), 400, 'not a JSON object'),
            (post('/VolumeDriver.Create', b'"v1"'), 400, 'not a JSON object'),
            (post('/VolumeDriver.Create', b'\xff\xfe{}'), 400, 'not JSON'),
            (post('/VolumeDriver.Create', b'[' * 60000), 400, 'not JSON'),
            (post('/VolumeDriver.Create', b'{"Name": 1' + b'0' * 5000 + b'}'), 400, 'not JSON'),
            (post('/VolumeDriver.Create', b' ' * (MAX_BODY + 1)), 413, f'at most {MAX_BODY}'),
            (b'POST /VolumeDriver.Create HTTP/1.1\r\nContent-Length: 100000000000\r\n\r\n',
             413, 'at most'),
            (b'POST /VolumeDriver.Create HTTP/1.1\r\nContent-Length: ' + b'9' * 30 + b'\r\n\r\n',
             400, 'not a length'),
            (b'POST /VolumeDriver.Create HTTP/1.1\r\nContent-Length: -5\r\n\r\n', 400,
             'not a length'),
            (b'POST /VolumeDriver.Create HTTP/1.1\r\nContent-Length: 2\r\n'
             b'Content-Length: 3\r\n\r\n{}', 400, 'twice'),
            (b'POST /VolumeDriver.Create HTTP/1.1\r\nX: ' + b'a' * (MAX_HEAD + 10) + b'\r\n\r\n',
             431, 'head is larger'),
            (b'POST /VolumeDriver.Create HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n'
             b'2\r\n{}\r\n0\r\n\r\n', 501, 'Content-Length'),
            (b'GET /VolumeDriver.List HTTP/1.1\r\n\r\n', 405, 'POST only'),
            (b'POST /VolumeDriver.List\r\n\r\n', 400, 'request line'),
            (b'POST /VolumeDriver.List HTTP/1.1\r\nno colon\r\n\r\n', 400, 'header line'),
            (post('/VolumeDriver.Destroy', b'{}'), 404, 'no endpoint'),
            (post('/../../VolumeDriver.Create', b'{}'), 404, 'no endpoint'),
            (post('/', b'{}'), 404, 'no endpoint'),
        ]
        for raw, status, word in cases:
            got, reply = http(self.sock, raw)
            self.assertEqual(got, status, f'{raw[:80]!r}: {reply!r:.200}')
            self.assertIn(word, reply['Err'], raw[:80])
        # a declared 1 GiB body whose first MiB is sent: 413, and the reply
        # is read, not lost to a reset
        got, reply = http(self.sock, b'POST /VolumeDriver.Create HTTP/1.1\r\n'
                          b'Content-Length: 1073741824\r\n\r\n', send_more=b'{' * (1 << 20))
        self.assertEqual(got, 413, reply)
        # a head with no CRLF CRLF that never ends: 431 at the limit
        got, reply = http(self.sock, b'POST /VolumeDriver.List HTTP/1.1\n' * 4000)
        self.assertEqual(got, 431, reply)
        self.assert_untouched()

    def test_slow_clients_and_a_flood(self):
        """A client that sends half a request and waits: 408 after the
        request timeout.  More connections at once than MAX_CONNECTIONS:
        the extra ones get 503 at once; then the plugin answers again."""
        t0 = time.monotonic()
        got, reply = http(self.sock, b'POST /VolumeDriver.List HTTP/1.1\r\nContent-Le')
        self.assertEqual(got, 408, reply)
        self.assertIn(f'at most {REQUEST_TIMEOUT} s', reply['Err'])
        self.assertGreaterEqual(time.monotonic() - t0, REQUEST_TIMEOUT - 0.1)
        got, reply = http(self.sock, b'POST /VolumeDriver.Create HTTP/1.1\r\n'
                          b'Content-Length: 100\r\n\r\n{"Name"')
        self.assertEqual(got, 408, reply)
        socks = []
        try:
            for _ in range(MAX_CONNECTIONS + 8):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(REQUEST_TIMEOUT + 10)
                s.connect(self.sock)
                socks.append(s)
            t0 = time.monotonic()
            busy = 0
            for s in socks[MAX_CONNECTIONS:]:
                data = s.recv(65536)
                self.assertIn(b' 503 ', data.split(b'\r\n')[0])
                busy += 1
            self.assertEqual(busy, 8)
            self.assertLess(time.monotonic() - t0, REQUEST_TIMEOUT, 'the 503s came at once')
        finally:
            for s in socks:
                s.close()
        wait_for(lambda: self.call('Plugin.Activate')[0] == 200, 30, 'the plugin to answer')
        self.assert_untouched()

    def test_non_root_client(self):
        """The socket's directory is root's 0700 and the socket 0600: a
        client running as nobody cannot connect; one that gets through
        anyway (CAP_DAC_OVERRIDE kept) is refused by SO_PEERCRED with 403."""
        d = os.path.dirname(self.sock)
        self.assertEqual(stat.S_IMODE(os.stat(d).st_mode), 0o700)
        st = os.lstat(self.sock)
        self.assertEqual((st.st_uid, stat.S_IMODE(st.st_mode)), (0, 0o600))
        client = ('import socket, sys\n'
                  's = socket.socket(socket.AF_UNIX)\n'
                  'try:\n'
                  '    s.connect(sys.argv[1])\n'
                  'except OSError as e:\n'
                  '    print("connect:", e.strerror); sys.exit(0)\n'
                  'b = b\'{"Name": "v1", "Opts": {"size": "64M"}}\'\n'
                  's.sendall(b"POST /VolumeDriver.Create HTTP/1.1\\r\\nContent-Length: %d'
                  '\\r\\n\\r\\n" % len(b) + b)\n'
                  'print(s.makefile("rb").read().decode())\n')
        base = ['setpriv', '--reuid=65534', '--regid=65534', '--clear-groups']
        p = subprocess.run(base + ['/usr/bin/python3', '-c', client, self.sock],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.stdout.strip(), 'connect: Permission denied', p.stderr)
        p = subprocess.run(base + ['--inh-caps=+dac_override', '--ambient-caps=+dac_override',
                                   '/usr/bin/python3', '-c', client, self.sock],
                           capture_output=True, text=True, timeout=60)
        self.assertIn('HTTP/1.1 403', p.stdout, p.stderr)
        self.assertIn('only root may use this plugin', p.stdout)
        self.assertIn('runs as uid 65534', p.stdout)
        self.assert_untouched()

    def test_socket_place(self):
        """A socket directory open to others, a file where the socket goes,
        a socket path too long for the kernel: refused at start, exit 2.  A
        second plugin on a live socket: refused, exit 1, the first one
        unharmed."""
        open_dir = os.path.join(self.tmp, 'open')
        os.makedirs(open_dir, mode=0o755)
        os.chmod(open_dir, 0o755)
        not_sock = os.path.join(self.tmp, 'plugin', 'file')
        open(not_sock, 'w').close()
        long_dir = os.path.join(self.tmp, 'l' * 100)
        for path, rc, word in ((os.path.join(open_dir, 's.sock'), 2, 'it must be 0700'),
                               (not_sock, 2, 'is not a socket'),
                               (os.path.join(long_dir, 's.sock'), 2, 'at most 107'),
                               ('relative.sock', 2, 'not an absolute path'),
                               (self.sock, 1, 'another plugin answers')):
            proc = self.start_plugin(path, check=False)
            self.assertEqual(proc.wait(30), rc, path)
            self.assertIn(word, self.plugin_log())
        self.assertFalse(os.path.exists(os.path.join(open_dir, 's.sock')))
        self.ok('Plugin.Activate')


# -- podman --------------------------------------------------------------------

WRITE_FILES = r'''
set -eu
cd /data
i=0
while [ $i -lt 40 ]; do
  mkdir -p d$((i % 5))
  head -c $(( (i * 7919) % 500 + 1 ))K /dev/urandom > d$((i % 5))/f$i
  i=$((i + 1))
done
find d* -type f | sort | xargs sha256sum > SUMS
sync
stat -f -c %T /data
'''


class PodmanPluginTest(PluginTest):
    """podman with the plugin in its containers.conf; volume names of this
    process's own (podman's storage is shared by the build's tests)."""

    def setUp(self):
        super().setUp()
        conf = (f'volume_plugin_timeout = 120\n'
                f'[engine.volume_plugins]\nhybridvm = "{self.sock}"\n')
        try:
            self.podman = Podman(extra_conf=conf)
            self.image = self.podman.image()
        except PodmanMissing as exc:
            self.tearDown()         # a skip in setUp runs no tearDown
            self.skipTest(str(exc))
        self.containers = []
        self.names = []

    def tearDown(self):
        pm = getattr(self, 'podman', None)
        if pm is not None:
            if self.containers:
                pm.rm(*self.containers)
            if self.plugin is None or self.plugin.poll() is not None:
                self.plugin = None
                self.start_plugin()
            for n in self.names:
                pm.run('volume', 'rm', '-f', n, check=False)
            try:
                os.unlink(pm.conf)
            except OSError:
                pass
        super().tearDown()

    def vol(self, tag):
        name = f'hvp{os.getpid()}-{tag}'
        self.names.append(name)
        return name

    def create(self, name, *opts, check=True):
        argv = ['volume', 'create', '--driver', 'hybridvm']
        for o in opts:
            argv += ['-o', o]
        return self.podman.run(*argv, name, check=check)

    def run_in(self, name, script, *extra, check=True):
        return self.podman.run('run', '--rm', '--network', 'none', *extra, '-v',
                               f'{name}:/data', self.image, 'sh', '-c', script, check=check)

    def start(self, name, script):
        cname = f'hvp{os.getpid()}-c{len(self.containers)}'
        self.containers.append(cname)
        self.podman.run('run', '-d', '--name', cname, '--network', 'none', '-v',
                        f'{name}:/data', self.image, 'sh', '-c', script)
        return cname

    def test_create_write_read_back(self):
        """podman volume create --driver hybridvm -o size=256M -o
        ram-size=64M -o mode=async; a container writes 40 files (about 10
        MiB) and syncs; the volume is unmounted when it exits (image clean);
        a second container reads every file back.  podman volume inspect
        shows the plugin's status."""
        name = self.vol('a')
        self.create(name, 'size=256M', 'ram-size=64M', 'mode=async')
        cfg = self.vols._config(name)
        self.assertEqual((cfg['size'], cfg['ram_size'], cfg['mode']),
                         (256 << 20, 64 << 20, 'async'))
        info = json.loads(self.podman.run('volume', 'inspect', name).stdout)[0]
        self.assertEqual(info['Driver'], 'hybridvm')
        self.assertEqual(info['Status']['state'], 'stopped')
        out = self.run_in(name, WRITE_FILES).stdout
        self.assertIn('ext2/ext3', out, 'the container sees the volume\'s ext4')
        self.assertEqual(self.vols.status(name)['state'], 'stopped', 'unmounted at exit')
        self.assertTrue(self.image_clean(cfg['image']))
        p = self.run_in(name, 'cd /data && sha256sum -c SUMS | grep -c ": OK$"')
        self.assertEqual(p.stdout.strip(), '40')
        self.assertEqual(self.vols.status(name)['state'], 'stopped')
        log = self.plugin_log()
        self.assertIn(f"for '{PODMAN_ID[:12]}", log, 'podman 4 mounts with its fixed ID')
        self.assertEqual(log.count(f'volume {name} unmounted, written back and stopped'), 2)

    def test_bad_options_through_podman(self):
        """podman volume create with bad options: podman fails with the
        plugin's message; no volume in podman or hvvol."""
        for opts, word in ((['size=1E'], "size '1E' is not a size"),
                           (['size=64M', 'foo=bar'], "unknown option 'foo'"),
                           (['size=64M', 'image=/etc/passwd'], 'hvvol create NAME --image'),
                           (['size=64M', 'ram-size=1G'], 'larger than the volume'),
                           ([], 'give its size')):
            name = self.vol('bad')
            p = self.create(name, *opts, check=False)
            self.assertNotEqual(p.returncode, 0, opts)
            self.assertIn(word, p.stderr, opts)
            self.assertNotEqual(self.podman.run('volume', 'exists', name,
                                                check=False).returncode, 0)
        self.assertEqual(self.vols.names(), [])

    def test_two_containers_and_rm(self):
        """Two containers at once on one volume see each other's files;
        podman volume rm is refused while they run (podman's own check,
        before the plugin hears of it), and so is the plugin's Remove sent
        straight to it (hvvol names the containers).  The volume is
        unmounted when the second one goes.  rm then deletes the image: a
        volume created again under the name is a new, empty one."""
        name = self.vol('two')
        self.create(name, 'size=128M', 'ram-size=32M', 'mode=async')
        image = self.vols._config(name)['image']
        c1 = self.start(name, 'echo one > /data/one; sync; exec sleep 600')
        c2 = self.start(name, 'echo two > /data/two; sync; exec sleep 600')
        wait_for(lambda: os.path.exists(os.path.join(self.run_dir, name, 'mnt', 'one')) and
                 os.path.exists(os.path.join(self.run_dir, name, 'mnt', 'two')), 60,
                 'both containers to write')
        self.assertEqual(self.podman.run('exec', c2, 'cat', '/data/one').stdout, 'one\n')
        self.assertEqual(self.podman.run('exec', c1, 'cat', '/data/two').stdout, 'two\n')
        p = self.podman.run('volume', 'rm', name, check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn('is being used by the following container(s)', p.stderr)
        status, reply = self.call('VolumeDriver.Remove', {'Name': name})
        self.assertEqual(status, 500, reply)
        for c in (c1, c2):
            self.assertIn(f'container {self.podman.inspect(c)["Id"][:12]}', reply['Err'])
        self.assertEqual(self.vols.status(name)['state'], 'mounted')
        self.podman.rm(c1)
        self.assertEqual(self.vols.status(name)['state'], 'mounted', 'c2 still uses it')
        self.assertEqual(self.podman.run('exec', c2, 'cat', '/data/one').stdout, 'one\n')
        self.podman.rm(c2)
        wait_for(lambda: self.vols.status(name)['state'] == 'stopped', 60,
                 'the volume to be unmounted')
        self.assertTrue(self.image_clean(image))
        self.podman.run('volume', 'rm', name)
        self.assertFalse(os.path.exists(image))
        self.assertEqual(self.vols.names(), [])
        self.create(name, 'size=128M')
        self.assertEqual(self.run_in(name, 'ls /data').stdout.split(), ['lost+found'])

    def test_unmount_refused_at_the_container_end(self):
        """A host process has its working directory on the volume when the
        last container using it goes: the plugin refuses the unmount naming
        it (podman rm reports it, or conmon's `podman container cleanup`
        when it got to the exited container first: then only the plugin's
        log has it), the volume stays mounted with the data; once the
        process has gone, podman volume unmount unmounts it."""
        name = self.vol('held')
        self.create(name, 'size=64M', 'mode=async')
        c = self.start(name, 'echo kept > /data/k; exec sleep 600')
        mnt = os.path.join(self.run_dir, name, 'mnt')
        wait_for(lambda: os.path.exists(os.path.join(mnt, 'k')), 60, 'the container to write')
        holder = subprocess.Popen(['sleep', '600'], cwd=mnt)
        try:
            p = self.podman.run('rm', '-f', '-t', '0', c, check=False)
            refusal = f'volume {name} (on {mnt}) is in use: pid {holder.pid} (sleep): cwd'
            wait_for(lambda: f"/VolumeDriver.Unmount': 500: {refusal}" in self.plugin_log(), 60,
                     'the plugin to refuse the unmount')
            if p.stderr:
                self.assertIn(f'on /VolumeDriver.Unmount on volume {name} in volume plugin '
                              f'hybridvm: {refusal}', p.stderr)
            self.assertEqual(self.vols.status(name)['state'], 'mounted')
            with open(os.path.join(mnt, 'k')) as f:
                self.assertEqual(f.read(), 'kept\n')
        finally:
            holder.kill()
            holder.wait()
        self.assertNotEqual(self.podman.run('container', 'exists', c, check=False).returncode,
                            0, 'the container went anyway')
        self.podman.run('volume', 'unmount', name)
        self.assertEqual(self.vols.status(name)['state'], 'stopped')
        self.assertEqual(self.run_in(name, 'cat /data/k').stdout, 'kept\n')

    def test_plugin_killed_under_a_container(self):
        """The plugin SIGKILLed while a container writes to its volume: the
        container goes on; a new plugin (stale socket replaced) unmounts the
        volume when podman lets go of it, with every byte."""
        name = self.vol('restart')
        self.create(name, 'size=128M', 'ram-size=32M', 'mode=async')
        c = self.start(name, 'i=0; while [ ! -e /data/stop ]; do echo $i >> /data/log; '
                             'i=$((i+1)); sleep 0.02; done; echo end >> /data/log; sync; '
                             'exec sleep 600')
        mnt = os.path.join(self.run_dir, name, 'mnt')
        log = os.path.join(mnt, 'log')
        wait_for(lambda: os.path.exists(log), 60, 'the container to write')
        self.stop_plugin(signal.SIGKILL)
        before = len(open(log).read().split())
        wait_for(lambda: len(open(log).read().split()) > before + 20, 60,
                 'the container to go on writing')
        self.start_plugin()
        open(os.path.join(mnt, 'stop'), 'w').close()
        wait_for(lambda: open(log).read().endswith('end\n'), 60, 'the container to end')
        with open(log) as f:
            written = f.read()
        self.assertGreater(len(written.split()), before + 20)
        self.podman.rm(c)
        wait_for(lambda: self.vols.status(name)['state'] == 'stopped', 60,
                 'the new plugin to unmount the volume')
        self.assertIn(f'volume {name} unmounted', self.plugin_log())
        self.assertEqual(self.run_in(name, 'cat /data/log').stdout, written)

    def test_plugin_down_at_rm(self):
        """With the plugin stopped, podman volume rm forgets the volume and
        says the plugin could not remove it; hvvol keeps it with its data,
        and podman volume create under the name adopts it again."""
        name = self.vol('down')
        self.create(name, 'size=64M')
        self.run_in(name, 'echo precious > /data/p; sync')
        self.assertEqual(self.stop_plugin(), 0)
        p = self.podman.run('volume', 'rm', name, check=False)
        self.assertIn('hybridvm', p.stderr)
        self.assertNotEqual(self.podman.run('volume', 'exists', name, check=False).returncode, 0)
        self.assertEqual(self.vols.names(), [name])
        self.start_plugin()
        self.create(name, 'size=64M')
        self.assertEqual(self.run_in(name, 'cat /data/p').stdout, 'precious\n')


if __name__ == '__main__':
    unittest.main()
