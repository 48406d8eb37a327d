"""Pipeline bubbles: each stage's time waiting on its neighbours, against the schedule's theory.

Measured per rank and step: the breakdown's ``bubble`` leaf (the training
thread or device blocked on pipeline sends/receives) plus the time the rank's
own step is shorter than the job's (the slowest rank's): a last stage finishes
its backwards early and then waits for the first stage to drain -- the same
bubble, spent at the step boundary.  Per stage: mean of its ranks, median over
steps.

Two bases, each figure labelled with its own:

- ``bubble_fraction`` -- of the **pipeline's time**: the job's step minus the
  rank's other exposed communication (data-parallel gathers, ...), which no
  schedule theory models.  Theory is on this basis, so ``vs_theory`` compares
  like with like.
- ``share_of_step`` -- of the **whole step**, what the step would lose.

Theory, on the pipeline-time basis: idle / (idle + m * T), where a rank's work
per microbatch is T = F + B + W (forward, input-gradient backward,
weight-gradient pass; W is part of B outside zero-bubble schedules) and idle
is, for p stages and v chunks per rank:

==================  =====================================  ============================
schedule            idle                                   source
==================  =====================================  ============================
gpipe, 1f1b         (p-1) T                                Narayanan et al. 2021
interleaved_1f1b    (p-1) T / v                            Narayanan et al. 2021
zero_bubble         (p-1) max(F + B - W, 0) / v            ZB-H1 (Qi et al. 2024),
                                                           spread over v chunks
zbv                 (p-1) max(F + B - 2W, 0) / 2           ZB-V: ZB-H2's bubble at
                                                           half the chunk size
==================  =====================================  ============================

For 1F1B this is the familiar (p-1)/(m+p-1).  F, B and W are the rank's
measured times per microbatch from the pipeline's action labels (``PP:0F1``,
``mfuscope.pp/0W1``); without them a zero-bubble theory takes F = B = W, the
paper's comparison, and says so.  Stage imbalance: the slowest stage's busy
time over the mean stage's, minus one.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from mfuscope.layout import ZERO_BUBBLE
from mfuscope.manifest import Manifest

BASIS = "of the pipeline's time (the step minus other exposed communication)"


def theory(p: int, m: int, v: int = 1, schedule: str | None = None,
           phases: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:
    """The bubble as a fraction of the pipeline's time; ``phases`` = (F, B, W) in any one unit."""
    f, b, w = phases
    work = f + b + w
    if schedule == "zero_bubble":
        idle = (p - 1) * max(f + b - w, 0.0) / max(v, 1)
    elif schedule == "zbv":
        idle = (p - 1) * max(f + b - 2 * w, 0.0) / 2
    else:
        idle = (p - 1) * work / max(v, 1)
    return idle / (idle + m * work) if work > 0 else 0.0


def formula(schedule: str | None) -> str:
    return {"zero_bubble": "(p-1)(F+B-W)/v idle", "zbv": "(p-1)(F+B-2W)/2 idle"}.get(
        schedule or "", "(p-1)T/v idle" if schedule == "interleaved_1f1b" else "(p-1)/(m+p-1)")


def phase_times(microbatches: pd.DataFrame | None) -> dict[str, float] | None:
    """Median over ranks and steps of a rank's F, B and W seconds per microbatch, from the
    executed schedule's labels; None where the trace has no labels."""
    if microbatches is None or microbatches.empty:
        return None
    mb = microbatches.assign(seconds=(microbatches["end_ns"] - microbatches["start_ns"]) / 1e9)
    per = mb.groupby(["rank", "step", "action"])["seconds"].sum().unstack("action", fill_value=0.0)
    count = mb[mb["action"] == "F"].groupby(["rank", "step"])["microbatch"].nunique()
    per = per.div(count, axis=0).dropna()
    if per.empty or "F" not in per:
        return None
    return {a: float(per[a].median()) if a in per else 0.0 for a in ("F", "B", "W")}


def analyze(leaves: pd.DataFrame, per_rank_step: pd.DataFrame, manifest: Manifest | dict | None,
            microbatches: pd.DataFrame | None = None) -> dict[str, Any] | None:
    manifest = Manifest.of(manifest)
    p = manifest.pp
    if p <= 1 or leaves.empty:
        return None
    sched = manifest.schedule
    name = sched.get("name")
    m, v = int(sched.get("microbatches") or 1), int(sched.get("virtual_stages") or 1)
    stage_of = manifest.stages
    bubble = leaves[leaves["leaf"] == "bubble"].groupby(["rank", "step"])["seconds"].sum()
    df = per_rank_step.set_index(["rank", "step"]).assign(bubble_s=bubble).fillna({"bubble_s": 0.0}).reset_index()
    df["stage"] = df["rank"].map(stage_of)
    job_step = df.groupby("step")["step_s"].transform("max")
    df["waited_s"] = df["bubble_s"] + (job_step - df["step_s"])
    df["pipeline_s"] = job_step - (df["wait_s"] - df["bubble_s"])
    df["fraction"] = df["waited_s"] / df["pipeline_s"]
    df["share"] = df["waited_s"] / job_step
    stages = []
    for stage, g in df.groupby("stage"):
        per_step = g.groupby("step")[["fraction", "share", "busy_s", "waited_s", "pipeline_s"]].mean()
        stages.append({"stage": int(stage), "bubble_fraction": float(per_step["fraction"].median()),
                       "share_of_step": float(per_step["share"].median()),
                       "busy_s": float(per_step["busy_s"].median()),
                       "bubble_s": float(per_step["waited_s"].median()),
                       "pipeline_s": float(per_step["pipeline_s"].median())})
    busy = [s["busy_s"] for s in stages]
    mean = lambda key: sum(s[key] for s in stages) / len(stages)  # noqa: E731
    measured = mean("bubble_fraction")
    phases = phase_times(microbatches)
    if name in ZERO_BUBBLE:
        basis = ("measured F/B/W per microbatch" if phases and phases["W"] > 0
                 else "F = B = W assumed (no weight-gradient labels in the trace)")
        use = (phases["F"], phases["B"], phases["W"]) if phases and phases["W"] > 0 else (1.0, 1.0, 1.0)
    else:
        basis, use = "independent of the phase times", (1.0, 1.0, 0.0)
    expected = theory(p, m, v, name, use)
    return {"schedule": name, "stages": p, "microbatches": m, "virtual_stages": v,
            "basis": BASIS, "bubble_fraction": measured, "theory_fraction": expected,
            "theory_at_2m": theory(p, 2 * m, v, name, use),
            "theory_formula": formula(name), "theory_phases": basis, "phase_times_s": phases,
            "share_of_step": mean("share_of_step"), "bubble_s": mean("bubble_s"), "pipeline_s": mean("pipeline_s"),
            "vs_theory": measured / expected if expected else None,
            "imbalance": max(busy) / (sum(busy) / len(busy)) - 1 if sum(busy) else 0.0, "per_stage": stages}
