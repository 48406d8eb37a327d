"""What profiling costs: the reference trainer's step rate with and without the collectors.

8 ranks (pp=2 x dp_shard=2 x tp=2, FSDP2 + DTensor + pipelining on gloo), the
tiny config on CPU, one training run.  The run's steps are cut into blocks of
``--block`` steps; the blocks cycle through the modes, so the modes interleave
through the whole run and share its warm state.  A block's first step (the mode
starting) and last step (the mode stopping: files flushed, trace exported) are
not counted; the whole loop iteration of the others is, so per-step
bookkeeping counts as overhead.  Median over all counted steps of a mode
(``--rounds`` blocks per mode), of the wall time and of the CPU time all
ranks spent on the step:

  bare            no instrumentation
  always-on       the collectors' session without a trace window: step timer,
                  communication timer (every collective wrapped), NVML sampler
  window          the session with a Kineto window over the block
  torch.profiler  bare ``torch.profiler`` (CPU activities, shapes) over the
                  block, exporting a gzip trace: what the window costs
                  without mfuscope

Eight ranks sharing two cores make step times noisy (several % between
blocks), so the always-on cost is also measured directly: the time the
communication timer adds to one collective call (1-rank gloo group, 20k calls,
wrapped against unwrapped), times the collective calls per step the run
recorded, over the bare step time.

Targets: always-on <= 2% over bare; window close to bare torch.profiler.
Memory: the largest rank's peak resident set over the run (MiB).

    python benchmarks/bench_overhead.py [--rounds 5] [--block 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("bare", "always-on", "window", "torch.profiler")


class _BareTorchProfiler:
    """torch.profiler around a block, exporting a gzip trace, the way a user would write it."""

    def __init__(self, path: Path):
        from torch.profiler import ProfilerActivity, profile

        self.path = path
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def start(self):
        self.prof.__enter__()

    def close(self):
        self.prof.__exit__(None, None, None)
        self.prof.export_chrome_trace(str(self.path))

    def step(self, tokens=None, loss=None):
        self.prof.step()


class _Bare:
    def start(self):
        pass

    def close(self):
        pass

    def step(self, tokens=None, loss=None):
        pass


class _ModeCycle:
    """The trainer's instrumentation: a different mode every ``block`` steps."""

    def __init__(self, rank: int, scratch: Path, block: int):
        self.rank, self.scratch, self.block = rank, scratch, block
        self.steps = 0
        self.modes: list[str] = []  # mode of each step
        self.cpu: list[float] = [time.process_time()]  # this rank's CPU seconds (all threads) at step ends
        self.current = None

    def _open(self):
        from mfuscope.collectors.session import ProfileSession

        block = self.steps // self.block
        mode = MODES[block % len(MODES)]
        out = self.scratch / f"{block:03d}-{mode}"
        if mode == "bare":
            self.current = _Bare()
        elif mode == "torch.profiler":
            out.mkdir(parents=True, exist_ok=True)
            self.current = _BareTorchProfiler(out / f"rank{self.rank}.pt.trace.json.gz")
        else:
            self.current = ProfileSession(out, window="0:" if mode == "window" else None, handle_signals=False)
        self.current.start()
        self.mode = mode

    def __enter__(self):
        self._open()
        return self

    def __exit__(self, *exc):
        self.current.close()

    def step(self, tokens=None, loss=None):
        self.current.step(tokens=tokens, loss=loss)
        self.cpu.append(time.process_time())
        self.modes.append(self.mode)
        self.steps += 1
        if self.steps % self.block == 0:
            self.current.close()
            self._open()


