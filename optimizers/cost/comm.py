"""Communication: which link tier each parallel dimension uses, and what a collective costs.

Alpha-beta per collective (Hockney; NCCL's own tuning model, ``src/graph/tuning.cc``):

    t = calls x latency + size x busfactor(n) / bandwidth

``size`` is the buffer as nccl-tests count it (the full tensor of an
all-reduce, the gathered output of an all-gather, the input of a
reduce-scatter), and the bus factors are nccl-tests' (doc/PERFORMANCE.md):
all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n,
send/recv 1.  ``calls``: how many collectives the bytes are split into (FSDP
gathers a block at a time; DeepSpeed's ZeRO-3 of 2021 gathered each parameter
tensor), each paying the latency.

Inside one scale-up domain the latency is ``log2 n`` steps (2 log2 n for an
all-reduce) of the NVLink tier, and the bandwidth the NVLink tier's.  A group
that spans N nodes with g of its ranks on each runs as NCCL runs it there:

- **bandwidth.** Rings (all-gather, reduce-scatter, all-reduce) take one
  channel per NIC, so a node's g ranks drive g NICs at once and the bus
  bandwidth is g x the NIC per GPU, capped by the NVLink tier that the ring
  also crosses.  NCCL's tuning model sets bus bandwidth = channels x
  per-channel inter-node speed; a DGX A100's 8 x 200 Gb/s measure 192 GB/s of
  all-reduce bus bandwidth (NCCL maintainers, NVIDIA/nccl#812, #1576).
  All-to-all "cannot aggregate the bandwidth of multiple NICs" (NVIDIA/nccl-tests#267):
  it and send/recv run at one NIC per GPU.  An all-to-all is a send and a receive to
  each peer (nccl-tests' alltoall groups ``ncclSend``/``ncclRecv``), and NCCL carries
  each by its transport: the (g-1)/n of the buffer bound for peers in the node over
  NVLink while the (n-g)/n for the other nodes crosses the NIC -- the slower of the two.
- **latency.** A ring all-gather or reduce-scatter takes n-1 steps, N-1 of them
  across the network (tuning.cc: ``(nsteps - nInterSteps) x intraLat +
  nInterSteps x interLat``) -- latency that grows with the group, which is
  what makes many small collectives over thousands of ranks slow.  An
  all-reduce across nodes runs as a tree: 2((g-1) NVLink steps + log2 N network
  steps).

**Two-level expert dispatch** (DeepEP's internode kernels, Megatron-Core's ``flex`` dispatcher
with ``--moe-enable-deepep``): a token bound for several experts on one node crosses the network
once, to the GPU of its own rail there, which forwards it over NVLink to each expert's GPU -- so
the NIC carries a copy per distinct remote node (``distinct_nodes``), not per expert, while
NVLink carries every copy; the two are pipelined (the slower one is the time).  Node-limited
routing (DeepSeek-V3: 8 expert groups, each token's experts from 4 of them; Megatron-Core's
``--moe-router-num-groups`` / ``--moe-router-group-topk``) bounds the distinct nodes further.

Placement: ranks are laid out innermost first in the order tp, cp, dp_shard,
dp_replicate, pp (torchtitan's and Megatron's mesh order).  A dimension of size
n whose ranks lie ``stride`` apart stays inside one scale-up domain when
stride x n <= GPUs per node; otherwise it pays the network, with
g = GPUs per node / stride of its ranks on each node (1 when stride >= GPUs
per node: a rail of its own).  Expert parallelism takes its ranks right after
tp (from the data and context ranks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mfuscope.layout import MESH_DIMS

from ..spec import Layout
from ..system import LinkTier, Profile, System

#: The mesh's dimensions innermost first: tp gets the fastest tier, then cp, the data dimensions, pp.
MESH_ORDER = tuple(reversed(MESH_DIMS))
RINGS = ("all_reduce", "all_gather", "reduce_scatter")


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
    """One collective inside one tier: log2 n latency steps (2 log2 n for an all-reduce; 1 for
    send/recv) and the tier's bandwidth."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    op = tier.runs_as(op)
    steps = 1 if op == "send_recv" else math.ceil(math.log2(n)) * (2 if op == "all_reduce" else 1)
    return (steps * tier.latency_s * latency_scale
            + size_bytes * bus_factor(op, n) / (tier.bandwidth_Bps * efficiency))


