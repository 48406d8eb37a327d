"""``mfuscope optimize`` on the reference trainer: propose, apply, re-measure, predicted against measured.

Paced mode (compute time known) from a deliberately poor start: GPipe with 2
microbatches of 4 sequences on 2 pipeline stages.  The optimizer must find
faster setups, run each as a new run directory, and keep the best; every
prediction is held against its own measured run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

START = ["--config", "tiny_dense", "--nproc", "2", "--layout", "pp=2", "--schedule", "gpipe", "--microbatches", "2",
         "--set", "global_batch=8", "--steps", "3", "--profile", "--paced", "fwd_ms=40,bwd_ms=80,per=sample"]


def _mfuscope(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "mfuscope", *args], capture_output=True, text=True, timeout=timeout)


def test_optimize_applies_measured_wins_and_each_prediction_holds(tmp_path):
    base = tmp_path / "gpipe"
    assert _mfuscope("train", *START, "--out", str(base)).returncode == 0
    assert _mfuscope("analyze", str(base)).returncode == 0
    proposed = _mfuscope("optimize", str(base), "--json")
    assert proposed.returncode == 0, proposed.stderr
    fixes = {f["fix"] for f in json.loads(proposed.stdout)["fixes"]}
    assert {"more_microbatches", "interleaved_schedule"} <= fixes

    done = _mfuscope("optimize", str(base), "--apply", "--rounds", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary == json.loads((base / "optimize.json").read_text())
    assert (base / "optimize.md").is_file()
    # The step falls by more than a quarter (the paced GPipe start wastes 1/3 of its pipeline).
    assert summary["final"]["measured_step_s"] < 0.75 * summary["base_step_s"], summary["final"]
    ran = [f for f in summary["fixes"] if f["measured_step_s"] is not None]
    assert any(f["fix"] == "more_microbatches" for f in ran)
    for f in ran:  # every change the optimizer ran: its prediction within 25% of its own measurement
        assert f["predicted_step_s"] == pytest.approx(f["measured_step_s"], rel=0.25), f
        assert Path(f["run"]).is_dir() and Path(f["run"]).parent == tmp_path  # beside the base: listed
    kept = json.loads((Path(summary["final"]["run"]) / "report.json").read_text())
    assert kept["summary"]["step_time_s"] == pytest.approx(summary["final"]["measured_step_s"])


def test_optimize_refuses_to_apply_to_a_trace_directory(tmp_path):
    done = _mfuscope("optimize", str(tmp_path), "--apply")
    assert done.returncode == 2 and "Traceback" not in done.stderr
