"""Per-rank timelines of each step, precomputed once so a viewer never re-reads the traces.

``segments``: for every (rank, step), the breakdown's leaves in time order --
the same priority split as :mod:`breakdown`, so a lane's segments add up to
the leaves of that rank and step.  A step split into more than ``RESOLUTION``
segments (a 20k-kernel GPU step) is stored re-binned at ``RESOLUTION`` bins,
each taking the leaf that covers most of it: its lane then adds up to the
leaves within a bin's width.  :func:`lanes` cuts the stored segments to what a
browser can draw for any zoom, server-side.

``microbatches``: the executed pipeline schedule -- every stage's forward,
backward and weight-gradient chunk per microbatch, from PyTorch's action labels
(``PP:0F1``), the collectors' (``mfuscope.pp/0F1``) or GPipe's ``Forward 3``
(:func:`mfuscope.labels.parse_pp`).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from mfuscope import labels
from mfuscope.event_table import EventTable

from . import intervals as iv
from .breakdown import StepPlan, step_plans

RESOLUTION = 10_000
SEGMENT_COLUMNS = ["rank", "step", "start_ns", "end_ns", "leaf"]
MICROBATCH_COLUMNS = ["rank", "step", "stage", "action", "microbatch", "start_ns", "end_ns"]


def segments(events: EventTable, plans: Iterable[StepPlan] | None = None) -> pd.DataFrame:
    """Every rank's steps as time-ordered leaf segments (see the module docstring).  ``plans``:
    :func:`step_plans` of ``events`` where the caller has made them."""
    parts = []
    for rank, step, (lo, hi), plan in step_plans(events) if plans is None else plans:
        s, e, names = iv.segments_by_priority((lo, hi), plan, rest="idle")
        if s.size == 0:
            continue
        if s.size > RESOLUTION:
            labels, codes = np.unique(np.asarray(names, dtype=object), return_inverse=True)
            s, e, c = iv.dominant_runs(s, e, codes, lo, hi, RESOLUTION)
            names = list(labels[c])
        parts.append(pd.DataFrame({"rank": rank, "step": step, "start_ns": s, "end_ns": e, "leaf": names}))
    if not parts:
        return pd.DataFrame(columns=SEGMENT_COLUMNS)
    out = pd.concat(parts, ignore_index=True)
    out["leaf"] = out["leaf"].astype("category")
    return out[SEGMENT_COLUMNS]


def microbatches(events: EventTable, stage_of_rank: dict[int, int] | None = None) -> pd.DataFrame:
    df = events.to_pandas(["rank", "name", "ts_ns", "dur_ns", "step"])
    actions = {n: a for n in df["name"].unique() if isinstance(n, str) and (a := labels.parse_pp(n)) is not None}
    df = df[df["name"].isin(list(actions)) & (df["step"] >= 0)]
    rows = []
    for name, g in df.groupby("name", observed=True, sort=False):
        stage, action, mb = actions[name]
        for r in g.itertuples():
            st = stage if stage is not None else (stage_of_rank or {}).get(int(r.rank), 0)
            rows.append((int(r.rank), int(r.step), st, "B" if action == "I" else action, mb,
                         int(r.ts_ns), int(r.ts_ns + r.dur_ns)))
    out = pd.DataFrame(rows, columns=MICROBATCH_COLUMNS)
    # the collectors' label and PyTorch's can both wrap one chunk: keep the outermost
    out = out.sort_values(["rank", "start_ns", "end_ns"], ascending=[True, True, False])
    return out.drop_duplicates(["rank", "step", "stage", "action", "microbatch"]).reset_index(drop=True)


def lanes(seg: pd.DataFrame, lo: int, hi: int, bins: int = 1200) -> pd.DataFrame:
    """Segments of each rank cut to [lo, hi] at ``bins`` pixels: what the browser draws."""
    seg = seg[(seg["end_ns"] > lo) & (seg["start_ns"] < hi)]
    if seg.empty:
        return pd.DataFrame(columns=["rank", "start_ns", "end_ns", "leaf"])
    leaf = seg["leaf"].astype("category")
    labels = leaf.cat.categories
    codes = leaf.cat.codes.to_numpy()
    out = []
    for rank, idx in seg.groupby("rank", sort=True).indices.items():
        s = np.maximum(seg["start_ns"].to_numpy()[idx], lo)
        e = np.minimum(seg["end_ns"].to_numpy()[idx], hi)
        rs, re_, rc = iv.dominant_runs(s, e, codes[idx], lo, hi, bins)
        out.append(pd.DataFrame({"rank": rank, "start_ns": rs, "end_ns": re_, "leaf": labels[rc]}))
    return pd.concat(out, ignore_index=True)
