"""The noise-aware gate on measured MFU and step time, over the matching history.

For each metric, a run *violates* when both hold:

1. its value (the trimmed mean of its step samples) is worse than the
   limit ``baseline x (1 - max(floor, k x sigma / baseline))``, where the
   baseline is the median of the last ``WINDOW`` matching records' values and
   sigma their MAD-estimated spread: the floor (``--max-mfu-drop``, 2%) on a
   quiet runner, k = 2.5 sigmas where runs vary more from one to the next;
2. its step samples are worse than the window's pooled samples by a
   one-sided Mann-Whitney U test at ``ALPHA`` (a few slow steps in a short
   run do not make a violation).

One violation is ``suspicious`` and passes with a warning: on a shared
runner a single slow run is common (a co-tenant, a thermal throttle).  A
``regression`` -- the gate fails -- is two consecutive violating records (the
previous matching record also violated its own window), or, with in-job
reruns (``--confirm-runs N``, a pull request's check), a violation that every
rerun repeats: there the job's own runs confirm, not main's last record (whose
violation, if real, the reruns repeat anyway; if noise, it would only add
false alarms).  With fewer than
``MIN_RECORDS`` matching records, the verdict is ``insufficient data`` and
the gate passes.

Why these numbers (docs/ci.md has the measured false-positive rate and
power behind them): a window of 20 records gives a baseline median whose own
error is a quarter of one run's; k = 2.5 puts a single noise-only run past the
limit in about 0.6% of checks where the spread sets it (fewer where the floor
does), and the second consecutive violation brings a failure to well under 1
in 1,000 while a 10% drop at 8% step noise is still confirmed within two
records (k = 3 missed 1 in 25 there); ALPHA = 0.01 keeps a run with
a handful of steps from failing on its first outlier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import statistics as st

WINDOW = 20
MIN_RECORDS = 5
K_SIGMA = 2.5
ALPHA = 0.01

#: Gated metrics and whether higher is better.
METRICS = {"mfu": True, "step_time_s": False}


def samples(record: dict[str, Any], metric: str, ref_peak: float | None) -> np.ndarray:
    """A record's step samples of ``metric``; MFU at ``ref_peak`` (a CPU measures its own peak each
    run: the runs, not the peak measurements, are compared)."""
    x = np.asarray((record.get("samples") or {}).get(metric) or [], dtype=float)
    peak = (record.get("metrics") or {}).get("peak_flops")
    if metric == "mfu" and ref_peak and peak:
        x = x * (peak / ref_peak)
    return x


def reference_peak(records: list[dict[str, Any]]) -> float | None:
    peaks = [r["metrics"]["peak_flops"] for r in records if (r.get("metrics") or {}).get("peak_flops")]
    return float(np.median(peaks)) if peaks else None


@dataclass
class Assessment:
    metric: str
    baseline: float | None
    current: float | None
    drop: float | None        # relative worsening: > 0 is worse
    limit: float | None
    p_value: float | None
    violated: bool
    note: str = ""


def assess(window: list[dict[str, Any]], current: dict[str, Any], metric: str, floor: float) -> Assessment:
    """``current`` against ``window`` (older matching records) on one metric."""
    higher = METRICS[metric]
    peak = reference_peak(window)
    base = [s for s in (samples(r, metric, peak) for r in window) if len(s)]
    cur = samples(current, metric, peak)
    if len(cur) == 0:
        return Assessment(metric, None, None, None, None, None, False, "the run has no step samples of it")
    if len(base) < MIN_RECORDS:
        return Assessment(metric, None, st.trimmed_mean(cur), None, None, None, False,
                          f"insufficient data: {len(base)} matching record(s) with it, {MIN_RECORDS} needed")
    values = np.array([st.trimmed_mean(s) for s in base])
    m = float(np.median(values))
    tol = max(floor, K_SIGMA * st.robust_sigma(values) / m)
    v = st.trimmed_mean(cur)
    drop = (m - v) / m if higher else (v - m) / m
    cur_n, base_n = _by_step_position(cur, base)
    pooled = np.concatenate(base_n)
    p = st.mann_whitney_less(cur_n, pooled) if higher else st.mann_whitney_less(-cur_n, -pooled)
    return Assessment(metric, m, v, drop, tol, p, bool(drop > tol and p < ALPHA))


def _by_step_position(cur: np.ndarray, base: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Samples divided by the window's typical shape over step positions, when the runs have the same
    steps: a training job's steps are not exchangeable (the first ones warm caches and allocators,
    every k-th one evaluates or checkpoints), and comparing raw samples would charge that
    structure to the noise.  Runs with other step counts are compared raw."""
    same = [s for s in base if len(s) == len(cur)]
    if len(same) < MIN_RECORDS:
        return cur, base
    shape = np.median(np.stack([s / st.trimmed_mean(s) for s in same]), axis=0)
    return cur / shape, [s / shape for s in same]


def gate(history: list[dict[str, Any]], current: dict[str, Any], metric: str, floor: float,
         previous_confirms: bool = True) -> dict[str, Any]:
    """The verdict on one metric: ``ok``, ``suspicious``, ``regression`` or ``insufficient data``.
    ``previous_confirms``: a violation after a violating last record is a regression (main's
    rule); off, a violation stays suspicious for in-job reruns to settle."""
    now = assess(history[-WINDOW:], current, metric, floor)
    row = {"metric": metric, "baseline": now.baseline, "current": now.current, "drop": now.drop,
           "limit": now.limit, "p_value": now.p_value, "violated": now.violated, "note": now.note}
    if now.baseline is None:
        row["verdict"] = "insufficient data" if now.current is not None else "no data"
        return row
    if not now.violated:
        row["verdict"] = "ok"
        return row
    prev = assess(history[-WINDOW - 1:-1], history[-1], metric, floor) if history and previous_confirms else None
    if prev is not None and prev.violated:
        row.update(verdict="regression", confirmed_by="the previous record violated too")
    else:
        row["verdict"] = "suspicious"
    return row


def judge_rerun(history: list[dict[str, Any]], row: dict[str, Any], rerun: dict[str, Any], floor: float) -> None:
    """A suspicious verdict's in-job rerun, assessed against the same window: ``row["reruns"]``."""
    a = assess(history[-WINDOW:], rerun, row["metric"], floor)
    row.setdefault("reruns", []).append({"current": a.current, "drop": a.drop, "p_value": a.p_value,
                                         "violated": a.violated})


def change_points(history: list[dict[str, Any]], current: dict[str, Any] | None, metric: str,
                  floor: float) -> list[dict[str, Any]]:
    """Where the metric's level shifted by at least ``floor``: the record (commit) that starts
    the new level, the levels before and after."""
    records = history + ([current] if current is not None else [])
    peak = reference_peak(records)
    pairs = [(i, st.trimmed_mean(s)) for i, s in ((i, samples(r, metric, peak)) for i, r in enumerate(records))
             if len(s)]
    if len(pairs) < 2 * MIN_RECORDS:
        return []
    idx = [i for i, _ in pairs]
    values = np.array([v for _, v in pairs])
    cps = st.change_points(values)
    bounds = [0] + cps + [len(values)]
    out = []
    for j, cp in enumerate(cps):
        before = float(np.median(values[bounds[j]:cp]))
        after = float(np.median(values[cp:bounds[j + 2]]))
        shift = (after - before) / before
        if abs(shift) >= floor:
            r = records[idx[cp]]
            out.append({"index": idx[cp], "commit": r.get("commit"), "time": r.get("time"), "before": before,
                        "after": after, "shift": shift,
                        "worse": (shift < 0) == METRICS[metric]})
    return out
