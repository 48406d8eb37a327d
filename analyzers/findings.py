"""Findings: what to fix first, each with its evidence, the step time it would save, and the id
of the optimizer that fixes it.  Ranked by estimated gain.

Rules (gains are per step, estimates, and say how they were made):

- ``overlap_dp_grads``     exposed data-parallel communication (dp*, fsdp): overlap it with
                           backward; gain: the exposed time.
- ``overlap_tp_comm``      exposed tensor/sequence-parallel communication; gain: half of it
                           (async TP overlaps about that much).
- ``more_microbatches``    bubble above 5% of the step; gain: the bubble minus the theory
                           at twice the microbatches (both over the pipeline's time).
- ``interleaved_schedule`` a non-interleaved schedule with a bubble; gain: bubble x (1 - 1/2).
- ``rebalance_stages``     pipeline stage imbalance above 10%; gain: the excess of the slowest.
- ``straggler_rank``       a rank holds the others up; gain: its cost.
- ``fuse_elementwise``     norm/elementwise compute above 15% of the step; gain: half of it
                           (fused kernels read memory once).
- ``reduce_host_overhead`` device idle while the host works, above 10%; gain: that time.
                           Not for steps that capture CUDA graphs (the device idles by design).
- ``cuda_graphs``          launch-bound ranks (median kernel shorter than a launch) that are
                           also host-bound; gain: the host-bound time (graphs launch once).
                           Not for a job that already replays graphs.
"""
from __future__ import annotations

from typing import Any


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
        if not leaf.startswith("comm/") or seconds < 0.05 * step_s:
            continue
        dim = leaf.split("/")[1]
        if dim.startswith("dp") or dim in ("fsdp", "world", "inner", "outer"):
            add("overlap_dp_grads", f"exposed {dim} communication ({leaf.split('/')[2]})", seconds,
                {"leaf": leaf, "seconds_per_step": seconds, "share_of_step": seconds / step_s})
        elif dim in ("tp", "cp", "ep"):
            add("overlap_tp_comm", f"exposed {dim} communication ({leaf.split('/')[2]})", seconds / 2,
                {"leaf": leaf, "seconds_per_step": seconds, "share_of_step": seconds / step_s})
    if bubbles and bubbles["share_of_step"] > 0.05:
        # One basis throughout: the measured bubble and the theory are both shares of the pipeline's
        # time (the step minus other exposed communication); the gain is in seconds of the step.
        p, m, v, sched = bubbles["stages"], bubbles["microbatches"], bubbles["virtual_stages"], bubbles["schedule"]
        bubble, pipeline = bubbles["bubble_s"], bubbles["pipeline_s"]
        better = bubbles["theory_at_2m"] * pipeline
        add("more_microbatches", f"pipeline bubble {bubbles['bubble_fraction']:.0%} of the pipeline's time "
            f"(theory {bubbles['theory_fraction']:.0%} at m={m}; {bubbles['share_of_step']:.0%} of the step)",
            bubble - better, {"bubble_s": bubble, "share_of_step": bubbles["share_of_step"], "microbatches": m,
                              "stages": p, "theory_at_2m_s": better})
        if v == 1:
            add("interleaved_schedule", "pipeline bubble with a non-interleaved schedule", bubble / 2,
                {"bubble_s": bubble, "schedule": sched})
    if bubbles and bubbles["imbalance"] > 0.10:
        slowest = max(bubbles["per_stage"], key=lambda s: s["busy_s"])
        add("rebalance_stages", f"pipeline stage {slowest['stage']} is {bubbles['imbalance']:.0%} busier than the "
            "mean stage", slowest["busy_s"] * bubbles["imbalance"] / (1 + bubbles["imbalance"]),
            {"per_stage": bubbles["per_stage"]})
    for s in stragglers:
        add("straggler_rank", f"rank {s['rank']} holds the others up", s["cost_s"],
            {"rank": s["rank"], "cost_s": s["cost_s"], "steps": s["steps"]})
    elementwise = leaves.get("compute/norm_elementwise", 0.0)
    if elementwise > 0.15 * step_s:
        add("fuse_elementwise", f"norm/elementwise kernels take {elementwise / step_s:.0%} of the step",
            elementwise / 2, {"seconds_per_step": elementwise})
    host = leaves.get("host_bound", 0.0)
    # A step that captures CUDA graphs idles the device while the host records: that is the
    # capture, not host overhead to cut (the report's summary says graphs were captured).
    if host > 0.10 * step_s and not (graphs or {}).get("captures"):
        add("reduce_host_overhead", f"device idle {host / step_s:.0%} of the step while the host works", host,
            {"seconds_per_step": host})
        bound = [r for r in launch or [] if r["launch_bound"]]
        if bound and not (graphs or {}).get("replays"):
            add("cuda_graphs", f"{len(bound)} rank(s) launch-bound: kernels shorter than their launches", host,
                {"ranks": [r["rank"] for r in bound], "median_kernel_us": bound[0]["median_kernel_us"],
                 "median_launch_us": bound[0]["median_launch_us"]})
    return sorted(found, key=lambda f: -f["gain_s"])
