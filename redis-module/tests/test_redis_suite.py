"""Redis's own test suite against a server with the module (issue 35, item
17). The units of Redis 7.0.15's tests/ (Debian's source package, the one
redismodule.h comes from, unpacked under build/redis-module/redis-src/suite
by fetch-redismodule-h.sh --tests, never committed) run in the suite's
external-server mode against real redis-server processes: stock, then with
the module at its defaults and at its most aggressive settings (everything
demoted as soon as a pass sees it, visits at every access, compaction at 1 %).
--singledb keeps the tests on db 0, the only database the module manages.
Every test that passes on stock must pass with the module, unless
redis-suite.skip lists it with the reason it cannot apply (a listed test is
not run with the module: one that fails may leave state behind, such as a
maxmemory or an unread reply, that fails the tests after it).

Each unit gets a fresh server (a test that leaves a config behind must not
decide the next unit's results) and units run a few at a time: most of the
suite's time is spent in its own sleeps. Stock's results are cached in the
suite's directory, keyed on the suite's version, redis-server's version and
the way the suite is run; delete the file (or HYBRIDVM_REDIS_SUITE_FRESH=1)
to run stock again. A unit where the module fails a test stock passed is
run once more on its own, so that a timing test that lost its race on this
shared machine is not taken for a bug; a test that fails twice fails the
variant. docs/redis-module.md, "Redis's own test suite", has the figures."""

import collections
import hashlib
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import REDIS_SERVER, TOP, Server, ServerTestCase, aggressive  # noqa: E402

BUILD = os.environ.get('HYBRIDVM_BUILD', os.path.join(TOP, 'build'))
SRC_DIR = os.path.join(BUILD, 'redis-module', 'redis-src')
FETCH = os.path.join(TOP, 'redis-module', 'fetch-redismodule-h.sh')
OUT_DIR = os.path.join(BUILD, 'redis-module', 'redis-suite')     # each unit's last output
SKIP_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'redis-suite.skip')

# The units that run against an external server, but for geo and
# type/list-3 (no strings, half a minute and more each) and those whose
# every test is tagged external:skip.
UNITS = [
    'type/string', 'type/incr', 'type/hash', 'type/list', 'type/list-2', 'type/set',
    'type/zset', 'type/stream', 'type/stream-cgroups', 'expire', 'keyspace', 'scan',
    'multi', 'bitops', 'bitfield', 'hyperloglog', 'dump', 'sort', 'scripting',
    'functions', 'introspection', 'introspection-2', 'info-command', 'latency-monitor',
    'slowlog', 'lazyfree', 'tracking', 'pubsub', 'pause', 'protocol', 'querybuf',
    'replybufsize', 'quit', 'violations', 'other',
]

VARIANTS = {
    'defaults': {},
    # As soon and as much as the module can: every idle string demoted at
    # the first pass (hot budget 0, no minimum idle time), passes every
    # millisecond in 1 ms slices, a read of a cold item a visit unless a
    # second one comes within 1 ms, compaction once 1 % was demoted.
    'aggressive': dict(aggressive(), **{'promote-window-ms': 1, 'compact-percent': 1}),
}

WORKERS = 3                 # units at a time (the suite mostly sleeps)
UNIT_TIMEOUT = 300          # s, per unit (the longest, hyperloglog, takes ~70 s)
# The suite's runners listen below --baseport (see run_unit): a range per
# process (two of these tests may run at once) and per slot within it.
BASEPORT = 21000 + 64 * (WORKERS + 1) * (os.getpid() % 40)
RUNNER = ['--singledb', '--durable', '--clients', '1', '--timeout', str(UNIT_TIMEOUT)]

RESULT = re.compile(r'^\[(ok|err|skip|ignore|exception)\]: (.*)$')


