"""Plotly figures: pure functions of analysis data (no Dash, no I/O), so each is easy to check alone."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mfuscope.analyzers import pipeline_schedule

from . import style

FONT = dict(family="-apple-system, Segoe UI, Roboto, Helvetica, Arial, sans-serif", size=12)


def _layout(fig: go.Figure, height: int, **kw: Any) -> go.Figure:
    fig.update_layout(height=height, margin=dict(l=10, r=10, t=36, b=10), font=FONT, plot_bgcolor="#fff",
                      paper_bgcolor="#fff", **kw)
    return fig


def empty(message: str, height: int = 200) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font=dict(size=14, color="#7b8794"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, height)


def breakdown_icicle(tree: dict[str, Any] | None) -> go.Figure:
    """The top-down tree; a click zooms into a node (in the browser) and selects it (in the app)."""
    if not tree or not tree.get("seconds"):
        return empty("no step markers in these traces: no breakdown")
    total = tree["seconds"]
    ids, labels, parents, values, colors, hover = [], [], [], [], [], []

    def walk(node: dict, parent: str) -> None:
        name = node["name"]
        ids.append(name)
        labels.append(name.split("/")[-1] if name != "step" else f"step {style.seconds(total)}")
        parents.append(parent)
        # leaves carry the time; inner nodes add up their children ("remainder": no rounding trap)
        values.append(node["seconds"] if not node["children"] else 0.0)
        colors.append(style.color(name) if name != "step" else "#dfe6ee")
        hover.append(f"{name}<br>{style.seconds(node['seconds'])} per step<br>{style.percent(node['seconds'] / total)}"
                     " of the step")
        for c in node["children"]:
            walk(c, name)

    walk(tree, "")
    fig = go.Figure(go.Icicle(ids=ids, labels=labels, parents=parents, values=values, branchvalues="remainder",
                              marker=dict(colors=colors, line=dict(color="#fff", width=1)),
                              hovertext=hover, hoverinfo="text", textinfo="label+percent root",
                              tiling=dict(orientation="v"), root=dict(color="#dfe6ee")))
    return _layout(fig, 430, title=dict(text="Where a step's time went (mean of ranks and steps; click to zoom)",
                                        font=dict(size=14)))


def rank_bars(rows: pd.DataFrame, node: str) -> go.Figure:
    """Per rank: seconds per step spent in ``node`` (sum of its leaves)."""
    if rows.empty:
        return empty(f"{node}: no time on any rank")
    fig = go.Figure(go.Bar(x=[f"rank {r}" for r in rows["rank"]], y=rows["seconds"] * 1e3,
                           marker_color=style.color(node),
                           hovertemplate="%{x}: %{y:.3g} ms per step<extra></extra>"))
    fig.update_yaxes(title="ms per step", gridcolor="#eee")
    return _layout(fig, 260, title=dict(text=f"{node} per rank", font=dict(size=14)))


def step_trend(per_step: list[dict[str, Any]]) -> go.Figure:
    if not per_step:
        return empty("no step times recorded")
    df = pd.DataFrame(per_step)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=df["step"], y=df["step_time_s"] * 1e3, name="step time", marker_color="#9fb3c8",
                         hovertemplate="step %{x}: %{y:.4g} ms<extra></extra>"))
    if "mfu" in df and df["mfu"].notna().any():
        fig.add_trace(go.Scatter(x=df["step"], y=df["mfu"] * 100, name="MFU", mode="lines+markers",
                                 line=dict(color="#1b7837"), hovertemplate="step %{x}: MFU %{y:.3g}%<extra></extra>"),
                      secondary_y=True)
        fig.update_yaxes(title_text="MFU (%)", secondary_y=True, rangemode="tozero", showgrid=False)
    fig.update_yaxes(title_text="step time (ms)", secondary_y=False, gridcolor="#eee", rangemode="tozero")
    fig.update_xaxes(title_text="step", dtick=1 if len(df) <= 30 else None)
    return _layout(fig, 300, title=dict(text="Step time and MFU per step", font=dict(size=14)),
                   legend=dict(orientation="h", y=1.12, x=1, xanchor="right"))


#: Episode classes' colours on the health figure.
HEALTH_COLORS = {"compute_slow": "#d6604d", "comm_slow": "#4393c3", "host": "#8c6bb1", "cpu_contention": "#e08214"}
HEALTH_POINTS = 4000  # steps drawn at most on the health figure (SVG stays responsive)


def health_steps(step_s: pd.Series, episodes: list[dict[str, Any]], baseline_s: float | None) -> go.Figure:
    """The job's step time (its slowest rank's) over every step, each slow episode shaded from its
    onset to its end (an intermittent one marked at each period)."""
    if step_s.empty:
        return empty("no step times recorded")
    if len(step_s) > HEALTH_POINTS:  # a long run: the slowest step of each bucket, so no spike is lost
        width = -(-len(step_s) // HEALTH_POINTS)  # steps a point stands for
        step_s = step_s.groupby(step_s.index // width * width).max()
    fig = go.Figure(go.Scatter(x=step_s.index, y=step_s.to_numpy() * 1e3, mode="lines", name="step time",
                               line=dict(color="#52667a", width=1),
                               hovertemplate="step %{x}: %{y:.4g} ms<extra></extra>"))
    if baseline_s:
        fig.add_hline(y=baseline_s * 1e3, line=dict(color="#999", dash="dot"), annotation_text="baseline")
    for e in episodes:
        color = HEALTH_COLORS.get(e["class"], "#999")
        label = f"{e['class'].replace('_', '-')} · ranks {', '.join(map(str, e['ranks'][:6]))}"
        if e.get("period"):
            for x in range(e["onset_step"], e["end_step"] + 1, e["period"]):
                fig.add_vline(x=x, line=dict(color=color, width=1))
            fig.add_annotation(x=e["onset_step"], y=1, yref="paper", text=label + f" · every {e['period']}",
                               showarrow=False, xanchor="left", font=dict(color=color, size=11))
        else:
            fig.add_vrect(x0=e["onset_step"] - 0.5, x1=e["end_step"] + 0.5, fillcolor=color, opacity=0.15,
                          line_width=0, annotation_text=label, annotation_position="top left",
                          annotation_font=dict(color=color, size=11))
    fig.update_yaxes(title_text="step time (ms)", rangemode="tozero", gridcolor="#eee")
    fig.update_xaxes(title_text="step")
    return _layout(fig, 320, title=dict(text="Step time over the whole run, slow episodes shaded", font=dict(size=14)),
                   showlegend=False)


#: The memory categories' colours, stacked bottom to top in this order.
MEMORY_COLORS = {"parameter": "#2f6f4f", "optimizer_state": "#c49a1a", "gradient": "#2b5fb4",
                 "activation": "#c0392b", "temporary": "#8e6bbf", "other": "#9aa5b1"}


def memory_timeline(view: pd.DataFrame, rank: int) -> go.Figure:
    """A rank's memory over its profiled window: the memory timeline's categories stacked where it
    has one, and the device allocator's allocated and reserved lines (Kineto's samples)."""
    if view.empty:
        return empty(f"rank {rank}: no memory series recorded")
    t0 = int(view["t_ns"].min())
    fig = go.Figure()
    cats = view[view["source"] == "memory_timeline"]
    for c, color in MEMORY_COLORS.items():
        if len(cats):
            fig.add_trace(go.Scatter(x=(cats["t_ns"] - t0) / 1e6, y=cats[c] / 2**20, name=c.replace("_", " "),
                                     stackgroup="cats", mode="lines", line=dict(width=0.5, color=color),
                                     hovertemplate=c.replace("_", " ") + " %{y:.4g} MiB<extra></extra>"))
    for source, g in view[view["source"] != "memory_timeline"].groupby("source"):
        x = (g["t_ns"] - t0) / 1e6
        # Kineto's CPU totals count from the window's start; a GPU's are the allocator's own
        fig.add_trace(go.Scatter(x=x, y=g["allocated_bytes"] / 2**20, name=f"allocated ({source})", mode="lines",
                                 line=dict(color="#222", width=1)))
        if g["reserved_bytes"].notna().any():
            fig.add_trace(go.Scatter(x=x, y=g["reserved_bytes"] / 2**20, name=f"reserved ({source})", mode="lines",
                                     line=dict(color="#222", width=1, dash="dot")))
    fig.update_yaxes(title_text="MiB", rangemode="tozero", gridcolor="#eee")
    fig.update_xaxes(title_text="ms into the profiled window")
    return _layout(fig, 340, title=dict(text=f"Rank {rank}: memory over the profiled window", font=dict(size=14)),
                   legend=dict(orientation="h", y=-0.25))


def memory_categories(measured: dict[str, Any], predicted: dict[str, Any] | None) -> go.Figure:
    """Bytes per category at the peak, measured beside the cost model's prediction."""
    names = [c for c in MEMORY_COLORS if measured.get(c) is not None or (predicted or {}).get(c) is not None]
    fig = go.Figure(go.Bar(x=[c.replace("_", " ") for c in names], y=[(measured.get(c) or 0) / 2**20 for c in names],
                           name="measured at the peak", marker_color="#52667a"))
    if predicted:
        fig.add_trace(go.Bar(x=[c.replace("_", " ") for c in names], y=[(predicted.get(c) or 0) / 2**20 for c in names],
                             name="predicted (cost model)", marker_color="#d9a441"))
    fig.update_yaxes(title_text="MiB", gridcolor="#eee")
    return _layout(fig, 300, barmode="group", title=dict(text="At the peak: measured and predicted",
                                                         font=dict(size=14)),
                   legend=dict(orientation="h", y=1.12, x=1, xanchor="right"))


