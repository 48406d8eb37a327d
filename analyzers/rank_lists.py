"""The report's per-rank lists at any rank count: the worst ranks in the report, every rank in a view.

A report of 16,384 ranks cannot hold a row per rank and step (``straggler_matrix``) or per rank
and leaf (``breakdown_by_rank``): the JSON would be hundreds of MB, and no reader wants all of it
first.  Each per-rank list keeps its key and its rows' fields, but holds the rows of the
:data:`LIMIT` worst ranks -- worst by the figure that list is read for (lowest MFU, slowest step,
largest lateness, ...) -- still in rank order; the whole list is written as a Parquet view
(``ranks/<key>.parquet`` in the analysis's views folder: ``RUN/views`` for a run directory,
``<report>.views`` beside the report of a trace set this large).  ``report["rank_lists"]`` says,
per list, how many ranks it has, how many were kept, by what, and where the rest is.

A list of :data:`LIMIT` ranks or fewer is left whole (and needs no view).  New per-rank lists
follow the same rule: one entry in :data:`WORST`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from mfuscope import atomic

#: Ranks a per-rank list keeps in the report.
LIMIT = 64
#: The views' folder of whole per-rank lists.
FOLDER = "ranks"


def _by(field: str, worst: str) -> Callable[[pd.DataFrame], pd.Series]:
    """Rank -> badness from the rows' ``field``: its worst value over the rank's rows, where a
    higher badness is worse (``worst``: "high" or "low" values are the bad ones)."""
    def badness(df: pd.DataFrame) -> pd.Series:
        values = pd.to_numeric(df[field], errors="coerce")
        if worst == "abs":
            values = values.abs()
        per = values.groupby(df["rank"]).max() if worst in ("high", "abs") else -values.groupby(df["rank"]).min()
        return per.fillna(float("-inf"))
    return badness


def _launch(df: pd.DataFrame) -> pd.Series:
    return (df["launch_bound"].astype(float) * 2 + df["small_kernel_share"].fillna(0)).groupby(df["rank"]).max()


def _mfu(df: pd.DataFrame) -> pd.Series:
    field = "mfu" if "mfu" in df else "hfu"
    return _by(field, "low")(df)


#: list -> (what the kept ranks are the worst by, rank -> badness).
WORST: dict[str, tuple[str, Callable[[pd.DataFrame], pd.Series]]] = {
    "per_rank_mfu": ("lowest MFU (HFU)", _mfu),
    "ranks": ("slowest median step", _by("step_time_s", "high")),
    "breakdown_by_rank": ("slowest step (sum of the rank's leaves)",
                          lambda df: df.groupby("rank")["seconds"].sum()),
    "straggler_matrix": ("largest excess over the rank's peers", _by("excess_s", "high")),
    "comm_overlap": ("least communication hidden behind compute", _by("overlap", "low")),
    "kernel_launch": ("launch-bound first, then the largest share of short kernels", _launch),
    "comm_arrival": ("latest median arrival at a collective", _by("median_lag_s", "high")),
    "clock_offsets": ("largest clock offset", _by("offset_s", "abs")),
    "memory.per_rank": ("highest peak allocated", _by("peak_allocated_bytes", "high")),
}


def cap(report: dict[str, Any], views_dir: str | Path | None = None, limit: int = LIMIT) -> dict[str, Any]:
    """``report`` with each per-rank list cut to its ``limit`` worst ranks (see the module
    docstring); the whole lists written under ``views_dir`` when given."""
    meta: dict[str, Any] = {}
    for key, (order, badness) in WORST.items():
        rows = _get(report, key)
        df = pd.DataFrame(rows)
        ranks = int(df["rank"].nunique()) if len(df) else 0
        entry = {"ranks": ranks, "kept": ranks, "worst_by": order, "view": None}
        if ranks > limit:
            keep = set(badness(df).sort_values(ascending=False, kind="stable").index[:limit])
            _set(report, key, [r for r in rows if r["rank"] in keep])
            entry["kept"] = limit
            if views_dir is not None:
                entry["view"] = _write(Path(views_dir), key, rows)  # relative to the views folder
        meta[key] = entry
    report["rank_lists"] = meta
    return report


def whole(report: dict[str, Any], views_dir: str | Path | None, key: str) -> pd.DataFrame:
    """Every rank's rows of the per-rank list ``key``: the view when the report holds only the worst
    ranks, else the report's own rows."""
    view = ((report.get("rank_lists") or {}).get(key) or {}).get("view")
    if view and views_dir is not None and (Path(views_dir) / view).is_file():
        return pd.read_parquet(Path(views_dir) / view)
    return pd.DataFrame(_get(report, key))


def _get(report: dict[str, Any], key: str) -> list[dict]:
    """The list at ``key``; a dotted key (``memory.per_rank``) is a list inside a section."""
    section, _, name = key.rpartition(".")
    holder = report.get(section) if section else report
    return (holder or {}).get(name) or []


def _set(report: dict[str, Any], key: str, rows: list[dict]) -> None:
    section, _, name = key.rpartition(".")
    (report[section] if section else report)[name] = rows


def _write(views_dir: Path, key: str, rows: list[dict]) -> str:
    """The whole list as ``views/ranks/<key>.parquet``; nested fields (lists, dicts) as JSON text."""
    df = pd.DataFrame(rows)
    for col in df.columns:
        if df[col].map(lambda v: isinstance(v, (list, dict))).any():
            df[col] = df[col].map(json.dumps)
    path = views_dir / FOLDER / f"{key}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_parquet(path, pa.Table.from_pandas(df, preserve_index=False))
    return f"{FOLDER}/{key}.parquet"
