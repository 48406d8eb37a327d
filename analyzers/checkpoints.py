"""What checkpointing cost a run: each save's blocking and background time, and the run's goodput.

The collectors record each save the training thread makes (``ProfileSession.checkpoint``, the
reference trainer's ``--checkpoint``) in ``checkpoints.parquet``: the time the thread was blocked
in it -- all of a synchronous save; the staging of an asynchronous one -- and, for an async save,
the time its background part took (writing the shards, DCP's metadata, the commit).  A save
blocks the job as long as its slowest rank does (the others wait for it at their next
collective), so a save's figures are the maxima over ranks.

Goodput is the productive share of the run's wall time: the span of every step the collectors
timed (first start to last end, over all ranks, less the collectors' own work in it -- exporting
a trace window is the profiler's time, not the job's) less the time saves held the training
thread (the slowest rank's total), over that span.  What it does not see: start-up before the
first step, restarts, and steps redone after a resume.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mfuscope import run_dir

from . import step_rows


def analyze(run: str | Path) -> dict[str, Any] | None:
    """The report's ``checkpoints`` section (None for a run that never saved), with ``goodput``."""
    run = Path(run)
    steps = step_rows.read(run)
    if steps is None or steps.empty:
        return None
    collectors_s = float(steps.groupby("step")["collector_s"].max().sum())
    wall_s = (int(steps["end_ns"].max()) - int(steps["start_ns"].min())) / 1e9 - collectors_s
    saves = (run_dir.read_table(run, run_dir.CHECKPOINTS).to_pandas() if (run / run_dir.CHECKPOINTS).exists()
             else None)
    if saves is None or saves.empty:
        return {"saves": [], "count": 0, "goodput": 1.0 if wall_s > 0 else None, "wall_s": wall_s,
                "collectors_s": collectors_s,
                "blocking_s": 0.0, "method": __doc__.split("\n\n")[2].replace("\n", " ")}
    blocking = saves.dropna(subset=["blocking_ns"])
    background = saves.dropna(subset=["background_ns"])
    per_save = []
    for step, g in blocking.groupby("step"):
        bg = background[background["step"] == step]["background_ns"]
        per_save.append({"step": int(step), "mode": str(g["mode"].iloc[0]),
                         "blocking_s": float(g["blocking_ns"].max()) / 1e9,
                         "background_s": float(bg.max()) / 1e9 if len(bg) else None,
                         "slowest_rank": int(g.loc[g["blocking_ns"].idxmax(), "rank"])})
    lost_s = float(blocking.groupby("rank")["blocking_ns"].sum().max()) / 1e9
    modes = sorted({s["mode"] for s in per_save})
    return {"saves": per_save, "count": len(per_save), "modes": modes,
            "median_blocking_s": float(np.median([s["blocking_s"] for s in per_save])),
            "median_background_s": (float(np.median(bgs)) if (bgs := [s["background_s"] for s in per_save
                                                                       if s["background_s"] is not None]) else None),
            "blocking_s": lost_s, "wall_s": wall_s, "collectors_s": collectors_s,
            "goodput": max(0.0, 1 - lost_s / wall_s) if wall_s > 0 else None,
            "method": __doc__.split("\n\n")[2].replace("\n", " ")}


def text_lines(section: dict[str, Any] | None) -> list[str]:
    """``mfuscope analyze``'s checkpoint lines."""
    if not section or not section.get("count"):
        return []
    bg = section.get("median_background_s")
    return ["", f"checkpoints   {section['count']} save(s) ({', '.join(section['modes'])}): the training thread "
                f"blocked {section['median_blocking_s'] * 1e3:.1f} ms a save (median of the slowest rank's)"
                + (f", {bg:.2f} s in the background" if bg is not None else "")
                + f"; goodput {section['goodput']:.1%} of {section['wall_s']:.1f} s"]
