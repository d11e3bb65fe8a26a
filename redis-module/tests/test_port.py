"""The host port: the module serves APPASSIST.* on a virtio-serial port
(here a pty or a unix socket stands in for /dev/virtio-ports/...), RESP2
replies, malformed and oversized input rejected without harming the server,
a missing port is not an error, and the port is reopened when the host side
goes away and comes back."""

import os
import select
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, aggressive, asmap  # noqa: E402


def parse_reply(buf):
    """Parse one RESP2 reply; (value, rest) or None when incomplete."""
    if not buf:
        return None
    nl = buf.find(b'\r\n')
    if nl < 0:
        return None
    t, line, rest = buf[:1], buf[1:nl], buf[nl + 2:]
    if t == b'+':
        return line.decode(), rest
    if t == b'-':
        return Exception(line.decode()), rest
    if t == b':':
        return int(line), rest
    if t == b'$':
        n = int(line)
        if n < 0:
            return None, rest
        if len(rest) < n + 2:
            return None
        return rest[:n], rest[n + 2:]
    if t == b'*':
        out = []
        for _ in range(int(line)):
            r = parse_reply(rest)
            if r is None:
                return None
            v, rest = r
            out.append(v)
        return out, rest
    raise ValueError('bad reply %r' % buf[:40])


def encode(*args):
    out = b'*%d\r\n' % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b'$%d\r\n%s\r\n' % (len(a), a)
    return out


class Endpoint:
    """The host side of the port: write requests, read replies."""

    def __init__(self, rfd, wfd=None):
        self.rfd = rfd
        self.wfd = rfd if wfd is None else wfd
        self.buf = b''

    def send(self, data):
        while data:
            n = os.write(self.wfd, data)
            data = data[n:]

    def reply(self, timeout=5.0):
        deadline = time.monotonic() + timeout
        while True:
            r = parse_reply(self.buf)
            if r is not None:
                v, self.buf = r
                return v
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError('no reply on the port (have %r)' % self.buf[:80])
            rd, _, _ = select.select([self.rfd], [], [], left)
            if rd:
                chunk = os.read(self.rfd, 65536)
                if not chunk:
                    raise EOFError('port closed')
                self.buf += chunk

    def call(self, *args):
        self.send(encode(*args))
        return self.reply()


