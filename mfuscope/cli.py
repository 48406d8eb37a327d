"""``mfuscope`` command line: one subcommand per job, ``--help`` on each.

Expected failures (bad files, bad flags) print one line naming the file and
the problem and exit 2; ``--json`` prints machine-readable output on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mfuscope import __version__
from mfuscope.errors import UserInputError

if TYPE_CHECKING:  # the CLI imports each command's modules when the command runs
    from mfuscope.trainer_options import TrainerOptions


def _add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("path",
                   help="a trace file (.json, .json.gz, nsys .sqlite), a directory of rank traces, or a run directory")
    p.add_argument("--no-cache", action="store_true", help="parse the traces again instead of using the parquet cache")
    p.add_argument("--rank", type=int, default=None, help="rank of a single trace file that does not say it")
    p.add_argument("--step-annotation", metavar="REGEX", default=None,
                   help="annotation that marks a step, for traces without ProfilerStep#N")
    p.add_argument("--skip-bad", action="store_true",
                   help="with several ranks, load the good files and list the bad ones")
    p.add_argument("--allow-mixed", action="store_true",
                   help="load traces that disagree on world size or device as one job anyway (with a warning)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes, each loading and analyzing one rank at a time (default: CPU count)")
    p.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="map the ranks on a Dask cluster: its scheduler's address (tcp://HOST:PORT), or 'local' for "
                        "a LocalCluster of --workers processes here (default: $DASK_SCHEDULER_ADDRESS, else this "
                        "machine's process pool; needs pip install 'mfuscope[cluster]')")
    p.add_argument("--layout", metavar="DEGREES", default=None,
                   help="the job's parallel degrees, e.g. tp=8,pp=4,dp=2 (dp: what the world leaves; also cp, ep, "
                        "etp, or dp_replicate/dp_shard), to name process groups the traces do not")
    p.add_argument("--rank-order", metavar="ORDER", default=None,
                   help="with --layout: the dimensions that number the ranks, fastest first "
                        "(default tp-cp-ep-dp-pp, Megatron-Core's)")
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
    p.add_argument("--predict", action="store_true",
                   help="also print the cost model's prediction for this run, leaf by leaf (runs with a model spec)")
    p.add_argument("--hardware", type=Path, default=None, help="with --predict: a profile from `mfuscope calibrate`")
    p.add_argument("--nccl-tests", type=Path, action="append", default=[], metavar="FILE",
                   help="an nccl-tests output (all_reduce_perf and the like) to compare each communication row's "
                        "bus bandwidth with, at the same message size; repeatable")
    p.set_defaults(func=cmd_analyze)
    p = sub.add_parser("hang", help="why a job hung: Flight Recorder dumps of every rank, read across ranks",
                       description="Read every rank's PyTorch Flight Recorder dump (pickle or JSON, files named "
                                   "..._rank_N) in DIR; per process group, the first collective not every member "
                                   "got through, and who is to blame: never entered, desync, not completed, "
                                   "missing.")
    p.add_argument("path", help="a directory of Flight Recorder dumps (or one dump)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=cmd_hang)
    p = sub.add_parser("memory", help="read a CUDA memory snapshot or a memory timeline export",
                       description="A pickled torch.cuda.memory._snapshot() (as _dump_snapshot, Megatron's "
                                   "--record-memory-history and torchtitan write them): reserved, allocated, "
                                   "fragmentation and, with recorded history, the peaks.  A memory timeline "
                                   "(export_memory_timeline's .raw.json.gz): the peak and its categories.  A run's "
                                   "measured memory per rank is in `mfuscope analyze`'s report.")
    p.add_argument("path", help="a snapshot pickle or a .raw.json.gz memory timeline")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=cmd_memory)
    p = sub.add_parser("train", help="run the bundled 5D-parallel reference trainer (through torchrun, or forked)",
                       description="Train the reference Llama/MoE model on N local ranks (gloo on CPU, NCCL on "
                                   "CUDA) and write a run directory.")
    from mfuscope.trainer_options import add_arguments
    add_arguments(p, launcher=True)  # every trainer flag (mfuscope/trainer_options.py), then the launcher's own
    p.add_argument("--profile", action="store_true",
                   help="record torch.profiler traces of every step after the first into RUN_DIR/traces "
                        "(same as --window 1:)")
    p.add_argument("--out", type=Path, required=True, help="run directory to create")
    p.add_argument("--force", action="store_true", help="replace an existing run directory")
    p.add_argument("--nproc", type=int, default=1, help="ranks per node")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rdzv-endpoint", default=None, help="host:port, for several nodes")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("compare", help="compare two runs' reports; fail on an MFU regression (for CI)",
                       description="Side-by-side summary and per-leaf deltas of two reports (report.json files, "
                                   "or run directories, analyzed if they have no report yet).")
    p.add_argument("base", help="baseline report.json or run directory")
    p.add_argument("new", help="new report.json or run directory")
    p.add_argument("--fail-on-mfu-drop", type=float, default=None, metavar="FRACTION",
                   help="exit 1 if NEW's MFU is more than FRACTION below BASE's (e.g. 0.05)")
    p.add_argument("--format", choices=("text", "markdown", "json", "junit"), default="text")
    p.set_defaults(func=cmd_compare)

    _add_ci(sub)

    p = sub.add_parser("predict", help="predict step time, MFU and memory of published, planned or measured runs "
                                       "(cost model)",
                       description="A CSV with the columns of calibration.csv: each row predicted, written with "
                                   "predicted_* columns, the error per source printed.  Run directories: each run's "
                                   "step predicted beside its measured median step, leaf by leaf.")
    p.add_argument("runs", type=Path, nargs="+", metavar="RUNS",
                   help="CSV with the columns of corpus/published/calibration.csv, or run directories")
    p.add_argument("--out", type=Path, default=None, help="CSV input: output CSV (default: RUNS.predicted.csv)")
    p.add_argument("--hardware", type=Path, default=None,
                   help="profile from `mfuscope calibrate` (default: the one fitted on the published runs)")
    p.add_argument("--json", action="store_true", help="run directories: a JSON list on stdout")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("calibrate", help="fit the cost model's efficiencies to measured runs, write hw.json",
                       description="From CSVs of published runs (their rows fitted together, then "
                                   "leave-one-source-out, the held-out error printed per source and per family: "
                                   "dense/moe, bf16/fp8, device generation) or from one or "
                                   "more measured run directories (each group of leaves its own number, fitted to "
                                   "all the runs at once, from the published profile).")
    p.add_argument("source", type=Path, nargs="+", metavar="SOURCE",
                   help="calibration.csv-style CSVs, or run directories (or their report.json)")
    p.add_argument("--out", type=Path, default=None, help="where to write the profile (default: ./hw.json)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("plan", help="rank the 5D layouts of a model on N GPUs by predicted throughput",
                       description="Enumerate tp/cp/pp/vpp/dp/ep/micro-batch/recompute layouts, prune those that do "
                                   "not fit in memory, rank the rest with the cost model.")
    p.add_argument("--model", required=True, help="preset (llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, "
                                                  "deepseek-v3, tiny_dense, ...) or a JSON model spec")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", default="H100", help="A100, H100, H200, H800, B200, B300, GB200, GB300, MI300X")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per NVLink domain (default: the system's)")
    p.add_argument("--power-limit-w", type=float, default=None,
                   help="boards capped below their TDP (e.g. 500 for 500 W H100s): compute scales as the cube root")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--dtype", default="bf16", help="bf16, fp16, fp8 (float8 linear layers) or fp32")
    p.add_argument("--fp8-recipe", default="tensorwise",
                   help="with --dtype fp8: tensorwise or rowwise (torchao), delayed or current (Transformer Engine), "
                        "mxfp8 (Blackwell) or blockwise; each its GEMM rate and casts (docs/cost_model.md)")
    p.add_argument("--fp8-scope", default="all", help="with --dtype fp8: all, linears (dense only) or experts "
                                                      "(the routed experts' grouped GEMMs only)")
    p.add_argument("--cp-comm", default="all_gather",
                   help="how context parallelism moves K and V: all_gather (PyTorch's context_parallel), p2p (a ring: "
                        "Megatron-Core, Transformer Engine) or a2a (Ulysses)")
    p.add_argument("--attention-kernel", default="fa2",
                   help="fa2 (FlashAttention-2, PyTorch's SDPA) or fa3 (FlashAttention-3, cuDNN: Hopper and later)")
    p.add_argument("--moe-overlap", default="none",
                   help="what the expert all-to-alls hide behind: none, shared_experts (Megatron-Core's "
                        "--moe-shared-expert-overlap) or microbatches (another microbatch's compute: "
                        "--overlap-moe-expert-parallel-comm, DualPipe)")
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="the busiest expert-parallel rank's routed tokens over the mean (default 1: balanced)")
    p.add_argument("--moe-capacity-factor", type=float, default=None,
                   help="tokens past this multiple of an expert's mean load are dropped (default: none dropped)")
    p.add_argument("--moe-dispatch", default="all_to_all",
                   help="how tokens reach experts on other nodes: all_to_all (NCCL: a copy per expert) or deepep "
                        "(DeepEP's two-level dispatch: a copy per node over the NIC, forwarded over NVLink)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--hardware", type=Path, default=None, help="profile from `mfuscope calibrate`")
    p.add_argument("--scaling", metavar="GPUS,...", default=None,
                   help="also the predicted weak-scaling curve at these GPU counts (e.g. 8,64,512,4096,16384): the "
                        "best layout at each, sequences per GPU held at --global-batch / --gpus")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("scaling", help="scaling efficiency of one job's runs at several sizes, and where it was lost",
                       description="Runs of one job at several sizes (run directories; analyzed first if they have "
                                   "no report.json), sorted by ranks, against the smallest: tokens/s per device, "
                                   "MFU, efficiency, and the lost step time split over the breakdown's leaves. "
                                   "Weak scaling (the same tokens per device per step) or strong (the same tokens "
                                   "per step) is detected, or forced (docs/cost_model.md, 'Scaling').")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--weak", dest="mode", action="store_const", const="weak",
                      help="weak scaling: the ideal step is the smallest run's")
    mode.add_argument("--strong", dest="mode", action="store_const", const="strong",
                      help="strong scaling: the ideal step is the smallest run's x N0/N")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=cmd_scaling)

    p = sub.add_parser("optimize", help="propose fixes ranked by predicted gain; --apply runs and measures them",
                       description="Proposals from the fix catalogue, each with its predicted step (the cost model "
                                   "calibrated on this run) and memory check; with --apply, each is run on the "
                                   "reference trainer and measured, and the best are kept greedily.")
    p.add_argument("run", type=Path, help="a run directory (analyzed first if it has no report.json), or a "
                                          "trace file or directory: proposals with flags only")
    p.add_argument("--apply", action="store_true", help="run each proposal (reference-trainer runs only)")
    p.add_argument("--fixes", default=None, help="comma-separated fix ids to consider (default: all)")
    p.add_argument("--rounds", type=int, default=3, help="with --apply: greedy rounds at most")
    p.add_argument("--first-win", action="store_true",
                   help="with --apply: each round runs its proposals in order of predicted gain and keeps the "
                        "first that makes the run faster (default: runs every one and keeps the fastest)")
    p.add_argument("--out", type=Path, default=None,
                   help="with --apply: where the new runs go (default: beside RUN); optimize.json goes into RUN")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory per GPU a change must fit in (default: the device's); changes over it are not run")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser("dashboard", help="browse runs in a web dashboard (Dash)",
                       description="Serve a web dashboard over every run under RUNS_DIR (run directories and "
                                   "directories of rank traces). Runs not analyzed yet are analyzed on first view.")
    p.add_argument("runs_dir", nargs="?", default="runs", type=Path, metavar="RUNS_DIR",
                   help="directory of runs, or one run (default: ./runs)")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: this machine only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--debug", action="store_true", help="Dash debug mode (reloader, error overlay)")
    p.add_argument("--history", type=Path, default=None, metavar="DIR",
                   help="a CI history (mfuscope ci record) for the Trend page")
    p.set_defaults(func=cmd_dashboard)

    p = sub.add_parser("profile", help="run a training command with every rank profiled (no code change)",
                       description="Run COMMAND (torchrun ..., python train.py ...) with a profiling session in "
                                   "each rank: steps (optimizer steps), communication per process group, GPU "
                                   "samples, and a Kineto trace window, into a run directory.",
                       usage="mfuscope profile --out RUN_DIR [options] -- COMMAND ...")
    p.add_argument("--out", type=Path, required=True, help="run directory to create")
    p.add_argument("--window", default="5:3", metavar="START:STEPS",
                   help="steps to trace with torch.profiler (default 5:3; 'none' for no trace)")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="tokens of one step over all data-parallel ranks (global batch x sequence length), for MFU")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks in the window (costly)")
    p.add_argument("--profile-memory", action="store_true", help="record allocations in the window (costly)")
    p.add_argument("--nsys", action="store_true", help="also run under Nsight Systems, capturing the window")
    p.add_argument("--no-nvml", action="store_true", help="do not sample GPUs with NVML")
    p.add_argument("--force", action="store_true", help="replace an earlier run directory")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND", help="the training command, after --")
    p.set_defaults(func=cmd_profile)
    return parser


def _fraction(text: str) -> float:
    """``2%`` or ``0.02``."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction (0.02) or a percentage (2%)") from None


