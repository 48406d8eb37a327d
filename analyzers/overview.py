"""The first report: step times, device time per rank by kind, communication per op, top kernels.

This is what the loader alone can tell; MFU, the top-down breakdown, bubbles
and stragglers are separate analyses that add their sections to the report.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from mfuscope import hardware
from mfuscope.event_table import EventTable
from mfuscope.report import new_report

from . import kernel_time


def build_report(events: EventTable, *, source: str, files: list[str]) -> dict[str, Any]:
    spans = kernel_time.step_spans(events)
    # The job's step time is the slowest rank's: everyone waits for it at the next collective.
    per_step = spans.groupby("step")["dur_ns"].max() / 1e9 if not spans.empty else pd.Series(dtype=float)
    dev = kernel_time.device_time(events)
    metas = events.ranks
    device = next((m.get("device_name") for m in metas.values() if m.get("device_name")), None)
    acc = hardware.lookup(device)
    world = max((m.get("world_size") or 0 for m in metas.values()), default=0) or None

    summary = {
        "mfu": None, "hfu": None,
        "mfu_note": "MFU needs the model FLOPs (model spec or GEMM shapes), which this analysis does not compute",
        "step_time_s": float(per_step.mean()) if len(per_step) else None,
        "step_time_p50_s": float(np.percentile(per_step, 50)) if len(per_step) else None,
        "step_time_p90_s": float(np.percentile(per_step, 90)) if len(per_step) else None,
        "tokens_per_s": None, "tflops_per_device": None,
        "device": device, "world_size": world, "ranks": len(metas), "steps": int(len(per_step)),
        "peak_flops_bf16": acc.peak_flops("bf16") if acc else None,
    }
    comm = events.to_pandas(["rank", "kind", "dur_ns"])
    comm_ns = comm[comm["kind"].astype(str) == "comm"].groupby("rank")["dur_ns"].sum()
    ranks = []
    for r in events.rank_ids:
        rs = spans[spans["rank"] == r]
        dr = dev[dev["rank"] == r].groupby("kind")["total_ns"].sum()
        ranks.append({
            "rank": r, "steps": int(len(rs)),
            "step_time_s": float(rs["dur_ns"].median() / 1e9) if len(rs) else None,
            "compute_kernel_s": float(dr.get("kernel", 0) / 1e9),
            # GPU communication kernels, or gloo work on CPU threads.
            "comm_s": float(comm_ns.get(r, 0) / 1e9),
            "memory_s": float((dr.get("memcpy", 0) + dr.get("memset", 0)) / 1e9),
        })
    kernels = kernel_time.top_kernels(events, n=20)
    return new_report(source, files, summary, ranks=ranks, comm=_comm_by_op(events),
                      comm_calls=_comm_by_op(events, calls=True),
                      kernels=[{"name": k.name, "kind": k.kind, "count": int(k.count),
                                "total_s": k.total_ns / 1e9, "mean_us": k.mean_ns / 1e3,
                                "median_us": k.median_ns / 1e3, "share": float(k.share)}
                               for k in kernels.itertuples()])


def _comm_by_op(events: EventTable, calls: bool = False) -> list[dict[str, Any]]:
    """Communication per (dimension, op): the work itself (NCCL kernels, gloo threads), or with
    ``calls`` the labelled call regions on the training thread (``mfuscope.comm/<dim>/<op>``)."""
    df = events.to_pandas(["rank", "kind", "name", "op", "dim", "bytes", "dur_ns"])
    if calls:
        df = df[df["name"].astype(str).str.startswith("mfuscope.comm/")]
    else:
        df = df[df["kind"].astype(str) == "comm"]
    if df.empty:
        return []
    df = df.assign(op=df["op"].fillna("unknown"), dim=df["dim"].fillna("unknown"),
                   known_bytes=df["bytes"].where(df["bytes"] >= 0, 0))
    g = df.groupby(["dim", "op"]).agg(count=("dur_ns", "size"), total_ns=("dur_ns", "sum"),
                                      bytes=("known_bytes", "sum")).reset_index()
    return [{"dim": r.dim, "op": r.op, "count": int(r.count), "total_s": r.total_ns / 1e9, "bytes": int(r.bytes)}
            for r in g.itertuples()]


def format_text(report: dict[str, Any]) -> str:
    s = report["summary"]
    fmt = lambda v, unit="s", scale=1.0: f"{v * scale:.4g} {unit}" if v is not None else "-"  # noqa: E731
    lines = [
        f"device        {s.get('device') or 'unknown'}   ranks {s['ranks']}   world size {s.get('world_size') or '?'}",
        f"steps         {s['steps']}",
        f"step time     mean {fmt(s['step_time_s'], 'ms', 1e3)}   p50 {fmt(s.get('step_time_p50_s'), 'ms', 1e3)}"
        f"   p90 {fmt(s.get('step_time_p90_s'), 'ms', 1e3)}",
        f"MFU           {_pct(s['mfu'])}" + (f"   ({s['mfu_note']})" if s.get("mfu_note") else ""),
        "",
        f"{'rank':>5} {'steps':>6} {'step ms':>10} {'kernels ms':>11} {'comm ms':>10} {'memory ms':>10}",
    ]
    for r in report.get("ranks", []):
        st = f"{r['step_time_s'] * 1e3:10.3f}" if r["step_time_s"] is not None else f"{'-':>10}"
        lines.append(f"{r['rank']:>5} {r['steps']:>6} {st} {r['compute_kernel_s'] * 1e3:11.3f} "
                     f"{r['comm_s'] * 1e3:10.3f} {r['memory_s'] * 1e3:10.3f}")
    for key, title in (("comm_calls", "communication calls by parallel dimension (training thread, all ranks):"),
                       ("comm", "communication work (NCCL kernels / gloo threads, all ranks):")):
        if report.get(key):
            lines += ["", title]
            for c in report[key]:
                lines.append(f"  {c['dim']:<12} {c['op']:<15} {c['count']:>7} calls {c['total_s'] * 1e3:10.3f} ms "
                             f"{c['bytes'] / 1e6:12.2f} MB")
    if report.get("kernels"):
        lines += ["", "top kernels (all ranks):"]
        for k in report["kernels"][:5]:
            lines.append(f"  {k['share']:6.1%} {k['total_s'] * 1e3:10.3f} ms {k['count']:>7}x  {k['name'][:90]}")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"
