"""Calibration: the VM/container gap on one device, measured, stored as the
arbiter's model (as iocost keeps a cost model of its device) and printed.

For each block size and queue depth, random reads (never writes: the
device holds data) for a few seconds through
  the container path  fio straight on the block device (O_DIRECT, libaio),
                      as a process in a container does;
  the VM path         fio through QEMU's block layer: a qemu-storage-daemon
                      holding the device (aio=native, cache.direct=on) and
                      exporting it over NBD on a Unix socket.
A TCG guest's own I/O rate is bound by its emulated CPU, not by the block
layer (bench/arbiter.py measures that path separately), so the model keeps
the block layer's cost: gap = container IOPS / VM-path IOPS per point.
"""

import json
import math
import os
import shutil
import subprocess
import tempfile
import time

from .files import replace_file

VERSION = 1
MAX_POINTS = 64


class ModelError(Exception):
    pass


def _num(x, what):
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
        raise ModelError(f'model: {what} is not a non-negative number')
    return float(x)


class Model:
    def __init__(self, device, points, measured=None):
        self.device, self.points, self.measured = device, points, measured

    @classmethod
    def load(cls, path):
        try:
            with open(path, 'rb') as f:
                raw = f.read((1 << 20) + 1)
            if len(raw) > 1 << 20:
                raise ModelError(f'{path}: larger than 1 MiB')
            d = json.loads(raw)
        except (OSError, ValueError) as e:
            raise ModelError(f'{path}: {e}') from None
        if not isinstance(d, dict) or d.get('version') != VERSION:
            raise ModelError(f'{path}: not an arbiter model of version {VERSION}')
        pts = d.get('points')
        if not isinstance(pts, list) or not 0 < len(pts) <= MAX_POINTS:
            raise ModelError(f'{path}: 1-{MAX_POINTS} points expected')
        out = []
        for p in pts:
            if not isinstance(p, dict):
                raise ModelError(f'{path}: a point is not an object')
            q = dict(bs=int(_num(p.get('bs'), 'bs')), qd=int(_num(p.get('qd'), 'qd')))
            for side in ('container', 'vm'):
                s = p.get(side)
                if not isinstance(s, dict):
                    raise ModelError(f'{path}: a point has no {side} side')
                q[side] = {k: _num(s.get(k), f'{side}.{k}') for k in ('iops', 'p50_ms', 'p99_ms')}
            if q['vm']['iops'] <= 0 or q['container']['iops'] <= 0:
                raise ModelError(f'{path}: a point has zero IOPS')
            q['gap'] = q['container']['iops'] / q['vm']['iops']
            out.append(q)
        return cls(d.get('device'), out, d.get('measured'))

    def save(self, path):
        replace_file(path, json.dumps(dict(version=VERSION, device=self.device,
                                           measured=self.measured, points=self.points),
                                      indent=1))

    def gap(self):
        """Geometric mean of the per-point gaps."""
        return math.exp(sum(math.log(p['gap']) for p in self.points) / len(self.points))

    def auto_target_ms(self):
        """io.latency's guidance: 15 % above what the container path sees
        alone, at the probe's shape (4 KiB, one at a time) or the nearest."""
        p = min(self.points, key=lambda p: (abs(p['bs'] - 4096), p['qd']))
        return max(0.05, 1.15 * p['container']['p99_ms'])

    def table(self):
        rows = ['  bs     qd | container IOPS  p50 ms  p99 ms | VM path IOPS  p50 ms  p99 ms |   gap',
                '  ---------+-------------------------------+-----------------------------+------']
        for p in self.points:
            c, v = p['container'], p['vm']
            rows.append(f'{p["bs"] // 1024:4d}K {p["qd"]:5d} | {c["iops"]:14.0f} {c["p50_ms"]:7.3f} '
                        f'{c["p99_ms"]:7.3f} | {v["iops"]:12.0f} {v["p50_ms"]:7.3f} '
                        f'{v["p99_ms"]:7.3f} | {p["gap"]:5.2f}')
        rows.append(f'gap (geometric mean): {self.gap():.2f}   auto target p99: '
                    f'{self.auto_target_ms():.3f} ms')
        return '\n'.join(rows)


def fio(args, seconds, timeout=None):
    r = subprocess.run(['fio', '--output-format=json', '--name=cal', '--rw=randread',
                        '--time_based=1', f'--runtime={seconds}', '--randseed=7', *args],
                       capture_output=True, text=True, timeout=timeout or seconds + 60)
    if r.returncode:
        raise ModelError(f'fio: {r.stderr.strip()[-300:]}')
    j = json.loads(r.stdout[r.stdout.index('{'):])['jobs'][0]['read']
    pc = j['clat_ns'].get('percentile', {})
    return dict(iops=j['iops'], p50_ms=pc.get('50.000000', 0) / 1e6,
                p99_ms=pc.get('99.000000', 0) / 1e6)


def calibrate(device, qsd, sizes=(4096, 65536), depths=(1, 32), seconds=3, log=print):
    """Measure both paths on 'device' (read only).  'qsd': the
    qemu-storage-daemon binary."""
    if not shutil.which('fio'):
        raise ModelError('calibration needs fio')
    tmp = tempfile.mkdtemp(prefix='hvarbiter-cal-')
    sock = os.path.join(tmp, 'nbd.sock')
    size = os.path.getsize(device) if os.path.isfile(device) else None
    node = json.dumps({'driver': 'host_device', 'filename': device, 'node-name': 'dev',
                       'aio': 'native', 'cache': {'direct': True}, 'read-only': True})
    d = subprocess.Popen([qsd, '--blockdev', node,
                          '--nbd-server', f'addr.type=unix,addr.path={sock}',
                          '--export', 'nbd,id=dev,node-name=dev'],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if os.path.exists(sock) or d.poll() is not None:
                break
            time.sleep(0.05)
        if not os.path.exists(sock):
            raise ModelError(f'qemu-storage-daemon: {(d.communicate()[1] or "")[-300:]}')
        points = []
        for bs in sizes:
            for qd in depths:
                common = [f'--bs={bs}', f'--iodepth={qd}']
                c = fio(common + [f'--filename={device}', '--direct=1', '--ioengine=libaio'],
                        seconds)
                v = fio(common + ['--ioengine=nbd', f'--uri=nbd+unix:///dev?socket={sock}']
                        + ([f'--size={size}'] if size else []), seconds)
                points.append(dict(bs=bs, qd=qd, container=c, vm=v, gap=c['iops'] / v['iops']))
                log(f'calibrate: {bs // 1024}K QD{qd}: container {c["iops"]:.0f} IOPS, '
                    f'VM path {v["iops"]:.0f} IOPS')
    finally:
        d.terminate()
        d.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    return Model(device, points, time.strftime('%Y-%m-%dT%H:%M:%S'))
