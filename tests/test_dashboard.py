"""The dashboard in a real browser: Debian's chromium driven by playwright, against `mfuscope dashboard`
serving two real 8-rank CPU runs of the reference trainer, the corpus's 8-rank NCCL DLRM set and a
broken run directory.

Every page must render with no browser console error, and each interaction must change the page
the way it should (asserted on page content).  Screenshots of every page and the measured page-load
times go to ``artifacts/dashboard/`` (look at them: legibility is checked by eye).  The views the
pages draw from are checked against independent references first: the breakdown leaves, the
closed-form pipeline bubble, the 1F1B order.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mfuscope import run_dir
from mfuscope.analyzers import breakdown, health, pipeline_schedule, timeline, trace_set
from mfuscope.analyzers import intervals as iv

from .helpers import DLRM, REPO

#: The paced lane (tests/lanes.py): its runs are paced, and an optimize run's measurements are shown.
pytestmark = [pytest.mark.slow, pytest.mark.paced]
ARTIFACTS = REPO / "artifacts" / "dashboard"
WAIT_S = 180  # seconds any page condition may take before the test gives up
try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips, saying why
    expect = None
CHROMIUM = "/usr/bin/chromium"
#: As the issue asks: headless, no sandbox (root in CI), no GPU, and no background networking --
#: the machine's closed network refuses those connections and chromium logs every refusal.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_3d, torchrun_run, optimized_gpipe, health_run) -> Path:
    """A runs directory as a user keeps one.  The session's shared runs (tests/shared_runs.py) are
    linked in under the names the pages are checked by: ``pp8`` (8 ranks, dp_shard=2 x tp=2 x pp=2,
    1F1B, 4 microbatches), ``no-window`` (mfuscope train through torchrun, no trace window) and
    ``gpipe`` with the ``gpipe-opt-*`` runs `mfuscope optimize --apply` made of it, and
    ``fail-slow`` (8 ranks x 100 steps, no trace window, two fail-slow faults), ``memory`` (2 pipeline
    stages that measured their memory) and ``crashed`` (2 ranks, rank 1 dies of SIGSEGV in step 2)."""
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.reference_trainer.launch import fork_ranks
    from mfuscope.reference_trainer.train import run_rank
    from mfuscope.tests.shared_runs import RUN_3D, RUN_3D_WORLD
    from mfuscope.trainer_options import TrainerOptions

    root = tmp_path_factory.mktemp("runs")
    (root / "pp8").symlink_to(run_3d, target_is_directory=True)
    # Paced stages (sleeps) keep 8 ranks on 2 cores timed like dedicated devices, and the injected
    # straggler must stand out in every step: with one of the 2 cores busy elsewhere, the busy time
    # of a stage's 4 ranks scatters by up to 0.2 s a step over their real compute (3 scaled MADs,
    # the detection threshold, reached 0.56 s), so rank 5 sleeps 250 ms in each of its 4 microbatch
    # forwards, 1 s a step.
    fork_ranks(run_rank, RUN_3D_WORLD, TrainerOptions(**RUN_3D, paced="fwd_ms=40,bwd_ms=80",
                                                  inject="compute:rank=5:ms=250", out=str(root / "pp8-straggler")))
    for run in sorted(optimized_gpipe["base"].parent.glob("gpipe*")):  # the poor start, and what optimize made
        (root / run.name).symlink_to(run, target_is_directory=True)
    if DLRM.is_dir():
        (root / "dlrm").symlink_to(DLRM, target_is_directory=True)
    (root / "broken").mkdir()
    (root / "broken" / run_dir.MANIFEST).write_text('{"schema_version": 1, "run_id": "cut off')
    # what else lies in a real runs directory: a run without a trace window, a run under an awkward
    # name, notes and a model folder -- none of which is a trace set
    (root / "no-window").symlink_to(torchrun_run, target_is_directory=True)
    (root / "fail-slow").symlink_to(health_run, target_is_directory=True)
    from mfuscope.tests.shared_runs import train_forked  # two pipeline stages that measured their memory
    train_forked(root / "memory", 2, layout="pp=2", steps=4, window="2:2", profile_memory=True)
    with pytest.raises(RuntimeError, match="killed by signal 11"):  # rank 1 crashes at step 2, no trace window
        train_forked(root / "crashed", 2, layout="dp_shard=2", steps=4, inject="die:rank=1:step=2:signal=SEGV")
    (root / "odd name #1 [x]").symlink_to(root / "pp8", target_is_directory=True)
    (root / "notes.json").write_text('{"what": "not a trace"}')
    (root / "checkpoint").mkdir()
    (root / "checkpoint" / "config.json").write_text('{"dim": 64}')
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def history(runs, tmp_path_factory) -> Path:
    """A CI history for the Trend page: ten runs simulated from the gpipe run's real report (1% step
    noise), then the gpipe run itself and the run `optimize --apply` made of it, recorded by
    `mfuscope ci record`."""
    from mfuscope.regression.history import append
    from mfuscope.regression.simulate import noisy_record

    root = tmp_path_factory.mktemp("history")
    gpipe = runs / "gpipe"
    report, manifest = (json.loads((gpipe / f).read_text()) for f in ("report.json", "manifest.json"))
    rng = np.random.default_rng(0)
    for i in range(10):
        append(root, {**noisy_record(report, manifest, rng, 0.01, index=i), "workload": "gpipe"})
    # the run optimize kept (more microbatches: its pipeline counters differ from the base's)
    optimized = runs / Path(json.loads((gpipe / "optimize.json").read_text())["final"]["run"]).name
    from mfuscope.cli import main
    for commit, run in (("c0ffee1", gpipe), ("c0ffee2", optimized)):
        assert main(["ci", "record", str(run), "--history", str(root), "--workload", "gpipe", "--commit", commit,
                     "--branch", "main"]) == 0
    return root


@pytest.fixture(scope="module")
def server(runs, history, tmp_path_factory):
    port = _free_port()
    env = {**os.environ, "MFUSCOPE_CACHE_DIR": str(tmp_path_factory.mktemp("dash-cache"))}
    log = open(tmp_path_factory.mktemp("dash-log") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mfuscope", "dashboard", str(runs), "--port", str(port),
                             "--history", str(history)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.25)
    else:
        proc.kill()
        proc.wait()
    if proc.poll() is not None:
        log.seek(0)
        pytest.fail(f"mfuscope dashboard did not start:\n{log.read()[-3000:]}")
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    log.seek(0)
    text = log.read()
    assert "Traceback" not in text, text[-4000:]  # a page may fail into an error panel, never crash


def _chromium() -> str:
    """Debian's chromium; installed with apt when missing (the CI machine starts without it)."""
    if not Path(CHROMIUM).exists() and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=900)
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing and could not be installed with apt "
                    "(needs root and Debian's package index)")
    return CHROMIUM


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the [dev] extra; not installed")
    executable = _chromium()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A browser tab that records console errors, with helpers for Dash pages."""

    def __init__(self, browser, base: str):
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        # Every wait is for a condition; the budget only bounds a hang.  A loaded 2-core CI machine
        # (analysis, 8-rank views and chromium sharing the cores) has taken over 30 s for one view.
        self.page.set_default_timeout(WAIT_S * 1000)
        self.page.set_default_navigation_timeout(WAIT_S * 1000)
        self.base = base
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, path: str, ready: str, timeout_s: float = WAIT_S) -> float:
        """Go to ``path`` and wait for ``ready`` (a selector); seconds it took."""
        t = time.perf_counter()
        self.page.goto(self.base + path)
        self.page.wait_for_selector(ready, timeout=timeout_s * 1000)
        return time.perf_counter() - t

    def settle(self, timeout_s: float = WAIT_S) -> None:
        """Wait until every data grid on the page has drawn its rows (or its no-rows overlay) and no
        callback is in flight: ag-grid renders rows after the page's other elements, which may be
        what ``open`` waited for, and a graph's first draw sends plotly's relayout back to the server."""
        self.page.wait_for_function(
            "() => [...document.querySelectorAll('.ag-root-wrapper')].every("
            "g => g.querySelector('.ag-row, .ag-overlay-no-rows-center'))"
            " && !document.querySelector('[data-dash-is-loading=\"true\"]')", timeout=timeout_s * 1000)

    def text(self, selector: str = "#page") -> str:
        return self.page.inner_text(selector)

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.wait_for_load_state("networkidle")
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def tab(browser, server):
    t = Page(browser, server)
    yield t
    t.close()
    assert not t.errors, f"browser console errors: {t.errors}"


# --------------------------------------------------------------------------- views, without a browser
def test_timeline_segments_tile_each_step_and_add_up_to_the_breakdown(runs):
    events = trace_set.load(runs / "pp8").events
    seg = timeline.segments(events)
    # independent reference 1: the raw step markers -- segments tile each (rank, step) exactly
    steps = events.to_pandas(["rank", "kind", "step", "ts_ns", "dur_ns"])
    steps = steps[steps["kind"] == "step"].set_index(["rank", "step"])
    for (rank, step), g in seg.groupby(["rank", "step"]):
        g = g.sort_values("start_ns")
        marker = steps.loc[(rank, step)]
        assert g["start_ns"].iloc[0] == marker["ts_ns"] and g["end_ns"].iloc[-1] == marker["ts_ns"] + marker["dur_ns"]
        assert (g["start_ns"].to_numpy()[1:] == g["end_ns"].to_numpy()[:-1]).all()  # no gap, no overlap
    # consistency with the breakdown's leaf totals (the report's numbers) per rank and step
    got = (seg.assign(s=(seg["end_ns"] - seg["start_ns"]) / 1e9, leaf=seg["leaf"].astype(str))
           .groupby(["rank", "step", "leaf"], observed=True)["s"].sum())
    want = breakdown.step_leaves(events).set_index(["rank", "step", "leaf"])["seconds"]
    assert len(got) == len(want) and (got.sort_index() - want.sort_index()).abs().max() < 1e-9


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 16), (8, 3)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_schedule_bubble_is_the_closed_form(schedule, p, m):
    # Narayanan et al. 2021: (p-1)/(m+p-1) for GPipe and 1F1B, with backward = 2 x forward.
    sim = pipeline_schedule.simulate(schedule, p, m, t_f=1.0, t_b=2.0)
    assert len(sim) == 2 * p * m
    assert pipeline_schedule.bubble_fraction(sim) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_executed_schedule_is_1f1b(runs):
    """The collectors label each stage's chunks; on the 8-rank 1F1B run every rank runs the order
    1F1B prescribes (Narayanan et al. 2021, PipeDream-Flush): p-1-s warm-up forwards, then one
    forward one backward, then the remaining backwards."""
    mb = timeline.microbatches(trace_set.load(runs / "pp8").events)
    manifest = run_dir.read_manifest(runs / "pp8")
    want = {0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],   # stage 0 of 2, 4 microbatches
            1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]}   # the last stage: no warm-up
    assert sorted(mb["step"].unique()) == [1, 2, 3]  # the window: every step after the first
    for (rank, step), g in mb.groupby(["rank", "step"]):
        stage = manifest["rank_coords"][str(rank)]["pp"]
        ordered = g.sort_values("start_ns")
        order = [f"{a}{m}" for a, m in zip(ordered["action"], ordered["microbatch"])]
        assert set(g["stage"]) == {stage}
        assert order == want[stage], (rank, step, order)


def test_lanes_ship_at_most_the_bins_asked_for_64_ranks():
    """What the browser receives for a 64-rank step is bounded by the bins, whatever the trace holds;
    each bin shows the category covering most of it (checked against a direct count); at
    ns-since-epoch times the lanes still start and end exactly at the step's edges."""
    rng = np.random.default_rng(0)
    t0 = 1_796_007_690_834_267_498  # a Kineto timestamp, ns since the epoch
    rows = []
    for rank in range(64):
        cuts = np.sort(rng.choice(np.arange(1, 10_000_000), 19_999, replace=False))
        edges = t0 + np.concatenate([[0], cuts, [10_000_000]])
        leaf = rng.choice(["compute/gemm", "comm/tp/all_gather", "idle"], edges.size - 1, p=[0.6, 0.3, 0.1])
        rows.append(pd.DataFrame({"rank": rank, "step": 0, "start_ns": edges[:-1], "end_ns": edges[1:], "leaf": leaf}))
    seg = pd.concat(rows, ignore_index=True)
    lanes = timeline.lanes(seg, t0, t0 + 10_000_000, bins=300)
    assert lanes.groupby("rank").size().max() <= 300
    assert (lanes.groupby("rank")["start_ns"].min() == t0).all() and (lanes.groupby("rank")["end_ns"].max() ==
                                                                        t0 + 10_000_000).all()
    one = seg[seg["rank"] == 7]  # bin 0 of rank 7, counted directly
    lo, hi = t0, t0 + 10_000_000 // 300
    cover = (np.minimum(one["end_ns"], hi) - np.maximum(one["start_ns"], lo)).clip(lower=0).groupby(one["leaf"]).sum()
    assert lanes[lanes["rank"] == 7].iloc[0]["leaf"] == cover.idxmax()


