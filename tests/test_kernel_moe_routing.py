"""``mfuscope.kernels.moe_permute`` and ``moe_unpermute`` (Triton: CPU tensors through the interpreter,
CUDA ones where a GPU is visible) against the routing written out by hand: every token's rows in its
experts' slots, and back as the weighted sum, in float32; both gradients per dtype (the router
weights' too); one token, top-1 and top-k, odd widths, strided tokens; registrations; torch.compile;
no access outside the tensors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from mfuscope.kernels import moe_permute, moe_positions, moe_unpermute  # noqa: E402
from mfuscope.kernels._dispatch import use_triton  # noqa: E402
from mfuscope.tests.kernel_checks import (  # noqa: E402
    DTYPES,
    assert_close,
    assert_compiles_like_eager,
    guarded,
    guards_intact,
    tolerance,
)

SHAPES = [(1, 1, 8), (7, 2, 1001), (33, 4, 64)]  # tokens, top_k, hidden


def _routing(t, k, n_experts=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    expert = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(t)])  # k distinct a token
    weight = torch.rand(t, k, generator=g)
    return expert, weight / weight.sum(-1, keepdim=True)


def _truth(tokens, expert, weight, dy):
    """A loop over experts and tokens, written from the definition: expert e's rows are the tokens
    routed to it in token order; each token's output is the weighted sum of its rows (here the rows
    are scaled by their slot number + 1, standing in for the experts' work).  On the CPU."""
    x, w = tokens.detach().double().cpu().requires_grad_(), weight.detach().double().cpu().requires_grad_()
    expert, dy = expert.cpu(), dy.cpu()
    t, k = expert.shape
    slots = [(tok, j) for e in range(int(expert.max()) + 1) for tok in range(t) for j in range(k)
             if expert[tok, j] == e]
    rows = torch.stack([x[tok] * 2.0 ** (i % 4) for i, (tok, _) in enumerate(slots)])
    where = {choice: i for i, choice in enumerate(slots)}
    y = torch.stack([sum(w[tok, j] * rows[where[(tok, j)]] for j in range(k)) for tok in range(t)])
    y.backward(dy.double())
    return rows.detach(), y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "tokens{}_top{}_hidden{}".format(*s))
