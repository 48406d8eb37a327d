"""Trace loading: mfuscope against HTA, wall time, CPU time and peak memory.

Data sets:
  (a) dlrm8  - the corpus's 8-rank NCCL DLRM trace set (~1 MB per rank);
  (b) big8   - the corpus's 54 MB ``df_index_resolver`` trace copied as ranks 0-7
               (``distributedInfo.rank`` rewritten in each copy).

Variants, interleaved in each round, median of ``--runs`` rounds:
  mfuscope cold     empty cache: parse and fill the cache
  mfuscope no-cache ``--no-cache``: parse only
  mfuscope cached   warm cache
  mfuscope msgspec  cold, with the C event scanner off (MFUSCOPE_KINETO_SCANNER=0): what it gains
  HTA               ``TraceAnalysis(trace_dir=...)`` (parse + align, its default)

Each measurement runs in a fresh Python process, twice: once for wall and CPU
time of the load call only (not interpreter start or imports), once, watched,
for peak memory: the largest
summed PSS of the process and all its children, sampled every 50 ms (reading
/proc/PID/smaps_rollup costs kernel time; sampling faster would slow what is measured).

    python benchmarks/bench_load.py [--runs 5] [--sets dlrm8,big8]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
DLRM = CORPUS / "traces/param/et_replay/tests/inputs/dlrm_kineto"
BIG = CORPUS / "traces/HolisticTraceAnalysis/tests/data/df_index_resolver/df_index_resolver.json.gz"
VARIANTS = ("mfuscope cold", "mfuscope no-cache", "mfuscope cached", "mfuscope msgspec", "HTA")


# ----------------------------------------------------------------------------- child side

def _child(variant: str, trace_dir: str) -> None:
    if variant == "HTA":
        import logging

        from hta.trace_analysis import TraceAnalysis
        logging.disable(logging.WARNING)
        run = lambda: TraceAnalysis(trace_dir=trace_dir)  # noqa: E731
    else:
        from mfuscope.analyzers import trace_set
        run = lambda: trace_set.load(trace_dir, use_cache=variant != "mfuscope no-cache",  # noqa: E731
                                     progress=False).events.table
    result = timed(run)
    if variant != "HTA":
        touch(result)  # after the timing: counts for memory (sampled over the whole process), not time


def touch(table) -> None:
    """Read every buffer of ``table``: memory-mapped data (worker hand-off files) then counts as
    resident, as it will be once anything analyzes it -- no credit for pages not yet read."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for column in table.columns:
        for chunk in column.chunks:
            if pa.types.is_dictionary(chunk.type):
                chunk = chunk.indices
            if pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type):
                pc.sum(pc.utf8_length(chunk))
            elif pa.types.is_integer(chunk.type) or pa.types.is_floating(chunk.type):
                pc.min_max(chunk)


# ----------------------------------------------------------------------------- parent side

