"""Scaling efficiency: ``mfuscope scaling RUN_DIR...`` and ``mfuscope plan --scaling``.

Expected values are typed from hand counts on hand-made runs (a manifest and a report written
here, numbers chosen so every figure is one division), from the reports' own summaries and
trees read with plain JSON, or from separate ``mfuscope plan`` calls at each size; the issue's
target is checked on real paced runs: weak scaling over 1, 2 and 4 ranks with a slow
data-parallel link puts at least 80% of the lost time on the ``comm/dp*`` leaves.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mfuscope.cli import main

from .helpers import micro_config

#: Each leaf's parent chain as the analyzers nest them.
PARENTS = {"compute/gemm": "compute", "idle": None, "comm/dp_shard/all_gather": "comm/dp_shard",
           "comm/dp_shard/reduce_scatter": "comm/dp_shard", "comm/dp_shard": "comm", "compute": None, "comm": None}


def _tree(leaves: dict[str, float]) -> dict:
    nodes = {"step": {"name": "step", "seconds": 0.0, "children": []}}

    def node(name: str) -> dict:
        if name not in nodes:
            nodes[name] = {"name": name, "seconds": 0.0, "children": []}
            node(PARENTS[name] or "step")["children"].append(nodes[name])
        return nodes[name]

    for leaf, seconds in leaves.items():
        name = leaf
        while name is not None:
            node(name)["seconds"] += seconds
            name = PARENTS.get(name)
        nodes["step"]["seconds"] += seconds
    return nodes["step"]


def _run(root: Path, name: str, ranks: int, global_batch: int, step_s: float, leaves: dict[str, float],
         seq_len: int = 8) -> Path:
    """A run directory by hand: what ``scaling`` reads (world size and batch; the summary's
    tokens/s, step and MFU; the breakdown tree)."""
    assert sum(leaves.values()) == pytest.approx(step_s)
    d = root / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({
        "schema_version": 1, "run_id": name, "start_time": "2025-01-01T00:00:00+00:00", "status": "complete",
        "world_size": ranks, "train": {"global_batch": global_batch, "seq_len": seq_len}}))
    (d / "report.json").write_text(json.dumps({
        "schema_version": 1,
        "summary": {"mfu": 0.5, "hfu": 0.5, "step_time_s": step_s, "tokens_per_s": global_batch * seq_len / step_s,
                    "world_size": ranks},
        "breakdown": _tree(leaves),
        "provenance": {"mfuscope_version": "0", "source": name, "created": "2025-01-01T00:00:00+00:00"}}))
    return d


#: 2 ranks, 4 sequences of 8 tokens a step in 0.1 s: 160 tokens/s per device.
BASE = dict(ranks=2, global_batch=4, step_s=0.100,
            leaves={"compute/gemm": 0.060, "comm/dp_shard/all_gather": 0.030, "idle": 0.010})


@pytest.fixture
def weak(tmp_path) -> list[Path]:
    """The same 16 tokens per device per step at 2, 4 and 8 ranks."""
    return [_run(tmp_path, "w8", 8, 16, 0.160, {"compute/gemm": 0.070, "comm/dp_shard/all_gather": 0.070,
                                                "comm/dp_shard/reduce_scatter": 0.015, "idle": 0.005}),
            _run(tmp_path, "w2", **BASE),
            _run(tmp_path, "w4", 4, 8, 0.125, {"compute/gemm": 0.060, "comm/dp_shard/all_gather": 0.050,
                                               "comm/dp_shard/reduce_scatter": 0.010, "idle": 0.005})]


def _scaling(capsys, *args) -> dict:
    assert main(["scaling", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_weak_scaling_by_hand(weak, capsys):
    out = _scaling(capsys, *weak)
    assert out["mode"] == "weak"
    rows = out["rows"]
    assert [r["ranks"] for r in rows] == [2, 4, 8]  # sorted by ranks
    # tokens/s per device: 32/0.1/2 = 160; 64/0.125/4 = 128; 128/0.16/8 = 100
    assert [r["tokens_per_s_per_device"] for r in rows] == pytest.approx([160, 128, 100])
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.8, 0.625])
    assert [r["mfu"] for r in rows] == [0.5, 0.5, 0.5]
    assert rows[0]["loss_by_leaf"] == {}
    # 4 ranks: 0.125 - 0.100 = 0.025 s lost; all_gather +20 ms, reduce_scatter +10 ms, idle -5 ms
    # (the dp_shard group is the model's dp)
    assert rows[1]["loss_s"] == pytest.approx(0.025)
    assert rows[1]["loss_by_leaf"] == pytest.approx(
        {"comm/dp/all_gather": 0.020, "comm/dp/reduce_scatter": 0.010, "idle": -0.005})
    # 8 ranks: 0.160 - 0.100 = 0.060 s; gemm +10 ms, all_gather +40, reduce_scatter +15, idle -5
    assert rows[2]["loss_s"] == pytest.approx(0.060)
    assert rows[2]["loss_by_leaf"] == pytest.approx(
        {"compute/gemm": 0.010, "comm/dp/all_gather": 0.040, "comm/dp/reduce_scatter": 0.015, "idle": -0.005})
    assert list(rows[2]["loss_by_leaf"])[0] == "comm/dp/all_gather"  # largest first

    # forced strong on the same runs: the ideal at 4 ranks is 0.1 x 2/4 = 0.05 s, so 0.075 s is lost:
    # gemm 0.06 - 0.03, all_gather 0.05 - 0.015, reduce_scatter 0.01, idle 0.005 - 0.005 (not listed)
    strong = _scaling(capsys, *weak, "--strong")
    assert strong["mode"] == "strong"
    four = strong["rows"][1]
    assert four["efficiency"] == pytest.approx(0.8)  # the same definition in both modes
    assert four["ideal_s"] == pytest.approx(0.05) and four["loss_s"] == pytest.approx(0.075)
    assert four["loss_by_leaf"] == pytest.approx(
        {"compute/gemm": 0.030, "comm/dp/all_gather": 0.035, "comm/dp/reduce_scatter": 0.010})

    assert main(["scaling", *map(str, weak)]) == 0  # the table for people
    text = capsys.readouterr().out
    assert text.startswith("weak scaling") and "80.0%" in text and "62.5%" in text
    assert "comm/dp/all_gather +40 ms" in text


def test_strong_scaling_by_hand_and_runs_that_are_neither(tmp_path, capsys):
    base = _run(tmp_path, "s2", **BASE)
    # the same 4 sequences on 4 ranks in 0.06 s: speedup 0.1/0.06 = 5/3 on twice the ranks, 5/6
    four = _run(tmp_path, "s4", 4, 4, 0.060, {"compute/gemm": 0.030, "comm/dp_shard/all_gather": 0.020,
                                               "idle": 0.010})
    out = _scaling(capsys, four, base)
    assert out["mode"] == "strong"
    row = out["rows"][1]
    assert row["efficiency"] == pytest.approx(5 / 6)
    assert row["tokens_per_s_per_device"] == pytest.approx(32 / 0.06 / 4)
    # ideal 0.1 x 2/4 = 0.05 s; lost 0.01 s: gemm 0.03 - 0.03 (none), all_gather 0.02 - 0.015, idle 0.01 - 0.005
    assert row["ideal_s"] == pytest.approx(0.05) and row["loss_s"] == pytest.approx(0.010)
    assert row["loss_by_leaf"] == pytest.approx({"comm/dp/all_gather": 0.005, "idle": 0.005})

    # 6 sequences on 4 ranks: neither the per-device work (16 vs 12 tokens) nor the job (32 vs 48) is the same
    odd = _run(tmp_path, "odd4", 4, 6, 0.100, {"compute/gemm": 0.1})
    assert main(["scaling", str(base), str(odd)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither weak nor strong" in err and "--weak or --strong" in err
    assert "Traceback" not in err
    weak = _scaling(capsys, base, odd, "--weak")["rows"][1]  # forced: per-device throughput 12/0.1 over 16/0.1
    assert weak["efficiency"] == pytest.approx(0.75)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    base = _run(tmp_path / "runs", "s2", **BASE)
    (tmp_path / "notes").mkdir()
    cases = {"not a run directory": [base, tmp_path / "notes"],
             "two runs or more": [base],
             "different sizes": [base, _run(tmp_path / "runs", "again2", **BASE)]}
    for why, runs in cases.items():
        assert main(["scaling", *map(str, runs), "--json"]) == 2, why
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and why in captured.err, captured.err
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--seq-len", "4096",
                 "--scaling", "8,x"]) == 2
    assert "--scaling '8,x'" in capsys.readouterr().err


def _plan(capsys, gpus: int, batch: int, *extra: str) -> dict:
    rc = main(["plan", "--model", "llama3-8b", "--gpus", str(gpus), "--gpu", "H100", "--global-batch", str(batch),
               "--seq-len", "8192", "--top", "1", "--json", *extra])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_plan_scaling_is_the_best_layout_planned_at_each_size(capsys):
    """``plan --scaling``'s curve against ``plan`` run at each size with the batch scaled by hand:
    2 sequences per GPU (128 on 64), so 16 on 8 GPUs and 1024 on 512."""
    curve = _plan(capsys, 64, 128, "--scaling", "512,8,64")["scaling"]
    assert [(r["gpus"], r["global_batch"]) for r in curve] == [(8, 16), (64, 128), (512, 1024)]
    alone = {n: _plan(capsys, n, 2 * n)["ranked"][0] for n in (8, 64, 512)}
    first = alone[8]
    for row in curve:
        best = alone[row["gpus"]]
        assert row["layout"] == best["layout"]
        assert row["tokens_per_s_per_gpu"] == pytest.approx(best["tokens_per_s_per_gpu"])
        assert row["mfu"] == pytest.approx(best["mfu"])
        assert row["efficiency"] == pytest.approx(best["tokens_per_s_per_gpu"] / first["tokens_per_s_per_gpu"])
        # weak: each leaf's growth over the 8-GPU step (plan lists the leaves above zero)
        assert row["loss_s"] == pytest.approx(best["step_s"] - first["step_s"], abs=1e-9)
        expected = {leaf: best["leaves"].get(leaf, 0.0) - first["leaves"].get(leaf, 0.0)
                    for leaf in {*best["leaves"], *first["leaves"]}}
        assert row["loss_by_leaf"] == pytest.approx({k: v for k, v in expected.items() if abs(v) > 1e-12})
    assert curve[0]["efficiency"] == 1.0 and curve[-1]["efficiency"] < 1.0

    assert main(["plan", "--model", "llama3-70b", "--gpus", "1024", "--global-batch", "2048", "--seq-len", "8192",
                 "--top", "1", "--scaling", "8,64"]) == 0
    text = capsys.readouterr().out
    assert "predicted weak scaling" in text and "no layout fits" in text  # 70B on 8 GPUs: 16 sequences do not fit


@pytest.mark.paced
def test_weak_scaling_over_a_slow_dp_link_loses_its_time_in_dp_communication(tmp_path, capsys):
    """The issue's target: paced runs at 1, 2 and 4 ranks of FSDP with 2 sequences per rank, every
    data-parallel group slowed to 4 Mbit/s (``link:rank=0``: the groups holding rank 0, here all of
    them).  The compute is paced (10/20 ms a microbatch), the same at every size, so what the
    larger runs lose is the link: at least 80% of the lost step time lands on ``comm/dp*`` leaves."""
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.tests.shared_runs import train_forked

    runs = []
    for n in (4, 1, 2):
        config = tmp_path / f"micro{n}.toml"
        config.write_text(micro_config(n_layers=1, global_batch=2 * n, grad_accum=1))
        runs.append(train_forked(tmp_path / f"fsdp{n}", n, config=str(config), layout=f"dp_shard={n}", steps=3,
                                 window="1:", paced="fwd_ms=10,bwd_ms=20", inject="link:rank=0:dim=dp:gbps=0.004"))
    out = _scaling(capsys, *runs)  # no report.json yet: each is analyzed first
    assert out["mode"] == "weak"
    rows = out["rows"]
    assert [r["ranks"] for r in rows] == [1, 2, 4]
    reports = {n: json.loads((tmp_path / f"fsdp{n}" / "report.json").read_text()) for n in (1, 2, 4)}
    for row in rows:
        n = row["ranks"]
        # weak: the same tokens per device, so efficiency is the step ratio of the two summaries
        step = reports[n]["summary"]["step_time_s"]
        assert row["efficiency"] == pytest.approx(reports[1]["summary"]["step_time_s"] / step, rel=1e-6)
        lost = reports[n]["breakdown"]["seconds"] - reports[1]["breakdown"]["seconds"]
        assert row["loss_s"] == pytest.approx(lost, abs=1e-9)
        assert sum(row["loss_by_leaf"].values()) == pytest.approx(lost, abs=1e-9)
        if n > 1:
            dp = sum(s for leaf, s in row["loss_by_leaf"].items() if leaf.startswith("comm/dp"))
            assert dp >= 0.8 * lost, row
            assert row["efficiency"] < 0.6, row  # the link costs more than the paced 30 ms of compute
