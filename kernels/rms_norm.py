"""RMSNorm, fused: ``y = x * rsqrt(mean(x**2, -1) + eps) * weight``, forward and backward.

Numerics follow the reference trainer's ``RMSNorm`` (``reference_trainer/model.py``):
the row statistics in float32 whatever the input dtype, the output in
``promote(x.dtype, weight.dtype)``.  The kernel computes in float32 throughout
(loads cast up, the store casts down); the reference casts the normalized row
to ``x``'s dtype before the weight multiplies it, so bf16 results differ by up
to one bf16 rounding.

Memory traffic per row of D elements (b bytes each): forward reads x and
writes y (2Db; unfused PyTorch reads x three times and writes three
intermediates), backward reads x and dy and writes dx (3Db) plus one float32
partial weight gradient per program, summed afterwards -- never atomics.

Backward, with x̂ = x * rstd and g = dy * weight:
``dx = rstd * (g - x̂ * mean(g * x̂))`` and ``dweight = sum over rows of dy * x̂``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import HAVE_TRITON, launch, multiprocessors, rows, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_forward_kernel(x_ptr, r_ptr, h_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps,
                                 BLOCK: tl.constexpr, TILE: tl.constexpr, ADD: tl.constexpr):
        # One program: TILE rows (one for wide rows, many for narrow ones), all their columns.  With
        # ADD, the row normalized is x + r, and that sum is stored in h (add_rms_norm).
        row = tl.program_id(0) * TILE + tl.arange(0, TILE)
        rows = row[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < n_rows) & (cols < n_cols)
        x = tl.load(x_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            x += tl.load(r_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + rows * n_cols + cols, x.to(h_ptr.dtype.element_ty), mask=mask)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd, mask=row < n_rows)
        tl.store(y_ptr + rows * n_cols + cols, (x * rstd[:, None] * w).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_backward_kernel(dy_ptr, dh_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                                  ROWS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, ADD: tl.constexpr):
        # One program: ROWS rows, TILE at a time; its share of dweight summed in float32.  With ADD,
        # the normalized row's own incoming gradient dh is added (add_rms_norm's sum feeds on).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)[None, :]
        col_ok = cols < n_cols
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, ROWS, TILE):
            rows = pid * ROWS + start + tl.arange(0, TILE)[:, None]
            ok = col_ok & (rows < n_rows)
            x = tl.load(x_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
            x_hat = x * rstd
            dw += tl.sum(dy * x_hat, axis=0)
            # The weight is loaded where it is used (from cache after the first row) rather than
            # held across the loop: at 16k columns a thread has no registers to spare for it.
            g = dy * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            c = tl.sum(g * x_hat, axis=1) / n_cols
            dx = rstd * (g - x_hat * c[:, None])
            if ADD:
                dx += tl.load(dh_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dx_ptr + rows * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        tl.store(dw_partial_ptr + pid * n_cols + tl.arange(0, BLOCK), dw, mask=tl.arange(0, BLOCK) < n_cols)


def tile_rows(n_cols: int, n_rows: int) -> int:
    """Rows a program holds at once: about 4k elements (one row when rows are that wide)."""
    return max(1, min(triton.next_power_of_2(max(n_rows, 1)), 4096 // triton.next_power_of_2(n_cols)))


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """The reference trainer's RMSNorm, in PyTorch."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _rows_per_program(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int]:
    """(rows each backward program takes, rows it holds at once): enough programs to fill a GPU,
    few enough that their partial weight gradients (one float32 row each) stay small; powers of
    two, so the kernel (which takes them as constants) compiles for a handful of values only."""
    programs = 4 * multiprocessors(device)
    per = triton.next_power_of_2(max(triton.cdiv(n_rows, programs), 1))
    return per, min(per, tile_rows(n_cols, n_rows))


def norm_forward(x2: Tensor, residual2: Tensor | None, weight: Tensor, eps: float, out_dtype: torch.dtype,
                 h_dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
    """(y, h = x + residual or None, rstd) of rows ``x2``: the kernel, or the same in PyTorch."""
    n_rows, n_cols = x2.shape
    if not use_triton(x2):
        h = x2.float() + residual2.float() if residual2 is not None else x2.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
        y = (h * rstd[:, None] * weight.float()).to(out_dtype)
        return y, (h.to(h_dtype) if residual2 is not None else None), rstd
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x2.device)
    h = torch.empty((n_rows, n_cols), dtype=h_dtype, device=x2.device) if residual2 is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if n_rows:
        tile = tile_rows(n_cols, n_rows)
        add = residual2 is not None
        block = triton.next_power_of_2(n_cols)
        launch(_rms_norm_forward_kernel, (triton.cdiv(n_rows, tile),),
               x2, residual2 if add else x2, h if add else y, weight.contiguous(), y, rstd, n_rows, n_cols, float(eps),
               values=tile * block, BLOCK=block, TILE=tile, ADD=add)
    return y, h, rstd


def norm_backward(dy2: Tensor, dh2: Tensor | None, x2: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx like x2, dweight like weight), with ``dh2`` added to dx when given."""
    n_rows, n_cols = x2.shape
    if not use_triton(x2):
        x_hat = x2.float() * rstd[:, None]
        g = dy2.float() * weight.float()
        dx = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        if dh2 is not None:
            dx = dx + dh2.float()
        return dx.to(x2.dtype), (dy2.float() * x_hat).sum(0).to(weight.dtype)
    dx = torch.empty_like(x2)
    per, tile = _rows_per_program(n_rows, n_cols, x2.device)
    programs = triton.cdiv(n_rows, per)
    partial = torch.zeros((max(programs, 1), n_cols), dtype=torch.float32, device=x2.device)
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        launch(_rms_norm_backward_kernel, (programs,), dy2, dh2 if dh2 is not None else dy2, x2, weight.contiguous(),
               rstd, dx, partial, n_rows, n_cols, values=tile * block, ROWS=per, BLOCK=block, TILE=tile,
               ADD=dh2 is not None)
    return dx, partial.sum(0).to(weight.dtype)


@torch.library.custom_op("mfuscope::rms_norm_forward", mutates_args=())
def _forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd): y like ``x`` in ``promote(x, weight)``, rstd float32 per row."""
    y, _, rstd = norm_forward(rows(x), None, weight, eps, torch.promote_types(x.dtype, weight.dtype), x.dtype)
    return y.reshape(x.shape), rstd


@_forward.register_fake
def _(x, weight, eps):
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty((n_rows,), dtype=torch.float32))


@torch.library.custom_op("mfuscope::rms_norm_backward", mutates_args=())
def _backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx like x, dweight like weight)."""
    dx, dw = norm_backward(rows(dy), None, rows(x), weight, rstd)
    return dx.reshape(x.shape), dw


@_backward.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _autograd_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.mfuscope.rms_norm_backward(dy.contiguous(), x, weight, rstd)
    return dx, dw, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm of ``x`` over its last dimension, scaled by ``weight`` (that dimension's size)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}")
    return torch.ops.mfuscope.rms_norm_forward(x, weight, float(eps))[0]
