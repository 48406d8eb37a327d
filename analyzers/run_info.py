"""What a run directory holds, before any trace is parsed: how the run went (complete or
ended early, and why), its layout, and what the always-on collectors recorded.

Backs the run section of ``mfuscope info``; reads the manifest and the small parquet tables only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from mfuscope import run_dir
from mfuscope.manifest import Manifest

from .hang import read_fatal


def summarize(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    m = Manifest.read(path)
    info: dict[str, Any] = {
        "run_id": m.raw["run_id"], "status": m.status, "ended_reason": m.ended_reason,
        "start_time": m.start_time, "end_time": m.raw.get("end_time"), "world_size": m.world_size,
        "layout": m.raw.get("layout"), "window": m.raw.get("window"), "device": m.device_name,
        "tables": {}, "steps": None, "comm_by_dim": {},
        # ranks that died of a fatal signal (their stacks: `mfuscope hang RUN`)
        "fatal": {str(r): f["signal"] for r, f in read_fatal(path).items()},
    }
    for name in (run_dir.STEPS, run_dir.COMM, run_dir.NVML):
        info["tables"][name] = run_dir.read_table(path, name).num_rows if (path / name).exists() else 0
    if info["tables"][run_dir.STEPS]:
        steps = run_dir.read_table(path, run_dir.STEPS)
        durations = pc.subtract(steps.column("end_ns"), steps.column("start_ns"))
        per_rank = steps.group_by("rank").aggregate([("step", "max")])
        info["steps"] = {
            "ranks": sorted(per_rank.column("rank").to_pylist()),
            "last_step_by_rank": {str(r): s for r, s in zip(per_rank.column("rank").to_pylist(),
                                                             per_rank.column("step_max").to_pylist())},
            "median_step_s": pc.approximate_median(durations).as_py() / 1e9,
        }
    if info["tables"][run_dir.COMM]:
        comm = run_dir.read_table(path, run_dir.COMM)
        by_dim = comm.group_by("dim").aggregate([("bytes", "sum"), ("bytes", "count")])
        info["comm_by_dim"] = {d: {"calls": n, "bytes": b} for d, b, n in zip(
            by_dim.column("dim").to_pylist(), by_dim.column("bytes_sum").to_pylist(),
            by_dim.column("bytes_count").to_pylist())}
    return info


def format_text(info: dict[str, Any]) -> str:
    status = info["status"] + (f" ({info['ended_reason']})" if info.get("ended_reason") else "")
    layout = ", ".join(f"{k}={v}" for k, v in (info.get("layout") or {}).items() if v != 1) or "-"
    lines = [f"run          {info['run_id']}: {status}",
             f"world size   {info['world_size']}   layout {layout}   device {info.get('device') or '-'}"]
    if info.get("fatal"):
        lines.append("crashed      " + ", ".join(f"rank {r}: {sig}" for r, sig in info["fatal"].items())
                     + " (stacks: mfuscope hang RUN)")
    s = info.get("steps")
    if s:
        last = s["last_step_by_rank"]
        span = f"{min(last.values()) + 1}" if len(set(last.values())) == 1 else \
            f"{min(last.values()) + 1}..{max(last.values()) + 1} (ranks differ)"
        lines.append(f"steps        {span} recorded on {len(s['ranks'])} rank(s), "
                     f"median {s['median_step_s'] * 1e3:.1f} ms")
    for dim, c in sorted(info["comm_by_dim"].items()):
        lines.append(f"  comm {dim:<12} {c['calls']:>8,} calls {c['bytes'] / 2**20:>12,.2f} MiB")
    w = info.get("window")
    lines.append("window       " + (f"steps {w['start_step']}.." + (f"{w['start_step'] + w['num_steps'] - 1}"
                                                                   if w.get("num_steps") else "end")
                                  if w else "none"))
    return "\n".join(lines)
