"""Memory measured: the allocator's peak per rank, what filled it, and how much of the reserve is waste.

Three sources, each as the profiler or the allocator writes it (docs/memory.md):

- **Kineto's ``[memory]`` events** (``profile_memory=True``): one per allocation and free, with the
  allocator's ``Total Allocated`` and ``Total Reserved`` after it.  On a GPU these are the caching
  allocator's totals since the process started; on the CPU they count from the window's start
  (tensors allocated before it, such as the parameters, are not in them) and nothing is reserved.
  The parse folds them into a bounded per-step summary in the rank's metadata
  (:func:`allocator_summary`), so neither the table nor the map's summaries grow with allocations.
- **The memory timeline** (``prof.export_memory_timeline(PATH.raw.json.gz)``): every tensor's
  creation and destruction, ``[time_ns, action, bytes, category]``, the category being what the
  profiler's categorizer made of the tensor (parameter, optimizer state, input, temporary,
  activation, gradient, autograd detail, unknown).  It includes the tensors alive before the
  window, so on the CPU its peak is the rank's peak.  Read as HTA's ``MemoryAnalysis`` reads it.
- **A CUDA memory snapshot** (``torch.cuda.memory._snapshot()`` pickled, as
  ``_dump_snapshot``, Megatron's ``--record-memory-history`` and torchtitan's memory snapshots write
  it): the allocator's segments and blocks at one moment, and with history the trace of its last
  actions, from which the peak is replayed (:func:`snapshot_summary`).

The categorizer files FSDP2's sharded gradients and optimizer state as parameters, so where the
collectors counted the model states themselves (``memory.parquet``: the local shards of the
parameters, gradients and optimizer state at each optimizer step), the timeline's states at the peak
are split by that count (:func:`peak_categories`).
"""
from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mfuscope import atomic, run_dir
from mfuscope.errors import UserInputError

#: The memory timeline's category index -> name, in ``torch.profiler._memory_profiler``'s order
#: (``_CATEGORY_TO_INDEX``; HTA reads the same order).
TIMELINE_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                       "autograd_detail", "unknown")
#: The report's categories, and which timeline categories each takes.
CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "other")
_REPORT_OF = {"parameter": "parameter", "optimizer_state": "optimizer_state", "gradient": "gradient",
              "activation": "activation", "temporary": "temporary",
              "autograd_detail": "temporary",  # autograd's own buffers in backward: transient
              "input": "other", "unknown": "other"}
STATES = ("parameter", "gradient", "optimizer_state")
#: Points kept of a series (the dashboard's plot): the maximum of each of this many time buckets.
SERIES_POINTS = 400
#: Kineto's ``Device Type`` values (c10::DeviceType): 0 CPU, 1 CUDA; others are named by number.
_DEVICE_TYPES = {0: "cpu", 1: "cuda", 12: "mtia", 13: "hpu", 20: "privateuse1"}
NO_RESERVE_ON_CPU = "the CPU allocator reserves nothing ahead of use (Kineto reports 0)"


# --------------------------------------------------------------------------- Kineto's [memory] events

def device_key(device_type: int | None, device_id: int | None) -> str:
    """``cuda:0``, ``cpu``: how the summaries name an allocator."""
    kind = _DEVICE_TYPES.get(device_type if device_type is not None else 0, f"device{device_type}")
    return kind if kind == "cpu" else f"{kind}:{device_id if device_id is not None and device_id >= 0 else 0}"


#: The autograd engine's op around each backward function: the first marks where backward begins.
BACKWARD_OP = "autograd::engine::evaluate_function"


def first_per_step(ts_ns: np.ndarray, step: np.ndarray) -> dict[int, int]:
    """Step -> the earliest of ``ts_ns`` in it (steps < 0, outside every step, left out)."""
    out: dict[int, int] = {}
    for t, s in zip(ts_ns.tolist(), step.tolist()):
        if s >= 0 and (s not in out or t < out[s]):
            out[s] = t
    return out


