"""Scaling efficiency: how much throughput per device a job keeps as it grows, and where the rest went.

A run at one size says where its step went; a single number for "does this job scale" needs
runs of the same job at several sizes, held against the smallest, and the question a user asks
next -- which part of the step grew -- needs the lost time split over the same breakdown leaves
the analyzers and the cost model speak (``compute/gemm``, ``comm/dp/all_gather``, ``bubble``,
...).  This module does that for measured runs (``mfuscope scaling RUN_DIR...``) and for the
cost model's best layout at each GPU count (``mfuscope plan --scaling``), with one definition:

- **weak scaling**: the work of each device is the same at every size (tokens per device per
  step equal), so the ideal step is the smallest run's: ``loss = step(N) - step(N0)``, per leaf
  ``leaf(N) - leaf(N0)``;
- **strong scaling**: the job is the same (tokens per step equal), so the ideal step is the
  smallest run's shared over more devices: ``loss = step(N) - step(N0) * N0 / N``, per leaf
  ``leaf(N) - leaf(N0) * N0 / N``.

Efficiency is ``tokens_per_s_per_device(N) / tokens_per_s_per_device(N0)`` in both (for strong
scaling that is the speedup over ``N / N0``).  The leaves of a breakdown add up to its step, so
the loss by leaf adds up to the loss exactly; an entry is negative where a leaf shrank more than
the ideal (the ideal share of the whole step is ``N0/N`` of every leaf, strong).  For measured
runs the efficiency is the report summary's (every timed step, the slowest rank) and the split
is over its breakdown (the traced steps, the mean of ranks), so ``loss_s / breakdown_s`` is close
to, not always equal to, ``1 - efficiency``.

Torch-free and with no dashboard import: the CLI and the dashboard's Planner page both call it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfuscope import run_dir
from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest
from mfuscope.report import read_report

from .measured import leaves_of

MODES = ("weak", "strong")
#: Two runs' tokens per step (or per device per step) are "the same" within this relative tolerance
#: (exact for reference-trainer runs, whose manifest has the batch; a product of two rounded
#: figures for a run profiled with --tokens-per-step).
SAME = 1e-3


@dataclass(frozen=True)
class Point:
    """One run as scaling reads it."""

    name: str
    ranks: int
    tokens_per_step: float          # global tokens of one optimizer step
    tokens_per_s: float             # the whole job's
    mfu: float | None
    step_s: float | None            # the report summary's step time
    leaves: dict[str, float] | None  # the breakdown's leaves, seconds a step; None without a breakdown

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.ranks

    @property
    def tokens_per_device(self) -> float:
        return self.tokens_per_step / self.ranks


def point(report: dict[str, Any], manifest: dict[str, Any] | Manifest | None, name: str) -> Point:
    """A run's :class:`Point` from its report and manifest (as the dashboard keeps them)."""
    summary = report.get("summary") or {}
    m = Manifest.of(manifest)
    ranks = int(m.raw.get("world_size") or summary.get("world_size") or 0)
    if ranks < 1:
        raise UserInputError("neither the manifest nor the report says how many ranks the run had", name)
    tps, step = summary.get("tokens_per_s"), summary.get("step_time_s")
    train = m.train
    if train.get("global_batch") and train.get("seq_len"):
        per_step = float(train["global_batch"]) * float(train["seq_len"])
    elif tps and step:  # tokens_per_s is the tokens of the timed steps over their time
        per_step = float(tps) * float(step)
    else:
        raise UserInputError("no tokens per step (the manifest has no batch, the report no tokens/s): profile "
                             "with --tokens-per-step", name)
    if not tps:
        if not step:
            raise UserInputError("the report has no timed step", name)
        tps = per_step / float(step)
    tree = report.get("breakdown")
    leaves = leaves_of(tree) if tree and tree.get("children") and tree.get("seconds") else None
    return Point(name, ranks, per_step, float(tps), summary.get("mfu"), step, leaves)


def load(path: str | Path, say=None) -> Point:
    """A run directory's :class:`Point`; a run with no report.json is analyzed first (as
    ``mfuscope optimize`` does), ``say`` told so."""
    p = Path(path)
    if not run_dir.is_run_dir(p):
        raise UserInputError("not a run directory (no manifest.json; mfuscope train/profile --out DIR makes one)", p)
    manifest = run_dir.read_manifest(p)
    if not (p / run_dir.REPORT).is_file():
        from .predicted_memory import analyze
        if say:
            say(f"mfuscope: analyzing {p} first")
        analyze(p, p / run_dir.REPORT, p / run_dir.VIEWS)
    return point(read_report(p / run_dir.REPORT), manifest, str(p))


