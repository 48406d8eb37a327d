"""The cost model's memory beside the measured: ``report.json``'s ``memory.per_rank[].predicted``.

The analyzers measure memory (analyzers/memory.py) and never import the cost model, so the
prediction is added here, above them: every command that writes a report (``mfuscope analyze``,
the dashboard, ``optimize``, ``ci``) analyzes through :func:`analyze`, which puts the model's
estimate for each measured rank of a reference-trainer run -- its pipeline stage's parameters,
that run's dtype, sharding, optimizer, recomputation and schedule (optimizers/cost/memory.py) --
beside what was measured, in the same categories.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mfuscope import run_dir
from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest
from mfuscope.trainer_options import TrainerOptions

from .cost import memory as memory_model
from .measured import run_layout
from .spec import ModelSpec


def analyze(path: str | Path, report_path: str | Path, views_dir: str | Path | None, **options: Any):
    """:func:`mfuscope.analyzers.analysis.analyze`, with the predicted memory added before the
    report is written."""
    from mfuscope.analyzers.analysis import analyze as measure
    return measure(path, report_path, views_dir, finish=lambda report: add(report, path), **options)


def add(report: dict[str, Any], path: str | Path) -> None:
    """Each measured rank's ``predicted`` categories, where ``path`` is a run directory whose
    manifest has the model spec and train settings (a reference-trainer run); else nothing, and
    ``memory.predicted_note`` says why."""
    section = report.get("memory")
    if not section:
        return
    predicted, note = per_rank(path, float((report.get("moe") or {}).get("expert_load") or 1.0))
    section["predicted_note"] = note
    for entry in section["per_rank"]:
        entry["predicted"] = predicted.get(entry["rank"]) if predicted else None


def per_rank(path: str | Path, expert_load: float = 1.0) -> tuple[dict[int, dict[str, int]] | None, str]:
    """(rank -> predicted bytes per category, how they were predicted) for a run directory;
    ``expert_load``: the routing's imbalance the run's exchanges measured (report.json's ``moe``)."""
    if not run_dir.is_run_dir(path):
        return None, "no prediction: a trace set has no model spec or layout"
    m = Manifest.of(run_dir.read_manifest(path))
    if not m.has_model_spec:
        return None, "no prediction: the manifest has no model spec or train settings"
    try:
        model = ModelSpec.from_manifest(m.model)
        opts = TrainerOptions.from_manifest(m)
        layout = run_layout(m, opts, Path(path) / run_dir.MANIFEST)
    except (UserInputError, TypeError, KeyError, ValueError) as e:
        return None, f"no prediction: {e}"
    train = m.train
    states = 0 if train.get("optimizer") == "sgd" else 2
    coords = m.rank_coords
    out: dict[int, dict[str, int]] = {}
    stages: dict[int, memory_model.Memory] = {}
    for rank in range(m.world_size):
        stage = int((coords.get(rank) or {}).get("pp", 0))
        if stage not in stages:
            try:
                stages[stage] = memory_model.estimate(
                    model, layout, int(train["seq_len"]), dtype=train.get("dtype", "bf16"), stage=stage,
                    reshard_after_forward=opts.reshard_after_forward, optimizer_states=states,
                    compiled=bool(train.get("compile")), expert_load=expert_load)
            except ValueError as e:
                return None, f"no prediction: {e}"
        out[rank] = {k: int(round(v)) for k, v in stages[stage].categories().items()}
    return out, "optimizers/cost/memory.py for the run's model, layout, dtype and optimizer"
