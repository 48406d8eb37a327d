"""How `mfuscope analyze` scales with the number of ranks: wall, CPU and memory.

Trace sets are built from a real trace in seconds: the corpus's 54 MB ``df_index_resolver``
(216k events a rank) copied as ranks 0..N-1, its gzip body reused and only the header rewritten
(rank, world size), in a temporary directory removed afterwards.  The 216 MB rank size repeats
the trace's five steps four times with shifted timestamps (steps renumbered), built once.

For each (ranks, rank size), cold (empty cache: parse and fill it) and warm (from the cache), in
a fresh process each: wall and CPU seconds of the whole analysis (children included), the peak
PSS of the whole process tree (parent and workers, sampled every 50 ms from /proc; PSS shares a
forked page among the processes that map it), the parent's own peak, the largest worker's (and
over the decompressed trace a worker parses), and the reduce's seconds (the report's
``provenance.timings``).
Median of ``--runs`` runs for the sizes of ``--ranks``; the ``--once`` sizes run once.  Ends
with the fitted slopes: MB of the parent's peak per rank, and the tree's.

    python benchmarks/bench_scale.py [--ranks 8,32,128] [--once 512,1024] [--sizes 54,216] [--runs 3]
                                     [--dask 128] [--json out.json]

``--dask``: at those rank counts (54 MB ranks) the same set is also mapped by a Dask LocalCluster of
2 single-threaded workers (``--scheduler local --workers 2``) and by the local pool of 2, runs
interleaved; the rows ``N x54MB dask`` and ``N x54MB pool`` and the ratio of their wall times
(issue 29: within 15%).

Issue 28's targets (2 cores): the tree <= 1.5 GB for 54 MB ranks, flat from 8 to 1,024 ranks; the
parent <= 100 KB a rank; a worker <= 4x the decompressed trace; 1,024 x 54 MB in <= 12 min cold and
<= 5 min warm.
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

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
BIG = CORPUS / "traces/HolisticTraceAnalysis/tests/data/df_index_resolver/df_index_resolver.json.gz"


# ----------------------------------------------------------------------------- trace sets
def _header_rewriter(raw: bytes):
    """A function rank -> bytes of the trace with ``distributedInfo``'s rank set (the world size is
    set by :func:`make_set`): only the header's first 4 KB are rewritten, the body is reused."""
    head, rest = raw[:4096], raw[4096:]

    def for_rank(rank: int, world: int) -> bytes:
        h = re.sub(rb'("distributedInfo"\s*:\s*\{[^}]*?"world_size"\s*:\s*)\d+',
                   lambda m: m.group(1) + str(world).encode(), head, count=1)
        h = re.sub(rb'("distributedInfo"\s*:\s*\{[^}]*?"rank"\s*:\s*)\d+',
                   lambda m: m.group(1) + str(rank).encode(), h, count=1)
        return h + rest
    return for_rank


def repeated(raw: bytes, times: int) -> bytes:
    """The trace with its events repeated ``times`` times, each copy shifted by the trace's span
    and its ProfilerStep numbers moved on, so the steps follow one another."""
    doc = json.loads(raw)
    events = doc["traceEvents"]
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    span = (max(ts) - min(ts)) * 1.01
    steps = [int(m.group(1)) for e in events if (m := re.match(r"ProfilerStep#(\d+)$", str(e.get("name", ""))))]
    step_span = (max(steps) - min(steps) + 1) if steps else 0
    out = []
    for k in range(times):
        for e in events:
            if k and isinstance(e.get("ts"), (int, float)):
                e = dict(e, ts=e["ts"] + k * span)
                m = re.match(r"ProfilerStep#(\d+)$", str(e.get("name", "")))
                if m:
                    e["name"] = f"ProfilerStep#{int(m.group(1)) + k * step_span}"
            out.append(e)
    doc["traceEvents"] = out
    return json.dumps(doc).encode()


def make_set(root: Path, ranks: int, raw: bytes, name: str) -> Path:
    """``ranks`` copies of ``raw`` (uncompressed JSON) as ranks 0..ranks-1 of one job, gzip level 1."""
    out = root / f"{name}-{ranks}"
    out.mkdir(parents=True, exist_ok=True)
    for_rank = _header_rewriter(raw)
    for r in range(ranks):
        with gzip.open(out / f"rank{r}.json.gz", "wb", compresslevel=1) as f:
            f.write(for_rank(r, ranks))
    return out


# ----------------------------------------------------------------------------- measuring
def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                    out += kids
                    stack += kids
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def run_analyze(trace_dir: Path, cache: Path, cold: bool, extra: tuple[str, ...] = ()) -> dict:
    """One ``mfuscope analyze`` in a fresh process (``extra``: more flags): wall, CPU (the tree's),
    peak PSS of the tree, of the parent, of the largest worker."""
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers count once the analysis reaps them
    env = dict(os.environ, MFUSCOPE_CACHE_DIR=str(cache), PYTHONWARNINGS="ignore")
    out = trace_dir.parent / f"{trace_dir.name}.report.json"
    cmd = [sys.executable, "-m", "mfuscope", "analyze", str(trace_dir), "--out", str(out), "--force", "--json", *extra]
    t0 = time.perf_counter()
    log = trace_dir.parent / f"{trace_dir.name}.stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    tree = parent = worker = 0
    while proc.poll() is None:
        kids = _descendants(proc.pid)
        mine, theirs = _pss(proc.pid), [_pss(k) for k in kids]
        parent, worker = max(parent, mine), max([worker, *theirs])
        tree = max(tree, mine + sum(theirs))
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"mfuscope analyze failed on {trace_dir} (exit {proc.returncode}):\n{tail}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    timings = json.loads(out.read_text())["provenance"].get("timings") or {}
    return {"wall": wall, "cpu": cpu, "tree_mb": tree / 2**20, "parent_mb": parent / 2**20,
            "worker_mb": worker / 2**20, "reduce_s": timings.get("reduce_s", float("nan"))}


