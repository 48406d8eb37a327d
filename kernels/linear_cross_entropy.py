"""The LM head and the loss, fused: ``cross_entropy(hidden @ weight.T, target)`` without the whole logits.

A 128k vocabulary makes the logits of 8k tokens 4 GiB in float32, and eager
PyTorch keeps them, their float32 copy and their gradient (14 GiB at its peak
on an H200 at 8k tokens and hidden 4096).  Both paths here hold a slice of
them at a time and take both gradients in the forward (as Liger and Cut
Cross-Entropy do), scaling them by the incoming gradient in the backward.

**GPU: slices of the vocabulary through the GEMM library.**  A first pass takes
each row's log-sum-exp and target logit a slice of ``GRAD_SLICE_BYTES`` at a
time (logits from 16-bit products kept in float32, the slices' log-sum-exps
combined as they come); a second pass makes each slice's logits again, turns
them into their gradient ``(softmax - onehot) x scale`` rounded to the inputs'
dtype, writes ``dW[slice] = g.T @ h`` once and adds ``g @ W[slice]`` into a
float32 ``dh``.  8 N V H FLOPs against eager's 6.  Measured on an H200 (bf16,
8k tokens, hidden 4096, 128k vocabulary; ``benchmarks/bench_kernels.py``, one
run): 90 ms and 3.6 GiB at its peak, against eager's 49 ms and 14.2 GiB,
torch.compile's 40 ms and 5.3 GiB and Liger's 56 ms and 3.3 GiB.  Two Triton
kernels that never held logits (Cut Cross-Entropy's design) ran there first and
lost: the log-sum-exp kernel at 210 TFLOP/s (96 against 90 ms overall), and the
gradient kernel's float32 atomic adds -- N V H / 16 bytes into both gradients --
took 533 ms.

**CPU: chunks of tokens.**  Each chunk's logits (``chunk x vocab`` float32) are
computed, turned into the rows' loss and, in place, their gradient, and the
chunk's share of the hidden and weight gradients is taken right away.  A CPU's
GEMMs slow at a few rows: the loss of 256 tokens at hidden 4096 and a 128k
vocabulary took 34 s in chunks of 8 rows, 8.4 s in chunks of 64 (eager: 8.0 s),
so a chunk is at least 64 tokens (31 MiB of logits, ``MIN_ROWS``); small
vocabularies fill ``CHUNK_BYTES`` with more.

Rows whose target is ``ignore_index`` contribute no loss and no gradient, and
the GPU path leaves them out of its GEMMs; ``mean`` divides by the rows that
count (all ignored: loss 0, gradients 0, where ``F.cross_entropy`` gives NaN).
Under autocast the op takes its inputs in autocast's dtype, as ``F.linear``
would (in float32 a training step's head ran on the CUDA cores: 577 ms a step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import INTERPRET

#: The GPU path's working set: a slice of logits in float32 and its 16-bit gradient take this much
#: at most (budgeted at 8 bytes a logit; at least 128 words a slice).
GRAD_SLICE_BYTES = 256 * 2**20
#: The CPU path: extra memory a chunk's float32 logits may take where the vocabulary leaves room
#: for more rows than ``MIN_ROWS``, the fewest rows its GEMMs run well at (module docstring).
CHUNK_BYTES = 4 * 2**20
MIN_ROWS = 64


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                                   reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)`` in float32: what the fused op replaces."""
    return F.cross_entropy(hidden.float() @ weight.float().t(), target, ignore_index=ignore_index, reduction=reduction)


