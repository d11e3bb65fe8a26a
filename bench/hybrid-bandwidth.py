#!/usr/bin/env python3
"""A hybrid node's bandwidth against memory and NBD ceilings (issue 40, target 3).

Three parts, in every round, each running its configurations once in an
order rotated from round to round (bench/pooled_stats.py `rotated`):

inproc: 128 KiB sequential reads, one in flight, inside one process.
  hybrid-ram   `qemu-img bench -d 1 -s 128K -S 128K -c COUNT` on a hybrid
               image of --size random bytes whose RAM tier is a current
               region in /dev/shm (`ram-file=`, opened with read-only=off,
               which a region needs): the open takes the region as it is, so
               every block is in RAM from the first read (checked once per
               run with the trace events hybrid_region_attach and
               hybrid_read_miss).  qemu-img times its own request loop.
  memcpy       bench/copy-bw.c: COUNT memcpy()s of 128 KiB from a buffer of
               --size random bytes, in order and wrapping, into one 128 KiB
               buffer (what qemu-img bench's single request buffer gets).
  memcpy@aa    the same again: the A/A control of the baseline.
  null-co-img  `qemu-img bench` as for hybrid-ram on a null-co node
               (read-zeroes=off: it neither fills nor copies): what qemu-img
               and the block layer cost per request without any data.
  GB/s = COUNT x 128 KiB / the loop's time.

nbd: fio's nbd engine, 128 KiB sequential reads at QD32 (the shape of
  bench/hybrid.py --pooled, without its 1 s ramp), nodes of one qemu-storage-daemon exported
  over a unix socket.
  hybrid-async      hybrid mode=async, ram-size covering --size of random
                    bytes, file on disk with cache.direct=on, restore done
                    before the first round: every read is served from RAM
  null-co           driver=null-co,read-zeroes=on: fills each buffer with
                    zeros, and the NBD server, seeing the node report zeros,
                    sends them as holes (no payload on the socket)
  null-co-data      driver=null-co,read-zeroes=off: sends its buffer, not
                    filled: the ceiling of reads that carry data
  null-co@aa, null-co-data@aa   second nodes like them: the A/A controls

dedup: fio 128 KiB sequential writes at QD32 with --dedupe_percentage=0
  --refill_buffers (fresh random bytes for every write, nothing to share)
  to hybrid mode=async nodes of --size, the persistent tier a file on
  /dev/shm: dedup-on (dedup=on), dedup-off, dedup-off@aa.  After each run
  the node is flushed through its export, so the next run starts with no
  write-back under way.  query-hybrid's dedup-ratio after the run shows
  that nothing was shared.

Also, at the start and at the end of the run: GB/s (of the thread's CPU
time) of each content fingerprint implementation (block/tests/
content-fp-test.c --bench, built with QEMU's flags for content-fp.c).

Each sample has two measures: bandwidth of the wall clock (what the goals
name), and bandwidth per CPU second (the same bytes over the CPU time spent
on them: the loop's for inproc, fio's and the daemon's for nbd and dedup),
steadier than the wall clock on a shared machine.

Per configuration the mean with its Student t 95 % interval; each goal a
ratio of means with a percentile bootstrap 95 % interval, read only when
the whole interval decides (bench/pooled_stats.py verdict), beside its A/A:

  inproc  hybrid-ram / memcpy            >= 0.8
  nbd     hybrid-async / null-co         >= 0.8
  nbd     hybrid-async / null-co-data    >= 0.8
  dedup   dedup-on / dedup-off           >= 0.8

Usage: bench/hybrid-bandwidth.py [--rounds 5] [--size 256M] [--runtime 3]
                                 [--count 32768] [--notes FILE] [--out docs/bench]
       bench/hybrid-bandwidth.py --report-only docs/bench/hybrid-bandwidth.json
Binaries from $HYBRIDVM_BUILD/bin (default <repo>/build/bin), copied at
start.  Writes docs/bench/hybrid-bandwidth.md, .json and .png.
"""

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'block', 'tests'))
import hybridlib as H   # noqa: E402  (sets up the path of qemu.qmp)
import test_content_fp   # noqa: E402
import charts   # noqa: E402
from sizes import parse_size   # noqa: E402
from saved_runs import add_report_args, load_saved   # noqa: E402
from pooled_stats import mean, mean_ci, ratio_ci, rotated, verdict   # noqa: E402

