"""Which devices the kernel tests run on, decided once per session from what the machine has.

Triton decides when it is imported whether ``@triton.jit`` kernels are compiled or run by its
interpreter (``TRITON_INTERPRET=1``), so one test session runs the kernels one way:

- no CUDA GPU visible: the interpreter runs them on CPU tensors -- device ``cpu``;
- a CUDA GPU visible: they compile and run on CUDA tensors -- device ``cuda``.  CPU tensors then
  take the ops' PyTorch path, as on any laptop, which the CPU-path tests check either way.

Facts of the interpreter alone (one streaming multiprocessor, host memory in numpy tiles) are
asserted under it alone: :data:`interpreter_only`.  ``tests/test_kernel_devices.py`` runs the
selection on a simulated CUDA machine.  Torch-free at import: conftest reads it first.
"""
from __future__ import annotations

import os

import pytest


def cuda_visible() -> bool:
    """A CUDA GPU that torch can use.  Asked of NVML, not the CUDA driver: a driver initialized in
    the test process would be unusable in the ranks the multi-rank tests fork from it."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError:  # the analysis-only install: no kernel test runs
        return False
    return torch.cuda.is_available()


def interpreting() -> bool:
    """Triton's interpreter is on for this process (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_devices(cuda: bool, interpret: bool) -> list[str]:
    """The devices whose tensors take the Triton kernels: CPU ones under the interpreter, CUDA ones
    where a GPU is visible (compiled, or interpreted if the interpreter was asked for anyway)."""
    return (["cpu"] if interpret else []) + (["cuda"] if cuda else [])


#: No kernel device: why the device-parametrized tests do not run.
NO_DEVICE = ("no device runs the Triton kernels here: no CUDA GPU is visible and TRITON_INTERPRET=1 was "
             "not set before triton was imported (the test suite sets it on a machine without a GPU)")

#: Marks a test of a fact true of Triton's interpreter only (a condition read when the test runs,
#: after conftest has chosen: this module is imported before).
interpreter_only = pytest.mark.skipif(
    "os.environ.get('TRITON_INTERPRET') != '1'",
    reason="asserts a property of Triton's interpreter (one SM, host memory); this session compiles the kernels "
           "for the GPU, where scripts/gpu_kernels_check.py measures them")
