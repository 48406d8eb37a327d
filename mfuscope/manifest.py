"""A run manifest, typed: the accessors every reader needs, instead of nested ``.get`` chains.

``manifest.json`` (:mod:`mfuscope.run_dir` reads, validates and writes it) is a JSON document whose
sections are optional: a foreign job profiled with ``mfuscope profile`` has no model spec, no
schedule and no trainer section; an old run may lack newer keys.  :class:`Manifest` answers each
question once, with the defaults the readers agreed on, so that "does this run have a model spec"
or "which pipeline stage is rank 5" has one answer everywhere.  Torch-free.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfuscope.layout import Degrees


@dataclass(frozen=True)
class Manifest:
    """One run's manifest.  ``raw`` is the document as read (never changed)."""

    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest | Mapping[str, Any] | None) -> Manifest:
        """A :class:`Manifest` from a document, a Manifest, or None (an empty one)."""
        return manifest if isinstance(manifest, Manifest) else cls(manifest or {})

    @classmethod
    def read(cls, run_dir: str | Path) -> Manifest:
        """``run_dir/manifest.json``, validated (:func:`mfuscope.run_dir.read_manifest`)."""
        from mfuscope.run_dir import read_manifest

        return cls(read_manifest(run_dir))

    def _section(self, name: str) -> dict[str, Any]:
        return dict(self.raw.get(name) or {})

    # ------------------------------------------------------------------ the run
    @property
    def world_size(self) -> int:
        return int(self.raw.get("world_size") or 1)

    @property
    def status(self) -> str:
        return str(self.raw.get("status") or "?")

    @property
    def ended_reason(self) -> str | None:
        return self.raw.get("ended_reason")

    @property
    def start_time(self) -> str:
        return str(self.raw.get("start_time") or "")

    # ------------------------------------------------------------------ what was trained, and how
    @property
    def model(self) -> dict[str, Any] | None:
        """The model spec (FLOPs formulas and the cost model read it), or None."""
        return dict(self.raw["model"]) if self.raw.get("model") else None

    @property
    def train(self) -> dict[str, Any]:
        """The resolved train settings (sequence length, global batch, dtype, ...); {} if none."""
        return self._section("train")

    @property
    def kernels(self) -> dict[str, Any]:
        """Which kernels the run's operations dispatch to, where the trainer recorded it
        (``attention``: the SDPA backend PyTorch picks); {} otherwise."""
        return self._section("kernels")

    @property
    def trainer(self) -> dict[str, Any]:
        """How the reference trainer was launched (:meth:`TrainerOptions.to_manifest
        <mfuscope.trainer_options.TrainerOptions.to_manifest>`); {} for any other job."""
        return self._section("trainer")

    @property
    def is_reference_trainer_run(self) -> bool:
        """The manifest says how the run was launched, so it can be run again."""
        return bool(self.raw.get("trainer"))

    @property
    def has_model_spec(self) -> bool:
        """A model spec and a sequence length: what the cost model and MFU from the spec need."""
        return bool(self.model and self.train.get("seq_len"))

    @property
    def hardware(self) -> dict[str, Any]:
        return self._section("hardware")

    @property
    def device_name(self) -> str | None:
        return self.hardware.get("device_name")

    # ------------------------------------------------------------------ the layout
    @property
    def layout(self) -> dict[str, int]:
        """The mesh's sizes as recorded ({dimension: size}; a user's own DeviceMesh may name its
        dimensions otherwise)."""
        return {k: int(v) for k, v in self._section("layout").items() if v is not None}

    @property
    def degrees(self) -> Degrees:
        """The layout in mfuscope's dimensions (others left out)."""
        return Degrees.from_sizes(self.layout)

    @property
    def pp(self) -> int:
        return int(self.layout.get("pp") or 1)

    @property
    def schedule(self) -> dict[str, Any]:
        """The pipeline schedule ({name, microbatches, virtual_stages}); {} without pipeline."""
        return self._section("schedule")

    @property
    def schedule_name(self) -> str | None:
        return self.schedule.get("name")

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches a step (the schedule's, else the train settings', else 1)."""
        return int(self.schedule.get("microbatches") or self.train.get("microbatches") or 1)

    @property
    def rank_coords(self) -> dict[int, dict[str, int]]:
        """rank -> its mesh coordinates ({} where the collectors had no mesh)."""
        return {int(r): dict(c) for r, c in (self.raw.get("rank_coords") or {}).items()}

    def stage_of(self, rank: int) -> int:
        """The pipeline stage (pp coordinate) of ``rank``; 0 where the manifest does not say."""
        return int(self.rank_coords.get(int(rank), {}).get("pp", 0))

    @property
    def stages(self) -> dict[int, int]:
        """rank -> pipeline stage, for every rank the manifest places."""
        return {r: int(c.get("pp", 0)) for r, c in self.rank_coords.items()}
