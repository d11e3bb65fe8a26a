"""Helpers for the hybrid block format tests: binaries, qemu-img, an
interactive qemu-io driver and a qemu-storage-daemon with a QMP client
(QEMU's qemu.qmp, from the QEMU source tree the build unpacked)."""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get('HYBRIDVM_BUILD', os.path.join(REPO, 'build'))
BIN = os.path.abspath(os.path.join(BUILD, 'bin'))   # also from a host's cwd
LONG = os.environ.get('HYBRIDVM_LONG') == '1'
QEMU_PYTHON = os.path.join(BUILD, 'qemu-src', 'python')
if os.path.isdir(QEMU_PYTHON) and QEMU_PYTHON not in sys.path:
    sys.path.insert(0, QEMU_PYTHON)
TESTS = os.path.join(REPO, 'tests')     # hvlib: real QEMU guests
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
import hvlib    # noqa: E402


def binary(name):
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f'{path} not built (set HYBRIDVM_BUILD)')
    return path


def have_binaries():
    return all(os.access(os.path.join(BIN, n), os.X_OK)
               for n in ('qemu-img', 'qemu-io', 'qemu-storage-daemon'))


def run(*args, check=True, timeout=120):
    """Run a tool; return CompletedProcess with text output."""
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode < 0:
        raise AssertionError(f'{args[0]} died from signal {-p.returncode}: '
                             f'{p.stderr}')
    if check and p.returncode != 0:
        raise AssertionError(f'{args} failed ({p.returncode}): '
                             f'{p.stdout}{p.stderr}')
    return p


def qemu_img(*args, **kw):
    return run(binary('qemu-img'), *args, **kw)


def qemu_io(*args, **kw):
    return run(binary('qemu-io'), *args, **kw)


def image_bytes(img, scratch, fmt='hybrid'):
    """What the guest would read of image @img: all of it, converted to raw
    through the file @scratch (removed again)."""
    qemu_img('convert', '-f', fmt, '-O', 'raw', img, scratch)
    try:
        with open(scratch, 'rb') as f:
            return f.read()
    finally:
        os.unlink(scratch)


def img_info(path, fmt='hybrid'):
    return json.loads(qemu_img('info', '--output=json', '-f', fmt, path).stdout)


TLS_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tls-session-shim.c')


def build_tls_shim(out):
    """Build tls-session-shim.c into the shared object @out: loaded with
    LD_PRELOAD into a QEMU program, it appends the description of each TLS
    session the program completes to $HYBRIDVM_TLS_LOG.  Raises
    unittest.SkipTest without GnuTLS's headers, AssertionError with the
    compiler's output when the build fails."""
    flags = subprocess.run(['pkg-config', '--cflags', '--libs', 'gnutls'],
                           capture_output=True, text=True)
    if flags.returncode or not shutil.which('gcc'):
        raise unittest.SkipTest('building the TLS shim needs gcc and GnuTLS\'s '
                                'headers (libgnutls28-dev, as QEMU\'s build does)')
    r = subprocess.run(['gcc', '-shared', '-fPIC', '-Wall', '-Werror', '-o', out, TLS_SHIM]
                       + flags.stdout.split() + ['-ldl'], capture_output=True, text=True)
    if r.returncode:
        raise AssertionError(f'building the TLS shim failed:\n{r.stderr}')
    return out


class TempDir:
    def __init__(self):
        self.path = tempfile.mkdtemp(prefix='hybrid-test-')

    def __call__(self, name):
        return os.path.join(self.path, name)

    def cleanup(self):
        shutil.rmtree(self.path, ignore_errors=True)


class ToolTest(unittest.TestCase):
    """A temporary directory, `tmp`, and `procs`: the qemu-io and
    qemu-storage-daemon processes a test started, killed in tearDown
    (a test removes one it stopped itself)."""

    def setUp(self):
        self.tmp = TempDir()
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            p.kill()
        self.tmp.cleanup()


class GuestCase:
    """Real guests (hvlib) for a unittest.TestCase, a mixin: `paths`,
    `qemu_img`, a temporary directory `dir` (named after `dir_prefix`) and
    add_guest(), whose guests tearDown shuts down before it removes the
    directory.  A test is skipped where qemu-img, QEMU or the test guest's
    initrd is not built."""

    dir_prefix = 'hybrid-guest-'

    def setUp(self):
        self.paths = hvlib.BuildPaths()
        try:
            self.qemu_img = self.paths.binary('qemu-img')
            self.paths.binary('qemu-system-x86_64')
            self.paths.guest_file('initrd.img')
        except hvlib.MissingBuild as exc:
            self.skipTest(str(exc))
        self.dir = tempfile.mkdtemp(prefix=self.dir_prefix)
        self.guests = []

    def add_guest(self, name, **kwargs):
        """An hvlib.Guest in `dir`, not launched yet."""
        g = hvlib.Guest(name, self.dir, paths=self.paths, **kwargs)
        self.guests.append(g)
        return g

    def tearDown(self):
        for g in reversed(self.guests):
            g.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


