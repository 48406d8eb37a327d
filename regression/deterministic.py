"""The deterministic gate: counters that do not depend on timing, held exactly against the last
matching record.

Two runs of one commit give the same counters (analyzers/counters.py), so
this gate needs no history and has no false positives from noise: any change
is reported, and a change past its threshold fails.  The thresholds are for
what a counter measures, in the direction that costs time:

- model FLOPs per step: any change beyond 0.1%, either way -- the workload
  itself changed, and its MFU is no longer comparable with the history
  (record a new baseline on purpose);
- communication calls and bytes per step, per (dim, op), and bus bytes (what
  goes on the wire, nccl-tests' factors) per dim: more than 5% more
  (one extra collective a layer in a 4-layer model is +25%; a
  sequence-parallel switch turns all-gathers into all-reduces);
- kernels (GPU) or operators (CPU) per step by kind: more than 10% more
  (launch-bound steps slow down with the count; small refactors move it a
  few percent);
- the cost model's predicted MFU for the run's layout and settings (on its
  device, or on an H100 for a CPU run): a drop past the MFU floor.

Fewer calls, bytes or kernels are reported as improvements and pass.
"""
from __future__ import annotations

from typing import Any

FLOPS_TOLERANCE = 0.001
COMM_GROWTH = 0.05
EVENT_GROWTH = 0.10


def counter_values(record: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """name -> (value, rule) for every counter a record holds."""
    c = record.get("counters") or {}
    out: dict[str, tuple[float, str]] = {}
    for key in ("model_flops_per_step",):
        if c.get(key) is not None:
            out[key] = (float(c[key]), "exact")
    for row in c.get("comm") or []:
        out[f"comm/{row['dim']}/{row['op']}/calls_per_step"] = (float(row["calls_per_step"]), "comm")
        out[f"comm/{row['dim']}/{row['op']}/bytes_per_step"] = (float(row["bytes_per_step"]), "comm")
    for row in c.get("comm_bus") or []:
        out[f"comm/{row['dim']}/bus_bytes_per_step"] = (float(row["bus_bytes_per_step"]), "comm")
    for row in c.get("events") or []:
        out[f"events/{row['kind']}/count_per_step"] = (float(row["count_per_step"]), "events")
    if c.get("predicted_mfu") is not None:
        out["predicted_mfu"] = (float(c["predicted_mfu"]), "mfu")
    return out


def check(base: dict[str, Any], current: dict[str, Any], mfu_floor: float) -> list[dict[str, Any]]:
    """One row per counter in either record: metric, baseline, current, change, limit, verdict
    (``ok``, ``changed`` (reported, passes), ``improved`` or ``fail``), why."""
    b, c = counter_values(base), counter_values(current)
    rows = []
    for name in sorted(set(b) | set(c)):
        rule = (b.get(name) or c.get(name))[1]
        bv, cv = (b[name][0] if name in b else None), (c[name][0] if name in c else None)
        rows.append(_row(name, rule, bv, cv, mfu_floor))
    order = {"fail": 0, "changed": 1, "improved": 2, "ok": 3}
    rows.sort(key=lambda r: (order[r["verdict"]], r["metric"]))
    return rows


def _row(name: str, rule: str, bv: float | None, cv: float | None, mfu_floor: float) -> dict[str, Any]:
    row = {"metric": name, "baseline": bv, "current": cv, "change": None, "limit": None, "verdict": "ok", "why": ""}
    if bv is None or cv is None:
        if rule in ("comm", "events") and cv:   # a new collective or kernel kind appeared
            row.update(verdict="fail", why="new in this run")
        elif rule in ("comm", "events"):
            row.update(verdict="improved", why="gone in this run")
        else:
            row.update(verdict="changed", why="only one of the runs has it")
        return row
    if bv == 0:
        if cv != 0 and rule in ("comm", "events"):
            row.update(verdict="fail", why="was 0")
        elif cv != 0:
            row.update(verdict="changed", why="was 0")
        return row
    change = (cv - bv) / bv
    row["change"] = change
    if rule == "exact":
        row["limit"] = FLOPS_TOLERANCE
        if abs(change) > FLOPS_TOLERANCE:
            row.update(verdict="fail", why="the workload changed: its MFU is not comparable with the history")
    elif rule in ("comm", "events"):
        limit = COMM_GROWTH if rule == "comm" else EVENT_GROWTH
        row["limit"] = limit
        if change > limit:
            row.update(verdict="fail", why=f"{change:+.1%} (more than +{limit:.0%})")
        elif change < 0:
            row["verdict"] = "improved"
        elif change > 0:
            row["verdict"] = "changed"
    else:  # predicted MFU: a drop past the floor fails
        row["limit"] = mfu_floor
        if -change > mfu_floor:
            row.update(verdict="fail", why=f"the cost model predicts {change:+.1%} MFU for this layout and settings")
        elif change > 0:
            row["verdict"] = "improved"
        elif change < 0:
            row["verdict"] = "changed"
    return row
