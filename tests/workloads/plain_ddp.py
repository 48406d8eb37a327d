"""An ordinary torchrun training script that knows nothing of its profiler (for the no-code wrap tests).

DDP over gloo, a small MLP, AdamW; prints one line per step with its pid so
tests can find a rank to signal.

    torchrun --nproc-per-node 2 plain_ddp.py --steps 6 [--sleep-ms 50] [--hidden 64] [--late-rank 1 --late-ms 50]

``--late-rank R --late-ms M``: rank R sleeps M ms before every other step's forward (a late
peer: the others wait for it in the gradient all-reduce).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--late-rank", type=int, default=-1)
    p.add_argument("--late-ms", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(a.hidden, 4 * a.hidden), torch.nn.GELU(), torch.nn.Linear(4 * a.hidden, a.hidden)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        if rank == a.late_rank and step % 2 == 1:
            time.sleep(a.late_ms / 1e3)
        x = torch.randn(a.batch, a.hidden, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(a.sleep_ms / 1e3)
        print(f"rank {rank} pid {os.getpid()} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