def allocator_summary(ts_ns: np.ndarray, step: np.ndarray, device: np.ndarray, allocated: np.ndarray,
                      reserved: np.ndarray, nbytes: np.ndarray | None = None, addr: np.ndarray | None = None,
                      backward_starts: dict[int, int] | None = None) -> dict[str, Any]:
    """Per allocator (``device`` keys as :func:`device_key` gives), from its ``[memory]`` samples:
    the peak allocated and reserved, the reserve's waste at the reserved peak, the peak of each
    step, a series of at most :data:`SERIES_POINTS` points (each bucket's maximum), and -- with
    each event's bytes and address, and where each step's backward began -- the step's
    activations: what its forward allocated and had not freed when backward began
    (:func:`live_at`)."""
    out: dict[str, Any] = {}
    order = np.argsort(ts_ns, kind="stable")
    ts_ns, step, device = ts_ns[order], step[order], device[order]
    allocated, reserved = allocated[order], reserved[order]
    if nbytes is not None and addr is not None:
        nbytes, addr = nbytes[order], addr[order]
    for key in sorted(set(device.tolist())):
        at = np.flatnonzero(device == key)
        a, r, t, s = allocated[at], reserved[at], ts_ns[at], step[at]
        top = int(np.argmax(a))
        fullest = int(np.argmax(r))
        per_step = {}
        for st in np.unique(s[s >= 0]).tolist():
            mask = s == st
            per_step[str(st)] = {"peak_allocated_bytes": int(a[mask].max()), "peak_reserved_bytes": int(r[mask].max())}
            if nbytes is not None and addr is not None and st in (backward_starts or {}):
                before = mask & (t < backward_starts[st])
                per_step[str(st)]["forward_live_bytes"] = live_at(nbytes[at][before], addr[at][before])
        edges = np.linspace(0, len(a), min(len(a), SERIES_POINTS) + 1).astype(int)
        series = [[int(t[lo]), int(a[lo:hi].max()), int(r[lo:hi].max())] for lo, hi in zip(edges, edges[1:]) if hi > lo]
        out[key] = {"samples": len(a), "peak_allocated_bytes": int(a[top]), "peak_at_ns": int(t[top]),
                    "peak_step": int(s[top]), "peak_reserved_bytes": int(r[fullest]),
                    "reserved_waste_bytes": int(r[fullest] - a[fullest]), "per_step": per_step,
                    "series": series}
    return out


def live_at(nbytes: np.ndarray, addr: np.ndarray) -> int:
    """Bytes of the allocations among these events (in time order) not freed by a later one of
    them: a free matches the latest allocation at its address.  Frees of blocks allocated before
    (the previous step's gradients, say) do not count."""
    live: dict[int, int] = {}
    for b, ad in zip(nbytes.tolist(), addr.tolist()):
        if b > 0:
            live[ad] = b
        elif b < 0:
            live.pop(ad, None)
    return int(sum(live.values()))


# --------------------------------------------------------------------------- the memory timeline

def read_timeline(path: str | Path) -> np.ndarray:
    """A memory-timeline export (``*.raw.json.gz`` or plain JSON): an (n, 4) int64 array of
    ``[time_ns, action, bytes, category]`` rows.  A file of another shape is a UserInputError."""
    path = Path(path)
    try:
        with _open(path) as f:
            rows = json.loads(f.read())
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as e:
        raise UserInputError(f"not a readable memory timeline ({type(e).__name__}: {e})", path) from None
    if not isinstance(rows, list) or (rows and not isinstance(rows[0], list)):
        raise UserInputError("not a raw memory timeline: expected a list of [time, action, bytes, category] "
                             "(export it with a path ending in .raw.json.gz)", path)
    try:
        table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    except (TypeError, ValueError):
        raise UserInputError("not a raw memory timeline: rows are not four integers each", path) from None
    bad = (table[:, 3] < 0) | (table[:, 3] >= len(TIMELINE_CATEGORIES))
    if bad.any():
        raise UserInputError(f"memory timeline row {int(np.flatnonzero(bad)[0])}: category "
                             f"{int(table[bad][0, 3])} is not one of 0..{len(TIMELINE_CATEGORIES) - 1}", path)
    return table


