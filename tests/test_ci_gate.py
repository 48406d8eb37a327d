"""``mfuscope ci``: the history, both gates, the outputs, and the GitHub workflow's steps run here.

Real runs: the workflow's own `run:` steps train the tiny config (2 gloo ranks, tp=2) for two
pushes to main (the second a docs-only commit), against a local origin with the perf-history
branch; a sequence-parallel-off run is then checked against that history; then two pull
requests run the workflow's steps with their in-job rerun: a deliberately slowed commit (fails)
and the unchanged one (passes).  The statistical gate's false-positive rate and power are
measured on histories simulated from the first run's real report (regression/simulate.py:
log-normal step noise of a known CV, a known MFU drop), and on a recorded history of 60 real
runs of this machine, replayed (regression/replay.py, tests/fixtures/ci_history/).
Expected values come from the arithmetic: the tensor-parallel calls and bytes a step makes by
hand count, nccl-tests' bus factors, a permutation test for Mann-Whitney's p-value.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import yaml

from mfuscope.regression import check as check_mod
from mfuscope.regression import deterministic, paired, replay, simulate, statistical
from mfuscope.regression import statistics as st
from mfuscope.regression.history import History, append, read

from . import lanes
from .helpers import REPO

#: The paced lane (tests/lanes.py): the gate compares real runs' step times (one fixture run feeds all).
pytestmark = pytest.mark.paced
WORKFLOW = REPO / ".github" / "workflows" / "mfu-regression.yml"
BIN = Path(sys.executable).parent
CLI = [sys.executable, "-m", "mfuscope"]


# ----------------------------------------------------------------------------- statistics


def _permutation_p(x, y, rng, n=20000):
    """One-sided P(U <= observed) by shuffling the pooled samples (independent of the formula)."""
    both = np.concatenate([x, y])
    def u(a, b):
        return (a[:, None] < b[None, :]).sum() + 0.5 * (a[:, None] == b[None, :]).sum()
    # U counts pairs where x is *larger*: small U = x smaller
    obs = u(y, x)
    hits = 0
    for _ in range(n):
        rng.shuffle(both)
        hits += u(both[len(x):], both[:len(x)]) <= obs
    return hits / n


@pytest.mark.parametrize("shift, ties", [(0.6, False), (0.0, False), (0.4, True)])
def test_mann_whitney_matches_a_permutation_test(shift, ties):
    rng = np.random.default_rng(3)
    x, y = rng.normal(0, 1, 15), rng.normal(shift, 1, 25)
    if ties:
        x, y = np.round(x, 0), np.round(y, 0)
    p_perm = _permutation_p(x, y, rng)
    # the normal approximation is accurate to about 0.01 at these sizes; the Monte Carlo estimate
    # has a standard error of sqrt(p(1-p)/20000) <= 0.0035
    assert abs(st.mann_whitney_less(x, y) - p_perm) < 0.02


def test_pelt_finds_known_shifts_and_no_shift_in_noise():
    rng = np.random.default_rng(11)
    x = np.r_[rng.normal(1.0, 0.01, 40), rng.normal(0.94, 0.01, 30), rng.normal(1.02, 0.01, 30)]
    assert st.change_points(x) == [40, 70]
    quiet = sum(len(st.change_points(rng.normal(1.0, 0.01, 100))) for _ in range(50))
    assert quiet <= 3  # penalty 3 log n: a noise-only series of 100 rarely shows one


def test_trimmed_mean_and_robust_sigma_ignore_an_outlier():
    assert st.trimmed_mean([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000]) == pytest.approx(5.5)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2.0, 20000)
    x[:50] = 1e6
    # MAD's standard error at n=20000 is about 0.8% of sigma
    assert st.robust_sigma(x) == pytest.approx(2.0, rel=0.04)


# ----------------------------------------------------------------------------- the workflow, run here


def _steps(workflow: Path = WORKFLOW):
    doc = yaml.safe_load(workflow.read_text())
    job = doc["jobs"]["mfu"]
    return {k: str(v) for k, v in job["env"].items()}, job["steps"]


def _run_workflow(work: Path, event: str, sha: str, summary: Path, *, workflow: Path = WORKFLOW,
                  env_over: dict[str, str] | None = None, skip: tuple[str, ...] = (),
                  alone: bool = True) -> dict[str, int]:
    """The workflow's `run:` steps in order, as GitHub runs them (bash -e, the job's env).
    `uses:` steps are GitHub's own actions (checkout, setup-python, upload-artifact) and the
    install steps are what this test's environment already did: main's code, in a pull request's
    job, is the code installed here (an empty ``MAIN_CODE`` folder first on PYTHONPATH); the
    steps' `if:` is evaluated for ``event``.  ``workflow``: the workflow file as of the commit under test (GitHub
    runs a pull request's own); ``env_over``: job env values replaced; ``skip``: steps (by the
    start of their name) whose outputs the caller put in place.  Under make test the workflow
    has the machine to itself (tests/lanes.py, ``quiet``): its runs' step times are what the gate
    compares, one push's against another's.  ``alone=False``: the rest lane goes on beside it, for a
    job whose runs differ by far more than the rest lane could move them."""
    with lanes.quiet() if alone else contextlib.nullcontext():
        return _run_steps(work, event, sha, summary, workflow, env_over, skip)


def _run_steps(work, event, sha, summary, workflow, env_over, skip) -> dict[str, int]:
    env_vars, steps = _steps(workflow)
    env = {**os.environ, **env_vars, **(env_over or {}), "GITHUB_STEP_SUMMARY": str(summary), "GITHUB_SHA": sha,
           "GITHUB_EVENT_NAME": event, "GITHUB_REF_NAME": "main" if event == "push" else "7/merge",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("GITHUB_HEAD_REF", None)
    if event == "pull_request":
        env["GITHUB_HEAD_REF"] = "feature"
    (work / env["MAIN_CODE"]).mkdir(exist_ok=True)
    codes = {}
    for step in steps:
        if "run" not in step or step["name"].startswith(("Install", *skip)):
            continue
        cond = step.get("if", "")
        if any(f"github.event_name == '{e}'" in cond and event != e for e in ("push", "pull_request")):
            continue
        start = time.perf_counter()
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["run"]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        print(f"{event} step {step['name']!r}: exit {proc.returncode} in {time.perf_counter() - start:.1f} s")
        codes[step["name"]] = proc.returncode
        if proc.returncode != 0 and not step["name"].startswith("Check"):
            raise AssertionError(f"step {step['name']!r} failed: {proc.stderr[-3000:]}")
    return codes


def _fresh_checkout(work: Path) -> None:
    """A new job starts from a clean checkout: no history worktree, no run, no outputs."""
    subprocess.run(["git", "worktree", "remove", "--force", "perf-history"], cwd=work, capture_output=True)
    subprocess.run(["git", "worktree", "prune"], cwd=work, check=True)
    subprocess.run(["git", "branch", "-D", "perf-history"], cwd=work, capture_output=True)
    for p in ("runs", "mfu-junit.xml", "mfu-report.html", "main-code"):
        shutil.rmtree(work / p, ignore_errors=True) if (work / p).is_dir() else (work / p).unlink(missing_ok=True)


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=work, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """Two pushes to main through the workflow: commit A, then a docs-only commit B."""
    root = tmp_path_factory.mktemp("ci")
    origin, work = root / "origin.git", root / "work"
    subprocess.run(["git", "init", "--quiet", "--bare", str(origin)], check=True)
    subprocess.run(["git", "init", "--quiet", "-b", "main", str(work)], check=True)
    _git(work, "config", "user.email", "dev@example.com")
    _git(work, "config", "user.name", "dev")
    (work / "README.md").write_text("project\n")
    _git(work, "add", "README.md")
    _git(work, "commit", "--quiet", "-m", "A")
    _git(work, "remote", "add", "origin", str(origin))
    _git(work, "push", "--quiet", "origin", "main")
    out = {"root": root, "work": work, "origin": origin, "summaries": [], "codes": [], "shas": []}
    for i, message in enumerate(("A", "docs: typo")):
        if i:
            (work / "README.md").write_text("project, documented\n")
            _git(work, "commit", "--quiet", "-am", message)
        sha = _git(work, "rev-parse", "HEAD")
        _fresh_checkout(work)
        summary = root / f"summary-{i}.md"
        out["codes"].append(_run_workflow(work, "push", sha, summary))
        out["summaries"].append(summary.read_text())
        out["shas"].append(sha)
        out[f"junit{i}"] = (work / "mfu-junit.xml").read_text()
        out[f"html{i}"] = (work / "mfu-report.html").stat().st_size
        shutil.copytree(work / "runs" / "ci-tiny-tp2", root / f"run{i}")
    return out


def _history_lines(origin: Path) -> list[dict]:
    text = subprocess.run(["git", "--git-dir", str(origin), "show", "perf-history:tiny-tp2.jsonl"],
                          check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in text.splitlines()]


def test_workflow_records_pushes_to_the_history_branch(pushed):
    records = _history_lines(pushed["origin"])
    assert [r["commit"] for r in records] == pushed["shas"]
    assert all(r["branch"] == "main" and r["workload"] == "tiny-tp2" for r in records)
    assert len({r["fingerprint_id"] for r in records}) == 1
    # 21 steps, the first left out as warm-up: 20 samples a record, 19 where the trace window's
    # export took over a step (analyzers/step_rows.py: the collectors' time, not the job's)
    assert all(len(r["samples"]["step_time_s"]) in (19, 20) for r in records)
    first = pushed["summaries"][0]
    assert "insufficient data" in first and "no baseline record" in first


def test_a_docs_only_commit_passes_with_every_counter_unchanged(pushed):
    codes = pushed["codes"][1]
    assert codes["Check against main's history"] == 0
    summary = pushed["summaries"][1]
    assert "0 of" in summary and "changed" in summary and "❌" not in summary
    suite = ET.fromstring(pushed["junit1"])
    assert suite.get("failures") == "0"
    names = {c.get("name") for c in suite.iter("testcase")}
    assert {"mfu", "step_time_s", "deterministic"} <= names
    # the statistical gate has one matching record: it says so and is skipped
    skipped = [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None]
    assert set(skipped) == {"mfu", "step_time_s"}


def test_the_html_report_is_self_contained(pushed):
    page = (pushed["work"] / "mfu-report.html").read_text()
    # plotly.js inline: no script is fetched from anywhere
    assert "plotly" in page.lower() and not re.search(r"<script[^>]*\bsrc=", page)
    assert pushed["html1"] > 1_000_000  # plotly.js inline


def test_counters_are_what_the_layout_makes(pushed):
    """Hand count for tp=2 with sequence parallelism, 4 layers, batch 8 x 32 tokens x dim 64, fp32:
    per rank and step, an all-gather before attention and before the MLP in each layer's forward
    and backward (the reduce-scatters' gradients), one for the LM head's input and one for the
    embedding's gradient: 4 x 4 + 2 = 18; the same number of reduce-scatters; each moves the
    full activation, 8 x 32 x 64 x 4 bytes."""
    rec = _history_lines(pushed["origin"])[0]
    comm = {(c["dim"], c["op"]): c for c in rec["counters"]["comm"]}
    full = 8 * 32 * 64 * 4
    for op in ("all_gather", "reduce_scatter"):
        assert comm[("tp", op)]["calls_per_step"] == 2 * 18
        assert comm[("tp", op)]["bytes_per_step"] == 2 * 18 * full
    ar = comm[("tp", "all_reduce")]["bytes_per_step"]
    # All-reduces besides the layers', per rank: the vocabulary-parallel loss's three over the 256
    # tokens' fp32 values (max, sum of exponentials, target logit: 1 KB each); the sequence-parallel
    # norms' weight gradients once, in one call (9 x 64 fp32: 2,304 bytes; left partial, AdamW's
    # three reads of each all-reduced it again: 27 calls); the logged loss (2 float64).
    assert comm[("tp", "all_reduce")]["calls_per_step"] == 2 * 5
    assert ar == 2 * (3 * 256 * 4 + 9 * 64 * 4 + 16)
    bus = {c["dim"]: c["bus_bytes_per_step"] for c in rec["counters"]["comm_bus"]}
    # nccl-tests' bus factors on a group of 2: (n-1)/n = 1/2 for gathers and scatters, 2(n-1)/n = 1
    assert bus["tp"] == pytest.approx(2 * 2 * 18 * full * 0.5 + ar * 1.0)


@pytest.fixture(scope="module")
def no_sp(pushed) -> Path:
    """The same workload with sequence parallelism off (a trainer change).  Its gate fails on the
    counters, which no load moves, so the rest lane goes on beside it (no ``quiet``)."""
    run = pushed["root"] / "no-sp"
    subprocess.run(CLI + ["train", "--config", "tiny_dense", "--nproc", "2", "--layout", "tp=2", "--steps", "6",
                          "--window", "1:3", "--set", "sequence_parallel=false", "--launcher", "fork",
                          "--out", str(run)],
                   check=True, capture_output=True, timeout=600)
    from mfuscope.analyzers.analysis import analyze
    analyze(run, run / "report.json", run / "views")
    return run


def test_sequence_parallel_off_fails_the_deterministic_gate(pushed, no_sp, tmp_path):
    """Without sequence parallelism every row-parallel output and column-parallel input gradient
    is all-reduced: the bytes on the wire grow by two thirds (an all-reduce moves twice an
    all-gather's bytes), and the gate fails naming tp."""
    run = no_sp
    hist = tmp_path / "hist-copy"
    for r in _history_lines(pushed["origin"]):
        append(hist, r)
    junit = tmp_path / "j.xml"
    proc = subprocess.run(CLI + ["ci", "check", str(run), "--history", str(hist), "--workload", "tiny-tp2",
                                 "--junit", str(junit), "--json"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    failed = {r["metric"]: r for r in result["deterministic"]["rows"] if r["verdict"] == "fail"}
    assert "comm/tp/bus_bytes_per_step" in failed and "comm/tp/all_reduce/bytes_per_step" in failed
    assert failed["comm/tp/bus_bytes_per_step"]["change"] > 0.3
    assert result["status"] == "regression"
    failures = [c.get("name") for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None]
    assert "comm/tp/bus_bytes_per_step" in failures


# ----------------------------------------------------------------------------- pull requests, blocked in the job

#: The slowed commit changes the trainer's command (in the workflow it runs: GitHub runs a pull
#: request's own) so that rank 0 sleeps in every forward three times as long as push A's whole
#: step took -- rank 1 waits for it in the next tensor-parallel collective: the same work and
#: counters, every step four times as long on the host push A ran on.  The paired gate's limit
#: widens with the runs' own step spread (1.65 standard errors of a 10% quantile of 5 steps): a
#: fresh-clone CI whose host ran main's code 2.3x slower than push A, with a 27% spread, set it
#: at 48%, over the +42% that one step's sleep (100 ms there) made; a fixed 100 ms was also +20%
#: of a 560 ms step on a slow host.  The run's manifest records the injection, so the second
#: pair's run (the run's command, read back from the manifest) is as slow.
SLOW = "compute:rank=0:ms={ms}"
#: Steps a pull request's runs train here (the job's STEPS, substituted): 5 step samples instead of
#: 20 keep the slowed job's four trainings (two pairs) within the suite's budget.
PR_STEPS = "6"
REAL_HISTORY = REPO / "tests" / "fixtures" / "ci_history" / "tiny-tp2-real.jsonl"


@pytest.fixture(scope="module")
def pr(pushed):
    """main's history for pull requests, in a copy of the pushes' origin: 18 records simulated from
    push A's run (5% step-to-step and 5% run-to-run noise: a limit near 17%, far below the slowed
    commit's +300% and far above two quiet runs apart), then the two pushes' own records; and a
    clone to work in.  (The gate's calibration is measured elsewhere: simulated, and on the real
    history; this history is only main's, for the workflow's steps.)"""
    root = pushed["root"] / "pr"
    origin, seed, work = root / "origin.git", root / "seed", root / "work"
    shutil.copytree(pushed["origin"], origin)
    _git(pushed["work"], "push", "--quiet", str(origin), "main")  # main's head: push B
    real = _history_lines(pushed["origin"])
    run0 = pushed["root"] / "run0"
    report, manifest = (json.loads((run0 / f).read_text()) for f in ("report.json", "manifest.json"))
    rng = np.random.default_rng(15)
    lines = [{**simulate.noisy_record(report, manifest, rng, 0.05, index=i, run_cv=0.05), "workload": "tiny-tp2"}
             for i in range(statistical.WINDOW - len(real))] + real
    subprocess.run(["git", "clone", "--quiet", "--branch", "perf-history", str(origin), str(seed)], check=True)
    (seed / "tiny-tp2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    _git(seed, "-c", "user.name=dev", "-c", "user.email=dev@example.com", "commit", "--quiet", "-am", "history")
    _git(seed, "push", "--quiet", "origin", "perf-history")
    subprocess.run(["git", "clone", "--quiet", str(origin), str(work)], check=True)
    _git(work, "config", "user.email", "dev@example.com")
    _git(work, "config", "user.name", "dev")
    slow = SLOW.format(ms=max(300, round(3 * report["summary"]["step_time_s"] * 1e3)))
    return {"root": root, "origin": origin, "work": work, "records": len(lines), "slow": slow}


def test_a_pull_request_that_slows_the_step_fails_in_the_job(pr):
    """The slowed commit's pull request: the workflow's steps (its own workflow) train main's code,
    then the pull request's, and check the pair: slower by about the injected sleep (three steps
    of push A's: +300%, so over +100% on a host twice as slow); a second pair -- main's run, then
    the slowed command again, each from its run's manifest -- is slower too, and the check step
    exits 1.
    The counters are unchanged (a timing regression only the timing gate sees), the history's
    timing rows only advise, and nothing is recorded.  (This is also where a rerun is trained from
    its run's manifest for real; the history gate's verdict on reruns is checked by hand in
    test_with_reruns_the_previous_record_does_not_confirm.)"""
    work = pr["work"]
    _git(work, "switch", "--quiet", "-c", "slow", "origin/main")
    workflow = work / ".github" / "workflows" / "mfu-regression.yml"
    workflow.parent.mkdir(parents=True)
    train = '--out "$RUN" --force'
    assert WORKFLOW.read_text().count(train) == 1
    workflow.write_text(WORKFLOW.read_text().replace(train, f"{train} --inject {pr['slow']}"))
    _git(work, "add", ".github")
    _git(work, "commit", "--quiet", "-m", "trainer: rank 0 sleeps in every forward")
    _fresh_checkout(work)
    summary = pr["root"] / "summary-slow.md"
    # Its pairs differ by the injected +300% against a limit of 5-50%: the rest lane (idle-priority)
    # may run beside them, rather than wait out four trainings.
    codes = _run_workflow(work, "pull_request", _git(work, "rev-parse", "HEAD"), summary, workflow=workflow,
                          env_over={"STEPS": PR_STEPS}, alone=False)
    text = summary.read_text()
    print(text)
    assert codes["Check against main's history"] == 1, text
    assert "Record the run (pushes to main)" not in codes
    cases = {c.get("name"): c for c in ET.parse(work / "mfu-junit.xml").getroot().iter("testcase")}
    failed = {n: c.find("failure").get("message") for n, c in cases.items() if c.find("failure") is not None}
    assert set(failed) == {"paired step_time_s"} and "more pair(s)" in failed["paired step_time_s"], failed
    assert {"mfu", "step_time_s"} <= set(cases)  # the history's rows: shown, advising
    props = {e.get("name"): e.get("value") for e in cases["paired step_time_s"].iter("property")}
    assert float(props["drop"]) > 0.5 and 0.05 <= float(props["limit"]) < float(props["drop"])
    assert "REGRESSION (paired step_time_s)" in text
    # the second pair: main's code first (not slowed), then the slowed command, from the manifests
    runs = work / "runs"
    main_rerun, rerun = (json.loads((runs / d / "manifest.json").read_text())
                         for d in ("main-tiny-tp2.rerun1", "ci-tiny-tp2.rerun1"))
    assert rerun["trainer"]["inject"] == pr["slow"] and not main_rerun["trainer"].get("inject")
    # trained from the runs' manifests, the pair starts its ranks as the workflow's did (--launcher fork)
    assert rerun["trainer"]["launcher"] == main_rerun["trainer"]["launcher"] == "fork"
    created = [json.loads((runs / d / "report.json").read_text())["provenance"]["created"]
               for d in ("main-tiny-tp2.rerun1", "ci-tiny-tp2.rerun1")]
    assert created == sorted(created)
    assert not (runs / "ci-tiny-tp2.rerun2").exists()
    assert len(_history_lines(pr["origin"])) == pr["records"]  # a pull request reads the history only


def test_a_pull_request_of_the_unchanged_commit_passes(pushed, pr):
    """The control: the workflow's pull-request steps on main's head (push B, the docs-only commit)
    pass.  Its pair is push A's run (main's code, one docs-only commit before) and push B's own
    (the same command; training both again would cost the suite two runs), checked before it was
    recorded (a run is never its own baseline).  Where the host ran the two pushes apart (a
    co-tenant between them: seen in fresh-clone CIs, +36% and -20%), the pair is slower and the
    job trains a second, back to back, which settles it."""
    work = pr["work"]
    _git(work, "switch", "--quiet", "--detach", pushed["shas"][1])
    _fresh_checkout(work)
    shutil.copytree(pushed["root"] / "run1", work / "runs" / "ci-tiny-tp2")
    shutil.copytree(pushed["root"] / "run0", work / "runs" / "main-tiny-tp2")
    summary = pr["root"] / "summary-control.md"
    codes = _run_workflow(work, "pull_request", pushed["shas"][1], summary, skip=("Train",))
    text = summary.read_text()
    print(text)
    assert codes["Check against main's history"] == 0, text
    assert "❌" not in text and "insufficient data" not in text
    assert "paired step_time_s" in text


def test_a_push_the_history_calls_slower_is_paired_with_its_parents_run(pushed, tmp_path, capsys):
    """``mfuscope ci check --pair-on-violation`` on push B's real run, against a history of push A's
    run at half its step time (simulated, 1% noise): the history calls B twice as slow, so the
    check makes the baseline's run with its command (here: B's own run copied into place, so that the
    pair is of one speed whatever the host did between the pushes) and the pair decides: not slower,
    so the push passes, where the history alone would have called it suspicious."""
    from mfuscope.cli import main

    report, manifest = (json.loads((pushed["root"] / "run0" / f).read_text()) for f in ("report.json", "manifest.json"))
    rng = np.random.default_rng(21)
    history = tmp_path / "history"
    for i in range(statistical.WINDOW):
        append(history, {**simulate.noisy_record(report, manifest, rng, 0.01, drop=-1.0, index=i),
                         "workload": "tiny-tp2"})
    run = tmp_path / "runs" / "ci-tiny-tp2"
    shutil.copytree(pushed["root"] / "run1", run)
    command = f"cp -r {pushed['root'] / 'run1'} {{out}}"
    capsys.readouterr()
    code = main(["ci", "check", str(run), "--history", str(history), "--workload", "tiny-tp2",
                 "--pair-on-violation", "--main-rerun-command", command, "--confirm-runs", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    rows = {r["metric"]: r for r in result["statistical"]}
    assert code == 0 and result["paired_on_violation"], rows
    assert rows["step_time_s"]["violated"] and rows["step_time_s"]["verdict"] == "suspicious"
    assert rows["paired step_time_s"]["verdict"] == "ok" and rows["paired step_time_s"]["drop"] == 0
    assert (run.parent / "ci-tiny-tp2.main1" / "report.json").is_file()


def test_a_main_that_cannot_train_leaves_the_pull_request_to_the_history(tmp_path):
    """The workflow's step that trains main's code, with main's code broken (its package fails to
    import): the step passes with a warning and leaves no main run, so the check step pairs nothing
    and gates on the history (a broken main must not block the pull request that fixes it)."""
    env_vars, steps = _steps()
    step = next(s for s in steps if s.get("name", "").startswith("Train main's code"))
    broken = tmp_path / env_vars["MAIN_CODE"] / "mfuscope"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('main is broken')\n")
    env = {**os.environ, **env_vars, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["run"]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "main is broken" in proc.stderr and "checked against the history alone" in proc.stdout
    assert not (tmp_path / env_vars["MAIN_RUN"]).exists()
    check = next(s for s in steps if s.get("name", "").startswith("Check"))["run"]
    assert '[ -d "$MAIN_RUN" ]' in check and "--paired-with" in check


# ----------------------------------------------------------------------------- false positives and power


@pytest.fixture(scope="module")
def real(pushed):
    run = pushed["root"] / "run0"
    return json.loads((run / "report.json").read_text()), json.loads((run / "manifest.json").read_text())


@pytest.mark.parametrize("cv", [0.01, 0.03, 0.08])
def test_noise_alone_fails_under_half_a_percent_of_checks(real, cv):
    rate = simulate.false_positive_rate(*real, cv=cv, checks=1000)
    print(f"false-positive rate at CV {cv:.0%}: {rate:.2%} of 1000 checks")
    assert rate < 0.005


@pytest.mark.parametrize("cv, drop", [(0.03, 0.05), (0.08, 0.10)])
def test_a_sustained_drop_is_confirmed_within_two_records(real, cv, drop):
    power = simulate.detection_power(*real, cv=cv, drop=drop, trials=400)
    print(f"a {drop:.0%} MFU drop at CV {cv:.0%}: confirmed within 2 records in {power:.1%} of 400 trials")
    # 95% required; 400 trials estimate it to +-1.1% (one standard error)
    assert power >= 0.95


@pytest.fixture(scope="module")
def real_replay():
    """The recorded real history (:data:`REAL_HISTORY`: 60 runs of the workflow's tiny run, one
    unchanged commit, on the shared 2-core machine under `chrt --idle 0`, its co-tenants' load
    included) replayed through the gate: every failure is a false positive."""
    records = replay.load(REAL_HISTORY)
    return records, replay.replay(records, confirm_runs=(1, 2))


def test_the_real_history_replays_to_the_documented_figures(real_replay):
    """docs/ci.md's figures on the real history (`python benchmarks/bench_ci_real.py replay`):
    the fixture is fixed, so the replay is exact.  Its failures are co-tenant episodes -- the run
    checked and the one after it (the rerun, or main's next record) both far slower than the
    window's median -- not the noise the gate is sized for."""
    records, r = real_replay
    print(f"real history: {r['checks']} checks, {r['violations']} violations, main fails {r['main_fails']}, "
          f"--confirm-runs 1 fails {r['pr_fails'][1]} of {r['pr_checks'][1]}, "
          f"--confirm-runs 2 fails {r['pr_fails'][2]} of {r['pr_checks'][2]}")
    assert len(records) == 60 and len({rec["fingerprint_id"] for rec in records}) == 1
    assert (r["checks"], r["violations"], r["main_fails"]) == (55, 20, 12)
    assert (r["pr_checks"][1], r["pr_fails"][1], r["pr_checks"][2], r["pr_fails"][2]) == (54, 13, 53, 10)
    for i in r["pr_failed_at"][1]:
        median = float(np.median([replay.level(x) for x in records[:i][-statistical.WINDOW:]]))
        assert replay.level(records[i]) > 1.15 * median and replay.level(records[i + 1]) > 1.15 * median


def test_the_pull_requests_paired_gate_stays_under_the_bound_on_the_real_history(real_replay):
    """The workflow's pull-request gate (regression/paired.py: main's code trained in the job, a
    pair slower than its limit, confirmed by a second) replayed on the real history: the record
    before each stands for main's run, the two after it for the second pair.  docs/ci.md's figures
    (the fixture is fixed, so exact): no failure in 57 checks, within the bound (at the nominal
    per-check rate, :data:`replay.NOMINAL_RATE`, 0.5%, the most failures 57 checks show with
    probability 99%); with the limit fixed at 5% (no noise term) it was 2 of 57."""
    records, _ = real_replay
    r = replay.paired(records, paired.THRESHOLD, drops=(0.5,))
    assert (r["checks"], r["fails"]) == (57, 0)
    assert r["fails"] <= replay.binomial_limit(r["checks"], replay.NOMINAL_RATE) == 2
    assert r["power"][0.5] == pytest.approx(52 / 57)


def test_a_pushs_gate_pairs_where_the_history_calls_it_slower_and_stays_under_the_bound(real_replay):
    """The workflow's push gate (``--pair-on-violation``) replayed on the real history
    (regression/replay.py, ``pushes``): each record checked against the records before it; where
    the history calls it slower (18 of 52 checks, every one a false alarm: the code never
    changed), the record after it stands for the parent commit's run, the next two for the second
    pair.  docs/ci.md's figures (the fixture is fixed, so exact): no failure in 52 checks, within
    the bound, where the history gate alone failed 12 of 55; a 50% slower push fails in 47 of 52."""
    records, r = real_replay
    pushes = replay.pushes(records, paired.THRESHOLD, drops=(0.5,))
    assert (pushes["checks"], pushes["violations"], pushes["fails"]) == (52, 18, 0)
    assert pushes["fails"] <= replay.binomial_limit(pushes["checks"], replay.NOMINAL_RATE) == 2
    assert pushes["power"][0.5] == pytest.approx(47 / 52)
    assert r["main_fails"] == 12  # the history gate alone, on the same records


@pytest.mark.xfail(strict=True, reason="this machine's co-tenant episodes (+50% to +500% for a minute) slow a run "
                   "and the next alike: against the history, main's gate fails 12 of 55 checks and a rerun-confirmed "
                   "check 13 of 54, where the bound allows 2 (docs/ci.md, 'Measured on real runs'); pull requests "
                   "and pushes are paired with main's (the parent's) code instead")
def test_false_positives_of_the_history_gate_on_the_real_history_stay_under_the_bound(real_replay):
    """The history gate alone (what a job without the baseline's code falls back to: a check with
    no pair) against the same bound.  Strict: when a change to it brings the real history under
    the bound, this passes and must be unmarked."""
    _, r = real_replay
    assert r["main_fails"] <= replay.binomial_limit(r["checks"], replay.NOMINAL_RATE)
    for n in (1, 2):
        assert r["pr_fails"][n] <= replay.binomial_limit(r["pr_checks"][n], replay.NOMINAL_RATE)


@pytest.mark.parametrize("cv", [0.01, 0.03, 0.08])
def test_the_paired_gate_fails_under_half_a_percent_of_unchanged_pull_requests(real, cv):
    """Simulated pull requests of unchanged code (regression/simulate.py, ``paired_fail_rate``:
    every run's steps independent log-normal noise): the paired gate holds the gate's nominal
    rate, where a fixed 5% limit failed 1.3% at 8% noise (regression/paired.py).  And it still
    catches what it should: a 10% slower pull request at 3% noise, a 20% slower one at 8%."""
    rate = simulate.paired_fail_rate(*real, cv=cv, trials=2000)
    print(f"paired gate, step noise {cv:.0%}: {rate:.2%} of 2000 unchanged pull requests fail")
    assert rate < 0.005
    if cv == 0.03:
        assert simulate.paired_fail_rate(*real, cv=cv, trials=300, seed=1, drop=0.10) >= 0.95
    if cv == 0.08:
        assert simulate.paired_fail_rate(*real, cv=cv, trials=300, seed=1, drop=0.20) >= 0.95


def test_the_pairs_limit_widens_with_the_runs_own_noise():
    """By hand: 20 steps alternating 90 and 110 ms -- median 100, MAD 10, so a step spread of
    1.4826 x 10 / 100 = 14.8%; a 10% quantile's standard error 1.709 x 0.148 / sqrt(20) = 5.67%
    a run, 5.67% x sqrt(2) = 8.01% for the ratio of two; the limit 1.65 x 8.01% = 13.2%.  A pull
    request 10% slower (99 and 121 ms) passes it, which a fixed 5% would fail; 20% slower fails."""
    def run(a, b):
        return {"samples": {"step_time_s": [a / 1e3, b / 1e3] * 10}, "fingerprint": {}}

    main = run(90, 110)
    assert paired.limit(run(99, 121), main) == pytest.approx(1.65 * 1.709 * 0.14826 / np.sqrt(20) * np.sqrt(2),
                                                                 rel=1e-3)
    assert paired.gate(run(99, 121), main)["verdict"] == "ok"
    assert paired.gate(run(108, 132), main)["verdict"] == "suspicious"
    quiet = run(100, 100)  # no spread: the floor
    assert paired.limit(run(105, 105), quiet) == paired.THRESHOLD


def test_the_paired_replay_fails_only_where_both_pairs_are_slower():
    """``replay.paired`` by hand: six runs whose fastest steps take 100, 100, 110, 100, 112, 100 ms
    (each run also has two slow steps, a co-tenant's, which the level -- the 10% quantile -- never
    sees).  The job at position i compares run i with run i-1, then run i+2 with run i+1; positions
    1 to 3 have both pairs.  At 5%: position 2 is 1.10x, then 1.12x slower -- a failure; position 1
    (1.00x, then 0.91x) and position 3 (0.91x, then 0.89x) pass.  Made 2% slower, the pull
    request's runs add no failure (position 1: 1.02x, then 0.93x)."""
    levels = [0.100, 0.100, 0.110, 0.100, 0.112, 0.100]
    records = [{"samples": {"step_time_s": [lv] * 18 + [lv * 3, lv * 5]}} for lv in levels]
    r = replay.paired(records, 0.05, drops=(0.02,))
    assert r["checks"] == 3 and r["failed_at"] == [2] and r["fails"] == 1
    assert r["power"][0.02] == pytest.approx(1 / 3)


def test_the_binomial_bound():
    # 54 checks at 0.5%: P(X > 2) = 0.26%, P(X > 1) = 3.0%; 1,000: P(X > 11) = 0.53%, P(X > 10) = 1.3%
    assert replay.binomial_limit(54, 0.005) == 2
    assert replay.binomial_limit(1000, 0.005) == 11
    assert replay.binomial_limit(10, 0.0) == 0


def test_one_violation_is_suspicious_and_a_second_confirms(real):
    rng = np.random.default_rng(5)
    records = [simulate.noisy_record(*real, rng, 0.01, index=i) for i in range(10)]
    slow = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=10)
    first = check_mod.check(History(Path("h"), records, []), slow, branch="main", floor=0.02)
    assert first["status"] == "suspicious" and first["exit_code"] == 0
    slow2 = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=11)
    second = check_mod.check(History(Path("h"), records + [slow], []), slow2, branch="main", floor=0.02)
    assert second["status"] == "regression" and second["exit_code"] == 1
    assert {r["verdict"] for r in second["statistical"]} == {"regression"}
    # the change-point scan puts the shift at the first slow record
    cps = second["change_points"]["mfu"]
    assert [c["commit"] for c in cps] == [slow["commit"]] and cps[0]["worse"]


def test_an_in_job_rerun_confirms_or_clears(real):
    rng = np.random.default_rng(6)
    records = [simulate.noisy_record(*real, rng, 0.01, index=i) for i in range(10)]
    slow = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=10)
    h = History(Path("h"), records, [])
    again = check_mod.check(h, slow, branch="main", floor=0.02, confirm_runs=2,
                            rerun=lambda i: simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=20 + i))
    assert again["status"] == "regression"
    assert all(len(r["reruns"]) == 2 for r in again["statistical"])
    fluke = check_mod.check(h, slow, branch="main", floor=0.02, confirm_runs=2,
                            rerun=lambda i: simulate.noisy_record(*real, rng, 0.01, index=30 + i))
    assert fluke["status"] == "suspicious" and fluke["exit_code"] == 0
    assert all(len(r["reruns"]) == 1 for r in fluke["statistical"])  # the first clean rerun settles it


def test_with_reruns_the_previous_record_does_not_confirm(real):
    """A pull request's check (in-job reruns): main's last record violating too does not make its
    violation a regression -- its reruns decide (a clean one clears it, a slow one confirms)."""
    rng = np.random.default_rng(7)
    records = [simulate.noisy_record(*real, rng, 0.01, index=i) for i in range(10)]
    records.append(simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=10))  # main's last: violated
    h = History(Path("h"), records, [])
    slow = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=11)
    assert check_mod.check(h, slow, branch="main", floor=0.02)["status"] == "regression"  # main's rule
    cleared = check_mod.check(h, slow, branch="main", floor=0.02, confirm_runs=1,
                              rerun=lambda i: simulate.noisy_record(*real, rng, 0.01, index=40 + i))
    assert cleared["status"] == "suspicious" and cleared["exit_code"] == 0
    confirmed = check_mod.check(h, slow, branch="main", floor=0.02, confirm_runs=1,
                                rerun=lambda i: simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=50 + i))
    assert confirmed["status"] == "regression"
    assert all("in-job rerun" in r["confirmed_by"] for r in confirmed["statistical"])


def test_a_paired_check_is_decided_by_its_pairs(real):
    """The pull request's gate (``main``: main's run in the job) by hand.  Runs whose fastest steps
    take 100 ms (main) and 110 ms (the pull request), each with two co-tenant steps that the 10%
    quantile never sees: +10%, over the 5% limit.  A second pair at 104 / 100 ms (+4%) clears it;
    one at 112 / 100 ms (+12%) confirms it.  Main's history violating, and its last record too
    (main's rule would call that a regression), only advises; main's run of another layout is not
    compared."""
    def run(ms, fp=real[0]):
        rec = simulate.noisy_record(fp, real[1], np.random.default_rng(0), 0.01, index=0)
        return {**rec, "samples": {"step_time_s": [ms / 1e3] * 18 + [ms / 1e3 * 3, ms / 1e3 * 5], "mfu": []}}

    main, head = run(100), run(110)
    assert paired.slower(head, main) == pytest.approx(0.10)
    cleared = paired.gate(head, main, 0.05, rerun_pair=lambda i: (run(104), run(100)), confirm_runs=1)
    assert cleared["verdict"] == "suspicious" and cleared["reruns"][0]["drop"] == pytest.approx(0.04)
    confirmed = paired.gate(head, main, 0.05, rerun_pair=lambda i: (run(112), run(100)), confirm_runs=1)
    assert confirmed["verdict"] == "regression" and confirmed["reruns"][0]["drop"] == pytest.approx(0.12)
    assert paired.gate(run(104), main, 0.05)["verdict"] == "ok"

    rng = np.random.default_rng(7)
    records = [simulate.noisy_record(*real, rng, 0.01, index=i) for i in range(10)]
    records.append(simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=10))  # main's last: violated
    slow = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=11)
    h = History(Path("h"), records, [])
    quick = slow["samples"]["step_time_s"]
    same_speed = {**slow, "samples": {**slow["samples"], "step_time_s": list(quick)}}
    r = check_mod.check(h, slow, branch="main", floor=0.02, main=same_speed, confirm_runs=1,
                        rerun_pair=lambda i: pytest.fail("a pair that is not slower is not trained again"))
    rows = {row["metric"]: row for row in r["statistical"]}
    assert rows["step_time_s"]["verdict"] == "suspicious" and rows["paired step_time_s"]["verdict"] == "ok"
    assert r["status"] == "suspicious" and r["exit_code"] == 0

    other = {**same_speed, "fingerprint": {**same_speed["fingerprint"], "layout": {"tp": 4}}}
    row = paired.gate(slow, other, 0.05)
    assert row["verdict"] == "insufficient data" and "layout" in row["note"]


