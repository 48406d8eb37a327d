"""``mfuscope.kernels.fused_linear_cross_entropy`` (chunked matmuls, the rows' loss and gradient by
a Triton kernel through the interpreter on CPU) against ``F.cross_entropy(hidden @ weight.T)`` in
float32: the loss and both gradients per dtype, an odd vocabulary, many chunks, ignored targets,
every target ignored, sum reduction; registrations; torch.compile."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from mfuscope.kernels import fused_linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402
from mfuscope.kernels import linear_cross_entropy as module  # noqa: E402
from mfuscope.tests.kernel_checks import DTYPES, assert_close, tolerance  # noqa: E402


def _case(dtype, n=37, h=24, v=1003, ignored=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, h, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    target[list(ignored)] = -100
    return hidden, weight, target


def _truth(hidden, weight, target, reduction="mean"):
    h, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    loss = linear_cross_entropy_reference(h, w, target, reduction=reduction)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_rows", [1, 8, 64], ids=lambda r: f"{r}rows_a_chunk")
def test_loss_and_gradients_match_the_reference(dtype, chunk_rows, monkeypatch):
    hidden, weight, target = _case(dtype, ignored=(3, 20))
    monkeypatch.setattr(module, "CHUNK_BYTES", chunk_rows * 4 * weight.shape[0])
    monkeypatch.setattr(module, "MIN_ROWS", {})
    loss = fused_linear_cross_entropy(hidden, weight, target)
    loss.backward()
    loss_true, dh_true, dw_true = _truth(hidden, weight, target)
    # bf16 inputs: the matmul rounds each logit to bf16 before the softmax, as eager bf16 does
    rel = tolerance(dtype, weight.shape[1]) * (4 if dtype == torch.bfloat16 else 1)
    assert_close(loss, loss_true, rel, "loss")
    assert_close(hidden.grad, dh_true, rel, "dhidden")
    assert_close(weight.grad, dw_true, rel * 2, "dweight")


def test_sum_reduction_and_every_target_ignored():
    hidden, weight, target = _case(torch.float32)
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


def test_registrations_and_compile():
    hidden, weight, target = _case(torch.float32, n=9, v=101)
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


def test_the_row_kernel_stays_inside_its_tensors():
    from mfuscope.kernels.linear_cross_entropy import _ce_rows_kernel
    from mfuscope.tests.kernel_checks import guarded, guards_intact

    rows, vocab = 3, 70
    logits, lb = guarded((rows, vocab), torch.float32, torch.randn(rows, vocab))
    target = torch.tensor([5, -100, 69])  # one read a row, at the row's own index
    loss, sb = guarded((rows,), torch.float32)
    # blocks of 32: the vocabulary's last block is part-filled
    _ce_rows_kernel[(rows,)](logits, target, loss, 1.0, -100, VOCAB=vocab, BLOCK=32)
    assert not torch.isnan(logits).any() and not torch.isnan(loss).any()
    assert guards_intact(lb, rows * vocab) and guards_intact(sb, rows)
    assert loss[1] == 0 and not logits[1].any()  # the ignored row


def test_extra_memory_is_a_chunk_not_the_logits(tmp_path):
    """The extra memory the loss takes beyond its inputs and the gradients it returns, measured by
    ``benchmarks/bench_ce_memory.py`` (peak resident memory of fresh processes): at the issue's 4k
    tokens and 128k vocabulary eager holds the float32 logits and their gradient, 2 x 2 GiB at least;
    the fused op a chunk of 64 rows, 31 MiB, and its temporaries.  The issue asks for at least 10x
    less.  Hidden 64 instead of the issue's 4096 (the benchmark's default, minutes of matmuls on 2
    cores): the extra memory of either way does not grow with it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak resident memory is read from Linux's /proc (clear_refs, VmHWM)")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ce_memory.py"
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, str(script), "--tokens", "4096", "--hidden", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    eager, fused = result["eager"]["extra_bytes"], result["fused"]["extra_bytes"]
    assert eager >= 2 * result["logits_bytes"]  # the measurement sees eager's logits and their gradient
    assert fused * 10 <= eager, result
    # Both in float32: the log-sum-exp over the vocabulary reassociated, sqrt(n) x 4 eps32 relative.
    assert abs(result["eager"]["loss"] - result["fused"]["loss"]) <= 4 * 128256 ** 0.5 * 2**-23 * result["eager"]["loss"]


def test_gpu_chunks_are_wide_enough_for_tensor_core_gemms():
    """A chunk's GEMMs do about ``rows`` FLOP per byte of the bf16 weight they read; on a GPU that
    must pass the ridge point (bf16 peak / HBM bandwidth, from the hardware table) of the GPUs the
    kernels target, or reading the weight once a chunk sets the time.  On CPU the chunk stays at
    ``CHUNK_BYTES`` of float32 logits, or 64 rows where that is less (GEMMs at 8 rows ran 4x slower)."""
    from mfuscope import hardware
    from mfuscope.kernels.linear_cross_entropy import CHUNK_BYTES, chunk_rows

    vocab, tokens = 128256, 8192
    gpu = chunk_rows(tokens, vocab, torch.device("cuda"))
    for name in ("A100", "H100", "H200", "B200"):
        acc = hardware.lookup(name)
        assert gpu >= acc.peak_flops("bf16") / (acc.memory_tbps * 1e12), name
    assert gpu * vocab * 4 <= tokens * vocab * 4 / 8  # still a fraction of the logits
    assert chunk_rows(tokens, vocab, torch.device("cpu")) == 64
    assert chunk_rows(tokens, 1000, torch.device("cpu")) == CHUNK_BYTES // 4000  # a small vocabulary
    assert chunk_rows(3, vocab, torch.device("cuda")) == 3  # never more rows than there are