def test_ordered_split_matches_the_totals_split():
    """The time-ordered split used by the timelines gives, per category, exactly the time of the
    totals-only split the breakdown uses (random interval sets with priorities), merges a name that
    appears twice in the plan, and leaves an instant step empty."""
    rng = np.random.default_rng(1)
    for _ in range(50):
        cats = []
        for name in ("a", "b", "a", "c"):  # "a" twice, as a CPU plan can hold "bubble" twice
            s = np.sort(rng.integers(0, 1000, 30))
            cats.append((name, iv.union(s, s + rng.integers(1, 40, 30))))
        window = tuple(sorted(rng.integers(0, 1000, 2)))
        starts, ends, names = iv.segments_by_priority(window, cats, rest="idle")
        totals = iv.assign_by_priority(window, cats, rest="idle")
        got = pd.Series(ends - starts, dtype="int64").groupby(pd.Series(names, dtype=object)).sum()
        assert got.to_dict() == {k: v for k, v in totals.items() if v > 0}
        assert all(x != y for x, y in zip(names, names[1:]))  # neighbours differ: runs are merged
    assert iv.segments_by_priority((5, 5), cats, rest="idle")[2] == []


def test_a_change_tried_in_two_rounds_gets_a_bar_per_round():
    """optimize --apply may try the same change again on the base a round kept (more microbatches
    on the rebalanced run): each try is its own pair of bars, not one bar stacked on the other."""
    from mfuscope.dashboard import figures

    fixes = [{"fix": "more_microbatches", "summary": "microbatches 2 -> 4", "measured_step_s": step,
              "predicted_step_s": step, "run": f"/r/gpipe-opt-r{r}-more_microbatches-1"}
             for r, step in ((1, 1.8), (2, 1.4))]
    fig = figures.predicted_vs_measured_fixes(fixes)
    for bars in fig.data:
        assert len(set(bars.y)) == 2 and sorted(bars.x) == [1.4, 1.8]
    assert any(label.startswith("round 2 · more_microbatches") for label in fig.data[0].y)


