"""The cost model against the reference trainer: predict a run first, then run it and compare.

Paced mode makes compute time known (``--paced ...,per=sample``: each stage
chunk sleeps a fixed time per sample of its microbatch), so what is checked is
the model's pipeline -- microbatch count, schedule, bubble -- not a CPU's
speed.  Per-sample pacing keeps the step's work constant while the microbatch
count changes, as on a real device.  Every prediction is made from the
layout alone (``predict``, no measurement), then held against one measured run.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mfuscope.analyzers import overview, trace_set
from mfuscope.optimizers import calibrate, measured
from mfuscope.optimizers.model import predict
from mfuscope.optimizers.spec import Layout, ModelSpec

from .helpers import WAKE_S, micro_config

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
#: Wall time is what these tests assert: make test runs them in its paced lane (tests/lanes.py).
pytestmark = pytest.mark.paced

from mfuscope.reference_trainer.launch import fork_ranks  # noqa: E402
from mfuscope.reference_trainer.train import run_rank  # noqa: E402
from mfuscope.trainer_options import TrainerOptions  # noqa: E402

P, FWD_MS, BWD_MS, GLOBAL_BATCH = 4, 40.0, 80.0, 8


def _train(tmp_path, name, schedule, m):
    config = tmp_path / "micro.toml"
    config.write_text(micro_config(n_layers=8, global_batch=GLOBAL_BATCH, grad_accum=1, microbatches=m))
    out = tmp_path / name
    fork_ranks(run_rank, P, TrainerOptions(config=str(config), layout=f"pp={P}", schedule=schedule, steps=3,
                                       window="1:", out=str(out), microbatches=m,
                                       paced=f"fwd_ms={FWD_MS:g},bwd_ms={BWD_MS:g},per=sample"))
    events = trace_set.load(out, use_cache=False).events
    report = overview.build_report(events, source=str(out), files=[], run=out)
    (out / "report.json").write_text(json.dumps(report))
    return out, report


LAYOUTS = [("1f1b", 1, 4), ("1f1b", 1, 8), ("gpipe", 1, 4), ("gpipe", 1, 8),
           ("interleaved_1f1b", 2, 4), ("interleaved_1f1b", 2, 8)]


def test_pipeline_predictions_match_paced_runs(tmp_path):
    """GPipe, 1F1B and interleaved 1F1B at 4 and 8 microbatches: step time and bubble predicted
    from the layout alone, then measured, within 15% each.

    A microbatch on a rank takes v chunks x the paced time x its samples (8 sequences / m).  What
    the pacing does not fix -- the host's time per microbatch (Python, autograd, the profiler)
    and the gloo hop a pipeline receive waits for -- is one number, calibrated on the first run
    (1F1B, m=4) and then held fixed: the other five runs are predictions, not fits."""
    model = ModelSpec(n_layers=8, dim=32, n_heads=2, ffn_dim=64, vocab_size=64)
    profile = None
    for schedule, v, m in LAYOUTS:
        b = GLOBAL_BATCH // m
        layout = Layout(pp=P, vpp=v, micro_batch=b, microbatches=m, schedule=schedule, sequence_parallel=False)
        phases = (v * FWD_MS / 1e3 * b, v * BWD_MS / 1e3 * b, 0.0)
        out, report = _train(tmp_path, f"{schedule}-m{m}", schedule, m)
        run = measured.load(out)
        assert run.known_phases == pytest.approx(phases)
        assert run.layout == layout, run.layout
        if profile is None:
            profile = calibrate.fit_run(run)
            assert profile.provenance["fields"] == ["microbatch_overhead_s"]
        pred = predict(model, layout, run.training, run.system, profile, known_phases=phases)
        step = report["summary"]["step_time_s"]
        bubble = report["bubbles"][0]["bubble_fraction"]
        print(f"{schedule} m={m}: step predicted {pred.step_s:.3f} s, measured {step:.3f} s; "
              f"bubble predicted {pred.bubble_fraction:.3f}, measured {bubble:.3f} "
              f"(host time per microbatch pass {profile.microbatch_overhead_s * 1e3:.1f} ms)")
        assert pred.step_s == pytest.approx(step, rel=0.15), (schedule, m, pred.step_s, step)
        # On a loaded host each hop of the fill and drain may wait a wake-up for a core: 2(p-1) of them.
        slack = 2 * (P - 1) * WAKE_S / step
        assert abs(pred.bubble_fraction - bubble) <= 0.15 * bubble + slack, (schedule, m, pred.bubble_fraction, bubble)


def test_a_cpu_run_calibrates_and_predicts_itself(tmp_path):
    """A CPU run of the reference trainer calibrates (the CPU's measured matmul peak is the device
    peak) and its calibrated profile predicts the run's compute within 10% -- the fit's own
    residual, which is small because one number scales compute."""
    config = tmp_path / "micro.toml"
    config.write_text(micro_config(n_layers=2, global_batch=8, grad_accum=2, microbatches=1))
    out = tmp_path / "dp2"
    fork_ranks(run_rank, 2, TrainerOptions(config=str(config), layout="dp_shard=2", steps=3, window="1:", out=str(out)))
    events = trace_set.load(out, use_cache=False).events
    report = overview.build_report(events, source=str(out), files=[], run=out)
    (out / "report.json").write_text(json.dumps(report))
    run = measured.load(out)
    assert run.system.key == "CPU"
    assert run.system.peak_flops("bf16") == pytest.approx(report["summary"]["peak_flops"])
    profile = calibrate.fit_run(run)
    assert profile.provenance["degrees_of_freedom"] >= 1
    pred = predict(run.model, run.layout, run.training, run.system, profile)
    measured_compute = sum(v for k, v in run.leaves.items() if k.startswith("compute/"))
    predicted_compute = sum(v for k, v in pred.leaves.items() if k.startswith("compute/"))
    print(f"compute predicted {predicted_compute:.4f} s, measured {measured_compute:.4f} s")
    assert predicted_compute == pytest.approx(measured_compute, rel=0.10)
    # The same through the CLI: a profile file, and the run's prediction beside its measurement.
    hw = tmp_path / "hw.json"
    done = subprocess.run([sys.executable, "-m", "mfuscope", "calibrate", str(out), "--out", str(hw)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    saved = json.loads(hw.read_text())
    assert saved["provenance"]["device"] == "CPU" and saved["profile"]["gemm"] == pytest.approx(profile.gemm)
    done = subprocess.run([sys.executable, "-m", "mfuscope", "analyze", str(out), "--predict", "--hardware", str(hw)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "predicted vs measured per step" in done.stdout and "compute/gemm" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "mfuscope", "calibrate", str(tmp_path / "nothing")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr
