"""What ``mfuscope predict``, ``calibrate`` and ``plan`` (and ``analyze --predict``) do and print.

The CLI parses flags and calls these; each returns the exit code.  Output is
plain text for people, ``--json`` for tools; files are written atomically.
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from mfuscope import run_dir
from mfuscope.atomic import write_bytes
from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest

from . import calibrate as calib
from . import measured, planner, presets, published, run_prediction
from .model import Prediction, predict
from .spec import ATTENTION_KERNELS, CP_COMMS, FP8_RECIPES, FP8_SCOPES, Training
from .system import MICROSCALING, Profile, default_profile, system

#: ``calibrate`` on published rows prints this many of the rows its held-out fits predict worst.
WORST_ROWS = 8
PREDICTED = ("predicted_step_time_s", "predicted_tokens_per_s_per_gpu", "predicted_mfu",
             "predicted_memory_gib_per_gpu", "fits_memory", "predicted_breakdown", "prediction_error")


def _profile(hardware: Path | None, device: str | None = None) -> Profile:
    profile = Profile.load(hardware) if hardware else default_profile()
    fitted_on = profile.provenance.get("device")
    if device and fitted_on and fitted_on != device:
        _err(f"mfuscope: warning: {hardware} was fitted on a {fitted_on} run; its efficiencies may not hold on "
             f"{device}")
    return profile


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- predict

def predict_csv(path: Path, out: Path | None, hardware: Path | None) -> int:
    rows = published.read_rows(path)
    profile = _profile(hardware)
    errors: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        try:
            case = published.case(i, row)
            p = predict(case.model, case.layout, case.training, case.system, profile)
        except (ValueError, UserInputError) as e:
            row.update({k: "" for k in PREDICTED}, prediction_error=str(e))
            continue
        row.update(predicted_step_time_s=f"{p.step_s:.6g}",
                   predicted_tokens_per_s_per_gpu=f"{p.tokens_per_s_per_gpu:.6g}",
                   predicted_mfu=f"{p.mfu:.4f}" if p.mfu is not None else "",
                   predicted_memory_gib_per_gpu=f"{p.memory.total_bytes / 2**30:.2f}",
                   fits_memory="" if p.memory.fits is None else str(p.memory.fits).lower(),
                   predicted_breakdown=json.dumps(p.tree, separators=(",", ":")), prediction_error="")
        if case.measured_tps:
            errors.setdefault(case.source, []).append(abs(p.tokens_per_s_per_gpu / case.measured_tps - 1))
    out = out or path.with_name(path.stem + ".predicted.csv")
    if out.resolve() == path.resolve():
        raise UserInputError("--out would overwrite the input; choose another file", out)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0].keys()) + [k for k in PREDICTED if k not in rows[0]])
    writer.writeheader()
    writer.writerows(rows)
    write_bytes(out, buf.getvalue().encode())
    skipped = sum(1 for r in rows if r["prediction_error"])
    print(f"profile: {profile.provenance.get('source', '?')}")
    print(f"{len(rows) - skipped} of {len(rows)} rows predicted; {skipped} not modelled (reason in prediction_error)")
    print(_mape_table(errors))
    print(f"written to {out}")
    return 0


def _mape_table(errors: dict[str, list[float]]) -> str:
    if not errors:
        return "no row has measured_tokens_per_s_per_gpu: nothing to score"
    lines = [f"{'source':<14} {'rows':>5} {'MAPE (tokens/s/GPU)':>20}"]
    for source, errs in sorted(errors.items()):
        lines.append(f"{source:<14} {len(errs):>5} {sum(errs) / len(errs):>20.1%}")
    every = [e for errs in errors.values() for e in errs]
    lines.append(f"{'overall':<14} {len(every):>5} {sum(every) / len(every):>20.1%}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- calibrate

def calibrate(sources: list[Path] | Path, out: Path | None, as_json: bool) -> int:
    """CSVs of published runs (their rows together), or run directories fitted at once
    (:func:`calib.fit_runs`)."""
    sources = [sources] if isinstance(sources, Path) else list(sources)
    out = out or Path("hw.json")
    if any(s.suffix == ".csv" for s in sources):
        if not all(s.suffix == ".csv" for s in sources):
            raise UserInputError("give CSVs of published runs, or run directories, not both", sources[0])
        result = _calibrate_published(sources)
        profile = result.pop("profile")
        fitted = []
    else:
        runs = [measured.load(s) for s in sources]
        devices = {r.system.key for r in runs}
        if len(devices) > 1:
            raise UserInputError(f"the runs ran on different devices ({', '.join(sorted(devices))}): calibrate each "
                                 "device's runs on their own", sources[0])
        peak = measured.host_peak(runs) if runs[0].system.key == "CPU" else None
        if peak:  # the host's peak: one for every run fitted, recorded for the runs predicted
            runs = [measured.at_host_peak(r, peak) for r in runs]
        profile = calib.fit_runs(runs)
        if peak:
            profile = replace(profile, provenance={**profile.provenance, measured.HOST_PEAK: peak})
        fitted = [run_prediction.comparison(r, profile, "the profile fitted to these runs") for r in runs]
        result = {"runs": [_run_json(c) for c in fitted], "device": runs[0].system.key}
    profile.save(out)
    result.update(profile=profile.values(), provenance=profile.provenance, written=str(out))
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"fitted {profile.provenance['degrees_of_freedom']} numbers: "
          + ", ".join(f"{k}={v:.4g}" for k, v in profile.values().items() if k in profile.provenance["fields"]))
    if "sources" in result:
        _print_held_out(result)
    else:
        print(f"fitted to {len(fitted)} run(s) on {result['device']}, mean |log error| of the step "
              f"{profile.provenance['mean_abs_log_error']:.3f}")
        for c in fitted:
            print(f"\n{c.run.path}:")
            print(run_prediction.text(c))
    print(f"\nprofile written to {out}; use it with --hardware {out}")
    return 0


def _print_held_out(result: dict[str, Any]) -> None:
    """The per-source and per-family table, then the rows predicted worst held out."""
    pct = lambda v, w: f"{v:>{w}.1%}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    for title, table in (("source", result["sources"]), ("family", result["families"])):
        print(f"\n{title:<14} {'rows':>5} {'in-sample MAPE':>15} {'held-out MAPE':>14}")
        for name, r in table.items():
            print(f"{name:<14} {r['rows']:>5} {pct(r['in_sample_mape'], 15)} {pct(r['held_out_mape'], 14)}")
    if not result["held_out_rows"]:
        print("held out: needs rows of two or more sources (these are all "
              f"{', '.join(result['sources'])}'s); the figures above are in sample")
        return
    print("held out: fitted on the other sources only (leave-one-source-out), then predicted; a family's "
          "rows are each predicted by the fit without their own source")
    print(f"\nthe {min(WORST_ROWS, len(result['held_out_rows']))} rows furthest from their measurement, held out "
          "(predicted / measured tokens/s per GPU; all rows: --json, held_out_rows):")
    for r in result["held_out_rows"][:WORST_ROWS]:
        print(f"  {r['held_out_ratio']:5.2f}x  {r['source']:<11} {r['row']:<27} {r['model'][:34]:<34} "
              f"{r['layout']:<42} {r['dtype']:<14} {r['gpu']}")


def predict_runs(paths: list[Path], hardware: Path | None, as_json: bool) -> int:
    """Each measured run's step predicted (the profile given, else the published one for a GPU run; a
    CPU run needs ``--hardware``: no published profile describes a host core) beside its median step."""
    runs = [measured.load(p) for p in paths]
    if hardware is None and any(r.system.key == "CPU" for r in runs):
        cpu = next(r for r in runs if r.system.key == "CPU")
        raise UserInputError("a CPU run needs a profile fitted to CPU runs: `mfuscope calibrate RUN_DIR... --out "
                             "hw.json`, then --hardware hw.json", cpu.path)
    profile = _profile(hardware, runs[0].system.key)
    note = f"profile {hardware}" if hardware else f"profile fitted on {profile.provenance.get('source', 'defaults')}"
    compared = [run_prediction.comparison(r, profile, note) for r in runs]
    if as_json:
        print(json.dumps([_run_json(c) for c in compared], indent=2))
        return 0
    print(f"{'run':<40} {'layout':<44} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for c in compared:
        m, p = c.run.typical_step_s, c.prediction.step_s
        print(f"{str(c.run.path):<40} {planner.describe(c.run.layout):<44} {m:>10.4g} {p:>11.4g} {p / m - 1:>+7.1%}")
    print(f"({note}; measured: the median step)")
    return 0


def _run_json(c: run_prediction.Comparison) -> dict[str, Any]:
    """One run's prediction as ``predict --json`` and ``calibrate --json`` write it."""
    leaves = c.run.typical_leaves()
    names = sorted(set(leaves) | {k for k, v in c.prediction.leaves.items() if v > 0})
    return {"run": str(c.run.path), "layout": planner.describe(c.run.layout), "measured_step_s": c.run.typical_step_s,
            "predicted_step_s": c.prediction.step_s,
            "leaves": {k: {"measured_s": leaves.get(k), "predicted_s": c.prediction.leaves.get(k) or None}
                       for k in names},
            "assumptions": c.prediction.assumptions}


