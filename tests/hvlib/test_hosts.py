"""Tests of tests/hvlib/hosts.py: hosts as namespaces on one machine
(issue 39, item 1).  Needs root.  The Ceph test (CephHostsTest) takes about
a minute; the others together well under 30 s."""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from hvlib import hosts   # noqa: E402
from hvlib.hosts import Network, pids_in_ns   # noqa: E402

PY = sys.executable
BUILD = os.environ.get('HYBRIDVM_BUILD',
                       os.path.join(os.path.dirname(os.path.dirname(HERE)), 'build'))
HVMEMD = os.path.join(os.environ.get('HVMEM_BIN', os.path.join(BUILD, 'broker')), 'hvmemd')
MB = 1000 * 1000

# sink PORT: accept one connection, count what arrives, write the count to
# FILE every 50 ms (if given) and send it back at EOF
SINK = r'''
import os, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(8)
print('listening', flush=True)
c, _ = s.accept()
n, last = 0, 0
while True:
    d = c.recv(1 << 16)
    if not d:
        break
    n += len(d)
    if len(sys.argv) > 2 and time.monotonic() - last > 0.05:
        with open(sys.argv[2] + '.new', 'w') as f:
            f.write(str(n))
        os.replace(sys.argv[2] + '.new', sys.argv[2])
        last = time.monotonic()
c.sendall(str(n).encode())
c.close()
'''

# send HOST PORT BYTES: send BYTES (forever if 0), print the seconds until
# the sink confirmed them
SEND = r'''
import socket, sys, time
t = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
total, chunk = int(sys.argv[3]), b'x' * (1 << 16)
c.settimeout(None)
sent = 0
while total == 0 or sent < total:
    n = min(len(chunk), total - sent) if total else len(chunk)
    c.sendall(chunk[:n]); sent += n
c.shutdown(socket.SHUT_WR)
got = int(c.recv(64))
print('%f %d' % (time.monotonic() - t, got), flush=True)
'''

# listen PORT: accept connections forever, answer each with the hostname
LISTEN = r'''
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(8)
print('listening', flush=True)
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode()); c.close()
'''

# probe HOST PORT TIMEOUT: connect and read; print what happened
PROBE = r'''
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print('ok', c.recv(64).decode())
except TimeoutError:
    print('timeout')
except OSError as e:
    print('error', e.errno, e)
'''

# hold HOST PORT: connect, then on each line of stdin: "wait" (recv with a
# 1 s timeout) or "poke" (send a byte, recv with a 5 s timeout)
HOLD = r'''
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print('connected', flush=True)
for line in sys.stdin:
    try:
        if line.strip() == 'poke':
            c.sendall(b'x'); c.settimeout(5)
        else:
            c.settimeout(1)
        d = c.recv(64)
        print('eof' if not d else 'data', flush=True)
    except TimeoutError:
        print('timeout', flush=True)
    except OSError as e:
        print('error', e.errno, flush=True)
'''

# echo PORT: accept one connection and echo
ECHO = r'''
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(8)
print('listening', flush=True)
c, _ = s.accept()
while True:
    d = c.recv(64)
    if not d:
        break
    c.sendall(d)
'''

# watch FILE: note in FILE every process of this host (but itself and the
# init) that goes away, from the moment it starts
WATCH = r'''
import os, sys, time
me = os.getpid()
def procs():
    return {p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, me)}
seen = procs()
with open(sys.argv[1], 'a') as f:
    f.write('watching %s\n' % ' '.join(sorted(seen))); f.flush()
    print('watching', flush=True)
    while True:
        now = procs()
        for p in seen - now:
            f.write('gone %s\n' % p); f.flush()
        seen = now | seen & now
        time.sleep(0.001)
'''


def netns_names():
    return set(os.listdir('/run/netns')) if os.path.isdir('/run/netns') else set()


def links():
    return set(os.listdir('/sys/class/net'))


def started(p):
    """Wait for the first line of p's stdout (a server saying 'listening')."""
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f'{p.argv} exited {p.wait()} before its first line')
    return line.strip()


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f'timed out waiting for {what}')


@unittest.skipUnless(os.geteuid() == 0, 'needs root (namespaces, tc)')

def kept_in(ram_path):
    """What `ls -A` shows in a host's fresh `ram_path`: only the way to the
    tree, its build and Python when they live there (hosts.program_dirs)."""
    names = sorted({p[len(ram_path) + 1:].split('/')[0] for p in hosts.program_dirs()
                    if p.startswith(ram_path + '/')})
    return ''.join(n + '\n' for n in names)

class HostsTest(unittest.TestCase):
    HOSTS = ('a', 'b')

    def setUp(self):
        self.net = Network('t')
        self.addCleanup(self.net.close)
        for h in self.HOSTS:
            setattr(self, h, self.net.host(h))
        self.procs = []
        self.addCleanup(self.stop_procs)

    def stop_procs(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()

    def popen(self, host, script, *args, **kw):
        kw.setdefault('stdout', subprocess.PIPE)
        kw.setdefault('text', True)
        p = host.popen([PY, '-c', script, *map(str, args)], **kw)
        self.procs.append(p)
        return p

    def server(self, host, script, *args):
        p = self.popen(host, script, *args)
        self.assertEqual(started(p), 'listening')
        return p

    def probe(self, src, dst, port, timeout=1.0):
        return src.run([PY, '-c', PROBE, dst.addr, port, timeout]).stdout.strip()

    def send(self, src, dst, port, nbytes):
        """Seconds to send nbytes from src to a sink on dst."""
        sink = self.server(dst, SINK, port)
        secs, got = src.run([PY, '-c', SEND, dst.addr, port, nbytes]).stdout.split()
        self.assertEqual(int(got), nbytes)
        self.assertEqual(sink.wait(10), 0)
        return float(secs)

    def test_tcp_between_hosts(self):
        self.server(self.b, LISTEN, 7000)
        self.assertEqual(self.probe(self.a, self.b, 7000), 'ok b')
        # the machine reaches the hosts too (ceph-cluster.sh needs that)
        with socket.create_connection((self.b.addr, 7000), timeout=5) as c:
            self.assertEqual(c.recv(64), b'b')
        # a port nobody listens on is refused at once: a real peer answers
        self.assertTrue(self.probe(self.a, self.b, 7001).startswith('error 111'))

    def test_private_namespaces(self):
        a, b = self.a, self.b
        net = self.net
        for d in ('/dev/shm', '/run', '/tmp'):
            a.run(['sh', '-c', f'echo a >{d}/hv-made-in-a'])
            self.assertFalse(os.path.exists(f'{d}/hv-made-in-a'), d)
            self.assertEqual(b.run(['sh', '-c', f'ls -A {d}']).stdout, kept_in(d), d)
            self.assertEqual(a.run(['cat', f'{d}/hv-made-in-a']).stdout, 'a\n')
        self.assertEqual(a.run(['hostname']).stdout, 'a\n')
        # its own PID namespace: pid 1 is the host's init, and only its own
        # processes are visible
        self.assertIn('_init', a.run(['cat', '/proc/1/cmdline']).stdout)
        self.popen(b, 'import time; time.sleep(60)')
        procs = a.run(['sh', '-c', 'ls /proc | grep -c "^[0-9]"']).stdout
        self.assertLessEqual(int(procs), 5)      # init, nsenter's child, sh, ls, grep
        # its disk: /var/lib/hybridvm is Host.files; other hosts' are hidden,
        # the shared and ceph directories are not
        a.run(['sh', '-c', 'echo disk >/var/lib/hybridvm/f'])
        with open(os.path.join(a.files, 'f')) as f:
            self.assertEqual(f.read(), 'disk\n')
        self.assertEqual(a.run(['cat', os.path.join(a.files, 'f')]).stdout, 'disk\n')
        self.assertEqual(sorted(a.run(['ls', net.workdir]).stdout.split()),
                         ['a', 'ceph', 'shared'])
        with open(os.path.join(net.shared, 'g'), 'w') as f:
            f.write('shared')
        self.assertEqual(b.run(['cat', os.path.join(net.shared, 'g')]).stdout, 'shared')
        # /proc/self/mountinfo of a host holds no copy of the machine's netns files
        self.assertNotIn('/run/netns', a.run(['cat', '/proc/self/mountinfo']).stdout)

    def test_signals_reach_the_process(self):
        p = self.popen(self.a, 'import time; print("up", flush=True); time.sleep(60)')
        self.assertEqual(started(p), 'up')
        self.assertEqual(p.ns_pid, 2)
        self.assertIn(p.real_pid, self.a.pids())
        p.terminate()
        self.assertEqual(p.wait(5), -signal.SIGTERM)
        # run() with a timeout kills the process itself, not just nsenter
        with self.assertRaises(subprocess.TimeoutExpired):
            self.a.run(['sleep', '30'], timeout=0.5)
        wait_for(lambda: len(self.a.pids()) == 1, 5, 'only init left in a')

    def test_tbf_limits_both_ways(self):
        a, b = self.a, self.b
        fast = self.send(a, b, 7100, 2 * MB)
        self.assertLess(fast, 1.0)
        self.net.link('a', 'b', rate='8mbit')
        ab = self.send(a, b, 7101, 2 * MB)
        ba = self.send(b, a, 7102, 2 * MB)
        # 2 MB at 1 MB/s, less the first burst of 64 KiB
        self.assertGreaterEqual(ab, 1.5)
        self.assertGreaterEqual(ba, 1.5)
        self.assertLess(max(ab, ba), 6)
        self.assertGreaterEqual(a.sent_to('b'), 2 * MB)
        self.assertGreaterEqual(b.sent_to('a'), 2 * MB)
        # unshaped again
        self.net.link('a', 'b', None)
        self.assertLess(self.send(a, b, 7103, 2 * MB), 1.0)

    def test_cut_stalls_and_restore_resumes(self):
        a, b = self.a, self.b
        self.net.link('a', 'b', rate='8mbit')    # keep the stream cheap
        count = os.path.join(b.files, 'count')
        sink = self.server(b, SINK, 7200, count)

        def received():
            try:
                with open(count) as f:
                    return int(f.read())
            except (OSError, ValueError):
                return 0
        sender = self.popen(a, SEND, b.addr, 7200, 0)
        wait_for(lambda: received() > 100000, 10, 'data to flow')
        self.net.cut('a')
        time.sleep(0.5)
        before = received()
        time.sleep(1.5)
        self.assertEqual(received(), before, 'data crossed a cut link')
        self.assertIsNone(sender.poll(), 'the sender failed instead of stalling')
        # a new connection neither gets through nor fails: it times out
        self.assertEqual(self.probe(a, b, 7200, 1.0), 'timeout')
        self.net.restore('a')
        wait_for(lambda: received() > before + 100000, 15, 'data to flow again')
        self.assertIsNone(sender.poll())
        self.assertIsNone(sink.poll())

    def test_restart_keeps_disk_loses_ram(self):
        a, b = self.a, self.b
        a.run(['sh', '-c', 'echo disk >/var/lib/hybridvm/d; for d in /dev/shm /run /tmp; '
                           'do echo ram >$d/r; done'])
        echo = self.server(a, ECHO, 7300)
        hold = self.popen(b, HOLD, a.addr, 7300, stdin=subprocess.PIPE)
        self.assertEqual(started(hold), 'connected')
        old_pid = a.pid
        a.kill()
        self.assertFalse(a.up)
        self.assertEqual(echo.wait(5), -signal.SIGKILL)
        self.assertNotIn(a.netns, netns_names())
        # a dead host says nothing: no FIN, no RST, only silence
        hold.stdin.write('wait\n')
        hold.stdin.flush()
        self.assertEqual(hold.stdout.readline().strip(), 'timeout')
        a.restart()
        self.assertNotEqual(a.pid, old_pid)
        self.assertEqual(a.run(['cat', '/var/lib/hybridvm/d']).stdout, 'disk\n')
        self.assertEqual(a.run(['sh', '-c', 'ls -A /dev/shm /run /tmp']).stdout,
                         f'/dev/shm:\n{kept_in("/dev/shm")}\n/run:\n{kept_in("/run")}\n'
                         f'/tmp:\n{kept_in("/tmp")}')
        # the rebooted host's kernel knows nothing of the old connection
        hold.stdin.write('poke\n')
        hold.stdin.flush()
        self.assertEqual(hold.stdout.readline().strip(), 'error 104')   # ECONNRESET
        # same address, same name
        self.server(a, LISTEN, 7301)
        self.assertEqual(self.probe(b, a, 7301), 'ok a')

    def test_kill_is_every_process_at_once(self):
        a, b = self.a, self.b
        watch_file = os.path.join(a.files, 'watch')
        survivor = self.popen(b, 'import time; print("up", flush=True); time.sleep(60)')
        self.assertEqual(started(survivor), 'up')
        b_pids = b.pids()
        procs = [
            self.popen(a, 'import time; time.sleep(60)'),
            # a shell with two grandchildren
            a.popen(['sh', '-c', 'sleep 60 & sleep 60 & wait']),
            # one that ignores SIGTERM
            self.popen(a, 'import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
                          'print("up", flush=True)\ntime.sleep(60)'),
        ]
        self.procs.append(procs[1])
        self.assertEqual(started(procs[2]), 'up')
        # a daemon, its parent gone: the init's child now
        a.run(['sh', '-c', 'setsid sleep 60 </dev/null >/dev/null 2>&1 &'])
        # a canary that goes by itself, so the watcher is seen to notice
        canary = a.popen(['sleep', '0.3'])
        self.procs.append(canary)
        watcher = self.popen(a, WATCH, watch_file)
        self.assertEqual(started(watcher), 'watching')
        self.assertEqual(canary.wait(5), 0)
        wait_for(lambda: 'gone' in read(watch_file), 5, 'the watcher to see the canary')
        procs[2].terminate()
        time.sleep(0.3)
        self.assertIsNone(procs[2].poll(), 'SIGTERM was not ignored')
        pids = a.pids()
        # init, sleep, sh and its two, the one ignoring SIGTERM, the daemon, the watcher
        self.assertEqual(len(pids), 8, pids)
        pidns = os.readlink(f'/proc/{a.pid}/ns/pid')
        before = read(watch_file)

        a.kill()
        for p in procs + [watcher]:
            self.assertEqual(p.wait(5), -signal.SIGKILL, p.argv)
        self.assertEqual([p for p in pids if os.path.exists(f'/proc/{p}')], [])
        left = [p for p in os.listdir('/proc') if p.isdigit()
                and os.path.exists(f'/proc/{p}/ns/pid')
                and _readlink(f'/proc/{p}/ns/pid') == pidns]
        self.assertEqual(left, [])
        # nobody in a outlived anybody else: the watcher saw nothing go
        self.assertEqual(read(watch_file), before)
        # b is untouched
        self.assertIsNone(survivor.poll())
        self.assertEqual(sorted(b.pids()), sorted(b_pids))

    @unittest.skipUnless(os.access(HVMEMD, os.X_OK), f'{HVMEMD} not built')
    def test_a_broker_per_host(self):
        """Each host runs hvmemd at its default pool and socket; a region
        lives in its host's RAM only."""
        bin_dir = os.path.dirname(HVMEMD)
        for h in (self.a, self.b):
            p = h.popen([HVMEMD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append(p)
        hvmem = os.path.join(bin_dir, 'hvmem')

        def up(h):
            wait_for(lambda: h.run([hvmem, 'stat'], check=False).returncode == 0,
                     10, f'hvmemd in {h.name}')

        def ask(h, *args):
            return h.run([hvmem, *args]).stdout
        up(self.a)
        up(self.b)
        ask(self.a, 'create', 'r1', '4M')
        self.assertIn('r1', ask(self.a, 'list'))
        self.assertNotIn('r1', ask(self.b, 'list'))
        self.assertFalse(os.path.exists('/dev/shm/hybridvm-broker/r1'))
        self.a.restart()
        self.procs.append(self.a.popen([HVMEMD], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))
        up(self.a)
        self.assertNotIn('r1', ask(self.a, 'list'))     # the pool was RAM

    def test_close_leaves_nothing(self):
        net = Network('t')
        a, b = net.host('a'), net.host('b')
        net.link('a', 'b', '10mbit')
        net.cut('b')
        ps = [a.popen(['sleep', '60']), b.popen(['sh', '-c', 'sleep 60 & wait'])]
        time.sleep(0.1)
        pids = a.pids() + b.pids()
        names = {a.netns, b.netns, net.fabric}
        self.assertLessEqual(names, netns_names())
        uplink, workdir = net.uplink, net.workdir
        self.assertIn(uplink, links())
        with self.assertRaises(ZeroDivisionError):
            with net:
                1 / 0
        for p in ps:
            self.assertEqual(p.wait(5), -signal.SIGKILL)
        self.assertEqual(names & netns_names(), set())
        self.assertNotIn(uplink, links())
        self.assertFalse(os.path.exists(workdir))
        self.assertEqual([p for p in pids if os.path.exists(f'/proc/{p}')], [])
        with open('/proc/self/mountinfo') as f:
            mounts = f.read()
        self.assertNotIn(f'hvn-t-{net.id}-', mounts)


def read(path):
    with open(path) as f:
        return f.read()


def _readlink(p):
    try:
        return os.readlink(p)
    except OSError:
        return None


@unittest.skipUnless(os.geteuid() == 0, 'needs root (namespaces, tc)')
class ThreeHostsTest(unittest.TestCase):
    def test_pairwise_cut(self):
        net = Network('t3')
        self.addCleanup(net.close)
        a, b, c = net.host('a'), net.host('b'), net.host('c')
        for h in (a, b, c):
            p = h.popen([PY, '-c', LISTEN, 7400], stdout=subprocess.PIPE, text=True)
            self.addCleanup(p.communicate)
            self.addCleanup(p.kill)
            self.assertEqual(started(p), 'listening')

        def probe(x, y):
            return x.run([PY, '-c', PROBE, y.addr, 7400, 1.0]).stdout.strip()
        net.cut('a', 'b')
        self.assertEqual(probe(a, b), 'timeout')
        self.assertEqual(probe(b, a), 'timeout')
        self.assertEqual(probe(a, c), 'ok c')
        self.assertEqual(probe(b, c), 'ok c')
        # a cut outlives a restart (it is the network's, not the host's)
        b.restart()
        p = b.popen([PY, '-c', LISTEN, 7400], stdout=subprocess.PIPE, text=True)
        self.addCleanup(p.communicate)
        self.addCleanup(p.kill)
        self.assertEqual(started(p), 'listening')
        self.assertEqual(probe(a, b), 'timeout')
        net.restore('a', 'b')
        self.assertEqual(probe(a, b), 'ok b')
        self.assertEqual(probe(b, a), 'ok a')

    def test_leftovers_of_a_killed_run_are_swept(self):
        child = subprocess.Popen([PY, '-c', r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
from hvlib.hosts import Network
net = Network('sweept')
a = net.host('a')
a.popen(['sleep', '600'])
time.sleep(0.2)
print(json.dumps(dict(netns=[a.netns, net.fabric], uplink=net.uplink,
                      workdir=net.workdir, pids=a.pids())), flush=True)
time.sleep(600)
''', os.path.dirname(HERE)], stdout=subprocess.PIPE, text=True)
        self.addCleanup(child.wait)
        self.addCleanup(child.kill)
        info = json.loads(child.stdout.readline())
        child.stdout.close()
        self.assertEqual(len(info['pids']), 2)        # init, sleep
        # hold the lock under which every Network sweeps, so that one
        # starting elsewhere now (the other CI lane) leaves them to us
        with open(hosts.LOCK, 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            child.kill()
            child.wait()
            # the host died with its owner (PR_SET_PDEATHSIG, --kill-child)...
            wait_for(lambda: not any(os.path.exists(f'/proc/{p}') for p in info['pids']),
                     5, "the killed owner's host processes to die")
            # ...its namespaces, port and files did not
            self.assertLessEqual(set(info['netns']), netns_names())
            self.assertIn(info['uplink'], links())
            self.assertTrue(os.path.isdir(info['workdir']))
        with Network('t'):
            self.assertEqual(set(info['netns']) & netns_names(), set())
            self.assertNotIn(info['uplink'], links())
            self.assertFalse(os.path.exists(info['workdir']))


@unittest.skipUnless(os.geteuid() == 0, 'needs root (namespaces, tc)')
class CephHostsTest(unittest.TestCase):
    """The persistent tier in its own namespace, used from two hosts (~1 min)."""

    def test_rbd_from_two_hosts(self):
        net = Network('tc')
        self.addCleanup(net.close)
        a, b = net.host('a'), net.host('b')
        ceph = net.ceph()          # SkipTest with hvlib.ceph's reason when missing
        node = net.node('ceph')
        for daemon in ('mon.a', 'osd.0'):
            self.assertIn(ceph.pid(daemon), pids_in_ns('net', node.netns_path))
        env = dict(os.environ, CEPH_CONF=ceph.conf)
        a.run(['rbd', 'create', '--size', '64M', 'rbd/hosts-img'], env=env, timeout=120)
        out = b.run(['rbd', 'info', '--format', 'json', 'rbd/hosts-img'], env=env,
                    timeout=120).stdout
        self.assertEqual(json.loads(out)['size'], 64 << 20)


if __name__ == '__main__':
    unittest.main()
