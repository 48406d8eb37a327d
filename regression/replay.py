"""A recorded history replayed through the gate: the false-positive rate on real runs.

Simulated histories (:mod:`.simulate`) draw independent noise; a real machine drifts -- a
co-tenant for ten minutes slows every run in them, one after another.  Replaying a history of real
runs of one unchanged commit measures what that does to the gate (every failure is a false
positive):

- **main's gate**: every record checked against the records before it (:func:`.check.check`, the
  two-consecutive-violations rule);
- **a pull request's gate with ``--confirm-runs N``**: the same check, whose in-job reruns are the
  N records that followed it -- runs of the same code right after it on the same machine, as an
  in-job rerun is;
- **a pull request's paired gate** (:mod:`.paired`, what the workflow runs): the record before
  it stands for main's run in the job, the two after it for the second pair (:func:`paired`);
- **a push's gate** (what the workflow runs on main): the history first, and where it calls the
  run slower, the parent commit's code trained in the job and the pairs deciding -- the record
  after it stands for the parent's run, the two after that for the second pair (:func:`pushes`).

``benchmarks/bench_ci_real.py`` records such a history and prints the shares; the fixture
tests/fixtures/ci_history/tiny-tp2-real.jsonl is one, replayed by tests/test_ci_gate.py.
"""
from __future__ import annotations

import json
from math import comb
from pathlib import Path
from typing import Any

import numpy as np

from . import check as check_mod
from . import paired as paired_gate
from . import statistical
from . import statistics as st
from .history import History

#: The per-check false-positive rate the gate is held to (docs/ci.md: under 0.5% of checks on
#: simulated noise, where two violations in a row come to well under 0.1%).
NOMINAL_RATE = 0.005

