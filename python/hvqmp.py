"""hvqmp: the QMP client of our host programs, for a peer that may be hostile.

The arbiter (arbiter/qmp.py), the libvirt hook (libvirt-hooks/qemu) and hvvol
(volume/hvvol.py) use this one module; the tests' own QEMU drivers (tests/hvlib, block/tests)
use QEMU's qemu.qmp instead.  Why not qemu.qmp here too:
- These programs run on the host's system Python (/usr/bin/python3), which
  has no qemu.qmp (Debian 12 does not package it) and no venv: `make
  install` puts this one file in PREFIX/lib/hybridvm/python, where the
  installed hook looks, and the arbiter runs from the tree.  The tests run
  in the build's venv, with QEMU's python/ tree on their path.
- Their peers may be hostile (a QEMU that hangs mid-reply, a socket that is
  not QEMU at all, a 1 GiB line), and each call must be bounded whatever the
  other end does.  qemu.qmp bounds a message at 10 MiB and a call only where
  its caller wraps it in a timeout, queues events without a cap, and only
  peeks at what it routes (its words: "not fully parsed/validated").
- libvirt waits for the hook on every event it handles (a whole call takes
  about 40 ms): importing qemu.qmp.legacy (asyncio and all) adds 47 ms to a
  python3 start here, this module 3 ms (medians of 20 and 40 runs,
  2026-11-27).

The bounds are those of the arbiter's client, which were the stricter of the
two that this module replaced (the hook's had a 10 s timeout for each read,
renewed by every byte, a 4 MiB line, and no cap on events before a reply):
- time: one deadline for each command (and for the greeting), whatever the
  peer sends meanwhile; its length is the caller's (`timeout`);
- size: a message is one line of at most MAX_LINE bytes;
- events: at most MAX_EVENTS before a command's reply (an event flood cannot
  keep a command from finishing); they are read and dropped;
- shape: every message must be a JSON object of the shape QMP specifies (a
  greeting, an event named by a string, a reply with our id and a return or
  an error object of two strings).
Any failure closes the connection and raises QMPError, with the socket's path
and the reason: QMPProtocolError when the peer said something that is not
QMP, QMPCommandError when QEMU answered with an error object (the connection
stays).  What a command returns is its caller's to check.  A subclass may
name its own exception classes (Error, ProtocolError, CommandError), as the
arbiter does to make them its link errors, and its own id prefix.
"""

import json
import socket
import time

MAX_LINE = 4 << 20      # a query-blockstats of many disks is a few tens of KiB
MAX_EVENTS = 1000


class QMPError(Exception):
    """The peer could not be asked (connect, timeout, garbage, closed)."""


class QMPProtocolError(QMPError):
    """The peer sent what QMP does not (not JSON, not an object, a line too
    long or cut short, a reply of the wrong shape)."""


class QMPCommandError(QMPError):
    """QEMU answered with an error object: class and desc are QEMU's."""

    def __init__(self, path, cmd, cls, desc):
        super().__init__(f'{path}: {cmd}: {cls}: {desc}')
        self.cls = cls
        self.desc = desc


class QMP:
    """A synchronous client on a Unix socket: connect(), cmd(), close()."""

    Error = QMPError
    ProtocolError = QMPProtocolError
    CommandError = QMPCommandError
    id_prefix = 'hvqmp'

    def __init__(self, path, timeout=2.0):
        self.path = path
        self.timeout = float(timeout)
        self.sock = None
        self.buf = b''
        self.next_id = 0

    # -- connection --------------------------------------------------------
    def connect(self):
        """Connect, read the greeting, negotiate capabilities."""
        self.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError as exc:
            s.close()
            raise self.Error(f'{self.path}: cannot connect: {exc.strerror or exc}') from None
        self.sock = s
        self.buf = b''
        deadline = time.monotonic() + self.timeout
        greeting = self._read_msg(deadline)
        if not isinstance(greeting.get('QMP'), dict):
            self._garbage(f'not a QMP greeting: {_short(greeting)}')
        if not isinstance(self.cmd('qmp_capabilities'), dict):
            self._garbage('qmp_capabilities: the return is not an object')
        return self

    def close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        self.buf = b''

    @property
    def connected(self):
        return self.sock is not None

    # -- commands ----------------------------------------------------------
    def cmd(self, name, /, **args):
        """Run a command; return its 'return' value.  Any transport failure
        closes the connection (the caller reconnects when it wants).  name
        is positional only: a command may take an argument 'name'."""
        if self.sock is None:
            raise self.Error(f'{self.path}: not connected')
        self.next_id += 1
        ident = f'{self.id_prefix}-{self.next_id}'
        msg = {'execute': name, 'id': ident}
        if args:
            msg['arguments'] = args
        deadline = time.monotonic() + self.timeout
        try:
            self.sock.settimeout(self.timeout)
            self.sock.sendall(json.dumps(msg).encode() + b'\n')
        except OSError as exc:
            self.close()
            raise self.Error(f'{self.path}: {name}: send failed: {exc}') from None
        for _ in range(MAX_EVENTS + 1):
            reply = self._read_msg(deadline)
            if 'event' in reply:
                if not isinstance(reply['event'], str):
                    self._garbage(f'{name}: an event not named by a string: {_short(reply)}')
                continue
            if reply.get('id') != ident:
                self._garbage(f'{name}: reply for another id: {_short(reply)}')
            if 'return' in reply:
                return reply['return']
            err = reply.get('error')
            if isinstance(err, dict) and isinstance(err.get('class'), str) \
                    and isinstance(err.get('desc'), str):
                raise self.CommandError(self.path, name, err['class'][:100], err['desc'][:500])
            self._garbage(f'{name}: reply has neither a return nor an error object: '
                          f'{_short(reply)}')
        self._garbage(f'{name}: more than {MAX_EVENTS} events before the reply')

    def _garbage(self, why):
        self.close()
        raise self.ProtocolError(f'{self.path}: {why}')

    def _timed_out(self):
        self.close()
        return self.Error(f'{self.path}: timed out: no reply within {self.timeout:g} s')

    def _read_msg(self, deadline):
        while True:
            nl = self.buf.find(b'\n')
            if nl >= 0:
                line, self.buf = self.buf[:nl], self.buf[nl + 1:]
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    bad = f'reply is not JSON ({str(exc)[:100]}): {line[:80]!r}'
                else:
                    if isinstance(msg, dict):
                        return msg
                    bad = f'reply is not a JSON object: {line[:80]!r}'
                self._garbage(bad)
            if len(self.buf) > MAX_LINE:
                self._garbage(f'reply line longer than {MAX_LINE} bytes')
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out()
            try:
                self.sock.settimeout(left)
                data = self.sock.recv(65536)
            except socket.timeout:
                raise self._timed_out() from None
            except OSError as exc:
                self.close()
                raise self.Error(f'{self.path}: receive failed: {exc}') from None
            if not data:
                if self.buf.strip():
                    self._garbage(f'connection closed in the middle of a line: '
                                  f'{self.buf[:80]!r}')
                self.close()
                raise self.Error(f'{self.path}: connection closed by the peer')
            self.buf += data


def _short(obj):
    text = json.dumps(obj)
    return text if len(text) <= 200 else text[:200] + '...'
