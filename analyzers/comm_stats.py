"""Communication: how much, how fast, how much of it the step waited for, and who was late.

Calls come from the collectors' ``comm.parquet`` when the run has one (every
call, with group and sequence number), else from the trace's communication
work (NCCL kernels, gloo threads).  Columns of :func:`calls_from_*`: rank,
step, dim, op, bytes, group_size, pg, seq, enqueue_ns, start_ns, end_ns.

Exposed time of a call: on a GPU rank, the part of it no compute kernel
overlaps; on a CPU rank, the part during which the training thread was
blocked in communication (the breakdown's comm leaves).

Bandwidth, as nccl-tests defines it: algbw = bytes / time; busbw = algbw x
2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and
all_to_all, 1 for broadcast and point-to-point.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from mfuscope.event_table import EventTable

from . import breakdown
from . import intervals as iv

SIZE_BUCKETS = [0, 64 << 10, 1 << 20, 16 << 20, 256 << 20, np.inf]
BUCKET_NAMES = ["<64KiB", "64KiB-1MiB", "1-16MiB", "16-256MiB", ">=256MiB"]


def bus_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def calls_from_run(comm: pd.DataFrame) -> pd.DataFrame:
    out = comm.copy()
    out["group_size"] = out["group_ranks"].str.count(",") + 1
    return out


def calls_from_trace(events: EventTable) -> pd.DataFrame:
    df = events.to_pandas(["rank", "kind", "step", "dim", "op", "bytes", "group_ranks", "pg", "seq", "ts_ns", "dur_ns"])
    df = df[df["kind"] == "comm"]
    sizes = df["group_ranks"].fillna("").map(lambda s: s.count(",") + 1 if s else 0)
    world = max((m.get("world_size") or 0 for m in events.ranks.values()), default=0) or len(events.rank_ids)
    return pd.DataFrame({
        "rank": df["rank"], "step": df["step"], "dim": df["dim"].fillna("unknown"), "op": df["op"].fillna("unknown"),
        "bytes": df["bytes"].where(df["bytes"] >= 0), "group_size": sizes.where(sizes > 0, world),
        "pg": df["pg"], "seq": df["seq"], "enqueue_ns": df["ts_ns"], "start_ns": df["ts_ns"],
        "end_ns": df["ts_ns"] + df["dur_ns"]}).reset_index(drop=True)


def exposure_sets(events: EventTable) -> dict[int, tuple[str, tuple[np.ndarray, np.ndarray]]]:
    """rank -> ("hidden_by", compute union) on GPU ranks, ("blocked", wait union) on CPU ranks."""
    df = events.to_pandas(["rank", "lane", "device", "kind", "name", "ts_ns", "dur_ns"])
    out = {}
    for rank, rdf in df.groupby("rank"):
        ends = rdf["ts_ns"] + rdf["dur_ns"]
        kernels = (rdf["kind"] == "kernel") & (rdf["device"] >= 0)
        if kernels.any():
            out[rank] = ("hidden_by", iv.union(rdf["ts_ns"][kernels].to_numpy(), ends[kernels].to_numpy()))
            continue
        steps = rdf[rdf["kind"] == "step"]
        main = (rdf["lane"] == steps["lane"].iloc[0]) if len(steps) else pd.Series(False, index=rdf.index)
        blocked = main & breakdown.blocked_in_comm(rdf)
        out[rank] = ("blocked", iv.union(rdf["ts_ns"][blocked].to_numpy(), ends[blocked].to_numpy()))
    return out


def add_exposure(calls: pd.DataFrame, sets: dict) -> pd.DataFrame:
    calls = calls.copy()
    dur = (calls["end_ns"] - calls["start_ns"]).astype("float64")
    exposed = np.full(len(calls), np.nan)
    for rank, idx in calls.groupby("rank").indices.items():
        if rank not in sets:
            continue
        how, union = sets[rank]
        s = calls["start_ns"].to_numpy()[idx]
        e = calls["end_ns"].to_numpy()[idx]
        ok = ~(np.isnan(s.astype(float)) | np.isnan(e.astype(float)))
        vals = np.full(len(idx), np.nan)
        if ok.any():
            s_ok, e_ok = s[ok].astype(np.int64), e[ok].astype(np.int64)
            ov = iv.overlap(union, s_ok, e_ok)
            vals[ok] = (e_ok - s_ok - ov) if how == "hidden_by" else ov
        exposed[idx] = vals
    calls["dur_ns"] = dur
    calls["exposed_ns"] = exposed
    return calls


def summarize(calls: pd.DataFrame) -> list[dict[str, Any]]:
    """Per (dim, op, size bucket): count, bytes, total and exposed seconds, overlap, bandwidths."""
    if calls.empty:
        return []
    c = calls.assign(bucket=pd.cut(calls["bytes"].fillna(0), SIZE_BUCKETS, labels=BUCKET_NAMES, right=False))
    rows = []
    for (dim, op, bucket), g in c.groupby(["dim", "op", "bucket"], observed=True):
        total = g["dur_ns"].sum() / 1e9
        exposed = g["exposed_ns"].sum() / 1e9 if g["exposed_ns"].notna().any() else None
        timed = g[(g["dur_ns"] > 0) & g["bytes"].notna()]
        algbw = float((timed["bytes"] / (timed["dur_ns"] / 1e9)).median()) if len(timed) else None
        n = int(g["group_size"].median()) if g["group_size"].notna().any() else 1
        rows.append({"dim": dim, "op": op, "size": str(bucket), "count": int(len(g)),
                     "bytes": int(g["bytes"].fillna(0).sum()), "total_s": float(total),
                     "exposed_s": None if exposed is None else float(exposed),
                     "overlap": None if exposed is None or total == 0 else float(1 - exposed / total),
                     "algbw_gbps": None if algbw is None else algbw / 1e9,
                     "busbw_gbps": None if algbw is None else algbw * bus_factor(op, n) / 1e9})
    return sorted(rows, key=lambda r: -(r["exposed_s"] or r["total_s"]))


def overlap_by_rank(events: EventTable) -> pd.DataFrame:
    """Per rank (GPU ranks only), over the whole trace:

    - comm_s: merged communication kernel time;
    - overlap: the share of it that compute kernels overlap (merged communication time covered
      by merged compute time, over merged communication time: HTA's ``get_comm_comp_overlap``);
    - compute_s, non_compute_s, idle_s: the device timeline from its first kernel to its last,
      split into compute running / only communication or memory work running / nothing running
      (HTA's temporal breakdown)."""
    df = events.to_pandas(["rank", "device", "kind", "ts_ns", "dur_ns"])
    df = df[(df["device"] >= 0) & df["kind"].isin(["kernel", "comm", "memcpy", "memset"])]
    rows = []
    for rank, rdf in df.groupby("rank"):
        ends = rdf["ts_ns"] + rdf["dur_ns"]
        comm = rdf["kind"] == "comm"
        comp = rdf["kind"] == "kernel"
        cu = iv.union(rdf["ts_ns"][comm].to_numpy(), ends[comm].to_numpy())
        ku = iv.union(rdf["ts_ns"][comp].to_numpy(), ends[comp].to_numpy())
        au = iv.union(rdf["ts_ns"].to_numpy(), ends.to_numpy())
        comm_ns, busy_ns, compute_ns = iv.length(cu), iv.length(au), iv.length(ku)
        covered = int(iv.overlap(ku, cu[0], cu[1]).sum()) if comm_ns else 0
        span = int(au[1][-1] - au[0][0]) if busy_ns else 0
        rows.append({"rank": int(rank), "comm_s": comm_ns / 1e9,
                     "overlap": covered / comm_ns if comm_ns else None,
                     "compute_s": compute_ns / 1e9, "non_compute_s": (busy_ns - compute_ns) / 1e9,
                     "idle_s": (span - busy_ns) / 1e9})
    return pd.DataFrame(rows, columns=["rank", "comm_s", "overlap", "compute_s", "non_compute_s", "idle_s"])


def matched(calls: pd.DataFrame) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Collectives matched across ranks by (group, sequence number).

    Returns (per-dimension arrival skew and whom everyone waited for, per-rank clock offsets
    estimated from the matched ends: all ranks leave a collective together)."""
    c = _match(calls)
    if c.empty:
        return [], []
    g = c.groupby("key")["arrival"]
    c = c.assign(second_last=g.shift(1).groupby(c["key"]).transform("last"))
    last = c.groupby("key").tail(1)
    waited = (last["arrival"] - last["second_last"]).fillna(0.0) / 1e9
    skew = []
    for dim, d in c.groupby("dim"):
        lags = d.groupby("key")["arrival_lag"].max() / 1e9
        lw = last[last["dim"] == dim].assign(waited=waited[last["dim"] == dim])
        culprits = lw.groupby("rank")["waited"].sum().sort_values(ascending=False)
        skew.append({"dim": dim, "instances": int(len(lags)), "median_skew_s": float(lags.median()),
                     "p90_skew_s": float(lags.quantile(0.9)),
                     "waited_for": [{"rank": int(r), "seconds": float(s)} for r, s in culprits.head(3).items() if s > 0]})
    ends = c.dropna(subset=["end_ns"])
    offsets = []
    if len(ends):
        rel = ends["end_ns"].astype("float64") - ends.groupby("key")["end_ns"].transform("median").astype("float64")
        for rank, r in rel.groupby(ends["rank"]):
            off = float(r.median())
            offsets.append({"rank": int(rank), "offset_s": off / 1e9,
                            "residual_s": float((r - off).abs().median()) / 1e9, "instances": int(len(r))})
    return skew, offsets


def _match(calls: pd.DataFrame) -> pd.DataFrame:
    """Collective calls every member of the group recorded, keyed by (group, sequence number), with
    ``arrival`` (enqueue ns) and ``arrival_lag`` (ns after the first member arrived)."""
    c = calls.dropna(subset=["pg", "seq"])
    c = c[(c["seq"] >= 0) & ~c["op"].isin(["send", "recv", "send_recv"])]
    if c.empty:
        return c.assign(key=[], arrival=[], arrival_lag=[])
    c = c.assign(key=c["pg"].astype(str) + "#" + c["seq"].astype("int64").astype(str))
    sizes = c.groupby("key")["rank"].transform("size")
    c = c[sizes == c["group_size"]]  # every member recorded it
    c = c.assign(arrival=c["enqueue_ns"].astype("float64")).sort_values(["key", "arrival"])
    return c.assign(arrival_lag=c["arrival"] - c.groupby("key")["arrival"].transform("min"))


def arrival_lags(calls: pd.DataFrame) -> list[dict[str, Any]]:
    """Rank x collective (dimension/op): how late each rank arrives at matched collectives -- median
    and p90 of its lag behind the group's first arrival, seconds.  A rank late everywhere is slow
    before the collective; a rank late in one dimension only waits on something of that dimension."""
    c = _match(calls)
    if c.empty:
        return []
    g = (c.assign(collective=c["dim"].astype(str) + "/" + c["op"].astype(str), lag=c["arrival_lag"] / 1e9)
         .groupby(["rank", "collective"])["lag"])
    out = pd.DataFrame({"median_lag_s": g.median(), "p90_lag_s": g.quantile(0.9), "instances": g.size()}).reset_index()
    return [{"rank": int(r.rank), "collective": r.collective, "median_lag_s": float(r.median_lag_s),
             "p90_lag_s": float(r.p90_lag_s), "instances": int(r.instances)} for r in out.itertuples()]
