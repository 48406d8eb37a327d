"""The parallel layout's vocabulary: its dimensions, their one order, and its one text form.

The CLI's ``--layout``, the run manifest's ``layout`` section, the trainer's DeviceMesh, the cost
model, optimize's changes and the dashboard all speak of a layout through this module, so a
layout reads the same everywhere: ``pp=2,dp_shard=2,tp=2``.

Mesh dimensions, outermost first (torchtitan's order): ``pp``, ``dp_replicate``, ``dp_shard``,
``cp``, ``tp`` -- tensor parallelism innermost, where the fastest links are.  Expert parallelism
borrows ranks from ``dp_shard x cp``: ``ep`` must divide that product.

"dp" alone is ambiguous (the cost model meant replicate x shard, the trainer also x cp), so the
data-parallel degrees are named for what they count:

- ``dp_replicate``: replicas (DDP, HSDP's outer dimension);
- ``dp_shard``: ranks FSDP shards parameters, gradients and optimizer state over;
- :attr:`Degrees.data_ranks` = replicate x shard: ranks that take different rows of the batch;
- :attr:`Degrees.grad_ranks` = data_ranks x cp: ranks whose gradients are averaged (each saw
  different tokens).

Torch-free: a laptop reading a cluster's run imports it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from mfuscope.errors import UserInputError

#: The DeviceMesh's dimensions, outermost first.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: Every dimension a layout names, in the text form's order.
DIMS = MESH_DIMS + ("ep",)

#: Pipeline schedules, as torch.distributed.pipelining names them (lower case).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
#: Schedules whose backward is split into input-gradient (B) and weight-gradient (W) passes.
ZERO_BUBBLE = ("zero_bubble", "zbv")


#: Schedules whose number of model chunks per pipeline rank is a choice (ZB-V's V has two).
INTERLEAVED = ("interleaved_1f1b", "zero_bubble")


def virtual_stages(schedule: str, chosen: int | None = None) -> int:
    """Model chunks per pipeline rank: 1 for GPipe and 1F1B, 2 for ZB-V, ``chosen`` (default 2)
    for the interleaved and zero-bubble schedules (the reference trainer's ``--virtual-stages``)."""
    if schedule in ("gpipe", "1f1b"):
        return 1
    return (chosen or 2) if schedule in INTERLEAVED else 2


@dataclass(frozen=True)
class Degrees:
    """How many ranks each dimension spans.  :meth:`parse` reads the text form (and, given the
    world size, checks the layout fills it), :meth:`text` writes it, :meth:`from_sizes` reads a
    manifest's ``layout`` section."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for d in DIMS:
            if getattr(self, d) < 1:
                raise UserInputError(f"layout: {d}={getattr(self, d)} must be at least 1")

    @classmethod
    def parse(cls, text: str | None, world_size: int | None = None) -> Degrees:
        """``"dp_shard=2,tp=2,pp=2"`` (any order); unnamed dimensions are 1.  With ``world_size``,
        an unnamed ``dp_shard`` takes whatever the other dimensions leave, and the layout must
        use exactly that many ranks."""
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            key, _, val = part.partition("=")
            key = key.strip()
            if key not in DIMS or not val.strip().lstrip("-").isdigit():
                raise UserInputError(f"layout: cannot read {part!r}; use e.g. dp_shard=2,tp=2,pp=2 "
                                     f"(dimensions: {', '.join(DIMS)})")
            values[key] = int(val)
        if world_size is None:
            return cls(**values)
        rest = 1
        for d in MESH_DIMS:
            if d != "dp_shard":
                rest *= values.get(d, 1)
                if values.get(d, 1) < 1:
                    return cls(**values)  # __post_init__ names the bad size
        if "dp_shard" not in values:
            if world_size % rest:
                raise UserInputError(f"layout: pp*dp_replicate*cp*tp = {rest} does not divide world size {world_size}")
            values["dp_shard"] = world_size // rest
        degrees = cls(**values)
        if degrees.world_size != world_size:
            raise UserInputError(f"layout: {degrees.text()} uses {degrees.world_size} ranks, "
                                 f"world size is {world_size}")
        if (degrees.dp_shard * degrees.cp) % degrees.ep:  # the ranks ep borrows
            raise UserInputError(f"layout: ep={degrees.ep} must divide dp_shard*cp = {degrees.dp_shard * degrees.cp}")
        return degrees

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, Any] | None) -> Degrees:
        """A manifest's ``layout`` section ({dimension: size}); names that are not ours (a user's
        own DeviceMesh) are left out."""
        return cls(**{d: int(v) for d, v in (sizes or {}).items() if d in DIMS and v is not None})

    def text(self) -> str:
        """The one text form: dimensions above 1 in :data:`DIMS` order; ``dp_shard=1`` for one
        rank (it parses back)."""
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS if getattr(self, d) != 1) or "dp_shard=1"

    def sizes(self) -> dict[str, int]:
        """{dimension: size} for every dimension, as the manifest's ``layout`` section holds it."""
        return asdict(self)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_ranks(self) -> int:
        """Ranks that take different rows of the batch: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are averaged: data ranks x context ranks (each saw other tokens)."""
        return self.data_ranks * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` (row-major over :data:`MESH_DIMS`)."""
        out, rem = {}, rank
        for d in reversed(MESH_DIMS):
            size = getattr(self, d)
            out[d] = rem % size
            rem //= size
        return {d: out[d] for d in MESH_DIMS}
