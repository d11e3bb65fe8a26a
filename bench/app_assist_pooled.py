"""Pooled report of bench/app-assist.py --repeat N: interleaved runs of each
configuration, means with 95 % confidence intervals, and ratios against the
baseline with bootstrap confidence intervals.  A configuration run twice
under two names (CONFIG and CONFIG@aa) is the A/A control: how far apart
two identical configurations land in the same run is the noise any other
ratio must be read against.

Writes NAME.md, .json and .png (--name, default app-assist-pooled) into
the output directory.
Only measured figures go there; a failed run is listed and not pooled."""

import json
import math
import os

import charts
from pooled_stats import in_run_order, mean_ci, ratio_ci, verdict

# (column, what, goal for ours/baseline: ('<=' or '>=', value) or None)
METRICS = [
    ('total time (ms)', 'total time', ('<=', 0.6)),
    ('load during: ops/s', 'Redis ops/s during the migration', ('>=', 1.0)),
    ('load before: ops/s', 'Redis ops/s before the migration', None),
    ('load during: p99 (ms)', 'Redis p99 during the migration', ('<=', 1.1)),
    # PREPARE and the page list run in the first half second
    ('load first 0.5 s: max (ms)', "Redis's longest GET in the migration's first 0.5 s", None),
    # the rate before x the migration's time, less the GETs served
    ('load lost: GETs', 'Redis GETs lost to the migration', None),
    ('load after: ops/s', 'Redis ops/s in the 2 s after the migration', None),
    ('load after: p99 (ms)', 'Redis p99 in the 2 s after the migration', None),
    ('transferred (MiB)', 'bytes transferred', None),
    ('setup share (%)', 'set-up (prepare + balloon) share of the total', None),
]
SETUP_GOAL = 5.0        # % of the total time


def setup_share(row):
    total = row.get('total time (ms)')
    if not total:
        return None
    setup = (row.get('prepare (ms)') or 0) + (row.get('balloon (ms)') or 0)
    return 100.0 * setup / total


def samples(runs, label, col):
    out = []
    for r in runs:
        if r.get('config') != label or 'failed' in r:
            continue
        v = setup_share(r) if col == 'setup share (%)' else r.get(col)
        if v is not None:
            out.append(float(v))
    return out


def analyse(runs, baseline):
    labels = in_run_order(runs, 'config')
    stats = {}
    for label in labels:
        stats[label] = {}
        for col, _, _ in METRICS:
            xs = samples(runs, label, col)
            if xs:
                m, h = mean_ci(xs)
                stats[label][col] = {'n': len(xs), 'mean': m, 'ci95': h, 'samples': xs}
    ratios = {}
    for label in labels:
        if label == baseline:
            continue
        ratios[label] = {}
        for col, _, _ in METRICS:
            if col == 'setup share (%)':
                continue
            a, b = samples(runs, label, col), samples(runs, baseline, col)
            if len(a) >= 2 and len(b) >= 2:
                p, lo, hi = ratio_ci(a, b)
                ratios[label][col] = {'ratio': p, 'lo': lo, 'hi': hi}
    return labels, stats, ratios


# Parts of the migration's window in its per-100 ms timeline: the first
# bucket (set-up), the last three (the switch), what lies between.
PHASES = ('first 100 ms', 'middle', 'last 300 ms', 'whole window')


def phase_shares(run):
    """GETs in each part of the migration's window as a share of the run's
    own rate in the second before it, from its 'load timeline'; None if the
    run has none or too short a window."""
    tl = run.get('load timeline')
    if not tl or 'failed' in run:
        return None
    buckets, i0 = tl['per_100ms'], int(round(-tl['start'] / 0.1))
    n = int(round(tl['end'] / 0.1))
    before = sum(buckets[:i0]) / (i0 * 0.1) if i0 else 0
    seg = [10 * x / before for x in buckets[i0:i0 + n]] if before else []
    if len(seg) < 5:
        return None
    return dict(zip(PHASES, (seg[0], sum(seg[1:-3]) / (len(seg) - 4),
                             sum(seg[-3:]) / 3, sum(seg) / len(seg))))


def phase_table(runs, labels):
    lines = ['| config | runs | window (s) | ' + ' | '.join(PHASES) + ' |',
             '|---|---:|---:|' + '---:|' * len(PHASES)]
    for label in labels:
        rows = [(r, phase_shares(r)) for r in runs if r.get('config') == label]
        rows = [(r, sh) for r, sh in rows if sh]
        if not rows:
            continue
        window = sum(r['load timeline']['end'] for r, _ in rows) / len(rows)
        lines.append(f'| {label} | {len(rows)} | {window:.1f} | ' +
                     ' | '.join(f'{sum(sh[p] for _, sh in rows) / len(rows):.2f}'
                                for p in PHASES) + ' |')
    return lines


def fmt(x, nd=2):
    return 'n/a' if x is None or (isinstance(x, float) and math.isnan(x)) else f'{x:.{nd}f}'


