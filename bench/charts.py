"""Charts of the benchmarks in this directory, one copy for all of them:
matplotlib without a display, a figure laid out, written and freed, and the
pieces that more than one report draws (ratios with their intervals on
labelled rows, bars of several series side by side).

The numbers a chart shows come from bench/pooled_stats.py; this module only
draws them."""

import sys

_missing_said = False


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), or None
    if matplotlib is missing: the report is then written without its
    charts, which stderr says once per process."""
    global _missing_said
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        if not _missing_said:
            print('matplotlib missing: no chart', file=sys.stderr)
            _missing_said = True
        return None
    return plt


def save(fig, path, dpi):
    """Lay @fig out, write it to @path as PNG at @dpi, and free it (a
    pooled report is redrawn after every run)."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def ratio_points(ax, ys, rs, **kw):
    """Ratios as dots at heights @ys, each with its interval as a horizontal
    error bar; @rs are dicts of 'ratio', 'lo' and 'hi' (as from
    pooled_stats.ratio_ci), @kw go to errorbar (a colour, say)."""
    ax.errorbar([r['ratio'] for r in rs], ys,
                xerr=[[r['ratio'] - r['lo'] for r in rs],
                      [r['hi'] - r['ratio'] for r in rs]],
                fmt='o', capsize=3, **kw)


def ratio_rows(ax, labels, xlabel, **xlabel_kw):
    """The frame of a chart of ratio_points: a grey line at 1 (no change),
    one row a label from the bottom up, and the x axis's label."""
    ax.axvline(1.0, color='grey', lw=0.8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel(xlabel, **xlabel_kw)


def grouped_bars(ax, groups, series, width):
    """Bars of several series side by side in each group: @series is a list
    of (label, values), a value per group; each bar @width wide, the
    group's tick (its label from @groups) under the middle of its bars."""
    k = len(series)
    for j, (label, values) in enumerate(series):
        ax.bar([i + (j - (k - 1) / 2) * width for i in range(len(groups))], values, width,
               label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