def detect_mode(points: list[Point]) -> str | None:
    """``weak`` when every run has the same tokens per device per step, ``strong`` when every run
    has the same tokens per step, else None (runs of one size only would be both: callers refuse
    them first)."""
    def same(values: list[float]) -> bool:
        return all(math.isclose(v, values[0], rel_tol=SAME) for v in values)
    if same([p.tokens_per_device for p in points]):
        return "weak"
    if same([p.tokens_per_step for p in points]):
        return "strong"
    return None


def loss_by_leaf(mode: str, base: dict[str, float], base_n: int, leaves: dict[str, float],
                 n: int) -> dict[str, float]:
    """Seconds a step each leaf lost against the ideal (the module docstring's definition),
    largest first; they add up to ``step - ideal step`` (callers drop the exact zeros)."""
    scale = 1.0 if mode == "weak" else base_n / n
    lost = {leaf: leaves.get(leaf, 0.0) - base.get(leaf, 0.0) * scale for leaf in {*base, *leaves}}
    return dict(sorted(lost.items(), key=lambda kv: (-kv[1], kv[0])))


def ideal_step(mode: str, base_step: float, base_n: int, n: int) -> float:
    return base_step if mode == "weak" else base_step * base_n / n


def measured(points: list[Point], mode: str | None = None) -> dict[str, Any]:
    """``{"mode", "rows"}`` over runs of one job at several sizes, sorted by ranks, each against
    the smallest (the first of them, where two runs have the fewest ranks)."""
    if mode is not None and mode not in MODES:
        raise UserInputError(f"scaling mode {mode!r}: weak or strong")
    if len(points) < 2:
        raise UserInputError("scaling needs two runs or more of one job at different sizes")
    points = sorted(points, key=lambda p: p.ranks)
    if len({p.ranks for p in points}) < 2:
        raise UserInputError(f"every run has {points[0].ranks} ranks: give runs of different sizes")
    if mode is None:
        mode = detect_mode(points)
        if mode is None:
            raise UserInputError(
                "neither weak nor strong scaling: tokens per device per step ("
                + ", ".join(f"{p.tokens_per_device:g}" for p in points) + ") and tokens per step ("
                + ", ".join(f"{p.tokens_per_step:g}" for p in points)
                + ") both differ between the runs; force one with --weak or --strong")
    base = points[0]
    rows = []
    for p in points:
        row: dict[str, Any] = {"run": p.name, "ranks": p.ranks, "tokens_per_step": p.tokens_per_step,
                               "tokens_per_s_per_device": p.tokens_per_s_per_device, "mfu": p.mfu,
                               "efficiency": p.tokens_per_s_per_device / base.tokens_per_s_per_device,
                               "step_s": p.step_s, "breakdown_s": None, "ideal_s": None, "loss_s": None,
                               "loss_by_leaf": None}
        if p.leaves is not None and base.leaves is not None:
            step, ideal = sum(p.leaves.values()), ideal_step(mode, sum(base.leaves.values()), base.ranks, p.ranks)
            lost = loss_by_leaf(mode, base.leaves, base.ranks, p.leaves, p.ranks)
            row.update(breakdown_s=step, ideal_s=ideal, loss_s=sum(lost.values()),
                       loss_by_leaf={k: v for k, v in lost.items() if v != 0.0})
        rows.append(row)
    out: dict[str, Any] = {"mode": mode, "base": base.name, "rows": rows}
    missing = [p.name for p in points if p.leaves is None]
    if missing:
        out["note"] = ("no breakdown (no trace window: train with --profile or --window) in "
                       + ", ".join(missing) + ": its loss is not split by leaf")
    return out


