"""Simulated histories made from a real report: how the gate's false-positive rate and detection
power are measured (tests/test_ci_gate.py, benchmarks/bench_ci.py, docs/ci.md).

Each simulated run is the real report with every step time multiplied by
independent log-normal noise of the given coefficient of variation (a shared
runner's step-to-step jitter), optionally by one run-wide factor (run-to-run
noise), and, for a regression, by 1 / (1 - drop): the
same work in more time, so MFU falls by ``drop`` exactly.  The counters stay
as they are (they do not depend on timing).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from . import check as check_mod
from . import paired, statistical
from .history import History, make_record
from .statistical import WINDOW


def _lognormal(rng: np.random.Generator, cv: float) -> float:
    sigma = float(np.sqrt(np.log1p(cv * cv)))  # log-normal with this coefficient of variation, mean 1
    return float(np.exp(rng.normal(-sigma * sigma / 2, sigma)))


def noisy_record(report: dict[str, Any], manifest: dict[str, Any] | None, rng: np.random.Generator, cv: float,
                 drop: float = 0.0, index: int = 0, run_cv: float = 0.0) -> dict[str, Any]:
    """``cv``: step-to-step noise; ``run_cv``: one factor for the whole run (a slower runner of the
    same model, a noisy neighbour for the job's length)."""
    rep = copy.copy(report)
    run_factor = _lognormal(rng, run_cv) if run_cv else 1.0
    steps = []
    for row in report["per_step"]:
        factor = _lognormal(rng, cv) * run_factor / (1.0 - drop)
        steps.append({**row, "step_time_s": row["step_time_s"] * factor,
                      "mfu": None if row.get("mfu") is None else row["mfu"] / factor})
    rep["per_step"] = steps
    rep["provenance"] = {**report["provenance"], "created": f"simulated-{index}"}
    return make_record(rep, manifest, workload="simulated", commit=f"sim{index:05d}", branch="main",
                       time=f"2026-01-01T00:00:{index % 60:02d}Z", source="simulated")


def false_positive_rate(report: dict[str, Any], manifest: dict[str, Any] | None, cv: float, checks: int,
                        floor: float = 0.02, seed: int = 0) -> float:
    """Share of ``checks`` noise-only checks (each against the records before it) that fail."""
    rng = np.random.default_rng(seed)
    records = [noisy_record(report, manifest, rng, cv, index=i) for i in range(WINDOW)]
    fails = 0
    for i in range(checks):
        current = noisy_record(report, manifest, rng, cv, index=WINDOW + i)
        fails += _statistical_fail(records, current, floor)
        records.append(current)
    return fails / checks


def detection_power(report: dict[str, Any], manifest: dict[str, Any] | None, cv: float, drop: float, trials: int,
                    within: int = 2, floor: float = 0.02, seed: int = 1) -> float:
    """Share of ``trials`` where a sustained ``drop`` is confirmed within ``within`` records."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(trials):
        records = [noisy_record(report, manifest, rng, cv, index=i) for i in range(WINDOW)]
        for k in range(within):
            current = noisy_record(report, manifest, rng, cv, drop, index=WINDOW + k)
            if _statistical_fail(records, current, floor):
                hits += 1
                break
            records.append(current)
    return hits / trials


def _statistical_fail(records: list[dict[str, Any]], current: dict[str, Any], floor: float) -> bool:
    """The statistical gate's verdict (the deterministic one cannot fail here: counters are equal)."""
    return any(statistical.gate(records, current, m, floor)["verdict"] == "regression" for m in statistical.METRICS)


def pull_request_fail_rate(report: dict[str, Any], manifest: dict[str, Any] | None, cv: float, trials: int,
                           confirm_runs: int, drop: float = 0.0, run_cv: float = 0.0, floor: float = 0.02,
                           seed: int = 4) -> float:
    """A pull request's gate (``ci check --confirm-runs N``): the share of ``trials`` that fail.  Each
    trial is a fresh window of main's noise-only records, then the pull request's run and its
    in-job reruns, all ``drop`` slower: with ``drop`` 0 the false-positive rate, else the power
    (the run and every rerun must violate)."""
    rng = np.random.default_rng(seed)
    fails = 0
    for _ in range(trials):
        records = [noisy_record(report, manifest, rng, cv, index=i, run_cv=run_cv) for i in range(WINDOW)]
        current = noisy_record(report, manifest, rng, cv, drop, index=WINDOW, run_cv=run_cv)
        result = check_mod.check(History(Path("simulated"), records, []), current, branch="main", floor=floor,
                                 confirm_runs=confirm_runs,
                                 rerun=lambda j: noisy_record(report, manifest, rng, cv, drop, index=WINDOW + 1 + j,
                                                              run_cv=run_cv))
        fails += result["exit_code"] == 1
    return fails / trials


def paired_fail_rate(report: dict[str, Any], manifest: dict[str, Any] | None, cv: float, trials: int,
                     seed: int = 0, drop: float = 0.0, threshold: float = paired.THRESHOLD) -> float:
    """The share of pull requests the paired gate (:mod:`.paired`) fails: main's run and the pull
    request's, ``drop`` slower, then (on a violation) a second pair.  Each run has the report's
    number of steps, all of its median step times independent log-normal noise of ``cv`` (the
    report's own step-to-step differences would be the same in both runs of a pair); with
    ``drop`` 0 it is the false-positive rate, else the power."""
    rng = np.random.default_rng(seed)
    base = make_record(report, manifest, workload="simulated", commit=None, branch="main", time="",
                       source="simulated")
    steps = base["samples"]["step_time_s"]
    median = float(np.median(steps))

    def run(d: float) -> dict[str, Any]:
        times = [median * _lognormal(rng, cv) / (1.0 - d) for _ in steps]
        return {**base, "samples": {"step_time_s": times, "mfu": []}}

    fails = 0
    for _ in range(trials):
        head, main = run(drop), run(0.0)
        row = paired.gate(head, main, threshold, rerun_pair=lambda i: (run(drop), run(0.0)), confirm_runs=1)
        fails += row["verdict"] == "regression"
    return fails / trials