def test_a_push_is_paired_only_where_the_history_calls_it_slower(real):
    """``pair_on_violation`` (a push's check) by hand.  A push as fast as the history trains
    nothing; one 10% slower than it is paired with the parent's run: of the same speed, it passes
    (the history's rows only advise, and main's rule of two violations in a row no longer applies:
    the last record violated too); twice as slow as the parent's run, and again in the second
    pair, it fails."""
    rng = np.random.default_rng(12)
    records = [simulate.noisy_record(*real, rng, 0.01, index=i) for i in range(10)]
    records.append(simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=10))  # main's last: violated
    h = History(Path("h"), records, [])
    trained = []

    def parent(rec, again=None):
        def train():
            trained.append(rec["run"]["id"] if rec.get("run") else "parent")
            return rec, (None if again is None else lambda i: again)
        return train

    quick = simulate.noisy_record(*real, rng, 0.01, index=11)
    r = check_mod.check(h, quick, branch="main", floor=0.02, confirm_runs=1,
                        pair_on_violation=lambda: pytest.fail("a push the history does not call slower trains nothing"))
    assert r["status"] == "ok" and "paired" not in r and not trained
    slow = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=12)
    same = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=13)  # the parent's code was as slow
    r = check_mod.check(h, slow, branch="main", floor=0.02, confirm_runs=1, pair_on_violation=parent(same))
    rows = {row["metric"]: row for row in r["statistical"]}
    assert trained and r["paired_on_violation"] and rows["step_time_s"]["verdict"] == "suspicious"
    assert rows["paired step_time_s"]["verdict"] == "ok" and r["exit_code"] == 0
    # the parent's code ran twice as fast: the pair, and the second pair, are +100% (over the limit,
    # 5% or 1.65 standard errors of the real run's own step spread, which these samples carry)
    fast = {**slow, "samples": {**slow["samples"], "step_time_s": [x / 2 for x in slow["samples"]["step_time_s"]]}}
    r = check_mod.check(h, slow, branch="main", floor=0.02, confirm_runs=1,
                        pair_on_violation=parent(fast, (slow, fast)))
    rows = {row["metric"]: row for row in r["statistical"]}
    assert rows["paired step_time_s"]["verdict"] == "regression" and r["exit_code"] == 1
    assert rows["paired step_time_s"]["drop"] == pytest.approx(1.0)


