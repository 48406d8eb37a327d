"""``mfuscope analyze``: every analysis over one run, into report.json, and its text summary.

Inputs: the EventTable of the traces, and, for a run directory, the
collectors' manifest and tables.  Step times and tokens come from
``steps.parquet`` when the run has it (every step; the first step is warm-up
and left out when there are three or more), else from the trace's step
markers (the slowest rank's span: everyone waits for it).  The breakdown,
bubbles and stragglers need the traces; communication uses ``comm.parquet``
when present, else the trace's communication work.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from mfuscope import run_dir
from mfuscope.event_table import EventTable
from mfuscope.manifest import Manifest
from mfuscope.report import new_report

from . import (
    breakdown,
    bubbles,
    checkpoints,
    collective_match,
    comm_stats,
    counters,
    findings,
    health,
    kernel_time,
    memory,
    mfu,
    rank_lists,
    rank_summary,
    step_rows,
    stragglers,
    timeline,
)
from .context import Context
from .nccl_tests import Table, compare
from .steps import DEVICE_SPAN, WHOLE_TRACE


def build_report(events: EventTable | Context, *, source: str, files: list[str],
                 run: str | Path | None = None, nccl_tests: list[Table] | None = None) -> dict[str, Any]:
    """The report of traces held in memory: each rank summarized here (:mod:`.rank_summary`),
    then reduced -- the path ``mfuscope analyze`` takes in worker processes (:mod:`.map_reduce`).
    ``events``: the traces, or the analysis context that holds them with the run's manifest;
    ``run``: the run directory, if any; ``nccl_tests``: nccl-tests tables (:mod:`.nccl_tests`)
    each communication row is compared with."""
    ctx = events if isinstance(events, Context) else Context.of(events, run)
    comm = run_comm(run)
    world = job_world(ctx.events.ranks, ctx.manifest)
    by_rank = split_ranks(ctx.events)
    summaries = [rank_summary.summarize(part, ctx.manifest, world=world, run=run,
                                        run_comm=None if comm is None else comm[comm["rank"] == rank])
                 for rank, part in by_rank.items()]

    def plan_of(rank: int):
        return next((plan for r, _, _, plan in breakdown.step_plans(by_rank[rank])), None) if rank in by_rank else None

    return rank_lists.cap(reduce(summaries, ctx.manifest, source=source, files=files, run=run, nccl_tests=nccl_tests,
                                 plan_of=plan_of))


def split_ranks(events: EventTable) -> dict[int, EventTable]:
    """One EventTable per rank (in rank order), each with its own metadata."""
    ranks = events.column("rank")
    order = np.argsort(ranks, kind="stable")
    bounds = np.flatnonzero(np.diff(ranks[order])) + 1
    out = {}
    for idx in np.split(order, bounds) if len(order) else []:
        r = int(ranks[idx[0]])
        out[r] = EventTable(events.table.take(pa.array(idx)), {r: events.ranks.get(r, {})})
    for r in events.rank_ids:  # a rank whose trace holds no events still counts
        out.setdefault(r, EventTable(events.table.slice(0, 0), {r: events.ranks[r]}))
    return dict(sorted(out.items()))


def run_comm(run: str | Path | None) -> pd.DataFrame | None:
    """The collectors' communication table of a run directory, if it has one."""
    if run is None or not (Path(run) / run_dir.COMM).exists():
        return None
    return run_dir.read_table(run, run_dir.COMM).to_pandas()


def job_world(metas: dict[int, dict], manifest: dict | None) -> int | None:
    """The job's world size: the manifest's, else the largest a trace states."""
    return Manifest.of(manifest).raw.get("world_size") or max(
        (m.get("world_size") or 0 for m in metas.values()), default=0) or None