def _tree_pss(pid: int) -> int:
    """Summed PSS (bytes) of ``pid`` and all its descendants, from /proc.

    PSS splits pages shared between forked workers among them, so a pool of
    forked processes is not charged several times for the same memory.
    """
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def _run_child(variant: str, trace_dir: Path, cache: Path, sample_memory: bool, script: str) -> tuple[dict, int]:
    env = dict(os.environ, MFUSCOPE_CACHE_DIR=str(cache), PYTHONWARNINGS="ignore")
    if variant == "mfuscope msgspec":
        env["MFUSCOPE_KINETO_SCANNER"] = "0"
    if "cold" in variant or variant == "mfuscope msgspec":
        shutil.rmtree(cache, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, script, "--child", variant, str(trace_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    peak = 0
    while proc.poll() is None:
        if sample_memory:
            peak = max(peak, _tree_pss(proc.pid))
        time.sleep(0.05)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed on {trace_dir} (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1]), peak


def measure(variant: str, trace_dir: Path, cache: Path, script: str = __file__) -> dict:
    """Times from a run with nobody watching; memory from a second run sampled from /proc
    (reading smaps costs kernel CPU, which would otherwise slow what is timed).  ``script`` is
    the benchmark whose ``--child VARIANT DIR`` mode runs the variant and prints its times."""
    result, _ = _run_child(variant, trace_dir, cache, sample_memory=False, script=script)
    _, result["peak_pss"] = _run_child(variant, trace_dir, cache, sample_memory=True, script=script)
    return result


def timed(run, phases: dict | None = None):
    """Run ``run()`` and print its wall and CPU time (children included) as the child's answer,
    with ``phases`` (what ``run`` measured of its parts: seconds, memory); returns what ``run`` returned."""
    r0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    result = run()
    wall = time.perf_counter() - t0
    r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(getattr(b, f) - getattr(a, f) for a, b in ((r0, r1), (c0, c1)) for f in ("ru_utime", "ru_stime"))
    print(json.dumps({"wall": wall, "cpu": cpu, **(phases or {})}), flush=True)
    return result


def make_big8(root: Path) -> Path:
    """Eight copies of the 54 MB trace as ranks 0-7 of one job (rank and world size rewritten in the
    header: the loader refuses ranks that claim different jobs)."""
    out = root / "big8"
    out.mkdir(parents=True, exist_ok=True)
    raw = gzip.decompress(BIG.read_bytes())
    head, rest = raw[:4096], raw[4096:]
    head = re.sub(rb'("distributedInfo"\s*:\s*\{[^}]*?"world_size"\s*:\s*)\d+', rb"\g<1>8", head, count=1)
    for r in range(8):
        new_head = re.sub(rb'("distributedInfo"\s*:\s*\{[^}]*?"rank"\s*:\s*)\d+',
                          lambda m, r=r: m.group(1) + str(r).encode(), head, count=1)
        with gzip.open(out / f"rank{r}.json.gz", "wb", compresslevel=1) as f:
            f.write(new_head + rest)
    return out


def medians(name: str, rounds: int, variants, run_one) -> dict:
    """``rounds`` rounds of every variant, interleaved (so drift hits all alike); per variant the
    median of each figure of ``run_one(variant)`` (wall, CPU, peak PSS and any phase times)."""
    runs: dict = {v: [] for v in variants}
    for i in range(rounds):
        for v in variants:
            runs[v].append(run_one(v))
        print(f"  {name}: round {i + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}


def print_table(results: dict, variants, rounds: int, what: str) -> None:
    """Per trace set: each variant's medians and its ratios to HTA."""
    print(f"\nmedian of {rounds} runs; {os.cpu_count()} CPUs; wall and CPU time of {what}, "
          "peak PSS of the whole process tree")
    for name, res in results.items():
        hta = res["HTA"]
        print(f"\n{name}")
        print(f"  {'variant':<18} {'wall s':>8} {'cpu s':>8} {'peak MB':>9} {'HTA/x wall':>11} {'x/HTA mem':>10}")
        for v in variants:
            r = res[v]
            print(f"  {v:<18} {r['wall']:8.3f} {r['cpu']:8.2f} {r['peak_pss'] / 2**20:9.0f} "
                  f"{hta['wall'] / r['wall']:10.1f}x {r['peak_pss'] / hta['peak_pss']:9.2f}x")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sets", default="dlrm8,big8")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if not CORPUS.is_dir():
        raise SystemExit(f"the corpus is not at {CORPUS}; set MFUSCOPE_CORPUS")

    work = Path(tempfile.mkdtemp(prefix="mfuscope-bench-"))
    sets = {}
    for name in args.sets.split(","):
        sets[name] = DLRM if name == "dlrm8" else make_big8(work)
    try:
        results = {name: medians(name, args.runs, VARIANTS,
                                 lambda v, d=trace_dir, c=work / f"cache-{name}": measure(v, d, c))
                   for name, trace_dir in sets.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results, VARIANTS, args.runs, "the load call")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
