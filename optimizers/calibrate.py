"""Fit the profile's numbers to measured runs, and score predictions honestly.

The fit minimises the mean absolute log error of predicted against measured
tokens/s per GPU (symmetric: 2x too fast costs what 2x too slow does) by
coordinate search: each number in turn tries a log-spaced grid inside its
bounds around the current value, keeps the best, and the grid narrows each
round.  Four numbers for the whole table -- the degrees of freedom are the
profile's fields (``Profile.FITTED``; three where no row runs flash attention,
which then takes the GEMMs' fraction), never one per row.

``leave_one_source_out`` is the honest figure: fit on every source but one,
predict the one left out.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import NamedTuple

from .cost.comm import bus_factor, placements
from .measured import MeasuredRun
from .model import dtensor_params, fsdp_hook_calls, predict
from .published import Case
from .system import Profile, default_profile


def predicted_tps(case: Case, profile: Profile) -> float:
    return predict(case.model, case.layout, case.training, case.system, profile).tokens_per_s_per_gpu


def log_error(cases: list[Case], profile: Profile) -> float:
    errs = [abs(math.log(predicted_tps(c, profile) / c.measured_tps)) for c in cases]
    return sum(errs) / len(errs)


def mape(cases: Iterable[Case], profile: Profile) -> float | None:
    errs = [abs(predicted_tps(c, profile) / c.measured_tps - 1) for c in cases if c.measured_tps]
    return sum(errs) / len(errs) if errs else None


def fit(cases: list[Case], start: Profile | None = None, rounds: int = 6, grid: int = 9,
        fields: tuple[str, ...] = Profile.FITTED, progress: Callable[[str], None] | None = None) -> Profile:
    """The profile that best predicts ``cases`` (those with a measurement)."""
    cases = [c for c in cases if c.measured_tps]
    if not cases:
        raise ValueError("no case has a measured throughput to fit")
    # Rows without flash attention cannot tell its rate: it then takes the GEMMs' fraction of
    # their benchmark (both are tensor-core kernels measured alone), not a bound of the search.
    tied = "attention" in fields and not any(c.training.flash_attention for c in cases)
    fields = tuple(f for f in fields if not (tied and f == "attention"))
    best = start or Profile()
    best = replace(best, optimizer=best.memory)
    best_err = log_error(cases, best)
    span = 4.0  # the first grid spans value / 4 .. value x 4
    for r in range(rounds):
        for name in fields:
            lo, hi = Profile.BOUNDS[name]
            now = getattr(best, name)
            if name == "overlap_slowdown":  # can be zero: search linearly
                values = [min(hi, max(lo, now + (k / (grid - 1) - 0.5) * (hi - lo) / (r + 1))) for k in range(grid)]
            else:
                values = [min(hi, max(lo, now * span ** (2 * k / (grid - 1) - 1))) for k in range(grid)]
            for value in values:
                # published throughput cannot separate the optimizer step from the other
                # memory-bound kernels: it moves with them
                trial = replace(best, **{name: value}, **({"optimizer": value} if name == "memory" else {}))
                err = log_error(cases, trial)
                if err < best_err - 1e-12:
                    best, best_err = trial, err
        if progress:
            progress(f"round {r + 1}/{rounds}: mean |log error| {best_err:.4f}")
        span = math.sqrt(span)
    provenance = {"source": "fit", "cases": len(cases), "mean_abs_log_error": best_err,
                  "degrees_of_freedom": len(fields), "fields": list(fields)}
    provenance["tied"] = {"optimizer": "memory (published throughput cannot tell them apart)"}
    if tied:
        best = replace(best, attention=best.gemm)
        provenance["tied"]["attention"] = "gemm (no case runs flash attention)"
    return replace(best, provenance=provenance)


def leave_one_source_out(cases: list[Case], **fit_args) -> dict[str, dict[str, float]]:
    """Per source: MAPE when fitted on all the other sources (held out) and on all (in sample)."""
    return leave_one_source_out_by_family(cases, **fit_args).sources


def families(case: Case) -> tuple[str, str, str]:
    """The families a row is reported under: dense or MoE, its number format, its device's
    generation (Ampere, Hopper, Blackwell, ...)."""
    generation = {"A100": "Ampere", "V100": "Volta", "MI300X": "CDNA3"}.get(case.system.key)
    if generation is None:
        generation = "Blackwell" if "B" in case.system.key else "Hopper"
    return ("moe" if case.model.n_experts else "dense", "fp8" if case.training.dtype == "fp8" else "bf16",
            generation)


class HeldOut(NamedTuple):
    """What leave-one-source-out scoring found: MAPE per source and per family (held out and in
    sample), and each row's held-out prediction -- which rows make a source's error.  Rows of one
    source alone have nothing to be held out from: their held-out figures are None, no row listed."""
    sources: dict[str, dict[str, float | None]]
    families: dict[str, dict[str, float | None]]
    rows: list[tuple[Case, float]]  # (row, tokens/s per GPU predicted by the fit without its source)


def leave_one_source_out_by_family(cases: list[Case], **fit_args) -> HeldOut:
    """Each row predicted by the fit on the sources other than its own, then the errors grouped by
    source and by each of :func:`families`."""
    measured = [c for c in cases if c.measured_tps]
    sources = sorted({c.source for c in measured})
    everything = fit(measured, **fit_args)
    out, errors, rows = {}, [], []  # errors: (case, held-out error or None, in-sample error)
    for held in sources:
        here = [c for c in measured if c.source == held]
        others = [c for c in measured if c.source != held]
        profile = fit(others, **fit_args) if others else None
        predicted = [predicted_tps(c, profile) if profile else None for c in here]
        rows += [(c, p) for c, p in zip(here, predicted) if p is not None]
        held_errors = [None if p is None else abs(p / c.measured_tps - 1) for c, p in zip(here, predicted)]
        errors += [(c, h, abs(predicted_tps(c, everything) / c.measured_tps - 1)) for c, h in zip(here, held_errors)]
        out[held] = {"rows": len(here), "held_out_mape": _mean(held_errors), "in_sample_mape": mape(here, everything)}
    by_family: dict[str, dict[str, float | None]] = {}
    for tag in sorted({t for c, _, _ in errors for t in families(c)}):
        mine = [(h, i) for c, h, i in errors if tag in families(c)]
        by_family[tag] = {"rows": len(mine), "held_out_mape": _mean(h for h, _ in mine),
                          "in_sample_mape": _mean(i for _, i in mine)}
    return HeldOut(out, by_family, rows)


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean, or None where any value is missing (a row with no held-out prediction)."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values) / len(values)


def groups(leaves: dict[str, float]) -> dict[str, float]:
    """Leaves summed to what one run can pin down: all compute, each dimension's exposed
    communication, the bubble."""
    out: dict[str, float] = {}
    for leaf, seconds in leaves.items():
        parts = leaf.split("/")
        key = "compute" if parts[0] == "compute" else "/".join(parts[:2]) if parts[0] == "comm" else parts[0]
        out[key] = out.get(key, 0.0) + seconds
    return out


def run_error(run: MeasuredRun, profile: Profile, keys: set[str]) -> float:
    """Mean |log| error over ``keys`` -- groups (see :func:`groups`) or "step" -- that the run
    measured above 1% of its step; "comm" stands for every dimension's group."""
    prediction = run.predict(profile)
    pred, meas = groups(prediction.leaves), groups(run.leaves)
    pred["step"], meas["step"] = prediction.step_s, run.step_s
    floor = 0.01 * run.step_s
    errs = [abs(math.log(pred[k] / meas[k])) for k in meas
            if (k in keys or ("comm" in keys and k.startswith("comm/"))) and meas[k] >= floor
            and pred.get(k, 0) > 0]
    return sum(errs) / len(errs) if errs else 0.0


