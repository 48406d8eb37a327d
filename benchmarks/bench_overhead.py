"""What profiling costs: the reference trainer's step rate with and without the collectors.

8 ranks (pp=2 x dp_shard=2 x tp=2, FSDP2 + DTensor + pipelining on gloo), the
tiny config on CPU.  Modes, interleaved in every round (the order rotates),
median of ``--rounds`` rounds of ``--steps`` steps each (step 0 is warm-up and
not counted); the whole loop iteration is timed, so per-step bookkeeping
counts as overhead:

  bare            no instrumentation
  always-on       the collectors' session without a trace window: step timer,
                  communication timer (every collective wrapped), NVML sampler
  window          the session with a Kineto window over every timed step
  torch.profiler  bare ``torch.profiler`` (CPU activities, shapes) over the
                  same steps, exporting a gzip trace: what the window costs
                  without mfuscope

Targets: always-on <= 2% over bare; window close to bare torch.profiler.
Memory: the ranks' resident set after each mode (median, MiB).

    python benchmarks/bench_overhead.py [--rounds 5] [--steps 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

MODES = ("bare", "always-on", "window", "torch.profiler")


class _BareTorchProfiler:
    """torch.profiler over steps 1.. with a gzip export, the way a user would write it."""

    def __init__(self, out: Path, rank: int):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.path = out / f"rank{rank}.pt.trace.json.gz"
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                            schedule=schedule(wait=0, warmup=1, active=10**6),
                            on_trace_ready=lambda p: p.export_chrome_trace(str(self.path)))

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        return self.prof.__exit__(*exc)

    def step(self, tokens=None, loss=None):
        self.prof.step()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _all_modes(rounds: int, steps: int, scratch: str) -> dict:
    from mfuscope.reference_trainer.train import RunOptions, run_rank

    results: dict[str, list] = {m: [] for m in MODES}
    memory: dict[str, list] = {m: [] for m in MODES}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            out = Path(scratch) / f"{mode}-{r}"
            opts = RunOptions(config="tiny_dense", layout="pp=2,dp_shard=2,tp=2", steps=steps)
            if mode == "always-on":
                opts.out, opts.window = str(out), None
            elif mode == "window":
                opts.out, opts.window = str(out), "1:"
            elif mode == "torch.profiler":
                out.mkdir(parents=True, exist_ok=True)
                opts.instrument = lambda rank, out=out: _BareTorchProfiler(out, rank)
            loop = run_rank(opts)["loop_times"][1:]
            results[mode].append(statistics.median(loop))
            memory[mode].append(_rss_mib())
    return {"step_s": results, "rss_mib": memory}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args(argv)
    from mfuscope.reference_trainer.launch import fork_ranks

    with tempfile.TemporaryDirectory(prefix="mfuscope-bench-") as scratch:
        print(f"8 ranks, tiny_dense, pp=2 x dp_shard=2 x tp=2, {a.rounds} rounds x {a.steps} steps "
              f"(cpu count {os.cpu_count()})", flush=True)
        per_rank = fork_ranks(_all_modes, 8, a.rounds, a.steps, scratch, timeout=3600)
    rank0 = per_rank[0]["step_s"]
    median = {m: statistics.median(v) for m, v in rank0.items()}
    rss = {m: statistics.median(max(pr["rss_mib"][m][i] for pr in per_rank) for i in range(a.rounds))
           for m in MODES}
    print(f"{'mode':<16}{'step (ms)':>11}{'steps/s':>9}{'vs bare':>9}   per-round step ms     max rank RSS MiB")
    for m in MODES:
        rounds = " ".join(f"{x * 1e3:.0f}" for x in rank0[m])
        print(f"{m:<16}{median[m] * 1e3:>11.1f}{1 / median[m]:>9.3f}{median[m] / median['bare'] - 1:>+9.1%}   "
              f"{rounds:<22}{rss[m]:>8.0f}")
    print(f"\nalways-on overhead: {median['always-on'] / median['bare'] - 1:+.1%} (target <= +2%)")
    print(f"window vs bare torch.profiler: {median['window'] / median['torch.profiler']:.3f}x step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