def test_dashboard_command_names_a_missing_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mfuscope", "dashboard", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- the browser
PAGES = {  # page -> (path suffix, selector that means "rendered")
    "overview": ("", "#summary-cards"),
    "timeline": ("/timeline", "#timeline-graph .barlayer"),
    "pipeline": ("/pipeline", "#pipeline-graph .barlayer, .info-panel"),
    "comm": ("/comm", "#skew-heatmap .heatmaplayer, .info-panel"),
    "stragglers": ("/stragglers", "#straggler-heatmap .hm, #straggler-heatmap .heatmaplayer"),
    "health": ("/health", "#health-steps .js-plotly-plot, .info-panel"),
    "memory": ("/memory", "#memory-timeline .js-plotly-plot, .info-panel"),
    "kernels": ("/kernels", "#kernels-grid, .info-panel"),
    "optimize": ("/optimize", "#optimize-grid, .info-panel"),
}


def test_runs_page_lists_every_run_and_the_broken_one(tab, runs):
    tab.open("/", "#runs-grid .ag-row")
    tab.page.wait_for_selector("#broken-runs")
    grid = tab.text("#runs-grid")
    for name in ("pp8", "pp8-straggler", "broken", "no-window", "odd name #1 [x]") + (
            ("dlrm",) if (runs / "dlrm").exists() else ()):
        assert name in grid
    assert "checkpoint" not in grid and "notes" not in grid  # not runs
    assert "pp=2, dp_shard=2, tp=2 (1f1b, m=4)" in grid and "complete" in grid
    broken = tab.text("#broken-runs")
    assert "broken" in broken and "manifest.json" in broken  # which file, and that it is unreadable
    tab.shot("runs")
    # the broken run's own page is an error panel naming the file; the app goes on
    tab.open("/run/broken", ".error-panel")
    assert "manifest.json" in tab.text(".error-panel") and "cannot be shown" in tab.text(".error-panel")
    # a run without a trace window says so, with what the always-on collectors recorded
    tab.open("/run/no-window", "#run-info")
    info = tab.text("#run-info")
    assert "no traces" in tab.text() and "2 recorded on 4 rank(s)" in info, info  # the shared torchrun run
    assert "comm dp_shard_cp" in info and "comm tp" in info, info
    # a run that crashed says which rank died of what, where, before anything else
    tab.open("/run/crashed", "#why-stopped")
    why = tab.text("#why-stopped")
    assert "rank 1 died of SIGSEGV (Segmentation fault)" in why and "in begin_step" in why, why
    assert "rank 1 never entered it (it died of SIGSEGV: above)" in why, why
    tab.shot("crashed")
    tab.open("/", "#runs-grid .ag-row")
    tab.page.locator("#runs-grid a", has_text="odd name #1 [x]").click()  # an awkward name round-trips the URL
    tab.page.wait_for_selector("#summary-cards, #analysis-progress")
    assert "odd name #1 [x]" in tab.text("h2")
    tab.open("/", "#runs-grid .ag-row")
    # open a run by its name: nothing has analyzed it yet, so its first view shows the progress
    tab.page.locator("#runs-grid a", has_text="pp8").filter(has_not_text="straggler").click()
    tab.page.wait_for_url("**/run/pp8")
    tab.page.wait_for_selector("#analysis-progress")
    progress = tab.text()
    tab.page.screenshot(path=str(ARTIFACTS / "pp8-analyzing.png"))
    assert "Analyzing pp8" in progress and "%" in progress, progress
    tab.page.wait_for_selector("#summary-cards", timeout=300_000)
    assert "Overview: pp8" in tab.text()


