"""Gradient reductions outside FSDP/DDP, bucketed: one all-reduce per dtype instead of one per tensor.

MoE gradients under tensor parallelism are summed over tp by the trainer
after backward.  A collective per tensor pays its launch and latency once per
tensor -- four per layer for the router and experts alone -- so the tensors are
flattened into one buffer, reduced once and copied back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place.  Every rank of the group must pass tensors of the
    same shapes, in the same order."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))
