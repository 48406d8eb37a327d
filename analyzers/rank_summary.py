"""The map of an analysis: one rank's events in, a :class:`RankSummary` of tens of KB out.

A job of thousands of ranks cannot be analyzed as one table (one ~130-byte row an event, for
every rank at once).  Nearly everything the report says is per rank first -- the breakdown's
leaves per step, the step spans, the launch statistics, the communication calls and their
exposure, the FLOPs from shapes, the counters -- and only then combined over ranks.  So an
analysis summarizes each rank alone, in a worker (:mod:`.map_reduce`), from the rank's own
table, and the parent folds the summaries (:func:`.overview.reduce`).  No EventTable leaves the
worker: the summary holds small frames, and the rank's timeline segments and collective calls
are written by the worker as its own Parquet parts of the views (:data:`TIMELINE`,
:data:`COMM_CALLS`), which the dashboard and the cross-rank matching read.

Everything here is a function of the rank's events alone, except what the caller passes that
belongs to the job: the run's manifest (stages), the collectors' communication rows of the rank,
and the job's world size.  Several ranks may be summarized in one pass (:func:`summarize_ranks`:
every analysis keys its rows by rank), which is how a worker takes a batch of small traces.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from pandas.api.types import union_categoricals

from mfuscope import atomic, labels
from mfuscope.event_table import EventTable
from mfuscope.manifest import Manifest

from . import breakdown, comm_stats, counters, findings, kernel_time, memory, mfu, timeline
from .context import Context
from .group_sums import grouped

#: The views' per-rank parts (directories of ``rankNNNNN.parquet`` files, read as one dataset).
TIMELINE = "timeline.parquet"
COMM_CALLS = "comm_calls.parquet"
#: The columns of the collective view: one row a call.
CALL_COLUMNS = ["rank", "step", "dim", "op", "bytes", "group_size", "group_ranks", "pg", "seq",
                "enqueue_ns", "start_ns", "end_ns", "dur_ns", "inflight_ns", "exposed_ns"]


@dataclass
class RankSummary:
    """What the reduce needs of one rank (see the module docstring).  Frames carry a ``rank``
    column where the reduce concatenates them."""

    rank: int
    meta: dict[str, Any]
    leaves: pd.DataFrame                 # rank, step, leaf, seconds (breakdown.step_leaves)
    spans: pd.DataFrame                  # rank, step, start_ns, end_ns, dur_ns (step markers)
    calls: pd.DataFrame                  # comm_stats.MATCH_COLUMNS of the calls matching can key
    comm_parts: dict[str, pd.DataFrame]  # comm_stats.summary_parts: the communication table's sums
    comm_counts: pd.DataFrame            # counters.comm_counts: calls and bytes per step
    kernels: pd.DataFrame                # kernel_time.kernel_stats
    launch: pd.DataFrame                 # kernel_time.launch_stats (a row, or none on a CPU rank)
    graphs: dict[str, int]               # kernel_time.graph_activity
    shapes: mfu.TraceShapes
    overlap: pd.DataFrame                # comm_stats.overlap_by_rank
    row: dict[str, Any]                  # the report's ``ranks`` entry
    comm_ops: pd.DataFrame               # dim, op, count, total_ns, bytes: labelled call regions
    counts: pd.DataFrame                 # counters.event_counts
    evidence: findings.EvidenceParts
    microbatches: pd.DataFrame           # timeline.microbatches
    memory: dict[str, Any] | None = None  # memory.of_rank: the report's memory.per_rank entry
    file: str | None = None
    cached: bool = False


def summarize(events: EventTable, manifest: dict[str, Any] | None = None, *,
              run_comm: pd.DataFrame | None = None, world: int | None = None,
              views_dir: str | Path | None = None, run: str | Path | None = None) -> RankSummary:
    """The summary of the one rank ``events`` holds.

    ``manifest``: the run's (stages, for the microbatches); ``run_comm``: the collectors'
    communication rows of this rank (``comm.parquet``), used instead of the trace's own when
    given; ``world``: the job's world size where the trace does not say it; ``views_dir``: where
    the rank writes its parts of the views; ``run``: the run directory (the collectors' memory count
    and the window's memory files)."""
    (summary,) = summarize_ranks(events, manifest, run_comm=run_comm, world=world, views_dir=views_dir, run=run)
    return summary


def summarize_ranks(events: EventTable, manifest: dict[str, Any] | None = None, *,
                    run_comm: pd.DataFrame | None = None, world: int | None = None,
                    views_dir: str | Path | None = None, run: str | Path | None = None) -> list[RankSummary]:
    """The summaries of the ranks ``events`` holds, made in one pass over their events together,
    as :func:`collapse` leaves summaries: the first holds the ranks' sums and per-rank rows, each
    summary its own rank's report row, metadata and memory.  Equal, folded, to summarizing each
    rank alone (every analysis here keys its rows by rank); what it saves is the fixed cost of the
    few hundred small frames an analysis makes, paid once for all the ranks, not once a rank: the
    map of a job of thousands of small traces hands a worker several ranks at a time.

    Options as :func:`summarize`; ``run_comm``: the communication rows of these ranks."""
    ranks = events.rank_ids
    metas = {r: {k: v for k, v in events.ranks[r].items() if k != "memory"} for r in ranks}
    # What the calls and their links read of a rank's metadata is one value for the lot: ranks of
    # other devices or world sizes (a mixed job) are summarized each alone.
    devices = {m.get("device_name") or Manifest.of(manifest).device_name for m in metas.values()}
    if len(devices) > 1 or len({m.get("world_size") for m in metas.values()}) > 1:
        return [s for r in ranks for s in summarize_ranks(_rank_of(events, r), manifest, run_comm=_rows_of(run_comm, r),
                                                            world=world, views_dir=views_dir, run=run)]
    ctx = Context.of_events(events, manifest)
    ev = ctx.events
    leaves = ctx.leaves
    rank_steps = breakdown.per_rank_step(leaves)
    if run_comm is not None:
        calls = comm_stats.calls_from_run(run_comm)
        calls = calls[_in_traced_steps(calls, leaves)]
    else:
        calls = comm_stats.calls_from_trace(ev, world=world)
    calls = comm_stats.add_exposure(calls, comm_stats.exposure_sets(ev, ctx.plans))
    calls = compact_calls(calls.reindex(columns=CALL_COLUMNS))
    steady = findings.steady(leaves)[["rank", "step"]].drop_duplicates()
    links = comm_stats.Links.of(devices.pop(), world, Manifest.of(manifest).raw)
    rows = _rank_rows(ev, ranks, rank_steps)
    sums = {"leaves": leaves, "spans": kernel_time.step_spans(ev), "calls": comm_stats.matchable(calls),
            "comm_parts": comm_stats.summary_parts(calls, links), "comm_counts": counters.comm_counts(calls),
            "kernels": kernel_time.kernel_stats(ev), "launch": kernel_time.launch_stats(ev),
            "graphs": kernel_time.graph_activity(ev), "shapes": mfu.TraceShapes.of(ev),
            "overlap": comm_stats.overlap_by_rank(ev), "comm_ops": _comm_ops(ev), "counts": counters.event_counts(ev),
            "evidence": findings.gather_parts(ev, steady, ctx.plans), "microbatches": ctx.microbatches}
    # The allocator's summary (400 points a device) becomes the rank's memory entry and its part of
    # the memory view here; kept in the meta too, it was 127 KB a rank in a 1,024-rank parent.
    summaries = [RankSummary(rank=r, meta=metas[r], row=rows[r],
                             memory=memory.of_rank(r, events.ranks[r].get("memory"), run, views_dir),
                             **(sums if r == ranks[0] else _no_parts())) for r in ranks]
    if views_dir is not None:
        _write_views(Path(views_dir), ranks, timeline.segments(ev, ctx.plans), calls)
    return summaries


def _no_parts() -> dict[str, Any]:
    """The fields of a summary whose ranks' sums and rows another summary holds (:func:`collapse`)."""
    return {**{name: _EMPTY[name] for name in _ROWS + ("kernels", "comm_counts", "counts", "comm_ops")},
            "calls": _EMPTY["calls"], "comm_parts": {}, "graphs": {"captures": 0, "replays": 0},
            "shapes": _NO_SHAPES, "evidence": findings.EvidenceParts()}


def _rank_of(events: EventTable, rank: int) -> EventTable:
    """The events and metadata of one of the ranks ``events`` holds."""
    return EventTable(events.table.filter(events.table.column("rank").to_numpy() == rank), {rank: events.ranks[rank]})


def _rows_of(frame: pd.DataFrame | None, rank: int) -> pd.DataFrame | None:
    return None if frame is None else frame[frame["rank"] == rank]


def _in_traced_steps(calls: pd.DataFrame, leaves: pd.DataFrame) -> np.ndarray:
    """Which of the collectors' ``calls`` fall in a step the rank's trace holds (all of a rank
    whose trace has no step)."""
    if leaves.empty:
        return np.ones(len(calls), dtype=bool)
    step = pd.to_numeric(calls["step"], errors="coerce").to_numpy()
    known = ~np.isnan(step)
    traced = np.zeros(len(calls), dtype=bool)
    traced[known] = findings.pair_in(calls[known], leaves)
    return traced | ~calls["rank"].isin(leaves["rank"].unique()).to_numpy()


#: The calls' text columns: a few distinct values a rank (a 1,024-rank group's list is 5 KB of text).
_TEXT = ("dim", "op", "pg", "group_ranks")


def compact_calls(calls: pd.DataFrame) -> pd.DataFrame:
    """The calls with their text columns as categoricals: each distinct value held once."""
    return calls.assign(**{c: calls[c].astype(object).astype("category") for c in _TEXT})


def concat_calls(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The ranks' calls (:attr:`RankSummary.calls`) as one frame whose text columns stay categorical
    (their categories united: a plain concat would expand every value to a Python string)."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=comm_stats.MATCH_COLUMNS)
    out = pd.concat([f.drop(columns=list(_TEXT)) for f in frames], ignore_index=True)
    for c in _TEXT:
        out[c] = union_categoricals([f[c] for f in frames], ignore_order=True)
    return out[comm_stats.MATCH_COLUMNS]


def collapse(summaries: list[RankSummary]) -> None:
    """Fold ``summaries`` into the first, leaving the others' frames empty: the job-wide sums (the
    kernel histograms, the findings' evidence, the counters, whose names repeat on every rank) are
    summed, and the per-rank rows (leaves, spans, launch, overlap, microbatches; each keeps its
    ``rank`` column) stacked.  The reduce reads the same totals and rows (:func:`stacked` puts the
    rows back in rank order), and a parent folding thousands of ranks holds a few frames, not a
    dozen small ones a rank (each ~2 KB of pandas objects before any row)."""
    first, rest = summaries[0], summaries[1:]
    if not rest:
        return
    first.kernels = kernel_time.combine_stats([s.kernels for s in summaries])
    first.evidence = findings.combine_parts([s.evidence for s in summaries])
    first.comm_parts = comm_stats.combine_parts([s.comm_parts for s in summaries])
    first.comm_counts = _summed([s.comm_counts for s in summaries], ["dim", "op", "step"])
    first.counts = _summed([s.counts for s in summaries], ["kind", "step"])
    first.comm_ops = _summed([s.comm_ops for s in summaries], ["dim", "op"])
    first.shapes = mfu.TraceShapes.merge([s.shapes for s in summaries])
    for name in _ROWS:
        frames = [f for f in (getattr(s, name) for s in summaries) if len(f)]
        if frames:
            setattr(first, name, pd.concat(frames, ignore_index=True))
    for s in rest:  # shared empty frames: an empty slice would keep the whole buffers alive
        s.kernels, s.comm_counts, s.counts, s.comm_ops = (_EMPTY[k] for k in ("kernels", "comm_counts", "counts",
                                                                                "comm_ops"))
        s.evidence = findings.EvidenceParts()
        s.comm_parts = {}
        s.shapes = _NO_SHAPES
        for name in _ROWS:
            setattr(s, name, _EMPTY[name])


#: The per-rank rows a collapse stacks into the first summary.
_ROWS = ("leaves", "spans", "launch", "overlap", "microbatches")
_EMPTY = {
    "kernels": pd.DataFrame(columns=kernel_time.KERNEL_STAT_COLUMNS),
    "comm_counts": pd.DataFrame(columns=counters.COMM_COUNT_COLUMNS),
    "counts": pd.DataFrame(columns=["kind", "step", "count"]),
    "comm_ops": pd.DataFrame(columns=["dim", "op", "count", "total_ns", "bytes"]),
    "leaves": pd.DataFrame(columns=["rank", "step", "leaf", "seconds"]),
    "spans": pd.DataFrame(columns=["rank", "step", "start_ns", "end_ns", "dur_ns"]),
    "launch": pd.DataFrame(columns=kernel_time.LAUNCH_COLUMNS),
    "overlap": pd.DataFrame(columns=comm_stats.OVERLAP_COLUMNS),
    "microbatches": pd.DataFrame(columns=timeline.MICROBATCH_COLUMNS),
    "calls": pd.DataFrame(columns=comm_stats.MATCH_COLUMNS),
}
_NO_SHAPES = mfu.TraceShapes(pd.DataFrame(columns=["step", "dtype", "flops"]))


def stacked(frames: list[pd.DataFrame], columns: list[str] | None = None) -> pd.DataFrame:
    """The per-rank rows of summaries (some collapsed: :func:`collapse`) as one frame in rank order,
    each rank's rows in their own order -- what concatenating the summaries by rank gives."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=columns)
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    return out.sort_values("rank", kind="stable", ignore_index=True)


def _summed(frames: list[pd.DataFrame], keys: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=keys)
    return pd.concat(frames, ignore_index=True).groupby(keys, as_index=False).sum(numeric_only=True)


def _write_views(views_dir: Path, ranks: list[int], segments: pd.DataFrame, calls: pd.DataFrame) -> None:
    """Each rank's part of the timeline and collective views: its own rows, its text columns'
    categories the values it holds (as a rank summarized alone writes them)."""
    for name, frame in ((TIMELINE, segments), (COMM_CALLS, calls)):
        at = frame.groupby("rank").indices if len(frame) else {}
        for rank in ranks:
            part = _pruned(frame.iloc[at.get(rank, [])])
            path = views_dir / name / f"rank{rank:05d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_parquet(path, pa.Table.from_pandas(part, preserve_index=False))


def _pruned(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its categorical columns' unused categories removed."""
    return frame.assign(**{c: frame[c].cat.remove_unused_categories() for c in frame.columns
                           if isinstance(frame[c].dtype, pd.CategoricalDtype)})


def _rank_rows(events: EventTable, ranks: list[int], rank_steps: pd.DataFrame) -> dict[int, dict[str, Any]]:
    """Each rank's entry of the report's ``ranks``: median step and wait, device time by kind,
    communication.  (Totals of integer durations, read with masks: a groupby per kind cost more
    than the rest of the row.)"""
    df = events.to_pandas(["rank", "kind", "dur_ns", "device"])
    kind, dur, on_device = df["kind"], df["dur_ns"].to_numpy(), df["device"].to_numpy() >= 0
    of_rank = df["rank"].to_numpy()
    kernel = (kind == "kernel").to_numpy() & on_device
    copies = kind.isin(["memcpy", "memset"]).to_numpy() & on_device
    comm = (kind == "comm").to_numpy()
    steps_of = rank_steps.groupby("rank").indices if len(rank_steps) else {}
    step_s, wait_s = rank_steps["step_s"].to_numpy(), rank_steps["wait_s"].to_numpy()
    rows = {}
    for rank in ranks:
        mine = of_rank == rank
        steps = steps_of.get(rank, np.empty(0, dtype=np.intp))
        rows[rank] = {"rank": rank, "steps": int(len(steps)),
                      "step_time_s": float(np.median(step_s[steps])) if len(steps) else None,
                      "wait_s": float(np.median(wait_s[steps])) if len(steps) else None,
                      "compute_kernel_s": float(dur[kernel & mine].sum() / 1e9),
                      # GPU communication kernels, or gloo work on CPU threads
                      "comm_s": float(dur[comm & mine].sum() / 1e9),
                      "memory_s": float(dur[copies & mine].sum() / 1e9)}
    return rows


def _comm_ops(events: EventTable) -> pd.DataFrame:
    """The labelled call regions on the training thread (``mfuscope.comm/<dim>/<op>``) per (dim,
    op): count, total_ns, bytes (the report's ``comm_calls``, summed over ranks by the reduce)."""
    df = events.to_pandas(["name", "op", "dim", "bytes", "dur_ns"])
    df = df[df["name"].str.startswith(labels.COMM)]
    if df.empty:
        return pd.DataFrame(columns=["dim", "op", "count", "total_ns", "bytes"])
    df = df.assign(op=df["op"].fillna("unknown"), dim=df["dim"].fillna("unknown"),
                   known_bytes=df["bytes"].where(df["bytes"] >= 0, 0))
    return grouped(df, ["dim", "op"], count=("dur_ns", "size"), total_ns=("dur_ns", "sum"),
                   bytes=("known_bytes", "sum"))