def reduce(summaries: list[rank_summary.RankSummary], manifest: dict | None, *, source: str, files: list[str],
           run: str | Path | None = None, nccl_tests: list[Table] | None = None,
           plan_of: Callable[[int], Any] = lambda rank: None,
           calls: collective_match.CallSpool | None = None) -> dict[str, Any]:
    """The report from every rank's summary (in any order).  ``plan_of``: rank -> its breakdown
    plan, asked for the few ranks named late (what they were doing while the others waited);
    ``calls``: the ranks' matchable calls, spooled as the summaries arrived (else taken from the
    summaries here)."""
    summaries = sorted(summaries, key=lambda s: s.rank)
    metas = {s.rank: s.meta for s in summaries}
    recorded = Manifest.of(manifest)
    step_s, tokens, step_source = _step_times(rank_summary.stacked([s.spans for s in summaries]), metas, run)
    device = next((m.get("device_name") for m in metas.values() if m.get("device_name")), None)
    device = device or recorded.device_name
    world = job_world(metas, manifest)
    leaves = rank_summary.stacked([s.leaves for s in summaries], ["rank", "step", "leaf", "seconds"])
    tree = breakdown.tree(leaves)
    rank_steps = breakdown.per_rank_step(leaves)
    rank_step_s = _rank_step_times(run)
    flops = mfu.compute(step_s, tokens, manifest, mfu.TraceShapes.merge([s.shapes for s in summaries]),
                        devices=world, rank_step_times=rank_step_s)
    strag, matrix = stragglers.find(rank_steps, recorded.stages)
    pp = recorded.pp
    microbatches = rank_summary.stacked([s.microbatches for s in summaries], timeline.MICROBATCH_COLUMNS)
    bub = bubbles.analyze(leaves, rank_steps, manifest, microbatches if pp > 1 else None)

    comm_counts = concat_frames([s.comm_counts for s in summaries], counters.COMM_COUNT_COLUMNS)
    calls_source = ("the collectors' communication table" if run is not None and (Path(run) / run_dir.COMM).exists()
                    else "the traces' communication work")
    counted_steps = sorted(int(s) for s in (leaves["step"] if not leaves.empty else comm_counts["step"]).unique()
                           if s >= 0)
    if calls is None:
        calls = collective_match.CallSpool(len(summaries))
        for s in summaries:
            calls.add(s.calls)
    steady = findings.steady(leaves)
    steady_tree = breakdown.tree(steady) if not steady.empty else None
    matched = calls.match(set(steady["step"]))

    step_time = float(step_s.mean()) if len(step_s) else None
    graphs = {k: sum(s.graphs[k] for s in summaries) for k in ("captures", "replays")}
    summary = {
        "mfu": flops["mfu"], "hfu": flops["hfu"], "mfu_note": flops["mfu_note"],
        "flops_source": flops["flops_source"], "peak_flops": flops["peak_flops"], "peak_source": flops["peak_source"],
        "step_time_s": step_time, "step_time_source": step_source,
        "step_time_p50_s": float(np.percentile(step_s, 50)) if len(step_s) else None,
        "step_time_p90_s": float(np.percentile(step_s, 90)) if len(step_s) else None,
        "tokens_per_s": flops["tokens_per_s"], "tflops_per_device": flops["tflops_per_device"],
        "device": device, "world_size": world, "steps": int(len(step_s)),
        # no trace window: the ranks the collectors timed
        "ranks": len(metas) or (int(rank_step_s["rank"].nunique()) if rank_step_s is not None else 0),
        "status": recorded.raw.get("status"),
        "cuda_graphs": graphs,
    }
    kernel_stats = concat_frames([s.kernels for s in summaries], kernel_time.KERNEL_STAT_COLUMNS)
    kernels = kernel_time.top_kernels(kernel_stats, n=20)
    launch = rank_summary.stacked([s.launch for s in summaries], kernel_time.LAUNCH_COLUMNS)
    found, summary["findings_note"] = _findings(steady, steady_tree, summaries, metas, bub, strag,
                                                launch.to_dict("records"), graphs, matched.late, plan_of, matched.moe)
    overlap = rank_summary.stacked([s.overlap for s in summaries], comm_stats.OVERLAP_COLUMNS)
    comm = comm_stats.summarize([s.comm_parts for s in summaries], comm_stats.Links.of(device, world, recorded.raw))
    if nccl_tests:
        compare(comm, nccl_tests)
    whole_run = health.analyze(run) if run is not None else None  # from the collectors' tables: runs only
    measured_memory = memory.section([s.memory for s in summaries])
    saves = checkpoints.analyze(run) if run is not None else None
    summary["goodput"] = saves["goodput"] if saves else None
    return new_report(
        source, files, summary, breakdown=tree, steady_breakdown=steady_tree, bubbles=[bub] if bub else [],
        **({"health": whole_run} if whole_run is not None else {}),
        **({"memory": measured_memory} if measured_memory is not None else {}),
        **({"checkpoints": saves} if saves is not None else {}),
        **({"moe": matched.moe} if matched.moe is not None else {}),
        comm=comm,
        stragglers=strag,
        kernels=[{"name": k.name, "kind": k.kind, "count": int(k.count), "total_s": k.total_ns / 1e9,
                  "mean_us": k.mean_ns / 1e3, "median_us": k.median_ns / 1e3, "share": float(k.share)}
                 for k in kernels.itertuples()],
        kernel_launch=launch.to_dict("records"),
        findings=found,
        per_step=flops["per_step"], per_rank_mfu=flops["per_rank"],
        comm_skew=matched.skew, clock_offsets=matched.offsets, comm_arrival=matched.arrival,
        comm_overlap=overlap.to_dict("records"),
        straggler_matrix=matrix.to_dict("records"),
        breakdown_by_rank=_by_rank(leaves),
        ranks=[s.row for s in summaries],
        comm_calls=_comm_calls([s.comm_ops for s in summaries]),
        counters=counters.per_step(concat_frames([s.counts for s in summaries], ["kind", "step", "count"]),
                                   comm_counts, counted_steps, flops, calls_source),
    )


