"""Unpaced reference-trainer runs on this CPU: real matmuls, real gloo collectives, one rank per core.

The cost model's proof on real compute (docs/cost_model.md, "Proof on real compute"): the same small
Llama-style model trained under seven layouts -- one rank, FSDP (dp_shard=2), tensor parallel,
pipeline (1F1B), context parallel, DDP, and expert parallel on its mixture-of-experts twin -- at most
two ranks, so each has a core of its own; 20 steps each, four of them traced.  The profile is
calibrated on two of them (:data:`CALIBRATE_ON`) and the others are predicted.

``benchmarks/real_compute.py`` prints the table; ``tests/test_cost_model_runs.py`` holds the targets.
Nothing here is paced: what a step costs is whatever this machine's cores, caches and gloo make of it.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
from pathlib import Path

from .lanes import quiet

#: Dimensions a 2-core host trains in ~100 ms a step on one rank, so that GEMMs, elementwise work,
#: the optimizer, host time and gloo's collectives all show: d=192 with grouped-query attention
#: and SwiGLU, 128-token sequences, 8 sequences a step.
MODEL = """
[model]
vocab_size = 1024
dim = 192
n_layers = 4
n_heads = 6
n_kv_heads = 2
ffn_dim = 512
max_seq_len = 128
{moe}
[train]
seq_len = 128
global_batch = 8
microbatches = 2
lr = 1e-3
dtype = "fp32"
"""
MOE = "n_experts = 4\ntop_k = 2"

STEPS, WINDOW = 20, "14:4"

#: name -> (ranks, config, trainer options)
LAYOUTS: dict[str, tuple[int, str, dict]] = {
    "1 rank": (1, "dense", {}),
    "dp_shard=2": (2, "dense", {"layout": "dp_shard=2"}),
    "tp=2": (2, "dense", {"layout": "tp=2"}),
    "pp=2": (2, "dense", {"layout": "pp=2", "microbatches": 2}),
    "cp=2": (2, "dense", {"layout": "cp=2"}),
    "ddp=2": (2, "dense", {"layout": "dp_shard=2", "dp_mode": "ddp"}),
    "ep=2 (moe)": (2, "moe", {"layout": "dp_shard=2,ep=2"}),
}
#: The two runs the profile is fitted on: one rank (compute, host) and tensor parallel (links).
CALIBRATE_ON = ("1 rank", "tp=2")


def config(root: Path, kind: str) -> Path:
    path = root / f"real-{kind}.toml"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(MODEL.format(moe=MOE if kind == "moe" else ""))
    return path


def run_path(root: Path, name: str) -> Path:
    """Where layout ``name``'s run lies under ``root`` (``1``, ``dp_shard2``, ``ep2``, ...)."""
    return root / name.split(" ")[0].replace("=", "")


def train(root: Path, name: str, analyzed: bool = True) -> Path:
    """Layout ``name`` trained into ``root/<slug>`` on forked gloo ranks, then analyzed (unless
    ``analyzed`` is False: :func:`analyze` it later)."""
    from .shared_runs import train_forked

    ranks, kind, options = LAYOUTS[name]
    out = run_path(root, name)
    with twin(root, config(root, kind)) if ranks == 1 else contextlib.nullcontext():
        train_forked(out, ranks, config=str(config(root, kind)), steps=STEPS, window=WINDOW, **options)
    if analyzed:
        analyze(out)
    return out


def analyze(out: Path) -> None:
    """A trained run's report.json and views, from its traces."""
    from mfuscope.optimizers import predicted_memory
    from mfuscope.run_dir import VIEWS

    predicted_memory.analyze(out, out / "report.json", out / VIEWS, use_cache=False)


@contextlib.contextmanager
def twin(root: Path, config_path: Path | str):
    """The one-rank run's twin on the other core, for as long as the run lasts: every run of the
    table then shares the machine's caches and memory bandwidth as two ranks do (and under ``make
    test`` no other test takes the idle core meanwhile).  Killed, its ranks with it, when the run
    is done."""
    from .shared_runs import train_forked

    ctx = multiprocessing.get_context("fork")
    other = ctx.Process(target=_run_twin, args=(train_forked, root / "twin", str(config_path)))
    other.start()
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(other.pid, signal.SIGKILL)
        other.join()
        shutil.rmtree(root / "twin", ignore_errors=True)


def _run_twin(train_forked, out: Path, config_path: str) -> None:
    os.setpgrp()  # its ranks join this group: one kill ends them all
    train_forked(out, 1, config=config_path, steps=10 * STEPS, force=True)


def train_all(root: Path, names=None, say=print) -> dict[str, Path]:
    """Layouts ``names`` (all of them by default) trained in turn, under make test with the machine
    to themselves (tests/lanes.py, ``quiet``): what a step of real compute costs is the point.  Then
    analyzed, with the machine shared again (an analysis times nothing)."""
    out = {}
    with quiet():
        for name in names or LAYOUTS:
            say(f"training {name} ...")
            out[name] = train(root, name, analyzed=False)
    for path in out.values():
        analyze(path)
    return out

#: How far a predicted step may fall from the median measured one.  The issue's target is 20%;
#: three rounds of 2026-12-06 (``python benchmarks/real_compute.py --rounds 3``, docs/cost_model.md,
#: "Proof on real compute") meet it on every layout in every round, the largest errors ddp=2 +13%,
#: cp=2 -12%, ep=2 -10%, dp_shard=2 +5% (and three rounds with the hooks' prior at 1.7: dp_shard=2
#: +16%, ddp=2 -14%, cp=2 -12%, pp=2 -11%).  The test adds what a core kept busy beside it moves the
#: errors by -- measured with ``python -c "while True: pass"`` running: ddp=2 0% -> +22%, pp=2 -1% ->
#: +17%, the others less -- so 30%.  (cp=2 and ep=2 had 40% while FSDP2's hooks went uncounted by a
#: calibration on one rank and tp=2: cp=2 -17% to -27%.)
TARGET: dict[str, float] = {name: 0.30 for name in LAYOUTS}
