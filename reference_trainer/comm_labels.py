"""Labels for communication regions, so traces say which parallel dimension talked.

Every collective the trainer issues itself runs under
``record_function("mfuscope.comm/<dim>/<op>")``; the loader reads the dimension
and op from that name.  Collectives issued inside PyTorch (FSDP, DTensor,
pipelining) are attributed through the process-group -> dimension map that
:func:`group_map` exports into the run manifest.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist
from torch.profiler import record_function


@contextmanager
def comm(dim: str, op: str):
    with record_function(f"mfuscope.comm/{dim}/{op}"):
        yield


def group_map(mesh, extra: dict | None = None) -> list[dict]:
    """[{name, dim, ranks}] for every mesh dimension (and extra named groups)."""
    out = []
    groups = {d: mesh.get_group(d) for d in mesh.mesh_dim_names}
    groups.update(extra or {})
    for dim, group in groups.items():
        if group is None:
            continue
        out.append({"name": str(group.group_name), "dim": dim, "ranks": dist.get_process_group_ranks(group)})
    return out