class QemuIo:
    """qemu-io in interactive mode: one command at a time, waiting for the
    prompt that says the previous one has completed."""

    PROMPT = b'qemu-io> '

    def __init__(self, image_opts, extra=(), pass_fds=(), popen=subprocess.Popen):
        """popen: what starts it (e.g. hvlib.hosts.Host.popen: on a host)."""
        self.proc = popen([binary('qemu-io'), '-t', 'writeback'] +
                                     list(extra) + ['--image-opts',
                                                    image_opts],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT,
                                     pass_fds=pass_fds)
        self.buf = b''
        self.output = ''        # everything it printed, prompts aside
        # what it printed before the first prompt (open warnings, traces)
        self.banner = self._wait_prompt(30)

    def _wait_prompt(self, timeout):
        deadline = time.monotonic() + timeout
        while self.PROMPT not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f'qemu-io: no prompt; output {self.buf!r}')
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise EOFError(f'qemu-io exited: {self.buf!r}')
                self.buf += chunk
        out, self.buf = self.buf.split(self.PROMPT, 1)
        out = out.decode(errors='replace')
        self.output += out
        return out

    def cmd(self, line, timeout=60):
        self.proc.stdin.write(line.encode() + b'\n')
        self.proc.stdin.flush()
        return self._wait_prompt(timeout)

    def send(self, line):
        """Send without waiting (the command may or may not complete)."""
        self.proc.stdin.write(line.encode() + b'\n')
        self.proc.stdin.flush()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def quit(self):
        try:
            self.proc.stdin.write(b'quit\n')
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        rc = self.proc.wait(60)
        self.proc.stdout.close()
        return rc