def _add_ci(sub) -> None:
    ci = sub.add_parser("ci", help="gate CI on MFU: record runs into a history, check a run against it, plot the trend",
                        description="A run history per workload (JSON Lines), a deterministic gate on counters that "
                                    "do not depend on timing, and a noise-aware gate on MFU and step time "
                                    "(docs/ci.md).")
    cisub = ci.add_subparsers(dest="ci_command", metavar="CI_COMMAND")
    cisub.required = True
    where = ("run", {"type": Path, "metavar": "RUN_OR_REPORT",
                     "help": "a run directory (analyzed if needed) or a report.json"})
    hist_opt = {"type": Path, "required": True, "metavar": "DIR",
                "help": "the history: one <workload>.jsonl per workload"}
    workload = {"default": None, "help": "the workload's name (default: the run directory's name)"}

    p = cisub.add_parser("record", help="append a run to the history",
                         description="Append one record (commit, time, environment fingerprint, step samples, "
                                     "counters) to DIR/<workload>.jsonl.")
    p.add_argument(where[0], **where[1])
    p.add_argument("--history", **hist_opt)
    p.add_argument("--workload", **workload)
    p.add_argument("--commit", default=None, help="default: $GITHUB_SHA, else git rev-parse HEAD")
    p.add_argument("--branch", default=None, help="default: $GITHUB_HEAD_REF or $GITHUB_REF_NAME, else git's branch")
    p.add_argument("--time", default=None, help="ISO 8601 (default: now)")
    p.add_argument("--accept", action="store_true",
                   help="this run starts a new baseline (an intended change); the gates compare from it on")
    p.add_argument("--json", action="store_true", help="print the record")
    p.set_defaults(func=cmd_ci_record)

    p = cisub.add_parser("check", help="check a run against the history; exit 1 on a confirmed regression",
                         description="Deterministic gate (FLOPs, communication calls and bytes, kernel counts, "
                                     "predicted MFU) and statistical gate (MFU, step time) against the matching "
                                     "records. Exit 0 pass, 1 regression, 2 bad input.")
    p.add_argument(where[0], **where[1])
    p.add_argument("--history", **hist_opt)
    p.add_argument("--workload", **workload)
    p.add_argument("--branch", default="main", help="baseline records from this branch (default: main; 'any' for all)")
    p.add_argument("--max-mfu-drop", type=_fraction, default=0.02, metavar="FRACTION",
                   help="the floor of the statistical limit (MFU and step time): a smaller drop never fails "
                        "it (default 2%%); also the predicted-MFU counter's limit")
    p.add_argument("--summary-md", type=Path, default=None, metavar="FILE",
                   help="append the markdown summary here (default: $GITHUB_STEP_SUMMARY when set)")
    p.add_argument("--junit", type=Path, default=None, metavar="FILE", help="write JUnit XML here")
    p.add_argument("--html", type=Path, default=None, metavar="FILE",
                   help="write a self-contained HTML report with trend plots")
    p.add_argument("--confirm-runs", type=int, default=0, metavar="N",
                   help="a suspicious run is rerun up to N times in the job; a regression if every rerun violates too")
    p.add_argument("--rerun-command", default=None, metavar="CMD",
                   help="with --confirm-runs, for runs not of the reference trainer: a command that writes a run "
                        "directory at {out}")
    p.add_argument("--paired-with", type=Path, default=None, metavar="MAIN_RUN",
                   help="a pull request's check: a run of main's code trained in the same job right before this "
                        "one; the pair decides on step time (each run's 10%% quantile step), the history's rows "
                        "only advise, and --confirm-runs trains further pairs (docs/ci.md)")
    p.add_argument("--max-slowdown", type=_fraction, default=0.05, metavar="FRACTION",
                   help="with --paired-with: how much slower than main's run a pair may be at least (default "
                        "5%%; wider where the runs' own steps are noisier)")
    p.add_argument("--main-code", type=Path, default=None, metavar="DIR",
                   help="with --paired-with and --confirm-runs, or --pair-on-violation: where main's code is "
                        "installed (pip install --no-deps --target DIR); its runs run with DIR first on PYTHONPATH")
    p.add_argument("--main-rerun-command", default=None, metavar="CMD",
                   help="with --paired-with and --confirm-runs, or --pair-on-violation, for runs not of the "
                        "reference trainer: a command that trains main's code into a run directory at {out}")
    p.add_argument("--pair-on-violation", action="store_true",
                   help="a push's check: where the history calls this run slower, train the baseline's code "
                        "(--main-code: the parent commit's) from this run's manifest and let the pairs decide, as "
                        "on a pull request (docs/ci.md)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.set_defaults(func=cmd_ci_check)

    p = cisub.add_parser("trend", help="MFU, step time and counters over commits, as one HTML page",
                         description="Plot every workload's records (per environment) with regressions and change "
                                     "points marked.")
    p.add_argument("--history", **hist_opt)
    p.add_argument("--out", type=Path, required=True, help="the HTML file to write")
    p.add_argument("--workload", default=None, help="only this workload")
    p.add_argument("--branch", default="main", help="records of this branch (default: main; 'any' for all)")
    p.add_argument("--max-mfu-drop", type=_fraction, default=0.02, metavar="FRACTION")
    p.set_defaults(func=cmd_ci_trend)


def _branch(name: str | None) -> str | None:
    return None if name in (None, "any") else name


def cmd_ci_record(args: argparse.Namespace) -> int:
    from mfuscope.regression import commands
    return commands.record(args.run, args.history, args.workload, args.commit, args.branch, args.time, args.accept,
                           args.json)


def cmd_ci_check(args: argparse.Namespace) -> int:
    from mfuscope.regression import commands
    if args.confirm_runs < 0:
        raise UserInputError(f"--confirm-runs {args.confirm_runs}: give 0 or more reruns")
    return commands.check(args.run, args.history, args.workload, _branch(args.branch), args.max_mfu_drop,
                          args.summary_md, args.junit, args.html, args.confirm_runs, args.rerun_command, args.json,
                          paired_with=args.paired_with, main_code=args.main_code,
                          main_rerun_command=args.main_rerun_command, max_slowdown=args.max_slowdown,
                          pair_on_violation=args.pair_on_violation)


def cmd_ci_trend(args: argparse.Namespace) -> int:
    from mfuscope.regression import commands
    return commands.trend_page(args.history, args.out, args.workload, _branch(args.branch), args.max_mfu_drop)


def cmd_compare(args: argparse.Namespace) -> int:
    from mfuscope.analyzers.compare import compare, render

    if args.fail_on_mfu_drop is not None and not 0 <= args.fail_on_mfu_drop < 1:
        raise UserInputError(f"--fail-on-mfu-drop {args.fail_on_mfu_drop}: give a fraction between 0 and 1")
    result = compare(_report_of(args.base), _report_of(args.new), args.fail_on_mfu_drop)
    print(render(result, args.format))
    gate = result["gate"]
    if gate and gate.get("comparable") is False:
        print(f"mfuscope compare: {gate['reason']}", file=sys.stderr)
        return 2
    return 1 if gate and gate["failed"] else 0


def _report_of(path: str) -> dict:
    """A report.json, or a run directory's (analyzed now if it has none)."""
    from mfuscope.report import read_report
    from mfuscope.run_dir import REPORT, is_run_dir

    p = Path(path)
    if is_run_dir(p):
        if not (p / REPORT).exists():
            from mfuscope.optimizers.predicted_memory import analyze
            from mfuscope.run_dir import VIEWS

            analyze(p, p / REPORT, p / VIEWS)
        p = p / REPORT
    if not p.is_file():
        raise UserInputError("not a report.json or a run directory", p)
    return read_report(p)


def cmd_predict(args: argparse.Namespace) -> int:
    from mfuscope.optimizers import commands
    csvs = [r for r in args.runs if r.suffix == ".csv"]
    if csvs:
        if len(args.runs) > 1:
            raise UserInputError("give one CSV of runs, or run directories, not both or several CSVs", csvs[0])
        return commands.predict_csv(args.runs[0], args.out, args.hardware)
    return commands.predict_runs(args.runs, args.hardware, args.json)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from mfuscope.optimizers import commands
    return commands.calibrate(args.source, args.out, args.json)


def cmd_optimize(args: argparse.Namespace) -> int:
    from mfuscope.optimizers import commands
    return commands.optimize(args.run, args.apply, args.fixes, args.rounds, args.out, args.json, args.memory_gib,
                             args.first_win)


def cmd_plan(args: argparse.Namespace) -> int:
    from mfuscope.optimizers import commands
    return commands.plan(args.model, args.gpus, args.gpu, args.gpus_per_node, args.global_batch, args.seq_len,
                         args.dtype, args.top, args.hardware, args.json, args.power_limit_w, args.scaling,
                         args.fp8_recipe, args.fp8_scope, args.cp_comm, args.attention_kernel,
                         {"moe_overlap": args.moe_overlap, "moe_imbalance": args.moe_imbalance,
                          "moe_capacity_factor": args.moe_capacity_factor, "moe_dispatch": args.moe_dispatch})


def cmd_scaling(args: argparse.Namespace) -> int:
    from mfuscope.optimizers import scaling
    result = scaling.measured([scaling.load(p, say=lambda m: print(m, file=sys.stderr, flush=True))
                               for p in args.runs], args.mode)
    print(json.dumps(result, indent=2) if args.json else scaling.text(result))
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    if not args.runs_dir.is_dir():
        raise UserInputError("no such directory of runs (make one with mfuscope train/profile --out RUNS_DIR/NAME)",
                             args.runs_dir)
    try:
        from mfuscope.dashboard.app import serve
    except ImportError as e:
        raise UserInputError(f"the dashboard needs its extra: pip install 'mfuscope[dashboard]' ({e})") from None
    if args.history is not None and not args.history.is_dir():
        raise UserInputError("no such history directory (mfuscope ci record --history DIR makes one)", args.history)
    serve(args.runs_dir, host=args.host, port=args.port, debug=args.debug, history=args.history)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from mfuscope.collectors import wrap_command

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    rc = wrap_command.run(command, args.out, window=args.window, force=args.force,
                          tokens_per_step=args.tokens_per_step, nvml=not args.no_nvml, nsys=args.nsys,
                          with_stack=args.with_stack, profile_memory=args.profile_memory)
    print(f"run directory: {args.out}  (next: mfuscope info {args.out}; mfuscope analyze {args.out})",
          file=sys.stderr)
    return rc


def _check_train(opts, world_size: int) -> None:
    """Everything the ranks would check, checked here first: one message instead of one per rank.
    Torch-free (a second of CPU per run saved): torch is imported by the ranks, not here."""
    from mfuscope.layout import Degrees
    from mfuscope.pacing import parse_paced
    from mfuscope.reference_trainer.checks import check_run
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.faults import parse_faults
    from mfuscope.window import parse_window

    parse_window(opts.window)
    parse_faults(opts.inject)
    parse_paced(opts.paced)
    cfg = load_config(opts.config, steps=opts.steps, microbatches=opts.microbatches, **opts.overrides)
    check_run(cfg, Degrees.parse(opts.layout, world_size), opts)


def cmd_train(args: argparse.Namespace) -> int:
    import subprocess

    from mfuscope import run_dir
    from mfuscope.reference_trainer.launch import torchrun_command
    from mfuscope.trainer_options import TrainerOptions

    if args.nproc < 1 or args.nnodes < 1:
        raise UserInputError(f"--nproc {args.nproc} and --nnodes {args.nnodes} must be at least 1")
    opts = TrainerOptions.from_args(args, launcher=True, window=args.window or ("1:" if args.profile else None),
                                    out=str(args.out))
    if opts.launcher == "fork" and (args.nnodes > 1 or args.rdzv_endpoint):
        raise UserInputError("--launcher fork starts the ranks on this node only; use torchrun (the default) "
                             "with --nnodes and --rdzv-endpoint")
    _check_train(opts, args.nproc * args.nnodes)  # a bad setting fails here, once, not in every rank
    run_dir.prepare(args.out, args.force)
    if opts.launcher == "fork":
        return _train_forked(opts, args.nproc, args.out)
    cmd = torchrun_command(args.nproc, opts.to_argv(), nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint)
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.call(cmd, env={**os.environ, run_dir.ENV_PREPARED: str(args.out.resolve())})
    if rc != 0:
        print(f"mfuscope: error: {_why_training_failed(args.out, f'torchrun exit {rc}')}", file=sys.stderr)
        return rc
    print(f"run directory: {args.out}")
    return 0


def _train_forked(opts: TrainerOptions, nproc: int, out: Path) -> int:
    """``--launcher fork``: this process imports torch once and forks the ranks (no torchrun agent,
    no interpreter start a rank).  A failure prints each failed rank's report, then the one line."""
    from mfuscope import run_dir
    from mfuscope.reference_trainer.launch import RanksFailed, fork_ranks
    from mfuscope.reference_trainer.train import run_rank

    print(f"+ forking {nproc} rank(s) of the reference trainer", file=sys.stderr, flush=True)
    before = os.environ.get(run_dir.ENV_PREPARED)
    os.environ[run_dir.ENV_PREPARED] = str(out.resolve())  # the ranks inherit it, as torchrun's would
    try:
        fork_ranks(run_rank, nproc, opts, timeout=None)
    except RanksFailed as e:
        print(e, file=sys.stderr)
        how = f"{e.failed} of {e.world} forked ranks failed, rank {e.first} first"
        print(f"mfuscope: error: {_why_training_failed(out, how)}", file=sys.stderr)
        return 1
    finally:  # an in-process caller (the demo, a test) keeps its own environment
        if before is None:
            os.environ.pop(run_dir.ENV_PREPARED, None)
        else:
            os.environ[run_dir.ENV_PREPARED] = before
    print(f"run directory: {out}")
    return 0


def _why_training_failed(out: Path, how: str) -> str:
    """One line: where the job's collectives stopped -- from its ranks' write-ahead records or
    Flight Recorder dumps -- else how the launcher saw it end (``how``: torchrun's exit code, or the
    fork launcher's first failed rank)."""
    from mfuscope import run_dir
    from mfuscope.analyzers import hang

    failed = f"training failed ({how})"
    out = Path(out)
    if not ((out / hang.RECORDS).is_dir() or (out / hang.FOLDER).is_dir()):
        return failed
    try:
        manifest = run_dir.read_manifest(out) or {}
        result = hang.diagnose(*hang.read_dumps(out), hang.run_group_dims(out))
    except UserInputError:
        return failed
    lines = hang.format_text(result).splitlines()
    if result["fatal"] and lines[0].startswith("rank "):  # a crash, no desync to explain it: the story
        return f"{failed}: {lines[0]} -- `mfuscope hang {out}` has every group"
    if not any(g["state"] == "hung" for g in result["groups"]):
        return failed
    first = next(i for i, line in enumerate(lines) if line.startswith("group "))
    where = lines[first] + (f"; {lines[first + 1].strip()}" if first + 1 < len(lines)
                            and lines[first + 1].startswith("  ") else "")
    # The manifest keeps the first rank's reason only; a peer's "connection closed" can come first
    # when a timed-out rank leaves.  Peers left waiting in a run with a collective timeout: it timed out.
    waiting = any(c["class"] in ("never_entered", "not_completed")
                  for g in result["groups"] if g["state"] == "hung" for c in g["culprits"])
    timed_out = "timed out" in (manifest.get("ended_reason") or "").lower() or (
        waiting and (manifest.get("trainer") or {}).get("collective_timeout"))
    what = "the job hung (a collective timed out)" if timed_out else "the job stopped in a collective"
    return f"{what}: {where} -- `mfuscope hang {out}` has every group"


def cmd_info(args: argparse.Namespace) -> int:
    from mfuscope.analyzers import map_reduce, run_info, trace_info
    from mfuscope.run_dir import TRACES, is_run_dir

    run = run_info.summarize(args.path) if is_run_dir(args.path) else None
    if run is not None and not (Path(args.path) / TRACES).is_dir():
        info = {"run": run}  # no window was recorded (or the run ended before it)
        print(json.dumps(info, indent=2) if args.json else run_info.format_text(run) + "\ntraces       none")
        return 0
    info, skipped = map_reduce.info_ranks(args.path, rank=args.rank, step_annotation=args.step_annotation,
                                          use_cache=not args.no_cache, skip_bad=args.skip_bad, workers=args.workers,
                                          allow_mixed=args.allow_mixed, layout=args.layout,
                                          rank_order=args.rank_order, scheduler=args.scheduler)
    for _, reason in skipped:
        print(f"mfuscope: skipped {reason}", file=sys.stderr)
    info["skipped"] = [{"file": f, "reason": r} for f, r in skipped]
    if run is not None:
        info = {"run": run, **info}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        if run is not None:
            print(run_info.format_text(run))
        print(trace_info.format_text(info))
        for _, r in skipped:
            print(f"skipped      {r}")
    return 0


def cmd_hang(args: argparse.Namespace) -> int:
    from mfuscope.analyzers import hang

    if not Path(args.path).exists():
        raise UserInputError("no such file or directory", args.path)
    dumps, world = hang.read_dumps(args.path)
    result = hang.diagnose(dumps, world, hang.run_group_dims(args.path))
    print(json.dumps(result, indent=2) if args.json else hang.format_text(result))
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from mfuscope.analyzers import memory

    result = memory.read_any(args.path)
    print(json.dumps(result, indent=2) if args.json else memory.file_text(result))
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from mfuscope.analyzers import nccl_tests, overview
    from mfuscope.optimizers.predicted_memory import analyze
    from mfuscope.run_dir import REPORT, VIEWS, is_run_dir

    run = is_run_dir(args.path)
    out = args.out or (Path(args.path) / REPORT if run else Path("mfuscope-report.json"))
    _check_overwrite(out, args.force)
    references = nccl_tests.read_all(args.nccl_tests)  # a bad file fails before the traces load
    # A run directory keeps the dashboard's views beside its report.
    report, result = analyze(args.path, out, Path(args.path) / VIEWS if run else None, nccl_tests=references,
                             rank=args.rank,
                             step_annotation=args.step_annotation, use_cache=not args.no_cache,
                             skip_bad=args.skip_bad, workers=args.workers, allow_mixed=args.allow_mixed,
                             layout=args.layout, rank_order=args.rank_order, scheduler=args.scheduler)
    for _, reason in result.skipped:
        print(f"mfuscope: skipped {reason}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(overview.format_text(report))
        if run and report.get("findings"):
            from mfuscope.optimizers import commands
            print(commands.model_gains_text(Path(args.path), report))
        print(f"\nreport written to {out}")
    if args.predict:
        if not run:
            raise UserInputError("--predict needs a run directory (its manifest has the model spec)", args.path)
        from mfuscope.optimizers import commands
        print("\n" + commands.predict_run_text(Path(args.path), args.hardware),
              file=sys.stderr if args.json else sys.stdout)
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
    from mfuscope.lean_imports import jsonschema_without_iri
    jsonschema_without_iri()
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
    except OSError as e:  # a path the user gave, or their disk: one line, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"mfuscope: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2



if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
