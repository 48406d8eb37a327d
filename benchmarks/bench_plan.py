"""Layout planning time: ``mfuscope plan`` at 1k, 16k and 100k GPUs, wall time and peak memory.

Each size plans Llama 3 70B and 405B, Mixtral 8x7B and DeepSeek-V3 (MoE) on H100s (8 per node) at 8,192 tokens,
with a global batch of 2 sequences per GPU, in-process: the planner is pure
Python, so ``time.perf_counter`` (untraced runs) and ``tracemalloc``'s peak (one
traced run) measure it.
Median of ``--runs``; the first (imports, profile load) is not counted.

    python benchmarks/bench_plan.py [--runs 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from mfuscope.optimizers import planner, presets
from mfuscope.optimizers.spec import Training
from mfuscope.optimizers.system import default_profile, system

SIZES = (1024, 16384, 102400)
MODELS = ("llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3")  # dense and MoE


def plan_once(model_name: str, gpus: int, trace_memory: bool = False) -> tuple[float, int, int]:
    """(wall seconds, peak bytes or 0, layouts considered); tracing memory slows Python down, so
    times come from untraced runs and the peak from one traced run."""
    model = presets.load(model_name)
    if trace_memory:
        tracemalloc.start()
    start = time.perf_counter()
    result = planner.plan(model, gpus, system("H100"), 2 * gpus, Training(seq_len=8192, compiled=True),
                          default_profile(), top=10)
    wall = time.perf_counter() - start
    peak = 0
    if trace_memory:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return wall, peak, result.considered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    plan_once(MODELS[0], SIZES[0])  # warm-up
    print(f"planning time, median of {args.runs} runs; peak: tracemalloc's, the planner's own allocations")
    print(f"  {'model':<12} {'GPUs':>7} {'layouts':>8} {'wall s':>8} {'peak MB':>8}")
    for model in MODELS:
        for gpus in SIZES:
            runs = [plan_once(model, gpus) for _ in range(args.runs)]
            wall = statistics.median(r[0] for r in runs)
            peak = plan_once(model, gpus, trace_memory=True)[1]
            print(f"  {model:<12} {gpus:>7} {runs[0][2]:>8} {wall:>8.3f} {peak / 2**20:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
