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

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mfuscope.report import write_report

from . import map_reduce, rank_lists, rank_summary, timeline, trace_set
from .trace_set import LoadResult

TIMELINE = rank_summary.TIMELINE
MICROBATCHES = map_reduce.MICROBATCHES

Progress = Callable[[float, str], None]


def analyze(path: str | Path, report_path: str | Path, views_dir: str | Path | None, *,
            on_progress: Progress | None = None, nccl_tests: list | None = None,
            finish: Callable[[dict[str, Any]], None] | None = None,
            **load_options: Any) -> tuple[dict[str, Any], LoadResult]:
    """Analyze ``path``, write its report (and views), return (report, what was loaded: files,
    skipped files, ranks from the cache; no events).  ``nccl_tests``: tables of
    :func:`.nccl_tests.read_all` the communication rows are compared with; ``finish``: what a layer
    above adds to the report before it is written (the cost model's predicted memory:
    ``mfuscope.optimizers.predicted_memory.analyze``); ``load_options``: as
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
        if finish is not None:
            finish(report)
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
    """(timeline segments, microbatches) of every rank and step; empty frames where a view is missing.
    A viewer of a large run reads what it draws instead (:func:`read_segments`, :func:`read_microbatches`)."""
    return read_segments(views_dir), read_microbatches(views_dir)


def view_ranks(views_dir: str | Path) -> list[int]:
    """The ranks the timeline view has, from its part files' names (no file opened)."""
    path = Path(views_dir) / TIMELINE
    if path.is_dir():
        return sorted(int(m.group(1)) for f in path.iterdir() if (m := _PART.fullmatch(f.name)))
    if path.is_file():  # one file (an older analysis)
        return sorted(int(r) for r in pq.read_table(path, columns=["rank"]).column("rank").unique().to_pylist())
    return []


def view_steps(views_dir: str | Path, sample: int = 8) -> list[int]:
    """The steps of the timeline view, read from the first ``sample`` ranks' parts (ranks of one job
    trace the same steps; reading 1,024 parts for it would take seconds)."""
    files = _parts(Path(views_dir) / TIMELINE, view_ranks(views_dir)[:sample])
    steps: set[int] = set()
    for f in files:
        steps.update(int(s) for s in pq.read_table(f, columns=["step"]).column("step").unique().to_pylist())
    return sorted(steps)


def read_segments(views_dir: str | Path, step: int | None = None, ranks=None) -> pd.DataFrame:
    """Timeline segments of ``step`` (all when None) of ``ranks`` (all when None): only those
    ranks' part files are opened, and within them only the row groups whose step statistics can
    hold ``step``."""
    path = Path(views_dir) / TIMELINE
    files = _parts(path, ranks)
    if not files:
        return pd.DataFrame(columns=timeline.SEGMENT_COLUMNS)
    filters = [("step", "=", int(step))] if step is not None else None
    if ranks is not None and path.is_file():
        filters = (filters or []) + [("rank", "in", [int(r) for r in ranks])]
    tables = [pq.read_table(f, filters=filters) for f in files]
    return pa.concat_tables(tables).to_pandas() if len(tables) > 1 else tables[0].to_pandas()


def read_microbatches(views_dir: str | Path, step: int | None = None, columns: list[str] | None = None
                      ) -> pd.DataFrame:
    """The executed pipeline schedule (``microbatches.parquet``), of ``step`` when given."""
    path = Path(views_dir) / MICROBATCHES
    if not path.exists():
        return pd.DataFrame(columns=columns or timeline.MICROBATCH_COLUMNS)
    return pq.read_table(path, columns=columns,
                         filters=[("step", "=", int(step))] if step is not None else None).to_pandas()


_PART = re.compile(r"rank(\d+)\.parquet")


def _parts(path: Path, ranks) -> list[Path]:
    """The files holding ``ranks`` (all when None) of a view that is a folder of per-rank parts,
    or the view's one file."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    if ranks is None:
        return sorted(f for f in path.iterdir() if _PART.fullmatch(f.name))
    wanted = (path / f"rank{int(r):05d}.parquet" for r in sorted(set(int(r) for r in ranks)))
    return [f for f in wanted if f.is_file()]
