"""What ``mfuscope ci check`` writes for people and for CI systems: a markdown table (the job
summary), JUnit XML (one testcase per gated metric), and a self-contained HTML report."""
from __future__ import annotations

import math
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from . import paired

#: GitHub refuses a step summary over 1 MiB; ours stays well under it.
SUMMARY_LIMIT = 1 << 20
#: Deterministic rows listed in full; the rest (unchanged) are counted.
MAX_ROWS = 40

VERDICT_ICON = {"ok": "✅", "improved": "✅", "changed": "ℹ️", "suspicious": "⚠️", "insufficient data": "⏳",
                "no data": "–", "regression": "❌", "fail": "❌"}


def _num(v: Any, metric: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if metric.endswith("mfu"):
        return f"{v:.3%}"
    if metric.endswith("_s"):
        return f"{v * 1e3:.2f} ms"
    if abs(v) >= 1e4:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def _pct(v: Any, sign: bool = True) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:+.2%}" if sign else f"{v:.2%}"


def headline(result: dict[str, Any]) -> str:
    status = result["status"]
    failed = [r["metric"] for r in result["statistical"] if r["verdict"] == "regression"]
    if any(r["verdict"] == "fail" for r in result["deterministic"]["rows"]):
        failed.append("deterministic counters")
    what = {"ok": "no regression", "suspicious": "suspicious (one violation: passes; a second confirms)",
            "insufficient data": f"insufficient data ({result['matching_records']} matching record(s)): passes",
            "regression": f"REGRESSION ({', '.join(failed)})"}[status]
    return f"{VERDICT_ICON.get(status, '')} mfuscope ci check `{result['workload']}`: {what}"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"### {headline(result)}", "",
             f"commit `{(result.get('commit') or 'unknown')[:12]}` · branch `{result.get('branch') or 'any'}` · "
             f"{result['matching_records']} matching record(s) in `{result['history']}` · floor "
             f"{_pct(result['floor'], False)}", ""]
    if result.get("fingerprint_differs"):
        lines += ["No record has this environment; the newest record differs in:", ""]
        lines += [f"- {d}" for d in result["fingerprint_differs"]] + [""]
    lines += ["| metric | baseline | current | Δ | limit | verdict | p-value |", "|---|---|---|---|---|---|---|"]
    for r in result["statistical"]:
        worse = r["drop"]
        delta = None if worse is None else (-worse if r["metric"] == "mfu" else worse)
        verdict = f"{VERDICT_ICON.get(r['verdict'], '')} {r['verdict']}"
        if r.get("confirmed_by"):
            verdict += f" ({r['confirmed_by']})"
        p = "–" if r["p_value"] is None else f"{r['p_value']:.2g}"
        lines.append(f"| {r['metric']} | {_num(r['baseline'], r['metric'])} | {_num(r['current'], r['metric'])} | "
                     f"{_pct(delta)} | {'–' if r['limit'] is None else '−' + _pct(r['limit'], False)} | {verdict} | "
                     f"{p} |")
    if result.get("paired"):
        pr = result["paired"]
        whose = ("the baseline's code (a push's parent commit), trained in this job because the history called "
                 "this run slower" if result.get("paired_on_violation") else "main's code trained in this job")
        lines += ["", f"`{paired.METRIC}`: against {whose} (`{pr.get('main_run') or '?'}`), "
                  f"each run's {paired.QUANTILE:.0%} quantile step, the limit {paired.THRESHOLD:.0%} or "
                  f"{paired.K_SIGMA} standard errors of the two; it decides on step time, and the history's rows "
                  "above only advise (their records ran at other times)."]
        row = next((r for r in result["statistical"] if r["metric"] == paired.METRIC), {})
        lines += [f"Pair {i + 2}, trained again in the job: main {_num(r['baseline'], '_s')}, this run "
                  f"{_num(r['current'], '_s')} ({_pct(r['drop'])}, limit {_pct(r['limit'], False)})"
                  for i, r in enumerate(row.get("reruns") or [])]
    det = result["deterministic"]
    rows = det["rows"]
    moved = [r for r in rows if r["verdict"] != "ok"]
    lines += ["", f"**Deterministic counters** (against `{(det.get('baseline_commit') or '–')[:12]}`): "
              + (f"{len(moved)} of {len(rows)} changed" if rows else "no baseline record")]
    if moved:
        lines += ["", "| counter | baseline | current | Δ | limit | verdict |", "|---|---|---|---|---|---|"]
        for r in moved[:MAX_ROWS]:
            verdict = f"{VERDICT_ICON.get(r['verdict'], '')} {r['verdict']}" + (f": {r['why']}" if r["why"] else "")
            lines.append(f"| `{r['metric']}` | {_num(r['baseline'], r['metric'])} | {_num(r['current'], r['metric'])} "
                         f"| {_pct(r['change'])} | {'–' if r['limit'] is None else _pct(r['limit'], False)} | "
                         f"{verdict} |")
        if len(moved) > MAX_ROWS:
            lines.append(f"| … {len(moved) - MAX_ROWS} more | | | | | |")
    if result.get("leaves_moved"):
        lines += ["", "**Breakdown leaves that moved most** (seconds per step, against the window's median):", "",
                  "| leaf | baseline | current | Δ |", "|---|---|---|---|"]
        lines += [f"| {r['leaf']} | {r['baseline_s'] * 1e3:.2f} ms | {r['current_s'] * 1e3:.2f} ms | "
                  f"{r['delta_s'] * 1e3:+.2f} ms |" for r in result["leaves_moved"]]
    cps = [(m, c) for m, cs in result["change_points"].items() for c in cs]
    if cps:
        lines += ["", "**Change points** (where the level shifted):", ""]
        lines += [f"- {m}: {_pct(c['shift'])} at commit `{(c.get('commit') or '?')[:12]}` ({c.get('time') or ''})"
                  + (" — worse" if c["worse"] else "") for m, c in cps]
    for s in result.get("skipped_lines") or []:
        lines.append(f"\n> skipped a torn history line: {s}")
    text = "\n".join(lines) + "\n"
    return text if len(text.encode()) < SUMMARY_LIMIT else text.encode()[:SUMMARY_LIMIT - 100].decode(
        errors="ignore") + "\n\n(truncated)\n"


