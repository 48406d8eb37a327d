"""The kernel tests choose their device from what the machine has (tests/devices.py): this machine
as it is, and a simulated CUDA machine, whose test session must compile the kernels for the GPU and
parametrize every kernel test over ``cuda`` alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mfuscope.tests import devices

from .helpers import REPO

pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

#: A pytest plugin that makes torch report a CUDA GPU (loaded with -p, before conftest), and
#: records what the session then chose once collection is done.
FAKE_CUDA = '''
import json, os
import torch

torch.cuda.is_available = lambda: True


def pytest_collection_finish(session):
    from mfuscope.kernels import _dispatch
    with open(os.environ["FAKE_CUDA_OUT"], "w") as f:
        json.dump({"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "interpret": _dispatch.INTERPRET,
                   "cpu_tensor_takes_triton": _dispatch.use_triton(torch.zeros(1)),
                   "ids": [item.nodeid for item in session.items]}, f)
'''


def test_the_selection_follows_the_machine():
    assert devices.kernel_devices(cuda=False, interpret=True) == ["cpu"]
    assert devices.kernel_devices(cuda=True, interpret=False) == ["cuda"]
    assert devices.kernel_devices(cuda=True, interpret=True) == ["cpu", "cuda"]  # asked for by hand
    assert devices.kernel_devices(cuda=False, interpret=False) == []


@pytest.mark.skipif(devices.cuda_visible(), reason="checks a machine without a GPU; this one has a CUDA GPU")
def test_without_a_gpu_the_session_interprets_the_kernels_on_cpu(device):
    assert devices.interpreting() and device == "cpu"


def test_a_cuda_machine_compiles_the_kernels_and_tests_them_on_cuda(tmp_path):
    (tmp_path / "fake_cuda.py").write_text(FAKE_CUDA)
    out = tmp_path / "chosen.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FAKE_CUDA_OUT=str(out), PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))
    files = ["tests/test_kernel_swiglu.py", "tests/test_kernel_linear_cross_entropy.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "fake_cuda", "-p", "no:cacheprovider",
                           "--collect-only", "-q", *files], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    chosen = json.loads(out.read_text())
    assert chosen["TRITON_INTERPRET"] is None and chosen["interpret"] is False  # compiled, not interpreted
    assert chosen["cpu_tensor_takes_triton"] is False  # CPU tensors take the PyTorch path there
    ids = chosen["ids"]
    kernel_tests = [i for i in ids if "[cuda" in i]
    assert kernel_tests and not any("[cpu" in i for i in ids)
    # the forward-and-backward check of every shape and dtype runs on the GPU
    swiglu = [i for i in kernel_tests if "swiglu.py::test_forward_and_backward_match_the_reference" in i]
    assert len(swiglu) == 8, swiglu
    # the CPU path's own checks stay, unparametrized, on CPU tensors
    assert any(i.endswith("::test_cpu_chunks_are_wide_enough_for_their_gemms") for i in ids)