def test_accept_starts_a_new_baseline(real):
    rng = np.random.default_rng(8)
    old = [simulate.noisy_record(*real, rng, 0.01, index=i) for i in range(10)]
    new = [simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=10 + i) for i in range(6)]
    new[0]["accepted"] = True
    cur = simulate.noisy_record(*real, rng, 0.01, drop=0.10, index=30)
    result = check_mod.check(History(Path("h"), old + new, []), cur, branch="main", floor=0.02)
    assert result["matching_records"] == 6 and result["status"] == "ok"


# ----------------------------------------------------------------------------- history and bad input


def test_records_of_another_environment_are_never_compared(real, tmp_path):
    report, manifest = real
    rng = np.random.default_rng(9)
    other = json.loads(json.dumps(manifest))
    other["layout"]["tp"], other["layout"]["dp_shard"] = 1, 2
    for i in range(8):
        append(tmp_path, simulate.noisy_record(report, other, rng, 0.01, index=i))
    cur = simulate.noisy_record(report, manifest, rng, 0.01, drop=0.5, index=99)
    result = check_mod.check(read(tmp_path, "simulated"), cur, branch="main", floor=0.02)
    assert result["matching_records"] == 0 and result["status"] == "insufficient data"
    assert any(d.startswith("layout:") for d in result["fingerprint_differs"])


