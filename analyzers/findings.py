"""Findings: what to fix first, each with its evidence, the step time at stake, and the id of
the fix that acts on it.  Ranked by that time.

Every finding starts from the breakdown: each leaf is a candidate cause, and each cause has one
record in :data:`mfuscope.fix_registry.FIXES` (its evidence, the threshold from which it applies
-- the number the optimize catalogue uses too -- and how its gain is sized).  Findings read the
**steady steps**: with three or more traced steps a rank's first is warm-up and left out.

Gains are what-if gains on each rank's own timeline: the leaves split every instant of a step
among causes exactly once, so removing a cause gives back its leaf's time and no instant is
claimed by two findings.  Where a fix's mechanism cannot remove all of it, the gain is cut to
what the mechanism reaches: communication is hidden only behind compute that exists (exposed
time, at most the step's compute), a bubble shrinks to the schedule's theory at twice the
microbatches, a straggler gives back its cost.  Each finding says which (``gain_basis``); the
cost model's figure for a concrete change sits beside it where the run has a model spec
(``mfuscope optimize``, the dashboard).

Causes, each a leaf (see :mod:`.breakdown`): exposed communication of any dimension, ``unknown``
included; the pipeline bubble and stage imbalance; a straggler rank; norm/elementwise kernels;
the optimizer step; the device waiting on the host (``host_bound`` + ``idle`` with nothing
queued: launch-bound jobs get ``cuda_graphs``, others ``reduce_host_overhead``); the device
waiting on a dependency with work queued; data loading; memory copies; blocking allocator calls;
and one-time initialization, which is reported with its calls but never as a per-step gain.

A trace that cannot support a per-step finding says so instead (``inconclusive``): a GPU job
whose trace holds no device activity, under 1 ms of device work a step (a test fixture, a
warm-up pass), or a window that is mostly one-time initialization.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from mfuscope.fix_registry import FIXES

from . import breakdown, kernel_kinds, kernel_time
from . import intervals as iv
from .group_sums import as_str, grouped
from .kernel_kinds import per_name

#: With this many traced steps or more, a rank's first step is warm-up: findings read the rest.
STEADY_FROM = 3
#: Less device work a step than this is a fixture or a warm-up pass, not a training step.
MIN_DEVICE_WORK_S = 1e-3
#: A window this much one-time initialization is a warm-up pass.
WARMUP_SHARE = 0.5
#: One-time initialization under this (and under 1% of the step) is not worth a line.
MIN_ONE_TIME_S = 1e-3
#: A late rank whose lateness costs the step this share is a finding of its own.
LATE_RANK_SHARE = 0.05
LATE_RANK_OUTLIER = 3.0

_DP_DIMS = ("fsdp", "world", "inner", "outer")
_IDLE_LEAVES = ("queued", "one_time_init", "allocator", "data_loading", "host_bound", "idle")


@dataclass
class LateArrivals:
    """Ranks the others waited for at matched collectives (from :func:`late_ranks`)."""

    ranks: list[dict] = field(default_factory=list)   # rank, gain_s, waited_s, collectives, doing
    waited: dict[str, float] = field(default_factory=dict)  # comm leaf -> seconds a rank-step spent waiting
    others: int = 0  # ranks of the job never last at a matched collective (their lateness: 0)

    def culprits(self, step_s: float) -> list[dict]:
        """The ranks late beyond the job's noise: lateness costing :data:`LATE_RANK_SHARE` of the
        step and :data:`LATE_RANK_OUTLIER` times the median of the other ranks'.  Ranks that take
        turns being last (time-shared cores, jitter) hold nobody up in particular."""
        out = []
        for r in self.ranks:
            rest = [x["gain_s"] for x in self.ranks if x is not r] + [0.0] * self.others
            typical = float(np.median(rest)) if rest else 0.0
            if r["gain_s"] >= max(LATE_RANK_SHARE * step_s, LATE_RANK_OUTLIER * typical):
                out.append(r)
        return out


@dataclass
class Evidence:
    """What the findings name beyond the leaves' seconds, per steady step (from :func:`gather`)."""

    device_work_missing: str | None = None       # why a GPU job's trace cannot be judged, if so
    one_time_calls: list[dict] = field(default_factory=list)
    loader: list[dict] = field(default_factory=list)
    copies: list[dict] = field(default_factory=list)
    blocking_calls: list[dict] = field(default_factory=list)
    allocator_calls: list[dict] = field(default_factory=list)
    elementwise_kernels: list[dict] = field(default_factory=list)
    elementwise_fused_share: float = 0.0   # of the norm/elementwise kernel time, in already fused kernels
    fp32_math: dict[str, Any] = field(default_factory=dict)   # share of GEMM/conv kernel time in FP32 SIMT
    launches: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)       # what the host did while the device waited on it


def steady(leaves: pd.DataFrame) -> pd.DataFrame:
    """``leaves`` (rank, step, leaf, seconds) without each rank's first step where it has
    :data:`STEADY_FROM` or more."""
    if leaves.empty:
        return leaves
    first = leaves.groupby("rank")["step"].transform("min")
    many = leaves.groupby("rank")["step"].transform("nunique") >= STEADY_FROM
    return leaves[~(many & (leaves["step"] == first))]


