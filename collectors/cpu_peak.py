"""A CPU's peak, measured: what MFU is taken against when there is no GPU.

The hardware table has accelerators only; a CPU run's "device" is one rank's
share of the host, so rank 0 times a large fp32 matmul with the threads a rank
uses and records the best of a few tries, labelled as measured.
"""
from __future__ import annotations

import time

import torch


def measured_matmul_peak(n: int = 512, tries: int = 5) -> tuple[float, str]:
    """(FLOP/s, label) of the best of ``tries`` n x n x n fp32 matmuls."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    threads = torch.get_num_threads()
    return 2.0 * n ** 3 / best, f"measured matmul peak (CPU, fp32, {threads} thread{'s' * (threads > 1)})"
