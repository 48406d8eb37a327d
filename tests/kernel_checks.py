"""What every fused kernel's tests share: tolerances derived from the dtype, a float32 truth,
inputs of awkward layouts, and guard buffers that catch reads and writes out of bounds (Triton's
interpreter does no bounds checks).  Results are compared on the CPU in float64, whatever device
computed them."""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype, reduced: int = 1) -> float:
    """Relative error a result may carry: one rounding of the output's dtype, plus float32
    accumulation over ``reduced`` terms (sqrt(n) eps for a sum of random-sign errors, with a
    factor 4 of margin)."""
    eps32 = torch.finfo(torch.float32).eps
    out = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    return out + 4 * eps32 * max(reduced, 1) ** 0.5


def assert_close(actual: torch.Tensor, truth: torch.Tensor, rel: float, what: str) -> None:
    """Elementwise |actual - truth| <= rel * (|truth| + scale), where ``scale`` is the truth's RMS:
    entries near zero are held to the tensor's scale, not to their own.  Either may be on any device."""
    a, t = actual.detach().to("cpu", torch.float64), truth.detach().to("cpu", torch.float64)
    scale = t.pow(2).mean().sqrt().item() if t.numel() else 0.0
    bad = (a - t).abs() > rel * (t.abs() + scale)
    assert not torch.isnan(a).any(), f"{what}: NaN in the result"
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} entries off by more than {rel:.2e} "
                           f"relative; worst {((a - t).abs() / (t.abs() + scale)).max().item():.2e}")


#: What surrounds an output: any write out of bounds changes it (a NaN written there would not show
#: in a NaN guard, so outputs get this instead).
SENTINEL = -12345.0


def guarded(shape: tuple[int, ...], dtype: torch.dtype, fill: torch.Tensor | None = None,
            pad: int = 64, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(a contiguous tensor of ``shape`` inside a guard buffer on ``device``, the buffer).  With
    ``fill`` (an input, on any device) the guard is NaN, so a read out of bounds spreads NaN into the
    result; without (an output) the guard is ``SENTINEL``, so a write out of bounds changes it."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 2 * pad,), float("nan") if fill is not None else SENTINEL, dtype=dtype, device=device)
    view = buf[pad:pad + n].view(shape)
    if fill is not None:
        view.copy_(fill)
    return view, buf


def guards_intact(buf: torch.Tensor, n: int, pad: int = 64) -> bool:
    """The guard of :func:`guarded` around ``n`` elements is as it was laid (read back on the CPU)."""
    buf = buf.detach().cpu()
    guard = torch.cat((buf[:pad], buf[pad + n:]))
    return bool(torch.isnan(guard).all() or (guard == SENTINEL).all())


def assert_compiles_like_eager(f, *inputs: torch.Tensor) -> None:
    """``torch.compile(f, fullgraph=True)`` traces through the custom ops (no graph break) and
    gives ``inputs`` the gradients eager ``f`` gives (``f`` returns a scalar)."""
    torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs).backward()
    compiled = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    f(*inputs).backward()
    for got, t in zip(compiled, inputs):
        assert torch.equal(got, t.grad)
