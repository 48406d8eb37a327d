"""Stragglers: ranks whose own work makes everyone else wait.

From the breakdown, each rank and step splits into wait (exposed communication
and pipeline bubble) and busy (everything else: compute, host work, idle gaps
between operators).  Ranks of one job that do the same work are busy for the
same time; a rank busy for longer holds the others up at the next collective,
and they wait exactly that long.  Per step, a rank is an outlier when its busy
time exceeds the median of the other ranks by more than max(3 scaled MADs of
the cohort, 5% of that median) -- the center leaves the candidate out, so a
straggler does not pull up the median it is measured from; a straggler is an
outlier in at least half the steps.
Its cost is the median over steps of how much longer it was busy than the
others' median: the time it took from everyone else.

Pipeline stages do different work, so with pipeline parallelism ranks are
compared within their stage (the manifest's rank coordinates say which).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def find(per_rank_step: pd.DataFrame,
         stage_of: dict[int, int] | None = None) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """(stragglers [{rank, cost_s, steps}], the rank x step matrix of busy and wait seconds).
    ``stage_of``: rank -> pipeline stage (:attr:`Manifest.stages <mfuscope.manifest.Manifest.stages>`);
    a rank is compared with its stage's."""
    df = per_rank_step.copy()
    if df.empty:
        return [], df
    stage = stage_of or {}
    df["cohort"] = df["rank"].map(lambda r: stage.get(int(r), 0))
    med, mad = _others(df)
    df["excess_s"] = df["busy_s"] - med
    df["outlier"] = df["excess_s"] > pd.concat([3 * mad, 0.05 * med], axis=1).max(axis=1)
    out = []
    for rank, r in df.groupby("rank"):
        if r["outlier"].mean() >= 0.5 and len(r) > 0:
            out.append({"rank": int(rank), "cost_s": float(r["excess_s"].median()),
                        "steps": [int(s) for s in r.loc[r["outlier"], "step"]]})
    out.sort(key=lambda x: -x["cost_s"])
    return out, df[["rank", "step", "step_s", "busy_s", "wait_s", "excess_s", "outlier"]]


def _others(df: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per row: the median busy time of the *other* ranks of its cohort and step, and the scaled
    MAD of the whole cohort.  The center leaves the candidate out, so a straggler in a small cohort
    (four ranks of a pipeline stage) does not pull up the median it is measured from; the spread
    keeps it, where it is one deviation of n and moves the MAD little, while a MAD of three values
    alone can be near zero and would name ordinary noise.  A cohort of two keeps both ranks.
    O(n log n) a cohort-step (:func:`leave_one_out_median`), so thousands of ranks cost little."""
    med = pd.Series(index=df.index, dtype=float)
    mad = pd.Series(index=df.index, dtype=float)
    for _, g in df.groupby(["cohort", "step"]):
        values = g["busy_s"].to_numpy(dtype=float)
        spread = float(np.median(np.abs(values - np.median(values)))) * 1.4826
        med[g.index] = leave_one_out_median(values) if len(values) > 2 else np.median(values)
        mad[g.index] = spread
    return med, mad


def leave_one_out_median(values: np.ndarray) -> np.ndarray:
    """For each element, the median of all the others along the first axis (each column of a 2-D
    array on its own), in O(n log n): sorted once, the others' middle is the sorted array's middle
    shifted past the element's own position."""
    v = np.asarray(values, dtype=float)
    n = v.shape[0]
    if n < 2:
        return v.copy()
    order = np.argsort(v, axis=0, kind="stable")
    ranked = np.take_along_axis(v, order, axis=0)
    pos = np.argsort(order, axis=0, kind="stable")  # each element's place in the sorted order

    def kth_of_others(k: int) -> np.ndarray:  # the k-th smallest once each element is removed
        return np.where(k < pos, ranked[k], ranked[min(k + 1, n - 1)])

    m = n - 1
    if m % 2:
        return kth_of_others((m - 1) // 2)
    return (kth_of_others(m // 2 - 1) + kth_of_others(m // 2)) / 2
