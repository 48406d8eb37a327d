"""Collectives matched across ranks, partition by partition, in memory that does not grow with the job.

A collective is known across ranks by its process group and sequence number (where a trace numbers
none, by its group, step, op, payload and place: :func:`_match`).  Only the calls of one key ever
need each other, so the parent spools every rank's matchable calls to disk as the summaries arrive
(:class:`CallSpool`), partitioned by (group, sequence number) -- or (group, step) for the calls
matched by payload -- and matches one partition at a time.  What the report reads of the matches is
reduced as it goes:

- per key (a few per collective instance): the arrival skew of each dimension and whom everyone
  waited for, and the late arrivals of the steady steps (:class:`Matched`);
- per call (every rank's arrival lag and clock offset): spooled again, partitioned by rank, and
  reduced to medians per rank at the end -- exact, not sketched.

A group's members -- the ranks whose traces hold calls of it -- are counted while spooling, so a
partition holding part of a group's keys still knows how many ranks a complete key has.
"""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

#: Point-to-point calls pair two ranks, not a group: never matched.
P2P = ("send", "recv", "send_recv")
#: Collectives every member calls with the same payload: where a trace numbers no call (PyTorch before
#: ``Seq`` was recorded), one is known across ranks by its op and payload (:func:`_match`).  Not
#: all-to-all (uneven splits) nor point-to-point.
SAME_PAYLOAD = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
#: Calls buffered in the parent before they are written to their partitions.
FLUSH_ROWS = 1 << 18
#: Calls a partition is sized for (the partitions are fixed before the calls arrive: from the ranks).
PARTITION_RANKS = 16
MAX_PARTITIONS = 256
#: Per-call rows a rank partition of the second pass holds.
RANK_PARTITION_ROWS = 2_000_000

_SCHEMA = pa.schema([("rank", pa.int32()), ("step", pa.int64()), ("dim", pa.int32()), ("op", pa.int32()),
                     ("bytes", pa.int64()), ("group_size", pa.float64()), ("gid", pa.int32()),
                     ("numbered", pa.bool_()), ("seq", pa.int64()), ("arrival", pa.float64()),
                     ("end_ns", pa.float64())])
_PER_CALL = pa.schema([("rank", pa.int32()), ("collective", pa.int32()), ("lag", pa.float64()),
                       ("rel", pa.float64())])


@dataclass
class Matched:
    """What the report reads of the matched collectives.

    ``skew``: per dimension, the arrival skew and whom everyone waited for (the report's
    ``comm_skew``); ``offsets``: per rank, the clock offset read off the matched ends
    (``clock_offsets``); ``arrival``: rank x collective arrival lags (``comm_arrival``); ``late``:
    one row per matched key of the steady steps -- step, dim, op, late_rank, gap_ns (how far the last
    arrival came after the second-last: what the collective would end sooner had it kept pace),
    waited_ns (the waiting members' wait, summed), late_from_ns/late_to_ns (first and last arrival)
    -- read by :func:`.findings.late_ranks`."""

    skew: list[dict[str, Any]] = field(default_factory=list)
    offsets: list[dict[str, Any]] = field(default_factory=list)
    arrival: list[dict[str, Any]] = field(default_factory=list)
    late: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=LATE_COLUMNS))
    moe: dict[str, Any] | None = None


def expert_load(exchanges: int, uneven: int, ratio_sum: float) -> dict[str, Any] | None:
    """The report's ``moe`` section from the expert-parallel all-to-alls of the steady steps:
    ``expert_load``, the busiest rank's received rows over the ranks' mean, averaged over the
    exchanges whose payload differs between ranks.

    Each rank sends all its routed rows in a dispatch (the same count on every rank: the batch is
    split evenly) and gets back what its experts computed in the combine, whose payload is the rows
    routed to its experts; the backward's two mirror them.  So the exchanges whose payload
    differs across the group are the ones carrying the routing's imbalance, and their max over
    mean is how long the busiest rank's experts run against the mean and how much more it
    exchanges, layer by layer: what the cost model's ``moe_imbalance`` prices.  The equal ones
    say nothing of it and are left out (an uneven exchange that came out even by chance is lost
    with them, which cannot move the mean by much).  ``exchanges``: the matched all-to-alls,
    ``uneven``: those it is the mean over.  None without expert-parallel all-to-alls."""
    if not exchanges:
        return None
    return {"expert_load": ratio_sum / uneven if uneven else 1.0, "exchanges": exchanges, "uneven": uneven}