def fit_run(run: MeasuredRun, start: Profile | None = None) -> Profile:
    """The profile that reproduces one measured run: an unpaced run group by group as
    :func:`fit_runs` fits several; a paced run (its compute known) as below.

    A paced run's compute is known: the host time per microbatch is fitted to what the run spent
    beyond its paced time, and the links where the run exposes communication, starting from their
    ratio of predicted to measured time.  Both start from the published profile (or ``start``), as
    ``plan``, ``predict`` and the CI gate do."""
    if run.known_phases is None:
        return fit_runs([run], start)
    profile = start or default_profile()
    prediction = run.predict(profile)
    pred, meas = groups(prediction.leaves), groups(run.leaves)
    fields: list[str] = []
    keys: set[str] = set()
    passes = 2 * run.layout.microbatches * run.layout.vpp
    slots = 2 * (run.layout.microbatches * run.layout.vpp + run.layout.pp - 1)
    gap = max(run.step_s - prediction.step_s, 0.0)
    profile = replace(profile, microbatch_overhead_s=max(gap / max(slots, passes), 1e-6))
    fields.append("microbatch_overhead_s")
    keys |= {"step", "bubble"}
    comm_pred = sum(v for k, v in pred.items() if k.startswith("comm/"))
    comm_meas = sum(v for k, v in meas.items() if k.startswith("comm/"))
    if comm_pred > 0 and comm_meas > 0.01 * run.step_s:
        ratio = comm_pred / comm_meas
        profile = replace(profile, scale_up=profile.scale_up * ratio, scale_out=profile.scale_out * ratio,
                          latency_scale=profile.latency_scale / ratio)
        fields += ["scale_up", "scale_out", "latency_scale"]
        keys |= {"comm", "bubble"}
    best, best_err = profile, run_error(run, profile, keys)
    span = 8.0
    for _ in range(6):
        for name in fields:
            for k in range(9):
                trial = replace(best, **{name: getattr(best, name) * span ** (k / 4 - 1)})
                err = run_error(run, trial, keys)
                if err < best_err - 1e-12:
                    best, best_err = trial, err
        span = math.sqrt(span)
    return replace(best, provenance={"source": str(run.path), "fields": fields, "degrees_of_freedom": len(fields),
                                     "mean_abs_log_error": best_err, "device": run.system.key})


