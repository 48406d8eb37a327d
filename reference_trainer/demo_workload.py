"""A plain multi-rank training script, with no mfuscope in it: DDP over gloo on CPU, under torch.profiler.

The reference trainer is what mfuscope profiles and optimizes; this is the
other kind of workload users bring -- an ordinary PyTorch loop.  Each rank
trains a small MLP with DistributedDataParallel for a few steps and writes
``<out>/traces/rank<N>.pt.trace.json.gz``; tests use those genuine gloo
traces.

    python -m mfuscope.reference_trainer.demo_workload --out /tmp/demo --ranks 4
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str, steps: int, hidden: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, schedule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                    torch.nn.Linear(4 * hidden, hidden)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)
    trace_dir = Path(out) / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)

    def on_ready(prof):
        prof.export_chrome_trace(str(trace_dir / f"rank{rank}.pt.trace.json.gz"))

    active = max(1, steps - 2)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=1, warmup=1, active=active), on_trace_ready=on_ready) as prof:
        for _ in range(steps):
            x = torch.randn(32, hidden, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


def run(out: str | os.PathLike, ranks: int = 4, steps: int = 5, hidden: int = 256) -> Path:
    import torch.multiprocessing as mp

    port = _free_port()
    mp.start_processes(_rank_main, args=(ranks, port, str(out), steps, hidden), nprocs=ranks,
                       start_method="spawn", join=True)
    return Path(out) / "traces"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory (traces/ is created inside)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args(argv)
    traces = run(a.out, a.ranks, a.steps, a.hidden)
    print(f"traces written to {traces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
