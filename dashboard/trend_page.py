"""The Trend page: a CI history (``mfuscope ci record``) over commits, and one record held
against its baseline.

``/trend?workload=W`` draws MFU, step time and the deterministic counters of
the workload's newest environment over its records, each point coloured by
the verdict the gate gave it then, change points marked.  Clicking a point
opens ``/trend/record?workload=W&index=I``: that commit checked against the
records before it -- the same gates and tables as ``mfuscope ci check`` --
and, where both runs are in this dashboard, a link to Compare them run to run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from dash import dcc, html

from mfuscope.errors import UserInputError
from mfuscope.regression import check as check_mod
from mfuscope.regression import history as hist
from mfuscope.regression import trend

from . import style
from .pages import grid, info_panel

FLOOR = 0.02


def _records(history: Path, workload: str) -> tuple[list[dict[str, Any]], str]:
    """The workload's main-branch records (all branches if main has none) of its newest environment."""
    h = hist.read(history, hist.check_workload_name(workload))
    if not h.records:
        raise UserInputError(f"no records for workload {workload!r}", h.path)
    fp_id = h.records[-1]["fingerprint_id"]
    main = h.matching(fp_id, "main")
    return (main, "main") if main else (h.matching(fp_id, None), "all branches")


def page(history: Path | None, query: dict[str, str]) -> html.Div:
    head = [html.H2("Trend")]
    if history is None:
        return html.Div(head + [info_panel("Start the dashboard with --history DIR (the directory ",
                                           html.Code("mfuscope ci record"), " appends to) to see trends.")])
    names = list(hist.workloads(history))
    if not names:
        return html.Div(head + [info_panel(f"No workload histories (*.jsonl) in {history} yet.")])
    workload = query.get("workload") or names[0]
    records, scope = _records(history, workload)
    picker = dcc.Dropdown(id="trend-workload", options=[{"label": n, "value": n} for n in names], value=workload,
                          clearable=False, style={"width": "320px"})
    fig = trend.figure(records, FLOOR, f"{workload}: {len(records)} records ({scope})")
    return html.Div(head + [
        html.Div([html.Span("workload "), picker], style={"display": "flex", "alignItems": "center", "gap": "8px"}),
        html.P("Each point is a recorded run, coloured by the verdict the gate gave it against the runs before "
               "it; dashed lines are change points. Click a point to check that commit against its baseline.",
               className="muted"),
        dcc.Graph(id="trend-graph", figure=fig, config={"displaylogo": False}),
    ])


def record_url(workload: str, index: int) -> str:
    return "/trend/record?" + urlencode({"workload": workload, "index": index})


def record_page(history: Path | None, query: dict[str, str], run_ids: set[str]) -> html.Div:
    if history is None:
        raise UserInputError("the dashboard has no --history")
    workload = query.get("workload") or ""
    records, _ = _records(history, workload)
    try:
        index = int(query.get("index", ""))
        current = records[index]
    except (ValueError, IndexError):
        raise UserInputError(f"no record {query.get('index')!r} of workload {workload!r}") from None
    before = hist.History(history, records[:index], [])
    result = check_mod.check(before, current, branch=None, floor=FLOOR)
    base = records[index - 1] if index else None
    head = [html.H2(f"{workload} @ {(current.get('commit') or '?')[:12]}"),
            html.P(f"{current.get('time') or ''} · branch {current.get('branch') or '?'} · checked against the "
                   f"{result['matching_records']} record(s) before it: {result['status']}", id="trend-status"),
            dcc.Link("back to the trend", href="/trend?" + urlencode({"workload": workload}))]
    if base is not None:
        a, b = (base.get("run") or {}).get("id"), (current.get("run") or {}).get("id")
        if a in run_ids and b in run_ids:
            head += [" · ", dcc.Link("compare the two runs", href="/compare?" + urlencode({"a": a, "b": b}),
                                     id="trend-compare-runs")]
    stat_rows = [{"metric": r["metric"], "baseline": _fmt(r["metric"], r["baseline"]),
                  "current": _fmt(r["metric"], r["current"]),
                  "worse by": style.signed_percent(r["drop"]), "limit": style.signed_percent(r["limit"]),
                  "verdict": r["verdict"], "p-value": "–" if r["p_value"] is None else f"{r['p_value']:.2g}"}
                 for r in result["statistical"]]
    det_rows = [{"counter": r["metric"], "baseline": r["baseline"], "current": r["current"],
                 "change": style.signed_percent(r["change"]), "verdict": r["verdict"], "why": r["why"]}
                for r in result["deterministic"]["rows"] if r["verdict"] != "ok"]
    leaves = [{"leaf": r["leaf"], "baseline_ms": r["baseline_s"] * 1e3, "current_ms": r["current_s"] * 1e3,
               "delta_ms": r["delta_s"] * 1e3} for r in result["leaves_moved"]]
    cols = [{"field": k} for k in ("metric", "baseline", "current", "worse by", "limit", "verdict", "p-value")]
    return html.Div(head + [
        html.H3("Measured (noise-aware gate)"), grid("trend-stat", stat_rows, cols),
        html.H3("Deterministic counters (against the previous record)"),
        grid("trend-det", det_rows, [{"field": k} for k in ("counter", "baseline", "current", "change", "verdict",
                                                            "why")]) if det_rows else
        info_panel("No counter changed." if base is not None else "The first record: nothing to hold it against."),
        html.H3("Breakdown leaves that moved most (per step)"),
        grid("trend-leaves", leaves, [{"field": "leaf"}, {"field": "baseline_ms"}, {"field": "current_ms"},
                                      {"field": "delta_ms"}]) if leaves else info_panel("No baseline yet."),
    ])


def _fmt(metric: str, v: float | None) -> str:
    if v is None:
        return "–"
    return style.percent(v) if metric == "mfu" else style.seconds(v)
