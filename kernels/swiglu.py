"""SwiGLU's gate, fused: ``silu(gate) * up``, forward and backward.

The backward recomputes ``sigmoid(gate)`` from the saved inputs instead of
saving the activation: it reads gate, up and dy and writes d_gate and d_up
(5 reads/writes of N elements), where eager PyTorch saves silu(gate) and
runs four kernels.  Float32 inside the kernel, whatever the input dtype.

With s = sigmoid(g): ``d_up = dy * g * s`` and
``d_gate = dy * up * s * (1 + g * (1 - s))``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import HAVE_TRITON, launch, use_triton

BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_forward_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(y_ptr + offs, (g * s * u).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """``F.silu(gate) * up``, as the reference trainer's feed-forward computes it."""
    return F.silu(gate) * up


@torch.library.custom_op("mfuscope::swiglu_forward", mutates_args=())
def _forward(gate: Tensor, up: Tensor) -> Tensor:
    return forward(gate, up)


def forward(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``: the kernel, or the same in PyTorch."""
    if not use_triton(gate):
        g = gate.float()
        return (g * torch.sigmoid(g) * up.float()).to(torch.promote_types(gate.dtype, up.dtype))
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty(g.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=g.device)
    n = g.numel()
    if n:
        launch(_swiglu_forward_kernel, (triton.cdiv(n, BLOCK),), g, u, y, n, values=BLOCK, BLOCK=BLOCK)
    return y


@_forward.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("mfuscope::swiglu_backward", mutates_args=())
def _backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return backward(dy, gate, up)


def backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(d gate, d up), the activation recomputed: the kernel, or the same in PyTorch."""
    if not use_triton(gate):
        g, u, d = gate.float(), up.float(), dy.float()
        s = torch.sigmoid(g)
        return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)
    d, g, u = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        launch(_swiglu_backward_kernel, (triton.cdiv(n, BLOCK),), d, g, u, dg, du, n, values=BLOCK, BLOCK=BLOCK)
    return dg, du


@_backward.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _autograd_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return tuple(torch.ops.mfuscope.swiglu_backward(dy, gate, up))


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` elementwise; ``gate`` and ``up`` of one shape."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return torch.ops.mfuscope.swiglu_forward(gate, up)
