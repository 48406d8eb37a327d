"""The run-directory contract: what collectors write and everything else reads.

::

    RUN_DIR/
      manifest.json                 the run: layout, hardware, model, groups (schema-validated)
      steps.parquet/                one row per (rank, step): wall-clock span, tokens, loss
      comm.parquet/                 one row per collective call per rank
      nvml.parquet/                 GPU samples (utilization, clocks, power, memory)
      memory.parquet/               --profile-memory: model-state bytes per (rank, step), GPU peaks
      checkpoints.parquet/          each checkpoint save: blocking and background time
      traces/rank<N>.pt.trace.json.gz   Kineto window, one file per rank
      memory/rank<N>.raw.json.gz    --profile-memory: the window's memory timeline (and on a GPU
                                    rank<N>.snapshot.pickle, the allocator's snapshot)
      nsys/                         optional Nsight Systems export
      report.json                   written by ``mfuscope analyze``

Each table is a parquet dataset: a directory of files, one or more per rank
(``rank00003-0000.parquet``), because every rank writes its own rows and no
rank waits for another -- a run where one rank died still has the others'
rows.  A single ``NAME.parquet`` file is read the same way.  Every file is
written atomically; a run that crashes keeps every file it had finished.
See docs/run_directory.md.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mfuscope import atomic
from mfuscope.errors import UserInputError
from mfuscope.schema_check import read_json, validate

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
STEPS = "steps.parquet"
COMM = "comm.parquet"
NVML = "nvml.parquet"
MEMORY = "memory.parquet"
CHECKPOINTS = "checkpoints.parquet"
TRACES = "traces"
MEMORY_FILES = "memory"  # memory/rank<N>.raw.json.gz (memory timeline), rank<N>.snapshot.pickle (CUDA)
FATAL = "fatal"  # fatal/rank<N>.txt: a rank's Python stacks at a fatal signal (collectors/fatal_stacks.py)
REPORT = "report.json"
VIEWS = "views"

STEPS_SCHEMA = pa.schema([
    ("rank", pa.int32()), ("step", pa.int32()),
    ("start_ns", pa.int64()), ("end_ns", pa.int64()),
    ("tokens", pa.int64()), ("loss", pa.float64()),
    ("device_time_ns", pa.int64()),   # null where no device timer ran (CPU)
    # the training thread's time runnable but waiting for a CPU during the step (the kernel's
    # run-queue delay, /proc/thread-self/schedstat); null off Linux and in runs written before it
    ("cpu_wait_ns", pa.int64()),
    # the collectors' own work on the training thread inside the step (exporting the trace window
    # and memory timeline, counting model states, writing table parts): not the job's time, so the
    # analyses leave out a step it dominates; null in runs written before it
    ("collector_ns", pa.int64()),
])

COMM_SCHEMA = pa.schema([
    ("rank", pa.int32()), ("step", pa.int32()), ("op", pa.string()), ("dim", pa.string()),
    ("pg", pa.string()), ("group_ranks", pa.string()), ("bytes", pa.int64()), ("seq", pa.int64()),
    ("enqueue_ns", pa.int64()), ("start_ns", pa.int64()), ("end_ns", pa.int64()),
])

NVML_SCHEMA = pa.schema([
    ("rank", pa.int32()), ("device", pa.int16()), ("ts_ns", pa.int64()),
    ("gpu_util_pct", pa.float32()), ("mem_util_pct", pa.float32()), ("sm_clock_mhz", pa.float32()),
    ("power_w", pa.float32()), ("mem_used_bytes", pa.int64()), ("temp_c", pa.float32()),
    ("pcie_tx_bps", pa.float64()), ("pcie_rx_bps", pa.float64()), ("nvlink_bps", pa.float64()),
])

#: --profile-memory: the model states this rank holds, counted at each optimizer step from the
#: tensors (local shards), and on a GPU the allocator's peaks over the step (null on the CPU).
MEMORY_SCHEMA = pa.schema([
    ("rank", pa.int32()), ("step", pa.int32()),
    ("parameter_bytes", pa.int64()), ("gradient_bytes", pa.int64()), ("optimizer_state_bytes", pa.int64()),
    ("peak_allocated_bytes", pa.int64()), ("peak_reserved_bytes", pa.int64()),
])

#: Each checkpoint save a rank made (``ProfileSession.checkpoint``): the training thread's blocking time
#: (a row per save), and for an async save, later, a row with its background time.
CHECKPOINTS_SCHEMA = pa.schema([
    ("rank", pa.int32()), ("step", pa.int32()), ("mode", pa.string()),
    ("start_ns", pa.int64()), ("blocking_ns", pa.int64()), ("background_ns", pa.int64()),
])

#: Columns added to a table after its first release: a run directory written before them reads
#: them as null rather than failing.
ADDED_COLUMNS = {STEPS: {"cpu_wait_ns", "collector_ns"}}

TABLE_SCHEMAS = {STEPS: STEPS_SCHEMA, COMM: COMM_SCHEMA, NVML: NVML_SCHEMA, MEMORY: MEMORY_SCHEMA,
                 CHECKPOINTS: CHECKPOINTS_SCHEMA}


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_manifest(run_id: str, world_size: int, **fields: Any) -> dict[str, Any]:
    manifest = {"schema_version": SCHEMA_VERSION, "run_id": run_id, "start_time": now_iso(),
                "status": "running", "world_size": world_size}
    manifest.update(fields)
    return manifest


def write_manifest(run_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Validate, then write atomically; an invalid manifest is never written."""
    path = Path(run_dir) / MANIFEST
    validate("manifest", manifest, path)
    atomic.write_json(path, manifest)
    return path


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    return read_json("manifest", Path(run_dir) / MANIFEST)


