"""The collectors' step table as the analyses read it, less the steps the collectors themselves
took over.

A profiled window ends with its trace (and memory timeline) exported on the training thread: on a
CPU run of this size it takes seconds, on a GPU job's window of hundreds of MB tens of seconds,
and every peer waits for the exporting rank at its next collective, so the whole step is the
profiler's, not one rank's share of it.  Counted as training, one such step made a 245 ms job's
mean step 2.6 s and its MFU ten times too low.  ``steps.parquet`` records the collectors' own work
inside each step (``collector_ns``); a step where it exceeds :data:`COLLECTOR_SHARE` of the job's
median step is left out of the step-time statistics and MFU, and its time out of goodput's span.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from mfuscope import run_dir

#: a step where the collectors worked more than this share of the job's median step is theirs
COLLECTOR_SHARE = 0.10


def read(run: str | Path | None) -> pd.DataFrame | None:
    """rank, step, start_ns, end_ns, seconds, tokens, collector_s of a run directory's
    ``steps.parquet`` (None without one; collector_s is 0 in runs written before the collectors
    recorded it)."""
    if run is None or not (Path(run) / run_dir.STEPS).exists():
        return None
    steps = run_dir.read_table(run, run_dir.STEPS).select(
        ["rank", "step", "start_ns", "end_ns", "tokens", "collector_ns"]).to_pandas()
    return pd.DataFrame({"rank": steps["rank"], "step": steps["step"], "start_ns": steps["start_ns"],
                         "end_ns": steps["end_ns"],
                         "seconds": (steps["end_ns"] - steps["start_ns"]) / 1e9, "tokens": steps["tokens"],
                         "collector_s": steps["collector_ns"].fillna(0) / 1e9})


def collectors_steps(rows: pd.DataFrame) -> dict[int, float]:
    """{step: the collectors' seconds in it} for the steps they dominated (any rank's work over
    :data:`COLLECTOR_SHARE` of the job's median step: its slowest rank's, every step counted)."""
    if rows is None or rows.empty:
        return {}
    job = rows.groupby("step")["seconds"].max()
    theirs = rows.groupby("step")["collector_s"].max()
    taken = theirs[theirs > COLLECTOR_SHARE * float(job.median())]
    return {int(s): float(v) for s, v in taken.items()}


def without_collectors(rows: pd.DataFrame) -> tuple[pd.DataFrame, dict[int, float]]:
    """The rows less the collectors' steps, and those steps (:func:`collectors_steps`)."""
    taken = collectors_steps(rows)
    return (rows[~rows["step"].isin(list(taken))] if taken else rows), taken


def left_out_text(taken: dict[int, float]) -> str:
    """How the step statistics name the steps they left out."""
    if not taken:
        return ""
    steps = ", ".join(map(str, sorted(taken)[:6])) + (", ..." if len(taken) > 6 else "")
    return (f", step{'s' if len(taken) > 1 else ''} {steps} left out (the collectors wrote their files: "
            f"{sum(taken.values()):.1f} s)")
