"""The statistics the noise-aware gate needs, in numpy (no scipy): robust location and spread,
a one-sided Mann-Whitney U test, and PELT change points.

Why these:

- A record's value is the 10%-trimmed mean of its step samples: nearly the
  mean's efficiency on well-behaved steps (a 10% drop at 8% noise is seen in
  20 steps) while one garbage-collection pause or page-fault storm does not
  move it.
- The history's spread is the MAD scaled to a normal sigma (1.4826 x MAD):
  a past regression or a one-off slow runner in the window does not widen
  the limit the way a standard deviation would.
- Mann-Whitney U compares the current run's step samples with the
  baseline's without assuming normal step times (they are skewed: a step is
  never faster than its compute, often slower); normal approximation with
  the tie correction, which is accurate from about 8 samples a side.
- PELT (Killick, Fearnhead & Eckley 2012) finds the commits where the level
  of a series shifted, exactly and in linear time on average, with a
  mean-shift Gaussian cost whose noise is estimated robustly from first
  differences (which a level shift barely touches); each change point is
  then placed at the best split between its neighbours.
"""
from __future__ import annotations

import math

import numpy as np

#: Share trimmed from each end for a record's value.
TRIM = 0.1
#: MAD to a normal distribution's standard deviation.
MAD_SIGMA = 1.4826


def trimmed_mean(x, trim: float = TRIM) -> float:
    a = np.sort(np.asarray(x, dtype=float))
    k = int(len(a) * trim)
    return float(a[k:len(a) - k].mean()) if len(a) > 2 * k else float(a.mean())


def robust_sigma(x) -> float:
    a = np.asarray(x, dtype=float)
    return float(MAD_SIGMA * np.median(np.abs(a - np.median(a))))


def mann_whitney_less(x, y) -> float:
    """One-sided p-value that ``x`` tends to be smaller than ``y`` (H1: P(X < Y) > 1/2)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    both = np.concatenate([x, y])
    order = np.argsort(both, kind="mergesort")
    sorted_ = both[order]
    ranks = np.empty(len(both))
    # average ranks over ties
    starts = np.flatnonzero(np.r_[True, sorted_[1:] != sorted_[:-1]])
    ends = np.r_[starts[1:], len(both)]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each tie block
    ranks[order] = np.repeat(avg, ends - starts)
    u1 = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0
    t = (ends - starts).astype(float)
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - (t ** 3 - t).sum() / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u1 - n1 * n2 / 2.0 + 0.5) / math.sqrt(var)  # continuity correction toward H0
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def noise_sigma(x) -> float:
    """The noise level of a series with level shifts: the MAD of first differences over sqrt(2)."""
    a = np.asarray(x, dtype=float)
    if len(a) < 3:
        return float("nan")
    return robust_sigma(np.diff(a)) / math.sqrt(2.0)


def change_points(x, penalty: float | None = None, min_size: int = 2) -> list[int]:
    """PELT on a Gaussian mean-shift cost: indices i where a new level starts at x[i].

    ``penalty`` in units of the noise variance; default 3 log n (BIC's 2 log n for the two new
    parameters of each change, raised by half again so noise alone rarely makes one)."""
    a = np.asarray(x, dtype=float)
    n = len(a)
    if n < 2 * min_size:
        return []
    sigma = noise_sigma(a)
    if not sigma > 0:
        return []
    z = (a - np.median(a)) / sigma
    s1 = np.r_[0.0, np.cumsum(z)]
    s2 = np.r_[0.0, np.cumsum(z * z)]
    beta = 3.0 * math.log(n) if penalty is None else penalty
    f = np.full(n + 1, np.inf)
    f[0] = -beta
    last = np.zeros(n + 1, dtype=int)
    candidates = np.array([0])
    for t in range(min_size, n + 1):
        length = t - candidates
        ready = length >= min_size
        cost = np.where(ready, s2[t] - s2[candidates] - (s1[t] - s1[candidates]) ** 2 / np.maximum(length, 1), 0.0)
        total = np.where(ready, f[candidates] + cost + beta, np.inf)
        best = int(np.argmin(total))
        f[t], last[t] = total[best], candidates[best]
        # PELT's pruning (exact for this cost): a start that cannot beat f[t] now never will
        keep = ~ready | (f[candidates] + cost <= f[t])
        candidates = np.r_[candidates[keep], t]
    out, t = [], n
    while t > 0:
        t = int(last[t])
        if t > 0:
            out.append(t)
    return _refine(sorted(out), s1, s2, n)


def _refine(cps: list[int], s1: np.ndarray, s2: np.ndarray, n: int) -> list[int]:
    """Each change point moved to the best split between its neighbours, one-point segments
    allowed: PELT's minimum segment puts a shift at the newest record one record early (the last
    segment needs two), which would name the commit before the one that made it."""
    def cost(a, b):
        return s2[b] - s2[a] - (s1[b] - s1[a]) ** 2 / (b - a)
    out = list(cps)
    for i in range(len(out)):
        lo, hi = (out[i - 1] if i else 0), (out[i + 1] if i + 1 < len(out) else n)
        if hi - lo < 2:
            continue
        splits = np.arange(lo + 1, hi)
        total = cost(lo, splits) + cost(splits, hi)
        out[i] = int(splits[int(np.argmin(total))])
    return out