@contextmanager
def _manifest_lock(run_dir: Path) -> Iterator[None]:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".manifest.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def update_manifest(run_dir: str | Path, change: Callable[[dict[str, Any] | None], dict[str, Any] | None]) -> None:
    """Read, change, write the manifest under a lock, so ranks that end early and rank 0's
    final write never undo each other.  ``change`` gets None when there is no manifest yet and
    may return None to write nothing."""
    run_dir = Path(run_dir)
    with _manifest_lock(run_dir):
        current = read_manifest(run_dir) if (run_dir / MANIFEST).is_file() else None
        new = change(current)
        if new is not None:
            write_manifest(run_dir, new)


def mark_ended_early(run_dir: str | Path, reason: str) -> None:
    """Record that the run stopped before its end (the first reason given wins)."""
    def change(manifest):
        if manifest is None or manifest["status"] == "ended_early":
            return None
        return {**manifest, "status": "ended_early", "ended_reason": reason, "end_time": now_iso()}
    update_manifest(run_dir, change)


#: Set by ``mfuscope train`` for its ranks to the run directory it has prepared (checked, emptied with
#: --force), so that the ranks' sessions write into it instead of refusing a directory that exists.
ENV_PREPARED = "MFUSCOPE_RUN_PREPARED"

RUN_ENTRIES = (MANIFEST, STEPS, COMM, NVML, MEMORY, CHECKPOINTS, TRACES, MEMORY_FILES, "collectives",
               "flight_recorder", FATAL, "nsys", REPORT, VIEWS, ".manifest.lock")


def prepare(run_dir: str | Path, force: bool = False) -> Path:
    """Make ``run_dir`` ready for a new run.  A non-empty directory is refused unless ``force``;
    with ``force`` an earlier run directory is replaced, but a directory that holds anything
    else is never deleted."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise UserInputError("exists and is not a directory", path)
    if path.is_dir() and any(path.iterdir()):
        if not force:
            raise UserInputError("exists and is not empty; choose another --out or pass --force", path)
        foreign = sorted(p.name for p in path.iterdir() if p.name not in RUN_ENTRIES)
        if foreign:
            raise UserInputError(f"holds files that are not a run's ({', '.join(foreign[:3])}); "
                                 "not replacing it even with --force", path)
        for entry in path.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_rank_table(run_dir: str | Path, name: str, rank: int, part: int, rows: list[dict]) -> Path:
    """Write one rank's rows of a table as part ``part`` of the ``name`` dataset."""
    schema = TABLE_SCHEMAS[name]
    table = pa.Table.from_pylist(rows, schema=schema)
    return write_table(run_dir, f"{name}/rank{rank:05d}-{part:04d}.parquet", table, schema)


def warm_parquet_writer() -> None:
    """Write each table's empty form to memory once: pyarrow imports pandas on its first
    ``write_table`` (0.2-0.3 s a process), which would otherwise land in the training step of the
    first flush and read, in the step times, as a host stall every rank takes at once."""
    for schema in TABLE_SCHEMAS.values():
        pq.write_table(schema.empty_table(), pa.BufferOutputStream())


def write_table(run_dir: str | Path, name: str, table: pa.Table, schema: pa.Schema | None = None) -> Path:
    """Write one of the run directory's parquet tables, cast to its contract schema."""
    schema = schema or TABLE_SCHEMAS[name]
    path = Path(run_dir) / name
    try:
        table = _with_added_columns(table, schema, name.split("/")[0]).select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ValueError(f"{name} does not fit its schema: {e}") from None
    atomic.write_parquet(path, table)
    return path


def read_table(run_dir: str | Path, name: str) -> pa.Table:
    """Read a run-directory table (a dataset directory or a single file) and check it has the
    contract's columns."""
    path = Path(run_dir) / name
    schema = TABLE_SCHEMAS[name]
    try:
        if path.is_dir():
            parts = sorted(p for p in path.glob("*.parquet") if not p.name.startswith("."))
            table = pa.concat_tables([_read_part(p, schema, name) for p in parts]) if parts else schema.empty_table()
        else:
            table = _with_added_columns(pq.read_table(path), schema, name)
    except FileNotFoundError:
        raise UserInputError(f"no {name} in this run directory", path.parent) from None
    except (OSError, pa.ArrowException) as e:
        raise UserInputError(f"unreadable parquet: {e}", path) from None
    missing = [n for n in schema.names if n not in table.schema.names]
    if missing:
        raise UserInputError(f"missing column(s) {', '.join(missing)}", path)
    return table.select(schema.names).cast(schema)


def _with_added_columns(table: pa.Table, schema: pa.Schema, name: str) -> pa.Table:
    """``table`` with the columns added since it was written (:data:`ADDED_COLUMNS`) as nulls."""
    for column in sorted(ADDED_COLUMNS.get(name, set()) - set(table.schema.names)):
        table = table.append_column(schema.field(column), pa.nulls(len(table), schema.field(column).type))
    return table


def _read_part(path: Path, schema: pa.Schema, name: str) -> pa.Table:
    try:
        table = _with_added_columns(pq.read_table(path), schema, name)
        return table.select(schema.names).cast(schema)
    except KeyError as e:
        raise UserInputError(f"missing column {e}", path) from None
    except (OSError, pa.ArrowException) as e:
        raise UserInputError(f"unreadable parquet: {e}", path) from None
