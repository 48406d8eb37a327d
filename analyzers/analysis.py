"""Analyze a run or a trace set once: ``report.json`` plus the views a viewer draws from.

The views (``views/timeline.parquet``: every rank's step as time-ordered
breakdown segments; ``views/microbatches.parquet``: the executed pipeline
schedule) exist so the dashboard never parses a trace per request.  A run
directory keeps both inside itself; ``mfuscope analyze`` and the dashboard
write them the same way.  The report and the views read one analysis
:class:`~.context.Context`, so what they share (the step plans, the schedule) is made once.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from mfuscope import atomic, run_dir
from mfuscope.report import write_report

from . import overview, timeline, trace_set
from .context import Context

TIMELINE = "timeline.parquet"
MICROBATCHES = "microbatches.parquet"

Progress = Callable[[float, str], None]


def analyze(path: str | Path, report_path: str | Path, views_dir: str | Path | None, *,
            on_progress: Progress | None = None, nccl_tests: list | None = None,
            **load_options: Any) -> tuple[dict[str, Any], trace_set.LoadResult]:
    """Load ``path``, write its report (and views), return (report, what was loaded).  ``nccl_tests``:
    tables of :func:`.nccl_tests.read_all` the communication rows are compared with."""
    say = on_progress or (lambda fraction, message: None)
    is_run = run_dir.is_run_dir(path)
    say(0.0, "loading traces")
    result = trace_set.load(path, on_file=lambda done, total: say(0.7 * done / total,
                                                                  f"loading traces: {done}/{total} files"),
                            **load_options)
    say(0.7, "analyzing")
    context = Context.of(result.events, path if is_run else None)
    report = overview.build_report(context, source=str(path), files=[str(f) for f in result.files],
                                   run=path if is_run else None, nccl_tests=nccl_tests)
    if views_dir is not None:
        say(0.9, "building timelines")
        write_views(views_dir, context)
    write_report(report_path, report)  # last: a report on disk means the views are there too
    say(1.0, "done")
    return report, result


def write_views(views_dir: str | Path, context: Context) -> None:
    """The timeline segments and the executed schedule, from the analysis's own step plans."""
    views_dir = Path(views_dir)
    views_dir.mkdir(parents=True, exist_ok=True)
    segments = timeline.segments(context.events, context.plans)
    atomic.write_parquet(views_dir / TIMELINE, pa.Table.from_pandas(segments, preserve_index=False))
    atomic.write_parquet(views_dir / MICROBATCHES, pa.Table.from_pandas(context.microbatches, preserve_index=False))


def read_views(views_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(timeline segments, microbatches); empty frames where a view is missing."""
    views_dir = Path(views_dir)

    def read(name: str, columns: list[str]) -> pd.DataFrame:
        p = views_dir / name
        return pd.read_parquet(p) if p.exists() else pd.DataFrame(columns=columns)

    return read(TIMELINE, timeline.SEGMENT_COLUMNS), read(MICROBATCHES, timeline.MICROBATCH_COLUMNS)