def junit(result: dict[str, Any]) -> str:
    """One testcase per gated metric (statistical) and per failing or changed counter."""
    cases = []
    for r in result["statistical"]:
        props = {k: r.get(k) for k in ("baseline", "current", "drop", "limit", "p_value", "verdict")}
        body = _properties(props)
        if r["verdict"] == "regression":
            msg = f"{r['metric']} regressed {_pct(r['drop'], False)} (limit {_pct(r['limit'], False)}; " \
                  f"{r.get('confirmed_by', '')})"
            body += f"<failure message={quoteattr(msg)}>{escape(msg)}</failure>"
        elif r["verdict"] in ("insufficient data", "no data"):
            body += f"<skipped message={quoteattr(r.get('note') or r['verdict'])}/>"
        elif r["verdict"] == "suspicious":
            body += f"<system-out>{escape('suspicious: one violation, not confirmed')}</system-out>"
        cases.append(f'<testcase classname="mfuscope.ci.{escape(result["workload"])}" '
                     f'name={quoteattr(r["metric"])}>{body}</testcase>')
    det_rows = result["deterministic"]["rows"]
    if not det_rows:
        cases.append(f'<testcase classname="mfuscope.ci.{escape(result["workload"])}" name="deterministic">'
                     '<skipped message="no baseline record"/></testcase>')
    for r in det_rows:
        if r["verdict"] == "ok":
            continue
        body = _properties({k: r.get(k) for k in ("baseline", "current", "change", "limit", "verdict")})
        if r["verdict"] == "fail":
            msg = f"{r['metric']}: {r['why']}"
            body += f"<failure message={quoteattr(msg)}>{escape(msg)}</failure>"
        cases.append(f'<testcase classname="mfuscope.ci.{escape(result["workload"])}.deterministic" '
                     f'name={quoteattr(r["metric"])}>{body}</testcase>')
    if not any(r["verdict"] != "ok" for r in det_rows) and det_rows:
        cases.append(f'<testcase classname="mfuscope.ci.{escape(result["workload"])}" name="deterministic">'
                     f'{_properties({"counters": len(det_rows), "changed": 0})}</testcase>')
    failures = sum("<failure" in c for c in cases)
    skipped = sum("<skipped" in c for c in cases)
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<testsuite name="mfuscope.ci" tests="{len(cases)}" failures="{failures}" skipped="{skipped}">\n'
            + "\n".join(cases) + "\n</testsuite>\n")


def _properties(values: dict[str, Any]) -> str:
    items = "".join(f"<property name={quoteattr(k)} value={quoteattr('' if v is None else str(v))}/>"
                    for k, v in values.items())
    return f"<properties>{items}</properties>"