def _none_picked(pool: float, avoided: float, k: int) -> float:
    """The chance that ``k`` distinct experts drawn uniformly from ``pool`` miss ``avoided`` of
    them: C(pool - avoided, k) / C(pool, k) as a product (real-valued pools allowed)."""
    p = 1.0
    for i in range(k):
        p *= max(0.0, (pool - avoided - i) / (pool - i))
    return p


def distinct_nodes(experts: int, top_k: int, nodes: int, groups: int = 1, group_topk: int = 1) -> float:
    """Expected number of nodes holding a token's ``top_k`` experts: ``experts`` laid out evenly
    and in order over ``nodes`` nodes, the router choosing uniformly among the experts of
    ``group_topk`` of ``groups`` equal, contiguous expert groups (1 of 1: no limit).  Groups that
    nest in nodes: a node's chosen groups are hypergeometric; nodes that nest in groups: a node
    is reachable only when its group is chosen.  Other shapes are counted without the limit."""
    k = min(top_k, experts)
    if nodes <= 1 or k <= 0:
        return float(min(nodes, 1))
    if groups < 1 or group_topk < 1 or group_topk >= groups or not (groups % nodes == 0 or nodes % groups == 0):
        groups = group_topk = 1
    per_group, pool = experts / groups, experts * group_topk / groups
    if groups >= nodes and groups > 1:
        q = groups // nodes  # groups per node
        missed = sum(math.comb(q, x) * math.comb(groups - q, group_topk - x) / math.comb(groups, group_topk)
                     * _none_picked(pool, x * per_group, k) for x in range(0, min(q, group_topk) + 1))
    else:
        reach = group_topk / groups
        missed = 1 - reach + reach * _none_picked(pool, experts / nodes, k)
    return nodes * (1 - missed)


@dataclass(frozen=True)
class Placement:
    """Where one dimension's group lies: its tier, and how many of its ranks share a node."""

    tier: str
    per_node: int


