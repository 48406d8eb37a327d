"""``mfuscope optimize`` on the reference trainer: propose, apply, re-measure, predicted against measured.

Paced mode (compute time known) from a deliberately poor start: GPipe with 2
microbatches of 4 sequences on 2 pipeline stages cut 7,1.  The optimizer must find
faster setups, run each as a new run directory, and keep the best; every
prediction is held against its own measured run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

from mfuscope.optimizers.optimize import gain_held  # noqa: E402
from mfuscope.tests.helpers import DLRM  # noqa: E402
from mfuscope.tests.shared_runs import mfuscope as _mfuscope  # noqa: E402
from mfuscope.tests.shared_runs import train_forked


@pytest.mark.paced
def test_optimize_rebalances_stages_adds_microbatches_and_each_prediction_holds(optimized_gpipe):
    """The session's shared optimize run (tests/shared_runs.py, ``optimized_gpipe``): GPipe, 2
    microbatches, 8 layers cut 7,1, then ``optimize --json`` and ``optimize --apply --fixes
    rebalance_stages,more_microbatches --rounds 3 --first-win``: rebalancing, predicted to gain
    most in round 1 (by hand below: 1.80 -> 1.44 s), makes the run faster, so it is round 1's only
    run (the microbatch counts, where also predicted to gain over 2%, are named as not run)."""
    base, proposals = optimized_gpipe["base"], optimized_gpipe["proposals"]["fixes"]
    assert (base / "report.json").is_file()
    assert {"more_microbatches", "interleaved_schedule", "rebalance_stages"} <= {f["fix"] for f in proposals}
    rebalance = next(f for f in proposals if f["fix"] == "rebalance_stages")
    assert rebalance["change"] == {"stage_layers": "4,4"}, rebalance  # 8 equal layers: 4 each

    # Interleaving (v=2 on 8 layers) would also cut the stages evenly; the pipeline fixes on their own here.
    summary, stderr = optimized_gpipe["summary"], optimized_gpipe["stderr"]
    assert summary == json.loads((base / "optimize.json").read_text())
    assert (base / "optimize.md").is_file()
    assert "round 1" in stderr and "s so far" in stderr  # progress
    by_round: dict[str, list] = {}
    for f in summary["fixes"]:
        if f.get("run"):
            by_round.setdefault(Path(f["run"]).name.split("-opt-")[1].split("-")[0], []).append(f)
    for fixes in by_round.values():  # a round ends at its first win: every run before it was no faster
        assert all(f["measured_gain"] <= 0 for f in fixes[:-1]), fixes
    assert [f["fix"] for f in by_round["r1"]] == ["rebalance_stages"], by_round["r1"]
    # Paced compute, by hand (30 ms a sample and layer, GPipe on 2 stages: m x the slower stage's
    # microbatch + the other's): 7,1 at 2 microbatches of 4 takes 2 x 840 + 120 = 1.80 s; 4,4 takes
    # 3 x 480 = 1.44 s; more microbatches shave the fill and drain (1.20 s at 4, 1.08 s at 8) but pay
    # the host's time per pass, which load stretches (a CI measured 8 slower than 4, and the optimizer
    # kept 4, as it predicted).  The host's time a step moved by up to 0.1 s between these 3-step
    # runs on a quiet machine (0.12-0.26 s), so the kept run gains at least rebalancing's 0.36 s of
    # compute less that.
    gained = summary["base_step_s"] - summary["final"]["measured_step_s"]
    assert gained > 0.36 - 0.1, summary["final"]
    assert summary["final"]["fixes"][0] == "rebalance_stages" and "more_microbatches" in summary["final"]["fixes"]
    ran = [f for f in summary["fixes"] if f["measured_step_s"] is not None]
    for f in ran:  # every change ran as predicted, its predicted step within 25% of its own measurement
        assert "ran otherwise" not in f["note"], f
        assert f["predicted_step_s"] == pytest.approx(f["measured_step_s"], rel=0.25), f
        # The tighter target -- the predicted *gain* within 25% of the measured gain or 5% of
        # the step (optimize.gain_held, flagged in the output) -- is asserted for rebalancing, whose
        # gain is paced compute: 19.8% predicted against 19.8% and 19.9% measured on a quiet machine
        # (2026-12-06).  The microbatch counts' gain is the host's time per pass, which load moves:
        # 16.0-16.3% predicted against 20.0-20.2% measured, quiet (held), but +10% against +17.6%
        # once in a CI (the host time per microbatch pass, fitted on the base run's 2 steps).
        if f["fix"] == "rebalance_stages":
            assert gain_held(f["predicted_gain"], f["measured_gain"]), f
        assert Path(f["run"]).is_dir() and Path(f["run"]).parent == base.parent  # beside the base: listed
    kept = Path(summary["final"]["run"])
    trainer = json.loads((kept / "manifest.json").read_text())["trainer"]
    assert trainer["stage_layers"] == [4, 4]
    assert trainer["launcher"] == "fork"  # a rerun starts its ranks as the run it changes did (--launcher fork)
    report = json.loads((kept / "report.json").read_text())
    assert report["summary"]["step_time_p50_s"] == pytest.approx(summary["final"]["measured_step_s"])  # the median


def _dp_leaves(report: dict, op: str) -> float:
    """Seconds a step of exposed data-parallel ``op``, from the report's breakdown (any dp group's name)."""
    def walk(node):
        if not node.get("children"):
            parts = node["name"].split("/")
            return node["seconds"] if parts[0] == "comm" and parts[1].startswith("dp") and parts[-1] == op else 0.0
        return sum(walk(c) for c in node["children"])
    return walk(report["breakdown"])


def _overlap_over_a_slow_link(base: Path, *options: str) -> tuple[Path, dict, Path]:
    """Two data ranks over a 0.04 Gbit/s link, paced 40/80 ms per block, then ``optimize --apply``
    with the overlap fix alone: (base run, the fix's row of optimize.json, the run it kept).
    Through torchrun: with a core kept busy, DDP's one-layer buckets hid less of the link under
    the fork launcher (exposed 0.42-0.57 of the unbucketed all-reduce, three runs) than through
    torchrun (0.28-0.35), and a fresh-clone CI failed the test's 0.5 so (docs/reference_trainer.md)."""
    trained = _mfuscope("train", "--config", "tiny_dense", "--nproc", "2", "--layout", "dp_shard=2", *options,
                        "--steps", "3", "--profile", "--paced", "fwd_ms=40,bwd_ms=80,scope=layer",
                        "--inject", "link:dim=dp:gbps=0.04", "--out", str(base))
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = _mfuscope("optimize", str(base), "--apply", "--fixes", "overlap_dp_grads", "--rounds", "1", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["final"]["fixes"] == ["overlap_dp_grads"], summary
    return base, summary["fixes"][0], Path(summary["final"]["run"])


@pytest.mark.paced
def test_prefetch_hides_a_slow_links_gathers_as_predicted(tmp_path):
    """Mechanism check (paced compute, an injected link: the model's own alpha-beta form).  FSDP
    over a slow data-parallel link (0.04 Gbit/s: each block's 148 KB gather takes 30 ms)
    with 40/80 ms of paced compute per block: unprefetched, every gather waits in the open.  The
    overlap fix turns on explicit prefetch; the gathers then hide behind the block before them,
    all but each pass's first, while the reduce-scatters (blocking on a CPU) stay exposed."""
    base, fix, kept = _overlap_over_a_slow_link(tmp_path / "fsdp")
    assert fix["change"] == {"prefetch": "true"} and fix["moved"].startswith("comm/dp/all_gather")
    assert json.loads((kept / "manifest.json").read_text())["trainer"]["prefetch"] is True
    before, after = (json.loads((p / "report.json").read_text()) for p in (base, kept))
    gathers, scatters = _dp_leaves(before, "all_gather"), _dp_leaves(before, "reduce_scatter")
    # 10 gathers and 5 reduce-scatters a step, 26-30 ms each, all exposed to begin with.
    assert gathers == pytest.approx(0.29, rel=0.2) and scatters == pytest.approx(0.145, rel=0.2)
    predicted = fix["predicted_leaves"]
    assert _dp_leaves(after, "all_gather") < 0.6 * gathers  # the leaf shrank ...
    assert _dp_leaves(after, "all_gather") == pytest.approx(predicted["comm/dp/all_gather"], abs=0.25 * gathers)
    assert _dp_leaves(after, "reduce_scatter") == pytest.approx(scatters, rel=0.2)  # ... and only that one
    assert fix["predicted_step_s"] == pytest.approx(fix["measured_step_s"], rel=0.25)


@pytest.mark.paced
def test_smaller_ddp_buckets_hide_a_slow_links_all_reduce_as_predicted(tmp_path):
    """Mechanism check (as above).  DDP over the same slow link: the tiny model's 0.7 MB of
    gradients fit one 25 MiB bucket, all reduced after the backward (145 ms a step).  Buckets of
    one layer start reducing the last layers' gradients while the first layers' are computed; the
    last bucket stays exposed."""
    base, fix, kept = _overlap_over_a_slow_link(tmp_path / "ddp", "--dp-mode", "ddp")
    assert set(fix["change"]) == {"ddp_bucket_mb"} and fix["moved"].startswith("comm/dp/all_reduce")
    assert json.loads((kept / "manifest.json").read_text())["trainer"]["ddp_bucket_mb"] == float(
        fix["change"]["ddp_bucket_mb"])
    before, after = (_dp_leaves(json.loads((p / "report.json").read_text()), "all_reduce") for p in (base, kept))
    # 725 KB at 0.04 Gbit/s, once a step (every byte of gradient crosses the link once).
    assert before == pytest.approx(0.145, rel=0.2)
    assert after < 0.5 * before
    assert after == pytest.approx(fix["predicted_leaves"]["comm/dp/all_reduce"], abs=0.2 * before)
    assert fix["predicted_step_s"] == pytest.approx(fix["measured_step_s"], rel=0.25)


def test_a_change_over_the_memory_budget_is_not_run(tmp_path):
    """Full recomputation cut to selective or none needs more activation memory than the run
    uses: with a budget between the two, the changes are listed with why, and never run."""
    base = train_forked(tmp_path / "full", 2, config="tiny_dense", layout="dp_shard=2", steps=3, window="1:",
                        overrides={"recompute": "full"})
    proposed = json.loads(_mfuscope("optimize", str(base), "--fixes", "less_recompute", "--json").stdout)
    gib = {f["summary"]: f["memory_gib"] for f in proposed["fixes"]}
    assert set(gib) == {"recompute full -> selective", "recompute full -> none"}, gib
    assert min(gib.values()) > proposed["base_memory_gib"]
    budget = (min(gib.values()) + proposed["base_memory_gib"]) / 2
    done = _mfuscope("optimize", str(base), "--apply", "--fixes", "less_recompute", "--memory-gib", repr(budget))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((base / "optimize.json").read_text())
    assert len(summary["fixes"]) == 2
    for f in summary["fixes"]:
        assert f["fits"] is False and f["run"] is None and f["measured_step_s"] is None, f
        assert f["note"].startswith("not applied: needs") and f"{budget:.4g}" in f["note"], f["note"]
    assert summary["final"]["fixes"] == [] and summary["final"]["run"] == str(base)
    assert "not applied: needs" in done.stdout
    assert not list(tmp_path.glob("full-opt-*"))  # nothing was run


def test_a_foreign_trace_gets_findings_and_flags_only(tmp_path):
    """Real traces of a job mfuscope cannot rerun (the corpus's 8-rank DLRM): proposals with the
    torchtitan, Megatron-Core and PyTorch switches, exit 0; --apply is refused in one line."""
    if not DLRM.is_dir():
        pytest.skip(f"the real-trace corpus is not at {DLRM} (set MFUSCOPE_CORPUS)")
    done = _mfuscope("optimize", str(DLRM))
    assert done.returncode == 0, done.stderr
    assert "No model spec" in done.stdout
    for who in ("torchtitan", "megatron", "pytorch"):
        assert who in done.stdout
    as_json = json.loads(_mfuscope("optimize", str(DLRM), "--json").stdout)
    report = json.loads(_mfuscope("analyze", str(DLRM), "--out", str(tmp_path / "r.json"), "--json").stdout)
    assert [f["fix"] for f in as_json["fixes"]] == [f["fix"] for f in report["findings"]]
    assert all(f["flags"] and f["run"] is None for f in as_json["fixes"])
    refused = _mfuscope("optimize", str(DLRM), "--apply")
    assert refused.returncode == 2 and "not a reference-trainer run" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_optimize_refuses_to_apply_to_a_trace_directory(tmp_path):
    done = _mfuscope("optimize", str(tmp_path), "--apply")
    assert done.returncode == 2 and "Traceback" not in done.stderr


def _starved(run: Path) -> bool:
    """A run of the rest lane (``SCHED_IDLE``) that lost its core for seconds to the paced lane: a
    step over five times the run's median step.  Its breakdown then measures the wait, not the
    code -- the step shares a fix is proposed on fall under their thresholds -- so it is trained
    again (the rest lane asserts no duration, and cannot ask the paced lane to wait)."""
    from mfuscope.analyzers import step_rows

    seconds = step_rows.read(run)["seconds"]
    return bool(seconds.max() > 5 * seconds.median())


def test_fuse_elementwise_compiles_for_real_and_runs_what_it_predicted(tmp_path):
    """One eager rank of tiny_dense: norm and elementwise work is a large part of its step, so
    ``fuse_elementwise`` proposes torch.compile (not mfuscope's kernels: a CPU runs their PyTorch
    references, nothing fused).  Applied, it runs as a new run whose own trace shows inductor's
    compiled regions and whose manifest reads back as the configuration predicted; the best run
    is kept.  (Not in the paced lane, so no duration is asserted here: the predicted-gain check on
    real reruns is test_optimize_rebalances_stages_adds_microbatches_and_each_prediction_holds.)"""
    import gzip
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Eager, no kernels.  Its norm/elementwise share is ~35% of a ~17 ms step on an idle machine;
    # on a loaded one a single preemption of the rank (a scheduler slice, tens of ms) lands in
    # one step's idle time, so a mean over two steps fell under the fix's 10% threshold in CI.
    # Four traced steps (the findings read three: the first is warm-up) keep the share over it
    # unless the preemptions outweigh the steps' own time.
    base = train_forked(tmp_path / "eager", 1, config="tiny_dense", steps=6, window="2:")
    if _starved(base):  # seen once in a fresh-clone CI: a traced step of 3.9 s among 20-35 ms ones
        base = train_forked(tmp_path / "eager-again", 1, config="tiny_dense", steps=6, window="2:")
    done = _mfuscope("optimize", str(base), "--apply", "--fixes", "fuse_elementwise", "--rounds", "1", "--json",
                     env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    rows = {json.dumps(f["change"], sort_keys=True): f for f in summary["fixes"]}
    # a CPU runs the kernels' PyTorch references: only torch.compile is proposed (test_fixes)
    evidence = {'{"set.compile": "true"}': '"name": "Torch-Compiled Region'}
    assert set(rows) == set(evidence), rows.keys()
    for change, marker in evidence.items():
        row = rows[change]
        run = Path(row["run"])
        assert row["measured_step_s"] is not None and run.is_dir() and run.parent == tmp_path
        trace = gzip.decompress((run / "traces" / "rank0.pt.trace.json.gz").read_bytes()).decode()
        assert marker in trace, change
        base_trace = gzip.decompress((base / "traces" / "rank0.pt.trace.json.gz").read_bytes()).decode()
        assert marker not in base_trace  # the base ran eager
        if row["measured_step_s"] > summary["base_step_s"]:  # reported, and its run not the one kept
            assert "slower" in row["note"] and summary["final"]["run"] != row["run"], row
        assert "ran otherwise" not in row["note"], row
    fastest = min([summary["base_step_s"]] + [f["measured_step_s"] for f in rows.values()])
    assert summary["final"]["measured_step_s"] == pytest.approx(fastest)  # the best run is kept
