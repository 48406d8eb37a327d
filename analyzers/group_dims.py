"""Which parallel dimension each process group of a loaded trace set is, after loading.

The loader names a call's dimension from what its own event says (:func:`.collectives.group_dim`:
DeviceMesh's ``mesh_<dim>``, Megatron-Core's group descriptions).  Here, once every rank is
loaded, the calls that are still without one get it from

1. the rank's ``distributedInfo.pg_config`` (full rank lists and descriptions of every group the
   rank belongs to), by the call's process-group name: its description's dimension, and its full
   rank list where the call's own list was cut (Kineto keeps 30 ranks of a group) or missing;
2. the layout the user states (``mfuscope analyze --layout tp=8,pp=4 --rank-order tp-cp-ep-dp-pp``)
   for groups nothing names (DeepSpeed's, a plain ``new_group``): ranks are numbered with the first
   dimension of the order varying fastest, as Megatron-Core numbers them, so a group whose ranks
   vary along exactly one dimension (or a known product of dimensions) is that dimension's group.

A dimension the trace states is never overridden by the layout.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from mfuscope.errors import UserInputError
from mfuscope.event_table import EventTable

#: Megatron-Core's default rank order (``initialize_model_parallel(order=...)``): tensor parallel
#: ranks adjacent, then context, expert, data, pipeline.  torchtitan's DeviceMesh
#: (pp, dp_replicate, dp_shard, cp, tp, outermost first) numbers its dense ranks the same way.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
#: The dimensions ``--rank-order`` names (Megatron-Core's tokens).
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
#: What ``--layout`` accepts: the order's dimensions; ``etp``, the expert layers' tensor-parallel
#: size (Megatron-Core's ``expert_tensor_parallel_size``, by default ``tp``); and, instead of ``dp``,
#: its two parts as mfuscope's layouts name them (``dp_shard`` varies faster than ``dp_replicate``).
LAYOUT_NAMES = ("tp", "cp", "ep", "dp", "pp", "etp", "dp_replicate", "dp_shard")
#: Products of dimensions with a name of their own (mfuscope's flattened mesh dimensions).
_COMBINED = {
    frozenset({"dp", "cp"}): "dp_cp",
    frozenset({"dp_shard", "cp"}): "dp_shard_cp",
    frozenset({"dp_replicate", "dp_shard"}): "dp",
    frozenset({"dp_replicate", "dp_shard", "cp"}): "dp_cp",
}


@dataclass(frozen=True)
class RankLayout:
    """Degrees of parallelism and the order in which they number the ranks (fastest first).

    ``sizes`` holds what ``--layout`` gave; ``dp`` may be left out and is then what the world size
    leaves (:meth:`resolve`)."""

    sizes: tuple[tuple[str, int], ...]
    order: tuple[str, ...]

    @classmethod
    def parse(cls, layout: str | None, rank_order: str | None = None) -> RankLayout | None:
        """``--layout`` / ``--rank-order`` as typed; None when neither is given.  Errors name the flag."""
        if layout is None and rank_order is None:
            return None
        if layout is None or not layout.strip():
            raise UserInputError("--rank-order needs --layout (the degrees it orders), e.g. --layout tp=8,pp=4")
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in layout.split(","))):
            key, eq, val = (x.strip() for x in part.partition("="))
            if not eq or key not in LAYOUT_NAMES or not val.isdigit():
                raise UserInputError(f"--layout: cannot read {part!r}; write NAME=SIZE,... e.g. tp=8,pp=4,dp=2 "
                                     f"(names: {', '.join(LAYOUT_NAMES)})")
            if key in sizes:
                raise UserInputError(f"--layout: {key} is given twice")
            if int(val) < 1:
                raise UserInputError(f"--layout: {key}={val} must be at least 1")
            sizes[key] = int(val)
        if not sizes:
            raise UserInputError("--layout: no dimension given; write NAME=SIZE,... e.g. tp=8,pp=4,dp=2")
        if "dp" in sizes and ({"dp_replicate", "dp_shard"} & sizes.keys()):
            raise UserInputError("--layout: give dp, or its parts dp_replicate and dp_shard, not both")
        order = cls._parse_order(DEFAULT_ORDER if rank_order is None else rank_order, sizes)
        return cls(tuple((d, sizes[d]) for d in LAYOUT_NAMES if d in sizes), order)

    @staticmethod
    def _parse_order(text: str, sizes: dict[str, int]) -> tuple[str, ...]:
        tokens = [t.strip() for t in text.strip().split("-")]
        bad = [t for t in tokens if t not in ORDER_TOKENS]
        if bad or not text.strip():
            raise UserInputError(f"--rank-order: cannot read {text!r}; name the dimensions fastest first, "
                                 f"joined by '-', e.g. {DEFAULT_ORDER} (dimensions: {', '.join(ORDER_TOKENS)})")
        twice = sorted({t for t in tokens if tokens.count(t) > 1})
        if twice:
            raise UserInputError(f"--rank-order: {', '.join(twice)} appears twice in {text!r}")
        split_dp = sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)
        for t in ORDER_TOKENS:
            size = split_dp if t == "dp" and "dp" not in sizes else sizes.get(t, 1)
            if t not in tokens and (size > 1 or (t == "dp" and not {"dp", "dp_replicate", "dp_shard"} & sizes.keys())):
                raise UserInputError(f"--rank-order: {text!r} leaves out {t}"
                                     + (f" ({t}={size} in --layout)" if size > 1 else
                                        " (the data-parallel ranks, whatever --layout leaves)"))
        return tuple(tokens)

    def text(self) -> str:
        """The ``--layout`` text that parses back to this layout."""
        return ",".join(f"{d}={n}" for d, n in self.sizes)

    def order_text(self) -> str:
        return "-".join(self.order)

    def resolve(self, world: int | None) -> ResolvedLayout:
        """Fill ``dp`` from the world size where it was left out; check the degrees fill the world."""
        s = dict(self.sizes)
        dense = s.get("tp", 1) * s.get("cp", 1) * s.get("pp", 1)
        given_dp = s.get("dp", s.get("dp_replicate", 1) * s.get("dp_shard", 1))
        if not {"dp", "dp_replicate", "dp_shard"} & s.keys():
            if world is None:
                given_dp = 1
            elif world % dense:
                raise UserInputError(f"--layout {self.text()}: tp*cp*pp = {dense} does not divide the traces' "
                                     f"world size {world}")
            else:
                given_dp = world // dense
            s["dp"] = given_dp
        total = dense * given_dp
        if world is not None and total != world:
            raise UserInputError(f"--layout {self.text()}: the degrees use {total} ranks, the traces' world size "
                                 f"is {world}")
        ep, etp = s.get("ep", 1), s.get("etp", s.get("tp", 1))
        if total % (etp * ep * s.get("pp", 1)):
            raise UserInputError(f"--layout {self.text()}: etp*ep*pp = {etp * ep * s.get('pp', 1)} does not divide "
                                 f"the {total} ranks (expert layers: ep borrows data and context ranks)")
        return ResolvedLayout(s, self.order, total)


@dataclass(frozen=True)
class ResolvedLayout:
    """A layout over a known number of ranks: its dense grid (every rank's coordinates in tp, cp, dp,
    pp) and, with ``ep`` > 1, the expert layers' grid (etp, ep, their data parallel, pp: context
    parallelism folds into the expert layers' data ranks, as Megatron-Core lays them out)."""

    sizes: dict[str, int]
    order: tuple[str, ...]
    world: int

    def _grids(self) -> list[list[tuple[str, int]]]:
        s = self.sizes
        dense: list[tuple[str, int]] = []
        for t in self.order:
            if t == "ep":
                continue
            if t == "dp" and "dp" not in s:
                dense += [("dp_shard", s.get("dp_shard", 1)), ("dp_replicate", s.get("dp_replicate", 1))]
            else:
                dense.append((t, s.get(t, 1)))
        grids = [dense]
        ep = s.get("ep", 1)
        if ep > 1:
            etp, pp = s.get("etp", s.get("tp", 1)), s.get("pp", 1)
            expert_sizes = {"tp": etp, "ep": ep, "dp": self.world // (etp * ep * pp), "pp": pp}
            names = {"tp": "tp", "ep": "ep", "dp": "dp_expert", "pp": "pp"}
            grids.append([(names[t], expert_sizes[t]) for t in self.order if t != "cp"])
        return grids

    def dim_of(self, ranks: Iterable[int], size: int | None = None, op: str | None = None) -> str | None:
        """The dimension of a group: ``ranks`` are its members, or the first of them (a cut list)
        with ``size`` the group's size.  Among groups of the layout with those ranks, the dense
        layers' first; an all-to-all's group is the expert layers' where both fit (the same ranks can
        be a data-parallel and an expert-parallel group).  None when no group of the layout has them."""
        members = sorted({int(r) for r in ranks})
        n = size or len(members)
        if n <= 1 or not members or len(members) > n or members[-1] >= self.world or members[0] < 0:
            return None
        found = []
        for grid in self._grids():
            name = _along(grid, members, n)
            if name is not None:
                found.append(name)
        if not found:
            return None
        if op == "all_to_all" and "ep" in found:
            return "ep"
        return found[0]


def _along(grid: list[tuple[str, int]], members: list[int], n: int) -> str | None:
    """The name of the grid's group of ``n`` ranks that holds ``members``: the dimensions along which
    its ranks vary.  Every member must share the first's coordinates in the other dimensions.  A cut
    list (``members`` fewer than ``n``) that two groups of the grid could begin is no group (None)."""
    names = [d for d, _ in grid]
    radices = np.array([size for _, size in grid], dtype=np.int64)
    strides = np.concatenate([[1], np.cumprod(radices)[:-1]])
    coords = (np.array(members, dtype=np.int64)[:, None] // strides) % radices
    varying = [i for i in range(len(grid)) if radices[i] > 1]
    fits = []
    for k in range(1, len(varying) + 1):
        for dims in itertools.combinations(varying, k):
            fixed = [i for i in range(len(grid)) if i not in dims]
            if int(np.prod(radices[list(dims)])) == n and not (coords[:, fixed] != coords[0, fixed]).any():
                fits.append(dims)
    if len(fits) != 1:
        return None
    (dims,) = fits
    if len(dims) == len(varying):
        return "world"
    return _COMBINED.get(frozenset(names[i] for i in dims), "_".join(names[i] for i in dims))


# --------------------------------------------------------------------------- assignment


def groups_by_rank(events: EventTable) -> dict[int, dict[str, dict[str, Any]]]:
    """rank -> process-group name -> what the rank's trace says of it: its calls' fields
    (``comm_groups``) over its ``pg_config`` entry, each field from whichever has it."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for rank, meta in events.ranks.items():
        mine: dict[str, dict[str, Any]] = {}
        for g in list(meta.get("pg_config") or []) + list(meta.get("comm_groups") or []):
            name = g.get("name")
            if name is None:
                continue
            have = mine.setdefault(str(name), {})
            for k, v in g.items():
                if v is not None and have.get(k) is None:
                    have[k] = v
        out[int(rank)] = mine
    return out


def group_size_of(groups: dict[int, dict[str, dict[str, Any]]], rank: int, pg: Any) -> int | None:
    """The size of a rank's process group as its trace states it (``Group size``, ``pg_size``, a whole
    rank list), never a cut list's length."""
    g = groups.get(rank, {}).get(str(pg)) if pg is not None else None
    if not g:
        return None
    if g.get("size"):
        return int(g["size"])
    return g["ranks"].count(",") + 1 if g.get("ranks") else None


def assign(events: EventTable, layout: RankLayout | None = None) -> EventTable:
    """``events`` with the dimension (and, where the call's own list was cut or missing, the rank
    list) of every communication row whose group the rank's ``pg_config`` names, or ``layout``
    places; rows that already have a dimension keep it."""
    resolved = layout.resolve(_world(events)) if layout is not None else None  # checked on every set
    table = events.table
    if not len(table) or not events.ranks:
        return events
    pg_col, ranks_col, dim_col = table.column("pg"), table.column("group_ranks"), table.column("dim")
    open_rows = np.flatnonzero((pg_col.is_valid().to_numpy(zero_copy_only=False)
                                | ranks_col.is_valid().to_numpy(zero_copy_only=False))
                               & (dim_col.is_null().to_numpy(zero_copy_only=False)
                                  | ranks_col.is_null().to_numpy(zero_copy_only=False)))
    if not len(open_rows):
        return events
    groups = groups_by_rank(events)
    sub = table.take(pa.array(open_rows)).select(["rank", "pg", "group_ranks", "dim", "op"]).to_pylist()
    dims = dim_col.to_numpy(zero_copy_only=False).astype(object)
    ranks_list = ranks_col.to_numpy(zero_copy_only=False).astype(object)
    cache: dict[tuple, tuple[str | None, str | None]] = {}
    changed = False
    for row, r in zip(open_rows.tolist(), sub):
        key = (r["rank"], r["pg"], r["group_ranks"], r["op"])
        if key not in cache:
            cache[key] = _place(groups.get(r["rank"], {}).get(str(r["pg"])) if r["pg"] is not None else None,
                                r["group_ranks"], r["op"], resolved)
        dim, full = cache[key]
        if r["dim"] is None and dim is not None:
            dims[row] = dim
            changed = True
        if r["group_ranks"] is None and full is not None:
            ranks_list[row] = full
            changed = True
    if not changed:
        return events
    i_dim, i_ranks = table.schema.get_field_index("dim"), table.schema.get_field_index("group_ranks")
    table = table.set_column(i_dim, table.schema.field(i_dim), pa.array(dims, type=table.schema.field(i_dim).type))
    table = table.set_column(i_ranks, table.schema.field(i_ranks),
                             pa.array(ranks_list, type=table.schema.field(i_ranks).type))
    return EventTable(table, events.ranks)


def _place(group: dict[str, Any] | None, listed: str | None, op: str | None,
           layout: ResolvedLayout | None) -> tuple[str | None, str | None]:
    """(dimension, whole rank list) of one call's group."""
    group = group or {}
    full = listed or group.get("ranks")
    dim = group.get("dim")
    if dim is None and layout is not None:
        if full:
            dim = layout.dim_of((int(x) for x in full.split(",")), op=op)
        elif group.get("ranks_head") and group.get("size"):
            dim = layout.dim_of((int(x) for x in group["ranks_head"].split(",")), int(group["size"]), op)
    return dim, full


def _world(events: EventTable) -> int | None:
    worlds = [m.get("world_size") for m in events.ranks.values() if m.get("world_size")]
    return int(max(worlds)) if worlds else None
