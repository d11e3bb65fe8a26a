"""One QEMU guest: our test kernel + initramfs under TCG, QMP, a logged serial console."""
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time

from .paths import BuildPaths, MissingBuild

LOG = logging.getLogger('hvlib')


class GuestError(Exception):
    pass


def parse_mem(text):
    """QEMU's -m syntax ('512M', '1G', plain MiB) -> bytes."""
    m = re.fullmatch(r'(\d+)([KMGT]?)', str(text).strip().upper())
    if not m:
        raise ValueError(f'cannot read memory size {text!r}')
    return int(m.group(1)) << {'K': 10, '': 20, 'M': 20, 'G': 30, 'T': 40}[m.group(2)]


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def redis_client(port, timeout=30, name='guest', socket_timeout=30, **kwargs):
    """A redis-py client for 127.0.0.1:port, once the server there answers PING
    (retried until `timeout`: a guest's Redis may still be starting); each
    command then waits at most `socket_timeout` seconds for its reply."""
    import redis
    deadline = time.monotonic() + timeout
    while True:
        client = redis.Redis(host='127.0.0.1', port=port, socket_timeout=socket_timeout,
                             socket_connect_timeout=5, **kwargs)
        try:
            client.ping()
            return client
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            client.close()
            if time.monotonic() > deadline:
                raise GuestError(f'{name}: Redis on port {port} does not answer: {exc}')
            time.sleep(0.2)


class Console:
    """A guest's serial console: a unix socket to type into and the log file
    its output is written to (QEMU's socket chardev with logfile=, or libvirt's
    <serial type='unix'> with <log file=...>).

    wait() tails the log; send() connects on first use and then keeps reading
    the socket in a thread, because QEMU logs console bytes only once the
    connected socket has taken them.  `alive` is a callable that says whether
    the guest still runs (so waits fail fast when it died)."""

    def __init__(self, name, sock_path, log_path, alive=lambda: True, exit_info=lambda: ''):
        self.name = name
        self.sock_path = sock_path
        self.log_path = log_path
        self.alive = alive
        self.exit_info = exit_info
        self.pos = 0
        self._sock = None

    def text(self):
        try:
            with open(self.log_path, 'rb') as f:
                return f.read().decode('utf-8', 'replace')
        except FileNotFoundError:
            return ''

    def wait(self, pattern, timeout=60, fail_pattern=r'HV-ERROR|Kernel panic'):
        """Wait until `pattern` (a regex) appears in console output after the
        previous match; return the match.  Raises GuestError on `fail_pattern`,
        on timeout or when the guest stops."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        frx = re.compile(fail_pattern) if fail_pattern else None
        while True:
            text = self.text()
            m = rx.search(text, self.pos)
            if m:
                self.pos = m.end()
                return m
            if frx:
                f = frx.search(text, self.pos)
                if f:
                    raise GuestError(f'{self.name}: console shows "{f.group(0)}": '
                                     f'{text[f.start():f.start() + 200]!r}')
            if not self.alive():
                raise GuestError(f'{self.name}: the guest stopped while waiting for '
                                 f'{pattern!r}; {self.exit_info()}')
            if time.monotonic() > deadline:
                raise GuestError(f'{self.name}: timed out after {timeout}s waiting for '
                                 f'{pattern!r}; console tail: {text[-500:]!r}')
            time.sleep(0.1)

    def send(self, line):
        """Type a line into the guest's shell."""
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.connect(self.sock_path)
            threading.Thread(target=self._drain, args=(self._sock,), daemon=True).start()
        self._sock.sendall(line.encode() + b'\n')

    @staticmethod
    def _drain(sock):
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass

    def run(self, command, timeout=60):
        """Run a shell command in the guest and return its output.  A non-zero
        exit status raises GuestError."""
        tag = f'HVCMD{time.monotonic_ns()}'
        start = self.pos
        self.send(f'{command}; echo "{tag}-rc=$?"')
        m = self.wait(rf'{tag}-rc=(\d+)\r?\n', timeout=timeout, fail_pattern=None)
        text = m.string[start:m.start()]
        # Drop the echoed command line: output starts after its last echo (the
        # tty echoes type-ahead once before the shell runs, the shell once more).
        echo_end = text.rfind(tag)
        if echo_end >= 0:
            nl = text.find('\n', echo_end)
            text = text[nl + 1:] if nl >= 0 else ''
        if int(m.group(1)) != 0:  # compare numbers: the console has shown 'rc=00'
            raise GuestError(f'{self.name}: "{command}" exited with {m.group(1)}: {text[-300:]!r}')
        return text.replace('\r', '')

    def close(self):
        if self._sock:
            self._sock.close()
            self._sock = None