def host_wait_s(leaves: Mapping[str, float]) -> float:
    """The device idle with nothing queued while the host works or runs Python between operators:
    ``host_bound`` + ``idle`` on a GPU rank.  (A CPU-only rank has no device to wait: 0.)"""
    if "host_bound" not in leaves and "queued" not in leaves:
        return 0.0
    return leaves.get("host_bound", 0.0) + leaves.get("idle", 0.0)


def leaf_seconds(tree: dict) -> dict[str, float]:
    """The breakdown tree's leaves: {leaf name: seconds}."""
    if not tree["children"]:
        return {tree["name"]: tree["seconds"]}
    out: dict[str, float] = {}
    for c in tree["children"]:
        out.update(leaf_seconds(c))
    return out


def inconclusive(leaves: Mapping[str, float], step_s: float, evidence: Evidence | None) -> str | None:
    """Why no per-step finding can be made on these steps, or None."""
    if evidence and evidence.device_work_missing:
        return evidence.device_work_missing
    if not ("host_bound" in leaves or "queued" in leaves or "one_time_init" in leaves):
        return None  # a CPU-only rank: its operators are its compute
    busy = step_s - sum(leaves.get(k, 0.0) for k in _IDLE_LEAVES)
    init = leaves.get("one_time_init", 0.0)
    if init >= WARMUP_SHARE * step_s:
        return (f"a warm-up pass: one-time initialization takes {init:.3g} s of the {step_s:.3g} s window "
                f"(CUDA context, module loads, streams); profile steady-state steps")
    if busy < MIN_DEVICE_WORK_S:
        return (f"{busy * 1e6:.0f} us of device work a step: a test fixture or a warm-up pass, too little to "
                "judge a training step by")
    return None


