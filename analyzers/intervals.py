"""Interval arithmetic on numpy arrays: the one tool every time analysis here is built from.

An "interval set" is a pair of sorted, disjoint arrays (starts, ends), the union
of some events.  ``covered_before`` turns it into a function: how much of the
set lies before time t, so the overlap of any interval [s, e] with the set is
``covered_before(e) - covered_before(s)`` -- vectorized over millions of events.
"""
from __future__ import annotations

import numpy as np


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge possibly overlapping intervals into a sorted disjoint set."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    # A new interval begins where the start is past everything seen so far.
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.append(reach[idx[1:] - 1], reach[-1])


def length(iv: tuple[np.ndarray, np.ndarray]) -> int:
    return int((iv[1] - iv[0]).sum())


def clip(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Intervals cut to [lo, hi]; those outside are dropped."""
    s, e = np.maximum(starts, lo), np.minimum(ends, hi)
    keep = e > s
    return s[keep], e[keep]


def combine(*sets: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return union(np.concatenate([s for s, _ in sets]), np.concatenate([e for _, e in sets]))


def intersect(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The instants two disjoint interval sets share, as a disjoint set."""
    points = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]).astype(np.int64))
    if len(points) < 2:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    mid = (points[:-1] + points[1:]) / 2
    keep = _inside(a, mid) & _inside(b, mid)
    return union(points[:-1][keep], points[1:][keep])


def _inside(iv: tuple[np.ndarray, np.ndarray], t: np.ndarray) -> np.ndarray:
    s, e = iv
    i = np.searchsorted(s, t, side="right") - 1
    return (i >= 0) & (t < e[np.clip(i, 0, None)]) if len(s) else np.zeros(len(t), bool)


def covered_before(iv: tuple[np.ndarray, np.ndarray], t: np.ndarray) -> np.ndarray:
    """Length of the interval set that lies before each time in ``t``."""
    s, e = iv
    t = np.asarray(t, dtype=np.int64)
    if s.size == 0:
        return np.zeros(t.shape, dtype=np.int64)
    done = np.concatenate([[0], np.cumsum(e - s)])
    i = np.searchsorted(s, t, side="right")  # intervals starting at or before t
    partial = np.where(i > 0, np.minimum(t, e[np.maximum(i - 1, 0)]) - s[np.maximum(i - 1, 0)], 0)
    return done[np.maximum(i - 1, 0)] * (i > 0) + np.maximum(partial, 0)


def overlap(iv: tuple[np.ndarray, np.ndarray], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For each interval [start, end]: how much of it the set covers."""
    return covered_before(iv, ends) - covered_before(iv, starts)


def assign_by_priority(window: tuple[int, int], categories: list[tuple[str, tuple[np.ndarray, np.ndarray]]],
                       rest: str) -> dict[str, int]:
    """Split the window's time among categories: each instant goes to the first category (in the
    given order) whose intervals cover it, else to ``rest``.  The parts add up to the window."""
    lo, hi = window
    covered = (np.empty(0, np.int64), np.empty(0, np.int64))
    out: dict[str, int] = {}
    done = 0
    for name, (s, e) in categories:
        s, e = clip(s, e, lo, hi)
        if s.size == 0:
            continue
        covered = combine(covered, (s, e))
        now = length(covered)
        if now > done:
            out[name] = out.get(name, 0) + now - done
            done = now
    out[rest] = out.get(rest, 0) + (hi - lo) - done
    return out


def assign_by_priority_within(windows: tuple[np.ndarray, np.ndarray],
                              categories: list[tuple[str, tuple[np.ndarray, np.ndarray]]], rest: str) -> dict[str, int]:
    """:func:`assign_by_priority` over a disjoint set of windows at once (their union, not one
    window after another): each category's instants inside the windows not taken by an earlier
    one; ``rest`` the windows' instants no category covers."""
    covered = (np.empty(0, np.int64), np.empty(0, np.int64))
    out: dict[str, int] = {}
    done = 0
    for name, interval_set in categories:
        part = intersect(interval_set, windows)
        if part[0].size == 0:
            continue
        covered = combine(covered, part)
        now = length(covered)
        if now > done:
            out[name] = out.get(name, 0) + now - done
            done = now
    out[rest] = out.get(rest, 0) + length(windows) - done
    return out


def segments_by_priority(window: tuple[int, int], categories: list[tuple[str, tuple[np.ndarray, np.ndarray]]],
                         rest: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The same split as :func:`assign_by_priority`, kept in time order: (starts, ends, names), one
    segment per run of the same category, covering the window without gaps."""
    lo, hi = window
    if hi <= lo:  # an instant step marker: nothing to split
        return np.empty(0, np.int64), np.empty(0, np.int64), []
    clipped = [(name, clip(s, e, lo, hi)) for name, (s, e) in categories]
    edges = np.unique(np.concatenate([[lo, hi]] + [np.concatenate([s, e]) for _, (s, e) in clipped]))
    a, b = edges[:-1], edges[1:]
    names = list(dict.fromkeys([n for n, _ in clipped] + [rest]))  # one code per name (a plan may repeat one)
    code_of = [names.index(n) for n, _ in clipped]
    owner = np.full(a.size, names.index(rest), dtype=np.int64)
    for i in range(len(clipped) - 1, -1, -1):                 # lowest priority first; higher ones overwrite
        s, e = clipped[i][1]
        if s.size:
            owner[overlap((s, e), a, b) > 0] = code_of[i]
    change = np.flatnonzero(np.diff(owner)) + 1               # merge runs of one name
    first = np.concatenate([[0], change])
    return a[first], np.append(a[change], b[-1]), [names[k] for k in owner[first]]


def dominant_runs(starts: np.ndarray, ends: np.ndarray, codes: np.ndarray, lo: int, hi: int,
                  bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint coded segments seen at ``bins`` pixels across [lo, hi]: each bin takes the code that
    covers most of it, and neighbouring bins of one code merge.  Bins nothing covers are dropped.
    Returns (starts, ends, codes) of at most ``bins`` segments."""
    present = np.unique(codes)
    if present.size == 0 or hi <= lo:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, codes.dtype)
    # integer edges: float linspace at ns-since-epoch magnitudes (1e18) rounds to 256 ns steps
    bins = int(min(bins, hi - lo))
    edges = lo + np.arange(bins + 1, dtype=np.int64) * (hi - lo) // bins
    cover = np.stack([np.diff(covered_before((starts[codes == c], ends[codes == c]), edges)) for c in present])
    best = cover.argmax(axis=0)
    keep = cover.max(axis=0) > 0
    code = np.where(keep, present[best], -1)
    change = np.flatnonzero(np.diff(code)) + 1
    first = np.concatenate([[0], change])
    last = np.append(change, bins)
    run_code = code[first]
    ok = run_code >= 0
    return edges[first][ok], edges[last][ok], run_code[ok]
