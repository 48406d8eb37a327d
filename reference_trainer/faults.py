"""Known faults, injected on purpose, so tests can check that analysis finds exactly them.

``--inject`` takes one or more specs, separated by ``;``, each ``kind:key=value:...``:

==========  =====================================  ===================================================
kind        keys                                   what happens
==========  =====================================  ===================================================
compute     ms, rank, pass=fwd|bwd                 every forward (or backward) of the rank's stage
                                                   modules takes ``ms`` more (per microbatch)
stage       ms, stage, pass=fwd|bwd                pipeline stage ``stage`` is that much heavier
comm        dim=tp, ms, rank (default 0)           global rank R arrives ``ms`` late at every
                                                   sequence-parallel all-gather in front of attention
                                                   and the MLP: its tp peers wait there
link        dim=dp|pp|cp|ep, gbps, rank            a slow link: every collective on that dimension's
                                                   groups (with ``rank``: only the groups of that
                                                   dimension that rank R is in, as when one node's
                                                   NIC degrades) moves its bytes at ``gbps`` Gb/s: it
                                                   completes no sooner than bytes/bandwidth after it
                                                   was issued (a blocking call returns then; an async
                                                   one's wait or future is held to it, so work issued
                                                   early overlaps it) -- the whole group sees long
                                                   collectives, nobody arrives late
loader      ms, rank                               a data-loader stall at the start of each step (a
                                                   ``DataLoader`` region, as PyTorch names real ones)
gc          ms, rank                               the training thread pauses with no operator running,
                                                   which is what a garbage-collection pass looks like
optimizer   ms, rank                               a slow optimizer step (inside ``Optimizer.step``)
sync        rank                                   a device-to-host sync (``.item()``) after every
                                                   transformer block's forward
hang        rank, step                             the rank stops at the start of that step, before its
                                                   next collective, and waits until it is killed (its
                                                   peers block in that collective: with
                                                   ``--collective-timeout`` they fail and the job ends)
die         rank, step, at=step|checkpoint,        the rank kills itself (SIGKILL) at the start of that
            signal=KILL|SEGV|ABRT|BUS              step: no handler runs, nothing is flushed; with
                                                   ``at=checkpoint``, in the checkpoint save made in that
                                                   step, after its shards are written and before the
                                                   save is committed; with ``signal``, by that signal
                                                   (SEGV: a crash in native code, whose Python stacks
                                                   the collectors keep)
desync      rank, step                             the rank's first all-reduce of that step sends one
                                                   element more than its peers' (gloo stops a rank
                                                   that receives it: an error on torch 2.13, SIGABRT
                                                   on some versions)
==========  =====================================  ===================================================

Every kind also takes ``every=N`` (only on steps divisible by N: an intermittent
fault), ``from=S`` (only from step S on: a job that turns slow, fail-slow) and
``jitter_ms=J`` (each occurrence lasts ``ms`` plus a uniform draw in [-J, J],
from a generator seeded by rank, so a run repeats).  ``rank`` is the global
rank; without it a fault hits every rank (``comm`` defaults to rank 0; a
``link`` without it slows every group of its dimension).

Parsing is torch-free: ``mfuscope train`` checks a spec in the launching process before any
rank starts; :mod:`.inject` makes the faults happen.
"""
from __future__ import annotations

from dataclasses import dataclass

from mfuscope.errors import UserInputError

_KEYS = {  # kind -> (required keys, optional keys)
    "compute": ({"ms"}, {"rank", "pass"}),
    "stage": ({"ms", "stage"}, {"pass"}),
    "comm": ({"ms", "dim"}, {"rank"}),
    "link": ({"dim", "gbps"}, {"rank"}),
    "loader": ({"ms"}, {"rank"}),
    "gc": ({"ms"}, {"rank"}),
    "optimizer": ({"ms"}, {"rank"}),
    "sync": (set(), {"rank"}),
    "hang": ({"rank", "step"}, set()),
    "die": ({"rank", "step"}, {"at", "signal"}),
    "desync": ({"rank", "step"}, set()),
}
_COMMON = {"every", "jitter_ms", "from"}
LINK_DIMS = ("dp", "pp", "cp", "ep")
DIE_SIGNALS = ("KILL", "SEGV", "ABRT", "BUS")
_EXAMPLES = ("e.g. compute:rank=3:ms=50, compute:rank=1:ms=30:pass=bwd, comm:dim=tp:ms=20, "
             "stage:stage=1:ms=30, link:dim=dp:gbps=1, link:rank=6:dim=dp:gbps=1, compute:rank=5:ms=50:from=60, "
             "loader:ms=200:every=4, gc:ms=80:rank=2, "
             "optimizer:ms=40, sync:rank=0, hang:rank=3:step=4, die:rank=1:step=2, die:rank=0:step=5:at=checkpoint, "
             "die:rank=1:step=2:signal=SEGV, "
             "desync:rank=2:step=3")