def concat_frames(frames: list[pd.DataFrame], columns: list[str] | None = None) -> pd.DataFrame:
    """The rows of ``frames`` (empty ones left out, so dtypes stay those of the rows)."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=columns)
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)


def _findings(leaves: pd.DataFrame, tree: dict[str, Any] | None, summaries: list[rank_summary.RankSummary],
              metas: dict[int, dict], bub: dict | None, strag: list[dict], launch: list[dict], graphs: dict,
              late_keys: pd.DataFrame, plan_of: Callable[[int], Any],
              moe: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The findings on the steady steps (``leaves``: a rank's first left out when it has three or
    more; ``tree``: their breakdown), and why they cannot be judged, if they cannot."""
    if leaves.empty or tree is None:
        return [], None
    step_s = float(breakdown.per_rank_step(leaves)["step_s"].mean())
    pairs = leaves[["rank", "step"]].drop_duplicates()
    evidence = findings.merge_evidence([s.evidence for s in summaries], metas)
    late = findings.late_ranks(late_keys, plan_of, pairs, step_s)
    return (findings.derive(tree, bub, strag, step_s, launch, graphs, evidence, late, moe),
            findings.inconclusive(findings.leaf_seconds(tree), step_s, evidence))


def _step_times(spans: pd.DataFrame, metas: dict[int, dict], run) -> tuple[pd.Series, pd.Series | None, str | None]:
    rows = step_rows.read(run)
    if rows is not None and len(rows):
        kept, taken = step_rows.without_collectors(rows)
        g = kept.groupby("step")
        step_s, tokens = g["seconds"].max(), g["tokens"].max()
        source = "every step the collectors timed"
        if len(step_s) >= 3:
            step_s, tokens = step_s.iloc[1:], tokens.iloc[1:]
            source += ", the first (warm-up) left out"
        source += step_rows.left_out_text(taken)
        if len(step_s):
            return step_s, (tokens if tokens.notna().all() else None), source
    if spans.empty:
        return pd.Series(dtype=float), None, None
    sources = {m.get("steps_source") for m in metas.values()}
    unmarked = {DEVICE_SPAN: "the device span (first device activity to last), no step markers",
                WHOLE_TRACE: "the whole trace, no step markers"}
    return spans.groupby("step")["dur_ns"].max() / 1e9, None, (
        unmarked[next(iter(sources))] if len(sources) == 1 and sources <= set(unmarked)
        else "the traces' step markers")


def _rank_step_times(run) -> pd.DataFrame | None:
    """rank, step, seconds from the run's steps.parquet (the collectors' wall clock), less the
    steps the collectors' own work took over."""
    rows = step_rows.read(run)
    return None if rows is None else step_rows.without_collectors(rows)[0][["rank", "step", "seconds"]]


