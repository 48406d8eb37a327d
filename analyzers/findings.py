"""Findings: what to fix first, each with its evidence, the step time it would save, and the id
of the optimizer that fixes it.  Ranked by estimated gain.

Each rule reads its fix's record in :data:`mfuscope.fix_registry.FIXES`: the evidence, the
threshold from which it applies (the same number the optimize catalogue uses) and how its gain
is estimated.  Gains are per step, estimates, and say how they were made:

- ``overlap_dp_grads``     an exposed data-parallel communication leaf (dp*, fsdp); gain: the time.
- ``overlap_tp_comm``      an exposed tensor/context/expert-parallel leaf; gain: half of it.
- ``more_microbatches``    the bubble; gain: the bubble minus the theory at twice the
                           microbatches (both over the pipeline's time).
- ``interleaved_schedule`` a non-interleaved schedule with a bubble; gain: half the bubble.
- ``rebalance_stages``     pipeline stage imbalance; gain: the excess of the slowest.
- ``straggler_rank``       a rank holds the others up; gain: its cost.
- ``fuse_elementwise``     norm/elementwise compute; gain: half of it.
- ``reduce_host_overhead`` device idle while the host works; gain: that time.  Not for steps
                           that capture CUDA graphs (the device idles by design).
- ``cuda_graphs``          launch-bound ranks (median kernel shorter than a launch) that are
                           host-bound; gain: the host-bound time (graphs launch once).  Not for a
                           job that already replays graphs.
"""
from __future__ import annotations

from typing import Any

from mfuscope.fix_registry import FIXES


def _leaves(tree: dict) -> dict[str, float]:
    if not tree["children"]:
        return {tree["name"]: tree["seconds"]}
    out: dict[str, float] = {}
    for c in tree["children"]:
        out.update(_leaves(c))
    return out


def derive(tree: dict, bubbles: dict | None, stragglers: list[dict], step_s: float | None,
           launch: list[dict] | None = None, graphs: dict | None = None) -> list[dict[str, Any]]:
    if not step_s:
        return []
    found = []

    def add(fix: str, title: str, gain: float, evidence: dict):
        if gain > 0:
            subject = evidence.get("rank", evidence.get("leaf", ""))
            found.append({"id": f"{fix}:{subject}" if subject != "" else fix, "fix": fix, "title": title,
                          "gain_s": gain, "gain_fraction": gain / step_s, "evidence": evidence})

    leaves = _leaves(tree)
    for leaf, seconds in leaves.items():
        if not leaf.startswith("comm/"):
            continue
        dim, op = (leaf.split("/") + [""])[1:3]
        if dim.startswith("dp") or dim in ("fsdp", "world", "inner", "outer"):
            fix = FIXES["overlap_dp_grads"]
        elif dim in ("tp", "cp", "ep"):
            fix = FIXES["overlap_tp_comm"]
        else:
            continue
        if fix.applies(seconds / step_s):
            add(fix.id, f"exposed {dim} communication ({op})", seconds * fix.gain_share,
                {"leaf": leaf, "seconds_per_step": seconds, "share_of_step": seconds / step_s})
    if bubbles and FIXES["more_microbatches"].applies(bubbles["share_of_step"]):
        # One basis throughout: the measured bubble and the theory are both shares of the pipeline's
        # time (the step minus other exposed communication); the gain is in seconds of the step.
        p, m, v, sched = bubbles["stages"], bubbles["microbatches"], bubbles["virtual_stages"], bubbles["schedule"]
        bubble, pipeline = bubbles["bubble_s"], bubbles["pipeline_s"]
        better = bubbles["theory_at_2m"] * pipeline
        add("more_microbatches", f"pipeline bubble {bubbles['bubble_fraction']:.0%} of the pipeline's time "
            f"(theory {bubbles['theory_fraction']:.0%} at m={m}; {bubbles['share_of_step']:.0%} of the step)",
            bubble - better, {"bubble_s": bubble, "share_of_step": bubbles["share_of_step"], "microbatches": m,
                              "stages": p, "theory_at_2m_s": better})
        interleave = FIXES["interleaved_schedule"]
        if v == 1 and interleave.applies(bubbles["share_of_step"]):
            add(interleave.id, "pipeline bubble with a non-interleaved schedule", bubble * interleave.gain_share,
                {"bubble_s": bubble, "schedule": sched})
    if bubbles and FIXES["rebalance_stages"].applies(bubbles["imbalance"]):
        slowest = max(bubbles["per_stage"], key=lambda s: s["busy_s"])
        add("rebalance_stages", f"pipeline stage {slowest['stage']} is {bubbles['imbalance']:.0%} busier than the "
            "mean stage", slowest["busy_s"] * bubbles["imbalance"] / (1 + bubbles["imbalance"]),
            {"per_stage": bubbles["per_stage"]})
    for s in stragglers:
        add("straggler_rank", f"rank {s['rank']} holds the others up", s["cost_s"] * FIXES["straggler_rank"].gain_share,
            {"rank": s["rank"], "cost_s": s["cost_s"], "steps": s["steps"]})
    elementwise = leaves.get("compute/norm_elementwise", 0.0)
    fuse = FIXES["fuse_elementwise"]
    if elementwise and fuse.applies(elementwise / step_s):
        add(fuse.id, f"norm/elementwise kernels take {elementwise / step_s:.0%} of the step",
            elementwise * fuse.gain_share, {"seconds_per_step": elementwise})
    host = leaves.get("host_bound", 0.0)
    # A step that captures CUDA graphs idles the device while the host records: that is the
    # capture, not host overhead to cut (the report's summary says graphs were captured).
    if not host or (graphs or {}).get("captures"):
        return sorted(found, key=lambda f: -f["gain_s"])
    if FIXES["reduce_host_overhead"].applies(host / step_s):
        add("reduce_host_overhead", f"device idle {host / step_s:.0%} of the step while the host works",
            host * FIXES["reduce_host_overhead"].gain_share, {"seconds_per_step": host})
    bound = [r for r in launch or [] if r["launch_bound"]]
    if bound and not (graphs or {}).get("replays") and FIXES["cuda_graphs"].applies(host / step_s):
        add("cuda_graphs", f"{len(bound)} rank(s) launch-bound: kernels shorter than their launches",
            host * FIXES["cuda_graphs"].gain_share,
            {"ranks": [r["rank"] for r in bound], "median_kernel_us": bound[0]["median_kernel_us"],
             "median_launch_us": bound[0]["median_launch_us"]})
    return sorted(found, key=lambda f: -f["gain_s"])