def test_health_page_shades_the_episodes_of_a_run_that_turned_slow(tab, runs):
    """The fail-slow run (tests/shared_runs.health_run: no trace window) has a Health page, linked from
    its no-traces page: the step time over all 100 steps with each episode shaded, the episodes'
    table (rank 5 compute-slow from step 60, rank 6's dp groups comm-slow from step 30) and the
    rank scores, rank 5 lowest."""
    tab.open("/run/fail-slow", "#run-info")
    tab.page.locator("a", has_text="Health").last.click()
    tab.page.wait_for_selector("#health-steps .js-plotly-plot")
    tab.settle()
    episodes = tab.text("#health-episodes")
    assert "compute-slow" in episodes and "comm-slow" in episodes, episodes
    shapes = tab.page.evaluate("() => document.querySelector('#health-steps .js-plotly-plot').layout.shapes"
                               ".filter(s => s.type === 'rect').map(s => [s.x0, s.x1])")
    # One shaded span per episode the analysis finds, from its onset to its end step (an intermittent
    # one is a line at each period instead); among them the two faults.  (A loaded runner can slow a
    # rank for a while besides: that is an episode too.)
    spans = sorted((round(x0 + 0.5), round(x1 - 0.5)) for x0, x1 in shapes)
    found = sorted((e["onset_step"], e["end_step"]) for e in health.analyze(runs / "fail-slow")["episodes"]
                   if not e["period"])
    assert spans == found, (shapes, found)
    assert any(abs(a - 30) <= 2 for a, _ in spans) and any(abs(a - 60) <= 2 for a, _ in spans), spans
    first_row = '#health-scores .ag-center-cols-container .ag-row[row-index="0"] [col-id="rank"]'
    assert tab.page.inner_text(first_row) == "5"
    tab.shot("fail-slow-health")