MiB = 1024 * 1024
KiB = 1024
CHUNK = 128 * KiB
PARTS = {
    'inproc': ['hybrid-ram', 'memcpy', 'memcpy@aa', 'null-co-img'],
    'nbd': ['hybrid-async', 'null-co', 'null-co@aa', 'null-co-data',
            'null-co-data@aa'],
    'dedup': ['dedup-on', 'dedup-off', 'dedup-off@aa'],
}
UNIT = {'inproc': 'GB/s', 'nbd': 'MB/s', 'dedup': 'MB/s'}
GOALS = [
    ('inproc', 'hybrid-ram', 'memcpy', ('>=', 0.8)),
    ('inproc', 'memcpy@aa', 'memcpy', None),
    ('nbd', 'hybrid-async', 'null-co', ('>=', 0.8)),
    ('nbd', 'null-co@aa', 'null-co', None),
    ('nbd', 'hybrid-async', 'null-co-data', ('>=', 0.8)),
    ('nbd', 'null-co-data@aa', 'null-co-data', None),
    ('dedup', 'dedup-on', 'dedup-off', ('>=', 0.8)),
    ('dedup', 'dedup-off@aa', 'dedup-off', None),
]


def node(config):
    """A configuration's node and export name (no '@' in a node name)."""
    return config.replace('@', '-')


