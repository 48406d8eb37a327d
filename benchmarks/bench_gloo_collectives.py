"""Gloo's collectives on two ranks of this machine, idle and barrier-aligned: what a call costs
when neither rank waits for the other.

The cost model's link fit on the real-compute runs (docs/cost_model.md, "Proof on real compute")
takes its numbers from calls timed inside training, where a call's time includes waiting for the
other rank to arrive.  This is the same calls without that wait: each size and op, 5 warm-up calls
then 40 timed ones, each started right after a barrier; the median per call, in milliseconds, as
rank 0 saw it.  An all-gather and an all-to-all of the same output size move the same bytes on two
ranks (each rank sends half), so their ratio says whether gloo's all-to-all itself is slower.

    python benchmarks/bench_gloo_collectives.py [--sizes 262144,786432,1572864] [--calls 40]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _calls(n: int) -> dict:
    """Each op on buffers of ``n`` float32 elements of output."""
    full, out, half, gathered = torch.randn(n), torch.empty(n), torch.randn(n // 2), torch.empty(n)
    return {
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, half),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
        "all_to_all (splits)": lambda: dist.all_to_all_single(out, full, [n // 2] * 2, [n // 2] * 2),
        "all_reduce": lambda: dist.all_reduce(full),
    }


def _rank(rank: int, port: int, sizes: list[int], calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)  # one core a rank, as the real-compute runs
    rows = []
    for nbytes in sizes:
        for name, call in _calls(nbytes // 4).items():
            for _ in range(5):
                call()
            times = []
            for _ in range(calls):
                dist.barrier()
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            rows.append((nbytes, name, statistics.median(times) * 1e3))
    if rank == 0:
        print(f"{'bytes':>9}  {'op':<20} {'median ms':>9}")
        for nbytes, name, ms in rows:
            print(f"{nbytes:>9}  {name:<20} {ms:9.3f}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="262144,786432,1572864", help="output bytes per call, comma-separated")
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    mp.spawn(_rank, args=(_free_port(), sizes, args.calls), nprocs=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