def test_memory_page_shows_the_peak_its_categories_and_the_prediction(tab, runs):
    """A run recorded with --profile-memory: the overview's peak-memory card links to the Memory page,
    which draws the peak rank's series (the memory timeline's categories stacked, Kineto's CPU
    allocator line), the categories at the peak beside the cost model's, and each rank's peak --
    the report's figures (analyzers/memory.py), shown as it wrote them."""
    _first_visit(tab, "memory")
    report = json.loads((runs / "memory" / "report.json").read_text())
    top = report["memory"]["per_rank"][0]
    tab.page.locator("#summary-cards a", has_text="see Memory").click()
    tab.page.wait_for_selector("#memory-timeline .js-plotly-plot")
    tab.settle()
    names = tab.page.evaluate("() => document.querySelector('#memory-timeline .js-plotly-plot').data.map(t => t.name)")
    assert {"parameter", "optimizer state", "activation", "allocated (kineto cpu)"} <= set(names), names
    bars = tab.page.evaluate("() => document.querySelector('#memory-categories .js-plotly-plot').data"
                             ".map(t => [t.name, t.x, t.y])")
    by_name = {name: dict(zip(x, y)) for name, x, y in bars}
    assert by_name["measured at the peak"]["activation"] == pytest.approx(top["categories"]["activation"] / 2**20)
    assert by_name["predicted (cost model)"]["parameter"] == pytest.approx(top["predicted"]["parameter"] / 2**20)
    cell = '#memory-ranks .ag-center-cols-container .ag-row[row-index="0"] [col-id="peak"]'
    assert tab.page.inner_text(cell).replace(",", "") == str(top["peak_allocated_bytes"])
    tab.shot("memory")
    # the other stage's row opens its own series and categories (each stage holds its own layers)
    (other,) = [e for e in report["memory"]["per_rank"] if e["rank"] != top["rank"]]
    tab.page.click(f'#memory-ranks .ag-center-cols-container .ag-row[row-id="{other["rank"]}"] [col-id="peak"]')
    tab.page.wait_for_url(f"**/memory?rank={other['rank']}")
    tab.page.wait_for_selector(f"h3:has-text('Rank {other['rank']}, peak')")
    tab.settle()
    bars = tab.page.evaluate("() => document.querySelector('#memory-categories .js-plotly-plot').data"
                             ".map(t => [t.name, t.x, t.y])")
    by_name = {name: dict(zip(x, y)) for name, x, y in bars}
    assert by_name["measured at the peak"]["activation"] == pytest.approx(other["categories"]["activation"] / 2**20)
    assert other["categories"]["activation"] != top["categories"]["activation"]


def _first_visit(tab: Page, run: str) -> None:
    """Open a run's overview, waiting out its first analysis (the tests may run in any subset)."""
    tab.page.goto(tab.base + f"/run/{run}")
    tab.page.wait_for_selector("#summary-cards", timeout=300_000)