class Bench:
    def __init__(self, args):
        self.args = args
        self.size = parse_size(args.size)
        self.work = tempfile.mkdtemp(prefix='hybrid-bw-', dir=os.path.join(REPO, 'build'))
        self.shm = tempfile.mkdtemp(prefix='hybrid-bw-', dir='/dev/shm')
        self.sock = os.path.join(self.work, 'nbd.sock')
        self.meta = {}

    def p(self, name, shm=False):
        return os.path.join(self.shm if shm else self.work, name)

    def run(self, *argv, timeout=600):
        """Run a tool to its end; its CPU seconds (user + system) as .cpu."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                           timeout=timeout)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode:
            raise RuntimeError(f'{argv}: exit {r.returncode}: {r.stderr.strip()[:2000]}')
        r.cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return r

    def qsd_cpu(self):
        """CPU seconds (user + system, all threads) of the daemon so far."""
        with open(f'/proc/{self.qsd.proc.pid}/stat') as f:
            fields = f.read().rsplit(')', 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')

    def setup(self):
        """Private copies of the binaries (a rebuild under the run changes
        nothing), copy-bw and content-fp-test built, the images made."""
        d = os.path.join(self.work, 'bin')
        os.makedirs(d)
        bins = {}
        for n in ('qemu-storage-daemon', 'qemu-img', 'qemu-io'):
            src = os.path.realpath(H.binary(n))
            shutil.copy2(src, os.path.join(d, n))
            with open(src, 'rb') as f:
                bins[n] = hashlib.sha256(f.read()).hexdigest()[:16]
        H.BIN = d
        self.meta['binaries'] = bins
        self.copy_bw = os.path.join(d, 'copy-bw')
        self.run('cc', '-O2', '-Wall', '-o', self.copy_bw,
                 os.path.join(REPO, 'bench', 'copy-bw.c'))
        self.fp_test = test_content_fp.build_fp_test(os.path.join(d, 'content-fp-test'))
        img = H.binary('qemu-img')
        src = self.p('random.raw')
        with open(src, 'wb') as f:
            for _ in range(self.size // MiB):
                f.write(os.urandom(MiB))
        mb = self.size // MiB
        # inproc: the region the image's RAM tier lives in, made current
        # by a first open (which restores into it)
        self.run(img, 'convert', '-O', 'hybrid', '-o', f'ram-size={self.size},mode=async',
                 src, self.p('inproc.hyb'))
        region = self.p('inproc.region', shm=True)
        with open(region, 'wb') as f:
            f.truncate(self.size + 2 * MiB)
        self.inproc_opts = (f'driver=hybrid,file.driver=file,file.filename={self.p("inproc.hyb")},'
                            f'read-only=off,ram-file={region}')
        self.meta['inproc_check'] = self.check_inproc()
        self.run(img, 'convert', '-O', 'hybrid', '-o', f'ram-size={self.size},mode=async',
                 src, self.p('async.hyb'))
        for c in PARTS['dedup']:
            self.run(img, 'create', '-q', '-f', 'hybrid', '-o',
                     f'ram-size={self.size},mode=async', self.p(f'{node(c)}.hyb', shm=True),
                     f'{mb}M')
        os.unlink(src)

    def qemu_img_bench(self, count, trace=(), opts=None):
        argv = [H.binary('qemu-img')]
        for t in trace:
            argv += ['-T', t]
        return self.run(*argv, 'bench', '-c', count, '-d', 1, '-s', CHUNK, '-S', CHUNK,
                        '--image-opts', opts or self.inproc_opts)

    def check_inproc(self):
        """Make the region current and check that hybrid-ram's reads are
        served from RAM: an open takes the region as it is with every block
        loaded, and no read misses.  The first opens restore into the region
        (a close stops a restore under way; the next open goes on with what
        is not valid yet)."""
        blocks = self.size // (64 * KiB)
        for attempt in range(20):
            r = self.qemu_img_bench(self.size // CHUNK,
                                    trace=('hybrid_region_attach', 'hybrid_read_miss'))
            out = r.stdout + r.stderr
            m = re.search(r'hybrid_region_attach .*reused (\d+) loaded (\d+)', out)
            misses = len(re.findall(r'hybrid_read_miss', out))
            if m and m.group(1) == '1' and int(m.group(2)) == blocks and not misses:
                return {'opens_before': attempt, 'loaded_blocks': blocks,
                        'read_misses': misses}
        raise RuntimeError(f'hybrid-ram is not served from RAM: {out[-2000:]}')

    # ---- one sample of each part ----

    def inproc(self, config):
        """GB/s of the loop's wall time, and of its CPU time: qemu-img's
        CPU time less that of a one-read run of it (open, close)."""
        n = self.args.count
        if config in ('hybrid-ram', 'null-co-img'):
            opts = self.inproc_opts if config == 'hybrid-ram' else \
                f'driver=null-co,read-zeroes=off,size={self.size}'
            r = self.qemu_img_bench(n, opts=opts)
            s = float(re.search(r'Run completed in ([\d.]+) seconds', r.stdout).group(1))
            cpu = r.cpu - self.qemu_img_bench(1, opts=opts).cpu
        else:
            out = json.loads(self.run(self.copy_bw, self.size // MiB, CHUNK // KiB, n).stdout)
            s, cpu = out['seconds'], out['cpu_seconds']
        return {'value': n * CHUNK / s / 1e9, 'cpu': n * CHUNK / cpu / 1e9}

    def fio(self, config, rw, extra=(), after=None):
        """MB/s of a fio run (no ramp: the bytes are all the run's), and MB
        per CPU second of fio and the daemon together, the daemon's CPU
        counted until @after (a flush, say) has run too."""
        uri = f'nbd+unix:///{node(config)}?socket={self.sock}'
        q0 = self.qsd_cpu()
        r = self.run('fio', '--name=job', '--ioengine=nbd', f'--uri={uri}', f'--rw={rw}',
                     '--bs=128k', '--iodepth=32', '--numjobs=1', f'--size={self.size}',
                     f'--runtime={self.args.runtime}', '--time_based',
                     '--output-format=json', *extra)
        if after:
            after()
        cpu = r.cpu + self.qsd_cpu() - q0
        text = r.stdout
        job = json.loads(text[text.find('{'):])['jobs'][0]
        if job['error']:
            raise RuntimeError(f'fio failed: {text[:2000]}')
        d = job['read' if rw == 'read' else 'write']
        return {'value': d['bw_bytes'] / 1e6, 'cpu': d['io_bytes'] / cpu / 1e6}

    def nbd(self, config):
        return self.fio(config, 'read')

    def dedup(self, config):
        def flush():
            H.qemu_io('-f', 'raw', '-c', 'flush',
                      f'nbd+unix:///{node(config)}?socket={self.sock}', timeout=300)
        r = self.fio(config, 'write', ('--dedupe_percentage=0', '--refill_buffers'),
                     after=flush)
        info = self.qsd.cmd('query-hybrid', **{'node-name': node(config)})[0]
        self.dedup_ratio.setdefault(config, []).append(round(info['dedup-ratio'], 4))
        return r

    # ---- the run ----

    def blockdevs(self):
        d = {'hybrid-async': {'driver': 'hybrid', 'mode': 'async',
                              'file': {'driver': 'file', 'filename': self.p('async.hyb'),
                                       'cache': {'direct': True}}}}
        for c in ('null-co', 'null-co@aa'):
            d[c] = {'driver': 'null-co', 'read-zeroes': True, 'size': self.size}
        for c in ('null-co-data', 'null-co-data@aa'):
            d[c] = {'driver': 'null-co', 'read-zeroes': False, 'size': self.size}
        for c in PARTS['dedup']:
            d[c] = {'driver': 'hybrid', 'mode': 'async', 'dedup': c == 'dedup-on',
                    'file': {'driver': 'file', 'filename': self.p(f'{node(c)}.hyb', shm=True)}}
        return d

    def fingerprint_rates(self):
        out = self.run(self.fp_test, '--bench', 256).stdout
        rates = {}
        for name, cache, mem in re.findall(
                r'^bench (\w+): ([\d.]+) GB/s from cache .*, ([\d.]+) GB/s from memory',
                out, re.M):
            rates[name] = {'cache_GBps': float(cache), 'memory_GBps': float(mem)}
        rates['selected'] = re.search(r'^selected: (\w+)', out, re.M).group(1)
        rates['load1'] = os.getloadavg()[0]
        return rates

    def main(self):
        self.setup()
        runs = []
        self.dedup_ratio = {}
        self.meta['fingerprint'] = [self.fingerprint_rates()]
        tmp = H.TempDir()
        self.qsd = H.StorageDaemon(tmp, '--nbd-server', f'addr.type=unix,addr.path={self.sock}')
        try:
            for c, bd in self.blockdevs().items():
                self.qsd.cmd('blockdev-add', **{'node-name': node(c), **bd})
                self.qsd.cmd('nbd-server-add', device=node(c), writable=True)
            info = self.qsd.wait_restored(timeout=600)
            if not all(i['restore-done'] for i in info):
                raise TimeoutError('restore did not finish')
            for rnd in range(self.args.rounds):
                for part, configs in PARTS.items():
                    for c in rotated(configs, rnd):
                        v = getattr(self, part)(c)
                        runs.append({'round': rnd, 'part': part, 'config': c, **v,
                                     'load1': os.getloadavg()[0]})
                        print(rnd, part, c, f'{v["value"]:.2f} {UNIT[part]}',
                              f'{v["cpu"]:.2f} per CPU s', f'load {runs[-1]["load1"]:.2f}',
                              flush=True)
            hits = {i['node-name']: (i['read-hits'], i['read-misses'])
                    for i in self.qsd.cmd('query-hybrid')}
            self.meta['nbd_hybrid_hits_misses'] = hits[node('hybrid-async')]
        finally:
            self.qsd.stop()
            tmp.cleanup()
            self.meta['dedup_ratio_after_runs'] = self.dedup_ratio
            self.meta['fingerprint'].append(self.fingerprint_rates())
            shutil.rmtree(self.work, ignore_errors=True)
            shutil.rmtree(self.shm, ignore_errors=True)
        return runs, self.meta


METRICS = {'value': 'bandwidth (wall clock)',
           'cpu': 'bandwidth per CPU second'}


def summarize(runs):
    """Per metric: means of each configuration, and the GOALS' ratios."""
    out = {}
    for metric in METRICS:
        vals = {}
        for r in runs:
            vals.setdefault(r['part'], {}).setdefault(r['config'], []).append(r[metric])
        means = {p: {c: mean_ci(v) for c, v in cs.items()} for p, cs in vals.items()}
        ratios = []
        for part, a, b, goal in GOALS:
            p, lo, hi = ratio_ci(vals[part][a], vals[part][b])
            ratios.append({'part': part, 'config': a, 'baseline': b, 'ratio': p, 'lo': lo,
                           'hi': hi, 'goal': goal,
                           'verdict': verdict(lo, hi, goal) if goal else 'A/A control'})
        out[metric] = {'means': means, 'ratios': ratios}
    return out


def report(args, runs, meta, summ):
    out = args.out
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, 'hybrid-bandwidth')
    with open(base + '.json', 'w') as f:
        json.dump({'args': vars(args), 'runs': runs, 'meta': meta}, f, indent=1)
    loads = [r['load1'] for r in runs]
    cmd = (f'bench/hybrid-bandwidth.py --rounds {args.rounds} --size {args.size} '
           f'--runtime {args.runtime} --count {args.count}')
    lines = [f'# hybrid bandwidth: RAM-tier reads against memcpy and NBD ceilings, '
             f'dedup writes (issue 40, target 3)', '',
             f'Run {meta.get("date", "?")}: `{cmd}` on the shared 2-core build machine '
             f'(AMD EPYC, Debian 12); 1-min load average {min(loads):.2f}-{max(loads):.2f} '
             f'over the samples (mean {mean(loads):.2f}).  {args.rounds} interleaved rounds: '
             f'in each, every part runs each of its configurations once, in an order rotated '
             f'from round to round.  What the parts and configurations are: the docstring of '
             f'`bench/hybrid-bandwidth.py`; in short:', '',
             f'* **inproc**: 128 KiB sequential reads at depth 1 in one process, '
             f'`qemu-img bench -c {args.count}` on a {args.size} hybrid image whose RAM tier '
             f'is a current region in /dev/shm (every block in RAM, checked: '
             f'{meta.get("inproc_check")}), against `bench/copy-bw.c`: the same number of '
             f'128 KiB `memcpy()`s from a {args.size} buffer into one 128 KiB buffer.  GB/s.',
             f'* **nbd**: fio nbd engine, 128 KiB sequential reads, QD32, {args.runtime} s '
             f'(no ramp), one qemu-storage-daemon: hybrid-async ({args.size} of random data, '
             f'all in RAM; read hits/misses over the run {meta.get("nbd_hybrid_hits_misses")}), '
             f'null-co (read-zeroes=on: zeros, sent by the NBD server as holes, no payload), '
             f'null-co-data (read-zeroes=off: its buffer is sent, not filled).  MB/s.',
             f'* **dedup**: fio 128 KiB sequential writes, QD32, random bytes for every write '
             f'(`--dedupe_percentage=0 --refill_buffers`), hybrid mode=async, tier on /dev/shm, '
             f'dedup=on against dedup=off; a flush after each run.  dedup-ratio after each run: '
             f'{meta.get("dedup_ratio_after_runs", {}).get("dedup-on")} (1.0: nothing shared).  '
             f'MB/s.', '',
             'Two measures of each sample.  **Bandwidth (wall clock)** is what the goals name: '
             'bytes over the elapsed time of the loop (qemu-img\'s own timing, copy-bw\'s, '
             'fio\'s).  On a 2-core machine shared at this load it mostly measures the share '
             'of the CPUs a process got, so each sample also has **bandwidth per CPU second**: '
             'the same bytes over the CPU time (user + system) spent on them: for inproc the '
             'loop\'s (copy-bw: the process CPU clock around its loop; qemu-img: its CPU time '
             'less that of a one-read run, open and close), for nbd and dedup fio\'s and the '
             'daemon\'s together (dedup: the daemon\'s until the flush after the run is done, '
             'so the write-back counts).', '',
             'Means with Student t 95 % intervals; ratios of means with percentile bootstrap '
             '95 % intervals; a goal is met or missed only when the whole interval says so.', '',
             '| part | configuration | wall clock: mean [95 % CI] | per CPU second |',
             '|---|---|---:|---:|']
    for part, cs in summ['value']['means'].items():
        for c, (m, h) in cs.items():
            mc, hc = summ['cpu']['means'][part][c]
            lines.append(f'| {part} | {c} | {m:.2f} ± {h:.2f} {UNIT[part]} | '
                         f'{mc:.2f} ± {hc:.2f} |')
    cm = {c: m for c, (m, _) in summ['cpu']['means'].get('inproc', {}).items()}
    if 'null-co-img' in cm:
        h, n, m = cm['hybrid-ram'], cm['null-co-img'], cm['memcpy']
        lines += ['', f'qemu-img and the block layer alone (null-co-img) spend '
                  f'{CHUNK / n / 1e3:.2f} µs of CPU per 128 KiB request, hybrid-ram '
                  f'{CHUNK / h / 1e3:.2f} µs and a memcpy() {CHUNK / m / 1e3:.2f} µs (means per '
                  f'CPU second); beyond the per-request cost, hybrid-ram reads '
                  f'{1 / (1 / h - 1 / n):.2f} GB per CPU second, {(1 / (1 / h - 1 / n)) / m:.2f}x '
                  f'memcpy.  The best ratio to memcpy() that a read through qemu-img bench at '
                  f'depth 1 can reach on this machine, a driver that copies at memcpy\'s '
                  f'speed and costs nothing else, is {1 / (1 + m / n):.2f}.']
    for metric, title in METRICS.items():
        lines += ['', f'**{title}**', '', '| part | ratio | value [95 % CI] | goal | verdict |',
                  '|---|---|---:|---|---|']
        for r in summ[metric]['ratios']:
            goal = f'{r["goal"][0]} {r["goal"][1]}' if r['goal'] else '-'
            lines.append(f'| {r["part"]} | {r["config"]} / {r["baseline"]} | '
                         f'{r["ratio"]:.2f} [{r["lo"]:.2f}, {r["hi"]:.2f}] | {goal} | '
                         f'{r["verdict"]} |')
    lines += ['', '**Content fingerprint** (`block/tests/content-fp-test.c --bench 256`: '
              '64 KiB blocks, GB/s of the thread\'s CPU time, best of 3 alternating rounds; '
              'at the start and at the end of the run):', '',
              '| when | implementation | GB/s from cache | GB/s from memory | load |',
              '|---|---|---:|---:|---:|']
    for when, fp in zip(('start', 'end'), meta.get('fingerprint', [])):
        for name, r in fp.items():
            if isinstance(r, dict):
                sel = ' (selected)' if name == fp['selected'] else ''
                lines.append(f'| {when} | {name}{sel} | {r["cache_GBps"]:.2f} | '
                             f'{r["memory_GBps"]:.2f} | {fp["load1"]:.2f} |')
    lines += ['', '![means and ratios](hybrid-bandwidth.png)', '']
    if args.notes:
        with open(args.notes) as f:
            lines += [f.read()]
    with open(base + '.md', 'w') as f:
        f.write('\n'.join(lines))
    chart(base + '.png', summ)


