"""Helpers for the arbiter's tests: a loop device with direct I/O on a file
(the shared "SSD"), a VM path through QEMU's block layer (a
qemu-storage-daemon whose export sits behind a throttle group, loaded by
fio's nbd engine), containers (podman's, running fio; tests/hvlib/podman.py)
and the daemon itself."""

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ARBITER = os.path.dirname(HERE)
REPO = os.path.dirname(ARBITER)
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
sys.path.insert(0, REPO)
import hybridlib as H   # noqa: E402
sys.path.insert(0, os.path.join(REPO, 'tests'))
from hvlib import Guest   # noqa: E402
from hvlib.podman import Podman, PodmanMissing   # noqa: E402
from arbiter.sources import HIST_NS   # noqa: E402

HVARBITER = os.path.join(ARBITER, 'hvarbiter')


def unavailable():
    """Why the integration tests cannot run here, or None."""
    if os.geteuid() != 0:
        return 'needs root (loop devices, cgroups, namespaces)'
    for tool in ('losetup', 'fio', 'unshare'):
        if not shutil.which(tool):
            return f'{tool} is not installed'
    if not H.have_binaries():
        return 'QEMU is not built (make)'
    why = podman_unavailable()
    if why:
        return why
    if not os.path.exists('/sys/fs/cgroup/blkio/blkio.throttle.io_serviced') and \
            not os.path.exists('/sys/fs/cgroup/cgroup.controllers'):
        return 'no cgroup v1 blkio or v2 hierarchy'
    return None


class Loop:
    """A loop device with direct I/O over a file on the build directory's
    disk (not tmpfs: O_DIRECT, and the point is a real device queue)."""

    def __init__(self, directory, size_mib=256):
        self.file = os.path.join(directory, 'ssd.img')
        with open(self.file, 'wb') as f:
            f.truncate(size_mib << 20)
        # written, not sparse: reads of holes would not reach the disk
        subprocess.run(['dd', 'if=/dev/urandom', f'of={self.file}', 'bs=1M',
                        f'count={size_mib}', 'conv=notrunc', 'status=none'], check=True)
        self.dev = subprocess.run(['losetup', '--direct-io=on', '--find', '--show', self.file],
                                  capture_output=True, text=True, check=True).stdout.strip()

    def close(self):
        subprocess.run(['losetup', '-d', self.dev], check=False)