def parse(out):
    """The results of one unit's run: {(name, n): status}, n counting the
    tests of that name before it in the unit ('ok', 'err', 'skip';
    'ignore'd tests, left out by their tags, are not results). An
    exception ends the unit: the tests after it have no result."""
    res, seen = {}, collections.Counter()
    for line in out.splitlines():
        m = RESULT.match(line)
        if not m:
            continue
        status, rest = m.groups()
        if status == 'ignore' or status == 'exception':
            continue
        if status == 'ok':
            name = re.sub(r' \(\d+ ms\)$', '', rest)
        elif status == 'err':
            name = rest.rsplit(' in tests/', 1)[0]
        else:
            name = rest
        res[(name, seen[name])] = status
        seen[name] += 1
    return res


def load_skips(path=SKIP_FILE):
    """redis-suite.skip: '<variants> <unit> <test name> ;; <reason>' per
    line, variants '*' or a comma-separated list of VARIANTS' names.
    Returns {(variant, unit, name): reason}; raises on an entry without a
    reason or naming an unknown variant."""
    skips = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip('\n')
            if not line.strip() or line.lstrip().startswith('#'):
                continue
            head, sep, reason = line.partition(' ;; ')
            parts = head.split(None, 2)
            if not sep or not reason.strip() or len(parts) != 3:
                raise ValueError('%s:%d: want "<variants> <unit> <test name> ;; <reason>"'
                                 % (path, n))
            variants = list(VARIANTS) if parts[0] == '*' else parts[0].split(',')
            for v in variants:
                if v not in VARIANTS:
                    raise ValueError('%s:%d: unknown variant %r' % (path, n, v))
                skips[(v, parts[1], parts[2].strip())] = reason.strip()
    return skips


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Runner:
    """Runs units of the suite against fresh servers, WORKERS at a time."""

    def __init__(self, suite, workdir, skips=None):
        self.suite = suite
        self.workdir = workdir
        self.skips = skips or {}
        self.lock = threading.Lock()
        self.serial = 0

    def server(self, variant, unit):
        with self.lock:
            self.serial += 1
            name = '%s-%s-%d' % (variant, unit.replace('/', '_'), self.serial)
        configs = None if variant == 'stock' else VARIANTS[variant]
        for _ in range(5):
            # Like the suite's default.conf where it matters to the units:
            # protected configs and DEBUG allowed.
            srv = Server(self.workdir, name, module=configs is not None, configs=configs,
                         extra=['--port', str(free_port()), '--bind', '127.0.0.1',
                                '--enable-protected-configs', 'yes'])
            try:
                return srv.start()
            except RuntimeError:
                srv.stop()         # the port was taken meanwhile: another
        raise RuntimeError('cannot start a server for ' + name)

    def run_unit(self, variant, unit, slot=0, tag=''):
        """Run one unit; returns (results, output, seconds, server stats).
        Units that run at the same time need their own 'slot': the suite's
        runner listens on a port it picks below --baseport, and two that
        find one free at once collide."""
        srv = self.server(variant, unit)
        port = int(srv.extra[1])
        # Listed tests do not run: one that fails may leave state behind
        # (a maxmemory, an unread reply) that fails the tests after it.
        skip = []
        for (v, u, name) in sorted(self.skips):
            if v == variant and u == unit:
                skip += ['--skiptest', name]
        t0 = time.monotonic()
        try:
            p = subprocess.run(['tclsh', 'tests/test_helper.tcl', '--host', '127.0.0.1',
                                '--port', str(port), '--baseport', str(BASEPORT + 64 * slot)] +
                               RUNNER + skip + ['--single', 'unit/' + unit],
                               cwd=self.suite, env=dict(os.environ, TERM='dumb'),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=UNIT_TIMEOUT + 60)
            out = p.stdout.decode(errors='replace')
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b'').decode(errors='replace') + '\n[runner timeout]\n'
        secs = time.monotonic() - t0
        stats = {}
        if srv.proc.poll() is not None:
            out += '\n[server died]\n' + srv.logtail()
        elif srv.module:
            try:
                i = srv.client(socket_timeout=10).info('appassist')
                stats = {k: i.get('appassist_' + k, 0)
                         for k in ('demotions', 'promotions', 'visits', 'relocations')}
            except Exception as e:       # noqa: BLE001 -- reported, not fatal
                out += '\n[INFO appassist failed: %s]\n' % e
        srv.stop()
        keep = os.path.join(OUT_DIR, variant, unit.replace('/', '_') + tag + '.out')
        os.makedirs(os.path.dirname(keep), exist_ok=True)
        with open(keep, 'w') as f:
            f.write(out)
        return parse(out), out, secs, stats

    def run(self, jobs):
        """Run (variant, unit) jobs, longest units first; returns
        {(variant, unit): run_unit's tuple}."""
        q = queue.Queue()
        order = {u: i for i, u in enumerate(LONGEST_FIRST)}
        for j in sorted(jobs, key=lambda j: order.get(j[1], -1)):
            q.put(j)
        done, errors = {}, []

        def worker(slot):
            while True:
                try:
                    j = q.get_nowait()
                except queue.Empty:
                    return
                try:
                    done[j] = self.run_unit(*j, slot=slot)
                except Exception as e:   # noqa: BLE001 -- re-raised below
                    errors.append((j, e))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError('running the suite failed: %r' % errors)
        return done


