"""``mfuscope.kernels.add_rms_norm`` (Triton: CPU tensors through the interpreter, CUDA ones where a
GPU is visible) against the sum and the reference RMSNorm in float32: both outputs, and the
gradients of x, residual and weight when both outputs carry a gradient (the normed row goes to the
sublayer, the sum on down the residual stream); registrations; torch.compile; no access outside the
tensors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from mfuscope.kernels import add_rms_norm, add_rms_norm_reference  # noqa: E402
from mfuscope.kernels._dispatch import use_triton  # noqa: E402
from mfuscope.tests.kernel_checks import (  # noqa: E402
    DTYPES,
    assert_close,
    assert_compiles_like_eager,
    guarded,
    guards_intact,
    tolerance,
)

SHAPES = [(1, 8), (3, 4095), (2, 5, 256)]


def _inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    r = torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    dh = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return x, r, w, dy, dh


def _upcast(*tensors):
    """The truth's inputs: float32 leaves on the CPU, whatever device the kernels ran on."""
    return tuple(t.detach().float().cpu().requires_grad_() for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_both_outputs_and_every_gradient_match_the_reference(shape, dtype, device):
    x, r, w, dy, dh = _inputs(shape, dtype, sum(shape), device)
    assert use_triton(x)
    y, h = add_rms_norm(x, r, w)
    torch.autograd.backward((y, h), (dy, dh))
    xf, rf, wf = _upcast(x, r, w)
    y_true, h_true = add_rms_norm_reference(xf, rf, wf)
    torch.autograd.backward((y_true, h_true), (dy.float().cpu(), dh.float().cpu()))
    d, rows = shape[-1], x.numel() // shape[-1]
    # h is one addition, then one rounding; y and the gradients reduce over the row
    assert_close(h, h_true.detach(), tolerance(dtype), "h")
    assert_close(y, y_true.detach(), tolerance(dtype, d), "y")
    assert_close(x.grad, xf.grad, tolerance(dtype, d), "dx")
    assert_close(r.grad, rf.grad, tolerance(dtype, d), "dresidual")
    assert_close(w.grad, wf.grad, tolerance(dtype, rows), "dweight")


def test_only_the_normed_output_used(device):
    x, r, w, dy, _ = _inputs((4, 100), torch.float32, 1, device)
    add_rms_norm(x, r, w)[0].backward(dy)
    xf, rf, wf = _upcast(x, r, w)
    add_rms_norm_reference(xf, rf, wf)[0].backward(dy.cpu())
    assert_close(x.grad, xf.grad, tolerance(torch.float32, 100), "dx")


def test_the_kernels_stay_inside_their_tensors(device):
    import triton

    from mfuscope.kernels.rms_norm import _rms_norm_backward_kernel, _rms_norm_forward_kernel

    rows, cols = 3, 45
    block = triton.next_power_of_2(cols)
    n = rows * cols
    x, xb = guarded((rows, cols), torch.float32, torch.randn(rows, cols), device=device)
    r, rb = guarded((rows, cols), torch.float32, torch.randn(rows, cols), device=device)
    w, wb = guarded((cols,), torch.float32, torch.rand(cols) + 0.5, device=device)
    y, yb = guarded((rows, cols), torch.float32, device=device)
    h, hb = guarded((rows, cols), torch.float32, device=device)
    rstd, sb = guarded((rows,), torch.float32, device=device)
    _rms_norm_forward_kernel[(2,)](x, r, h, w, y, rstd, rows, cols, 1e-6, BLOCK=block, TILE=2, ADD=True)
    assert not any(torch.isnan(t).any() for t in (y, h, rstd))
    assert all(guards_intact(b, k) for b, k in ((xb, n), (rb, n), (wb, cols), (yb, n), (hb, n), (sb, rows)))
    dy, dyb = guarded((rows, cols), torch.float32, torch.randn(rows, cols), device=device)
    dh, dhb = guarded((rows, cols), torch.float32, torch.randn(rows, cols), device=device)
    dx, dxb = guarded((rows, cols), torch.float32, device=device)
    partial, pb = guarded((2, cols), torch.float32, device=device)
    h_in, hib = guarded((rows, cols), torch.float32, h, device=device)
    rstd_in, rib = guarded((rows,), torch.float32, rstd, device=device)
    _rms_norm_backward_kernel[(2,)](dy, dh, h_in, w, rstd_in, dx, partial, rows, cols, ROWS=2, BLOCK=block,
                                    TILE=2, ADD=True)
    assert not torch.isnan(dx).any() and not torch.isnan(partial).any()
    assert all(guards_intact(b, k) for b, k in ((dyb, n), (dhb, n), (dxb, n), (pb, 2 * cols), (hib, n), (rib, rows)))


def test_registrations_and_compile(device):
    x, r, w, dy, dh = _inputs((4, 64), torch.float32, 2, device)
    torch.library.opcheck(torch.ops.mfuscope.add_rms_norm_forward.default, (x, r, w, 1e-6))

    def f(x, r, w):
        y, h = add_rms_norm(x, r, w)
        return (y * dy).sum() + (h * dh).sum()

    assert_compiles_like_eager(f, x, r, w)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 9), torch.ones(8))