def timeline_sizes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(times, bytes alive per category at each time): the running sum of each category, one row
    per distinct consecutive timestamp -- the series HTA's ``MemoryAnalysis`` plots.  Tensors that
    existed before profiling (time -1) are dated at the first real timestamp."""
    if len(rows) == 0:
        return np.empty(0, np.int64), np.empty((0, len(TIMELINE_CATEGORIES)), np.int64)
    t, nbytes, cat = rows[:, 0], rows[:, 2], rows[:, 3]
    delta = np.zeros((len(rows), len(TIMELINE_CATEGORIES)), np.int64)
    delta[np.arange(len(rows)), cat] = nbytes
    running = np.cumsum(delta, axis=0)
    last_of_run = np.flatnonzero(np.append(t[1:] != t[:-1], True))  # a time's state after all its events
    times = t[last_of_run].copy()
    positive = t[t > 0]
    if len(positive):
        times[times < 0] = positive.min()
    return times, running[last_of_run]


def timeline_summary(rows: np.ndarray) -> dict[str, Any]:
    """The timeline's peak (bytes alive in all categories) and what held it, plus a series of at
    most :data:`SERIES_POINTS` points in the report's categories (each bucket's peak instant)."""
    times, sizes = timeline_sizes(rows)
    if len(times) == 0:
        return {"peak_bytes": 0, "peak_at_ns": None, "at_peak": dict.fromkeys(TIMELINE_CATEGORIES, 0),
                "category_peaks": dict.fromkeys(CATEGORIES, 0), "series": []}
    total = sizes.sum(axis=1)
    top = int(np.argmax(total))
    edges = np.linspace(0, len(total), min(len(total), SERIES_POINTS) + 1).astype(int)
    series = []
    for lo, hi in zip(edges, edges[1:]):
        if hi > lo:
            i = lo + int(np.argmax(total[lo:hi]))
            series.append([int(times[i]), *_in_report_categories(sizes[i]).values()])
    in_report = sizes @ _TO_REPORT  # every time's bytes in the report's categories
    highest = {c: int(v) for c, v in zip(CATEGORIES, in_report.max(axis=0))}
    return {"peak_bytes": int(total[top]), "peak_at_ns": int(times[top]),
            "at_peak": {c: int(v) for c, v in zip(TIMELINE_CATEGORIES, sizes[top])}, "category_peaks": highest,
            "series": series}


#: (timeline category, report category) -> 1 where the first is counted in the second.
_TO_REPORT = np.array([[int(_REPORT_OF[t] == c) for c in CATEGORIES] for t in TIMELINE_CATEGORIES], dtype=np.int64)


def _in_report_categories(sizes: np.ndarray) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for name, value in zip(TIMELINE_CATEGORIES, sizes.tolist()):
        out[_REPORT_OF[name]] += int(value)
    return out


def peak_categories(at_peak: dict[str, int], states: dict[str, int] | None) -> dict[str, int]:
    """The report's categories at the timeline's peak (``at_peak``: bytes per timeline category),
    the states split by the collectors' count where there is one (:func:`split_states`)."""
    out = _in_report_categories(np.array([at_peak.get(c, 0) for c in TIMELINE_CATEGORIES]))
    if states:
        split, unexplained = split_states(sum(out[c] for c in STATES), states)
        out.update(split)
        out["other"] += unexplained
    return out


def split_states(filed: int, states: dict[str, int]) -> tuple[dict[str, int], int]:
    """The timeline's model states (``filed``: its parameter + gradient + optimizer-state bytes,
    right in sum, wrongly split under FSDP2) split by the collectors' count of the states held:
    parameters and optimizer state live the whole step, gradients take what remains.  Returns the
    split and the bytes the count does not explain (FSDP's gathered copies, filed as parameters)."""
    out, left = {}, filed
    for c in ("parameter", "optimizer_state", "gradient"):
        out[c] = min(int(states.get(c) or 0), left)
        left -= out[c]
    return out, left


# --------------------------------------------------------------------------- CUDA memory snapshots

