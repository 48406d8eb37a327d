"""The LM head and the loss, fused: ``cross_entropy(hidden @ weight.T, target)`` without the logits.

A 128k vocabulary makes the logits of 4k tokens 2 GiB in float32, and eager
PyTorch keeps them and their gradient.  Two ways here never hold them:

**Triton (CUDA, or the interpreter under ``TRITON_INTERPRET=1``): no logits at
all**, as Cut Cross-Entropy (Wijmans et al. 2024) computes them.
``_lse_kernel`` walks each block of 128 rows through (a split of) the vocabulary
one 128 x 128 tile of logits at a time, computed on chip by ``tl.dot`` and
folded into an online max and sum of exp; it stores those and the target's
logit, three floats a row and split, which the host combines into the
log-sum-exp and the loss.  ``_grad_kernel`` recomputes each tile, turns it into
its gradient ``(softmax - onehot) x scale`` and adds the tile's share of both
input gradients, ``g @ W`` and ``g.T @ h``, into float32 accumulators with
atomic adds (float32, never 16-bit).  Extra memory: 8 + 12 x splits bytes a
token (splits: enough for two programs an SM, 9 at 4k tokens on an H100: 464
KiB), plus -- for 16-bit inputs, whose gradients are returned in their own
dtype -- the float32 accumulators: the hidden gradient's (4 bytes a hidden
element) and the weight's in vocabulary slices of ``DW_SLICE_BYTES``, each cast
into the gradient when done.  At 4k tokens, hidden 4096 and a 128k vocabulary
that is a few hundred KiB in float32 and about 96 MiB in bf16, against eager's
4 GiB and more.
The price is FLOPs: the logits are computed three times (forward, and per tile
for each gradient), 8 N V H in all against eager's 6 N V H; blocks of rows whose
targets are all ignored are left out of both grids.

**PyTorch on CPU (the reference path): chunks of tokens.**  Each chunk's logits
(``chunk x vocab`` float32) are computed, turned into the rows' loss and, in
place, their gradient, and the chunk's share of the hidden and weight
gradients is taken right away.  A CPU's GEMMs slow at a few rows: the loss of
256 tokens at hidden 4096 and a 128k vocabulary took 34 s in chunks of 8 rows,
8.4 s in chunks of 64 (eager: 8.0 s), so a chunk is at least 64 tokens (31 MiB
of logits, ``MIN_ROWS``); small vocabularies fill ``CHUNK_BYTES`` with more.

Both take the gradients in the forward (as Liger and Cut Cross-Entropy do) and
scale them by the incoming gradient in the backward.  Rows whose target is
``ignore_index`` contribute no loss and no gradient; ``mean`` divides by the
rows that count (all ignored: loss 0, gradients 0, where ``F.cross_entropy``
gives NaN).  Float32 accumulation throughout; on a GPU the tiles' products run
in the inputs' dtype (bf16 tensor cores), in the interpreter in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import HAVE_TRITON, INTERPRET, launch, multiprocessors, use_triton

#: The Triton path's tiles: (rows, vocabulary words) of logits a program holds and the hidden width
#: its products step through.  16-bit inputs run on the tensor cores in 128 x 128 tiles: a tile's
#: products do rows x words / (rows + words) multiply-adds per element read, 64 here against 43 at
#: 64 x 128, as large GEMMs tile to stay off the L2's bandwidth (no spills on sm_80/90/100; at
#: 128 x 256 both kernels spill).  Float32 ones (exact float32 products, not TF32) take smaller
#: tiles, which the compiler otherwise spills (7 KB a thread at 64 x 128 on sm_90).  Both at 8 warps.
TILES = {"half": (128, 128, 32), "float": (64, 64, 32)}
WARPS_VALUES = 8 * 512  # ``_dispatch.launch`` sizes warps by values a program holds: this gives 8
#: The float32 weight-gradient accumulator for 16-bit weights is this large at most: the vocabulary
#: is reduced a slice of words at a time.
DW_SLICE_BYTES = 32 * 2**20
#: How the Triton path takes the gradients after ``_lse_kernel``: "gemm" (``_vocab_slice_grads``, a
#: slice of logits at a time through the GEMM library) or "atomic" (``_grad_kernel``: no logits, both
#: gradients by float32 atomic adds).  The atomic adds moved N V H / 16 bytes: 574 ms at 8k tokens,
#: hidden 4096 and a 128k vocabulary on an H200, against eager's 50 ms (benchmarks/bench_kernels.py).
GRAD_PATH = "gemm"
#: How it takes each row's log-sum-exp: "gemm" (``_vocab_slice_lse``) or "triton" (``_lse_kernel``: no
#: logits; 41 ms of the 87 at the shape above, 2 N V H FLOPs at 210 TFLOP/s).
LSE_PATH = "gemm"
GRAD_SLICE_BYTES = 256 * 2**20
#: The CPU path: extra memory a chunk's float32 logits may take where the vocabulary leaves room
#: for more rows than ``MIN_ROWS``, the fewest rows its GEMMs run well at (module docstring).
CHUNK_BYTES = 4 * 2**20
MIN_ROWS = 64

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _logits_tile(h_ptr, w_ptr, row_at, col_at, row_ok, col_ok, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        # A (BLOCK_M x BLOCK_V) tile of logits, h[rows] @ W[words].T, on chip in float32 (inlined
        # into both kernels; row_at / col_at: the rows' and words' 64-bit offsets).
        acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HIDDEN
            a = tl.load(h_ptr + row_at[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + col_at[None, :] + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _lse_kernel(h_ptr, w_ptr, target_ptr, blocks_ptr, m_ptr, d_ptr, picked_ptr, n_rows, VOCAB: tl.constexpr,
                    HIDDEN: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        # BLOCK_M rows over SPLIT_BLOCKS tiles of the vocabulary (this program's split): each
        # (BLOCK_M x BLOCK_V) tile of logits computed on chip and folded into an online max m and
        # sum of exp d; the target's logit picked on the way.  Only m, d and the pick are stored,
        # a float each per row and split; the host combines the splits into the log-sum-exp.
        # blocks_ptr lists the row blocks that have a row to learn from (the grid's first axis).
        rows = tl.load(blocks_ptr + tl.program_id(0)) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_at = rows.to(tl.int64) * HIDDEN  # 64-bit: 128k words x 16k wide passes 2^31
        row_ok = rows < n_rows
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
        m = tl.full((BLOCK_M,), -float("inf"), tl.float32)
        d = tl.zeros((BLOCK_M,), tl.float32)
        picked = tl.zeros((BLOCK_M,), tl.float32)
        for i in range(0, SPLIT_BLOCKS):
            cols = (tl.program_id(1) * SPLIT_BLOCKS + i) * BLOCK_V + tl.arange(0, BLOCK_V)
            col_ok = cols < VOCAB
            col_at = cols.to(tl.int64) * HIDDEN
            acc = _logits_tile(h_ptr, w_ptr, row_at, col_at, row_ok, col_ok, HIDDEN, BLOCK_M, BLOCK_V, BLOCK_K,
                               UPCAST)
            logits = tl.where(col_ok[None, :], acc, -float("inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
            m = m_new
            picked += tl.sum(tl.where(cols[None, :] == target[:, None], acc, 0.0), axis=1)
        out = tl.program_id(1) * n_rows + rows
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(d_ptr + out, d, mask=row_ok)
        tl.store(picked_ptr + out, picked, mask=row_ok)

    @triton.jit
    def _grad_kernel(h_ptr, w_ptr, target_ptr, blocks_ptr, lse_ptr, dh_ptr, dw_ptr, n_rows, v_start, v_end,
                     ignore_index, scale, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        # One (BLOCK_M rows x BLOCK_V words) tile of the logits, recomputed on chip, turned into its
        # gradient g = (softmax - onehot) x scale; then its share of both input gradients, added
        # into float32 accumulators: dh[rows] += g @ W[words], dW[words] += g.T @ h[rows].  dw_ptr
        # points at the accumulator of words v_start .. v_end; blocks_ptr lists the row blocks.
        rows = tl.load(blocks_ptr + tl.program_id(0)) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_at = rows.to(tl.int64) * HIDDEN  # 64-bit: 128k words x 16k wide passes 2^31
        cols = v_start + tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = rows < n_rows
        col_ok = cols < v_end
        col_at = cols.to(tl.int64) * HIDDEN
        target = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        acc = _logits_tile(h_ptr, w_ptr, row_at, col_at, row_ok, col_ok, HIDDEN, BLOCK_M, BLOCK_V, BLOCK_K, UPCAST)
        keep = row_ok & (target != ignore_index)
        g = tl.exp(acc - lse[:, None]) - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
        g = tl.where(keep[:, None] & col_ok[None, :], g * scale, 0.0)
        if not UPCAST:
            g = g.to(h_ptr.dtype.element_ty)  # the tensor cores' format, as the forward's GEMM
        # Two passes over the hidden width, one a gradient: fewer values live at once (Triton 3.9
        # spilled on sm_80 with both products in one loop).
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HIDDEN
            w_tile = tl.load(w_ptr + col_at[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                             other=0.0)
            if UPCAST:
                dh = tl.dot(g, w_tile.to(tl.float32), input_precision="ieee")
            else:
                dh = tl.dot(g, w_tile)
            tl.atomic_add(dh_ptr + row_at[:, None] + ks[None, :], dh, mask=row_ok[:, None] & k_ok[None, :])
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HIDDEN
            h_tile = tl.load(h_ptr + row_at[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                             other=0.0)
            if UPCAST:
                dw = tl.dot(tl.trans(g), h_tile.to(tl.float32), input_precision="ieee")
            else:
                dw = tl.dot(tl.trans(g), h_tile)
            tl.atomic_add(dw_ptr + (col_at - v_start * HIDDEN)[:, None] + ks[None, :], dw,
                          mask=col_ok[:, None] & k_ok[None, :])


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                                   reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)`` in float32: what the fused op replaces."""
    return F.cross_entropy(hidden.float() @ weight.float().t(), target, ignore_index=ignore_index, reduction=reduction)


