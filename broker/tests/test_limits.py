"""Hostile and greedy clients: pool capacity and per-uid quotas refuse with
clear errors; malformed, oversized and garbage requests get an error (and a
hang-up when framing is lost) while the broker stays healthy; connections
beyond the maximum are refused with a message and no descriptor leaks."""

import errno
import os
import resource
import socket
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from brokerlib import (HDR, MAGIC, NOBODY, OPS, REPLY, VERSION, BrokerError,  # noqa: E402
                       BrokerTestCase, Client, encode, fd_count, wait_for)

MiB = 1 << 20
N_CONNS = 2000


class CapacityTest(BrokerTestCase):
    BROKER_ARGS = ('--capacity', '64M')

    def test_pool_exhaustion(self):
        """The pool hands out at most --capacity bytes; the error says how
        much is free; destroying gives it back."""
        self.c.create('a', 40 * MiB)
        self.c.create('b', 20 * MiB)
        e = self.assertBrokerError(errno.ENOSPC, self.c.create, 'c', 8 * MiB)
        self.assertIn('pool full', e.msg)
        self.assertIn(str(4 * MiB), e.msg)
        self.assertBrokerError(errno.ENOSPC, self.c.resize, 'b', 32 * MiB)
        self.c.destroy('a')
        self.c.create('c', 8 * MiB)
        self.assertEqual(self.c.pool()['used'], 28 * MiB)
        self.assertHealthy()


class QuotaTest(BrokerTestCase):
    BROKER_ARGS = ('--quota', '40M')

    def test_quota(self):
        """--quota caps each uid, root included; another uid's usage does not
        count against it; the error names the uid and its usage."""
        self.c.create('root1', 40 * MiB)
        e = self.assertBrokerError(errno.EDQUOT, self.c.create, 'root2', 4096)
        self.assertIn('quota of uid 0 exceeded', e.msg)
        n = self.agent(NOBODY)
        n.ok(op='call', method='create', name='n1', size=32 * MiB)
        res = n.do(op='call', method='create', name='n2', size=16 * MiB)
        self.assertEqual(res['errno'], errno.EDQUOT, res)
        self.assertIn(f'uid {NOBODY}', res['msg'])
        res = n.do(op='call', method='resize', name='n1', size=48 * MiB)
        self.assertEqual(res['errno'], errno.EDQUOT, res)
        n.ok(op='call', method='create', name='n2', size=8 * MiB)
        self.assertEqual(n.ok(op='call', method='pool')['result']['caller_used'], 40 * MiB)
        self.assertHealthy()


class MalformedTest(BrokerTestCase):

    def raw(self, data, expect_close):
        """Send raw bytes on a fresh connection; (status, msg) of the reply."""
        c = self.broker.client()
        try:
            c.sock.sendall(data)
            op, seq, status, msg, _, fds = c.read_reply()
            self.assertEqual(fds, [])
            if expect_close:
                self.assertEqual(op, REPLY)
                self.assertEqual(c.sock.recv(1), b'')
            else:
                c.pool()        # the connection still works
            return status, msg
        finally:
            c.close()

    def test_malformed_requests(self):
        """Bad magic, version or length: an error and a hang-up.  Bad fields in
        a well-framed request: an error, the connection lives on."""
        good = encode(OPS['lookup'], name='x')
        status, msg = self.raw(b'GET / HTTP/1.0\r\n\r\n', True)
        self.assertEqual(-status, errno.EPROTO)
        self.assertIn('magic', msg)
        status, _ = self.raw(HDR.pack(MAGIC, 9, 2, 0, 1), True)
        self.assertEqual(-status, errno.EPROTONOSUPPORT)
        status, msg = self.raw(HDR.pack(MAGIC, VERSION, 2, 1 << 30, 1), True)
        self.assertEqual(-status, errno.EMSGSIZE)
        self.assertIn('limit', msg)
        status, _ = self.raw(HDR.pack(MAGIC, VERSION, 2 | REPLY, 0, 1), True)
        self.assertEqual(-status, errno.EPROTO)
        cases = [
            (HDR.pack(MAGIC, VERSION, 99, 0, 1), errno.EOPNOTSUPP),
            (HDR.pack(MAGIC, VERSION, 2, 3, 1) + b'abc', errno.EINVAL),
            (good[:16 + 16] + struct.pack('<H', 200) + good[16 + 18:], errno.EINVAL),
            (good[:16 + 20] + b'\1\0\0\0' + good[16 + 24:], errno.EINVAL),
            (encode(OPS['lookup'], name='x', size=5), errno.EINVAL),
            (encode(OPS['map'], name='x', flags=0x80), errno.EINVAL),
            (encode(OPS['create'], name='x', size=1, mode=0o4777), errno.EINVAL),
            (encode(OPS['create'], name='x', size=1 << 60), errno.EINVAL),
        ]
        for data, err in cases:
            with self.subTest(data=data):
                status, msg = self.raw(data, False)
                self.assertEqual(-status, err, msg)
                self.assertTrue(msg)
        self.assertHealthy()

    def test_garbage_and_truncation(self):
        """Random bytes, a request cut short and a client that vanishes
        mid-request leave the broker serving others."""
        junk = bytes((i * 131 + 7) % 256 for i in range(4096))
        for data in (junk, encode(OPS['create'], name='half', size=MiB)[:20]):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(self.broker.sock)
            s.sendall(data)
            s.close()
        self.assertBrokerError(errno.ENOENT, self.c.lookup, 'half')
        self.assertHealthy()

    def test_pipelined_requests(self):
        """Several requests in one write are answered in order."""
        c = self.broker.client()
        c.sock.sendall(encode(OPS['create'], name='p', size=MiB, mode=0o600, seq=1) +
                       encode(OPS['lookup'], name='p', seq=2) +
                       encode(OPS['destroy'], name='p', seq=3))
        replies = [c.read_reply() for _ in range(3)]
        self.assertEqual([(r[0] & ~REPLY, r[1], r[2]) for r in replies],
                         [(OPS['create'], 1, 0), (OPS['lookup'], 2, 0),
                          (OPS['destroy'], 3, 0)])
        c.close()