def timeline(lanes: pd.DataFrame, labels: dict[int, str], t0: int, waits: pd.DataFrame,
             x_range: tuple[float, float] | None = None, highlight: int | None = None,
             order: list[int] | None = None) -> go.Figure:
    """Per-rank lanes, top to bottom in ``order`` (default: rank order); ``lanes`` already cut to
    what the browser can draw (see timeline.lanes).  A bar carries its rank (``customdata``)."""
    if lanes.empty:
        return empty("no timeline for this step")
    order = list(order) if order is not None else sorted(labels)
    fig = go.Figure()
    for leaf, g in lanes.groupby("leaf", observed=True, sort=True):
        start = (g["start_ns"] - t0) / 1e6
        dur = (g["end_ns"] - g["start_ns"]) / 1e6
        fig.add_trace(go.Bar(orientation="h", y=g["rank"].map(labels), x=dur, base=start, name=str(leaf),
                             customdata=g["rank"],
                             marker=dict(color=style.color(str(leaf)), line=dict(width=0)),
                             hovertemplate=f"{leaf}<br>%{{y}}<br>+%{{base:.4g}} ms for %{{x:.4g}} ms<extra></extra>"))
    for i, w in enumerate(waits.itertuples(), 1):
        y = order.index(w.rank) if w.rank in order else None
        if y is None:
            continue
        x0, x1 = (w.start_ns - t0) / 1e6, (w.end_ns - t0) / 1e6
        fig.add_shape(type="rect", x0=x0, x1=x1, y0=y - 0.45, y1=y + 0.45, line=dict(color="#000", width=2))
        fig.add_annotation(x=x0, y=y, text=f"#{i}", showarrow=False, xanchor="left", xshift=2,
                           bgcolor="rgba(255,255,255,0.85)", font=dict(size=10, color="#000"))
    if highlight is not None and highlight in order:
        y = order.index(highlight)
        fig.add_hrect(y0=y - 0.5, y1=y + 0.5, fillcolor="#ffd54f", opacity=0.25, line_width=0, layer="below")
    fig.update_layout(barmode="overlay", bargap=0.15, uirevision="timeline")
    fig.update_yaxes(categoryorder="array", categoryarray=[labels[r] for r in order], autorange="reversed",
                     ticksuffix="  ")
    fig.update_xaxes(title_text="ms since the step began", gridcolor="#eee", range=list(x_range) if x_range else None)
    return _layout(fig, max(300, 90 + 34 * len(order)), legend=dict(font=dict(size=11), tracegroupgap=2),
                   title=dict(text="Per-rank timeline (drag to zoom; boxes: longest waits)", font=dict(size=14)))


