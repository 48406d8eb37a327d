"""Expert parallelism, written here: experts sharded over an ``ep`` group, tokens moved by all-to-all.

Each rank keeps ``n_experts / ep`` experts.  Routed rows, grouped by
expert (``MoE.permute``), are sent to the rank that owns the expert (``all_to_all_single``,
autograd-aware, so the backward pass sends gradients the same way back), run
there, and sent home.  The ranks first swap their rows-per-expert counts: one
copy of them to the host per layer gives both the all-to-all split sizes and
the experts' slice sizes.  Expert groups are consecutive blocks of ``ep``
ranks along the flattened ``dp_shard x cp`` dimension; ranks in different
blocks with the same position hold the same experts: the "expert
data-parallel" group.  FSDP shards each rank's experts over that group
(:func:`expert_mesh`, :func:`data_parallel.apply_fsdp`), as it shards the rest
of the model over all the data ranks, so a rank stores, and keeps optimizer
state for, ``1/|group|`` of its experts; it gathers them for the forward and
reduce-scatters their gradients.  Where the group is this rank alone (``ep``
spans every data rank), there is nothing to shard: the experts stay whole,
outside FSDP, and :func:`scale_local_expert_grads` averages their gradients.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from mfuscope.layout import MESH_DIMS

from .model import expert_counts
from .parallel_dims import ParallelDims


def expert_groups(dims: ParallelDims, rank: int):
    """(ep group, ep rank, expert data-parallel group) for ``rank``; every rank must call this."""
    ep_group = edp_group = None
    mine = dims.coords(rank)
    f_of = lambda c: c["dp_shard"] * dims.cp + c["cp"]  # noqa: E731
    for r0 in range(dims.world_size):
        c0 = dims.coords(r0)
        # One set of groups per (pp, tp) coordinate; iterate deterministically on every rank.
        if f_of(c0) != 0 or c0["dp_replicate"] != 0:
            continue
        same = [r for r in range(dims.world_size)
                if all(dims.coords(r)[d] == c0[d] for d in MESH_DIMS if d not in ("dp_replicate", "dp_shard", "cp"))]
        for block in range(dims.dp_replicate * dims.dp_shard * dims.cp // dims.ep):
            members = [r for r in same if (dims.coords(r)["dp_replicate"] * dims.dp_shard * dims.cp
                                           + f_of(dims.coords(r))) // dims.ep == block]
            g = dist.new_group(members)
            if rank in members:
                ep_group = g
        for slot in range(dims.ep):
            members = [r for r in same if f_of(dims.coords(r)) % dims.ep == slot]
            g = dist.new_group(members)
            if rank in members:
                edp_group = g
    return ep_group, f_of(mine) % dims.ep, edp_group


def apply_ep(model: nn.Module, ep_group, ep: int, ep_rank: int) -> None:
    """Keep this rank's experts (on the meta device too: the trainer materializes afterwards, which
    makes new parameter objects -- take them with :func:`expert_parameters` then)."""
    for block in model.layers.values():
        moe = block.feed_forward
        if moe.n_experts % ep:
            raise ValueError(f"{moe.n_experts} experts do not split over ep={ep}")
        local = moe.n_experts // ep
        lo = ep_rank * local
        for name in ("w1", "w2", "w3"):
            setattr(moe.experts, name, nn.Parameter(getattr(moe.experts, name).detach()[lo:lo + local].clone()))
        moe.experts.offset = lo
        moe.dispatch = functools.partial(ep_dispatch, group=ep_group, ep=ep, local=local)


def expert_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The routed experts' weights this rank holds."""
    from .model import Experts

    return [p for m in modules for mod in m.modules() if isinstance(mod, Experts) for p in mod.parameters()]


class _AllToAll(torch.autograd.Function):
    """Rows out by ``send`` split sizes, in by ``recv``; backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def ep_dispatch(moe, rows: torch.Tensor, expert: torch.Tensor, *, group, ep: int, local: int) -> torch.Tensor:
    """``rows`` grouped by ``expert`` (the MoE permuted them) out to their experts' ranks and back,
    in the same order."""
    # Rows per expert, expert-major, so chunk r of ``send`` is what goes to rank r; ``recv`` holds
    # (source rank x local expert) counts, the layout of the rows that arrive.
    send = expert_counts(expert, ep * local)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_counts, recv_counts = torch.stack([send, recv]).view(2, ep, local).tolist()  # the one host copy
    send_split, recv_split = [sum(c) for c in send_counts], [sum(c) for c in recv_counts]
    received = _AllToAll.apply(rows, send_split, recv_split, group)
    recv_expert = torch.arange(local, device=expert.device).repeat(ep).repeat_interleave(
        recv, output_size=sum(recv_split))  # output_size: no host read of the repeats
    out = moe.experts(received, recv_expert, counts=[sum(c) for c in zip(*recv_counts)])
    return _AllToAll.apply(out, recv_split, send_split, group)


def expert_mesh(edp_group, device_type: str):
    """The expert data-parallel group as the 1-D DeviceMesh FSDP shards the experts over; None
    where the group is this rank alone.

    Not FSDP over one rank: it would only copy the experts in and out, and how FSDP applies a
    gradient divide factor on a one-rank mesh has changed between torch releases (2.13 divides
    twice when sums are forced)."""
    from torch.distributed.device_mesh import DeviceMesh

    if dist.get_world_size(edp_group) == 1:
        return None
    return DeviceMesh.from_group(edp_group, device_type)


def scale_local_expert_grads(expert_params: list[nn.Parameter], dp: int) -> None:
    """Experts no other rank holds (no FSDP over them): the loss is a mean over the ``dp`` data
    ranks' tokens, and this rank's gradient is the sum over the tokens routed to it."""
    for p in expert_params:
        if p.grad is not None:
            p.grad.div_(dp)
