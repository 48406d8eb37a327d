"""Tensor parallelism with sequence parallelism, through DTensor ``parallelize_module``.

Megatron-style: attention q/k/v and the MLP's w1/w3 are column-parallel, wo
and w2 row-parallel; norms run sequence-parallel (activations sharded on the
sequence between blocks); the LM head is column-parallel and the loss is
computed on vocab-sharded logits (``loss_parallel``), so the full logits are
never gathered.

With ``sequence_parallel=False`` (Megatron without ``--sequence-parallel``)
the activations between blocks are replicated over tp: each row-parallel
output is all-reduced (forward) and each column-parallel input's gradient too
(backward), in place of the all-gather / reduce-scatter pairs, and every tp
rank repeats the norms.  Same bus traffic, half the calls, tp times the
norm work and activation memory.

MoE layers are not split over tp (expert parallelism shards experts): each tp
rank runs the router and experts on its own sequence shard -- the tokens
sequence parallelism already gives it -- so no tp rank repeats another's
expert work or all-to-all.  The MoE weights are then replicated over tp and
see different tokens on each rank: :func:`reduce_moe_grads` sums their
gradients over tp (one bucketed all-reduce), and each rank's balance loss
counts 1/tp.
"""
from __future__ import annotations

from torch import nn

from .buckets import all_reduce_flat
from .parallel_dims import ParallelDims


def apply_tp(model: nn.Module, dims: ParallelDims, sequence_parallel: bool = True) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = dims.mesh["tp"]
    if not sequence_parallel:
        return _apply_tp_replicated(model, mesh)
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, top)
    if model.cfg.n_experts:
        model.aux_scale = 1.0 / dims.tp  # see the module docstring
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
            _moe_on_sequence_shard(block.feed_forward)
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        parallelize_module(block, mesh, plan)
    return model


def _apply_tp_replicated(model: nn.Module, mesh) -> nn.Module:
    """Tensor parallelism without sequence parallelism: activations replicated between blocks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})
    return model


def _moe_on_sequence_shard(moe: nn.Module) -> None:
    """The MoE takes this rank's sequence shard of the norm's output (a plain tensor) and returns
    its output for those tokens, which is what the residual stream holds under sequence parallel."""
    moe.register_forward_pre_hook(lambda module, args: (args[0].to_local(),))


def moe_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """Router and expert weights: replicated over tp, trained on different tokens per tp rank."""
    return [p for m in modules for block in m.layers.values() if hasattr(block.feed_forward, "router")
            for p in block.feed_forward.parameters()]


def reduce_moe_grads(params: list[nn.Parameter], tp_group) -> None:
    """Sum MoE gradients over tp (after data-parallel reduction: every tp rank holds the same shard)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    all_reduce_flat(grads, tp_group)


def replicate_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum, in one all-reduce, the gradients tensor parallelism leaves as partial sums: a
    sequence-parallel norm's weight is replicated over tp, and each rank's gradient covers only its
    sequence shard (DTensor ``Partial``).  Left partial, each optimizer operator that reads such a
    gradient all-reduced it again: AdamW's three reads made 27 all-reduces a step for tiny_dense's 9
    norm weights on tp=2 (measured in its trace), and their DTensor redistribution sat in the
    optimizer's time.  Megatron-LM likewise all-reduces its sequence-parallel norms' gradients over
    tp once, coalesced, before the optimizer.  Only gradients on a 1-D mesh (tp alone): with FSDP
    the data-parallel reduction owns them."""
    from torch.distributed.tensor import DTensor, Replicate

    by_mesh: dict[int, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and g.device_mesh.ndim == 1 and g.placements[0].is_partial("sum"):
            by_mesh.setdefault(id(g.device_mesh), []).append(p)
    for partial in by_mesh.values():
        mesh = partial[0].grad.device_mesh
        locals_ = [p.grad.to_local() for p in partial]
        all_reduce_flat(locals_, mesh.get_group())
        for p, local in zip(partial, locals_):
            p.grad = DTensor.from_local(local, mesh, [Replicate()], run_check=False)


def enable_async_tp(tp_group, device) -> None:
    """Micro-pipelined (async) TP, as torchtitan's ``enable_async_tensor_parallel``: inductor
    rewrites each sequence-parallel all-gather + GEMM (and GEMM + reduce-scatter) into per-rank
    chunks that overlap, over symmetric memory on the tp group.  Needs CUDA and torch.compile
    (checks.py refuses it otherwise)."""
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    if device.type != "cuda":
        raise RuntimeError("async TP needs CUDA tensors (symmetric memory)")
    inductor._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_group.group_name)
