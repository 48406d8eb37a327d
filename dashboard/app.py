"""``mfuscope dashboard``: the Dash app over a directory of runs.

URLs are the state, so every view can be linked and reloaded:
``/`` runs, ``/run/<id>`` overview, ``/run/<id>/<page>?step=&rank=``,
``/compare?a=<id>&b=<id>[&fix=<change>]``, ``/plan?model=&gpus=&gpu=&batch=&seq=&dtype=&scaling=``.
One callback renders a page from the URL; a run
not analyzed yet shows a progress bar (an interval ticks until its analysis is
on disk).  A failure inside a page becomes an error panel, never a dead app.
"""
from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode

import dash
import pandas as pd
from dash import Input, Output, State, dcc, html, no_update

from mfuscope.analyzers import timeline as timeline_views
from mfuscope.errors import UserInputError

from . import figures, pages, style, trend_page
from .store import Store

log = logging.getLogger("mfuscope.dashboard")

RUN_PAGES = [("", "Overview"), ("timeline", "Timeline"), ("pipeline", "Pipeline"), ("comm", "Communication"),
             ("stragglers", "Stragglers"), ("health", "Health"), ("memory", "Memory"), ("kernels", "Kernels"),
             ("optimize", "Optimize")]
#: Bars the timeline may ship to the browser, over all lanes: 64 lanes stay responsive.
TIMELINE_BARS = 24_000


def create_app(runs_dir: str | Path, history: str | Path | None = None) -> dash.Dash:
    """``history``: a CI history directory (``mfuscope ci record``) for the Trend page."""
    store = Store(Path(runs_dir))
    history = Path(history) if history else None
    app = dash.Dash(__name__, title="mfuscope", update_title=None, suppress_callback_exceptions=True)
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + style.CSS + "</style>")
    app.layout = html.Div([
        dcc.Location(id="url", refresh="callback-nav"),
        html.Div(id="topbar", className="topbar"),
        html.Div(id="page", className="page"),
        dcc.Interval(id="tick", interval=400, disabled=True),
    ])
    _routes(app, store, history)
    _interactions(app, store)
    _trend_interactions(app)
    return app


def _parse(pathname: str | None, search: str | None) -> tuple[list[str], dict[str, str]]:
    parts = [unquote(p) for p in (pathname or "/").strip("/").split("/") if p]
    return parts, dict(parse_qsl((search or "").lstrip("?")))


def _topbar(run_id: str | None, current: str) -> list[Any]:
    links = [html.Span("mfuscope", className="brand"),
             dcc.Link("Runs", href="/", className="active" if current == "runs" else "")]
    if run_id:
        for slug, label in RUN_PAGES:
            links.append(dcc.Link(label, href=f"/run/{quote(run_id)}" + (f"/{slug}" if slug else ""),
                                  className="active" if current == slug else "", id=f"nav-{slug or 'overview'}"))
    links.append(dcc.Link("Compare", href="/compare", className="active" if current == "compare" else ""))
    links.append(dcc.Link("Planner", href="/plan", className="active" if current == "plan" else "", id="nav-plan"))
    links.append(dcc.Link("Trend", href="/trend", className="active" if current == "trend" else "", id="nav-trend"))
    if run_id:
        links.append(html.Span(f"run: {run_id}", className="run"))
    return links


