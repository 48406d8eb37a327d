"""The EventTable contract: one normalized, columnar form for every trace.

Loaders (Kineto JSON, Nsight Systems SQLite, the collectors' own tables) all
produce this; every analysis reads only this.  One row per event, on one
aligned nanosecond clock (absolute epoch ns where the trace says so).

Columns (see docs/event_table.md for the meaning of each):

=============  =========================  =====================================================
column         dtype                      meaning
=============  =========================  =====================================================
rank           int32                      global rank of the process that recorded the event
lane           dictionary<string>         ``gpu<D>/stream<S>`` or ``cpu/<tid>`` (thread name in meta)
device         int16                      GPU index for device events, -1 on CPU lanes
stream         int32                      GPU stream, -1 on CPU lanes
tid            int64                      CPU thread id, -1 on GPU lanes
kind           dictionary<string>         one of :data:`KINDS`
name           dictionary<string>         event name (kernel name, op name, annotation)
ts_ns          int64                      start, ns on the aligned clock
dur_ns         int64                      duration in ns, never negative
step           int32                      training step the event belongs to, -1 if outside all
correlation    int64                      CUDA/HIP correlation id (links a launch to its kernel), -1
external_id    int64                      profiler "External id" (links CPU op and GPU work), -1
op             string (nullable)          collective: all_reduce, all_gather, reduce_scatter, ...
dim            string (nullable)          parallel dimension: dp, fsdp, tp, pp, cp, ep, world
pg             string (nullable)          process-group name
group_ranks    string (nullable)          process-group ranks, comma separated
bytes          int64                      collective size, as nccl-tests counts it (all_gather: output), -1 unknown
seq            int64                      collective sequence number in its group, -1 unknown
peer           int32                      p2p peer rank, -1 unknown
shapes         string (nullable)          JSON of input dims, kept for GEMM/attention/comm ops only
=============  =========================  =====================================================
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1

#: Every value the ``kind`` column may take.
KINDS = (
    "kernel",        # GPU compute kernel
    "comm",          # communication: NCCL/RCCL kernel on GPU, gloo work on CPU
    "memcpy",        # GPU copy
    "memset",        # GPU memset
    "gpu_annotation",
    "cpu_op",        # aten ops and other CPU-side operators
    "annotation",    # user annotations (record_function), incl. mfuscope.comm/<dim>/<op>
    "step",          # the step boundary annotation itself (ProfilerStep#N or the user's)
    "runtime",       # CUDA/HIP runtime API call
    "driver",        # CUDA driver API call
    "sync",          # synchronization (cudaStreamSynchronize, events)
    "python",        # python_function events
    "instant",       # zero-duration markers
    "nvtx",          # NVTX ranges (Nsight)
    "other",
)

#: Kinds that run on a device lane.
DEVICE_KINDS = ("kernel", "comm", "memcpy", "memset", "gpu_annotation")

#: ``kind`` as the loaders carry it while they build a table: each row's position in :data:`KINDS`.
#: A loader compares and reassigns kinds a dozen times over every row; on int8 codes numpy does that
#: in C, on an object array of strings it calls Python's comparison once per row.
KIND_CODE = {k: i for i, k in enumerate(KINDS)}


def kind_codes(values) -> np.ndarray:
    """int8 codes of kind names (an unknown name is a KeyError: :data:`KINDS` is the contract)."""
    return np.array([KIND_CODE[v] for v in values], dtype=np.int8)


def is_kind(codes: np.ndarray, *kinds: str) -> np.ndarray:
    """Which rows of a code array are one of ``kinds``."""
    out = codes == KIND_CODE[kinds[0]]
    for k in kinds[1:]:
        out |= codes == KIND_CODE[k]
    return out


def kind_column(codes: np.ndarray) -> pa.DictionaryArray:
    """The ``kind`` column of a code array: its dictionary holds the kinds present, in :data:`KINDS` order."""
    present = np.flatnonzero(np.bincount(codes, minlength=len(KINDS)))
    remap = np.zeros(len(KINDS), dtype=np.int32)
    remap[present] = np.arange(len(present), dtype=np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(remap[codes]), pa.array([KINDS[i] for i in present]))

_DICT = pa.dictionary(pa.int32(), pa.string())

SCHEMA = pa.schema([
    ("rank", pa.int32()),
    ("lane", _DICT),
    ("device", pa.int16()),
    ("stream", pa.int32()),
    ("tid", pa.int64()),
    ("kind", _DICT),
    ("name", _DICT),
    ("ts_ns", pa.int64()),
    ("dur_ns", pa.int64()),
    ("step", pa.int32()),
    ("correlation", pa.int64()),
    ("external_id", pa.int64()),
    ("op", pa.string()),
    ("dim", pa.string()),
    ("pg", pa.string()),
    ("group_ranks", pa.string()),
    ("bytes", pa.int64()),
    ("seq", pa.int64()),
    ("peer", pa.int32()),
    ("shapes", pa.string()),
])

COLUMNS = tuple(SCHEMA.names)
META_KEY = b"mfuscope"


class SchemaMismatch(ValueError):
    pass


def check_schema(table: pa.Table) -> None:
    """Raise SchemaMismatch unless ``table`` has exactly the EventTable columns and dtypes."""
    if table.schema.names != list(COLUMNS):
        raise SchemaMismatch(f"columns {table.schema.names} != {list(COLUMNS)}")
    for f in SCHEMA:
        got = table.schema.field(f.name).type
        if got != f.type:
            raise SchemaMismatch(f"column {f.name}: {got} != {f.type}")


@dataclass
class EventTable:
    """Events of one or more ranks plus what each rank's trace said about itself.

    ``ranks`` maps rank -> metadata (source file, device name and properties,
    world size, process groups, how steps were found, time base).
    """

    table: pa.Table
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_schema(self.table)

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def rank_ids(self) -> list[int]:
        return sorted(self.ranks)

    def column(self, name: str) -> np.ndarray:
        """A column as numpy; dictionary columns come back as their string values."""
        col = self.table.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(pa.string())
        return col.to_numpy(zero_copy_only=False)

    def to_pandas(self, columns: list[str] | None = None):
        tbl = self.table.select(columns) if columns else self.table
        return tbl.to_pandas()

    def filter(self, mask) -> EventTable:
        keep = mask if isinstance(mask, (pa.Array, pa.ChunkedArray)) else pa.array(mask)
        return EventTable(self.table.filter(keep), self.ranks)

    def with_metadata(self) -> pa.Table:
        """The table with ``ranks`` stored in the schema metadata (for parquet)."""
        meta = json.dumps({"schema_version": SCHEMA_VERSION,
                           "ranks": {str(k): v for k, v in self.ranks.items()}})
        return self.table.replace_schema_metadata({META_KEY: meta.encode()})

    @classmethod
    def from_arrow(cls, table: pa.Table) -> EventTable:
        raw = (table.schema.metadata or {}).get(META_KEY)
        ranks = {}
        if raw:
            meta = json.loads(raw)
            if meta.get("schema_version") != SCHEMA_VERSION:
                raise SchemaMismatch(f"EventTable schema version {meta.get('schema_version')} != {SCHEMA_VERSION}")
            ranks = {int(k): v for k, v in meta["ranks"].items()}
        return cls(table.replace_schema_metadata(None), ranks)

    @classmethod
    def concat(cls, parts: list[EventTable]) -> EventTable:
        if not parts:
            return cls.empty()
        # One chunk per part; dictionary columns may keep a dictionary per chunk (valid
        # Arrow, and pandas conversion unifies them), so no copy is made here.
        table = pa.concat_tables([p.table for p in parts])
        ranks: dict[int, dict[str, Any]] = {}
        for p in parts:
            ranks.update(p.ranks)
        return cls(table, ranks)

    @classmethod
    def empty(cls) -> EventTable:
        return cls(SCHEMA.empty_table(), {})


def build_table(columns: dict[str, Any], order: np.ndarray | None = None) -> pa.Table:
    """Assemble an EventTable-shaped pyarrow Table from numpy arrays / lists, casting to the schema.

    ``order``: the rows to take, in that order, from every numpy column (one column's reordered
    copy at a time, not a reordered copy of the whole table beside the original).  The columns
    are taken out of ``columns`` as they are converted, so a caller that keeps no other reference
    to them has each original freed once its copy is made."""
    arrays = []
    for f in SCHEMA:
        values = columns.pop(f.name)
        if order is not None and isinstance(values, np.ndarray):
            values = values[order]
        if pa.types.is_dictionary(f.type):
            if isinstance(values, pa.Array) and pa.types.is_dictionary(values.type):
                arr = values
            else:
                arr = pa.array(values, type=pa.string()).dictionary_encode()
            if arr.type != f.type:
                arr = arr.cast(f.type)
        else:
            arr = pa.array(values, type=f.type, from_pandas=True)
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=SCHEMA)
