"""The dashboard on a 1,024-rank run, in a real browser: lanes of grouped ranks with a drill-down to
one rank, and the per-rank heatmaps cut to the worst ranks -- no page reads every rank's events.

The run is synthetic but analyzed for real (tests/helpers.synthetic_job: 1,024 small Kineto traces
of a data-parallel job, rank 517's GEMM 400 us slower in step 2, so every rank waits for it in that
step's all-reduce), by the dashboard itself on the first visit.  Expected values come from that
construction: rank 517 is the latest rank of step 2, its block of 32 ranks (512-543) the latest
group, and the one every rank waited for.  Each page's load time (median of 3, in the browser) goes
to ``artifacts/dashboard/page_load_1024.json``; speed is reported, not asserted (a loaded CI
machine is no measure of it).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

import pytest

from .helpers import synthetic_job
from .test_dashboard import ARTIFACTS, WAIT_S, Page, _free_port, browser  # noqa: F401 -- browser: a fixture

#: The paced lane (tests/lanes.py): page loads are timed, so the machine should be otherwise idle.
pytestmark = [pytest.mark.slow, pytest.mark.paced]
WORLD, SLOW_RANK, SLOW_STEP = 1024, 517, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    synthetic_job(runs / "job1024", WORLD, slow_rank=SLOW_RANK, slow_step=SLOW_STEP)
    port = _free_port()
    env = {**os.environ, "MFUSCOPE_CACHE_DIR": str(tmp_path_factory.mktemp("dash-cache"))}
    log = open(tmp_path_factory.mktemp("dash-log") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mfuscope", "dashboard", str(runs), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log.seek(0)
                pytest.fail(f"mfuscope dashboard did not start:\n{log.read()[-3000:]}")
            time.sleep(0.25)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    log.seek(0)
    text = log.read()
    assert "Traceback" not in text, text[-4000:]


@pytest.fixture(scope="module")
def tab(browser, server):  # noqa: F811 -- the browser fixture imported above
    t = Page(browser, server)
    # the first visit analyzes the 1,024 ranks (a progress bar until the report is on disk)
    t.page.goto(server + "/run/job1024")
    t.page.wait_for_selector("#summary-cards", timeout=600_000)
    yield t
    t.close()
    assert not t.errors, f"browser console errors: {t.errors}"


def _categories(tab: Page) -> list[str]:
    return tab.page.evaluate("() => document.querySelector('#timeline-graph .js-plotly-plot')"
                             ".layout.yaxis.categoryarray")


def _load(tab: Page, path: str, ready: str) -> float:
    return statistics.median(tab.open(path, ready) for _ in range(3))


def test_a_1024_rank_run_on_the_timeline_stragglers_and_communication_pages(tab):
    times = {}
    # Timeline: 32 lanes of 32 ranks; in step 2 the block holding rank 517 is the latest, drawn as rank 517.
    ready = "#timeline-graph .barlayer"
    times["timeline"] = _load(tab, f"/run/job1024/timeline?step={SLOW_STEP}", ready)
    assert "1,024 ranks: a lane a group of ranks (block)" in tab.text("#timeline-grouped")
    lanes = _categories(tab)
    assert len(lanes) == 32, lanes
    assert lanes[0].startswith("ranks 512–543 (32 ranks) · latest: rank 517, +400"), lanes[0]
    # in step 1 nobody is late: the lanes are the blocks in rank order, each drawn as its first rank
    tab.open("/run/job1024/timeline?step=1", ready)
    assert [lane.split(" (")[0] for lane in _categories(tab)][:2] == ["ranks 0–31", "ranks 32–63"]
    # drill-down: a rank typed in gets its own lane on top, read from its view
    tab.page.fill("#timeline-rank-input", "3")
    tab.page.press("#timeline-rank-input", "Enter")
    tab.page.wait_for_url("**/run/job1024/timeline?step=1&rank=3")
    tab.page.wait_for_function("() => document.querySelector('#timeline-graph .js-plotly-plot')"
                               "?.layout?.yaxis?.categoryarray?.[0]?.startsWith('rank 3 ')", timeout=WAIT_S * 1000)
    assert _categories(tab)[0] == "rank 3 (ranks 0–31)"
    assert "rank 3, step 1" in tab.text("#timeline-title")
    tab.shot("job1024-timeline-rank3")

    # Stragglers: the heatmap holds the 64 worst ranks, rank 517 among them; the note says where the rest is.
    times["stragglers"] = _load(tab, "/run/job1024/stragglers", "#straggler-heatmap .heatmaplayer")
    assert "Showing the 64 worst of 1,024 ranks" in tab.text("#capped-straggler_matrix")
    assert "views/ranks/straggler_matrix.parquet" in tab.text("#capped-straggler_matrix")
    heat_ranks = tab.page.evaluate("() => document.querySelector('#straggler-heatmap .js-plotly-plot').data[0].y")
    assert len(heat_ranks) == 64 and "rank 517" in heat_ranks
    tab.shot("job1024-stragglers")

    # Communication: one all-reduce row for the 3,072 calls, and everyone waited for rank 517.
    times["comm"] = _load(tab, "/run/job1024/comm", "#skew-heatmap .heatmaplayer")
    tab.settle()
    body = tab.text()
    assert "all_reduce" in body and "3,072" in body, body[:2000]
    assert "everyone waited most for rank 517" in body
    assert "Showing the 64 worst of 1,024 ranks" in tab.text("#capped-comm_arrival")
    tab.shot("job1024-comm")

    times["overview"] = _load(tab, "/run/job1024", "#summary-cards")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "page_load_1024.json").write_text(json.dumps({"ranks": WORLD, "median_of_3_s": times}, indent=2))
    print(f"\n1,024 ranks: page loads (median of 3) {times}")