def try_connect(path):
    try:
        return Client(path)
    except BlockingIOError:
        return None


class ConnectionLimitTest(BrokerTestCase):
    BROKER_ARGS = ('--max-conns', '32', '--request-timeout', '1')

    def test_many_connections_bounded_no_fd_leak(self):
        """With --max-conns 32, 2000 connections: the first ones are served, the
        rest get EUSERS 'too many connections' and a hang-up; once all close,
        the broker holds exactly the descriptors it held before."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < N_CONNS + 100:
            if hard < N_CONNS + 100:
                self.skipTest(f'RLIMIT_NOFILE hard limit {hard} < {N_CONNS + 100}')
            resource.setrlimit(resource.RLIMIT_NOFILE, (N_CONNS + 100, hard))
            self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        pid = self.broker.proc.pid
        self.c.pool()       # accepted, and the start-up probe gone
        wait_for(lambda: self.c.pool()['nconns'] == 1, what='one connection')
        before = fd_count(pid)
        conns, refused = [], 0
        for _ in range(N_CONNS):
            # the listen backlog may be full for a moment: retry
            conns.append(wait_for(lambda: try_connect(self.broker.sock),
                                  what='connect'))
        for c in conns:
            try:
                c.pool()
            except BrokerError as e:
                self.assertEqual(e.errno, errno.EUSERS)
                self.assertIn('too many connections (max 32)', e.msg)
                refused += 1
        self.assertEqual(refused, N_CONNS - 31)   # self.c holds one slot
        self.assertLessEqual(fd_count(pid), before + 31)
        # leases of connections that go away are freed with them
        self.c.create('r', MiB, 0o666)
        _, fd = conns[0].map('r', rw=True)
        os.close(fd)
        for c in conns:
            c.close()
        wait_for(lambda: fd_count(pid) == before, what='broker fds back to baseline')
        self.assertEqual(self.c.pool()['nconns'], 1)
        self.assertEqual(self.c.lookup('r')['lease_pid'], 0)
        self.assertHealthy()

    def test_slow_request_dropped_idle_kept(self):
        """A connection that starts a request and stalls is told ETIMEDOUT and
        dropped after --request-timeout; an idle one (holding a lease) stays."""
        self.c.create('r', MiB)
        holder = self.broker.client()
        _, fd = holder.map('r', rw=True)
        os.close(fd)
        slow = self.broker.client()
        slow.sock.sendall(encode(OPS['lookup'], name='r')[:10])
        slow.sock.settimeout(10)
        op, _, status, msg, _, _ = slow.read_reply()
        self.assertEqual((op, -status), (REPLY, errno.ETIMEDOUT))
        self.assertIn('not complete within 1 s', msg)
        self.assertEqual(slow.sock.recv(1), b'')
        slow.close()
        self.assertEqual(holder.lookup('r')['lease_pid'], os.getpid())
        holder.close()
        self.assertHealthy()


if __name__ == '__main__':
    unittest.main()
