"""MFU, step time and the deterministic counters over a workload's records, with each record's
verdict as the gate gave it then (against the records before it) and the change points marked:
``mfuscope ci trend``, the check's HTML report and the dashboard's Trend page draw this."""
from __future__ import annotations

from typing import Any

from . import deterministic, statistical
from . import statistics as st

COLORS = {"ok": "#4c78a8", "insufficient data": "#9ecae9", "suspicious": "#f58518", "regression": "#e45756"}


def series(records: list[dict[str, Any]], floor: float) -> list[dict[str, Any]]:
    """One point per record: index, commit, time, MFU (at one reference peak), step time, verdict."""
    peak = statistical.reference_peak(records)
    points, prev_violated = [], False
    for i, rec in enumerate(records):
        window = records[max(0, i - statistical.WINDOW):i]
        a = statistical.assess(window, rec, "mfu", floor)
        if a.baseline is None:
            a = statistical.assess(window, rec, "step_time_s", floor)
        verdict = ("insufficient data" if a.baseline is None else
                   "regression" if a.violated and prev_violated else "suspicious" if a.violated else "ok")
        prev_violated = a.violated
        mfu = statistical.samples(rec, "mfu", peak)
        step = statistical.samples(rec, "step_time_s", None)
        points.append({"index": i, "commit": rec.get("commit"), "time": rec.get("time"),
                       "branch": rec.get("branch"), "mfu": st.trimmed_mean(mfu) if len(mfu) else None,
                       "step_time_s": st.trimmed_mean(step) if len(step) else None, "verdict": verdict,
                       "counters": {k: v for k, (v, _) in deterministic.counter_values(rec).items()}})
    return points


def figure(records: list[dict[str, Any]], floor: float, title: str):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    pts = series(records, floor)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("MFU (at one reference peak)", "step time (s)",
                                        "deterministic counters (relative to the first record)"))
    x = [p["index"] for p in pts]
    labels = [f"{(p['commit'] or '?')[:10]}" for p in pts]
    for row, key in ((1, "mfu"), (2, "step_time_s")):
        fig.add_trace(go.Scatter(
            x=x, y=[p[key] for p in pts], mode="lines+markers", name=key, showlegend=False,
            marker={"color": [COLORS[p["verdict"]] for p in pts], "size": 8},
            line={"color": "#bbbbbb"}, customdata=[[p["index"], p["commit"] or "", p["verdict"]] for p in pts],
            text=labels, hovertemplate="%{text}<br>%{y:.4g}<br>%{customdata[2]}<extra></extra>"), row=row, col=1)
    names = sorted({k for p in pts for k in p["counters"]})
    for name in names:
        first = next((p["counters"][name] for p in pts if p["counters"].get(name)), None)
        if not first:
            continue
        ys = [None if p["counters"].get(name) is None else p["counters"][name] / first for p in pts]
        known = [y for y in ys if y is not None]
        if max(known) - min(known) < 1e-9 and len(names) > 8:
            continue  # an unchanged counter among many adds nothing but a line at 1
        fig.add_trace(go.Scatter(x=x, y=ys, mode="lines", name=name, text=labels,
                                 hovertemplate=f"{name}<br>%{{text}}: x%{{y:.3f}}<extra></extra>"), row=3, col=1)
    shifts: dict[int, list[dict[str, Any]]] = {}
    for metric in ("mfu", "step_time_s"):
        for cp in statistical.change_points(records, None, metric, floor):
            shifts.setdefault(cp["index"], []).append({**cp, "metric": metric})
    for index, cps in shifts.items():  # one line and one label per commit, however many metrics moved
        worse = any(c["worse"] for c in cps)
        fig.add_vline(x=index - 0.5, line={"dash": "dash", "color": "#e45756" if worse else "#54a24b"})
        fig.add_annotation(x=index - 0.5, y=1.0, yref="paper", showarrow=False, xanchor="right",
                           text=", ".join(f"{c['metric']} {c['shift']:+.1%}" for c in cps)
                           + f" from {(cps[0].get('commit') or '?')[:8]}")
    for verdict, color in COLORS.items():  # the legend of the marker colours
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker={"color": color, "size": 8},
                                 name=verdict), row=1, col=1)
    fig.update_layout(title=title, height=780, margin={"l": 60, "r": 20, "t": 80, "b": 40},
                      legend={"orientation": "h", "y": -0.08}, clickmode="event")
    fig.update_xaxes(title_text="record (oldest first)", row=3, col=1)
    return fig


def html(records: list[dict[str, Any]], floor: float, title: str, extra_markdown: str = "") -> str:
    """A self-contained page: plotly's JavaScript inline (no CDN), the figure, the check's table."""
    import html as html_mod

    import plotly.io as pio

    body = pio.to_html(figure(records, floor, title), include_plotlyjs=True, full_html=False)
    table = f"<pre>{html_mod.escape(extra_markdown)}</pre>" if extra_markdown else ""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html_mod.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif'>{table}{body}</body></html>")
