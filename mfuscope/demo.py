"""``make demo``: train and profile the reference trainer on this machine, analyze it, say where to look.

1. ``mfuscope train``: 8 ranks of the tiny Llama (pipeline x FSDP2 x tensor
   parallel, gloo on the CPU) through torchrun, profiled, into a run directory
   under ``artifacts/demo/runs``;
2. ``mfuscope info`` and ``mfuscope analyze`` on that run: report.json and the
   dashboard's views;
3. if the real-trace corpus is beside the repository, its 8-rank NCCL DLRM set
   joins the runs (a link; the dashboard analyzes it on first view);
4. the command that opens the dashboard over those runs.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mfuscope import cli

REPO = Path(__file__).resolve().parent.parent
DLRM = "traces/param/et_replay/tests/inputs/dlrm_kineto"


def _banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from mfuscope.lean_imports import jsonschema_without_iri
    jsonschema_without_iri()
    p = argparse.ArgumentParser(description="Train, profile and analyze the reference trainer end to end.")
    p.add_argument("--out", type=Path, default=Path("artifacts/demo"))
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--layout", default="dp_shard=2,tp=2,pp=2")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)

    runs = args.out / "runs"
    run = runs / f"tiny-llama-{args.nproc}ranks"
    _banner(f"mfuscope train: tiny Llama, {args.nproc} ranks, {args.layout}, {args.steps} steps, profiled")
    rc = cli.main(["train", "--config", "tiny_dense", "--nproc", str(args.nproc), "--layout", args.layout,
                   "--microbatches", str(args.microbatches), "--steps", str(args.steps), "--profile",
                   "--out", str(run), "--force"])
    if rc:
        return rc
    _banner(f"mfuscope info {run}")
    rc = cli.main(["info", str(run)])
    _banner(f"mfuscope analyze {run}")
    rc = rc or cli.main(["analyze", str(run)])

    corpus = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
    dlrm = runs / "dlrm-corpus-8ranks"
    if (corpus / DLRM).is_dir() and not dlrm.exists():
        dlrm.symlink_to((corpus / DLRM).resolve(), target_is_directory=True)

    _banner("where to look")
    print(f"  run directory:             {run}  (manifest.json, steps.parquet/, comm.parquet/, traces/)")
    print(f"  report:                    {run / 'report.json'}")
    print(f"  traces (open in Perfetto): {run}/traces/rank*.pt.trace.json.gz")
    if dlrm.exists():
        print(f"  corpus DLRM set (8 ranks): {dlrm} -> {os.readlink(dlrm)}")
    print(f"  gate CI on it:             mfuscope ci record {run} --history perf-history --workload tiny-llama; "
          "later: mfuscope ci check NEW_RUN --history perf-history --workload tiny-llama (docs/ci.md)")
    exe = Path(sys.executable).parent / "mfuscope"
    print(f"\n  dashboard:  {exe} dashboard {runs}   (or: make dashboard)")
    print("              then open http://127.0.0.1:8050/ in a browser")
    return rc


if __name__ == "__main__":
    sys.exit(main())
