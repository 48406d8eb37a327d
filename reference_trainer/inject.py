"""Known faults, injected on purpose, so tests can check that analysis finds exactly them.

``--inject`` takes one or more specs, separated by ``;``:

- ``compute:rank=3:ms=50``      sleep 50 ms in every forward (per microbatch) of rank 3;
- ``comm:dim=tp:ms=20[:rank=R]`` global rank R (default 0) arrives 20 ms late at every
  sequence-parallel all-gather in front of attention and the MLP, so its tp peers wait 20 ms in
  that all-gather;
- ``stage:stage=1:ms=30``        pipeline stage 1's forward is 30 ms heavier.

``--paced fwd_ms=20,bwd_ms=40`` makes every stage's forward and backward take a fixed time
(a sleep that dominates the tiny model's compute): 16 ranks on 2 cores then keep the timing
of dedicated devices, which pipeline-bubble tests need.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from mfuscope.errors import UserInputError


@dataclass(frozen=True)
class Fault:
    kind: str
    ms: float
    rank: int | None = None
    dim: str | None = None
    stage: int | None = None


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for spec in filter(None, (s.strip() for s in (text or "").split(";"))):
        kind, *fields = spec.split(":")
        kv = dict(f.split("=", 1) for f in fields if "=" in f)
        try:
            if kind == "compute":
                faults.append(Fault("compute", float(kv["ms"]), rank=int(kv["rank"])))
            elif kind == "comm":
                faults.append(Fault("comm", float(kv["ms"]), rank=int(kv.get("rank", 0)), dim=kv["dim"]))
            elif kind == "stage":
                faults.append(Fault("stage", float(kv["ms"]), stage=int(kv["stage"])))
            else:
                raise KeyError(kind)
        except (KeyError, ValueError):
            raise UserInputError(f"--inject: cannot read {spec!r}; e.g. compute:rank=3:ms=50, "
                                 "comm:dim=tp:ms=20, stage:stage=1:ms=30") from None
    return faults


def parse_paced(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        kv = dict(p.split("=", 1) for p in text.split(","))
        return float(kv["fwd_ms"]), float(kv["bwd_ms"])
    except (KeyError, ValueError):
        raise UserInputError(f"--paced: cannot read {text!r}; e.g. fwd_ms=20,bwd_ms=40") from None


def _sleep_hook(ms: float, label: str):
    # Labelled, so the breakdown counts the sleep as the compute it stands for.
    def hook(module, args):
        with record_function(label):
            time.sleep(ms / 1e3)
    return hook


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with record_function("mfuscope.paced/backward"):
            time.sleep(ctx.ms / 1e3)
        return grad, None


def apply_faults(modules: list[nn.Module], stage_ids: list[int], faults: list[Fault], rank: int) -> None:
    for f in faults:
        if f.kind == "compute" and f.rank == rank:
            for m in modules:
                m.register_forward_pre_hook(_sleep_hook(f.ms, "mfuscope.inject/compute"))
        elif f.kind == "stage":
            for m, sid in zip(modules, stage_ids):
                if sid == f.stage:
                    m.register_forward_pre_hook(_sleep_hook(f.ms, "mfuscope.inject/stage"))
        elif f.kind == "comm" and f.dim == "tp" and rank == f.rank:
            # Late to the sequence-parallel all-gathers in front of attention and MLP: the sleep runs
            # before tensor parallelism's own input hook (prepend), which starts the gather.  The late
            # rank is busy elsewhere (compute/other); its peers wait in the collective.
            for m in modules:
                for block in m.layers.values():
                    for part in (block.attention, block.feed_forward):
                        part.register_forward_pre_hook(_sleep_hook(f.ms, "mfuscope.inject/late"), prepend=True)
        elif f.kind == "comm" and f.dim != "tp":
            raise UserInputError(f"--inject comm: dimension {f.dim!r} is not supported yet (tp is)")


def apply_paced(modules: list[nn.Module], fwd_ms: float, bwd_ms: float) -> None:
    """Each stage module's forward takes ``fwd_ms`` more, its backward ``bwd_ms`` more."""
    for m in modules:
        m.register_forward_pre_hook(_sleep_hook(fwd_ms, "mfuscope.paced/forward"))
        m.register_forward_hook(lambda mod, args, out: _SleepInBackward.apply(out, bwd_ms))