def _calibrate_published(paths: list[Path]) -> dict[str, Any]:
    cases, skipped, where = [], {}, {}
    for path in paths:
        found, not_modelled = published.load_cases(path)
        cases += found
        where.update({id(c): f"{path.name}:{c.row}" for c in found})
        skipped.update({f"{path.name}:{row}": why for row, why in not_modelled.items()})
    cases = [c for c in cases if c.measured_tps]
    if not cases:
        raise UserInputError("no row can be modelled with a measured throughput", paths[0])
    held = ("then once per held-out source" if len({c.source for c in cases}) > 1
            else "in sample only: one source, nothing to hold out")
    _err(f"fitting the profile to {len(cases)} rows ({len(skipped)} rows not modelled), {held} ...")
    profile = calib.fit(cases)
    sources, families, rows = calib.leave_one_source_out_by_family(cases)
    names = ", ".join(p.name for p in paths)
    profile.provenance.update(source=f"{names} ({len(cases)} measured runs: {', '.join(sorted(sources))})",
                              path=", ".join(str(p) for p in paths), held_out=sources, held_out_by_family=families)
    held_out_rows = [{"row": where[id(c)], "source": c.source, "model": c.name, "layout": planner.describe(c.layout),
                      "dtype": c.training.dtype + (f"/{c.training.fp8_recipe}" if c.training.dtype == "fp8" else ""),
                      "gpu": c.system.key, "measured_tokens_per_s_per_gpu": c.measured_tps,
                      "held_out_tokens_per_s_per_gpu": tps, "held_out_ratio": tps / c.measured_tps}
                     for c, tps in sorted(rows, key=lambda r: -abs(math.log(r[1] / r[0].measured_tps)))]
    return {"profile": profile, "sources": sources, "families": families, "held_out_rows": held_out_rows,
            "rows_not_modelled": skipped}


