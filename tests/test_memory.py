"""Memory measured (analyzers/memory.py, collectors/memory_recorder.py) and the model beside it.

Expected values come from outside the code under test: the model states from a hand count of
tiny_dense's parameters (numel x 4 bytes x states: fp32 weights, fp32 gradients, AdamW's two fp32
moments); the corpus's memory timeline from HTA's own reader; the H100 trace's peaks from its
``[memory]`` events read with the json module; the snapshot's figures from a snapshot built by hand
in the documented format (``torch.cuda.memory._snapshot``'s TypedDicts) with known sizes.
"""
from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mfuscope.analyzers import memory
from mfuscope.tests.helpers import CORPUS

TIMELINE = CORPUS / "traces/HolisticTraceAnalysis/tests/data/memory_analysis/memory_timeline.raw.gz"
QWEN_H100 = CORPUS / "traces/TraceLens/tests/traces/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"

# tiny_dense (reference_trainer/configs/tiny_dense.toml): vocab 256, dim 64, 4 layers, 4 heads of 16,
# 2 KV heads, SwiGLU 128.  Per layer: wq, wo 64x64; wk, wv 64x32; w1, w2, w3 64x128; two norms of 64.
TINY_PARAMS = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 2 * 256 * 64 + 64
HAND = {"parameter": 4 * TINY_PARAMS, "gradient": 4 * TINY_PARAMS, "optimizer_state": 2 * 4 * TINY_PARAMS}


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory):
    """Three tiny_dense runs with ``--profile-memory`` (window: step 2, the optimizer's state made at
    step 0 and a step to warm up): one rank; dp_shard=2 (FSDP2, with a step after the window, inside
    which the window is exported); one rank with full recomputation.  Each analyzed."""
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.optimizers.predicted_memory import analyze
    from mfuscope.tests.shared_runs import train_forked

    root = tmp_path_factory.mktemp("memory")
    runs = {}
    for name, world, options in (("one", 1, {"layout": "dp_shard=1", "steps": 3}),
                                 ("fsdp", 2, {"layout": "dp_shard=2", "steps": 4}),
                                 ("full", 1, {"layout": "dp_shard=1", "steps": 3, "overrides": {"recompute": "full"}})):
        out = train_forked(root / name, world, window="2:1", profile_memory=True, **options)
        report, _ = analyze(out, out / "report.json", out / "views")
        runs[name] = (out, report)
    return runs


def test_expert_parallel_ranks_keep_their_own_experts_whole_and_the_model_counts_them(tmp_path):
    """tiny_moe on dp_shard=2 with ep=2: each rank holds 2 of the 4 experts, which the other does
    not, so FSDP shards the rest in halves and leaves the experts whole (expert data parallelism,
    reference_trainer/expert_parallel.py).  Hand count from tiny_moe.toml (dim 64, 4 layers, 4
    heads of 16, 2 KV heads, 4 experts of SwiGLU 64, vocabulary 256): a layer's wq, wo 64x64, wk,
    wv 64x32, router 64x4 and two norms; each expert's w1, w3, w2 64x64; the embedding, head and
    final norm.  The model's states beside them are the same count: before it knew the expert
    data-parallel group it halved the experts again (363,648 bytes of parameters, not 560,256).
    And the whole peak, which PyTorch's categories do not split reliably on this run (its memory
    timeline files the experts' saved rows as "other", when it does not fail): the model's count,
    with the routed rows the busiest rank keeps at the measured load, less the gradients (this
    trainer frees them before its forward, docs/memory.md), within the 15% of the tests above."""
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.optimizers.predicted_memory import analyze
    from mfuscope.tests.shared_runs import train_forked

    dense = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 64 * 4 + 2 * 64) + 2 * 256 * 64 + 64
    own_experts = 4 * 2 * 3 * 64 * 64
    params = dense / 2 + own_experts
    hand = {"parameter": 4 * params, "gradient": 4 * params, "optimizer_state": 2 * 4 * params}
    out = train_forked(tmp_path / "ep", 2, config="tiny_moe", layout="dp_shard=2,ep=2", steps=2, window="1:1",
                       profile_memory=True)
    report, _ = analyze(out, out / "report.json", out / "views")
    for rank in (0, 1):
        e = _rank(report, rank)
        for c, expected in hand.items():
            # optimizer state: AdamW's step counters (one 4-byte scalar a parameter tensor) on top
            assert e["states"][c] == pytest.approx(expected, rel=0.01), (rank, c)
            assert e["predicted"][c] == pytest.approx(expected, rel=0.01), (rank, c)
        peak = sum(e["predicted"].values()) - e["predicted"]["gradient"]
        assert e["peak_allocated_bytes"] == pytest.approx(peak, rel=0.15), (rank, e["predicted"])


