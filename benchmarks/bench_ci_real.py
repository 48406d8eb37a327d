"""The CI gate's false-positive rate on a recorded history of *real* runs of this machine (with its
drift), not simulated i.i.d. noise.

``record`` runs the workflow's own training step (.github/workflows/mfu-regression.yml: the tiny
config, 2 gloo ranks, tp=2, 21 steps, a 3-step trace window) again and again on one unchanged
commit and appends each run's record to a history, as a push to main would; ``compact`` keeps what
the statistical gate reads of each record (the fixture tests/fixtures/ci_history/tiny-tp2-real.jsonl);
``replay`` slides over the history: every record is checked against the records before it, as main's
gate (two consecutive violations) and as a pull request's with ``--confirm-runs N`` (the record
and the next N -- the runs that followed it on the machine, as an in-job rerun follows its run --
all violate), and prints the share of checks each fails.  Every run is of the same code, so every
failure is a false positive.

    chrt --idle 0 python benchmarks/bench_ci_real.py record --runs 60 --history DIR [--scratch DIR]  # ~12 s a run
    python benchmarks/bench_ci_real.py compact DIR/tiny-tp2.jsonl tests/fixtures/ci_history/tiny-tp2-real.jsonl
    python benchmarks/bench_ci_real.py replay [HISTORY.jsonl]   # default: the fixture

``record`` under ``chrt --idle 0`` leaves the machine to everyone else (its runs then see every
other job's load: the drift of a shared runner).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mfuscope.regression import replay as rp

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ci_history" / "tiny-tp2-real.jsonl"
TRAIN = ["train", "--config", "tiny_dense", "--nproc", "2", "--layout", "tp=2", "--steps", "21", "--window", "1:3"]


def record(runs: int, history: Path, scratch: Path | None) -> int:
    scratch = scratch or Path(tempfile.mkdtemp(prefix="mfuscope-ci-real-"))
    mfuscope = [sys.executable, "-m", "mfuscope"]
    for i in range(runs):
        run = scratch / "ci-tiny-tp2"
        start = time.perf_counter()
        subprocess.run(mfuscope + TRAIN + ["--out", str(run), "--force"], check=True, capture_output=True)
        out = subprocess.run(mfuscope + ["ci", "record", str(run), "--history", str(history), "--workload",
                                         "tiny-tp2", "--commit", f"real-{i:03d}", "--branch", "main"],
                             check=True, capture_output=True, text=True).stdout.strip()
        print(f"[{i + 1}/{runs}] {time.perf_counter() - start:.1f} s  {out}", flush=True)
        shutil.rmtree(run, ignore_errors=True)
    return 0


def compact(src: Path, dst: Path) -> int:
    lines = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(rp.compact(r), separators=(",", ":")) + "\n" for r in lines))
    print(f"{len(lines)} records -> {dst} ({dst.stat().st_size / 1024:.0f} KiB)")
    return 0


def replay(path: Path, confirm: tuple[int, ...], drops: tuple[float, ...]) -> int:
    records = rp.load(path)
    levels = [rp.level(r) for r in records]
    print(f"{path}: {len(records)} real runs of one commit, {records[0]['time']} to {records[-1]['time']}; "
          f"a run's step time (trimmed mean) {min(levels) * 1e3:.0f}-{max(levels) * 1e3:.0f} ms, median "
          f"{sorted(levels)[len(levels) // 2] * 1e3:.0f} ms; run-to-run CV {rp.run_to_run_cv(records):.1%}, "
          f"step-to-step CV {rp.step_cv(records):.1%} (MAD-scaled)")
    r = rp.replay(records, confirm_runs=confirm)
    n = r["checks"]
    print(f"\nfalse positives: each record checked against the {r['window']} before it (from the "
          f"{r['min_records'] + 1}th on): {n} checks")
    print(f"  one violation (suspicious, passes)         {r['violations']:>3} ({r['violations'] / n:.1%})")
    print(f"  main's gate (two consecutive violations)   {r['main_fails']:>3} ({r['main_fails'] / n:.1%})  "
          f"at {r['failed_at']}")
    for k in confirm:
        f, c = r["pr_fails"][k], r["pr_checks"][k]
        print(f"  a pull request's, --confirm-runs {k}         {f:>3} of {c} ({f / c:.1%})  at {r['pr_failed_at'][k]}")
    for k in confirm:
        c = r["pr_checks"][k]
        print(f"  bound for {c} checks at a per-check rate of {rp.NOMINAL_RATE:.1%}: at most "
              f"{rp.binomial_limit(c, rp.NOMINAL_RATE)} failures (P(more) < 1%)")
    if drops:
        print("\npower on the same runs: the code turns slower by the drop from each record on")
        print(f"  {'':<34}" + "".join(f" {f'-{d:.0%}':>7}" for d in drops))
        p = {d: rp.power(records, d, confirm_runs=confirm) for d in drops}
        print(f"  {'main: fails within two records':<34}" + "".join(
            f" {p[d]['main'] / p[d]['positions']:>7.1%}" for d in drops))
        for k in confirm:
            print(f"  {f'a pull request, --confirm-runs {k}':<34}" + "".join(
                f" {p[d]['pr'][k] / p[d]['pr_positions'][k]:>7.1%}" for d in drops))
    print("\nthe workflow's pull-request gate (--paired-with): the job also trains main's code, and "
          "fails when the pull request's run is slower than main's run of the same job by the threshold, in "
          "two pairs (a run's level: the 10% quantile of its steps); power as above")
    c = None
    for t in (0.02, 0.05, 0.08):
        q = rp.paired(records, t, drops=drops)
        c = q["checks"]
        print(f"  threshold {t:>3.0%}: fails {q['fails']:>2} of {c} ({q['fails'] / c:.1%}) at {q['failed_at']}"
              + "".join(f"   -{d:.0%}: {q['power'][d]:.1%}" for d in drops))
    print(f"  bound for {c} checks at {rp.NOMINAL_RATE:.1%}: at most {rp.binomial_limit(c, rp.NOMINAL_RATE)}")
    q = rp.pushes(records, drops=drops)
    c = q["checks"]
    print("\nthe workflow's push gate (--pair-on-violation): checked against the history; where it calls the run "
          "slower, the job trains the parent commit's code and the pairs decide (limit 5% or 1.65 standard errors)")
    print(f"  the history called {q['violations']} of {c} pushes slower; the job failed {q['fails']} "
          f"({q['fails'] / c:.1%}) at {q['failed_at']}" + "".join(f"   -{d:.0%}: {q['power'][d]:.1%}" for d in drops))
    print(f"  bound for {c} checks at {rp.NOMINAL_RATE:.1%}: at most {rp.binomial_limit(c, rp.NOMINAL_RATE)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("record", help="train and record the workflow's run RUNS times")
    p.add_argument("--runs", type=int, default=60)
    p.add_argument("--history", type=Path, required=True)
    p.add_argument("--scratch", type=Path, default=None)
    p = sub.add_parser("compact", help="keep what the statistical gate reads of each record")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p = sub.add_parser("replay", help="the sliding replay's false-positive shares")
    p.add_argument("history", type=Path, nargs="?", default=FIXTURE)
    p.add_argument("--confirm-runs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--drops", type=float, nargs="*", default=[0.05, 0.10, 0.20, 0.50],
                   help="MFU drops whose detection power is measured on the same runs (none: skip)")
    args = parser.parse_args()
    if args.cmd == "record":
        return record(args.runs, args.history, args.scratch)
    if args.cmd == "compact":
        return compact(args.src, args.dst)
    return replay(args.history, tuple(args.confirm_runs), tuple(args.drops))


if __name__ == "__main__":
    raise SystemExit(main())