def derive(tree: dict, bubbles: dict | None, stragglers: list[dict], step_s: float | None,
           launch: list[dict] | None = None, graphs: dict | None = None,
           evidence: Evidence | None = None, late: LateArrivals | None = None,
           moe: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The findings of one report, largest gain first; per-step gains before one-time costs.

    ``tree``: the breakdown of the steady steps (mean seconds a rank-step); ``step_s``: their
    mean; ``launch``: :func:`.kernel_time.launch_stats` rows; ``graphs``: CUDA-graph activity;
    ``late``: who the others waited for at collectives (waiting for a late peer is no bandwidth
    or overlap problem: it becomes a late-rank finding and leaves the communication's); ``moe``:
    the report's ``moe`` section (the routing's imbalance, :func:`.collective_match.expert_load`),
    whose share of the expert exchanges is no overlap problem either."""
    if not step_s:
        return []
    ev = evidence or Evidence()
    leaves = leaf_seconds(tree)
    found: list[dict[str, Any]] = []

    def add(fix: str, title: str, gain: float, detail: dict, basis: str = "the cause's time (what-if: removed)",
            subject: Any = "") -> None:
        if gain > 0:
            ident = f"late_rank:{str(subject)[4:]}" if str(subject).startswith("late") else \
                f"{fix}:{subject}" if subject != "" else fix
            found.append({"id": ident, "fix": fix, "title": title,
                          "gain_s": gain, "gain_fraction": gain / step_s, "gain_basis": basis, "per_step": True,
                          "evidence": detail})

    def share(seconds: float) -> dict:
        return {"seconds_per_step": seconds, "share_of_step": seconds / step_s}

    init = leaves.get("one_time_init", 0.0)
    reason = inconclusive(leaves, step_s, evidence)
    if reason is None:
        late = late or LateArrivals()
        routing = _communication(leaves, step_s, add, late.waited, moe)
        straggling = {s["rank"] for s in stragglers}
        for r in late.culprits(step_s):
            if r["rank"] in straggling or {f"comm/{c}" for c in r["collectives"]} <= routing:
                continue  # late only at expert exchanges that wait for the routing: balance_experts' time
            doing = _in_words(max(r["doing"], key=r["doing"].get)) if r["doing"] else None
            add("straggler_rank", f"late rank {r['rank']}: the others wait {r['waited_s'] * 1e3:.1f} ms a step for it "
                f"in {', '.join(r['collectives'])}" + (f" (meanwhile it was in {doing})" if doing else ""),
                r["gain_s"], r, "the late arrival's lead over the second-last (what-if: it keeps pace)",
                f"late{r['rank']}")
        _pipeline(bubbles, add)
        for s in stragglers:
            add("straggler_rank", f"rank {s['rank']} holds the others up", s["cost_s"],
                {"rank": s["rank"], "cost_s": s["cost_s"], "steps": s["steps"]},
                "its cost to the others (what-if: it keeps pace)", s["rank"])
        _compute(leaves, step_s, add, share, ev)
        _waiting(leaves, step_s, add, share, ev, launch, graphs)
    out = sorted(found, key=lambda f: -f["gain_s"])
    if ev.one_time_calls and (init >= max(MIN_ONE_TIME_S, 0.01 * step_s) or reason is not None and init > 0):
        out.append({"id": "one_time_init", "fix": "one_time_init",
                    "title": f"one-time initialization: {init * 1e3:.1f} ms of the window (start-up, not a per-step "
                             "cost)", "gain_s": 0.0, "gain_fraction": 0.0, "per_step": False,
                    "gain_basis": "none: paid once", "one_time_s": init,
                    "evidence": {"seconds": init, "calls": ev.one_time_calls}})
    if reason is not None:
        for f in out:
            f["evidence"]["inconclusive"] = reason
    return out


def _in_words(leaf: str) -> str:
    """A breakdown leaf as a sentence says it."""
    words = {"idle": "Python between operators (no operator running)", "host_bound": "host operators",
             "data_loading": "its DataLoader", "queued": "a device wait with work queued",
             "one_time_init": "one-time initialization", "allocator": "allocator calls", "memory": "memory copies",
             "bubble": "the pipeline bubble"}
    if leaf.startswith("compute/"):
        return f"compute ({leaf[8:]})"
    if leaf.startswith("comm/"):
        return f"communication ({leaf[5:]})"
    return words.get(leaf, leaf)


def _communication(leaves: dict[str, float], step_s: float, add, waited: dict[str, float],
                   moe: Mapping[str, Any] | None = None) -> set[str]:
    """The communication findings; returns the expert-exchange leaves given to the routing's
    imbalance (``balance_experts``)."""
    compute = sum(v for k, v in leaves.items() if k.startswith("compute/"))
    load = float((moe or {}).get("expert_load") or 1.0)
    balance, routing = FIXES["balance_experts"], set()
    for leaf, exposed in leaves.items():
        if not leaf.startswith("comm/"):
            continue
        seconds = max(exposed - waited.get(leaf, 0.0), 0.0)  # the wait for a late peer is the late rank's
        dim, op = (leaf.split("/") + [""])[1:3]
        if "ep" in dim.split("_") and balance.applies(load - 1):
            # The exchanges end with the busiest rank's experts: the others' wait for it there, and
            # its own rows beyond the mean, are the routing's, which no overlap hides.
            skew = min(exposed - seconds + seconds * (1 - 1 / load), exposed)
            add(balance.id, f"the expert exchanges ({op}) wait for the busiest expert-parallel rank: it gets "
                f"{load - 1:.0%} more routed rows than the mean", skew,
                {"leaf": leaf, "expert_load": load, "exchanges": (moe or {}).get("exchanges"),
                 "exposed_s": exposed, "waiting_for_the_busiest_s": exposed - seconds,
                 "seconds_per_step": skew, "share_of_step": skew / step_s},
                "the exchanges' wait for the busiest rank and its rows beyond the mean (what-if: balanced routing)",
                leaf)
            routing.add(leaf)
            seconds = exposed - skew
        if dim.startswith("dp") or dim in _DP_DIMS:
            fix, where = FIXES["overlap_dp_grads"], f"{dim} dimension"
        elif set(dim.split("_")) & {"tp", "cp", "ep", "etp"}:  # tp, cp, ep and groups that join them (tp_cp)
            fix, where = FIXES["overlap_tp_comm"], f"{dim} dimension"
        elif dim == "unknown":
            fix, where = FIXES["overlap_comm"], "dimension unknown: no process-group names in the trace"
        else:
            fix, where = FIXES["overlap_comm"], f"{dim} group"
        if fix.applies(seconds / step_s):
            add(fix.id, f"exposed {op} communication ({where}): {seconds / step_s:.0%} of the step",
                min(seconds, compute), {"leaf": leaf, "seconds_per_step": seconds, "share_of_step": seconds / step_s,
                                        "exposed_s": exposed, "waiting_for_late_peers_s": exposed - seconds,
                                        "compute_to_hide_behind_s": compute},
                "the exposed time, at most the step's compute to hide it behind", leaf)
    return routing


def _pipeline(bubbles: dict | None, add) -> None:
    if bubbles and FIXES["more_microbatches"].applies(bubbles["share_of_step"]):
        # One basis throughout: the measured bubble and the theory are both shares of the pipeline's
        # time (the step minus other exposed communication); the gain is in seconds of the step.
        p, m, v, sched = bubbles["stages"], bubbles["microbatches"], bubbles["virtual_stages"], bubbles["schedule"]
        bubble, pipeline = bubbles["bubble_s"], bubbles["pipeline_s"]
        better = bubbles["theory_at_2m"] * pipeline
        add("more_microbatches", f"pipeline bubble {bubbles['bubble_fraction']:.0%} of the pipeline's time "
            f"(theory {bubbles['theory_fraction']:.0%} at m={m}; {bubbles['share_of_step']:.0%} of the step)",
            bubble - better, {"bubble_s": bubble, "share_of_step": bubbles["share_of_step"], "microbatches": m,
                              "stages": p, "theory_at_2m_s": better}, "the bubble down to the theory's at 2m")
        interleave = FIXES["interleaved_schedule"]
        if v == 1 and interleave.applies(bubbles["share_of_step"]):
            add(interleave.id, "pipeline bubble with a non-interleaved schedule", bubble * interleave.gain_share,
                {"bubble_s": bubble, "schedule": sched}, "the bubble over two chunks a rank ((p-1)/(v m), v=2)")
    if bubbles and FIXES["rebalance_stages"].applies(bubbles["imbalance"]):
        slowest = max(bubbles["per_stage"], key=lambda s: s["busy_s"])
        add("rebalance_stages", f"pipeline stage {slowest['stage']} is {bubbles['imbalance']:.0%} busier than the "
            "mean stage", slowest["busy_s"] * bubbles["imbalance"] / (1 + bubbles["imbalance"]),
            {"per_stage": bubbles["per_stage"]}, "the busiest stage's excess over the mean")


def _compute(leaves: dict[str, float], step_s: float, add, share, ev: Evidence) -> None:
    # Kernels that already fuse (torch.compile's, a library's fused norm) are left out: fusing
    # them again gains nothing, and a compiled job's elementwise time is mostly theirs.
    fused = ev.elementwise_fused_share
    elementwise = leaves.get("compute/norm_elementwise", 0.0) * (1 - fused)
    if elementwise and FIXES["fuse_elementwise"].applies(elementwise / step_s):
        already = f" ({fused:.0%} of that kind's time is in kernels already fused)" if fused >= 0.05 else ""
        add("fuse_elementwise", f"{'unfused ' if already else ''}norm/elementwise kernels take "
            f"{elementwise / step_s:.0%} of the step{already}",
            elementwise, {**share(elementwise), "kernels": ev.elementwise_kernels, "already_fused_share": fused},
            "the unfused kernels' time (what-if: fused away; fusion keeps one read and one write of each chain)")
    math = leaves.get("compute/conv", 0.0) + leaves.get("compute/gemm", 0.0)
    fp32 = math * ev.fp32_math.get("share", 0.0)
    if fp32 and FIXES["mixed_precision"].applies(fp32 / step_s):
        what = "convolutions" if leaves.get("compute/conv", 0.0) > leaves.get("compute/gemm", 0.0) else "GEMMs"
        add("mixed_precision", f"FP32 {what} without tensor cores take {fp32 / step_s:.0%} of the step", fp32,
            {**share(fp32), "conv_s": leaves.get("compute/conv", 0.0), "gemm_s": leaves.get("compute/gemm", 0.0),
             "fp32_share_of_conv_gemm_time": ev.fp32_math["share"], "kernels": ev.fp32_math["kernels"]},
            "their time (what-if: on tensor cores, a fraction of it)")
    optimizer = leaves.get("compute/optimizer", 0.0)
    if optimizer and FIXES["fused_optimizer"].applies(optimizer / step_s):
        add("fused_optimizer", f"the optimizer step takes {optimizer / step_s:.0%} of the step", optimizer,
            share(optimizer))


def _waiting(leaves: dict[str, float], step_s: float, add, share, ev: Evidence, launch, graphs) -> None:
    queued = leaves.get("queued", 0.0)
    if FIXES["wait_on_dependency"].applies(queued / step_s):
        calls = ev.blocking_calls
        where = ", ".join(x for x in [calls[0].get("copy"), (calls[0].get("inside") or [None])[0]] if x) \
            if calls else ""
        meanwhile = (f"; the host meanwhile blocks in {calls[0]['name']}" + (f" ({where})" if where else "")
                     if calls else "")
        add("wait_on_dependency", f"the device idles {queued / step_s:.0%} of the step with work queued: it waits "
            f"on a dependency (a stream event, a peer, a copy), not on the host{meanwhile}", queued,
            {**share(queued), "blocking_calls": calls})
    loading = leaves.get("data_loading", 0.0)
    if FIXES["faster_data_loading"].applies(loading / step_s):
        add("faster_data_loading", f"data loading: the device idles {loading / step_s:.0%} of the step while the "
            "loop waits for its next batch", loading, {**share(loading), "annotations": ev.loader})
    saving = leaves.get("checkpoint", 0.0)
    if FIXES["async_checkpoint"].applies(saving / step_s):
        add("async_checkpoint", f"checkpoint saves hold the training thread {saving / step_s:.0%} of the step: "
            "save asynchronously (stage to host memory, write in the background)", saving, share(saving))
    memory = leaves.get("memory", 0.0)
    if FIXES["fewer_copies"].applies(memory / step_s):
        top = f" ({ev.copies[0]['name']} most)" if ev.copies else ""
        add("fewer_copies", f"memory copies: the device only copies {memory / step_s:.0%} of the step{top}", memory,
            {**share(memory), "copies": ev.copies})
    alloc = leaves.get("allocator", 0.0)
    if FIXES["caching_allocator"].applies(alloc / step_s):
        add("caching_allocator", f"blocking allocator calls: the device idles {alloc / step_s:.0%} of the step "
            "while the host allocates or frees", alloc, {**share(alloc), "calls": ev.allocator_calls})
    host = host_wait_s(leaves)
    # A step that captures CUDA graphs idles the device while the host records: that is the
    # capture, not host overhead to cut (the report's summary says graphs were captured).
    if not host or (graphs or {}).get("captures"):
        return
    detail = {**share(host), "host_bound_s": leaves.get("host_bound", 0.0), "python_between_ops_s":
              leaves.get("idle", 0.0), "launches": ev.launches, **ev.host}
    after_sync = ev.host.get("after_sync_s", 0.0)
    why = (f"; {after_sync / host:.0%} of it right after synchronizing calls "
           f"({ev.host['sync_calls_per_step']:.0f} a step)" if host and after_sync >= 0.5 * host else "")
    bound = [r for r in launch or [] if r.get("launch_bound")]
    if bound and not (graphs or {}).get("replays") and FIXES["cuda_graphs"].applies(host / step_s):
        add("cuda_graphs", f"the device waits on the host {host / step_s:.0%} of the step, launch-bound: most "
            f"kernels are shorter than their launches ({len(bound)} rank(s)){why}", host,
            {**detail, "ranks": [r["rank"] for r in bound], "median_kernel_us": bound[0]["median_kernel_us"],
             "median_launch_us": bound[0]["median_launch_us"]})
    elif FIXES["reduce_host_overhead"].applies(host / step_s):
        add("reduce_host_overhead", f"the device waits on the host {host / step_s:.0%} of the step: idle with "
            f"nothing queued while the host dispatches{why}", host, detail)


# ----------------------------------------------------------------------------- late ranks
def late_ranks(keys: pd.DataFrame, plan_of, pairs: pd.DataFrame, step_s: float | None = None) -> LateArrivals:
    """:class:`LateArrivals` from the matched collectives of the steady steps, one row a key
    (:attr:`.collective_match.Matched.late`).

    A late rank's gain is its lead over the second-last arrival, summed over its collectives a
    step (the critical path: everyone leaves together once the last arrives); ``waited_s`` the
    others' wait a rank-step; ``doing`` the late rank's own breakdown leaves while the others
    waited, what it was doing instead -- worked out for the ranks whose lateness reaches
    :data:`LATE_RANK_SHARE` of ``step_s`` (the findings).  ``plan_of``: rank -> the rank's plan
    (:func:`.breakdown.rank_plan`) or None, asked only for those ranks (a reduce over thousands of
    ranks reads them again for the few it names)."""
    if keys.empty or pairs.empty:
        return LateArrivals()
    steps = pairs["step"].nunique()
    per_rank_step = len(pairs)
    out = []
    for rank, g in keys.groupby("late_rank"):
        gain = float(g["gap_ns"].sum()) / 1e9 / steps
        doing: dict[str, float] = {}
        plan = plan_of(int(rank)) if step_s is None or gain >= LATE_RANK_SHARE * step_s else None  # worth naming
        if plan is not None:
            late = iv.union(g["late_from_ns"].to_numpy(dtype=np.int64), g["late_to_ns"].to_numpy(dtype=np.int64))
            doing = {leaf: ns / 1e9 for leaf, ns in iv.assign_by_priority_within(late, plan, "idle").items() if ns > 0}
        out.append({"rank": int(rank), "gain_s": gain, "waited_s": float(g["waited_ns"].sum()) / 1e9 / per_rank_step,
                    "collectives": sorted(set(g["dim"].astype(str) + "/" + g["op"].astype(str))),
                    "instances_per_step": len(g) / steps, "doing": doing})
    leaf = "comm/" + keys["dim"].astype(str) + "/" + keys["op"].astype(str)
    waited = (keys["waited_ns"].groupby(leaf).sum() / 1e9 / per_rank_step).to_dict()
    return LateArrivals(sorted(out, key=lambda r: -r["gain_s"]), {k: float(v) for k, v in waited.items()},
                        max(pairs["rank"].nunique() - len(out), 0))


# ----------------------------------------------------------------------------- evidence from the events
#: The named lists of :class:`Evidence`, each summed per name over the ranks (:class:`EvidenceParts`).
_NAMED = ("one_time_calls", "allocator_calls", "blocking_calls", "loader", "copies", "elementwise_kernels",
          "fp32_kernels")


@dataclass
class EvidenceParts:
    """One rank's (or any set of ranks') evidence as sums, so that ranks summarized apart merge
    into the :class:`Evidence` of all of them (:func:`merge_evidence`): per named list the calls and
    nanoseconds of each name, the longest blocking call of each name with where it was made, and
    the counters the per-step figures divide by the steady rank-steps."""

    pairs: int = 0                        # steady (rank, step) pairs read
    device_work: bool = False             # any device activity in the trace (any step)
    runtime_calls: int = 0                # for the hint when there is none
    nccl_ops: list[str] = field(default_factory=list)
    named: dict[str, pd.DataFrame] = field(default_factory=dict)   # list -> name, count, sum (ns)
    blocking_longest: list[dict] = field(default_factory=list)     # name, longest_ns, inside, copy
    has_runtime: bool = False
    launch_calls: int = 0
    launch_host_ns: float = 0.0
    kernels: int = 0
    short_kernels: int = 0
    math_ns: float = 0.0                  # GEMM/conv (and FP32 SIMT) kernel time
    fp32_ns: float = 0.0                  # of it, FP32 SIMT
    elementwise_ns: float = 0.0           # norm/elementwise kernel time
    fused_elementwise_ns: float = 0.0     # of it, in kernels that already fuse (kernel_kinds.is_fused_kernel)
    host_ops_ns: dict[str, float] | None = None
    after_sync_ns: int = 0
    sync_calls: int = 0


def gather(events, steady_steps: pd.DataFrame, ranks_meta: Mapping[int, dict], plans=None) -> Evidence:
    """The calls, kernels and annotations the findings name, per steady rank-step (all ranks of
    ``events`` at once: :func:`gather_parts` then :func:`merge_evidence`)."""
    return merge_evidence([gather_parts(events, steady_steps, plans)], ranks_meta)


def gather_parts(events, steady_steps: pd.DataFrame, plans=None) -> EvidenceParts:
    """The sums behind :class:`Evidence` for the ranks of ``events``.

    ``events``: an EventTable; ``steady_steps``: (rank, step) pairs the findings read; ``plans``:
    the step plans of ``events`` (for what the host did while the device waited on it)."""
    ev = EvidenceParts(pairs=len(steady_steps))
    head = events.to_pandas(["kind", "device", "name"])
    ev.device_work = bool((head["kind"].isin(["kernel", "comm", "memcpy", "memset"]) & (head["device"] >= 0)).any())
    if not ev.device_work:
        ev.runtime_calls = int(head["kind"].isin(["runtime", "driver"]).sum())
        ev.nccl_ops = sorted({str(n) for n in head["name"].unique() if str(n).startswith("nccl:")})
        return ev
    df = events.to_pandas(["rank", "kind", "name", "ts_ns", "dur_ns", "step", "device", "tid", "correlation"])
    df = df[pair_in(df, steady_steps)]
    kind = df["kind"]  # categorical: compared and matched per category, never expanded to strings
    names = df["name"]

    def sums(rows: pd.DataFrame) -> pd.DataFrame:
        return grouped({"name": as_str(rows["name"]), "dur_ns": rows["dur_ns"]}, ["name"],
                       as_index=True, count=("dur_ns", "count"), sum=("dur_ns", "sum"))

    calls = df[kind.isin(["runtime", "driver"])]
    kernels = df[(kind == "kernel") & (df["device"] >= 0)]
    if len(calls):
        ev.has_runtime = True
        init, alloc = breakdown._init_and_allocator_calls(calls)
        ev.named["one_time_calls"], ev.named["allocator_calls"] = sums(init), sums(alloc)
        blocking = calls[_matches(calls["name"], r"Synchronize|Memcpy|StreamWaitEvent")]
        ev.named["blocking_calls"] = sums(blocking)
        for name, rows in blocking.groupby(as_str(blocking["name"])):
            ev.blocking_longest.append({"name": name, **_context(df, rows)})
        launches = calls[_matches(calls["name"], "Launch")]
        ev.launch_calls, ev.launch_host_ns = len(launches), float(launches["dur_ns"].sum())
    ev.kernels, ev.short_kernels = len(kernels), int((kernels["dur_ns"] < kernel_time.SMALL_KERNEL_NS).sum())
    ev.named["loader"] = sums(df[_matches(names, "DataLoader") & kind.isin(["annotation", "cpu_op", "python"])])
    if plans is not None:
        ev.host_ops_ns, ev.after_sync_ns, ev.sync_calls = _host_while_waited(df, kind, plans, steady_steps)
    ev.named["copies"] = sums(df[kind.isin(["memcpy", "memset"]) & (df["device"] >= 0)])
    if len(kernels):
        kinds = pd.Series(per_name(kernels["name"], breakdown.kernel_kind), index=kernels.index)
        simt = pd.Series(per_name(kernels["name"], kernel_kinds.is_fp32_simt, default=False), index=kernels.index)
        elementwise = kernels[kinds == "norm_elementwise"]
        ev.named["elementwise_kernels"] = sums(elementwise)
        fused = per_name(elementwise["name"], kernel_kinds.is_fused_kernel, default=False).astype(bool)
        ev.elementwise_ns, ev.fused_elementwise_ns = (float(elementwise["dur_ns"].sum()),
                                                      float(elementwise["dur_ns"][fused].sum()))
        math = kernels[kinds.isin(["gemm", "conv"]) | simt]
        fp32 = simt[math.index]
        ev.math_ns, ev.fp32_ns = float(math["dur_ns"].sum()), float(math["dur_ns"][fp32].sum())
        ev.named["fp32_kernels"] = sums(math[fp32])
    return ev


def combine_parts(parts: list[EvidenceParts]) -> EvidenceParts:
    """One :class:`EvidenceParts` holding the sums of ``parts`` (in rank order): merged, it gives
    the same :class:`Evidence` as they do, in the space of one rank's."""
    out = EvidenceParts(pairs=sum(p.pairs for p in parts), device_work=any(p.device_work for p in parts),
                        runtime_calls=sum(p.runtime_calls for p in parts),
                        nccl_ops=sorted({n for p in parts for n in p.nccl_ops}),
                        has_runtime=any(p.has_runtime for p in parts))
    for key in _NAMED:
        frames = [p.named[key] for p in parts if key in p.named]
        if frames:
            out.named[key] = pd.concat(frames).groupby(level=0).sum() if len(frames) > 1 else frames[0]
    longest: dict[str, dict] = {}
    for b in (b for p in parts for b in p.blocking_longest):
        if b["name"] not in longest or b["longest_s"] > longest[b["name"]]["longest_s"]:
            longest[b["name"]] = b
    out.blocking_longest = list(longest.values())
    for name in ("launch_calls", "launch_host_ns", "kernels", "short_kernels", "math_ns", "fp32_ns",
                 "elementwise_ns", "fused_elementwise_ns", "after_sync_ns", "sync_calls"):
        setattr(out, name, sum(getattr(p, name) for p in parts))
    hosts = [p.host_ops_ns for p in parts if p.host_ops_ns is not None]
    if hosts:
        out.host_ops_ns = {}
        for ops in hosts:
            for name, ns in ops.items():
                out.host_ops_ns[name] = out.host_ops_ns.get(name, 0.0) + ns
    return out