def pipeline(executed: pd.DataFrame, bubbles: pd.DataFrame, t0: int, schedule: str, p: int, m: int,
             v: int = 1) -> go.Figure:
    """The executed schedule (one lane per pipeline rank: ``executed`` and ``bubbles`` carry a
    ``lane`` label) above the theoretical one for p stages and m microbatches at the measured
    forward/backward times (with v virtual stages a rank runs v chunks per microbatch, drawn as one
    chunk v times as long)."""
    shown = schedule if schedule in ("gpipe", "1f1b") else "1f1b"
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("executed (one rank per stage)",
                                        f"theory: {shown} at the measured forward/backward times"
                                        + (f" (the {schedule} schedule drawn as 1f1b)" if shown != schedule else "")))
    dur = executed["end_ns"] - executed["start_ns"]
    forward = executed["action"] == "F"
    t_f_ms = float(dur[forward].median()) / 1e6 if forward.any() else 1.0
    n_b = executed[~forward].groupby(["stage", "microbatch"]).ngroups or 1   # B and W of one chunk: one backward
    t_b_ms = float(dur[~forward].sum()) / n_b / 1e6 if (~forward).any() else 2 * t_f_ms
    if len(bubbles):
        fig.add_trace(go.Bar(orientation="h", y=bubbles["lane"], x=(bubbles["end_ns"] - bubbles["start_ns"]) / 1e6,
                             base=(bubbles["start_ns"] - t0) / 1e6, marker_color=style.DIM_COLORS["pp"], opacity=0.35,
                             name="bubble (waiting on a neighbour)", hovertemplate="bubble %{x:.3g} ms<extra></extra>"),
                      row=1, col=1)
    for action, g in executed.groupby("action"):
        chunk = [f"{action}{mb}" + (f"·s{st}" if v > 1 else "") for mb, st in zip(g["microbatch"], g["stage"])]
        fig.add_trace(go.Bar(orientation="h", y=g["lane"], x=(g["end_ns"] - g["start_ns"]) / 1e6,
                             base=(g["start_ns"] - t0) / 1e6, text=chunk, textposition="inside",
                             insidetextanchor="middle",
                             marker=dict(color=style.ACTION_COLORS.get(action, "#999"),
                                         line=dict(color="#fff", width=1)),
                             name={"F": "forward", "B": "backward", "W": "weight grad"}.get(action, action),
                             legendgroup=action, hovertemplate="%{text} on %{y}: %{x:.3g} ms<extra></extra>"),
                      row=1, col=1)
    sim = pipeline_schedule.simulate(shown, p, m, t_f_ms * v, t_b_ms * v)
    for action, g in sim.groupby("action"):
        fig.add_trace(go.Bar(orientation="h", y=[f"stage {s}" for s in g["stage"]], x=g["end"] - g["start"],
                             base=g["start"], text=[f"{action}{mb}" for mb in g["microbatch"]], textposition="inside",
                             insidetextanchor="middle", showlegend=False, legendgroup=action,
                             marker=dict(color=style.ACTION_COLORS.get(action, "#999"),
                                         line=dict(color="#fff", width=1)),
                             hovertemplate="%{text} on %{y}: %{x:.3g} ms<extra></extra>"), row=2, col=1)
    lanes = list(dict.fromkeys(executed.sort_values("stage")["lane"]))
    fig.update_yaxes(categoryorder="array", categoryarray=lanes, autorange="reversed", row=1, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=[f"stage {s}" for s in range(p)], autorange="reversed",
                     row=2, col=1)
    fig.update_xaxes(title_text="ms since the step began", gridcolor="#eee", row=2, col=1)
    fig.update_xaxes(gridcolor="#eee", row=1, col=1)
    fig.update_layout(barmode="overlay", bargap=0.2)
    return _layout(fig, 200 + 45 * (len(lanes) + p), legend=dict(orientation="h", y=1.12, x=1, xanchor="right"))