@pytest.mark.parametrize("run", ["pp8", "dlrm"])
def test_every_page_renders(tab, runs, run):
    if not (runs / run).exists():
        pytest.skip(f"the corpus DLRM set is not at {DLRM} (set MFUSCOPE_CORPUS)")
    _first_visit(tab, run)
    needles = {
        "pp8": {"overview": ["FLOPs from model spec", "dp_shard_cp", "reduce_scatter", "communication (tp dimension)",
                            "cost model: predicted gain"],
                "timeline": ["rank 7 · pp1 dp_shard1 tp1", "comm/tp", "bubble"],
                "pipeline": ["measured bubble", "theory: 1f1b", "p=2 stages, m=4 microbatches", "F3", "B3"],
                "comm": ["send_recv", "reduce_scatter", "Arrival lag"],
                "stragglers": ["Busy time over the median rank"], "kernels": ["No GPU kernels"],
                "health": ["Not enough steps to judge", "warm-up"],
                "memory": ["No memory was measured", "--profile-memory"],
                "optimize": ["Optimize: pp8", "interleaved_schedule", "predicted gain"]},
        "dlrm": {"overview": ["Tesla V100", "hardware table: V100", "launch-bound"],
                 "timeline": ["rank 7", "comm/unknown"],
                 "pipeline": ["No pipeline parallelism"], "comm": ["all_reduce", "all_to_all"],
                 "stragglers": ["No straggler"], "kernels": ["ncclKernel_SendRecv", "gemm"],
                 "health": ["Health needs a run directory"],
                 "memory": ["No memory was measured"],
                 "optimize": ["No model spec"]},
    }[run]
    times = {}
    for page, (suffix, ready) in PAGES.items():
        times[page] = tab.open(f"/run/{run}{suffix}", ready)
        tab.settle()  # the comm page's info panel, for one, is there before its table's rows
        if page == "timeline":  # its lanes' names are the y axis' ticks, drawn after the first bars,
            # one lane after another: wait for the last rank's (a core kept busy beside the browser
            # left the page read after the first tick and before rank 7's)
            tab.page.locator("#timeline-graph .ytick", has_text="rank 7").first.wait_for()
        if page == "overview":
            tab.page.wait_for_selector("#breakdown .slice")
            body = tab.text() + " ".join(tab.page.locator("#breakdown .slice").all_text_contents())
        else:
            body = tab.text()
        for needle in needles[page]:
            assert needle in body, (page, needle, body[:2000])
        tab.shot(f"{run}-{page}")
        if page == "kernels" and run == "dlrm":  # the table filters by name
            tab.page.locator("#kernels-grid .ag-floating-filter-input input").first.fill("nccl")
            expect(tab.page.locator("#kernels-grid .ag-center-cols-container .ag-row")).to_have_count(2)
            names = tab.page.locator('#kernels-grid .ag-center-cols-container [col-id="name"]').all_inner_texts()
            assert all(n.startswith("nccl") for n in names), names
            # ...and sorts by a clicked column (the raw JSON's counts: 40 SendRecv, 24 AllReduce kernels)
            tab.page.locator('#kernels-grid .ag-header-cell[col-id="count"] .ag-header-cell-label').click()
            rows = '#kernels-grid .ag-center-cols-container .ag-row[row-index="{}"]'
            expect(tab.page.locator(rows.format(0))).to_contain_text("AllReduce")  # rows sit in DOM order
            assert [tab.page.locator(rows.format(i) + ' [col-id="count"]').inner_text() for i in (0, 1)] == ["24", "40"]
    # page load after the first analysis: median of 5 loads of the overview, in the browser
    loads = [tab.open(f"/run/{run}", "#breakdown .slice") for _ in range(5)]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"page_load_{run}.json").write_text(json.dumps(
        {"overview_median_s": statistics.median(loads), "overview_loads_s": loads, "first_render_s": times}, indent=2))
    print(f"\n{run}: overview load median {statistics.median(loads):.3f} s; pages {times}")


def test_clicking_a_breakdown_node_shows_it_per_rank(tab):
    _first_visit(tab, "pp8")
    tab.page.wait_for_selector("#breakdown .slice")
    assert tab.page.locator("#node-title").count() == 0
    tab.page.locator("#breakdown g.slice", has_text="tp").first.click()
    tab.page.wait_for_selector("#node-title")
    title = tab.text("#node-title")
    assert title.startswith("comm/tp: ") and "per step" in title and "of the step" in title
    assert tab.page.locator("#node-detail .xtick").count() == 8  # one bar per rank
    tab.shot("pp8-overview-node-clicked")


def test_clicking_a_straggler_cell_opens_that_rank_and_step(tab):
    _first_visit(tab, "pp8-straggler")
    tab.open("/run/pp8-straggler/stragglers", "#straggler-heatmap .nsewdrag")
    assert "rank 5 costs everyone" in tab.text()  # the injected rank is named a straggler
    box = tab.page.locator("#straggler-heatmap .nsewdrag").bounding_box()
    steps, ranks = 3, 8  # steps 1..3 in the window, ranks 0..7 top to bottom
    tab.page.mouse.click(box["x"] + box["width"] * (1.5 / steps), box["y"] + box["height"] * (5.5 / ranks))
    tab.page.wait_for_url("**/run/pp8-straggler/timeline?step=2&rank=5")
    tab.page.wait_for_selector("#timeline-graph .barlayer")
    assert "rank 5, step 2" in tab.text("#timeline-title")
    assert tab.page.locator("#timeline-step").inner_text().strip() == "step 2"
    # rank 5's lane (the 6th from the top) is highlighted
    lanes = tab.page.evaluate("""() => document.querySelector('#timeline-graph .js-plotly-plot').layout.shapes
                                       .filter(s => s.fillcolor === '#ffd54f').map(s => [s.y0, s.y1])""")
    assert lanes == [[4.5, 5.5]]
    tab.shot("pp8-straggler-timeline-from-heatmap")


