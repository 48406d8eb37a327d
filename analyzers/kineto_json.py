"""Kineto (PyTorch profiler) JSON trace -> EventTable, for one file.

Speed comes from choices measured in ``benchmarks/bench_json_parsers.py`` and
``bench_load.py`` (see docs/loader.md): ISA-L gzip when available; each batch of
events through a C scanner (``_kineto_scan.c``) that writes the columns straight
from the bytes, with msgspec decoding only the args of the rows that need them;
msgspec's *typed* decoder (unknown keys skipped in C) for any batch the scanner
hands back, its columns built by list comprehensions; no per-row pandas work.

Real-world cases handled here: ``.json``/``.json.gz``; timestamps in absolute
epoch us or relative to ``baseTimeNanoseconds``; fractional (ns-resolution)
us; string ``pid``/``tid``; kernels/memcpy/memset linked to their CPU launch by
correlation id; ``ProfilerStep#N`` steps or a user-named step annotation or
one window (the device span, else the whole trace); ``record_param_comms`` with or without
collective fields; NCCL/RCCL kernels of every naming era; gloo work on CPU
threads; AMD/ROCm traces; no ``distributedInfo``.
"""
from __future__ import annotations

import gc
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pyarrow as pa

from mfuscope.errors import UserInputError
from mfuscope.event_table import KIND_CODE, EventTable, build_table, is_kind, kind_codes, kind_column

from . import collectives, memory
from .steps import UNMARKED, Steps, assign_steps, device_window, find_steps, with_whole_trace_marker

try:  # the C scanner (analyzers/_kineto_scan.c); optional: without a C compiler at install, msgspec decodes
    from . import _kineto_scan as _scan
except ImportError:  # pragma: no cover - exercised only where the extension was not built
    _scan = None
if os.environ.get("MFUSCOPE_KINETO_SCANNER") == "0":  # msgspec alone: to measure or to rule the scanner out
    _scan = None

try:  # ISA-L inflates gzip ~1.6x faster than zlib; optional.
    from isal import igzip as _gzip
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - exercised only without isal
    import gzip as _gzip
    import zlib as _zlib


# --------------------------------------------------------------------------- decoding

_field = msgspec.field


class _Args(msgspec.Struct, gc=False):
    external_id: int | None = _field(name="External id", default=None)
    correlation: int | None = None
    stream: int | str | None = None  # ROCm traces write strings
    device: int | str | None = None
    collective: str | None = _field(name="Collective name", default=None)
    pg_name: str | None = _field(name="Process Group Name", default=None)
    pg_desc: str | None = _field(name="Process Group Description", default=None)
    pg_ranks: msgspec.Raw = _field(name="Process Group Ranks", default=msgspec.Raw())
    group_size: int | str | None = _field(name="Group size", default=None)
    rank_start: int | str | None = _field(name="Global rank start", default=None)
    rank_stride: int | str | None = _field(name="Global rank stride", default=None)
    in_nelems: int | None = _field(name="In msg nelems", default=None)
    out_nelems: int | None = _field(name="Out msg nelems", default=None)
    dtype: str | None = None
    seq: int | None = _field(name="Seq", default=None)
    input_dims: msgspec.Raw = _field(name="Input Dims", default=msgspec.Raw())
    input_type: msgspec.Raw = _field(name="Input type", default=msgspec.Raw())
    concrete: msgspec.Raw = _field(name="Concrete Inputs", default=msgspec.Raw())
    name: str | None = None  # thread_name / process_name metadata
    # [memory] events: the allocator's totals after the allocation or free
    total_allocated: int | float | None = _field(name="Total Allocated", default=None)
    total_reserved: int | float | None = _field(name="Total Reserved", default=None)
    device_type: int | None = _field(name="Device Type", default=None)
    device_id: int | None = _field(name="Device Id", default=None)
    alloc_bytes: int | float | None = _field(name="Bytes", default=None)  # > 0 allocated, < 0 freed
    addr: int | None = _field(name="Addr", default=None)


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    cat: str = ""
    ts: float | None = None
    dur: float = 0.0
    pid: int | str = 0
    tid: int | str = 0
    args: _Args | None = None


class _PgConfig(msgspec.Struct, gc=False):
    pg_name: str | None = None
    pg_desc: str | None = None
    pg_size: int | None = None
    group_size: int | None = None  # older PyTorch's name for pg_size
    ranks: list[int] | str | None = None
    backend_config: str | None = None


class _DistInfo(msgspec.Struct, gc=False):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    pg_config: list[_PgConfig] | None = None
    nccl_version: str | None = None


class _DeviceProps(msgspec.Struct, gc=False):
    id: int | None = None
    name: str | None = None
    totalGlobalMem: int | None = None
    numSms: int | None = None


class _Trace(msgspec.Struct, gc=False):
    # Events stay raw JSON here and are decoded in batches (see _collect_events):
    # decoding all of them at once costs ~2x the file size in Python objects.
    traceEvents: list[msgspec.Raw] | None = None
    distributedInfo: _DistInfo | None = None
    deviceProperties: list[_DeviceProps] | None = None
    baseTimeNanoseconds: int | None = None


_DECODER = msgspec.json.Decoder(_Trace)
_EVENTS_DECODER = msgspec.json.Decoder(list[_Event])
_BATCH = 16384

