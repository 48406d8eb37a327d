"""Context parallelism for causal attention, written here (PyTorch's has no causal CPU path).

The sequence is cut into ``2 x cp`` chunks and rank ``c`` holds chunks ``c``
and ``2cp-1-c``: an early and a late chunk, so every rank has the same amount
of causal attention work.  Queries stay local; keys and values are
all-gathered over the cp group with the model's KV heads (before any GQA
repeat, so the gather moves ``n_kv_heads``, not ``n_heads``), autograd-aware so
gradients flow back to their owners.

Each local query chunk ``g`` then attends only to the keys it can see: global
chunks ``0..g``, causal within chunk ``g`` (a lower-right causal bias).  That
keeps the causal saving -- rank ``c`` computes ``(c+1) + (2cp-c) = 2cp+1``
chunk pairs, the same on every rank -- and lets the ``is_causal`` / flash
kernels run on GPU, where an explicit boolean mask would rule them out.
Checked against one process in ``tests/test_reference_trainer.py`` (the
``cp2`` layouts, and a mutant that drops a gathered chunk).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfuscope.layout import MESH_DIMS


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk numbers ``cp_rank`` holds (of ``2 x cp``)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens ``cp_rank`` holds."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} must be divisible by 2*cp = {2 * cp}")
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunk_ids(cp, cp_rank)])


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim; backward is a reduce-scatter done with all-to-all.

    (gloo has no reduce-scatter, and ``torch.distributed.nn.functional.all_gather``'s
    gloo backward returns wrong gradients.)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world, *x.shape))
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        return received.sum(0), None


def _global_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """(cp, batch, heads, 2*size, dim) gathered per rank -> (batch, heads, seq, dim) in sequence order."""
    halves = gathered.chunk(2, dim=3)   # first and second local chunk of every rank
    by_chunk = {}
    for r in range(cp):
        first, second = chunk_ids(cp, r)
        by_chunk[first], by_chunk[second] = halves[0][r], halves[1][r]
    return torch.cat([by_chunk[c] for c in range(2 * cp)], dim=2)


def kv_group(mesh, dims):
    """The process group the K/V exchange runs on: the mesh's cp group, or one of its own over the
    same ranks where every other data-parallel degree is 1.  There the mesh's cp group is also the
    flattened ``dp_shard_cp`` and ``dp_cp`` (one group, one name), so FSDP's gathers and the K/V
    gathers would carry one label and context parallelism's traffic would show as data
    parallelism's.  Megatron-Core likewise keeps its cp and dp-cp communicators apart.  Every rank
    creates every such group (``new_group`` is collective over the world) and keeps its own."""
    if dims.dp_shard * dims.dp_replicate > 1:
        return mesh["cp"].get_group()
    rank, mine = dist.get_rank(), None
    for ranks in mesh.mesh.movedim(MESH_DIMS.index("cp"), -1).reshape(-1, dims.cp).tolist():
        group = dist.new_group(ranks, group_desc="mesh_cp")
        if rank in ranks:
            mine = group
    return mine


def make_attention(group, cp: int, seq_len: int, cp_rank: int):
    """An ``attention_fn`` for :class:`Attention` that attends over the whole sequence."""
    # Imported here, not at the top: torch.nn.attention.bias imports TorchDynamo (1.7 s a process),
    # which only context-parallel runs need.
    from torch.nn.attention.bias import causal_lower_right

    size = seq_len // (2 * cp)
    mine = chunk_ids(cp, cp_rank)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all = _global_order(_AllGather.apply(k, group), cp)
        v_all = _global_order(_AllGather.apply(v, group), cp)
        out = []
        for i, chunk in enumerate(mine):
            q_i = q[:, :, i * size:(i + 1) * size]
            visible = (chunk + 1) * size  # keys of chunks 0..chunk
            k_i, v_i = k_all[:, :, :visible], v_all[:, :, :visible]
            if chunk == 0:
                o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=causal_lower_right(size, visible),
                                                   enable_gqa=True)
            out.append(o)
        return torch.cat(out, dim=2)

    return attention


def apply_cp(model, group, cp: int, cp_rank: int, seq_len: int):
    model.positions = chunk_indices(seq_len, cp, cp_rank).to(model.positions.device)
    attention = make_attention(group, cp, seq_len, cp_rank)
    for block in model.layers.values():
        block.attention.attention_fn = attention
    return model


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """The columns of ``x`` (batch, seq) this cp rank holds."""
    return x[:, chunk_indices(x.shape[1], cp, cp_rank)]