@dataclass(frozen=True)
class Fault:
    kind: str
    ms: float = 0.0
    rank: int | None = None    # global rank; None: every rank
    dim: str | None = None
    stage: int | None = None
    phase: str = "fwd"         # compute/stage: the forward or the backward
    gbps: float | None = None  # link
    every: int = 1
    jitter_ms: float = 0.0
    step: int | None = None    # hang/die/desync: the step it happens at
    start: int = 0             # ``from``: the first step it happens at
    at: str = "step"           # die: at the step's start, or in its checkpoint save
    signal: str = "KILL"       # die: the signal it dies of (SIG<name>)

    def hits(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def on(self, step: int) -> bool:
        """Whether an occurrence falls on ``step`` (``from`` and ``every``)."""
        return step >= self.start and step % self.every == 0


def parse_faults(text: str | None) -> list[Fault]:
    return [_parse_one(s) for s in filter(None, (s.strip() for s in (text or "").split(";")))]


def _parse_one(spec: str) -> Fault:
    kind, *fields = spec.split(":")
    if kind not in _KEYS:
        raise UserInputError(f"--inject: unknown fault kind {kind!r} in {spec!r}; kinds: {', '.join(_KEYS)}; "
                             f"{_EXAMPLES}")
    try:
        kv = dict(f.split("=", 1) for f in fields)
    except ValueError:
        raise UserInputError(f"--inject: cannot read {spec!r} (fields are key=value); {_EXAMPLES}") from None
    required, optional = _KEYS[kind]
    if missing := required - set(kv):
        raise UserInputError(f"--inject: {spec!r} needs {', '.join(sorted(missing))}; {_EXAMPLES}")
    if unknown := set(kv) - required - optional - _COMMON:
        raise UserInputError(f"--inject: {spec!r}: {kind} takes no {', '.join(sorted(unknown))} "
                             f"(it takes {', '.join(sorted(required | optional | _COMMON))})")
    try:
        fault = Fault(kind, ms=float(kv.get("ms", 0)),
                      rank=int(kv["rank"]) if "rank" in kv else (0 if kind == "comm" else None),
                      dim=kv.get("dim"), stage=int(kv["stage"]) if "stage" in kv else None, phase=kv.get("pass", "fwd"),
                      gbps=float(kv["gbps"]) if "gbps" in kv else None, every=int(kv.get("every", 1)),
                      jitter_ms=float(kv.get("jitter_ms", 0)), step=int(kv["step"]) if "step" in kv else None,
                      start=int(kv.get("from", 0)), at=kv.get("at", "step"),
                      signal=kv.get("signal", "KILL").upper().removeprefix("SIG"))
    except ValueError:
        raise UserInputError(f"--inject: cannot read the numbers in {spec!r}; {_EXAMPLES}") from None
    if fault.at not in ("step", "checkpoint"):
        raise UserInputError(f"--inject: {spec!r}: at is step or checkpoint")
    if fault.signal not in DIE_SIGNALS:
        raise UserInputError(f"--inject: {spec!r}: signal is one of {', '.join(DIE_SIGNALS)}")
    if fault.phase not in ("fwd", "bwd"):
        raise UserInputError(f"--inject: {spec!r}: pass is fwd or bwd")
    if (fault.step is not None and fault.step < 0) or fault.start < 0:
        raise UserInputError(f"--inject: {spec!r}: step and from must be >= 0")
    if fault.every < 1 or fault.ms < 0 or fault.jitter_ms < 0 or (fault.gbps is not None and fault.gbps <= 0):
        raise UserInputError(f"--inject: {spec!r}: every must be >= 1, ms and jitter_ms >= 0, gbps > 0")
    if kind == "comm" and fault.dim != "tp":
        raise UserInputError(f"--inject: {spec!r}: late arrival is injected on tp (a slow link on other "
                             f"dimensions is link:dim=...:gbps=...)")
    if kind == "link" and fault.dim not in LINK_DIMS:
        raise UserInputError(f"--inject: {spec!r}: link dim is one of {', '.join(LINK_DIMS)}")
    return fault