class PortTest(ServerTestCase):

    def connected(self, c):
        return c.info('appassist')['appassist_port_connected'] == 1

    def listen(self):
        path = os.path.join(self.workdir, 'port.sock')
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(path)
        ls.listen(4)
        ls.settimeout(10)
        self.addCleanup(ls.close)
        return path, ls

    def accept(self, ls):
        conn, _ = ls.accept()
        self.addCleanup(conn.close)
        return conn, Endpoint(conn.fileno())

    def test_pty(self):
        """Over a pty (a tty, like the virtio console device): STATUS and
        PREPARE answer with RESP2 flat maps."""
        master, slave = os.openpty()
        self.addCleanup(os.close, master)
        self.addCleanup(os.close, slave)
        s = self.server(configs=dict(aggressive(), **{'port-path': os.ttyname(slave)}))
        c = s.client()
        self.wait_for(lambda: self.connected(c), what='port open')
        ep = Endpoint(master)
        st = asmap(ep.call('APPASSIST.STATUS'))
        self.assertEqual(st[b'state'], b'normal')
        self.assertEqual(ep.call('PING'), 'PONG')
        for i in range(100):
            c.set('k%d' % i, 'v' * 100)
        self.wait_for(lambda: c.info('appassist')['appassist_cold_items'] == 100, what='demotion')
        rep = asmap(ep.call('APPASSIST.PREPARE', 3000))
        self.assertEqual(rep[b'items'], 100)
        self.assertGreater(rep[b'freed_bytes'], 0)
        self.assertEqual(rep[b'policy'], b'drop')
        self.assertEqual(asmap(ep.call('APPASSIST.RESUME'))[b'state'], b'normal')
        self.assertEqual(asmap(ep.call('APPASSIST.ABORT'))[b'state'], b'normal')
        self.assertEqual(c.info('appassist')['appassist_port_requests'], 5)
        self.assertHealthy(s)

    def test_inline_and_pipelined(self):
        """Inline requests and several requests in one write."""
        path, ls = self.listen()
        s = self.server(configs={'port-path': path})
        conn, ep = self.accept(ls)
        ep.send(b'PING\r\n' + encode('APPASSIST.STATUS') + b'ping\n')
        self.assertEqual(ep.reply(), 'PONG')
        self.assertIsInstance(ep.reply(), list)
        self.assertEqual(ep.reply(), 'PONG')
        self.assertHealthy(s)

    def test_malformed_input(self):
        """Each malformed request gets one error reply; the port and the
        server keep working."""
        path, ls = self.listen()
        s = self.server(configs={'port-path': path})
        c = s.client()
        conn, ep = self.accept(ls)
        bad = [b'*x\r\n', b'*1\r\n+PING\r\n', b'*1\r\n$-5\r\n', b'*99\r\n',
               b'*1\r\n$4\r\nPINGxx', b'\x00\x01\x02\n', b'*1\r\n$999999\r\n']
        for b in bad:
            ep.send(b)
            r = ep.reply()
            self.assertIsInstance(r, Exception, b)
            self.assertIn('Protocol error', str(r))
            time.sleep(0.05)        # a new burst: the parser starts afresh
            self.assertEqual(ep.call('PING'), 'PONG', b)
            self.assertHealthy(s)
        r = ep.call('FLUSHALL')
        self.assertIsInstance(r, Exception)
        r = ep.call('APPASSIST.PREPARE', 'soon')
        self.assertIsInstance(r, Exception)
        self.assertEqual(c.info('appassist')['appassist_state'], 'normal')
        self.assertGreaterEqual(c.info('appassist')['appassist_port_errors'], len(bad) + 2)
        self.assertHealthy(s)

    def test_oversized_input(self):
        """1 MiB without a newline, and a huge bulk: rejected, no growth."""
        path, ls = self.listen()
        s = self.server(configs={'port-path': path})
        conn, ep = self.accept(ls)
        rss0 = s.rss()
        conn.sendall(b'A' * (1 << 20))
        r = ep.reply()
        self.assertIsInstance(r, Exception)
        time.sleep(0.2)
        ep.buf = b''
        # drain any further error replies from the rest of the flood
        conn.setblocking(False)
        try:
            while conn.recv(65536):
                pass
        except BlockingIOError:
            pass
        conn.setblocking(True)
        self.assertEqual(ep.call('PING'), 'PONG')
        self.assertLess(s.rss() - rss0, 4 << 20)
        self.assertHealthy(s)

    def test_missing_port_then_appears(self):
        """A missing port is not an error; when it appears it is opened."""
        path = os.path.join(self.workdir, 'later.sock')
        s = self.server(configs={'port-path': path, 'port-retry-ms': 50})
        c = s.client()
        self.assertFalse(self.connected(c))
        self.assertHealthy(s)
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(path)
        ls.listen(1)
        ls.settimeout(10)
        self.addCleanup(ls.close)
        conn, ep = self.accept(ls)
        self.assertEqual(ep.call('PING'), 'PONG')

    def test_host_goes_away_and_comes_back(self):
        """EOF from the host side closes the port; it is reopened."""
        path, ls = self.listen()
        # port-path is a protected config: CONFIG SET below needs this
        s = self.server(configs={'port-path': path, 'port-retry-ms': 50},
                        extra=['--enable-protected-configs', 'yes'])
        c = s.client()
        conn, ep = self.accept(ls)
        self.assertEqual(ep.call('PING'), 'PONG')
        conn.close()
        self.wait_for(lambda: c.info('appassist')['appassist_port_opens'] >= 2, what='reopen')
        conn2, ep2 = self.accept(ls)
        self.assertEqual(ep2.call('PING'), 'PONG')
        # a pty whose other end closes (EIO/POLLHUP) is handled too
        master, slave = os.openpty()
        self.addCleanup(os.close, slave)
        c.config_set('appassist.port-path', os.ttyname(slave))
        self.wait_for(lambda: self.connected(c), what='pty open')
        os.close(master)
        self.wait_for(lambda: not self.connected(c), what='pty hangup seen')
        self.assertHealthy(s)

    def test_config_set_port_path(self):
        """CONFIG SET appassist.port-path switches ports; '' disables
        (where protected configs may be set)."""
        path, ls = self.listen()
        s = self.server(configs={'port-path': ''}, extra=['--enable-protected-configs', 'yes'])
        c = s.client()
        self.assertFalse(self.connected(c))
        c.config_set('appassist.port-path', path)
        conn, ep = self.accept(ls)
        self.assertEqual(ep.call('PING'), 'PONG')
        c.config_set('appassist.port-path', '')
        self.wait_for(lambda: not self.connected(c), what='port closed')
        self.assertHealthy(s)


if __name__ == '__main__':
    unittest.main()