#: What :func:`compact` keeps of a record: what the statistical gate reads, and where it came from.
KEEP = ("schema", "workload", "commit", "branch", "time", "fingerprint", "fingerprint_id", "run", "metrics",
        "samples")


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its counters and leaves (the deterministic gate's and the table's: equal
    between runs of one commit, and two thirds of a record's bytes), samples to 4 significant
    digits (a microsecond of a 200 ms step)."""
    out = {k: record[k] for k in KEEP if k in record}
    out["samples"] = {k: [float(f"{x:.4g}") for x in v] if v else v for k, v in (record.get("samples") or {}).items()}
    return out


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def replay(records: list[dict[str, Any]], *, confirm_runs: tuple[int, ...] = (1, 2), floor: float = 0.02,
           branch: str | None = "main") -> dict[str, Any]:
    """The sliding replay: counts over the checks from the ``MIN_RECORDS``-th record on (before
    that the gate says "insufficient data").  ``pr_fails[n]`` counts only the checks with n records
    after them to rerun (``pr_checks[n]``)."""
    out: dict[str, Any] = {"window": statistical.WINDOW, "min_records": statistical.MIN_RECORDS, "checks": 0,
                           "violations": 0, "main_fails": 0, "failed_at": [],
                           "pr_checks": dict.fromkeys(confirm_runs, 0), "pr_fails": dict.fromkeys(confirm_runs, 0),
                           "pr_failed_at": {n: [] for n in confirm_runs}}
    for i in range(statistical.MIN_RECORDS, len(records)):
        history = History(Path("replay"), records[:i], [])
        main = check_mod.check(history, records[i], branch=branch, floor=floor)
        out["checks"] += 1
        out["violations"] += any(r["violated"] for r in main["statistical"])
        if main["exit_code"]:
            out["main_fails"] += 1
            out["failed_at"].append(i)
        for n in confirm_runs:
            if i + n >= len(records):
                continue
            pr = check_mod.check(history, records[i], branch=branch, floor=floor, confirm_runs=n,
                                 rerun=lambda j, i=i: records[i + 1 + j])
            out["pr_checks"][n] += 1
            if pr["exit_code"]:
                out["pr_fails"][n] += 1
                out["pr_failed_at"][n].append(i)
    return out


def slowed(record: dict[str, Any], drop: float) -> dict[str, Any]:
    """The record's run with the same work in 1 / (1 - drop) of the time (MFU ``drop`` lower): a
    regression on top of the machine's real noise."""
    f = 1.0 / (1.0 - drop)
    s = record.get("samples") or {}
    out = {**record, "samples": {**s, "step_time_s": [x * f for x in s.get("step_time_s") or []],
                                 "mfu": [None if x is None else x / f for x in s.get("mfu") or []]},
           "run": {**(record.get("run") or {}), "id": f"{(record.get('run') or {}).get('id')}-slowed"}}
    return out


def power(records: list[dict[str, Any]], drop: float, *, confirm_runs: tuple[int, ...] = (1, 2),
          floor: float = 0.02, branch: str | None = "main") -> dict[str, Any]:
    """Detection power on the real history: at every position, the code turns ``drop`` slower
    from that record on.  ``main``: the share of positions where main's gate fails within two
    records (that one or the next); ``pr[n]``: where a pull request's gate with ``--confirm-runs
    n`` fails at once (its run and reruns are that record and the ones after it, slowed)."""
    out: dict[str, Any] = {"drop": drop, "positions": 0, "main": 0, "pr": dict.fromkeys(confirm_runs, 0),
                           "pr_positions": dict.fromkeys(confirm_runs, 0)}
    for i in range(statistical.MIN_RECORDS, len(records) - 1):
        before = records[:i]
        first = slowed(records[i], drop)
        hit = check_mod.check(History(Path("replay"), before, []), first, branch=branch, floor=floor)["exit_code"]
        if not hit:
            hit = check_mod.check(History(Path("replay"), before + [first], []), slowed(records[i + 1], drop),
                                  branch=branch, floor=floor)["exit_code"]
        out["positions"] += 1
        out["main"] += bool(hit)
        for n in confirm_runs:
            if i + n >= len(records):
                continue
            pr = check_mod.check(History(Path("replay"), before, []), first, branch=branch, floor=floor,
                                 confirm_runs=n, rerun=lambda j, i=i: slowed(records[i + 1 + j], drop))
            out["pr_positions"][n] += 1
            out["pr"][n] += bool(pr["exit_code"])
    return out


def paired(records: list[dict[str, Any]], threshold: float, *, quantile: float = paired_gate.QUANTILE,
           drops: tuple[float, ...] = ()) -> dict[str, Any]:
    """The pull request's gate (:mod:`.paired`) replayed: its job trains main's code right before
    its own run, and fails when the pull request's run is slower than main's by more than the
    pair's limit (``threshold`` or its noise, :func:`.paired.limit`), and
    again in a second pair (main's rerun, then the pull request's).  At record i the job's runs
    are records i-1 (main), i (the pull request), i+1 and i+2 (the second pair): consecutive runs
    of one commit on the same machine, so every failure is a false positive.  ``power[d]``: the
    share of the same positions that fail when the pull request's two runs are ``d`` slower."""
    lv = [paired_gate.level(r, quantile) for r in records]
    lv = [float("nan") if v is None else v for v in lv]
    positions = range(1, len(records) - 2)
    # each pair's limit (the runs' spreads are the same when the pull request's are slowed)
    lim = {(i + d, i + d - 1): paired_gate.limit(records[i + d], records[i + d - 1], threshold)
           for i in positions for d in (0, 2)}

    def fails(slow: float) -> list[int]:
        """The positions whose two pairs both fail with the pull request's runs ``slow`` x longer."""
        worse = lambda run, main: lv[run] * slow / lv[main] - 1 > lim[run, main]  # noqa: E731
        return [i for i in positions if worse(i, i - 1) and worse(i + 2, i + 1)]

    failed = fails(1.0)
    return {"threshold": threshold, "quantile": quantile, "checks": len(positions), "fails": len(failed),
            "failed_at": failed, "power": {d: len(fails(1 / (1 - d))) / len(positions) for d in drops}}


def pushes(records: list[dict[str, Any]], threshold: float = paired_gate.THRESHOLD, *, floor: float = 0.02,
           branch: str | None = "main", drops: tuple[float, ...] = ()) -> dict[str, Any]:
    """A push's gate replayed through :func:`.check.check` (``pair_on_violation``): record i is the
    push's run, checked against the records before it; where the history calls it slower, record
    i+1 stands for the parent commit's run trained next in the job, and records i+2 (the parent's)
    and i+3 (the push's) for the second pair.  Every failure is a false positive.  ``power[d]``:
    the share of the same positions that fail when the push's two runs are ``d`` slower (the
    regression starts at the push: the history before it is not slowed)."""
    positions = range(statistical.MIN_RECORDS, len(records) - 3)

    def outcome(i: int, drop: float) -> tuple[bool, bool]:
        """(the history called the push slower, the job failed)."""
        push = [slowed(records[i + k], drop) if drop else records[i + k] for k in (0, 3)]
        asked: list[int] = []

        def parent():
            asked.append(i)
            return records[i + 1], lambda j: (push[1], records[i + 2])
        result = check_mod.check(History(Path("replay"), records[:i], []), push[0], branch=branch, floor=floor,
                                 confirm_runs=1, pair_threshold=threshold, pair_on_violation=parent)
        return bool(asked), bool(result["exit_code"])

    quiet = [outcome(i, 0.0) for i in positions]
    return {"threshold": threshold, "checks": len(positions), "violations": sum(v for v, _ in quiet),
            "fails": sum(f for _, f in quiet), "failed_at": [i for i, (_, f) in zip(positions, quiet) if f],
            "power": {d: sum(outcome(i, d)[1] for i in positions) / len(positions) for d in drops}}


def level(record: dict[str, Any]) -> float:
    """A run's step time as the gate takes it: the trimmed mean of its step samples."""
    return st.trimmed_mean(statistical.samples(record, "step_time_s", None))


def run_to_run_cv(records: list[dict[str, Any]]) -> float:
    """The spread of the runs' levels (each run's trimmed mean step time), MAD-scaled, over their median."""
    values = np.array([level(r) for r in records])
    return float(st.robust_sigma(values) / np.median(values))


def step_cv(records: list[dict[str, Any]]) -> float:
    """The median over runs of the step-to-step spread within a run (MAD-scaled, over the run's median)."""
    cvs = [st.robust_sigma(s) / np.median(s) for s in (statistical.samples(r, "step_time_s", None) for r in records)]
    return float(np.median(cvs))


def binomial_limit(checks: int, rate: float, alpha: float = 0.01) -> int:
    """The most failures ``checks`` checks may show while a per-check false-positive rate of
    ``rate`` stays believable: the smallest k with P(X > k) < ``alpha`` for X ~ Binomial(checks, rate)."""
    tail = 1.0
    for k in range(checks + 1):
        tail -= comb(checks, k) * rate ** k * (1 - rate) ** (checks - k)
        if tail < alpha:
            return k
    return checks
