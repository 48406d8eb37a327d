"""The held-out error with ``overlap_slowdown`` held at other values than the model's.

``overlap_slowdown`` (compute time added per second of communication it hides) was the fifth
number ``mfuscope calibrate`` fitted to published runs; since 2026-12-05 the model holds it at a
published measurement (``Profile.overlap_slowdown``, Lee et al. 2025).  This prints what other
values would do to the leave-one-source-out error per source and per family, against the model's.

    python benchmarks/overlap_sweep.py [--values 0,0.2,0.32,0.5] [CSV ...]
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from mfuscope.optimizers import calibrate, published
from mfuscope.optimizers.system import Profile

CORPUS = Path(os.environ.get("MFUSCOPE_CORPUS", Path(__file__).resolve().parent.parent.parent / "shared" / "corpus"))
TABLES = [CORPUS / "published" / "calibration.csv", CORPUS / "published" / "calibration_moe_fp8.csv"]


def _row(label: str, sources: dict, families: dict) -> str:
    cells = [f"{sources[s]['held_out_mape'] * 100:.1f}" for s in sorted(sources)]
    cells += [f"{families[f]['held_out_mape'] * 100:.1f}" for f in ("dense", "moe", "bf16", "fp8") if f in families]
    return f"| {label} | " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="*", type=Path, default=TABLES)
    ap.add_argument("--values", default="0,0.2,0.32,0.5")
    args = ap.parse_args(argv)
    cases = [c for t in args.tables for c in published.load_cases(t)[0] if c.measured_tps]
    fields = Profile.FITTED
    model = calibrate.leave_one_source_out_by_family(cases)
    names = sorted(model.sources)
    print("| overlap_slowdown | " + " | ".join(names) + " | dense | moe | bf16 | fp8 |")
    print("|---" * (len(names) + 5) + "|")
    for value in (float(v) for v in args.values.split(",")):
        held = calibrate.leave_one_source_out_by_family(cases, start=Profile(overlap_slowdown=value), fields=fields)
        print(_row(f"{value:g} (held)", held.sources, held.families))
    print(_row(f"{Profile().overlap_slowdown:g} (the model's)", model.sources, model.families))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
