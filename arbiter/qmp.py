"""A small synchronous QMP client for a hostile peer.

Why not qemu.qmp: the arbiter talks to many VMs from one loop, and each call
must be bounded in time and in size whatever the other end does (a QEMU that
hangs mid-reply, a socket that is not QEMU at all, a 1 GiB line).  This
client reads line by line with one deadline per command, caps a reply line at
MAX_LINE bytes, checks that every message is a JSON object of the shape QMP
specifies (a greeting, an event named by a string, a reply with our id and a
return or an error object of two strings), and turns each of those failures
into QMPError with the socket's path and the reason: QMPProtocolError when
the peer said something that is not QMP.  Events are read and dropped (at
most MAX_EVENTS per command, so an event flood cannot keep a command from
finishing).  What a command returns is its caller's to check (vmlink.py).
"""

import json
import socket
import time

MAX_LINE = 4 << 20      # a query-blockstats of many disks is a few tens of KiB
MAX_EVENTS = 1000


class LinkError(Exception):
    """The VM could not be asked (connect, timeout, garbage, closed): the
    link is dropped and made again later.  Also raised by the libvirt link
    (libvirtlink.py)."""


class LinkCommandError(LinkError):
    """The VM was asked and answered with an error: the link stays."""


class LinkProtocolError(LinkError):
    """The VM answered something that is not its protocol, or a reply not
    of the shape the command returns: the link is dropped and made again
    later, and the VM is in error meanwhile."""


class QMPError(LinkError):
    """The VM could not be asked (connect, timeout, garbage, closed)."""


class QMPProtocolError(QMPError, LinkProtocolError):
    """The peer sent what QMP does not (not JSON, not an object, a line too
    long or cut short, a reply of the wrong shape)."""


class QMPCommandError(QMPError, LinkCommandError):
    """QEMU answered with an error object: class and desc are QEMU's."""

    def __init__(self, path, cmd, cls, desc):
        super().__init__(f'{path}: {cmd}: {cls}: {desc}')
        self.cls = cls
        self.desc = desc


class QMP:
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
            raise QMPError(f'{self.path}: cannot connect: {exc.strerror or exc}') from None
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
    def cmd(self, name, **args):
        """Run a command; return its 'return' value.  Any transport failure
        closes the connection (the caller reconnects on its next period)."""
        if self.sock is None:
            raise QMPError(f'{self.path}: not connected')
        self.next_id += 1
        ident = f'arb-{self.next_id}'
        msg = {'execute': name, 'id': ident}
        if args:
            msg['arguments'] = args
        deadline = time.monotonic() + self.timeout
        try:
            self.sock.settimeout(self.timeout)
            self.sock.sendall(json.dumps(msg).encode() + b'\n')
        except OSError as exc:
            self.close()
            raise QMPError(f'{self.path}: {name}: send failed: {exc}') from None
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
                raise QMPCommandError(self.path, name, err['class'][:100], err['desc'][:500])
            self._garbage(f'{name}: reply has neither a return nor an error object: '
                          f'{_short(reply)}')
        self._garbage(f'{name}: more than {MAX_EVENTS} events before the reply')

    def _garbage(self, why):
        self.close()
        raise QMPProtocolError(f'{self.path}: {why}')

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
                self.close()
                raise QMPError(f'{self.path}: no reply within {self.timeout:g} s')
            try:
                self.sock.settimeout(left)
                data = self.sock.recv(65536)
            except socket.timeout:
                self.close()
                raise QMPError(f'{self.path}: no reply within {self.timeout:g} s') from None
            except OSError as exc:
                self.close()
                raise QMPError(f'{self.path}: receive failed: {exc}') from None
            if not data:
                if self.buf.strip():
                    self._garbage(f'connection closed in the middle of a line: '
                                  f'{self.buf[:80]!r}')
                self.close()
                raise QMPError(f'{self.path}: connection closed by the peer')
            self.buf += data


def _short(obj):
    text = json.dumps(obj)
    return text if len(text) <= 200 else text[:200] + '...'
