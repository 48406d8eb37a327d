"""Stragglers: ranks whose own work makes everyone else wait.

From the breakdown, each rank and step splits into wait (exposed communication
and pipeline bubble) and busy (everything else: compute, host work, idle gaps
between operators).  Ranks of one job that do the same work are busy for the
same time; a rank busy for longer holds the others up at the next collective,
and they wait exactly that long.  Per step, a rank is an outlier when its busy
time exceeds the median rank's by more than max(3 scaled MADs, 5% of the
median); a straggler is an outlier in at least half the steps.  Its cost is the
median over steps of how much longer it was busy than the median rank: the
time it took from everyone else.

Pipeline stages do different work, so with pipeline parallelism ranks are
compared within their stage (the manifest's rank coordinates say which).
"""
from __future__ import annotations

from typing import Any

import pandas as pd


def find(per_rank_step: pd.DataFrame, rank_coords: dict | None = None) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """(stragglers [{rank, cost_s, steps}], the rank x step matrix of busy and wait seconds)."""
    df = per_rank_step.copy()
    if df.empty:
        return [], df
    stage = {int(r): c.get("pp", 0) for r, c in (rank_coords or {}).items()}
    df["cohort"] = df["rank"].map(lambda r: stage.get(int(r), 0))
    med = df.groupby(["cohort", "step"])["busy_s"].transform("median")
    mad = df.groupby(["cohort", "step"])["busy_s"].transform(lambda s: (s - s.median()).abs().median()) * 1.4826
    df["excess_s"] = df["busy_s"] - med
    df["outlier"] = df["excess_s"] > pd.concat([3 * mad, 0.05 * med], axis=1).max(axis=1)
    out = []
    for rank, r in df.groupby("rank"):
        if r["outlier"].mean() >= 0.5 and len(r) > 0:
            out.append({"rank": int(rank), "cost_s": float(r["excess_s"].median()),
                        "steps": [int(s) for s in r.loc[r["outlier"], "step"]]})
    out.sort(key=lambda x: -x["cost_s"])
    return out, df[["rank", "step", "step_s", "busy_s", "wait_s", "excess_s", "outlier"]]