class LoopTestCase(unittest.TestCase):
    """Tests sharing one 16 MiB Loop (cls.loop) in a private directory
    (cls.tmp) for the whole class."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = H.TempDir()
        cls.loop = Loop(cls.tmp.path, size_mib=16)

    @classmethod
    def tearDownClass(cls):
        cls.loop.close()
        cls.tmp.cleanup()


class GuestVM:
    """A TCG guest whose virtio-blk disk (disk0) is the device behind
    throttle group tg0, with a QMP monitor of the arbiter's own; its load:
    1 MiB O_DIRECT reads of the whole disk in a loop (a backup, a scan)."""

    def __init__(self, tmp, dev, name='g0'):
        self.qmp_path = tmp(f'{name}-arb.qmp')
        self.g = Guest(name, tmp('logs'), mem='256M', redis=False, balloon=False, args=[
            '-object', 'throttle-group,id=tg0',
            '-blockdev', json.dumps({'driver': 'host_device', 'filename': dev, 'node-name': 'dev',
                                     'aio': 'native', 'cache': {'direct': True}}),
            '-blockdev', 'throttle,node-name=thr,throttle-group=tg0,file=dev',
            '-device', 'virtio-blk-pci,drive=thr,id=disk0',
            '-chardev', f'socket,id=arb,path={self.qmp_path},server=on,wait=off',
            '-mon', 'chardev=arb,mode=control'])
        self.g.boot()
        self.loading = False

    def start_load(self):
        if not self.loading:
            self.g.run('touch /tmp/go; (while [ -e /tmp/go ]; do '
                       'dd if=/dev/vda of=/dev/null bs=1M iflag=direct 2>/dev/null; done) & :')
            self.loading = True

    def stop_load(self):
        if self.loading:
            self.g.run('rm -f /tmp/go; wait')
            self.loading = False

    def set_limits(self, **limits):
        lim = {'iops-total': 0, 'bps-total': 0}
        lim.update({k.replace('_', '-'): v for k, v in limits.items()})
        self.g.qmp('qom-set', path='/objects/tg0', property='limits', value=lim)

    def sample(self):
        for e in self.g.qmp('query-blockstats'):
            if (e.get('qdev') or '').startswith('/machine/peripheral/disk0'):
                s = e['stats']
                h = s.get('rd_latency_histogram')
                bins = h['bins'] if h and len(h['bins']) == len(HIST_NS) + 1 else None
                return time.monotonic(), s['rd_operations'], s['rd_bytes'], bins
        raise AssertionError('disk0 not in query-blockstats')

    def histogram(self):
        self.g.qmp('block-latency-histogram-set', id='disk0/virtio-backend',
                   boundaries=HIST_NS)

    def close(self):
        self.g.shutdown()



class VMPath:
    """A "VM" whose disk is the loop device through QEMU's block layer: a
    qemu-storage-daemon with throttle group tg0 (default limits: none) in
    front of the device, exported over NBD, with a QMP monitor of the
    arbiter's own.  No guest device, so no latency histogram: IOPS only."""

    def __init__(self, tmp, dev, name='vm0'):
        self.name = name
        self.qmp_path = tmp(f'{name}-arb.qmp')
        self.nbd = tmp(f'{name}-nbd.sock')
        self.qsd = H.StorageDaemon(
            _Sub(tmp, name),
            '--object', 'throttle-group,id=tg0',
            '--blockdev', json.dumps({'driver': 'host_device', 'filename': dev,
                                      'node-name': 'dev', 'aio': 'native',
                                      # beside a guest that has it open
                                      'locking': 'off',
                                      'cache': {'direct': True}}),
            '--blockdev', 'throttle,node-name=thr,throttle-group=tg0,file=dev',
            '--nbd-server', f'addr.type=unix,addr.path={self.nbd}',
            '--export', 'nbd,id=disk,name=disk,node-name=thr,writable=on',
            '--chardev', f'socket,id=arb,path={self.qmp_path},server=on,wait=off',
            '--monitor', 'chardev=arb')

    def limits(self):
        return self.qsd.cmd('qom-get', path='/objects/tg0', property='limits')

    def load(self, seconds, qd=16, bs='4k', rw='randread'):
        return subprocess.Popen(
            ['fio', '--name=vm', f'--rw={rw}', f'--bs={bs}', f'--iodepth={qd}',
             '--ioengine=nbd', f'--uri=nbd+unix:///disk?socket={self.nbd}', '--time_based=1',
             f'--runtime={seconds}', '--output-format=json', '--size=256M'],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self):
        self.qsd.stop()

    def kill(self):
        self.qsd.kill()


class StandInVM:
    """What the arbiter manages of a VM, without the guest: a QEMU process
    (qemu-system-x86_64 -M none: no CPU, no devices) whose BlockBackend
    disk0 is the device behind throttle group tg0, with a QMP monitor of
    the arbiter's own.  The arbiter reaches it exactly as a guest's
    (attach, query-blockstats of disk0, qom-set of tg0's limits); nothing
    does I/O through it (an NBD export would have a BlockBackend of its
    own, which query-blockstats does not list), and with no guest device it
    has no latency histogram.  For counts of VMs that TCG guests cannot
    reach on a small host (bench/arbiter-scale.py)."""

    def __init__(self, tmp, dev, name):
        self.name = name
        self.qmp_path = tmp(f'{name}-arb.qmp')
        self.qemu = H.StorageDaemon(
            _Sub(tmp, name),
            '-object', 'throttle-group,id=tg0',
            '-drive', f'if=none,id=disk0,driver=throttle,throttle-group=tg0,'
                      f'file.driver=host_device,file.filename={dev},file.aio=native,'
                      f'file.cache.direct=on,file.locking=off',
            '-chardev', f'socket,id=arb,path={self.qmp_path},server=on,wait=off',
            '-mon', 'chardev=arb,mode=control', system=True)

    @property
    def pid(self):
        return self.qemu.proc.pid

    def limits(self):
        return self.qemu.cmd('qom-get', path='/objects/tg0', property='limits')

    def stop(self):
        self.qemu.stop()


class _Sub:
    """A TempDir view with a name prefix (two daemons in one directory)."""

    def __init__(self, tmp, prefix):
        self.tmp, self.prefix = tmp, prefix

    def __call__(self, name):
        return self.tmp(f'{self.prefix}-{name}')


_podman = None


