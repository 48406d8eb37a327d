"""Starting ranks: ``torchrun`` for real runs, a fork launcher for tests.

The fork launcher imports torch once in the parent and forks the ranks, which
keeps multi-rank tests fast on a small machine (no per-rank interpreter start
and torch import).  Each child gets the env:// variables torchrun would set.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world: int, port: int, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        import torch
        torch.set_num_threads(1)
        queue.put((rank, fn(*args), None))
    except BaseException:  # report, do not hang the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def fork_ranks(fn: Callable, world: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Run ``fn(*args)`` in ``world`` forked ranks; return each rank's result, rank order."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value, error = queue.get(timeout=timeout)
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def torchrun_command(nproc: int, train_args: list[str], nnodes: int = 1, rdzv_endpoint: str | None = None) -> list[str]:
    """The torchrun command line for the trainer (standalone on one machine unless told otherwise)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    return cmd + ["-m", "mfuscope.reference_trainer.train", *train_args]
