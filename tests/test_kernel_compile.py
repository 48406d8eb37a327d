"""The kernels compile for a real GPU, at the 8B-405B shapes, without spilling registers.

The interpreter (every other kernel test) never runs Triton's compiler, so these
compile each launch ahead of time for sm_90 (H100/H200) with ``triton.compile``
and read registers and spills from the cubin.  They run in a subprocess: this
process imported Triton under ``TRITON_INTERPRET=1``, which replaces the compiler.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the kernels need the [torch] extra's triton")
CUDA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(not (CUDA_BIN / "cuobjdump").exists(),
                                reason=f"this Triton build ships no CUDA tools ({CUDA_BIN}) to compile with")


def _run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


def _jit_kernels() -> set[str]:
    """Every ``@triton.jit`` kernel in the package's modules, found by reading their source: the
    functions named ``*_kernel`` (the others are helpers the kernels inline)."""
    import re
    root = Path(__file__).resolve().parents[1] / "kernels"
    names = set()
    for path in root.glob("*.py"):
        names |= set(re.findall(r"@triton\.jit\s+def (\w+_kernel)\(", path.read_text()))
    return names


def test_every_kernel_compiles_for_sm90_at_8b_to_405b_shapes_without_spilling(tmp_path):
    out = tmp_path / "compile.json"
    proc = _run("-m", "mfuscope.kernels.compile_check", "--arch", "90", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert {r["kernel"] for r in results} == _jit_kernels()  # the check leaves no kernel out
    for r in results:
        assert r["ok"] and r["spill_bytes"] == 0, r
        # A thread has 65,536 registers / (32 x warps) at most (255 at 8 warps or fewer).
        assert 0 < r["registers"] <= min(255, 65536 // (32 * r["num_warps"])), r
    widths = {r["constexprs"]["BLOCK"] for r in results if r["kernel"] == "_rms_norm_backward_kernel"}
    assert widths == {4096, 8192, 16384}  # one compile per model's hidden size


def test_a_spilling_launch_is_reported():
    """Triton's default of 4 warps at 16k columns: 128 float32 values a tensor per thread, and the
    backward holds several (x, dy, the weight-gradient accumulator) -- past 255 registers."""
    script = ("from mfuscope.kernels import compile_check as cc\n"
              "launch = next(l for l in cc.record(cc.SHAPES['405b'], 132)"
              " if l.kernel.__name__ == '_rms_norm_backward_kernel')\n"
              "r = cc.compile_launch(launch, 90, '405b', num_warps=4)\n"
              "print(r.ok, r.spill_bytes)\n")
    proc = _run("-c", script)
    assert proc.returncode == 0, proc.stderr
    ok, spill = proc.stdout.split()
    assert ok == "True" and int(spill) > 0


def test_the_check_refuses_to_run_under_the_interpreter():
    proc = _run("-m", "mfuscope.kernels.compile_check", interpret=True)
    assert proc.returncode == 2
    assert "TRITON_INTERPRET" in proc.stderr and "Traceback" not in proc.stderr
