"""Data parallelism: FSDP2 (``fully_shard``), HSDP (replicate x shard) or DDP.

Gradients are averaged over every rank that saw different tokens -- the data
ranks and the context-parallel ranks -- so the flattened ``dp_shard_cp`` mesh
dimension is what FSDP shards over.  Expert weights under expert parallelism
differ between the ranks of one expert group, so they are sharded over the
ranks that hold the same experts instead (:mod:`expert_parallel`): a unit of
their own inside each block, on that mesh.
"""
from __future__ import annotations

import torch
from torch import nn

from .model import Experts
from .parallel_dims import ParallelDims


def apply_fsdp(model: nn.Module, dims: ParallelDims, *, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None, ignored_params: set | None = None,
               expert_mesh=None, prefetch: bool = False, keep_last_gathered: bool = False) -> nn.Module:
    """Shard ``model`` over the data ranks, except ``ignored_params``; with ``expert_mesh``, each
    MoE's experts (already cut to this rank's slice) over that mesh first.

    ``prefetch``: each block, once its own weights are gathered, starts gathering the next
    block's (forward) or the previous block's (backward), and every gather is issued as an async
    op and waited for only when its block runs -- so the gather overlaps the block before it
    (torchtitan's and FSDP2's explicit prefetching).  Without it, FSDP2's own order: each block's
    gather starts when the block does (on a GPU a separate stream still overlaps it; on a CPU,
    where gloo's calls block, nothing does).

    ``keep_last_gathered``: the last block keeps its weights gathered after forward (torchtitan's
    default): its backward comes right after, so resharding it would only gather it again."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = dims.mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else dims.mesh["dp_shard_cp"]
    mp = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype
          else MixedPrecisionPolicy())
    if expert_mesh is not None:
        for experts in (m for m in model.modules() if isinstance(m, Experts)):
            fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
            # FSDP would average over its mesh; an expert's gradient is the sum over the ranks
            # holding it, averaged over every data rank (the loss is a mean over all their tokens).
            # Sums in the collective, division after: gloo has no premultiplied sum.
            experts.set_gradient_divide_factor(dims.grad_ranks)
            experts.set_force_sum_reduction_for_comms(True)
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        last = keep_last_gathered and i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    if prefetch:
        _prefetch(model, blocks)
    return model


def _prefetch(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Explicit prefetching: the root gathers block 0 early, each block the next one in forward
    and the previous one in backward; gathers async, waited for when their block runs."""
    chain = [model, *blocks]
    for here, ahead in zip(chain, chain[1:]):
        here.set_modules_to_forward_prefetch([ahead])
    for here, behind in zip(blocks[1:], blocks):
        here.set_modules_to_backward_prefetch([behind])
    for m in chain:
        m._set_unshard_async_op(True)


def apply_ddp(model: nn.Module, dims: ParallelDims, *, bucket_mb: float | None = None,
              as_bucket_view: bool = False) -> nn.Module:
    """Pure data (+context) parallelism (checks.py refuses DDP with tp, pp or ep).

    ``bucket_mb``: DDP's gradient bucket (default 25 MiB).  Buckets are all-reduced as soon as
    their gradients are ready, so smaller ones start during the backward and overlap it; one
    bucket holding every gradient waits for the end.  ``as_bucket_view``: gradients live in the
    buckets (no copy in and out)."""
    from torch.nn.parallel import DistributedDataParallel

    # Profiled runs see DDP's all-reduces through the collectors' comm hook (collectors/comm_timer.py).
    return DistributedDataParallel(model, process_group=dims.mesh["dp_cp"].get_group(), bucket_cap_mb=bucket_mb,
                                   gradient_as_bucket_view=as_bucket_view)