# ----------------------------------------------------------------------------- analyze --predict

def predict_run_text(run_path: Path, hardware: Path | None) -> str:
    """``analyze --predict``: the model's prediction for a measured run, leaf by leaf."""
    return run_prediction.text(run_prediction.compare(run_path, hardware))


# ----------------------------------------------------------------------------- plan

def plan(model_name: str, gpus: int, gpu: str, gpus_per_node: int | None, global_batch: int, seq_len: int,
         dtype: str, top: int, hardware: Path | None, as_json: bool, power_limit_w: float | None = None,
         scaling: str | None = None, fp8_recipe: str = "tensorwise", fp8_scope: str = "all",
         cp_comm: str = "all_gather", attention_kernel: str = "fa2", moe: dict | None = None) -> int:
    from . import scaling as scaling_curve
    sizes = scaling_curve.parse_sizes(scaling) if scaling is not None else None
    if gpus < 1 or global_batch < 1 or seq_len < 1 or top < 1 or (gpus_per_node is not None and gpus_per_node < 1):
        raise UserInputError("--gpus, --gpus-per-node, --global-batch, --seq-len and --top must be positive")
    model = presets.load(model_name)
    sys_ = system(gpu, gpus_per_node=gpus_per_node, power_limit_w=power_limit_w)
    if dtype not in ("bf16", "fp16", "fp8", "fp32"):
        raise UserInputError(f"--dtype {dtype!r}: bf16, fp16, fp8 or fp32")
    sys_.peak_flops("bf16" if dtype == "fp32" else dtype)  # refuses fp8 on a GPU without it
    if fp8_recipe not in FP8_RECIPES or fp8_scope not in FP8_SCOPES:
        raise UserInputError(f"--fp8-recipe {fp8_recipe!r} / --fp8-scope {fp8_scope!r}: recipes "
                             f"{', '.join(FP8_RECIPES)}; scopes {', '.join(FP8_SCOPES)}")
    if dtype == "fp8" and fp8_recipe == "mxfp8" and sys_.key not in MICROSCALING:
        raise UserInputError(f"--fp8-recipe mxfp8: {sys_.key} has no MX GEMMs (Blackwell: {', '.join(MICROSCALING)})")
    if cp_comm not in CP_COMMS or attention_kernel not in ATTENTION_KERNELS:
        raise UserInputError(f"--cp-comm {cp_comm!r} / --attention-kernel {attention_kernel!r}: "
                             f"{', '.join(CP_COMMS)}; {', '.join(ATTENTION_KERNELS)}")
    try:
        training = Training(seq_len=seq_len, dtype=dtype, compiled=True, fp8_recipe=fp8_recipe, fp8_scope=fp8_scope,
                            cp_comm=cp_comm, attention_kernel=attention_kernel, **(moe or {}))
    except ValueError as e:  # --moe-overlap, --moe-imbalance, --moe-capacity-factor, --moe-dispatch
        raise UserInputError(str(e)) from None
    profile = _profile(hardware, sys_.key)
    result = planner.plan(model, gpus, sys_, global_batch, training, profile, top)
    curve = (scaling_curve.predicted(model, gpus, sys_, global_batch, training, profile, sizes)
             if sizes else None)
    if as_json:
        print(json.dumps({"model": model_name, "gpus": gpus, "gpu": sys_.key, "gpus_per_node": sys_.gpus_per_node,
                          "considered": result.considered, "tp_across_nodes": result.tp_across_nodes,
                          "ranked": [{"layout": planner.describe(lay), **_layout_dict(lay), **pred.summary()}
                                     for lay, pred in result.ranked],
                          "rejected": {k: {"count": v, "example": result.examples[k]}
                                       for k, v in result.rejected.items()},
                          **({"scaling": curve} if curve is not None else {})}, indent=2))
        return 0 if result.ranked else 1
    print(f"{model_name} on {gpus} x {sys_.key} ({sys_.gpus_per_node} per node), global batch {global_batch} "
          f"x {seq_len} tokens, {dtype}; profile: {profile.provenance.get('source', 'defaults')}")
    print(f"{result.considered} layouts considered")
    if result.tp_across_nodes:
        print("no layout fits with TP inside a node: TP groups spanning nodes were allowed")
    if result.ranked:
        print(f"\n{'#':>2} {'tokens/s/GPU':>12} {'MFU':>6} {'GiB':>5}  layout / where the step goes")
        for i, (lay, pred) in enumerate(result.ranked, 1):
            print(f"{i:>2} {pred.tokens_per_s_per_gpu:>12,.0f} {pred.mfu or 0:>6.1%} "
                  f"{pred.memory.total_bytes / 2**30:>5.0f}  {planner.describe(lay)}")
            print(f"{'':>29}{_shares(pred)}")
    else:
        print("\nno layout fits: see the reasons below")
    print("\nnot chosen:")
    for family, count in result.rejected.most_common():
        print(f"  {count:>6}  {family}, e.g. {result.examples[family]}")
    if curve is not None:
        print(scaling_curve.predicted_text(curve))
    return 0 if result.ranked else 1


