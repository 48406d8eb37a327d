"""Pipeline parallelism through ``torch.distributed.pipelining``.

The model's layers are cut into ``pp x virtual`` contiguous stages; stage 0
keeps the embedding, the last stage the final norm and LM head.  Schedules:

==================  ======================================  ==================
name                PyTorch schedule                        stages per rank
==================  ======================================  ==================
gpipe               ScheduleGPipe                           1
1f1b                Schedule1F1B                            1
interleaved_1f1b    ScheduleInterleaved1F1B                 2 (looped)
zero_bubble         ScheduleInterleavedZeroBubble           2 (looped)
zbv                 ScheduleZBVZeroBubble                   2 (V-shaped)
==================  ======================================  ==================

Theory for the bubble (used by the analyzers): (p-1)/(m+p-1) of the step for
GPipe and 1F1B, divided by the number of virtual stages for interleaved.
"""
from __future__ import annotations

import copy

from torch import nn

from .parallel_dims import ParallelDims

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
ZERO_BUBBLE = ("zero_bubble", "zbv")  # backward split into input-gradient (B) and weight-gradient (W) passes


def virtual_stages(schedule: str) -> int:
    return 1 if schedule in ("gpipe", "1f1b") else 2


def stage_ids(schedule: str, pp: int, pp_rank: int) -> list[int]:
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages(schedule))]


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline stages")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def stage_module(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of ``model`` with only what ``stage`` runs (same parameters' values, same names)."""
    keep = layer_ranges(len(model.layers), n_stages)[stage]
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if int(name) not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


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
