"""Analyze a run or a trace set once: ``report.json`` plus the views a viewer draws from.

The analysis is a map over ranks and a reduce (:mod:`.map_reduce`): each rank is summarized
in a worker, which also writes the rank's parts of the views -- ``views/timeline.parquet/``
(every step as time-ordered breakdown segments) and ``views/comm_calls.parquet/`` (one row a
communication call), one ``rankNNNNN.parquet`` file a rank, read as one dataset -- and the
parent adds ``views/microbatches.parquet`` (the executed pipeline schedule).  The views exist
so the dashboard never parses a trace per request.  A run directory keeps them inside itself.

The views are written to a staging folder beside the final one and swapped in whole once the
report is ready: an analysis that fails midway leaves the previous views and report as they
were, never half of each.  A trace set of more than :data:`.rank_lists.LIMIT` ranks gets a views
folder beside its report (``<report>.views``), for the whole per-rank lists the report cuts.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from mfuscope.report import write_report

from . import map_reduce, rank_lists, rank_summary, timeline, trace_set
from .trace_set import LoadResult

TIMELINE = rank_summary.TIMELINE
MICROBATCHES = map_reduce.MICROBATCHES

Progress = Callable[[float, str], None]


def analyze(path: str | Path, report_path: str | Path, views_dir: str | Path | None, *,
            on_progress: Progress | None = None, nccl_tests: list | None = None,
            **load_options: Any) -> tuple[dict[str, Any], LoadResult]:
    """Analyze ``path``, write its report (and views), return (report, what was loaded: files,
    skipped files, ranks from the cache; no events).  ``nccl_tests``: tables of
    :func:`.nccl_tests.read_all` the communication rows are compared with; ``load_options``: as
    :func:`.map_reduce.analyze_ranks`."""
    say = on_progress or (lambda fraction, message: None)
    say(0.0, "analyzing ranks")
    found = trace_set.rank_files(path, load_options.get("rank"), load_options.get("skip_bad", False))
    if views_dir is None and len(found[0]) > rank_lists.LIMIT:
        views_dir = Path(report_path).with_suffix(".views")  # the per-rank lists' whole versions go there
    staging = _staging(views_dir)
    try:
        report, files, skipped, cached = map_reduce.analyze_ranks(
            path, views_dir=staging, nccl_tests=nccl_tests, files=found,
            on_file=lambda done, total: say(0.9 * done / total, f"analyzing ranks: {done}/{total} files"),
            **load_options)
        if staging is not None:
            _swap(staging, Path(views_dir))
        write_report(report_path, report)  # last: a report on disk means the views are there too
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    say(1.0, "done")
    return report, LoadResult(None, files, skipped, cached)


def _staging(views_dir: str | Path | None) -> Path | None:
    if views_dir is None:
        return None
    staging = Path(views_dir).with_name(Path(views_dir).name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # a previous analysis that was killed
    staging.mkdir(parents=True)
    return staging


def _swap(staging: Path, views_dir: Path) -> None:
    """Replace ``views_dir`` by ``staging`` (the old views removed only once the new are whole)."""
    old = views_dir.with_name(views_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if views_dir.exists():
        views_dir.rename(old)
    staging.rename(views_dir)
    shutil.rmtree(old, ignore_errors=True)


def read_views(views_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(timeline segments, microbatches); empty frames where a view is missing."""
    views_dir = Path(views_dir)

    def read(name: str, columns: list[str]) -> pd.DataFrame:
        p = views_dir / name
        return pd.read_parquet(p) if p.exists() else pd.DataFrame(columns=columns)

    return read(TIMELINE, timeline.SEGMENT_COLUMNS), read(MICROBATCHES, timeline.MICROBATCH_COLUMNS)
