"""Step windows: which training step each event belongs to.

A step is marked by an annotation -- ``ProfilerStep#N`` from
``torch.profiler.schedule``, ``mfuscope.step#N`` from mfuscope's collectors,
or one the user names with ``--step-annotation REGEX``.  With no marker one
window is step 0: the **device span** (first device activity to last) where the
trace has device work, else the whole trace -- a markerless trace of a GPU job
often opens with seconds of CPU-only start-up (CUDA context, cuBLAS, the first
batch) that no step contains.  :func:`with_whole_trace_marker` adds a marker row
(``mfuscope.whole_trace``) for that window, so every analysis runs on such a
trace as on any other; the rank's ``steps_source`` says "device span" or "whole
trace".  A marker that outlives the trace (a step never closed: the profiler
stopped inside it) is clipped to the trace's last event.  CPU events belong to
the step whose span contains them; device events to the step of the CPU call
that launched them (a kernel often runs after its step's CPU span has ended).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mfuscope import labels
from mfuscope.errors import UserInputError
from mfuscope.event_table import KIND_CODE, build_table, is_kind

WHOLE_TRACE = "whole trace"
DEVICE_SPAN = "device span"
UNMARKED = (WHOLE_TRACE, DEVICE_SPAN)  #: the sources of a trace without step markers: one window
WHOLE_TRACE_MARKER = "mfuscope.whole_trace"


@dataclass
class Steps:
    number: np.ndarray   # step ids, sorted by start
    start: np.ndarray
    end: np.ndarray
    source: str


def find_steps(kind: np.ndarray, name_values: list[str], name_idx: np.ndarray, ts_ns: np.ndarray,
               dur_ns: np.ndarray, step_annotation: str | None, path: Path,
               on_device: np.ndarray | None = None) -> Steps:
    """The step markers, in time order; marks their rows ``kind="step"`` and clips a marker that
    outlives the trace (``dur_ns`` of its row too).  ``kind``, here and in every function of this
    module, holds the loader's kind codes (:data:`~mfuscope.event_table.KIND_CODE`).

    Precedence: the user's ``--step-annotation``; else mfuscope's own
    ``mfuscope.step#N`` (numbered by training step); else ``ProfilerStep#N``;
    else one window as step 0: the device span of ``on_device`` rows that are device work, or
    the whole trace.
    """
    markers = ("annotation", "cpu_op", "python", "nvtx")
    if step_annotation is not None:
        try:
            pattern = re.compile(step_annotation)
        except re.error as e:
            raise UserInputError(f"--step-annotation {step_annotation!r} "
                                 f"is not a valid regular expression: {e}") from None
        match = np.array([bool(pattern.search(s)) for s in name_values] or [False])
        rows = np.flatnonzero(match[name_idx] & is_kind(kind, *markers))
        if len(rows) == 0:
            raise UserInputError(f"no annotation matches --step-annotation {step_annotation!r}", path)
        rows = rows[np.argsort(ts_ns[rows], kind="stable")]
        numbers, source = np.arange(len(rows)), f"annotation {step_annotation!r}"
    else:
        parsed = [labels.parse_step(s) for s in name_values]
        for prefix in (labels.STEP, labels.PROFILER_STEP):
            step_num = np.array([p[1] if p and p[0] == prefix else -1 for p in parsed] or [-1])
            rows = np.flatnonzero((step_num[name_idx] >= 0) & is_kind(kind, *markers))
            if len(rows):
                break
        if len(rows) == 0:
            work = is_kind(kind, "kernel", "comm", "memcpy", "memset")
            if on_device is not None:
                work &= on_device
            span, source = (work, DEVICE_SPAN) if work.any() else (slice(None), WHOLE_TRACE)
            start, end = int(ts_ns[span].min()), int((ts_ns[span] + dur_ns[span]).max())
            return Steps(np.array([0]), np.array([start]), np.array([end]), source)
        rows = rows[np.argsort(ts_ns[rows], kind="stable")]
        numbers, source = step_num[name_idx][rows], prefix
    kind[rows] = KIND_CODE["step"]
    others = np.ones(len(ts_ns), dtype=bool)
    others[rows] = False
    if others.any():  # a step never closed ends with the trace's last event
        last = int((ts_ns[others] + dur_ns[others]).max())
        dur_ns[rows] = np.clip(np.minimum(ts_ns[rows] + dur_ns[rows], last) - ts_ns[rows], 0, None)
    return Steps(numbers, ts_ns[rows], ts_ns[rows] + dur_ns[rows], source)


def assign_steps(steps: Steps, kind: np.ndarray, on_device: np.ndarray, ts_ns: np.ndarray,
                  correlation: np.ndarray) -> np.ndarray:
    """Step of each event: CPU events by time; device events by their launch's step."""
    idx = np.searchsorted(steps.start, ts_ns, side="right") - 1
    inside = (idx >= 0) & (ts_ns < steps.end[np.clip(idx, 0, None)])
    step = np.where(inside, steps.number[np.clip(idx, 0, None)], -1).astype(np.int32)
    launches = is_kind(kind, "runtime", "driver")
    launch_corr = correlation[launches]
    dev_rows = np.flatnonzero(on_device & (correlation >= 0))
    if len(launch_corr) and len(dev_rows):
        order = np.argsort(launch_corr, kind="stable")
        sorted_corr = launch_corr[order]
        launch_step = step[launches][order]
        pos = np.searchsorted(sorted_corr, correlation[dev_rows])
        pos_c = np.clip(pos, 0, len(sorted_corr) - 1)
        found = sorted_corr[pos_c] == correlation[dev_rows]
        step[dev_rows[found]] = launch_step[pos_c[found]]
    return step


