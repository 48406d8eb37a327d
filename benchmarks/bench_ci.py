"""The CI gate: ``mfuscope ci check`` on a 10,000-record history (wall time, peak memory), and
its false-positive rate and detection power beside simpler rules, on simulated histories.

The histories are made from a real report (``--run``, or a tiny run trained now: 2 gloo ranks,
tp=2, 21 steps) by regression/simulate.py: every step time multiplied by log-normal noise of a
given coefficient of variation; a regression multiplies them by 1 / (1 - drop).

Rules compared on the same histories (each fails a check when it says "regression"):
  mfuscope          this gate: trimmed mean vs the window's median, max(2%, 2.5 MAD) limit, one-sided
                    Mann-Whitney U at 0.01, two consecutive violations confirm
  single-run 5%     fail when MFU is 5% below the previous record (the naive gate)
  fixed ratio 2x    github-action-benchmark's default alert: twice as slow as the previous record
  asv-like          ratio over 1.1 against the previous record and Mann-Whitney p < 0.05 on the samples

A pull request's gate (``ci check --confirm-runs N``: its run and every in-job rerun must violate)
is measured the same way, for N = 1 and 2, and so is the workflow's paired gate (``ci check
--paired-with``: main's run in the job against the pull request's, regression/paired.py)
(``--pull-requests`` prints only those tables).

    python benchmarks/bench_ci.py [--run RUN_DIR] [--records 10000] [--runs 3] [--trials 300] [--pull-requests]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mfuscope.regression import simulate
from mfuscope.regression import statistics as st
from mfuscope.regression.history import append
from mfuscope.regression.statistical import METRICS, WINDOW, gate, samples

NOISE = (0.01, 0.03, 0.08)
DROPS = (0.02, 0.03, 0.05, 0.08, 0.10, 0.15)


def real_run(path: Path | None, scratch: Path) -> Path:
    if path:
        return path
    run = scratch / "tiny-tp2"
    print("training a tiny run for its report (2 ranks, tp=2, 21 steps) ...", file=sys.stderr, flush=True)
    for cmd in (["train", "--config", "tiny_dense", "--nproc", "2", "--layout", "tp=2", "--steps", "21",
                 "--window", "1:5", "--out", str(run)], ["analyze", str(run)]):
        subprocess.run([sys.executable, "-m", "mfuscope", *cmd], check=True, capture_output=True)
    return run


def time_check(run: Path, history: Path, runs: int) -> tuple[float, float]:
    """Median wall seconds of `mfuscope ci check` and the largest child peak RSS (MiB)."""
    walls = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "mfuscope", "ci", "check", str(run), "--history", str(history),
                               "--workload", "simulated", "--branch", "main", "--json"], capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        if proc.returncode not in (0, 1):
            raise SystemExit(proc.stderr)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return statistics.median(walls), peak_kib / 1024


# --------------------------------------------------------------------------- rules


def mfuscope_rule(history, current):
    return any(gate(history, current, m, 0.02)["verdict"] == "regression" for m in METRICS)


def single_run_5pct(history, current):
    prev, cur = (st.trimmed_mean(samples(r, "mfu", None)) for r in (history[-1], current))
    return cur < 0.95 * prev


def fixed_ratio_2x(history, current):
    prev, cur = (st.trimmed_mean(samples(r, "step_time_s", None)) for r in (history[-1], current))
    return cur > 2.0 * prev


def asv_like(history, current):
    prev, cur = samples(history[-1], "step_time_s", None), samples(current, "step_time_s", None)
    return np.median(cur) > 1.1 * np.median(prev) and st.mann_whitney_less(-cur, -prev) < 0.05


RULES = {"mfuscope": mfuscope_rule, "single-run 5%": single_run_5pct, "fixed ratio 2x": fixed_ratio_2x,
         "asv-like": asv_like}


def rates(report, manifest, cv: float, drop: float, trials: int, seed: int, run_cv: float = 0.0) -> dict[str, float]:
    """drop == 0: share of noise-only checks failed; else: share of trials confirmed within 2 records."""
    rng = np.random.default_rng(seed)
    hits = dict.fromkeys(RULES, 0)
    if drop == 0:
        records = [simulate.noisy_record(report, manifest, rng, cv, index=i, run_cv=run_cv) for i in range(WINDOW)]
        for i in range(trials):
            cur = simulate.noisy_record(report, manifest, rng, cv, index=WINDOW + i, run_cv=run_cv)
            for name, rule in RULES.items():
                hits[name] += rule(records, cur)
            records.append(cur)
        return {k: v / trials for k, v in hits.items()}
    for _ in range(trials):
        records = [simulate.noisy_record(report, manifest, rng, cv, index=i) for i in range(WINDOW)]
        seen = set()
        for k in range(2):
            cur = simulate.noisy_record(report, manifest, rng, cv, drop, index=WINDOW + k)
            for name, rule in RULES.items():
                if name not in seen and rule(records, cur):
                    seen.add(name)
            records.append(cur)
        for name in seen:
            hits[name] += 1
    return {k: v / trials for k, v in hits.items()}


def pull_request_tables(report, manifest, trials: int) -> None:
    """A pull request's gate with --confirm-runs 1 and 2: false positives (1,000 fresh noise-only
    windows per cell) and the power to fail a sustained drop at once (``trials`` per cell)."""
    print("\na pull request's gate (--confirm-runs N): false-positive rate, 1,000 noise-only checks")
    cells = [(cv, 0.0) for cv in NOISE] + [(0.03, r) for r in (0.02, 0.05)]
    print(f"  {'':<16}" + "".join(f" {f'CV {cv:.0%}' + (f' run {r:.0%}' if r else ''):>14}" for cv, r in cells))
    for n in (1, 2):
        rates_ = [simulate.pull_request_fail_rate(report, manifest, cv, 1000, n, run_cv=r, seed=5) for cv, r in cells]
        print(f"  {f'--confirm-runs {n}':<16}" + "".join(f" {x:>14.2%}" for x in rates_))
    print(f"\na pull request's gate: power, share of {trials} trials failing a sustained MFU drop in the job")
    for cv in (0.03, 0.08):
        print(f"  CV {cv:.0%}          " + "".join(f" {f'-{d:.0%}':>7}" for d in DROPS))
        for n in (1, 2):
            hits = [simulate.pull_request_fail_rate(report, manifest, cv, trials, n, drop=d, seed=6) for d in DROPS]
            print(f"  {f'--confirm-runs {n}':<19}" + "".join(f" {x:>7.1%}" for x in hits))
    print("\nthe workflow's pull-request gate (--paired-with main's run, one more pair on a violation): "
          "false-positive rate over 4,000 unchanged pull requests, power over " f"{trials} per cell")
    print(f"  {'step CV':<10} {'false pos.':>10}" + "".join(f" {f'-{d:.0%}':>7}" for d in DROPS))
    for cv in (0.01, 0.03, 0.05, 0.08, 0.10):
        fp = simulate.paired_fail_rate(report, manifest, cv, 4000, seed=7)
        hits = [simulate.paired_fail_rate(report, manifest, cv, trials, seed=8, drop=d) for d in DROPS]
        print(f"  {f'{cv:.0%}':<10} {fp:>10.2%}" + "".join(f" {x:>7.1%}" for x in hits))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=None, help="a run directory with report.json (default: train one)")
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trials", type=int, default=300, help="power trials per cell (1,000 checks for the FPR)")
    parser.add_argument("--pull-requests", action="store_true", help="only the pull-request gate's tables")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run = real_run(args.run, Path(scratch))
        report, manifest = (json.loads((run / f).read_text()) for f in ("report.json", "manifest.json"))
        if args.pull_requests:
            pull_request_tables(report, manifest, args.trials)
            return 0
        history = Path(scratch) / "history"
        rng = np.random.default_rng(0)
        for i in range(args.records):
            append(history, simulate.noisy_record(report, manifest, rng, 0.03, index=i))
        size = (history / "simulated.jsonl").stat().st_size
        wall, peak = time_check(run, history, args.runs)
        print(f"mfuscope ci check on {args.records:,} records ({size / 2**20:.1f} MiB of history): "
              f"{wall:.2f} s (median of {args.runs}), peak RSS {peak:.0f} MiB")

        samples_n = len(report["per_step"])
        print(f"\nfalse-positive rate: share of 1,000 noise-only checks failed ({samples_n} step samples a record)")
        print(f"  {'rule':<16}" + "".join(f" {f'CV {cv:.0%}':>9}" for cv in NOISE))
        fpr = {cv: rates(report, manifest, cv, 0.0, 1000, seed=1) for cv in NOISE}
        for name in RULES:
            print(f"  {name:<16}" + "".join(f" {fpr[cv][name]:>9.2%}" for cv in NOISE))

        print("\nwith run-to-run noise too (one factor per run), step CV 3%: false-positive rate")
        print(f"  {'rule':<16}" + "".join(f" {f'run {r:.0%}':>9}" for r in (0.01, 0.02, 0.05)))
        runs_fpr = {r: rates(report, manifest, 0.03, 0.0, 1000, seed=3, run_cv=r) for r in (0.01, 0.02, 0.05)}
        for name in RULES:
            print(f"  {name:<16}" + "".join(f" {runs_fpr[r][name]:>9.2%}" for r in (0.01, 0.02, 0.05)))

        print(f"\ndetection power: share of {args.trials} trials where a sustained MFU drop is confirmed "
              "within 2 records")
        for cv in NOISE:
            print(f"  CV {cv:.0%}    " + "".join(f" {f'-{d:.0%}':>7}" for d in DROPS))
            cells = {d: rates(report, manifest, cv, d, args.trials, seed=2) for d in DROPS}
            for name in RULES:
                print(f"  {name:<16}" + "".join(f" {cells[d][name]:>7.1%}" for d in DROPS))
        pull_request_tables(report, manifest, args.trials)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
