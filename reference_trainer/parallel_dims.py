"""The 5D layout: validate it against the world size and build the DeviceMesh.

Mesh dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``,
``cp``, ``tp`` (tensor parallel innermost, where the fastest links are).
Expert parallelism borrows ranks from ``dp_shard x cp``: ``ep`` must divide
that product, and consecutive blocks of ``ep`` ranks along it form an expert
group.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

from mfuscope.errors import UserInputError

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other dimensions leave
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        sizes = {d: getattr(self, d) for d in DIMS if d != "dp_shard"} | {"ep": self.ep}
        for d, v in sizes.items():
            if v < 1:
                raise UserInputError(f"layout: {d}={v} must be at least 1")
        rest = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % rest:
                raise UserInputError(f"layout: pp*dp_replicate*cp*tp = {rest} does not divide world size {self.world_size}")
            object.__setattr__(self, "dp_shard", self.world_size // rest)
        if rest * self.dp_shard != self.world_size:
            raise UserInputError(f"layout: {self.describe()} uses {rest * self.dp_shard} ranks, "
                                 f"world size is {self.world_size}")
        if (self.dp_shard * self.cp) % self.ep:
            raise UserInputError(f"layout: ep={self.ep} must divide dp_shard*cp = {self.dp_shard * self.cp}")

    @classmethod
    def parse(cls, text: str | None, world_size: int) -> "ParallelDims":
        """``"dp_shard=2,tp=2,pp=2"`` -> ParallelDims; unnamed dimensions are 1 (dp_shard fills the rest)."""
        values: dict[str, int] = {}
        for part in filter(None, (text or "").split(",")):
            key, _, val = part.partition("=")
            key = key.strip()
            if key not in DIMS + ("ep",) or not val.strip().lstrip("-").isdigit():
                raise UserInputError(f"layout: cannot read {part!r}; use e.g. dp_shard=2,tp=2,pp=2 "
                                     f"(dimensions: {', '.join(DIMS + ('ep',))})")
            values[key] = int(val)
        return cls(world_size=world_size, **values)

    def describe(self) -> str:
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS + ("ep",) if getattr(self, d) != 1) or "single"

    def sizes(self) -> dict[str, int]:
        d = asdict(self)
        d.pop("world_size")
        return d

    @property
    def dp(self) -> int:
        """Ranks that see different data: gradients are averaged over these."""
        return self.dp_replicate * self.dp_shard * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` (row-major over DIMS)."""
        out, rem = {}, rank
        for d in reversed(DIMS):
            size = getattr(self, d)
            out[d] = rem % size
            rem //= size
        return {d: out[d] for d in DIMS}

    @cached_property
    def mesh(self):
        """The DeviceMesh (built on first use, after the process group exists)."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, tuple(getattr(self, d) for d in DIMS), mesh_dim_names=DIMS)
        # Gradients are reduced over every rank that saw different tokens: dp_shard and cp together.
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh
