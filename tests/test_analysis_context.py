"""Work done once: each rank's step plan once per ``analyze`` (the report and the timeline views
share one analysis context), and the cost model fitted once per version of a run's report in the
dashboard's store (the Overview and the Optimize page share it).

A one-rank run written by hand (manifest and trace): these tests count how often the work is
done, not what it finds, so the run needs no trainer.
"""
from __future__ import annotations

import json
import os

import pytest

from mfuscope.analyzers import analysis, breakdown
from mfuscope.tests.helpers import write_trace

MANIFEST = {
    "schema_version": 1, "run_id": "tiny", "start_time": "2026-01-01T00:00:00Z", "status": "complete",
    "world_size": 1,
    "hardware": {"device_name": "x86_64", "device_count": 1, "peak_flops": 1e11, "peak_source": "measured"},
    "model": {"family": "llama", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "ffn_dim": 128, "max_seq_len": 64},
    "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1},
    "train": {"seq_len": 32, "global_batch": 4, "microbatches": 1, "grad_accum": 1, "dtype": "fp32"},
    "trainer": {"dp_mode": "fsdp"},
    "rank_coords": {"0": {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "ep": 0}},
}


def _op(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def _run(root):
    """Two steps of matmuls and an all-reduce on one CPU rank."""
    run = root / "tiny"
    events = []
    for step, t0 in ((1, 0.0), (2, 2000.0)):
        events += [_op(f"ProfilerStep#{step}", t0, 1500.0, "user_annotation"), _op("aten::mm", t0 + 100, 800.0),
                   _op("c10d::allreduce_", t0 + 1000, 300.0), _op("aten::zero_", t0 + 1400, 100.0)]
    write_trace(run / "traces" / "rank0.pt.trace.json", events, distributedInfo={"rank": 0, "world_size": 1})
    (run / "manifest.json").write_text(json.dumps(MANIFEST))
    return run


def _count(monkeypatch, module, name: str) -> list:
    """Calls of ``module.name`` from now on (it still runs)."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_analyze_makes_each_ranks_step_plan_once(tmp_path, monkeypatch):
    # rank_plan is what step_plans spends its time in, and every caller of step_plans reaches it
    plans = _count(monkeypatch, breakdown, "rank_plan")
    run = _run(tmp_path)
    report, _ = analysis.analyze(run, run / "report.json", run / "views", use_cache=False, progress=False)
    assert len(plans) == 1  # one rank: the breakdown, the communication exposure and the views share it
    assert report["breakdown"]["seconds"] == pytest.approx(1500e-6)
    segments, _ = analysis.read_views(run / "views")
    assert segments.groupby("step")["end_ns"].max().sub(segments.groupby("step")["start_ns"].min()).eq(1_500_000).all()


def test_the_dashboard_fits_a_runs_cost_model_once_per_report(tmp_path, monkeypatch):
    pytest.importorskip("dash", reason="the dashboard's dependencies are not installed")
    from mfuscope.dashboard import pages
    from mfuscope.dashboard.store import Store
    from mfuscope.optimizers import calibrate

    path = _run(tmp_path / "runs")
    analysis.analyze(path, path / "report.json", path / "views", use_cache=False, progress=False)
    fits = _count(monkeypatch, calibrate, "fit_run")
    store = Store(tmp_path / "runs")
    run = store.run("tiny")

    def render() -> None:
        a = store.load(run)
        overview, optimize = pages.overview_page(store, run, a), pages.optimize_page(store, run, a)
        assert "prediction-grid" in repr(overview) and "optimize-grid" in repr(optimize)  # the model, not an error

    render()
    render()
    assert len(fits) == 1
    # Analyzed again: a new report, so a new fit (its time set later, as a slower analysis would leave it).
    analysis.analyze(path, path / "report.json", path / "views", use_cache=False, progress=False)
    later = (path / "report.json").stat().st_mtime + 1
    os.utime(path / "report.json", (later, later))
    render()
    assert len(fits) == 2
