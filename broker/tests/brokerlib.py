"""Helpers for the memory broker tests: a Python client of the wire protocol
(docs/broker.md), a real hvmemd process on a private pool and socket, and an
"agent": a child process (optionally under another uid) that maps regions and
reads or writes them on command, so that data, leases and refusals cross real
process boundaries.  Not a test file itself (no test_ prefix).

Run as a script (`brokerlib.py agent SOCKET`) it is the agent: one JSON
command per line on stdin, one JSON reply per line on stdout."""

import errno
import fcntl
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get('HYBRIDVM_BUILD', os.path.join(REPO, 'build'))
BIN = os.environ.get('HVMEM_BIN', os.path.join(BUILD, 'broker'))
HVMEMD = os.path.join(BIN, 'hvmemd')
HVMEM = os.path.join(BIN, 'hvmem')
NOBODY = 65534
SYSTEM_PYTHON = '/usr/bin/python3'

MAGIC = 0x424d5648
VERSION = 1
HDR = struct.Struct('<IHHII')
REQ = struct.Struct('<QIIHHI')
REP = struct.Struct('<iIII')
REGION = struct.Struct('<QQQIIIIIIIHH')
ITEM = struct.Struct('<QQHHI')
POOL = struct.Struct('<QQQQIIIIQQ')
REPLY = 0x8000
MAP_RW = 1
LEASED = 1
DESTROYED = 2
ITEM_ALIGN = 2 << 20
OPS = dict(create=1, lookup=2, destroy=3, resize=4, alloc=5, item_lookup=6,
           free=7, chmod=8, stat=9, list=10, map=11, release=12, export_keys=13)


class BrokerError(Exception):
    def __init__(self, err, msg):
        super().__init__(f'{errno.errorcode.get(err, err)}: {msg}')
        self.errno = err
        self.msg = msg


def decode_region(data, off=0):
    f = REGION.unpack_from(data, off)
    off += REGION.size
    name = data[off:off + f[10]].decode()
    return dict(size=f[0], used=f[1], id=f[2], mode=f[3], uid=f[4], gid=f[5],
                nitems=f[6], attached=f[7], flags=f[8], lease_pid=f[9],
                name=name), off + f[10]


def decode_item(data, off=0):
    f = ITEM.unpack_from(data, off)
    off += ITEM.size
    return dict(offset=f[0], size=f[1], name=data[off:off + f[2]].decode()), off + f[2]


def encode(op, name=b'', item=b'', size=0, mode=0, flags=0, seq=1):
    name = name.encode() if isinstance(name, str) else name
    item = item.encode() if isinstance(item, str) else item
    body = REQ.pack(size, mode, flags, len(name), len(item), 0) + name + item
    return HDR.pack(MAGIC, VERSION, op, len(body), seq) + body


