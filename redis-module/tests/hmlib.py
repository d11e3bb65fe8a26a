"""Helpers for the appassist module tests: start real redis-server processes
(stock or with the module) in a temp dir on a unix socket, always killed in
tearDown. Not a test file itself (no test_ prefix)."""

import io
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

import redis

TOP = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
MODULE = os.environ.get('HYBRIDMEM_SO',
                        os.path.join(TOP, 'build', 'redis-module', 'hybridmem.so'))
REDIS_SERVER = shutil.which('redis-server') or '/usr/bin/redis-server'


def pipe(srv, commands):
    """Send `commands` (iterables of bytes arguments) to `srv` with
    redis-cli --pipe: the fastest way to get millions of commands in.
    Keep replies small (SET, STRLEN): redis-cli's reply buffer handling is
    quadratic in the bytes it holds."""
    buf = io.BytesIO()
    for args in commands:
        buf.write(b'*%d\r\n' % len(args))
        for a in args:
            buf.write(b'$%d\r\n%s\r\n' % (len(a), a))
    subprocess.run(['redis-cli', '-s', srv.sock, '--pipe'], input=buf.getvalue(),
                   check=True, stdout=subprocess.DEVNULL)


def rss_of(pid):
    """Resident set size of a process in bytes (from /proc)."""
    with open('/proc/%d/statm' % pid) as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


class Server:
    """One redis-server process. module=True loads hybridmem.so with the
    given appassist.* configs (names without the prefix); the test helpers
    APPASSIST.DEMOTE/COMPACT are on (enable-debug-commands) unless the
    configs say otherwise."""

    def __init__(self, workdir, name, module=False, configs=None, extra=None):
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.sock = os.path.join(self.dir, 'redis.sock')
        self.log = os.path.join(self.dir, 'redis.log')
        self.module = module
        self.configs = dict(configs or {})
        self.extra = list(extra or [])
        self.proc = None

    def argv(self):
        a = [REDIS_SERVER, '--port', '0', '--unixsocket', self.sock,
             '--dir', self.dir, '--logfile', self.log, '--save', '',
             '--appendonly', 'no', '--daemonize', 'no',
             '--enable-debug-command', 'yes', '--enable-module-command', 'yes']
        if self.module:
            a += ['--loadmodule', MODULE]
            cfg = {'port-path': '', 'spill-path': os.path.join(self.dir, 'spill'),
                   'enable-debug-commands': 'yes'}
            cfg.update(self.configs)
            for k, v in cfg.items():
                a += ['--appassist.' + k, str(v)]
        return a + self.extra

    def start(self, timeout=10.0):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError('redis-server exited: ' + self.logtail())
            if os.path.exists(self.sock):
                # A timeout: a server stuck while loading (e.g. in stock
                # redis-check-rdb after a refused RDB) never answers.
                try:
                    if self.client(socket_timeout=1).ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
            time.sleep(0.02)
        raise RuntimeError('redis-server did not start: ' + self.logtail())

    def logtail(self):
        try:
            with open(self.log) as f:
                return ''.join(f.readlines()[-10:])
        except OSError:
            return '(no log)'

    def client(self, **kw):
        return redis.Redis(unix_socket_path=self.sock, **kw)

    def rss(self):
        return rss_of(self.proc.pid)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def shutdown_save(self):
        """SHUTDOWN SAVE and wait for the process to exit."""
        try:
            self.client().shutdown(save=True)
        except redis.ConnectionError:
            pass
        self.proc.wait(30)
        self.proc = None


