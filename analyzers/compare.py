"""``mfuscope compare BASE NEW``: two reports side by side, per-leaf deltas, and a CI gate.

The gate: with ``fail_on_mfu_drop=F`` the comparison fails when NEW's MFU is
more than F (a fraction) below BASE's, both taken against BASE's peak (a CPU
run measures its peak each time; the runs, not the measurements, are
compared).  Runs without MFU (no peak for the
device) are gated on step time instead, the same way (a step more than F
slower fails), and the output says so.  Reports where neither is defined are
not comparable: the gate neither passes nor fails them (``mfuscope compare``
exits 2 and says why).
"""
from __future__ import annotations

import json
import math
from typing import Any
from xml.sax.saxutils import escape


def leaves(node: dict | None, out: dict | None = None) -> dict[str, float]:
    """A breakdown tree's leaves: name -> seconds."""
    out = {} if out is None else out
    if node is None:
        return out
    if not node.get("children"):
        out[node["name"]] = node["seconds"]
    for c in node.get("children") or []:
        leaves(c, out)
    return out


def compare(base: dict, new: dict, fail_on_mfu_drop: float | None = None) -> dict[str, Any]:
    b, n = base["summary"], new["summary"]
    rows = []
    for key in ("mfu", "hfu", "step_time_s", "tokens_per_s", "tflops_per_device"):
        rows.append({"metric": key, "base": b.get(key), "new": n.get(key), "change": _change(b.get(key), n.get(key))})
    lb, ln = leaves(base.get("breakdown")), leaves(new.get("breakdown"))
    by_leaf = [{"leaf": k, "base_s": lb.get(k, 0.0), "new_s": ln.get(k, 0.0),
                "delta_s": ln.get(k, 0.0) - lb.get(k, 0.0)}
               for k in sorted(set(lb) | set(ln))]
    by_leaf.sort(key=lambda r: -abs(r["delta_s"]))
    gate = None
    if fail_on_mfu_drop is not None:
        if _defined(b.get("mfu")) and _defined(n.get("mfu")):
            # Against one peak: a CPU peak is measured per run and varies, and MFU on different
            # peaks would compare the measurements, not the runs.
            scale = (n["peak_flops"] / b["peak_flops"]) if b.get("peak_flops") and n.get("peak_flops") else 1.0
            drop = (b["mfu"] - n["mfu"] * scale) / b["mfu"]
            gate = {"metric": "mfu", "drop": drop, "limit": fail_on_mfu_drop, "failed": drop > fail_on_mfu_drop}
        elif _defined(b.get("step_time_s")) and _defined(n.get("step_time_s")):
            drop = n["step_time_s"] / b["step_time_s"] - 1  # slower = lower MFU by the same factor
            gate = {"metric": "step_time_s (no MFU in these reports)", "drop": drop, "limit": fail_on_mfu_drop,
                    "failed": drop > fail_on_mfu_drop}
        else:
            # Undefined is not a drop: the gate cannot judge, and says so (exit 2, not 1).
            gate = {"metric": None, "drop": None, "limit": fail_on_mfu_drop, "failed": False, "comparable": False,
                    "reason": "not comparable: neither MFU nor step time is defined in both reports "
                              f"(base: {b.get('mfu_note') or 'no MFU'}; new: {n.get('mfu_note') or 'no MFU'})"}
    fb = {f["id"]: f for f in base.get("findings") or []}
    fn = {f["id"]: f for f in new.get("findings") or []}
    found = [{"id": k, "title": (fn.get(k) or fb[k])["title"], "fix": (fn.get(k) or fb[k])["fix"],
              "base_gain_s": fb[k]["gain_s"] if k in fb else None, "new_gain_s": fn[k]["gain_s"] if k in fn else None,
              "delta_s": (fn[k]["gain_s"] if k in fn else 0.0) - (fb[k]["gain_s"] if k in fb else 0.0)}
             for k in list(fb) + [k for k in fn if k not in fb]]
    found.sort(key=lambda r: -abs(r["delta_s"]))
    return {"base": base["provenance"]["source"], "new": new["provenance"]["source"], "summary": rows,
            "leaves": by_leaf, "findings": found, "gate": gate}


def _defined(v) -> bool:
    """A positive, finite number (reports write undefined figures as null; older ones had NaN)."""
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _change(a, b):
    if not _defined(a) or b is None or not math.isfinite(b):
        return None
    return b / a - 1


def _fmt(v, metric: str = "") -> str:
    if v is None:
        return "-"
    if metric in ("mfu", "hfu"):
        return f"{v:.2%}"
    if metric.endswith("_s"):
        return f"{v * 1e3:.1f} ms"
    return f"{v:,.3g}"


def _pct_change(v) -> str:
    return "-" if v is None else f"{v:+.1%}"


def render(result: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result, indent=2)
    gate = result["gate"]
    if fmt == "junit":
        failed = gate is not None and gate["failed"]
        msg = escape(_gate_text(gate)) if gate else "no gate"
        body = (f'<failure message="{msg}">{msg}</failure>' if failed else
                f'<skipped message="{msg}"/>' if gate and gate.get("comparable") is False else "")
        return ('<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="mfuscope.compare" tests="1" '
                f'failures="{int(failed)}"><testcase classname="mfuscope" name="mfu_regression">{body}'
                "</testcase></testsuite>")
    md = fmt == "markdown"
    lines = []
    if md:
        lines += ["### mfuscope compare", "", f"base `{result['base']}` → new `{result['new']}`", "",
                  "| metric | base | new | change |", "|---|---|---|---|"]
        lines += [f"| {r['metric']} | {_fmt(r['base'], r['metric'])} | {_fmt(r['new'], r['metric'])} | "
                  f"{_pct_change(r['change'])} |" for r in result["summary"]]
        lines += ["", "| leaf | base | new | delta |", "|---|---|---|---|"]
        lines += [f"| {r['leaf']} | {r['base_s'] * 1e3:.1f} ms | {r['new_s'] * 1e3:.1f} ms | "
                  f"{r['delta_s'] * 1e3:+.1f} ms |"
                  for r in result["leaves"][:12]]
    else:
        lines += [f"base {result['base']}", f"new  {result['new']}", "",
                  f"{'metric':<20} {'base':>12} {'new':>12} {'change':>9}"]
        lines += [f"{r['metric']:<20} {_fmt(r['base'], r['metric']):>12} {_fmt(r['new'], r['metric']):>12} "
                  f"{_pct_change(r['change']):>9}" for r in result["summary"]]
        lines += ["", f"{'breakdown leaf (per step)':<34} {'base ms':>9} {'new ms':>9} {'delta ms':>9}"]
        lines += [f"{r['leaf']:<34} {r['base_s'] * 1e3:9.1f} {r['new_s'] * 1e3:9.1f} {r['delta_s'] * 1e3:+9.1f}"
                  for r in result["leaves"][:12]]
    if gate:
        lines += ["", ("**" if md else "") + _gate_text(gate) + ("**" if md else "")]
    return "\n".join(lines)


def _gate_text(gate: dict) -> str:
    if gate.get("reason"):
        return gate["reason"]
    verdict = "FAIL" if gate["failed"] else "ok"
    return (f"{verdict}: {gate['metric']} dropped {gate['drop']:+.1%} (limit {gate['limit']:.1%})"
            if gate["drop"] >= 0 else f"{verdict}: {gate['metric']} improved ({-gate['drop']:.1%})")