def _shares(pred: Prediction) -> str:
    top = sorted(((v, k) for k, v in pred.leaves.items() if v > 0), reverse=True)[:5]
    return ", ".join(f"{k} {v / pred.step_s:.0%}" for v, k in top)


def _layout_dict(layout) -> dict[str, Any]:
    return asdict(layout)


# ----------------------------------------------------------------------------- optimize

def optimize(run_path: Path, apply_: bool, only: str | None, rounds: int, out: Path | None, as_json: bool,
             memory_gib: float | None = None, first_win: bool = False) -> int:
    from . import optimize as opt
    wanted = {f.strip() for f in only.split(",")} if only else None
    from mfuscope.fix_registry import FIXES
    known = list(dict.fromkeys(fixes_catalogue() + list(FIXES)))
    unknown = (wanted or set()) - set(known)
    if unknown:
        raise UserInputError(f"--fixes: unknown {', '.join(sorted(unknown))}; one of {', '.join(known)}")
    if memory_gib is not None and memory_gib <= 0:
        raise UserInputError(f"--memory-gib {memory_gib:g}: a memory budget per GPU must be positive")
    if not (run_dir.is_run_dir(run_path) and Manifest.read(run_path).has_model_spec):
        if apply_:
            raise UserInputError("not a reference-trainer run (no model spec or launch command to rerun): "
                                 "run `mfuscope optimize` without --apply for proposals", run_path)
        return _optimize_foreign(run_path, wanted, as_json)
    if not (run_path / "report.json").is_file():
        from .predicted_memory import analyze
        _err(f"mfuscope: analyzing {run_path} first")
        analyze(run_path, run_path / "report.json", run_path / run_dir.VIEWS)
    run = measured.load(run_path)
    if memory_gib is not None:
        run = replace(run, system=replace(run.system, memory_bytes=memory_gib * 2**30))
    if not apply_:
        base, _, proposals = opt.propose(run, wanted)
        result = {"base_step_s": run.step_s, "base_predicted_step_s": base.step_s,
                  "base_memory_gib": base.memory.total_bytes / 2**30, "base_fits": base.memory.fits,
                  "fixes": [p.as_dict() for p in proposals], "final": None}
        if as_json:
            print(json.dumps(result, indent=2))
            return 0
        print(f"{run.path}: measured step {run.step_s:.4g} s, predicted {base.step_s:.4g} s "
              f"(profile fitted to this run); {base.memory.total_bytes / 2**30:.4g} GiB per GPU\n")
        _print_proposals(result["fixes"])
        print("\nflags for other jobs:")
        for p in proposals[:5]:
            print(f"  {p.change.summary}")
            for who, flag in p.change.flags.items():
                print(f"    {who:<11} {flag}")
        return 0
    summary = opt.apply(run, out or run.path.parent, wanted, rounds, _err, first_win)
    write_bytes(run.path / "optimize.json", (json.dumps(summary, indent=2) + "\n").encode())
    write_bytes(run.path / "optimize.md", _markdown(summary).encode())
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_proposals(summary["fixes"])
    final = summary["final"]
    print(f"\nbase {summary['base_step_s']:.4g} s (MFU {_pct(summary['base_mfu'])}) -> final "
          f"{final['measured_step_s']:.4g} s (MFU {_pct(final['measured_mfu'])}, {final['gain']:+.1%}) with "
          f"{', '.join(final['fixes']) or 'no change'}: {final['run']}")
    print(f"written: {run.path / 'optimize.json'}, {run.path / 'optimize.md'}")
    return 0