# Measured alone, stock, 2026-11-27: the order the pool starts them in.
LONGEST_FIRST = ['hyperloglog', 'type/zset', 'type/stream', 'dump', 'type/list', 'expire',
                 'type/set', 'type/list-2', 'type/string', 'scan', 'latency-monitor',
                 'introspection-2', 'other', 'scripting', 'multi', 'sort', 'type/hash',
                 'querybuf', 'type/stream-cgroups', 'functions', 'tracking', 'keyspace',
                 'bitops', 'slowlog', 'replybufsize', 'lazyfree', 'pubsub', 'protocol',
                 'bitfield', 'introspection', 'pause', 'info-command', 'quit', 'violations',
                 'type/incr']


class RedisSuiteTest(ServerTestCase):
    """The units of Redis's own suite pass with the module as on stock."""

    def setUp(self):
        super().setUp()
        if not shutil.which('tclsh'):
            self.skipTest('tclsh not installed (Debian package tcl, scripts/setup-host.sh)')
        p = subprocess.run(['sh', FETCH, SRC_DIR, '--tests'], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
        if p.returncode != 0:
            self.skipTest("Redis's test suite unavailable (apt-get source redis): " +
                          p.stderr.decode(errors='replace').strip())
        self.suite = p.stdout.decode().strip()
        self.skips = load_skips()
        self.runner = Runner(self.suite, self.workdir, self.skips)
        os.makedirs(OUT_DIR, exist_ok=True)

    def stock_key(self):
        with open(os.path.join(self.suite, '.version')) as f:
            version = f.read().strip()
        server = subprocess.run([REDIS_SERVER, '--version'], stdout=subprocess.PIPE).stdout
        h = hashlib.sha1(json.dumps([version, server.decode(), RUNNER, UNITS]).encode())
        return h.hexdigest()

    def stock_cache(self):
        return os.path.join(self.suite, 'stock-results.json')

    def stock_results(self, jobs):
        """Stock's results per unit, from the cache or by adding its units
        to 'jobs' (run with them; see store_stock)."""
        key = self.stock_key()
        path = self.stock_cache()
        if os.environ.get('HYBRIDVM_REDIS_SUITE_FRESH') != '1' and os.path.exists(path):
            with open(path) as f:
                cached = json.load(f)
            if cached.get('key') == key:
                return {u: {(n, int(k)): s for n, k, s in cached['units'][u]} for u in UNITS}
        jobs += [('stock', u) for u in UNITS]
        return None

    def store_stock(self, done):
        units = {}
        for u in UNITS:
            res, out, _, _ = done[('stock', u)]
            if 'done]: unit/%s (' % u not in out or not res:
                self.fail('stock Redis failed to run unit %s:\n%s' % (u, out[-3000:]))
            units[u] = [[n, k, s] for (n, k), s in sorted(res.items())]
        tmp = self.stock_cache() + '.tmp'
        with open(tmp, 'w') as f:
            json.dump({'key': self.stock_key(), 'units': units}, f)
        os.replace(tmp, self.stock_cache())
        return {u: {(n, k): s for n, k, s in units[u]} for u in UNITS}

    def check_variant(self, variant):
        jobs = [(variant, u) for u in UNITS]
        stock = self.stock_results(jobs)
        t0 = time.monotonic()
        done = self.runner.run(jobs)
        if stock is None:
            stock = self.store_stock(done)
        report, failures, stats = [], [], collections.Counter()
        for u in UNITS:
            res, out, secs, st = done[(variant, u)]
            stats.update(st)
            lost = [t for t, s in stock[u].items() if s == 'ok' and res.get(t) != 'ok'
                    and (variant, u, t[0]) not in self.skips]
            if lost:
                # Once more, on its own: a timing test may have lost its race.
                # The first output is kept as <unit>.lost.out.
                first = out
                base = os.path.join(OUT_DIR, variant, u.replace('/', '_'))
                shutil.copy(base + '.out', base + '.lost.out')
                res, out, secs2, st = self.runner.run_unit(variant, u, tag='.rerun')
                again = [t for t in lost if res.get(t) != 'ok']
                report.append('%s: %d test(s) failed, %d again when run alone: %s' %
                              (u, len(lost), len(again), '; '.join(t[0] for t in lost)))
                for t in again:
                    failures.append('%s: %s\n%s' % (u, t[0], self.details(out, t[0]) or
                                                     self.details(first, t[0])))
            counts = collections.Counter(res.values())
            report.append('%-16s %5.1f s  ok %d  err %d  skip %d  (stock ok %d)' % (
                u, secs, counts['ok'], counts['err'], counts['skip'],
                sum(1 for s in stock[u].values() if s == 'ok')))
        report.append('%s: %.0f s in all; module: %s' % (variant, time.monotonic() - t0,
                                                         dict(stats)))
        self.log('\n'.join(report))
        self.assertFalse(failures, 'tests that pass on stock Redis failed with the module (%s):'
                         '\n\n%s' % (variant, '\n\n'.join(failures)))
        return stats

    @staticmethod
    def details(out, name):
        """The [err] line of test 'name' in a unit's output and what follows."""
        lines = out.splitlines()
        for i, line in enumerate(lines):
            if line.startswith('[err]: ' + name + ' in tests/'):
                return '\n'.join(lines[i:i + 12])
        return ''

    def log(self, text):
        sys.stdout.write(text + '\n')
        with open(os.path.join(OUT_DIR, 'summary.log'), 'a') as f:
            f.write(time.strftime('%Y-%m-%d %H:%M:%S ') + self.id() + '\n' + text + '\n\n')

    def test_module_defaults(self):
        """With the module at its defaults (nothing of this size is cold)."""
        self.check_variant('defaults')

    def test_module_aggressive(self):
        """With the module demoting everything it can, as soon as it can:
        the units run on cold items, visits and relocations."""
        stats = self.check_variant('aggressive')
        self.assertGreater(stats['demotions'], 1000, stats)
        self.assertGreater(stats['visits'] + stats['promotions'], 1000, stats)

    def test_skip_list(self):
        """Every entry of redis-suite.skip names a unit that runs and a test
        of it that passes on stock (from the cache of stock's results, when
        there is one), and says why the test cannot apply."""
        stock = self.stock_results([])
        for (variant, unit, name), reason in self.skips.items():
            self.assertIn(unit, UNITS, name)
            self.assertGreater(len(reason), 20, name)
            if stock is not None:
                self.assertIn((name, 'ok'), {(n, st) for (n, _), st in stock[unit].items()},
                              'redis-suite.skip: %s: no such test passes on stock' % name)


if __name__ == '__main__':
    unittest.main()
