"""Context parallelism for causal attention, written here (PyTorch's has no causal CPU path).

The sequence is cut into ``2 x cp`` chunks and rank ``c`` holds chunks ``c``
and ``2cp-1-c``: an early and a late chunk, so every rank has the same amount
of causal attention work.  Queries stay local; keys and values are
all-gathered over the cp group (autograd-aware, so gradients flow back to
their owners), and the causal mask is built from global token positions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F



def chunk_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens ``cp_rank`` holds."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} must be divisible by 2*cp = {2 * cp}")
    size = seq_len // (2 * cp)
    first = torch.arange(cp_rank * size, (cp_rank + 1) * size)
    last_chunk = 2 * cp - 1 - cp_rank
    second = torch.arange(last_chunk * size, (last_chunk + 1) * size)
    return torch.cat([first, second])


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim; backward is a reduce-scatter done with all-to-all.

    (gloo has no reduce-scatter, and ``torch.distributed.nn.functional.all_gather``'s
    gloo backward returns wrong gradients -- checked in tests/test_context_parallel.py.)
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


def make_attention(group, cp: int, seq_len: int, cp_rank: int):
    """An ``attention_fn`` for :class:`Attention` that attends over the whole sequence."""
    q_pos = chunk_indices(seq_len, cp, cp_rank)
    k_pos = torch.cat([chunk_indices(seq_len, cp, r) for r in range(cp)])
    mask = k_pos[None, :] <= q_pos[:, None]  # (local seq, global seq)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ks = _AllGather.apply(k, group)  # (cp, batch, heads, local seq, head_dim)
        vs = _AllGather.apply(v, group)
        k_all, v_all = torch.cat(ks.unbind(0), dim=2), torch.cat(vs.unbind(0), dim=2)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask.to(q.device))

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
