"""``make demo``: profile a real multi-rank job on this machine, analyze it, say where to look.

1. runs a 4-rank DistributedDataParallel job over gloo on the CPU under
   torch.profiler (a genuine multi-rank Kineto trace set, made here);
2. ``mfuscope info`` and ``mfuscope analyze`` on it, writing report.json;
3. if the real-trace corpus is beside the repository, the same on its 8-rank
   NCCL DLRM set.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from mfuscope import cli

REPO = Path(__file__).resolve().parent.parent
DLRM = "traces/param/et_replay/tests/inputs/dlrm_kineto"


def _banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Profile and analyze a real multi-rank job end to end.")
    p.add_argument("--out", type=Path, default=Path("artifacts/demo"))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)

    from mfuscope.reference_trainer import demo_workload

    out = args.out
    traces = out / "traces"
    if traces.exists():
        shutil.rmtree(traces)  # the demo's own output from an earlier run
    _banner(f"profiling a {args.ranks}-rank DDP job (gloo, CPU) for {args.steps} steps")
    t0 = time.perf_counter()
    demo_workload.run(out, ranks=args.ranks, steps=args.steps)
    print(f"traces in {traces}  ({time.perf_counter() - t0:.1f} s)")

    _banner(f"mfuscope info {traces}")
    rc = cli.main(["info", str(traces)])
    _banner(f"mfuscope analyze {traces}")
    report = out / "report.json"
    rc = rc or cli.main(["analyze", str(traces), "--out", str(report), "--force"])

    corpus = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
    dlrm_report = None
    if (corpus / DLRM).is_dir():
        _banner("mfuscope analyze on the corpus 8-rank NCCL DLRM trace set")
        dlrm_report = out / "dlrm-report.json"
        rc = rc or cli.main(["analyze", str(corpus / DLRM), "--out", str(dlrm_report), "--force"])

    _banner("where to look")
    print(f"  report (4-rank gloo run):  {report}")
    if dlrm_report:
        print(f"  report (8-rank DLRM set):  {dlrm_report}")
    print(f"  traces (open in Perfetto): {traces}/rank*.pt.trace.json.gz")
    print(f"  explore:  {sys.executable} -m mfuscope info {traces} --json")
    return rc


if __name__ == "__main__":
    sys.exit(main())
