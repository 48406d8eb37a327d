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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

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


_recording: dict[str, Any] | None = None  # {"launches": [...], "multiprocessors": n} inside recording()


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when ``tensors`` (all on one device) should run the Triton kernel."""
    if not HAVE_TRITON:
        return False
    if _recording is not None:
        return True
    device = tensors[0].device.type
    return device == "cuda" or (device == "cpu" and INTERPRET)


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the recorded target's; 4 for the interpreter), which
    sizes grids that should fill the GPU."""
    if _recording is not None:
        return _recording["multiprocessors"]
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
    if _recording is not None:
        _recording["launches"].append(Launch(kernel, tuple(grid), args, constexprs, warps))
        return
    kernel[grid](*args, num_warps=warps, **constexprs)


@contextmanager
def recording(multiprocessors: int) -> Iterator[list[Launch]]:
    """Inside, ops take the Triton path on any tensors (``meta`` ones cost nothing) and their
    launches are listed instead of run, as on a GPU with ``multiprocessors`` SMs."""
    global _recording
    if not HAVE_TRITON:
        raise RuntimeError("recording kernel launches needs triton (pip install 'mfuscope[torch]')")
    launches: list[Launch] = []
    previous, _recording = _recording, {"launches": launches, "multiprocessors": multiprocessors}
    try:
        yield launches
    finally:
        _recording = previous


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous (rows, last dim) matrix, the layout every kernel here reads."""
    return x.reshape(-1, x.shape[-1]).contiguous()
