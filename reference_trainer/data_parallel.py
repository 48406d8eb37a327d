"""Data parallelism: FSDP2 (``fully_shard``), HSDP (replicate x shard) or DDP.

Gradients are averaged over every rank that saw different tokens -- the data
ranks and the context-parallel ranks -- so the flattened ``dp_shard_cp`` mesh
dimension is what FSDP shards over.  Expert weights under expert parallelism
are not ours to average here: :mod:`expert_parallel` reduces them over the
ranks that hold the same experts.
"""
from __future__ import annotations

import torch
from torch import nn

from .parallel_dims import ParallelDims


def apply_fsdp(model: nn.Module, dims: ParallelDims, *, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None, ignored_params: set | None = None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = dims.mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else dims.mesh["dp_shard_cp"]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def apply_ddp(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Pure data (+context) parallelism (checks.py refuses DDP with tp, pp or ep)."""
    from torch.nn.parallel import DistributedDataParallel

    # Profiled runs see DDP's all-reduces through the collectors' comm hook (collectors/comm_timer.py).
    return DistributedDataParallel(model, process_group=dims.mesh["dp_cp"].get_group())