def merge_evidence(parts: list[EvidenceParts], ranks_meta: Mapping[int, dict]) -> Evidence:
    """The :class:`Evidence` of the ranks ``parts`` summarize (in rank order), per steady rank-step."""
    ev = Evidence()
    if not any(p.device_work for p in parts):
        hint = _gpu_hint(sum(p.runtime_calls for p in parts), sorted({n for p in parts for n in p.nccl_ops}),
                         ranks_meta)
        if hint:
            ev.device_work_missing = (f"the trace records no device activity, though the job ran on a GPU ({hint}): "
                                      "nothing can be said about device time")
        return ev
    n = max(sum(p.pairs for p in parts), 1)

    def top(key: str, k: int = 5) -> list[dict]:
        frames = [p.named[key] for p in parts if key in p.named and len(p.named[key])]
        if not frames:
            return []
        g = pd.concat(frames).groupby(level=0).sum() if len(frames) > 1 else frames[0]
        g = g.sort_values("sum", ascending=False).head(k)
        return [{"name": name, "calls_per_step": r["count"] / n, "seconds_per_step": r["sum"] / 1e9 / n}
                for name, r in g.iterrows()]

    if any(p.has_runtime for p in parts):
        ev.one_time_calls, ev.allocator_calls, ev.blocking_calls = (top("one_time_calls"), top("allocator_calls"),
                                                                     top("blocking_calls"))
        if ev.blocking_calls:
            first = ev.blocking_calls[0]["name"]
            longest = [b for p in parts for b in p.blocking_longest if b["name"] == first]
            best = max(longest, key=lambda b: b["longest_s"])  # the first of equals: the lowest rank's
            ev.blocking_calls[0].update({k: v for k, v in best.items() if k != "name"})
        kernels = sum(p.kernels for p in parts)
        ev.launches = {"per_step": sum(p.launch_calls for p in parts) / n,
                       "host_s_per_step": sum(p.launch_host_ns for p in parts) / 1e9 / n,
                       "kernels_per_step": kernels / n,
                       "short_kernel_share": sum(p.short_kernels for p in parts) / kernels if kernels else None}
    ev.loader = top("loader")
    hosts = [p for p in parts if p.host_ops_ns is not None]
    if hosts:
        ops: dict[str, float] = {}
        for p in hosts:
            for name, ns in p.host_ops_ns.items():
                ops[name] = ops.get(name, 0.0) + ns
        best = sorted(ops.items(), key=lambda kv: -kv[1])[:6]
        ev.host = {"host_ops": [{"name": k, "seconds_per_step": v / 1e9 / n} for k, v in best if v > 0],
                   "after_sync_s": sum(p.after_sync_ns for p in hosts) / 1e9 / n,
                   "sync_calls_per_step": sum(p.sync_calls for p in hosts) / n}
    ev.copies = top("copies")
    ev.elementwise_kernels = top("elementwise_kernels")
    elementwise_ns = sum(p.elementwise_ns for p in parts)
    if elementwise_ns > 0:
        ev.elementwise_fused_share = sum(p.fused_elementwise_ns for p in parts) / elementwise_ns
    fp32_ns = sum(p.fp32_ns for p in parts)
    if fp32_ns > 0 or any(len(p.named.get("fp32_kernels", ())) for p in parts):
        ev.fp32_math = {"share": fp32_ns / max(sum(p.math_ns for p in parts), 1), "kernels": top("fp32_kernels")}
    return ev


