"""A VM's link against a hostile QMP peer.  Every reply the link consumes
(the greeting, qmp_capabilities, the throttle group's qom-get and qom-set,
query-blockstats, block-latency-histogram-set, events before a reply) is
served with the wrong type at each level, as garbage, as a huge or a
truncated line, and as random mutations of the valid reply (a fixed seed:
a failure is reproduced by running the test again).  Each is an error of
that VM only: its link thread lives on, its state says so ('error'; a peer
that goes silent, 'unresponsive'), its figures are not used, its link is
made again with a back-off and comes back when the peer behaves, and the
other VM is measured and driven all along.  The loop, the links and the
QMP client are the real ones, run in the test's process (inproc.py); the
peers are FakeQMP stand-ins (fakeqmp.py): no QEMU sends these replies."""

import collections
import copy
import json
import math
import os
import random
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakeqmp import line   # noqa: E402
from inproc import InProcess   # noqa: E402
from arbiter import vmlink   # noqa: E402

# replies a link only reads while it connects and attaches
CONNECT = (None, 'qmp_capabilities', 'qom-get', 'block-latency-histogram-set')
STATES = ('connecting', 'ok', 'error', 'unresponsive', 'absent')
MiB = 1 << 20
NAN, INF = float('nan'), float('inf')
JUNK = [None, True, False, 0, -1, 2 ** 64, 2 ** 70, 1.5, NAN, INF, -INF, '', 'x', 'x' * 5000,
        [], [1], ['a'], {}, {'a': 1}, [[[[]]]]]


def at(path, value):
    """The reply with value at path (keys and list indexes), as a line."""
    def make(reply):
        r = copy.deepcopy(reply)
        node = r
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return line(r)
    return make


def without(path):
    def make(reply):
        r = copy.deepcopy(reply)
        node = r
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        return line(r)
    return make


def raw(data, then=None):
    return lambda reply: (data, then) if then else data


def events(*evs):
    return lambda reply: b''.join(line(e) for e in evs) + line(reply)


STATS = ('return', 0, 'stats')
HIST = STATS + ('rd_latency_histogram',)

