"""Device time by rank, stream and kind; step spans; top kernels.

Plain functions from an EventTable to DataFrames with documented columns.
"Device events" are kernels, communication kernels, memcpy and memset on GPU
lanes -- the same population HTA's kernel breakdown counts.
"""
from __future__ import annotations

import pandas as pd

from mfuscope.event_table import EventTable

DEVICE_WORK = ("kernel", "comm", "memcpy", "memset")


def _device_work(events: EventTable) -> pd.DataFrame:
    df = events.to_pandas(["rank", "lane", "stream", "kind", "name", "dur_ns", "step", "device"])
    df["kind"] = df["kind"].astype(str)
    return df[df["kind"].isin(DEVICE_WORK) & (df["device"] >= 0)]


def device_time(events: EventTable) -> pd.DataFrame:
    """Columns: rank, stream, kind, count, total_ns -- one row per (rank, stream, kind)."""
    df = _device_work(events)
    out = (df.groupby(["rank", "stream", "kind"], observed=True)["dur_ns"]
             .agg(count="count", total_ns="sum").reset_index())
    return out.sort_values(["rank", "stream", "kind"], ignore_index=True)


def step_spans(events: EventTable) -> pd.DataFrame:
    """Columns: rank, step, start_ns, end_ns, dur_ns -- from the step markers (CPU span)."""
    df = events.to_pandas(["rank", "kind", "step", "ts_ns", "dur_ns"])
    steps = df[df["kind"].astype(str) == "step"]
    out = steps.assign(start_ns=steps["ts_ns"], end_ns=steps["ts_ns"] + steps["dur_ns"])
    return out[["rank", "step", "start_ns", "end_ns", "dur_ns"]].sort_values(["rank", "step"], ignore_index=True)


def top_kernels(events: EventTable, n: int = 20) -> pd.DataFrame:
    """Columns: name, kind, count, total_ns, mean_ns, median_ns, share (of all device time)."""
    df = _device_work(events)
    if df.empty:
        return pd.DataFrame(columns=["name", "kind", "count", "total_ns", "mean_ns", "median_ns", "share"])
    g = df.groupby(["name", "kind"], observed=True)["dur_ns"]
    out = g.agg(count="count", total_ns="sum", mean_ns="mean", median_ns="median").reset_index()
    out["share"] = out["total_ns"] / out["total_ns"].sum()
    out["name"] = out["name"].astype(str)
    return out.sort_values("total_ns", ascending=False, ignore_index=True).head(n)