def heatmap(df: pd.DataFrame, x: str, y: str, z: str, *, title: str, z_title: str, scale: float = 1.0,
            x_prefix: str = "", y_prefix: str = "", colorscale: str = "Reds") -> go.Figure:
    if df.empty:
        return empty(f"{title}: nothing to show")
    grid = df.pivot_table(index=y, columns=x, values=z, aggfunc="mean") * scale
    fig = go.Figure(go.Heatmap(z=grid.values, x=[f"{x_prefix}{c}" for c in grid.columns],
                               y=[f"{y_prefix}{r}" for r in grid.index], colorscale=colorscale,
                               colorbar=dict(title=dict(text=z_title, side="right")), xgap=1, ygap=1,
                               hovertemplate=f"%{{y}}, %{{x}}: %{{z:.3g}} {z_title}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return _layout(fig, max(260, 90 + 24 * len(grid.index)), title=dict(text=title, font=dict(size=14)))


def compare_leaves(leaves: list[dict[str, Any]], base: str, new: str) -> go.Figure:
    if not leaves:
        return empty("no breakdown in either report")
    df = pd.DataFrame(leaves).head(15).iloc[::-1]
    fig = go.Figure(go.Bar(orientation="h", y=df["leaf"], x=df["delta_s"] * 1e3,
                           marker_color=[style.color(leaf) for leaf in df["leaf"]],
                           customdata=df[["base_s", "new_s"]].to_numpy() * 1e3,
                           hovertemplate="%{y}<br>%{customdata[0]:.4g} → %{customdata[1]:.4g} ms "
                                         "(%{x:+.4g} ms)<extra></extra>"))
    fig.add_vline(x=0, line_color="#333", line_width=1)
    fig.update_xaxes(title_text=f"ms per step, {new} minus {base}", gridcolor="#eee", zeroline=False)
    return _layout(fig, 120 + 26 * len(df), title=dict(text="Change per breakdown leaf", font=dict(size=14)))


def predicted_vs_measured(rows: list[dict[str, Any]]) -> go.Figure:
    """The cost model's leaves beside the measured ones (ms per step), largest first."""
    rows = [r for r in rows if r["leaf"] != "step"][:12]
    if not rows:
        return empty("nothing to compare")
    df = pd.DataFrame(rows).iloc[::-1]
    fig = go.Figure([
        go.Bar(orientation="h", y=df["leaf"], x=df["measured_s"].fillna(0) * 1e3, name="measured",
               marker_color="#3b6ea8", hovertemplate="%{y}: %{x:.4g} ms measured<extra></extra>"),
        go.Bar(orientation="h", y=df["leaf"], x=df["predicted_s"].fillna(0) * 1e3, name="predicted",
               marker_color="#e39b3b", hovertemplate="%{y}: %{x:.4g} ms predicted<extra></extra>")])
    fig.update_xaxes(title_text="ms per step", gridcolor="#eee")
    return _layout(fig, 140 + 34 * len(df), barmode="group",
                   legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0))


def predicted_leaves(leaves: dict[str, float], step_s: float, title: str) -> go.Figure:
    """One predicted layout's breakdown as horizontal bars (share of the step)."""
    items = sorted(((v, k) for k, v in leaves.items() if v > 0), reverse=True)
    if not items:
        return empty("no prediction")
    df = pd.DataFrame(items, columns=["seconds", "leaf"]).iloc[::-1]
    fig = go.Figure(go.Bar(orientation="h", y=df["leaf"], x=df["seconds"] / step_s,
                           marker_color=[style.color(leaf) for leaf in df["leaf"]],
                           customdata=df["seconds"] * 1e3,
                           hovertemplate="%{y}: %{customdata:.4g} ms, %{x:.1%} of the step<extra></extra>"))
    fig.update_xaxes(title_text="share of the predicted step", tickformat=".0%", gridcolor="#eee")
    return _layout(fig, 120 + 28 * len(df), title=dict(text=title, font=dict(size=14)))


def _fix_label(fix: dict[str, Any]) -> str:
    """A fix's bar label, with its round where ``optimize --apply`` ran it in several (its run
    directory is ``<base>-opt-r<round>-<fix>-<i>``): the same change tried again on a better base
    is another bar, not the same bar twice."""
    found = re.search(r"-opt-r(\d+)-", Path(fix.get("run") or "").name)
    return (f"round {found.group(1)} · " if found else "") + f"{fix['fix']}: {fix['summary']}"


def predicted_vs_measured_fixes(fixes: list[dict[str, Any]]) -> go.Figure:
    """Each applied fix's predicted and measured step (s)."""
    if not fixes:
        return empty("no fix was run")
    labels = [_fix_label(f)[:80] for f in fixes][::-1]
    fig = go.Figure([
        go.Bar(orientation="h", y=labels, x=[f["measured_step_s"] for f in fixes][::-1], name="measured",
               marker_color="#3b6ea8", hovertemplate="%{x:.4g} s measured<extra></extra>"),
        go.Bar(orientation="h", y=labels, x=[f["predicted_step_s"] for f in fixes][::-1], name="predicted",
               marker_color="#e39b3b", hovertemplate="%{x:.4g} s predicted<extra></extra>")])
    fig.update_xaxes(title_text="step time (s)", gridcolor="#eee")
    return _layout(fig, 140 + 44 * len(fixes), barmode="group",
                   legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0))