class _PlainData(pickle.Unpickler):
    """A snapshot is dicts, lists, tuples, numbers and strings: anything that names a Python
    object is refused (unpickling an arbitrary file can run code)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names the Python object {module}.{name}")


def read_snapshot(path: str | Path) -> dict[str, Any]:
    """A pickled ``torch.cuda.memory._snapshot()`` (optionally gzipped).  Anything else --
    a truncated file, another pickle, a pickle naming Python objects -- is a UserInputError."""
    path = Path(path)
    try:
        with _open(path) as f:
            snap = _PlainData(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError) as e:
        raise UserInputError(f"not a readable CUDA memory snapshot ({type(e).__name__}: {e})", path) from None
    if isinstance(snap, list):  # torch.cuda.memory_snapshot(): the segments alone
        snap = {"segments": snap, "device_traces": []}
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise UserInputError("not a CUDA memory snapshot: no 'segments' list (write one with "
                             "torch.cuda.memory._dump_snapshot)", path)
    for i, seg in enumerate(snap["segments"]):
        if not isinstance(seg, dict) or not isinstance(seg.get("total_size"), int) \
                or not isinstance(seg.get("blocks"), list):
            raise UserInputError(f"not a CUDA memory snapshot: segment {i} has no 'total_size' and 'blocks'", path)
    return snap


def snapshot_summary(snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per device: reserved (the segments' sizes), allocated (active blocks), the reserve's waste
    (inactive blocks) and its largest free block, and -- with recorded history -- the peaks of
    allocated and reserved over the trace, replayed backwards from the state at the snapshot."""
    out: dict[str, dict[str, Any]] = {}
    for seg in snap["segments"]:
        d = out.setdefault(f"cuda:{int(seg.get('device', 0))}", {
            "segments": 0, "reserved_bytes": 0, "allocated_bytes": 0, "requested_bytes": 0,
            "inactive_bytes": 0, "largest_inactive_block_bytes": 0})
        d["segments"] += 1
        d["reserved_bytes"] += seg["total_size"]
        for block in seg["blocks"]:
            size, state = int(block.get("size", 0)), block.get("state")
            if state == "active_allocated":
                d["allocated_bytes"] += size
                d["requested_bytes"] += int(block.get("requested_size", size))
            elif state == "inactive":
                d["inactive_bytes"] += size
                d["largest_inactive_block_bytes"] = max(d["largest_inactive_block_bytes"], size)
    for device, trace in enumerate(snap.get("device_traces") or []):
        d = out.setdefault(f"cuda:{device}", {"segments": 0, "reserved_bytes": 0, "allocated_bytes": 0,
                                              "requested_bytes": 0, "inactive_bytes": 0,
                                              "largest_inactive_block_bytes": 0})
        d.update(_replayed_peaks(trace, d["allocated_bytes"], d["reserved_bytes"]))
    for d in out.values():
        d["fragmentation"] = d["inactive_bytes"] / d["reserved_bytes"] if d["reserved_bytes"] else None
    return out


#: A trace action -> (its change to allocated, to reserved) as a multiple of its size.
_ACTION_EFFECT = {"alloc": (1, 0), "free_requested": (-1, 0), "segment_alloc": (0, 1), "segment_map": (0, 1),
                  "segment_free": (0, -1), "segment_unmap": (0, -1)}


def _replayed_peaks(trace: list, allocated_end: int, reserved_end: int) -> dict[str, Any]:
    """Peaks over a device's trace: walking back from the snapshot's state, undoing each action."""
    allocated, reserved = allocated_end, reserved_end
    peak_a, peak_r, ooms = allocated, reserved, 0
    for entry in reversed(trace):
        if not isinstance(entry, dict):
            continue
        action = entry.get("action")
        ooms += action == "oom"
        da, dr = _ACTION_EFFECT.get(action, (0, 0))
        size = int(entry.get("size", 0))
        allocated -= da * size
        reserved -= dr * size
        peak_a, peak_r = max(peak_a, allocated), max(peak_r, reserved)
    return {"trace_entries": len(trace), "peak_allocated_bytes": peak_a, "peak_reserved_bytes": peak_r,
            "ooms": ooms}


# --------------------------------------------------------------------------- one rank, one report

