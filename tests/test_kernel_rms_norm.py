"""``mfuscope.kernels.rms_norm`` (Triton: CPU tensors through the interpreter, CUDA ones where a GPU is
visible) against the reference trainer's RMSNorm in float32: output, input gradient and weight
gradient, per dtype, over awkward shapes and layouts; the custom op's registrations; torch.compile
without graph breaks; no access outside the tensors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from mfuscope.kernels import rms_norm, rms_norm_reference  # noqa: E402
from mfuscope.kernels._dispatch import use_triton  # noqa: E402
from mfuscope.tests.kernel_checks import (  # noqa: E402
    DTYPES,
    assert_close,
    assert_compiles_like_eager,
    guarded,
    guards_intact,
    tolerance,
)

SHAPES = [(1, 8), (3, 4095), (64, 128), (2, 3, 1000)]


def _truth(x, w, dy, eps=1e-6):
    """Output and gradients of the reference in float32 on the CPU, from the (rounded) inputs upcast."""
    xf, wf = x.detach().float().cpu().requires_grad_(), w.detach().float().cpu().requires_grad_()
    y = rms_norm_reference(xf, wf, eps)
    y.backward(dy.float().cpu())
    return y.detach(), xf.grad, wf.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_match_the_reference(shape, dtype, device):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    assert use_triton(x)  # the kernel runs, not the reference
    y = rms_norm(x, w)
    y.backward(dy)
    y_true, dx_true, dw_true = _truth(x, w, dy)
    d = shape[-1]
    rows = x.numel() // d
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    assert_close(y, y_true, tolerance(dtype, d), "y")
    assert_close(x.grad, dx_true, tolerance(dtype, d), "dx")
    assert_close(w.grad, dw_true, tolerance(dtype, rows), "dweight")


def test_non_contiguous_input_and_gradient(device):
    base = torch.randn(6, 2 * 257).to(device)
    x = base[:, ::2].requires_grad_()  # every other column: a strided view
    w = (torch.rand(257) + 0.5).to(device)
    dy = torch.randn(257, 6).to(device).t()
    assert not x.is_contiguous() and not dy.is_contiguous()
    y = rms_norm(x, w)
    y.backward(dy)
    y_true, dx_true, _ = _truth(x, w, dy)
    assert_close(y, y_true, tolerance(torch.float32, 257), "y")
    assert_close(x.grad, dx_true, tolerance(torch.float32, 257), "dx")


def test_the_kernels_stay_inside_their_tensors(device):
    """Inputs and outputs inside NaN-filled buffers: a read outside would put NaN into the result,
    a write outside would overwrite the NaN around it."""
    import triton

    from mfuscope.kernels.rms_norm import _rms_norm_backward_kernel, _rms_norm_forward_kernel

    rows, cols = 5, 33
    block = triton.next_power_of_2(cols)
    x, xb = guarded((rows, cols), torch.float32, torch.randn(rows, cols), device=device)
    w, wb = guarded((cols,), torch.float32, torch.rand(cols) + 0.5, device=device)
    y, yb = guarded((rows, cols), torch.float32, device=device)
    rstd, rb = guarded((rows,), torch.float32, device=device)
    # a part-filled last tile; no residual (the pointers it would use are x's and y's, never touched)
    _rms_norm_forward_kernel[(3,)](x, x, y, w, y, rstd, rows, cols, 1e-6, BLOCK=block, TILE=2, ADD=False)
    assert not torch.isnan(y).any() and not torch.isnan(rstd).any()
    assert all(guards_intact(b, n) for b, n in ((xb, rows * cols), (wb, cols), (yb, rows * cols), (rb, rows)))
    dy, dyb = guarded((rows, cols), torch.float32, torch.randn(rows, cols), device=device)
    rstd_in, rib = guarded((rows,), torch.float32, rstd, device=device)
    dx, dxb = guarded((rows, cols), torch.float32, device=device)
    partial, pb = guarded((3, cols), torch.float32, device=device)
    _rms_norm_backward_kernel[(3,)](dy, dy, x, w, rstd_in, dx, partial, rows, cols, ROWS=2, BLOCK=block, TILE=2,
                                    ADD=False)
    assert not torch.isnan(dx).any() and not torch.isnan(partial).any()
    assert all(guards_intact(b, n) for b, n in ((dxb, rows * cols), (pb, 3 * cols), (dyb, rows * cols), (rib, rows)))


def test_custom_op_registrations_hold(device):
    x, w = torch.randn(4, 64, device=device, requires_grad=True), torch.rand(64, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.mfuscope.rms_norm_forward.default, (x, w, 1e-6))
    rstd = torch.rand(4, device=device) + 0.5
    dy = torch.randn(4, 64, device=device)
    torch.library.opcheck(torch.ops.mfuscope.rms_norm_backward.default, (dy, x.detach(), w.detach(), rstd))


def test_torch_compile_traces_it_without_a_graph_break(device):
    x, w = torch.randn(4, 96, device=device, requires_grad=True), torch.rand(96, device=device, requires_grad=True)

    assert_compiles_like_eager(lambda x, w: rms_norm(x, w).sum(), x, w)


def test_a_mismatched_weight_is_refused():
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm(torch.randn(2, 8), torch.ones(7))


def test_without_the_interpreter_cpu_tensors_take_the_pytorch_path():
    """A CPU run without TRITON_INTERPRET (any user's laptop): the ops run their PyTorch
    implementation, with the same results."""
    import os
    import subprocess
    import sys

    script = ("import torch\n"
              "from mfuscope.kernels import rms_norm, rms_norm_reference, swiglu, swiglu_reference\n"
              "from mfuscope.kernels._dispatch import use_triton\n"
              "x = torch.randn(3, 65); w = torch.rand(65) + 0.5\n"
              "assert not use_triton(x)\n"
              "assert torch.allclose(rms_norm(x, w), rms_norm_reference(x, w), rtol=1e-5, atol=1e-6)\n"
              "assert torch.allclose(swiglu(x, x.flip(0)), swiglu_reference(x, x.flip(0)), rtol=1e-6, atol=1e-7)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
