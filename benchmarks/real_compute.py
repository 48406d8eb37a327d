"""The cost model on real compute: unpaced reference-trainer runs on this CPU, calibrated on two.

    python benchmarks/real_compute.py [--out DIR] [--reuse] [--calibrate-on "1 rank,tp=2"]

Trains the seven layouts of ``tests/real_compute.py`` (one rank, FSDP, tensor, pipeline, context and
data parallel, expert parallel on the MoE twin; at most two ranks, 20 steps each), fits a profile
with ``mfuscope calibrate`` on two of them and predicts every one with ``mfuscope predict --json``:
the markdown table of docs/cost_model.md ("Proof on real compute"), the measured median step
against the predicted one, and the three largest leaves of each.  ``--reuse`` keeps runs already
in ``--out``.  Run it on a quiet machine: what is measured is this host's speed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mfuscope.tests import real_compute

CLI = [sys.executable, "-m", "mfuscope"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("artifacts/real-compute"))
    ap.add_argument("--reuse", action="store_true", help="keep the runs already in --out")
    ap.add_argument("--calibrate-on", default=",".join(real_compute.CALIBRATE_ON),
                    help="the layouts the profile is fitted on (names of tests/real_compute.py's LAYOUTS)")
    args = ap.parse_args(argv)
    names = list(real_compute.LAYOUTS)
    calibrate_on = [n.strip() for n in args.calibrate_on.split(",")]
    if unknown := set(calibrate_on) - set(names):
        print(f"--calibrate-on: unknown {', '.join(sorted(unknown))}; one of {', '.join(names)}", file=sys.stderr)
        return 2
    if args.out.exists() and not args.reuse:
        shutil.rmtree(args.out)
    runs = {}
    for name in names:
        path = real_compute.run_path(args.out, name)
        if not (args.reuse and (path / "report.json").is_file()):
            t = time.perf_counter()
            real_compute.train(args.out, name)
            print(f"trained {name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        runs[name] = path
    hw = args.out / "hw.json"
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
    return 0


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
