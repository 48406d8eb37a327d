"""``mfuscope`` command line: one subcommand per job, ``--help`` on each.

Expected failures (bad files, bad flags) print one line naming the file and
the problem and exit 2; ``--json`` prints machine-readable output on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from mfuscope import __version__
from mfuscope.errors import UserInputError


def _add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a trace file (.json, .json.gz, nsys .sqlite), a directory of rank traces, or a run directory")
    p.add_argument("--no-cache", action="store_true", help="parse the traces again instead of using the parquet cache")
    p.add_argument("--rank", type=int, default=None, help="rank of a single trace file that does not say it")
    p.add_argument("--step-annotation", metavar="REGEX", default=None,
                   help="annotation that marks a step, for traces without ProfilerStep#N")
    p.add_argument("--skip-bad", action="store_true", help="with several ranks, load the good files and list the bad ones")
    p.add_argument("--workers", type=int, default=None, help="parallel parse processes (default: CPU count)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mfuscope", description=(
        "Find out why distributed training is slow: MFU, top-down step breakdown, exposed "
        "communication per parallel dimension."))
    parser.add_argument("--version", action="version", version=f"mfuscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("info", help="what a trace set holds: ranks, device, steps, events by kind, time span",
                       description="Summarize a trace file, trace directory or run directory.")
    _add_load_options(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("analyze", help="analyze a run or trace set, write report.json, print a summary",
                       description="Load every rank, run the analyses, write report.json and print a summary.")
    _add_load_options(p)
    p.add_argument("--out", type=Path, default=None,
                   help="where to write report.json (default: RUN_DIR/report.json for a run directory, "
                        "else ./mfuscope-report.json)")
    p.add_argument("--force", action="store_true", help="overwrite --out even if it is not an mfuscope report")
    p.set_defaults(func=cmd_analyze)
    return parser


def _load(args: argparse.Namespace):
    from mfuscope.analyzers import trace_set

    result = trace_set.load(args.path, rank=args.rank, step_annotation=args.step_annotation,
                            use_cache=not args.no_cache, skip_bad=args.skip_bad, workers=args.workers)
    for f, reason in result.skipped:
        print(f"mfuscope: skipped {reason}", file=sys.stderr)
    return result


def cmd_info(args: argparse.Namespace) -> int:
    from mfuscope.analyzers import trace_info

    result = _load(args)
    info = trace_info.summarize(result.events)
    info["skipped"] = [{"file": f, "reason": r} for f, r in result.skipped]
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(trace_info.format_text(info))
        for f, r in result.skipped:
            print(f"skipped      {r}")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from mfuscope.analyzers import overview
    from mfuscope.report import write_report
    from mfuscope.run_dir import REPORT, is_run_dir

    out = args.out or (Path(args.path) / REPORT if is_run_dir(args.path) else Path("mfuscope-report.json"))
    _check_overwrite(out, args.force)
    result = _load(args)
    report = overview.build_report(result.events, source=str(args.path), files=[str(f) for f in result.files])
    write_report(out, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(overview.format_text(report))
        print(f"\nreport written to {out}")
    return 0


def _check_overwrite(out: Path, force: bool) -> None:
    """Never clobber a file the user had: only an earlier mfuscope report may be replaced."""
    if not out.exists() or force:
        return
    try:
        existing = json.loads(out.read_text())
        ours = isinstance(existing, dict) and "schema_version" in existing and "provenance" in existing
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise UserInputError("exists and is not an mfuscope report; choose another --out or pass --force", out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserInputError as e:
        print(f"mfuscope: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("mfuscope: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0



if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
