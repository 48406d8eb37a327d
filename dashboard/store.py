"""The runs a dashboard shows, and their analyses: found on disk, analyzed once, held in memory.

A *run* is a child of the runs directory that is a run directory (has
``manifest.json``) or a directory of trace files (a corpus set, a cluster's
dump); the runs directory itself may be one.  Its analysis is ``report.json``
plus ``views/``: inside a run directory (where ``mfuscope analyze`` puts them),
or for a trace directory -- which may be read-only -- in the cache directory,
keyed by its resolved path.  An analysis older than its inputs (a run that was
still going, traces copied in again) is stale and redone.  A run with no
analysis is analyzed once, in a background thread (one at a time: analysis
already uses every core), and pages show its progress.  Anything wrong with a
run -- an unreadable manifest, a bad trace, a failed analysis -- is kept as
that run's error message; other runs are unaffected.

The cost model calibrated on a run (its fitted profile, predicted step and
the fixes' proposals) is fitted once per version of the run's report and
kept: the Overview and the Optimize page both show it, and a re-analyzed run
is fitted again.
"""
from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import logging
import os
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from mfuscope import run_dir
from mfuscope.analyzers import analysis, rank_lists, trace_cache, trace_set
from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest
from mfuscope.optimizers import measured, optimize, predicted_memory
from mfuscope.optimizers.model import Prediction
from mfuscope.optimizers.system import Profile
from mfuscope.report import read_report

log = logging.getLogger("mfuscope.dashboard")

#: Analyses (reports and their views' rank and step lists) kept in memory; older ones are read again.
KEEP_LOADED = 6


@dataclass
class Run:
    id: str                      # the directory's name: what URLs carry
    path: Path
    kind: str                    # "run" (a run directory) or "traces"
    manifest: dict | None = None
    error: str | None = None     # why the run cannot be shown

    @property
    def analysis_dir(self) -> Path:
        inside = self.kind == "run" and (os.access(self.path, os.W_OK) or (self.path / run_dir.REPORT).is_file())
        if inside:
            return self.path
        digest = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
        return trace_cache.cache_dir() / "dashboard" / f"{self.path.name}-{digest}"

    @property
    def report_path(self) -> Path:
        return self.analysis_dir / run_dir.REPORT

    @property
    def views_dir(self) -> Path:
        return self.analysis_dir / run_dir.VIEWS

    @property
    def has_traces(self) -> bool:
        """A run directory records traces only in its window (``--window`` / ``--profile``)."""
        return self.kind == "traces" or (self.path / run_dir.TRACES).is_dir()

    def inputs_mtime(self) -> float:
        """When what the analysis reads last changed (manifest, trace files)."""
        files = [self.path / run_dir.MANIFEST] if self.kind == "run" else []
        traces = self.path / run_dir.TRACES if self.kind == "run" else self.path
        if traces.is_dir():
            files += [f for f in traces.iterdir() if trace_set.is_trace_file(f)]
        return max((f.stat().st_mtime for f in files if f.exists()), default=0.0)


@dataclass
class Analysis:
    """A run's report and where its views are.  Pages read from the views what they draw (one
    step, some ranks), never every rank's events: a 1,024-rank run's views are hundreds of MB."""

    report: dict[str, Any]
    views_dir: Path
    ranks: list[int]   # the ranks the timeline view has
    steps: list[int]   # the steps it has

    def segments(self, step: int | None = None, ranks=None) -> pd.DataFrame:
        """Timeline segments of ``step`` of ``ranks`` (all when None)."""
        return analysis.read_segments(self.views_dir, step, ranks)

    def microbatches(self, step: int | None = None, columns: list[str] | None = None) -> pd.DataFrame:
        """The executed pipeline schedule of ``step`` (all steps when None)."""
        return analysis.read_microbatches(self.views_dir, step, columns)

    def whole(self, key: str) -> pd.DataFrame:
        """Every rank's rows of a per-rank list of the report (which may hold only the worst ranks)."""
        return rank_lists.whole(self.report, self.views_dir, key)