class Client:
    """One connection to the broker; methods raise BrokerError."""

    def __init__(self, path, timeout=30):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.seq = 0

    def close(self):
        self.sock.close()

    def _recv(self, n, fds):
        buf = b''
        while len(buf) < n:
            data, anc, _, _ = self.sock.recvmsg(n - len(buf),
                                                socket.CMSG_SPACE(16))
            for level, typ, cdata in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                    fds.extend(struct.unpack('<%di' % (len(cdata) // 4),
                                             cdata[:len(cdata) // 4 * 4]))
            if not data:
                raise ConnectionError('broker closed the connection')
            buf += data
        return buf

    def read_reply(self):
        """(op, seq, status, msg, data, fds) of the next reply."""
        fds = []
        magic, ver, op, length, seq = HDR.unpack(self._recv(HDR.size, fds))
        assert magic == MAGIC and ver == VERSION, (magic, ver)
        body = self._recv(length, fds)
        status, ml, dl, _ = REP.unpack_from(body)
        msg = body[REP.size:REP.size + ml].decode()
        data = body[REP.size + ml:REP.size + ml + dl]
        return op, seq, status, msg, data, fds

    def call(self, op, **kw):
        self.seq += 1
        try:
            self.sock.sendall(encode(OPS[op], seq=self.seq, **kw))
        except (BrokenPipeError, ConnectionResetError):
            pass    # refused at accept: the broker's reason is still to read
        rop, seq, status, msg, data, fds = self.read_reply()
        if rop == REPLY:
            for fd in fds:
                os.close(fd)
            raise BrokerError(-status, msg)
        assert rop == OPS[op] | REPLY and seq == self.seq, (rop, seq)
        if status:
            for fd in fds:
                os.close(fd)
            raise BrokerError(-status, msg)
        return data, fds

    def create(self, name, size, mode=0o600):
        return decode_region(self.call('create', name=name, size=size, mode=mode)[0])[0]

    def lookup(self, name):
        return decode_region(self.call('lookup', name=name)[0])[0]

    def destroy(self, name):
        self.call('destroy', name=name)

    def resize(self, name, size):
        return decode_region(self.call('resize', name=name, size=size)[0])[0]

    def chmod(self, name, mode):
        self.call('chmod', name=name, mode=mode)

    def alloc(self, region, item, size):
        return decode_item(self.call('alloc', name=region, item=item, size=size)[0])[0]

    def item_lookup(self, region, item):
        return decode_item(self.call('item_lookup', name=region, item=item)[0])[0]

    def free(self, region, item):
        self.call('free', name=region, item=item)

    def stat(self, name):
        data = self.call('stat', name=name)[0]
        info, off = decode_region(data)
        items = []
        while off < len(data):
            it, off = decode_item(data, off)
            items.append(it)
        return info, items

    def pool(self):
        f = POOL.unpack(self.call('stat')[0])
        return dict(capacity=f[0], used=f[1], quota=f[2], caller_used=f[3],
                    nregions=f[4], nconns=f[5], max_conns=f[6], align=f[7],
                    item_align=f[8])

    def list(self):
        data = self.call('list')[0]
        n, _ = struct.unpack_from('<II', data)
        off, out = 8, []
        for _ in range(n):
            r, off = decode_region(data, off)
            out.append(r)
        return out

    def map(self, name, rw=False):
        """(info, fd); the caller owns fd."""
        data, fds = self.call('map', name=name, flags=MAP_RW if rw else 0)
        assert len(fds) == 1, fds
        return decode_region(data)[0], fds[0]

    def export_keys(self, name, rw=False):
        """The "IDENTITY:KEY" lines of the remote clients the broker admits
        to an export of `name` (docs/broker.md, "Remote clients")."""
        data, _ = self.call('export_keys', name=name, flags=MAP_RW if rw else 0)
        (n,) = struct.unpack_from('<I', data)
        off, lines = 4, []
        for _ in range(n):
            (ln,) = struct.unpack_from('<H', data, off)
            lines.append(data[off + 2:off + 2 + ln].decode())
            off += 2 + ln
        assert off == len(data), (off, len(data))
        return lines

    def release(self, name):
        self.call('release', name=name)


def fd_count(pid):
    return len(os.listdir(f'/proc/{pid}/fd'))


def wait_for(pred, timeout=30, what='condition'):
    """Poll pred() until it is true, up to a monotonic deadline."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f'timed out waiting for {what}')
        time.sleep(0.02)


def podman_run_argv(sock, region, podman_argv, rw=False, hvmem_args=()):
    """`hvmem -s SOCK podman-run REGION [--rw] -- PODMAN ... run ...`: a
    podman container with the region inside (docs/broker.md); podman_argv
    is the podman command line, e.g. hvlib.podman.Podman.argv('run', ...)."""
    return [HVMEM, '-s', sock, 'podman-run', region] + (['--rw'] if rw else []) + \
        list(hvmem_args) + ['--'] + list(podman_argv)


def stop_podman_runs(procs, pm, names):
    """Tear down `hvmem podman-run` holders: kill those still running (the
    guard of each removes its container), remove the named containers should
    a guard not have, and reap the holders."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    if names:
        pm.rm(*names)
    for p in procs:
        p.communicate(timeout=60)


def wait_container_running(pm, name, proc, timeout=60):
    """Wait until podman (a hvlib.podman.Podman) says container `name`
    runs; fail at once if proc, the hvmem podman-run that starts it, exits."""
    def running():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f'hvmem podman-run exited {proc.returncode} before '
                                 f'container {name} ran: {out}{err}')
        r = pm.run('inspect', '--type', 'container', '--format', '{{.State.Running}}',
                   name, check=False)
        return r.stdout.strip() == 'true'
    wait_for(running, timeout=timeout, what=f'container {name} running')


class Broker:
    """A real hvmemd on a private pool (in /dev/shm) and socket."""

    def __init__(self, workdir, pool, args=(), env=None):
        self.workdir = workdir
        self.pool = pool
        self.sock = os.path.join(workdir, 'broker.sock')
        self.log = os.path.join(workdir, 'hvmemd.log')
        self.args = list(args)
        self.env = env
        self.proc = None

    def start(self, args=None, expect_fail=False, timeout=30):
        """Start hvmemd and wait until it answers; with expect_fail, wait
        for it to exit and return its status (None if it was still running
        after timeout seconds: then it is killed)."""
        argv = [HVMEMD, '--pool', self.pool, '--socket', self.sock] + \
            (self.args if args is None else list(args))
        logf = open(self.log, 'a')
        self.proc = subprocess.Popen(argv, stdout=logf, stderr=logf, env=self.env)
        logf.close()
        if expect_fail:
            try:
                rc = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                rc = None
            self.proc = None
            return rc
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f'hvmemd exited {self.proc.returncode}: '
                                     f'{self.read_log()}')
            try:
                Client(self.sock, timeout=2).close()
                return 0
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError('hvmemd did not come up: ' + self.read_log())
                time.sleep(0.02)

    def read_log(self):
        with open(self.log, errors='replace') as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM):
        if self.proc:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
            self.proc = None

    def client(self):
        return Client(self.sock)

    def region_file(self, rid):
        return os.path.join(self.pool, f'r-{rid}')


class Agent:
    """A child process acting on the broker on command (see agent_main)."""

    def __init__(self, workdir, sock, uid=None, groups=()):
        script = os.path.join(workdir, 'brokeragent.py')
        if not os.path.exists(script):
            shutil.copy(os.path.abspath(__file__), script)
            os.chmod(script, 0o644)
        kw, python = {}, sys.executable
        if uid is not None:
            # Our interpreter may live where another uid cannot run it.
            kw, python = dict(user=uid, group=uid, extra_groups=list(groups)), SYSTEM_PYTHON
        self.proc = subprocess.Popen([python, script, 'agent', sock],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=workdir, **kw)
        self.pid = self.proc.pid

    def do(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + '\n')
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f'agent died (rc {self.proc.poll()})')
        return json.loads(line)

    def ok(self, **cmd):
        r = self.do(**cmd)
        if r.get('errno'):
            raise AssertionError(f'{cmd}: {r}')
        return r

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def agent_main(sock):
    client = Client(sock)
    held = {}   # name -> (fd, mmap)
    extra = []  # connections opened by 'connect'
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop('op')
        try:
            if op == 'call':
                meth = cmd.pop('method')
                res = getattr(client, meth)(**cmd)
                out = {'result': res if isinstance(res, (dict, list)) else None}
            elif op == 'map':
                info, fd = client.map(cmd['name'], cmd.get('rw', False))
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if cmd.get('rw') else 0)
                m = mmap.mmap(fd, info['size'], flags=mmap.MAP_SHARED, prot=prot)
                if cmd['name'] in held:     # a second map replaces the first
                    held[cmd['name']][1].close()
                    os.close(held[cmd['name']][0])
                held[cmd['name']] = (fd, m)
                out = {'result': info,
                       'accmode': fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE}
            elif op == 'mmap_write':
                fd = held[cmd['name']][0]
                mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
                out = {'result': 'mapped writable'}
            elif op == 'reopen_rw':
                fd = held[cmd['name']][0]
                os.close(os.open(f'/proc/self/fd/{fd}', os.O_RDWR))
                out = {'result': 'reopened read-write'}
            elif op == 'write':
                m = held[cmd['name']][1]
                data = bytes.fromhex(cmd['hex'])
                m[cmd['offset']:cmd['offset'] + len(data)] = data
                out = {'result': None}
            elif op == 'read':
                m = held[cmd['name']][1]
                out = {'result': m[cmd['offset']:cmd['offset'] + cmd['len']].hex()}
            elif op == 'unmap':
                fd, m = held.pop(cmd['name'])
                m.close()
                os.close(fd)
                out = {'result': None}
            elif op == 'connect':
                # n more connections, each asked for the pool; refused ones closed
                accepted, refused = 0, []
                for _ in range(cmd['n']):
                    c = Client(sock)
                    try:
                        c.pool()
                        extra.append(c)
                        accepted += 1
                    except BrokerError as e:
                        refused.append(e.msg)
                        c.close()
                out = {'result': {'accepted': accepted, 'refused': refused}}
            elif op == 'disconnect':
                for c in extra:
                    c.close()
                extra.clear()
                out = {'result': None}
            elif op == 'create_many':
                # create prefix0, prefix1, ... until n are made or one fails
                made, out = 0, None
                while made < cmd['n'] and out is None:
                    try:
                        client.create(f"{cmd['prefix']}{made}", cmd.get('size', 4096))
                        made += 1
                    except BrokerError as e:
                        out = {'result': made, 'errno': e.errno, 'msg': e.msg}
                out = out or {'result': made}
            else:
                out = {'errno': errno.EINVAL, 'msg': f'unknown agent op {op}'}
        except BrokerError as e:
            out = {'errno': e.errno, 'msg': e.msg}
        except OSError as e:
            out = {'errno': e.errno, 'msg': str(e)}
        sys.stdout.write(json.dumps(out) + '\n')
        sys.stdout.flush()


