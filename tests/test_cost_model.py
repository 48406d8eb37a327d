"""The step-time model: hand counts on toys, the published runs, and the planner's choices.

Toys pin the algebra (expected values typed from the formulas' sources, with
ideal links and no latency so every term is one division); the published runs
in ``corpus/published/calibration.csv`` pin the constants; the planner is
checked against published practice.
"""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from mfuscope.analyzers.bubbles import theory
from mfuscope.optimizers import calibrate, planner, presets, published
from mfuscope.optimizers.cost import comm
from mfuscope.optimizers.cost.compute import Gemm, layer_gemms, shape_efficiency, stage_compute
from mfuscope.optimizers.model import predict
from mfuscope.optimizers.spec import Layout, ModelSpec, Training
from mfuscope.optimizers.system import LinkTier, Profile, default_profile, system

from .helpers import CORPUS

CALIBRATION = CORPUS / "published" / "calibration.csv"
needs_calibration = pytest.mark.skipif(not CALIBRATION.is_file(), reason=f"no {CALIBRATION} (set MFUSCOPE_CORPUS)")

TOY = ModelSpec(n_layers=4, dim=1024, n_heads=8, ffn_dim=4096, vocab_size=1000)
IDEAL = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0,
                overlap_slowdown=0.0)


def ideal_system(key="H100", gpus_per_node=8):
    """The table's system with zero-latency links, so a collective is size x busfactor / bandwidth."""
    s = system(key, gpus_per_node=gpus_per_node)
    return replace(s, scale_up=replace(s.scale_up, latency_s=0.0), scale_out=replace(s.scale_out, latency_s=0.0))


# ----------------------------------------------------------------------------- communication

def test_bus_factors_are_nccl_tests():
    assert comm.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert comm.bus_factor("all_gather", 8) == comm.bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert comm.bus_factor("all_to_all", 4) == pytest.approx(3 / 4)
    assert comm.bus_factor("send_recv", 2) == 1.0


def test_alpha_beta_collective_time():
    tier = LinkTier("t", latency_s=5e-6, bandwidth_Bps=100e9, source="test")
    # all-reduce of 1 GB over 8 ranks at 80% of 100 GB/s: 2 log2(8) = 6 latencies + 1.75 GB / 80 GB/s
    assert comm.collective_seconds("all_reduce", 1e9, 8, tier, 0.8) == pytest.approx(6 * 5e-6 + 1.75e9 / 80e9)
    assert comm.collective_seconds("all_gather", 1e9, 1, tier, 0.8) == 0.0


def test_placement_keeps_inner_dimensions_in_the_node():
    tiers = comm.tiers(Layout(tp=8, cp=2, dp_shard=4), gpus_per_node=8)
    assert tiers["tp"] == "scale_up" and tiers["cp"] == "scale_out" and tiers["dp_shard"] == "scale_out"
    tiers = comm.tiers(Layout(tp=4, cp=2, dp_shard=4), gpus_per_node=8)
    assert tiers["tp"] == tiers["cp"] == "scale_up" and tiers["dp_shard"] == "scale_out"
    # An NVL72 rack: tp=8 x dp=9 is one NVLink domain.
    assert comm.tiers(Layout(tp=8, dp_shard=9), gpus_per_node=72)["dp_shard"] == "scale_up"


def test_tensor_parallel_traffic_is_the_hand_count():
    """tp=2 with sequence parallelism: per layer and microbatch, 2 all-gathers and 2 reduce-scatters
    of the b s h activation forward and again backward (Korthikanti et al. 2022, sec. 4.2.2),
    each (t-1)/t of the buffer over NVLink, all exposed without async TP."""
    s = ideal_system()
    layout = Layout(tp=2, micro_batch=1, microbatches=3)
    p = predict(TOY, layout, Training(seq_len=1024), s, IDEAL)
    buf = 1024 * TOY.dim * 2
    one = 0.5 * buf / s.scale_up.bandwidth_Bps
    assert p.leaves["comm/tp/all_gather"] == pytest.approx(TOY.n_layers * 3 * 4 * one)
    assert p.leaves["comm/tp/reduce_scatter"] == pytest.approx(TOY.n_layers * 3 * 4 * one)
    # Without sequence parallelism: 2 all-reduces each way, twice the bus bytes of a gather.
    q = predict(TOY, replace(layout, sequence_parallel=False), Training(seq_len=1024), s, IDEAL)
    assert q.leaves["comm/tp/all_reduce"] == pytest.approx(TOY.n_layers * 3 * 4 * 2 * one)