def _health_lines(health: dict[str, Any] | None) -> list[str]:
    """The run's slow episodes, costliest first, and the lowest rank scores (analyzers/health.py)."""
    if not health or not health.get("steps"):
        return []
    episodes = health["episodes"]
    theirs = len(health.get("collectors_steps") or [])
    lines = ["", f"health        {len(episodes) or 'no'} slow episode(s) in {health['steps']} steps "
                 "(every step the collectors timed" + (f", less {theirs} they spent writing" if theirs else "")
                 + (f"; baseline step {health['baseline_step_s'] * 1e3:.1f} ms)"
                    if health.get("baseline_step_s") else ")")]
    for e in episodes:
        span = f"steps {e['onset_step']}-{e['end_step']}" + (" (ongoing)" if e["ongoing"] else "")
        span += f" every {e['period']}" if e.get("period") else ""
        who = (", ".join(f"{g['dim']} group [{_ranks_text(g['ranks'])}]" for g in e["groups"][:3])
               if e.get("groups") else f"rank(s) {_ranks_text(e['ranks'])}")
        lines.append(f"  {span:<26} {e['class'].replace('_', '-'):<13} {who}: +{e['cost_per_step_s'] * 1e3:.1f} ms "
                     f"a slow step, {e['cost_s']:.2f} s in all -- {e['why']}")
    low = [r for r in health.get("rank_scores") or [] if min(r["individual"], r["relative"]) < 0.9][:4]
    if low:
        lines.append("  lowest rank scores (1 = its best / the best rank's busy time): " + "; ".join(
            f"rank {r['rank']} individual {r['individual']:.2f} relative {r['relative']:.2f}" for r in low))
    return lines


def _ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)})" if len(ranks) > 8 else "")


def _by_rank(leaves: pd.DataFrame) -> list[dict[str, Any]]:
    if leaves.empty:
        return []
    n = leaves.groupby("rank")["step"].nunique()
    g = leaves.groupby(["rank", "leaf"])["seconds"].sum().reset_index()
    g["seconds"] = g["seconds"] / g["rank"].map(n)
    return g.to_dict("records")


def _comm_calls(parts: list[pd.DataFrame]) -> list[dict[str, Any]]:
    """Communication per (dimension, op) of the labelled call regions on the training thread
    (``mfuscope.comm/<dim>/<op>``), summed over the ranks' :attr:`RankSummary.comm_ops`."""
    df = concat_frames(parts)
    if df.empty:
        return []
    g = df.groupby(["dim", "op"])[["count", "total_ns", "bytes"]].sum().reset_index()
    return [{"dim": r.dim, "op": r.op, "count": int(r.count), "total_s": r.total_ns / 1e9, "bytes": int(r.bytes)}
            for r in g.itertuples()]


def format_text(report: dict[str, Any]) -> str:
    s = report["summary"]
    ms = lambda v: f"{v * 1e3:.1f} ms" if v is not None else "-"  # noqa: E731
    lines = [
        f"device        {s.get('device') or 'unknown'}   ranks {s['ranks']} of world size {s.get('world_size') or '?'}"
        + (f"   run {s['status']}" if s.get("status") else ""),
        f"steps         {s['steps']}   step time mean {ms(s['step_time_s'])}   p50 {ms(s.get('step_time_p50_s'))}"
        f"   p90 {ms(s.get('step_time_p90_s'))}   (the slowest rank's, {s.get('step_time_source') or 'step markers'})",
        f"MFU           {_pct(s['mfu'])}   HFU {_pct(s['hfu'])}"
        + (f"   tokens/s {s['tokens_per_s']:,.0f}" if s.get("tokens_per_s") else "")
        + (f"   ({s['mfu_note']})" if s.get("mfu_note") else ""),
    ]
    graphs = s.get("cuda_graphs") or {}
    if graphs.get("captures") or graphs.get("replays"):
        lines.append(f"CUDA graphs   {graphs['captures']} capture call(s), {graphs['replays']} replay(s) in the traced "
                     "steps" + ("; the device idles while graphs are captured, so no host-overhead finding is made"
                                if graphs["captures"] else ""))
    if s.get("peak_source"):
        lines.append(f"peak          {s['peak_flops'] / 1e12:.3g} TFLOP/s per device ({s['peak_source']})")
    lines += _health_lines(report.get("health"))
    lines += memory.text_lines(report.get("memory"))
    lines += checkpoints.text_lines(report.get("checkpoints"))
    tree = report.get("breakdown")
    if tree and tree["seconds"]:
        lines += ["", f"where a step's time went (each rank's own step markers, mean of ranks and traced steps, "
                      f"{ms(tree['seconds'])}):"]
        for c in tree["children"]:
            lines.append(f"  {c['name']:<28} {c['seconds'] * 1e3:9.1f} ms  {c['seconds'] / tree['seconds']:6.1%}")
            for g in c["children"][:4]:
                if g["name"] != c["name"]:
                    lines.append(f"    {g['name']:<26} {g['seconds'] * 1e3:9.1f} ms  "
                                 f"{g['seconds'] / tree['seconds']:6.1%}")
    for b in report.get("bubbles") or []:
        lines.append(f"pipeline      bubble {b['bubble_fraction']:.1%} of the pipeline's time (theory "
                     f"{b['theory_fraction']:.1%}: {b['theory_formula']}, {b['schedule'] or 'schedule unknown'} "
                     f"p={b['stages']} m={b['microbatches']} v={b['virtual_stages']}); {b['share_of_step']:.1%} "
                     f"of the step; stage imbalance {b['imbalance']:.1%}")
    if report.get("stragglers"):
        lines.append("stragglers    " + ", ".join(f"rank {x['rank']} (+{x['cost_s'] * 1e3:.1f} ms/step)"
                                              for x in report["stragglers"]))
    if report.get("comm"):
        lines += _comm_lines(report["comm"])
    if s.get("findings_note"):
        lines += ["", f"no per-step finding: {s['findings_note']}"]
    per_step = [f for f in report.get("findings") or [] if f.get("per_step", True)]
    if per_step:
        lines += ["", "top findings (what-if gain per step: the cause's time on each rank's timeline):"]
        for f in per_step[:5]:
            lines.append(f"  {f['gain_s'] * 1e3:8.1f} ms  {f['gain_fraction']:6.1%}  {f['title']}  [fix: {f['fix']}]")
    elif not s.get("findings_note") and report.get("breakdown"):
        lines += ["", "top findings: none (no cause reaches its threshold; docs/analyzers.md lists them)"]
    for f in report.get("findings") or []:
        if not f.get("per_step", True):
            lines.append(f"  {f['title']}  [{f['fix']}]")
    if report.get("kernels"):
        lines += ["", "top kernels (all ranks):"]
        for k in report["kernels"][:5]:
            lines.append(f"  {k['share']:6.1%} {k['total_s'] * 1e3:10.3f} ms {k['count']:>7}x  {k['name'][:90]}")
    return "\n".join(lines)