# (what, the reply it replaces, how, the VM's state then)
CASES = [
    ('greeting not JSON', None, raw(b'hello\n')),
    ('greeting a list', None, raw(b'[]\n')),
    ('greeting QMP a list', None, at(('QMP',), [])),
    ('greeting a huge line', None, raw(b'x' * (5 * MiB))),
    ('greeting truncated', None, lambda r: (line(r)[:20], 'close')),
    ('greeting nested too deep', None, raw(b'[' * 100000 + b']' * 100000 + b'\n')),
    ('greeting not UTF-8', None, raw(b'{"QMP": {"\xff\xfe": 1}}\n')),
    ('capabilities return a list', 'qmp_capabilities', at(('return',), [])),
    ('capabilities id a list', 'qmp_capabilities', lambda r: line(dict(r, id=[r['id']]))),
    ('capabilities neither return nor error', 'qmp_capabilities',
     lambda r: line({'id': r['id']})),
    ('capabilities error a string', 'qmp_capabilities',
     lambda r: line({'id': r['id'], 'error': 'no'})),
    ('capabilities error class a list', 'qmp_capabilities',
     lambda r: line({'id': r['id'], 'error': {'class': [], 'desc': 'x'}})),
    ('qom-get error desc an object', 'qom-get',
     lambda r: line({'id': r['id'], 'error': {'class': 'GenericError', 'desc': {}}})),
    ('histogram-set return a list', 'block-latency-histogram-set', at(('return',), [])),
    ('histogram-set error desc a number', 'block-latency-histogram-set',
     lambda r: line({'id': r['id'], 'error': {'class': 'GenericError', 'desc': 5}})),
    ('qom-set return a list', 'qom-set', at(('return',), [])),
    ('qom-set return a number', 'qom-set', at(('return',), 0)),
    ('qom-set error a list', 'qom-set', lambda r: line({'id': r['id'], 'error': []})),
    ('qom-set reply for another id', 'qom-set', at(('id',), 'arb-0')),
    ('qom-set not JSON', 'qom-set', raw(b'{"return": {}\n')),
    ('blockstats an object', 'query-blockstats', at(('return',), {})),
    ('blockstats a string', 'query-blockstats', at(('return',), 'disks')),
    ('blockstats entry a number', 'query-blockstats', at(('return', 0), 1)),
    ('blockstats entry a list', 'query-blockstats', at(('return', 0), [])),
    ('blockstats qdev a list', 'query-blockstats', at(('return', 0, 'qdev'), ['x'])),
    ('blockstats device an object', 'query-blockstats', at(('return', 0, 'device'), {})),
    ('blockstats node-name a number', 'query-blockstats', at(('return', 0, 'node-name'), 7)),
    ('blockstats qdev a huge string', 'query-blockstats',
     at(('return', 0, 'qdev'), '/machine/peripheral/disk0/' + 'x' * MiB)),
    ('blockstats stats a list', 'query-blockstats', at(STATS, [])),
    ('blockstats stats missing', 'query-blockstats', without(STATS)),
    ('blockstats rd_operations missing', 'query-blockstats', without(STATS + ('rd_operations',))),
    ('blockstats histogram a list', 'query-blockstats', at(HIST, [])),
    ('blockstats bins a string', 'query-blockstats', at(HIST + ('bins',), 'many')),
    ('blockstats a bin a string', 'query-blockstats', at(HIST + ('bins', 3), '3')),
    ('blockstats a bin negative', 'query-blockstats', at(HIST + ('bins', 3), -1)),
    ('blockstats a bin too large', 'query-blockstats', at(HIST + ('bins', 3), 2 ** 64)),
    ('blockstats bins all null', 'query-blockstats', at(HIST + ('bins',), [None] * 25)),
    ('event name a number', 'query-blockstats', events({'event': 5})),
    ('event name a list', 'query-blockstats', events({'event': ['SHUTDOWN']})),
    ('event flood', 'query-blockstats',
     events(*[{'event': 'BLOCK_IO_ERROR', 'data': {}}] * 1001)),
    ('reply not JSON', 'query-blockstats', raw(b'{"return": [\n')),
    ('reply a number', 'query-blockstats', raw(b'42\n')),
    ('reply a string', 'query-blockstats', raw(b'"return"\n')),
    ('reply empty object', 'query-blockstats', raw(b'{}\n')),
    ('reply NUL bytes', 'query-blockstats', raw(b'\0\0\0\n')),
    ('reply a huge line', 'query-blockstats', raw(b'[' + b'0,' * (3 * MiB))),
    ('reply truncated', 'query-blockstats', lambda r: (line(r)[:40], 'close')),
    ('reply truncated, then silence', 'query-blockstats', lambda r: (line(r)[:40], 'hang'),
     'unresponsive'),
    ('reply and garbage after it', 'query-blockstats', lambda r: line(r) + b'}}garbage\n'),
] + [
    (f'qom-get {key} {v!r:.20}', 'qom-get', at(('return', key), v))
    for key in ('iops-total', 'bps-total') for v in ('1', -1, 2 ** 70, True, 1.5, NAN, {}, None)
] + [
    ('qom-get return a list', 'qom-get', at(('return',), [])),
    ('qom-get return null', 'qom-get', at(('return',), None)),
    ('qom-get iops-total missing', 'qom-get', without(('return', 'iops-total'))),
] + [
    (f'blockstats {key} {v!r:.20}', 'query-blockstats', at(STATS + (key,), v))
    for key in ('rd_operations', 'rd_bytes', 'wr_operations')
    for v in ('x', -1, 2 ** 64, 1.5, None, True, [], {}, NAN, INF)
]


def paths(obj, here=()):
    """Every path in a JSON value, the root's included."""
    yield here
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, here + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:30]):
            yield from paths(v, here + (i,))


