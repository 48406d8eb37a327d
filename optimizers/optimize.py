"""``mfuscope optimize``: propose the catalogue's changes ranked by predicted gain; with ``--apply``,
run them on the reference trainer, measure, and keep the best greedily.

Predicted gains come from the cost model with the profile calibrated on the
run itself (``calibrate.fit_run``): predicted step of the run as it is minus
predicted step with the change.  A change the memory model says does not fit
is proposed with that reason and never run.

Applying (reference-trainer runs only; the manifest says how the run was
launched): each proposal whose predicted gain exceeds ``MIN_GAIN`` becomes
a new run directory beside the base (``<run>-opt-r<round>-<fix>-<i>``, so the
dashboard lists it) with the same steps, profiling window, pacing and
injected faults, analyzed like any run.  The biggest measured win becomes the
new base and the search repeats from it (Aceso's iterative bottleneck
alleviation) while a change is predicted to gain more than ``MIN_GAIN``.
A run whose manifest shows another configuration than the change predicted is flagged
(``ran_otherwise``); a predicted gain that misses the measured one by more than 25% of it (and
by more than 5% of the step, :func:`gain_held`) is flagged; a change that made the run slower is
reported and dropped.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest
from mfuscope.trainer_options import TrainerOptions, parse_checkpoint

from . import calibrate, fixes, measured
from .cost import memory as memory_model
from .model import Prediction
from .spec import Layout, Training
from .system import Profile, System

MIN_GAIN = 0.02
#: A predicted gain holds when it is within this share of the measured gain, or within
#: :data:`MISS_FLOOR` of the step (a small gain's share is mostly the measurement's noise).
MISS = 0.25
MISS_FLOOR = 0.05


def gain_held(predicted: float, measured: float) -> bool:
    """Whether a change's predicted gain (a fraction of the step) held against its measured one."""
    return abs(predicted - measured) <= max(MISS * abs(measured), MISS_FLOOR)


@dataclass
class Proposal:
    change: fixes.Change
    predicted_step_s: float
    predicted_gain: float            # fraction of the base's predicted step
    fits: bool | None
    memory_gib: float
    predicted_leaves: dict[str, float]  # seconds a step, busiest GPU
    predicted_mfu: float | None = None
    measured_step_s: float | None = None
    measured_gain: float | None = None      # fraction of the step of the run it was applied to
    measured_mfu: float | None = None
    measured_leaves: dict[str, float] | None = None
    moved: str | None = None             # the leaf the change moved most, measured
    run: str | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"fix": self.change.fix, "summary": self.change.summary, "change": self.change.trainer,
                "flags": self.change.flags, "predicted_step_s": self.predicted_step_s,
                "predicted_gain": self.predicted_gain, "fits": self.fits, "memory_gib": self.memory_gib,
                "predicted_leaves": self.predicted_leaves, "predicted_mfu": self.predicted_mfu,
                "measured_step_s": self.measured_step_s, "measured_gain": self.measured_gain,
                "measured_mfu": self.measured_mfu,
                "measured_leaves": self.measured_leaves, "moved": self.moved, "run": self.run, "note": self.note}

    def measured_against(self, new: measured.MeasuredRun, before: measured.MeasuredRun) -> None:
        """Record the run this change made, against the run it was applied to."""
        self.measured_step_s, self.run, self.measured_leaves = new.typical_step_s, str(new.path), new.typical_leaves()
        self.measured_mfu = new.mfu
        names = set(new.leaves) | set(before.leaves)
        delta = {k: new.leaves.get(k, 0.0) - before.leaves.get(k, 0.0) for k in names}
        leaf = max(delta, key=lambda k: abs(delta[k]))
        self.moved = f"{leaf} {delta[leaf] * 1e3:+.0f} ms"


def memory_needed(run: measured.MeasuredRun, base: memory_model.Memory,
                  changed: memory_model.Memory) -> tuple[float, bool | None]:
    """(bytes a change needs on the busiest GPU, whether they fit).  Where the run measured its memory
    (``--profile-memory``), its measured peak scaled by the model's ratio of the change to the base
    -- the model's errors in what it predicts for the run cancel -- plus the CUDA context; else the
    model's estimate with its headroom (optimizers/cost/memory.py)."""
    if run.measured_memory_bytes and base.total_bytes:
        need = run.measured_memory_bytes * changed.total_bytes / base.total_bytes
        budget = run.system.device_bytes
        return need, None if budget is None else need + memory_model.CONTEXT_BYTES <= budget
    return changed.total_bytes, changed.fits