def _rank(report: dict, rank: int) -> dict:
    return next(e for e in report["memory"]["per_rank"] if e["rank"] == rank)


def test_model_states_are_the_hand_count_and_fsdp_halves_them(memory_runs):
    _, one = memory_runs["one"]
    states = _rank(one, 0)["states"]
    for c, expected in HAND.items():
        # optimizer state: AdamW's step counters (one 4-byte scalar a parameter tensor) on top
        assert states[c] == pytest.approx(expected, rel=0.01), c
    _, fsdp = memory_runs["fsdp"]
    for rank in (0, 1):  # every parameter's first dimension is even: FSDP2's shards are exact halves
        sharded = _rank(fsdp, rank)["states"]
        for c, expected in HAND.items():
            assert sharded[c] == pytest.approx(expected / 2, rel=0.01), (rank, c)


def test_the_windows_export_is_the_collectors_step_and_not_the_jobs(memory_runs):
    """The window (step 2) is written on the training thread inside step 3's span -- a trace and a
    memory timeline per rank, seconds against a step of tens of ms: the step table records the
    collectors' work there, and the report's step time leaves that step out (its mean is no longer
    than the slowest step it kept; counted in, the export made it several times longer)."""
    out, report = memory_runs["fsdp"]
    steps = pq.read_table(out / "steps.parquet").to_pandas()
    steps["seconds"] = (steps["end_ns"] - steps["start_ns"]) / 1e9
    export = steps[steps["step"] == 3]
    assert (export["collector_ns"] > 0).all() and (export["collector_ns"] / 1e9 <= export["seconds"]).all()
    kept = steps[steps["step"].isin([1, 2])]  # step 0 is warm-up
    assert export["collector_ns"].max() / 1e9 > 0.1 * kept.groupby("step")["seconds"].max().median()
    # Left out: the steps where some rank's collectors worked over 10% of the job's median step --
    # step 3 (the export) always; step 2 too where starting the profiler took that long (a loaded
    # CI runner: 31 s of collectors' work in all, some of it in step 2).
    job = steps.groupby("step")["seconds"].max()
    theirs = steps.groupby("step")["collector_ns"].max() / 1e9
    left_out = sorted(int(s) for s in theirs[theirs > 0.10 * job.median()].index)
    assert 3 in left_out and set(left_out) <= {2, 3}, left_out
    summary = report["summary"]
    named = ", ".join(map(str, left_out))
    assert f"step{'s' if len(left_out) > 1 else ''} {named} left out" in summary["step_time_source"], summary
    assert summary["step_time_s"] <= kept["seconds"].max() * (1 + 1e-9)