def mutation(rng):
    """A random change of a valid reply: structural (a value replaced,
    removed, wrapped; a key added) or on the line's bytes (one flipped, a
    newline added, the line cut short)."""
    kind = rng.choice(('replace', 'replace', 'delete', 'wrap', 'add', 'flip', 'newline', 'cut'))
    seed = rng.random()

    def make(reply):
        r = random.Random(seed)
        if kind in ('flip', 'newline', 'cut'):
            data = bytearray(line(reply))
            i = r.randrange(len(data))
            if kind == 'flip':
                data[i] ^= 1 << r.randrange(8)
                return bytes(data)
            if kind == 'newline':
                return bytes(data[:i] + b'\n' + data[i:])
            return bytes(data[:i]), 'close'
        reply = copy.deepcopy(reply)
        path = r.choice(list(paths(reply))[1:] or [()])
        if not path:
            return line(r.choice(JUNK))
        node = reply
        for k in path[:-1]:
            node = node[k]
        if kind == 'replace':
            node[path[-1]] = r.choice(JUNK)
        elif kind == 'delete':
            if isinstance(node, dict):
                del node[path[-1]]
            else:
                node.pop(path[-1])
        elif kind == 'wrap':
            node[path[-1]] = [node[path[-1]]]
        elif isinstance(node, dict):
            node[f'x-{r.randrange(100)}'] = r.choice(JUNK)
        else:
            node.append(r.choice(JUNK))
        return line(reply)
    return f'{kind} {seed:.6f}', make


class LinkFuzzTest(unittest.TestCase):
    def setUp(self):
        saved = vmlink.BACKOFF_MIN, vmlink.BACKOFF_MAX
        # a quick back-off: hundreds of failures in one test
        vmlink.BACKOFF_MIN, vmlink.BACKOFF_MAX = 0.01, 0.05
        self.addCleanup(setattr, vmlink, 'BACKOFF_MAX', saved[1])
        self.addCleanup(setattr, vmlink, 'BACKOFF_MIN', saved[0])
        self.p = InProcess(vms=('bad', 'good'), period_ms=200, qmp_timeout_ms=300)
        self.addCleanup(self.p.close)
        self.bad, self.link = self.p.peers['bad'], self.p.arb.links['bad']
        self.n = 0
        self.until(lambda rec: self.link.state == 'ok' and 'bad' in rec['vms'] and
                   'good' in rec['vms'], 'both attached', others=False)

    def tick(self):
        """One period: the container, both VMs do I/O; the containers'
        latency is over its target every other period, under it in the
        others, so that the VMs' limits change (qom-set) every period."""
        self.n += 1
        self.p.container_io(1000)
        for peer in self.p.peers.values():
            peer.add(50, 50 * 65536, 8)
        self.p.arb.probe.lat_ms = 10.0 if self.n % 2 else 1.0
        before = self.link.state
        self.p.arb.period()
        rec = self.p.decisions()[-1]
        after = self.link.state
        for name, link in self.p.arb.links.items():
            self.assertTrue(link.is_alive(), f'the link thread of {name} died')
        for m in rec['vms'].values():
            for k, v in m.items():
                if k != 'late' and v is not None:
                    self.assertTrue(math.isfinite(v) and v >= 0, rec)
        if before != 'ok' and after != 'ok':
            self.assertNotIn('bad', rec['vms'], 'figures of a VM in error were used')
        st = self.p.arb.status()['vm_state']['bad']
        self.assertIn(st['state'], STATES)
        if st['state'] not in ('ok', 'connecting'):
            self.assertIsInstance(st['error'], str)
            self.assertTrue(0 < len(st['error']) <= 1000, st['error'][:2000])
        json.dumps(self.p.arb.status())
        self.p.arb.metrics()
        time.sleep(0.01)
        return rec, before, after

    def until(self, pred, what, timeout=15, others=True):
        deadline = time.monotonic() + timeout
        good = total = 0
        while True:
            rec, before, after = self.tick()
            total += 1
            good += 'good' in rec['vms']
            if pred(rec):
                if others:      # the other VM was measured in (nearly) every period
                    self.assertGreaterEqual(good, total * 0.8 - 1, what)
                return rec
            self.assertLess(time.monotonic(), deadline,
                            f'{what}: not reached; bad: {self.link.state} {self.link.error}')

    def serve(self, what, target, make):
        """Serve make(reply) for every reply to target (None: the
        greeting); returns the bad VM's state once the link has moved on
        from the first such reply (a command or a connection after it)
        and been in that state for three periods."""
        hit = []

        def mangle(name, reply):
            if name != target:
                return None
            if not hit:
                hit.append((len(self.bad.commands), self.bad.connections))
            return make(reply)
        self.bad.mangle = mangle
        if target in CONNECT:
            self.bad.hangup()
        states = []

        def settled(rec):
            if hit and (len(self.bad.commands), self.bad.connections) > hit[0]:
                states.append(self.link.state)
            return len(states) >= 3 and len(set(states[-3:])) == 1
        self.until(settled, what)
        return states[-1]

    def recover(self, what):
        self.bad.mangle = None
        self.until(lambda rec: self.link.state == 'ok' and 'bad' in rec['vms'],
                   f'{what}: the VM back')

    def test_malformed_replies_are_that_vms_error(self):
        for what, target, make, *want in CASES:
            with self.subTest(what):
                self.serve(what, target, make)
                st = self.p.arb.status()['vm_state']
                self.assertEqual(st['bad']['state'], (want or ['error'])[0],
                                 f'{what}: {st["bad"]}')
                self.assertEqual(st['good']['state'], 'ok', what)
                self.recover(what)
        self.no_bug()

    def no_bug(self):
        """Every reply was caught by a check, none by the link's last
        resort (which keeps the thread alive but logs a vm-bug)."""
        self.assertEqual([r for r in self.p.records if r.get('event') == 'vm-bug'], [])

    def test_random_mutations(self):
        rng = random.Random(35)
        targets = CONNECT + ('query-blockstats', 'qom-set')
        outcomes = collections.Counter()
        for i in range(120):
            target = rng.choice(targets)
            how, make = mutation(rng)
            what = f'#{i} {target or "greeting"}: {how}'
            with self.subTest(what):
                outcomes[self.serve(what, target, make)] += 1
                self.assertEqual(self.p.arb.status()['vm_state']['good']['state'], 'ok', what)
                self.recover(what)
        self.no_bug()
        # the mutations reached the checks: most of them are errors
        self.assertGreater(outcomes['error'], 60, outcomes)


