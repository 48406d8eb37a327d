"""GPU check for the reference trainer: the dense GPU config on one GPU, bf16, torch.compile.

Prints tokens/s and MFU against the hardware table and writes JSON (``--json``).
The run goes through the collectors (``--run-dir``), so it also checks their
GPU paths: CUDA-event step times, NVML samples from the driver, and a Kineto
window with GPU kernels.
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
    p.add_argument("--run-dir", default="gpu_check_run", help="run directory the collectors write (replaced)")
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
    result = run_rank(RunOptions(config=args.config, steps=args.steps, out=args.run_dir, window="5:2", force=True))
    # The trainer synchronizes the device at each step boundary, so these are GPU step times (the
    # collectors' CUDA-event times are reported beside them), not the host's time to enqueue a step.
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
        "collectors": _collector_checks(args.run_dir, statistics.median(times)),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _collector_checks(run: str, host_step_s: float) -> dict:
    """What the collectors recorded on the GPU: device step times, NVML samples, kernels in the window."""
    from mfuscope import run_dir
    from mfuscope.analyzers import trace_set

    steps = run_dir.read_table(run, run_dir.STEPS).to_pandas()
    nvml = run_dir.read_table(run, run_dir.NVML).to_pandas() if (os.path.exists(os.path.join(run, run_dir.NVML))) else None
    events = trace_set.load(run, use_cache=False).events.to_pandas()
    device_s = steps["device_time_ns"].dropna().iloc[3:] / 1e9
    return {
        "steps_rows": len(steps),
        "device_step_s_median": float(device_s.median()) if len(device_s) else None,
        "host_step_s_median": host_step_s,
        "nvml_rows": 0 if nvml is None else len(nvml),
        "nvml_gpu_util_pct_median": None if nvml is None else float(nvml["gpu_util_pct"].median()),
        "nvml_power_w_median": None if nvml is None else float(nvml["power_w"].median()),
        "nvml_sm_clock_mhz_median": None if nvml is None else float(nvml["sm_clock_mhz"].median()),
        "window_kernels": int((events["kind"].astype(str) == "kernel").sum()),
    }


if __name__ == "__main__":
    sys.exit(main())
