"""What ``mfuscope ci record``, ``ci check`` and ``ci trend`` do; the CLI parses flags and calls
these, each returning its exit code.  Files are written atomically (a temporary file, then a
rename); the history is only ever appended to."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mfuscope import atomic, run_dir
from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest

from . import check as check_mod
from . import history as hist
from . import outputs, paired, prediction, trend

#: Records the HTML report plots (each point is re-judged against the 20 before it).
HTML_RECORDS = 1000


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def default_commit() -> str | None:
    return os.environ.get("GITHUB_SHA") or _git("rev-parse", "HEAD")


def default_branch() -> str | None:
    # A pull request's own branch is GITHUB_HEAD_REF; a push's is GITHUB_REF_NAME.
    return os.environ.get("GITHUB_HEAD_REF") or os.environ.get("GITHUB_REF_NAME") or _git(
        "rev-parse", "--abbrev-ref", "HEAD")


def load_run(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None, Path]:
    """(report, manifest or None, directory) of a run directory (analyzed now if it has no report, or
    one from before the counters) or of a report.json."""
    from mfuscope.report import read_report

    if run_dir.is_run_dir(path):
        report_path = path / run_dir.REPORT
        report = read_report(report_path) if report_path.exists() else None
        if report is None or "counters" not in report:
            if not (path / run_dir.TRACES).is_dir():
                raise UserInputError("the run has no trace window to analyze; record CI runs with one "
                                     "(mfuscope train --window 1:5, mfuscope profile --window 5:3): the gate's "
                                     "counters come from the traced steps", path)
            from mfuscope.optimizers.predicted_memory import analyze
            print(f"mfuscope ci: analyzing {path}", file=sys.stderr, flush=True)
            report, _ = analyze(path, report_path, path / run_dir.VIEWS)
        return report, run_dir.read_manifest(path), path
    if path.is_file():
        report = read_report(path)
        manifest = run_dir.read_manifest(path.parent) if run_dir.is_run_dir(path.parent) else None
        return report, manifest, path.parent
    raise UserInputError("not a run directory or a report.json", path)


def build_record(path: Path, workload: str | None, commit: str | None, branch: str | None,
                 time: str | None) -> dict[str, Any]:
    report, manifest, where = load_run(path)
    name = hist.check_workload_name(workload or (where.name if run_dir.is_run_dir(where) else path.stem))
    rec = hist.make_record(report, manifest, workload=name, commit=commit or default_commit(),
                           branch=branch or default_branch(),
                           time=time or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           source=str(path))
    pred = prediction.predicted(report, manifest, where)
    if pred and rec["counters"] is not None:
        rec["counters"] = {**rec["counters"], **pred}
    if not rec["samples"]["step_time_s"]:
        print(f"mfuscope ci: warning: {path} has no per-step times; only its counters can be gated",
              file=sys.stderr)
    return rec


def record(path: Path, history: Path, workload: str | None, commit: str | None, branch: str | None,
           time: str | None, accept: bool, as_json: bool) -> int:
    rec = build_record(path, workload, commit, branch, time)
    if accept:
        rec["accepted"] = True
    where = hist.append(history, rec)
    if as_json:
        print(json.dumps(rec, indent=2))
    else:
        m = rec["metrics"]
        mfu = f"MFU {m['mfu']:.3%}" if m.get("mfu") is not None else "no MFU"
        step = f"step {m['step_time_s'] * 1e3:.1f} ms" if m.get("step_time_s") else "no step time"
        print(f"recorded {rec['workload']} @ {(rec['commit'] or 'unknown commit')[:12]} ({mfu}, {step}, "
              f"{len(rec['samples']['step_time_s'])} step samples{', new baseline' if accept else ''}) -> {where}")
    return 0


def check(path: Path, history: Path, workload: str | None, branch: str | None, max_drop: float,
          summary_md: Path | None, junit: Path | None, html: Path | None, confirm_runs: int,
          rerun_command: str | None, as_json: bool, paired_with: Path | None = None,
          main_code: Path | None = None, main_rerun_command: str | None = None,
          max_slowdown: float = paired.THRESHOLD, pair_on_violation: bool = False) -> int:
    """``paired_with``: main's run of the same job, trained right before this one (a pull
    request's check, :mod:`.paired`); its reruns run with ``main_code`` (where main's code is
    installed) first on ``PYTHONPATH``, or as ``main_rerun_command``.  ``pair_on_violation`` (a
    push's check): where the history calls the run slower, the baseline's code (``main_code``:
    the parent commit's) is trained from this run's manifest into ``RUN.main1`` and the pairs
    decide, as on a pull request."""
    if not 0 <= max_drop < 1:
        raise UserInputError(f"--max-mfu-drop {max_drop}: give a fraction such as 0.02 or a percentage such as 2%")
    if not 0 <= max_slowdown < 1:
        raise UserInputError(f"--max-slowdown {max_slowdown}: give a fraction such as 0.05 or a percentage such as 5%")
    if not history.is_dir():
        raise UserInputError("no such history directory (make one with `mfuscope ci record RUN --history DIR`)",
                             history)
    if pair_on_violation and paired_with is not None:
        raise UserInputError("--pair-on-violation trains the baseline's run itself; give it or --paired-with, "
                             "not both")
    if pair_on_violation and main_code is None and main_rerun_command is None:
        raise UserInputError("--pair-on-violation needs the baseline's code: --main-code DIR (pip install --no-deps "
                             "--target DIR PARENT_CHECKOUT) or --main-rerun-command 'CMD {out}'")
    if main_code is not None and not main_code.is_dir():
        raise UserInputError("--main-code: no such directory (install main's code there: pip install --no-deps "
                             "--target DIR MAIN_CHECKOUT)", main_code)
    current = build_record(path, workload, None, None, None)
    h = hist.read(history, current["workload"])
    for s in h.skipped:
        print(f"mfuscope ci: warning: skipped {s}", file=sys.stderr)
    rerun = _rerun_fn(path, current, rerun_command) if confirm_runs else None
    env = None if main_code is None else {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(main_code.resolve()), os.environ.get("PYTHONPATH")]))}

    def pairs_after(main_run: Path, main: dict[str, Any]):
        """The further pairs: main's code trained again from its run's manifest, then this run's."""
        if not confirm_runs:
            return None
        rerun_main = _rerun_fn(main_run, main, main_rerun_command, env=env, flag="--main-rerun-command",
                               what="main's code, trained again")

        def rerun_pair(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
            m = rerun_main(i)  # main's code first, as in the job's first pair
            return rerun(i), m
        return rerun_pair

    main = rerun_pair = train_main = None
    if paired_with is not None:
        main = build_record(paired_with, current["workload"], None, "main", None)
        rerun_pair = pairs_after(paired_with, main)
    if pair_on_violation:
        first_main = _rerun_fn(path, current, main_rerun_command, env=env, flag="--main-rerun-command",
                               what="the history calls this run slower: the baseline's code, trained for a pair",
                               suffix="main", commit="")

        def train_main():
            m = first_main(0)
            return m, pairs_after(path.parent / f"{path.name}.main1", m)
    result = check_mod.check(h, current, branch=branch, floor=max_drop, rerun=rerun, confirm_runs=confirm_runs,
                             main=main, rerun_pair=rerun_pair, pair_threshold=max_slowdown,
                             pair_on_violation=train_main)
    md = outputs.markdown(result)
    summary_md = summary_md or (Path(os.environ["GITHUB_STEP_SUMMARY"]) if os.environ.get("GITHUB_STEP_SUMMARY")
                                else None)
    if summary_md:
        with open(summary_md, "a", encoding="utf-8") as f:  # GitHub's summary file is appended to
            f.write(md + "\n")
    if junit:
        atomic.write_bytes(junit, outputs.junit(result).encode())
    if html:
        records = check_mod.baseline_records(h, current, branch)[-HTML_RECORDS:] + [current]
        atomic.write_bytes(html, trend.html(records, max_drop, f"{current['workload']}: the last "
                                            f"{len(records) - 1} matching records and this run", md).encode())
    print(json.dumps(result, indent=2, default=str) if as_json else md)
    return result["exit_code"]


def _rerun_fn(path: Path, current: dict[str, Any], rerun_command: str | None, env: dict[str, str] | None = None,
              flag: str = "--rerun-command", what: str = "confirming rerun", suffix: str = "rerun",
              commit: str | None = None):
    """Run the workload again into a fresh run directory beside ``path`` (``RUN.<suffix>N``); return
    its record.  ``env``: variables set for the rerun (main's code on ``PYTHONPATH``); ``flag``: the
    option that gives ``rerun_command``, for the error; ``what``: the progress line's words;
    ``commit``: the record's commit where it is not the checked run's ("": not known here)."""
    manifest = Manifest.read(path) if run_dir.is_run_dir(path) else Manifest()
    if rerun_command is None and not manifest.is_reference_trainer_run:
        raise UserInputError(f"only a reference-trainer run is trained again by itself ({what}); for another job "
                             f"give {flag} 'CMD {{out}}' (it must write a run directory at {{out}})", path)

    def rerun(i: int) -> dict[str, Any]:
        out = path.parent / f"{path.name}.{suffix}{i + 1}"
        if rerun_command is not None:
            cmd = [a.replace("{out}", str(out)) for a in shlex.split(rerun_command)]
        else:
            from mfuscope.optimizers.optimize import trainer_command, write_config
            scratch = tempfile.mkdtemp(prefix="mfuscope-ci-")
            cmd = trainer_command(manifest, write_config(manifest, Path(scratch) / "config.toml"), out, {})
        print(f"mfuscope ci: {what} {i + 1}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise UserInputError(f"the confirming rerun failed (exit {done.returncode}): {last}", out)
        record = build_record(out, current["workload"], current.get("commit"), current.get("branch"), None)
        return record if commit is None else {**record, "commit": commit or None}
    return rerun


def trend_page(history: Path, out: Path, workload: str | None, branch: str | None, floor: float) -> int:
    if not history.is_dir():
        raise UserInputError("no such history directory", history)
    names = [hist.check_workload_name(workload)] if workload else list(hist.workloads(history))
    if not names:
        raise UserInputError("no workload histories (*.jsonl) in this directory", history)
    import plotly.io as pio

    parts, first = [], True
    for name in names:
        h = hist.read(history, name)
        if not h.records:
            raise UserInputError(f"no records for workload {name!r}", h.path)
        for fp_id in dict.fromkeys(r["fingerprint_id"] for r in h.records):
            recs = [r for r in h.matching(fp_id, branch)]
            if not recs:
                continue
            fig = trend.figure(recs, floor, f"{name} ({len(recs)} records, environment {fp_id})")
            parts.append(pio.to_html(fig, include_plotlyjs=first, full_html=False))
            first = False
    if not parts:
        raise UserInputError(f"no records on branch {branch!r}", history)
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>mfuscope trend</title></head>"
            "<body style='font-family:sans-serif'>" + "".join(parts) + "</body></html>")
    atomic.write_bytes(out, page.encode())
    print(f"trend of {len(names)} workload(s) written to {out}")
    return 0
