"""Pipeline bubbles: each stage's time waiting on its neighbours, against the schedule's theory.

Measured per rank and step: the breakdown's ``bubble`` leaf (the training
thread or device blocked on pipeline sends/receives) plus the time the rank's
own step is shorter than the job's (the slowest rank's): a last stage finishes
its backwards early and then waits for the first stage to drain -- the same
bubble, spent at the step boundary.  Over the pipeline's time: the job's step
minus the rank's other exposed communication (data-parallel gathers, ...),
which the theory does not model.  Per stage: mean of its ranks, median over
steps.  ``share_of_step`` is that bubble over the job's whole step.  Theory for p stages and m microbatches:
(p-1)/(m+p-1) of the step for GPipe and 1F1B, divided by the virtual stages v
for interleaved 1F1B (Narayanan et al. 2021); zero-bubble schedules aim lower,
and are compared with the 1F1B figure.  Stage imbalance: the slowest stage's
busy time over the mean stage's, minus one.
"""
from __future__ import annotations

from typing import Any

import pandas as pd


def theory(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (m + p - 1) / max(v, 1)


def analyze(leaves: pd.DataFrame, per_rank_step: pd.DataFrame, manifest: dict | None) -> dict[str, Any] | None:
    manifest = manifest or {}
    layout = manifest.get("layout") or {}
    p = int(layout.get("pp") or 1)
    if p <= 1 or leaves.empty:
        return None
    sched = manifest.get("schedule") or {}
    m, v = int(sched.get("microbatches") or 1), int(sched.get("virtual_stages") or 1)
    coords = manifest.get("rank_coords") or {}
    stage_of = {int(r): int(c.get("pp", 0)) for r, c in coords.items()}
    bubble = leaves[leaves["leaf"] == "bubble"].groupby(["rank", "step"])["seconds"].sum()
    df = per_rank_step.set_index(["rank", "step"]).assign(bubble_s=bubble).fillna({"bubble_s": 0.0}).reset_index()
    df["stage"] = df["rank"].map(stage_of)
    job_step = df.groupby("step")["step_s"].transform("max")
    waited = df["bubble_s"] + (job_step - df["step_s"])
    other_comm = df["wait_s"] - df["bubble_s"]
    df["fraction"] = waited / (job_step - other_comm)
    df["share"] = waited / job_step
    stages = []
    for stage, g in df.groupby("stage"):
        per_step = g.groupby("step")[["fraction", "share", "busy_s"]].mean()
        stages.append({"stage": int(stage), "bubble_fraction": float(per_step["fraction"].median()),
                       "share_of_step": float(per_step["share"].median()),
                       "busy_s": float(per_step["busy_s"].median())})
    busy = [s["busy_s"] for s in stages]
    measured = sum(s["bubble_fraction"] for s in stages) / len(stages)
    expected = theory(p, m, v)
    return {"schedule": sched.get("name"), "stages": p, "microbatches": m, "virtual_stages": v,
            "bubble_fraction": measured, "theory_fraction": expected,
            "share_of_step": sum(s["share_of_step"] for s in stages) / len(stages),
            "vs_theory": measured / expected if expected else None,
            "imbalance": max(busy) / (sum(busy) / len(busy)) - 1 if sum(busy) else 0.0, "per_stage": stages}