def test_overview_shows_the_cost_models_prediction_beside_the_measurement(tab, runs):
    """The 8-rank run's manifest has the model spec, so the Overview puts the cost model's leaves
    beside the measured ones: the same numbers `mfuscope analyze --predict` prints."""
    _first_visit(tab, "pp8")
    tab.page.wait_for_selector("#prediction-grid .ag-row")
    text = tab.text("#prediction")
    assert "predicted against measured" in text and "tp=2+sp pp=2 1f1b fsdp=2" in text, text
    assert "comm/tp/" in text and "bubble" in text and "step" in text
    tab.page.wait_for_selector("#prediction-bars .bars")
    tab.shot("pp8-overview-prediction")


def test_planner_page_ranks_layouts_and_shows_each_ones_breakdown(tab, runs):
    """The planner page: the ranked layouts of the CLI's `mfuscope plan` for the same inputs, a
    clicked row's predicted breakdown, the predicted scaling curve of `plan --scaling`, the measured
    scaling of the runs of one model at two sizes (``memory``: 2 ranks, ``pp8``: 8, the same 8
    sequences a step: strong scaling), and a new plan from the form."""
    for run in ("memory", "pp8"):  # analyzed (the measured scaling reads analyzed runs only)
        _first_visit(tab, run)
    query = "model=llama3-8b&gpus=64&gpu=H100&batch=128&seq=8192&dtype=bf16&scaling=8,64,512,4096,16384"
    tab.open(f"/plan?{query}", "#plan-grid .ag-row")
    cli = subprocess.run([sys.executable, "-m", "mfuscope", "plan", "--model", "llama3-8b", "--gpus", "64",
                          "--gpu", "H100", "--global-batch", "128", "--seq-len", "8192", "--json",
                          "--scaling", "8,64,512,4096,16384"], capture_output=True, text=True, timeout=120)
    planned = json.loads(cli.stdout)
    best = planned["ranked"][0]["layout"]
    tab.page.wait_for_selector("#plan-scaling .js-plotly-plot")
    curve = tab.page.evaluate("() => document.querySelector('#plan-scaling .js-plotly-plot').data[0]")
    assert curve["x"] == [8, 64, 512, 4096, 16384]
    assert curve["y"] == pytest.approx([r["efficiency"] for r in planned["scaling"]])
    layouts = tab.page.locator('#plan-scaling-grid .ag-center-cols-container [col-id="layout"]').all_inner_texts()
    assert layouts == [r["layout"] for r in planned["scaling"]]
    # measured: tokens/s per device of pp8 (8 ranks) over the memory run's (2 ranks), from their reports
    tps = {r: json.loads((runs / r / "report.json").read_text())["summary"]["tokens_per_s"] for r in ("memory", "pp8")}
    grid_rows = '#measured-scaling-grid .ag-center-cols-container .ag-row'
    tab.page.wait_for_selector(grid_rows)
    cells = {tab.page.locator(f'{grid_rows}[row-index="{i}"] [col-id="run"]').inner_text():
             tab.page.locator(f'{grid_rows}[row-index="{i}"] [col-id="efficiency"]').inner_text()
             for i in range(tab.page.locator(grid_rows).count())}
    assert float(cells["pp8"].rstrip("%")) == pytest.approx(tps["pp8"] / 8 / (tps["memory"] / 2) * 100, abs=0.051)
    assert cells["memory"] == "100.0%" and "strong" in tab.text("#measured-scaling-grid")
    first = '#plan-grid .ag-center-cols-container .ag-row[row-index="0"]'
    expect(tab.page.locator(first)).to_contain_text(best)
    assert f"#1: {best}" in tab.text("#plan-breakdown")
    tab.page.locator('#plan-grid .ag-center-cols-container .ag-row[row-index="2"]').click()
    third = tab.page.locator('#plan-grid .ag-center-cols-container .ag-row[row-index="2"] '
                             '[col-id="layout"]').inner_text()
    expect(tab.page.locator("#plan-breakdown")).to_contain_text(f"#3: {third}")
    assert "does not fit in memory" in tab.text("#plan-rejected")
    tab.shot("planner")
    tab.page.fill("#plan-gpus", "128")
    tab.page.click("#plan-go")
    tab.page.wait_for_url("**/plan?*gpus=128*")
    expect(tab.page.locator("#plan-summary")).to_contain_text("on 128 x H100")


def test_optimize_page_shows_proposals_and_what_was_applied(tab, runs):
    """The Optimize page of a run `mfuscope optimize --apply` worked on: the proposals, the
    predicted against measured steps of the fixes it ran (the numbers of its optimize.json), and
    the new runs, which the runs page lists."""
    summary = json.loads((runs / "gpipe" / "optimize.json").read_text())
    _first_visit(tab, "gpipe")
    tab.open("/run/gpipe/optimize", "#optimize-grid .ag-row")
    assert "more_microbatches" in tab.text("#optimize-grid")
    tab.page.wait_for_selector("#optimize-bars .bars")
    final = tab.text("#optimize-final")
    assert "more_microbatches" in final and "final" in final
    listed = tab.text("#optimize-runs")
    ran = [f for f in summary["fixes"] if f["measured_step_s"] is not None]
    assert ran and all(Path(f["run"]).name in listed for f in ran)
    tab.shot("gpipe-optimize")
    # Each fix's run opens beside the base on the Compare page, the fix named.
    href = tab.page.locator("#optimize-runs a.compare-fix-link").first.get_attribute("href")
    tab.open(href, "#compare-summary-box .ag-row")
    assert ran[0]["fix"] in tab.text("#compare-fix") and ran[0]["summary"] in tab.text("#compare-fix")
    assert Path(ran[0]["run"]).name in tab.text("#compare-summary-box")
    tab.open("/", "#runs-grid .ag-row")
    assert Path(ran[0]["run"]).name in tab.text("#runs-grid")


