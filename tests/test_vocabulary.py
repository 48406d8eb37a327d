"""The run's vocabulary, one home each: the layout (mfuscope/layout.py), the trainer's options
(mfuscope/trainer_options.py), the manifest (mfuscope/manifest.py) and the fix records
(mfuscope/fix_registry.py).  Expected values are hand counts, or the other side of a round trip."""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mfuscope.analyzers import findings
from mfuscope.errors import UserInputError
from mfuscope.fix_registry import FIXES
from mfuscope.layout import DIMS, MESH_DIMS, Degrees
from mfuscope.manifest import Manifest
from mfuscope.optimizers import fixes
from mfuscope.optimizers.measured import MeasuredRun, cpu_system, leaves_of
from mfuscope.optimizers.spec import Layout, ModelSpec, Training
from mfuscope.optimizers.system import system
from mfuscope.trainer_options import TrainerOptions, add_arguments

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- the layout
def test_a_layout_reads_in_any_order_and_writes_in_the_mesh_order():
    d = Degrees.parse("tp=2, dp_shard=2,pp=2")
    assert d.text() == "pp=2,dp_shard=2,tp=2" and Degrees.parse(d.text()) == d
    assert Degrees().text() == "dp_shard=1" and Degrees.parse(Degrees().text()) == Degrees()
    assert DIMS == MESH_DIMS + ("ep",) and MESH_DIMS[0] == "pp" and MESH_DIMS[-1] == "tp"


def test_the_data_parallel_degrees_are_named_for_what_they_count():
    d = Degrees(dp_replicate=2, dp_shard=3, cp=5, tp=7)
    assert d.data_ranks == 2 * 3  # rows of the batch
    assert d.grad_ranks == 2 * 3 * 5  # gradients averaged over: every rank that saw other tokens
    assert d.world_size == 2 * 3 * 5 * 7


def test_dp_shard_fills_the_world_and_a_bad_layout_says_why():
    assert Degrees.parse("tp=2,pp=2", 8).dp_shard == 2
    for text, world, words in (("tp=3", 8, "does not divide"), ("tp=2,dp_shard=2", 8, "uses 4 ranks"),
                               ("tp=0", 2, "at least 1"), ("tp:2", 2, "cannot read"), ("ep=4", 2, "ep=4 must divide")):
        with pytest.raises(UserInputError, match=words):
            Degrees.parse(text, world)


def test_mesh_coordinates_are_row_major_with_tp_innermost():
    d = Degrees.parse("pp=2,dp_shard=2,tp=2", 8)
    # rank 5 = 1*4 + 0*2 + 1: pp 1, dp_shard 0, tp 1
    assert d.coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert [d.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]


# ----------------------------------------------------------------------------- the trainer's options
RICH = TrainerOptions(config="x.toml", layout="pp=2,dp_shard=2", schedule="gpipe", microbatches=4, steps=7,
                      dp_mode="fsdp", reshard_after_forward=False, prefetch=True, keep_last_gathered=True,
                      kernels="fused", inject="compute:rank=1:ms=5;sync", paced="fwd_ms=1,bwd_ms=2",
                      stage_layers=(3, 1), overrides={"recompute": "full", "global_batch": 16, "compile": True},
                      window="1:2", profile_memory=True, out="/tmp/run", force=True, result="/tmp/res")


def _parse(argv: list[str], launcher: bool = False) -> TrainerOptions:
    p = argparse.ArgumentParser()
    add_arguments(p, launcher=launcher)
    return TrainerOptions.from_args(p.parse_args(argv), launcher=launcher)


def test_the_command_line_round_trips_every_field():
    assert _parse(RICH.to_argv()) == RICH
    ddp = TrainerOptions(layout="dp_replicate=2", dp_mode="ddp", ddp_bucket_mb=0.25, grad_as_bucket_view=True)
    assert _parse(ddp.to_argv()) == ddp
    assert _parse([]) == TrainerOptions() and TrainerOptions().to_argv() == []


def test_both_parsers_are_derived_from_the_one_definition():
    """Every field is a flag of the trainer's parser; mfuscope train takes all but the three it owns."""
    trainer = subprocess.run([sys.executable, "-m", "mfuscope.reference_trainer.train", "--help"],
                             capture_output=True, text=True, check=True).stdout
    launcher = subprocess.run([sys.executable, "-m", "mfuscope", "train", "--help"],
                              capture_output=True, text=True, check=True).stdout
    for f in dataclasses.fields(TrainerOptions):
        flag = "--set" if f.name == "overrides" else "--" + f.name.replace("_", "-")
        assert flag in trainer, flag
        if f.name not in ("result",):
            assert flag in launcher, flag  # --out and --force are the launcher's own, with the same names


def test_the_manifest_section_reads_back_as_the_options_that_made_the_run():
    manifest = {"world_size": 4, "layout": {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1},
                "schedule": {"name": "gpipe", "microbatches": 4, "virtual_stages": 1},
                "train": {"microbatches": 4}, "trainer": RICH.to_manifest()}
    back = TrainerOptions.from_manifest(manifest, config="x.toml")
    # steps and overrides are in the config optimize writes from the same manifest; out, force and
    # result say nothing about the run
    assert back == dataclasses.replace(RICH, steps=None, overrides={}, out=None, force=False, result=None)


def test_a_recorded_change_is_a_replace():
    change = TrainerOptions.change(prefetch=True, stage_layers=(4, 4), overrides={"recompute": "none"})
    assert change == {"prefetch": "true", "stage_layers": "4,4", "set.recompute": "none"}
    base = TrainerOptions(layout="pp=2,dp_shard=2", overrides={"compile": True})
    assert base.changed(change) == dataclasses.replace(base, prefetch=True, stage_layers=(4, 4),
                                                       overrides={"compile": True, "recompute": "none"})
    with pytest.raises(UserInputError, match="not a trainer option"):
        base.changed({"prefech": "true"})


