"""Residual add and RMSNorm, fused: ``h = x + residual; y = rms_norm(h, weight)`` -> ``(y, h)``.

A pre-norm transformer adds each sublayer's output to the residual stream and
normalizes the sum for the next sublayer: eager PyTorch writes ``h`` and then
reads it back for the norm.  Here one pass reads x and residual and writes y
and h (4 per element instead of 6 with the norm's own intermediates).

Backward: ``h`` feeds both the norm and the rest of the residual stream, so
its gradient is the norm's input gradient plus the gradient arriving at ``h``
(``d_new_residual``); ``x`` and ``residual`` both receive it.  The norm's
backward is :mod:`rms_norm`'s kernel, with that extra gradient added in the
same pass.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import HAVE_TRITON, rows, use_triton
from .rms_norm import _rows_per_program, rms_norm_reference, tile_rows

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_forward_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, n_rows, n_cols, eps,
                                     BLOCK: tl.constexpr, TILE: tl.constexpr):
        row = tl.program_id(0) * TILE + tl.arange(0, TILE)
        rows = row[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < n_rows) & (cols < n_cols)
        h = (tl.load(x_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
             + tl.load(r_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd, mask=row < n_rows)
        tl.store(h_ptr + rows * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + rows * n_cols + cols, (h * rstd[:, None] * w).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_backward_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows,
                                      n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)[None, :]
        col_ok = cols < n_cols
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, ROWS, TILE):
            rows = pid * ROWS + start + tl.arange(0, TILE)[:, None]
            ok = col_ok & (rows < n_rows)
            h = tl.load(h_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            dh = tl.load(dh_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
            h_hat = h * rstd
            g = dy * w
            c = tl.sum(g * h_hat, axis=1) / n_cols
            tl.store(dx_ptr + rows * n_cols + cols, (rstd * (g - h_hat * c[:, None]) + dh).to(dx_ptr.dtype.element_ty),
                     mask=ok)
            dw += tl.sum(dy * h_hat, axis=0)
        tl.store(dw_partial_ptr + pid * n_cols + tl.arange(0, BLOCK), dw, mask=tl.arange(0, BLOCK) < n_cols)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The same in PyTorch: the sum, then the reference trainer's RMSNorm of it."""
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


@torch.library.custom_op("mfuscope::add_rms_norm_forward", mutates_args=())
def _forward(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, h, rstd)."""
    x2, r2 = rows(x), rows(residual)
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(h_dtype, weight.dtype)
    if not use_triton(x2):
        h = x2.float() + r2.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
        y = (h * rstd[:, None] * weight.float()).to(out_dtype)
        return y.reshape(x.shape), h.to(h_dtype).reshape(x.shape), rstd
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    h = torch.empty((n_rows, n_cols), dtype=h_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        tile = tile_rows(n_cols, n_rows)
        _add_rms_norm_forward_kernel[(triton.cdiv(n_rows, tile),)](x2, r2, weight.contiguous(), y, h, rstd, n_rows,
                                                                   n_cols, float(eps),
                                                                   BLOCK=triton.next_power_of_2(n_cols), TILE=tile)
    return y.reshape(x.shape), h.reshape(x.shape), rstd


@_forward.register_fake
def _(x, residual, weight, eps):
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.new_empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype)), x.new_empty(x.shape, dtype=h_dtype),
            x.new_empty((n_rows,), dtype=torch.float32))


@torch.library.custom_op("mfuscope::add_rms_norm_backward", mutates_args=())
def _backward(dy: Tensor, dh: Tensor, h: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(gradient of h -- x's and residual's alike -- , dweight)."""
    h2, dy2, dh2 = rows(h), rows(dy), rows(dh)
    if not use_triton(h2):
        h_hat = h2.float() * rstd[:, None]
        g = dy2.float() * weight.float()
        dx = rstd[:, None] * (g - h_hat * (g * h_hat).mean(-1, keepdim=True)) + dh2.float()
        return dx.to(h.dtype).reshape(h.shape), (dy2.float() * h_hat).sum(0).to(weight.dtype)
    n_rows, n_cols = h2.shape
    dx = torch.empty_like(h2)
    per, tile = _rows_per_program(n_rows, n_cols, h.device)
    programs = triton.cdiv(n_rows, per)
    partial = torch.zeros((max(programs, 1), n_cols), dtype=torch.float32, device=h.device)
    if n_rows:
        _add_rms_norm_backward_kernel[(programs,)](dy2, dh2, h2, weight.contiguous(), rstd, dx, partial, n_rows,
                                                   n_cols, ROWS=per, BLOCK=triton.next_power_of_2(n_cols), TILE=tile)
    return dx.reshape(h.shape), partial.sum(0).to(weight.dtype)


@_backward.register_fake
def _(dy, dh, h, weight, rstd):
    return torch.empty_like(h), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, residual, weight, _ = inputs
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.save_for_backward(output[1], weight, output[2])


def _autograd_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dy = dy if dy is not None else torch.zeros_like(h)
    dh = dh if dh is not None else torch.zeros_like(h)
    dx, dw = torch.ops.mfuscope.add_rms_norm_backward(dy.contiguous(), dh.contiguous(), h, weight, rstd)
    return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual, weight), x + residual)``."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}")
    y, h, _ = torch.ops.mfuscope.add_rms_norm_forward(x, residual, weight, float(eps))
    return y, h
