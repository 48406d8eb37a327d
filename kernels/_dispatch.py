"""Where a fused op runs, and the one place every Triton kernel is launched.

CUDA tensors go to the Triton kernel.  CPU tensors go to the reference, unless
``TRITON_INTERPRET=1`` was set before Triton was imported: then Triton's
interpreter runs the kernel on the CPU tensors, which is how the tests
exercise the kernels on a machine without a GPU.  Without Triton installed,
everything runs the reference.

Every op launches through :func:`launch`, which sizes the program's warps to
the values it holds, and which :func:`recording` can turn into a list of the
launches a shape makes, so ``kernels.compile_check`` compiles exactly those
kernels for a GPU this machine does not have.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # the kernels need the [torch] extra's triton; the references do not
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Launch:
    """One kernel launch as the op would make it: the kernel, its arguments and its warps."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    num_warps: int


#: {"launches": [...], "multiprocessors": n} inside recording() (in that thread or task only).
_recording: ContextVar[dict[str, Any] | None] = ContextVar("mfuscope_kernel_recording", default=None)


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when ``tensors`` (all on one device) should run the Triton kernel."""
    if not HAVE_TRITON:
        return False
    if _recording.get() is not None:
        return True
    device = tensors[0].device.type
    return device == "cuda" or (device == "cpu" and INTERPRET)


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, which size grids that should fill the GPU: the
    recorded target's inside :func:`recording`, 1 for the interpreter on CPU."""
    recorded = _recording.get()
    if recorded is not None:
        return recorded["multiprocessors"]
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_warps(values: int) -> int:
    """Warps for a program holding ``values`` elements of each tensor it works on: about 16 a thread
    (32 threads a warp), between 4 and 32 warps.  Triton's default of 4 would leave a 16k-wide row
    at 128 float32 values a tensor per thread, past the 255 registers a thread has, so it spills."""
    return min(32, max(4, triton.next_power_of_2(values) // 512))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, values: int, **constexprs: Any) -> None:
    """Launch ``kernel`` on ``grid`` with warps for ``values`` elements a tensor per program; inside
    :func:`recording` only note the launch."""
    warps = num_warps(values)
    recorded = _recording.get()
    if recorded is not None:
        recorded["launches"].append(Launch(kernel, tuple(grid), args, constexprs, warps))
        return
    kernel[grid](*args, num_warps=warps, **constexprs)


@contextmanager
def recording(multiprocessors: int) -> Iterator[list[Launch]]:
    """Inside, ops take the Triton path on any tensors (``meta`` ones cost nothing) and their
    launches are listed instead of run, as on a GPU with ``multiprocessors`` SMs."""
    if not HAVE_TRITON:
        raise RuntimeError("recording kernel launches needs triton (pip install 'mfuscope[torch]')")
    launches: list[Launch] = []
    token = _recording.set({"launches": launches, "multiprocessors": multiprocessors})
    try:
        yield launches
    finally:
        _recording.reset(token)


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous (rows, last dim) matrix, the layout every kernel here reads."""
    return x.reshape(-1, x.shape[-1]).contiguous()
