"""One function per page: (store, run, analysis, query) -> Dash components.

Pages only arrange what the analysis computed; figures come from
:mod:`figures`, numbers are formatted by :mod:`style`.  Interactive parts (a
clicked breakdown node, the timeline's step and zoom, the compare pair) are
filled by callbacks in :mod:`app`; the ids they use are defined here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import dash_ag_grid as dag
import pandas as pd
from dash import dcc, html

from mfuscope import run_dir
from mfuscope.analyzers import compare as compare_reports
from mfuscope.analyzers import hang, health, memory, run_info
from mfuscope.analyzers.breakdown import kernel_kind
from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest
from mfuscope.optimizers import planner, presets, run_prediction, scaling
from mfuscope.optimizers.spec import Training
from mfuscope.optimizers.system import SYSTEMS, default_profile, system

from . import figures, style
from .store import Analysis, Run, Store, manifest_text, status_text, trace_set_text

NUM = {"function": "params.value == null ? '–' : d3.format(',.4~g')(params.value)"}
#: Bytes, whole, with thousands separators.
BYTES = {"function": "params.value == null ? '–' : d3.format(',')(params.value)"}
#: Wrapped cells: several lines at text spacing, not one line per row height.
WRAP = {"wrapText": True, "autoHeight": True,
        "cellStyle": {"lineHeight": "1.45", "paddingTop": "9px", "paddingBottom": "9px"}}
PCT = {"function": "params.value == null ? '–' : (Math.abs(params.value) >= 0.01 || params.value == 0 ? "
                   "d3.format('.1%')(params.value) : d3.format('.2~p')(params.value))"}


def grid(id_: str, rows: list[dict[str, Any]], columnDefs: list[dict[str, Any]], height: int | None = None,
         **kw: Any) -> dag.AgGrid:
    for c in columnDefs:  # the grid would capitalize bare field names; keep ours as written
        c.setdefault("headerName", c["field"].replace("_", " "))
    short = height is None and len(rows) <= 25  # short tables grow to fit; long ones scroll
    options = {"domLayout": "autoHeight"} if short else {}
    options.update(kw.pop("dashGridOptions", {}))
    kw.setdefault("defaultColDef", {"sortable": True, "filter": True, "resizable": True, "minWidth": 80})
    return dag.AgGrid(id=id_, rowData=rows, columnDefs=columnDefs, columnSize="responsiveSizeToFit",
                      dashGridOptions=options, style={"height": None if short else (height or 600)},
                      className="ag-theme-alpine", **kw)


def _md_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\`*_{}[]()#+-.!<>|" else c for c in text)


def card(label: str, value: str, note: Any = "") -> html.Div:
    return html.Div([html.Div(label, className="label"), html.Div(value, className="value"),
                     html.Div(note, className="note")], className="card")


def error_panel(message: str) -> html.Div:
    return html.Div(message, className="error-panel", role="alert")


def info_panel(*children: Any) -> html.Div:
    return html.Div(list(children), className="info-panel")


def progress_panel(run: Run, fraction: float, message: str) -> html.Div:
    return html.Div([html.H2(f"Analyzing {run.id}"),
                     html.P(f"{run.path}: first visit, so every rank's trace is read and analyzed once; "
                            "later visits read the stored result."),
                     html.Progress(value=f"{fraction:.3f}", max="1", id="analysis-progress"),
                     html.Div(f"{message} ({fraction:.0%})", className="muted", id="analysis-message")])


def rank_labels(manifest: dict | None, ranks) -> dict[int, str]:
    m = Manifest.of(manifest)
    coords = m.rank_coords
    shown = [d for d, n in m.layout.items() if n > 1]
    out = {}
    for r in sorted(int(x) for x in ranks):
        c = coords.get(r) or {}
        extra = " ".join(f"{d}{c[d]}" for d in shown if d in c)
        out[r] = f"rank {r}" + (f" · {extra}" if extra else "")
    return out


def why_stopped(run: Run) -> html.Div | None:
    """For a run that ended early: where its collectives stopped and which rank crashed, as
    ``mfuscope hang RUN`` says it (from the ranks' write-ahead records and fatal-signal stacks);
    None for a run that ended normally, or one without records."""
    m = Manifest.of(run.manifest)
    if run.kind != "run" or (m.status != "ended_early" and not hang.read_fatal(run.path)):
        return None
    try:
        result = hang.diagnose(*hang.read_dumps(run.path), hang.run_group_dims(run.path))
    except UserInputError as e:
        return error_panel(f"This run ended early ({m.ended_reason or 'no reason recorded'}); its records cannot "
                           f"say where: {e}")
    return html.Div([
        html.H3("Why the run stopped"),
        html.P(f"It ended early (the first rank to say why: {m.ended_reason or 'no reason recorded'}). Where "
               f"every rank's collectives stopped, and a rank that crashed (mfuscope hang {run.path}):",
               style={"overflowWrap": "anywhere"}),
        html.Pre(hang.format_text(result), style={"whiteSpace": "pre-wrap", "overflowWrap": "anywhere"}),
    ], className="error-panel", id="why-stopped")


def no_traces_page(run: Run) -> html.Div:
    """A run directory without a trace window: what the always-on collectors recorded."""
    info = run_info.summarize(run.path)
    return html.Div([
        html.H2(f"{run.id}: no traces"),
        why_stopped(run),
        info_panel("This run recorded no torch.profiler window, so there is no breakdown or timeline to show. "
                   "Record one with mfuscope train --profile / --window S:N, mfuscope profile --window S:N, or "
                   "mfuscope.profile(..., window='S:N')."),
        html.P(["Its health over every step (slow episodes, rank scores) is on the ",
                dcc.Link("Health", href=f"/run/{quote(run.id)}/health"), " page."]),
        html.H3("What the always-on collectors recorded"),
        html.Pre(run_info.format_text(info), id="run-info"),
    ])


# ----------------------------------------------------------------------------- runs
def runs_page(store: Store) -> html.Div:
    runs = store.runs()
    rows, broken = [], []
    for run in runs:
        summary = store.summary(run)
        text = manifest_text(run.manifest) if run.kind == "run" else trace_set_text(run)
        rows.append({
            "run": f"[{_md_escape(run.id)}](/run/{quote(run.id)})", "id": run.id, **text,
            "world": Manifest.of(run.manifest).raw.get("world_size") or (summary or {}).get("world_size"),
            "mfu": (summary or {}).get("mfu"), "step_ms": ((summary or {}).get("step_time_s") or 0) * 1e3 or None,
            "status": status_text(run, run.manifest) + ("" if summary or run.error else " (not analyzed yet)"),
        })
        if run.error:
            broken.append(html.Li([html.B(run.id), f": {run.error}"]))
    columns = [
        {"field": "run", "headerName": "run", "cellRenderer": "markdown", "minWidth": 160},
        {"field": "date", "headerName": "date (UTC)", "minWidth": 175}, {"field": "config"},
        {"field": "layout", "minWidth": 220, **WRAP},
        {"field": "world", "headerName": "world size", "type": "numericColumn"},
        {"field": "mfu", "headerName": "MFU", "valueFormatter": PCT, "type": "numericColumn"},
        {"field": "step_ms", "headerName": "step time (ms)", "valueFormatter": NUM, "type": "numericColumn"},
        {"field": "status", "minWidth": 200, **WRAP},
    ]
    table = grid("runs-grid", rows, columns, getRowId="params.data.id",
                 dashGridOptions={"rowSelection": {"mode": "multiRow", "checkboxes": True, "headerCheckbox": False,
                                                    "enableClickSelection": False}})
    return html.Div([
        html.H2(f"Runs in {store.root}"),
        html.P("Open a run by its name; tick two to compare them.", className="muted"),
        table if rows else info_panel(f"No runs under {store.root}: a run is a directory with manifest.json "
                                      "(mfuscope train / profile) or a directory of rank trace files."),
        html.Div([dcc.Link("Compare the two ticked runs", id="compare-link", href="/compare", className="muted")],
                 style={"marginTop": "8px"}),
        html.Div([html.H3("Runs that cannot be shown"), html.Ul(broken)], className="error-panel",
                 id="broken-runs") if broken else None,
    ])


# ----------------------------------------------------------------------------- overview
def overview_page(store: Store, run: Run, a: Analysis) -> html.Div:
    r = a.report
    s = r["summary"]
    peak = f"peak {style.rate(s.get('peak_flops'), 'FLOP/s')} ({s.get('peak_source')})" if s.get("peak_flops") else ""
    cards = [
        card("MFU", style.percent(s.get("mfu")), s.get("mfu_note") or f"FLOPs from {s.get('flops_source') or '–'}"),
        card("HFU", style.percent(s.get("hfu")), "with recomputation"),
        card("tokens/s", style.rate(s.get("tokens_per_s"), "tok/s") if s.get("tokens_per_s") else "–", "whole job"),
        card("FLOP/s per device", style.rate(s["tflops_per_device"] * 1e12, "FLOP/s")
             if s.get("tflops_per_device") is not None else "–", peak),
        card("step time", style.seconds(s.get("step_time_s")),
             f"p50 {style.seconds(s.get('step_time_p50_s'))} · p90 {style.seconds(s.get('step_time_p90_s'))}"),
        card("ranks", f"{s.get('ranks')}", f"world size {s.get('world_size') or '?'} · {s.get('device') or '?'}"),
        card("steps timed", f"{s.get('steps')}", f"{_traced_steps(r)} in the trace window · "
             + (f"run {s['status']}" if s.get("status") else "from traces")),
    ]
    saves = r.get("checkpoints") or {}
    if saves.get("count"):
        cards.append(card("goodput", style.percent(s.get("goodput")),
                          f"{saves['count']} checkpoint save(s) blocked {style.seconds(saves['blocking_s'])} of "
                          f"{style.seconds(saves['wall_s'])}"))
    mem = r.get("memory") or {}
    if mem.get("peak_allocated_bytes") is not None:
        cards.append(card("peak memory", style.size(mem["peak_allocated_bytes"]),
                          dcc.Link(f"rank {mem['peak_rank']}: see Memory", href=f"/run/{quote(run.id)}/memory")))
    model = _model_gains(store, run)
    findings = [{"gain_ms": f["gain_s"] * 1e3, "gain": f["gain_fraction"], "title": f["title"], "fix": f["fix"],
                 "model_gain": model[f["fix"]].predicted_gain if f["fix"] in model else None,
                 "model_change": model[f["fix"]].change.summary if f["fix"] in model else None}
                for f in r.get("findings") or []]
    episodes = (r.get("health") or {}).get("episodes") or []
    slow = info_panel(
        f"The run had {len(episodes)} slow episode(s) outside and inside the traced window; the costliest, "
        f"steps {episodes[0]['onset_step']}–{episodes[0]['end_step']} ({episodes[0]['class'].replace('_', '-')}, "
        f"{episodes[0]['cost_s']:.3g} s): {episodes[0]['why']}. ",
        dcc.Link("See Health", href=f"/run/{quote(run.id)}/health")) if episodes else None
    return html.Div([
        html.H2(f"Overview: {run.id}"),
        why_stopped(run),
        html.Div(cards, className="cards", id="summary-cards"),
        html.Div(slow, id="health-banner"),
        html.Div([
            html.Div(dcc.Graph(id="breakdown", figure=figures.breakdown_icicle(r.get("breakdown")),
                               config={"displaylogo": False})),
            html.Div(dcc.Graph(id="step-trend", figure=figures.step_trend(_per_step(r)),
                               config={"displaylogo": False})),
        ], className="row"),
        html.Div(info_panel("Click a box of the breakdown to see it per rank."), id="node-detail"),
        _prediction_section(store, run),
        html.H3("Top findings (what-if gain per step: the cause's time on each rank's timeline)"),
        html.P("The what-if gain bounds what the cause could give back; where the run has a model spec, "
               "the cost model's predicted gain for the fix's best change (calibrated on this run) stands beside "
               "it. The Optimize page lists every change.", className="muted") if model else None,
        info_panel(f"No per-step finding: {s['findings_note']}") if s.get("findings_note") else None,
        grid("findings-grid", findings, [
            {"field": "gain_ms", "headerName": "what-if gain (ms/step)", "valueFormatter": NUM, "sort": "desc",
             "minWidth": 150, "maxWidth": 200},
            {"field": "gain", "headerName": "of the step", "valueFormatter": PCT, "maxWidth": 130},
            {"field": "title", "headerName": "finding", "minWidth": 320},
            {"field": "fix", "headerName": "fix id", "maxWidth": 200}]
            + ([{"field": "model_gain", "headerName": "cost model: predicted gain", "valueFormatter": PCT,
                 "maxWidth": 190},
                {"field": "model_change", "headerName": "its change", "minWidth": 220, **WRAP}] if model else []))
        if findings else
        info_panel("No findings: nothing exceeded a finding's threshold."),
    ])


def _model_gains(store: Store, run: Run) -> dict:
    """Fix id -> the cost model's best proposal, for a run with a model spec (else empty)."""
    if not Manifest.of(run.manifest).has_model_spec:
        return {}
    try:
        return store.cost_model(run).best_by_fix()
    except (UserInputError, ValueError, KeyError):
        return {}


def _prediction_section(store: Store, run: Run) -> html.Div | None:
    """Predicted against measured leaves, for a run whose manifest has the model spec."""
    if not Manifest.of(run.manifest).has_model_spec:
        return None
    try:
        model = store.cost_model(run)
        c = run_prediction.compare_run(model.run, fitted=model.profile)
    except (UserInputError, ValueError, KeyError) as e:
        return info_panel(f"No cost-model prediction for this run: {e}")
    rows = [{**r, "ratio": r["predicted_s"] / r["measured_s"] if r["measured_s"] and r["predicted_s"] else None}
            for r in c.rows]
    return html.Div([
        html.H3("Cost model: predicted against measured"),
        html.P(f"{c.note}; layout {planner.describe(c.run.layout)}", className="note"),
        html.Div([
            html.Div(dcc.Graph(id="prediction-bars", figure=figures.predicted_vs_measured(c.rows),
                               config={"displaylogo": False})),
            html.Div(grid("prediction-grid", rows, [
                {"field": "leaf", "minWidth": 200},
                {"field": "measured_s", "headerName": "measured (s)", "valueFormatter": NUM},
                {"field": "predicted_s", "headerName": "predicted (s)", "valueFormatter": NUM},
                {"field": "ratio", "headerName": "predicted / measured", "valueFormatter": NUM}])),
        ], className="row"),
    ], id="prediction")


# ----------------------------------------------------------------------------- planner
PLAN_DEFAULTS = {"model": "llama3-70b", "gpus": "1024", "gpu": "H100", "batch": "2048", "seq": "8192",
                 "dtype": "bf16", "scaling": "8,64,512,4096,16384"}


def planner_page(query: dict[str, str], store: Store | None = None) -> html.Div:
    """Model, GPUs and device in; the ranked layouts and each one's predicted breakdown out, with the
    predicted scaling curve (and the measured one of the dashboard's runs of one model at several
    sizes, where there are such)."""
    q = {**PLAN_DEFAULTS, **{k: v for k, v in query.items() if k in PLAN_DEFAULTS}}
    form = html.Div([
        html.Label(["model", dcc.Dropdown(presets.names(), q["model"], id="plan-model", clearable=False)]),
        html.Label(["GPUs", dcc.Input(id="plan-gpus", type="number", min=1, value=int(q["gpus"]))]),
        html.Label(["device", dcc.Dropdown(sorted(SYSTEMS), q["gpu"], id="plan-gpu", clearable=False)]),
        html.Label(["global batch (sequences)", dcc.Input(id="plan-batch", type="number", min=1,
                                                          value=int(q["batch"]))]),
        html.Label(["sequence length", dcc.Input(id="plan-seq", type="number", min=1, value=int(q["seq"]))]),
        html.Label(["dtype", dcc.Dropdown(["bf16", "fp8"], q["dtype"], id="plan-dtype", clearable=False)]),
        html.Label(["scaling curve at GPUs", dcc.Input(id="plan-scaling", type="text", value=q["scaling"])]),
        html.Button("Plan", id="plan-go", n_clicks=0),
    ], className="plan-form")
    head = [html.H2("Planner"), html.P("The cost model searched over tp, cp, pp (with its schedule), data "
                                       "sharding, ep, micro-batch size and recompute; layouts that do not fit in "
                                       "memory are pruned first.", className="note"), form]
    measured_section = _measured_scaling(store) if store is not None else None
    if "model" not in query:
        return html.Div(head + [info_panel("Choose a model, GPUs and device, then Plan."), measured_section])
    try:
        model = presets.load(q["model"])
        gpus, batch, seq = int(q["gpus"]), int(q["batch"]), int(q["seq"])
        if min(gpus, batch, seq) < 1:
            raise UserInputError("GPUs, global batch and sequence length must be positive")
        sys_, training = system(q["gpu"]), Training(seq_len=seq, dtype=q["dtype"], compiled=True)
        result = planner.plan(model, gpus, sys_, batch, training, default_profile(), 10)
    except (UserInputError, ValueError) as e:
        return html.Div(head + [error_panel(str(e))])
    rows = [{"rank": i, "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "mfu": p.mfu,
             "memory_gib": p.memory.total_bytes / 2**30, "layout": planner.describe(lay),
             "leaves": {k: v for k, v in p.leaves.items() if v > 0}, "step_s": p.step_s}
            for i, (lay, p) in enumerate(result.ranked, 1)]
    rejected = [{"reason": k, "layouts": v, "example": result.examples[k]} for k, v in result.rejected.most_common()]
    first = rows[0] if rows else None
    return html.Div(head + [
        html.P(f"{result.considered} layouts considered on {gpus} x {q['gpu']}"
               + ("; TP had to span nodes: nothing fits with TP inside a node" if result.tp_across_nodes else ""),
               className="note", id="plan-summary"),
        html.Div([
            html.Div(grid("plan-grid", rows, [
                {"field": "rank", "maxWidth": 80},
                {"field": "tokens_per_s_per_gpu", "headerName": "tokens/s per GPU", "valueFormatter": NUM,
                 "minWidth": 150},
                {"field": "mfu", "headerName": "MFU", "valueFormatter": PCT, "minWidth": 90, "maxWidth": 110},
                {"field": "memory_gib", "headerName": "GiB per GPU", "valueFormatter": NUM, "minWidth": 120},
                {"field": "layout", "minWidth": 380, **WRAP}], dashGridOptions={"rowSelection": "single"}))
            if rows else error_panel("No layout fits: see why below."),
            html.Div(dcc.Graph(id="plan-breakdown", figure=figures.predicted_leaves(
                first["leaves"], first["step_s"], f"#1: {first['layout']}") if first else figures.empty("–"),
                config={"displaylogo": False})),
        ], className="row"),
        html.H3("Not chosen, and why"),
        grid("plan-rejected", rejected, [{"field": "reason", "minWidth": 260}, {"field": "layouts", "maxWidth": 110},
                                         {"field": "example", "minWidth": 420, **WRAP}]),
        _predicted_scaling(model, gpus, sys_, batch, training, q["scaling"]),
        measured_section,
    ])


def _lost_text(lost: dict[str, float] | None, k: int = 3) -> str:
    return ", ".join(f"{leaf} +{style.seconds(v)}" for leaf, v in list((lost or {}).items())[:k] if v > 0)


def _predicted_scaling(model, gpus: int, sys_, batch: int, training: Training,
                       sizes_text: str) -> html.Div | None:
    """The cost model's weak-scaling curve (``mfuscope plan --scaling``): the best layout at each
    GPU count, sequences per GPU held; nothing where no GPU count is asked for."""
    if not sizes_text.strip():
        return None
    head = [html.H3("Predicted scaling"),
            html.P(f"Weak scaling: {batch / gpus:.4g} sequences per GPU at every size (the global batch grows with "
                   "the GPUs); efficiency is the best layout's tokens/s per GPU over the first size's, and the lost "
                   "time is each leaf's growth over that size's step (docs/cost_model.md, Scaling).",
                   className="note")]
    try:
        rows = scaling.predicted(model, gpus, sys_, batch, training, default_profile(),
                                 scaling.parse_sizes(sizes_text))
    except (UserInputError, ValueError) as e:
        return html.Div(head + [error_panel(str(e))], id="plan-scaling-section")
    curve = {"name": "predicted (best layout at each size)", "x": [r["gpus"] for r in rows],
             "y": [r["efficiency"] for r in rows], "hover": [r["layout"] or r.get("note", "") for r in rows]}
    table = [{"gpus": r["gpus"], "global_batch": r["global_batch"], "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
              "mfu": r["mfu"], "efficiency": r["efficiency"], "layout": r["layout"] or r.get("note", ""),
              "lost": _lost_text(r["loss_by_leaf"])} for r in rows]
    return html.Div(head + [
        dcc.Graph(id="plan-scaling", figure=figures.scaling_curves([curve]), config={"displaylogo": False}),
        grid("plan-scaling-grid", table, [
            {"field": "gpus", "headerName": "GPUs", "minWidth": 90, "maxWidth": 110},
            {"field": "global_batch", "headerName": "global batch", "minWidth": 120, "maxWidth": 140},
            {"field": "tokens_per_s_per_gpu", "headerName": "tokens/s per GPU", "valueFormatter": NUM,
             "minWidth": 150, "maxWidth": 170},
            {"field": "mfu", "headerName": "MFU", "valueFormatter": PCT, "minWidth": 90, "maxWidth": 100},
            {"field": "efficiency", "valueFormatter": PCT, "minWidth": 110, "maxWidth": 120},
            {"field": "layout", "minWidth": 300, **WRAP},
            {"field": "lost", "headerName": "lost time, largest leaves", "minWidth": 300, **WRAP}]),
    ], id="plan-scaling-section")


def _measured_scaling(store: Store) -> html.Div | None:
    """The dashboard's analyzed runs of one model (spec, sequence length, device) at two sizes or
    more, each group's scaling against its smallest run (``mfuscope scaling``); None where there
    are none.  Runs not analyzed yet are left out (they are analyzed when opened)."""
    groups: dict[str, list[scaling.Point]] = {}
    for run in store.runs():
        m = Manifest.of(run.manifest)
        if run.error or run.kind != "run" or not m.has_model_spec or not store.analyzed(run):
            continue
        spec = m.model or {}
        key = (f"{spec.get('family', 'model')} dim={spec.get('dim')} layers={spec.get('n_layers')}, "
               f"seq {m.train.get('seq_len')}, {m.device_name}")
        try:
            groups.setdefault(key, []).append(scaling.point(store.report(run), run.manifest, run.id))
        except (UserInputError, KeyError, TypeError, ValueError):  # a report it cannot read: not on the curve
            continue
    curves, rows, notes = [], [], []
    for key, points in sorted(groups.items()):
        if len({p.ranks for p in points}) < 2:
            continue
        try:
            result = scaling.measured(points)
        except UserInputError as e:
            notes.append(html.Li(f"{key}: {e}"))
            continue
        name = f"measured, {result['mode']}: {key}"
        curves.append({"name": name, "x": [r["ranks"] for r in result["rows"]],
                       "y": [r["efficiency"] for r in result["rows"]], "hover": [r["run"] for r in result["rows"]],
                       "dash": "dot" if result["mode"] == "strong" else "solid"})
        rows += [{"model": key, "mode": result["mode"], "run": r["run"], "ranks": r["ranks"],
                  "tokens_per_s_per_device": r["tokens_per_s_per_device"], "efficiency": r["efficiency"],
                  "lost": _lost_text(r["loss_by_leaf"])} for r in result["rows"]]
    if not curves and not notes:
        return None
    return html.Div([
        html.H3("Measured scaling of these runs"),
        html.P("Analyzed runs of one model at several sizes, against the smallest: weak scaling where every run "
               "has the same tokens per device per step, strong where the same tokens per step "
               "(`mfuscope scaling RUN_DIR...` prints the same, with every leaf).", className="note"),
        dcc.Graph(id="measured-scaling", figure=figures.scaling_curves(curves),
                  config={"displaylogo": False}) if curves else None,
        grid("measured-scaling-grid", rows, [
            {"field": "model", "minWidth": 220, **WRAP}, {"field": "mode", "minWidth": 90, "maxWidth": 100},
            {"field": "run", "minWidth": 140}, {"field": "ranks", "minWidth": 80, "maxWidth": 90},
            {"field": "tokens_per_s_per_device", "headerName": "tokens/s per device", "valueFormatter": NUM,
             "minWidth": 160, "maxWidth": 180},
            {"field": "efficiency", "valueFormatter": PCT, "minWidth": 110, "maxWidth": 120},
            {"field": "lost", "headerName": "lost time, largest leaves", "minWidth": 300, **WRAP}])
        if curves else None,
        html.Ul(notes, className="note") if notes else None,
    ], id="measured-scaling-section")


# ----------------------------------------------------------------------------- optimize
def optimize_page(store: Store, run: Run, a: Analysis) -> html.Div:
    """The fix catalogue's proposals for this run, ranked by predicted gain; once `mfuscope optimize
    --apply` has run (its optimize.json beside the run), predicted against measured per fix."""
    head = [html.H2(f"Optimize: {run.id}")]
    if not Manifest.of(run.manifest).has_model_spec:
        return html.Div(head + [info_panel("No model spec in this run's manifest: the cost model cannot predict "
                                           "its fixes. Runs of the reference trainer (mfuscope train) have one.")])
    try:
        model = store.cost_model(run)
    except (UserInputError, ValueError, KeyError) as e:
        return html.Div(head + [error_panel(f"No proposals for this run: {e}")])
    rows = [{"fix": p.change.fix, "change": p.change.summary, "predicted_step_s": p.predicted_step_s,
             "predicted_gain": p.predicted_gain, "memory_gib": p.memory_gib, "note": p.note,
             "trainer": " ".join(f"{k}={v}" for k, v in p.change.trainer.items())} for p in model.proposals]
    body = head + [
        html.P(f"Measured step {style.seconds(a.report['summary'].get('step_time_s'))}; predicted "
               f"{style.seconds(model.base.step_s)} with the cost model calibrated on this run. Apply with "
               f"`mfuscope optimize {run.path} --apply`.", className="note"),
        grid("optimize-grid", rows, [
            {"field": "fix", "maxWidth": 200}, {"field": "change", "minWidth": 320, **WRAP},
            {"field": "predicted_step_s", "headerName": "predicted step (s)", "valueFormatter": NUM},
            {"field": "predicted_gain", "headerName": "predicted gain", "valueFormatter": PCT},
            {"field": "memory_gib", "headerName": "GiB per GPU", "valueFormatter": NUM},
            {"field": "trainer", "headerName": "trainer options", "minWidth": 200, **WRAP},
            {"field": "note", "minWidth": 160, **WRAP}]) if rows else
        info_panel("No fix applies to this run."),
    ]
    applied = _applied(run)
    if applied:
        done = [f for f in applied["fixes"] if f.get("measured_step_s") is not None]
        final = applied["final"]
        body += [html.H3("Applied: predicted against measured"),
                 html.P(f"Base {style.seconds(applied['base_step_s'])} → final "
                        f"{style.seconds(final['measured_step_s'])} with {', '.join(final['fixes']) or 'no change'}",
                        className="note", id="optimize-final"),
                 dcc.Graph(id="optimize-bars", figure=figures.predicted_vs_measured_fixes(done),
                           config={"displaylogo": False}),
                 html.Ul([html.Li([f"{f['fix']}: {f['summary']} → ", html.Code(f["run"]), " ",
                                   _compare_link(run.id, f["run"], f"{f['fix']}: {f['summary']}")]) for f in done]
                         + ([html.Li(["final: ", _compare_link(run.id, final["run"], ", ".join(final["fixes"]),
                                                               "before and after, leaf by leaf")],
                                     id="optimize-final-compare")] if final["fixes"] else []),
                         id="optimize-runs")]
    return html.Div(body)


def _compare_link(base_id: str, new_run: str, fix: str, text: str = "compare") -> dcc.Link:
    """The Compare page of the base and a run a fix made, with the fix named (runs made by
    ``optimize --apply`` sit beside the base, so their directory name is their id)."""
    query = urlencode({"a": base_id, "b": Path(new_run).name, "fix": fix})
    return dcc.Link(text, href=f"/compare?{query}", className="compare-fix-link")


def _applied(run: Run) -> dict | None:
    path = run.path / "optimize.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def _traced_steps(report: dict) -> int:
    return len({row["step"] for row in report.get("straggler_matrix") or []})


def _per_step(report: dict) -> list[dict[str, Any]]:
    """Step times (and MFU) per step; for a trace set without collector tables, the slowest rank's
    step span from the breakdown."""
    if report.get("per_step"):
        return report["per_step"]
    m = pd.DataFrame(report.get("straggler_matrix") or [], columns=["step", "step_s"])
    return [{"step": int(k), "step_time_s": float(v)} for k, v in m.groupby("step")["step_s"].max().items()]


def node_detail(a: Analysis, node: str) -> html.Div:
    """A clicked breakdown node: its time per step, and per rank."""
    by_rank = pd.DataFrame(a.report.get("breakdown_by_rank") or [], columns=["rank", "leaf", "seconds"])
    inside = (by_rank[(by_rank["leaf"] == node) | by_rank["leaf"].str.startswith(node + "/")] if node != "step"
              else by_rank)
    per_rank = inside.groupby("rank", as_index=False)["seconds"].sum()
    tree = a.report.get("breakdown") or {}
    total = tree.get("seconds") or 0.0
    seconds = _node_seconds(tree, node)
    return html.Div([
        html.H3(f"{node}: {style.seconds(seconds)} per step ({style.percent(seconds / total if total else None)} "
                "of the step)", id="node-title"),
        dcc.Graph(figure=figures.rank_bars(per_rank, node), config={"displaylogo": False}),
    ])


def _node_seconds(node: dict, name: str) -> float:
    if node.get("name") == name:
        return node.get("seconds", 0.0)
    for c in node.get("children") or []:
        v = _node_seconds(c, name)
        if v:
            return v
    return 0.0


# ----------------------------------------------------------------------------- timeline
#: Up to this many ranks the timeline has a lane a rank; beyond, a lane a group of ranks.
LANE_RANKS = 64
#: Lanes of grouped ranks when the layout has no pipeline stages to group by.
LANE_GROUPS = 32


def timeline_page(run: Run, a: Analysis, query: dict[str, str]) -> html.Div:
    steps = a.steps
    if not steps:
        return info_panel("No step markers in these traces, so no per-step timeline.")
    step = int(query["step"]) if query.get("step", "").lstrip("-").isdigit() and int(query["step"]) in steps \
        else steps[len(steps) // 2]
    rank = query.get("rank")
    rank = int(rank) if rank is not None and rank.isdigit() else None
    grouped = len(a.ranks) > LANE_RANKS
    controls: list[Any] = [html.Span("step "), dcc.Dropdown(id="timeline-step", options=[
        {"label": f"step {s}", "value": s} for s in steps], value=step, clearable=False, style={"width": "160px"})]
    # drill-down at scale: one rank's own lane, read from its view (the input is always there, for
    # its callback, and shown only where lanes are groups)
    shown = {} if grouped else {"display": "none"}
    controls += [html.Span("rank ", style=shown),
                 dcc.Input(id="timeline-rank-input", type="number", min=min(a.ranks, default=0),
                           max=max(a.ranks, default=0), step=1, value=rank, debounce=True, placeholder="any rank",
                           style={"width": "110px", **shown})]
    return html.Div([
        html.H2(f"Timeline: {run.id}" + (f" — rank {rank}, step {step}" if rank is not None else ""),
                id="timeline-title"),
        html.P(f"{len(a.ranks):,} ranks: a lane a group of ranks ({'pipeline stage' if _stages(run, a) else 'block'}"
               "), drawn as the group's latest rank in this step, latest group first; pick a rank or click a lane "
               "to see that rank's own lane.", className="muted", id="timeline-grouped") if grouped else None,
        html.Div(controls, style={"display": "flex", "alignItems": "center", "gap": "8px"}),
        dcc.Store(id="timeline-rank", data=rank),
        # The lanes stay on screen, dimmed, while a zoom recuts them (dcc.Loading hides what it wraps by
        # default), and a call that answers at once -- plotly's first draw reports a relayout -- shows
        # no spinner at all.
        dcc.Loading(dcc.Graph(id="timeline-graph", config={"displaylogo": False, "scrollZoom": True}),
                    overlay_style={"visibility": "visible", "opacity": 0.5}, delay_show=300),
        html.H3("Longest collective waits in this step" + (" (of the ranks shown)" if grouped else "")),
        html.Div(id="timeline-waits"),
    ])


def timeline_lanes(run: Run, a: Analysis, step: int, chosen: int | None) -> tuple[list[int], dict[int, str]]:
    """The ranks the timeline draws, top to bottom, and their lane labels.

    Up to :data:`LANE_RANKS` ranks: every rank, in rank order.  Beyond: a lane a group -- the
    ranks of a pipeline stage, else :data:`LANE_GROUPS` blocks of consecutive ranks -- drawn as the
    group's latest rank in this step (largest busy time over its peers', the straggler matrix's
    ``excess_s``: the rank the group waits for), the latest group first; a ``chosen`` rank gets its
    own lane on top.
    """
    if len(a.ranks) <= LANE_RANKS:
        return list(a.ranks), rank_labels(run.manifest, a.ranks)
    matrix = a.whole("straggler_matrix")
    excess: dict[int, float] = {}  # seconds, whole nanoseconds (sums of ns durations carry float dust)
    if {"rank", "step", "excess_s"} <= set(matrix.columns):
        in_step = matrix[matrix["step"] == step]
        excess = {int(r): round(float(x), 9) for r, x in zip(in_step["rank"], in_step["excess_s"])}
    stages = _stages(run, a)
    if stages:
        key = {r: f"pp{stages[r]}" for r in a.ranks}
    else:
        size = -(-len(a.ranks) // LANE_GROUPS)
        blocks = [a.ranks[i:i + size] for i in range(0, len(a.ranks), size)]
        key = {r: f"ranks {b[0]}–{b[-1]}" for b in blocks for r in b}
    groups: dict[str, list[int]] = {}
    for r in a.ranks:
        groups.setdefault(key[r], []).append(r)
    lanes = []
    for name, members in groups.items():
        latest = max(members, key=lambda r: (excess.get(r, 0.0), -r))
        lanes.append((-excess.get(latest, 0.0), members[0], name, latest, len(members)))
    lanes.sort()  # the latest group first; groups equally late in rank order
    order = [latest for _, _, _, latest, _ in lanes]
    labels = {latest: f"{name} ({n} ranks) · " + (f"latest: rank {latest}, +{style.seconds(-neg)}" if neg < 0
                                                   else f"rank {latest}")
              for neg, _, name, latest, n in lanes}
    if chosen is not None and chosen in set(a.ranks):
        if chosen in labels:
            order.remove(chosen)
        order.insert(0, chosen)
        labels[chosen] = f"rank {chosen} ({key[chosen]})" + (
            f", +{style.seconds(excess[chosen])}" if excess.get(chosen, 0.0) > 0 else "")
    return order, labels


def _stages(run: Run, a: Analysis) -> dict[int, int]:
    """rank -> pipeline stage, where the manifest's layout has more than one stage."""
    m = Manifest.of(run.manifest)
    if m.layout.get("pp", 1) <= 1:
        return {}
    coords = m.rank_coords
    return {r: int(coords[r]["pp"]) for r in a.ranks if "pp" in coords.get(r, {})}


def waits_table(waits: pd.DataFrame, labels: dict[int, str], t0: int) -> Any:
    if waits.empty:
        return info_panel("No exposed communication or bubble in this step.")
    rows = [{"#": f"#{i}", "rank": labels.get(int(w.rank), f"rank {w.rank}"), "what": str(w.leaf),
             "at_ms": (w.start_ns - t0) / 1e6, "waited_ms": (w.end_ns - w.start_ns) / 1e6}
            for i, w in enumerate(waits.itertuples(), 1)]
    return grid("waits-grid", rows, [{"field": "#", "maxWidth": 70}, {"field": "rank"},
                                     {"field": "what", "headerName": "waiting in"},
                                     {"field": "at_ms", "headerName": "at (ms)", "valueFormatter": NUM},
                                     {"field": "waited_ms", "headerName": "waited (ms)", "valueFormatter": NUM}])


# ----------------------------------------------------------------------------- pipeline
def pipeline_page(run: Run, a: Analysis) -> html.Div:
    bubbles = (a.report.get("bubbles") or [None])[0]
    mb_steps = _microbatch_steps(a)
    title = html.H2(f"Pipeline: {run.id}" + (f" ({bubbles['schedule']} schedule)" if bubbles and bubbles.get("schedule")
                                             else ""))
    if bubbles is None and not mb_steps:
        return html.Div([title, info_panel("No pipeline parallelism in this run (pp = 1, and no pipeline "
                                           "microbatch labels in the traces), so no schedule to draw.")])
    parts: list[Any] = [title]
    if bubbles is not None:
        parts.append(html.Div([
            card("measured bubble", style.percent(bubbles["bubble_fraction"]), "of the pipeline's time"),
            card("theory", style.percent(bubbles["theory_fraction"]),
                 f"of the pipeline's time: {bubbles.get('theory_formula', '(p-1)/(m+p-1)')}, p={bubbles['stages']} "
                 f"m={bubbles['microbatches']} v={bubbles['virtual_stages']}"),
            card("of the step", style.percent(bubbles["share_of_step"]), "the bubble over the whole step"),
            card("vs theory", f"{bubbles['vs_theory']:.2f}×" if bubbles.get("vs_theory") else "–", "measured / theory"),
            card("stage imbalance", style.percent(bubbles["imbalance"]), "slowest stage's busy time over the mean"),
        ], className="cards", id="bubble-cards"))
    if not mb_steps:
        parts.append(info_panel("These traces carry no per-microbatch labels (PyTorch's PP:<stage>F<mb> or the "
                                "collectors' mfuscope.pp/...), so only the measured bubble is shown."))
    else:
        parts.append(_executed_schedule(a, mb_steps, bubbles))
    if bubbles is not None:
        parts += [html.H3("Per stage"), grid("stages-grid", [
            {"stage": s["stage"], "bubble": s["bubble_fraction"], "share": s["share_of_step"],
             "busy_ms": s["busy_s"] * 1e3} for s in bubbles["per_stage"]], [
            {"field": "stage"}, {"field": "bubble", "headerName": "bubble (of pipeline time)", "valueFormatter": PCT},
            {"field": "share", "headerName": "bubble (of the step)", "valueFormatter": PCT},
            {"field": "busy_ms", "headerName": "busy (ms/step)", "valueFormatter": NUM}])]
    return html.Div(parts)


def _microbatch_steps(a: Analysis) -> list[int]:
    """The steps of the executed pipeline schedule (none without pipeline labels)."""
    return sorted(int(s) for s in a.microbatches(columns=["step"])["step"].unique())


def _executed_schedule(a: Analysis, steps: list[int], bubbles: dict | None) -> html.Div:
    """The middle step as executed by one rank per stage, beside the theory.  p, m and v come from
    the manifest's schedule, else from the labels themselves (a trace set, a wrapped script)."""
    step = steps[len(steps) // 2]
    in_step = a.microbatches(step)
    rep = in_step.groupby("stage")["rank"].min()   # one rank per stage (interleaved: a rank has several)
    executed = in_step.merge(pd.DataFrame({"stage": rep.index, "rank": rep.values}), on=["stage", "rank"])
    n_stages = int(rep.index.nunique())
    p = int(bubbles["stages"]) if bubbles else int(rep.nunique())
    v = max(1, n_stages // p)
    m = int(in_step["microbatch"].nunique())
    lane = (lambda s, r: f"stage {s}") if v == 1 else (lambda s, r: f"rank {r}")
    executed = executed.assign(lane=[lane(s, r) for s, r in zip(executed["stage"], executed["rank"])])
    seg = a.segments(step, rep.values)
    t0 = int(seg["start_ns"].min()) if len(seg) else int(executed["start_ns"].min())
    first_stage = {int(r): int(s) for s, r in rep.iloc[::-1].items()}
    bub = seg[seg["leaf"].astype(str) == "bubble"]
    bub = bub.assign(lane=[lane(first_stage[int(r)], r) for r in bub["rank"]])
    schedule = (bubbles or {}).get("schedule") or "1f1b"
    fig = figures.pipeline(executed, bub, t0, schedule, p, m, v)
    return html.Div([html.P(f"Step {step}: p={p} stages, m={m} microbatches"
                            + (f", v={v} chunks per rank" if v > 1 else "")
                            + "; ranks " + ", ".join(f"{r} (stage {s})" for s, r in rep.items()), className="muted"),
                     dcc.Graph(id="pipeline-graph", figure=fig, config={"displaylogo": False})])


# ----------------------------------------------------------------------------- communication
def comm_page(run: Run, a: Analysis) -> html.Div:
    r = a.report
    rows = [{"dim": c["dim"], "op": c["op"], "size": c["size"], "count": c["count"],
             "bytes": None if c["bytes"] is None else c["bytes"] / 2**20,
             "total_ms": c["total_s"] * 1e3, "exposed_ms": None if c["exposed_s"] is None else c["exposed_s"] * 1e3,
             "overlap": c.get("overlap"), "algbw": c.get("algbw_gbps"), "busbw": c.get("busbw_gbps"),
             "of_link": c.get("busbw_of_attainable"), "of_nccl_tests": c.get("busbw_of_nccl_tests")}
            for c in r.get("comm") or []]
    dim_style = {"styleConditions": [{"condition": f"params.value == '{d}'",
                                      "style": {"backgroundColor": col, "color": "white"}}
                                     for d, col in style.DIM_COLORS.items()]}
    table = grid("comm-grid", rows, [
        {"field": "dim", "cellStyle": dim_style, "maxWidth": 140}, {"field": "op"},
        {"field": "size", "headerName": "message size"},
        {"field": "count", "headerName": "calls", "valueFormatter": NUM},
        {"field": "bytes", "headerName": "MiB", "valueFormatter": NUM},
        {"field": "total_ms", "headerName": "total (ms)", "valueFormatter": NUM},
        {"field": "exposed_ms", "headerName": "exposed (ms)", "valueFormatter": NUM, "sort": "desc"},
        {"field": "overlap", "headerName": "overlapped", "valueFormatter": PCT},
        {"field": "algbw", "headerName": "algbw (GB/s)", "valueFormatter": NUM},
        {"field": "busbw", "headerName": "busbw (GB/s)", "valueFormatter": NUM},
        {"field": "of_link", "headerName": "of link", "valueFormatter": PCT},
        {"field": "of_nccl_tests", "headerName": "of nccl-tests", "valueFormatter": PCT}]) if rows else \
        info_panel("No communication in this run.")
    skew = r.get("comm_skew") or []
    skew_text = [html.Li(f"{k['dim']}: {k['instances']} matched calls, arrival skew median "
                         f"{style.seconds(k['median_skew_s'])}, p90 {style.seconds(k['p90_skew_s'])}"
                         + (("; everyone waited most for "
                             + ", ".join(f"rank {w['rank']} ({style.seconds(w['seconds'])})" for w in k["waited_for"]))
                            if k["waited_for"] else ""))
                 for k in skew]
    arrival = pd.DataFrame(r.get("comm_arrival") or [])
    heat = figures.heatmap(arrival, "collective", "rank", "median_lag_s", scale=1e3, y_prefix="rank ",
                           title="Arrival lag: how late each rank reaches each collective (median)",
                           z_title="ms late") if len(arrival) else None
    names_of: dict[str, list[str]] = {}
    for d, c in style.DIM_COLORS.items():
        names_of.setdefault(c, []).append(d)
    legend = html.Div([html.Span(" / ".join(ds), className="legend-dim", style={"background": c})
                       for c, ds in names_of.items()])
    return html.Div([
        html.H2(f"Communication: {run.id}"), legend,
        html.H3("Per dimension, op and message size (all ranks)"), table,
        html.H3("Arrival skew"), html.Ul(skew_text) if skew_text else None, capped_note(r, "comm_arrival"),
        dcc.Graph(id="skew-heatmap", figure=heat, config={"displaylogo": False}) if heat is not None else
        info_panel("No collective could be matched across ranks (matching needs at least two ranks of a "
                   "group, and sequence numbers or same-size calls of a replicated collective), so there is "
                   "no arrival skew to show."),
    ])


def capped_note(report: dict, key: str) -> html.P | None:
    """What a per-rank list of a large run shows: its worst ranks, and where every rank's rows are."""
    meta = (report.get("rank_lists") or {}).get(key) or {}
    if not meta or meta.get("kept", 0) >= meta.get("ranks", 0):
        return None
    where = f"; every rank's rows: views/{meta['view']}" if meta.get("view") else ""
    return html.P(f"Showing the {meta['kept']:,} worst of {meta['ranks']:,} ranks (by {meta['worst_by']}){where}.",
                  className="muted", id=f"capped-{key}")


# ----------------------------------------------------------------------------- health
def health_page(run: Run, a: Analysis | None) -> html.Div:
    """Whole-run health (analyzers/health.py): read from the collectors' tables on every visit --
    cheap, and a run without a trace window (no analysis) has it too."""
    title = html.H2(f"Health: {run.id}")
    if run.kind != "run" or not (run.path / run_dir.STEPS).exists():
        return html.Div([title, info_panel("Health needs a run directory's step and communication tables "
                                           "(steps.parquet, comm.parquet): the collectors write them for every "
                                           "step of a run that mfuscope wraps.")])
    h = (a.report.get("health") if a is not None else None) or health.analyze(run.path)
    steps = run_dir.read_table(run.path, run_dir.STEPS).select(["step", "start_ns", "end_ns"]).to_pandas()
    step_s = ((steps["end_ns"] - steps["start_ns"]) / 1e9).groupby(steps["step"]).max()
    episodes = h.get("episodes") or []
    rows = [{"onset": e["onset_step"], "end": e["end_step"], "class": e["class"].replace("_", "-"),
             "ranks": ", ".join(map(str, e["ranks"][:16])) + (" …" if len(e["ranks"]) > 16 else ""),
             "dim": e.get("dim") or "–", "every": e.get("period"), "cost_s": e["cost_s"],
             "per_step_ms": e.get("cost_per_step_s", 0.0) * 1e3,
             "groups": "; ".join(f"{g['dim']} [{', '.join(map(str, g['ranks']))}]" for g in e.get("groups") or []),
             "why": e.get("why", "")} for e in episodes]
    head = (info_panel(f"Not enough steps to judge: {h['note']}.") if not h.get("steps") else
            info_panel(f"{len(episodes)} slow episode(s) in {h['steps']} steps; the costliest: steps "
                       f"{episodes[0]['onset_step']}–{episodes[0]['end_step']}, {episodes[0]['why']}.")
            if episodes else
            info_panel(f"No slow episode in {h.get('steps', 0)} steps: no rank, group or host stayed slower than "
                       "its reference (its own best steps and its peers) by the threshold."))
    return html.Div([
        title, head,
        html.P(h.get("method") or h.get("note") or "", className="muted"),
        dcc.Graph(id="health-steps", figure=figures.health_steps(step_s, episodes, h.get("baseline_step_s")),
                  config={"displaylogo": False}),
        html.H3("Episodes (costliest first; cost: the run's time had it not happened)"),
        grid("health-episodes", rows, [
            {"field": "onset", "headerName": "onset step", "minWidth": 120, "maxWidth": 130},
            {"field": "end", "headerName": "end step", "minWidth": 110, "maxWidth": 120},
            {"field": "class", "maxWidth": 140}, {"field": "ranks", "maxWidth": 160},
            {"field": "dim", "maxWidth": 90}, {"field": "every", "headerName": "period", "minWidth": 100,
                                               "maxWidth": 110},
            {"field": "cost_s", "headerName": "cost (s)", "valueFormatter": NUM, "maxWidth": 110},
            {"field": "per_step_ms", "headerName": "ms a slow step", "valueFormatter": NUM, "minWidth": 140,
             "maxWidth": 150},
            {"field": "groups", "minWidth": 160, **WRAP}, {"field": "why", "minWidth": 300, **WRAP}])
        if rows else None,
        html.H3("Rank scores (1 = as fast as its own best / the best rank; nvidia-resiliency-ext's two scores)"),
        grid("health-scores", h.get("rank_scores") or [], [
            {"field": "rank", "maxWidth": 90}, {"field": "individual", "valueFormatter": NUM, "sort": "asc"},
            {"field": "relative", "valueFormatter": NUM},
            {"field": "busy_s", "headerName": "busy now (s)", "valueFormatter": NUM},
            {"field": "best_busy_s", "headerName": "its best (s)", "valueFormatter": NUM}], height=260),
    ])


# ----------------------------------------------------------------------------- memory
def memory_page(run: Run, a: Analysis, query: dict[str, str] | None = None) -> html.Div:
    """Memory measured in the profiled window (analyzers/memory.py): a rank's series and categories
    at its peak beside the cost model's -- the highest rank's, or ``?rank=N`` (a click on the rank
    table's row) -- and every rank's peak."""
    title = html.H2(f"Memory: {run.id}")
    section = a.report.get("memory")
    if not section:
        return html.Div([title, info_panel(
            "No memory was measured in this run's traces. Record it with ",
            html.Code("mfuscope train --profile-memory"),
            " (or ", html.Code("mfuscope.profile(..., profile_memory=True)"), "): the allocator's events, the memory "
            "timeline and, on a GPU, the allocator's snapshot of the profiled window.")])
    top = next(e for e in section["per_rank"] if e["rank"] == section["peak_rank"]) if section.get("peak_rank") \
        is not None else section["per_rank"][0]
    wanted = (query or {}).get("rank")
    shown = next((e for e in section["per_rank"] if str(e["rank"]) == wanted), top)
    predicted = top.get("predicted")
    size = style.size
    head = (f"Peak {size(top['peak_allocated_bytes'])} allocated on rank {top['rank']} ({top['device']}"
            + (f"; {size(top['peak_reserved_bytes'])} reserved)" if top.get("peak_reserved_bytes") else
               f": {top.get('reserved_note', 'nothing reserved')})")
            + (f"; the model predicts {size(sum(v for v in predicted.values() if v))} "
               "with gradients held" if predicted else "") + ".")
    rows = [{"rank": e["rank"], "device": e["device"], "peak": e["peak_allocated_bytes"],
             "reserved": e["peak_reserved_bytes"], "fragmentation": e.get("fragmentation"),
             "activation_peak": e.get("activation_peak_bytes"),
             "predicted_activation": (e.get("predicted") or {}).get("activation"),
             **{f"held_{c}": (e.get("states") or {}).get(c) for c in ("parameter", "gradient", "optimizer_state")}}
            for e in section["per_rank"]]
    return html.Div([
        title, info_panel(head),
        html.P(f"Sources: {', '.join(section.get('sources') or [])}. {section.get('predicted_note') or ''}",
               className="muted"),
        html.H3(f"Rank {shown['rank']}" + (" (the highest peak)" if shown is top else
                                            f", peak {size(shown['peak_allocated_bytes'])} allocated")),
        *([html.P(f"Rank {wanted} is not among the ranks listed below; showing the highest peak's.",
                  className="muted")] if wanted is not None and str(shown["rank"]) != wanted else []),
        dcc.Graph(id="memory-timeline", config={"displaylogo": False},
                  figure=figures.memory_timeline(memory.read_view(a.views_dir, shown["rank"]), shown["rank"])),
        dcc.Graph(id="memory-categories", config={"displaylogo": False},
                  figure=figures.memory_categories(shown.get("categories") or {}, shown.get("predicted"))),
        html.H3("Every rank (bytes; held: the model states counted at the optimizer step; "
                "click a row for its rank's series)"),
        grid("memory-ranks", rows, [
            {"field": "rank", "maxWidth": 90}, {"field": "device", "maxWidth": 110},
            {"field": "peak", "headerName": "peak allocated", "valueFormatter": BYTES, "sort": "desc"},
            {"field": "reserved", "headerName": "peak reserved", "valueFormatter": BYTES},
            {"field": "fragmentation", "valueFormatter": PCT},
            {"field": "activation_peak", "headerName": "activations (highest)", "valueFormatter": BYTES},
            {"field": "predicted_activation", "headerName": "predicted", "valueFormatter": BYTES},
            {"field": "held_parameter", "headerName": "held: parameters", "valueFormatter": BYTES},
            {"field": "held_gradient", "headerName": "gradients", "valueFormatter": BYTES},
            {"field": "held_optimizer_state", "headerName": "optimizer state", "valueFormatter": BYTES}],
            height=min(300, 100 + 42 * len(rows)), getRowId="params.data.rank"),
    ])


# ----------------------------------------------------------------------------- stragglers
def stragglers_page(run: Run, a: Analysis) -> html.Div:
    r = a.report
    matrix = pd.DataFrame(r.get("straggler_matrix") or [])
    found = r.get("stragglers") or []
    head = (info_panel("Stragglers: " + ", ".join(f"rank {s['rank']} costs everyone {style.seconds(s['cost_s'])} "
                                                   f"per step (slow in steps {', '.join(map(str, s['steps']))})"
                                                   for s in found)) if found else
            info_panel("No straggler: no rank's busy time stands out from its peers' (within 3 MADs or 5%)."))
    fig = figures.heatmap(matrix, "step", "rank", "excess_s", scale=1e3, x_prefix="step ", y_prefix="rank ",
                          title="Busy time over the median rank's (same pipeline stage), per rank and step — "
                                "click a cell for its timeline", z_title="ms over median", colorscale="RdBu_r")
    if len(matrix):
        lim = float(matrix["excess_s"].abs().max() * 1e3) or 1.0
        fig.update_traces(zmid=0, zmin=-lim, zmax=lim)
    return html.Div([html.H2(f"Stragglers: {run.id}"), head, capped_note(r, "straggler_matrix"),
                     dcc.Graph(id="straggler-heatmap", figure=fig, config={"displaylogo": False})])


# ----------------------------------------------------------------------------- kernels
def kernels_page(run: Run, a: Analysis) -> html.Div:
    r = a.report
    rows = [{"name": k["name"], "kind": kernel_kind(k["name"]) if k["kind"] == "kernel" else k["kind"],
             "count": k["count"], "total_ms": k["total_s"] * 1e3,
             "mean_us": k["mean_us"], "median_us": k["median_us"], "share": k["share"]} for k in r.get("kernels") or []]
    launch = r.get("kernel_launch") or []
    parts = [html.H2(f"Kernels: {run.id}")]
    if not rows:
        parts.append(info_panel("No GPU kernels in this run (CPU training: its operators are under Overview's "
                                "compute leaves)."))
    else:
        parts += [html.P("Top kernels over all ranks; sort by any column, filter by name or kind.", className="muted"),
                  grid("kernels-grid", rows, defaultColDef={"sortable": True, "filter": True, "resizable": True,
                                                            "floatingFilter": True, "minWidth": 80}, columnDefs=[
                      {"field": "name", "minWidth": 420, "filter": "agTextColumnFilter", "tooltipField": "name"},
                      {"field": "kind", "headerName": "kind (breakdown leaf)", "maxWidth": 190},
                      {"field": "count", "valueFormatter": NUM, "maxWidth": 110},
                      {"field": "total_ms", "headerName": "total (ms)", "valueFormatter": NUM, "sort": "desc"},
                      {"field": "mean_us", "headerName": "mean (µs)", "valueFormatter": NUM},
                      {"field": "median_us", "headerName": "median (µs)", "valueFormatter": NUM},
                      {"field": "share", "headerName": "share of kernel time", "valueFormatter": PCT}])]
    if launch:
        parts += [html.H3("Launch overhead per rank"), grid("launch-grid", [
            {**x, "small_kernel_ms": x.get("small_kernel_s", 0) * 1e3} for x in launch], [
            {"field": "rank"}, {"field": "kernels", "valueFormatter": NUM},
            {"field": "median_kernel_us", "headerName": "median kernel (µs)", "valueFormatter": NUM},
            {"field": "median_launch_us", "headerName": "median launch (µs)", "valueFormatter": NUM},
            {"field": "small_kernel_share", "headerName": "kernels < 10 µs", "valueFormatter": PCT},
            {"field": "small_kernel_ms", "headerName": "time in them (ms)", "valueFormatter": NUM},
            {"field": "launch_bound", "headerName": "launch-bound"}])]
    return html.Div(parts)


# ----------------------------------------------------------------------------- compare
def compare_page(store: Store, analyzed: list[Run], a_id: str | None, b_id: str | None,
                 fix: str | None = None) -> html.Div:
    """Two runs side by side; ``fix`` names the change that made ``b`` from ``a`` (the Optimize
    page's links)."""
    ids = [r.id for r in analyzed]
    options = [{"label": i, "value": i} for i in ids]
    pickers = html.Div([
        html.Span("base "), dcc.Dropdown(id="compare-a", options=options, value=a_id, clearable=False,
                                         style={"width": "260px"}),
        html.Span("new "), dcc.Dropdown(id="compare-b", options=options, value=b_id, clearable=False,
                                        style={"width": "260px"}),
    ], style={"display": "flex", "alignItems": "center", "gap": "8px"})
    head = [html.H2("Compare two runs"), pickers]
    if fix:
        head.append(html.P(["Fix applied: ", html.B(fix)], id="compare-fix", className="note"))
    if len(ids) < 2:
        return html.Div(head + [info_panel("Compare needs two analyzed runs; open runs from the Runs page first.")])
    if a_id not in ids or b_id not in ids:
        return html.Div(head + [info_panel("Pick a base and a new run.")])
    base = store.report(next(r for r in analyzed if r.id == a_id))
    new = store.report(next(r for r in analyzed if r.id == b_id))
    result = compare_reports.compare(base, new)
    fmt = {"mfu": style.percent, "hfu": style.percent, "step_time_s": style.seconds,
           "tokens_per_s": lambda v: style.rate(v, "tok/s"),
           "tflops_per_device": lambda v: "–" if v is None else style.rate(v * 1e12, "FLOP/s")}
    names = {"mfu": "MFU", "hfu": "HFU", "step_time_s": "step time", "tokens_per_s": "tokens/s",
             "tflops_per_device": "FLOP/s per device"}
    summary = grid("compare-summary", [{"metric": names[x["metric"]], "base": fmt[x["metric"]](x["base"]),
                                        "new": fmt[x["metric"]](x["new"]), "change": style.signed_percent(x["change"])}
                                       for x in result["summary"]],
                   [{"field": "metric"}, {"field": "base", "headerName": f"base: {a_id}"},
                    {"field": "new", "headerName": f"new: {b_id}"}, {"field": "change"}])
    finding_rows = [{"title": f["title"], "fix": f["fix"],
                     "base_ms": None if f["base_gain_s"] is None else f["base_gain_s"] * 1e3,
                     "new_ms": None if f["new_gain_s"] is None else f["new_gain_s"] * 1e3,
                     "delta_ms": f["delta_s"] * 1e3} for f in result["findings"]]
    peaks = {base["summary"].get("peak_flops"), new["summary"].get("peak_flops")}
    peak_note = html.P(f"MFU is against each run's own peak ({style.rate(base['summary'].get('peak_flops'), 'FLOP/s')} "
                       f"and {style.rate(new['summary'].get('peak_flops'), 'FLOP/s')}); mfuscope compare "
                       "--fail-on-mfu-drop rescales to one peak.", className="muted") if len(peaks) > 1 else None
    return html.Div(head + [
        html.Div(summary, id="compare-summary-box", style={"marginTop": "10px"}), peak_note,
        dcc.Graph(id="compare-leaves", figure=figures.compare_leaves(result["leaves"], a_id, b_id),
                  config={"displaylogo": False}),
        html.H3("Findings (estimated gain per step)"),
        grid("compare-findings", finding_rows, [
            {"field": "title", "headerName": "finding", "minWidth": 300}, {"field": "fix"},
            {"field": "base_ms", "headerName": "base (ms)", "valueFormatter": NUM},
            {"field": "new_ms", "headerName": "new (ms)", "valueFormatter": NUM},
            {"field": "delta_ms", "headerName": "change (ms)", "valueFormatter": NUM}]) if finding_rows else
        info_panel("Neither run has findings."),
    ])