def predicted(model, gpus: int, system, global_batch: int, training, profile, sizes: list[int]) -> list[dict]:
    """The cost model's weak-scaling curve: at each GPU count the planner's best layout, the
    sequences per GPU held at ``global_batch / gpus`` (the global batch grows with the GPUs,
    rounded to a whole sequence, at least one: each row says the batch it planned).  Efficiency
    and the loss by leaf are against the first size where a layout fits."""
    from . import planner

    if not sizes or min(sizes) < 1:
        raise UserInputError("--scaling: give GPU counts of 1 or more, e.g. 8,64,512")
    rows: list[dict[str, Any]] = []
    base = None
    for n in sorted(set(sizes)):
        batch = max(1, round(global_batch * n / gpus))
        result = planner.plan(model, n, system, batch, training, profile, 1)
        row: dict[str, Any] = {"gpus": n, "global_batch": batch, "efficiency": None, "tokens_per_s_per_gpu": None,
                               "mfu": None, "step_s": None, "layout": None, "loss_s": None, "loss_by_leaf": None}
        if not result.ranked:
            family = result.rejected.most_common(1)
            row["note"] = "no layout fits" + (f" (most: {family[0][0]})" if family else "")
            rows.append(row)
            continue
        layout, pred = result.ranked[0]
        if base is None:
            base = (n, pred)
        base_n, base_pred = base
        lost = loss_by_leaf("weak", base_pred.leaves, base_n, pred.leaves, n)
        row.update(efficiency=pred.tokens_per_s_per_gpu / base_pred.tokens_per_s_per_gpu,
                   tokens_per_s_per_gpu=pred.tokens_per_s_per_gpu, mfu=pred.mfu, step_s=pred.step_s,
                   layout=planner.describe(layout), loss_s=sum(lost.values()),
                   loss_by_leaf={k: v for k, v in lost.items() if v != 0.0},
                   tp_across_nodes=result.tp_across_nodes)
        rows.append(row)
    return rows


def parse_sizes(text: str) -> list[int]:
    """``8,64,512`` -> [8, 64, 512]."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserInputError(f"--scaling {text!r}: give GPU counts separated by commas, e.g. 8,64,512,4096")
    return sizes


def _top_losses(lost: dict[str, float] | None, total: float | None, k: int = 3) -> str:
    """The leaves that grew most, in ms (no shares: a leaf that shrank makes others add up to more
    than the loss)."""
    if not lost or not total or total <= 0:
        return ""
    return ", ".join(f"{leaf} +{s * 1e3:.3g} ms" for leaf, s in list(lost.items())[:k] if s > 0)


def text(result: dict[str, Any]) -> str:
    """The measured scaling as a table for people."""
    mode = result["mode"]
    base = result["rows"][0]
    what = ("the same tokens per device per step" if mode == "weak" else "the same tokens per step")
    lines = [f"{mode} scaling ({what}), against {base['ranks']} rank(s): {base['run']}",
             f"{'ranks':>6} {'tokens/s/dev':>13} {'MFU':>8} {'efficiency':>10} {'step s':>9} {'lost s':>9}  "
             "where the lost time went (largest leaves)"]
    for r in result["rows"]:
        mfu = f"{r['mfu']:.3%}" if r["mfu"] is not None else "-"
        step = f"{r['step_s']:.4g}" if r["step_s"] is not None else "-"
        lost = f"{r['loss_s']:.4g}" if r["loss_s"] is not None else "-"
        lines.append(f"{r['ranks']:>6} {r['tokens_per_s_per_device']:>13,.1f} {mfu:>8} {r['efficiency']:>10.1%} "
                     f"{step:>9} {lost:>9}  {_top_losses(r['loss_by_leaf'], r['loss_s'])}")
    for r in result["rows"]:
        lines.append(f"  {r['ranks']:>5}: {r['run']}")
    if result.get("note"):
        lines.append(f"note: {result['note']}")
    lines.append("lost s: the breakdown's step minus the ideal (" + (
        "the smallest run's step" if mode == "weak" else "the smallest run's step x N0/N")
                 + "), split leaf by leaf (--json has every leaf)")
    return "\n".join(lines)


def predicted_text(rows: list[dict[str, Any]]) -> str:
    """``plan --scaling``'s curve for people."""
    lines = ["\npredicted weak scaling (sequences per GPU held; best layout at each size):",
             f"{'GPUs':>7} {'batch':>7} {'tokens/s/GPU':>12} {'MFU':>6} {'efficiency':>10}  layout / where the "
             "lost time went"]
    for r in rows:
        if r["efficiency"] is None:
            lines.append(f"{r['gpus']:>7} {r['global_batch']:>7} {'-':>12} {'-':>6} {'-':>10}  {r.get('note', '')}")
            continue
        lines.append(f"{r['gpus']:>7} {r['global_batch']:>7} {r['tokens_per_s_per_gpu']:>12,.0f} "
                     f"{r['mfu'] or 0:>6.1%} {r['efficiency']:>10.1%}  {r['layout']}")
        losses = _top_losses(r["loss_by_leaf"], r["loss_s"])
        if losses:
            lines.append(f"{'':>47}{losses}")
    return "\n".join(lines)
