"""The trainer's paced mode, ``--paced fwd_ms=20,bwd_ms=40[,w_ms=20][,per=sample][,scope=layer]``, as data.

Torch-free, so the cost model can read a run's pacing from its manifest and
predict the run with compute time known (``reference_trainer/inject.py``
applies it to the stage modules).
"""
from __future__ import annotations

from dataclasses import dataclass

from mfuscope.errors import UserInputError


@dataclass(frozen=True)
class Pacing:
    """Sleep per stage chunk and pass: forward, input-gradient backward, weight-gradient pass (ms),
    per microbatch or, with ``per_sample``, per sample of the microbatch; with ``per_layer``, per
    transformer layer of the chunk, so a stage's time follows how many layers it holds (which
    stage rebalancing changes)."""

    fwd_ms: float
    bwd_ms: float
    w_ms: float = 0.0
    per_sample: bool = False
    per_layer: bool = False


def parse_paced(text: str | None) -> Pacing | None:
    if not text:
        return None
    hint = "e.g. fwd_ms=20,bwd_ms=40 or fwd_ms=5,bwd_ms=5,w_ms=5,per=sample,scope=layer"
    try:
        kv = dict(p.split("=", 1) for p in text.split(","))
        if (set(kv) - {"fwd_ms", "bwd_ms", "w_ms", "per", "scope"}
                or kv.get("per", "microbatch") not in ("microbatch", "sample")
                or kv.get("scope", "stage") not in ("stage", "layer")):
            raise KeyError
        return Pacing(float(kv["fwd_ms"]), float(kv["bwd_ms"]), float(kv.get("w_ms", 0)), kv.get("per") == "sample",
                      kv.get("scope") == "layer")
    except (KeyError, ValueError):
        raise UserInputError(f"--paced: cannot read {text!r}; {hint}") from None