class Guest:
    """A guest booted from build/guest/{vmlinuz,initrd.img}.

    The serial console is a socket chardev whose output is also logged to
    <log_dir>/<name>-console.log, so it is captured whether or not anybody
    reads it; wait_console() tails that file.  Redis in the guest is reached
    through a slirp host forward on 127.0.0.1:<redis_port>.

    QEMU runs under `setpriv --pdeathsig KILL`, so it dies with its parent
    even when the harness itself is killed; shutdown() always reaps it.
    """

    def __init__(self, name, log_dir, mem='512M', smp=1, redis=True, module=False,
                 append='', args=(), incoming=None, paths=None, redis_port=None,
                 balloon=True, root_disk=None, root_format='raw', root_snapshot=False):
        self.paths = paths or BuildPaths()
        # Everything that can be missing is looked up before anything is created.
        binary = self.paths.binary('qemu-system-x86_64')
        kernel = self.paths.guest_file('vmlinuz')
        initrd = self.paths.guest_file('initrd.img')
        try:
            from qemu.machine import QEMUMachine  # from paths.qemu_python
        except ImportError as exc:
            raise MissingBuild(f'QEMU\'s python package is missing ({exc}): run "make" first') from exc

        self.name = name
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.console_log = os.path.join(log_dir, f'{name}-console.log')
        # Unix socket paths must stay under 108 bytes: a short private dir.
        self.sock_dir = tempfile.mkdtemp(prefix=f'hv-{name}-')
        self.serial_sock = os.path.join(self.sock_dir, 'serial.sock')
        self.redis_port = redis_port or free_port()
        self.incoming = incoming

        cmdline = ['console=ttyS0', 'panic=-1', 'quiet', 'loglevel=3']
        if redis:
            cmdline.append('hv.redis=1')
        if module:
            cmdline.append('hv.module=1')
        if root_disk:
            # The disk is the first virtio-blk device, so /dev/vda in the guest.
            cmdline.append('hv.root=/dev/vda')
        if append:
            cmdline.append(append)

        # debug-threads: threads named after their job ('CPU 0/TCG',
        # 'mig/src/main'), so per-thread CPU can be read from /proc
        qargs = ['-accel', 'tcg', '-m', mem, '-smp', str(smp), '-no-reboot',
                 '-name', 'guest=hvlib,debug-threads=on',
                 '-L', '/usr/share/seabios', '-L', '/usr/share/qemu',
                 '-kernel', kernel,
                 '-initrd', initrd,
                 '-append', ' '.join(cmdline),
                 '-chardev', f'socket,id=ser0,path={self.serial_sock},server=on,wait=off,'
                             f'logfile={self.console_log}',
                 '-serial', 'chardev:ser0',
                 '-netdev', f'user,id=net0,hostfwd=tcp:127.0.0.1:{self.redis_port}-:6379',
                 '-device', 'virtio-net-pci,netdev=net0,romfile=']
        if root_disk:
            snap = ',snapshot=on' if root_snapshot else ''
            qargs += ['-drive', f'if=none,id=root,file={root_disk},format={root_format}{snap}',
                      '-device', 'virtio-blk-pci,drive=root']
        if balloon:
            qargs += ['-device', 'virtio-balloon-pci,id=balloon0']
        qargs += list(args)
        if incoming:
            qargs += ['-incoming', incoming]

        self.vm = QEMUMachine(binary,
                              args=qargs, name=name, log_dir=log_dir,
                              base_temp_dir=self.sock_dir,
                              wrapper=['setpriv', '--pdeathsig', 'KILL'])
        self.console = Console(name, self.serial_sock, self.console_log,
                               alive=self.vm.is_running,
                               exit_info=lambda: f'exit code {self.vm.exitcode}; log: {self.vm.get_log()}')

    # -- life cycle -------------------------------------------------------
    def launch(self):
        LOG.info('%s: launching', self.name)
        if os.path.exists(self.console_log):
            os.unlink(self.console_log)
        self.console.pos = 0
        self.vm.launch()
        return self

    def shutdown(self, timeout=10):
        """Stop QEMU (quit, then SIGKILL after timeout).  Safe to call twice."""
        self.console.close()
        try:
            self.vm.shutdown(timeout=timeout)
        except Exception as exc:  # the process is gone either way
            LOG.warning('%s: shutdown: %s', self.name, exc)
            self.vm.kill()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def kill(self):
        self.vm.kill()

    @property
    def pid(self):
        return self.vm.get_pid()

    def qmp(self, cmd, **args):
        """Must-succeed QMP command: returns its 'return' value."""
        return self.vm.cmd(cmd, **args)

    def qmp_raw(self, cmd, **args):
        return self.vm.qmp(cmd, **args)

    # -- console (delegates to self.console) ------------------------------
    def console_text(self):
        return self.console.text()

    def wait_console(self, pattern, timeout=60, fail_pattern=r'HV-ERROR|Kernel panic'):
        return self.console.wait(pattern, timeout=timeout, fail_pattern=fail_pattern)

    def console_send(self, line):
        self.console.send(line)

    def run(self, command, timeout=60):
        return self.console.run(command, timeout=timeout)

    # -- redis ------------------------------------------------------------
    def redis(self, timeout=30, **kwargs):
        """A redis-py client for the guest's Redis, once it answers PING."""
        return redis_client(self.redis_port, timeout=timeout, name=self.name, **kwargs)

    def boot(self, timeout=120):
        """launch() and wait until init reports it is done."""
        self.launch()
        self.wait_console(r'HV-BOOTED', timeout=timeout)
        return self