def podman():
    """The tests' podman (rootful, runc, its own storage under the build
    directory), made once."""
    global _podman
    if _podman is None:
        _podman = Podman()
    return _podman


def podman_unavailable():
    """Why podman containers cannot run here, or None."""
    if os.geteuid() != 0:
        return 'needs root (rootful podman)'
    try:
        podman()
    except PodmanMissing as e:
        return str(e)
    return None


def podman_command():
    """[arbiter] podman-command for the tests' podman: its global options
    (its storage) and nothing else."""
    return shlex.join(podman().argv())


def parse_fio(out):
    j = json.loads(out[out.index('{'):])['jobs'][0]
    side = j['read'] if j['read']['io_bytes'] else j['write']
    pc = side['clat_ns']['percentile']
    return dict(iops=side['iops'], p50_ms=pc['50.000000'] / 1e6, p99_ms=pc['99.000000'] / 1e6)


class FioContainer:
    """fio in a podman container of the test image, on the device dev
    (given to it with --device), started detached: `podman run -d`
    returns once fio runs, so a phase's clock starts with it, and
    result() waits for its end (its init pid, not podman's 250 ms poll).
    Its figures leave out the first 'ramp' seconds (fio's ramp_time);
    fio writes them to a directory of tmp bind-mounted at /out.  The
    container is removed by result() or stop() (tests call stop() in their
    clean-up: a failed test leaves none behind).  run_args go to podman
    run (--cgroup-parent ...)."""

    def __init__(self, tmp, name, dev, seconds, qd=4, bs='4k', rw='randread', ramp=0,
                 run_args=()):
        self.pm, self.name, self.seconds = podman(), name, seconds
        self.out = tmp(f'{name}-out')
        os.makedirs(self.out, exist_ok=True)
        self.pm.rm(name)                # a killed run's leftover
        self.pm.run('run', '-d', '--name', name, '--network', 'none', '--device', dev,
                    '-v', f'{self.out}:/out', *run_args, self.pm.image(),
                    'fio', '--name=ctr', f'--filename={dev}', '--direct=1', '--ioengine=libaio',
                    f'--rw={rw}', f'--bs={bs}', f'--iodepth={qd}', '--time_based=1',
                    f'--runtime={seconds}', f'--ramp_time={ramp}', '--output-format=json',
                    '--output=/out/fio.json')
        info = self.pm.inspect(name)
        self.id, self.pid = info['Id'], info['State']['Pid']
        self.done = False

    def result(self, timeout=120):
        """fio's figures (iops, p50_ms, p99_ms) once it has ended."""
        deadline = time.monotonic() + timeout
        why = 'no output'
        while os.path.exists(f'/proc/{self.pid}'):
            if time.monotonic() > deadline:
                raise AssertionError(f'container {self.name}: fio still runs after {timeout} s')
            time.sleep(0.02)
        code = self.pm.run('wait', self.name, timeout=60).stdout.strip()
        try:
            with open(os.path.join(self.out, 'fio.json')) as f:
                out = f.read()
        except OSError as e:
            out = ''
            why = str(e)
        self.stop()
        if code != '0' or not out:
            raise AssertionError(f'fio in container {self.name} failed ({code}): '
                                 f'{out[-500:] or why}')
        return parse_fio(out)

    def stop(self):
        if not self.done:
            self.pm.rm(self.name)
            self.done = True


def container(tmp, name, dev, seconds, **kw):
    """fio as a podman container (FioContainer)."""
    return FioContainer(tmp, name, dev, seconds, **kw)