def chart(path, summ):
    plt = charts.pyplot()
    if not plt:
        return
    rs = summ['value']['ratios']
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(rs) + 1.4))
    for i, r in enumerate(rs):
        charts.ratio_points(ax, [i + 0.15], [r], color='tab:gray' if not r['goal']
                            else 'tab:red', label='wall clock' if i == 0 else None)
        charts.ratio_points(ax, [i - 0.15], [summ['cpu']['ratios'][i]], color='tab:blue',
                            label='per CPU second' if i == 0 else None)
        if r['goal']:
            ax.plot([r['goal'][1]] * 2, [i - 0.35, i + 0.35], 'k--', lw=1)
    charts.ratio_rows(ax, [f'{r["part"]}: {r["config"]} / {r["baseline"]}' for r in rs],
                      'ratio of means, 95 % bootstrap CI (dashed: goal)')
    ax.legend(fontsize=8)
    charts.save(fig, path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--size', default='256M', help='each image and the copy source')
    ap.add_argument('--runtime', type=int, default=3, help='s per fio run (no ramp)')
    ap.add_argument('--count', type=int, default=32768,
                    help='128 KiB reads per inproc sample (qemu-img bench -c)')
    add_report_args(ap)
    args = ap.parse_args()
    if args.report_only:
        saved = load_saved(args)
        report(args, saved['runs'], saved['meta'], summarize(saved['runs']))
        return
    if args.rounds < 2:
        ap.error('--rounds needs at least 2 for an interval')
    runs, meta = Bench(args).main()
    meta['date'] = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    report(args, runs, meta, summarize(runs))


if __name__ == '__main__':
    main()
