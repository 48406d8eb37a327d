"""MoE token permute and unpermute, fused: each token's rows go straight to their experts' slots and back.

A top-k router sends each of T tokens to k experts.  The experts (and an
expert-parallel all-to-all) want the T x k routed rows grouped by expert.  The
routing map is ``positions`` (T, k): the row of choice (t, j) in that
expert-sorted order (:func:`moe_positions`; a stable sort, so rows of one
expert keep their token order).

=============  ======================================  =============================================
op             fused (per token, one program)          eager (the reference trainer's)
=============  ======================================  =============================================
permute        read the token once, write it to its    ``repeat_interleave`` writes T k d, a copy by
               k slots: T d read, T k d written       ``index_copy`` reads and writes them again
unpermute      gather the k expert outputs, weight     gather T k d into token order, multiply by
               and sum in float32: T k d read,         the weights (T k d written and read), sum
               T d written
=============  ======================================  =============================================

Backward: permute's gradient gathers and sums a token's k row gradients --
the unpermute kernel with unit weights; unpermute's scatters ``w x dy`` to
each slot (every slot written once: no atomics) and takes each weight's
gradient as the dot product of ``dy`` with its slot's output.  Float32 inside
the kernels, whatever the rows' dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import HAVE_TRITON, launch, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _permute_kernel(x_ptr, pos_ptr, rows_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
        # Token t, read once, written to each of its K slots.
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(x_ptr + t.to(tl.int64) * D + cols, mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(pos_ptr + t * K + j).to(tl.int64)
            tl.store(rows_ptr + slot * D + cols, x.to(rows_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _unpermute_kernel(rows_ptr, pos_ptr, w_ptr, y_ptr, D: tl.constexpr, K: tl.constexpr,
                          BLOCK: tl.constexpr):
        # Token t: the sum over its K slots of weight x the slot's row, in float32.
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(pos_ptr + t * K + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += w * tl.load(rows_ptr + slot * D + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + t.to(tl.int64) * D + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _unpermute_backward_kernel(dy_ptr, rows_ptr, pos_ptr, w_ptr, drows_ptr, dw_ptr, D: tl.constexpr,
                                   K: tl.constexpr, BLOCK: tl.constexpr):
        # Token t: each slot's gradient w x dy (every slot is one token's: written once), and each
        # weight's, dy . row.
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        dy = tl.load(dy_ptr + t.to(tl.int64) * D + cols, mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(pos_ptr + t * K + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            tl.store(drows_ptr + slot * D + cols, (w * dy).to(drows_ptr.dtype.element_ty), mask=ok)
            row = tl.load(rows_ptr + slot * D + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dw_ptr + t * K + j, tl.sum(dy * row, axis=0).to(dw_ptr.dtype.element_ty))


def moe_positions(expert: Tensor) -> Tensor:
    """The routing map: for ``expert`` (T, k) of expert indices, the row (T, k) each choice takes in
    the expert-sorted order (stable: one expert's rows keep their token order)."""
    order = torch.argsort(expert.reshape(-1), stable=True)
    slots = torch.arange(order.numel(), device=expert.device)
    return torch.empty_like(order).scatter_(0, order, slots).view(expert.shape)


def moe_permute_reference(tokens: Tensor, positions: Tensor) -> Tensor:
    """Each token copied to its k slots: ``rows[positions[t, j]] = tokens[t]``."""
    k = positions.shape[1]
    rows = tokens.new_empty((positions.numel(), tokens.shape[-1]))
    return rows.index_copy(0, positions.reshape(-1), tokens.repeat_interleave(k, dim=0))


def moe_unpermute_reference(rows: Tensor, positions: Tensor, weight: Tensor) -> Tensor:
    """``y[t] = sum_j weight[t, j] * rows[positions[t, j]]``."""
    t, k = positions.shape
    picked = rows.index_select(0, positions.reshape(-1)).view(t, k, rows.shape[-1])
    return (picked * weight.unsqueeze(-1)).sum(1)


def _program(d: int) -> dict:
    return dict(values=triton.next_power_of_2(d), BLOCK=triton.next_power_of_2(d), D=d)


def permute(tokens: Tensor, positions: Tensor) -> Tensor:
    """The rows in expert order: the kernel, or the same in PyTorch."""
    t, k = positions.shape
    if not use_triton(tokens):
        return moe_permute_reference(tokens, positions)
    x, pos = tokens.contiguous(), positions.contiguous()
    rows = x.new_empty((t * k, x.shape[-1]))
    if t:
        launch(_permute_kernel, (t,), x, pos, rows, K=k, **_program(x.shape[-1]))
    return rows


def unpermute(rows: Tensor, positions: Tensor, weight: Tensor) -> Tensor:
    """The tokens, each the weighted sum of its slots: the kernel, or the same in PyTorch (float32)."""
    t, k = positions.shape
    if not use_triton(rows):
        picked = rows.float().index_select(0, positions.reshape(-1)).view(t, k, rows.shape[-1])
        return (picked * weight.float().unsqueeze(-1)).sum(1).to(rows.dtype)
    r, pos, w = rows.contiguous(), positions.contiguous(), weight.contiguous()
    y = r.new_empty((t, r.shape[-1]))
    if t:
        launch(_unpermute_kernel, (t,), r, pos, w, y, K=k, **_program(r.shape[-1]))
    return y


def unpermute_backward(dy: Tensor, rows: Tensor, positions: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(d rows, d weight): the kernel, or the same in PyTorch (float32)."""
    t, k = positions.shape
    flat = positions.reshape(-1)
    if not use_triton(rows):
        d32 = dy.float()
        drows = torch.empty(rows.shape, dtype=torch.float32, device=rows.device).index_copy_(
            0, flat, (d32.unsqueeze(1) * weight.float().unsqueeze(-1)).reshape(-1, rows.shape[-1]))
        dw = (rows.float().index_select(0, flat).view(t, k, -1) * d32.unsqueeze(1)).sum(-1)
        return drows.to(rows.dtype), dw.to(weight.dtype)
    d, r, pos, w = dy.contiguous(), rows.contiguous(), positions.contiguous(), weight.contiguous()
    drows, dw = torch.empty_like(r), torch.empty_like(w)
    if t:
        launch(_unpermute_backward_kernel, (t,), d, r, pos, w, drows, dw, K=k, **_program(r.shape[-1]))
    return drows, dw


@torch.library.custom_op("mfuscope::moe_permute", mutates_args=())
def _permute_op(tokens: Tensor, positions: Tensor) -> Tensor:
    return permute(tokens, positions)


@_permute_op.register_fake
def _(tokens, positions):
    return tokens.new_empty((positions.numel(), tokens.shape[-1]))


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _permute_grad(ctx, drows):
    (positions,) = ctx.saved_tensors
    ones = torch.ones(positions.shape, dtype=torch.float32, device=positions.device)
    return torch.ops.mfuscope.moe_unpermute(drows, positions, ones), None


_permute_op.register_autograd(_permute_grad, setup_context=_permute_setup)


@torch.library.custom_op("mfuscope::moe_unpermute", mutates_args=())
def _unpermute_op(rows: Tensor, positions: Tensor, weight: Tensor) -> Tensor:
    return unpermute(rows, positions, weight)


@_unpermute_op.register_fake
def _(rows, positions, weight):
    return rows.new_empty((positions.shape[0], rows.shape[-1]))


@torch.library.custom_op("mfuscope::moe_unpermute_backward", mutates_args=())
def _unpermute_backward_op(dy: Tensor, rows: Tensor, positions: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    return unpermute_backward(dy, rows, positions, weight)


@_unpermute_backward_op.register_fake
def _(dy, rows, positions, weight):
    return torch.empty_like(rows), torch.empty_like(weight)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_grad(ctx, dy):
    rows, positions, weight = ctx.saved_tensors
    drows, dw = torch.ops.mfuscope.moe_unpermute_backward(dy, rows, positions, weight)
    return drows, None, dw


_unpermute_op.register_autograd(_unpermute_grad, setup_context=_unpermute_setup)


def _check(what: str, positions: Tensor, width: Tensor, rows: int | None = None) -> None:
    if positions.dim() != 2 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: positions must be an integer (tokens, top_k) map, got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if width.dim() != 2:
        raise ValueError(f"{what}: expected a (rows, hidden) matrix, got {tuple(width.shape)}")
    if rows is not None and rows != positions.numel():
        raise ValueError(f"{what}: {rows} rows for {positions.numel()} routed choices {tuple(positions.shape)}")


def moe_permute(tokens: Tensor, positions: Tensor) -> Tensor:
    """``tokens`` (T, d) as the (T x k, d) routed rows in expert order; ``positions`` (T, k) from
    :func:`moe_positions`."""
    _check("moe_permute", positions, tokens)
    if tokens.shape[0] != positions.shape[0]:
        raise ValueError(f"moe_permute: {tokens.shape[0]} tokens, positions for {positions.shape[0]}")
    return torch.ops.mfuscope.moe_permute(tokens, positions)


def moe_unpermute(rows: Tensor, positions: Tensor, weight: Tensor) -> Tensor:
    """The (T, d) tokens from the (T x k, d) expert outputs ``rows``: each token the sum of its k
    slots times ``weight`` (T, k), its router weights."""
    _check("moe_unpermute", positions, rows, rows.shape[0])
    if weight.shape != positions.shape:
        raise ValueError(f"moe_unpermute: weight {tuple(weight.shape)} and positions "
                         f"{tuple(positions.shape)} differ in shape")
    return torch.ops.mfuscope.moe_unpermute(rows, positions, weight)