#: The compute leaves whose speed one profile number sets, each its own group.
RATES = {"gemm": "compute/gemm", "attention": "compute/attention", "memory": "compute/norm_elementwise",
         "optimizer": "compute/optimizer"}
#: Where the host's own time shows on a run's timeline: what runs on the host between kernels (on a
#: CPU every gap between operators), the device waiting on launches.  The model books its host time
#: per pass (``microbatch_overhead_s``) as ``compute/other``.
HOST = ("compute/other", "idle", "host_bound")
#: Each dimension's collectives, the leaves ``comm/<dim>/...`` (the data dimensions share ``dp``).
LINK_DIMS = ("tp", "cp", "dp", "ep", "pp")


def _passes(run: MeasuredRun) -> float:
    """Forward and backward passes of the busiest rank's chunks in one step: what the host's time
    per pass (``microbatch_overhead_s``) is paid per."""
    return 2.0 * run.layout.microbatches * run.layout.vpp


def run_tensors(run: MeasuredRun) -> float:
    """Parameter tensors the busiest rank's optimizer updates (``ModelSpec.parameter_tensors``)."""
    return run.model.parameter_tensors(run.layout.stage_layers(run.model), first=run.layout.pp == 1)


def _layer_passes(run: MeasuredRun) -> float:
    """Layers times passes of the busiest rank in one step: what host time per layer is paid per."""
    return _passes(run) * run.layout.stage_layers(run.model) / run.layout.vpp


def _hook_calls(run: MeasuredRun) -> float:
    """FSDP's hook calls on the busiest rank in one step (none without sharded parameters)."""
    return fsdp_hook_calls(run.model, run.layout, run.training)