def test_a_changed_layout_drops_the_switches_it_cannot_take():
    base = TrainerOptions(layout="pp=2,dp_shard=2", prefetch=True, keep_last_gathered=True, stage_layers=(3, 1))
    same = base.changed({"microbatches": "8"}).carried_over(base)
    assert same.prefetch and same.keep_last_gathered and same.stage_layers == (3, 1)
    moved = base.changed({"layout": "tp=4"}).carried_over(base)
    assert not moved.prefetch and not moved.keep_last_gathered and moved.stage_layers is None
    ddp = TrainerOptions(layout="dp_replicate=2", dp_mode="ddp", ddp_bucket_mb=1.0)
    assert ddp.changed({"dp_mode": "fsdp"}).carried_over(ddp).ddp_bucket_mb is None


# ----------------------------------------------------------------------------- the manifest
def test_the_manifest_answers_each_question_once():
    raw = {"world_size": 8, "layout": {"pp": 2, "dp_shard": 2, "tp": 2, "mystery": 3},
           "rank_coords": {"5": {"pp": 1, "dp_shard": 0, "tp": 1}}, "model": {"n_layers": 2},
           "train": {"seq_len": 32}, "trainer": {"dp_mode": "fsdp"}}
    m = Manifest.of(raw)
    assert m.degrees == Degrees(pp=2, dp_shard=2, tp=2) and m.pp == 2
    assert m.stage_of(5) == 1 and m.stage_of(0) == 0 and m.has_model_spec and m.is_reference_trainer_run
    empty = Manifest.of(None)
    assert not empty.has_model_spec and empty.world_size == 1 and empty.stages == {} and empty.microbatches == 1


# ----------------------------------------------------------------------------- one record per fix
MODEL = ModelSpec(n_layers=8, dim=64, n_heads=4, ffn_dim=128, vocab_size=256)


def _tree(leaves: dict[str, float]) -> dict:
    return {"name": "step", "seconds": sum(leaves.values()),
            "children": [{"name": k, "seconds": v, "children": []} for k, v in leaves.items()]}


@pytest.mark.parametrize("fix, leaf, layout, on_gpu, training", [
    ("overlap_dp_grads", "comm/dp_shard/all_gather", Layout(dp_shard=2, micro_batch=4), False,
     Training(seq_len=32, dtype="fp32", overlap_param_gather=False)),
    ("overlap_tp_comm", "comm/tp/all_gather", Layout(tp=2, micro_batch=8), True, Training(seq_len=32)),
    ("fuse_elementwise", "compute/norm_elementwise", Layout(micro_batch=8), False, Training(seq_len=32)),
    ("cuda_graphs", "host_bound", Layout(micro_batch=8), True, Training(seq_len=32)),
])
def test_findings_and_the_catalogue_apply_from_the_same_threshold(fix, leaf, layout, on_gpu, training):
    """Just under the record's threshold neither raises the fix; just over, both do."""
    threshold = FIXES[fix].threshold
    launch = [{"rank": 0, "launch_bound": True, "median_kernel_us": 3.0, "median_launch_us": 5.0}]
    for share, expected in ((threshold * 0.98, False), (threshold * 1.02, True)):
        tree = _tree({leaf: share, "compute/gemm": 1.0 - share})  # the report's breakdown
        found = {f["fix"] for f in findings.derive(tree, None, [], 1.0, launch)}
        sys_ = system("H100") if on_gpu else cpu_system(1e11, layout.gpus)
        run = MeasuredRun(Path("run"), MODEL, layout, training, sys_, None, None, leaves_of(tree), 1.0, None, None, ())
        proposed = bool(fixes.CATALOGUE[fix](run))
        assert (fix in found, proposed) == (expected, expected), (fix, share)


def test_every_fix_id_has_one_record_with_three_frameworks_flags():
    ids = set(fixes.CATALOGUE)
    # findings with nothing the reference trainer can run, only advice and the frameworks' switches
    ids |= {"straggler_rank", "reduce_host_overhead", "wait_on_dependency", "faster_data_loading", "fewer_copies",
            "caching_allocator", "overlap_comm", "fused_optimizer", "one_time_init", "mixed_precision",
            "balance_experts"}
    assert ids == set(FIXES)
    for fix in FIXES.values():
        assert set(fix.flags) == {"torchtitan", "megatron", "pytorch"} and all(fix.flags.values()), fix.id


# ----------------------------------------------------------------------------- a flag added in one place
def test_profile_memory_is_one_field_that_reaches_the_trace(tmp_path):
    """``profile_memory`` (issue 31's ``mfuscope train --profile-memory``) was added as one field of
    TrainerOptions plus the line in train.py that hands it to the profile session: the parsers, the
    manifest and optimize's reruns carry it with no other change.  One forked rank: its trace holds
    the allocator's ``[memory]`` events."""
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.reference_trainer.launch import fork_ranks
    from mfuscope.reference_trainer.train import run_rank

    opts = _parse(["--layout", "dp_shard=1", "--steps", "2", "--window", "1:1", "--profile-memory",
                   "--out", str(tmp_path / "run")])
    fork_ranks(run_rank, 1, opts)
    manifest = Manifest.read(tmp_path / "run")
    assert manifest.trainer["profile_memory"] is True
    assert TrainerOptions.from_manifest(manifest).profile_memory
    trace = json.loads(gzip.decompress((tmp_path / "run" / "traces" / "rank0.pt.trace.json.gz").read_bytes()))
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])