def test_ddp_all_reduce_is_exposed_without_overlap_and_hidden_with_it():
    s = ideal_system()
    layout = Layout(dp_replicate=4, micro_batch=8, microbatches=2)
    params = TOY.total_params()
    exposed = predict(TOY, layout, Training(seq_len=1024, overlap_grad_reduce=False), s, IDEAL)
    full = 2 * 3 / 4 * params * 4 / s.scale_up.bandwidth_Bps
    assert exposed.leaves["comm/dp/all_reduce"] == pytest.approx(full)
    # Eight buckets: seven reduce during the backward (longer than the reduction), the last after it.
    eight = Training(seq_len=1024, grad_bucket_bytes=params * 4 / 8)
    slow = replace(IDEAL, overlap_slowdown=0.5)
    hidden = predict(TOY, layout, eight, s, slow)
    base = predict(TOY, layout, eight, s, IDEAL)
    assert hidden.leaves["comm/dp/all_reduce"] == pytest.approx(full / 8)
    # Hiding is not free: half the hidden time is added to the GEMMs.
    assert hidden.leaves["compute/gemm"] - base.leaves["compute/gemm"] == pytest.approx(0.5 * full * 7 / 8)
    # One bucket holding every gradient is reduced after the backward: nothing hides.
    one = Training(seq_len=1024, grad_bucket_bytes=params * 4)
    assert predict(TOY, layout, one, s, IDEAL).leaves["comm/dp/all_reduce"] == pytest.approx(full)


# ----------------------------------------------------------------------------- compute

def test_gemm_flops_are_the_hand_count():
    """One layer, 1024 tokens: q and o d x d, k and v d x d (no GQA), SwiGLU 3 d x ffn."""
    tokens = 1024
    flops = sum(g.flops for g in layer_gemms(TOY, Layout(), tokens))
    d, f = TOY.dim, TOY.ffn_dim
    assert flops == 2 * tokens * (4 * d * d + 3 * d * f)
    # tp=4 splits every projection four ways.
    assert sum(g.flops for g in layer_gemms(TOY, Layout(tp=4), tokens)) == pytest.approx(flops / 4)
    # MoE: each token visits top_k experts; the GPU holds E/ep of them.
    moe = replace(TOY, n_experts=8, top_k=2)
    expert = sum(g.flops for g in layer_gemms(moe, Layout(ep=4, dp_shard=4), tokens) if g.name.startswith("expert"))
    assert expert == pytest.approx(2 * tokens * 2 * 3 * d * f)


def test_skinny_gemms_run_slower():
    big, thin = Gemm("a", 8192, 8192, 8192), Gemm("b", 8192, 8192, 128)
    assert shape_efficiency(big, 128) == pytest.approx(1.0)
    assert shape_efficiency(thin, 128) == pytest.approx((128 / 256) / (8192 / 8320))


def test_forward_time_is_flops_over_the_matmul_ceiling():
    s = ideal_system()
    stage = stage_compute(TOY, Layout(), Training(seq_len=1024), s, IDEAL, layers=1, with_head=False)
    flops = sum(g.flops for g in layer_gemms(TOY, Layout(), 1024))
    assert stage.fwd["gemm"] == pytest.approx(flops / s.matmul_flops("bf16"))
    assert stage.bwd["gemm"] == pytest.approx(2 * stage.fwd["gemm"])
    # Full recomputation runs the forward again inside backward.
    full = stage_compute(TOY, Layout(recompute="full"), Training(seq_len=1024), s, IDEAL, layers=1, with_head=False)
    assert full.bwd["gemm"] == pytest.approx(3 * stage.fwd["gemm"])
    # Causal flash attention: 4 s^2 d / 2 forward, 2.5x that backward at 0.87 of the forward rate
    # (FlashAttention-2: 63% against 73% of A100's peak; 322 against 370 TFLOP/s on H100).
    causal = 4 * 1024 * 1024 * TOY.dim / 2
    assert stage.fwd["attention"] == pytest.approx(causal / s.attention_ceiling())
    assert stage.bwd["attention"] == pytest.approx(2.5 * stage.fwd["attention"] / 0.87)