def _cell(tab: Page, row_text: str, col: str) -> str:
    return tab.page.locator(f'#compare-summary-box .ag-row:has-text("{row_text}") [col-id="{col}"]').inner_text()


def test_ticking_two_runs_then_switching_the_compare_pair(tab):
    for run in ("pp8", "pp8-straggler"):
        _first_visit(tab, run)
    tab.open("/", "#runs-grid .ag-row")
    for run in ("pp8", "pp8-straggler"):
        tab.page.locator(f'#runs-grid .ag-row[row-id="{run}"] input[type=checkbox]').check()
    link = tab.page.locator("#compare-link")
    expect(link).to_have_text("Compare pp8 with pp8-straggler")
    link.click()
    tab.page.wait_for_selector("#compare-summary-box .ag-row")
    assert "base: pp8" in tab.text("#compare-summary-box") and "new: pp8-straggler" in tab.text("#compare-summary-box")
    before = tab.text("#compare-summary-box")
    step_change = _cell(tab, "step time", "change")
    tab.shot("compare-pp8-pp8-straggler")
    # switch the pair: new = pp8 and base = pp8-straggler
    tab.page.locator("#compare-a").click()
    tab.page.get_by_role("option", name="pp8-straggler", exact=True).click()
    tab.page.wait_for_url("**/compare?a=pp8-straggler&b=pp8-straggler")
    # the page redraws for the new pair (the dropdowns too): open the next one only once it has
    expect(tab.page.locator('#compare-summary-box .ag-header-cell[col-id="base"]')).to_have_text("base: pp8-straggler")
    tab.page.locator("#compare-b").click()
    tab.page.get_by_role("option", name="pp8", exact=True).click()
    tab.page.wait_for_url("**/compare?a=pp8-straggler&b=pp8")
    expect(tab.page.locator('#compare-summary-box .ag-header-cell[col-id="new"]')).to_have_text("new: pp8")
    after = tab.text("#compare-summary-box")
    assert "base: pp8-straggler" in after and after != before
    # the step-time change flips sign with the pair
    assert ("+" in step_change) != ("+" in _cell(tab, "step time", "change"))
    tab.shot("compare-switched")


def test_an_analysis_older_than_its_traces_is_redone(tmp_path):
    """Traces copied in again after their analysis make it stale: the store analyzes them anew."""
    if not DLRM.is_dir():
        pytest.skip(f"the corpus DLRM set is not at {DLRM} (set MFUSCOPE_CORPUS)")
    from mfuscope.dashboard.store import Store

    shutil.copytree(DLRM, tmp_path / "runs" / "dlrm")
    store = Store(tmp_path / "runs")
    (run,) = store.runs()
    assert run.kind == "traces" and not store.analyzed(run)
    job = store.ensure_analysis(run)
    for _ in range(600):
        if job.done:
            break
        time.sleep(0.1)
    assert job.error is None and store.ensure_analysis(run) is None and store.analyzed(run)
    trace = next((tmp_path / "runs" / "dlrm").glob("*.json"))
    later = run.report_path.stat().st_mtime + 10
    os.utime(trace, (later, later))
    assert not store.analyzed(run)


def test_trend_page_opens_a_commit_against_its_baseline(tab, runs):
    """The Trend page draws the history; clicking the newest point (the optimized run) opens that
    commit checked against the records before it, which links to Compare of the two real runs."""
    tab.open("/trend", "#trend-graph .scatterlayer .trace .points path")
    assert "12 records" in tab.text()
    tab.shot("trend")
    tab.page.locator("#trend-graph .scatterlayer .trace").first.locator(".points path").last.click(force=True)
    tab.page.wait_for_url("**/trend/record?workload=gpipe&index=11")
    tab.page.wait_for_selector("#trend-stat .ag-row")
    assert "c0ffee2" in tab.text() and "11 record(s) before it" in tab.text("#trend-status")
    # more microbatches: twice the pipeline sends and receives a step, which the deterministic
    # gate lists (an intended change is recorded with --accept)
    tab.page.wait_for_selector("#trend-det .ag-row")
    assert "comm/pp/" in tab.text("#trend-det")
    tab.page.locator("#trend-compare-runs").click()
    tab.page.wait_for_selector("#compare-summary-box .ag-row")
    assert "base: gpipe" in tab.text("#compare-summary-box") and "gpipe-opt-" in tab.text("#compare-summary-box")
