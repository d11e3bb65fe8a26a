#!/usr/bin/env python3
"""Benchmark: the database through an assisted migration at every shape.

Runs bench/app-assist.py's configurations at a series of shapes (Redis item
count and guest RAM, hot share), pooled at each shape: --repeat rounds, each
running every configuration once, every other round in reverse order, with
an A/A control (the baseline run again under another name) in the same
rounds.  Per shape: means with 95 % confidence intervals, ratios of ours
against stock post-copy with bootstrap intervals, and the verdict on the
goals (GETs lost <= 0.8x, p99 during <= 1.1x, total time <= 0.6x, set-up <=
5 % of the total).

Writes NAME.md, NAME.json and NAME.png (--name, default app-assist-shapes)
into --out (docs/bench): the chart has the item count on the x axis and a
line per configuration, one panel per figure.  The JSON is rewritten after
every run, so an interrupted sweep keeps what it measured; --report-only
redraws from it.

Shapes: ITEMS:MEM[:HOT], HOT a fraction of the items (default --hot), e.g.
--shapes 200000:1G,1000000:1G,3000000:2G,5000000:3G,10000000:5G.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
_spec = importlib.util.spec_from_file_location('app_assist', os.path.join(HERE, 'app-assist.py'))
aa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aa)

import charts  # noqa: E402
import app_assist_pooled as pooled  # noqa: E402
from pooled_stats import mean_ci, ratio_ci, verdict  # noqa: E402

# (column of a run's row, what, goal of ours / baseline or None)
FIGURES = [
    ('load lost: GETs', 'GETs lost to the migration', ('<=', 0.8)),
    ('load during: p99 (ms)', 'p99 during (ms)', ('<=', 1.1)),
    ('total time (ms)', 'total time (ms)', ('<=', 0.6)),
    ('load during: ops/s', 'GETs/s during', None),
    ('load during: max (ms)', 'longest stall (ms)', None),
    ('transferred (MiB)', 'transferred (MiB)', None),
    ('load during: failed', 'failed requests during', None),
    ('setup share (%)', 'set-up (% of total)', ('<=', 5.0)),
]
DEFAULT_SHAPES = '200000:1G,1000000:1G,3000000:2G,5000000:3G'


def parse_shapes(text, hot):
    shapes = []
    for part in text.split(','):
        bits = part.split(':')
        if len(bits) not in (2, 3):
            raise ValueError(f'shape {part!r}: expected ITEMS:MEM[:HOT]')
        items, mem = int(bits[0]), bits[1]
        h = float(bits[2]) if len(bits) == 3 else hot
        if items <= 0 or not 0 < h <= 1:
            raise ValueError(f'shape {part!r}: items must be > 0 and HOT in (0, 1]')
        shapes.append({'items': items, 'mem': mem, 'hot': h})
    return shapes


def shape_key(s):
    return f"{s['items']}:{s['mem']}:{s['hot']:g}"


def samples(runs, shape, label, col):
    return pooled.samples([r for r in runs if r.get('shape') == shape], label, col)


def baseline_samples(runs, shape, labels, baseline, col):
    """The baseline's samples and its A/A twins' together: the same
    configuration, so the best estimate of it that the run has."""
    return [x for label in labels if label.split('@')[0] == baseline
            for x in samples(runs, shape, label, col)]


def analyse(runs, shapes, labels, baseline):
    """{shape: {'stats': {label: {col: (mean, ci, n)}}, 'ratios': {label:
    {col: ratio dict}}}} for the shapes that have runs."""
    out = {}
    for s in shapes:
        key = shape_key(s)
        st, rt = {}, {}
        for label in labels:
            st[label] = {}
            for col, _, _ in FIGURES:
                xs = samples(runs, key, label, col)
                if xs:
                    m, h = mean_ci(xs)
                    st[label][col] = {'mean': m, 'ci95': h, 'n': len(xs)}
            if label == baseline:
                continue
            rt[label] = {}
            # The A/A twin against the baseline alone (the noise); any other
            # configuration against every run of the baseline's configuration.
            aa_twin = label.split('@')[0] == baseline
            for col, _, _ in FIGURES:
                if col == 'setup share (%)':
                    continue
                a = samples(runs, key, label, col)
                b = (samples(runs, key, baseline, col) if aa_twin else
                     baseline_samples(runs, key, labels, baseline, col))
                if len(a) >= 2 and len(b) >= 2 and sum(b) > 0:
                    p, lo, hi = ratio_ci(a, b)
                    rt[label][col] = {'ratio': p, 'lo': lo, 'hi': hi}
        if any(st[label] for label in labels):
            out[key] = {'shape': s, 'stats': st, 'ratios': rt}
    return out


def fmt(x, nd=1):
    return 'n/a' if x is None or (isinstance(x, float) and math.isnan(x)) else f'{x:.{nd}f}'


def write_report(runs, args, shapes, labels, history):
    """`history`: the invocations that made `runs` ({cmdline, started}), the
    first one's sweep and every --add-to after it."""
    os.makedirs(args.out, exist_ok=True)
    res = analyse(runs, shapes, labels, args.baseline)
    with open(os.path.join(args.out, f'{args.name}.json'), 'w') as f:
        json.dump({'args': vars(args), 'history': history, 'shapes': shapes, 'labels': labels,
                   'runs': runs, 'results': res}, f, indent=1, default=str)
    failed = [r for r in runs if 'failed' in r]
    made = '; then '.join(f'`bench/app-assist-shapes.py {h["cmdline"]}` ({h["started"]})'
                          for h in history)
    lines = [f'# App-assisted post-copy at every shape ({history[0]["started"]})', '',
             f'Generated by {made}: TCG guests, Redis items '
             f'of {args.size} bytes, bandwidth {args.bandwidth * 8 / 1e9:.1f} Gbit/s, post-copy '
             'after the first pre-copy pass, one host client GETting hot keys.  At each shape '
             'the rounds in its table (n), each running every configuration once (every other round in '
             "reverse order, so the shared machine's drift falls on all alike); "
             f'`{args.baseline}@aa` is the baseline run again under another name, the A/A '
             'control: its ratios (against the baseline alone) are the noise; the other '
             "configurations' ratios are against every run of the baseline's configuration "
             '(its A/A twin included).  Mean ± half-width of the 95 % interval '
             '(Student t); ratios of means with a percentile bootstrap 95 % interval.', '',
             f'Runs: {len(runs)} ({len(failed)} failed'
             + (': ' + '; '.join(f'{r["shape"]} {r["config"]} round {r["round"]}: '
                                 f'{r["failed"][:80]}' for r in failed) if failed else '')
             + ').', '']
    for key, r in res.items():
        s = r['shape']
        loads = [r['host load avg'] for r in runs
                 if r.get('shape') == key and 'host load avg' in r]
        lines += [f'## {s["items"]:,} items, {s["mem"]} guest, {int(round(100 * s["hot"]))} % hot',
                  '']
        if loads:
            lines += [f'Host load average (1 min, 2 cores) when the migrations started: '
                      f'{min(loads):.1f}-{max(loads):.1f}.', '']
        lines += ['| config | n | ' + ' | '.join(w for _, w, _ in FIGURES) + ' |',
                  '|---|---:|' + '---:|' * len(FIGURES)]
        for label in labels:
            st = r['stats'].get(label) or {}
            if not st:
                continue
            n = max(v['n'] for v in st.values())
            lines.append(f'| {label} | {n} | ' + ' | '.join(
                '' if c not in st else f'{fmt(st[c]["mean"])} ± {fmt(st[c]["ci95"])}'
                for c, _, _ in FIGURES) + ' |')
        for label, rs in r['ratios'].items():
            cells = []
            for col, _, goal in FIGURES:
                q = rs.get(col)
                cells.append('' if not q else f'{q["ratio"]:.2f}x [{q["lo"]:.2f}, {q["hi"]:.2f}]')
            against = args.baseline if '@' in label else f'{args.baseline} (all its runs)'
            lines.append(f'| {label} / {against} | | ' + ' | '.join(cells) + ' |')
        lines.append('')
        for label, rs in r['ratios'].items():
            if '@' in label:
                continue
            for col, what, goal in FIGURES:
                if goal and col in rs:
                    q = rs[col]
                    lines.append(f'- `{label}` {what}: {q["ratio"]:.2f}x [{q["lo"]:.2f}, '
                                 f'{q["hi"]:.2f}], goal {goal[0]} {goal[1]}x: '
                                 f'{verdict(q["lo"], q["hi"], goal)}.')
            sh = r['stats'].get(label, {}).get('setup share (%)')
            if sh and not math.isnan(sh['ci95']):
                lo, hi = sh['mean'] - sh['ci95'], sh['mean'] + sh['ci95']
                lines.append(f'- `{label}` set-up: {sh["mean"]:.1f} % [{lo:.1f}, {hi:.1f}] of '
                             f'the total, goal <= 5 %: {verdict(lo, hi, ("<=", 5.0))}.')
        lines.append('')
    lines += [f'![shapes]({args.name}.png)', '']
    with open(os.path.join(args.out, f'{args.name}.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(res, runs, labels, args)


def chart(res, runs, labels, args):
    """NAME.png: a panel per figure, the item count on the x axis (log), a
    line per configuration through its means, every run as a dot, and the
    95 % interval as error bars where a shape has 3 runs or more (with two,
    Student's t makes the bar 12.7 standard errors: it says nothing the two
    dots do not)."""
    plt = charts.pyplot()
    if not plt or not res:
        return
    cols = [(c, w) for c, w, _ in FIGURES if c != 'load during: failed']
    fig, axes = plt.subplots(2, (len(cols) + 1) // 2, figsize=(4.2 * ((len(cols) + 1) // 2), 7))
    for ax, (col, what) in zip(axes.flat, cols):
        for i, label in enumerate(labels):
            color = f'C{i}'
            pts = sorted((r['shape']['items'], r['stats'][label][col])
                         for r in res.values() if col in (r['stats'].get(label) or {}))
            if not pts:
                continue
            ax.errorbar([x for x, _ in pts], [v['mean'] for _, v in pts],
                        yerr=[0 if v['n'] < 3 or math.isnan(v['ci95']) else v['ci95']
                              for _, v in pts],
                        marker='o', capsize=3, label=label, color=color,
                        linestyle='--' if '@' in label else '-')
            dots = [(r['shape']['items'], x) for key, r in res.items()
                    for x in samples(runs, key, label, col)]
            ax.scatter([x for x, _ in dots], [y for _, y in dots], s=10, alpha=0.4,
                       color=color)
        ax.set_xscale('log')
        ax.set_xlabel('Redis items')
        ax.set_title(what, fontsize=9)
    for ax in list(axes.flat)[len(cols):]:
        ax.axis('off')
    axes.flat[0].legend(fontsize=7)
    charts.save(fig, os.path.join(args.out, f'{args.name}.png'), dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--shapes', default=DEFAULT_SHAPES)
    ap.add_argument('--size', type=int, default=100)
    ap.add_argument('--hot', type=float, default=0.3)
    ap.add_argument('--bandwidth', type=int, default=125_000_000, help='bytes/s')
    ap.add_argument('--repeat', type=int, default=3)
    ap.add_argument('--configs', default='postcopy-stock-redis,postcopy-stock-redis@aa,ours')
    ap.add_argument('--baseline', default='postcopy-stock-redis')
    ap.add_argument('--timeout', type=float, default=900)
    ap.add_argument('--out', default=os.path.join(aa.TOP, 'docs', 'bench'))
    ap.add_argument('--name', default='app-assist-shapes')
    ap.add_argument('--logdir', default=None)
    ap.add_argument('--report-only', default=None, metavar='JSON')
    ap.add_argument('--add-to', default=None, metavar='JSON',
                    help="a previous sweep's JSON: keep its runs (and its shapes in the report) "
                         'and add rounds to each of --shapes until it has --repeat')
    args = aa.parse_args(ap)
    if args.report_only:
        saved = aa.load_saved(args, keep=('out', 'report_only', 'name'))
        write_report(saved['runs'], args, saved['shapes'], saved['labels'],
                     saved.get('history') or [{'cmdline': args.cmdline, 'started': args.started}])
        return
    shapes = parse_shapes(args.shapes, args.hot)
    labels = args.configs.split(',')
    for label in labels:
        if label.split('@')[0] not in aa.CONFIGS:
            ap.error(f'unknown configuration {label}')
    if args.baseline not in labels:
        ap.error(f'the baseline {args.baseline} is not among --configs')
    build = os.environ.get('HYBRIDVM_BUILD') or os.path.join(aa.TOP, 'build')
    logdir = args.logdir or os.path.join(build, 'bench',
                                         time.strftime('app-assist-shapes-%Y%m%d-%H%M%S'))
    aa.log(f'logs in {logdir}')
    runs = []
    history = [{'cmdline': args.cmdline, 'started': args.started}]
    if args.add_to:
        with open(args.add_to) as f:
            saved = json.load(f)
        if saved['labels'] != labels:
            ap.error(f'--add-to: its configurations are {saved["labels"]}, not {labels}')
        runs = saved['runs']
        history = saved.get('history') or [{'cmdline': saved['args']['cmdline'],
                                             'started': saved['args']['started']}]
        history.append({'cmdline': args.cmdline, 'started': args.started})
    # The report covers the saved shapes too; rounds are added to --shapes'.
    report_shapes = (saved['shapes'] if args.add_to else []) + [
        s for s in shapes if not args.add_to or
        shape_key(s) not in {shape_key(t) for t in saved['shapes']}]
    for s in shapes:
        # app-assist.py's run_config reads the shape from its args.
        run_args = argparse.Namespace(mem=s['mem'], items=s['items'], size=args.size,
                                      hot=s['hot'], bandwidth=args.bandwidth,
                                      precopy_seconds=None, timeout=args.timeout, trace=None,
                                      dest_thp='on', started=args.started)
        done = max((r['round'] for r in runs if r.get('shape') == shape_key(s)), default=-1)
        for rnd in range(done + 1, args.repeat):
            for label in (labels if rnd % 2 == 0 else labels[::-1]):
                aa.log(f'shape {shape_key(s)} round {rnd}: {label}')
                try:
                    row = aa.run_config(label.split('@')[0], run_args,
                                        os.path.join(logdir, shape_key(s).replace(':', '-'),
                                                     str(rnd)))
                except Exception as exc:  # noqa: BLE001 -- a failed run is reported, not pooled
                    aa.log(f'FAILED: {exc!r}')
                    row = {'failed': str(exc)[:200]}
                row.update(config=label, round=rnd, shape=shape_key(s))
                runs.append(row)
                write_report(runs, args, report_shapes, labels, history)
    aa.log(f'report in {args.out}/{args.name}.md')


if __name__ == '__main__':
    main()