#: Host calls that block until the device catches up (the key's "CPU sync"): synchronizes, blocking
#: copies, and the copies into pageable host memory that ``cudaMemcpyAsync`` makes blocking.
_SYNC_CALL = r"Synchronize|^(?:cuda|hip)Memcpy$|MemcpyWithStream|^(?:cuda|hip)MemcpyAsync$|^cuMemcpyDtoH"
AFTER_SYNC_NS = 100_000  #: a device gap this soon after a sync returned is the sync's doing


def _context(df: pd.DataFrame, calls: pd.DataFrame) -> dict[str, Any]:
    """Where the longest of ``calls`` was made: the operators and annotations around it on its
    thread (outermost first) and, for a copy, the device copy it waited for."""
    longest = calls.loc[calls["dur_ns"].idxmax()]
    start, end = longest["ts_ns"], longest["ts_ns"] + longest["dur_ns"]
    host = df[(df["tid"] == longest["tid"]) & (df["rank"] == longest["rank"])
              & df["kind"].isin(["cpu_op", "annotation"])]
    around = host[(host["ts_ns"] <= start) & (host["ts_ns"] + host["dur_ns"] >= end)].sort_values("ts_ns")
    out: dict[str, Any] = {"longest_s": float(longest["dur_ns"]) / 1e9,
                           "inside": [str(n) for n in around["name"].head(4)]}
    if longest["correlation"] >= 0:
        copy = df[(df["correlation"] == longest["correlation"]) & (df["rank"] == longest["rank"])
                  & df["kind"].isin(["memcpy", "memset"])]
        if len(copy):
            out["copy"] = str(copy["name"].iloc[0])
    return out


