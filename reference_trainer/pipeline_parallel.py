"""Pipeline parallelism through ``torch.distributed.pipelining``.

The model's layers are cut into ``pp x virtual`` contiguous stages, evenly or
as ``--stage-layers`` says (5,3: five layers on stage 0, three on stage 1, to
balance a heavier stage); stage 0 keeps the embedding, the last stage the
final norm and LM head.  A rank
builds each of its stages on the meta device and cuts it there
(:func:`build_stage`); the trainer shards it, still on meta, and then
allocates and initializes what is left (:func:`materialize`): no rank holds
the full model, and the values are the full model's, as the model seeds each
parameter from its name.  Schedules:

==================  ======================================  ==================
name                PyTorch schedule                        stages per rank
==================  ======================================  ==================
gpipe               ScheduleGPipe                           1
1f1b                Schedule1F1B                            1
interleaved_1f1b    ScheduleInterleaved1F1B                 2 (looped)
zero_bubble         ScheduleInterleavedZeroBubble           2 (looped)
zbv                 ScheduleZBVZeroBubble                   2 (V-shaped)
==================  ======================================  ==================

The bubble theory of each schedule (1F1B's (p-1)/(m+p-1), interleaved's
division by v, zero-bubble's from the F/B/W times) is in
``analyzers/bubbles.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from mfuscope.layout import virtual_stages

from .config import ModelConfig
from .model import Transformer
from .parallel_dims import ParallelDims


def stage_ids(schedule: str, pp: int, pp_rank: int, virtual: int | None = None) -> list[int]:
    """The global stage numbers ``pp_rank`` holds: every pp-th (looping), or ZB-V's V shape."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages(schedule, virtual))]


def layer_ranges(n_layers: int, n_stages: int, split: tuple[int, ...] | None = None) -> list[range]:
    """The layers of each stage: ``split`` (layers per stage, in stage order) or an even cut, the
    first stages taking one more where it does not divide."""
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline stages")
    if split is None:
        base, extra = divmod(n_layers, n_stages)
        split = tuple(base + (1 if s < extra else 0) for s in range(n_stages))
    elif len(split) != n_stages or sum(split) != n_layers:
        raise ValueError(f"stage split {split} is not {n_stages} stages of {n_layers} layers in all")
    out, start = [], 0
    for size in split:
        out.append(range(start, start + size))
        start += size
    return out


def stage_module(model: nn.Module, stage: int, n_stages: int, split: tuple[int, ...] | None = None) -> nn.Module:
    """``model`` cut, in place, to what ``stage`` runs; the parameters keep their names."""
    keep = layer_ranges(len(model.layers), n_stages, split)[stage]
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def build_stage(cfg: ModelConfig, seq_len: int, seed: int, stage: int, n_stages: int,
                device: torch.device | str, split: tuple[int, ...] | None = None) -> Transformer:
    """Stage ``stage`` of ``n_stages`` (the whole model for one stage) on ``device``: built on meta
    and cut.  On the meta device it holds no values yet: the trainer shards it there (tensor and
    expert parallelism) and then :func:`materialize` s it, so a rank allocates only its part."""
    with torch.device("meta"):
        model = Transformer(cfg, seq_len, seed=seed)
    stage_module(model, stage, n_stages, split)
    if torch.device(device).type != "meta":
        materialize(model, device)
    return model


def materialize(model: Transformer, device: torch.device | str) -> Transformer:
    """Allocate a meta-built (and maybe sharded) model on ``device`` and draw its initial values."""
    model.to_empty(device=device)
    model.reset_parameters()
    return model


def build_schedule(stages: list, schedule: str, microbatches: int, loss_fn):
    """The schedule; it averages gradients over microbatches (``scale_grads``), as the loss is a mean."""
    from torch.distributed import pipelining as pl

    if schedule == "gpipe":
        return pl.ScheduleGPipe(stages[0], microbatches, loss_fn=loss_fn)
    if schedule == "1f1b":
        return pl.Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn)
    cls = {"interleaved_1f1b": pl.ScheduleInterleaved1F1B, "zero_bubble": pl.ScheduleInterleavedZeroBubble,
           "zbv": pl.ScheduleZBVZeroBubble}[schedule]
    return cls(stages, microbatches, loss_fn=loss_fn)


def pipeline_stages(modules: list[nn.Module], ids: list[int], dims: ParallelDims, device):
    from torch.distributed.pipelining import PipelineStage

    n_stages = dims.pp * len(ids)
    group = dims.mesh["pp"].get_group()
    return [PipelineStage(m, sid, n_stages, device, group=group) for m, sid in zip(modules, ids)]