def _routes(app: dash.Dash, store: Store, history: Path | None) -> None:
    @app.callback(Output("topbar", "children"), Output("page", "children"), Output("tick", "disabled"),
                  Input("url", "pathname"), Input("url", "search"), Input("tick", "n_intervals"))
    def render(pathname, search, _tick):
        parts, query = _parse(pathname, search)
        if dash.callback_context.triggered_id == "tick":
            query.pop("retry", None)  # progress ticks never restart a failed analysis
        try:
            if not parts:
                return _topbar(None, "runs"), pages.runs_page(store), True
            if parts[0] == "compare":
                analyzed = [r for r in store.runs() if not r.error and store.analyzed(r)]
                ids = [r.id for r in analyzed]
                a = query.get("a") or (ids[0] if ids else None)
                b = query.get("b") or (next((i for i in ids if i != a), None))
                return _topbar(None, "compare"), pages.compare_page(store, analyzed, a, b, query.get("fix")), True
            if parts[0] == "plan":
                return _topbar(None, "plan"), pages.planner_page(query, store), True
            if parts == ["trend"]:
                return _topbar(None, "trend"), trend_page.page(history, query), True
            if parts == ["trend", "record"]:
                ids = {r.id for r in store.runs()}
                return _topbar(None, "trend"), trend_page.record_page(history, query, ids), True
            if parts[0] == "run" and len(parts) >= 2:
                return _run_page(store, parts[1], parts[2] if len(parts) > 2 else "", query)
            return _topbar(None, ""), pages.error_panel(f"no page at {pathname}"), True
        except UserInputError as e:
            return _topbar(None, ""), pages.error_panel(str(e)), True
        except Exception as e:  # noqa: BLE001 -- shown, logged, and the app lives on
            log.exception("page %s failed", pathname)
            return _topbar(None, ""), pages.error_panel(f"this page failed: {type(e).__name__}: {e}"), True


def _run_page(store: Store, run_id: str, slug: str, query: dict[str, str]):
    top = _topbar(run_id, slug)
    run = store.run(run_id)
    if run is None:
        return top, pages.error_panel(f"no run named {run_id!r} under {store.root}"), True
    if run.error:
        return top, pages.error_panel(f"{run.id} cannot be shown: {run.error}"), True
    if not run.has_traces:  # the collectors' tables only: their own page, and health (which reads only them)
        return top, (pages.health_page(run, None) if slug == "health" else pages.no_traces_page(run)), True
    if "retry" in query:
        store.forget_failure(run)
    job = store.ensure_analysis(run)
    if job is not None:
        if job.error:  # a plain link: a full load, so a second click retries again
            return top, html.Div([pages.error_panel(f"{run.id} could not be analyzed: {job.error}"),
                                  html.A("Try again", href=f"/run/{quote(run_id)}?retry=1")]), True
        return top, pages.progress_panel(run, job.fraction, job.message), False
    a = store.load(run)
    # The Overview and Optimize pages show the run's calibrated cost model, which the store keeps.
    builders = {"": partial(pages.overview_page, store), "pipeline": pages.pipeline_page, "comm": pages.comm_page,
                "stragglers": pages.stragglers_page, "health": pages.health_page,
                "kernels": pages.kernels_page,
                "optimize": partial(pages.optimize_page, store)}
    if slug == "timeline":
        return top, pages.timeline_page(run, a, query), True
    if slug == "memory":
        return top, pages.memory_page(run, a, query), True
    if slug not in builders:
        known = ", ".join(s or "overview" for s, _ in RUN_PAGES)
        return top, pages.error_panel(f"no page {slug!r}; pages: {known}"), True
    return top, builders[slug](run, a), True


def _run_of(store: Store, pathname: str | None):
    """(run, its analysis) for a run page's URL; raises UserInputError when there is none."""
    parts, _ = _parse(pathname, None)
    run = store.run(parts[1]) if len(parts) >= 2 and parts[0] == "run" else None
    # the page's render checked the analysis is current; a click or zoom only needs it on disk
    if run is None or run.error or not run.report_path.is_file():
        raise UserInputError(f"the run of this page is gone or no longer analyzed ({pathname}); reload the page")
    return run, store.load(run)


def _safe(*fallback_outputs: Any):
    """An interaction callback whose failure shows as a message, never as a dead page: the
    wrapped function's ``UserInputError`` or crash becomes ``fallback_outputs(message)``."""
    def wrap(fn):
        def run(*args):
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001
                if not isinstance(e, UserInputError):
                    log.exception("callback %s failed", fn.__name__)
                message = str(e) if isinstance(e, UserInputError) else f"{type(e).__name__}: {e}"
                return tuple(f(message) for f in fallback_outputs) if len(fallback_outputs) > 1 \
                    else fallback_outputs[0](message)
        run.__name__ = fn.__name__
        return run
    return wrap