def _host_while_waited(df: pd.DataFrame, kind: pd.Series, plans,
                       steady_steps: pd.DataFrame) -> tuple[dict[str, float], int, int]:
    """What the host did while the device waited on it (``host_bound`` and ``idle`` time): the
    operators and annotations that overlap it most, and how much of it follows a synchronizing
    call (within :data:`AFTER_SYNC_NS`: the device drained at the sync and idles while the host
    refills it)."""
    keep = set(map(tuple, steady_steps[["rank", "step"]].to_numpy().tolist()))
    waits: dict[int, list] = {}
    for rank, step, window, plan in plans:
        if (rank, step) in keep:
            a, b, names = iv.segments_by_priority(window, plan, "idle")
            mask = [x in ("host_bound", "idle") for x in names]
            waits.setdefault(rank, []).append((a[mask], b[mask]))
    ops: dict[str, float] = {}
    after_sync = 0
    syncs = df[kind.isin(["runtime", "driver"]) & _matches(df["name"], _SYNC_CALL)]
    host = df[kind.isin(["cpu_op", "annotation"])]
    # each rank's rows as positions into the columns (one pass each; no frame a rank)
    host_of, syncs_of = host.groupby("rank").indices, syncs.groupby("rank").indices
    host_start = host["ts_ns"].to_numpy()
    host_end, host_name = host_start + host["dur_ns"].to_numpy(), as_str(host["name"]).to_numpy()
    sync_done = (syncs["ts_ns"] + syncs["dur_ns"]).to_numpy()
    none = np.empty(0, dtype=np.intp)
    for rank, parts in waits.items():
        starts = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64)
        ends = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
        if not len(starts):
            continue
        wait = iv.union(starts, ends)
        mine = host_of.get(rank, none)
        covered = iv.overlap(wait, host_start[mine], host_end[mine])
        per_op = grouped({"name": pd.Series(host_name[mine]), "ns": pd.Series(covered)}, ["name"], as_index=True,
                         ns=("ns", "sum"))["ns"]
        for name, ns in per_op.items():
            ops[name] = ops.get(name, 0.0) + ns
        done = np.sort(sync_done[syncs_of.get(rank, none)])
        if len(done):  # a sync returned in [gap start - 100 us, gap end]
            first = np.searchsorted(done, wait[0] - AFTER_SYNC_NS)
            hit = (first < len(done)) & (done[np.clip(first, 0, len(done) - 1)] <= wait[1])
            after_sync += int((wait[1] - wait[0])[hit].sum())
    return ops, after_sync, len(syncs)