def test_the_peak_is_measured_and_its_categories_add_up(memory_runs):
    out, one = memory_runs["one"]
    e = _rank(one, 0)
    assert e["device"] == "cpu" and e["peak_reserved_bytes"] is None and "reserves nothing" in e["reserved_note"]
    assert e["peak_allocated_bytes"] == sum(e["categories"].values())  # the timeline's peak, whole
    # Kineto's CPU totals count from the window's start: its peak is the timeline's less the tensors
    # alive before the window (the parameters and the optimizer's state at least)
    trace = json.loads(gzip.decompress((out / "traces" / "rank0.pt.trace.json.gz").read_bytes()))
    kineto_peak = max(ev["args"]["Total Allocated"] for ev in trace["traceEvents"] if ev.get("name") == "[memory]")
    assert kineto_peak <= e["peak_allocated_bytes"] - HAND["parameter"] - HAND["optimizer_state"]
    assert max(s["peak_allocated_bytes"] for s in e["per_step"].values()) == kineto_peak
    # the states at the peak: the trainer frees gradients before its forward (zero_grad(set_to_none))
    assert e["categories"]["parameter"] == e["states"]["parameter"]
    assert e["categories"]["optimizer_state"] == e["states"]["optimizer_state"]
    assert e["categories"]["gradient"] == 0
    assert one["memory"]["peak_rank"] == 0 and "memory_timeline" in one["memory"]["sources"]
    view = __import__("pandas").read_parquet(out / "views" / memory.VIEW)
    assert set(view["source"]) == {"memory_timeline", "kineto cpu"}
    assert view.loc[view["source"] == "memory_timeline", "allocated_bytes"].max() == e["peak_allocated_bytes"]


def test_full_recompute_lowers_the_activation_peak_and_the_model_predicts_each_category(memory_runs):
    _, one = memory_runs["one"]
    _, full = memory_runs["full"]
    _, fsdp = memory_runs["fsdp"]
    kept, recomputed = _rank(one, 0)["activation_peak_bytes"], _rank(full, 0)["activation_peak_bytes"]
    assert recomputed < 0.5 * kept, (recomputed, kept)
    for report in (one, full, fsdp):
        for e in report["memory"]["per_rank"]:
            predicted = e["predicted"]
            for c in memory.STATES:  # against the states held (the count at the optimizer step)
                assert predicted[c] == pytest.approx(e["states"][c], rel=0.15), (e["rank"], c)
            assert predicted["activation"] == pytest.approx(e["activation_peak_bytes"], rel=0.15), e["rank"]


def test_the_corpus_timeline_gives_htas_totals():
    hta = pytest.importorskip("hta.memory_analysis", reason="HTA (the oracle) is in the [dev] extra")
    times, sizes = hta.MemoryAnalysis(str(TIMELINE))._process_raw_events()
    ours_t, ours = memory.timeline_sizes(memory.read_timeline(TIMELINE))
    assert ours_t.tolist() == times
    assert ours.tolist() == sizes  # every category at every timestamp, in bytes
    top = int(np.argmax(np.array(sizes).sum(axis=1)))
    summary = memory.timeline_summary(memory.read_timeline(TIMELINE))
    assert summary["peak_bytes"] == sum(sizes[top])
    assert list(summary["at_peak"].values()) == sizes[top]


def test_a_gpu_traces_allocator_peaks_are_its_memory_events():
    from mfuscope.analyzers import overview, trace_set

    raw = json.loads(gzip.decompress(QWEN_H100.read_bytes()))
    cuda = [ev["args"] for ev in raw["traceEvents"] if ev.get("name") == "[memory]" and ev["args"]["Device Type"] == 1]
    events = trace_set.load(QWEN_H100, rank=0).events
    report = overview.build_report(events, source=str(QWEN_H100), files=[str(QWEN_H100)])
    e = _rank(report, 0)
    assert e["device"] == "cuda:0"
    assert e["peak_allocated_bytes"] == max(a["Total Allocated"] for a in cuda)
    assert e["peak_reserved_bytes"] == max(a["Total Reserved"] for a in cuda)
    fullest = max(cuda, key=lambda a: a["Total Reserved"])  # the first sample at the reserve's peak
    assert e["fragmentation"] == pytest.approx(1 - fullest["Total Allocated"] / fullest["Total Reserved"])


