"""A QMP peer on a Unix socket for the arbiter's host tests: it answers the
commands a VM's link sends (qmp_capabilities, qom-get and qom-set of a
throttle group's limits, query-blockstats, block-latency-histogram-set)
with figures the test sets, and can be told to answer anything at all.

Why a stand-in and not QEMU: the tests that use it need what a real QEMU
cannot give on demand, figures that change at an exact moment (a period's
own sample) and replies no QEMU sends (the wrong type at any level,
garbage, huge or truncated lines).  The link, the QMP client and the
daemon's loop it talks to are the real ones; the guest tests drive them
against QEMU (test_guest_arbiter_ops.py).
"""

import json
import os
import socket
import threading
import time

from arbiter.sources import HIST_NS

QDEV = '/machine/peripheral/disk0/virtio-backend'
GREETING = {'QMP': {'version': {'qemu': {'major': 10, 'minor': 0, 'micro': 0},
                                'package': ''}, 'capabilities': []}}


def line(obj):
    return json.dumps(obj).encode() + b'\n'


class FakeQMP(threading.Thread):
    """One client at a time, as a QMP monitor serves.  mangle, if set, is
    called as mangle(command name, reply object) for the greeting (name
    None) and every reply; it returns None (send the reply), bytes (send
    these instead), or (bytes, then) with then 'close' (hang up) or
    'hang' (answer nothing more on this connection)."""

    def __init__(self, path, group='tg0'):
        super().__init__(name=f'fakeqmp-{os.path.basename(path)}', daemon=True)
        self.path, self.group = path, group
        self.lock = threading.Lock()
        self.ops = self.nbytes = 0          # cumulative, as QEMU's counters
        self.bins = [0] * (len(HIST_NS) + 1)
        self.histogram = False              # set by block-latency-histogram-set
        self.limits = {'iops-total': 0, 'bps-total': 0}
        self.delay = 0.0                    # before each reply
        self.mangle = None
        self.commands = []
        self.connections = 0
        self.drop = threading.Event()       # hang up on the client (hangup())
        self.stop_ev = threading.Event()
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(4)
        self.srv.settimeout(0.05)
        self.start()

    def add(self, ops, nbytes, bin_index=None):
        """ops more I/Os of nbytes in all, each in histogram bin bin_index."""
        with self.lock:
            self.ops += ops
            self.nbytes += nbytes
            if bin_index is not None:
                self.bins[bin_index] += ops

    def hangup(self):
        """Close the client's connection (the next one, if there is none
        now): it connects again, and is greeted and attached again."""
        self.drop.set()

    def close(self):
        self.stop_ev.set()
        self.join(5)
        self.srv.close()

    def run(self):
        while not self.stop_ev.is_set():
            try:
                conn, _ = self.srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                try:
                    self.serve(conn)
                except OSError:
                    pass

    def serve(self, conn):
        conn.settimeout(0.05)
        if not self.send(conn, None, GREETING):
            return
        buf = b''
        while not self.stop_ev.is_set():
            if self.drop.is_set():
                self.drop.clear()
                return
            nl = buf.find(b'\n')
            if nl < 0:
                try:
                    d = conn.recv(65536)
                except socket.timeout:
                    continue
                if not d:
                    return
                buf += d
                continue
            msg, buf = json.loads(buf[:nl]), buf[nl + 1:]
            name = msg.get('execute')
            self.commands.append(name)
            reply = dict(self.answer(name, msg.get('arguments', {})), id=msg.get('id'))
            if self.delay:
                time.sleep(self.delay)
            if not self.send(conn, name, reply):
                return

    def send(self, conn, name, reply):
        """Send the reply, or what mangle makes of it; False: the
        connection is done with."""
        out, then = line(reply), None
        m = self.mangle
        if m is not None:
            got = m(name, reply)
            if got is not None:
                out, then = got if isinstance(got, tuple) else (got, None)
        conn.settimeout(5)
        conn.sendall(out)
        if then == 'close':
            return False
        if then == 'hang':
            conn.settimeout(0.05)
            while not self.stop_ev.is_set():       # until the client hangs up
                try:
                    if not conn.recv(65536):
                        break
                except socket.timeout:
                    pass
            return False
        return True

    def answer(self, name, args):
        with self.lock:
            if name == 'qmp_capabilities':
                return {'return': {}}
            if name == 'qom-get' and args.get('path') == f'/objects/{self.group}':
                return {'return': dict(self.limits)}
            if name == 'qom-set' and args.get('path') == f'/objects/{self.group}':
                self.limits = dict(args['value'])
                return {'return': {}}
            if name == 'block-latency-histogram-set':
                self.histogram = True
                return {'return': {}}
            if name == 'query-blockstats':
                stats = {'rd_operations': self.ops, 'wr_operations': 0,
                         'rd_bytes': self.nbytes, 'wr_bytes': 0}
                if self.histogram:
                    stats['rd_latency_histogram'] = {'boundaries': HIST_NS,
                                                     'bins': list(self.bins)}
                return {'return': [{'device': '', 'qdev': QDEV, 'node-name': 'thr',
                                    'stats': stats}]}
        return {'error': {'class': 'GenericError', 'desc': f'no {name} here'}}