def test_doubling_tp_bytes_fails_and_halving_them_passes(real):
    report, manifest = real
    rng = np.random.default_rng(10)
    base = simulate.noisy_record(report, manifest, rng, 0.01)

    def scaled(factor):
        rec = json.loads(json.dumps(base))
        for c in rec["counters"]["comm"] + rec["counters"]["comm_bus"]:
            for key in ("bytes_per_step", "bus_bytes_per_step"):
                if key in c and c["dim"] == "tp":
                    c[key] *= factor
        return rec

    worse = {r["metric"]: r["verdict"] for r in deterministic.check(base, scaled(2.0), 0.02)}
    better = {r["metric"]: r["verdict"] for r in deterministic.check(base, scaled(0.5), 0.02)}
    assert worse["comm/tp/bus_bytes_per_step"] == "fail"
    assert better["comm/tp/bus_bytes_per_step"] == "improved" and "fail" not in better.values()


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``mfuscope ARGS`` in this process (main() turns expected errors into one line and exit 2;
    anything else would raise here): (exit code, stderr)."""
    from mfuscope.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_a_torn_last_line_is_skipped_and_a_bad_line_is_an_error(real, tmp_path, capsys):
    rng = np.random.default_rng(12)
    for i in range(3):
        append(tmp_path, simulate.noisy_record(*real, rng, 0.01, index=i))
    path = tmp_path / "simulated.jsonl"
    with path.open("a") as f:
        f.write('{"schema": 1, "workl')  # a job killed mid-append
    h = read(tmp_path, "simulated")
    assert len(h.records) == 3 and len(h.skipped) == 1 and "simulated.jsonl:4" in h.skipped[0]
    append(tmp_path, simulate.noisy_record(*real, rng, 0.01, index=3))  # goes on its own line
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[-1])["commit"] == "sim00003"
    # now the torn line is in the middle: an error naming the file and line, exit 2, no traceback
    run = tmp_path / "report.json"
    run.write_text(json.dumps(real[0]))
    code, err = _cli(capsys, "ci", "check", str(run), "--history", str(tmp_path), "--workload", "simulated")
    assert code == 2 and "simulated.jsonl" in err and "line 4" in err


@pytest.mark.parametrize("args, words", [
    (["--max-mfu-drop", "150%"], "--max-mfu-drop"),
    (["--confirm-runs", "-1"], "--confirm-runs"),
    (["--workload", "../x"], "workload name"),
    (["--pair-on-violation"], "--main-code"),
    (["--pair-on-violation", "--main-code", ".", "--paired-with", "."], "not both"),
])
def test_bad_check_flags_are_refused_in_one_line(real, tmp_path, capsys, args, words):
    run = tmp_path / "report.json"
    run.write_text(json.dumps(real[0]))
    code, err = _cli(capsys, "ci", "check", str(run), "--history", str(tmp_path), *args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_record_needs_a_run_or_report(pushed, tmp_path, capsys):
    code, err = _cli(capsys, "ci", "record", str(tmp_path / "nope"), "--history", str(tmp_path / "h"))
    assert code == 2 and "nope" in err and not (tmp_path / "h").exists()
    bare = tmp_path / "no-window"  # a run directory without traces (trained without --window)
    bare.mkdir()
    shutil.copy(pushed["root"] / "run0" / "manifest.json", bare / "manifest.json")
    code, err = _cli(capsys, "ci", "record", str(bare), "--history", str(tmp_path / "h"))
    assert code == 2 and "trace window" in err and not (tmp_path / "h").exists()


def test_a_paired_check_names_its_bad_input(pushed, tmp_path, capsys):
    """A missing --main-code folder, or a --max-slowdown that is not a fraction: one line, exit 2,
    before any run is analyzed."""
    run = str(pushed["root"] / "run1")
    (tmp_path / "h").mkdir()
    code, err = _cli(capsys, "ci", "check", run, "--history", str(tmp_path / "h"), "--paired-with",
                     str(pushed["root"] / "run0"), "--main-code", str(tmp_path / "main-code"), "--confirm-runs", "1")
    assert code == 2 and "main-code" in err and "pip install" in err and "analyzing" not in err
    code, err = _cli(capsys, "ci", "check", run, "--history", str(tmp_path / "h"), "--paired-with",
                     str(pushed["root"] / "run0"), "--max-slowdown", "150%")
    assert code == 2 and "--max-slowdown" in err


def test_trend_marks_regressions_and_change_points(real, tmp_path, capsys):
    from mfuscope.regression import trend

    rng = np.random.default_rng(13)
    for i in range(12):
        append(tmp_path, simulate.noisy_record(*real, rng, 0.01, index=i))
    for i in range(12, 20):
        append(tmp_path, simulate.noisy_record(*real, rng, 0.01, drop=0.08, index=i))
    records = read(tmp_path, "simulated").records
    verdicts = [p["verdict"] for p in trend.series(records, 0.02)]
    assert verdicts[:5] == ["insufficient data"] * 5 and set(verdicts[5:12]) == {"ok"}
    assert verdicts[12:14] == ["suspicious", "regression"]
    assert [c["index"] for c in statistical.change_points(records, None, "mfu", 0.02)] == [12]
    out = tmp_path / "trend.html"
    code, err = _cli(capsys, "ci", "trend", "--history", str(tmp_path), "--out", str(out))
    assert code == 0, err
    page = out.read_text()
    assert "sim00012" in page and not re.search(r"<script[^>]*\bsrc=", page)
