"""What a trace set holds: ranks, world size, device, steps, event counts, time span.

Backs ``mfuscope info``: each rank is read alone, in a worker (:func:`rank_info`, cheap: counts
and min/max over columns), and the ranks combined (:func:`combine`), so a set of thousands of
ranks never has its events in one process.
"""
from __future__ import annotations

from typing import Any

import pyarrow.compute as pc

from mfuscope.event_table import KINDS, EventTable


def rank_info(events: EventTable) -> dict[str, Any]:
    """What one rank's events hold: its ``per_rank`` entry, with its event counts by kind, time span
    and world size for :func:`combine` (a map task: no event leaves the worker)."""
    (rank,) = events.rank_ids
    m = events.ranks[rank]
    t = events.table
    counts = {}
    if t.num_rows:
        vc = pc.value_counts(t.column("kind").combine_chunks().cast("string"))
        counts = {v["values"].as_py(): v["counts"].as_py() for v in vc}
    return {
        "rank": rank, "file": m.get("file"), "rank_source": m.get("rank_source"),
        "device": m.get("device_name"), "steps": m.get("steps", []), "steps_source": m.get("steps_source"),
        "events": t.num_rows, "clock": m.get("clock"),
        "world_size": m.get("world_size"), "device_name": m.get("device_name"), "by_kind": counts,
        "start_ns": int(pc.min(t.column("ts_ns")).as_py()) if t.num_rows else None,
        "end_ns": int(pc.max(pc.add(t.column("ts_ns"), t.column("dur_ns"))).as_py()) if t.num_rows else None,
    }


#: What :func:`rank_info` adds to a rank's ``per_rank`` entry for :func:`combine`.
_FOR_COMBINE = ("world_size", "device_name", "by_kind", "start_ns", "end_ns")


def combine(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """``mfuscope info`` of a trace set from its ranks' :func:`rank_info`."""
    parts = sorted(parts, key=lambda p: p["rank"])
    world = {p["world_size"] for p in parts if p.get("world_size")}
    counts: dict[str, int] = {}
    for p in parts:
        for k, v in p["by_kind"].items():
            counts[k] = counts.get(k, 0) + v
    starts = [p["start_ns"] for p in parts if p["start_ns"] is not None]
    ends = [p["end_ns"] for p in parts if p["end_ns"] is not None]
    start, end = (min(starts), max(ends)) if starts else (None, None)
    return {
        "ranks": [p["rank"] for p in parts],
        "world_size": max(world) if world else None,
        "devices": sorted({p["device_name"] for p in parts if p.get("device_name")}),
        "steps": sorted({s for p in parts for s in p.get("steps", [])}),
        "events": sum(p["events"] for p in parts),
        "events_by_kind": {k: counts[k] for k in KINDS if k in counts},
        "time_span": {"start_ns": start, "end_ns": end,
                      "seconds": (end - start) / 1e9 if start is not None else None},
        "per_rank": [{k: v for k, v in p.items() if k not in _FOR_COMBINE} for p in parts],
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