def _sliced_loss_and_grads(h: Tensor, w: Tensor, t: Tensor, scale: float, ignore_index: int
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's loss, d loss / d h and d loss / d w (``scale`` folded in), a slice of the
    vocabulary at a time; ``h`` (N, H), ``w`` (V, H) contiguous, ``t`` (N,).  Off a GPU (the tests,
    under ``TRITON_INTERPRET=1``) and for float32 or mixed inputs the products are float32."""
    f32 = torch.float32
    upcast = INTERPRET or h.device.type != "cuda" or h.dtype == f32 or h.dtype != w.dtype
    lse, picked = _vocab_slice_lse(h, w, t, ignore_index, upcast)
    losses = torch.where(t != ignore_index, lse - picked, torch.zeros_like(lse))
    dh = torch.zeros(h.shape, dtype=f32, device=h.device)
    dw = torch.zeros(w.shape, dtype=f32, device=w.device) if w.dtype == f32 else torch.empty_like(w)
    if not bool((t != ignore_index).any()):  # every target ignored: no loss, no gradient
        return losses, dh.to(h.dtype), dw.zero_()
    _vocab_slice_grads(h, w, t, lse, scale, ignore_index, dh, dw, upcast)
    return losses, dh.to(h.dtype), dw


class _Rows:
    """What both passes take from the rows whose target counts: their positions, their hidden
    states in the products' dtype and their targets (all rows: ``h`` and ``t`` themselves, no
    copy), and the vocabulary slice width that keeps a slice's float32 logits and 16-bit gradient
    within ``GRAD_SLICE_BYTES`` (8 bytes a logit, a multiple of 128 words)."""

    def __init__(self, h: Tensor, t: Tensor, ignore_index: int, upcast: bool):
        self.like = torch.float32 if upcast else h.dtype
        self.rows = (t != ignore_index).nonzero()[:, 0]
        self.every = self.rows.numel() == t.numel()
        n = self.rows.numel()
        self.h = (h if self.every else h[self.rows]).to(self.like)
        self.t = t if self.every else t[self.rows]
        self.at = torch.arange(n, device=h.device)
        self.step = max(128, GRAD_SLICE_BYTES // (8 * max(1, n)) // 128 * 128)

    def slices(self, vocab: int):
        """(first, end) of each slice of the vocabulary, and where each row's target falls in it."""
        for v0 in range(0, vocab, self.step):
            v1 = min(vocab, v0 + self.step)
            hit = (self.t >= v0) & (self.t < v1)
            yield v0, v1, self.at[hit], self.t[hit] - v0


def _vocab_slice_lse(h: Tensor, w: Tensor, t: Tensor, ignore_index: int, upcast: bool) -> tuple[Tensor, Tensor]:
    """Each row's log-sum-exp and target logit (float32; rows whose target is ignored: 0 and 0), a
    slice of the vocabulary at a time by the GEMM library, the slices' log-sum-exps combined as they
    come.  The logits as :func:`_vocab_slice_grads` makes them; extra memory ``GRAD_SLICE_BYTES``."""
    k = _Rows(h, t, ignore_index, upcast)
    lse = torch.full((k.rows.numel(),), -float("inf"), dtype=torch.float32, device=h.device)
    picked = torch.zeros_like(lse)
    for v0, v1, row, col in k.slices(w.shape[0]):
        logits = _mm_float32(k.h, w[v0:v1].to(k.like).t())
        picked[row] = logits[row, col]
        top = logits.max(dim=1).values  # in place from here: no second slice-sized buffer
        lse = torch.logaddexp(lse, top + logits.sub_(top[:, None]).exp_().sum(dim=1).log())
    if k.every:
        return lse, picked
    out = torch.zeros(2, t.numel(), dtype=torch.float32, device=h.device)
    out[0, k.rows], out[1, k.rows] = lse, picked
    return out[0], out[1]


def _vocab_slice_grads(h: Tensor, w: Tensor, t: Tensor, lse: Tensor, scale: float, ignore_index: int,
                       dh: Tensor, dw: Tensor, upcast: bool) -> None:
    """Both gradients a slice of the vocabulary at a time, by the GEMM library: the slice's logits of
    the rows that count in float32 (from 16-bit products: :func:`_mm_float32`), their gradient
    rounded to the inputs' dtype (the tensor cores' format), then ``dW[slice] = g.T @ h`` (written
    once) and ``dh += g @ W[slice]`` (float32).  ``upcast``: every product in float32.  Extra memory:
    ``GRAD_SLICE_BYTES`` for a slice's logits and gradient."""
    k = _Rows(h, t, ignore_index, upcast)
    lse_k = lse if k.every else lse[k.rows]
    acc = dh if k.every else torch.zeros(k.rows.numel(), h.shape[1], dtype=torch.float32, device=h.device)
    for v0, v1, row, col in k.slices(w.shape[0]):
        wc = w[v0:v1].to(k.like)
        p = _mm_float32(k.h, wc.t())
        p.sub_(lse_k[:, None]).exp_()
        p[row, col] -= 1.0
        g = p.mul_(scale).to(k.like)
        del p
        if dw.dtype == k.like:
            torch.mm(g.t(), k.h, out=dw[v0:v1])
        else:
            dw[v0:v1] = g.t() @ k.h
        acc += _mm_float32(g, wc)
    if not k.every:
        dh[k.rows] = acc