def device_window(steps: Steps, kind: np.ndarray, on_device: np.ndarray, ts_ns: np.ndarray, dur_ns: np.ndarray,
                  step: np.ndarray, name_idx: np.ndarray) -> None:
    """The one step of a one-step trace, on the device: the device-side annotation of the same
    name where the trace has one (Kineto's ``gpu_user_annotation`` ``ProfilerStep#N``), else the
    CPU range stretched to the end of the device work it launched.  The CPU range alone cuts the
    tail the host did not wait for (a real EP trace: a 112 ms marker, the device busy to 129 ms,
    121 kernels left out) and holds work launched before it (the Qwen traces: 363 kernels of the
    untraced warm-up step).

    With more steps, markers that follow one another (``ProfilerStep#N``) each hold a step's worth
    of device work in the steady state -- the previous step's tail in place of its own -- and
    device windows would drop what happens between steps' device work (data loading, the
    optimizer's host time), so those windows stay on the markers.  Markers with host time between
    them (a ``record_function`` that ends before the step's synchronization, as the reference
    trainer's did) leave each step's tail in the gap, outside every window: there each window is
    stretched to the end of the device work its step launched, never past the next marker (a
    1.3B model on an H200: 383 ms markers, 566 ms of device work a step, a third of it lost).
    Changes ``steps`` and the marker rows' ``ts_ns``/``dur_ns`` in place."""
    rows = np.flatnonzero(kind == KIND_CODE["step"])
    if steps.source in UNMARKED or len(rows) != len(steps.number) or not len(rows):
        return
    if len(rows) > 1:
        _stretch_into_gaps(steps, rows, kind, on_device, ts_ns, dur_ns, step)
        return
    row = rows[0]
    twin = np.flatnonzero((kind == KIND_CODE["gpu_annotation"]) & (name_idx == name_idx[row]))
    if len(twin):
        start, end = int(ts_ns[twin].min()), int((ts_ns[twin] + dur_ns[twin]).max())
    else:
        work = on_device & is_kind(kind, "kernel", "comm", "memcpy", "memset") & (step == steps.number[0])
        if not work.any():
            return
        start, end = int(steps.start[0]), max(int(steps.end[0]), int((ts_ns[work] + dur_ns[work]).max()))
    ts_ns[row], dur_ns[row] = start, end - start
    steps.start, steps.end = np.array([start]), np.array([end])


def _stretch_into_gaps(steps: Steps, rows: np.ndarray, kind: np.ndarray, on_device: np.ndarray,
                       ts_ns: np.ndarray, dur_ns: np.ndarray, step: np.ndarray) -> None:
    """Each step's window stretched to the end of the device work it launched, up to the next
    marker's start (markers that follow one another: at most the microseconds between them); the
    last step's only where the step before it finished on the device before it began (else its
    window already holds that step's tail).  See :func:`device_window`."""
    work = on_device & is_kind(kind, "kernel", "comm", "memcpy", "memset") & (step >= 0)
    if not work.any():
        return
    ends = ts_ns[work] + dur_ns[work]
    order = np.argsort(step[work], kind="stable")
    launched, first = np.unique(step[work][order], return_index=True)
    device_end = dict(zip(launched.tolist(), np.maximum.reduceat(ends[order], first).tolist()))
    new_end = steps.end.copy()
    numbers = steps.number.tolist()
    for i, number in enumerate(numbers):
        reach = device_end.get(number)
        if reach is None or reach <= steps.end[i]:
            continue
        if i + 1 < len(numbers):
            new_end[i] = min(reach, steps.start[i + 1])
        elif device_end.get(numbers[i - 1], steps.start[i]) <= steps.start[i]:
            new_end[i] = reach  # the step before finished on the device before this one began
    by_start = {int(t): r for t, r in zip(ts_ns[rows].tolist(), rows.tolist())}
    for i, start in enumerate(steps.start.tolist()):
        row = by_start.get(int(start))
        if row is not None:
            dur_ns[row] = new_end[i] - start
    steps.end = new_end


def with_whole_trace_marker(table: pa.Table, rank: int, steps: Steps) -> pa.Table:
    """``table`` (one rank, no step markers) with a marker for its one window (``steps``: what
    :func:`find_steps` found) as step 0, on the host thread that spent the most time in operators
    (the training thread; the first lane of a device-only trace)."""
    if table.num_rows == 0:
        return table
    start, end = int(steps.start[0]), int(steps.end[0])
    host = table.filter(pc.and_(pc.equal(table.column("device"), -1),
                                pc.is_in(table.column("kind").cast(pa.string()),
                                         pa.array(["cpu_op", "annotation", "python"]))))
    if host.num_rows:
        busy = host.group_by("lane").aggregate([("dur_ns", "sum")]).sort_by([("dur_ns_sum", "descending")])
        lane = busy.column("lane")[0].as_py()
    else:
        lane = table.column("lane").cast(pa.string())[0].as_py()
    row = build_table({
        "rank": [rank], "lane": [lane], "device": [-1], "stream": [-1], "tid": [-1], "kind": ["step"],
        "name": [WHOLE_TRACE_MARKER], "ts_ns": [start], "dur_ns": [end - start], "step": [0], "correlation": [-1],
        "external_id": [-1], "op": [None], "dim": [None], "pg": [None], "group_ranks": [None], "bytes": [-1],
        "seq": [-1], "peer": [-1], "shapes": [None]})
    # One chunk with one dictionary per column, as a freshly loaded (or cached) table has.
    return pa.concat_tables([row, table]).unify_dictionaries().combine_chunks()
