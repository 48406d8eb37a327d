"""The trainer as a user runs it: through torchrun, with injected faults, with bad layouts."""
from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
#: Wall time is what these tests assert: make test runs them in its paced lane (tests/lanes.py).
pytestmark = pytest.mark.paced

from mfuscope import run_dir  # noqa: E402
from mfuscope.errors import UserInputError  # noqa: E402
from mfuscope.reference_trainer.launch import fork_ranks  # noqa: E402
from mfuscope.reference_trainer.parallel_dims import ParallelDims  # noqa: E402
from mfuscope.reference_trainer.train import run_rank  # noqa: E402
from mfuscope.trainer_options import TrainerOptions  # noqa: E402


def test_mfuscope_train_through_torchrun_writes_a_valid_run_directory(torchrun_run):
    """The session's shared torchrun run (tests/shared_runs.py): ``mfuscope train --nproc 4 --layout
    dp_shard=2,tp=2 --steps 2``."""
    out = torchrun_run
    manifest = run_dir.read_manifest(out)  # validates against the schema
    assert manifest["world_size"] == 4 and manifest["layout"]["tp"] == 2 and manifest["layout"]["dp_shard"] == 2
    assert {g["dim"] for g in manifest["process_groups"]} >= {"tp", "dp_shard", "pp", "cp"}
    steps = run_dir.read_table(out, run_dir.STEPS).to_pandas()
    assert sorted(steps["rank"].unique()) == [0, 1, 2, 3] and sorted(steps["step"].unique()) == [0, 1]
    assert (steps["tokens"] == 8 * 32).all() and (steps["end_ns"] > steps["start_ns"]).all()
    # An existing run directory is never overwritten without --force.
    again = subprocess.run([sys.executable, "-m", "mfuscope", "train", "--nproc", "1", "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "not empty" in again.stderr


MICRO = """
[model]
vocab_size = 64
dim = 32
n_layers = 1
n_heads = 2
n_kv_heads = 1
ffn_dim = 64
max_seq_len = 16
[train]
seq_len = 16
global_batch = 8
grad_accum = 2
"""


def _rank3_step_times(config, inject):
    # 4 data ranks (DDP), 2 accumulation forwards per step; a micro model and paced stages, so the
    # sleeps, not CPU sharing between 4 ranks on few cores, decide the timing.
    opts = TrainerOptions(config=str(config), layout="dp_shard=4", dp_mode="ddp", steps=8, inject=inject,
                      paced="fwd_ms=40,bwd_ms=80")
    results = fork_ranks(run_rank, 4, opts)
    return results[3]["step_times"][1:]  # step 0 includes warm-up


def test_injected_compute_delay_shows_on_rank_3(tmp_path):
    config = tmp_path / "micro.toml"
    config.write_text(MICRO)
    base = statistics.median(_rank3_step_times(config, None))
    slow = statistics.median(_rank3_step_times(config, "compute:rank=3:ms=50"))
    expected = 2 * 0.050  # one 50 ms sleep per forward, 2 forwards per step
    # Beyond its pacing (2 x (40 + 80) ms), a base step is real work and waiting, which CPU sharing
    # moves between ranks: while rank 3 sleeps the others get its core and finish sooner.  That
    # un-paced time, measured in the base run, bounds how far the delay can move the step.
    unpaced = max(base - 2 * (0.040 + 0.080), 0.0)
    assert abs(slow - base - expected) <= 0.15 * expected + unpaced, (slow, base, unpaced)


@pytest.mark.parametrize("layout, world, message", [
    ("tp=3", 4, "does not divide world size"),
    ("dp_shard=2,tp=2", 8, "uses 4 ranks"),
    ("tp=two", 2, "cannot read"),
    ("dp_shard=2,cp=1,ep=4", 2, "ep=4 must divide"),
])
def test_bad_layouts_are_named(layout, world, message):
    with pytest.raises(UserInputError, match=message):
        ParallelDims.parse(layout, world)


def test_coordinates_are_row_major_over_pp_dp_cp_tp():
    dims = ParallelDims.parse("pp=2,dp_shard=2,cp=2,tp=2", 16)
    assert dims.coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert dims.coords(1)["tp"] == 1 and dims.coords(2)["cp"] == 1 and dims.coords(4)["dp_shard"] == 1
    assert dims.coords(8)["pp"] == 1
    assert dims.coords(15) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 1, "tp": 1}


def _median_step(world, layout, inject, rank, stat=statistics.median, **kw):
    opts = TrainerOptions(config="tiny_dense", layout=layout, steps=6, inject=inject, paced="fwd_ms=30,bwd_ms=60", **kw)
    return stat(fork_ranks(run_rank, world, opts)[rank]["step_times"][1:])


def test_heavier_pipeline_stage_slows_the_step_by_its_forwards():
    # pp=2, 2 microbatches: stage 1's forward runs twice per step, each 40 ms heavier; stage 1's
    # forwards are on the critical path of a 2-stage 1F1B schedule.  That path is the same every
    # step and CPU sharing only adds to it, so each run's fastest step measures it best (a median
    # of five steps still carried 60 ms of one loaded run's noise).
    base = _median_step(2, "pp=2", None, 0, stat=min, microbatches=2)
    slow = _median_step(2, "pp=2", "stage:stage=1:ms=40", 0, stat=min, microbatches=2)
    # Beyond the paced critical path ((m + p - 1) x (30 + 60) ms), a step is real work and waiting
    # that CPU sharing moves between runs; that un-paced time, measured in the base run, bounds it.
    unpaced = max(base - 3 * 0.090, 0.0)
    assert abs(slow - base - 2 * 0.040) <= 0.2 * 2 * 0.040 + unpaced, (slow, base, unpaced)


def test_late_tensor_parallel_rank_makes_its_peer_wait():
    # tp=2: tp rank 1 arrives 100 ms late at the attention and MLP input gathers of each of 4 layers,
    # and rank 0 waits for it there.  Where rank 0 was already the slower one (two ranks sharing
    # two busy cores), part of each delay hides in that lag: a few ms per collective, which a large
    # delay keeps well inside the tolerance.
    base = _median_step(2, "tp=2", None, 0)
    slow = _median_step(2, "tp=2", "comm:dim=tp:ms=100:rank=1", 0)
    unpaced = max(base - 0.090, 0.0)  # beyond one paced microbatch (30 + 60 ms): see above
    assert abs(slow - base - 4 * 2 * 0.100) <= 0.15 * 4 * 2 * 0.100 + unpaced, (slow, base, unpaced)
