"""A measured run beside the model's prediction for it, leaf by leaf (``analyze --predict``, the
dashboard's Overview).

Which profile predicts: the one given (``--hardware``); else, for a GPU run,
the profile fitted on the published runs; for a CPU run, whose host-core
"device" no published profile describes, one fitted to the run itself -- an
in-sample comparison, and the note says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import calibrate, measured
from .model import Prediction
from .system import Profile, default_profile


@dataclass
class Comparison:
    run: measured.MeasuredRun
    prediction: Prediction
    rows: list[dict[str, Any]]   # leaf, measured_s, predicted_s (None where a side has no such leaf)
    note: str


def compare(path: str | Path, hardware: str | Path | None = None) -> Comparison:
    return compare_run(measured.load(path), hardware)


def compare_run(run: measured.MeasuredRun, hardware: str | Path | None = None,
                fitted: Profile | None = None) -> Comparison:
    """``fitted``: ``calibrate.fit_run(run)`` where the caller has it already (the dashboard keeps
    one per run), so a CPU run is not fitted again."""
    if hardware:
        profile, note = Profile.load(hardware), f"profile {hardware}"
    elif run.system.key == "CPU":
        profile = fitted or calibrate.fit_run(run)
        note = "profile fitted to this run (CPU: no published profile applies)"
    else:
        profile = default_profile()
        note = f"profile fitted on {profile.provenance.get('source', 'defaults')}"
    return comparison(run, profile, note)


def comparison(run: measured.MeasuredRun, profile: Profile, note: str) -> Comparison:
    """``run`` predicted with ``profile`` beside what it measured, leaf by leaf; a CPU run at the
    host peak the profile was fitted at (:func:`measured.at_host_peak`)."""
    if peak := profile.provenance.get(measured.HOST_PEAK):
        run = measured.at_host_peak(run, float(peak))
    p = run.predict(profile)
    leaves = run.typical_leaves()  # the median step, split as the traced steps split theirs
    names = sorted(set(leaves) | {k for k, v in p.leaves.items() if v > 0},
                   key=lambda k: -max(leaves.get(k, 0.0), p.leaves.get(k, 0.0)))
    rows = [{"leaf": k, "measured_s": leaves.get(k), "predicted_s": p.leaves.get(k) or None} for k in names]
    rows.append({"leaf": "step", "measured_s": run.typical_step_s, "predicted_s": p.step_s})
    return Comparison(run, p, rows, note)


def text(c: Comparison) -> str:
    lines = [f"predicted vs measured per step ({c.note})",
             f"{'leaf':<30} {'measured s':>12} {'predicted s':>12} {'ratio':>7}"]
    for r in c.rows:
        m, p = r["measured_s"], r["predicted_s"]
        ratio = f"{p / m:7.2f}" if m and p else "      -"
        lines.append(f"{r['leaf']:<30} {_s(m):>12} {_s(p):>12} {ratio}")
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"
