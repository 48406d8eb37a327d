"""The LM head and the loss, fused: ``cross_entropy(hidden @ weight.T, target)`` without the logits.

A 128k vocabulary makes the logits of 4k tokens 2 GiB in float32, and eager
PyTorch keeps them and their gradient.  Here the tokens go through in chunks:
each chunk's logits (``chunk x vocab`` float32, a few MiB) are computed, a
Triton kernel turns each row into its loss and, in place, its gradient
(``softmax - onehot``, scaled for the reduction), and the chunk's share of the
hidden and weight gradients is taken right away.  The gradients are computed
in the forward (as Liger's and Cut Cross-Entropy's are) and scaled by the
incoming gradient in the backward, so nothing of the chunk outlives it.

How many tokens a chunk takes is a trade of memory for GEMM speed
(:func:`chunk_rows`).  A chunk's three GEMMs each read the whole (vocab x
hidden) weight for ``rows x hidden x vocab`` multiply-adds: about ``rows``
FLOP per weight byte in bf16.  On a GPU that must pass the tensor cores' ridge
(H100: 989 TFLOP/s over 3.35 TB/s, about 300 FLOP a byte) or the weight's
reads set the time -- at 8 rows a chunk the loss of 8k tokens would read a
1 GB weight 3,000 times.  So on CUDA a chunk is at least 512 tokens
(``MIN_ROWS``; 256 MiB of float32 logits at a 128k vocabulary, about 500 MiB
with the bf16 GEMM output and gradient beside them, still a fraction of
eager's), and the weight gradient is accumulated by a bf16 GEMM with a
float32 output (``addmm(..., out_dtype=float32)``, tensor cores), not by a
float32 GEMM.  A CPU's ridge is a few FLOP a byte, but its GEMMs still
slow at a few rows: the loss of 256 tokens at hidden 4096 and a 128k
vocabulary took 34 s in chunks of 8 rows, 8.4 s in chunks of 64 (eager: 8.0 s),
so a CPU chunk is at least 64 tokens (31 MiB).  Small vocabularies fill
``CHUNK_BYTES`` with more rows.

Rows whose target is ``ignore_index`` contribute no loss and no gradient;
``mean`` divides by the rows that count (all ignored: loss 0, gradients 0, as
``F.cross_entropy`` gives NaN there instead).  Float32 throughout the kernel;
the matmuls run in the inputs' dtype with float32 accumulation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import HAVE_TRITON, launch, use_triton

#: Extra memory a chunk's float32 logits may take where the vocabulary leaves room for more rows.
CHUNK_BYTES = 4 * 2**20
#: Tokens a chunk takes at least, by device type, so its GEMMs are not bound by reading the weight
#: (module docstring).
MIN_ROWS = {"cuda": 512, "cpu": 64}

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_rows_kernel(logits_ptr, target_ptr, loss_ptr, scale, ignore_index, VOCAB: tl.constexpr,
                        BLOCK: tl.constexpr):
        # One row: online max and sum of exp over the vocabulary, then the loss and, in place, the
        # gradient (softmax - onehot) * scale.
        row = tl.program_id(0)
        ptr = logits_ptr + row * VOCAB
        target = tl.load(target_ptr + row)
        m = -float("inf")
        d = 0.0
        for start in range(0, VOCAB, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(ptr + cols, mask=cols < VOCAB, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)
        keep = target != ignore_index
        x_target = tl.load(ptr + target, mask=keep, other=0.0).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(keep, lse - x_target, 0.0))
        row_scale = tl.where(keep, scale, 0.0)
        for start in range(0, VOCAB, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < VOCAB
            x = tl.load(ptr + cols, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(ptr + cols, g * row_scale, mask=ok)


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                                   reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)`` in float32: what the fused op replaces."""
    return F.cross_entropy(hidden.float() @ weight.float().t(), target, ignore_index=ignore_index, reduction=reduction)