def propose(run: measured.MeasuredRun, only: set[str] | None = None) -> tuple[Prediction, Profile, list[Proposal]]:
    """(the base's prediction, the run's profile, proposals best first)."""
    profile = calibrate.fit_run(run)
    base_prediction = run.predict(profile)
    base = base_prediction.step_s
    out = []
    for fix_id, make in fixes.CATALOGUE.items():
        if only and fix_id not in only:
            continue
        changes = make(run, profile) if fix_id == "better_layout" else make(run)
        for change in changes:
            try:
                p = run.predict(profile, change.layout, change.training)
            except ValueError:
                continue  # an illegal layout for this model: the fix does not apply
            need, fits = memory_needed(run, base_prediction.memory, p.memory)
            gib = need / 2**30
            note = "" if fits is not False else (
                f"not applied: needs {gib:.4g} GiB, the budget is {run.system.device_bytes / 2**30:.4g}")
            leaves = {k: v for k, v in p.leaves.items() if v > 0}
            out.append(Proposal(change, p.step_s, 1 - p.step_s / base, fits, gib, leaves, p.mfu, note=note))
    out.sort(key=lambda pr: -pr.predicted_gain)
    return base_prediction, profile, out


def best_by_fix(proposals: list[Proposal]) -> dict[str, Proposal]:
    """Each fix id's most promising change that fits, from :func:`propose`'s proposals (best
    first): the cost model's gain beside a finding's estimate (the analyzers' fixed ratios know
    nothing of the layout)."""
    best: dict[str, Proposal] = {}
    for p in proposals:
        if p.fits is not False:
            best.setdefault(p.change.fix, p)
    return best


# ----------------------------------------------------------------------------- applying

def trainer_command(manifest: Manifest | dict[str, Any], config: Path, out: Path, change: dict[str, str]) -> list[str]:
    """``mfuscope train`` as the run was launched (:meth:`TrainerOptions.from_manifest`), with
    ``change`` (in its recorded text form) applied, traced from step 1 if the run was not, and
    without the switches the changed layout cannot take.  A run that saved checkpoints saves the
    rerun's into a folder of its own under them (never over the run's own saves)."""
    m = Manifest.of(manifest)
    opts = changed_options(m, config, out, change)
    return [sys.executable, "-m", "mfuscope", "train", "--nproc", str(m.world_size), *opts.to_argv()]


def changed_options(manifest: Manifest, config: Path, out: Path, change: dict[str, str]) -> TrainerOptions:
    """The trainer options :func:`trainer_command` launches (see there)."""
    base = TrainerOptions.from_manifest(manifest, config=str(config))
    opts = base.changed(change).carried_over(base)
    opts = replace(opts, window=opts.window or "1:", out=str(out), force=True)
    if opts.checkpoint and "checkpoint" not in change:
        spec = parse_checkpoint(opts.checkpoint)
        opts = replace(opts, checkpoint=f"every={spec.every},mode={spec.mode},dir={Path(spec.dir) / Path(out).name}")
    return opts


#: What a change's run must have as the change predicted it (the cost model's Layout fields; the
#: stage split is compared where the change sets one).
LAYOUT_KEYS = ("tp", "pp", "vpp", "dp_replicate", "dp_shard", "cp", "ep", "micro_batch", "microbatches", "schedule",
               "recompute", "sequence_parallel")


def ran_otherwise(change: fixes.Change, layout: Layout, training: Training) -> list[str]:
    """Where the layout and training a run ran (its manifest, read as ``measured.load`` reads it)
    differ from what ``change`` predicted: the prediction was of another configuration.  The
    blocking time of checkpoint saves is a measurement, not a setting: not compared."""
    out = [f"{k}={getattr(layout, k)} (predicted {getattr(change.layout, k)})" for k in LAYOUT_KEYS
           if getattr(layout, k) != getattr(change.layout, k)]
    if change.layout.split and tuple(layout.split) != tuple(change.layout.split):
        out.append(f"split={layout.split} (predicted {change.layout.split})")
    ran, predicted = asdict(training), asdict(change.training)
    out += [f"{k}={ran[k]} (predicted {predicted[k]})" for k in predicted
            if k != "checkpoint_s" and ran[k] != predicted[k]]
    return out


