"""Where a fused op runs: the Triton kernel or its PyTorch reference.

CUDA tensors go to the Triton kernel.  CPU tensors go to the reference, unless
``TRITON_INTERPRET=1`` was set before Triton was imported: then Triton's
interpreter runs the kernel on the CPU tensors, which is how the tests
exercise the kernels on a machine without a GPU.  Without Triton installed,
everything runs the reference.
"""
from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # the kernels need the [torch] extra's triton; the references do not
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when ``tensors`` (all on one device) should run the Triton kernel."""
    if not HAVE_TRITON:
        return False
    device = tensors[0].device.type
    return device == "cuda" or (device == "cpu" and INTERPRET)


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous (rows, last dim) matrix, the layout every kernel here reads."""
    return x.reshape(-1, x.shape[-1]).contiguous()
