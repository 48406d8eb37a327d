"""The cost model on real compute: unpaced reference-trainer runs on this CPU, calibrated on two.

    python benchmarks/real_compute.py [--out DIR] [--reuse] [--calibrate-on "1 rank,tp=2"] [--rounds N]

Trains the seven layouts of ``tests/real_compute.py`` (one rank, FSDP, tensor, pipeline, context and
data parallel, expert parallel on the MoE twin; at most two ranks, 20 steps each), fits a profile
with ``mfuscope calibrate`` on two of them and predicts every one with ``mfuscope predict --json``:
the markdown table of docs/cost_model.md ("Proof on real compute"), the measured median step
against the predicted one, and the three largest leaves of each.  ``--reuse`` keeps runs already
in ``--out``.  Run it on a quiet machine: what is measured is this host's speed.

``--rounds N`` trains the seven N times, a whole set a round (``DIR/round-1`` ...), so that a
passing disturbance of the host lands in one round's runs, not in one layout's: each round is
calibrated on its own two runs and predicted on its own, and a second table gives, per layout, the
median over the rounds of the measured step, of the predicted one and of the error, the errors'
range, and in how many rounds the prediction fell within the issue's 20%.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mfuscope.tests import real_compute

CLI = [sys.executable, "-m", "mfuscope"]
#: The issue's target: a predicted step within 20% of the measured median step.
WITHIN = 0.20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("artifacts/real-compute"))
    ap.add_argument("--reuse", action="store_true", help="keep the runs already in --out")
    ap.add_argument("--calibrate-on", default=",".join(real_compute.CALIBRATE_ON),
                    help="the layouts the profile is fitted on (names of tests/real_compute.py's LAYOUTS)")
    ap.add_argument("--rounds", type=int, default=1, help="train the whole set this many times (default 1)")
    args = ap.parse_args(argv)
    names = list(real_compute.LAYOUTS)
    calibrate_on = [n.strip() for n in args.calibrate_on.split(",")]
    if unknown := set(calibrate_on) - set(names):
        print(f"--calibrate-on: unknown {', '.join(sorted(unknown))}; one of {', '.join(names)}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"--rounds {args.rounds}: give 1 or more", file=sys.stderr)
        return 2
    if args.out.exists() and not args.reuse:
        shutil.rmtree(args.out)
    roots = [args.out] if args.rounds == 1 else [args.out / f"round-{i}" for i in range(1, args.rounds + 1)]
    rounds = []
    for i, root in enumerate(roots, 1):
        if args.rounds > 1:
            print(f"round {i} of {args.rounds}", file=sys.stderr)
        rounds.append(_one_set(root, names, calibrate_on, args.reuse))
    if args.rounds > 1:
        _print_rounds(rounds, names, calibrate_on)
    return 0


def _one_set(root: Path, names: list[str], calibrate_on: list[str], reuse: bool) -> dict[str, dict]:
    """Train (or reuse) the set under ``root``, calibrate on ``calibrate_on``, predict every run;
    print its table and return each layout's prediction row (``mfuscope predict --json``)."""
    runs = {}
    for name in names:
        path = real_compute.run_path(root, name)
        if not (reuse and (path / "report.json").is_file()):
            t = time.perf_counter()
            real_compute.train(root, name)
            print(f"trained {name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        runs[name] = path
    hw = root / "hw.json"
    subprocess.run([*CLI, "calibrate", *[str(runs[n]) for n in calibrate_on], "--out", str(hw), "--json"],
                   check=True, capture_output=True)
    done = subprocess.run([*CLI, "predict", *map(str, runs.values()), "--hardware", str(hw), "--json"],
                          check=True, capture_output=True, text=True)
    rows = {Path(r["run"]): r for r in json.loads(done.stdout)}
    profile = json.loads(hw.read_text())["profile"]
    print(f"calibrated on {', '.join(calibrate_on)}: " + ", ".join(
        f"{k}={v:.3g}" for k, v in profile.items() if v not in (0.0, 1.0)))
    print("\n| layout | measured median step (ms) | predicted (ms) | error "
          "| largest leaves, measured / predicted (ms) |")
    print("|---|---|---|---|---|")
    for name, path in runs.items():
        r = rows[path]
        m, p = r["measured_step_s"], r["predicted_step_s"]
        leaves = sorted(r["leaves"].items(), key=lambda kv: -max(kv[1]["measured_s"] or 0, kv[1]["predicted_s"] or 0))
        top = ", ".join(f"{k} {_ms(v['measured_s'])} / {_ms(v['predicted_s'])}" for k, v in leaves[:3])
        mark = " (calibration)" if name in calibrate_on else ""
        print(f"| {name}{mark} | {m * 1e3:.1f} | {p * 1e3:.1f} | {p / m - 1:+.0%} | {top} |")
    print()
    return {name: rows[path] for name, path in runs.items()}


def _print_rounds(rounds: list[dict[str, dict]], names: list[str], calibrate_on: list[str]) -> None:
    n = len(rounds)
    print(f"over {n} rounds (each calibrated on its own {' and '.join(calibrate_on)}):\n")
    print(f"| layout | measured (ms) | predicted (ms) | error | range | within {WITHIN:.0%} |")
    print("|---|---|---|---|---|---|")
    for name in names:
        m = [r[name]["measured_step_s"] for r in rounds]
        p = [r[name]["predicted_step_s"] for r in rounds]
        err = [b / a - 1 for a, b in zip(m, p)]
        mark = " (calibration)" if name in calibrate_on else ""
        print(f"| {name}{mark} | {statistics.median(m) * 1e3:.1f} | {statistics.median(p) * 1e3:.1f} "
              f"| {statistics.median(err):+.0%} | {min(err):+.0%} to {max(err):+.0%} "
              f"| {sum(abs(e) <= WITHIN for e in err)} of {n} |")


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