def write_config(manifest: Manifest | dict[str, Any], path: Path) -> Path:
    """The run's model and train settings as a trainer TOML file."""
    def toml_value(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str) else ("true" if v is True else "false" if v is False else str(v))
    m = Manifest.of(manifest)
    model = {k: v for k, v in (m.model or {}).items() if k != "family" and v is not None}
    train = {k: v for k, v in m.train.items() if v is not None}
    lines = ["[model]"] + [f"{k} = {toml_value(v)}" for k, v in model.items()]
    lines += ["[train]"] + [f"{k} = {toml_value(v)}" for k, v in train.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_and_measure(manifest: Manifest, config: Path, out: Path, change: dict[str, str],
                    say: Callable[[str], None], system: System) -> measured.MeasuredRun:
    from mfuscope.run_dir import VIEWS

    from .predicted_memory import analyze

    cmd = trainer_command(manifest, config, out, change)
    say("+ " + " ".join(cmd[2:]))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserInputError(f"the trainer failed (exit {done.returncode}): {last}", out)
    analyze(out, out / "report.json", out / VIEWS, use_cache=False)
    return replace(measured.load(out), system=system)


def apply(base_run: measured.MeasuredRun, out_dir: Path, only: set[str] | None, rounds: int,
          say: Callable[[str], None], first_win: bool = False) -> dict[str, Any]:
    """Run the proposals, keep the best measured win, repeat; the summary ``optimize.json`` holds.
    Every run is held to ``base_run``'s system (a ``--memory-gib`` budget included).
    ``first_win``: a round runs its proposals in order of predicted gain and keeps the first that
    makes the run faster, leaving the rest unrun (each is a training run: on a real job, minutes of
    the cluster); one that ran slower or failed does not end the round."""
    manifest = Manifest.read(base_run.path)
    if not manifest.is_reference_trainer_run:
        raise UserInputError("not a reference-trainer run (its manifest does not say how it was launched): "
                             "run `mfuscope optimize` without --apply for proposals", base_run.path)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="mfuscope-optimize-")
    config = write_config(manifest, Path(scratch.name) / "config.toml")
    base_step = base_run.typical_step_s
    current, current_manifest, applied_changes = base_run, manifest, {}
    tried: list[Proposal] = []
    applied: list[str] = []
    started, runs = time.monotonic(), 0
    for r in range(rounds):
        _, _, proposals = propose(current, only)
        todo = [p for p in proposals if p.predicted_gain > MIN_GAIN and p.fits is not False]
        listed = {(p.change.fix, p.change.summary) for p in tried}
        for p in proposals:
            if p.fits is False and (p.change.fix, p.change.summary) not in listed:
                tried.append(p)
                say(f"round {r + 1}: {p.change.summary}: {p.note}")
        if not todo:
            say(f"round {r + 1}: no change that fits is predicted to gain more than {MIN_GAIN:.0%}")
            break
        best: tuple[float, Proposal, measured.MeasuredRun, dict] | None = None
        for i, p in enumerate(todo, 1):
            name = f"{base_run.path.name}-opt-r{r + 1}-{p.change.fix}-{i}"
            elapsed = time.monotonic() - started
            left = f", about {elapsed / runs * (len(todo) - i + 1):.0f} s left in this round" if runs else ""
            say(f"round {r + 1}, {i}/{len(todo)}: {p.change.summary} (predicted {p.predicted_gain:+.0%}); "
                f"{elapsed:.0f} s so far{left}")
            runs += 1
            change = {**applied_changes, **p.change.trainer}
            try:
                new = run_and_measure(current_manifest, config, out_dir / name, change, say, base_run.system)
            except UserInputError as e:  # the trainer refused or failed: reported, the search goes on
                p.note = f"not measured: {e}"
                tried.append(p)
                say(f"round {r + 1}: {p.change.summary}: {p.note}")
                continue
            p.measured_against(new, current)
            if otherwise := ran_otherwise(p.change, new.layout, new.training):
                p.note = "ran otherwise than predicted: " + ", ".join(otherwise)
            measured_gain = p.measured_gain = 1 - new.typical_step_s / current.typical_step_s
            if measured_gain < 0:
                p.note = (p.note + "; " if p.note else "") + (
                    f"slower: {new.typical_step_s:.3f} s against {current.typical_step_s:.3f} s; dropped")
            if not gain_held(p.predicted_gain, measured_gain):
                p.note = (p.note + "; " if p.note else "") + (
                    f"prediction missed: gain {p.predicted_gain:+.1%} predicted, {measured_gain:+.1%} measured")
            tried.append(p)
            if measured_gain > 0 and (best is None or new.typical_step_s < best[0]):
                best = (new.typical_step_s, p, new, change)
            if first_win and measured_gain > 0 and i < len(todo):
                say(f"round {r + 1}: the first win is kept (--first-win); not run: "
                    + ", ".join(q.change.summary for q in todo[i:]))
                break
        if best is None:
            say(f"round {r + 1}: no change made the run faster")
            break
        _, p, new, change = best
        applied.append(p.change.fix)
        applied_changes = change
        current = new
        current_manifest = Manifest.read(new.path)
        say(f"round {r + 1}: kept {p.change.summary}: step {new.typical_step_s:.3f} s")
    summary = {"base_run": str(base_run.path), "base_step_s": base_step, "base_mfu": base_run.mfu,
               "fixes": [p.as_dict() for p in tried],
               "final": {"fixes": applied, "change": applied_changes,
                         "measured_step_s": current.typical_step_s,
                         "predicted_step_s": None if current is base_run else
                         next(p.predicted_step_s for p in tried if p.run == str(current.path)),
                         "gain": 1 - current.typical_step_s / base_step, "measured_mfu": current.mfu,
                         "run": str(current.path)}}
    scratch.cleanup()
    return summary
