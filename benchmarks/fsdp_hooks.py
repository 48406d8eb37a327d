"""FSDP2's host time per hook call, in layer passes of host time: the number the cost model books
where no calibration run shards (``optimizers/system.py``, ``FSDP_HOOK_LAYER_PASSES``).

    python benchmarks/fsdp_hooks.py [--out DIR] [--rounds 5]

On a CPU every operator is dispatched, and every hook run, by the thread that also computes, so
FSDP2's hooks (their Python, the copy-in and copy-out calls, the DTensor wrapping of the sharded
parameters) add host time to a step: about as much as a fixed amount of Python costs on this host,
as a layer's module calls do.  A calibration on one rank and tensor parallelism (the cost model's
real-compute table) sees no FSDP, so the model books each hook call as this many layer passes of
the host time it fitted.

Two models, neither the one the real-compute table predicts (d=192, 4 layers, 128-token
sequences): the reference trainer's ``tiny_dense`` (d=64, 32-token sequences) and a d=128 one of 6
layers and 64-token sequences.  Each round trains a model on one rank, with a twin on the other core
as that table's one-rank run has, and on dp_shard=2 -- 20 steps, 4 traced, forked ranks -- and
calibrates the pair (``mfuscope calibrate``): the one-rank run fits the host time per layer and pass
(``layer_overhead_s``), the FSDP run what its host leaves hold beyond it per hook call
(``fsdp_hook_layer_passes``).  The hook's seconds stay near 0.6-0.8 ms on both models while the
per-layer host time grows with the tensors (0.4 ms at d=64, 0.8-0.9 at d=128), so the ratio moves
with the model: the number booked is the geometric mean of the two models' medians, and the spread
is the prior's uncertainty.  Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from mfuscope.tests import real_compute
from mfuscope.tests.shared_runs import train_forked

CLI = [sys.executable, "-m", "mfuscope"]
#: The second model, beside the shipped ``tiny_dense``: wider, deeper, longer sequences.
D128 = """
[model]
vocab_size = 512
dim = 128
n_layers = 6
n_heads = 4
n_kv_heads = 2
ffn_dim = 384
max_seq_len = 64

[train]
seq_len = 64
global_batch = 8
microbatches = 2
lr = 1e-3
dtype = "fp32"
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("artifacts/fsdp-hooks"))
    ap.add_argument("--rounds", type=int, default=5, help="pairs of runs to train per model (default 5)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"--rounds {args.rounds}: give 1 or more", file=sys.stderr)
        return 2
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    (args.out / "d128.toml").write_text(D128)
    models = {"tiny_dense": "tiny_dense", "d128": str(args.out / "d128.toml")}
    rows, medians = [], {}
    for name, config in models.items():
        ratios = []
        for i in range(1, args.rounds + 1):
            layer, ratio = _one_round(args.out / name / f"round-{i}", config)
            ratios.append(ratio)
            rows.append(f"| {name} | {i} | {layer * 1e3:.3f} | {ratio * layer * 1e3:.3f} | {ratio:.2f} |")
            print(f"{name}, round {i}: {ratio:.2f} layer passes a hook call", file=sys.stderr)
        medians[name] = statistics.median(ratios)
    print("\n| model | round | host per layer pass (ms) | per FSDP hook call (ms) | layer passes a hook call |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nmedians: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items())
          + f"; their geometric mean {statistics.geometric_mean(medians.values()):.2f} layer passes a hook call")
    return 0


def _one_round(root: Path, config: str) -> tuple[float, float]:
    """One rank and dp_shard=2 of ``config`` trained, analyzed and calibrated together: the fitted
    host seconds per layer pass and FSDP hook call's layer passes."""
    with real_compute.twin(root, config):
        one = train_forked(root / "1", 1, config=config, steps=real_compute.STEPS, window=real_compute.WINDOW)
    fsdp = train_forked(root / "dp_shard2", 2, config=config, steps=real_compute.STEPS,
                        window=real_compute.WINDOW, layout="dp_shard=2")
    for run in (one, fsdp):
        real_compute.analyze(run)
    hw = root / "hw.json"
    subprocess.run([*CLI, "calibrate", str(one), str(fsdp), "--out", str(hw)], check=True, capture_output=True)
    profile = json.loads(hw.read_text())["profile"]
    return profile["layer_overhead_s"], profile["fsdp_hook_layer_passes"]


if __name__ == "__main__":
    raise SystemExit(main())