def _interactions(app: dash.Dash, store: Store) -> None:
    @app.callback(Output("node-detail", "children"), Input("breakdown", "clickData"), State("url", "pathname"),
                  prevent_initial_call=True)
    @_safe(pages.error_panel)
    def breakdown_node(click, pathname):
        _, a = _run_of(store, pathname)
        if not click or not click.get("points"):
            return no_update
        return pages.node_detail(a, click["points"][0].get("id") or click["points"][0].get("label"))

    @app.callback(Output("timeline-graph", "figure"), Output("timeline-waits", "children"),
                  Input("timeline-step", "value"), Input("timeline-graph", "relayoutData"),
                  State("timeline-rank", "data"), State("url", "pathname"), State("timeline-graph", "figure"))
    @_safe(figures.empty, pages.error_panel)
    def draw_timeline(step, relayout, rank, pathname, shown):
        run, a = _run_of(store, pathname)
        if step is None:
            return figures.empty("no step chosen"), None
        order, labels = pages.timeline_lanes(run, a, step, rank)
        seg = a.segments(step, order if len(a.ranks) > pages.LANE_RANKS else None)
        if seg.empty:
            return figures.empty(f"no timeline for step {step}"), None
        t0, t1 = int(seg["start_ns"].min()), int(seg["end_ns"].max())
        lo, hi, x_range = t0, t1, None
        trigger = dash.callback_context.triggered_id
        if trigger == "timeline-graph":
            relayout = relayout or {}
            if "xaxis.range[0]" in relayout:  # zoomed: cut the lanes again at the new resolution
                x_range = (float(relayout["xaxis.range[0]"]), float(relayout["xaxis.range[1]"]))
                lo, hi = max(t0, t0 + int(x_range[0] * 1e6)), min(t1, t0 + int(x_range[1] * 1e6))
            elif not relayout.get("xaxis.autorange") and (shown or {}).get("data"):
                # A hover or a resize: nothing to redraw.  But plotly also reports the first draw of
                # the empty graph as a relayout, and Dash drops the answer of an earlier call of this
                # callback once a later one is asked: on a slow server that later call would leave
                # the timeline empty for good, so an empty graph is always drawn.
                return no_update, no_update
        shown = set(seg["rank"].unique().tolist())
        order = [r for r in order if r in shown]
        labels = {r: labels[r] for r in order}
        bins = max(100, min(1500, TIMELINE_BARS // max(1, len(labels))))
        lanes = timeline_views.lanes(seg.assign(leaf=seg["leaf"].astype(str).map(lane_category)), lo, hi, bins)
        waits = longest_waits(seg)
        fig = figures.timeline(lanes, labels, t0, waits, x_range, highlight=rank, order=order)
        return fig, pages.waits_table(waits, labels, t0)

    @app.callback(Output("url", "href", allow_duplicate=True), Input("timeline-rank-input", "value"),
                  Input("timeline-graph", "clickData"), State("timeline-step", "value"), State("timeline-rank", "data"),
                  State("url", "pathname"), prevent_initial_call=True)
    def drill_down(typed, click, step, shown, pathname):
        """A grouped timeline's rank picked (typed, or a lane's bar clicked): that rank's own lane."""
        parts, _ = _parse(pathname, None)
        if dash.callback_context.triggered_id == "timeline-graph":
            _, a = _run_of(store, pathname)
            if len(a.ranks) <= pages.LANE_RANKS:  # a lane a rank already
                return no_update
            points = (click or {}).get("points") or []
            rank = points[0].get("customdata") if points else None
        else:
            rank = typed
        if rank is None or len(parts) < 2 or int(rank) == shown:
            return no_update
        return f"/run/{quote(parts[1])}/timeline?" + urlencode({"step": step, "rank": int(rank)})

    @app.callback(Output("url", "href", allow_duplicate=True), Input("straggler-heatmap", "clickData"),
                  State("url", "pathname"), prevent_initial_call=True)
    def open_cell(click, pathname):
        parts, _ = _parse(pathname, None)
        if not click or not click.get("points") or len(parts) < 2:
            return no_update
        point = click["points"][0]
        step = str(point["x"]).removeprefix("step ")
        rank = str(point["y"]).removeprefix("rank ")
        run_id = parts[1]
        return f"/run/{quote(run_id)}/timeline?" + urlencode({"step": step, "rank": rank})

    @app.callback(Output("url", "href", allow_duplicate=True), Input("memory-ranks", "cellClicked"),
                  State("url", "pathname"), State("url", "search"), prevent_initial_call=True)
    def open_memory_rank(cell, pathname, search):
        parts, query = _parse(pathname, search)
        if not cell or cell.get("rowId") is None or len(parts) < 2 or query.get("rank") == str(cell["rowId"]):
            return no_update
        return f"/run/{quote(parts[1])}/memory?" + urlencode({"rank": cell["rowId"]})

    @app.callback(Output("url", "href", allow_duplicate=True), Input("compare-a", "value"), Input("compare-b", "value"),
                  State("url", "search"), prevent_initial_call=True)
    def switch_pair(a, b, search):
        _, query = _parse(None, search)
        if (query.get("a"), query.get("b")) == (a, b):
            return no_update
        return "/compare?" + urlencode({"a": a, "b": b})

    @app.callback(Output("compare-link", "href"), Output("compare-link", "children"),
                  Input("runs-grid", "selectedRows"), prevent_initial_call=True)
    def pick_pair(rows):
        ids = [r["id"] for r in rows or []]
        if len(ids) == 2:
            return "/compare?" + urlencode({"a": ids[0], "b": ids[1]}), f"Compare {ids[0]} with {ids[1]}"
        return "/compare", "Compare the two ticked runs" + (f" ({len(ids)} ticked)" if ids else "")


    @app.callback(Output("url", "href", allow_duplicate=True), Input("plan-go", "n_clicks"),
                  State("plan-model", "value"), State("plan-gpus", "value"), State("plan-gpu", "value"),
                  State("plan-batch", "value"), State("plan-seq", "value"), State("plan-dtype", "value"),
                  State("plan-scaling", "value"), prevent_initial_call=True)
    def run_plan(clicks, model, gpus, gpu, batch, seq, dtype, sizes):
        if not clicks:
            return no_update
        return "/plan?" + urlencode({"model": model, "gpus": gpus or 0, "gpu": gpu, "batch": batch or 0,
                                     "seq": seq or 0, "dtype": dtype, "scaling": sizes or ""})

    @app.callback(Output("plan-breakdown", "figure"), Input("plan-grid", "selectedRows"), prevent_initial_call=True)
    @_safe(figures.empty)
    def show_layout(rows):
        if not rows:
            return no_update
        row = rows[0]
        return figures.predicted_leaves(row["leaves"], row["step_s"], f"#{row['rank']}: {row['layout']}")


def lane_category(leaf: str) -> str:
    """What a timeline lane shows: communication by dimension (one colour each), the rest as is."""
    parts = leaf.split("/")
    return "/".join(parts[:2]) if parts[0] == "comm" else leaf


def longest_waits(seg: pd.DataFrame, n: int = 5) -> pd.DataFrame:
    """The step's longest stretches of exposed communication or bubble, any rank."""
    leaf = seg["leaf"].astype(str)
    waiting = seg[leaf.str.startswith("comm/") | (leaf == "bubble")]
    return waiting.assign(dur=waiting["end_ns"] - waiting["start_ns"]).nlargest(n, "dur")


def _trend_interactions(app: dash.Dash) -> None:
    @app.callback(Output("url", "href", allow_duplicate=True), Input("trend-workload", "value"),
                  State("url", "search"), prevent_initial_call=True)
    def pick_workload(workload, search):
        _, query = _parse(None, search)
        return no_update if query.get("workload") == workload else "/trend?" + urlencode({"workload": workload})

    @app.callback(Output("url", "href", allow_duplicate=True), Input("trend-graph", "clickData"),
                  State("trend-workload", "value"), prevent_initial_call=True)
    def open_record(click, workload):
        points = (click or {}).get("points") or []
        data = points[0].get("customdata") if points else None
        if not data:
            return no_update
        return trend_page.record_url(workload, int(data[0]))


def serve(runs_dir: str | Path, host: str = "127.0.0.1", port: int = 8050, debug: bool = False,
          history: str | Path | None = None) -> None:
    app = create_app(runs_dir, history)
    print(f"mfuscope dashboard: {Path(runs_dir).resolve()} at http://{host}:{port}/  (Ctrl-C stops it)", flush=True)
    app.run(host=host, port=port, debug=debug)
