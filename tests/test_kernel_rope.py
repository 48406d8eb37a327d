"""``mfuscope.kernels.apply_rope`` (Triton: CPU tensors through the interpreter, CUDA ones where a GPU
is visible): both pair conventions against their float32 references, the interleaved one against
the reference trainer's own RoPE, GQA head counts, a transposed (strided) input, both gradients;
registrations; torch.compile; no access outside the tensors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from mfuscope.kernels import apply_rope, rope_reference  # noqa: E402
from mfuscope.kernels._dispatch import use_triton  # noqa: E402
from mfuscope.kernels.rope import rope_angles  # noqa: E402
from mfuscope.tests.kernel_checks import (  # noqa: E402
    DTYPES,
    assert_close,
    assert_compiles_like_eager,
    guarded,
    guards_intact,
    tolerance,
)


def _qk(dtype, device="cpu", b=2, hq=4, hk=2, s=7, d=34, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    k = torch.randn(b, hk, s, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    cos, sin = rope_angles(torch.arange(s, device=device), d, 10000.0)
    return q, k, cos, sin


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_and_k_and_their_gradients_match_the_reference(dtype, interleaved, device):
    q, k, cos, sin = _qk(dtype, device)
    assert use_triton(q)
    qo, ko = apply_rope(q, k, cos, sin, interleaved=interleaved)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (dq, dk))
    # the truth on the CPU, from the same inputs in float32
    qf, kf = q.detach().float().cpu().requires_grad_(), k.detach().float().cpu().requires_grad_()
    cos, sin = cos.cpu(), sin.cpu()
    q_true, k_true = rope_reference(qf, cos, sin, interleaved), rope_reference(kf, cos, sin, interleaved)
    torch.autograd.backward((q_true, k_true), (dq.float().cpu(), dk.float().cpu()))
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    for got, truth, what in ((qo, q_true, "q"), (ko, k_true, "k"), (q.grad, qf.grad, "dq"), (k.grad, kf.grad, "dk")):
        assert_close(got, truth.detach(), tolerance(dtype, 2), what)


def test_interleaved_pairs_are_the_reference_trainers_rope(device):
    """Independent of rope_reference: the trainer's model.rope on (batch, seq, heads, head_dim), on the CPU."""
    from mfuscope.reference_trainer.model import rope, rotary_table

    x = torch.randn(2, 9, 3, 16)  # (batch, seq, heads, head_dim), as the trainer holds q
    positions = torch.arange(5, 14)
    theirs = rope(x, rotary_table(positions, 16, 500000.0))
    x, positions = x.to(device), positions.to(device)
    cos, sin = rope_angles(positions, 16, 500000.0)
    ours, _ = apply_rope(x.transpose(1, 2), x.transpose(1, 2)[:, :1], cos, sin, interleaved=True)
    assert_close(ours.transpose(1, 2), theirs, tolerance(torch.float32, 2), "rope")


def test_hugging_face_cos_sin_of_repeated_halves_are_accepted(device):
    q, k, cos, sin = _qk(torch.float32, device)
    a = apply_rope(q, k, cos, sin)
    b = apply_rope(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_kernel_stays_inside_its_tensors(device):
    import triton

    from mfuscope.kernels.rope import _rope_kernel

    b, h, s, d = 1, 2, 3, 10
    n = b * h * s * d
    x, xb = guarded((b, h, s, d), torch.float32, torch.randn(b, h, s, d), device=device)
    cos, sin = rope_angles(torch.arange(s), d, 10000.0)
    c, cb = guarded((s, d // 2), torch.float32, cos, device=device)
    sn, sb = guarded((s, d // 2), torch.float32, sin, device=device)
    y, yb = guarded((b, h, s, d), torch.float32, device=device)
    for interleaved in (False, True):  # two positions a program: the second program's last is past the end
        _rope_kernel[(b * h, 2)](x, c, sn, y, h, s, *x.stride(), 1.0, HALF=d // 2,
                                 BLOCK=triton.next_power_of_2(d // 2), SEQ_BLOCK=2, INTERLEAVED=interleaved)
        assert not torch.isnan(y).any()
        assert all(guards_intact(buf, k) for buf, k in ((xb, n), (cb, s * d // 2), (sb, s * d // 2), (yb, n)))


def test_registrations_and_compile(device):
    q, k, cos, sin = _qk(torch.float32, device, s=5, d=8)
    torch.library.opcheck(torch.ops.mfuscope.rope.default, (q, cos, sin, True, 1.0))

    def f(q, k):
        a, b = apply_rope(q, k, cos, sin, interleaved=True)
        return a.square().sum() + b.sum()

    assert_compiles_like_eager(f, q, k)


def test_bad_shapes_are_refused():
    q, k, cos, sin = _qk(torch.float32)
    with pytest.raises(ValueError, match="expected"):
        apply_rope(q[..., :33], k, cos, sin)
    with pytest.raises(ValueError, match="cos/sin of shape"):
        apply_rope(q, k, cos[:, :3], sin)
