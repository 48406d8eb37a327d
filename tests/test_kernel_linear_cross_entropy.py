"""``mfuscope.kernels.fused_linear_cross_entropy`` against ``F.cross_entropy(hidden @ weight.T)`` in
float32: its GPU path (slices of the vocabulary; CPU tensors take it under the interpreter setting,
CUDA ones where a GPU is visible) and its CPU path (chunks of tokens), the loss and both gradients per
dtype, one row and many, odd hidden and vocabulary sizes, many slices, non-contiguous inputs, ignored
targets left out of the GEMMs, every target ignored, sum reduction, autocast; registrations;
torch.compile; the extra memory of both paths, measured."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from mfuscope.kernels import fused_linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402
from mfuscope.kernels import linear_cross_entropy as module  # noqa: E402
from mfuscope.tests.kernel_checks import DTYPES, assert_close, tolerance  # noqa: E402


def _case(dtype, n=37, h=24, v=1003, ignored=(), seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, h, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    target[list(ignored)] = -100
    return hidden, weight, target.to(device)


def _truth(hidden, weight, target, reduction="mean"):
    """The reference's loss and gradients in float32 on the CPU."""
    h, w = hidden.detach().float().cpu().requires_grad_(), weight.detach().float().cpu().requires_grad_()
    loss = linear_cross_entropy_reference(h, w, target.cpu(), reduction=reduction)
    loss.backward()
    return loss.detach(), h.grad, w.grad


SHAPES = [(37, 24, 1003), (1, 24, 1003)]
#: Each shape in each dtype; a long odd hidden size in both, 4,095 in float32 and 1,023 in 16 bits;
#: the odd 32k vocabulary in float32 only.
CASES = ([(d, s) for s in SHAPES for d in DTYPES]
         + [(d, (5, 4095 if d == torch.float32 else 1023, 300)) for d in DTYPES]
         + [(torch.float32, (33, 24, 32003))])


def _assert_like_the_reference(hidden, weight, target, rel, dw_rel=None):
    """The fused loss and both gradients against :func:`_truth`, within ``rel`` (``dw_rel`` for the
    weight's)."""
    loss = fused_linear_cross_entropy(hidden, weight, target)
    loss.backward()
    loss_true, dh_true, dw_true = _truth(hidden, weight, target)
    assert_close(loss, loss_true, rel, "loss")
    assert_close(hidden.grad, dh_true, rel, "dhidden")
    assert_close(weight.grad, dw_true, rel if dw_rel is None else dw_rel, "dweight")


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=lambda c: str(c) if isinstance(c, torch.dtype)
                         else "rows{}_hidden{}_vocab{}".format(*c))