def test_a_power_cap_slows_compute_by_the_cube_root():
    assert system("H100", power_limit_w=500).matmul_flops("bf16") == pytest.approx(
        794.5e12 * (500 / 700) ** (1 / 3))


# ----------------------------------------------------------------------------- pipeline

@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)])
def test_the_bubble_is_the_schedules_theory(schedule, v):
    """With compute known and ideal links, the predicted bubble is the schedule's theory and the
    step is the pipeline's time over (1 - bubble).  (Links of unbounded bandwidth: the sends of
    the fill and drain would add their bytes / bandwidth.)"""
    s = ideal_system()
    s = replace(s, scale_up=replace(s.scale_up, bandwidth_Bps=math.inf))
    f, b, w = 0.010, 0.012, 0.008
    layout = Layout(pp=4, vpp=v, micro_batch=1, microbatches=8, schedule=schedule)
    p = predict(replace(TOY, n_layers=8), layout, Training(seq_len=1024), s, IDEAL, known_phases=(f, b, w))
    zb = schedule == "zero_bubble"
    expected = theory(4, 8, v, schedule, (f, b, w) if zb else (f, b + w, 0.0))
    assert p.bubble_fraction == pytest.approx(expected, rel=1e-3)
    work = 8 * (f + b + w)
    assert p.step_s - p.leaves["compute/optimizer"] == pytest.approx(work / (1 - expected), rel=1e-3)


# ----------------------------------------------------------------------------- published runs

@needs_calibration
def test_measured_throughput_from_mfu_matches_the_papers_own_iteration_time():
    """Korthikanti et al. give both MFU and iteration time for their "present work" rows: the
    tokens/s derived from the MFU through their FLOP formula must equal global batch x sequence
    / iteration time, which the paper states separately (3-digit MFU: within 0.5%)."""
    rows = published.read_rows(CALIBRATION)
    checked = 0
    for row in rows:
        if published.source_family(row["source"]) == "korthikanti" and row["measured_mfu"] and row["iteration_time_s"]:
            stated = int(row["global_batch"]) * int(row["seq_len"]) / float(row["iteration_time_s"]) / int(row["num_gpus"])
            derived = published.measured_tps({**row, "measured_tokens_per_s_per_gpu": ""}, "korthikanti")
            assert derived == pytest.approx(stated, rel=0.005), row["model"]
            checked += 1
    assert checked >= 4


@needs_calibration
def test_every_row_is_predicted_or_says_why():
    cases, skipped = published.load_cases(CALIBRATION)
    assert len(cases) + len(skipped) == 73
    assert all(reason for reason in skipped.values())
    # The rows the source leaves unsplit are the ones not modelled.
    assert "tensor/pipeline split not stated" in skipped.values()


@needs_calibration
def test_leave_one_source_out_error():
    """The honest figure: fit the profile's 7 numbers on two sources, predict the third.  The
    issue's target is 15% MAPE.  Korthikanti's rows meet it; Narayanan's (its DeepSpeed ZeRO-3
    rows overlap less than the model's FSDP prefetch) and torchtitan's (H100s at 500 W, unstated
    float8 recipes, an attention kernel slower than FlashAttention-2's published rate) do not yet:
    this guards the figures docs/cost_model.md reports (4.2%, 17.3%, 29.5%) against getting worse.
    The fit is deterministic (a fixed grid search in double precision), so the margins are for
    changes to the model, not for noise."""
    cases, _ = published.load_cases(CALIBRATION)
    result = calibrate.leave_one_source_out(cases)
    assert result["korthikanti"]["held_out_mape"] <= 0.15
    assert result["narayanan"]["held_out_mape"] <= 0.20
    assert result["torchtitan"]["held_out_mape"] <= 0.33
    for source in result.values():  # in sample, every source near the target
        assert source["in_sample_mape"] <= 0.17


