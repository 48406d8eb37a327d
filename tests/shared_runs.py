"""Runs of the reference trainer that several test modules read, each made once per test session.

A multi-rank run costs 5-90 s on 2 cores, most of it process start-up, paced sleeps and the
collectors' writing; the modules that read the same kind of run share one.  ``conftest.py`` turns
each builder below into a session-scoped fixture of the same name; a run is made the first time a
test asks for it, in the session's temporary directory, and is read-only to its readers (a test
that changes a run copies it first).

- ``run_3d``: 8 forked ranks, ``dp_shard=2,tp=2,pp=2``, 1F1B, 4 microbatches, 4 steps, traced from
  step 1.  Read by test_collectors, test_comm_labels, test_dashboard.
- ``torchrun_run``: ``mfuscope train`` through torchrun, 4 ranks ``dp_shard=2,tp=2``, 2 steps, no
  traces.  Read by test_trainer_runs, test_dashboard.
- ``optimized_gpipe``: a poor paced pipeline start and ``mfuscope optimize --apply`` on it (3
  rounds, each keeping its first win).  Read by test_optimize, test_dashboard.
- ``paced_pipelines``: 4 pipeline stages paced per sample (40/80 ms forward/backward), 8 layers,
  3 steps traced: 1F1B at 4 microbatches, GPipe at 8, interleaved 1F1B at 4 and 8.  Read by
  test_cost_model_runs (the model's mechanism check) and test_analyzers (the measured bubble).
- ``health_run``: 8 forked ranks, 100 paced steps, no traces, two fail-slow faults (a compute delay
  on rank 5 from step 60, rank 6's data-parallel links slow from step 30).  Read by test_health,
  test_dashboard.

Every reader of a run is in the same lane of make test (tests/lanes.py: a paced test reads all three,
so all their readers are marked ``paced``), so each is made once.

To add one: write a builder here (its docstring says what the run is and why its size), add the
fixture to conftest (and to ``SHARED`` there), and list it here; a module with a run nobody else reads keeps it
as a module-scoped fixture of its own.  docs/contributing.md has the suite's time budget.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .helpers import micro_config
from .lanes import quiet

CLI = [sys.executable, "-m", "mfuscope"]

#: The 3D layout on 8 ranks: every dimension but cp and ep, and a pipeline of 4 microbatches.
RUN_3D = dict(config="tiny_dense", layout="dp_shard=2,tp=2,pp=2", microbatches=4, steps=4, window="1:")
RUN_3D_WORLD = 8


def mfuscope(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m mfuscope ARGS`` as a user runs it: output captured."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _ok(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{what} failed:\n{proc.stderr[-3000:]}"
    return proc


def train_forked(out: Path, world: int, **options) -> Path:
    """The reference trainer on ``world`` forked gloo ranks into the run directory ``out``, with
    the collectors: what ``mfuscope train --nproc WORLD --out OUT`` writes, without an interpreter
    start and torch import per rank (``options`` are :class:`TrainerOptions` fields; ``--profile`` is
    ``window="1:"``; the manifest records the fork launcher, which a rerun of the run uses).  For
    tests about what reads a run, not about how it was launched."""
    from mfuscope.reference_trainer.launch import fork_ranks
    from mfuscope.reference_trainer.train import run_rank
    from mfuscope.trainer_options import TrainerOptions

    fork_ranks(run_rank, world, TrainerOptions(**{"launcher": "fork", **options}, out=str(out)))
    return out


def run_3d(root: Path) -> Path:
    """:data:`RUN_3D` on :data:`RUN_3D_WORLD` forked gloo ranks (the fork launcher: no per-rank
    interpreter start), with the collectors and a Kineto window from step 1."""
    return train_forked(root / "3d", RUN_3D_WORLD, **RUN_3D)


#: :func:`health_run`: HSDP (data-parallel groups of 4 and of 2, so one rank's groups are not the whole
#: dimension), a one-layer micro model paced 4/8 ms kept gathered after the forward (fewer collectives:
#: a step near 65 ms), 100 steps; rank 5 computes 50 ms more a step from
#: step 60, and every dp group holding rank 6 moves its bytes at 0.01 Gb/s from step 30.
HEALTH_WORLD, HEALTH_COMPUTE, HEALTH_LINK = 8, (5, 60), (6, 30)
HEALTH_RUN = dict(layout="dp_replicate=2,dp_shard=4", steps=100, paced="fwd_ms=4,bwd_ms=8", reshard_after_forward=False,
                  inject=f"compute:rank={HEALTH_COMPUTE[0]}:ms=50:from={HEALTH_COMPUTE[1]};"
                         f"link:rank={HEALTH_LINK[0]}:dim=dp:gbps=0.01:from={HEALTH_LINK[1]}")


def health_run(root: Path) -> Path:
    """:data:`HEALTH_RUN` on :data:`HEALTH_WORLD` forked ranks with the always-on collectors only: a
    job that turns slow twice, for the whole-run health analysis (analyzers/health.py).  A hundred
    steps of eight ranks take ~16 s here."""
    root.mkdir(parents=True, exist_ok=True)
    config = root / "micro1.toml"
    config.write_text(micro_config(n_layers=1, global_batch=8, grad_accum=1))
    return train_forked(root / "health8", HEALTH_WORLD, config=str(config), **HEALTH_RUN)


#: :func:`paced_pipelines`: stages, forward and backward ms per sample a layer chunk, sequences a
#: step; (schedule, v, microbatches) of each run.  1F1B and GPipe share their bubble's theory: one
#: of each, at 4 and 8 microbatches; interleaving at both.
PIPE_STAGES, PIPE_FWD_MS, PIPE_BWD_MS, PIPE_BATCH = 4, 40.0, 80.0, 8
PIPELINES = [("1f1b", 1, 4), ("gpipe", 1, 8), ("interleaved_1f1b", 2, 4), ("interleaved_1f1b", 2, 8)]


def paced_pipelines(root: Path) -> dict[tuple[str, int], tuple[Path, dict]]:
    """Each of :data:`PIPELINES` on 4 forked ranks, paced per sample (``per=sample``: the step's
    work stays constant as the microbatch count changes, as on a device), traced from step 1,
    analyzed (``report.json`` written): {(schedule, microbatches): (run, report)}."""
    from mfuscope.analyzers import overview, trace_set

    out = {}
    for schedule, _, m in PIPELINES:
        config = root / f"micro8-m{m}.toml"
        root.mkdir(parents=True, exist_ok=True)
        config.write_text(micro_config(n_layers=8, global_batch=PIPE_BATCH, grad_accum=1, microbatches=m))
        run = train_forked(root / f"{schedule}-m{m}", PIPE_STAGES, config=str(config), layout=f"pp={PIPE_STAGES}",
                           schedule=schedule, steps=3, window="1:", microbatches=m,
                           paced=f"fwd_ms={PIPE_FWD_MS:g},bwd_ms={PIPE_BWD_MS:g},per=sample")
        report = overview.build_report(trace_set.load(run, use_cache=False).events, source=str(run), files=[],
                                       run=run)
        (run / "report.json").write_text(json.dumps(report))
        out[(schedule, m)] = (run, report)
    return out


#: ``mfuscope train`` of :func:`torchrun_run`: tensor and data parallel, no trace window.
TORCHRUN = ["--config", "tiny_dense", "--nproc", "4", "--layout", "dp_shard=2,tp=2", "--steps", "2"]


def torchrun_run(root: Path) -> Path:
    """The trainer as a user starts it, through ``mfuscope train`` and torchrun, with only the
    always-on collectors (no ``--profile``)."""
    out = root / "torchrun"
    _ok(mfuscope("train", *TORCHRUN, "--out", str(out), timeout=300), "mfuscope train")
    return out


#: Eight layers cut 7,1 over two pipeline stages, paced per layer (10/20 ms a sample forward and
#: backward): stage 0 computes seven times what stage 1 does, and GPipe with two microbatches idles
#: a third of the pipeline on top.
GPIPE_MODEL = micro_config(n_layers=8, global_batch=8, grad_accum=1, microbatches=2)
#: Started by the fork launcher (``--launcher fork``): optimize's reruns start theirs the same way.
GPIPE_START = ["--nproc", "2", "--layout", "pp=2", "--schedule", "gpipe", "--microbatches", "2",
               "--stage-layers", "7,1", "--steps", "3", "--profile",
               "--paced", "fwd_ms=10,bwd_ms=20,per=sample,scope=layer", "--launcher", "fork"]
GPIPE_FIXES = "rebalance_stages,more_microbatches"



def optimized_gpipe(root: Path) -> dict:
    """:data:`GPIPE_START` trained, its proposals (``optimize --json``, which analyzes the run
    first), then ``optimize --apply`` with :data:`GPIPE_FIXES` for up to 3 rounds; the runs it made
    lie beside the base, in ``root/gpipe-opt-*``.  Returns {"base", "proposals", "summary",
    "stderr"}: the base run, the two commands' JSON, the apply's progress output."""
    root.mkdir(parents=True, exist_ok=True)
    config = root / "micro8.toml"
    config.write_text(GPIPE_MODEL)
    base = root / "gpipe"
    _ok(mfuscope("train", "--config", str(config), *GPIPE_START, "--out", str(base)), "mfuscope train")
    proposals = json.loads(_ok(mfuscope("optimize", str(base), "--json"), "mfuscope optimize").stdout)
    # Every change's measured step is held against its prediction (test_optimize): the 3-step runs have
    # the machine to themselves (tests/lanes.py, ``quiet``).  Beside the rest lane a fresh-clone CI once
    # measured 4,4 stages at 8 microbatches at 2.04 s in one round and 1.26 s in the next.
    with quiet():
        # --first-win: rebalancing (+20% predicted) wins round 1 alone and a microbatch count round 2,
        # 2-3 trainings where running every proposal took 4-5 (12 s of quiet machine each)
        done = _ok(mfuscope("optimize", str(base), "--apply", "--fixes", GPIPE_FIXES, "--rounds", "3", "--first-win",
                            "--json"),
                   "mfuscope optimize --apply")
    return {"base": base, "proposals": proposals, "summary": json.loads(done.stdout), "stderr": done.stderr}
