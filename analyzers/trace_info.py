"""What a loaded trace set holds: ranks, world size, device, steps, event counts, time span.

Backs ``mfuscope info``; cheap (counts and min/max over columns).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.compute as pc

from mfuscope.event_table import KINDS, EventTable


def summarize(events: EventTable) -> dict[str, Any]:
    t = events.table
    ranks = events.rank_ids
    metas = [events.ranks[r] for r in ranks]
    world = {m.get("world_size") for m in metas if m.get("world_size")}
    devices = sorted({m.get("device_name") for m in metas if m.get("device_name")})
    counts = {}
    if t.num_rows:
        vc = pc.value_counts(t.column("kind").combine_chunks().cast("string"))
        got = {v["values"].as_py(): v["counts"].as_py() for v in vc}
        counts = {k: got[k] for k in KINDS if k in got}
    start = int(pc.min(t.column("ts_ns")).as_py()) if t.num_rows else None
    end = int(pc.max(pc.add(t.column("ts_ns"), t.column("dur_ns"))).as_py()) if t.num_rows else None
    per_rank = []
    rank_col = t.column("rank").to_numpy()
    for r, m in zip(ranks, metas):
        per_rank.append({
            "rank": r, "file": m.get("file"), "rank_source": m.get("rank_source"),
            "device": m.get("device_name"), "steps": m.get("steps", []), "steps_source": m.get("steps_source"),
            "events": int(np.count_nonzero(rank_col == r)), "clock": m.get("clock"),
        })
    return {
        "ranks": ranks,
        "world_size": max(world) if world else None,
        "devices": devices,
        "steps": sorted({s for m in metas for s in m.get("steps", [])}),
        "events": t.num_rows,
        "events_by_kind": counts,
        "time_span": {"start_ns": start, "end_ns": end,
                      "seconds": (end - start) / 1e9 if start is not None else None},
        "per_rank": per_rank,
    }


def format_text(info: dict[str, Any]) -> str:
    ranks = info["ranks"]
    rank_str = f"{len(ranks)} ({ranks[0]}..{ranks[-1]})" if len(ranks) > 1 else str(ranks[0]) if ranks else "none"
    lines = [
        f"ranks        {rank_str}",
        f"world size   {info['world_size'] if info['world_size'] is not None else 'unknown'}",
        f"device       {', '.join(info['devices']) or 'unknown (CPU-only or not recorded)'}",
        f"steps        {_steps(info['steps'])}  ({info['per_rank'][0]['steps_source'] if info['per_rank'] else '-'})",
        (f"time span    {info['time_span']['seconds']:.6f} s" if info["time_span"]["seconds"] is not None
         else "time span    -"),
        f"events       {info['events']:,}",
    ]
    for k, v in info["events_by_kind"].items():
        lines.append(f"  {k:<14} {v:>12,}")
    return "\n".join(lines)


def _steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) > 6:
        return f"{len(steps)}: {steps[0]}..{steps[-1]}"
    return f"{len(steps)}: {', '.join(map(str, steps))}"
