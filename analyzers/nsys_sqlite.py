"""Nsight Systems SQLite export (``nsys export --type sqlite``) -> EventTable.

Reads kernels, memcpy, memset, synchronization, CUDA runtime calls and NVTX
ranges, resolving names through ``StringIds`` and the device through
``TARGET_INFO_GPU``.  Timestamps are ns from the session start;
``TARGET_INFO_SESSION_START_TIME.utcEpochNs`` moves them to epoch ns.

Export schema 3.x is supported; columns that came and went within 3.x are
looked up by name, and a table that lacks a required column is reported
by name rather than failing with an SQL error.
"""
from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import numpy as np
import pyarrow as pa

from mfuscope.errors import UserInputError
from mfuscope.event_table import KIND_CODE, EventTable, build_table, is_kind, kind_codes, kind_column

from . import collectives
from .steps import UNMARKED, assign_steps, device_window, find_steps, with_whole_trace_marker

SUPPORTED_MAJOR = 3

# NVTX event types that carry a duration (push/pop and start/end ranges).
_NVTX_RANGE_TYPES = (59, 60, 70, 71)

_DEVICE_TABLES = (
    ("CUPTI_ACTIVITY_KIND_KERNEL", "kernel"),
    ("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"),
    ("CUPTI_ACTIVITY_KIND_MEMSET", "memset"),
    ("CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "sync"),
)
_NO_STREAM = 0xFFFFFFFF
_API_VERSION_TAG = re.compile(r"_v\d{4,}$")  # ABI tags (_v7000, _v10000); _v2 is part of an API name


def is_nsys_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def load_nsys_sqlite(path: str | Path, *, rank: int = 0, step_annotation: str | None = None) -> EventTable:
    path = Path(path)
    if not is_nsys_sqlite(path):
        raise UserInputError("not an SQLite file (expected the output of nsys export --type sqlite)", path)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return _load(con, path, rank, step_annotation)
    except sqlite3.DatabaseError as e:
        raise UserInputError(f"cannot read the Nsight export: {e}", path) from None
    finally:
        con.close()


def _tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def _schema_version(con: sqlite3.Connection, tables: set[str], path: Path) -> str:
    if "META_DATA_EXPORT" not in tables:
        raise UserInputError("no META_DATA_EXPORT table: not an Nsight Systems export", path)
    meta = dict(con.execute("SELECT name, value FROM META_DATA_EXPORT").fetchall())
    version = meta.get("EXPORT_SCHEMA_VERSION", "")
    major = version.split(".")[0]
    if not major.isdigit() or int(major) != SUPPORTED_MAJOR:
        raise UserInputError(f"Nsight export schema version {version or 'unknown'} is not supported "
                             f"(mfuscope reads {SUPPORTED_MAJOR}.x)", path)
    return version


def _require(con, table: str, needed: tuple[str, ...], path: Path) -> set[str]:
    cols = _columns(con, table)
    missing = [c for c in needed if c not in cols]
    if missing:
        raise UserInputError(f"table {table} lacks column(s) {', '.join(missing)} "
                             "(unexpected Nsight export schema)", path)
    return cols


def _load(con: sqlite3.Connection, path: Path, rank: int, step_annotation: str | None) -> EventTable:
    tables = _tables(con)
    version = _schema_version(con, tables, path)
    strings = dict(con.execute("SELECT id, value FROM StringIds").fetchall()) if "StringIds" in tables else {}
    epoch = 0
    if "TARGET_INFO_SESSION_START_TIME" in tables:
        row = con.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
        epoch = int(row[0]) if row and row[0] is not None else 0

    cols: dict[str, list] = {k: [] for k in ("lane", "device", "stream", "tid", "kind", "name",
                                             "ts", "end", "correlation")}

    def add(kind, rows, lane_fn, name_fn):
        for r in rows:
            cols["kind"].append(kind)
            cols["name"].append(name_fn(r))
            cols["ts"].append(r[0])
            cols["end"].append(r[1] if r[1] is not None else r[0])
            lane, dev, stream, tid = lane_fn(r)
            cols["lane"].append(lane)
            cols["device"].append(dev)
            cols["stream"].append(stream)
            cols["tid"].append(tid)
            cols["correlation"].append(r[4] if r[4] is not None else -1)

    def device_lane(r):
        dev, stream = int(r[2]), int(r[3]) if r[3] is not None else -1
        if stream == _NO_STREAM:
            stream = -1
        return f"gpu{dev}/stream{stream}", dev, stream, -1

    def cpu_lane(r):
        tid = int(r[2]) & 0xFFFFFF if r[2] is not None else -1  # globalTid low 24 bits = OS tid
        return f"cpu/{tid}", -1, -1, tid

    for table, kind in _DEVICE_TABLES:
        if table not in tables:
            continue
        tcols = _require(con, table, ("start", "end", "deviceId", "streamId", "correlationId"), path)
        if kind == "kernel":
            name_col = next((c for c in ("demangledName", "shortName", "mangledName") if c in tcols), None)
            if name_col is None:
                raise UserInputError(f"table {table} has no kernel name column", path)
            rows = con.execute(f"SELECT start, end, deviceId, streamId, correlationId, {name_col} FROM {table}")
            add(kind, rows, device_lane, lambda r: strings.get(r[5], str(r[5])))
        elif kind == "memcpy":
            kinds = _enum(con, tables, "ENUM_CUDA_MEMCPY_OPER")
            extra = "copyKind" if "copyKind" in tcols else "NULL"
            rows = con.execute(f"SELECT start, end, deviceId, streamId, correlationId, {extra} FROM {table}")
            add(kind, rows, device_lane, lambda r, kinds=kinds: f"Memcpy {kinds.get(r[5], r[5])}".strip())
        elif kind == "memset":
            rows = con.execute(f"SELECT start, end, deviceId, streamId, correlationId FROM {table}")
            add(kind, rows, device_lane, lambda r: "Memset")
        else:
            types = _enum(con, tables, "ENUM_CUPTI_SYNC_TYPE")
            extra = "syncType" if "syncType" in tcols else "NULL"
            rows = con.execute(f"SELECT start, end, deviceId, streamId, correlationId, {extra} FROM {table}")
            add(kind, rows, device_lane, lambda r, types=types: f"Sync {types.get(r[5], r[5])}")

    if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        _require(con, "CUPTI_ACTIVITY_KIND_RUNTIME", ("start", "end", "globalTid", "correlationId", "nameId"), path)
        rows = con.execute("SELECT start, end, globalTid, NULL, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME")
        add("runtime", rows, cpu_lane, lambda r: _api_name(strings.get(r[5], str(r[5]))))

    if "NVTX_EVENTS" in tables:
        ncols = _require(con, "NVTX_EVENTS", ("start", "end", "eventType", "globalTid"), path)
        text = "COALESCE(text, s.value)" if "textId" in ncols else "text"
        join = "LEFT JOIN StringIds s ON s.id = n.textId" if "textId" in ncols and "StringIds" in tables else ""
        if not join:
            text = "text"
        rows = con.execute(
            f"SELECT n.start, n.end, n.globalTid, NULL, NULL, {text} FROM NVTX_EVENTS n {join} "
            f"WHERE n.eventType IN ({','.join(map(str, _NVTX_RANGE_TYPES))}) AND n.end IS NOT NULL")
        add("nvtx", rows, cpu_lane, lambda r: r[5] or "")

    if not cols["ts"]:
        raise UserInputError("the export holds no kernels, runtime calls or NVTX ranges", path)

    ts = np.asarray(cols["ts"], dtype=np.int64) + epoch
    dur = np.maximum(np.asarray(cols["end"], dtype=np.int64) + epoch - ts, 0)
    kind = kind_codes(cols["kind"])
    names = np.asarray(cols["name"], dtype=object)
    correlation = np.asarray(cols["correlation"], dtype=np.int64)
    on_device = is_kind(kind, "kernel", "memcpy", "memset", "sync") & (np.asarray(cols["device"]) >= 0)
    comm = (kind == KIND_CODE["kernel"]) & np.array([collectives.is_comm_kernel(n) for n in names], dtype=bool)
    kind[comm] = KIND_CODE["comm"]

    name_arr = pa.array(names, type=pa.string()).dictionary_encode()
    steps = find_steps(kind, name_arr.dictionary.to_pylist(), name_arr.indices.to_numpy(), ts, dur,
                       step_annotation, path, on_device)
    step = assign_steps(steps, kind, on_device, ts, correlation)
    device_window(steps, kind, on_device, ts, dur, step, name_arr.indices.to_numpy())
    n = len(ts)
    op = np.array([collectives.normalize_op(x) if c else None for x, c in zip(names, comm)], dtype=object)

    gpu = _gpu_info(con, tables)
    meta = {
        "file": str(path), "format": "nsys-sqlite", "export_schema": version,
        "rank": int(rank), "rank_source": "given", "world_size": None, "backend": None,
        "device_name": gpu[0]["name"] if gpu else None, "devices": gpu,
        "base_time_ns": epoch, "clock": "epoch (session start + ns)" if epoch else "relative",
        "steps_source": steps.source, "n_steps": int(len(steps.number)),
        "steps": [int(s) for s in steps.number], "pg_config": [], "threads": {},
    }
    table = build_table({
        "rank": np.full(n, rank, dtype=np.int32), "lane": cols["lane"],
        "device": np.asarray(cols["device"], dtype=np.int16), "stream": np.asarray(cols["stream"], dtype=np.int32),
        "tid": np.asarray(cols["tid"], dtype=np.int64), "kind": kind_column(kind), "name": name_arr,
        "ts_ns": ts, "dur_ns": dur, "step": step, "correlation": correlation,
        "external_id": np.full(n, -1, dtype=np.int64), "op": op,
        "dim": np.array([collectives.kernel_dim(x) if c else None for x, c in zip(names, comm)], dtype=object),
        "pg": np.full(n, None, dtype=object), "group_ranks": np.full(n, None, dtype=object),
        "bytes": np.full(n, -1, dtype=np.int64), "seq": np.full(n, -1, dtype=np.int64),
        "peer": np.full(n, -1, dtype=np.int32), "shapes": np.full(n, None, dtype=object),
    })
    order = np.argsort(ts, kind="stable")
    table = table.take(pa.array(order))
    if steps.source in UNMARKED:
        table = with_whole_trace_marker(table, int(rank), steps)
    return EventTable(table, {int(rank): meta})


def _api_name(name: str) -> str:
    """``cudaLaunchKernel_v7000`` -> ``cudaLaunchKernel``, ``cudaStreamIsCapturing_v10000`` ->
    ``cudaStreamIsCapturing``: drop the ABI version tag (four digits or more; ``nsys stats`` drops
    only four), so runtime calls read the same as in Kineto traces.  ``cuGetProcAddress_v2`` keeps
    its ``_v2``: that is another API, not a tag."""
    return _API_VERSION_TAG.sub("", name)


def _enum(con, tables: set[str], table: str) -> dict:
    if table not in tables:
        return {}
    cols = _columns(con, table)
    label = "label" if "label" in cols else "name"
    return {k: re.sub(r"\s+", " ", str(v)) for k, v in con.execute(f"SELECT id, {label} FROM {table}")}


def _gpu_info(con, tables: set[str]) -> list[dict]:
    if "TARGET_INFO_GPU" not in tables:
        return []
    cols = _columns(con, "TARGET_INFO_GPU")
    want = [c for c in ("id", "name", "totalMemory", "smCount") if c in cols]
    out = []
    for row in con.execute(f"SELECT {', '.join(want)} FROM TARGET_INFO_GPU"):
        d = dict(zip(want, row))
        out.append({"id": d.get("id"), "name": d.get("name"), "memory_bytes": d.get("totalMemory"),
                    "sms": d.get("smCount")})
    return out
