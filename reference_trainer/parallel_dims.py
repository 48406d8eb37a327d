"""The 5D layout of a training job and its DeviceMesh.

The layout's vocabulary (dimensions, order, text form, the data-parallel degrees) is
:mod:`mfuscope.layout`'s; this module adds what a running job needs on top: the DeviceMesh, built
once the process group exists, with the flattened data-parallel dimensions FSDP reduces over.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mfuscope.layout import MESH_DIMS, Degrees


@dataclass(frozen=True)
class ParallelDims(Degrees):
    """:class:`~mfuscope.layout.Degrees` with the job's DeviceMesh.  Build it with
    ``ParallelDims.parse(text, world_size)``."""

    @cached_property
    def mesh(self):
        """The DeviceMesh (built on first use, after the process group exists)."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, tuple(getattr(self, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        # Gradients are reduced over every rank that saw different tokens: dp_shard and cp together.
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh
