"""The run-directory contract: what collectors write and everything else reads.

::

    RUN_DIR/
      manifest.json                 the run: layout, hardware, model, groups (schema-validated)
      steps.parquet                 one row per (rank, step): wall-clock span, tokens, loss
      comm.parquet                  one row per collective call per rank
      nvml.parquet                  GPU samples (utilization, clocks, power, memory)
      traces/rank<N>.pt.trace.json.gz   Kineto window, one file per rank
      nsys/                         optional Nsight Systems export
      report.json                   written by ``mfuscope analyze``

Every file is written atomically; a run that crashes keeps every file it had
finished.  See docs/run_directory.md.
"""
from __future__ import annotations

import datetime as _dt
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
TRACES = "traces"
REPORT = "report.json"

STEPS_SCHEMA = pa.schema([
    ("rank", pa.int32()), ("step", pa.int32()),
    ("start_ns", pa.int64()), ("end_ns", pa.int64()),
    ("tokens", pa.int64()), ("loss", pa.float64()),
    ("device_time_ns", pa.int64()),   # null where no device timer ran (CPU)
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

TABLE_SCHEMAS = {STEPS: STEPS_SCHEMA, COMM: COMM_SCHEMA, NVML: NVML_SCHEMA}


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


def write_table(run_dir: str | Path, name: str, table: pa.Table) -> Path:
    """Write one of the run directory's parquet tables, cast to its contract schema."""
    schema = TABLE_SCHEMAS[name]
    path = Path(run_dir) / name
    try:
        table = table.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ValueError(f"{name} does not fit its schema: {e}") from None
    atomic.write_parquet(path, table)
    return path


def read_table(run_dir: str | Path, name: str) -> pa.Table:
    """Read a run-directory table and check it has the contract's columns."""
    path = Path(run_dir) / name
    schema = TABLE_SCHEMAS[name]
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise UserInputError(f"no {name} in this run directory", path.parent) from None
    except (OSError, pa.ArrowException) as e:
        raise UserInputError(f"unreadable parquet: {e}", path) from None
    missing = [n for n in schema.names if n not in table.schema.names]
    if missing:
        raise UserInputError(f"missing column(s) {', '.join(missing)}", path)
    return table.select(schema.names).cast(schema)