@needs_calibration
def test_predict_command_writes_every_row_and_scores_per_source(tmp_path):
    out = tmp_path / "pred.csv"
    done = subprocess.run([sys.executable, "-m", "mfuscope", "predict", str(CALIBRATION), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "korthikanti" in done.stdout and "overall" in done.stdout
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 73
    for row in rows:
        if row["prediction_error"]:
            assert row["predicted_tokens_per_s_per_gpu"] == ""
        else:
            tree = json.loads(row["predicted_breakdown"])
            assert tree["name"] == "step"
            assert tree["seconds"] == pytest.approx(float(row["predicted_step_time_s"]), rel=1e-5)
            assert float(row["predicted_tokens_per_s_per_gpu"]) > 0


def test_predict_command_rejects_a_csv_without_the_columns(tmp_path):
    bad = tmp_path / "runs.csv"
    bad.write_text("a,b\n1,2\n")
    done = subprocess.run([sys.executable, "-m", "mfuscope", "predict", str(bad)], capture_output=True, text=True)
    assert done.returncode == 2 and "missing columns" in done.stderr and "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- planner

def test_planner_keeps_tensor_parallelism_inside_a_node_and_follows_practice_for_70b():
    """Llama 3 70B on 1024 H100s: every layout ranked keeps TP inside the 8-GPU node; the top ones
    are model-parallel over half a node or more (tp of 4 or 8) with pipeline stages or sharded data
    ranks, as the published recipes for this size: NeMo's Llama 3 70B pretraining recipe runs tp=4
    with pp=4, torchtitan's benchmarks tp=8 with FSDP."""
    result = planner.plan(presets.load("llama3-70b"), 1024, system("H100"), 2048, Training(seq_len=8192),
                          default_profile(), top=10)
    assert result.ranked and not result.tp_across_nodes
    for layout, _ in result.ranked:
        assert layout.tp * layout.cp <= 8
    for layout, _ in result.ranked[:5]:
        assert layout.tp in (4, 8) and (layout.pp > 1 or layout.dp_shard > 1 or layout.zero >= 1)
    assert result.rejected["does not fit in memory"] > 0  # 70B does not fit unsharded on one H100


def test_planner_allows_tensor_parallelism_across_nodes_only_when_forced():
    """One very wide layer (nothing to pipeline, a sequence too short for context parallelism) on
    16 GB GPUs, two per node: no layout with tp <= 2 fits, so the planner lets TP span nodes and
    says so."""
    wide = ModelSpec(n_layers=1, dim=16384, n_heads=128, ffn_dim=65536, vocab_size=32000)
    small_nodes = replace(system("A100", gpus_per_node=2), memory_bytes=16e9)
    result = planner.plan(wide, 8, small_nodes, 8, Training(seq_len=8192), top=3)
    assert result.tp_across_nodes and result.ranked
    assert all(layout.tp > 2 for layout, _ in result.ranked)


def test_plan_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mfuscope", "plan", "--model", "llama3-8b", "--gpus", "64",
                           "--gpu", "H100", "--global-batch", "128", "--seq-len", "8192", "--top", "3", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert len(plan["ranked"]) == 3 and plan["rejected"]
    speeds = [r["tokens_per_s_per_gpu"] for r in plan["ranked"]]
    assert speeds == sorted(speeds, reverse=True)
    bad = subprocess.run([sys.executable, "-m", "mfuscope", "plan", "--model", "nope", "--gpus", "8",
                          "--global-batch", "8", "--seq-len", "128"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown model" in bad.stderr


def test_memory_of_a_prediction_is_the_memory_model():
    from mfuscope.optimizers.cost import memory
    layout = Layout(tp=2, dp_shard=4, micro_batch=2, microbatches=2)
    p = predict(TOY, layout, Training(seq_len=1024), system("H100"))
    assert p.memory.total_bytes == memory.estimate(TOY, layout, 1024, device_bytes=80e9).total_bytes
    assert math.isclose(p.tokens_per_s_per_gpu * p.step_s * layout.gpus, layout.dp * 2 * 2 * 1024)