def have_broker():
    return os.access(HVMEMD, os.X_OK) and os.access(HVMEM, os.X_OK)


@unittest.skipUnless(have_broker(), f'{HVMEMD} not built (set HYBRIDVM_BUILD or HVMEM_BIN)')
class BrokerTestCase(unittest.TestCase):
    """setUp starts a broker on a fresh pool; tearDown kills every agent and
    the broker and removes the pool.  BROKER_ARGS adds daemon options."""

    BROKER_ARGS = ()

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix='hvmem-test-')
        os.chmod(self.workdir, 0o755)     # agents under another uid connect
        self.pool = tempfile.mkdtemp(prefix='hvmem-pool-', dir='/dev/shm')
        self.agents = []
        self.broker = Broker(self.workdir, self.pool, self.BROKER_ARGS)
        self.broker.start()
        self.c = self.broker.client()

    def tearDown(self):
        for a in self.agents:
            a.kill()
            a.close()
        self.c.close()
        self.broker.stop(signal.SIGKILL)
        shutil.rmtree(self.pool, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def agent(self, uid=None, groups=()):
        if uid is not None and os.geteuid() != 0:
            self.skipTest('needs root to run an agent under another uid')
        if uid is not None and not os.access(SYSTEM_PYTHON, os.X_OK):
            self.skipTest(f'{SYSTEM_PYTHON} missing (agents under another uid)')
        a = Agent(self.workdir, self.broker.sock, uid, groups)
        self.agents.append(a)
        return a

    def assertBrokerError(self, err, fn, *args, **kw):
        with self.assertRaises(BrokerError) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.errno, err, cm.exception.msg)
        return cm.exception

    def assertHealthy(self):
        """The broker still answers a fresh connection."""
        c = self.broker.client()
        try:
            c.pool()
        finally:
            c.close()
        self.assertIsNone(self.broker.proc.poll())

    def hvmem(self, *args, check=True):
        p = subprocess.run([HVMEM, '-s', self.broker.sock] + [str(a) for a in args],
                           capture_output=True, text=True, timeout=30)
        if check and p.returncode:
            raise AssertionError(f'hvmem {args}: {p.returncode} {p.stderr}')
        return p


if __name__ == '__main__' and len(sys.argv) == 3 and sys.argv[1] == 'agent':
    agent_main(sys.argv[2])
