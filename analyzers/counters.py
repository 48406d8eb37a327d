"""Per-step counters that do not depend on timing: what a deterministic CI gate compares.

A step's model FLOPs, its communication calls and bytes per (dim, op) and
bus bytes per dim, and
its kernels (GPU) or operators (CPU) by kind are fixed by the program, not by
how fast the machine ran it: two runs of one commit give the same numbers, and
a change that doubles tensor-parallel traffic doubles ``bytes_per_step`` of
``tp`` exactly.  ``mfuscope ci check`` fails on such changes with no noise to
allow for (docs/ci.md).

Every figure is a job total (all loaded ranks) per step, over the steps the
counts cover; the median over steps, so one step cut short by the end of a
trace window does not move it.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from mfuscope.event_table import EventTable

from .comm_stats import bus_factor
from .group_sums import as_str, grouped

#: Event kinds counted per step: the work a step launches (not annotations or runtime calls,
#: whose number follows the profiler's settings).
COUNTED_KINDS = ("kernel", "comm", "memcpy", "memset", "cpu_op")


def event_counts(events: EventTable) -> pd.DataFrame:
    """Columns kind, step, count: the events of :data:`COUNTED_KINDS` per step (ranks read apart
    concatenate; :func:`per_step` sums them)."""
    df = events.to_pandas(["kind", "step"])
    df = df[df["kind"].isin(COUNTED_KINDS)]
    return grouped({"kind": as_str(df["kind"]), "step": df["step"]}, ["kind", "step"], count=("step", "size"))


COMM_COUNT_COLUMNS = ["dim", "op", "step", "calls", "bytes", "bus_bytes"]


def comm_counts(calls: pd.DataFrame) -> pd.DataFrame:
    """Columns dim, op, step, calls, bytes, bus_bytes: some ranks' communication calls per step
    (ranks read apart concatenate; :func:`per_step` sums them).  Bus bytes are what a call puts on
    the wire (nccl-tests' bus factors): an all-reduce moves twice an all-gather's bytes, so trading
    all-gathers for all-reduces shows here."""
    if calls.empty:
        return pd.DataFrame(columns=COMM_COUNT_COLUMNS)
    c = pd.DataFrame({"dim": calls["dim"].astype(str), "op": calls["op"].astype(str), "step": calls["step"],
                      "bytes": calls["bytes"].fillna(0)})
    c["bus_bytes"] = c["bytes"] * [bus_factor(op, int(n)) for op, n in zip(c["op"], calls["group_size"].fillna(1))]
    return grouped(c, ["dim", "op", "step"], calls=("bytes", "size"), bytes=("bytes", "sum"),
                   bus_bytes=("bus_bytes", "sum"))


def per_step(counts: pd.DataFrame, comm: pd.DataFrame, steps: list[int], flops: dict[str, Any],
             calls_source: str) -> dict[str, Any]:
    """``counts``: :func:`event_counts` of the ranks; ``comm``: their :func:`comm_counts` (or the
    calls themselves: rank, step, dim, op, bytes, group_size)."""
    if "calls" not in comm:
        comm = comm_counts(comm)
    comm_rows = comm[comm["step"].isin(steps)]
    out_comm, bus = [], []
    if len(comm_rows):
        per_dim = comm_rows.groupby(["dim", "step"])["bus_bytes"].sum()
        for dim, g in per_dim.groupby(level=0):
            g = g.droplevel(0).reindex(steps, fill_value=0)
            bus.append({"dim": str(dim), "bus_bytes_per_step": float(g.median())})
        by_step = comm_rows.groupby(["dim", "op", "step"])[["calls", "bytes"]].sum()
        for (dim, op), g in by_step.groupby(level=[0, 1]):
            g = g.reindex(pd.MultiIndex.from_product([[dim], [op], steps]), fill_value=0)
            out_comm.append({"dim": str(dim), "op": str(op), "calls_per_step": float(g["calls"].median()),
                             "bytes_per_step": float(g["bytes"].median())})
    counts = counts[counts["step"].isin(steps)]
    kinds = []
    if len(counts):
        counts = counts.groupby(["kind", "step"])["count"].sum()
        for kind, g in counts.groupby(level=0):
            g = g.droplevel(0).reindex(steps, fill_value=0)
            kinds.append({"kind": kind, "count_per_step": float(g.median())})
    return {"steps": len(steps), "comm_source": calls_source,
            "model_flops_per_step": flops.get("model_flops_per_step"),
            "hardware_flops_per_step": flops.get("hardware_flops_per_step"),
            "comm": out_comm, "comm_bus": bus, "events": kinds}
