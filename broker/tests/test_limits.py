"""Hostile and greedy clients: pool capacity and per-uid quotas refuse with
clear errors; malformed, oversized and garbage requests get an error (and a
hang-up when framing is lost) while the broker stays healthy; connections
beyond the maximum are refused with a message and no descriptor leaks; one
uid cannot take every connection or region (per-uid limits, slots kept for
root), and a client that never reads its replies delays no one else."""

import errno
import os
import resource
import socket
import struct
import sys
import time
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


class PerUidConnectionTest(BrokerTestCase):
    BROKER_ARGS = ('--max-conns', '16')

    def test_one_uid_cannot_lock_root_out(self):
        """With --max-conns 16, nobody opening 20 idle connections gets a
        quarter of them (the default per uid, its agent's own included) and
        'too many connections from uid 65534'; root and another uid still
        connect and are served."""
        n = self.agent(NOBODY)
        res = n.ok(op='connect', n=20)['result']
        self.assertEqual(res['accepted'], 3, res)
        self.assertEqual(len(res['refused']), 17)
        self.assertIn(f'too many connections from uid {NOBODY} (max 4 per uid)',
                      res['refused'][0])
        roots = [self.broker.client() for _ in range(4)]
        for c in roots:
            c.pool()
        other = self.agent(NOBODY - 1)
        self.assertEqual(other.ok(op='connect', n=1)['result']['accepted'], 1)
        for c in roots:
            c.close()
        n.ok(op='disconnect')
        self.assertHealthy()


class RootReserveTest(BrokerTestCase):
    BROKER_ARGS = ('--max-conns', '16', '--max-conns-per-uid', '16',
                   '--reserved-conns', '2')

    def test_slots_kept_for_root(self):
        """Even a uid allowed every connection leaves the --reserved-conns
        last slots to root: root's clients are served, then the limit holds
        for root too."""
        n = self.agent(NOBODY)
        res = n.ok(op='connect', n=20)['result']
        # 16 slots - 2 for root - self.c - the agent's own connection
        self.assertEqual(res['accepted'], 12, res)
        self.assertIn('too many connections (max 16, the last 2 kept for uid 0)',
                      res['refused'][0])
        roots = [self.broker.client() for _ in range(2)]
        for c in roots:
            c.pool()
        late = self.broker.client()
        self.assertBrokerError(errno.EUSERS, late.pool)
        late.close()
        for c in roots:
            c.close()


class PerUidRegionTest(BrokerTestCase):

    def test_one_uid_cannot_fill_the_region_table(self):
        """One uid may hold 256 regions by default (the table has 4096):
        nobody creating tiny regions is refused with EDQUOT at its limit,
        while root and another uid still create."""
        n = self.agent(NOBODY)
        res = n.do(op='create_many', prefix='n', n=300)
        self.assertEqual(res['result'], 256, res)
        self.assertEqual(res.get('errno'), errno.EDQUOT, res)
        self.assertIn(f'too many regions for uid {NOBODY} (max 256 per uid)', res['msg'])
        self.c.create('root-region', 4096)
        other = self.agent(NOBODY - 1)
        other.ok(op='call', method='create', name='other-region', size=4096)
        n.ok(op='call', method='destroy', name='n0')
        n.ok(op='call', method='create', name='n-again', size=4096)

    def test_option(self):
        """--max-regions-per-uid sets the limit."""
        self.c.close()
        self.broker.stop()
        self.broker.start(['--max-regions-per-uid', '3'])
        self.c = self.broker.client()
        n = self.agent(NOBODY)
        res = n.do(op='create_many', prefix='n', n=5)
        self.assertEqual((res['result'], res.get('errno')), (3, errno.EDQUOT), res)
        for i in range(5):
            self.c.create(f'root{i}', 4096)     # uid 0 has no per-uid limit


class SlowReaderTest(BrokerTestCase):
    BROKER_ARGS = ('--request-timeout', '2')

    def flood(self, nreq):
        """A connection that sends @nreq list requests (about 8 KiB of reply
        each) and never reads."""
        hog = self.broker.client()
        hog.sock.sendall(b''.join(encode(OPS['list'], seq=i) for i in range(nreq)))
        return hog

    def setUp(self):
        super().setUp()
        for i in range(32):
            self.c.create(f'r{i:02d}-' + 'x' * 200, 4096)

    def test_client_that_never_reads_delays_no_one(self):
        """While a client's unread replies fill its socket, another client's
        requests are answered within 200 ms; the reader-less client is
        dropped after --request-timeout without progress."""
        hog = self.flood(300)
        time.sleep(0.3)         # the broker has more for hog than its socket holds
        for _ in range(5):
            t0 = time.monotonic()
            self.c.pool()
            self.assertLess(time.monotonic() - t0, 0.2)
            time.sleep(0.05)
        wait_for(lambda: 'replies not read for 2 s' in self.broker.read_log(),
                 timeout=10, what='the slow reader dropped')
        hog.sock.settimeout(10)
        with self.assertRaises(ConnectionError):
            while True:
                hog.read_reply()
        hog.close()
        self.assertHealthy()

    def test_queue_bound(self):
        """A client whose unread replies pass the queue's bound is dropped at
        once, with a message naming it."""
        hog = self.flood(3000)
        wait_for(lambda: 'unread replies' in self.broker.read_log(),
                 timeout=10, what='the queue bound')
        self.assertIn(f'pid {os.getpid()} uid 0', self.broker.read_log())
        self.c.pool()
        hog.close()
        self.assertHealthy()


if __name__ == '__main__':
    unittest.main()
