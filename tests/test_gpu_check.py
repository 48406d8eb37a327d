"""scripts/gpu_check.py without a GPU: its CPU dry run for real, and its refusals.

The GPU run itself needs a lent GPU; what this checks is everything around it: the runs go
through torchrun, every multi-GPU path says how it was covered, the timing basis is named, the
MFU arithmetic holds, and the dry run's own run directory, read as a GPU run's, takes its MFU
from the device times.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

SCRIPT = str(REPO / "scripts" / "gpu_check.py")
PATHS = {"nccl", "fsdp2_bf16_1rank", "fsdp2_bf16", "tp", "pp", "cp", "ep"}


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cpu_dry_run_covers_every_path_and_names_its_timing(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--device", "cpu", "--config", "tiny_dense", "--steps", "5", "--warmup", "1",
                "--json", str(out), "--run-dir", str(tmp_path / "runs"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert json.loads(proc.stdout) == doc
    for name in ("dense", "fsdp2_bf16_1rank"):  # progress, one line as each run starts and ends
        assert f"{name}: running" in proc.stderr and f"{name}: ok in" in proc.stderr

    # Timing: steps 0 (warm-up) and 2..4 (the profiled window and its warm-up step) are left out.
    timing = doc["timing"]
    assert timing["basis"].startswith("host clock") and timing["timed_steps"] == [1]
    assert timing["device_step_s_median"] is None and doc["step_time_s"] == timing["host_step_s_median"] > 0
    # MFU against the CPU's measured matmul peak, as the collectors record it for a CPU run.
    assert doc["peak_source"].startswith("measured matmul peak") and doc["mfu_note"].startswith("host step time")
    assert 0 < doc["mfu"] < 1
    assert math.isclose(doc["mfu"], doc["tflops_per_s"] / doc["peak_tflops"], rel_tol=1e-9)
    assert len(doc["losses"]) == 5 and all(math.isfinite(x) for x in doc["losses"])
    assert doc["collectors"]["steps_rows"] == 5 and doc["collectors"]["steps_with_device_time"] == 0
    assert doc["collectors"]["window_events"] > 0
    # The cost model's memory for the run, against torch.cuda.max_memory_allocated on a GPU (none here).
    memory = doc["memory_check"]
    assert memory["predicted_gib"] > 0 and memory["measured_gib"] is None and memory["within_15pct"] is None

    paths = {p["path"]: p for p in doc["paths"]}
    assert set(paths) == PATHS and len(doc["paths"]) == len(PATHS)
    for name in ("nccl", "fsdp2_bf16_1rank"):
        assert paths[name]["covered"] == "ran on CPU (dry run with gloo, not NCCL)" and paths[name]["scope"]
    assert paths["nccl"]["result"]["comm_ops"]["all_reduce"] == 5  # the loss, once a step
    fsdp = paths["fsdp2_bf16_1rank"]["result"]
    assert fsdp["ok"] and fsdp["params_sharded"] and len(fsdp["losses"]) == 3
    assert fsdp["param_dtype_in_forward"] == "torch.bfloat16" and fsdp["grad_dtypes"] == ["torch.float32"]
    for name in PATHS - {"nccl", "fsdp2_bf16_1rank"}:  # a size-1 layout is a no-op: said, not pretended
        assert paths[name]["covered"].startswith("needs ≥2 GPUs: "), paths[name]
        assert paths[name]["result"]["trainer_on_one_rank"]  # the trainer's own refusal of the layout on 1 rank
    assert "Duplicate GPU detected" in doc["several_ranks_one_gpu"]
    assert doc["ok"] is True
    _gpu_run_takes_device_time(tmp_path / "runs" / "dense", tmp_path / "as_gpu", doc)


def _gpu_run_takes_device_time(dense: Path, copy: Path, cpu_doc: dict) -> None:
    """The same run read as a GPU run: MFU follows the CUDA-event times, never the host's; without them
    for every timed step there is no MFU and the check fails."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mfuscope.reference_trainer.config import load_config

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    shutil.copytree(dense, copy)
    result = json.loads((dense.parent / "dense.result.json").read_text())
    run = result | {"ok": True, "wall_s": 1.0, "run_dir": str(copy), "log": "-"}
    args = argparse.Namespace(device="cuda", config="tiny_dense", steps=5, warmup=1)
    cfg = load_config("tiny_dense", steps=5)

    missing = gpu_check._dense_report(cfg, args, run)
    assert missing["mfu"] is None and missing["dense_run"]["ok"] is False
    assert "no CUDA-event time" in missing["mfu_note"]

    for part in (copy / "steps.parquet").glob("*.parquet"):  # device time: 3x the host's, as if the GPU lagged
        table = pq.read_table(part)
        rows = table.to_pandas()
        rows["device_time_ns"] = (rows["end_ns"] - rows["start_ns"]) * 3
        pq.write_table(pa.Table.from_pandas(rows, schema=table.schema, preserve_index=False), part)
    report = gpu_check._dense_report(cfg, args, run)
    assert report["timing"]["basis"].startswith("device: CUDA-event")
    assert report["step_time_s"] == report["timing"]["device_step_s_median"]
    assert math.isclose(report["step_time_s"], 3 * cpu_doc["step_time_s"], rel_tol=1e-6)
    assert math.isclose(report["mfu"], cpu_doc["mfu"] / 3, rel_tol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="checks the refusal on a machine without a GPU; this one has a CUDA GPU")
def test_without_cuda_and_without_the_cpu_flag_it_says_so_and_exits_3(tmp_path):
    proc = _run("--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: no CUDA GPU here; run this on a GPU machine, or --device cpu for a dry run"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, message", [
    (("--steps", "4", "--warmup", "1"), "--steps 4 leaves no timed step"),
    (("--config", "no_such_config"), "no such config"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, message):
    proc = _run("--device", "cpu", "--run-dir", str(tmp_path / "runs"), *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: ") and message in lines[0]
    assert not (tmp_path / "runs").exists()


def test_the_gpu_kernel_check_dry_runs_on_cpu(tmp_path):
    """``scripts/gpu_kernels_check.py --device cpu`` under the interpreter: every op in both dtypes is
    checked against its reference and passes, and the JSON says so (on a GPU the same script checks
    the bf16 tensor-core paths the interpreter cannot run)."""
    script = REPO / "scripts" / "gpu_kernels_check.py"
    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    ops = {"rms_norm", "add_rms_norm", "swiglu", "rope", "linear_ce", "moe_permute"}
    assert {(c["op"], c["dtype"]) for c in checks} == {(op, d) for op in ops for d in ("bfloat16", "float32")}
    assert all(c["passed"] and c["worst_rel_error"] <= c["tolerance"] for c in checks)
