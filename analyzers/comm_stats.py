"""Communication: how much, how fast, how much of it the step waited for, and who was late.

Calls come from the collectors' ``comm.parquet`` when the run has one (every
call, with group and sequence number), else from the trace's communication
work (NCCL kernels, gloo threads).  Columns of :func:`calls_from_*`: rank,
step, dim, op, bytes, group_size, pg, seq, enqueue_ns, start_ns, end_ns.

Exposed time of a call: the part of it the breakdown gives to communication
or bubble -- on a GPU rank, nothing but communication runs; on a CPU rank, the
training thread is blocked in communication.  Overlapping calls share their
time, one owner per instant (:func:`add_exposure`), so the table's total and
exposed seconds never exceed the ranks' step time.

Bandwidth, as nccl-tests defines it: algbw = bytes / time; busbw = algbw x
2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and
all_to_all, 1 for broadcast and point-to-point.

Against the links (:class:`Links`): a row's bus bandwidth over what the link of its tier carries a
direction per device (half the hardware table's bidirectional figure: the scale-up link when the
group sits in one node, the NIC when it spans nodes), flagged under :data:`FAR_BELOW` for calls of
16 MiB and more (smaller ones are latency-bound: nccl-tests itself stays far under the link there).
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mfuscope import hardware
from mfuscope.event_table import EventTable

from . import breakdown, collective_match, duration_sketch, group_dims
from . import intervals as iv
from .duration_sketch import weighted_median
from .group_sums import grouped

SIZE_BUCKETS = [0, 64 << 10, 1 << 20, 16 << 20, 256 << 20, np.inf]
BUCKET_NAMES = ["<64KiB", "64KiB-1MiB", "1-16MiB", "16-256MiB", ">=256MiB"]
UNKNOWN = "unknown size"
#: Buckets whose calls are judged against the links: from 16 MiB a collective's time is its bytes over the
#: bandwidth; below, latency (launch, protocol handshakes, a ring's n-1 hops) sets it and nccl-tests
#: itself stays far under the link (16 H100s on two nodes: 9.7 GB/s bus bandwidth at 1 MiB, 33 at 16 MiB,
#: 339 at 8 GiB; tests/fixtures/nccl_tests/all_reduce_perf_h100_2x8.txt).
BANDWIDTH_BOUND = ("16-256MiB", ">=256MiB")
#: A bandwidth-bound row is flagged when its bus bandwidth is under this share of what its tier's link
#: carries: at 16 MiB nccl-tests reaches two thirds of the NIC across two H100 nodes, so a row under 10%
#: lost most of its bandwidth to something other than message size.
FAR_BELOW = 0.10


@dataclass(frozen=True)
class Links:
    """What one device's links carry a direction (GB/s, the unit of nccl-tests' bus bandwidth), and
    which ranks share a node.  From the hardware table (half its bidirectional figures) and, for the
    node, the run's ``local_world_size`` or hosts when the manifest has them, else the device's
    scale-up domain (8 on an HGX/DGX board or an MI300X platform, 72 in an NVL72 rack), assumed."""

    device: str
    scale_up_gbps: float
    scale_out_gbps: float | None
    ranks_per_node: int
    world: int | None
    node_source: str
    link_source: str

    @classmethod
    def of(cls, device_name: str | None, world: int | None,
           manifest: Mapping[str, Any] | None = None) -> Links | None:
        acc = hardware.lookup(device_name, warn=False)  # an unknown device is already warned about for MFU
        if acc is None:
            return None
        raw = manifest or {}
        hosts = raw.get("hosts") or []
        if raw.get("local_world_size"):
            rpn, how = int(raw["local_world_size"]), "the run's local world size"
        elif len(hosts) > 1 and world and world % len(hosts) == 0:
            rpn, how = world // len(hosts), f"{world} ranks on {len(hosts)} hosts"
        else:
            rpn, how = acc.scaleup_domain, (f"assumed from the {acc.key}'s reference system, whose scale-up link "
                                            f"joins {acc.scaleup_domain}")
        source = f"hardware table: {acc.key}, scale-up link {acc.link_gbps:g} GB/s bidirectional" + (
            f", NIC {acc.nic_gbps:g} GB/s bidirectional ({acc.nic_source})" if acc.nic_gbps else ", no NIC figure")
        return cls(acc.key, acc.link_gbps / 2, acc.nic_gbps / 2 if acc.nic_gbps else None, max(rpn, 1),
                   world, how, source)

    def tier(self, group_size: int, ranks: str | None = None) -> tuple[str, str]:
        """("scale-up" or "scale-out", how it is known) for a group of ``group_size`` ranks, whose
        members (``"0,1,2"``) are given when the calls carry them.  Ranks fill nodes in order
        (torchrun's node-major numbering)."""
        members = _members(ranks)
        if members:
            nodes = {r // self.ranks_per_node for r in members}
            return ("scale-up", "its ranks share a node") if len(nodes) == 1 else ("scale-out", "its ranks span nodes")
        if group_size > self.ranks_per_node:
            return "scale-out", "the group is larger than a node"
        if self.world and self.world <= self.ranks_per_node:
            return "scale-up", "the whole job fits in a node"
        return "scale-out", "assumed: the group's ranks are not known, so the lower figure"

    def attainable_gbps(self, tier: str) -> float | None:
        return self.scale_up_gbps if tier == "scale-up" else self.scale_out_gbps


def _members(ranks: Any) -> list[int] | None:
    """``"0,1,2"`` -> [0, 1, 2]; None for a missing or truncated list (Kineto's ``"[0, 1, ..., 29, ...]"``)."""
    if not isinstance(ranks, str) or not ranks:
        return None
    try:
        return [int(r) for r in ranks.split(",")]
    except ValueError:
        return None


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


def calls_from_trace(events: EventTable, world: int | None = None) -> pd.DataFrame:
    """The trace's communication work as calls.  ``group_size``: the whole rank list's length where
    the call has it, else the size the rank's trace states for its process group (``Group size``,
    ``pg_config``: :func:`.group_dims.group_size_of`), else the world; never a cut list's
    (Kineto keeps 30 ranks of a larger group, which the loader does not take for the group).
    ``world``: the job's world size where no trace states it (a rank summarized alone)."""
    df = events.to_pandas(["rank", "kind", "step", "dim", "op", "bytes", "group_ranks", "pg", "seq", "ts_ns", "dur_ns"])
    df = df[df["kind"] == "comm"]
    sizes = df["group_ranks"].fillna("").map(lambda s: s.count(",") + 1 if s else 0)
    world = max((m.get("world_size") or 0 for m in events.ranks.values()), default=0) or world or len(events.rank_ids)
    groups = group_dims.groups_by_rank(events)
    stated = pd.Series([group_dims.group_size_of(groups, int(r), pg) or 0 for r, pg in zip(df["rank"], df["pg"])],
                       index=df.index, dtype="int64")
    sizes = sizes.where(sizes > 0, stated)
    return pd.DataFrame(index=df.index, data={  # every column on df's index: given, none is aligned
        "rank": df["rank"], "step": df["step"], "dim": df["dim"].fillna("unknown"), "op": df["op"].fillna("unknown"),
        "bytes": df["bytes"].where(df["bytes"] >= 0), "group_size": sizes.where(sizes > 0, world),
        "group_ranks": df["group_ranks"], "pg": df["pg"], "seq": df["seq"], "enqueue_ns": df["ts_ns"],
        "start_ns": df["ts_ns"], "end_ns": df["ts_ns"] + df["dur_ns"]}).reset_index(drop=True)


def exposure_sets(events: EventTable,
                  plans: Iterable[breakdown.StepPlan] | None = None) -> dict[int, tuple[tuple, tuple]]:
    """rank -> (exposed, steps): the instants the breakdown gives to communication or bubble
    (exposed communication: on a GPU rank nothing but communication runs, on a CPU rank the
    training thread waits for a collective), and the rank's step windows.  The table takes its
    exposed time from these, so it counts what the breakdown counts.  ``plans``:
    :func:`breakdown.step_plans` of ``events`` where the caller has made them."""
    parts: dict[int, list] = {}
    for rank, _, (lo, hi), plan in breakdown.step_plans(events) if plans is None else plans:
        s, e, names = iv.segments_by_priority((lo, hi), plan, rest="idle")
        waiting = np.array([n.startswith("comm/") or n == "bubble" for n in names], dtype=bool)
        parts.setdefault(rank, []).append((s[waiting], e[waiting], lo, hi))
    out = {}
    for rank, p in parts.items():
        exposed = iv.union(np.concatenate([x[0] for x in p]), np.concatenate([x[1] for x in p]))
        windows = iv.union(np.array([x[2] for x in p]), np.array([x[3] for x in p]))
        out[rank] = (exposed, windows)
    return out


def add_exposure(calls: pd.DataFrame, sets: dict) -> pd.DataFrame:
    """Adds ``dur_ns`` (each call's own span, for bandwidths), ``inflight_ns`` and ``exposed_ns``.

    Calls of a rank overlap -- a pipeline send is posted early and waited on at the step's end,
    FSDP prefetches -- so summing their spans would count an instant several times and give a
    rank more communication time than wall time.  Instead every instant goes to one call: of the
    calls in flight then, the one that ends first (the one the rank is about to have back).
    ``inflight_ns`` is a call's share of the time any call is in flight, ``exposed_ns`` its share
    of the breakdown's exposed communication and bubble (:func:`exposure_sets`), both within the
    rank's step windows.  Per rank both add up to at most its steps' time, and the exposed
    seconds of a rank with calls add up to its breakdown's."""
    calls = calls.copy()
    start = calls["start_ns"].to_numpy(dtype="float64")
    end = calls["end_ns"].to_numpy(dtype="float64")
    inflight, exposed = np.full(len(calls), np.nan), np.full(len(calls), np.nan)
    for rank, idx in calls.groupby("rank").indices.items():
        ok = idx[~(np.isnan(start[idx]) | np.isnan(end[idx]))]
        if not len(ok):
            continue
        s, e = start[ok].astype(np.int64), np.maximum(end[ok].astype(np.int64), start[ok].astype(np.int64))
        points = np.unique(np.concatenate([s, e]))
        seg = np.diff(points).astype(np.float64)
        if rank not in sets:
            inflight[ok] = _owned(s, e, points, seg)
            continue
        waiting, windows = sets[rank]
        inflight[ok] = _owned(s, e, points, np.diff(iv.covered_before(windows, points)).astype(np.float64))
        # The breakdown's waits before the first or after the last call too: the points must span them.
        wpoints = np.unique(np.concatenate([points, waiting[0], waiting[1]]))
        exposed[ok] = _owned(s, e, wpoints, np.diff(iv.covered_before(waiting, wpoints)).astype(np.float64),
                             nearest=True)
    calls["dur_ns"] = (calls["end_ns"] - calls["start_ns"]).astype("float64")
    calls["inflight_ns"] = inflight
    calls["exposed_ns"] = exposed
    return calls


def _owned(starts: np.ndarray, ends: np.ndarray, points: np.ndarray, weight: np.ndarray,
           nearest: bool = False) -> np.ndarray:
    """Each elementary segment [points[i], points[i+1]) gives ``weight[i]`` to the in-flight
    interval that ends first; returns what each interval got.  With ``nearest``, a segment no
    interval covers goes to the one that ended last before it (else the next to start): the
    breakdown sees a thread still waiting a little after the collectors stamped the call's end
    (its future's callback), and that wait is the call's."""
    out = np.zeros(len(starts))
    order = np.argsort(starts, kind="stable")
    heap: list[tuple[int, int]] = []
    k, recent = 0, -1
    for i in range(len(points) - 1):
        t = points[i]
        while k < len(order) and starts[order[k]] <= t:
            heapq.heappush(heap, (int(ends[order[k]]), int(order[k])))
            k += 1
        while heap and heap[0][0] <= t:
            recent = heapq.heappop(heap)[1]
        if weight[i] <= 0:
            continue
        if heap:
            out[heap[0][1]] += weight[i]
        elif nearest:
            out[recent if recent >= 0 else order[min(k, len(order) - 1)]] += weight[i]
    return out


#: The groups of the communication table: a row per (dimension, op, size bucket).
ROW_KEYS = ["dim", "op", "size"]


def summary_parts(calls: pd.DataFrame, links: Links | None = None) -> dict[str, pd.DataFrame]:
    """What :func:`summarize` needs of some ranks' calls, as sums and counts that add up over ranks
    read apart: per (dim, op, size bucket) the counts and sums (``sums``), and the counts of each
    value its medians and most common tier are read from -- bus bandwidths as
    :mod:`.duration_sketch` buckets (``algbw``), group sizes (``group_size``), message sizes of the
    timed calls (``timed_bytes``), the link tiers with ``links`` (``tier``)."""
    empty = {"sums": pd.DataFrame(columns=[*ROW_KEYS, "count", "bytes", "bytes_n", "inflight", "exposed",
                                           "exposed_n"])}
    if calls.empty:
        return empty
    # A call whose size the trace does not give is in its own bucket, and out of the bandwidths:
    # as 0 bytes it would pull the small-message figures down.
    known = calls["bytes"].where(calls["bytes"] >= 0)
    bucket = pd.cut(known, SIZE_BUCKETS, labels=BUCKET_NAMES, right=False).astype(object).where(known.notna(), UNKNOWN)
    none = pd.Series(np.nan, index=calls.index)
    c = pd.DataFrame({"dim": calls["dim"].astype(str), "op": calls["op"].astype(str), "size": bucket.astype(str),
                      "bytes": known, "inflight": calls.get("inflight_ns", calls["dur_ns"]),  # else its own span
                      "exposed": calls.get("exposed_ns", none), "dur": calls["dur_ns"],
                      "group_size": calls["group_size"]})
    out = {"sums": grouped(c, ROW_KEYS, count=("op", "size"), bytes=("bytes", "sum"), bytes_n=("bytes", "count"),
                           inflight=("inflight", "sum"), exposed=("exposed", "sum"),
                           exposed_n=("exposed", "count"))}
    timed = c[(c["dur"] > 0) & c["bytes"].notna()]
    per_value = [*ROW_KEYS, "value"]
    timed_keys = {k: timed[k] for k in ROW_KEYS}
    out["algbw_exact"] = grouped({**timed_keys, "value": timed["bytes"] / (timed["dur"] / 1e9)}, per_value,
                                 n=("value", "size"))
    out.update(_settle(out))
    out["timed_bytes"] = grouped({**timed_keys, "value": timed["bytes"]}, per_value, n=("value", "size"))
    out["group_size"] = grouped({**{k: c[k] for k in ROW_KEYS}, "value": c["group_size"]}, per_value,
                                n=("value", "size"))
    if links is not None:
        ranks = calls["group_ranks"] if "group_ranks" in calls else pd.Series([None] * len(calls), index=calls.index)
        tiers = [links.tier(int(n), r) if pd.notna(n) else None for n, r in zip(c["group_size"], ranks)]
        c = c.assign(tier=[t[0] if t else None for t in tiers], how=[t[1] if t else None for t in tiers])
        out["tier"] = grouped(c, [*ROW_KEYS, "tier", "how"], dropna=False, n=("op", "size"))
    return out


_PART_KEYS = {"sums": ROW_KEYS, "algbw": [*ROW_KEYS, "value"], "algbw_exact": [*ROW_KEYS, "value"],
              "timed_bytes": [*ROW_KEYS, "value"], "group_size": [*ROW_KEYS, "value"],
              "tier": [*ROW_KEYS, "tier", "how"]}
#: A row's bandwidths are kept exactly up to this many calls (its median then exact); beyond, as
#: :mod:`.duration_sketch` buckets (its median within the sketch's relative error).
EXACT_LIMIT = 256


def _settle(parts: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The rows whose exact bandwidths outgrow :data:`EXACT_LIMIT` moved into the sketch's buckets."""
    exact = parts.get("algbw_exact")
    if exact is None or exact.empty:
        return {}
    sketched = parts.get("algbw")
    if (sketched is None or sketched.empty) and exact["n"].sum() <= EXACT_LIMIT:
        return {}  # no row can hold more calls than all rows together (a rank's few: no groupby)
    total = exact.groupby(ROW_KEYS)["n"].transform("sum")
    has_buckets = (pd.MultiIndex.from_frame(exact[ROW_KEYS]).isin(pd.MultiIndex.from_frame(sketched[ROW_KEYS]))
                   if sketched is not None and len(sketched) else np.zeros(len(exact), dtype=bool))
    move = (total > EXACT_LIMIT).to_numpy() | has_buckets
    if not move.any():
        return {}
    moved = exact[move].assign(value=duration_sketch.buckets(exact.loc[move, "value"].to_numpy()))
    buckets = pd.concat([f for f in (sketched, moved) if f is not None and len(f)], ignore_index=True)
    return {"algbw_exact": exact[~move].reset_index(drop=True),
            "algbw": buckets.groupby([*ROW_KEYS, "value"], as_index=False)["n"].sum()}


def combine_parts(parts: list[dict[str, pd.DataFrame]]) -> dict[str, pd.DataFrame]:
    """:func:`summary_parts` of several ranks as one, the size of one rank's."""
    out = {}
    for name, keys in _PART_KEYS.items():
        frame = _parts(parts, name, keys)
        if frame is not None:
            out[name] = frame
    out.update(_settle(out))
    return out


def _parts(parts: list[dict[str, pd.DataFrame]], name: str, keys: list[str]) -> pd.DataFrame | None:
    frames = [p[name] for p in parts if name in p and len(p[name])]
    if not frames:
        return None
    return pd.concat(frames, ignore_index=True).groupby(keys, dropna=False).sum(numeric_only=True).reset_index()


def summarize(calls: pd.DataFrame | list[dict[str, pd.DataFrame]], links: Links | None = None) -> list[dict[str, Any]]:
    """Per (dim, op, size bucket): count, bytes, total and exposed seconds, overlap, bandwidths
    (medians within the sketch's 0.5%), the group size and median message size; with ``links``,
    the bus bandwidth against the link of the row's tier (:func:`against_links`).  ``calls``:
    the calls, or the :func:`summary_parts` of the ranks (computed with the same ``links``)."""
    parts = [summary_parts(calls, links)] if isinstance(calls, pd.DataFrame) else calls
    sums = _parts(parts, "sums", ROW_KEYS)
    if sums is None:
        return []
    combined = combine_parts(parts)
    counts = {name: combined.get(name) for name in ("algbw", "algbw_exact", "timed_bytes", "group_size")}
    grouped = {name: dict(tuple(f.groupby(ROW_KEYS))) if f is not None else {} for name, f in counts.items()}
    tiers = _parts(parts, "tier", [*ROW_KEYS, "tier", "how"]) if links is not None else None
    tier_of = dict(tuple(tiers.groupby(ROW_KEYS))) if tiers is not None else {}
    rows = []
    for r in sums.itertuples(index=False):
        key = (r.dim, r.op, r.size)
        total = r.inflight / 1e9  # in flight, one owner per instant
        exposed = r.exposed / 1e9 if r.exposed_n else None
        bw, exact, timed, sizes = (grouped[n].get(key) for n in ("algbw", "algbw_exact", "timed_bytes", "group_size"))
        if bw is not None and len(bw):  # many calls: the sketch's median
            algbw = duration_sketch.median(bw["value"].to_numpy(), bw["n"].to_numpy())
        else:  # few: the exact one
            algbw = (weighted_median(exact["value"].to_numpy(), exact["n"].to_numpy())
                     if exact is not None and len(exact) else None)
        n = (int(weighted_median(sizes["value"].to_numpy(), sizes["n"].to_numpy()))
             if sizes is not None and len(sizes) else 1)
        rows.append({"dim": r.dim, "op": r.op, "size": r.size, "count": int(r.count),
                     "bytes": int(r.bytes) if r.bytes_n else None, "total_s": float(total),
                     "exposed_s": None if exposed is None else float(exposed),
                     "overlap": None if exposed is None or total == 0 else float(1 - exposed / total),
                     "algbw_gbps": None if algbw is None else algbw / 1e9,
                     "busbw_gbps": None if algbw is None else algbw * bus_factor(r.op, n) / 1e9,
                     "group_size": n,
                     "median_bytes": (weighted_median(timed["value"].to_numpy(), timed["n"].to_numpy())
                                      if timed is not None and len(timed) else None)})
        if links is not None:
            rows[-1].update(against_links(rows[-1], tier_of.get(key), links))
    return sorted(rows, key=lambda r: -(r["exposed_s"] or r["total_s"]))


def against_links(row: dict[str, Any], tiers: pd.DataFrame | None, links: Links) -> dict[str, Any]:
    """A row's tier (the most common among its calls: ``tiers`` counts them, a call of unknown group
    size taking the row's), what that tier's link carries a direction (``attainable_busbw_gbps``),
    the row's bus bandwidth as a share of it, and ``flag``: True when a bandwidth-bound row
    (:data:`BANDWIDTH_BOUND`) is under :data:`FAR_BELOW` of it, False when it is not, None when the
    row cannot be judged (``link_note`` says why)."""
    known = tiers[tiers["tier"].notna()] if tiers is not None else None
    counts = known.groupby(["tier", "how"])["n"].sum() if known is not None and len(known) else pd.Series(dtype=int)
    unknown = int(tiers.loc[tiers["tier"].isna(), "n"].sum()) if tiers is not None else 0
    if unknown:
        fallback = links.tier(int(row["group_size"]))
        counts = counts.add(pd.Series({fallback: unknown}), fill_value=0)
    tier, how = counts.sort_values(ascending=False, kind="stable").index[0]
    attainable = links.attainable_gbps(tier)
    busbw = row["busbw_gbps"]
    share = busbw / attainable if busbw is not None and attainable else None
    if attainable is None:
        flag, note = None, f"no {tier} figure for the {links.device} in the hardware table"
    elif share is None:
        flag, note = None, "no bandwidth: no call of known size and duration"
    elif row["size"] not in BANDWIDTH_BOUND:
        flag, note = None, "latency-bound size (under 16 MiB): not judged"
    else:
        flag = share < FAR_BELOW
        note = (f"{busbw:.3g} GB/s, {share:.1%} of the {tier} link's {attainable:.0f} GB/s a direction"
                + (f" (under {FAR_BELOW:.0%} at 16 MiB and more)" if flag else ""))
    return {"tier": tier, "tier_source": f"{how}; {links.ranks_per_node} ranks a node, {links.node_source}",
            "attainable_busbw_gbps": attainable, "attainable_source": links.link_source,
            "busbw_of_attainable": share, "flag": flag, "link_note": note}


OVERLAP_COLUMNS = ["rank", "comm_s", "overlap", "compute_s", "non_compute_s", "idle_s"]


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
    starts, ends = df["ts_ns"].to_numpy(), (df["ts_ns"] + df["dur_ns"]).to_numpy()
    is_comm, is_compute = (df["kind"] == "comm").to_numpy(), (df["kind"] == "kernel").to_numpy()
    for rank, idx in df.groupby("rank").indices.items():  # positions into the columns: no frame a rank
        s, e, comm, comp = starts[idx], ends[idx], is_comm[idx], is_compute[idx]
        cu = iv.union(s[comm], e[comm])
        ku = iv.union(s[comp], e[comp])
        au = iv.union(s, e)
        comm_ns, busy_ns, compute_ns = iv.length(cu), iv.length(au), iv.length(ku)
        covered = int(iv.overlap(ku, cu[0], cu[1]).sum()) if comm_ns else 0
        span = int(au[1][-1] - au[0][0]) if busy_ns else 0
        rows.append({"rank": int(rank), "comm_s": comm_ns / 1e9,
                     "overlap": covered / comm_ns if comm_ns else None,
                     "compute_s": compute_ns / 1e9, "non_compute_s": (busy_ns - compute_ns) / 1e9,
                     "idle_s": (span - busy_ns) / 1e9})
    return pd.DataFrame(rows, columns=OVERLAP_COLUMNS)


#: What matching reads of a call (:func:`matchable`).
MATCH_COLUMNS = ["rank", "step", "dim", "op", "bytes", "group_size", "group_ranks", "pg", "seq", "enqueue_ns",
                 "end_ns"]


def matchable(calls: pd.DataFrame) -> pd.DataFrame:
    """The calls :mod:`.collective_match` can key -- collectives with a group and sequence number,
    or of a payload that names them (:data:`.collective_match.SAME_PAYLOAD`) -- with only what
    matching reads: a rank's summary keeps these, not every call."""
    c = calls[~calls["op"].isin(collective_match.P2P)]
    seq = pd.to_numeric(c["seq"], errors="coerce")
    numbered = c["pg"].notna() & seq.notna() & (seq >= 0)
    derived = (c["op"].isin(collective_match.SAME_PAYLOAD) & c["bytes"].notna()
               & (pd.to_numeric(c["step"], errors="coerce").fillna(-1) >= 0))
    return c.loc[numbered | derived, MATCH_COLUMNS].reset_index(drop=True)
