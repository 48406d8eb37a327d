"""Device time by rank, stream and kind; step spans; top kernels; small kernels and launch-bound ranks.

Plain functions from an EventTable to DataFrames with documented columns.
"Device events" are kernels, communication kernels, memcpy and memset on GPU
lanes -- the same population HTA's kernel breakdown counts.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from mfuscope.event_table import EventTable

from . import duration_sketch
from .group_sums import as_str, grouped
from .kernel_kinds import per_name

DEVICE_WORK = ("kernel", "comm", "memcpy", "memset")


def _device_work(events: EventTable) -> pd.DataFrame:
    df = events.to_pandas(["rank", "lane", "stream", "kind", "name", "dur_ns", "step", "device"])
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
    steps = df[df["kind"] == "step"]
    out = steps.assign(start_ns=steps["ts_ns"], end_ns=steps["ts_ns"] + steps["dur_ns"])
    return out[["rank", "step", "start_ns", "end_ns", "dur_ns"]].sort_values(["rank", "step"], ignore_index=True)


KERNEL_STAT_COLUMNS = ["name", "kind", "bucket", "count", "total_ns"]


def kernel_stats(events: EventTable) -> pd.DataFrame:
    """Device work per (name, kind) as a mergeable histogram of durations: one row per (name,
    kind, :mod:`.duration_sketch` bucket) with its count and total time.  Stats of ranks read apart
    concatenate into the stats of all of them (:func:`top_kernels` reads them)."""
    df = _device_work(events)
    if df.empty:
        return pd.DataFrame(columns=KERNEL_STAT_COLUMNS)
    columns = {"name": as_str(df["name"]), "kind": as_str(df["kind"]),
               "bucket": pd.Series(duration_sketch.buckets(df["dur_ns"].to_numpy()), index=df.index),
               "dur_ns": df["dur_ns"]}
    return grouped(columns, ["name", "kind", "bucket"], count=("dur_ns", "count"), total_ns=("dur_ns", "sum"))


def combine_stats(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """:func:`kernel_stats` of several ranks as one frame of the same form (one row per name,
    kind and bucket), the size of the job's distinct kernels, not of its ranks."""
    frames = [f for f in frames if len(f)]
    if len(frames) <= 1:
        return frames[0] if frames else pd.DataFrame(columns=KERNEL_STAT_COLUMNS)
    return pd.concat(frames).groupby(["name", "kind", "bucket"], as_index=False)[["count", "total_ns"]].sum()


def top_kernels(stats: pd.DataFrame | EventTable, n: int = 20) -> pd.DataFrame:
    """Columns: name, kind, count, total_ns, mean_ns, median_ns (within the sketch's
    :data:`~.duration_sketch.RELATIVE_ERROR`), share (of all device time).  ``stats``: the
    concatenated :func:`kernel_stats` of the ranks (or an EventTable)."""
    if isinstance(stats, EventTable):
        stats = kernel_stats(stats)
    if stats.empty:
        return pd.DataFrame(columns=["name", "kind", "count", "total_ns", "mean_ns", "median_ns", "share"])
    per = stats.groupby(["name", "kind", "bucket"], as_index=False)[["count", "total_ns"]].sum()
    g = per.groupby(["name", "kind"])
    out = g[["count", "total_ns"]].sum().reset_index()
    out["mean_ns"] = out["total_ns"] / out["count"]
    out["share"] = out["total_ns"] / out["total_ns"].sum()
    out = out.sort_values("total_ns", ascending=False, ignore_index=True).head(n)
    medians = {key: duration_sketch.median(h["bucket"].to_numpy(), h["count"].to_numpy())
               for key, h in g if key in set(zip(out["name"], out["kind"]))}
    out["median_ns"] = [medians[k] for k in zip(out["name"], out["kind"])]
    return out[["name", "kind", "count", "total_ns", "mean_ns", "median_ns", "share"]]


SMALL_KERNEL_NS = 10_000  # kernels under 10 us do too little work to hide their own launch
LAUNCH_BOUND_TIME_SHARE = 0.25  # ...and where they hold this much of the kernel time, launches set the pace


LAUNCH_COLUMNS = ["rank", "kernels", "median_kernel_us", "median_launch_us", "small_kernel_share", "small_kernel_s",
                  "launch_bound"]


def launch_stats(events: EventTable) -> pd.DataFrame:
    """Per GPU rank: is the device starved by kernel launches?

    Columns: rank, kernels, median_kernel_us, median_launch_us (host time of one launch call),
    small_kernel_share (of kernels under 10 us), small_kernel_s (their total time), launch_bound.
    A rank is launch-bound when its median kernel runs shorter than the host takes to launch
    one (the device then finishes each kernel before the next arrives, whatever the overlap)
    **and** such short kernels hold at least :data:`LAUNCH_BOUND_TIME_SHARE` of its kernel
    time: a 2 us median among kernels whose short ones are 1% of the time is no launch limit.
    """
    df = events.to_pandas(["rank", "kind", "name", "dur_ns", "device"])
    kind = df["kind"]
    kernels = df[(kind == "kernel") & (df["device"] >= 0)]
    launches = df[kind.isin(["runtime", "driver"]) & df["name"].str.contains("LaunchKernel", regex=False)]
    rows = []
    # each rank's rows as positions into the durations: one pass, not a scan (or a frame) per rank
    launch_of, launch_ns = launches.groupby("rank").indices, launches["dur_ns"].to_numpy()
    kernel_ns = kernels["dur_ns"].to_numpy()
    for rank, idx in kernels.groupby("rank").indices.items():
        k, lr = kernel_ns[idx], launch_ns[launch_of.get(rank, np.empty(0, dtype=np.intp))]
        small = k < SMALL_KERNEL_NS
        median_kernel, median_launch = float(np.median(k)), float(np.median(lr)) if len(lr) else None
        small_time = float(k[small].sum())
        short_enough = small_time >= LAUNCH_BOUND_TIME_SHARE * max(float(k.sum()), 1.0)
        rows.append({"rank": int(rank), "kernels": int(len(k)), "median_kernel_us": median_kernel / 1e3,
                     "median_launch_us": None if median_launch is None else median_launch / 1e3,
                     "small_kernel_share": float(small.mean()), "small_kernel_s": small_time / 1e9,
                     "launch_bound": bool(median_launch is not None and median_kernel < median_launch
                                          and short_enough)})
    return pd.DataFrame(rows, columns=LAUNCH_COLUMNS)


_CAPTURE = re.compile(r"^(cuda|hip)(StreamBeginCapture|StreamEndCapture|GraphInstantiate)")
_REPLAY = re.compile(r"^(cuda|hip)GraphLaunch")


def graph_activity(events: EventTable) -> dict[str, int]:
    """CUDA/HIP graph captures (stream capture, instantiation) and replays (graph launches) in the
    traced steps.  While a graph is captured the host records and the device idles by design,
    which is no steady-state host overhead; a replaying job already launches by graph."""
    df = events.to_pandas(["kind", "name", "step"])
    api = df["name"][(df["kind"].isin(["runtime", "driver"]) & (df["step"] >= 0)).to_numpy()]
    # each distinct name tested once (per_name), the calls counted under the masks
    return {"captures": int(per_name(api, lambda n: bool(_CAPTURE.match(n)), default=False).sum()),
            "replays": int(per_name(api, lambda n: bool(_REPLAY.match(n)), default=False).sum())}