#: Whether ``torch.mm(..., out_dtype=float32)`` runs on a device type (found on first use).
_OUT_DTYPE: dict[str, bool] = {}


def _mm_float32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in float32: 16-bit inputs on the tensor cores with the result kept in float32 (one
    rounding fewer) where this torch has ``out_dtype`` for the device, else rounded then widened."""
    if a.dtype == torch.float32:
        return a @ b
    if _OUT_DTYPE.get(a.device.type, True):
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _OUT_DTYPE[a.device.type] = True
            return out
        except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
            _OUT_DTYPE[a.device.type] = False
    return (a @ b).float()


def _rows_loss_and_grad(logits: Tensor, target: Tensor, scale: float, ignore_index: int) -> Tensor:
    """Each row's loss; ``logits`` (float32) overwritten with the rows' gradients."""
    keep = target != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target.clamp(min=0)[:, None])[:, 0]
    loss = torch.where(keep, lse - picked, torch.zeros_like(lse))
    logits.sub_(lse[:, None]).exp_()
    logits[keep, target[keep]] -= 1.0
    logits.mul_(torch.where(keep, scale, 0.0)[:, None])
    return loss


def chunk_rows(n_rows: int, vocab: int) -> int:
    """Tokens per chunk of the CPU path: ``CHUNK_BYTES`` of float32 logits, at least ``MIN_ROWS``."""
    return max(1, min(max(CHUNK_BYTES // (4 * vocab), MIN_ROWS), n_rows))


def _chunked_loss_and_grads(h: Tensor, w: Tensor, t: Tensor, scale: float, ignore_index: int
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """What :func:`_sliced_loss_and_grads` returns, a chunk of tokens at a time."""
    n = h.shape[0]
    chunk = chunk_rows(n, w.shape[0])
    losses = torch.empty(n, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    for start in range(0, n, chunk):
        hc = h[start:start + chunk]
        logits = (hc @ w.t()).float()
        losses[start:start + chunk] = _rows_loss_and_grad(logits, t[start:start + chunk], scale, ignore_index)
        g = logits.to(w.dtype)
        dh[start:start + chunk] = g @ w
        dw.addmm_(g.t().float(), hc.float())
    return losses, dh, dw.to(w.dtype)


def _takes_gpu_path(h: Tensor) -> bool:
    """CUDA tensors take the GPU path; so do CPU ones under ``TRITON_INTERPRET=1``, as every kernel's
    do (the test suite's setting)."""
    return h.device.type == "cuda" or INTERPRET


@torch.library.custom_op("mfuscope::linear_cross_entropy", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden, d loss / d weight)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    valid = int((t != ignore_index).sum())
    scale = 1.0 / valid if reduction == "mean" and valid else 1.0
    how = _sliced_loss_and_grads if _takes_gpu_path(h) else _chunked_loss_and_grads
    # its products in the dtypes it chose (the inputs arrive in autocast's: fused_linear_cross_entropy)
    with torch.autocast(h.device.type, enabled=False):
        losses, dh, dw = how(h.contiguous(), weight.contiguous(), t.contiguous(), scale, ignore_index)
    loss = losses.sum() * scale if reduction in ("mean", "sum") else losses
    return loss, dh.reshape(hidden.shape), dw


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
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs F.linear: both in its dtype (an fp32
        dtype = torch.get_autocast_dtype(device)  # master weight's gradient flows back through the cast)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return torch.ops.mfuscope.linear_cross_entropy(hidden, weight, target, int(ignore_index), reduction)[0]