def test_permute_and_unpermute_match_the_routing_written_out(shape, dtype, device):
    t, k, d = shape
    g = torch.Generator().manual_seed(d)
    tokens = torch.randn(t, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    expert, weight = _routing(t, k)
    weight = weight.to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
    assert use_triton(tokens)
    positions = moe_positions(expert.to(device))
    rows = moe_permute(tokens, positions)
    scale = (2.0 ** (torch.arange(t * k) % 4)).to(device=device, dtype=dtype)[:, None]  # each slot's "expert"
    y = moe_unpermute(rows * scale, positions, weight)
    y.backward(dy)
    rows_true, y_true, dx_true, dw_true = _truth(tokens, expert, weight, dy)
    # exact copies, in the experts' order
    assert torch.equal((rows.detach().double() * scale.double()).cpu(), rows_true)
    # y: a float32 sum of k products, rounded once; d tokens: the slots' gradients are rounded once
    # more before their sum; d weight: a float32 dot product over d, rounded once.
    assert_close(y, y_true, tolerance(dtype, k), "y")
    assert_close(tokens.grad, dx_true, 2 * tolerance(dtype, k), "dtokens")
    assert_close(weight.grad, dw_true, tolerance(dtype, d), "dweight")


def test_the_pytorch_path_matches_the_kernels(monkeypatch, device):
    """CPU tensors outside the interpreter take the PyTorch path: the same results as the kernels on
    ``device`` (the PyTorch path run on CPU copies of the inputs)."""
    from mfuscope.kernels import moe_routing as module

    tokens = torch.randn(7, 30)
    expert, weight = _routing(7, 2)

    def run(device):
        x, w = (t.to(device, copy=True).requires_grad_() for t in (tokens, weight))  # fresh leaves each run
        positions = moe_positions(expert.to(device))
        y = moe_unpermute(moe_permute(x, positions) * 3.0, positions, w)
        y.backward(torch.arange(7 * 30.0, device=device).view(7, 30).cos())
        return y.detach(), x.grad, w.grad

    kernel = run(device)
    monkeypatch.setattr(module, "use_triton", lambda *tensors: False)
    for got, want, what in zip(run("cpu"), kernel, ("y", "dtokens", "dweight")):
        assert_close(got, want, tolerance(torch.float32, 30), what)


def test_strided_tokens_and_top1(device):
    wide = torch.randn(6, 2 * 40).to(device)
    tokens = wide[:, ::2].requires_grad_()
    expert, weight = _routing(6, 1)
    positions = moe_positions(expert.to(device))
    rows = moe_permute(tokens, positions)
    assert torch.equal(rows[positions[:, 0]], tokens.detach())
    moe_unpermute(rows, positions, weight.to(device)).sum().backward()
    assert_close(tokens.grad, weight.expand(6, 40), tolerance(torch.float32), "dtokens")


def test_registrations_and_compile(device):
    tokens = torch.randn(9, 16, device=device, requires_grad=True)
    expert, weight = _routing(9, 2)
    weight = weight.to(device).requires_grad_()
    positions = moe_positions(expert.to(device))
    rows = moe_permute(tokens, positions).detach().requires_grad_()
    torch.library.opcheck(torch.ops.mfuscope.moe_permute.default, (tokens, positions))
    torch.library.opcheck(torch.ops.mfuscope.moe_unpermute.default, (rows, positions, weight))

    def f(x, w):
        return (moe_unpermute(moe_permute(x, positions).sin(), positions, w) ** 2).sum()

    assert_compiles_like_eager(f, tokens, weight)


def test_misuse_is_refused():
    tokens = torch.randn(4, 8)
    expert, weight = _routing(4, 2)
    positions = moe_positions(expert)
    with pytest.raises(ValueError, match="tokens, positions"):
        moe_permute(tokens[:3], positions)
    with pytest.raises(ValueError, match="integer"):
        moe_permute(tokens, positions.float())
    with pytest.raises(ValueError, match="differ in shape"):
        moe_unpermute(moe_permute(tokens, positions), positions, weight[:, :1])


def test_the_kernels_stay_inside_their_tensors(device):
    from mfuscope.kernels.moe_routing import _permute_kernel, _unpermute_backward_kernel, _unpermute_kernel

    t, k, d, block = 3, 2, 20, 32  # a part-filled block
    expert, weight = _routing(t, k)
    positions = moe_positions(expert.to(device))
    x, xb = guarded((t, d), torch.float32, torch.randn(t, d), device=device)
    rows, rb = guarded((t * k, d), torch.float32, device=device)
    _permute_kernel[(t,)](x, positions, rows, D=d, K=k, BLOCK=block)
    assert guards_intact(rb, t * k * d) and torch.isfinite(rows).all()
    r, rib = guarded((t * k, d), torch.float32, rows.clone(), device=device)
    w, wb = guarded((t, k), torch.float32, weight, device=device)
    y, yb = guarded((t, d), torch.float32, device=device)
    _unpermute_kernel[(t,)](r, positions, w, y, D=d, K=k, BLOCK=block)
    assert guards_intact(yb, t * d) and torch.isfinite(y).all()
    dy, dyb = guarded((t, d), torch.float32, torch.randn(t, d), device=device)
    drows, drb = guarded((t * k, d), torch.float32, device=device)
    dw, dwb = guarded((t, k), torch.float32, device=device)
    _unpermute_backward_kernel[(t,)](dy, r, positions, w, drows, dw, D=d, K=k, BLOCK=block)
    assert guards_intact(drb, t * k * d) and guards_intact(dwb, t * k)
    assert torch.isfinite(drows).all() and torch.isfinite(dw).all()
    assert all(guards_intact(b, n) for b, n in ((xb, t * d), (rib, t * k * d), (wb, t * k), (dyb, t * d)))
