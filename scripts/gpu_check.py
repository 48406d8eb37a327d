"""GPU check for the reference trainer: the dense GPU config on one GPU, bf16, torch.compile.

Prints tokens/s and MFU against the hardware table and writes JSON (``--json``).
Needs one CUDA GPU; on a machine without one it says so and exits 3.

    python scripts/gpu_check.py --json gpu_check.json [--config gpu_dense_1b] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="gpu_dense_1b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run this on a GPU machine", file=sys.stderr)
        return 3
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")

    from mfuscope import hardware
    from mfuscope.flops import train_flops_per_token
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.train import RunOptions, run_rank

    cfg = load_config(args.config)
    result = run_rank(RunOptions(config=args.config, steps=args.steps))
    times = result["step_times"][3:]  # compile and warm-up steps excluded
    step = statistics.median(times)
    tokens = cfg.global_batch * cfg.seq_len
    model_flops, hw_flops = train_flops_per_token(cfg.model.spec(), cfg.seq_len, cfg.recompute)
    name = torch.cuda.get_device_name()
    acc = hardware.lookup(name)
    peak = acc.peak_flops("bf16") if acc else None
    out = {
        "device": name, "config": args.config, "steps": args.steps, "step_time_s": step,
        "tokens_per_s": tokens / step, "tflops_per_s": model_flops * tokens / step / 1e12,
        "mfu": model_flops * tokens / step / peak if peak else None,
        "hfu": hw_flops * tokens / step / peak if peak else None,
        "peak_tflops": peak / 1e12 if peak else None, "losses": result["losses"],
        "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
