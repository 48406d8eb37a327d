"""One analysis's shared inputs: what several analyses read, made once per ``analyze``.

The report's analyses and the dashboard's views start from the same things:
the events as pandas columns, every step's plan (the breakdown's interval
sets: name rules over every distinct kernel and a union per leaf, the costliest
part of an analysis), the leaves, the executed pipeline schedule.  Made by each
analysis for itself, the plans were built three times per ``mfuscope analyze``
(breakdown, communication exposure, timeline views) and the events converted
to pandas some fifteen times.  A :class:`Context` makes each on first use and
keeps it for the one analysis it belongs to: the caller holds it, no module
does, so nothing carries over from one run to the next.

The analyses stay plain functions of documented inputs: they are handed
``context.events`` (an EventTable whose pandas columns are converted once and
shared) and, where they split steps, ``context.plans``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from mfuscope import run_dir
from mfuscope.event_table import EventTable
from mfuscope.manifest import Manifest

from . import breakdown, timeline


@dataclass
class SharedColumns(EventTable):
    """An EventTable whose columns are converted to pandas once: every ``to_pandas`` after the
    first that asks for a column reuses it.  The frames handed out are copy-on-write views
    (pandas 3), so an analysis that changes its frame never changes another's."""

    _columns: dict[str, pd.Series] = field(default_factory=dict, init=False, repr=False, compare=False)

    def to_pandas(self, columns: list[str] | None = None) -> pd.DataFrame:
        names = list(columns or self.table.column_names)
        missing = [c for c in names if c not in self._columns]
        if missing:
            self._columns.update(super().to_pandas(missing).items())
        # All columns share one index: given, the frame skips aligning each column to the others'.
        index = self._columns[names[0]].index if names else None
        return pd.DataFrame({c: self._columns[c] for c in names}, index=index, copy=False)


@dataclass(frozen=True, eq=False)
class Context:
    """The events of one analysis and what is derived from them, each made on first use.

    ``events``: the loaded traces (as :class:`SharedColumns`); ``manifest``: the run's, None for a
    bare trace set."""

    events: SharedColumns
    manifest: dict[str, Any] | None = None

    @classmethod
    def of(cls, events: EventTable, run: str | Path | None = None) -> Context:
        """The context of ``events``, with the manifest of ``run`` (a run directory) if given."""
        return cls(SharedColumns(events.table, events.ranks), run_dir.read_manifest(run) if run is not None else None)

    @classmethod
    def of_events(cls, events: EventTable, manifest: dict[str, Any] | None = None) -> Context:
        """The context of ``events`` with a manifest already read (a worker gets it from the parent)."""
        return cls(SharedColumns(events.table, events.ranks), manifest)

    @property
    def stage_of(self) -> dict[int, int]:
        """Rank -> pipeline stage, from the manifest's rank coordinates (empty without them)."""
        return Manifest.of(self.manifest).stages

    @cached_property
    def plans(self) -> tuple[breakdown.StepPlan, ...]:
        """:func:`breakdown.step_plans`: read by the leaves, the communication exposure and the views."""
        return tuple(breakdown.step_plans(self.events))

    @cached_property
    def leaves(self) -> pd.DataFrame:
        """:func:`breakdown.step_leaves`: rank, step, leaf, seconds."""
        return breakdown.step_leaves(self.events, self.plans)

    @cached_property
    def microbatches(self) -> pd.DataFrame:
        """:func:`timeline.microbatches` on the manifest's stages: read by the bubbles and the views."""
        return timeline.microbatches(self.events, self.stage_of)
