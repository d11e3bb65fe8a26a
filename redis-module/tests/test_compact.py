"""Compaction (relocation of hot keys after demotion) is invisible to clients:
values, TTLs, LFU counters, LRU idle times, encodings and DBSIZE are kept;
no keyspace notification, nothing written to the AOF or the replication
stream, no WATCHed transaction aborted; a SCAN across a running pass returns
every key. Each check is followed by a control (a real write) that shows the
check would see a change."""

import glob
import os
import random
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase  # noqa: E402


def free_port():
    with socket.socket() as so:
        so.bind(('127.0.0.1', 0))
        return so.getsockname()[1]


def aof_bytes(srv):
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(srv.dir, 'appendonlydir', '*')))


def populate(c, n, seed):
    """Strings of every encoding (int, embstr, raw), a third with a TTL, LFU
    counters spread by reading keys different numbers of times, plus keys of
    other types (left alone)."""
    rng = random.Random(seed)
    want = {}
    p = c.pipeline(transaction=False)
    for i in range(n):
        k = 'k%d' % i
        v = rng.choice([b'%d' % rng.randrange(10**9), b'v%d' % i,
                        rng.randbytes(100), rng.randbytes(1024)])
        if i % 3 == 0:
            p.set(k, v, px=3600000 + i)
        else:
            p.set(k, v)
        want[k] = v
    p.hset('h', mapping={'a': 1, 'b': 2})
    p.rpush('l', 'x', 'y')
    p.execute()
    p = c.pipeline(transaction=False)
    for i in range(n):
        for _ in range(i % 40):
            p.strlen('k%d' % i)
    p.execute()
    return want


def snapshot(c, keys):
    """What a client can observe without touching the keys."""
    p = c.pipeline(transaction=False)
    for k in keys:
        p.object('freq', k)
        p.object('encoding', k)
        p.execute_command('PEXPIRETIME', k)
    r = p.execute()
    return {k: tuple(r[3 * i:3 * i + 3]) for i, k in enumerate(keys)}


class CompactTest(ServerTestCase):

    def test_relocation_is_invisible(self):
        """LFU policy, AOF on, a replica attached, a keyspace subscriber and a
        WATCHing client: a full compaction pass changes nothing any of them
        can see."""
        port = free_port()
        m = self.server('master', extra=['--port', str(port), '--appendonly', 'yes',
                                         '--maxmemory-policy', 'allkeys-lfu',
                                         '--lfu-decay-time', '0',
                                         '--notify-keyspace-events', 'KEA',
                                         '--repl-ping-replica-period', '3600'])
        mc = m.client()
        want = populate(mc, 3000, 1)
        r = self.server('replica')
        rc = r.client()
        rc.execute_command('REPLICAOF', '127.0.0.1', port)
        self.wait_for(lambda: mc.info('replication').get('slave0', {}).get('state') == 'online',
                      what='replica online')
        self.wait_for(lambda: rc.info('replication')['slave_repl_offset'] ==
                      mc.info('replication')['master_repl_offset'], what='replica in sync')
        keys = sorted(want)
        before = snapshot(mc, keys)
        self.assertEqual(len({e for _, e, _ in before.values()}), 3, 'all encodings present')
        self.assertGreater(len({f for f, _, _ in before.values()}), 3, 'LFU counters spread')
        dbsize = mc.dbsize()
        sub = m.client().pubsub()
        sub.psubscribe('__key*__:*')
        self.assertEqual(sub.get_message(timeout=1.0)['type'], 'psubscribe')
        watcher = m.client()
        watcher.execute_command('WATCH', *keys[:100])
        aof0 = aof_bytes(m)
        off0 = mc.info('replication')['master_repl_offset']

        relocated = mc.execute_command('APPASSIST.COMPACT', 60000)
        info = mc.info('appassist')
        self.assertEqual(info['appassist_compactions'], 1)
        self.assertEqual(relocated, info['appassist_last_compaction_relocated'])
        nint = sum(1 for _, e, _ in before.values() if e == b'int')
        self.assertEqual(relocated, len(keys) - nint)
        self.assertEqual(info['appassist_relocation_skips'], nint)

        self.assertEqual(snapshot(mc, keys), before)
        self.assertEqual(mc.dbsize(), dbsize)
        self.assertIsNone(sub.get_message(timeout=0.5))
        self.assertEqual(aof_bytes(m), aof0)
        self.assertEqual(mc.info('replication')['master_repl_offset'], off0)
        watcher.execute_command('MULTI')
        watcher.execute_command('SET', keys[0], want[keys[0]])
        self.assertEqual(watcher.execute_command('EXEC'), [b'OK'])
        self.assertEqual(mc.type('h'), b'hash')
        self.assertEqual(mc.lrange('l', 0, -1), [b'x', b'y'])
        for k in keys:
            self.assertEqual(mc.get(k), want[k])
            self.assertEqual(rc.get(k), want[k])

        # Controls: a real write is seen by every one of those checks.
        watcher.execute_command('WATCH', keys[1])
        mc.set(keys[1], b'changed')
        watcher.execute_command('MULTI')
        watcher.execute_command('GET', keys[1])
        self.assertIsNone(watcher.execute_command('EXEC'))
        self.assertIsNotNone(sub.get_message(timeout=1.0))
        self.wait_for(lambda: aof_bytes(m) > aof0, what='AOF write')
        self.assertGreater(mc.info('replication')['master_repl_offset'], off0)
        self.wait_for(lambda: rc.get(keys[1]) == b'changed', what='propagation')
        self.assertHealthy(m)

    def test_lru_idle_kept(self):
        """Without an LFU policy the LRU idle time is kept (Redis's LRU clock
        has 1 s resolution)."""
        s = self.server()
        c = s.client()
        for i in range(200):
            c.set('k%d' % i, b'x' * 100)
        time.sleep(2.2)
        for i in range(0, 200, 2):
            c.strlen('k%d' % i)
        idle = {i: c.object('idletime', 'k%d' % i) for i in range(200)}
        self.assertEqual(c.execute_command('APPASSIST.COMPACT'), 200)
        for i in range(200):
            self.assertLessEqual(abs(c.object('idletime', 'k%d' % i) - idle[i]), 1)
        self.assertGreaterEqual(min(idle[i] for i in range(1, 200, 2)), 2)

    def test_scan_across_a_pass(self):
        """A client SCAN interleaved with slices of a compaction pass returns
        every key at least once."""
        s = self.server()
        c = s.client()
        want = {('s%d' % i).encode() for i in range(5000)}
        p = c.pipeline(transaction=False)
        for k in want:
            p.set(k, b'v' * 64)
        p.execute()
        seen, cursor, slices = set(), 0, 0
        while True:
            cursor, keys = c.scan(cursor, count=20)
            seen.update(keys)
            c.execute_command('APPASSIST.COMPACT', 1)
            slices += 1
            if cursor == 0:
                break
        self.assertGreater(slices, 10)
        self.assertGreater(c.info('appassist')['appassist_relocations'], 0)
        self.assertEqual(want - seen, set())
        self.assertHealthy(s)

    def test_slices_stay_short_when_much_is_free(self):
        """A pass's slices do only relocation: the pages it empties, and
        whatever else jemalloc holds dirty (here 60 MB just deleted), go
        back through jemalloc's decay, from its background thread. A purge
        in a slice returned all of it at once (measured with the purge:
        a 16 ms slice here)."""
        slice_us = 1000
        s = self.server(configs={'demote': 'no', 'slice-us': slice_us})
        c = s.client()
        p = c.pipeline(transaction=False)
        for i in range(30000):
            p.set('k%d' % i, b'v' * 100)
            p.set('big%d' % i, b'b' * 2000)
        p.execute()
        rss_full = s.rss()
        p = c.pipeline(transaction=False)
        for i in range(30000):
            p.delete('big%d' % i)
        p.execute()
        relocated = c.execute_command('APPASSIST.COMPACT', 60000)
        self.assertEqual(relocated, 30000)
        info = c.info('appassist')
        self.assertLessEqual(info['appassist_last_compaction_slice_max_us'], 2 * slice_us, info)
        # The command purges after the pass (the background's passes leave
        # that to jemalloc's decay): the memory is given back at once.
        self.assertLess(s.rss(), rss_full - 45 * 2**20)
        for i in range(0, 30000, 997):
            self.assertEqual(c.get('k%d' % i), b'v' * 100)
        self.assertHealthy(s)

    def test_paused_when_prepared(self):
        """No compaction while a MULTI is open or between PREPARE and
        RESUME; a pass that was due runs after RESUME."""
        s = self.server(configs={'hot-percent': 0, 'min-idle-ms': 0, 'interval-ms': 1,
                                 'slice-us': 1000, 'demote': 'no'})
        c = s.client()
        p = c.pipeline(transaction=False)
        for i in range(20000):
            p.set('k%d' % i, b'v' * 100)
            p.hset('h%d' % i, 'f', 'v')     # never demoted: the demotions leave holes
        p.execute()
        c.execute_command('APPASSIST.PREPARE')
        self.assertRaisesRegex(Exception, 'paused', c.execute_command, 'APPASSIST.COMPACT')
        c.execute_command('APPASSIST.RESUME')
        tx = s.client()
        tx.execute_command('MULTI')                     # pauses background work
        c.execute_command('APPASSIST.DEMOTE', 5000)     # demotes everything: a pass is due
        c.set('hot', b'h' * 100)
        time.sleep(0.3)
        self.assertEqual(c.info('appassist')['appassist_compactions'], 0)
        c.execute_command('APPASSIST.PREPARE')
        tx.execute_command('DISCARD')
        time.sleep(0.3)
        self.assertEqual(c.info('appassist')['appassist_compactions'], 0)
        c.execute_command('APPASSIST.RESUME')
        self.wait_for(lambda: c.info('appassist')['appassist_compactions'] == 1,
                      what='compaction after RESUME')
        self.assertEqual(c.info('appassist')['appassist_last_compaction_relocated'], 1)
        self.assertEqual(c.get('hot'), b'h' * 100)
        self.assertHealthy(s)


if __name__ == '__main__':
    unittest.main()
