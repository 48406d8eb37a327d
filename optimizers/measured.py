"""A measured run as a cost-model case: its manifest's model and layout, its report's breakdown.

A run directory written by the collectors holds ``manifest.json`` (model spec,
mesh layout, schedule, train settings, the trainer's options) beside
``report.json`` (the measured breakdown tree).  This module turns the pair
into the model's inputs and the measurement to hold the prediction against,
leaf by leaf.

On a CPU run the "device" is a host core: its peak is the matmul peak the
collectors measured (the report says so), its memory bandwidth is not
measured (a nominal 10 GB/s that calibration scales), and all ranks share one
host, so every dimension uses the one ``gloo`` tier over loopback.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mfuscope import hardware
from mfuscope.errors import UserInputError
from mfuscope.fix_registry import FIXES
from mfuscope.manifest import Manifest
from mfuscope.pacing import Pacing, parse_paced
from mfuscope.trainer_options import TrainerOptions

from .model import Prediction, predict
from .spec import Layout, ModelSpec, Training
from .system import GB, LinkTier, Profile, System, system

CPU_MEMORY_BPS = 10 * GB
GLOO = LinkTier("gloo-loopback", 50e-6, 1 * GB, "nominal: gloo over loopback TCP on one host",
                reduce_scatter_as_all_reduce=True)


@dataclass(frozen=True)
class Collectives:
    """One row of the report's communication table (``comm``): ``calls`` collectives of one kind
    over a group of ``group_size`` ranks, ``bytes`` each on average, ``seconds`` each from issue to
    completion on average -- what a link calibration fits latency and bandwidth to."""

    dim: str
    op: str
    group_size: int
    calls: int
    bytes: float
    seconds: float


def collectives_of(rows: list[dict[str, Any]]) -> tuple[Collectives, ...]:
    out = []
    for row in rows or []:
        calls, size = int(row.get("count") or 0), row.get("group_size")
        if calls and size and row.get("total_s"):
            out.append(Collectives(str(row["dim"]), str(row["op"]), int(size), calls, float(row["bytes"]) / calls,
                                   float(row["total_s"]) / calls))
    return tuple(out)


@dataclass(frozen=True)
class MeasuredRun:
    path: Path
    model: ModelSpec
    layout: Layout
    training: Training
    system: System
    known_phases: tuple[float, float, float] | None   # paced runs: (F, B, W) per microbatch, busiest rank
    pacing: Pacing | None
    leaves: dict[str, float]                          # measured seconds per step, leaf by leaf
    step_s: float
    tokens_per_s_per_gpu: float | None
    bubble_fraction: float | None
    stage_compute_s: tuple[float, ...] = ()           # compute seconds a step per pipeline rank, measured
    mfu: float | None = None
    dp_mode: str = "fsdp"                             # how the trainer shards data ranks: fsdp | ddp
    measured_memory_bytes: float | None = None        # --profile-memory: the highest rank's peak (reserved
                                                      # where the device reserves, else allocated)
    checkpoint: str | None = None                     # --checkpoint as the run was given it
    median_step_s: float | None = None                # the median of every step the collectors timed
    collectives: tuple[Collectives, ...] = ()         # the report's communication table, per call

    @property
    def typical_step_s(self) -> float:
        """The step a prediction is held against: the median step where the collectors timed every
        step (a loaded host's outliers move the mean, not the median), else the mean."""
        return self.median_step_s or self.step_s

    def typical_leaves(self) -> dict[str, float]:
        """The leaves scaled to :attr:`typical_step_s`: the traced steps split the median step as
        they split their own (their sum is the traced steps' mean, the profiler's overhead in it)."""
        total = sum(self.leaves.values())
        scale = self.typical_step_s / total if total > 0 else 1.0
        return {k: v * scale for k, v in self.leaves.items()}

    def predict(self, profile: Profile | None, layout: Layout | None = None,
                training: Training | None = None) -> Prediction:
        """The cost model's step for this run, or for it with ``layout``/``training`` changed: the
        paced compute (if any) follows the layout."""
        lay = layout or self.layout
        return predict(self.model, lay, training or self.training, self.system, profile,
                       paced_phases(self.pacing, lay, self.model), stage_work(self.pacing, lay, self.model))


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        # a run trained but not analyzed yet: its report is made from its traces
        unanalyzed = path.name == "report.json" and (path.parent / "traces").is_dir()
        hint = f" (the run is not analyzed yet: mfuscope analyze {path.parent})" if unanalyzed else ""
        raise UserInputError(f"no such file{hint}", path) from None
    except ValueError as e:
        raise UserInputError(f"not JSON ({e})", path) from None


def leaves_of(tree: dict[str, Any]) -> dict[str, float]:
    """The tree's leaves (nodes without children), by name, with every data-parallel group's
    dimension (``dp_shard``, ``dp_shard_cp``, ``dp_cp``, ``fsdp``, ...) named ``dp`` as the
    model names it."""
    if not tree.get("children"):
        return {_model_leaf(tree["name"]): float(tree["seconds"])}
    out: dict[str, float] = {}
    for child in tree["children"]:
        for leaf, seconds in leaves_of(child).items():
            out[leaf] = out.get(leaf, 0.0) + seconds
    return out


def _model_leaf(name: str) -> str:
    parts = name.split("/")
    if parts[0] == "comm" and len(parts) == 3 and (parts[1].startswith("dp") or parts[1] == "fsdp"):
        return f"comm/dp/{parts[2]}"
    return name


def paced_phases(pacing: Pacing | None, layout: Layout, model: ModelSpec) -> tuple[float, float, float] | None:
    """(F, B, W) seconds of one microbatch on the busiest pipeline rank in paced mode: each of its v
    chunks (with ``scope=layer`` each of its layers) sleeps the paced time, per sample of the
    microbatch with ``per=sample``.  Per layer, full recomputation sleeps the forward again in
    backward, as recomputing a layer runs its forward again."""
    if pacing is None:
        return None
    rows = layout.micro_batch if pacing.per_sample else 1
    units = layout.stage_layers(model) if pacing.per_layer else layout.vpp
    f, b, w = (units * ms / 1e3 * rows for ms in (pacing.fwd_ms, pacing.bwd_ms, pacing.w_ms))
    if pacing.per_layer and layout.recompute == "full":
        b += f
    return f, b, w


def stage_work(pacing: Pacing | None, layout: Layout, model: ModelSpec) -> tuple[float, ...] | None:
    """Each pipeline rank's work relative to the busiest in paced mode: its layers' share, or the
    same on every rank where each sleeps per stage whatever it holds.  Unpaced, None: the cost
    model's own per-rank compute (the LM head's rank included)."""
    if pacing is None:
        return None
    if not pacing.per_layer:
        return (1.0,) * layout.pp
    layers = layout.rank_layers(model)
    return tuple(n / max(layers) for n in layers)


#: The provenance key of a profile fitted to CPU runs: the host's peak its rates are fractions of.
HOST_PEAK = "cpu_peak_flops"


def host_peak(runs: list[MeasuredRun]) -> float:
    """The host's peak FLOP/s from its runs' own measurements: the best of them (a try is only
    ever slowed by load, never sped up)."""
    return max(r.system.accelerator.bf16_tflops * 1e12 for r in runs)


def at_host_peak(run: MeasuredRun, peak_flops: float) -> MeasuredRun:
    """A CPU run put at the host's peak ``peak_flops`` in place of the one it measured.  Each run
    times a few matmuls as it starts (collectors/cpu_peak.py, best of 5); on 2 loaded cores that
    moved between 68 and 91 GFLOP/s across the seven runs of one table, and a prediction's compute
    is FLOPs over that number -- so runs held against each other (a calibration and the runs it
    predicts) are taken at one peak, the calibration's.  A GPU run is returned as it is: its peak
    is the hardware table's."""
    if run.system.key != "CPU":
        return run
    return replace(run, system=cpu_system(peak_flops, run.system.gpus_per_node))


def cpu_system(peak_flops: float, ranks: int) -> System:
    acc = hardware.Accelerator("CPU", "cpu", peak_flops / 1e12, peak_flops / 1e12, None, 0.0,
                               CPU_MEMORY_BPS / 1e12, 0.0, "measured matmul peak (see the report)")
    return System("CPU", acc, max(ranks, 1), GLOO, GLOO, {}, "measured matmul peak",
                  attention_flops=peak_flops)


def load(path: str | Path) -> MeasuredRun:
    """``path``: a run directory or its ``report.json`` (with ``manifest.json`` beside it)."""
    p = Path(path)
    if p.exists() and not p.is_dir() and p.suffix != ".json":
        raise UserInputError("not a run directory or its report.json", p)
    report_path = p / "report.json" if p.is_dir() else p
    manifest_path = report_path.parent / "manifest.json"
    return from_documents(_read(report_path), _read(manifest_path), report_path.parent)


def from_documents(report: dict[str, Any], manifest: Manifest | dict[str, Any], where: Path) -> MeasuredRun:
    """The same from the two documents already read (the dashboard keeps reports in a cache)."""
    report_path, manifest_path = where / "report.json", where / "manifest.json"
    m = Manifest.of(manifest)
    if not m.has_model_spec:
        raise UserInputError("the run's manifest has no model spec or train settings to predict from "
                             "(runs of the reference trainer have both)", manifest_path)
    model = ModelSpec.from_manifest(m.model)
    opts = TrainerOptions.from_manifest(m)
    layout = run_layout(m, opts, manifest_path)
    train, pp = m.train, layout.pp
    summary = report.get("summary") or {}
    acc = hardware.lookup(m.device_name) if m.device_name not in (None, "x86_64", "cpu") else None
    training = Training.of_run(opts, train, on_gpu=acc is not None, attention=m.kernels.get("attention"))
    ranks = m.world_size
    if acc is not None:
        sys = system(acc.key)
    elif summary.get("peak_flops"):
        sys = cpu_system(float(summary["peak_flops"]), ranks)
    else:
        raise UserInputError("the report has no peak FLOP/s for its device", report_path)
    pacing = parse_paced(opts.paced)
    tps = summary.get("tokens_per_s")
    bubbles = report.get("bubbles") or []
    fractions = [b["bubble_fraction"] for b in bubbles if b.get("bubble_fraction") is not None]
    stages = _stage_leaves(report, m, pp)
    stage_compute = tuple(sum(v for k, v in leaves.items() if k.startswith("compute/")) for leaves in stages)
    # The steady steps' leaves (the warm-up left out), on the basis of summary.step_time_s and the
    # findings; a report from before steady_breakdown has only the tree of every traced step.
    leaves = leaves_of(report.get("steady_breakdown") or report["breakdown"])
    training = replace(training, checkpoint_s=leaves.get("checkpoint", 0.0))
    if layout.ep > 1 and (report.get("moe") or {}).get("expert_load"):
        # The routing's imbalance as the run's exchanges measured it (analyzers/collective_match.py).
        training = replace(training, moe_imbalance=max(1.0, float(report["moe"]["expert_load"])))
    if stage_compute and max(stage_compute) > UNEVEN * min(stage_compute):
        # The model predicts the busiest rank; where stages differ, that rank's leaves are the
        # measurement to hold it against (the mean of ranks mixes in the light stages' waits).
        leaves = stages[stage_compute.index(max(stage_compute))]
    return MeasuredRun(where, model, layout, training, sys, paced_phases(pacing, layout, model), pacing, leaves,
                       float(summary.get("step_time_s") or report["breakdown"]["seconds"]),
                       tps / ranks if tps else None, max(fractions) if fractions else None, stage_compute,
                       summary.get("mfu"), opts.dp_mode, _measured_memory(report), opts.checkpoint,
                       summary.get("step_time_p50_s"), collectives_of(report.get("comm") or []))


#: Pipeline ranks whose compute differs by more than this ratio are uneven stages (the threshold
#: from which rebalancing them applies).
UNEVEN = 1 + FIXES["rebalance_stages"].threshold


def _measured_memory(report: dict[str, Any]) -> float | None:
    """The highest rank's measured peak (analyzers/memory.py): what it reserved on a GPU (the
    allocator's fragmentation included), what it allocated on the CPU."""
    ranks = (report.get("memory") or {}).get("per_rank") or []
    peaks = [e.get("peak_reserved_bytes") or e.get("peak_allocated_bytes") for e in ranks]
    peaks = [p for p in peaks if p]
    return float(max(peaks)) if peaks else None


def run_layout(m: Manifest, opts: TrainerOptions, manifest_path: Path) -> Layout:
    """The layout a reference-trainer run ran, in the cost model's terms (DDP's ranks are
    replicas; without a pipeline the microbatches are the gradient-accumulation steps)."""
    degrees, train = m.degrees, m.train
    pp = degrees.pp
    dp_replicate, dp_shard = degrees.dp_replicate, degrees.dp_shard
    if opts.dp_mode == "ddp":
        dp_replicate, dp_shard = degrees.data_ranks, 1
    microbatches = m.microbatches if pp > 1 else int(train.get("grad_accum", 1))
    data_ranks = dp_replicate * dp_shard
    global_batch = int(train["global_batch"])
    if global_batch % (data_ranks * microbatches):
        raise UserInputError(f"global batch {global_batch} does not split over {data_ranks} data ranks x "
                             f"{microbatches} microbatches", manifest_path)
    return Layout(tp=degrees.tp, pp=pp, vpp=int(m.schedule.get("virtual_stages") or 1), dp_replicate=dp_replicate,
                  dp_shard=dp_shard, cp=degrees.cp, ep=degrees.ep,
                  micro_batch=global_batch // (data_ranks * microbatches), microbatches=microbatches,
                  schedule=m.schedule_name or "1f1b", recompute=train.get("recompute", "none"),
                  sequence_parallel=degrees.tp > 1 and train.get("sequence_parallel", True) is not False,
                  split=opts.stage_layers or ())


def _stage_leaves(report: dict[str, Any], manifest: Manifest, pp: int) -> list[dict[str, float]]:
    """Each pipeline coordinate's leaves, seconds a step, mean of its ranks (empty where the report
    or the manifest cannot say)."""
    stages = manifest.stages
    per: dict[int, dict[int, dict[str, float]]] = {}
    for row in report.get("breakdown_by_rank") or []:
        if int(row["rank"]) not in stages:
            continue
        leaves = per.setdefault(stages[int(row["rank"])], {}).setdefault(int(row["rank"]), {})
        leaf = _model_leaf(str(row["leaf"]))
        leaves[leaf] = leaves.get(leaf, 0.0) + float(row["seconds"])
    if pp == 1 or sorted(per) != list(range(pp)):
        return []
    out = []
    for stage in range(pp):
        ranks = list(per[stage].values())
        names = {k for r in ranks for k in r}
        out.append({k: sum(r.get(k, 0.0) for r in ranks) / len(ranks) for k in sorted(names)})
    return out

