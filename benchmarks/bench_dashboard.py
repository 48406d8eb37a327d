"""What the dashboard's timeline costs per request at 8, 64 and 256 ranks: binned server-side (what
mfuscope ships) against shipping every segment (what a naive viewer would).

Input: the timeline segments of a real trace set (default: the corpus's 8-rank NCCL DLRM set, else
``--run``), copied onto more ranks (each copy a rank of its own) to reach 64 and 256.  For each
size: median of ``--runs`` builds of the figure (cut to bins + plotly figure + JSON), the peak
memory of one build (tracemalloc: Python and numpy allocations), the JSON the browser receives, and
the bars drawn.  Speed is reported, not asserted.

    python benchmarks/bench_dashboard.py [--run RUN_DIR_OR_TRACES] [--runs 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import pandas as pd

from mfuscope.analyzers import timeline, trace_set
from mfuscope.dashboard import app as dashboard_app
from mfuscope.dashboard import figures

REPO = Path(__file__).resolve().parent.parent
DLRM = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus")) / \
    "traces/param/et_replay/tests/inputs/dlrm_kineto"


def build(seg: pd.DataFrame, binned: bool) -> tuple[float, int, int]:
    """Seconds to build the figure's JSON, its size, and the bars in it."""
    t = time.perf_counter()
    lo, hi = int(seg["start_ns"].min()), int(seg["end_ns"].max())
    ranks = seg["rank"].nunique()
    shown = seg.assign(leaf=seg["leaf"].astype(str).map(dashboard_app.lane_category))
    if binned:
        bins = max(100, min(1500, dashboard_app.TIMELINE_BARS // ranks))
        shown = timeline.lanes(shown, lo, hi, bins)
    labels = {r: f"rank {r}" for r in sorted(shown["rank"].unique())}
    waits = dashboard_app.longest_waits(seg)
    payload = figures.timeline(shown, labels, lo, waits).to_json()
    return time.perf_counter() - t, len(payload), len(shown)


def peak_mib(seg: pd.DataFrame, binned: bool) -> float:
    tracemalloc.start()
    build(seg, binned)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=DLRM, help="run directory or trace directory (default: corpus DLRM)")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    if not args.run.exists():
        print(f"no input at {args.run}: pass --run RUN_DIR (or set MFUSCOPE_CORPUS)", file=sys.stderr)
        return 2
    seg = timeline.segments(trace_set.load(args.run, progress=False).events)
    step = sorted(seg["step"].unique())[len(seg["step"].unique()) // 2]
    seg = seg[seg["step"] == step]
    base = seg["rank"].nunique()
    print(f"input: {args.run}, step {step}: {len(seg):,} segments on {base} ranks; median of {args.runs} builds\n")
    print(f"{'ranks':>6} {'segments':>10} | {'binned ms':>10} {'peak':>8} {'JSON':>9} {'bars':>7} | {'all ms':>9} "
          f"{'peak':>8} {'JSON':>9} {'bars':>8} | {'speed-up':>8} {'smaller':>8}")
    for ranks in (8, 64, 256):
        copies = [seg.assign(rank=seg["rank"] + k * base) for k in range(-(-ranks // base))]
        big = pd.concat(copies, ignore_index=True)
        big = big[big["rank"] < ranks]
        fast = [build(big, True) for _ in range(args.runs)]
        slow = [build(big, False) for _ in range(max(1, args.runs // 2))]
        f_s, f_b, f_n = statistics.median(x[0] for x in fast), fast[0][1], fast[0][2]
        s_s, s_b, s_n = statistics.median(x[0] for x in slow), slow[0][1], slow[0][2]
        f_m, s_m = peak_mib(big, True), peak_mib(big, False)
        print(f"{ranks:>6} {len(big):>10,} | {f_s * 1e3:>10.0f} {f_m:>5.0f}MiB {f_b / 2**20:>6.2f}MiB {f_n:>7,} | "
              f"{s_s * 1e3:>9.0f} {s_m:>5.0f}MiB {s_b / 2**20:>6.2f}MiB {s_n:>8,} | "
              f"{s_s / f_s:>7.1f}x {s_b / f_b:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