def fit_runs(runs: Iterable[MeasuredRun], start: Profile | None = None, rounds: int = 12,
             progress: Callable[[str], None] | None = None) -> Profile:
    """The profile that reproduces several measured runs at once, group by group, starting from the
    published profile (or ``start``).

    Each group of leaves has its own number, fitted to what the runs measured there in all: GEMMs
    (``gemm``), the attention core (``attention``), elementwise work (``memory``), the optimizer step
    (``optimizer``), the host's time per layer and pass (``layer_overhead_s``, from the host
    leaves :data:`HOST`) and each dimension's collectives (``link_<dim>``).  A rate scales by predicted /
    measured time of its group summed over the runs (time is work over rate), the host time by the
    unexplained host seconds per layer and pass; rounds repeat it until the groups' interplay (overlap,
    pipeline bubbles) settles.  Before the rounds each link tier's latency and bandwidth are fitted
    to every collective the runs timed (:func:`fit_link_tiers`); a dimension's own factor then
    takes up what its exposed time says beyond that, and a dimension no run exposes runs at the
    tier's fit.  Paced runs (compute known) inform only the host and link groups.  Measured leaves
    are scaled to the median step
    (:meth:`MeasuredRun.typical_leaves`)."""
    runs = list(runs)
    if not runs:
        raise ValueError("no run to fit")
    profile = start or default_profile()
    measured = [r.typical_leaves() for r in runs]
    fitted: set[str] = set()

    def floor(which: list[int]) -> float:
        """What a group must measure in runs ``which`` to be fitted there: 1% of their steps.  Held
        against those runs' steps alone -- a slow run the group is not fitted on (a tensor-parallel
        run's tail on a loaded host) must not lift the bar out of the one-rank run's reach."""
        return 0.01 * sum(runs[i].typical_step_s for i in which)

    def total(leaves_list, names: tuple[str, ...], which: list[int]) -> float:
        """Seconds of the leaves named (or under the names) in runs ``which``."""
        return sum(v for i in which for k, v in leaves_list[i].items()
                   if any(k == n or k.startswith(n + "/") for n in names))

    profile, tiers = fit_link_tiers(runs, profile)
    # A tensor-parallel run's operators carry DTensor's dispatch inside their time: the rates and the
    # host time are fitted on the runs without tp where there are any, and what a tp run spends
    # beyond them is tp's own host term (tp_overhead_s), what its sharded optimizer spends beyond
    # them per parameter tensor dtensor_param_s.  Paced runs (compute known) fit no rate.
    everyone = list(range(len(runs)))
    plain = [i for i in everyone if runs[i].layout.tp == 1]
    unpaced = [i for i in everyone if runs[i].known_phases is None]
    has_plain = any(i in unpaced for i in plain)
    rate_runs = [i for i in unpaced if i in plain] if has_plain else unpaced
    host_runs = plain if has_plain else everyone
    tp_runs = [i for i in everyone if i not in plain] if has_plain else []
    sharded = [i for i in unpaced if dtensor_params(runs[i].layout)] if has_plain else []
    # FSDP's hooks are host time too: where some of those runs shard their parameters and some do
    # not, the host time per layer is fitted on the others and what a sharding run's host leaves
    # hold beyond it is FSDP's, per unit and collective, in layer passes (fsdp_hook_layer_passes).
    # Elsewhere the hooks are booked at the profile's layer passes, which the per-layer time scales.
    unsharded = [i for i in host_runs if runs[i].layout.shard_ranks == 1]
    fsdp_runs = [i for i in host_runs if i not in unsharded] if has_plain and unsharded else []
    layer_runs = unsharded if fsdp_runs else host_runs
    if fsdp_runs:  # the rates too: a sharding run's operators interleave with FSDP's copies and hooks
        rate_runs = [i for i in rate_runs if i in unsharded] or rate_runs
    for r in range(rounds):
        predicted = [run.predict(profile).leaves for run in runs]
        changes: dict[str, float] = {}
        for name, leaf in RATES.items():
            meas, pred = total(measured, (leaf,), rate_runs), total(predicted, (leaf,), rate_runs)
            if meas > floor(rate_runs) and pred > 0:
                changes[name] = getattr(profile, name) * pred / meas
        meas_host, pred_host = total(measured, HOST, layer_runs), total(predicted, HOST, layer_runs)
        if meas_host > floor(layer_runs) or profile.layer_overhead_s > 0:
            # per layer pass of host time, each run pays its layer passes and its FSDP hooks' share
            layer_passes = sum(_layer_passes(runs[i]) + profile.fsdp_hook_layer_passes * _hook_calls(runs[i])
                               for i in layer_runs)
            changes["layer_overhead_s"] = max(0.0, profile.layer_overhead_s + (meas_host - pred_host) / layer_passes)
        if fsdp_runs and profile.layer_overhead_s > 0:
            gap = total(measured, HOST, fsdp_runs) - total(predicted, HOST, fsdp_runs)
            calls = sum(_hook_calls(runs[i]) for i in fsdp_runs)
            changes["fsdp_hook_layer_passes"] = max(
                0.0, profile.fsdp_hook_layer_passes + gap / calls / profile.layer_overhead_s)
        if sharded:
            meas = total(measured, ("compute/optimizer",), sharded)
            pred = total(predicted, ("compute/optimizer",), sharded)
            tensors = sum(run_tensors(runs[i]) for i in sharded)
            changes["dtensor_param_s"] = max(0.0, profile.dtensor_param_s + (meas - pred) / tensors)
        if tp_runs:
            gap = sum(runs[i].typical_step_s - sum(predicted[i].values()) for i in tp_runs)
            layer_passes = sum(_layer_passes(runs[i]) for i in tp_runs)
            changes["tp_overhead_s"] = max(0.0, profile.tp_overhead_s + gap / layer_passes)
        links = {}
        for dim in LINK_DIMS:
            meas, pred = total(measured, (f"comm/{dim}",), everyone), total(predicted, (f"comm/{dim}",), everyone)
            if meas > floor(everyone) and pred > 0:
                links[f"link_{dim}"] = getattr(profile, f"link_{dim}") * pred / meas
        changes.update(links)
        fitted |= set(changes) | tiers
        profile = replace(profile, **changes)
        if progress:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(f"{k}={v:.4g}" for k, v in changes.items()))
    errors = [abs(math.log(run.predict(profile).step_s / run.typical_step_s)) for run in runs]
    fields = [f for f in Profile.FIELDS if f in fitted]
    return replace(profile, provenance={
        "source": ", ".join(str(run.path) for run in runs), "runs": [str(run.path) for run in runs],
        "fields": fields, "degrees_of_freedom": len(fields),
        "start": (start or default_profile()).provenance.get("source"),
        "mean_abs_log_error": sum(errors) / len(errors), "device": runs[0].system.key})


