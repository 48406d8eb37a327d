"""``mfuscope ci check``: a run held against its workload's history -- both gates, change points,
the leaves that moved, and one verdict.

With a run of main's code trained in the same job (``main``: a pull request's check,
:mod:`.paired`), that pair decides on step time and its reruns are further pairs; the history's
statistical rows are then shown but only advise (a violation stays ``suspicious``): its records
were trained at other times, on a machine that drifts.  A push to main is paired only when the
history calls it slower (``pair_on_violation``: the parent commit's code is trained then), so
that a quiet push costs one training and a co-tenant's minute fails nothing.

Exit codes: 0 pass (``ok``, ``suspicious``, ``insufficient data``), 1 a
confirmed regression or a deterministic failure, 2 bad input (raised as
``UserInputError`` by the caller's readers).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import deterministic, paired, statistical
from .history import History

#: How many leaves the output lists as having moved most.
TOP_LEAVES = 5


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """A record of this very run (recorded before the check): never its own baseline."""
    ra, rb = a.get("run") or {}, b.get("run") or {}
    return bool(ra.get("report_created")) and ra.get("report_created") == rb.get("report_created") \
        and ra.get("id") == rb.get("id")


def baseline_records(history: History, current: dict[str, Any], branch: str | None) -> list[dict[str, Any]]:
    """Matching records, oldest first, from the latest accepted baseline on."""
    matching = [r for r in history.matching(current["fingerprint_id"], branch) if not same_run(r, current)]
    accepted = [i for i, r in enumerate(matching) if r.get("accepted")]
    return matching[accepted[-1]:] if accepted else matching


def check(history: History, current: dict[str, Any], *, branch: str | None, floor: float,
          rerun: Callable[[int], dict[str, Any]] | None = None, confirm_runs: int = 0,
          main: dict[str, Any] | None = None,
          rerun_pair: Callable[[int], tuple[dict[str, Any], dict[str, Any]]] | None = None,
          pair_threshold: float = paired.THRESHOLD,
          pair_on_violation: Callable[[], tuple[dict[str, Any], Callable | None]] | None = None) -> dict[str, Any]:
    """``rerun(i)``: the i-th in-job rerun's record; ``main``: the record of main's run in this job,
    whose further pairs ``rerun_pair(i)`` trains (then ``rerun`` is not used);
    ``pair_on_violation()``: called only when a row of the history is violated, trains the
    baseline's code (a push's parent commit) and returns (its record, its ``rerun_pair``), which
    then decide as ``main`` and ``rerun_pair`` do."""
    base = baseline_records(history, current, branch)
    result: dict[str, Any] = {
        "workload": current["workload"], "commit": current.get("commit"), "branch": branch,
        "fingerprint": current["fingerprint"], "fingerprint_id": current["fingerprint_id"],
        "history": str(history.path), "matching_records": len(base), "floor": floor,
        "skipped_lines": history.skipped}
    if not base:
        result["fingerprint_differs"] = _nearest_difference(history, current, branch)

    last = base[-1] if base else None
    result["deterministic"] = {
        "baseline_commit": last.get("commit") if last else None,
        "rows": deterministic.check(last, current, floor) if last else [],
    }
    # With in-job reruns (a pull request's check) the reruns confirm a violation, not the last record.
    in_job = main is not None or pair_on_violation is not None or (rerun is not None and confirm_runs > 0)
    rows = [statistical.gate(base, current, metric, floor, previous_confirms=not in_job)
            for metric in statistical.METRICS]
    if main is None and pair_on_violation is not None and any(r["violated"] for r in rows):
        main, rerun_pair = pair_on_violation()
        result["paired_on_violation"] = True
    if main is not None:
        rerun = None  # the pairs settle it; the history's rows advise
        result["paired"] = {"main_commit": main.get("commit"), "main_run": (main.get("run") or {}).get("source")}
        rows.append(paired.gate(current, main, pair_threshold, rerun_pair=rerun_pair, confirm_runs=confirm_runs))
    # In-job reruns of a suspicious run, until one passes or all have been run.
    pending = [r for r in rows if r["verdict"] == "suspicious"]
    done = 0
    while pending and rerun is not None and done < confirm_runs:
        record = rerun(done)
        done += 1
        for r in pending:
            statistical.judge_rerun(base, r, record, floor)
        pending = [r for r in pending if r["reruns"][-1]["violated"]]
    for r in pending if done else []:
        if len(r["reruns"]) == confirm_runs:
            r.update(verdict="regression", confirmed_by=f"{confirm_runs} in-job rerun(s) violated too")
    result["statistical"] = rows
    result["change_points"] = {m: statistical.change_points(base, current, m, floor) for m in statistical.METRICS}
    result["leaves_moved"] = leaves_moved(base[-statistical.WINDOW:], current)

    det_fail = any(r["verdict"] == "fail" for r in result["deterministic"]["rows"])
    regressed = any(r["verdict"] == "regression" for r in rows)
    suspicious = any(r["verdict"] == "suspicious" for r in rows)
    insufficient = all(r["verdict"] in ("insufficient data", "no data") for r in rows)
    result["status"] = ("regression" if regressed or det_fail else "suspicious" if suspicious
                        else "insufficient data" if insufficient else "ok")
    result["exit_code"] = 1 if regressed or det_fail else 0
    return result


def leaves_moved(window: list[dict[str, Any]], current: dict[str, Any]) -> list[dict[str, Any]]:
    """The breakdown leaves whose seconds per step moved most from the window's median."""
    if not window:
        return []
    names = set(current.get("leaves") or {}) | {k for r in window for k in (r.get("leaves") or {})}
    rows = []
    for name in names:
        base = float(np.median([(r.get("leaves") or {}).get(name, 0.0) for r in window]))
        now = float((current.get("leaves") or {}).get(name, 0.0))
        rows.append({"leaf": name, "baseline_s": base, "current_s": now, "delta_s": now - base})
    rows.sort(key=lambda r: -abs(r["delta_s"]))
    return rows[:TOP_LEAVES]


def _nearest_difference(history: History, current: dict[str, Any], branch: str | None) -> list[str]:
    """What differs from the newest record of the workload (on the branch): why none matches."""
    pool = [r for r in history.records if branch is None or r.get("branch") == branch] or history.records
    if not pool:
        return []
    other = pool[-1]["fingerprint"]
    mine = current["fingerprint"]
    return [f"{k}: {other.get(k)!r} in the history, {mine.get(k)!r} now" for k in sorted(set(mine) | set(other))
            if mine.get(k) != other.get(k)]
