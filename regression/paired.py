"""The pull request's gate on step time: its run against a run of main's code in the same job.

Why not the history alone: a shared machine drifts.  For a minute at a time a co-tenant slows
every run, a run and its in-job rerun alike, and against main's history (recorded at other times)
that reads as a regression -- on a recorded history of 60 real runs of one commit, 13 of 54 pull
request checks failed where the gate's nominal rate allows 2 (docs/ci.md, "Measured on real
runs").  A run of main's code trained right before the pull request's, on the same machine,
meets the same minute.

The rule (on that history, :func:`mfuscope.regression.replay.paired`: no false positive in 57
checks; docs/ci.md has its power, and what it costs against the history gate's):

- a run's **level** is the 10% quantile of its step times: a co-tenant only ever adds time, so a
  run's fastest steps show its code's speed;
- a **pair** (main's run, then the pull request's) **violates** when the pull request's level is
  above main's by more than its limit: ``threshold`` (5%), or :data:`K_SIGMA` standard errors of
  the two levels' ratio where the runs' own steps are noisier than that allows.  The standard
  error of a sample quantile is ``sqrt(q (1 - q) / n) / f(x_q)``; for normal steps of relative
  spread ``cv`` that is :data:`QUANTILE_SE` x ``cv / sqrt(n)`` (1.71 at q = 0.1), and a ratio of
  two adds the two in quadrature.  At 8% step noise and 20 steps a fixed 5% made a pair violate in
  12% of noise-only pairs and a check fail in 1.3% (both pairs), over the gate's 0.5%; at
  K_SIGMA = 1.65 a pair violates in 5% (one-sided), a check fails in 0.25% where the steps are
  near normal (simulated, :func:`.simulate.paired_fail_rate`: 0.20% at 8% and at 10%);
- a violating pair is trained again (main's code first, as before), up to ``confirm_runs`` more
  pairs; the gate fails when every pair violates.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import statistical
from . import statistics as st

#: The step-time quantile that stands for a run's speed.
QUANTILE = 0.1
#: How much slower (the pull request's level over main's, minus 1) a pair may be at least (docs/ci.md).
THRESHOLD = 0.05
#: The limit in standard errors of the levels' ratio, where that is wider than THRESHOLD: a pair's
#: one-sided 5%, so that two pairs in a row come to 0.25%, under the gate's 0.5% a check.
K_SIGMA = 1.65
#: A normal sample's QUANTILE standard error, in sigmas times sqrt(n): sqrt(q (1 - q)) / phi(z_q).
QUANTILE_SE = 1.709
#: The metric the pair compares, as the row names it.
METRIC = "paired step_time_s"


def level(record: dict[str, Any], quantile: float = QUANTILE) -> float | None:
    """A run's speed: the ``quantile`` of its step times (None without step samples)."""
    s = statistical.samples(record, "step_time_s", None)
    return float(np.quantile(s, quantile)) if len(s) else None


def slower(head: dict[str, Any], main: dict[str, Any], quantile: float = QUANTILE) -> float | None:
    """How much slower the pull request's run is than main's: its level over main's, minus 1."""
    h, m = level(head, quantile), level(main, quantile)
    return None if h is None or m is None or m <= 0 else h / m - 1


def ratio_se(head: dict[str, Any], main: dict[str, Any]) -> float:
    """The standard error of the two runs' level ratio, from each run's own step spread (MAD-scaled,
    so a co-tenant's few slow steps do not widen it)."""
    var = 0.0
    for r in (head, main):
        s = statistical.samples(r, "step_time_s", None)
        if len(s) < 2:
            return 0.0
        var += (QUANTILE_SE * st.robust_sigma(s) / float(np.median(s))) ** 2 / len(s)
    return float(np.sqrt(var))


def limit(head: dict[str, Any], main: dict[str, Any], threshold: float = THRESHOLD) -> float:
    """How much slower the pull request's run may be: ``threshold``, or K_SIGMA standard errors."""
    return max(threshold, K_SIGMA * ratio_se(head, main))


def gate(head: dict[str, Any], main: dict[str, Any], threshold: float = THRESHOLD, *,
         rerun_pair: Callable[[int], tuple[dict[str, Any], dict[str, Any]]] | None = None,
         confirm_runs: int = 0) -> dict[str, Any]:
    """The verdict on the pair, shaped as the statistical gate's rows (``baseline``: main's level,
    ``current``: the pull request's, ``drop``: how much slower, ``limit``: :func:`limit`).
    ``rerun_pair(i)`` trains the i-th further pair and returns (the pull request's record, main's)."""
    first, lim = slower(head, main), limit(head, main, threshold)
    row: dict[str, Any] = {"metric": METRIC, "baseline": level(main), "current": level(head), "drop": first,
                           "limit": lim, "p_value": None, "violated": first is not None and first > lim,
                           "note": f"each run's {QUANTILE:.0%} quantile step time, main's code trained in this job"}
    differs = sorted(k for k in set(head["fingerprint"]) | set(main["fingerprint"])
                     if head["fingerprint"].get(k) != main["fingerprint"].get(k))
    if differs:  # another layout or device: not the same work, so not a measure of the code
        row.update(verdict="insufficient data", violated=False,
                   note=f"main's run is not the same job ({', '.join(differs)} differ): not compared")
        return row
    if first is None:
        row["verdict"] = "no data"
        return row
    if not row["violated"]:
        row["verdict"] = "ok"
        return row
    row["verdict"] = "suspicious"
    done = 0
    while rerun_pair is not None and done < confirm_runs and row["violated"]:
        h, m = rerun_pair(done)
        done += 1
        s, lim = slower(h, m), limit(h, m, threshold)
        row.setdefault("reruns", []).append({"current": level(h), "baseline": level(m), "drop": s, "limit": lim,
                                             "violated": s is not None and s > lim})
        row["violated"] = row["reruns"][-1]["violated"]
    if done and done == confirm_runs and row["violated"]:
        row.update(verdict="regression", confirmed_by=f"{done} more pair(s) in the job were slower too")
    return row