def pair_in(rows: pd.DataFrame, pairs: pd.DataFrame) -> np.ndarray:
    """Which of ``rows`` have a (rank, step) among ``pairs``' (both 32-bit values, packed into one
    64-bit code: a numpy isin, where two MultiIndexes cost milliseconds to build)."""
    def code(frame: pd.DataFrame) -> np.ndarray:
        rank, step = frame["rank"].to_numpy().astype(np.int64), frame["step"].to_numpy().astype(np.int64)
        return (rank << 32) | (step & 0xFFFFFFFF)

    return np.isin(code(rows), code(pairs))


def _matches(names: pd.Series, pattern: str) -> np.ndarray:
    """Which rows' names match ``pattern`` (a regular expression), tested once per distinct name."""
    rule = re.compile(pattern)
    return per_name(names, lambda n: bool(rule.search(n)), default=False)


def _gpu_hint(runtime_calls: int, nccl_ops: list[str], ranks_meta: Mapping[int, dict]) -> str | None:
    """What says a trace without device activity is of a GPU job, if anything does."""
    if runtime_calls:
        return f"{runtime_calls:,} CUDA/HIP runtime calls"
    for meta in ranks_meta.values():
        if meta.get("device_name"):
            return f"device {meta['device_name']}"
        if str(meta.get("backend") or "").lower() in ("nccl", "rccl"):
            return f"{meta['backend']} backend"
    if nccl_ops:
        return f"NCCL operators ({', '.join(nccl_ops[:3])})"
    return None