#: A collective's op as the model's alpha-beta knows it (the report's names for a pipeline's
#: point-to-point calls vary with how they were issued).
_OPS = {"send": "send_recv", "recv": "send_recv", "send_recv": "send_recv", "all_reduce": "all_reduce",
        "all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}


def fit_link_tiers(runs: list[MeasuredRun], profile: Profile) -> tuple[Profile, set[str]]:
    """Each link tier's latency (``latency_scale``) and achieved bandwidth (``scale_up`` /
    ``scale_out``) fitted to the collectives the runs timed (their reports' ``comm`` tables): every
    call's mean duration is ``a x latency steps x the tier's latency + size x bus factor / (the
    tier's bandwidth x efficiency)``, linear in ``a`` and ``1 / efficiency``; weighted least squares
    over the calls (a group of identical calls weighs its count).  Latency-bound small calls (a
    tensor-parallel norm's gradient) and bandwidth-bound large ones (FSDP's gathers) pin down one
    number each, which a ratio of exposed time cannot separate.  Returns the profile and the names
    it fitted; a tier whose calls cannot separate the two (all of one size, or a solve below zero)
    keeps its latency and fits its bandwidth alone."""
    rows: dict[str, list[tuple[float, float, float, float]]] = {}
    for run in runs:
        place = placements(run.layout, run.system.gpus_per_node)
        for c in run.collectives:
            op = _OPS.get(c.op)
            if op is None or c.group_size < 2:
                continue
            dim = "dp" if c.dim.startswith("dp") or c.dim not in place else c.dim
            tier_name = place[dim].tier
            tier = getattr(run.system, tier_name)
            op = tier.runs_as(op)
            steps = 1 if op == "send_recv" else math.ceil(math.log2(c.group_size)) * (2 if op == "all_reduce" else 1)
            rows.setdefault(tier_name, []).append((c.calls, steps * tier.latency_s,
                                                   c.bytes * bus_factor(op, c.group_size) / tier.bandwidth_Bps,
                                                   c.seconds))
    changes: dict[str, float] = {}
    for tier_name, data in rows.items():
        w = [r[0] for r in data]
        x1, x2, y = [r[1] for r in data], [r[2] for r in data], [r[3] for r in data]
        s11 = sum(wi * a * a for wi, a in zip(w, x1))
        s22 = sum(wi * b * b for wi, b in zip(w, x2))
        s12 = sum(wi * a * b for wi, a, b in zip(w, x1, x2))
        s1y = sum(wi * a * t for wi, a, t in zip(w, x1, y))
        s2y = sum(wi * b * t for wi, b, t in zip(w, x2, y))
        det = s11 * s22 - s12 * s12
        lat, inv_eff = (None, None)
        if det > 1e-12 * s11 * s22:
            lat, inv_eff = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if lat is not None and lat > 0 and inv_eff > 0:
            changes["latency_scale"] = lat
        else:
            # sizes too alike to separate the two, or noise pushed one below zero (a loaded host's
            # large calls waiting on the peer longer than its small ones): bandwidth only, at the
            # latency the profile has -- and the latency is not reported as fitted
            lat = changes.get("latency_scale", profile.latency_scale)
            inv_eff = max(s2y - lat * s12, 1e-30) / s22 if s22 > 0 else None
        if inv_eff:
            changes[tier_name] = 1.0 / inv_eff
    return replace(profile, **changes), set(changes)