def write_report(runs, args, out):
    os.makedirs(out, exist_ok=True)
    labels, stats, ratios = analyse(runs, args.baseline)
    with open(os.path.join(out, f'{args.name}.json'), 'w') as f:
        json.dump({'args': {k: v for k, v in vars(args).items()}, 'runs': runs,
                   'stats': stats, 'ratios': ratios}, f, indent=1, default=str)
    failed = [r for r in runs if 'failed' in r]
    lines = [f'# App-assisted post-copy: pooled benchmark ({args.started})', '',
             f'Generated by `bench/app-assist.py {args.cmdline}`: {args.mem} TCG guest, '
             f'{args.items} Redis items of {args.size} bytes, {int(100 * args.hot)} % hot, '
             f'bandwidth {args.bandwidth * 8 / 1e9:.1f} Gbit/s.  {args.repeat} rounds; each round '
             'runs every configuration once, every other round in reverse order, so the '
             "machine's load drifts over all alike.  Mean ± half-width of the 95 % confidence "
             'interval (Student t); ratios are of means against '
             f'`{args.baseline}`, with a percentile bootstrap 95 % interval.  A name with '
             '`@` is a configuration run again under another name: the A/A control.', '',
             f'Runs: {len(runs)} ({len(failed)} failed'
             + (': ' + '; '.join(f'{r["config"]} round {r["round"]}: {r["failed"][:80]}'
                                 for r in failed) if failed else '') + ').', '',
             '| config | n | ' + ' | '.join(c for c, _, _ in METRICS) + ' |',
             '|---|---:|' + '---:|' * len(METRICS)]
    for label in labels:
        st = stats[label]
        n = max((v['n'] for v in st.values()), default=0)
        cells = []
        for col, _, _ in METRICS:
            v = st.get(col)
            cells.append('' if not v else f'{fmt(v["mean"], 1)} ± {fmt(v["ci95"], 1)}')
        lines.append(f'| {label} | {n} | ' + ' | '.join(cells) + ' |')
    lines += ['', f'## Ratios against `{args.baseline}`', '',
              '| config | ' + ' | '.join(w for c, w, _ in METRICS if c != 'setup share (%)') + ' |',
              '|---|' + '---:|' * (len(METRICS) - 1)]
    for label, rs in ratios.items():
        cells = []
        for col, _, _ in METRICS:
            if col == 'setup share (%)':
                continue
            r = rs.get(col)
            cells.append('' if not r else
                         f'{r["ratio"]:.2f}x [{r["lo"]:.2f}, {r["hi"]:.2f}]')
        lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
    lines += ['', '## Where in the window', '',
              'GETs in each part of the migration as a share of the run\'s own rate in the '
              'second before it (per-100 ms timeline; the first bucket holds the set-up, the '
              'last three the switch), averaged over the runs.', '',
              *phase_table(runs, labels)]
    lines += ['', '## Goals (issue 22)', '']
    for label, rs in ratios.items():
        if '@' in label:
            lines.append(f'- `{label}` is the A/A control: its ratios above are the noise.')
            continue
        if not label.startswith('ours'):
            # The goals are the assisted migration's; another configuration
            # (stock post-copy of our module, say) is there to compare with.
            lines.append(f'- `{label}` is a comparison, not judged against the goals.')
            continue
        for col, what, goal in METRICS:
            r = rs.get(col)
            if goal and r:
                lines.append(f'- `{label}` {what}: {r["ratio"]:.2f}x '
                             f'[{r["lo"]:.2f}, {r["hi"]:.2f}] of the baseline, goal '
                             f'{goal[0]} {goal[1]}x: {verdict(r["lo"], r["hi"], goal)}.')
        sh = stats[label].get('setup share (%)')
        if sh and not math.isnan(sh['ci95']):
            lo, hi = sh['mean'] - sh['ci95'], sh['mean'] + sh['ci95']
            lines.append(f'- `{label}` set-up: {sh["mean"]:.1f} % [{lo:.1f}, {hi:.1f}] of the '
                         f'total, goal <= {SETUP_GOAL:.0f} %: '
                         f'{verdict(lo, hi, ("<=", SETUP_GOAL))}.')
    lines += ['', f'![ratios]({args.name}.png)', '']
    with open(os.path.join(out, f'{args.name}.md'), 'w') as f:
        f.write('\n'.join(lines))
    chart(ratios, args, out)


def chart(ratios, args, out):
    """NAME.png: a panel a metric, a row a configuration, its ratio against
    the baseline with the interval."""
    plt = charts.pyplot()
    if not plt:
        return
    cols = [(c, w) for c, w, _ in METRICS if c != 'setup share (%)']
    names = list(ratios)
    if not names:
        return
    fig, axes = plt.subplots(1, len(cols), figsize=(3.2 * len(cols), 0.5 * len(names) + 1.6),
                             sharey=True)
    for ax, (col, what) in zip(axes, cols):
        rows = [i for i, n in enumerate(names) if ratios[n].get(col)]
        charts.ratio_points(ax, rows, [ratios[names[i]][col] for i in rows])
        ax.set_title(what, fontsize=8)
        charts.ratio_rows(ax, names, f'x {args.baseline}', fontsize=7)
    charts.save(fig, os.path.join(out, f'{args.name}.png'), dpi=100)