LATE_COLUMNS = ["step", "dim", "op", "late_rank", "gap_ns", "waited_ns", "late_from_ns", "late_to_ns"]


class _Interner:
    """Text -> a small integer, in order of first sight."""

    def __init__(self) -> None:
        self.codes: dict[Any, int] = {}
        self.values: list[Any] = []

    def code(self, value: Any) -> int:
        c = self.codes.get(value)
        if c is None:
            c = self.codes[value] = len(self.values)
            self.values.append(value)
        return c

    def encode(self, column: pd.Series, tag: str | None = None) -> np.ndarray:
        """int32 codes of a column's values (-1 for missing), computed once per distinct value."""
        cat = column if isinstance(column.dtype, pd.CategoricalDtype) else column.astype(object).astype("category")
        codes = cat.cat.codes.to_numpy()
        table = np.array([self.code((tag, v) if tag else v) for v in cat.cat.categories] + [-1], dtype=np.int32)
        return table[np.where(codes >= 0, codes, len(table) - 1)]


class _PartitionedFiles:
    """Tables appended to numbered partitions (Arrow IPC streams in ``directory``), buffered in
    memory up to :data:`FLUSH_ROWS` rows so each write is a sizeable batch."""

    def __init__(self, directory: Path, name: str, schema: pa.Schema):
        self.directory, self.name, self.schema = directory, name, schema
        self._buffer: list[pa.Table] = []
        self._parts: list[np.ndarray] = []
        self._buffered = 0
        self._writers: dict[int, Any] = {}

    def add(self, table: pa.Table, part: np.ndarray) -> None:
        self._buffer.append(table)
        self._parts.append(part)
        self._buffered += len(table)
        if self._buffered >= FLUSH_ROWS:
            self._flush()

    def _path(self, p: int) -> Path:
        return self.directory / f"{self.name}{p:05d}.arrow"

    def _flush(self) -> None:
        if not self._buffer:
            return
        table, part = pa.concat_tables(self._buffer), np.concatenate(self._parts)
        self._buffer, self._parts, self._buffered = [], [], 0
        order = np.argsort(part, kind="stable")
        table, part = table.take(order), part[order]
        bounds = np.flatnonzero(np.diff(part)) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(part)]):
            p = int(part[lo])
            if p not in self._writers:
                self._writers[p] = pa.ipc.new_stream(pa.OSFile(str(self._path(p)), "wb"), self.schema)
            self._writers[p].write_table(table.slice(lo, hi - lo))

    def read(self) -> Iterator[pd.DataFrame]:
        """Each partition once, in partition order, deleted once read."""
        self._flush()
        for p in sorted(self._writers):
            self._writers.pop(p).close()
            with pa.OSFile(str(self._path(p)), "rb") as f:
                frame = pa.ipc.open_stream(f).read_all().to_pandas()
            self._path(p).unlink()
            yield frame

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
        self._buffer, self._parts = [], []


