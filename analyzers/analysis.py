"""Analyze a run or a trace set once: ``report.json`` plus the views a viewer draws from.

The views (``views/timeline.parquet``: every rank's step as time-ordered
breakdown segments; ``views/microbatches.parquet``: the executed pipeline
schedule) exist so the dashboard never parses a trace per request.  A run
directory keeps both inside itself; ``mfuscope analyze`` and the dashboard
write them the same way.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pyarrow as pa

from mfuscope import atomic, run_dir
from mfuscope.report import write_report

from . import overview, timeline, trace_set

TIMELINE = "timeline.parquet"
MICROBATCHES = "microbatches.parquet"

Progress = Callable[[float, str], None]


def analyze(path: str | Path, report_path: str | Path, views_dir: str | Path | None, *,
            on_progress: Progress | None = None, **load_options: Any) -> tuple[dict[str, Any], trace_set.LoadResult]:
    """Load ``path``, write its report (and views), return (report, what was loaded)."""
    say = on_progress or (lambda fraction, message: None)
    is_run = run_dir.is_run_dir(path)
    say(0.0, "loading traces")
    result = trace_set.load(path, on_file=lambda done, total: say(0.7 * done / total,
                                                                  f"loading traces: {done}/{total} files"),
                            **load_options)
    say(0.7, "analyzing")
    report = overview.build_report(result.events, source=str(path), files=[str(f) for f in result.files],
                                   run=path if is_run else None)
    if views_dir is not None:
        say(0.9, "building timelines")
        manifest = run_dir.read_manifest(path) if is_run else None
        write_views(views_dir, result.events, manifest)
    write_report(report_path, report)  # last: a report on disk means the views are there too
    say(1.0, "done")
    return report, result


def write_views(views_dir: str | Path, events, manifest: dict | None) -> None:
    views_dir = Path(views_dir)
    views_dir.mkdir(parents=True, exist_ok=True)
    coords = (manifest or {}).get("rank_coords") or {}
    stage_of = {int(r): int(c.get("pp", 0)) for r, c in coords.items()}
    atomic.write_parquet(views_dir / TIMELINE, pa.Table.from_pandas(timeline.segments(events), preserve_index=False))
    atomic.write_parquet(views_dir / MICROBATCHES,
                         pa.Table.from_pandas(timeline.microbatches(events, stage_of), preserve_index=False))


def read_views(views_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(timeline segments, microbatches); empty frames where a view is missing."""
    views_dir = Path(views_dir)

    def read(name: str, columns: list[str]) -> pd.DataFrame:
        p = views_dir / name
        return pd.read_parquet(p) if p.exists() else pd.DataFrame(columns=columns)

    return read(TIMELINE, timeline.SEGMENT_COLUMNS), read(MICROBATCHES, timeline.MICROBATCH_COLUMNS)