def _run(rounds: int, block: int, scratch: str) -> dict:
    import resource

    from mfuscope.reference_trainer.train import run_rank
    from mfuscope.trainer_options import TrainerOptions

    cycles = []

    def instrument(rank):
        cycles.append(_ModeCycle(rank, Path(scratch), block))
        return cycles[-1]

    steps = rounds * len(MODES) * block
    loop = run_rank(TrainerOptions(config="tiny_dense", layout="pp=2,dp_shard=2,tp=2", steps=steps),
                    instrument)["loop_times"]
    cycle = cycles[0]
    cpu = [b - a for a, b in zip(cycle.cpu, cycle.cpu[1:])]
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    cpu_per_mode: dict[str, list[tuple[int, float]]] = {m: [] for m in MODES}
    for i, (mode, seconds) in enumerate(zip(cycle.modes, loop)):
        if 0 < i % block < block - 1 and i >= block:  # the very first block also warms the run up
            per_mode[mode].append(seconds)
            cpu_per_mode[mode].append((i, cpu[i]))
    return {"step_s": per_mode, "cpu_s": cpu_per_mode,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _per_call_cost(calls: int = 20000) -> float:
    """Seconds the communication timer adds to one small all_reduce (median of 5 runs)."""
    import time

    import torch
    import torch.distributed as dist

    from mfuscope.collectors.comm_timer import CommTimer
    from mfuscope.collectors.group_dims import GroupDims

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(1)

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        return (time.perf_counter() - t0) / calls

    added = []
    for _ in range(5):
        bare = run()
        timer = CommTimer(GroupDims(), lambda: 0)
        timer.install()
        try:
            timed = run()
        finally:
            timer.uninstall()
        added.append(timed - bare)
    dist.destroy_process_group()
    return statistics.median(added)


def _calls_per_step(scratch: Path) -> float:
    from mfuscope import run_dir

    counts = []
    for block in sorted(scratch.glob("*-always-on")):
        comm = run_dir.read_table(block, run_dir.COMM).to_pandas().query("rank == 0")
        steps = run_dir.read_table(block, run_dir.STEPS).to_pandas().query("rank == 0")
        counts.append(len(comm) / len(steps))
    return statistics.median(counts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="blocks per mode")
    p.add_argument("--block", type=int, default=5, help="steps per block (the first and last are not counted)")
    a = p.parse_args(argv)
    if a.block < 3:
        p.error("--block must be at least 3")
    from mfuscope.reference_trainer.launch import fork_ranks

    with tempfile.TemporaryDirectory(prefix="mfuscope-bench-") as scratch:
        print(f"8 ranks, tiny_dense, pp=2 x dp_shard=2 x tp=2, {a.rounds} blocks of {a.block} steps per mode "
              f"(cpu count {os.cpu_count()})", flush=True)
        per_rank = fork_ranks(_run, 8, a.rounds + 1, a.block, scratch, timeout=3600)
        calls = _calls_per_step(Path(scratch))
    per_call = _per_call_cost()
    steps = per_rank[0]["step_s"]
    median = {m: statistics.median(v) for m, v in steps.items()}
    # CPU seconds of one step summed over the 8 ranks: what instrumentation adds, with far less
    # scheduling noise than wall time on an oversubscribed machine.
    cpu = {m: statistics.median(sum(pr["cpu_s"][m][k][1] for pr in per_rank) for k in range(len(steps[m])))
           for m in MODES}
    print(f"\n{'mode':<16}{'step (ms)':>11}{'steps/s':>9}{'vs bare':>9}{'CPU s/step':>12}{'vs bare':>9}"
          f"{'counted steps':>15}")
    for m in MODES:
        print(f"{m:<16}{median[m] * 1e3:>11.1f}{1 / median[m]:>9.3f}{median[m] / median['bare'] - 1:>+9.1%}"
              f"{cpu[m]:>12.3f}{cpu[m] / cpu['bare'] - 1:>+9.1%}{len(steps[m]):>15}")
    print(f"\npeak RSS of the largest rank: {max(r['peak_rss_mib'] for r in per_rank):.0f} MiB")
    print(f"always-on overhead, end to end: {median['always-on'] / median['bare'] - 1:+.1%} wall, "
          f"{cpu['always-on'] / cpu['bare'] - 1:+.1%} CPU (target <= +2%)")
    print(f"always-on overhead, per call: {per_call * 1e6:.1f} us x {calls:.0f} collectives/step = "
          f"{per_call * calls * 1e3:.2f} ms/step = {per_call * calls / median['bare']:+.2%} of a bare step")
    print(f"window vs bare torch.profiler: {median['window'] / median['torch.profiler']:.3f}x step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
