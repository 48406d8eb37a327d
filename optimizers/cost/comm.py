"""Communication: which link tier each parallel dimension uses, and what a collective costs.

Alpha-beta per collective (Hockney; NCCL's own performance model):

    t = steps x alpha + size x busfactor(n) / (bandwidth x efficiency)

``size`` is the buffer as nccl-tests count it (the full tensor of an
all-reduce, the gathered output of an all-gather, the input of a
reduce-scatter), and the bus factors are nccl-tests' (doc/PERFORMANCE.md):
all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n,
send/recv 1.  ``steps`` is 2 log2 n for an all-reduce and log2 n for the others
(tree-like latency: NCCL switches to trees and LL protocols where ring latency
would grow with n), 1 for send/recv.

Placement: ranks are laid out innermost first in the order tp, cp, dp_shard,
dp_replicate, pp (torchtitan's and Megatron's mesh order).  A dimension of size
g whose ranks lie ``stride`` apart stays inside one scale-up domain when
stride x g <= GPUs per node; otherwise it pays the network.  Expert
parallelism takes its ranks right after tp (from the data and context ranks).
"""
from __future__ import annotations

import math

from ..spec import Layout
from ..system import LinkTier, Profile, System

MESH_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def collective_seconds(op: str, size_bytes: float, n: int, tier: LinkTier, efficiency: float,
                       latency_scale: float = 1.0) -> float:
    if n <= 1 or size_bytes <= 0:
        return 0.0
    steps = 1 if op == "send_recv" else math.ceil(math.log2(n)) * (2 if op == "all_reduce" else 1)
    return (steps * tier.latency_s * latency_scale
            + size_bytes * bus_factor(op, n) / (tier.bandwidth_Bps * efficiency))


def tiers(layout: Layout, gpus_per_node: int) -> dict[str, str]:
    """``scale_up`` or ``scale_out`` for each dimension (and ``ep``) of the layout."""
    out, stride = {}, 1
    for dim in MESH_ORDER:
        size = getattr(layout, dim)
        out[dim] = "scale_up" if stride * size <= gpus_per_node else "scale_out"
        stride *= size
    out["ep"] = "scale_up" if layout.tp * layout.ep <= gpus_per_node else "scale_out"
    # The data-parallel ranks as one group (DDP over dp_replicate x dp_shard).
    out["dp"] = "scale_up" if layout.tp * layout.cp * layout.dp <= gpus_per_node else "scale_out"
    return out


class Links:
    """Collective times for one layout on one system: ``links.seconds("tp", "all_gather", bytes)``."""

    def __init__(self, layout: Layout, system: System, profile: Profile):
        self.layout, self.system, self.profile = layout, system, profile
        self.tier_of = tiers(layout, system.gpus_per_node)

    def size(self, dim: str) -> int:
        return self.layout.dp if dim == "dp" else getattr(self.layout, dim)

    def seconds(self, dim: str, op: str, size_bytes: float, n: int | None = None) -> float:
        tier_name = self.tier_of[dim]
        tier = getattr(self.system, tier_name)
        return collective_seconds(op, size_bytes, self.size(dim) if n is None else n, tier,
                                  getattr(self.profile, tier_name), self.profile.latency_scale)
