"""A full analysis: ``mfuscope analyze`` against HTA's equivalent, wall time and peak memory.

HTA's side: ``TraceAnalysis`` (parse and align) + temporal breakdown +
communication/computation overlap + kernel breakdown -- the HTA analyses that
``mfuscope analyze`` covers (it also computes the top-down breakdown,
communication per dimension, stragglers and findings).  mfuscope's side: what
``mfuscope analyze PATH`` does (``analysis.analyze``: load every rank, build
the whole report and, for a run directory, the dashboard's timeline views),
cold (empty cache) and cached, written to a temporary directory.  ``analysis s``
and ``its cpu s`` are its part after the load (the analyses, the views and
writing them), wall and CPU time; CPU time is the steadier figure on a busy machine.
``its rss MB`` is the analyzing process's own peak resident memory, exact (the
kernel's high-water mark), beside ``peak MB``, sampled over the process tree.

Data sets: ``demo`` (the run ``make demo`` trains: 8 gloo ranks of the tiny
Llama, dp_shard=2 x tp=2 x pp=2, 5 steps, profiled -- ``--demo-run`` names one
already made, else it is trained once into the work directory; HTA reads no
CPU-only gloo trace, so it has no HTA row), and as in bench_load.py ``dlrm8``
(the corpus's 8-rank DLRM set) and ``big8`` (the 54 MB trace as 8 ranks).
Each measurement is a fresh process, run twice (times unwatched, then peak PSS
sampled); variants interleave in each round; median of ``--runs`` rounds.

    python benchmarks/bench_analyze.py [--runs 5] [--sets demo,dlrm8,big8] [--demo-run RUN_DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mfuscope.benchmarks import bench_load  # its process runner and data sets

VARIANTS = ("mfuscope cold", "mfuscope cached", "HTA")


def _child(variant: str, trace_dir: str) -> None:
    phases: dict[str, float] = {}
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
        from mfuscope import run_dir
        from mfuscope.analyzers import analysis

        marks: dict[str, tuple[float, float]] = {}

        def mark(fraction: float, message: str) -> None:
            if message in ("analyzing", "done"):
                marks[message] = (time.perf_counter(), time.process_time())  # after the load: one process

        def run():
            with tempfile.TemporaryDirectory() as out:
                views = Path(out) / run_dir.VIEWS if run_dir.is_run_dir(trace_dir) else None
                analysis.analyze(trace_dir, Path(out) / run_dir.REPORT, views, on_progress=mark, progress=False)
            phases["analysis"], phases["analysis_cpu"] = (b - a for a, b in zip(marks["analyzing"], marks["done"]))
            phases["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # exact, this process
    bench_load.timed(run, phases)


def _demo_run(given: Path | None, work: Path) -> Path:
    """The demo-sized run: ``given``, else trained once with ``python -m mfuscope.demo``."""
    if given is not None:
        return given
    out = work / "demo"
    subprocess.run([sys.executable, "-m", "mfuscope.demo", "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return out / "runs" / "tiny-llama-8ranks"


def _print(results: dict, rounds: int) -> None:
    print(f"\nmedian of {rounds} runs; {os.cpu_count()} CPUs; wall and CPU time of the analyze call, "
          "peak PSS of the whole process tree")
    for name, res in results.items():
        hta = res.get("HTA")
        print(f"\n{name}")
        print(f"  {'variant':<18} {'wall s':>8} {'cpu s':>8} {'analysis s':>11} {'its cpu s':>10} {'peak MB':>9} "
              f"{'its rss MB':>11} {'HTA/x wall':>11} {'x/HTA mem':>10}")
        for v, r in res.items():
            ratios = (f"{hta['wall'] / r['wall']:10.1f}x {r['peak_pss'] / hta['peak_pss']:9.2f}x" if hta
                      else f"{'-':>11} {'-':>10}")
            analysis = (f"{r['analysis']:11.3f} {r['analysis_cpu']:10.3f}" if "analysis" in r
                        else f"{'-':>11} {'-':>10}")
            rss = f"{r['peak_rss'] / 2**20:11.0f}" if "peak_rss" in r else f"{'-':>11}"
            print(f"  {v:<18} {r['wall']:8.3f} {r['cpu']:8.2f} {analysis} {r['peak_pss'] / 2**20:9.0f} {rss} {ratios}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sets", default="dlrm8,big8")
    p.add_argument("--demo-run", type=Path, default=None, help="the demo-sized run directory, if made already")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if not bench_load.CORPUS.is_dir():
        raise SystemExit(f"the corpus is not at {bench_load.CORPUS}; set MFUSCOPE_CORPUS")
    work = Path(tempfile.mkdtemp(prefix="mfuscope-bench-"))
    try:
        results = {}
        for name in args.sets.split(","):
            if name == "demo":
                trace_dir, variants = _demo_run(args.demo_run, work), VARIANTS[:2]
            else:
                trace_dir, variants = bench_load.DLRM if name == "dlrm8" else bench_load.make_big8(work), VARIANTS
            results[name] = bench_load.medians(
                name, args.runs, variants,
                lambda v, d=trace_dir, c=work / f"cache-{name}": bench_load.measure(v, d, c, script=__file__))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print(results, args.runs)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
