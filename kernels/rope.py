"""Rotary position embedding, fused: q and k rotated pair by pair, forward and backward.

``apply_rope(q, k, cos, sin)`` takes q and k of shape (batch, heads, seq,
head_dim) -- with different head counts under GQA, and any strides, so a
(batch, seq, heads, head_dim) tensor transposed is read in place -- and
``cos``/``sin`` of shape (seq, head_dim // 2), one angle per pair (Hugging
Face's (seq, head_dim), the halves repeated, is accepted too).  Pairs are
(i, i + head_dim/2) by default (rotate-half, Hugging Face's convention) or
(2i, 2i + 1) with ``interleaved=True`` (Meta's and torchtitan's complex-number
form, which the reference trainer uses).

Each element is read once and written once (eager PyTorch: slices, four
multiplies, an add, a subtract and a stack).  The backward is the same
rotation by the opposite angle.  Float32 inside, whatever the dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import HAVE_TRITON, launch, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, seq, sb, sh, ss, sd, sign,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, SEQ_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
        # One program: SEQ_BLOCK positions of one (batch, head), every pair of each.
        bh = tl.program_id(0)
        head = bh % n_heads
        batch = bh // n_heads
        pos = tl.program_id(1) * SEQ_BLOCK + tl.arange(0, SEQ_BLOCK)[:, None]
        j = tl.arange(0, BLOCK)[None, :]
        ok = (j < HALF) & (pos < seq)
        if INTERLEAVED:
            i1 = 2 * j
            i2 = 2 * j + 1
        else:
            i1 = j
            i2 = j + HALF
        base = x_ptr + batch * sb + head * sh + pos * ss
        x1 = tl.load(base + i1 * sd, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + i2 * sd, mask=ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * HALF + j, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * HALF + j, mask=ok, other=0.0).to(tl.float32) * sign
        out = y_ptr + (bh * seq + pos) * (2 * HALF)
        tl.store(out + i1, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(out + i2, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=ok)


def _pairs(x: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    half = x.shape[-1] // 2
    return (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])


def _join(a: Tensor, b: Tensor, interleaved: bool) -> Tensor:
    return torch.stack((a, b), dim=-1).flatten(-2) if interleaved else torch.cat((a, b), dim=-1)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """``x`` (batch, heads, seq, head_dim) rotated by the angles whose cos/sin are (seq, head_dim/2)."""
    x1, x2 = _pairs(x.float(), interleaved)
    c, s = cos.float()[None, None], sin.float()[None, None]
    return _join(x1 * c - x2 * s, x2 * c + x1 * s, interleaved).to(x.dtype)


def _half_angles(t: Tensor, head_dim: int) -> Tensor:
    """(seq, head_dim/2), from that or from Hugging Face's (seq, head_dim) of repeated halves."""
    if t.dim() != 2 or t.shape[-1] not in (head_dim // 2, head_dim):
        raise ValueError(f"apply_rope: cos/sin of shape {tuple(t.shape)}; expected (seq, {head_dim // 2}) "
                         f"or (seq, {head_dim})")
    return t[:, : head_dim // 2].contiguous() if t.shape[-1] == head_dim else t.contiguous()


@torch.library.custom_op("mfuscope::rope", mutates_args=())
def _rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, sign: float) -> Tensor:
    return rotate(x, cos, sin, interleaved, sign)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, sign: float) -> Tensor:
    """``x`` rotated by ``sign`` times the angles; contiguous (batch, heads, seq, head_dim)."""
    if not use_triton(x):
        return rope_reference(x, cos, sin * sign, interleaved).contiguous()
    b, h, s, d = x.shape
    y = torch.empty((b, h, s, d), dtype=x.dtype, device=x.device)
    if y.numel():
        block = triton.next_power_of_2(d // 2)
        seq_block = _seq_block(s, block)
        launch(_rope_kernel, (b * h, triton.cdiv(s, seq_block)), x, cos, sin, y, h, s, *x.stride(), float(sign),
               values=seq_block * block, HALF=d // 2, BLOCK=block, SEQ_BLOCK=seq_block, INTERLEAVED=interleaved)
    return y


def _seq_block(seq: int, block: int) -> int:
    """Positions per program: a tile of about 2k pairs (a power of two; whole short sequences)."""
    return min(triton.next_power_of_2(seq), max(1, 2048 // block))


@_rope.register_fake
def _(x, cos, sin, interleaved, sign):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, cos, sin, interleaved, sign = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.sign = interleaved, sign


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return torch.ops.mfuscope.rope(dy, cos, sin, ctx.interleaved, -ctx.sign), None, None, None, None


_rope.register_autograd(_backward, setup_context=_setup_context)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """(q, k) rotated; q and k (batch, heads, seq, head_dim), cos/sin (seq, head_dim/2)."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or t.shape[-1] % 2 or t.shape[2] != cos.shape[0]:
            raise ValueError(f"apply_rope: {name} of shape {tuple(t.shape)}; expected (batch, heads, "
                             f"{cos.shape[0]}, an even head_dim)")
    d = q.shape[-1]
    c, s = _half_angles(cos, d).to(q.device), _half_angles(sin, d).to(q.device)
    return (torch.ops.mfuscope.rope(q, c, s, interleaved, 1.0), torch.ops.mfuscope.rope(k, c, s, interleaved, 1.0))


def rope_angles(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin (seq, head_dim/2) of the reference trainer's angles: position x theta^(-2i/d)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()