class ServerTestCase(unittest.TestCase):
    """Creates a temp dir per test; every server made with self.server() is
    killed in tearDown whatever happens."""

    def setUp(self):
        if not os.path.exists(MODULE):
            self.skipTest('module not built: ninja -C build redis-module/hybridmem.so')
        if not os.path.exists(REDIS_SERVER):
            self.skipTest('redis-server not installed')
        self.workdir = tempfile.mkdtemp(prefix='hmtest-')
        self.servers = []

    def tearDown(self):
        for s in self.servers:
            s.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def server(self, name='redis', module=True, start=True, **kw):
        s = Server(self.workdir, name, module=module, **kw)
        self.servers.append(s)
        if start:
            s.start()
        return s

    def stock_and_module(self, configs):
        """Stock Redis, then Redis with the module and @configs, each
        started when the loop gets to it: (name, module, server, client)
        of each, the names 'stock' and 'mod'."""
        for name, module in (('stock', False), ('mod', True)):
            srv = self.server(name, module=module, configs=configs)
            yield name, module, srv, srv.client()

    def demote_all(self, c, n, timeout=30, batch=1000):
        """Run APPASSIST.DEMOTE until n items are cold."""
        deadline = time.monotonic() + timeout
        while c.info('appassist')['appassist_cold_items'] < n:
            c.execute_command('APPASSIST.DEMOTE', batch)
            self.assertLess(time.monotonic(), deadline, 'demotion did not finish')

    def wait_for(self, fn, timeout=10.0, what='condition'):
        """Poll fn() until it is true, with a monotonic deadline."""
        deadline = time.monotonic() + timeout
        while True:
            v = fn()
            if v:
                return v
            if time.monotonic() > deadline:
                self.fail('timed out waiting for ' + what)
            time.sleep(0.01)

    def assertHealthy(self, srv):
        c = srv.client()
        self.assertTrue(c.ping())
        c.set('__health__', 'ok')
        self.assertEqual(c.get('__health__'), b'ok')
        c.delete('__health__')

    @staticmethod
    def info(client):
        return client.info('appassist')


class ReplicaStream:
    """What a master sends its replicas, read as a replica does: a raw
    connection that sends SYNC, skips the RDB of the full sync, then parses
    the command stream (RESP arrays). The server must sync from disk
    (repl-diskless-sync no): a plain SYNC announces no EOF capability."""

    def __init__(self, srv, timeout=30.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(srv.sock)
        self.buf = b''
        self.sock.sendall(b'SYNC\r\n')
        while True:                     # newlines keep the link alive meanwhile
            line = self._line()
            if line:
                break
        if not line.startswith(b'$'):
            raise RuntimeError('SYNC: unexpected reply %r' % line[:80])
        self._take(int(line[1:]))      # the RDB, not followed by CRLF

    def close(self):
        self.sock.close()

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError('the master closed the replication link')
        self.buf += data

    def _line(self):
        while b'\r\n' not in self.buf and not self.buf.startswith(b'\n'):
            self._fill()
        if self.buf.startswith(b'\n'):
            self.buf = self.buf[1:]
            return b''
        line, self.buf = self.buf.split(b'\r\n', 1)
        return line

    def _take(self, n):
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def command(self):
        """The next command of the stream: a tuple, its name lowercased."""
        line = self._line()
        if not line.startswith(b'*'):
            raise RuntimeError('replication stream: unexpected %r' % line[:80])
        args = []
        for _ in range(int(line[1:])):
            ln = self._line()
            args.append(self._take(int(ln[1:]) + 2)[:-2])
        return (args[0].lower(),) + tuple(args[1:])

    def until(self, *last):
        """The commands up to and including the first one that starts with
        'last' (lowercase name first), without the master's PINGs."""
        out = []
        while True:
            c = self.command()
            if c[0] == b'ping':
                continue
            out.append(c)
            if c[:len(last)] == last:
                return out


def drain(sub, timeout=0.5):
    """Every (channel, data) a pubsub object receives until it has been
    quiet for `timeout` seconds."""
    events = []
    while True:
        m = sub.get_message(timeout=timeout)
        if m is None:
            return events
        events.append((m['channel'], m['data']))


def asmap(rep):
    """A module reply map as a dict (RESP2 gives a flat name, value list)."""
    return dict(zip(rep[::2], rep[1::2]))


def aggressive():
    """Configs that demote every string item as soon as the pass sees it."""
    return {'hot-percent': 0, 'min-idle-ms': 0, 'interval-ms': 1, 'slice-us': 1000}
