"""The cost model against the reference trainer: predict a run first, then run it and compare.

Two kinds of check.  **Proof on real compute**: unpaced runs of seven layouts (tests/real_compute.py)
on this CPU, calibrated on two, the other five predicted -- what the model is for.  **Mechanism
checks**: paced mode makes compute time known (``--paced ...,per=sample``: each stage chunk sleeps a
fixed time per sample of its microbatch), so what is checked is the model's pipeline --
microbatch count, schedule, bubble -- not a CPU's speed; being the model's own assumption (stage
time proportional to the work), a pass there proves the mechanism, not the rates.  Per-sample
pacing keeps the step's work constant while the microbatch count changes, as on a real device.
Every prediction is made from the layout alone, then held against a measured run.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mfuscope.optimizers import calibrate, measured
from mfuscope.optimizers.model import predict
from mfuscope.optimizers.spec import Layout, ModelSpec
from mfuscope.optimizers.system import FSDP_HOOK_LAYER_PASSES, Profile, default_profile

from . import real_compute
from .helpers import WAKE_S
from .shared_runs import PIPE_BATCH, PIPE_BWD_MS, PIPE_FWD_MS, PIPE_STAGES, PIPELINES

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
#: Wall time is what these tests assert: make test runs them in its paced lane (tests/lanes.py).
pytestmark = pytest.mark.paced


P, FWD_MS, BWD_MS, GLOBAL_BATCH = PIPE_STAGES, PIPE_FWD_MS, PIPE_BWD_MS, PIPE_BATCH


def test_mechanism_pipeline_schedules_on_paced_runs(paced_pipelines):
    """Mechanism check.  1F1B, GPipe and interleaved 1F1B at 4 and 8 microbatches: step time and bubble predicted
    from the layout alone, then measured, within 15% each.

    A microbatch on a rank takes v chunks x the paced time x its samples (8 sequences / m).  What
    the pacing does not fix -- the host's time per microbatch (Python, autograd, the profiler)
    and the gloo hop a pipeline receive waits for -- is one number, calibrated on the first run
    (1F1B, m=4) and then held fixed: the other three runs are predictions, not fits."""
    model = ModelSpec(n_layers=8, dim=32, n_heads=2, ffn_dim=64, vocab_size=64)
    profile = None
    for schedule, v, m in PIPELINES:
        b = GLOBAL_BATCH // m
        layout = Layout(pp=P, vpp=v, micro_batch=b, microbatches=m, schedule=schedule, sequence_parallel=False)
        phases = (v * FWD_MS / 1e3 * b, v * BWD_MS / 1e3 * b, 0.0)
        out, report = paced_pipelines[(schedule, m)]
        run = measured.load(out)
        assert run.known_phases == pytest.approx(phases)
        assert run.layout == layout, run.layout
        if profile is None:
            profile = calibrate.fit_run(run)
            assert profile.provenance["fields"] == ["microbatch_overhead_s"]
            # What it does not fit is the published profile's, as in plan, predict and the CI gate.
            published = default_profile()
            assert all(getattr(profile, f) == getattr(published, f) for f in Profile.FITTED)
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


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """The seven unpaced layouts of tests/real_compute.py, trained and analyzed."""
    return real_compute.train_all(tmp_path_factory.mktemp("real"), say=lambda _: None)


def _link_terms(run) -> list[tuple[float, float, float]]:
    """Each collective's (weight, latency term, bandwidth term) at the profile's defaults, written
    out from the alpha-beta formula: ceil(log2 n) latency steps (twice for an all-reduce, one for a
    send), bus bytes 2(n-1)/n of the size for an all-reduce, (n-1)/n for a gather or scatter."""
    terms = []
    for c in run.collectives:
        # gloo has no reduce-scatter of its own: an all-reduce of the whole input
        op = {"send": "send_recv", "recv": "send_recv", "reduce_scatter": "all_reduce"}.get(c.op, c.op)
        n = c.group_size
        steps = 1 if op == "send_recv" else math.ceil(math.log2(n)) * (2 if op == "all_reduce" else 1)
        bus = {"all_reduce": 2 * (n - 1) / n}.get(op, (n - 1) / n if op != "send_recv" else 1.0)
        tier = run.system.scale_up
        terms.append((c.calls, steps * tier.latency_s, c.bytes * bus / tier.bandwidth_Bps))
    return terms


def _expected_link_fit(runs) -> tuple[float | None, float]:
    """numpy's weighted least squares of per-call time on the two terms, weighted by the calls;
    where it leaves the latency or the inverse efficiency at or below zero, the latency stays at
    the default (1) and the bandwidth alone is solved.  Returns (latency scale or None, scale_up)."""
    import numpy as np
    rows = [(t, c.seconds) for run in runs for t, c in zip(_link_terms(run), run.collectives)]
    w = np.sqrt([t[0] for t, _ in rows])
    a = np.array([[t[1], t[2]] for t, _ in rows])
    y = np.array([s for _, s in rows])
    lat, inv_eff = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    if lat > 0 and inv_eff > 0:
        return float(lat), float(1 / inv_eff)
    inv_eff = np.linalg.lstsq((a[:, 1] * w)[:, None], (y - a[:, 0]) * w, rcond=None)[0][0]
    return None, float(1 / inv_eff)


def test_link_tiers_fit_is_the_weighted_least_squares_of_the_calls(real_runs):
    """The links' latency and bandwidth fitted to every collective two real runs timed equal an
    independent weighted least-squares solve (numpy's) of per-call time on latency steps and bus
    bytes -- on the times as measured, and on times written from known coefficients: a latency
    scale of 3 and an efficiency of 0.5 come back exactly; a latency of -0.5 (what a loaded host
    once made of the measured calls, its large ones waiting longer on the peer) is refused, the
    latency kept and the bandwidth solved alone."""
    runs = [measured.load(real_runs[n]) for n in ("tp=2", "dp_shard=2")]

    def with_times(lat_scale: float, inv_eff: float) -> list:
        return [dataclasses.replace(run, collectives=tuple(
            dataclasses.replace(c, seconds=lat_scale * t[1] + inv_eff * t[2])
            for t, c in zip(_link_terms(run), run.collectives))) for run in runs]

    for label, these, known in (("measured", runs, None),
                                ("latency 3, efficiency 0.5", with_times(3.0, 2.0), (3.0, 0.5)),
                                ("latency -0.5", with_times(-0.5, 2.0), None)):
        profile, fitted = calibrate.fit_link_tiers(these, Profile())
        lat, scale_up = _expected_link_fit(these)
        if known:
            assert (lat, scale_up) == pytest.approx(known, rel=1e-9), label
        if label == "latency -0.5":
            assert lat is None, label
        if lat is None:
            assert fitted == {"scale_up"} and profile.latency_scale == 1.0, (label, fitted)
        else:
            assert fitted == {"latency_scale", "scale_up"}, (label, fitted)
            assert profile.latency_scale == pytest.approx(lat, rel=1e-6), label
        assert profile.scale_up == pytest.approx(scale_up, rel=1e-6), label


def test_a_slow_run_beside_the_one_rank_run_leaves_its_groups_fitted(real_runs):
    """The groups fitted on the one-rank run alone (the compute rates, the host's time per layer)
    are held to 1% of that run's step, not of every run's: a tp=2 run whose steps a loaded host
    stretched 10x (injected here) must not lift the bar out of their reach.  It did once, in a
    fresh-clone CI (tp=2's mean step 4x its quiet one): the optimizer rate and the host time went
    unfitted and every layout's prediction with them."""
    one, tp = (measured.load(real_runs[n]) for n in real_compute.CALIBRATE_ON)
    slow = dataclasses.replace(tp, median_step_s=10 * tp.typical_step_s, step_s=10 * tp.step_s)
    quiet = set(calibrate.fit_runs([one, tp]).provenance["fields"])
    assert {"gemm", "attention", "memory", "optimizer", "layer_overhead_s"} <= quiet
    assert quiet <= set(calibrate.fit_runs([one, slow]).provenance["fields"])


def test_context_parallel_k_v_exchange_is_labelled_cp(real_runs):
    """On cp=2 alone the mesh's cp group is also FSDP's (``dp_shard_cp``): the trainer gives the K/V
    exchange a group of its own so that it shows as cp's traffic, not dp's.  Hand count for the
    four traced steps: K and V gathered apart (2) in each of 4 layers on each of the 2 ranks (one
    microbatch a step) is 16 all-gathers a step, 64 in all, and as many all-to-alls carry their
    gradients back."""
    comm = json.loads((real_runs["cp=2"] / "report.json").read_text())["comm"]
    cp = {row["op"]: row["count"] for row in comm if row["dim"] == "cp"}
    assert cp == {"all_gather": 64, "all_to_all": 64}, comm
    assert not [row for row in comm if row["dim"].startswith("dp") and row["op"] == "all_to_all"], comm


def test_fsdp_traffic_of_the_moe_run_is_data_parallel(real_runs):
    """On dp_shard=2,ep=2 the MoE balance loss counts tokens over every data rank -- the world,
    which DeviceMesh serves with the default group, FSDP's own -- so its extra group used to rename
    FSDP's gathers ``moe_aux`` and the model's ``comm/dp`` leaves had nothing measured beside them.
    Hand count for both FSDP runs of the table: five FSDP units (four layers and the root) gather
    in forward and again in backward and reduce-scatter once, on each of the 2 ranks (one
    microbatch a step), in 4 traced steps: 80 all-gathers and 40 reduce-scatters, all on the
    data-parallel group."""
    def fsdp_calls(name: str) -> dict[tuple[str, str], int]:
        calls: dict[tuple[str, str], int] = {}
        for row in json.loads((real_runs[name] / "report.json").read_text())["comm"]:
            if row["op"] in ("all_gather", "reduce_scatter"):
                key = ("dp" if row["dim"].startswith("dp") else row["dim"], row["op"])
                calls[key] = calls.get(key, 0) + row["count"]
        return calls

    expected = {("dp", "all_gather"): 80, ("dp", "reduce_scatter"): 40}
    assert fsdp_calls("dp_shard=2") == expected
    assert fsdp_calls("ep=2 (moe)") == expected


def test_the_expert_exchange_sends_its_counts_first_as_the_model_has_it(real_runs):
    """What the model's expert parallelism counts (``model.expert_exchange_s``,
    ``expert_counts_s``), against the trainer's calls: in each of 4 layers, on each of the 2
    ranks (one microbatch a step), forward exchanges the token counts (4 experts, one int64 each: 32 bytes), then
    dispatches and combines the tokens; backward sends the two exchanges' gradients back with the
    same split sizes.  4 traced steps: 32 count exchanges of 32 bytes and 128 of tokens."""
    comm = json.loads((real_runs["ep=2 (moe)"] / "report.json").read_text())["comm"]
    ep = [row for row in comm if row["dim"] == "ep"]
    assert {row["op"] for row in ep} == {"all_to_all"}
    small = [row for row in ep if row["median_bytes"] == 32]
    assert sum(row["count"] for row in small) == 32 and sum(row["bytes"] for row in small) == 32 * 32
    assert sum(row["count"] for row in ep) - 32 == 128


def test_fsdps_hooks_predict_the_host_time_of_the_layouts_that_shard(real_runs):
    """What the FSDP layouts spend on the host beyond the per-layer time the one-rank run fits is
    FSDP2's hooks (about 15 calls a step: five units, each gathered twice and reduce-scattered once).
    Calibrated on one rank and tp=2, which cannot see them, the model books each call as
    ``FSDP_HOOK_LAYER_PASSES`` layer passes of the host time it fitted -- a number measured on
    two other models (``benchmarks/fsdp_hooks.py``: tiny_dense and a d=128 one), not on these
    runs; calibrated with a third run that shards, dp_shard=2, it fits the number
    (``fsdp_hook_layer_passes``).  Either way dp_shard=2, cp=2 and ep=2 are predicted their host
    leaves (``compute/other`` and ``idle``) within 2.5x of what they measure (2026-12-06: 1.25-1.35x
    at the prior of 1.1 with a core kept busy, up to 2.0x while a prior of 1.6-1.7 was tried -- the
    prior scales with the one-rank run's noisy per-layer time; 0.66-1.0x fitted), where without
    the hooks they get 0.19-0.47x; fitted, closer than without them."""
    names = ("1 rank", "tp=2", "dp_shard=2", "cp=2", "ep=2 (moe)")
    runs = {n: measured.load(real_runs[n]) for n in names}
    two = calibrate.fit_runs([runs["1 rank"], runs["tp=2"]])
    three = calibrate.fit_runs([runs["1 rank"], runs["tp=2"], runs["dp_shard=2"]])
    assert "fsdp_hook_layer_passes" not in two.provenance["fields"]
    assert two.fsdp_hook_layer_passes == FSDP_HOOK_LAYER_PASSES and two.layer_overhead_s > 0
    assert "fsdp_hook_layer_passes" in three.provenance["fields"]
    no_hooks = dataclasses.replace(two, fsdp_hook_layer_passes=0.0)

    def host(leaves: dict[str, float]) -> float:
        return sum(v for k, v in leaves.items() if k in calibrate.HOST)

    for name in ("dp_shard=2", "cp=2", "ep=2 (moe)"):
        run = runs[name]
        measured_host = host(run.typical_leaves())
        prior, fitted, without = (host(run.predict(p).leaves) for p in (two, three, no_hooks))
        print(f"{name}: host {measured_host * 1e3:.1f} ms measured; predicted {prior * 1e3:.1f} with the hooks "
              f"at {FSDP_HOOK_LAYER_PASSES} layer passes, {fitted * 1e3:.1f} at the "
              f"{three.fsdp_hook_layer_passes:.2f} dp_shard=2 fits, {without * 1e3:.1f} without them")
        for predicted_host in (prior, fitted):
            assert 0.4 < predicted_host / measured_host < 2.5, name
        assert abs(math.log(fitted / measured_host)) < abs(math.log(without / measured_host)), name


def test_cpu_runs_are_predicted_at_the_calibrations_host_peak(real_runs, tmp_path):
    """Each CPU run's rank 0 times a few matmuls for the host's peak (best of 5), and a loaded host
    moves that number between runs.  ``calibrate`` keeps the best its runs measured and ``predict``
    holds every CPU run to it: a copy of the ddp=2 run whose report claims twice the peak is
    predicted exactly as the run itself."""
    hw = tmp_path / "hw.json"
    done = subprocess.run([sys.executable, "-m", "mfuscope", "calibrate",
                           *[str(real_runs[n]) for n in real_compute.CALIBRATE_ON], "--out", str(hw)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    peaks = [json.loads((real_runs[n] / "report.json").read_text())["summary"]["peak_flops"]
             for n in real_compute.CALIBRATE_ON]
    assert json.loads(hw.read_text())["provenance"]["cpu_peak_flops"] == max(peaks)

    twin = tmp_path / "ddp2-claims-twice-the-peak"
    twin.mkdir()
    report = json.loads((real_runs["ddp=2"] / "report.json").read_text())
    report["summary"]["peak_flops"] *= 2
    (twin / "report.json").write_text(json.dumps(report))
    (twin / "manifest.json").write_text((real_runs["ddp=2"] / "manifest.json").read_text())
    done = subprocess.run([sys.executable, "-m", "mfuscope", "predict", str(real_runs["ddp=2"]), str(twin),
                           "--hardware", str(hw), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    original, claimed = (row["predicted_step_s"] for row in json.loads(done.stdout))
    assert claimed == original


def _prediction_errors(runs: dict[str, Path], out: Path) -> dict[str, float]:
    """predicted / measured - 1 for each of ``runs``, the profile calibrated (``mfuscope
    calibrate``) on :data:`real_compute.CALIBRATE_ON` and each run predicted (``mfuscope predict
    --json``)."""
    out.mkdir(parents=True, exist_ok=True)
    hw = out / "hw.json"
    done = subprocess.run([sys.executable, "-m", "mfuscope", "calibrate",
                           *[str(runs[n]) for n in real_compute.CALIBRATE_ON], "--out", str(hw), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    fit = json.loads(done.stdout)
    # the links' latency too, unless a loaded host's calls put its solve below zero (kept, then)
    assert {"gemm", "attention", "memory", "optimizer", "layer_overhead_s", "scale_up"} <= set(
        fit["provenance"]["fields"])
    done = subprocess.run([sys.executable, "-m", "mfuscope", "predict", *[str(p) for p in runs.values()],
                           "--hardware", str(hw), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {Path(r["run"]): r for r in json.loads(done.stdout)}
    errors = {}
    for name, path in runs.items():
        row = rows[path]
        assert set(row) == {"run", "layout", "measured_step_s", "predicted_step_s", "leaves", "assumptions"}
        errors[name] = row["predicted_step_s"] / row["measured_step_s"] - 1
        print(f"{name:<12} measured {row['measured_step_s'] * 1e3:6.1f} ms, predicted "
              f"{row['predicted_step_s'] * 1e3:6.1f} ms ({errors[name]:+.0%})")
        if abs(errors[name]) > real_compute.TARGET[name]:  # where it went: the leaves that differ most
            gaps = sorted(row["leaves"].items(), key=lambda kv: -abs((kv[1]["measured_s"] or 0.0)
                                                                       - (kv[1]["predicted_s"] or 0.0)))
            print("    " + ", ".join(f"{leaf} {(v['measured_s'] or 0) * 1e3:.1f} / "
                                    f"{(v['predicted_s'] or 0) * 1e3:.1f} ms" for leaf, v in gaps[:5])
                  + " (measured / predicted)")
    return errors


def _misses(errors: dict[str, float]) -> set[str]:
    return {name for name, error in errors.items() if abs(error) > real_compute.TARGET[name]}


def test_unpaced_cpu_runs_are_predicted_from_two_of_them(real_runs, tmp_path):
    """Real compute: the profile calibrated on two unpaced runs predicts the median step of the
    other five, each within its target.

    A layout that misses is measured again -- trained anew with the two calibration runs, the
    profile refitted -- and fails only if it misses both times.  A model error is systematic and
    misses again; a co-tenant's burst of load (a CI runner's neighbours, the rest lane's processes
    taking a core whenever a rank blocks in gloo) stretches one run's steps by 30-40% and is gone
    a minute later: seen in fresh-clone CIs as ddp=2 +32% and pp=2 -35%, each once, against +12%
    and +1% at worst on quiet runs (docs/cost_model.md)."""
    # The MoE run's routing, as its exchanges measured it: a randomly initialised router does not
    # balance, and over two ranks the busiest holds at most all of the rows: twice the mean.
    report = json.loads((real_runs["ep=2 (moe)"] / "report.json").read_text())
    moe = report["moe"]
    assert 1 < moe["expert_load"] <= 2 and moe["uneven"] <= moe["exchanges"], moe
    if moe["expert_load"] >= 1.1:  # the record's threshold; this seed's router measures about 1.16
        assert "balance_experts" in {f["fix"] for f in report["findings"]}, report["findings"]
    first = _prediction_errors(real_runs, tmp_path / "first")
    misses = _misses(first)
    if misses:
        print(f"missed {sorted(misses)}: measured again")
        names = [*real_compute.CALIBRATE_ON, *sorted(misses - set(real_compute.CALIBRATE_ON))]
        again = _prediction_errors(real_compute.train_all(tmp_path / "again", names, say=lambda _: None),
                                   tmp_path / "second")
        misses &= _misses(again)
    assert not misses, {name: f"{first[name]:+.0%}, then {again[name]:+.0%}" for name in misses}
    bad = subprocess.run([sys.executable, "-m", "mfuscope", "calibrate", str(tmp_path / "nothing")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr
    cpu = subprocess.run([sys.executable, "-m", "mfuscope", "predict", str(real_runs["1 rank"])],
                         capture_output=True, text=True)
    assert cpu.returncode == 2 and "--hardware" in cpu.stderr and "Traceback" not in cpu.stderr
