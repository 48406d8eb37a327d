"""Which parallel dimension a process group belongs to.

Three sources, best first:

1. the mesh map the user gave (a DeviceMesh or the trainer's ParallelDims):
   every mesh dimension's group, and the flattened ones, by name;
2. the group's own description: DeviceMesh creates its groups as ``mesh_<dim>``
   (the same text Kineto writes as ``distributedInfo`` / ``pg_desc``);
3. the structure of the group's ranks: the whole world is ``world``; a
   contiguous block of ranks is the innermost dimension (``inner``); a strided
   set is an outer one (``outer``).  That is how every 5D layout orders its
   mesh (tensor parallel innermost), but the name cannot be known for sure, so
   the label says only what the structure shows.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def mesh_groups(mesh: Any, extra: dict | None = None) -> list[dict]:
    """[{name, dim, ranks}] for every dimension of ``mesh`` (or ``ParallelDims``), its flattened
    dimensions, and ``extra`` {dim: ProcessGroup} groups.

    One process group may serve several of them: DeviceMesh hands a dimension that spans the whole
    world the default group, and a flattened dimension over the same ranks gets it too.  A later
    entry for the same group names it (``GroupDims`` keeps the last), so a flattened mesh dimension
    names the group of the dimension it covers (FSDP's ``dp_shard_cp`` over cp's ranks on cp=2
    alone: its traffic is data-parallel), but an ``extra`` group never renames a mesh's: the MoE
    balance loss's counts over every data rank ride on FSDP's own group when the data ranks are
    the world, and FSDP's gathers must stay ``dp_shard``'s, not become the balance loss's."""
    mesh = getattr(mesh, "mesh", mesh)  # ParallelDims holds its DeviceMesh
    groups = {d: mesh.get_group(d) for d in (mesh.mesh_dim_names or ())}
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    for flat in ("dp_shard_cp", "dp_cp"):
        try:
            groups[flat] = root[flat].get_group()
        except (KeyError, RuntimeError, ValueError):
            pass
    named = {str(g.group_name) for g in groups.values() if g is not None}
    groups.update({dim: g for dim, g in (extra or {}).items() if g is not None and str(g.group_name) not in named})
    return [{"name": str(g.group_name), "dim": dim, "ranks": dist.get_process_group_ranks(g)}
            for dim, g in groups.items() if g is not None]


def dim_from_description(desc: str | None) -> str | None:
    if desc and desc.startswith("mesh_"):
        return desc[len("mesh_"):]
    return None


def dim_from_ranks(ranks: list[int], world: int) -> str:
    if len(ranks) == world:
        return "world"
    if len(ranks) <= 1:
        return "self"
    ordered = sorted(ranks)
    stride = ordered[1] - ordered[0]
    return "inner" if stride == 1 else "outer"


class GroupDims:
    """Resolves a process group to (name, dim, ranks), caching per group."""

    def __init__(self, known: list[dict] | None = None):
        self._by_name: dict[str, dict] = {g["name"]: dict(g) for g in known or ()}
        self._cache: dict[int, dict] = {}

    def add(self, groups: list[dict]) -> None:
        for g in groups:
            self._by_name[g["name"]] = dict(g)
        self._cache.clear()

    def resolve(self, group: Any) -> dict:
        key = _cache_key(group)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        pg = _process_group(group)
        name = str(pg.group_name)
        info = self._by_name.get(name)
        if info is None or info.get("dim") is None:
            ranks = dist.get_process_group_ranks(pg)
            dim = dim_from_description(getattr(pg, "group_desc", None)) or dim_from_ranks(ranks, dist.get_world_size())
            info = {"name": name, "dim": dim, "ranks": ranks}
            self._by_name[name] = info
        self._cache[key] = info
        return info

    def seen(self) -> list[dict]:
        return list(self._by_name.values())


def _cache_key(group: Any) -> Any:
    # Names and None are values; groups and meshes live as long as training does.
    if group is None or isinstance(group, str):
        return group
    if isinstance(group, tuple):
        return (id(group[0]), group[1])
    if isinstance(group, list):
        return tuple(group)
    return id(group)


def _process_group(group: Any):
    """The ProcessGroup behind the forms collectives accept: None (world), a group, a group name,
    a 1-D DeviceMesh, or (DeviceMesh, dim)."""
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(group)
    if isinstance(group, tuple) and len(group) == 2:
        return group[0].get_group(group[1])
    if hasattr(group, "get_group"):
        return group.get_group()
    if isinstance(group, list):  # funcol also takes a rank list; such groups are created on the fly
        return dist.group.WORLD
    return group