def test_the_gpu_path_matches_the_reference(dtype, shape, device):
    n, h, v = shape
    hidden, weight, target = _case(dtype, n, h, v, ignored=(3, 20) if n > 20 else (), device=device)
    assert module._takes_gpu_path(hidden)  # the vocabulary slices run, not the CPU path's chunks
    # bf16 inputs: the gradients are rounded to bf16 once; the loss sums float32 products over h
    rel = tolerance(dtype, max(h, v)) * (4 if dtype == torch.bfloat16 else 1)
    _assert_like_the_reference(hidden, weight, target, rel, rel * 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_vocabulary_is_taken_in_slices(dtype, monkeypatch, device):
    """A slice budget of 128 words for the 35 rows that count: vocabulary 1,003 in 8 slices, the last
    part-filled; the slices' log-sum-exps combine and each slice's weight gradient is written once."""
    calls = []
    mm = module._mm_float32
    monkeypatch.setattr(module, "_mm_float32", lambda a, b: calls.append(b.shape) or mm(a, b))
    hidden, weight, target = _case(dtype, ignored=(3, 20), device=device)
    monkeypatch.setattr(module, "GRAD_SLICE_BYTES", 8 * 35 * 128)
    rel = tolerance(dtype, 1003) * (4 if dtype == torch.bfloat16 else 1)
    _assert_like_the_reference(hidden, weight, target, rel, rel * 2)
    # the log-sum-exp pass and the gradient pass (logits, then g @ W): 8 slices each
    assert sorted({b[1] for b in calls if b[0] == 24}) == [107, 128]  # W slice transposed: (24, words)
    assert len(calls) == 8 + 2 * 8


def test_rows_without_a_counted_target_are_left_out_of_the_gemms(monkeypatch, device):
    """A fine-tuning batch masks its prompts: rows whose targets are ``ignore_index`` take no part in
    the GEMMs, and the result is what the reference gives.  150 rows, the first 70 ignored: every
    product runs on 80 rows."""
    rows = []
    mm = module._mm_float32
    monkeypatch.setattr(module, "_mm_float32", lambda a, b: rows.append(a.shape[0]) or mm(a, b))
    hidden, weight, target = _case(torch.float32, n=150, ignored=range(70), device=device)
    _assert_like_the_reference(hidden, weight, target, tolerance(torch.float32, 1003))
    assert not hidden.grad[:70].any()
    assert set(rows) == {80}


def test_autocast_takes_the_inputs_in_its_dtype(device):
    """Under autocast the op runs in autocast's dtype, as ``F.linear`` would: float32 master weights
    and activations reach it rounded to bf16, and their gradients come back float32.  By hand: the
    loss equals the op's on the bf16-rounded inputs exactly (same arithmetic)."""
    hidden, weight, target = _case(torch.float32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, target)
    loss.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    rounded = fused_linear_cross_entropy(hidden.detach().bfloat16(), weight.detach().bfloat16(), target)
    assert loss.item() == rounded.item()


def test_non_contiguous_inputs(device):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 2 * 40, generator=g).to(device)[:, ::2].requires_grad_()  # every other column
    weight = (0.3 * torch.randn(40, 301, generator=g)).to(device).t().requires_grad_()  # (vocab, hidden), transposed
    target = torch.randint(0, 301, (9,), generator=g).to(device)
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    _assert_like_the_reference(hidden, weight, target, tolerance(torch.float32, 301))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_rows", [1, 8, 64], ids=lambda r: f"{r}rows_a_chunk")
def test_the_cpu_path_matches_the_reference(dtype, chunk_rows, monkeypatch):
    """CPU tensors outside the interpreter take the PyTorch path, a chunk of tokens at a time."""
    hidden, weight, target = _case(dtype, ignored=(3, 20))
    monkeypatch.setattr(module, "_takes_gpu_path", lambda h: False)
    monkeypatch.setattr(module, "CHUNK_BYTES", chunk_rows * 4 * weight.shape[0])
    monkeypatch.setattr(module, "MIN_ROWS", 1)
    # bf16 inputs: the matmul rounds each logit to bf16 before the softmax, as eager bf16 does
    rel = tolerance(dtype, weight.shape[1]) * (4 if dtype == torch.bfloat16 else 1)
    _assert_like_the_reference(hidden, weight, target, rel, rel * 2)