def rank_entry(rank: int, allocators: dict[str, Any] | None, timeline: dict[str, Any] | None,
               states: dict[str, int] | None, snapshot: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The report's ``memory.per_rank`` entry of a rank from what it has of the sources (module
    docstring); None when it has none.

    The peak: a GPU allocator's from Kineto (absolute) or the snapshot; on the CPU the timeline's
    (it counts the tensors alive before the window), else Kineto's window-relative peak plus the
    states held from before the window (parameters and optimizer state).  The categories at the
    peak: the timeline's; without one, the states, the activations Kineto's events show alive when
    the peak step's backward began, and the rest as ``other``.  ``activation_peak_bytes``: the
    most activation memory held at once (the timeline's activation category over time, else the
    largest of the steps' forward-live bytes), what recomputation lowers and the model predicts."""
    if not (allocators or timeline or states or snapshot):
        return None
    allocators = allocators or {}
    device = next((k for k in sorted(allocators) if k != "cpu"), None)
    kineto = allocators.get(device or "cpu")
    entry: dict[str, Any] = {"rank": rank, "device": device or "cpu", "peak_allocated_bytes": None,
                             "peak_reserved_bytes": None, "fragmentation": None, "peak_step": None,
                             "categories": None, "activation_peak_bytes": None, "states": states, "sources": []}
    if kineto is not None:
        entry["sources"].append("kineto")
        entry.update(peak_step=kineto["peak_step"], per_step=kineto["per_step"])
        forward_live = [v["forward_live_bytes"] for v in kineto["per_step"].values() if "forward_live_bytes" in v]
        if forward_live:
            entry.update(activation_peak_bytes=max(forward_live), activation_source="kineto: allocated in forward, "
                         "alive when backward began")
    if device is not None:  # a GPU's caching allocator: absolute totals
        entry.update(peak_allocated_bytes=kineto["peak_allocated_bytes"],
                     peak_reserved_bytes=kineto["peak_reserved_bytes"],
                     fragmentation=kineto["reserved_waste_bytes"] / kineto["peak_reserved_bytes"]
                     if kineto["peak_reserved_bytes"] else None)
    else:
        entry["reserved_note"] = NO_RESERVE_ON_CPU
    if timeline is not None:
        entry["sources"].append("memory_timeline")
        entry["categories"] = peak_categories(timeline["at_peak"], states)
        entry.update(activation_peak_bytes=timeline["category_peaks"]["activation"],
                     activation_source="memory timeline: its activation category at its highest")
        if device is None:  # the CPU: the timeline counts the tensors alive before the window too
            entry["peak_allocated_bytes"] = timeline["peak_bytes"]
    elif device is None and kineto is not None:
        held = sum(int((states or {}).get(c) or 0) for c in ("parameter", "optimizer_state"))
        entry["peak_allocated_bytes"] = kineto["peak_allocated_bytes"] + held
        entry["peak_note"] = ("Kineto's CPU totals start at the profiled window"
                              + (": the parameters and optimizer state held from before it are added" if held
                                 else "; tensors allocated before it are not counted"))
    if snapshot is not None:
        snap = snapshot.get(entry["device"]) or next(iter(snapshot.values()), None)
        if snap is not None:
            entry["sources"].append("snapshot")
            entry["snapshot"] = snap
            for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
                if snap.get(key) is not None:
                    entry[key] = max(entry[key] or 0, snap[key])
            if entry["fragmentation"] is None:
                entry["fragmentation"] = snap["fragmentation"]
    if entry["categories"] is None and (states or entry["activation_peak_bytes"] is not None):
        known = {c: int((states or {}).get(c) or 0) if states else None for c in STATES}
        at_peak_step = ((kineto or {}).get("per_step", {}).get(str(entry["peak_step"])) or {}).get("forward_live_bytes")
        explained = sum(v for v in (*known.values(), at_peak_step) if v)
        entry["categories"] = {**known, "activation": at_peak_step, "temporary": None,
                               "other": max(0, (entry["peak_allocated_bytes"] or 0) - explained)}
    return entry


def of_rank(rank: int, allocators: dict[str, Any] | None, run: str | Path | None = None,
            views_dir: str | Path | None = None) -> dict[str, Any] | None:
    """A rank's ``memory.per_rank`` entry (a map task's: it reads only this rank's files).
    ``allocators``: the parse's :func:`allocator_summary` of its trace; ``run``: its run directory,
    for the collectors' count of the states and the window's memory files; ``views_dir``: where
    its part of the memory view goes (the dashboard's plot: :func:`series_frame`)."""
    timeline = snapshot = states = None
    if run is not None:
        files = Path(run) / run_dir.MEMORY_FILES
        if (files / f"rank{rank}.raw.json.gz").is_file():
            timeline = timeline_summary(read_timeline(files / f"rank{rank}.raw.json.gz"))
        if (files / f"rank{rank}.snapshot.pickle").is_file():
            snapshot = snapshot_summary(read_snapshot(files / f"rank{rank}.snapshot.pickle"))
        states = _states(Path(run), rank)
    entry = rank_entry(rank, allocators, timeline, states, snapshot)
    if entry is not None and views_dir is not None:
        frame = series_frame(rank, allocators, timeline, states)
        if len(frame):
            part = Path(views_dir) / VIEW / f"rank{rank:05d}.parquet"
            part.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_parquet(part, pa.Table.from_pandas(frame, preserve_index=False))
    return entry


def section(entries: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The report's ``memory`` section from the ranks' entries (None when no rank has one)."""
    per_rank = sorted((e for e in entries if e), key=lambda e: e["rank"])
    if not per_rank:
        return None
    peaks = [e for e in per_rank if e["peak_allocated_bytes"] is not None]
    top = max(peaks, key=lambda e: e["peak_allocated_bytes"]) if peaks else None
    return {"per_rank": per_rank, "ranks": len(per_rank),
            "peak_allocated_bytes": top["peak_allocated_bytes"] if top else None,
            "peak_rank": top["rank"] if top else None,
            "sources": sorted({src for e in per_rank for src in e["sources"]})}


#: The dashboard's memory view: each rank's series, time-ordered.
VIEW = "memory.parquet"
VIEW_COLUMNS = ["rank", "t_ns", "source", "allocated_bytes", "reserved_bytes", *CATEGORIES]


def series_frame(rank: int, allocators: dict[str, Any] | None, timeline: dict[str, Any] | None,
                 states: dict[str, int] | None) -> pd.DataFrame:
    """A rank's rows of the memory view: the timeline's points in the report's categories (its
    states split as :func:`peak_categories` splits the peak's) and the device allocator's samples."""
    rows = []
    for t, *values in (timeline or {}).get("series", []):
        at = dict(zip(CATEGORIES, values))
        if states:
            split, unexplained = split_states(sum(at[c] for c in STATES), states)
            at.update(split)
            at["other"] += unexplained
        rows.append({"rank": rank, "t_ns": t, "source": "memory_timeline", "allocated_bytes": sum(at.values()),
                     "reserved_bytes": None, **at})
    for key, a in (allocators or {}).items():
        for t, allocated, reserved in a["series"]:
            rows.append({"rank": rank, "t_ns": t, "source": f"kineto {key}", "allocated_bytes": allocated,
                         "reserved_bytes": reserved if key != "cpu" else None})
    frame = pd.DataFrame(rows, columns=VIEW_COLUMNS).sort_values("t_ns", kind="stable", ignore_index=True)
    # one schema in every rank's part (a missing figure is NaN, not a column of nulls)
    return frame.astype({"rank": "int32", "t_ns": "int64", "source": "string",
                         **{c: "float64" for c in VIEW_COLUMNS[3:]}})


def read_view(views_dir: str | Path, rank: int) -> pd.DataFrame:
    """A rank's rows of the memory view (empty when it has none)."""
    part = Path(views_dir) / VIEW / f"rank{rank:05d}.parquet"
    return pd.read_parquet(part) if part.is_file() else pd.DataFrame(columns=VIEW_COLUMNS)


def _states(run: Path, rank: int) -> dict[str, int] | None:
    """The collectors' count of the rank's model states (``memory.parquet``) at its last optimizer
    step: parameters, gradients and optimizer state are the same every step once the optimizer has
    made its state."""
    parts = sorted((run / run_dir.MEMORY).glob(f"rank{rank:05d}-*.parquet"))
    if not parts:
        return None
    rows = pa.concat_tables([pq.read_table(p) for p in parts]).to_pandas()
    rows = rows.dropna(subset=["parameter_bytes"]).sort_values("step")
    if rows.empty:
        return None
    last = rows.iloc[-1]
    return {"parameter": int(last["parameter_bytes"]), "gradient": int(last["gradient_bytes"]),
            "optimizer_state": int(last["optimizer_state_bytes"])}


def _open(path: Path):
    """The file, decompressed on the fly when it is gzip (by its magic number, not its name)."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def text_lines(section: dict[str, Any] | None) -> list[str]:
    """``mfuscope analyze``'s memory lines: the highest peak, what held it, and the prediction."""
    if not section or section.get("peak_allocated_bytes") is None:
        return []
    top = next(e for e in section["per_rank"] if e["rank"] == section["peak_rank"])
    peaks = [e["peak_allocated_bytes"] for e in section["per_rank"] if e["peak_allocated_bytes"] is not None]
    reserved = (f"reserved {_size(top['peak_reserved_bytes'])}"
                + (f", {top['fragmentation']:.0%} of it unused at its peak" if top.get("fragmentation") is not None
                   else "") if top["peak_reserved_bytes"] is not None else "nothing reserved on the CPU")
    lines = ["", f"memory        peak {_size(top['peak_allocated_bytes'])} allocated on rank {top['rank']} "
                 f"({top['device']}{'' if top.get('peak_step') is None else ', step ' + str(top['peak_step'])}; "
                 f"{reserved})" + (f"; ranks from {_size(min(peaks))}" if len(peaks) > 1 else "")]
    for label, cats in (("at the peak", top.get("categories")), ("predicted", top.get("predicted"))):
        if cats:
            lines.append(f"  {label:<13}" + "  ".join(f"{c.replace('_state', '')} {_size(cats[c])}"
                                                   for c in CATEGORIES if cats.get(c) is not None))
    if top.get("states"):
        st = top["states"]
        lines.append(f"  {'held':<13}" + "  ".join(f"{c.replace('_state', '')} {_size(st[c])}" for c in STATES)
                     + "  (counted at the optimizer step)")
    return lines


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def read_any(path: str | Path) -> dict[str, Any]:
    """``mfuscope memory FILE``: a CUDA snapshot pickle or a raw memory timeline, told apart by
    content (a pickle starts with its protocol byte, 0x80; the timeline is JSON, gzipped or not)."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError("no such file", path)
    with _open(path) as f:
        try:
            head = f.read(1)
        except (OSError, EOFError) as e:
            raise UserInputError(f"unreadable ({type(e).__name__}: {e})", path) from None
    if head == b"\x80":
        return {"file": str(path), "kind": "snapshot", "devices": snapshot_summary(read_snapshot(path))}
    summary = timeline_summary(read_timeline(path))
    return {"file": str(path), "kind": "memory_timeline", "peak_bytes": summary["peak_bytes"],
            "peak_at_ns": summary["peak_at_ns"], "at_peak": summary["at_peak"]}


def file_text(result: dict[str, Any]) -> str:
    """The text form of :func:`read_any`'s result."""
    if result["kind"] == "memory_timeline":
        lines = [f"memory timeline {result['file']}: peak {_size(result['peak_bytes'])} alive",
                 "  at the peak: " + "  ".join(f"{c} {_size(v)}" for c, v in result["at_peak"].items() if v)]
        return "\n".join(lines)
    lines = [f"CUDA memory snapshot {result['file']}"]
    for device, d in sorted(result["devices"].items()):
        frag = f"{d['fragmentation']:.1%}" if d["fragmentation"] is not None else "-"
        lines.append(f"  {device}: reserved {_size(d['reserved_bytes'])} in {d['segments']} segment(s), allocated "
                     f"{_size(d['allocated_bytes'])}, unused in the reserve {_size(d['inactive_bytes'])} ({frag}; "
                     f"largest free block {_size(d['largest_inactive_block_bytes'])})")
        if d.get("trace_entries"):
            lines.append(f"    over its {d['trace_entries']} recorded allocator actions: peak allocated "
                         f"{_size(d['peak_allocated_bytes'])}, peak reserved {_size(d['peak_reserved_bytes'])}"
                         + (f", {d['ooms']} out-of-memory error(s)" if d["ooms"] else ""))
    return "\n".join(lines)