def scaling_curves(curves: list[dict[str, Any]]) -> go.Figure:
    """Scaling efficiency against the device count, one line per curve (``{"name", "x", "y",
    "hover", "dash"}``): the cost model's predicted curve, and measured runs of one model at several
    sizes.  The x axis is logarithmic (sizes grow by factors)."""
    curves = [c for c in curves if any(y is not None for y in c["y"])]
    if not curves:
        return empty("no size has a layout that fits: no curve")
    colors = ["#3b6ea8", "#e39b3b", "#4f9a5b", "#a34f8f", "#7b8794"]
    fig = go.Figure([go.Scatter(x=c["x"], y=c["y"], name=c["name"], mode="lines+markers", connectgaps=False,
                                line=dict(color=colors[i % len(colors)], dash=c.get("dash", "solid")),
                                customdata=c["hover"],
                                hovertemplate="%{x} devices: %{y:.1%}<br>%{customdata}<extra>" + c["name"][:40]
                                              + "</extra>")
                     for i, c in enumerate(curves)])
    ticks = sorted({x for c in curves for x in c["x"]})
    fig.update_xaxes(type="log", title_text="GPUs (ranks)", gridcolor="#eee", tickvals=ticks,
                     ticktext=[f"{x:,}" for x in ticks])
    fig.update_yaxes(title_text="efficiency (tokens/s per device vs the smallest)", tickformat=".0%",
                     gridcolor="#eee", rangemode="tozero")
    return _layout(fig, 340, title=dict(text="Scaling efficiency", font=dict(size=14)),
                   legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1))