class StorageDaemon:
    """qemu-storage-daemon with a QMP monitor (qemu.qmp); events are
    collected."""

    def __init__(self, tmp, *args, system=False, pass_fds=(), env=None):
        """system=True: qemu-system-x86_64 -M none instead (has HMP);
        env: the daemon's environment (default: ours)."""
        from qemu.qmp import ConnectError
        from qemu.qmp.legacy import QEMUMonitorProtocol
        self.sock_path = tmp('qmp.sock')
        self.log = open(tmp('qsd.log'), 'w+')
        prog = [binary('qemu-storage-daemon')]
        if system:
            prog = [binary('qemu-system-x86_64'), '-M', 'none', '-nodefaults',
                    '-display', 'none']
        self.proc = subprocess.Popen(
            prog +
            ['--chardev', f'socket,id=qmp,path={self.sock_path},server=on,wait=off',
             '--mon', 'chardev=qmp,mode=control'] + list(args),
            stdout=self.log, stderr=subprocess.STDOUT, pass_fds=pass_fds,
            env=env)
        self.mon = QEMUMonitorProtocol(self.sock_path)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.mon.connect()      # greeting and qmp_capabilities
                break
            except ConnectError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise RuntimeError('qemu-storage-daemon did not start: ' +
                                       self.log.read()) from None
                time.sleep(0.05)
        self.mon.settimeout(60)
        self.events = []

    def qmp(self, cmd, **args):
        """Run a command; return the whole response (error or return)."""
        r = self.mon.cmd_raw(cmd, args)
        self.events += self.mon.get_events()
        return r

    def cmd(self, cmd, **args):
        r = self.qmp(cmd, **args)
        if 'error' in r:
            raise AssertionError(f'{cmd} failed: {r["error"]}')
        return r['return']

    def wait_restored(self, node=None, timeout=60):
        """query-hybrid (of @node, else of every hybrid node) once every
        restore is done, or as it stands after @timeout s: the caller
        asserts.  Polled: HYBRID_RESTORE_COMPLETED may come before QMP is
        up."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.cmd('query-hybrid',
                            **({'node-name': node} if node else {}))
            if all(i['restore-done'] for i in info) or \
                    time.monotonic() > deadline:
                return info
            time.sleep(0.05)

    def wait_event(self, name, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e['event'] == name:
                    return self.events.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f'no {name} event')
            try:
                self.events.append(self.mon.pull_event(wait=left))
            except TimeoutError:        # asyncio's, the same class since 3.11
                pass

    def _close_monitor(self):
        """Close QMP: the daemon having gone (quit, killed) is no error."""
        from qemu.qmp import QMPError
        try:
            self.mon.close()
        except (QMPError, EOFError, OSError):
            pass

    def stop(self):
        if self.proc.poll() is None:
            from qemu.qmp import QMPError
            try:
                self.qmp('quit')
            except (QMPError, EOFError, OSError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_monitor()
        self.log.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._close_monitor()
        self.log.close()


def clone_cache_daemon(tmp, size):
    """The host's clone-cache daemon as the libvirt hook finds it: a
    clone-cache object cc0, an NBD server on tmp('cc.sock') with no export
    yet, and a QMP monitor of the hook's own on tmp('hook.qmp') (a QMP
    socket serves one client at a time)."""
    return StorageDaemon(
        tmp, '--object', f'clone-cache,id=cc0,filename={tmp("cc")},size={size}',
        '--nbd-server', f'addr.type=unix,addr.path={tmp("cc.sock")}',
        '--chardev', f'socket,id=hook,path={tmp("hook.qmp")},server=on,wait=off',
        '--monitor', 'chardev=hook')


# qemu-io's own report of a failed request (not a warning that says "failed")
FAILED_RE = re.compile(r'^(aio_write|write|flush) failed', re.M)
# an aio_write's completion, as qemu-io reports it (no -q, no -C)
WROTE_RE = re.compile(r'^wrote (\d+)/\d+ bytes at offset (\d+)$', re.M)


def loaded_kills(aio, depth=32):
    """Whether the kill rounds without flushes (run_aio counts, aio[0::2])
    stressed what they should: each killed with writes in flight after
    having at least half of `depth` in flight, and one the whole `depth`.
    How many pile up depends on how fast the node completes them (a busy
    host, the mirror's one-round-trip first writes), not on the node's
    correctness, which the check after each kill proves."""
    rounds = aio[0::2]
    return (all(a['left'] and a['max_in_flight'] >= depth // 2 for a in rounds) and
            any(a['max_in_flight'] == depth for a in rounds))


class WriteModel:
    """Random 4 KiB pattern writes through a QemuIo, and what a read of each
    slot may return after the writer is killed.

    durable='flush': only what a completed flush covered must survive (async
    mode); durable='ack': every acknowledged write must (the RAM tier in a
    region).  A write sent but not waited for may or may not have happened."""

    SLOT = 4096

    def __init__(self, nslots, rnd, durable):
        assert durable in ('flush', 'ack')
        self.nslots, self.rnd, self.durable = nslots, rnd, durable
        self.accepted = {}      # slot -> values a read may return
        self.pending = {}       # durable='flush': written since the last flush
        self.lost = 0           # unflushed writes the kills took (allowed)
        self.aio_io, self.in_flight = None, {}  # run_aio: slot -> value sent

    def run(self, io, ops, flush_p=0.0, hot=16):
        """`ops` commands: writes (half to a small hot set) and, with
        probability flush_p, flushes.  Raises AssertionError on a failure."""
        hot_set = [self.rnd.randrange(self.nslots) for _ in range(hot)]
        self.pending = {}
        for _ in range(ops):
            if self.rnd.random() < flush_p:
                out = io.cmd('flush')
                if FAILED_RE.search(out):
                    raise AssertionError(f'flush failed: {out}')
                self.accepted.update({s: {v} for s, v in self.pending.items()})
                self.pending.clear()
                continue
            slot = self.rnd.choice(hot_set) if self.rnd.random() < 0.5 else \
                self.rnd.randrange(self.nslots)
            val = self.rnd.randint(1, 255)
            out = io.cmd(f'write -P {val} {slot * self.SLOT} {self.SLOT}')
            if FAILED_RE.search(out):
                raise AssertionError(f'write failed: {out}')
            if self.durable == 'ack':
                self.accepted[slot] = {val}
            else:
                self.accepted.setdefault(slot, {0}).add(val)
                self.pending[slot] = val

    def run_aio(self, io, ops, depth=32, flush_p=0.0, hot=16, drain=False, timeout=60):
        """`ops` commands as run() does, but the writes asynchronous
        (qemu-io's aio_write): up to `depth` in flight, never two to one
        slot (so each slot's order is known).  A write is acknowledged once
        its completion line ("wrote 4096/4096 bytes at offset N") is read;
        until then its value is one the slot may hold.  The flushes are
        qemu-io's `flush` (blk_flush, the writes in flight staying so;
        aio_flush is a drain, no flush).  Returns with the last writes in
        flight, for the caller to kill the writer under them (or to call
        run_aio on it again); drain=True waits for them (aio_flush).
        durable='ack' only.  Raises AssertionError on a failure.

        qemu-io (stdin and stdout pipes) reads a command only when the last
        one's prompt is out, and prints completions into its stdout buffer,
        flushed with the next prompt: so one command at a time, and a
        `sleep` command to collect completions while `depth` are in
        flight.  Returns counts: writes, flushes, max_in_flight (as this
        side saw them), mean_in_flight (at each write sent), left (in
        flight at the return)."""
        assert self.durable == 'ack', 'run_aio models acknowledged writes only'
        if io is not self.aio_io:       # a new writer: the old one's are gone
            self.aio_io, self.in_flight = io, {}
        in_flight = self.in_flight
        hot_set = [self.rnd.randrange(self.nslots) for _ in range(hot)]
        stats = dict(writes=0, flushes=0, max_in_flight=0, mean_in_flight=0.0)
        total = 0
        for _ in range(ops):
            if self.rnd.random() < flush_p:
                self._aio_acks(io.cmd('flush', timeout), 'flush')
                stats['flushes'] += 1
                continue
            wait, deadline = 1, time.monotonic() + timeout
            while len(in_flight) >= depth:
                if time.monotonic() > deadline:
                    raise TimeoutError(f'{len(in_flight)} writes in flight, none '
                                       f'completed in {timeout} s')
                self._aio_acks(io.cmd(f'sleep {wait}', timeout), 'sleep')
                wait = min(2 * wait, 32)
            slot = None
            if self.rnd.random() < 0.5:
                free = [s for s in hot_set if s not in in_flight]
                slot = self.rnd.choice(free) if free else None
            while slot is None or slot in in_flight:
                slot = self.rnd.randrange(self.nslots)
            val = self.rnd.randint(1, 255)
            self.accepted.setdefault(slot, {0}).add(val)
            in_flight[slot] = val
            stats['writes'] += 1
            total += len(in_flight)
            stats['max_in_flight'] = max(stats['max_in_flight'], len(in_flight))
            self._aio_acks(io.cmd(f'aio_write -P {val} {slot * self.SLOT} {self.SLOT}',
                                  timeout), 'aio_write')
        if drain:
            self._aio_acks(io.cmd('aio_flush', timeout), 'aio_flush')
            assert not in_flight, f'no completion read for slots {sorted(in_flight)}'
        stats['mean_in_flight'] = round(total / max(stats['writes'], 1), 1)
        stats['left'] = len(in_flight)
        return stats

    def _aio_acks(self, out, what):
        """The completions in qemu-io's output `out`: each makes its write
        the one value its slot may hold."""
        if FAILED_RE.search(out):
            raise AssertionError(f'{what}: write failed: {out}')
        for m in WROTE_RE.finditer(out):
            off = int(m.group(2))
            slot = off // self.SLOT
            if int(m.group(1)) != self.SLOT or off % self.SLOT or \
                    slot not in self.in_flight:
                raise AssertionError(f'{what}: a completion of no write in flight: '
                                     f'{m.group(0)!r}')
            self.accepted[slot] = {self.in_flight.pop(slot)}

    def round(self, io, flush_p, depth=None, ops=(40, 150)):
        """One round of a kill test, the kill to come right after: with
        `depth`, 150-400 writes kept that many in flight (run_aio; its
        counts are returned), else `ops` (a range) writes one at a time and
        up to 6 sent without waiting (None)."""
        if depth:
            return self.run_aio(io, self.rnd.randint(150, 400), depth, flush_p)
        self.run(io, self.rnd.randint(*ops), flush_p=flush_p)
        self.send_unacked(io, self.rnd.randint(0, 6))
        return None

    def send_unacked(self, io, n):
        """n writes sent without waiting: the kill may come before them."""
        for _ in range(n):
            slot = self.rnd.randrange(self.nslots)
            val = self.rnd.randint(1, 255)
            self.accepted.setdefault(slot, {0}).add(val)
            io.send(f'write -P {val} {slot * self.SLOT} {self.SLOT}')

    def check(self, data, what=''):
        """Every slot holds one whole value it may hold; then what survived
        becomes the only truth for the next round."""
        for slot, ok in self.accepted.items():
            blk = data[slot * self.SLOT:(slot + 1) * self.SLOT]
            if blk != bytes([blk[0]]) * self.SLOT:
                raise AssertionError(f'{what}slot {slot}: torn block')
            if blk[0] not in ok:
                raise AssertionError(
                    f'{what}slot {slot}: {blk[0]} not in {sorted(ok)}: '
                    f'{"an acknowledged" if self.durable == "ack" else "a flushed"}'
                    ' write was lost')
        for slot in self.accepted:
            v = data[slot * self.SLOT]
            if slot in self.pending and v != self.pending[slot]:
                self.lost += 1
            self.accepted[slot] = {v}
