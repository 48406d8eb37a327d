"""Tensor parallelism with sequence parallelism, through DTensor ``parallelize_module``.

Megatron-style: attention q/k/v and the MLP's w1/w3 are column-parallel, wo
and w2 row-parallel; norms run sequence-parallel (activations sharded on the
sequence between blocks); the LM head is column-parallel and the loss is
computed on vocab-sharded logits (``loss_parallel``), so the full logits are
never gathered.
"""
from __future__ import annotations

from torch import nn

from .parallel_dims import ParallelDims


def apply_tp(model: nn.Module, dims: ParallelDims) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    mesh = dims.mesh["tp"]
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if model.cfg.n_experts:
            _replicate_moe(block.feed_forward, mesh)
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        parallelize_module(block, mesh, plan)
    return model


def _replicate_moe(moe: nn.Module, mesh) -> None:
    """Experts run replicated over tp (expert parallelism shards them instead): gather the
    sequence-sharded input to a plain tensor, and give back this rank's sequence shard of the
    output, as the row-parallel layers of the dense MLP do."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather(module, args):
        return (args[0].full_tensor(),)

    def shard(module, args, out):
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

    moe.register_forward_pre_hook(gather)
    moe.register_forward_hook(shard)
