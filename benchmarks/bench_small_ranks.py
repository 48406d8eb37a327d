"""Many small ranks: ``mfuscope analyze`` with a task a file against small files batched.

A job's ranks each hold a small trace here (tests/helpers.synthetic_job: 18 events a rank, a
data-parallel job with one slow rank), the case where a rank's analysis is mostly the fixed cost
of its frames, not its events.  Each row is ``mfuscope analyze DIR --workers 2`` in a fresh
process, cold (empty cache) and warm, run the way the map runs by default (up to 32 files a task,
analyzers/map_reduce.batches) and with ``MFUSCOPE_MAP_BATCH_FILES=1`` (a task a file, as before
batching); variants interleave in each round; median of ``--runs`` rounds.  Columns as
bench_scale.py's: wall and CPU seconds of the process tree, peak PSS of the tree and the largest
worker; then the ratio of the two variants' CPU seconds.

    python benchmarks/bench_small_ranks.py [--ranks 256,1024] [--runs 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from mfuscope.analyzers.map_reduce import ENV_BATCH_FILES
from mfuscope.benchmarks.bench_scale import run_analyze
from mfuscope.tests.helpers import synthetic_job

VARIANTS = {"batched": None, "a task a file": "1"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="256,1024", help="comma-separated rank counts")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{'set':<22} {'variant':<14} {'cache':<5} {'wall s':>7} {'cpu s':>7} {'tree MB':>8} {'worker MB':>9}")
    with tempfile.TemporaryDirectory(prefix="mfuscope-bench-small-") as work:
        for ranks in (int(r) for r in args.ranks.split(",") if r):
            job = synthetic_job(Path(work) / f"job{ranks}", ranks, slow_rank=ranks // 2)
            rows: dict[tuple[str, str], list[dict]] = {}
            for _ in range(args.runs):
                for variant, value in VARIANTS.items():
                    if value is None:
                        os.environ.pop(ENV_BATCH_FILES, None)
                    else:
                        os.environ[ENV_BATCH_FILES] = value
                    cache = Path(work) / f"cache-{ranks}-{len(rows)}"
                    for cold in (True, False):
                        r = run_analyze(job, cache, cold, ("--workers", "2"))
                        rows.setdefault((variant, "cold" if cold else "warm"), []).append(r)
            os.environ.pop(ENV_BATCH_FILES, None)
            median = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
            for (variant, cache), m in median.items():
                print(f"{f'{ranks} x 18 events':<22} {variant:<14} {cache:<5} {m['wall']:>7.1f} {m['cpu']:>7.1f} "
                      f"{m['tree_mb']:>8.0f} {m['worker_mb']:>9.0f}")
            for cache in ("cold", "warm"):
                ratio = median[("a task a file", cache)]["cpu"] / median[("batched", cache)]["cpu"]
                print(f"  {ranks} ranks, {cache}: a task a file takes {ratio:.2f}x the CPU of batched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
