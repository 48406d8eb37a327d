"""Checkpoints of the reference trainer (reference_trainer/checkpointing.py) and what they cost
(analyzers/checkpoints.py): saved on one layout, resumed on another; a save killed midway never
loads; async saves block less than sync ones; the breakdown's ``checkpoint`` leaf is the blocking
time the collectors saw.

Expected values: an uninterrupted run of the same steps (a single source of truth for the losses),
an injected kill (``die:...:at=checkpoint``) at a known save, and the collectors' own clock.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from mfuscope.tests.shared_runs import mfuscope

pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

STEPS = 8
#: One CFS scheduling period on 2 CPUs: sched_latency 6 ms x (1 + log2(2)).
SCHED_PERIOD_S = 0.012


def _tolerance(steps: int) -> float:
    """Relative loss difference allowed between a run that took its first steps on dp_shard=2 and one
    that took them on tp=2: each step's gradients differ by at most the float32 tolerance of a
    reordered sum (tests/test_reference_trainer.fp32_tolerance), AdamW's update is invariant to a
    gradient's scale so it does not amplify a relative perturbation, and the perturbations of
    successive steps add: ``steps`` times that tolerance."""
    from mfuscope.tests.test_reference_trainer import fp32_tolerance
    return steps * fp32_tolerance("tiny_dense")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """tp=2, AdamW, STEPS steps, no checkpoint: the losses every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    from mfuscope.reference_trainer.launch import fork_ranks
    from mfuscope.reference_trainer.train import run_rank
    from mfuscope.trainer_options import TrainerOptions
    return fork_ranks(run_rank, 2, TrainerOptions(layout="tp=2", steps=STEPS, out=str(out)))[0]["losses"]


def _train(out, **options):
    from mfuscope.reference_trainer.launch import fork_ranks
    from mfuscope.reference_trainer.train import run_rank
    from mfuscope.trainer_options import TrainerOptions
    return fork_ranks(run_rank, 2, TrainerOptions(out=str(out), **options))[0]["losses"]


def test_saved_on_dp_shard_resumed_on_tp_continues_the_same_run(tmp_path, uninterrupted):
    """Five steps on FSDP2 (dp_shard=2) saved after step 5; resumed onto tensor parallelism (tp=2),
    which shards every weight differently: steps 6-8 give the uninterrupted tp=2 run's losses (the
    model, AdamW's moments and step counts, and the data position all carried over; without the
    moments, a loss moved by 3.3e-3 here, almost three times the tolerance)."""
    save = tmp_path / "ckpt"
    _train(tmp_path / "first", layout="dp_shard=2", steps=5, checkpoint=f"every=5,mode=sync,dir={save}")
    assert sorted(p.name for p in save.iterdir()) == ["step_000005"]
    info = json.loads((save / "step_000005" / "mfuscope.json").read_text())
    assert info["steps_done"] == 5 and info["samples"] == 5 * 8 and info["layout"] == "dp_shard=2"
    resumed = _train(tmp_path / "second", layout="tp=2", steps=STEPS, resume=str(save))
    assert len(resumed) == STEPS - 5
    assert resumed == pytest.approx(uninterrupted[5:], rel=_tolerance(STEPS))