class BackoffTest(unittest.TestCase):
    def test_malformed_replies_reconnect_with_backoff(self):
        """A peer that answers every qom-set with garbage: the link is
        made again with a growing back-off (0.5, 1, 2 s...), not every
        period, and the VM stays in error; the other VM is unaffected."""
        p = InProcess(vms=('bad', 'good'), period_ms=100)
        self.addCleanup(p.close)
        bad = p.peers['bad']
        p.container_io(1000)
        deadline = time.monotonic() + 10
        while p.arb.links['bad'].state != 'ok' or p.arb.links['good'].state != 'ok':
            self.assertLess(time.monotonic(), deadline, 'VMs attached')
            p.arb.period()
            time.sleep(0.05)
        bad.mangle = lambda name, reply: b'{"return": {}\n' if name == 'qom-set' else None
        c0 = bad.connections
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < 4.0:
            n += 1
            p.container_io(1000)
            for peer in p.peers.values():
                peer.add(50, 50 * 65536, 8)
            p.arb.probe.lat_ms = 10.0 if n % 2 else 1.0
            p.arb.period()
            time.sleep(0.1)
        st = p.arb.status()['vm_state']
        self.assertEqual(st['bad']['state'], 'error', st['bad'])
        self.assertIn('not JSON', st['bad']['error'])
        self.assertEqual(st['good']['state'], 'ok', st['good'])
        # 0.5 + 1 + 2 s of back-off in 4 s: at most four connections
        self.assertLessEqual(bad.connections - c0, 4)
        self.assertTrue(p.arb.links['bad'].is_alive())


if __name__ == '__main__':
    unittest.main()