def test_sum_reduction_and_every_target_ignored(device):
    hidden, weight, target = _case(torch.float32, device=device)
    loss = fused_linear_cross_entropy(hidden, weight, target, reduction="sum")
    loss.backward()
    loss_true, dh_true, _ = _truth(hidden, weight, target, "sum")
    assert_close(loss, loss_true, tolerance(torch.float32, 24 * 37), "loss")
    assert_close(hidden.grad, dh_true, tolerance(torch.float32, 1003), "dhidden")
    hidden.grad = weight.grad = None
    none = torch.full_like(target, -100)
    loss = fused_linear_cross_entropy(hidden, weight, none)
    loss.backward()
    assert loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_registrations_and_compile(device):
    hidden, weight, target = _case(torch.float32, n=9, v=101, device=device)
    torch.library.opcheck(torch.ops.mfuscope.linear_cross_entropy.default, (hidden, weight, target, -100, "mean"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

    def f(h, w):
        return fused_linear_cross_entropy(h, w, target)

    torch.compile(f, fullgraph=True, backend="aot_eager")(hidden, weight).backward()
    dh = hidden.grad.clone()
    hidden.grad = weight.grad = None
    f(hidden, weight).backward()
    assert torch.equal(dh, hidden.grad)


def test_misuse_is_refused():
    hidden, weight, target = _case(torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        fused_linear_cross_entropy(hidden, weight[:, :5], target)
    with pytest.raises(ValueError, match="forward-only"):
        fused_linear_cross_entropy(hidden, weight, target, reduction="none")


def _memory(tmp_path, *args: str) -> dict:
    """``benchmarks/bench_ce_memory.py`` run with ``args``: its JSON."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak resident memory is read from Linux's /proc (clear_refs, VmHWM)")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ce_memory.py"
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, str(script), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def _same_loss(a: float, b: float, vocab: int) -> bool:
    """Both in float32: the log-sum-exp over the vocabulary reassociated, sqrt(V) x 4 eps32 relative."""
    return abs(a - b) <= 4 * vocab ** 0.5 * 2**-23 * abs(a)


def test_extra_memory_of_the_cpu_path_is_a_chunk_not_the_logits(tmp_path):
    """The extra memory the loss takes beyond its inputs and the gradients it returns, measured by
    ``benchmarks/bench_ce_memory.py`` (peak resident memory of fresh processes): at the issue's 128k
    vocabulary eager holds the float32 logits and their gradient, 2 x 0.75 GiB at least at 1,536 tokens;
    the CPU path a chunk of 64 rows, 31 MiB, and its temporaries.  The issue asks for at least 10x
    less at 4k tokens and hidden 4096 (the benchmark's default, minutes of matmuls on 2 cores,
    measured in docs/kernels.md: 3,954 against 135 MiB); here 1,536 tokens and hidden 64 -- the CPU
    path's extra memory grows with neither, eager's with the tokens, so the ratio here is the
    harder one."""
    result = _memory(tmp_path, "--tokens", "1536", "--hidden", "64", "--ways", "eager,fused")
    eager, fused = result["eager"]["extra_bytes"], result["fused"]["extra_bytes"]
    assert eager >= 2 * result["logits_bytes"]  # the measurement sees eager's logits and their gradient
    assert fused * 10 <= eager, result
    assert _same_loss(result["eager"]["loss"], result["fused"]["loss"], 128256)


def test_extra_memory_of_the_gpu_path_is_its_slice_budget(tmp_path):
    """The GPU path (run on the CPU) with a 4 MiB slice budget, measured as above: 512 tokens and a
    32k vocabulary, where eager holds 2 x 62.5 MiB of float32 logits and their gradient.  By hand the
    sliced way holds one slice's float32 logits at a time (2 MiB here: 1,024 words, their gradient
    made in place), a row's log-sum-exp, pick and loss, and its float32 hidden gradient (128 KiB).
    Each slice's buffer is freed and made again; the benchmark fixes glibc's mmap threshold so
    that a freed one leaves resident memory (measured 4.5-4.6 MiB; with glibc's default, which
    keeps freed buffers for reuse, 4.7-6 MiB here and 22 MiB in a loaded CI run), and resident
    memory can grow in 2 MiB huge pages: the bound is 4 budgets and two huge pages, and at least
    5x less than eager."""
    result = _memory(tmp_path, "--tokens", "512", "--hidden", "64", "--vocab", "32003", "--ways", "eager,sliced",
                     "--slice-mib", "4")
    eager, sliced = result["eager"]["extra_bytes"], result["sliced"]["extra_bytes"]
    assert eager >= 2 * result["logits_bytes"]
    assert sliced <= (4 * 4 + 2 * 2) * 2**20, result
    assert sliced * 5 <= eager, result
    assert _same_loss(result["eager"]["loss"], result["sliced"]["loss"], 32003)


def test_cpu_chunks_are_wide_enough_for_their_gemms():
    """A CPU chunk takes ``CHUNK_BYTES`` of float32 logits, or 64 rows where that is less (GEMMs at 8
    rows ran 4x slower), and never more rows than there are."""
    from mfuscope.kernels.linear_cross_entropy import CHUNK_BYTES, chunk_rows

    assert chunk_rows(8192, 128256) == 64
    assert chunk_rows(8192, 1000) == CHUNK_BYTES // 4000  # a small vocabulary
    assert chunk_rows(3, 128256) == 3
