"""``make demo``: train and profile the reference trainer on this machine, analyze it, say where to look.

1. ``mfuscope train``: 4 ranks of the tiny Llama (FSDP2 x tensor parallel, gloo
   on the CPU) through torchrun, profiled, into a run directory;
2. ``mfuscope info`` and ``mfuscope analyze`` on that run, writing report.json;
3. if the real-trace corpus is beside the repository, the same on its 8-rank
   NCCL DLRM set.
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
    p = argparse.ArgumentParser(description="Train, profile and analyze the reference trainer end to end.")
    p.add_argument("--out", type=Path, default=Path("artifacts/demo"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layout", default="dp_shard=2,tp=2")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)

    run = args.out / "run"
    _banner(f"mfuscope train: tiny Llama, {args.nproc} ranks, {args.layout}, {args.steps} steps, profiled")
    rc = cli.main(["train", "--config", "tiny_dense", "--nproc", str(args.nproc), "--layout", args.layout,
                   "--steps", str(args.steps), "--profile", "--out", str(run), "--force"])
    if rc:
        return rc
    _banner(f"mfuscope info {run}")
    rc = cli.main(["info", str(run)])
    _banner(f"mfuscope analyze {run}")
    rc = rc or cli.main(["analyze", str(run)])

    corpus = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
    dlrm_report = None
    if (corpus / DLRM).is_dir():
        _banner("mfuscope analyze on the corpus 8-rank NCCL DLRM trace set")
        dlrm_report = args.out / "dlrm-report.json"
        rc = rc or cli.main(["analyze", str(corpus / DLRM), "--out", str(dlrm_report), "--force"])

    _banner("where to look")
    print(f"  run directory:             {run}  (manifest.json, steps.parquet/, comm.parquet/, traces/)")
    print(f"  report:                    {run / 'report.json'}")
    if dlrm_report:
        print(f"  report (8-rank DLRM set):  {dlrm_report}")
    print(f"  traces (open in Perfetto): {run}/traces/rank*.pt.trace.json.gz")
    print(f"  explore:  {sys.executable} -m mfuscope info {run} --json")
    return rc


if __name__ == "__main__":
    sys.exit(main())