def _comm_lines(comm: list[dict[str, Any]]) -> list[str]:
    """The communication table; with the link's and nccl-tests' figures when the rows have them, and a
    line for each row far below its link."""
    link = any(c.get("busbw_of_attainable") is not None for c in comm)
    nccl = any(c.get("busbw_of_nccl_tests") is not None for c in comm)
    lines = ["", f"communication  {'dim':<12} {'op':<15} {'size':<11} {'calls':>7} {'total ms':>10} "
                 f"{'exposed ms':>11} {'busbw GB/s':>11}" + (f" {'of link':>9}" if link else "")
             + (f" {'of nccl-tests':>13}" if nccl else "")]
    for c in comm[:8]:
        exposed = f"{c['exposed_s'] * 1e3:11.1f}" if c["exposed_s"] is not None else f"{'-':>11}"
        bw = f"{c['busbw_gbps']:11.3f}" if c["busbw_gbps"] is not None else f"{'-':>11}"
        share, ref = c.get("busbw_of_attainable"), c.get("busbw_of_nccl_tests")
        lines.append(f"               {c['dim']:<12} {c['op']:<15} {c['size']:<11} {c['count']:>7} "
                     f"{c['total_s'] * 1e3:10.1f} {exposed} {bw}"
                     + ((f" {share:8.1%}" + ("!" if c.get("flag") else " ") if share is not None else f" {'-':>9}")
                        if link else "")
                     + ((f" {ref:13.1%}" if ref is not None else f" {'-':>13}") if nccl else ""))
    for c in comm:
        if c.get("flag"):
            lines.append(f"  ! {c['dim']}/{c['op']} {c['size']}: bus bandwidth {c['link_note']}; "
                         f"{c['tier']}: {c['tier_source']}")
    used = {(c["nccl_tests_file"], c["nccl_tests_test"], c["nccl_tests_ranks"]) for c in comm
            if c.get("nccl_tests_file")}
    for path, test, ranks in sorted(used, key=str):
        lines.append(f"  of nccl-tests: achieved bus bandwidth over {test}'s at the same message size "
                     f"({path}{f', {ranks} ranks' if ranks else ''})")
    return lines


def _pct(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" if v >= 0.01 or v == 0 else f"{v * 100:.2g}%"  # tiny CPU-run MFUs keep two digits