def _snapshot() -> dict:
    """Two segments on cuda:0 (a 2 MiB small-pool and a 20 MiB large-pool one) and the history that
    led to them: 20 MiB reserved, 12 MiB allocated and 8 MiB freed (the peak, 20 MiB allocated of
    22 MiB reserved, before the free), then the small segment."""
    mib = 2**20
    block = lambda size, state: {"size": size, "requested_size": size, "address": 0, "state": state,  # noqa: E731
                                 "frames": []}
    segments = [
        {"device": 0, "address": 1 << 30, "total_size": 20 * mib, "stream": 0, "segment_type": "large",
         "segment_pool_id": (0, 0), "allocated_size": 12 * mib, "active_size": 12 * mib,
         "blocks": [block(12 * mib, "active_allocated"), block(8 * mib, "inactive")]},
        {"device": 0, "address": 2 << 30, "total_size": 2 * mib, "stream": 0, "segment_type": "small",
         "segment_pool_id": (0, 0), "allocated_size": 2 * mib, "active_size": 2 * mib,
         "blocks": [block(2 * mib, "active_allocated")]},
    ]
    entry = lambda action, size: {"action": action, "addr": 0, "size": size, "stream": 0, "frames": []}  # noqa: E731
    trace = [entry("segment_alloc", 20 * mib), entry("alloc", 12 * mib), entry("alloc", 8 * mib),
             entry("segment_alloc", 2 * mib), entry("alloc", 2 * mib), entry("free_requested", 8 * mib),
             entry("free_completed", 8 * mib)]
    return {"segments": segments, "device_traces": [trace]}


def test_a_snapshot_in_the_documented_format_parses(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    d = memory.snapshot_summary(memory.read_snapshot(path))["cuda:0"]
    mib = 2**20
    assert (d["reserved_bytes"], d["allocated_bytes"], d["inactive_bytes"]) == (22 * mib, 14 * mib, 8 * mib)
    assert d["fragmentation"] == pytest.approx(8 / 22)
    assert (d["peak_allocated_bytes"], d["peak_reserved_bytes"]) == (22 * mib, 22 * mib)
    done = subprocess.run([sys.executable, "-m", "mfuscope", "memory", str(path)], capture_output=True, text=True)
    assert done.returncode == 0 and "reserved 22 MiB in 2 segment(s)" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("content", [pickle.dumps(_snapshot())[:200],            # cut short
                                     pickle.dumps(Path("/etc/passwd")),          # names a Python object
                                     pickle.dumps({"device_traces": []})],       # no segments
                         ids=["truncated", "names-an-object", "no-segments"])
def test_a_bad_snapshot_is_one_line_and_exit_2(tmp_path, content):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    done = subprocess.run([sys.executable, "-m", "mfuscope", "memory", str(path)], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and str(path) in done.stderr


def test_optimize_weighs_a_change_against_the_measured_peak(memory_runs):
    """A run that measured its memory: a change needs the measured peak scaled by the model's ratio
    (the base itself needs exactly what was measured), and it fits when that and the CUDA
    context are within the device's memory."""
    from dataclasses import replace

    from mfuscope.optimizers import measured, optimize
    from mfuscope.optimizers.cost.memory import CONTEXT_BYTES

    out, report = memory_runs["one"]
    run = measured.load(out)
    assert run.measured_memory_bytes == report["memory"]["peak_allocated_bytes"]  # the CPU: allocated
    base = run.predict(None).memory
    need, _ = optimize.memory_needed(run, base, base)
    assert need == run.measured_memory_bytes
    for budget, fits in ((need + CONTEXT_BYTES, True), (need + CONTEXT_BYTES - 1, False)):
        sized = replace(run, system=replace(run.system, memory_bytes=budget))
        assert optimize.memory_needed(sized, base, base) == (need, fits)
