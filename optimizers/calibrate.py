"""Fit the profile's numbers to measured runs, and score predictions honestly.

The fit minimises the mean absolute log error of predicted against measured
tokens/s per GPU (symmetric: 2x too fast costs what 2x too slow does) by
coordinate search: each number in turn tries a log-spaced grid inside its
bounds around the current value, keeps the best, and the grid narrows each
round.  Five numbers for the whole table -- the degrees of freedom are the
profile's fields (``Profile.FITTED``; four where no row runs flash attention,
which then takes the GEMMs' fraction), never one per row.

``leave_one_source_out`` is the honest figure: fit on every source but one,
predict the one left out.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

from .measured import MeasuredRun
from .model import predict
from .published import Case
from .system import Profile


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
                trial = replace(best, **{name: value})
                err = log_error(cases, trial)
                if err < best_err - 1e-12:
                    best, best_err = trial, err
        if progress:
            progress(f"round {r + 1}/{rounds}: mean |log error| {best_err:.4f}")
        span = math.sqrt(span)
    provenance = {"source": "fit", "cases": len(cases), "mean_abs_log_error": best_err,
                  "degrees_of_freedom": len(fields), "fields": list(fields)}
    if tied:
        best = replace(best, attention=best.gemm)
        provenance["tied"] = {"attention": "gemm (no case runs flash attention)"}
    return replace(best, provenance=provenance)


def leave_one_source_out(cases: list[Case], **fit_args) -> dict[str, dict[str, float]]:
    """Per source: MAPE when fitted on all the other sources (held out) and on all (in sample)."""
    measured = [c for c in cases if c.measured_tps]
    sources = sorted({c.source for c in measured})
    everything = fit(measured, **fit_args)
    out = {}
    for held in sources:
        rest = [c for c in measured if c.source != held]
        here = [c for c in measured if c.source == held]
        profile = fit(rest, **fit_args)
        out[held] = {"rows": len(here), "held_out_mape": mape(here, profile),
                     "in_sample_mape": mape(here, everything)}
    return out


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
    """The profile that reproduces one measured run, group by group (see :func:`groups`).

    Compute is one number (``gemm``, with ``memory`` and ``attention``) fitted to the measured
    compute; where compute time is known (paced runs) the host time per microbatch is fitted
    instead, to what the run spent beyond its paced time.  Links are fitted where the run
    exposes communication.  A first guess comes from the ratio of predicted to measured time, so
    a CPU run, whose tiny GEMMs reach a ten-thousandth of the matmul peak, starts near its answer."""
    profile = start or Profile()
    prediction = run.predict(profile)
    pred, meas = groups(prediction.leaves), groups(run.leaves)
    fields: list[str] = []
    keys: set[str] = set()
    if run.known_phases is not None:
        passes = 2 * run.layout.microbatches * run.layout.vpp
        slots = 2 * (run.layout.microbatches * run.layout.vpp + run.layout.pp - 1)
        gap = max(run.step_s - prediction.step_s, 0.0)
        profile = replace(profile, microbatch_overhead_s=max(gap / max(slots, passes), 1e-6))
        fields.append("microbatch_overhead_s")
        keys |= {"step", "bubble"}
    elif meas.get("compute") and pred.get("compute"):
        ratio = pred["compute"] / meas["compute"]
        profile = replace(profile, gemm=profile.gemm * ratio, memory=profile.memory * ratio,
                          attention=profile.attention * ratio)
        fields += ["gemm", "memory", "attention"]
        keys.add("compute")
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