#: profiler category -> EventTable kind.  Categories in _SKIP_CATS are flow
#: arrows and profiler bookkeeping, not work.
_CAT_KIND = {
    "kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset",
    "gpu_user_annotation": "gpu_annotation", "cpu_op": "cpu_op",
    "user_annotation": "annotation", "cuda_runtime": "runtime",
    "cuda_driver": "driver", "cuda_sync": "sync", "python_function": "python",
    "cpu_instant_event": "instant",
    # Older Kineto spelled categories in title case.
    "Kernel": "kernel", "Memcpy": "memcpy", "Memset": "memset", "Runtime": "runtime",
    "Operator": "cpu_op", "user_annotation ": "annotation",
    # Accelerators that are not CUDA/ROCm GPUs, as Kineto names their activities: their device
    # work is device work (else an MTIA or Gaudi trace reads as CPU-only), their runtime calls
    # are launches.
    "mtia_ccp_events": "kernel", "mtia_runtime": "runtime", "hpu_op": "kernel",
    "xpu_runtime": "runtime", "xpu_driver": "driver", "privateuse1_runtime": "runtime",
    "privateuse1_driver": "driver", "mlu_memcpy": "memcpy", "mlu_memset": "memset",
    "mlu_user_annotation": "gpu_annotation", "mlu_runtime": "runtime", "gcu_runtime": "runtime",
    "gcu_driver": "driver", "GCU_MEMCPY": "memcpy", "GCU_MEMSET": "memset",
}
#: Device work that is a copy though its category says kernel (MTIA's DMA requests): memory, not compute.
_COPY_KERNEL = re.compile(r"^dma(_request|_copy)?(?![A-Za-z])", re.I)
_SKIP_CATS = {"ac2g", "fwdbwd", "Trace", "flow", "async"}
_WORK_PHASES = {"X", "i", "I"}
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation",
                "Kernel", "Memcpy", "Memset", "mtia_ccp_events", "hpu_op", "mlu_memcpy", "mlu_memset",
                "mlu_user_annotation", "GCU_MEMCPY", "GCU_MEMSET"}

#: CPU ops whose input shapes are kept (FLOPs from shapes; collective sizes).
_SHAPE_OPS = re.compile(
    r"^(aten::(mm|addmm|bmm|baddbmm|linear|matmul|_scaled_mm|_scaled_dot_product\w*|scaled_dot_product\w*"
    r"|_flash_attention\w*|_efficient_attention\w*|convolution|convolution_backward)$|record_param_comms|nccl:|"
    r"gloo:|c10d::)")