def fio_result(proc, timeout=120):
    """The figures of a fio process (the VM path's fio, over NBD)."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode:
        raise AssertionError(f'fio failed ({proc.returncode}): {err[-500:]}')
    return parse_fio(out)


def remove_cgroup_tree(rel):
    """Remove the group rel ('/parent') and its children (a container's,
    conmon's) from every hierarchy under /sys/fs/cgroup: what podman's
    cgroupfs manager made for --cgroup-parent and leaves behind."""
    for h in os.listdir('/sys/fs/cgroup'):
        top = os.path.join('/sys/fs/cgroup', h, rel.lstrip('/'))
        if not os.path.isdir(top):
            continue
        for d, _, _ in sorted(os.walk(top), key=lambda x: -len(x[0])):
            deadline = time.monotonic() + 5
            while True:
                try:
                    os.rmdir(d)
                    break
                except OSError:         # conmon may still be on its way out
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)


def cgroup_paths(name):
    """Cgroups a test makes itself (a [container] given by cgroup =)."""
    return (f'/sys/fs/cgroup/blkio/hvarbiter-test/{name}',
            f'/sys/fs/cgroup/unified/hvarbiter-test/{name}')


def config(tmp, dev, vms, containers, target_ms=5.0, period_ms=100, extra_device='',
           extra_vm='', state='state', extra_arbiter='', cgroups=()):
    """Write an arbiter configuration; vms: [(name, qmp_path)]; containers:
    podman names (the tests' podman, podman-command set for it); cgroups:
    names of containers given by their cgroups (cgroup_paths)."""
    if containers:
        extra_arbiter = f'podman-command = {podman_command()}\n' + extra_arbiter
    text = (f'[arbiter]\nperiod-ms = {period_ms}\nstate-dir = {tmp(state)}\n'
            f'qmp-timeout-ms = 500\n{extra_arbiter}\n'
            f'[device]\npath = {dev}\ntarget-latency-ms = {target_ms}\nprobe-iops = 200\n'
            f'{extra_device}\n')
    for name in containers:
        text += f'[container {name}]\npodman = {name}\n\n'
    for name in cgroups:
        v1, v2 = cgroup_paths(name)
        text += f'[container {name}]\ncgroup = {v1}\n'
        if os.path.exists('/sys/fs/cgroup/unified/cgroup.controllers'):
            text += f'pressure = {v2}\n'
        text += '\n'
    for name, qmp in vms:
        text += (f'[vm {name}]\nqmp = {qmp}\nthrottle-group = tg0\nfloor-iops = 10\n'
                 f'{extra_vm}\n')
    path = tmp(f'{state}.conf')
    with open(path, 'w') as f:
        f.write(text)
    os.chmod(path, 0o644)       # whatever the umask: the daemon refuses 0o022
    return path


def wait_for(get, pred, timeout, what, check=lambda: None):
    """Poll get() every 0.1 s until pred(value) holds and return that
    value; check() may raise (a process that died).  Fails naming what and
    the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if pred(value):
            return value
        check()
        if time.monotonic() > deadline:
            raise AssertionError(f'{what} not reached in {timeout} s: {str(value)[:1500]}')
        time.sleep(0.1)


class Daemon:
    """hvarbiter run CONF_PATH (from cwd, if given), its state directory
    tmp(state)."""

    def __init__(self, conf_path, tmp, state='state', python=sys.executable, cwd=None):
        self.conf = conf_path
        # the watchdog is given the configuration's real path
        self.conf_real = os.path.realpath(os.path.join(cwd or os.getcwd(), conf_path))
        self.out = open(tmp(f'{state}.out'), 'a+')
        self.proc = subprocess.Popen([python, HVARBITER, 'run', conf_path],
                                     stdout=self.out, stderr=subprocess.STDOUT, cwd=cwd)
        self.log_path = tmp(f'{state}/decisions.jsonl')
        self.sock = tmp(f'{state}/arbiter.sock')
        deadline = time.monotonic() + 20
        while True:                 # a killed daemon's socket file may remain
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(self.sock)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError('hvarbiter did not start: ' + self.output()) \
                        from None
                time.sleep(0.05)
            finally:
                s.close()

    def output(self):
        self.out.seek(0)
        return self.out.read()

    def ask(self, what, raw=None):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(self.sock)
        s.sendall(raw if raw is not None else what.encode() + b'\n')
        out = b''
        while True:
            d = s.recv(65536)
            if not d:
                break
            out += d
        s.close()
        return out.decode()

    def status(self):
        return json.loads(self.ask('status'))

    def records(self):
        with open(self.log_path) as f:
            return [json.loads(line) for line in f]

    def wait(self, pred, timeout=20, what='condition'):
        return wait_for(self.status, pred, timeout, what, check=self.check_alive)

    def check_alive(self):
        if self.proc.poll() is not None:
            raise AssertionError('hvarbiter exited: ' + self.output())

    def watchdog_pid(self):
        r = subprocess.run(['pgrep', '-f', f'arbiter.watchdog {self.conf_real} '],
                           capture_output=True, text=True)
        return [int(x) for x in r.stdout.split()]

    def terminate(self, sig=signal.SIGTERM, timeout=20):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout)
        return self.proc.returncode

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.watchdog_pid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.out.close()