def _triton_loss_and_grads(h: Tensor, w: Tensor, t: Tensor, scale: float, ignore_index: int
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's loss, d loss / d h and d loss / d w (``scale`` folded in) by the two kernels;
    ``h`` (N, H), ``w`` (V, H) contiguous, ``t`` (N,)."""
    n, hidden = h.shape
    vocab = w.shape[0]
    f32 = torch.float32
    upcast = INTERPRET or h.dtype == f32 or h.dtype != w.dtype
    dh = torch.zeros(n, hidden, dtype=f32, device=h.device)
    dw = torch.zeros(w.shape, dtype=f32, device=w.device) if w.dtype == f32 else torch.empty_like(w)
    block_m, block_v, block_k = TILES["float" if f32 in (h.dtype, w.dtype) else "half"]
    blocks = dict(BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_K=block_k, UPCAST=upcast)
    word_blocks = triton.cdiv(vocab, block_v)
    active = _active_row_blocks(t, ignore_index, block_m)
    row_blocks = active.numel()
    losses = torch.zeros(n, dtype=f32, device=h.device)
    if row_blocks == 0:  # every target ignored: no loss, no gradient
        return losses, dh.to(h.dtype), dw.zero_()
    # 8k tokens are 64 blocks of rows, fewer than an H100's 132 SMs: the vocabulary is split too,
    # into enough parts for two programs an SM.
    if LSE_PATH == "gemm":
        lse, picked = _vocab_slice_lse(h, w, t, ignore_index, upcast)
    else:
        splits = min(word_blocks, triton.cdiv(2 * multiprocessors(h.device), row_blocks))
        per_split = triton.cdiv(word_blocks, splits)
        splits = triton.cdiv(word_blocks, per_split)
        m, d, picks = (torch.zeros(splits, n, dtype=f32, device=h.device) for _ in range(3))  # skipped rows: 0
        launch(_lse_kernel, (row_blocks, splits), h, w, t, active, m, d, picks, n, values=WARPS_VALUES,
               VOCAB=vocab, HIDDEN=hidden, SPLIT_BLOCKS=per_split, **blocks)
        top = m.max(dim=0).values
        lse, picked = top + (d * torch.exp(m - top)).sum(dim=0).log(), picks.sum(dim=0)
    losses = torch.where(t != ignore_index, lse - picked, losses)
    if GRAD_PATH == "gemm":
        _vocab_slice_grads(h, w, t, lse, scale, ignore_index, dh, dw, upcast)
        return losses, dh.to(h.dtype), dw
    step = vocab if w.dtype == f32 else max(block_v, DW_SLICE_BYTES // (4 * hidden) // block_v * block_v)
    for v0 in range(0, vocab, step):
        v1 = min(vocab, v0 + step)
        acc = dw[v0:v1] if w.dtype == f32 else torch.zeros(v1 - v0, hidden, dtype=f32, device=w.device)
        launch(_grad_kernel, (row_blocks, triton.cdiv(v1 - v0, block_v)), h, w, t, active, lse, dh, acc, n, v0, v1,
               int(ignore_index), float(scale), values=WARPS_VALUES, HIDDEN=hidden, **blocks)
        if w.dtype != f32:
            dw[v0:v1].copy_(acc)
    return losses, dh.to(h.dtype), dw


def _vocab_slice_lse(h: Tensor, w: Tensor, t: Tensor, ignore_index: int, upcast: bool) -> tuple[Tensor, Tensor]:
    """Each row's log-sum-exp and target logit (float32; rows whose target is ignored: 0 and 0), a
    slice of the vocabulary at a time by the GEMM library, the slices' log-sum-exps combined as they
    come.  The logits as :func:`_vocab_slice_grads` makes them; extra memory ``GRAD_SLICE_BYTES``."""
    keep = t != ignore_index
    rows = keep.nonzero()[:, 0]
    like = torch.float32 if upcast else h.dtype
    hk, tk = h[rows].to(like), t[rows]
    lse_k = torch.full((rows.numel(),), -float("inf"), dtype=torch.float32, device=h.device)
    picked_k = torch.zeros(rows.numel(), dtype=torch.float32, device=h.device)
    step = max(128, GRAD_SLICE_BYTES // (8 * max(1, rows.numel())) // 128 * 128)
    at = torch.arange(rows.numel(), device=h.device)
    for v0 in range(0, w.shape[0], step):
        v1 = min(w.shape[0], v0 + step)
        logits = _mm_float32(hk, w[v0:v1].to(like).t())
        lse_k = torch.logaddexp(lse_k, torch.logsumexp(logits, dim=1))
        hit = (tk >= v0) & (tk < v1)
        picked_k[hit] = logits[at[hit], tk[hit] - v0]
    lse = torch.zeros(t.numel(), dtype=torch.float32, device=h.device)
    picked = torch.zeros_like(lse)
    lse[rows], picked[rows] = lse_k, picked_k
    return lse, picked


def _vocab_slice_grads(h: Tensor, w: Tensor, t: Tensor, lse: Tensor, scale: float, ignore_index: int,
                       dh: Tensor, dw: Tensor, upcast: bool) -> None:
    """Both gradients a slice of the vocabulary at a time, by the GEMM library, with the kernels'
    roundings: the slice's logits of the rows that count in float32 (from 16-bit products, as
    ``tl.dot`` makes them), their gradient rounded to the inputs' dtype, then ``dW[slice] = g.T @ h``
    (written once) and ``dh += g @ W[slice]`` (float32).  ``upcast`` (the interpreter, float32 or
    mixed inputs): every product in float32.  Extra memory: ``GRAD_SLICE_BYTES`` for a slice's logits
    and gradient."""
    keep = t != ignore_index
    rows = keep.nonzero()[:, 0]
    every = rows.numel() == t.numel()
    like = torch.float32 if upcast else h.dtype
    hk = (h if every else h[rows]).to(like)
    tk, lse_k = (t, lse) if every else (t[rows], lse[rows])
    acc = dh if every else torch.zeros(rows.numel(), h.shape[1], dtype=torch.float32, device=h.device)
    step = max(128, GRAD_SLICE_BYTES // (8 * max(1, rows.numel())) // 128 * 128)
    at = torch.arange(rows.numel(), device=h.device)
    for v0 in range(0, w.shape[0], step):
        v1 = min(w.shape[0], v0 + step)
        wc = w[v0:v1].to(like)
        p = _mm_float32(hk, wc.t())
        p.sub_(lse_k[:, None]).exp_()
        hit = (tk >= v0) & (tk < v1)
        p[at[hit], tk[hit] - v0] -= 1.0
        g = p.mul_(scale).to(like)
        del p
        if dw.dtype == like:
            torch.mm(g.t(), hk, out=dw[v0:v1])
        else:
            dw[v0:v1] = g.t() @ hk
        acc += _mm_float32(g, wc)
    if not every:
        dh[rows] = acc


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


def _active_row_blocks(target: Tensor, ignore_index: int, block_m: int) -> Tensor:
    """The blocks of ``block_m`` rows with a target that counts (int32), the kernels' grid: a
    fine-tuning batch whose prompts are masked leaves whole blocks ignored, and their tiles are
    skipped, not computed as zeros.  ``meta`` tensors (the compile check) hold no targets: every
    block."""
    blocks = triton.cdiv(target.numel(), block_m)
    if target.device.type == "meta":
        return torch.arange(blocks, dtype=torch.int32, device=target.device)
    kept = F.pad(target != ignore_index, (0, blocks * block_m - target.numel())).view(blocks, block_m)
    return kept.any(dim=1).nonzero().flatten().to(torch.int32)


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
    """What :func:`_triton_loss_and_grads` returns, by PyTorch a chunk of tokens at a time."""
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


@torch.library.custom_op("mfuscope::linear_cross_entropy", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden, d loss / d weight)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    valid = int((t != ignore_index).sum())
    scale = 1.0 / valid if reduction == "mean" and valid else 1.0
    how = _triton_loss_and_grads if use_triton(h) else _chunked_loss_and_grads
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