def test_a_save_killed_before_its_commit_leaves_the_previous_one_to_load(tmp_path, uninterrupted):
    """Saves every 2 steps; rank 1 is killed inside the save of step 4, after every shard and DCP's
    metadata are written but before the commit.  The folder it leaves is loadable by DCP yet not
    committed: --resume takes the save of step 2 and continues from step 3."""
    save = tmp_path / "ckpt"
    with pytest.raises(Exception, match="rank 1"):
        _train(tmp_path / "killed", layout="dp_shard=2", steps=6, checkpoint=f"every=2,mode=sync,dir={save}",
               inject="die:rank=1:step=3:at=checkpoint")
    names = sorted(p.name for p in save.iterdir())
    assert names == ["step_000002", "step_000004.partial"], names
    assert (save / "step_000004.partial" / ".metadata").is_file()  # DCP finished; the commit did not
    lone = tmp_path / "lone"  # a folder holding only a save that did not finish: refused before any rank starts
    shutil.copytree(save / "step_000004.partial", lone / "step_000004.partial")
    refused = mfuscope("train", "--nproc", "1", "--resume", str(lone), "--out", str(tmp_path / "never"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [f"mfuscope: error: {lone}: no complete checkpoint here (only "
                                                    "step_000004.partial, a save that did not finish)"]
    resumed = _train(tmp_path / "resumed", layout="tp=2", steps=STEPS, resume=str(save))
    assert len(resumed) == STEPS - 2
    assert resumed == pytest.approx(uninterrupted[2:], rel=_tolerance(STEPS))


@pytest.mark.paced
def test_async_saves_block_less_and_the_leaf_is_the_blocking_time(tmp_path):
    """Six steps, a save every 2 (3 saves), once sync and once async, each traced from step 1: the
    median blocking time of the async saves is below the sync saves'; in each run the trace's
    ``checkpoint`` leaf of a saving step equals the blocking time the collectors measured on their
    own clock, within one CFS scheduling period (6 ms x (1 + log2 of 2 CPUs) = 12 ms: a thread
    preempted between the profiler's and the collectors' readings waits at most that long; a leaf
    that missed the save, or took other work, would be off by tens of ms); goodput is the share of
    the steps not blocked.  The
    sync run's saves are a finding (``async_checkpoint``), and optimize proposes the async change,
    into a folder of its own, with the staging as what remains of the leaf."""
    from mfuscope.analyzers.analysis import analyze
    from mfuscope.optimizers import measured, optimize

    medians = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        _train(out, layout="dp_shard=2", steps=6, window="1:5",
               checkpoint=f"every=2,mode={mode},dir={tmp_path}/c-{mode}")
        report, _ = analyze(out, out / "report.json", out / "views")
        saves = report["checkpoints"]
        assert saves["count"] == 3 and saves["modes"] == [mode]
        assert (saves["median_background_s"] is None) == (mode == "sync")
        medians[mode] = saves["median_blocking_s"]
        seg = pd.read_parquet(out / "views" / "timeline.parquet")
        leaf = seg[seg["leaf"] == "checkpoint"].assign(s=lambda d: (d.end_ns - d.start_ns) / 1e9)
        leaf = leaf.groupby(["rank", "step"])["s"].sum()
        rows = pd.read_parquet(out / "checkpoints.parquet").dropna(subset=["blocking_ns"])
        blocked = rows.set_index(["rank", "step"])["blocking_ns"] / 1e9
        assert sorted(leaf.index) == sorted(blocked.index)  # every save in the window, no other step
        assert (leaf - blocked.loc[leaf.index]).abs().max() < SCHED_PERIOD_S
        total = blocked.groupby(level="rank").sum().max()
        assert report["summary"]["goodput"] == pytest.approx(1 - total / saves["wall_s"], rel=1e-9)
        found = {f["id"] for f in report["findings"]}
        proposals = [p for p in optimize.propose(measured.load(out))[2] if p.change.fix == "async_checkpoint"]
        if mode == "sync":
            assert "async_checkpoint" in found, found
            (p,) = proposals
            assert p.change.trainer == {"checkpoint": f"every=2,mode=async,dir={tmp_path}/c-sync/async"}
            assert p.predicted_gain > 0 and p.predicted_leaves["checkpoint"] < report_leaf(report)
            done = mfuscope("optimize", str(out), "--apply", "--fixes", "async_checkpoint", "--rounds", "1", "--json")
            assert done.returncode == 0, done.stderr[-3000:]
            (row,) = json.loads(done.stdout)["fixes"]
            applied = json.loads((Path(row["run"]) / "report.json").read_text())["checkpoints"]
            assert row["measured_step_s"] is not None and applied["modes"] == ["async"]
            assert applied["median_blocking_s"] < saves["median_blocking_s"], (applied, saves)
        else:
            assert "async_checkpoint" not in {p.change.fix for p in proposals}
    assert medians["async"] < medians["sync"], medians


def report_leaf(report: dict) -> float:
    """The breakdown's ``checkpoint`` leaf, seconds a step."""
    return next(c["seconds"] for c in report["breakdown"]["children"] if c["name"] == "checkpoint")


def test_an_interleaved_pipelines_save_resumes_on_tensor_parallelism(tmp_path, uninterrupted):
    """pp=2 with the interleaved 1F1B schedule: each rank holds two stage modules (layers 0 and 2, or
    1 and 3), each with its own optimizer; their states are saved under the full model's names and
    load onto tp=2, whose ranks hold a slice of every layer: steps 4-5 give the uninterrupted run's."""
    save = tmp_path / "ckpt"
    _train(tmp_path / "pp", layout="pp=2", schedule="interleaved_1f1b", steps=3,
           checkpoint=f"every=3,mode=sync,dir={save}")
    resumed = _train(tmp_path / "tp", layout="tp=2", steps=5, resume=str(save))
    assert resumed == pytest.approx(uninterrupted[3:5], rel=_tolerance(STEPS))
