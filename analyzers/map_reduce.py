"""Analyze a trace set rank by rank: each rank summarized in a worker, the summaries reduced here.

The map task (:func:`map_batch`) loads a rank's file (from the cache, or parsed and cached),
places its process groups, summarizes it (:mod:`.rank_summary`) and writes its parts of the
views; only the summary comes back.  Small files go several to a task (:func:`batches`), their
ranks summarized together: a small rank's analysis is mostly the fixed cost of its frames.  The
parent (:func:`analyze_ranks`) folds summaries as they finish, then reduces them to the report
(:func:`.overview.reduce`): its memory grows with the summaries, not with the events.  The
executor is any ``concurrent.futures`` one (:mod:`.executor`): the local pool by default.

A worker that dies (killed for memory, a crash in a native library) breaks the local pool; its
unfinished ranks are then tried again one at a time in a fresh pool, so the rank that kills a
worker alone is named in the error, and the others still finish.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import warnings
from concurrent.futures import Executor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
from tqdm import tqdm

from mfuscope import atomic, run_dir
from mfuscope.errors import UserInputError
from mfuscope.event_table import EventTable

from . import (
    breakdown,
    cluster,
    collective_match,
    comm_stats,
    executor,
    group_dims,
    heap,
    overview,
    rank_lists,
    rank_summary,
    timeline,
    trace_cache,
    trace_info,
    trace_set,
)

#: Summaries folded into the running sums at a time (rank_summary.collapse).
COLLAPSE_EVERY = 8
#: What a summary's calls are once spooled (one frame, shared).
_NO_CALLS = pd.DataFrame(columns=comm_stats.MATCH_COLUMNS)
#: The view the parent writes: the executed pipeline schedule of every rank.
MICROBATCHES = "microbatches.parquet"
#: Fault injection for the tests: a worker whose file name contains this value kills itself.
ENV_KILL_WORKER = "MFUSCOPE_FAULT_KILL_WORKER"
#: What a worker needs of the parent's environment (a fork server started earlier has its own).
_ENV = ("MFUSCOPE_CACHE_DIR", "XDG_CACHE_HOME", "HOME", ENV_KILL_WORKER)


@dataclass(frozen=True)
class RankJob:
    """One file to summarize, and what of the job it needs."""

    file: Path
    rank: int | None
    step_annotation: str | None
    use_cache: bool
    known_key: str | None
    layout: str | None
    rank_order: str | None
    manifest: dict[str, Any] | None
    run: str | None
    world: int | None
    views_dir: str | None
    env: tuple[tuple[str, str], ...]


@dataclass
class MapResult:
    summaries: list[Any]  # what the task makes of each rank in the file: a RankSummary, or an info part
    error: str | None
    key: str | None
    cached: bool
    bytes: int


@contextlib.contextmanager
def _object_strings():
    """pandas' string columns as Python objects while a rank is summarized: pandas 3 backs them with
    Arrow, whose per-call cost dominates the hundreds of small frames one rank's analyses make (a
    small trace's rank: 112 -> 79 ms).  For the task only, so a process that imports mfuscope keeps
    its own settings.  pandas 3 deprecates the switch (said once a call, silenced here); where it is
    gone the task runs with Arrow strings, slower and the same."""
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.filterwarnings("ignore", message=".*infer_string.*")
        with contextlib.suppress(KeyError, pd.errors.OptionError):
            stack.enter_context(pd.option_context("future.infer_string", False))
        yield


def map_rank(job: RankJob) -> MapResult:
    """Load, summarize and write the views of the rank(s) in ``job.file`` (a worker's task)."""
    (result,) = map_batch((job,))
    return result


def map_batch(jobs: tuple[RankJob, ...]) -> list[MapResult]:
    """:func:`map_rank` of several files in one task: their ranks summarized together
    (:func:`.rank_summary.summarize_ranks`), each file's load failing alone.  What a rank's
    analyses cost apart from its events -- some 50 ms of small frames on 2 cores -- is then paid
    once a batch, which on a job of thousands of small traces was most of the map."""
    loaded = [_load(job) for job in jobs]
    results = [result for _, result in loaded]
    parts: list[tuple[int, int, EventTable]] = []  # (the job's position, rank, its events)
    with _object_strings():
        for i, (job, (events, _)) in enumerate(zip(jobs, loaded)):
            if events is None:
                continue
            events = group_dims.assign(events, group_dims.RankLayout.parse(job.layout, job.rank_order))
            parts += [(i, rank, part) for rank, part in overview.split_ranks(events).items()]
        for group in _summarized_together(parts):
            job = jobs[group[0][0]]
            ranks = [rank for _, rank, _ in group]
            summaries = rank_summary.summarize_ranks(
                EventTable.concat([part for _, _, part in group]), job.manifest,
                run_comm=_run_comm(job.run, ranks) if job.run else None, world=job.world, views_dir=job.views_dir,
                run=job.run)
            at = {rank: i for i, rank, _ in group}
            for s in summaries:
                s.file, s.cached = str(jobs[at[s.rank]].file), results[at[s.rank]].cached
                results[at[s.rank]].summaries.append(s)
    return results


def _summarized_together(parts: list[tuple[int, int, EventTable]]) -> list[list[tuple[int, int, EventTable]]]:
    """``parts`` in the groups one :func:`.rank_summary.summarize_ranks` takes: each rank once in
    a group (two files that claim one rank stay two summaries, which the job's check refuses)."""
    groups: list[list[tuple[int, int, EventTable]]] = [[]]
    for item in parts:
        if any(rank == item[1] for _, rank, _ in groups[-1]):
            groups.append([])
        groups[-1].append(item)
    return [g for g in groups if g]


def info_rank(job: RankJob) -> MapResult:
    """What the rank(s) in ``job.file`` hold (``mfuscope info``'s task: :func:`.trace_info.rank_info`)."""
    events, result = _load(job)
    if events is not None:
        result.summaries = [trace_info.rank_info(part) for part in overview.split_ranks(events).values()]
    return result


def info_batch(jobs: tuple[RankJob, ...]) -> list[MapResult]:
    """:func:`info_rank` of each of ``jobs``."""
    return [info_rank(job) for job in jobs]


def _load(job: RankJob):
    """(the file's events or None, its MapResult with no summaries yet)."""
    os.environ.update(dict(job.env))
    kill = os.environ.get(ENV_KILL_WORKER)
    if kill and kill in job.file.name:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        size = job.file.stat().st_size
        with open(job.file, "rb"):
            pass
    except OSError as e:  # on a cluster's worker: the traces are not where this process sees them
        return None, MapResult([], f"{job.file}: cannot be read on host {socket.gethostname()} ({e.strerror}); "
                               "workers on other machines need the traces at the same path", None, False, 0)
    heap.give_back()  # what the worker's previous rank left
    events, error, key, cached = trace_set.load_file(job.file, job.rank, job.step_annotation, job.use_cache,
                                                     job.known_key)
    heap.give_back()  # the parse's buffers, before the analyses convert columns
    return events, MapResult([], error, key, cached, size)


def _run_comm(run: str, ranks: list[int]):
    """The collectors' communication rows of some ranks (a filtered read of ``comm.parquet``)."""
    path = Path(run) / run_dir.COMM
    if not path.exists():
        return None
    return ds.dataset(path, format="parquet").to_table(filter=ds.field("rank").isin(ranks)).to_pandas()


def analyze_ranks(path: str | os.PathLike, *, views_dir: str | Path | None = None, rank: int | None = None,
                  step_annotation: str | None = None, use_cache: bool = True, skip_bad: bool = False,
                  workers: int | None = None, progress: bool | None = None, on_file=None,
                  allow_mixed: bool = False, layout: str | None = None, rank_order: str | None = None,
                  pool: Executor | None = None, scheduler: str | None = None, nccl_tests: list | None = None,
                  files: tuple[list[tuple[Path, int | None]], list[tuple[str, str]]] | None = None,
                  ) -> tuple[dict[str, Any], list[Path], list[tuple[str, str]], int]:
    """The report of every rank under ``path``: (report, files, skipped (file, reason), ranks from
    the cache).  Options as :func:`.trace_set.load`; ``views_dir``: where the ranks' views are
    written; ``pool``: an executor to run the map on (default: a local pool of ``workers``, or the
    Dask cluster at ``scheduler`` -- :mod:`.cluster`);
    ``files``: :func:`.trace_set.rank_files` of ``path`` where the caller has it."""
    group_dims.RankLayout.parse(layout, rank_order)  # bad flags fail before any file is read
    files, skipped = files or trace_set.rank_files(path, rank, skip_bad)
    files = _for_workers(files, scheduler if pool is None else None)
    is_run = run_dir.is_run_dir(path)
    manifest = run_dir.read_manifest(path) if is_run else None
    # The job's world size where no trace states it (ranks of one job agree: checked after the map).
    head = trace_set.peek_header(files[0][0]) if files and files[0][0].suffix != ".sqlite" else {}
    world = overview.job_world({0: head}, manifest) or len(files)
    run = str(Path(path).absolute()) if is_run else None  # a worker has its own working directory
    jobs = _jobs(files, step_annotation, use_cache, layout, rank_order, manifest, run, world, views_dir)
    started = time.perf_counter()
    summaries: list[rank_summary.RankSummary] = []
    carrier: list[rank_summary.RankSummary] = []  # the summary the others are folded into
    fresh: list[rank_summary.RankSummary] = []    # summaries not folded yet
    calls = collective_match.CallSpool(len(jobs))

    def take(arrived: list[rank_summary.RankSummary]) -> None:
        for s in arrived:  # the calls to their partitions on disk, not kept a rank
            calls.add(s.calls)
            s.calls = _NO_CALLS
        summaries.extend(arrived)
        fresh.extend(arrived)
        if len(fresh) >= COLLAPSE_EVERY:  # folded into one summary as they come
            rank_summary.collapse([carrier[0], *fresh] if carrier else fresh)
            carrier[:] = carrier or fresh[:1]
            fresh.clear()

    try:
        cached = _map(jobs, map_batch, take, workers, pool, progress, on_file, skipped, skip_bad, scheduler=scheduler)
        mapped = time.perf_counter()
        if jobs or not trace_set.untraced_run(path):
            _check_job([(s.rank, s.file, s.meta) for s in summaries], skipped, Path(path), allow_mixed)
    except BaseException:
        calls.close()
        raise
    job_by_file = {str(j.file): j for j in jobs}
    job_of = {s.rank: job_by_file[s.file] for s in summaries}

    def plan_of(r: int):
        """A named late rank's plan: its events read again (from the cache: it was just filled)."""
        job = job_of.get(r)
        if job is None:
            return None
        events, _, _, _ = trace_set.load_file(job.file, job.rank, step_annotation, use_cache)
        if events is None:
            return None
        events = group_dims.assign(events, group_dims.RankLayout.parse(layout, rank_order))
        part = overview.split_ranks(events).get(r)
        return next((plan for _, _, _, plan in breakdown.step_plans(part)), None) if part is not None else None

    if views_dir is not None:
        mb = rank_summary.stacked([s.microbatches for s in summaries], timeline.MICROBATCH_COLUMNS)
        atomic.write_parquet(Path(views_dir) / MICROBATCHES, pa.Table.from_pandas(mb, preserve_index=False))
    report = overview.reduce(summaries, manifest, source=str(path), files=sorted({s.file for s in summaries}),
                             run=path if is_run else None, nccl_tests=nccl_tests, plan_of=plan_of, calls=calls)
    rank_lists.cap(report, views_dir)
    report["provenance"]["timings"] = {"map_s": mapped - started, "reduce_s": time.perf_counter() - mapped,
                                       "workers": getattr(pool, "workers", None)
                                       or executor.default_workers(len(jobs), workers),
                                       "scheduler": cluster.scheduler_address(scheduler)}
    return report, sorted({Path(s.file) for s in summaries}), skipped, cached


def info_ranks(path: str | os.PathLike, *, rank: int | None = None, step_annotation: str | None = None,
               use_cache: bool = True, skip_bad: bool = False, workers: int | None = None,
               progress: bool | None = None, allow_mixed: bool = False, layout: str | None = None,
               rank_order: str | None = None, scheduler: str | None = None,
               ) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``mfuscope info`` of every rank under ``path``, mapped rank by rank as an analysis is (no
    rank's events reach the parent): (:func:`.trace_info.combine` of the ranks, skipped files).
    ``layout``/``rank_order`` are only checked (what info shows does not depend on them)."""
    group_dims.RankLayout.parse(layout, rank_order)
    files, skipped = trace_set.rank_files(path, rank, skip_bad)
    jobs = _jobs(_for_workers(files, scheduler), step_annotation, use_cache, None, None, None, None, None, None)
    parts: list[dict[str, Any]] = []
    _map(jobs, info_batch, parts.extend, workers, None, progress, None, skipped, skip_bad, desc="reading ranks",
         scheduler=scheduler)
    _check_job([(p["rank"], p["file"], p) for p in parts], skipped, Path(path), allow_mixed)
    return trace_info.combine(parts), skipped


def _for_workers(files: list[tuple[Path, int | None]], scheduler: str | None) -> list[tuple[Path, int | None]]:
    """The files as a cluster's workers must name them: absolute (a worker has its own working directory)."""
    if not cluster.scheduler_address(scheduler):
        return files
    return [(f.absolute(), r) for f, r in files]


def _jobs(files: list[tuple[Path, int | None]], step_annotation: str | None, use_cache: bool, layout: str | None,
          rank_order: str | None, manifest: dict | None, run: str | None, world: int | None,
          views_dir: str | Path | None) -> list[RankJob]:
    index = trace_cache.read_index() if use_cache else {}
    env = tuple((k, os.environ[k]) for k in _ENV if k in os.environ)
    jobs = []
    for f, r in files:
        sig = trace_cache.stat_signature(f, r, step_annotation) if use_cache else None
        jobs.append(RankJob(f, r, step_annotation, use_cache, index.get(sig) if sig else None, layout, rank_order,
                            manifest, run, world, str(Path(views_dir).absolute()) if views_dir is not None else None,
                            env))
    return jobs


def _check_job(ranks: list[tuple[int, str, dict]], skipped: list[tuple[str, str]], path: Path,
               allow_mixed: bool) -> None:
    """Something loaded, no two files claim a rank, and the ranks are of one job."""
    if not ranks:
        reasons = "; ".join(r for _, r in skipped)
        raise UserInputError(f"no trace could be loaded: {reasons}", path)
    seen: dict[int, str] = {}
    for rank, file, _ in ranks:
        if rank in seen:
            raise UserInputError(f"two files claim rank {rank}: {Path(seen[rank]).name} and {Path(file).name}", path)
        seen[rank] = file
    trace_set.check_one_job({rank: {**meta, "file": file} for rank, file, meta in ranks}, path, allow_mixed)


def _map(jobs: list[RankJob], task, take, workers: int | None, pool: Executor | None, progress: bool | None,
         on_file, skipped: list[tuple[str, str]], skip_bad: bool, desc: str = "analyzing ranks",
         scheduler: str | None = None) -> int:
    """Run ``task`` (:func:`map_batch` or :func:`info_batch`) on every job, in batches of small
    files (:func:`batches`), handing each file's ranks to ``take`` as they finish; the cache index
    learns the files parsed.  Returns how many files came from the cache.  The map runs on
    ``pool``, else on the Dask cluster at ``scheduler`` (or ``DASK_SCHEDULER_ADDRESS``), else on a
    local pool of ``workers``."""
    learned: dict[str, str] = {}
    cached = 0
    show = progress if progress is not None else sys.stderr.isatty()
    bar = tqdm(total=len(jobs), desc=desc, unit="rank", disable=not show, file=sys.stderr)
    started, read = time.monotonic(), 0

    def fold(job: RankJob, result: MapResult) -> None:
        nonlocal cached, read
        bar.update()
        read += result.bytes
        bar.set_postfix_str(f"{read / 2**20 / max(time.monotonic() - started, 1e-9):.0f} MB/s", refresh=False)
        if on_file is not None:
            on_file(bar.n, len(jobs))
        if result.key is not None and result.error is None and job.use_cache:
            learned[trace_cache.stat_signature(job.file, job.rank, job.step_annotation)] = result.key
        cached += result.cached
        if result.error is None:
            take(result.summaries)
        elif skip_bad:
            skipped.append((str(job.file), result.error))
        else:
            error = result.error
            raise UserInputError(error.split(": ", 1)[1] if error.startswith(str(job.file)) else error, job.file)

    n = executor.default_workers(len(jobs), workers)
    address = cluster.scheduler_address(scheduler) if pool is None else None
    own = cluster.ClusterPool(address, workers) if address else None
    units = batches(jobs, getattr(pool or own, "workers", None) or n)
    try:
        if pool is None and own is None and n == 1:
            for unit in units:
                for job, result in zip(unit, task(unit)):
                    fold(job, result)
        else:
            _run(units, task, pool or own, n, fold)
    finally:
        bar.close()
        trace_cache.update_index(learned)
        if own is not None:
            own.shutdown()
    return cached


#: A map task's batch (:func:`batches`): at most this many files, this many bytes of trace (as
#: parsed: a gzip file's decompressed size).  A rank of 16 MB and more is a task alone, so a
#: worker never holds two large traces at once (its peak memory is a trace's: docs/loader.md).
BATCH_FILES = 32
BATCH_BYTES = 16 * 2**20
#: Sets the most files a map task takes in place of :data:`BATCH_FILES` (1: a task a file, as the
#: map ran before batches; benchmarks/bench_small_ranks.py compares the two).
ENV_BATCH_FILES = "MFUSCOPE_MAP_BATCH_FILES"


def batches(jobs: list[RankJob], workers: int) -> list[tuple[RankJob, ...]]:
    """``jobs`` in order, cut into the map's tasks: consecutive small files together, up to
    :data:`BATCH_FILES` files and :data:`BATCH_BYTES` of trace, and at least two tasks a worker
    where there are that many files (so that no worker idles long while another finishes a
    batch).  A larger file is a task alone: its events are most of its cost, not the frames."""
    most = int(os.environ.get(ENV_BATCH_FILES) or BATCH_FILES)
    size = max(1, min(most, len(jobs) // (2 * max(workers, 1))))
    out: list[tuple[RankJob, ...]] = []
    unit: list[RankJob] = []
    held = 0
    for job in jobs:
        nbytes = trace_bytes(job.file)
        if unit and (len(unit) >= size or held + nbytes > BATCH_BYTES):
            out.append(tuple(unit))
            unit, held = [], 0
        unit.append(job)
        held += nbytes
    if unit:
        out.append(tuple(unit))
    return out


def trace_bytes(path: Path) -> int:
    """The bytes the parser reads of a trace file: a gzip file's decompressed size (its trailer's
    ISIZE, the size modulo 4 GiB: never less than the compressed size is taken), another file's
    size; an nsys database or a file this process cannot read counts as :data:`BATCH_BYTES` (a
    task alone)."""
    try:
        size = path.stat().st_size
        if path.suffix == ".sqlite":
            return BATCH_BYTES
        if path.suffix != ".gz" or size < 18:  # a gzip member's header and trailer alone are 18 bytes
            return size
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            return max(size, int.from_bytes(f.read(4), "little"))
    except OSError:  # unreadable here: its task says why
        return BATCH_BYTES


def _run(units: list[tuple[RankJob, ...]], task, pool: Executor | None, n: int, fold) -> None:
    """The map on ``pool`` (or a local pool of ``n``); files a dying worker took with it run again
    one at a time, and the one that kills a worker alone fails the analysis, named.  (A dying
    worker takes every batch it held: a local pool breaks whole, a Dask worker fails the batches
    queued on it too.)"""
    own = pool is None
    pool = pool or executor.local_pool(n)
    broken: list[RankJob] = []
    try:
        for unit, fut in executor.bounded_map(pool, task, units, in_flight=2 * getattr(pool, "workers", n)):
            try:
                results = fut.result()
            except Exception as e:
                if not _worker_died(e):
                    raise
                broken.extend(unit)
                continue
            for job, result in zip(unit, results):
                fold(job, result)
        for job in broken:  # alone: on the cluster (its nannies restart dead workers), else in a fresh pool
            fold(job, _alone(task, job, None if own else pool))
    finally:
        if own:
            pool.shutdown(wait=True, cancel_futures=True)


def _alone(task, job: RankJob, cluster_pool: Executor | None) -> MapResult:
    """``task`` on ``job`` with nothing else running beside it: a worker that dies now died of this rank."""
    try:
        if cluster_pool is not None:
            (result,) = cluster_pool.submit(task, (job,)).result()
            return result
        with executor.local_pool(1) as alone:
            (result,) = alone.submit(task, (job,)).result()
            return result
    except Exception as e:
        if not _worker_died(e):
            raise
        return MapResult([], f"{job.file}: the worker analyzing this trace died, and died again when it ran alone "
                         "(killed, out of memory, or a crash in a native library); --skip-bad analyzes the other "
                         "ranks", None, False, 0)


def _worker_died(error: BaseException) -> bool:
    return isinstance(error, BrokenProcessPool) or cluster.is_worker_death(error)