_RANK_IN_NAME = re.compile(r"(?:^|[^a-z])(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)

#: Timestamps below this many us (about 3 years) cannot be epoch time.
_EPOCH_US_MIN = 1e14


# --------------------------------------------------------------------------- file reading

def read_trace_bytes(path: Path) -> bytearray:
    """File bytes, gunzipped if the file is gzip (by magic, not by name), by the same
    chunked reader the streaming decoder uses (:func:`_decompressed_chunks`)."""
    if not os.access(path, os.R_OK):
        raise UserInputError("cannot read: permission denied or missing", path)
    out = bytearray()
    try:
        for chunk in _decompressed_chunks(path):
            out += chunk
    except (EOFError, OSError, zlib.error, ValueError) as e:
        raise UserInputError(f"truncated or corrupt gzip ({e})", path) from None
    return out


def peek_header(path: Path, limit: int = 1 << 18) -> dict[str, Any]:
    """Rank and world size from ``distributedInfo``, without parsing the events.

    Writers put ``distributedInfo`` before ``traceEvents`` or after it (Kineto
    writes it at the end): the first ``limit`` decompressed bytes are searched,
    then, if the file is longer, its last ``limit`` bytes (streamed, never held
    whole).  Returns {} when neither has it.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
            f.seek(0)
            if magic == b"\x1f\x8b":
                with _gzip.open(f) as g:
                    head = g.read(limit)
            else:
                head = f.read(limit)
    except (OSError, EOFError, zlib.error):
        return {}  # the full parse reports the problem with the file
    events_at = head.find(b'"traceEvents"')
    found = _dist_info(head[:events_at] if events_at >= 0 else head)
    if found is None and len(head) >= limit:
        found = _dist_info(_tail(path, limit))
    return found or {}


def _tail(path: Path, limit: int) -> bytes:
    tail = b""
    try:
        for chunk in _decompressed_chunks(path):
            tail = (tail + chunk)[-limit:]
    except (EOFError, OSError, zlib.error, ValueError, UserInputError):
        return b""  # the full parse reports the problem with the file
    return tail


def _dist_info(text: bytes) -> dict[str, Any] | None:
    m = re.search(rb'"distributedInfo"\s*:\s*\{', text)
    if not m:
        return None
    info = text[m.end():]
    out: dict[str, Any] = {}
    head = info[:info.find(b'"pg_config"')] if b'"pg_config"' in info else info
    for key in ("rank", "world_size"):
        km = re.search(rb'"%s"\s*:\s*(\d+)' % key.encode(), head)
        if km:
            out[key] = int(km.group(1))
    return out


def rank_from_file_name(path: Path) -> int | None:
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- parsing

def load_kineto_file(path: str | os.PathLike, *, rank: int | None = None,
                     step_annotation: str | None = None) -> EventTable:
    """Parse one Kineto trace into an EventTable.

    ``rank`` is used when the trace has no ``distributedInfo.rank``.
    ``step_annotation`` is a regular expression naming the annotation that
    marks a step, for traces without ``ProfilerStep#N``.
    """
    path = Path(path)
    # Millions of short-lived objects: the cyclic GC only costs time here.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load(path, rank, step_annotation)
    finally:
        if gc_was_enabled:
            gc.enable()


def _load(path: Path, rank: int | None, step_annotation: str | None) -> EventTable:
    try:
        trace, work = _load_streaming(path)
    except _NotStreamable:
        trace, work = _load_whole(path)
    dist = trace.distributedInfo
    meta = _rank_meta(path, trace, rank)
    if work.n == 0:
        raise UserInputError("no complete events ('ph': 'X') in 'traceEvents'", path)

    table, steps = _columns(work, meta, step_annotation, path)
    if steps.source in UNMARKED:
        table = with_whole_trace_marker(table, meta["rank"], steps)
    meta["steps_source"] = steps.source
    meta["n_steps"] = int(len(steps.number))
    meta["steps"] = [int(s) for s in steps.number]
    meta["threads"] = {str(k): v for k, v in work.thread_names.items()}
    meta["pg_config"] = _pg_config(dist)
    return EventTable(table, {meta["rank"]: meta})


def _load_whole(path: Path) -> tuple[_Trace, _Work]:
    """Decompress the whole file, split ``traceEvents`` into raw events, decode them in batches."""
    raw = read_trace_bytes(path)
    trace = _decode(raw, path)
    events = trace.traceEvents
    if events is None:
        raise UserInputError("not a PyTorch profiler trace: no 'traceEvents' list", path)
    if not events:
        raise UserInputError("'traceEvents' is empty: the profiler recorded nothing", path)
    work = _collect_events(_raw_batches(events), path)
    trace.traceEvents = None  # drop the raw slices, and with them the decompressed JSON
    return trace, work


class _NotStreamable(Exception):
    """The file is not laid out as the streaming splitter expects; use the whole-buffer path."""


_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[([ \t\r\n]*)')


def _load_streaming(path: Path) -> tuple[_Trace, _Work]:
    """Decode a pretty-printed trace (Kineto's own layout) while it is being decompressed.

    In a pretty-printed ``traceEvents`` array every event starts and ends on
    its own line at one indentation, and JSON strings cannot hold a raw
    newline, so ``"\\n" + indent + "},"`` can only end an event.  The file is
    cut there into batches as it streams in; only a few MB are ever held.
    Anything unexpected raises _NotStreamable, and the whole-buffer path
    (which also reports errors precisely) takes over.
    """
    holder: dict[str, bytes] = {}
    try:
        work = _collect_events(_stream_batches(_decompressed_chunks(path), holder), path)
    except (UserInputError, EOFError, OSError, zlib.error, ValueError):
        raise _NotStreamable from None
    try:
        trace = _DECODER.decode(holder["meta"])
    except (msgspec.DecodeError, KeyError):
        raise _NotStreamable from None
    return trace, work


def _decompressed_chunks(path: Path, size: int = 1 << 21) -> Iterator[bytes]:
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
        f.seek(0)
        if not gz:
            while chunk := f.read(size):
                yield chunk
            return
        d = _zlib.decompressobj(wbits=31)
        while comp := f.read(1 << 20):
            while comp:
                out = d.decompress(comp, size)
                if out:
                    yield out
                comp = d.unconsumed_tail
                if d.eof:
                    comp, d = d.unused_data, _zlib.decompressobj(wbits=31) if d.unused_data else d
                    if not comp:
                        break
        if not d.eof:
            raise EOFError("compressed file ended before the end-of-stream marker")


def _stream_batches(chunks: Iterator[bytes], holder: dict[str, bytes]) -> Iterator[bytes]:
    buf = b""
    for chunk in chunks:
        buf += chunk
        m = _EVENTS_KEY.search(buf)
        if m or len(buf) > (64 << 20):
            break
    else:
        m = None
    if m is None:
        raise _NotStreamable
    head, ws, buf = buf[:m.start()], m.group(1), buf[m.end():]
    newline = ws.rfind(b"\n")
    if newline < 0 or not buf.startswith(b"{"):
        raise _NotStreamable  # minified or unusual layout
    indent = ws[newline + 1:]
    sep = b"\n" + indent + b"},"
    end = re.compile(rb"\n" + re.escape(indent) + rb"\}\s*\]")
    while True:
        # One copy per chunk into the batch (join takes a memoryview); the remainder is a partial event.
        # The array can only end after the last event separator, so only that tail is searched.
        cut = buf.rfind(sep)
        last = end.search(buf, max(cut, 0))
        if last is not None:
            close = last.start() + len(indent) + 2  # just past the last event's "}"
            yield b"".join((b"[", memoryview(buf)[:close], b"]"))
            holder["meta"] = head + b'"traceEvents": []' + buf[last.end():] + b"".join(chunks)
            return
        if cut >= 0:
            comma = cut + len(sep) - 1
            yield b"".join((b"[", memoryview(buf)[:comma], b"]"))
            buf = buf[comma + 1:].lstrip()
        chunk = next(chunks, None)
        if chunk is None:
            raise _NotStreamable  # no end of the array: let the whole-buffer path report it
        buf = buf + chunk if buf else chunk


def _decode(raw: bytes, path: Path) -> _Trace:
    try:
        return _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        msg = str(e)
        if msg.startswith("Expected `object`"):
            raise UserInputError("not a PyTorch profiler trace: the top level is not a JSON object", path) from None
        raise UserInputError(f"unexpected trace content: {msg}", path) from None
    except msgspec.DecodeError as e:
        raise UserInputError(f"invalid JSON: {e}", path) from None


def _rank_meta(path: Path, trace: _Trace, rank_override: int | None) -> dict[str, Any]:
    dist = trace.distributedInfo
    if dist is not None and dist.rank is not None:
        rank, source = dist.rank, "distributedInfo"
    elif rank_override is not None:
        rank, source = rank_override, "given"
    elif (from_name := rank_from_file_name(path)) is not None:
        rank, source = from_name, "file name"
    else:
        raise UserInputError("no rank in distributedInfo or in the file name (rank<N>/worker<N>); "
                             "pass --rank N", path)
    props = trace.deviceProperties or []
    devices = [{"id": p.id, "name": p.name, "memory_bytes": p.totalGlobalMem, "sms": p.numSms} for p in props]
    return {
        "file": str(path),
        "format": "kineto",
        "rank": int(rank),
        "rank_source": source,
        "world_size": dist.world_size if dist is not None else None,
        "backend": dist.backend if dist is not None else None,
        "nccl_version": dist.nccl_version if dist is not None else None,
        "device_name": devices[0]["name"] if devices else None,
        "devices": devices,
        "base_time_ns": trace.baseTimeNanoseconds,
    }


def _pg_config(dist: _DistInfo | None) -> list[dict[str, Any]]:
    if dist is None or not dist.pg_config:
        return []
    out = []
    for pg in dist.pg_config:
        out.append(collectives.call_group(pg.pg_name, pg.pg_desc, pg.ranks, pg.pg_size or pg.group_size))
    return out


def _to_ns(us: np.ndarray) -> np.ndarray:
    """us (float64) -> int64 ns without the 256 ns rounding of ``us * 1000`` at epoch scale."""
    whole = np.floor(us)
    return whole.astype(np.int64) * 1000 + np.rint((us - whole) * 1000).astype(np.int64)


@dataclass
class _Work:
    """The events that are work (complete and instant events), as compact columns.

    Names and categories are dictionary-encoded per batch (a trace has a few
    thousand distinct names), so nothing holds a Python object per event.
    Full ``args`` are kept only for rows whose name needs them (collectives,
    GEMM/attention shapes).
    """

    n: int
    names: pa.DictionaryArray
    cats: pa.DictionaryArray
    pid: np.ndarray
    tid: np.ndarray
    tid_labels: np.ndarray | None  # per row, only when some thread ids are strings
    ts_us: np.ndarray
    dur_us: np.ndarray
    arg_device: np.ndarray
    arg_stream: np.ndarray
    correlation: np.ndarray
    external_id: np.ndarray
    args: dict  # row -> _KeptArgs or _Args (same fields), for rows whose name needs the full args
    thread_names: dict
    allocator: _Allocator  # the [memory] events' fields


class _KeptArgs(NamedTuple):
    """The args of a collective or GEMM/attention row, detached from the JSON buffer.

    (A ``msgspec.Raw`` keeps its whole decode buffer alive; bytes copies do not.)
    """

    collective: str | None
    pg_name: str | None
    pg_desc: str | None
    pg_ranks: bytes
    in_nelems: int | None
    out_nelems: int | None
    dtype: str | None
    seq: int | None
    input_dims: bytes
    input_type: bytes
    concrete: bytes
    group_size: int | str | None = None
    rank_start: int | str | None = None
    rank_stride: int | str | None = None


def _kept(a: _Args) -> _KeptArgs:
    return _KeptArgs(a.collective, a.pg_name, a.pg_desc, bytes(a.pg_ranks), a.in_nelems, a.out_nelems, a.dtype,
                     a.seq, bytes(a.input_dims), bytes(a.input_type), bytes(a.concrete), a.group_size,
                     a.rank_start, a.rank_stride)


def _needs_args(name: str) -> bool:
    return (collectives.is_comm_kernel(name) or collectives.is_comm_cpu_name(name)
            or bool(_SHAPE_OPS.match(name)))


def _raw_batches(raw_events: list) -> Iterator[bytes]:
    for start in range(0, len(raw_events), _BATCH):
        yield b"[" + b",".join(raw_events[start:start + _BATCH]) + b"]"


class _Allocator(NamedTuple):
    """The allocator's ``[memory]`` events (those with args), as columns: the row of each, the
    totals allocated and reserved after it, its device (``cuda:0``), the bytes (< 0 freed), the address."""

    rows: np.ndarray
    allocated: np.ndarray
    reserved: np.ndarray
    device: np.ndarray  # object: memory.device_key
    nbytes: np.ndarray
    addr: np.ndarray

    @staticmethod
    def concat(parts: list[_Allocator], offsets: list[int]) -> _Allocator:
        if not parts:
            return _NO_ALLOCATOR
        rows = np.concatenate([p.rows + off for p, off in zip(parts, offsets)])
        return _Allocator(rows, *(np.concatenate(c) for c in list(zip(*parts))[1:]))


_I64 = np.empty(0, np.int64)
_NO_ALLOCATOR = _Allocator(_I64, _I64, _I64, np.empty(0, object), _I64, _I64)


def _device_keys(device_type: np.ndarray, device_id: np.ndarray, missing: int) -> np.ndarray:
    """memory.device_key of each row, called once per distinct (type, id); ``missing`` marks an absent field."""
    key = lambda t, i: memory.device_key(None if t == missing else t, None if i == missing else i)  # noqa: E731
    if (device_type == device_type[0]).all() and (device_id == device_id[0]).all():  # one allocator: the usual
        return np.full(len(device_type), key(int(device_type[0]), int(device_id[0])), dtype=object)
    out = np.empty(len(device_type), dtype=object)
    for t in np.unique(device_type).tolist():  # a few types, a few ids each: no 2-D unique (slow)
        of_type = device_type == t
        ids, inverse = np.unique(device_id[of_type], return_inverse=True)
        out[of_type] = np.array([key(t, i) for i in ids.tolist()], dtype=object)[inverse.reshape(-1)]
    return out


class _Part(NamedTuple):
    """One batch's work rows as columns (what :class:`_Work` concatenates), from either decoder."""

    names: pa.DictionaryArray
    cats: pa.DictionaryArray
    pid: np.ndarray
    tid: np.ndarray
    tid_labels: np.ndarray | None  # only when some thread ids are strings
    ts: np.ndarray
    dur: np.ndarray
    dev: np.ndarray
    stream: np.ndarray
    corr: np.ndarray
    ext: np.ndarray
    args: dict  # row in the batch -> _KeptArgs
    allocator: _Allocator  # rows counted in the batch
    thread_names: dict


def _collect_events(batches: Iterable[bytes], path: Path) -> _Work:
    """Decode the batches, each by the C scanner where it can (``_kineto_scan``), else by msgspec."""
    needs: dict[str, bool] = {}
    parts: list[_Part] = []
    seen = 0
    for data in batches:
        decoded = _native_part(data, needs) if _scan is not None else None
        part, count = decoded if decoded is not None else _msgspec_part(data, needs, seen, path)
        del data, decoded
        seen += count
        parts.append(part)
    return _concat_parts(parts)


def _concat_parts(parts: list[_Part]) -> _Work:
    """The batches' parts as one :class:`_Work`; empties ``parts``.  Each column is concatenated
    in turn and its batches' pieces freed before the next (all at once, the parts and their
    concatenation would both be alive: 13 MB more at a 54 MB trace's peak)."""
    args: dict[int, _KeptArgs] = {}
    thread_names: dict = {}
    offsets = []
    n = 0
    for p in parts:
        args.update((n + row, kept) for row, kept in p.args.items())
        thread_names.update(p.thread_names)
        offsets.append(n)
        n += len(p.ts)
    with_memory = [(p.allocator, off) for p, off in zip(parts, offsets) if len(p.allocator.rows)]
    allocator = _Allocator.concat([a for a, _ in with_memory], [off for _, off in with_memory])
    tid_labels = None
    if any(p.tid_labels is not None for p in parts):
        tid_labels = np.concatenate([p.tid_labels if p.tid_labels is not None else p.tid.astype(str).astype(object)
                                     for p in parts])
    pieces = {f: [getattr(p, f) for p in parts] for f in _Part._fields}
    parts.clear()

    def cat(field: str, dtype) -> np.ndarray:
        return np.concatenate(pieces.pop(field)) if n else np.empty(0, dtype)

    def dictionary(field: str) -> pa.DictionaryArray:
        chunks = pieces.pop(field) or [pa.array([], type=pa.string()).dictionary_encode()]
        return pa.chunked_array(chunks).unify_dictionaries().combine_chunks() if len(chunks) > 1 else chunks[0]

    return _Work(n, dictionary("names"), dictionary("cats"), cat("pid", np.int64), cat("tid", np.int64),
                 tid_labels, cat("ts", np.float64), cat("dur", np.float64), cat("dev", np.int64),
                 cat("stream", np.int64), cat("corr", np.int64), cat("ext", np.int64), args, thread_names,
                 allocator)


def _kept_args(names: pa.DictionaryArray, needs: dict[str, bool], args_of: Callable[[np.ndarray], list],
               detach: Callable[[_Args], Any] = lambda a: a) -> dict[int, _KeptArgs | _Args]:
    """The full args a batch keeps, of the rows whose name needs them (``needs`` caches the verdict
    by name).  ``args_of(rows)`` gives the decoded ``_Args`` (or None) of the given work rows;
    ``detach`` copies one out of its decode buffer where that buffer is the whole batch."""
    values = names.dictionary.to_pylist()
    flags = [needs.get(x) for x in values]
    for i, x in enumerate(values):
        if flags[i] is None:
            flags[i] = needs[x] = _needs_args(x)
    kept: dict[int, _KeptArgs] = {}
    indices = names.indices.to_numpy()
    if any(flags):
        rows = np.flatnonzero(np.array(flags)[indices])
        kept = {r: detach(a) for r, a in zip(rows.tolist(), args_of(rows)) if a is not None}
    return kept


def _memory_rows(names: pa.DictionaryArray) -> np.ndarray:
    values = names.dictionary.to_pylist()
    if "[memory]" not in values:
        return _I64
    return np.flatnonzero(names.indices.to_numpy() == values.index("[memory]"))


_ARGS_LIST = msgspec.json.Decoder(list[_Args | None])


def _native_part(data: bytes, needs: dict[str, bool]) -> tuple[_Part, int] | None:
    """The batch by the C scanner, and its number of events (work or not).

    None where the batch is out of the scanner's scope (string thread ids, malformed JSON, ...): the
    msgspec path then decodes it, and words any error."""
    try:
        c = _scan.scan(data)
    except _scan.Unsupported:
        return None
    count = c["n"]
    names = pa.StringArray.from_buffers(count, pa.py_buffer(c["name_offsets"]), pa.py_buffer(c["name_data"]))
    cats = pa.StringArray.from_buffers(count, pa.py_buffer(c["cat_offsets"]), pa.py_buffer(c["cat_data"]))
    if c["non_ascii"]:
        try:
            names.validate(full=True)
            cats.validate(full=True)
        except pa.ArrowInvalid:
            return None
    col = {k: np.frombuffer(v, np.uint8 if k == "ph" else np.float64 if k in ("ts", "dur") else np.int64)
           for k, v in c.items() if isinstance(v, bytes) and not k.endswith(("_offsets", "_data"))}
    ph, ts, a_start = col["ph"], col["ts"], col["args_start"]
    cat_codes = cats.dictionary_encode()
    good_cat = np.array([bool(x) and x not in _SKIP_CATS for x in cat_codes.dictionary.to_pylist()] or [False])
    work = ((ph == ord("X")) | (ph == ord("i")) | (ph == ord("I"))) & ~np.isnan(ts)
    work &= good_cat[cat_codes.indices.to_numpy()]
    mv = memoryview(data)

    def args_of(rows: np.ndarray) -> list:
        spans = zip(a_start[rows].tolist(), col["args_end"][rows].tolist())
        return _ARGS_LIST.decode(b"[" + b",".join(mv[s:e] if s >= 0 else b"null" for s, e in spans) + b"]")

    rows = np.flatnonzero(work)
    take = pa.array(rows)
    work_names = names.take(take).dictionary_encode()
    try:
        meta_rows = np.flatnonzero(ph == ord("M"))
        meta_rows = meta_rows[np.array(names.take(pa.array(meta_rows)).to_pylist(), dtype=object) == "thread_name"]
        thread_names = {t: a.name for t, a in zip(col["tid"][meta_rows].tolist(), args_of(meta_rows))
                        if a is not None and a.name}
        # Kept as decoded: their Raw fields hold the buffer of these rows' args alone, not the batch's.
        kept = _kept_args(work_names, needs, lambda r: args_of(rows[r]))
    except msgspec.DecodeError:  # an args field of another type than _Args says
        return None
    memory_rows = _memory_rows(work_names)
    memory_rows = memory_rows[a_start[rows[memory_rows]] >= 0]  # events with args, as the msgspec path keeps
    allocator = _NO_ALLOCATOR
    if len(memory_rows):
        at = rows[memory_rows]
        field = lambda k: np.where(col[k][at] == _MISSING, 0, col[k][at])  # noqa: E731
        allocator = _Allocator(memory_rows, field("total_allocated"), field("total_reserved"),
                               _device_keys(col["device_type"][at], col["device_id"][at], _MISSING),
                               field("bytes"), field("addr"))
    part = _Part(work_names, cats.take(take).dictionary_encode(), col["pid"][rows], col["tid"][rows], None, ts[rows],
                 col["dur"][rows], col["device"][rows], col["stream"][rows], col["correlation"][rows],
                 col["external_id"][rows], kept, allocator, thread_names)
    return part, count


#: The C scanner's mark of an absent allocator field (INT64_MIN).
_MISSING = np.iinfo(np.int64).min


def _msgspec_part(data: bytes, needs: dict[str, bool], seen: int, path: Path) -> tuple[_Part, int]:
    """The batch by msgspec's typed decoder; ``seen`` events came before it (for error positions)."""
    try:
        batch = _EVENTS_DECODER.decode(data)
    except msgspec.ValidationError as e:
        where = re.sub(r"`\$\[(\d+)\]", lambda m, seen=seen: f"`$.traceEvents[{seen + int(m.group(1))}]", str(e))
        raise UserInputError(f"unexpected trace content: {where}", path) from None
    count = len(batch)
    thread_names = {e.tid: e.args.name for e in batch
                    if e.ph == "M" and e.name == "thread_name" and e.args is not None and e.args.name}
    # Complete and instant events are work; flows ("ac2g") and bookkeeping are not.
    work = [e for e in batch if e.ph in _WORK_PHASES and e.cat and e.ts is not None and e.cat not in _SKIP_CATS]
    del batch
    names = pa.array([e.name for e in work], type=pa.string()).dictionary_encode()
    kept = _kept_args(names, needs, lambda rows: [work[r].args for r in rows.tolist()], _kept)
    allocator = _NO_ALLOCATOR
    memory_rows = [r for r in _memory_rows(names).tolist() if work[r].args is not None]
    if memory_rows:
        m = [work[r].args for r in memory_rows]
        ints = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
        allocator = _Allocator(ints(memory_rows), ints([a.total_allocated or 0 for a in m]),
                               ints([a.total_reserved or 0 for a in m]),
                               np.array([memory.device_key(a.device_type, a.device_id) for a in m], dtype=object),
                               ints([a.alloc_bytes or 0 for a in m]), ints([a.addr or 0 for a in m]))
    tids = [e.tid for e in work]
    a = [e.args for e in work]
    labels = None
    if not all(type(t) is int for t in tids):
        labels = np.array([str(t) for t in tids], dtype=object)
    part = _Part(names, pa.array([e.cat for e in work], type=pa.string()).dictionary_encode(),
                 _ints([e.pid for e in work]), _ints(tids), labels,
                 np.array([e.ts for e in work], dtype=np.float64), np.array([e.dur for e in work], dtype=np.float64),
                 _ints([x.device if x is not None else None for x in a]),
                 _ints([x.stream if x is not None else None for x in a]),
                 _ints([x.correlation if x is not None else None for x in a]),
                 _ints([x.external_id if x is not None else None for x in a]), kept, allocator, thread_names)
    return part, count


def _columns(work: _Work, meta: dict[str, Any], step_annotation: str | None,
             path: Path) -> tuple[pa.Table, Steps]:
    n = work.n
    rank = meta["rank"]
    args = work.args
    ts_us, dur_us = work.ts_us, work.dur_us

    # --- time: one nanosecond clock.  With baseTimeNanoseconds, ts is relative to it.
    base = meta["base_time_ns"]
    ts_ns = _to_ns(ts_us)
    # Round the end, not the duration, so touching events stay touching; never negative.
    dur_ns = np.maximum(_to_ns(ts_us + dur_us) - ts_ns, 0)
    if base is not None and n and float(np.nanmax(ts_us)) < _EPOCH_US_MIN:
        ts_ns += int(base)
        meta["clock"] = "epoch (baseTimeNanoseconds + relative ts)"
    elif n and float(np.nanmin(ts_us)) >= _EPOCH_US_MIN:
        meta["clock"] = "epoch"
    else:
        meta["clock"] = "relative (no time base in trace)"
    # Each of work's columns is let go once used: a worker's peak here sets the whole load's.
    work.ts_us = work.dur_us = ts_us = dur_us = None

    # --- kinds, by category, then by name for communication and steps.
    cat_arr = work.cats
    cat_values = cat_arr.dictionary.to_pylist()
    kind_of_cat = kind_codes([_CAT_KIND.get(c, "other") for c in cat_values] or ["other"])
    is_dev_cat = np.array([c in _DEVICE_CATS for c in cat_values] or [False])
    cat_idx = cat_arr.indices.to_numpy()
    kind = kind_of_cat[cat_idx]
    on_device = is_dev_cat[cat_idx]

    name_arr = work.names
    name_values = name_arr.dictionary.to_pylist()
    name_idx = name_arr.indices.to_numpy()
    comm_kernel_name = np.array([collectives.is_comm_kernel(s) for s in name_values] or [False])
    gloo_name = np.array([s.startswith("gloo:") for s in name_values] or [False])
    comm_cpu_name = np.array([collectives.is_comm_cpu_name(s) for s in name_values] or [False])
    op_of_name = np.array([collectives.normalize_op(s) if (k or c) else None
                           for s, k, c in zip(name_values, comm_kernel_name, comm_cpu_name)] or [None], dtype=object)
    dim_of_name = np.array([collectives.label_dim(s) for s in name_values] or [None], dtype=object)
    shape_name = np.array([bool(_SHAPE_OPS.match(s)) for s in name_values] or [False])

    kind[(kind == KIND_CODE["kernel"]) & comm_kernel_name[name_idx]] = KIND_CODE["comm"]
    copy_name = np.array([bool(_COPY_KERNEL.match(s)) for s in name_values] or [False])
    kind[(kind == KIND_CODE["kernel"]) & copy_name[name_idx]] = KIND_CODE["memcpy"]  # MTIA's dma_request
    kind[(kind == KIND_CODE["annotation"]) & gloo_name[name_idx]] = KIND_CODE["comm"]  # gloo work on its own thread

    # --- lanes.
    arg_device, arg_stream = work.arg_device, work.arg_stream
    on_device |= (kind == KIND_CODE["sync"]) & (arg_stream >= 0)
    tid_num = work.tid
    device = np.where(arg_device >= 0, arg_device, work.pid)
    stream = np.where(arg_stream >= 0, arg_stream, tid_num)
    device = np.where(on_device, device, -1)
    stream = np.where(on_device, stream, -1)
    tid_col = np.where(on_device, -1, tid_num)
    lane, lane_labels = _lane_labels(on_device, device, stream, tid_num, work.tid_labels)
    work.pid = work.tid = work.tid_labels = work.arg_device = work.arg_stream = None
    tid_num = arg_device = arg_stream = None

    # --- ids linking CPU launches and device work.
    correlation, external_id = work.correlation, work.external_id

    # --- steps.
    steps = find_steps(kind, name_values, name_idx, ts_ns, dur_ns, step_annotation, path, on_device)
    step_col = assign_steps(steps, kind, on_device, ts_ns, correlation)
    device_window(steps, kind, on_device, ts_ns, dur_ns, step_col, name_idx)

    # --- collectives: op/dim/pg/ranks/bytes/seq for comm-related rows.
    op = op_of_name[name_idx].copy()
    dim = dim_of_name[name_idx].copy()
    pg = np.full(n, None, dtype=object)
    group_ranks = np.full(n, None, dtype=object)
    nbytes = np.full(n, -1, dtype=np.int64)
    seq = np.full(n, -1, dtype=np.int64)
    shapes = np.full(n, None, dtype=object)
    comm_rows = np.flatnonzero(comm_cpu_name[name_idx] | (kind == KIND_CODE["comm"]))
    groups: dict[str, dict[str, Any]] = {}  # process groups the calls name: meta["comm_groups"]
    for i in comm_rows:
        a = args.get(i)
        if a is None:
            continue
        if a.collective:
            op[i] = collectives.normalize_op(a.collective) or op[i]
        if a.pg_name is not None:
            pg[i] = a.pg_name
        if (a.pg_desc or a.pg_name) and dim[i] is None:
            dim[i] = collectives.group_dim(a.pg_name, a.pg_desc)
        if a.pg_ranks or a.group_size is not None:
            listed = msgspec.json.decode(a.pg_ranks) if a.pg_ranks else None
            group = collectives.call_group(a.pg_name, a.pg_desc, listed, _as_int(a.group_size),
                                           _as_int(a.rank_start), _as_int(a.rank_stride))
            group_ranks[i] = group["ranks"]
            if a.pg_name is not None:
                groups.setdefault(a.pg_name, group)
        if a.seq is not None:
            seq[i] = a.seq
        size = collectives.dtype_bytes(a.dtype)
        # nccl-tests' size, as the collectors record it: an all-gather's output, every other's input
        nelems = a.out_nelems if op[i] == "all_gather" and a.out_nelems is not None else a.in_nelems
        if nelems is not None and size is not None:
            nbytes[i] = nelems * size
        elif a.input_dims and a.input_type:
            b = collectives.bytes_from_dims(bytes(a.input_dims).decode(), bytes(a.input_type).decode())
            if b is not None:
                nbytes[i] = b
    for i in np.flatnonzero(shape_name[name_idx]):
        a = args.get(i)
        if a is not None and a.input_dims:
            shapes[i] = _shapes_json(a)

    meta["comm_groups"] = list(groups.values())
    alloc = work.allocator
    if len(alloc.rows):  # the allocator's samples, folded per step (analyzers/memory.py)
        rows = alloc.rows
        backward = np.array([s.startswith(memory.BACKWARD_OP) for s in name_values] or [False])[name_idx]
        meta["memory"] = memory.allocator_summary(
            ts_ns[rows], step_col[rows], alloc.device, alloc.allocated, alloc.reserved, alloc.nbytes, alloc.addr,
            backward_starts=memory.first_per_step(ts_ns[backward], step_col[backward]))
    _link_device_comm(kind, on_device, correlation, ts_ns, dur_ns, tid_col, name_values, name_idx,
                      op, dim, pg, group_ranks, nbytes, seq)
    gloo = np.array([str(v).startswith("gloo:") for v in name_values] or [False], dtype=bool)[name_idx]
    _link_worker_comm(kind, on_device, ts_ns, dur_ns, tid_col, op, dim, pg, group_ranks, gloo)

    # Rows in time order, each column reordered as the table is built (a worker's peak memory is
    # what sets a load's: a reordered copy of every column at once cost ~30 MB on a 54 MB trace).
    order = np.argsort(ts_ns, kind="stable")
    columns = {
        "rank": np.full(n, rank, dtype=np.int32), "device": device.astype(np.int16), "stream": stream.astype(np.int32),
        "tid": tid_col, "ts_ns": ts_ns, "dur_ns": dur_ns, "step": step_col, "correlation": correlation,
        "external_id": external_id, "op": op, "dim": dim, "pg": pg, "group_ranks": group_ranks, "bytes": nbytes,
        "seq": seq, "peer": np.full(n, -1, dtype=np.int32), "shapes": shapes,
        "name": pa.DictionaryArray.from_arrays(pa.array(name_idx[order]), name_arr.dictionary),
        "lane": pa.DictionaryArray.from_arrays(pa.array(lane[order]), pa.array(lane_labels, pa.string())),
        "kind": kind_column(kind[order]),
    }
    # Only ``columns`` holds them now: build_table frees each original as it makes the reordered copy.
    work.correlation = work.external_id = work.names = work.cats = None
    del device, stream, tid_col, ts_ns, dur_ns, step_col, correlation, external_id, op, dim, pg, group_ranks
    del nbytes, seq, shapes, lane, kind, on_device, name_idx, cat_idx
    return build_table(columns, order), steps


def _shapes_json(a: _KeptArgs) -> str:
    """The ``shapes`` column: ``{"dims": Input Dims, "types": Input type, "concrete": Concrete
    Inputs}`` as the profiler recorded them (the last two where it did: scalar arguments such as a
    convolution's stride, padding and groups are in ``Concrete Inputs`` from PyTorch 2.1)."""
    out = b'{"dims":' + a.input_dims
    if a.input_type:
        out += b',"types":' + a.input_type
    if a.concrete:
        out += b',"concrete":' + a.concrete
    return (out + b"}").decode()


def _ints(values: list) -> np.ndarray:
    """int64 array from ints, numeric strings or None (-> -1); other strings -> -1."""
    try:
        return pa.array(values, type=pa.int64()).fill_null(-1).to_numpy()
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return np.array([_as_int(v) for v in values], dtype=np.int64)


def _as_int(v: int | str | None) -> int:
    if isinstance(v, int):
        return v
    if v is None:
        return -1
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _lane_labels(on_device: np.ndarray, device: np.ndarray, stream: np.ndarray, tid: np.ndarray,
                 tid_labels: np.ndarray | None) -> tuple[np.ndarray, list[str]]:
    """Each row's lane, ``gpu<D>/stream<S>`` or ``cpu/<tid>``, as (int32 codes, the labels): a
    label is made once per distinct lane, not per row."""
    codes = np.empty(len(tid), dtype=np.int32)
    labels: list[str] = []
    if on_device.any():
        key = device[on_device] * (1 << 32) + stream[on_device]
        uniq, inv = np.unique(key, return_inverse=True)
        labels += [f"gpu{k >> 32}/stream{k & 0xFFFFFFFF}" for k in uniq.tolist()]
        codes[on_device] = inv.reshape(-1)
    cpu = ~on_device
    if cpu.any():
        ids = tid_labels[cpu] if tid_labels is not None else tid[cpu]
        uniq, inv = np.unique(ids, return_inverse=True)
        codes[cpu] = inv.reshape(-1) + len(labels)
        labels += [f"cpu/{t}" for t in uniq.tolist()]
    return codes, labels


def _enclosing(outer_start: np.ndarray, outer_end: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Index of the latest-starting interval that contains each query time, else -1."""
    if len(outer_start) == 0:
        return np.full(len(query), -1)
    order = np.argsort(outer_start, kind="stable")
    s, e = outer_start[order], outer_end[order]
    pos = np.searchsorted(s, query, side="right") - 1
    ok = (pos >= 0) & (query <= e[np.clip(pos, 0, None)])
    return np.where(ok, order[np.clip(pos, 0, None)], -1)


def _link_device_comm(kind, on_device, correlation, ts_ns, dur_ns, tid_col, name_values, name_idx,
                      op, dim, pg, group_ranks, nbytes, seq) -> None:
    """Give each communication kernel the fields of the CPU call that launched it.

    kernel --correlation--> runtime launch (thread, time) --inside--> the
    innermost ``record_param_comms`` / ``nccl:*`` / ``mfuscope.comm/*`` call
    on that thread.  Fields the kernel already has stay, except an operation read from its
    name alone: the operation the trace states for the call wins (NCCL runs an all-to-all as
    ``ncclKernel_SendRecv``; Kineto's ``nccl:all_to_all`` says what it is).
    """
    dev_comm = np.flatnonzero((kind == KIND_CODE["comm"]) & on_device & (correlation >= 0))
    if len(dev_comm) == 0:
        return
    launch = np.flatnonzero(is_kind(kind, "runtime", "driver") & (correlation >= 0))
    order = np.argsort(correlation[launch], kind="stable")
    lc = correlation[launch][order]
    pos = np.clip(np.searchsorted(lc, correlation[dev_comm]), 0, max(len(lc) - 1, 0))
    if len(lc) == 0:
        return
    found = lc[pos] == correlation[dev_comm]
    kernels = dev_comm[found]
    launches = launch[order][pos[found]]
    is_call = np.array([collectives.is_comm_cpu_name(s) for s in name_values] or [False])[name_idx]
    is_call &= ~on_device
    calls = np.flatnonzero(is_call)
    for t in np.unique(tid_col[launches]):
        on_t = calls[tid_col[calls] == t]
        mine = launches[tid_col[launches] == t]
        ks = kernels[tid_col[launches] == t]
        if len(on_t) == 0:
            continue
        # Each field from the innermost call that has it: labels and record_param_comms nest.  A layer
        # gives each kernel at most one call, so a layer's fields are filled at once, innermost first.
        guessed = np.array([op[k] is None or op[k] == collectives.normalize_op(name_values[name_idx[k]])
                            for k in ks.tolist()], dtype=bool)
        for layer in _nesting_layers(on_t, ts_ns, dur_ns):
            hit = _enclosing(ts_ns[layer], ts_ns[layer] + dur_ns[layer], ts_ns[mine])
            inside = np.flatnonzero(hit >= 0)
            k, c = ks[inside], layer[hit[inside]]
            take = guessed[inside] & np.not_equal(op[c], None)
            op[k[take]] = op[c[take]]
            guessed[inside[take]] = False
            for field in (dim, pg, group_ranks):
                fill = np.equal(field[k], None) & np.not_equal(field[c], None)
                field[k[fill]] = field[c[fill]]
            for field in (nbytes, seq):
                fill = (field[k] < 0) & (field[c] >= 0)
                field[k[fill]] = field[c[fill]]


#: How long after an async call returns a gloo worker may still be picking its work up.
PICKUP_NS = 5_000_000


def _link_worker_comm(kind, on_device, ts_ns, dur_ns, tid_col, op, dim, pg, group_ranks, gloo) -> None:
    """Give each collective a gloo worker thread runs the group of the call that issued it.

    An async gloo call (DDP's bucket all-reduces, FSDP's prefetched gathers) returns at once; its
    work runs as ``gloo:<op>`` on a worker thread, without the process group's name, whenever the
    worker gets to it (on a loaded host, long after the call returned).  Every c10d call the
    collectors wrap is labelled, so the issuing call is the latest labelled call of the same op
    on another thread that started before the work.  The work inherits its dimension, group and
    ranks.  When a worker picked it up while the call ran or within ``PICKUP_NS`` of its return,
    the work is in flight from the call's start; later work is not stretched back, since a call
    matched across a gap (say a rank that slept before its next call) would book that gap as
    communication.
    """
    host = ~on_device
    work = np.flatnonzero(host & gloo & (kind == KIND_CODE["comm"]))  # none at all in an NCCL trace
    orphans = work[np.equal(dim[work], None)]
    if len(orphans) == 0:
        return
    labelled = np.flatnonzero(host & np.not_equal(dim, None) & np.not_equal(op, None))
    if len(labelled) == 0:
        return
    labelled = labelled[np.argsort(ts_ns[labelled], kind="stable")]
    starts = ts_ns[labelled]
    for i in orphans:
        j = np.searchsorted(starts, ts_ns[i], side="right") - 1
        while j >= 0 and (tid_col[labelled[j]] == tid_col[i] or op[labelled[j]] != op[i]):
            j -= 1
        if j < 0:
            continue
        c = labelled[j]
        if ts_ns[i] <= ts_ns[c] + dur_ns[c] + PICKUP_NS:
            end = ts_ns[i] + dur_ns[i]
            ts_ns[i] = min(ts_ns[i], ts_ns[c])
            dur_ns[i] = end - ts_ns[i]
        dim[i] = dim[c]
        if pg[i] is None:
            pg[i] = pg[c]
        if group_ranks[i] is None:
            group_ranks[i] = group_ranks[c]


def _nesting_layers(rows: np.ndarray, ts_ns: np.ndarray, dur_ns: np.ndarray) -> list[np.ndarray]:
    """Split intervals into layers of non-overlapping ones, innermost layer first.

    A call nested in another (``record_param_comms`` inside ``nccl:all_reduce``
    inside ``mfuscope.comm/tp/all_reduce``) lands in a deeper layer, so the
    per-layer interval search stays a binary search.
    """
    order = rows[np.lexsort((-(ts_ns[rows] + dur_ns[rows]), ts_ns[rows]))]
    layers: list[list[int]] = []
    ends: list[int] = []
    for r in order:
        start, end = ts_ns[r], ts_ns[r] + dur_ns[r]
        for li in range(len(layers)):
            if start >= ends[li]:
                layers[li].append(r)
                ends[li] = end
                break
        else:
            # Opens a new, deeper layer if it sits inside every layer's last interval.
            layers.append([r])
            ends.append(end)
    return [np.array(layer, dtype=np.int64) for layer in reversed(layers)]