def measure(trace_dir: Path, cache: Path, runs: int, extra: tuple[str, ...] = ()) -> dict:
    """Median of ``runs`` cold and ``runs`` warm analyses (the warm ones after a cold one filled
    the cache)."""
    out = {}
    for label, cold in (("cold", True), ("warm", False)):
        rows = [run_analyze(trace_dir, cache, cold, extra) for _ in range(runs)]
        out[label] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return out


def dask_rows(work: Path, ranks: int, body: bytes, runs: int) -> dict:
    """The same set mapped by the local pool and by a Dask LocalCluster, each of 2 workers, their
    runs interleaved (so both see the same machine), and Dask's wall time over the pool's."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        print("  (no Dask row: pip install 'mfuscope[cluster]')", file=sys.stderr)
        return {}
    trace_dir = make_set(work, ranks, body, "dask")
    variants = {"pool": ("--workers", "2"), "dask": ("--scheduler", "local", "--workers", "2")}
    rows: dict = {v: {"cold": [], "warm": []} for v in variants}
    try:
        for _ in range(runs):
            for name, extra in variants.items():
                rows[name]["cold"].append(run_analyze(trace_dir, work / "cache", True, extra))
                rows[name]["warm"].append(run_analyze(trace_dir, work / "cache", False, extra))
    finally:
        shutil.rmtree(trace_dir)
        shutil.rmtree(work / "cache", ignore_errors=True)
    out = {}
    for name in variants:
        med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in rows[name].items()}
        out[f"{ranks}x54MB {name}"] = {"ranks": ranks, "rank_mb": len(body) / 2**20, "runs": runs, **med}
    for label in ("cold", "warm"):
        ratio = out[f"{ranks}x54MB dask"][label]["wall"] / out[f"{ranks}x54MB pool"][label]["wall"]
        print(f"  {ranks} x 54 MB, {label}: Dask LocalCluster / local pool wall = {ratio:.3f}", file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="8,32,128", help="rank counts measured --runs times")
    p.add_argument("--once", default="512,1024", help="rank counts measured once ('' for none)")
    p.add_argument("--sizes", default="54,216", help="MB a rank: 54 (the real trace) or 216 (its steps x4)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dask", default="128",
                   help="54 MB rank counts also mapped on a Dask LocalCluster of 2 workers (--scheduler local), "
                        "beside the local pool of 2 ('' for none)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not BIG.exists():
        raise SystemExit(f"the corpus is not at {CORPUS}; set MFUSCOPE_CORPUS")
    work = Path(tempfile.mkdtemp(prefix="mfuscope-bench-scale-"))
    results: dict = {}
    try:
        raw54 = gzip.decompress(BIG.read_bytes())
        bodies = {54: raw54}
        plan = [(int(n), args.runs) for n in args.ranks.split(",") if n] + \
               [(int(n), 1) for n in args.once.split(",") if n]
        for size in (int(s) for s in args.sizes.split(",")):
            body = bodies.setdefault(size, repeated(raw54, round(size / 54)))
            for ranks, runs in plan:
                t0 = time.perf_counter()
                trace_dir = make_set(work, ranks, body, f"{size}mb")
                built = time.perf_counter() - t0
                res = measure(trace_dir, work / "cache", runs)
                results[f"{ranks}x{size}MB"] = {"ranks": ranks, "rank_mb": len(body) / 2**20, "runs": runs,
                                                "built_s": built, **res}
                print(f"  {ranks} x {size} MB: cold {res['cold']['wall']:.1f} s, warm {res['warm']['wall']:.1f} s",
                      file=sys.stderr, flush=True)
                shutil.rmtree(trace_dir)
                shutil.rmtree(work / "cache", ignore_errors=True)
        for ranks in (int(n) for n in args.dask.split(",") if n):
            results.update(dask_rows(work, ranks, raw54, args.runs))
        print(f"\n{os.cpu_count()} CPUs; median of runs; memory: peak PSS")
        print(f"{'set':<18} {'':5} {'wall s':>8} {'cpu s':>8} {'tree MB':>8} {'parent MB':>10} {'worker MB':>10} "
              f"{'worker/trace':>12} {'reduce s':>9}")
        for name, r in results.items():
            for label in ("cold", "warm"):
                m = r[label]
                print(f"{name:<18} {label:5} {m['wall']:8.1f} {m['cpu']:8.1f} {m['tree_mb']:8.0f} "
                      f"{m['parent_mb']:10.0f} {m['worker_mb']:10.0f} {m['worker_mb'] / r['rank_mb']:12.2f} "
                      f"{m['reduce_s']:9.2f}")
        for size in {r["rank_mb"] for r in results.values()}:
            rows = [r for name, r in results.items() if r["rank_mb"] == size and " " not in name]
            if len(rows) >= 2:
                x = np.array([r["ranks"] for r in rows], dtype=float)
                for key in ("parent_mb", "tree_mb"):
                    slope = np.polyfit(x, [r["cold"][key] for r in rows], 1)[0]
                    print(f"slope, {size:.0f} MB ranks, cold {key}: {slope:.2f} MB a rank")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
