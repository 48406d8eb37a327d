"""Colours and number formats shared by every page: one colour per parallel dimension, everywhere.

A breakdown leaf is coloured by what it is: exposed communication and the
pipeline bubble by their parallel dimension (the bubble is the pipeline
dimension's), compute by kind in greens, the rest in neutral tones.  Numbers
always carry units.
"""
from __future__ import annotations

import math

#: One colour per parallel dimension (the mesh's names; dp_shard_cp is FSDP over dp_shard x cp).
DIM_COLORS = {
    "dp_replicate": "#1f77b4",
    "dp": "#1f77b4",
    "dp_shard": "#17becf",
    "dp_shard_cp": "#17becf",
    "dp_cp": "#17becf",
    "cp": "#9467bd",
    "tp": "#d62728",
    "ep": "#ff7f0e",
    "moe_aux": "#ffbb78",  # the MoE balance loss's token counts (the trainer's own label)
    "pp": "#8c564b",
    "world": "#7f7f7f",
    "unknown": "#bcbd22",
}
COMPUTE_COLORS = {
    "gemm": "#1b7837",
    "attention": "#5aae61",
    "norm_elementwise": "#a6dba0",
    "optimizer": "#00441b",
    "other": "#d9f0d3",
}
OTHER_COLORS = {
    "memory": "#c49c94",
    "data_loading": "#e377c2",
    "checkpoint": "#8c564b",
    "queued": "#9467bd",
    "host_bound": "#f7b6d2",
    "idle": "#e5e5e5",
    "compute": "#4d9221",
    "comm": "#6b6b6b",
}
#: Pipeline actions: forward, backward (input), backward (weights).
ACTION_COLORS = {"F": "#6baed6", "B": "#2171b5", "W": "#9ecae1"}


def dim_of(leaf: str) -> str | None:
    """The parallel dimension a breakdown node belongs to, if any (``bubble`` is the pipeline's)."""
    if leaf == "bubble":
        return "pp"
    parts = leaf.split("/")
    return parts[1] if parts[0] == "comm" and len(parts) > 1 else None


def color(leaf: str) -> str:
    dim = dim_of(leaf)
    if dim is not None:
        return DIM_COLORS.get(dim, DIM_COLORS["unknown"])
    parts = leaf.split("/")
    if parts[0] == "compute" and len(parts) > 1:
        return COMPUTE_COLORS.get(parts[1], COMPUTE_COLORS["other"])
    return OTHER_COLORS.get(parts[0], "#999999")


def seconds(v: float | None) -> str:
    """A duration with the unit that keeps 3 significant digits readable."""
    if _missing(v):
        return "–"
    a = abs(v)
    if a >= 1:
        return f"{v:.3g} s"
    if a >= 1e-3:
        return f"{v * 1e3:.3g} ms"
    if a >= 1e-6 or a == 0:
        return f"{v * 1e6:.3g} µs"
    return f"{v * 1e9:.3g} ns"


def _missing(v: float | None) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def percent(v: float | None) -> str:
    if _missing(v):
        return "–"
    return f"{v:.1%}" if abs(v) >= 0.01 or v == 0 else f"{v * 100:.2g}%"


def signed_percent(v: float | None) -> str:
    return "–" if _missing(v) else ("+" if v > 0 else "") + percent(v)


def size(v: float | None) -> str:
    """Bytes in binary units, 3 significant digits."""
    if _missing(v):
        return "–"
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"


def rate(v: float | None, unit: str) -> str:
    if _missing(v):
        return "–"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"


CSS = """
body { font-family: -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif; margin: 0; color: #222; }
.topbar { background: #1d2733; color: #fff; padding: 8px 20px; display: flex; gap: 18px; align-items: center; }
.topbar a { color: #cfe3ff; text-decoration: none; font-size: 14px; }
.topbar a.active { color: #fff; font-weight: 600; border-bottom: 2px solid #fff; }
.topbar .brand { font-weight: 700; font-size: 17px; color: #fff; margin-right: 10px; }
.topbar .run { margin-left: auto; font-size: 13px; color: #9fb3c8; }
.page { padding: 14px 22px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin-bottom: 10px; }
.card { border: 1px solid #dde3ea; border-radius: 6px; padding: 8px 14px; min-width: 120px; background: #fafbfc; }
.card .label { font-size: 12px; color: #5f6b7a; }
.card .value { font-size: 21px; font-weight: 600; }
.card .note { font-size: 11px; color: #7b8794; }
.error-panel { border: 1px solid #e0a3a3; background: #fdf0f0; color: #8a1c1c; padding: 10px 14px;
               border-radius: 6px; margin: 10px 0; white-space: pre-wrap; }
.info-panel { border: 1px solid #c9d7e8; background: #f3f7fc; padding: 10px 14px; border-radius: 6px; margin: 10px 0; }
.row { display: flex; gap: 16px; flex-wrap: wrap; }
.row > div { flex: 1 1 480px; min-width: 0; }
h2 { font-size: 19px; margin: 6px 0 10px; }
h3 { font-size: 15px; margin: 14px 0 6px; color: #334; }
.legend-dim { display: inline-block; padding: 1px 8px; margin: 2px; border-radius: 3px; color: #fff; font-size: 12px; }
progress { width: 420px; height: 16px; }
.muted { color: #7b8794; font-size: 13px; }
.note { color: #5f6b7a; font-size: 13px; margin: 4px 0 8px; }
.plan-form { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-end; margin-bottom: 10px; }
.plan-form label { display: flex; flex-direction: column; font-size: 12px; color: #5f6b7a; gap: 3px; min-width: 150px; }
.plan-form input { padding: 6px 8px; border: 1px solid #ccd4dd; border-radius: 4px; font-size: 14px; }
#plan-go { padding: 8px 22px; background: #1d2733; color: #fff; border: 0; border-radius: 4px;
                    font-size: 14px; cursor: pointer; }
"""
