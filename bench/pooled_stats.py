"""Statistics of the benchmarks in this directory, one copy for all of them:
means with Student t 95 % confidence intervals, geometric means of paired
ratios with their intervals, ratios of means with percentile bootstrap 95 %
intervals, the verdict on a goal read against such an interval, and the
order of the configurations in each round of an interleaved run.

A fix to any of these lands in every report at once: keep it so, and add
here what a second benchmark would otherwise copy."""

import math
import random

# Two-sided 95 % Student t quantiles by degrees of freedom (1..30)
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
       2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
       2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df):
    """The two-sided 95 % Student t quantile for @df (>= 1) degrees of
    freedom; beyond the table, its last (30), a little wide."""
    return T95[min(df, len(T95)) - 1]


def mean(xs):
    """The arithmetic mean of a non-empty sequence."""
    return sum(xs) / len(xs)


def stdev(xs, m):
    """The sample standard deviation (n - 1) of @xs, whose mean is @m."""
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def mean_ci(xs, z=None):
    """Mean and the half-width of its 95 % confidence interval: Student t's,
    or @z standard errors where the caller pools enough samples for the
    normal quantile (1.96).  The half-width is nan for a single sample."""
    n = len(xs)
    m = mean(xs)
    if n < 2:
        return m, float('nan')
    q = t95(n - 1) if z is None else z
    return m, q * stdev(xs, m) / math.sqrt(n)


def geo_mean_ci(ratios, z=None):
    """Geometric mean of paired ratios and its 95 % interval, (gm, lo, hi):
    the mean of their logs and its interval (mean_ci, @z as there), mapped
    back.  lo and hi are nan for a single ratio."""
    m, h = mean_ci([math.log(r) for r in ratios], z)
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def ratio_ci(a, b, reps=4000, seed=1):
    """mean(a) / mean(b) and a percentile bootstrap 95 % interval: (ratio,
    lo, hi).  Seeded, so the same samples give the same interval."""
    point = mean(a) / mean(b)
    rnd = random.Random(seed)
    rs = []
    for _ in range(reps):
        ra = [rnd.choice(a) for _ in a]
        rb = [rnd.choice(b) for _ in b]
        mb = mean(rb)
        if mb:
            rs.append(mean(ra) / mb)
    rs.sort()
    return point, rs[int(0.025 * len(rs))], rs[int(0.975 * len(rs)) - 1]


def verdict(lo, hi, goal):
    """A goal ('<=' or '>=', value) read against the interval [lo, hi]: met
    or not only when the whole interval says so."""
    op, v = goal
    if (op == '<=' and hi <= v) or (op == '>=' and lo >= v):
        return 'met (the whole interval)'
    if (op == '<=' and lo > v) or (op == '>=' and hi < v):
        return 'NOT met (the whole interval)'
    return 'inside the noise (the interval spans the goal)'


def in_run_order(rows, key):
    """The distinct values of @key over @rows, in the order they first
    appear: the configurations of an interleaved run as it ran them."""
    return list(dict.fromkeys(r[key] for r in rows))


def rotated(seq, k):
    """@seq rotated left by @k places (modulo its length): the order of
    round k, so that what one configuration leaves behind, and a drift of
    the machine's load, falls on every configuration alike."""
    seq = list(seq)
    if not seq:
        return seq
    k %= len(seq)
    return seq[k:] + seq[:k]


def linear_fit(xs, ys):
    """Least-squares line through the points: (intercept, slope).  A growth
    chart's 'cost = a + b n' (bench/arbiter-scale.py)."""
    mx, my = mean(xs), mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b
