"""Statistics shared by the pooled benchmarks (bench/app_assist_pooled.py,
bench/hybrid.py --pooled): means with Student t 95 % confidence intervals,
ratios of means with percentile bootstrap 95 % intervals, and the verdict
on a goal read against such an interval."""

import math
import random

# Two-sided 95 % Student t quantiles by degrees of freedom (1..30)
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
       2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
       2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci(xs):
    """Mean and the half-width of its 95 % confidence interval."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float('nan')
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = T95[min(n - 1, len(T95)) - 1]
    return m, t * sd / math.sqrt(n)


def ratio_ci(a, b, reps=4000, seed=1):
    """mean(a) / mean(b) and a percentile bootstrap 95 % interval."""
    point = (sum(a) / len(a)) / (sum(b) / len(b))
    rnd = random.Random(seed)
    rs = []
    for _ in range(reps):
        ra = [rnd.choice(a) for _ in a]
        rb = [rnd.choice(b) for _ in b]
        mb = sum(rb) / len(rb)
        if mb:
            rs.append((sum(ra) / len(ra)) / mb)
    rs.sort()
    return point, rs[int(0.025 * len(rs))], rs[int(0.975 * len(rs)) - 1]


def verdict(lo, hi, goal):
    op, v = goal
    if (op == '<=' and hi <= v) or (op == '>=' and lo >= v):
        return 'met (the whole interval)'
    if (op == '<=' and lo > v) or (op == '>=' and hi < v):
        return 'NOT met (the whole interval)'
    return 'inside the noise (the interval spans the goal)'
