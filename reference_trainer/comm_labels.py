"""Labels for communication regions, so traces say which parallel dimension talked.

Every collective runs under ``record_function("mfuscope.comm/<dim>/<op>")``:
the trainer's own (context and expert parallel) through :func:`comm`, and
those PyTorch issues on the trainer's behalf (FSDP2, DDP's comm hook, DTensor,
pipelining) through :func:`labelled_collectives`, which wraps the c10d and
functional-collective entry points while training runs.  The dimension comes
from the process group: :func:`group_map` names every group of the mesh, and
it is exported into the run manifest for the collectors and analyzers.
"""
from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable

import torch.distributed as dist
from torch.profiler import record_function


@contextmanager
def comm(dim: str, op: str):
    with record_function(f"mfuscope.comm/{dim}/{op}"):
        yield


def group_map(mesh, extra: dict | None = None) -> list[dict]:
    """[{name, dim, ranks}] for every mesh dimension, the flattened ones, and ``extra`` groups."""
    groups = {d: mesh.get_group(d) for d in mesh.mesh_dim_names}
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    for flat in ("dp_shard_cp", "dp_cp"):
        try:
            groups[flat] = root[flat].get_group()
        except (KeyError, RuntimeError, ValueError):
            pass
    groups.update(extra or {})
    return [{"name": str(g.group_name), "dim": dim, "ranks": dist.get_process_group_ranks(g)}
            for dim, g in groups.items() if g is not None]


# (module, function name, op) -- whatever of these this torch version has.
_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
         "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
         "send", "recv", "batch_isend_irecv")
_FUNCOL = ("all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single",
           "all_gather_single_autograd", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
           "reduce_scatter_single", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
           "permute_tensor")
_OPS = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
        "all_to_all": "all_to_all", "broadcast": "broadcast", "permute": "send_recv", "send": "send",
        "recv": "recv", "batch_isend_irecv": "send_recv"}


def _op(fn_name: str) -> str:
    return next((op for prefix, op in _OPS.items() if fn_name.startswith(prefix)), fn_name)


def _group_name(group: Any) -> str | None:
    if group is None:
        return str(dist.group.WORLD.group_name) if dist.is_initialized() else None
    if isinstance(group, str):
        return group
    if isinstance(group, tuple) and len(group) == 2:  # (DeviceMesh, mesh dim)
        return str(group[0].get_group(group[1]).group_name)
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh
        return str(group.get_group().group_name)
    return str(getattr(group, "group_name", "")) or None


def _wrap(fn: Callable, op: str, dims: dict[str, str]) -> Callable:
    params = list(inspect.signature(fn).parameters)
    index = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def labelled(*args, **kwargs):
        if fn.__name__ == "batch_isend_irecv":
            group = args[0][0].group if args and args[0] else None
        else:
            group = kwargs.get("group", args[index] if index is not None and index < len(args) else None)
        dim = dims.get(_group_name(group) or "", "unknown")
        with record_function(f"mfuscope.comm/{dim}/{op}"):
            return fn(*args, **kwargs)

    labelled.__wrapped_collective__ = fn
    return labelled


@contextmanager
def labelled_collectives(groups: list[dict]):
    """While active, every c10d / functional collective call runs under its dimension's label."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.pipelining import schedules

    dims = {g["name"]: g["dim"] for g in groups}
    dims.setdefault(str(dist.group.WORLD.group_name), "world")
    patched = []
    for module, names in ((dist, _C10D), (funcol, _FUNCOL)):
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None and not hasattr(fn, "__wrapped_collective__"):
                patched.append((module, name, fn))
                setattr(module, name, _wrap(fn, _op(name), dims))
    # Pipelining sends isend/irecv through this helper (isend itself cannot be wrapped:
    # P2POp checks its op is the original function).
    batch = getattr(schedules, "_batch_p2p", None)
    if batch is not None and not hasattr(batch, "__wrapped_collective__"):
        def batch_p2p(p2p_ops, *args, **kwargs):
            if not p2p_ops:  # nothing to send or receive at this point of the schedule
                return batch(p2p_ops, *args, **kwargs)
            dim = dims.get(_group_name(p2p_ops[0].group) or "", "unknown")
            with record_function(f"mfuscope.comm/{dim}/send_recv"):
                return batch(p2p_ops, *args, **kwargs)
        batch_p2p.__wrapped_collective__ = batch
        patched.append((schedules, "_batch_p2p", batch))
        schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        for module, name, fn in reversed(patched):
            setattr(module, name, fn)