class CallSpool:
    """Every rank's matchable calls (:func:`.comm_stats.matchable`), partitioned on disk as they
    arrive; :meth:`match` then matches them partition by partition (see the module docstring).

    ``ranks``: how many ranks will be added (it sizes the partitions); ``directory``: where the
    partitions go (a temporary directory in it, removed by :meth:`match` or :meth:`close`)."""

    def __init__(self, ranks: int, directory: str | Path | None = None):
        self.partitions = int(min(MAX_PARTITIONS, max(1, ranks // PARTITION_RANKS)))
        self._dir = Path(tempfile.mkdtemp(prefix="mfuscope-calls-", dir=directory))
        self._files = _PartitionedFiles(self._dir, "calls", _SCHEMA)
        self._dims, self._ops, self._groups = _Interner(), _Interner(), _Interner()
        self._members: dict[int, set[int]] = {}  # group id (numbered, or matched by payload) -> its ranks
        self.rows = 0
        self.max_rank = -1

    def add(self, calls: pd.DataFrame) -> None:
        """Spool the calls of one or more ranks (columns :data:`.comm_stats.MATCH_COLUMNS`)."""
        c = calls[~calls["op"].isin(P2P)]
        seq = pd.to_numeric(c["seq"], errors="coerce")
        numbered = (c["pg"].notna() & seq.notna() & (seq >= 0)).to_numpy()
        step = pd.to_numeric(c["step"], errors="coerce").fillna(-1).astype("int64").to_numpy()
        derived = ~numbered & (c["op"].isin(SAME_PAYLOAD) & c["bytes"].notna()).to_numpy() & (step >= 0)
        keep = numbered | derived
        if not keep.any():
            return
        c, numbered, step = c[keep], numbered[keep], step[keep]
        seq = seq[keep].fillna(-1).astype("int64").to_numpy()
        # The group: the call's process-group name, else its rank list (-1: neither).
        by_name = self._groups.encode(c["pg"], "pg")
        listed = c["group_ranks"] if "group_ranks" in c else pd.Series(None, index=c.index, dtype=object)
        by_list = self._groups.encode(listed, "ranks")
        gid = np.where(by_name >= 0, by_name, by_list).astype(np.int32)
        rank = c["rank"].to_numpy().astype(np.int32)
        for g, r in set(zip((gid.astype(np.int64) * 2 + ~numbered).tolist(), rank.tolist())):
            self._members.setdefault(g, set()).add(r)
        table = pa.table({
            "rank": rank, "step": step, "dim": self._dims.encode(c["dim"]), "op": self._ops.encode(c["op"]),
            "bytes": c["bytes"].fillna(-1).astype("int64").to_numpy(),
            "group_size": pd.to_numeric(c["group_size"], errors="coerce").astype("float64").to_numpy(),
            "gid": gid, "numbered": numbered, "seq": seq,
            "arrival": c["enqueue_ns"].astype("float64").to_numpy(),
            "end_ns": pd.to_numeric(c["end_ns"], errors="coerce").astype("float64").to_numpy(),
        }, schema=_SCHEMA)
        # A numbered key's calls share (group, seq), a payload-matched key's (group, step).
        spread = np.where(numbered, seq, step)
        part = (gid.astype(np.int64) * 2_654_435_761 + spread * 40_503 + numbered) % self.partitions
        self._files.add(table, part)
        self.rows += len(table)
        self.max_rank = max(self.max_rank, int(rank.max()))

    def match(self, steady_steps: set[int] | None = None) -> Matched:
        """Match every spooled call and reduce what the report reads (:class:`Matched`);
        ``steady_steps``: the steps whose late arrivals the findings read (None: every step)."""
        try:
            return self._match(steady_steps)
        finally:
            self.close()

    def _match(self, steady_steps: set[int] | None) -> Matched:
        members = {g: len(r) for g, r in self._members.items()}
        self._members.clear()
        dims, ops = self._dims.values, self._ops.values
        lags: dict[int, list[np.ndarray]] = {}
        waited: list[pd.Series] = []
        late: list[pd.DataFrame] = []
        collectives = _Interner()
        ep_a2a = ([d for d, v in enumerate(dims) if v == "ep"], [o for o, v in enumerate(ops) if v == "all_to_all"])
        exchanges = uneven = 0
        ratio_sum = 0.0
        per_call = _PartitionedFiles(self._dir, "ranks", _PER_CALL)
        rank_parts = max(1, -(-self.rows // RANK_PARTITION_ROWS))
        for frame in self._files.read():
            # A rank's calls in the order it recorded them, ranks in order: the order of one frame.
            m = _match(frame.sort_values("rank", kind="stable", ignore_index=True), members)
            if m.empty:
                continue
            key = m["key"].to_numpy()
            head = np.r_[True, key[1:] != key[:-1]]  # rows sorted by key, then arrival
            tail = np.r_[key[1:] != key[:-1], True]
            idx = np.cumsum(head) - 1                 # the key's number here
            arrival, rank = m["arrival"].to_numpy(), m["rank"].to_numpy()
            first, last = arrival[head], arrival[tail]
            second = np.r_[np.nan, arrival[:-1]][tail]  # every key has two members or more
            dim = m["dim"].to_numpy()[tail]
            for d in np.unique(dim[dim >= 0]):
                lags.setdefault(int(d), []).append((last - first)[dim == d] / 1e9)
            gap = last - second
            waited.append(pd.Series(gap / 1e9).groupby([dim, rank[tail]]).sum())
            keys = pd.DataFrame({"step": m["step"].to_numpy()[tail], "dim": dim, "op": m["op"].to_numpy()[tail],
                                 "late_rank": rank[tail], "gap_ns": gap,
                                 "waited_ns": np.bincount(idx, weights=last[idx] - arrival),
                                 "late_from_ns": first, "late_to_ns": last})
            late.append(keys if steady_steps is None else keys[keys["step"].isin(steady_steps)])
            a2a = np.isin(m["dim"].to_numpy(), ep_a2a[0]) & np.isin(m["op"].to_numpy(), ep_a2a[1])
            if steady_steps is not None:
                a2a &= m["step"].isin(steady_steps).to_numpy()
            if a2a.any():
                payload = pd.Series(m["bytes"].to_numpy(np.float64)[a2a]).groupby(idx[a2a])
                most, mean = payload.max().to_numpy(), payload.mean().to_numpy()
                known = (payload.min().to_numpy() >= 0) & (mean > 0)  # a rank's size unknown (-1): not judged
                ratio = np.divide(most, mean, out=np.ones_like(most), where=known)
                exchanges += len(ratio)
                uneven += int((ratio > 1).sum())
                ratio_sum += float(ratio[ratio > 1].sum())
            end = m["end_ns"].to_numpy()
            median_end = pd.Series(end).groupby(idx).transform("median").to_numpy()
            label = _pair_codes(m["dim"].to_numpy(), m["op"].to_numpy(), collectives)
            per_call.add(pa.table({"rank": rank.astype(np.int32), "collective": label,
                                   "lag": arrival - first[idx], "rel": end - median_end}, schema=_PER_CALL),
                         rank.astype(np.int64) * rank_parts // (self.max_rank + 1))
        names = _collective_names(collectives.values, dims, ops)
        out = Matched(skew=_skew(lags, waited, dims), moe=expert_load(exchanges, uneven, ratio_sum))
        out.offsets, out.arrival = _per_rank(per_call.read(), names)
        if late:
            frame = pd.concat(late, ignore_index=True)
            out.late = frame.assign(dim=_decoded(frame["dim"], dims), op=_decoded(frame["op"], ops))[LATE_COLUMNS]
        return out

    def close(self) -> None:
        self._files.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def match_calls(calls: pd.DataFrame, steady_steps: set[int] | None = None) -> Matched:
    """:class:`Matched` of one frame of every rank's calls (a small job, or a test)."""
    spool = CallSpool(1)
    spool.add(calls)
    return spool.match(steady_steps)


def _match(c: pd.DataFrame, members: dict[int, int]) -> pd.DataFrame:
    """The calls of one partition matched: a ``key`` per collective instance, rows sorted by key then
    arrival, one per rank and key (its first: calls coalesced into one share their number).

    A numbered call is keyed by (group, seq).  Where a trace numbers none (older PyTorch), a
    collective of :data:`SAME_PAYLOAD` is keyed by its group, step, op and payload and its place
    among the rank's calls of those in the step -- the k-th 78 MB all-reduce of step 551 is the same
    call on every rank, where the k-th SendRecv kernel is not.  A key is matched when every member of
    its group recorded it: the members are the ranks whose traces hold calls of that group (a run's
    ranks are often a sample of the job: two of 128), at least two, never more than the group's
    size.  A group's rank list, cut by Kineto to 30 entries, is neither the group nor its size."""
    numbered = c["numbered"].to_numpy()
    signature = c.groupby(["gid", "step", "op", "bytes"], sort=False).ngroup().to_numpy()
    order = c["arrival"].rank(method="first").to_numpy()
    place = (pd.Series(order).groupby([c["rank"].to_numpy(), signature]).rank(method="first")
             .astype("int64").to_numpy() - 1)
    by_seq = c.groupby(["gid", "seq"], sort=False).ngroup().to_numpy()
    by_place = pd.DataFrame({"s": signature, "p": place}).groupby(["s", "p"], sort=False).ngroup().to_numpy()
    key = np.where(numbered, by_seq, by_seq.max(initial=-1) + 1 + by_place)
    group_id = c["gid"].to_numpy().astype(np.int64) * 2 + ~numbered
    c = c.assign(key=key, group_id=group_id)
    c = c.sort_values(["key", "arrival"]).drop_duplicates(["key", "rank"])
    expected = c["group_id"].map(members)
    count = c.groupby("key")["rank"].transform("size")
    return c[(count == expected) & (count >= 2) & ~(count > c["group_size"])]


def _pair_codes(dim: np.ndarray, op: np.ndarray, interner: _Interner) -> np.ndarray:
    """One code per distinct (dim, op) of the rows."""
    pair = (dim.astype(np.int64) + 1) << 32 | (op.astype(np.int64) + 1)
    uniq, inverse = np.unique(pair, return_inverse=True)
    table = np.array([interner.code((int(k >> 32) - 1, int(k & 0xFFFFFFFF) - 1)) for k in uniq], dtype=np.int32)
    return table[inverse.reshape(-1)]


def _decoded(codes: pd.Series, values: list[Any]) -> pd.Series:
    """Codes back to their text, as the categorical the calls had (missing: -1)."""
    return pd.Series(pd.Categorical.from_codes(codes.to_numpy().astype(np.int64), categories=values)
                     if values else pd.Categorical([None] * len(codes)), index=codes.index)


def _collective_names(pairs: list[tuple[int, int]], dims: list[Any], ops: list[Any]) -> list[str]:
    """``dim/op`` for each (dim, op) code pair, spelled as ``astype(str)`` spells the calls' text."""
    if not pairs:
        return []
    d = _decoded(pd.Series([p[0] for p in pairs]), dims)
    o = _decoded(pd.Series([p[1] for p in pairs]), ops)
    return (d.astype(str) + "/" + o.astype(str)).tolist()


def _skew(lags: dict[int, list[np.ndarray]], waited: list[pd.Series], dims: list[Any]) -> list[dict[str, Any]]:
    """Per dimension: how many instances matched, the median and p90 of each instance's spread of
    arrivals, and the three ranks the others waited for longest (the last arrival's lead over the
    second-last, summed)."""
    by = pd.concat(waited).groupby(level=[0, 1]).sum() if waited else pd.Series(dtype="float64")
    out = []
    for d in sorted(lags, key=lambda d: str(dims[d])):
        values = np.concatenate(lags[d])
        culprits = by.xs(d, level=0).sort_index().sort_values(ascending=False)
        out.append({"dim": dims[d], "instances": int(len(values)), "median_skew_s": float(np.median(values)),
                    "p90_skew_s": float(np.quantile(values, 0.9)),
                    "waited_for": [{"rank": int(r), "seconds": float(s)}
                                   for r, s in culprits.head(3).items() if s > 0]})
    return out


def _per_rank(parts: Iterator[pd.DataFrame], names: list[str]) -> tuple[list[dict], list[dict]]:
    """(clock offsets, arrival lags) from the per-call rows, one rank partition at a time.

    A rank's clock offset: the median of its matched ends' distance from each instance's median
    end (all members leave a collective together), with the median distance from it; its arrival
    lag at a collective: median and p90 of how long after the first member it arrived."""
    offsets, arrival = [], []
    for f in parts:
        ends = f.dropna(subset=["rel"])
        for rank, r in ends["rel"].groupby(ends["rank"]):
            off = float(r.median())
            offsets.append({"rank": int(rank), "offset_s": off / 1e9,
                            "residual_s": float((r - off).abs().median()) / 1e9, "instances": int(len(r))})
        g = f.assign(collective=np.asarray(names, dtype=object)[f["collective"].to_numpy()],
                     lag=f["lag"] / 1e9).groupby(["rank", "collective"])["lag"]
        stats = pd.DataFrame({"median_lag_s": g.median(), "p90_lag_s": g.quantile(0.9),
                              "instances": g.size()}).reset_index()
        arrival += [{"rank": int(r.rank), "collective": r.collective, "median_lag_s": float(r.median_lag_s),
                     "p90_lag_s": float(r.p90_lag_s), "instances": int(r.instances)} for r in stats.itertuples()]
    return sorted(offsets, key=lambda x: x["rank"]), sorted(arrival, key=lambda x: (x["rank"], x["collective"]))
