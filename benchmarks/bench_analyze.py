"""A full analysis: ``mfuscope analyze`` against HTA's equivalent, wall time and peak memory.

HTA's side: ``TraceAnalysis`` (parse and align) + temporal breakdown +
communication/computation overlap + kernel breakdown -- the HTA analyses that
``mfuscope analyze`` covers (it also computes the top-down breakdown,
communication per dimension, stragglers and findings).  mfuscope's side: load
every rank and build the whole report, cold (empty cache) and cached.

Data sets as in bench_load.py: ``dlrm8`` (the corpus's 8-rank DLRM set) and
``big8`` (the 54 MB trace as 8 ranks).  Each measurement is a fresh process,
run twice (times unwatched, then peak PSS sampled); variants interleave in
each round; median of ``--runs`` rounds.

    python benchmarks/bench_analyze.py [--runs 5] [--sets dlrm8,big8]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from mfuscope.benchmarks import bench_load  # its process runner and data sets

VARIANTS = ("mfuscope cold", "mfuscope cached", "HTA")


def _child(variant: str, trace_dir: str) -> None:
    if variant == "HTA":
        import logging

        from hta.trace_analysis import TraceAnalysis
        logging.disable(logging.WARNING)

        def run():
            analysis = TraceAnalysis(trace_dir=trace_dir)
            analysis.get_temporal_breakdown(visualize=False)
            analysis.get_comm_comp_overlap(visualize=False)
            analysis.get_gpu_kernel_breakdown(visualize=False)
    else:
        from mfuscope.analyzers import overview, trace_set

        def run():
            result = trace_set.load(trace_dir, progress=False)
            overview.build_report(result.events, source=trace_dir, files=[str(f) for f in result.files])
    bench_load.timed(run)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sets", default="dlrm8,big8")
    args = p.parse_args()
    if not bench_load.CORPUS.is_dir():
        raise SystemExit(f"the corpus is not at {bench_load.CORPUS}; set MFUSCOPE_CORPUS")
    work = Path(tempfile.mkdtemp(prefix="mfuscope-bench-"))
    try:
        results = {}
        for name in args.sets.split(","):
            trace_dir = bench_load.DLRM if name == "dlrm8" else bench_load.make_big8(work)
            results[name] = bench_load.medians(
                name, args.runs, VARIANTS,
                lambda v, d=trace_dir, c=work / f"cache-{name}": bench_load.measure(v, d, c, script=__file__))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bench_load.print_table(results, VARIANTS, args.runs, "the analysis")
    return 0


if __name__ == "__main__":
    sys.exit(main())