def _ce_rows(logits: Tensor, target: Tensor, scale: float, ignore_index: int) -> Tensor:
    """Each row's loss; ``logits`` (float32, contiguous) overwritten with the rows' gradients."""
    if use_triton(logits):
        loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        if logits.shape[0]:
            vocab = logits.shape[1]
            block = min(triton.next_power_of_2(vocab), 4096)
            launch(_ce_rows_kernel, (logits.shape[0],), logits, target, loss, float(scale), int(ignore_index),
                   values=block, VOCAB=vocab, BLOCK=block)
        return loss
    keep = target != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target.clamp(min=0)[:, None])[:, 0]
    loss = torch.where(keep, lse - picked, torch.zeros_like(lse))
    logits.sub_(lse[:, None]).exp_()
    logits[keep, target[keep]] -= 1.0
    logits.mul_(torch.where(keep, scale, 0.0)[:, None])
    return loss


#: ``addmm(dw_fp32, g, h, out_dtype=torch.float32)`` on CUDA half inputs: the overload came in torch 2.8,
#: but took a float32 ``self`` only from 2.10 (pytorch/pytorch#154086).
_HALF_GEMM_TO_FLOAT = torch.torch_version.TorchVersion(torch.__version__) >= "2.10"


def chunk_rows(n_rows: int, vocab: int, device: torch.device) -> int:
    """Tokens per chunk: ``CHUNK_BYTES`` of float32 logits, and at least the device's ``MIN_ROWS``."""
    rows = max(CHUNK_BYTES // (4 * vocab), MIN_ROWS.get(device.type, 1))
    return max(1, min(rows, n_rows))


@torch.library.custom_op("mfuscope::linear_cross_entropy", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden, d loss / d weight)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    n, vocab = h.shape[0], weight.shape[0]
    valid = int((t != ignore_index).sum())
    scale = 1.0 / valid if reduction == "mean" and valid else 1.0
    chunk = chunk_rows(n, vocab, h.device)
    losses = torch.empty(n, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, n, chunk):
        hc = h[start:start + chunk]
        logits = (hc @ weight.t()).float().contiguous()
        losses[start:start + chunk] = _ce_rows(logits, t[start:start + chunk].contiguous(), scale, ignore_index)
        g = logits.to(weight.dtype)
        dh[start:start + chunk] = g @ weight
        half = hc.dtype in (torch.bfloat16, torch.float16) and g.dtype == hc.dtype  # not under autocast's mixes
        if _HALF_GEMM_TO_FLOAT and hc.is_cuda and half:
            torch.addmm(dw, g.t(), hc, out_dtype=torch.float32, out=dw)
        else:
            dw.addmm_(g.t().float(), hc.float())
    loss = losses.sum() * scale if reduction in ("mean", "sum") else losses
    return loss, dh.reshape(hidden.shape), dw.to(weight.dtype)


@_forward.register_fake
def _(hidden, weight, target, ignore_index, reduction):
    n = target.numel()
    loss = hidden.new_empty((), dtype=torch.float32) if reduction in ("mean", "sum") else hidden.new_empty(
        (n,), dtype=torch.float32)
    return loss, torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    ctx.reduction = inputs[4]
    ctx.save_for_backward(output[1], output[2])
    # The gradient outputs are not differentiated: without this, autograd would hand the backward
    # zero-filled incoming gradients for them, a weight-sized buffer each call.
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, _ddh, _ddw):
    if dloss is None:  # only the gradient outputs were differentiated: they carry no gradient back
        return None, None, None, None, None
    dh, dw = ctx.saved_tensors  # reduction mean or sum (none is refused with gradients)
    # Scaled in place: they are this op's own buffers, used once (a copy would add a weight's worth).
    return dh.mul_(dloss.to(dh.dtype)), dw.mul_(dloss.to(dw.dtype)), None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                               reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``target``, never holding the logits;
    ``hidden`` (..., H), ``weight`` (V, H), ``target`` (...) of class indices."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"fused_linear_cross_entropy: reduction {reduction!r}: mean, sum or none")
    if reduction == "none" and (hidden.requires_grad or weight.requires_grad):
        raise ValueError("fused_linear_cross_entropy: reduction='none' is forward-only (the gradients are taken "
                         "in the forward, summed over rows); use mean or sum to train")
    if hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != target.shape:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
                         f"target {tuple(target.shape)} do not fit (hidden (..., H), weight (V, H), target (...))")
    return torch.ops.mfuscope.linear_cross_entropy(hidden, weight, target, int(ignore_index), reduction)[0]
