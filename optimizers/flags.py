"""What each finding's fix is in the frameworks people train with, for a job mfuscope cannot rerun.

A trace directory or a foreign job's run has no model spec for the cost model
and no launch command to change, so ``mfuscope optimize`` proposes the report's
findings as they stand -- the evidence and the analyzers' estimate of the
seconds at stake -- with the switches that act on each in torchtitan,
Megatron-Core and plain PyTorch.  The reference trainer's own changes, with
gains predicted by the cost model, are in :mod:`fixes`.

The switches are each fix's record in :data:`mfuscope.fix_registry.FIXES`.
"""
from __future__ import annotations

from typing import Any

from mfuscope.fix_registry import FIXES


def proposals_from_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's findings as proposals in ``optimize.json``'s shape: nothing predicted by the
    cost model (no model spec), the analyzers' estimate of the step it could save instead."""
    step = (report.get("summary") or {}).get("step_time_s")
    out = []
    for f in report.get("findings") or []:
        if not f.get("per_step", True):
            continue  # one-time costs: nothing to gain a step
        out.append({"fix": f["fix"], "summary": f["title"], "change": {},
                    "flags": dict(FIXES[f["fix"]].flags) if f["fix"] in FIXES else {},
                    "predicted_step_s": step - f["gain_s"] if step else None,
                    "predicted_gain": f.get("gain_fraction"), "basis": "analyzer estimate from the trace "
                    "(no model spec: the cost model cannot predict)", "fits": None, "memory_gib": None,
                    "measured_step_s": None, "run": None, "note": "", "evidence": f.get("evidence")})
    return out
