"""Load a trace file, a directory of rank files, or a run directory into one EventTable.

Ranks are discovered from the head of each file (``distributedInfo``) or its
name before anything is parsed, so a set with two files claiming one rank
fails in milliseconds.  Files are then parsed in a process pool -- at most one
file per worker in memory at a time -- and each normalized result is cached
as parquet keyed by the file's content.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from mfuscope import run_dir
from mfuscope.errors import UserInputError
from mfuscope.event_table import EventTable

from . import executor, group_dims, heap, trace_cache
from .kineto_json import load_kineto_file, peek_header, rank_from_file_name
from .nsys_sqlite import is_nsys_sqlite, load_nsys_sqlite

_TRACE_SUFFIXES = (".json", ".json.gz", ".sqlite")
_NOT_TRACES = {"manifest.json", "report.json"}


@dataclass
class LoadResult:
    events: EventTable | None  # None from an analysis (its ranks were summarized apart)
    files: list[Path]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    cached: int = 0


def is_trace_file(path: Path) -> bool:
    return path.is_file() and path.name.endswith(_TRACE_SUFFIXES) and path.name not in _NOT_TRACES \
        and not path.name.startswith(".")


def discover(path: str | os.PathLike) -> list[Path]:
    """Trace files under ``path`` (a file, a trace directory, or a run directory)."""
    p = Path(path)
    if not p.exists():
        raise UserInputError("no such file or directory", p)
    if p.is_file():
        if p.suffix == ".nsys-rep" or p.name.endswith(".qdrep"):
            return [_export_nsys(p)]
        return [p]
    root = p / "traces" if (p / "manifest.json").exists() and (p / "traces").is_dir() else p
    files = sorted(f for f in root.rglob("*") if is_trace_file(f))
    if not files:
        reps = sorted(root.rglob("*.nsys-rep"))
        hint = (f"; found {reps[0].name}: export it with nsys export --type sqlite" if reps else "")
        raise UserInputError(f"no trace files (*.json, *.json.gz, *.sqlite) in this directory{hint}", p)
    return files


def _export_nsys(report: Path) -> Path:
    """An .nsys-rep becomes SQLite through ``nsys export`` when nsys is installed.

    The export goes to the cache directory (never beside the user's report),
    keyed by the report's content, and is reused on the next load.
    """
    nsys = shutil.which("nsys")
    if nsys is None:
        raise UserInputError("this is an Nsight Systems report and nsys is not on PATH; export it first: "
                             f"nsys export --type sqlite --output {report.with_suffix('.sqlite').name} {report.name}",
                             report)
    out = trace_cache.cache_dir() / f"{trace_cache.cache_key(report, 'nsys-export')}.sqlite"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial.sqlite")
        proc = subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
                               "--output", str(tmp), str(report)], capture_output=True, text=True)
        if proc.returncode != 0 or not tmp.exists():
            reason = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserInputError(f"nsys export failed: {reason[0]}", report)
        os.replace(tmp, out)
    return out


def _expected_rank(f: Path, rank_override: int | None, single: bool) -> int | None:
    if f.suffix == ".sqlite":
        return rank_override if single else rank_from_file_name(f)
    head = peek_header(f)
    if "rank" in head:
        return head["rank"]
    if single and rank_override is not None:
        return rank_override
    return rank_from_file_name(f)


def _parse(f: Path, rank: int | None, step_annotation: str | None) -> EventTable:
    if is_nsys_sqlite(f):
        return load_nsys_sqlite(f, rank=rank if rank is not None else 0, step_annotation=step_annotation)
    return load_kineto_file(f, rank=rank, step_annotation=step_annotation)


def load_file(f: Path, rank: int | None, step_annotation: str | None, use_cache: bool,
              known_key: str | None = None) -> tuple[EventTable | None, str | None, str | None, bool]:
    """Load one file: from the cache by content key if there, else parse (and cache).

    Returns (events, error, content key, whether it came from the cache).  ``known_key``: the
    key the cache index holds for the file's stat signature (no hashing needed)."""
    if known_key is not None:
        hit = trace_cache.get(known_key)
        if hit is not None:
            return hit, None, known_key, True
    key = trace_cache.cache_key(f, rank, step_annotation) if use_cache else None
    hit = trace_cache.get(key) if key is not None else None
    if hit is not None:
        return hit, None, key, True
    try:
        events = _parse(f, rank, step_annotation)
    except UserInputError as e:
        return None, str(e), key, False
    if key is not None:
        trace_cache.put(key, events)
    return events, None, key, False


def _worker(job):
    """:func:`load_file` in a pool process; with a hand-off directory, the events come back as
    the path of an uncompressed Arrow file holding them (see :func:`_hand_off`), and the worker
    gives the parse's heap back before its next file (:func:`.heap.give_back`)."""
    f, rank, step_annotation, use_cache, handoff = job
    events, error, key, cached = load_file(f, rank, step_annotation, use_cache)
    result = _hand_off(events, handoff, f) if events is not None else None
    if handoff is not None:
        del events
        heap.give_back()
    return f, result, error, key, cached


def _hand_off(events: EventTable, directory: str | None, f: Path):
    """A pool worker's result, as an Arrow IPC file the parent memory-maps: sent through the
    pool's pipe instead, a table exists twice in the worker (and pickled again in the parent)
    just when memory peaks."""
    if directory is None:
        return events
    import pyarrow as pa

    path = os.path.join(directory, f"{os.getpid()}-{abs(hash(str(f)))}.arrow")
    table = events.with_metadata()
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def _take_hand_off(path: str) -> EventTable:
    import pyarrow as pa

    with pa.memory_map(path) as source:
        table = pa.ipc.open_file(source).read_all()
    os.unlink(path)  # the mapping keeps the data until the table is dropped
    return EventTable.from_arrow(table)


def untraced_run(path: str | os.PathLike) -> bool:
    """A run directory with the collectors' step table and no trace window."""
    p = Path(path)
    return (p / run_dir.MANIFEST).exists() and not (p / run_dir.TRACES).is_dir() and (p / run_dir.STEPS).exists()


def rank_files(path: str | os.PathLike, rank: int | None = None,
               skip_bad: bool = False) -> tuple[list[tuple[Path, int | None]], list[tuple[str, str]]]:
    """(file, the rank it holds) for every trace under ``path``, read from each file's head or
    name before anything is parsed -- two files claiming one rank fail here, in milliseconds --
    and the files skipped (with ``skip_bad``) with why.  ``rank`` applies to a single file
    without rank information.  A run directory that recorded no trace window has none: its report
    comes from the collectors' tables alone (step times, communication, health)."""
    if untraced_run(path):
        return [], []
    files = discover(path)
    single = len(files) == 1
    jobs = []
    skipped: list[tuple[str, str]] = []
    claimed: dict[int, Path] = {}
    # Heads are read on threads: a file whose distributedInfo sits at its end (Kineto's writer puts it
    # there) is decompressed whole, and zlib lets other threads run meanwhile.
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as readers:
        expected = list(readers.map(lambda f: _expected_rank(f, rank, single), files))
    for f, r in zip(files, expected):
        if r is None and single:
            r = 0  # one file, no rank anywhere: it is rank 0 of its own run
        if r is not None:
            if r in claimed:
                raise UserInputError(f"two files claim rank {r}: {claimed[r].name} and {f.name}", Path(path))
            claimed[r] = f
        elif not single:
            problem = UserInputError("cannot tell which rank this file is: no distributedInfo.rank in its head "
                                     "and no rank<N>/worker<N> in its name; load it alone with --rank N", f)
            if not skip_bad:
                raise problem
            skipped.append((str(f), str(problem)))
            continue
        jobs.append((f, r))
    return jobs, skipped


def load(path: str | os.PathLike, *, rank: int | None = None, step_annotation: str | None = None,
         use_cache: bool = True, skip_bad: bool = False, workers: int | None = None,
         progress: bool | None = None, on_file: Callable[[int, int], None] | None = None,
         allow_mixed: bool = False, layout: str | None = None, rank_order: str | None = None) -> LoadResult:
    """Load every trace under ``path`` into one EventTable.

    The files must be ranks of one job (:func:`check_one_job`); ``allow_mixed`` loads them
    anyway, with a warning.

    ``rank`` applies to a single file without rank information.  With
    ``skip_bad``, files that fail to load are listed in ``skipped`` instead of
    failing the whole set (at least one must load).  ``on_file(done, total)`` is called as each
    file is loaded (the dashboard's progress bar).  ``layout`` / ``rank_order`` (``--layout
    tp=8,pp=4``, ``--rank-order tp-cp-ep-dp-pp``) place the process groups nothing in the traces
    names (:mod:`.group_dims`).
    """
    groups = group_dims.RankLayout.parse(layout, rank_order)  # bad flags fail before any file is read
    jobs, skipped = rank_files(path, rank, skip_bad)

    show = progress if progress is not None else sys.stderr.isatty()
    results: list[tuple[Path, EventTable]] = []
    bar = tqdm(total=len(jobs), desc="loading traces", unit="file", disable=not show, file=sys.stderr)

    def advance() -> None:
        bar.update()
        if on_file is not None:
            on_file(bar.n, len(jobs))
    pending = []
    index = trace_cache.read_index() if use_cache else {}
    signatures = {f: trace_cache.stat_signature(f, r, step_annotation) for f, r in jobs} if use_cache else {}
    cached = 0
    # Files seen before, unchanged: read here (parquet decoding releases the GIL, so threads
    # overlap), with no hashing and no worker process.
    keys = [index.get(signatures[f]) if use_cache else None for f, _ in jobs]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as readers:
        hits = list(readers.map(lambda k: trace_cache.get(k) if k is not None else None, keys))
    for (f, r), hit in zip(jobs, hits):
        if hit is not None:
            results.append((f, hit))
            cached += 1
            advance()
        else:
            pending.append((f, r, step_annotation, use_cache))
    learned: dict[str, str] = {}

    def collect(outcome) -> None:
        nonlocal cached
        f, events, error, key, was_cached = outcome
        if key is not None and error is None:
            learned[signatures[f]] = key
        cached += was_cached
        advance()
        if isinstance(events, str):
            events = _take_hand_off(events)
        if error is None:
            results.append((f, events))
        elif skip_bad:
            skipped.append((str(f), error))
        else:
            raise UserInputError(error.split(": ", 1)[1] if error.startswith(str(f)) else error, f)

    n_workers = max(1, min(workers or os.cpu_count() or 1, len(pending)))
    try:
        if n_workers == 1:
            for job in pending:
                collect(_worker((*job, None)))
        else:
            # executor.local_pool: forked with the parent's objects frozen out of the workers' collections
            with tempfile.TemporaryDirectory(prefix="mfuscope-handoff-") as handoff, \
                    executor.local_pool(n_workers) as pool:
                for fut in as_completed([pool.submit(_worker, (*job, handoff)) for job in pending]):
                    collect(fut.result())
    finally:
        bar.close()
        trace_cache.update_index(learned)
    if not results:
        reasons = "; ".join(r for _, r in skipped)
        raise UserInputError(f"no trace could be loaded: {reasons}", Path(path))

    by_rank: dict[int, Path] = {}
    for f, ev in results:
        for r in ev.ranks:
            if r in by_rank:
                raise UserInputError(f"two files claim rank {r}: {by_rank[r].name} and {f.name}", Path(path))
            by_rank[r] = f
    results.sort(key=lambda fe: min(fe[1].ranks))
    events = EventTable.concat([ev for _, ev in results])
    check_one_job(events.ranks, Path(path), allow_mixed)
    events = group_dims.assign(events, groups)
    return LoadResult(events, [f for f, _ in results], skipped, cached)


def check_one_job(metas: dict[int, dict], path: Path, allow_mixed: bool = False) -> None:
    """Ranks of one job agree on the world size and the device, and no rank lies outside the
    world: a folder holding ranks of two jobs would otherwise be analyzed as one job, with one
    world size and one peak."""
    worlds = {m["world_size"] for m in metas.values() if m.get("world_size")}
    devices = {m["device_name"] for m in metas.values() if m.get("device_name")}
    problems = []
    if len(worlds) > 1:
        problems.append("world sizes " + ", ".join(map(str, sorted(worlds))))
    if len(devices) > 1:
        problems.append("devices " + ", ".join(sorted(devices)))
    if len(worlds) == 1 and max(metas) >= next(iter(worlds)):
        problems.append(f"rank {max(metas)} in a world of {next(iter(worlds))}")
    if not problems:
        return
    files = ", ".join(sorted({Path(m.get("file", "?")).name for m in metas.values()}))
    message = f"these traces are not ranks of one job ({'; '.join(problems)}; files {files})"
    if not allow_mixed:
        raise UserInputError(message + ": load each job's folder alone, or pass --allow-mixed", path)
    print(f"mfuscope: warning: {message}; loaded together as asked (--allow-mixed)", file=sys.stderr)
