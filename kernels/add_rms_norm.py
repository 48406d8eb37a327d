"""Residual add and RMSNorm, fused: ``h = x + residual; y = rms_norm(h, weight)`` -> ``(y, h)``.

A pre-norm transformer adds each sublayer's output to the residual stream and
normalizes the sum for the next sublayer: eager PyTorch writes ``h`` and then
reads it back for the norm.  Here one pass reads x and residual and writes y
and h (4 per element instead of 6 with the norm's own intermediates).

Backward: ``h`` feeds both the norm and the rest of the residual stream, so
its gradient is the norm's input gradient plus the gradient arriving at ``h``
(``d_new_residual``); ``x`` and ``residual`` both receive it, added in the
norm's backward pass.  Forward and backward are :mod:`rms_norm`'s kernels in
their ``ADD`` variant.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import rows
from .rms_norm import norm_backward, norm_forward, rms_norm_reference


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The same in PyTorch: the sum, then the reference trainer's RMSNorm of it."""
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


@torch.library.custom_op("mfuscope::add_rms_norm_forward", mutates_args=())
def _forward(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, h, rstd): RMSNorm's kernel with the residual added first (its ``ADD`` variant)."""
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    y, h, rstd = norm_forward(rows(x), rows(residual), weight, eps, torch.promote_types(h_dtype, weight.dtype), h_dtype)
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
    dx, dw = norm_backward(rows(dy), rows(dh), rows(h), weight, rstd)
    return dx.reshape(h.shape), dw


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
