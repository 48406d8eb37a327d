"""The cost model's predicted MFU of a run's layout and settings: a deterministic CI counter.

It depends only on the manifest (model spec, mesh layout, schedule, train
settings) and the shipped profile, never on how fast the run went, so it is
exact from one run to the next and moves only when the code changes what the
run does: a layout, a recompute policy, a schedule, the overlap switches.  A
GPU run is predicted on its own device; a CPU run, whose host core no
published profile describes, on an H100 -- "what this change would cost on
real hardware".
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest

REFERENCE_GPU = "H100"


def predicted(report: dict[str, Any], manifest: dict[str, Any] | None, where: Path) -> dict[str, Any] | None:
    """``{"predicted_mfu", "predicted_on", "predicted_leaves"}``, or None for a run the cost model
    cannot read (a trace set, a run without a model spec, a layout it does not model)."""
    if not Manifest.of(manifest).model:
        return None
    from mfuscope.optimizers import measured
    from mfuscope.optimizers.model import predict
    from mfuscope.optimizers.system import default_profile, system

    try:
        run = measured.from_documents(report, manifest, where)
        sys_ = system(REFERENCE_GPU) if run.system.key == "CPU" else run.system
        p = predict(run.model, run.layout, run.training, sys_, default_profile())
    except (UserInputError, ValueError, KeyError):
        return None
    if p.mfu is None:
        return None
    return {"predicted_mfu": p.mfu, "predicted_on": sys_.key,
            "predicted_leaves": {k: v for k, v in p.leaves.items() if v > 0}}
