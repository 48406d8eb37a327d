"""``mfuscope.kernels.swiglu`` (Triton: CPU tensors through the interpreter, CUDA ones where a GPU is
visible) against ``silu(gate) * up`` in float32: output and both gradients per dtype, odd sizes,
strided inputs; the custom op's registrations; torch.compile without graph breaks; no access outside
the tensors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from mfuscope.kernels import swiglu, swiglu_reference  # noqa: E402
from mfuscope.kernels._dispatch import use_triton  # noqa: E402
from mfuscope.tests.kernel_checks import (  # noqa: E402
    DTYPES,
    assert_close,
    assert_compiles_like_eager,
    guarded,
    guards_intact,
    tolerance,
)

SHAPES = [(1, 1), (3, 1001), (4, 2, 1024), (2050,)]


def _truth(gate, up, dy):
    """Output and gradients of the reference in float32 on the CPU."""
    g, u = gate.detach().float().cpu().requires_grad_(), up.detach().float().cpu().requires_grad_()
    y = swiglu_reference(g, u)
    y.backward(dy.float().cpu())
    return y.detach(), g.grad, u.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_match_the_reference(shape, dtype, device):
    gen = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    # well into both tails of silu
    gate = (3 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype).requires_grad_()
    up = torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    assert use_triton(gate)
    y = swiglu(gate, up)
    y.backward(dy)
    y_true, dg_true, du_true = _truth(gate, up, dy)
    assert y.dtype == dtype and gate.grad.dtype == dtype and up.grad.dtype == dtype
    for got, truth, what in ((y, y_true, "y"), (gate.grad, dg_true, "dgate"), (up.grad, du_true, "dup")):
        assert_close(got, truth, tolerance(dtype), what)


def test_strided_inputs(device):
    wide = torch.randn(5, 2, 300).to(device)
    gate, up = wide[:, 0].requires_grad_(), wide[:, 1].clone().requires_grad_()
    assert not gate.is_contiguous()
    y = swiglu(gate, up)
    y.backward(torch.ones_like(y))
    y_true, dg_true, du_true = _truth(gate, up, torch.ones(5, 300))
    assert_close(y, y_true, tolerance(torch.float32), "y")
    assert_close(gate.grad, dg_true, tolerance(torch.float32), "dgate")


def test_the_kernels_stay_inside_their_tensors(device):
    from mfuscope.kernels.swiglu import BLOCK, _swiglu_backward_kernel, _swiglu_forward_kernel

    n = BLOCK + 37  # a partial last block
    g, gb = guarded((n,), torch.float32, torch.randn(n), device=device)
    u, ub = guarded((n,), torch.float32, torch.randn(n), device=device)
    y, yb = guarded((n,), torch.float32, device=device)
    _swiglu_forward_kernel[(2,)](g, u, y, n, BLOCK=BLOCK)
    assert not torch.isnan(y).any() and all(guards_intact(b, n) for b in (gb, ub, yb))
    dy, dyb = guarded((n,), torch.float32, torch.randn(n), device=device)
    dg, dgb = guarded((n,), torch.float32, device=device)
    du, dub = guarded((n,), torch.float32, device=device)
    _swiglu_backward_kernel[(2,)](dy, g, u, dg, du, n, BLOCK=BLOCK)
    assert not torch.isnan(dg).any() and not torch.isnan(du).any()
    assert all(guards_intact(b, n) for b in (dyb, dgb, dub))


def test_custom_op_registrations_hold(device):
    g, u = (torch.randn(3, 50, device=device, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.mfuscope.swiglu_forward.default, (g, u))
    dy = torch.randn(3, 50, device=device)
    torch.library.opcheck(torch.ops.mfuscope.swiglu_backward.default, (dy, g.detach(), u.detach()))


def test_torch_compile_traces_it_without_a_graph_break(device):
    g, u = (torch.randn(4, 64, device=device, requires_grad=True) for _ in range(2))

    assert_compiles_like_eager(lambda g, u: swiglu(g, u).square().sum(), g, u)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        swiglu(torch.randn(2, 8), torch.randn(2, 9))
