"""Label each pipeline-stage microbatch in the trace: ``mfuscope.pp/<stage><F|B|W><microbatch>``.

The executed schedule (which stage ran which microbatch's forward and
backward, when) is what the dashboard's pipeline view draws beside the
theoretical one.  PyTorch's multi-stage schedules label their actions
(``PP:0F1``) but the single-stage ones (1F1B) do not, so while a session runs
every ``torch.distributed.pipelining`` stage's forward, backward and
weight-gradient chunk is wrapped in a ``record_function`` (and an NVTX range on
GPU) named like PyTorch's own action strings: ``mfuscope.pp/1B3`` is stage 1's
backward of microbatch 3.  Outside the Kineto window ``record_function`` costs
well under a microsecond.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from mfuscope import labels

_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


class PipelineLabels:
    """Wraps the pipelining stage's chunk methods while installed."""

    def __init__(self) -> None:
        self._patched: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        try:
            from torch.distributed.pipelining.stage import _PipelineStageBase
        except ImportError:  # pipelining is absent from some builds
            return
        for name, action in _METHODS.items():
            fn = getattr(_PipelineStageBase, name, None)
            if fn is not None and not hasattr(fn, "__mfuscope_labelled__"):  # a second session: already labelled
                self._patched.append((_PipelineStageBase, name, fn))
                setattr(_PipelineStageBase, name, _labelled(fn, action))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


def _labelled(fn: Callable, action: str) -> Callable:
    chunk_param = list(inspect.signature(fn).parameters)[1]  # fwd_chunk_id / bwd_chunk_id, after self

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        chunk = kwargs.get(chunk_param, args[0] if args else "?")
        label = labels.pp_label(getattr(self, "stage_index", "?"), action, chunk)
        nvtx = torch.cuda.nvtx.range(label) if torch.cuda.is_available() else contextlib.nullcontext()
        with record_function(label), nvtx:
            return fn(self, *args, **kwargs)
    run.__mfuscope_labelled__ = True
    return run