@dataclass(frozen=True)
class CostModel:
    """The cost model calibrated on one run (``optimize.propose``): the measured run, its base
    prediction, the profile fitted to it and the fixes' proposals, best first."""

    run: measured.MeasuredRun
    base: Prediction
    profile: Profile
    proposals: tuple[optimize.Proposal, ...]

    def best_by_fix(self) -> dict[str, optimize.Proposal]:
        """Each fix id's most promising change that fits, from the proposals made once."""
        return optimize.best_by_fix(self.proposals)


@dataclass
class Job:
    fraction: float = 0.0
    message: str = "queued"
    error: str | None = None
    done: bool = False


@dataclass
class Store:
    root: Path
    jobs: dict[str, Job] = field(default_factory=dict)
    _loaded: OrderedDict[str, tuple[float, Analysis]] = field(default_factory=OrderedDict)
    _reports: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    _models: dict[str, tuple[float, CostModel]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _fitting: threading.Lock = field(default_factory=threading.Lock)
    _one_at_a_time: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()  # "." and ".." name no run

    # ------------------------------------------------------------ discovery
    def runs(self) -> list[Run]:
        """Every run under the root, sorted by name; broken ones carry their error."""
        if not self.root.is_dir():
            raise UserInputError("not a directory", self.root)
        children = sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        described = [r for r in (self._describe(p) for p in children) if r is not None]
        if described or not _looks_like_run(self.root):
            return described
        return [self._describe(self.root)]

    def run(self, run_id: str) -> Run | None:
        """The run named ``run_id``: a direct child of the root, or the root itself when it is one."""
        if "/" in run_id or run_id.startswith(".") or not run_id:
            return None
        if (self.root / run_id).is_dir():
            return self._describe(self.root / run_id)
        if run_id == self.root.name:
            return next((r for r in self.runs() if r.path == self.root), None)
        return None

    def _describe(self, path: Path) -> Run | None:
        if run_dir.is_run_dir(path):
            run = Run(path.name, path, "run")
            try:
                run.manifest = run_dir.read_manifest(path)
            except UserInputError as e:
                run.error = str(e)
            except Exception as e:  # noqa: BLE001 -- one bad run never takes the page down
                run.error = f"{path / run_dir.MANIFEST}: {e}"
            return run
        if _looks_like_run(path):
            return Run(path.name, path, "traces")
        return None

    # ------------------------------------------------------------ analyses
    def analyzed(self, run: Run) -> bool:
        """A report and its views on disk, newer than the run's inputs."""
        try:
            return (run.views_dir.is_dir() and run.report_path.is_file()
                    and run.report_path.stat().st_mtime >= run.inputs_mtime())
        except OSError:
            return False

    def report(self, run: Run) -> dict[str, Any]:
        """The run's report.json, read once per version (the runs page and compare need no views)."""
        mtime = run.report_path.stat().st_mtime
        with self._lock:
            hit = self._reports.get(run.id)
        if hit is None or hit[0] != mtime:
            hit = (mtime, read_report(run.report_path))
            with self._lock:
                self._reports[run.id] = hit
        return hit[1]

    def summary(self, run: Run) -> dict[str, Any] | None:
        """The report's summary if the run was analyzed."""
        if run.error or not self.analyzed(run):
            return None
        try:
            return self.report(run)["summary"]
        except Exception as e:  # noqa: BLE001 -- shown as this run's error
            run.error = str(e)
            return None

    def load(self, run: Run) -> Analysis:
        """The run's report and views, read once per version of its report; the last
        ``KEEP_LOADED`` stay in memory."""
        mtime = run.report_path.stat().st_mtime
        with self._lock:
            hit = self._loaded.get(run.id)
            if hit and hit[0] == mtime:
                self._loaded.move_to_end(run.id)
                return hit[1]
        loaded = Analysis(self.report(run), run.views_dir, analysis.view_ranks(run.views_dir),
                          analysis.view_steps(run.views_dir))
        with self._lock:
            self._loaded[run.id] = (mtime, loaded)
            while len(self._loaded) > KEEP_LOADED:
                self._loaded.popitem(last=False)
        return loaded

    def cost_model(self, run: Run) -> CostModel:
        """The cost model calibrated on ``run`` (a run whose manifest has the model spec), fitted
        once per version of its report.  Raises what ``measured.from_documents`` and
        ``optimize.propose`` raise for a run they cannot model."""
        mtime = run.report_path.stat().st_mtime
        with self._fitting:  # pages rendered at once wait for one fit rather than each making it
            hit = self._models.get(run.id)
            if hit is None or hit[0] != mtime:
                measured_run = measured.from_documents(self.report(run), run.manifest, run.path)
                base, profile, proposals = optimize.propose(measured_run)
                hit = self._models[run.id] = (mtime, CostModel(measured_run, base, profile, tuple(proposals)))
        return hit[1]

    def ensure_analysis(self, run: Run) -> Job | None:
        """None when the analysis is on disk; else the (started) job producing it."""
        if self.analyzed(run) and run.id not in self.jobs:
            return None
        with self._lock:
            job = self.jobs.get(run.id)
            if job is None:
                job = self.jobs[run.id] = Job()
                threading.Thread(target=self._analyze, args=(run, job), daemon=True,
                                 name=f"analyze-{run.id}").start()
        if job.done and job.error is None:
            with self._lock:
                self.jobs.pop(run.id, None)
            return None
        return job

    def forget_failure(self, run: Run) -> None:
        """Let a failed analysis run again (the run may have been fixed or finished since)."""
        with self._lock:
            job = self.jobs.get(run.id)
            if job is not None and job.error is not None:
                del self.jobs[run.id]

    def _analyze(self, run: Run, job: Job) -> None:
        def progress(fraction: float, message: str) -> None:
            job.fraction, job.message = fraction, message

        with self._one_at_a_time:
            try:
                run.analysis_dir.mkdir(parents=True, exist_ok=True)
                predicted_memory.analyze(run.path, run.report_path, run.views_dir, on_progress=progress,
                                         progress=False)
            except UserInputError as e:
                job.error = str(e)
            except Exception as e:  # noqa: BLE001 -- shown on the run's page, logged with its traceback
                log.exception("analysis of %s failed", run.path)
                job.error = f"{run.path}: analysis failed: {type(e).__name__}: {e}"
            finally:
                job.done = True


def _looks_like_run(path: Path) -> bool:
    """A run directory, or a directory with trace files directly in it (subfolders are other runs)."""
    return run_dir.is_run_dir(path) or any(_is_trace(f) for f in path.iterdir())


def _is_trace(path: Path) -> bool:
    """A trace by its content, not only its name: a config.json or a report beside runs is not one."""
    if not trace_set.is_trace_file(path):
        return False
    if path.name.endswith(".sqlite"):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        if head[:2] == b"\x1f\x8b":
            with gzip.open(path, "rb") as g:
                head = g.read(1 << 16)
    except (OSError, EOFError, zlib.error):
        return True  # unreadable: let the analysis say what is wrong with it
    return any(key in head for key in (b'"traceEvents"', b'"schemaVersion"', b'"deviceProperties"'))


def manifest_text(manifest: dict | None) -> dict[str, str]:
    """Date, config and layout of a run, for the runs table."""
    if not manifest:
        return {"date": "", "config": "", "layout": ""}
    m = Manifest.of(manifest)
    model = m.model or {}
    config = model.get("family") or ""
    if model.get("dim"):
        config += f" d{model['dim']}×{model.get('n_layers', '?')}L"
        if model.get("n_experts"):
            config += f" {model['n_experts']}E"
    layout = ", ".join(f"{k}={v}" for k, v in m.layout.items() if v != 1)  # any mesh's names, as recorded
    sched = m.schedule
    if sched.get("name"):
        layout += f" ({sched['name']}, m={sched.get('microbatches')})"
    return {"date": m.start_time.replace("T", " ")[:19], "config": config.strip(),
            "layout": layout or "single rank"}


def trace_set_text(run: Run) -> dict[str, str]:
    """Date (newest file) and size of a directory of traces, for the runs table."""
    files = [f for f in run.path.iterdir() if trace_set.is_trace_file(f)]
    newest = max((f.stat().st_mtime for f in files), default=None)
    date = dt.datetime.fromtimestamp(newest, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if newest else ""
    return {"date": date, "config": f"trace set, {len(files)} file(s)", "layout": ""}


def status_text(run: Run, manifest: dict | None) -> str:
    if run.error:
        return "error"
    if manifest is None:
        return "traces"
    m = Manifest.of(manifest)
    return m.status.replace("_", " ") + (f": {m.ended_reason}" if m.ended_reason else "")
