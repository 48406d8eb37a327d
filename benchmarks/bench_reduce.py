"""The reduce of a very large job, without its traces: summaries synthesized from a real rank.

One real rank -- the corpus's ``df_index_resolver`` (54 MB of JSON, 216k events) unless
``--trace`` names another -- is summarized once (:func:`mfuscope.analyzers.map_reduce.map_rank`),
and its summary copied as ranks 0..N-1 as the parent gets them (unpickled, frames renumbered).
The rank's collectives become numbered calls of data-parallel groups of ``--group`` ranks
(every member records each, so all match: the cross-rank matching runs at full size).  Known
stragglers are injected: ``--stragglers`` ranks get their compute leaves 30% longer in every
step, so their busy time exceeds their peers' median by 30% of the compute -- over the
stragglers analysis's 5% threshold and 3 MADs of identical peers (MAD 0) -- and arrive 1 ms late
at their group's collectives.  Then the parent's reduce runs
(:func:`mfuscope.analyzers.overview.reduce`) as ``mfuscope analyze`` runs it, folding the
summaries as they would arrive (collapsed every :data:`~mfuscope.analyzers.map_reduce.COLLAPSE_EVERY`, their
calls spooled to disk: :class:`~mfuscope.analyzers.collective_match.CallSpool`).

Prints the reduce's wall seconds, the process's peak RSS (synthesis included: the summaries the
parent would hold), the parent's memory a rank, and whether the injected stragglers -- and only
they -- were found.

    python benchmarks/bench_reduce.py [--ranks 16384] [--stragglers 7,5000,16000] [--trace FILE]

Issue 28's target (2 cores): a 16,384-rank reduce in <= 5 minutes and <= 3 GB, finding the
injected stragglers.
"""
from __future__ import annotations

import argparse
import os
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
BIG = CORPUS / "traces/HolisticTraceAnalysis/tests/data/df_index_resolver/df_index_resolver.json.gz"
#: How much longer an injected straggler's compute is.
SLOWER = 1.3


def _numbered_calls(calls: pd.DataFrame, group: int) -> pd.DataFrame:
    """The real rank's collectives as calls of one data-parallel group (``dp<k>`` of ``group``
    ranks), numbered in order: every rank of the group records each, so each matches."""
    c = calls[~calls["op"].isin(["send", "recv", "send_recv"])].sort_values("enqueue_ns").reset_index(drop=True)
    c = c.assign(seq=np.arange(len(c), dtype="float64"), group_size=group, group_ranks=None, pg="dp0")
    return c


def _renumbered(pickled: bytes, rank: int, slower: bool, group: int):
    """The summary as ``rank`` arrives in the parent -- unpickled, its own copy of every frame --
    with every frame's rank column renumbered (compute leaves x SLOWER for a straggler, which then
    arrives 1 ms late at every collective of its group)."""
    s = pickle.loads(pickled)
    s.rank = rank
    s.meta["rank"] = rank
    s.row["rank"] = rank
    for name in ("leaves", "spans", "calls", "launch", "overlap", "microbatches"):
        frame = getattr(s, name)
        if "rank" in frame:
            frame["rank"] = rank
    if group:
        s.calls["pg"] = pd.Categorical([f"dp{rank // group}"] * len(s.calls))
    if slower:
        compute = s.leaves["leaf"].str.startswith("compute/")
        s.leaves.loc[compute, "seconds"] *= SLOWER
        s.calls["enqueue_ns"] = s.calls["enqueue_ns"] + 1_000_000
    return s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--stragglers", default="7,5000,16000", help="ranks made slower (comma-separated)")
    p.add_argument("--trace", type=Path, default=BIG)
    p.add_argument("--group", type=int, default=128,
                   help="ranks of a data-parallel group (its calls match); 0: the trace's calls as they are")
    args = p.parse_args()
    if not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace}; set MFUSCOPE_CORPUS or pass --trace")
    from mfuscope.analyzers import collective_match, comm_stats, map_reduce, overview, rank_lists, rank_summary

    injected = {int(r) for r in args.stragglers.split(",") if r and int(r) < args.ranks}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mfuscope-bench-reduce-") as views:
        job = map_reduce.RankJob(args.trace, 0, None, False, None, None, None, None, None, args.ranks, views, ())
        (base,) = map_reduce.map_rank(job).summaries
        calls = pd.read_parquet(Path(views) / rank_summary.COMM_CALLS)
    if args.group:  # else the calls as the trace has them
        base.calls = comm_stats.matchable(rank_summary.compact_calls(_numbered_calls(calls, args.group)))
    print(f"one real rank summarized in {time.perf_counter() - t0:.1f} s: {len(base.calls):,} collectives "
          f"(numbered, groups of {args.group}), {len(base.leaves):,} leaf rows", file=sys.stderr)
    pickled = pickle.dumps(base)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    summaries, fresh = [], []
    calls = collective_match.CallSpool(args.ranks)
    for r in range(args.ranks):
        s = _renumbered(pickled, r, r in injected, args.group)
        calls.add(s.calls)  # spooled as it arrives, as the map does
        s.calls = map_reduce._NO_CALLS
        summaries.append(s)
        fresh.append(s)
        if len(fresh) >= map_reduce.COLLAPSE_EVERY:
            rank_summary.collapse([summaries[0], *fresh] if summaries[0] is not fresh[0] else fresh)
            fresh.clear()
    built = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    report = rank_lists.cap(overview.reduce(summaries, None, source="synthesized", files=[], calls=calls))
    reduced = time.perf_counter() - t0
    rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    found = {s["rank"] for s in report["stragglers"]}
    late = sorted({f["id"] for f in report["findings"] if f["id"].startswith("late_rank")})
    print(f"late ranks named: {late}; matched: {sum(x['instances'] for x in report['comm_skew'])} collective instances")
    print(f"{args.ranks:,} ranks: summaries built in {built:.1f} s; reduce {reduced:.1f} s")
    print(f"peak RSS {rss2 / 2**20:.2f} GB (after one rank {rss0 / 2**20:.2f} GB, with every summary "
          f"{rss1 / 2**20:.2f} GB: {(rss1 - rss0) * 1024 / args.ranks / 1e3:.1f} KB a rank in the parent)")
    print(f"stragglers injected {sorted(injected)}, found {sorted(found)}: "
          f"{'right' if found == injected else 'WRONG'}")
    return 0 if found == injected else 1


if __name__ == "__main__":
    sys.exit(main())
