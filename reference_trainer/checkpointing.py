"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded as the layout shards, restored
onto any layout, committed atomically, saved in the background if asked.

``--checkpoint every=N,mode=sync|async,dir=DIR`` saves after every N steps; ``--resume DIR`` starts
from DIR's latest complete save (or from DIR itself when it is one), onto this run's layout.

What a save holds: each model part's and its optimizer's state as DCP's state-dict helpers give
them, under the full model's parameter names (the optimizer's flattened: ``state.<name>.exp_avg``),
so the parts of any pipeline layout meet in one namespace -- DTensor shards under FSDP2 and tensor
parallelism, so DCP reshards them on load and a save made on dp_shard=2 restores onto tp=2, or
onto an interleaved pipeline --; ``mfuscope.json``: the steps done and the data position in global samples
(the loader's stream is indexed by sample, so a resume onto another data-parallel degree continues
the same stream); and each rank's RNG state (restored when the world size matches).

On disk: ``DIR/step_000005/`` (DCP's ``.distcp`` shards and ``.metadata``, ``mfuscope.json``,
``rng/``).  A save is written to ``step_000005.partial/`` and renamed by rank 0 once every rank's
shards and DCP's metadata are written: a save killed midway leaves a ``.partial`` folder that
``--resume`` never takes (it may even hold DCP's metadata: the rename is the commit, not DCP's own
last write), and the previous save is the one that loads.

``mode=async``: ``dcp.async_save`` stages the state into host memory and returns; the shards, the
metadata and the commit follow on a background thread.  Its collectives run on a gloo group of its
own: on the training's group they interleave with FSDP's and the job deadlocks.  The next save and
the run's end wait for the one before.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mfuscope.errors import UserInputError
from mfuscope.trainer_options import CheckpointSpec

from .checkpoint_files import INFO, PARTIAL, latest, name
from .optimizers import PartOptimizers


class Checkpointer:
    """This rank's side of ``--checkpoint``.  Every rank constructs it (it makes a process group)."""

    def __init__(self, spec: CheckpointSpec, rank: int, world: int, on_background=None):
        """``on_background(steps_done, seconds)``: told when an async save's background part ends."""
        self.spec, self.rank, self.world = spec, rank, world
        self.dir = Path(spec.dir)
        self.on_background = on_background
        self.group = dist.new_group(backend="gloo")
        self.pending: Future | None = None
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    def due(self, steps_done: int) -> bool:
        return steps_done % self.spec.every == 0

    def save(self, steps_done: int, modules: list, optimizer: PartOptimizers, samples: int, layout: str,
             before_commit=None) -> None:
        """Save the state after ``steps_done`` steps (blocking the caller for the whole save, or for
        the staging of an async one).  ``before_commit(steps_done)``: called between the write and
        the commit (the fault injector's ``die ... at=checkpoint``)."""
        self.wait()  # the previous save's background work, before a new one starts
        partial = self.dir / (name(steps_done) + PARTIAL)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what a killed save of the same step left
            (partial / "rng").mkdir(parents=True)
            info = {"steps_done": steps_done, "samples": samples, "layout": layout, "world_size": self.world}
            (partial / INFO).write_text(json.dumps(info, indent=1) + "\n")
        dist.barrier(group=self.group)
        torch.save(_rng_state(), partial / "rng" / f"rank{self.rank}.pt")
        state = _state(modules, optimizer)
        if self.spec.mode == "sync":
            dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
            if before_commit is not None:
                before_commit(steps_done)
            dist.barrier(group=self.group)
            if self.rank == 0:
                _commit(partial)
            return
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
        future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse (staging options)

        def done(f: Future) -> None:
            if f.exception() is None:
                if before_commit is not None:
                    before_commit(steps_done)
                if self.rank == 0:
                    _commit(partial)
                if self.on_background is not None:
                    self.on_background(steps_done, time.perf_counter() - started)
        future.add_done_callback(done)
        self.pending = future

    def wait(self) -> None:
        """Block until the pending async save is written and committed (its error, if any, raised)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
            dist.barrier(group=self.group)  # every rank's callback ran: rank 0's commit included


def resume(path: str | Path, modules: list, optimizer: PartOptimizers, global_batch: int) -> tuple[int, Path]:
    """Load the latest complete save under ``path`` into ``modules`` and ``optimizer``; returns (the
    step to continue from, the save).  The optimizer's state is made first (one step of zero
    gradients: Adam's update of a zero gradient is zero, and weight decay is off), so DCP has
    tensors to load into."""
    save = latest(path)
    info = json.loads((save / INFO).read_text())
    samples = int(info["samples"])
    if samples % global_batch:
        raise UserInputError(f"the checkpoint is {samples} samples in, not a whole number of this run's global "
                             f"batches of {global_batch}", save)
    for o in optimizer.optimizers:
        _make_optimizer_state(o)
    state = _state(modules, optimizer)
    dcp.load(state, checkpoint_id=str(save))
    for part, o in zip(modules, optimizer.optimizers):  # each takes its own names of the whole
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, o, state["optim"], options=_FLAT)
    rng = save / "rng" / f"rank{dist.get_rank()}.pt"
    if info.get("world_size") == dist.get_world_size() and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    return samples // global_batch, save


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def _state(modules: list, optimizer: PartOptimizers) -> dict[str, Any]:
    """Every part's model and optimizer state, merged under the full model's names."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for part, o in zip(modules, optimizer.optimizers):
        model_sd.update(get_model_state_dict(part))
        optim_sd.update(get_optimizer_state_dict(part, o, options=_FLAT))
    return {"model": model_sd, "optim": optim_sd}


def _make_optimizer_state(optimizer) -> None:
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _commit(partial: Path) -> None:
    """Rename a finished save to its final name (an earlier save of the same step moved aside first)."""
    final = partial.with_name(partial.name.removesuffix(PARTIAL))
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(partial, final)


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