def placements(layout: Layout, gpus_per_node: int) -> dict[str, Placement]:
    """Each dimension's (and ``ep``'s, and ``dp``'s: the data ranks as one group) placement; with
    expert parallelism also the expert data-parallel groups' (``dp_expert``, ``dp_expert_shard``:
    :attr:`Layout.expert_grad_ranks`, :attr:`Layout.expert_shard_ranks`)."""
    def place(stride: int, size: int) -> Placement:
        if stride * size <= gpus_per_node:
            return Placement("scale_up", size)
        return Placement("scale_out", max(1, min(size, gpus_per_node // stride)))

    out, stride = {}, 1
    for dim in MESH_ORDER:
        size = getattr(layout, dim)
        out[dim] = place(stride, size)
        stride *= size
    # Folded expert groups take the ranks innermost first (tp's included); otherwise they are cut
    # from the data ranks, after tp.
    out["ep"] = place(1 if layout.expert_folding else layout.tp, layout.ep)
    # The gradient and FSDP groups take the context ranks in (Layout.grad_ranks, shard_ranks): they
    # start right after tp.
    out["dp"] = place(layout.tp, layout.grad_ranks)
    if layout.shard_ranks > 1:
        out["dp_shard"] = place(layout.tp, layout.shard_ranks)
    if layout.ep > 1:
        # The ranks that hold the same experts lie one expert-parallel group apart: folded, every
        # ep-th rank; cut from the data ranks, a tp group every tp x ep ranks.
        if layout.expert_folding:
            out["dp_expert"] = place(layout.ep, layout.expert_grad_ranks)
        else:
            out["dp_expert"] = _place_blocks(layout.tp, layout.tp * layout.ep, layout.expert_grad_ranks,
                                             gpus_per_node)
        stride = math.lcm(layout.tp, layout.ep) if layout.expert_folding else layout.tp * layout.ep
        out["dp_expert_shard"] = place(stride, layout.expert_shard_ranks)
    return out


def _place_blocks(block: int, stride: int, size: int, gpus_per_node: int) -> Placement:
    """A group of ``size`` ranks in contiguous blocks of ``block``, the blocks ``stride`` apart."""
    if stride * (size // block) <= gpus_per_node:
        return Placement("scale_up", size)
    return Placement("scale_out", max(1, min(size, block * max(1, gpus_per_node // stride), gpus_per_node)))


def tiers(layout: Layout, gpus_per_node: int) -> dict[str, str]:
    """``scale_up`` or ``scale_out`` for each dimension (and ``ep``, ``dp``) of the layout."""
    return {dim: p.tier for dim, p in placements(layout, gpus_per_node).items()}


class Links:
    """Collective times for one layout on one system: ``links.seconds("tp", "all_gather", bytes)``."""

    def __init__(self, layout: Layout, system: System, profile: Profile):
        self.layout, self.system, self.profile = layout, system, profile
        self.placement = placements(layout, system.gpus_per_node)

    @property
    def tier_of(self) -> dict[str, str]:
        return {dim: p.tier for dim, p in self.placement.items()}

    def size(self, dim: str) -> int:
        if dim == "dp":
            return self.layout.grad_ranks
        if dim == "dp_shard":
            return self.layout.shard_ranks
        if dim == "dp_expert":
            return self.layout.expert_grad_ranks
        if dim == "dp_expert_shard":
            return self.layout.expert_shard_ranks
        return getattr(self.layout, dim)

    def seconds(self, dim: str, op: str, size_bytes: float, n: int | None = None, calls: float = 1) -> float:
        """``size_bytes`` moved by ``op`` over ``dim``'s group (or ``n`` of its ranks), split into
        ``calls`` collectives."""
        n = self.size(dim) if n is None else n
        if n <= 1 or size_bytes <= 0:
            return 0.0
        return self._tier_seconds(dim, op, size_bytes, n, calls) / self.dim_factor(dim)

    def expert_dispatch_seconds(self, token_bytes: float, top_k: int, experts: int, groups: int = 1,
                                group_topk: int = 1, two_level: bool = False) -> float:
        """One dispatch (or combine) of the expert-parallel group: ``token_bytes`` is the rank's
        tokens once; each goes to ``top_k`` experts.  NCCL's all-to-all sends every copy; the
        two-level dispatch (module docstring) sends one a distinct remote node over the NIC and
        forwards the copies over NVLink.  Inside one node the two are the same."""
        n, place = self.size("ep"), self.placement["ep"]
        if not two_level or place.tier == "scale_up" or n <= 1:
            return self.seconds("ep", "all_to_all", token_bytes * top_k)
        g = min(place.per_node, n)
        nodes = math.ceil(n / g)
        d = distinct_nodes(experts, top_k, nodes, groups, group_topk)
        # a copy a distinct remote node over the NIC; every copy but the receiving GPU's over NVLink
        seconds = self._split_seconds(token_bytes * d * (nodes - 1) / nodes, token_bytes * top_k * (g - 1) / g)
        return (self._all_to_all_latency(n) + seconds) / self.dim_factor("ep")

    def _split_seconds(self, remote_bytes: float, local_bytes: float) -> float:
        """Bytes bound for other nodes over one NIC while the node's own go over NVLink, at once:
        the slower of the two."""
        s, prof = self.system, self.profile
        return max(remote_bytes / (s.scale_out.bandwidth_Bps * prof.scale_out),
                   local_bytes / (s.scale_up.bandwidth_Bps * prof.scale_up))

    def _all_to_all_latency(self, n: int) -> float:
        return math.ceil(math.log2(n)) * self.system.scale_out.latency_s * self.profile.latency_scale

    def dim_factor(self, dim: str) -> float:
        """The profile's own factor for ``dim``'s collectives (``Profile.link_*``); the data
        dimensions share ``link_dp``."""
        key = "dp" if dim.startswith("dp") else dim
        return getattr(self.profile, f"link_{key}", 1.0)

    def _tier_seconds(self, dim: str, op: str, size_bytes: float, n: int, calls: float) -> float:
        s, prof, place = self.system, self.profile, self.placement[dim]
        if place.tier == "scale_up":
            one = collective_seconds(op, size_bytes / calls, n, s.scale_up, prof.scale_up, prof.latency_scale)
            return calls * one
        up, out = s.scale_up, s.scale_out
        g = min(place.per_node, n)
        nodes = math.ceil(n / g)
        if op == "all_to_all":
            return calls * self._all_to_all_latency(n) + self._split_seconds(size_bytes * (n - g) / n,
                                                                             size_bytes * (g - 1) / n)
        if op in RINGS:
            bandwidth = min(g * out.bandwidth_Bps * prof.scale_out, up.bandwidth_Bps * prof.scale_up)
        else:
            bandwidth = out.bandwidth_Bps * prof.scale_out
        if op in ("all_gather", "reduce_scatter"):
            latency = (n - nodes) * up.latency_s + (nodes - 1) * out.latency_s
        elif op == "all_reduce":
            latency = 2 * ((g - 1) * up.latency_s + math.ceil(math.log2(nodes)) * out.latency_s)
        else:  # send_recv
            latency = out.latency_s
        return calls * latency * prof.latency_scale + size_bytes * bus_factor(op, n) / bandwidth