def model_gains_text(run_path: Path, report: dict[str, Any]) -> str:
    """The cost model's predicted gain for each finding's fix (runs with a model spec; else '')."""
    from . import optimize as opt
    manifest = Manifest.read(run_path)
    if not manifest.has_model_spec:
        return ""
    try:
        best = opt.best_by_fix(opt.propose(measured.from_documents(report, manifest, run_path))[2])
    except (UserInputError, ValueError, KeyError):
        return ""
    rows = [(best[f].predicted_gain, f, best[f].change.summary)
            for f in dict.fromkeys(x["fix"] for x in report["findings"]) if f in best]
    if not rows:
        return ""
    lines = ["\ncost model, calibrated on this run (`mfuscope optimize` to apply and measure):"]
    lines += [f"  {gain:>+7.1%}  {fix}: {summary}" for gain, fix, summary in sorted(rows, reverse=True)]
    return "\n".join(lines)


def _optimize_foreign(path: Path, wanted: set[str] | None, as_json: bool) -> int:
    """Proposals for a job mfuscope cannot rerun: the report's findings with each fix's flags."""
    from mfuscope.analyzers import overview, trace_set

    from .flags import proposals_from_findings

    report_path = path / "report.json"
    if report_path.is_file():
        report = measured._read(report_path)
    else:
        loaded = trace_set.load(path)
        report = overview.build_report(loaded.events, source=str(path), files=[str(f) for f in loaded.files],
                                       run=path if run_dir.is_run_dir(path) else None)
    rows = [r for r in proposals_from_findings(report) if not wanted or r["fix"] in wanted]
    step = (report.get("summary") or {}).get("step_time_s")
    if as_json:
        print(json.dumps({"base_step_s": step, "base_predicted_step_s": None, "fixes": rows, "final": None,
                          "note": "no model spec: findings with the analyzers' estimates; nothing can be applied"},
                         indent=2))
        return 0
    print(f"{path}: measured step {step:.4g} s. No model spec and no launch command here: these are the "
          "trace's findings with the analyzers' estimate of the time at stake, and the switches that act on "
          "each (nothing is predicted or applied).\n" if step else f"{path}: no timed step in the trace.\n")
    if not rows:
        print("no finding: nothing to propose")
    for r in rows:
        gain = f"{r['predicted_gain']:.1%} of the step" if r["predicted_gain"] is not None else ""
        print(f"{r['fix']:<22} {gain:>18}  {r['summary']}")
        for who, flag in r["flags"].items():
            print(f"    {who:<11} {flag}")
    return 0


def fixes_catalogue() -> list[str]:
    from .fixes import CATALOGUE
    return list(CATALOGUE)


def _print_proposals(rows: list[dict[str, Any]]) -> None:
    print(f"{'fix':<22} {'pred. step s':>12} {'pred. gain':>10} {'meas. step s':>12}  change / note")
    for r in rows:
        meas = f"{r['measured_step_s']:.4g}" if r["measured_step_s"] is not None else "-"
        print(f"{r['fix']:<22} {r['predicted_step_s']:>12.4g} {r['predicted_gain']:>+10.1%} {meas:>12}  "
              f"{r['summary']}" + (f"; moved {r['moved']}" if r.get("moved") else "")
              + (f"  [{r['note']}]" if r["note"] else ""))


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.3g}%"


def _markdown(summary: dict[str, Any]) -> str:
    lines = ["# mfuscope optimize", "", f"Base run: `{summary['base_run']}`, step {summary['base_step_s']:.4g} s", "",
             "| fix | change | predicted step (s) | measured step (s) | gain | MFU | leaf moved most | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["fixes"]:
        meas = f"{r['measured_step_s']:.4g}" if r["measured_step_s"] is not None else "–"
        gain = f"{1 - r['measured_step_s'] / summary['base_step_s']:+.1%}" if r["measured_step_s"] else "–"
        lines.append(f"| {r['fix']} | {r['summary']} | {r['predicted_step_s']:.4g} | {meas} | {gain} | "
                     f"{_pct(r['measured_mfu'])} | {r['moved'] or '–'} | {r['note']} |")
    f = summary["final"]
    lines += ["", f"Base: step {summary['base_step_s']:.4g} s, MFU {_pct(summary['base_mfu'])}.",
              f"Final: {', '.join(f['fixes']) or 'no change'}, step {f['measured_step_s']:.4g} s "
              f"({f['gain']:+.1%}), MFU {_pct(f['measured_mfu'])}, run `{f['run']}`", ""]
    return "\n".join(lines)
