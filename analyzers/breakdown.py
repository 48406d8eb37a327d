"""Top-down breakdown: where each step's time went, per rank, with leaves that add up exactly.

Every instant of a step (its marker's span on the training thread) goes to
exactly one leaf, by priority:

On a GPU rank (device work in the trace), the device's view:
  1. compute/<kind>   a compute kernel runs (gemm, conv, attention,
                      norm_elementwise, optimizer, other -- from the kernel name and the
                      operator that launched it: kernel_kinds.py)
  2. memory           only copies / fills run
  3. comm/<dim>/<op>  only communication runs: exposed communication
     bubble           ...of the pipeline dimension: a stage waiting on its neighbour
  4. queued           the device is idle with work already queued (launched, not yet
                      started): it waits on a dependency -- another stream's event, a
                      peer's data, a copy -- not on the host
  5. one_time_init    idle while the host initializes: CUDA/HIP context creation (the
                      first cudaFree), device queries, stream and event creation, module
                      and library loads, NVRTC, first-call launches that load a module
                      lazily (a launch over 1 ms): start-up, never a per-step cost
  6. allocator        idle while the host is in a blocking allocator call (cudaMalloc,
                      cudaFree, hipFree, pinned host allocations)
  7. data_loading     idle while the host is in a DataLoader
  8. host_bound       idle while the host is busy in operators or launches
  9. idle             idle otherwise (Python between operators, or nothing to do)

On either, before all of these: ``checkpoint``, the training thread blocked in a checkpoint save
(``mfuscope.checkpoint/<mode>``, the collectors' ``checkpoint`` region), whatever runs in it.

On a CPU-only rank (gloo training), the training thread's view: the thread
blocked in a collective or its wait (``mfuscope.comm/...``,
``mfuscope.wait/...``, c10d operators) is exposed communication (bubble for
the pipeline dimension), and so is its idle time while one of its collectives
is in flight on a gloo thread (DDP waits for its gradients that way, inside
C++); operators are compute by kind (the reference
trainer's paced and injected compute, ``mfuscope.paced``/``mfuscope.inject``
regions, count as compute/other; an operator called on a tensor subclass --
DTensor under tensor parallelism -- is host work, compute/other: its Python
dispatch runs inside it, and its compute is the local operators within, booked
by their own kind); DataLoader regions are
data_loading; the rest -- Python between operators -- is idle.

Output of :func:`step_leaves`: rank, step, leaf, seconds (a row per non-zero leaf).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd

from mfuscope import labels
from mfuscope.event_table import EventTable

from . import intervals as iv
from . import kernel_kinds
from .group_sums import grouped
from .kernel_kinds import kernel_kind  # noqa: F401 (by name alone; dashboard and tests import it from here)

COMPUTE_KINDS = ("gemm", "conv", "attention", "norm_elementwise", "optimizer", "other")

_OP_RULES = [
    ("attention", re.compile(r"scaled_dot_product|flash|attention|_efficient_attention")),
    ("gemm", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv)$")),
    ("norm_elementwise", re.compile(r"^aten::")),
]
_COMM_OP = re.compile(r"^(c10d::|_c10d_functional::|c10d_functional::|gloo:|nccl:|record_param_comms)")


def op_kind(name: str) -> str:
    for kind, rule in _OP_RULES:
        if rule.search(name):
            return kind
    return "other"


def _comm_leaf(dim: Any, op: Any) -> str:
    dim = dim if isinstance(dim, str) and dim else "unknown"
    op = op if isinstance(op, str) and op else "unknown"
    return "bubble" if dim == "pp" else f"comm/{dim}/{op}"


def _sets(frame: pd.DataFrame, keys: pd.Series) -> list[tuple[str, tuple[np.ndarray, np.ndarray]]]:
    out = []
    start = frame["ts_ns"].to_numpy()
    end = start + frame["dur_ns"].to_numpy()
    for key, idx in frame.groupby(keys.to_numpy(), sort=True).indices.items():
        out.append((key, iv.union(start[idx], end[idx])))
    return out


#: (rank, step, the step's [start, end) ns, the rank's plan): one step as :func:`step_plans` gives it.
StepPlan = tuple[int, int, tuple[int, int], list]


def step_leaves(events: EventTable, plans: Iterable[StepPlan] | None = None) -> pd.DataFrame:
    """Leaves of every (rank, step); see the module docstring.  ``plans``: :func:`step_plans` of
    ``events`` where the caller has made them (an analysis context makes them once for all readers)."""
    rows = []
    for rank, step, window, plan in step_plans(events) if plans is None else plans:
        for leaf, ns in iv.assign_by_priority(window, plan, rest="idle").items():
            if ns > 0:
                rows.append((rank, step, leaf, ns / 1e9))
    return pd.DataFrame(rows, columns=["rank", "step", "leaf", "seconds"])


def step_plans(events: EventTable) -> Iterator[StepPlan]:
    """(rank, step, the step's [start, end) ns, the rank's plan -- see :func:`rank_plan`) for every
    step marker: what the breakdown and the timelines split."""
    cols = ["rank", "lane", "device", "kind", "name", "ts_ns", "dur_ns", "op", "dim", "step", "correlation", "tid"]
    df = events.to_pandas(cols)
    # kind, name and lane stay categorical: string tests run once per distinct value, not per event
    for rank, rdf in df.groupby("rank", sort=True):
        steps = rdf[rdf["kind"] == "step"]
        if steps.empty:
            continue
        plan = rank_plan(rdf, steps)
        for step, ts, dur in zip(steps["step"].to_numpy(), steps["ts_ns"].to_numpy(), steps["dur_ns"].to_numpy()):
            yield rank, int(step), (int(ts), int(ts + dur)), plan


def rank_plan(rdf: pd.DataFrame, steps: pd.DataFrame) -> list[tuple[str, tuple[np.ndarray, np.ndarray]]]:
    """One rank's leaves as interval sets, highest priority first (time no set covers is idle).

    ``rdf``: the rank's events (columns as in :func:`step_leaves`); ``steps``: its step markers.
    """
    device = rdf[(rdf["device"] >= 0) & rdf["kind"].isin(["kernel", "comm", "memcpy", "memset"])]
    categories, idle_split = _device_plan(rdf, device) if len(device) else _cpu_plan(rdf, steps)
    # A checkpoint save holds the training thread: its whole span is the save's, whatever runs in it.
    saving = rdf[rdf["name"].str.startswith(labels.CHECKPOINT)]
    first = _sets(saving, pd.Series("checkpoint", index=saving.index)) if len(saving) else []
    return first + categories + idle_split  # idle_split: what idle device time is spent on, lowest priority


def _device_plan(rdf: pd.DataFrame, device: pd.DataFrame):
    kinds = device["kind"]
    compute = device[kinds == "kernel"]
    memory = device[kinds.isin(["memcpy", "memset"])]
    comm = device[kinds == "comm"]
    categories = []
    if len(compute):
        keys = kernel_kinds.classify(rdf, compute)  # by name and by the operators that launched it
        by_kind = dict(_sets(compute, keys))
        categories += [(f"compute/{k}", by_kind[k]) for k in COMPUTE_KINDS if k in by_kind]
    if len(memory):
        categories += _one_set("memory", memory["ts_ns"].to_numpy(), memory["dur_ns"].to_numpy())
    if len(comm):
        leaves = [_comm_leaf(d, o) for d, o in zip(comm["dim"], comm["op"])]
        categories += _sets(comm, pd.Series(leaves, index=comm.index))
    # host and loading rows as masks into the rank's columns: their sets need no frame of their own
    host = ((rdf["device"] < 0) & rdf["kind"].isin(["cpu_op", "runtime", "driver"])
            & ~rdf["name"].str.contains("Synchronize|cudaStreamWaitEvent|hipStreamSynchronize", regex=True)).to_numpy()
    loading = rdf["name"].str.contains("DataLoader", regex=False).to_numpy()
    ts, dur = rdf["ts_ns"].to_numpy(), rdf["dur_ns"].to_numpy()
    idle_split = []
    queued = _queued(rdf, device)
    if queued is not None:
        idle_split.append(("queued", queued))
    calls = rdf[rdf["kind"].isin(["runtime", "driver"])]
    if len(calls):
        init, allocator = _init_and_allocator_calls(calls)
        idle_split += [(leaf, _sets(rows, pd.Series(leaf, index=rows.index))[0][1])
                       for leaf, rows in (("one_time_init", init), ("allocator", allocator)) if len(rows)]
    if loading.any():
        idle_split += _one_set("data_loading", ts[loading], dur[loading])
    if host.any():
        idle_split += _one_set("host_bound", ts[host], dur[host])
    return categories, idle_split


def _one_set(leaf: str, ts: np.ndarray, dur: np.ndarray) -> list[tuple[str, tuple[np.ndarray, np.ndarray]]]:
    """:func:`_sets` of rows that all go to one leaf: their union, without grouping by a constant key."""
    return [(leaf, iv.union(ts, ts + dur))]


def _queued(rdf: pd.DataFrame, device: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """The device's idle gaps that had work queued when they began: the activity that ends the
    gap was launched before the gap began, so the device waited on a dependency (another stream's
    event, a peer, a copy), not on the host.  An activity launched before the trace began (its
    correlation id is below every launch the trace holds) was queued too; one whose launch is
    simply not in the trace decides nothing (the host rules take its gap)."""
    if device.empty:
        return None
    starts, ends = iv.union(device["ts_ns"].to_numpy(dtype=np.int64),
                            (device["ts_ns"] + device["dur_ns"]).to_numpy(dtype=np.int64))
    if len(starts) < 2:
        return None
    gap_start, gap_end = ends[:-1], starts[1:]
    launches = rdf[rdf["kind"].isin(["runtime", "driver"]) & (rdf["correlation"] >= 0)]
    at = _launch_times(launches["correlation"].to_numpy(), launches["ts_ns"].to_numpy(),
                       device["correlation"].to_numpy())
    # the earliest launch among the activities that start where each gap ends (NaN: none known)
    ts = device["ts_ns"].to_numpy()
    order = np.argsort(ts, kind="stable")
    at_ts, first_of = np.unique(ts[order], return_index=True)
    earliest = np.fmin.reduceat(at[order], first_of)
    where = np.minimum(np.searchsorted(at_ts, gap_end), len(at_ts) - 1)
    next_launch = np.where(at_ts[where] == gap_end, earliest[where], np.nan)
    waited = next_launch < gap_start  # NaN (launch unknown) compares False
    if not waited.any():
        return None
    return gap_start[waited], gap_end[waited]


def _launch_times(launch_corr: np.ndarray, launch_ts: np.ndarray, corr: np.ndarray) -> np.ndarray:
    """The (earliest) launch time of each correlation id in ``corr``, as float64: NaN where the
    trace holds no launch of it, -inf where it was launched before the trace began (an id below
    every launch's)."""
    at = np.full(len(corr), np.nan)
    if not len(launch_corr):
        return at
    ids, which = np.unique(launch_corr, return_inverse=True)
    earliest = np.full(len(ids), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(earliest, which, launch_ts)
    pos = np.minimum(np.searchsorted(ids, corr), len(ids) - 1)
    found = ids[pos] == corr
    at[found] = earliest[pos[found]].astype(np.float64)
    at[~found & (corr >= 0) & (corr < ids[0])] = -np.inf
    return at


#: Host calls that initialize, once: device and context queries, stream/event creation, module
#: and library loads, runtime compilation, context set-up.  (API names as CUDA, HIP and Nsight
#: print them, version tags dropped by the loaders.)
_INIT_CALL = re.compile(r"^(cuda|hip)(GetDeviceProperties|DeviceGetStreamPriorityRange|DeviceGetAttribute|"
                        r"StreamCreate|EventCreate|SetDevice|GetDeviceCount|DeviceSetLimit|FuncGetAttributes|"
                        r"DeviceGetPCIBusId|RuntimeGetVersion|DriverGetVersion|Init)|"
                        r"^cu(Init|DevicePrimaryCtx|CtxCreate|ModuleLoad|LibraryLoad|LibraryGetModule|"
                        r"ModuleGetFunction|LibraryGetKernel|GetProcAddress)|^nvrtc|^hipModuleLoad|"
                        r"^__hipRegister|^hipGetDevicePropertiesR", re.I)
_ALLOCATOR_CALL = re.compile(r"^(cuda|hip)(Malloc|Free|HostAlloc|HostFree|MallocHost|FreeHost|HostMalloc|"
                             r"HostRegister|HostUnregister|MallocAsync|FreeAsync)|^cuMem(Alloc|Free|Create|Map|"
                             r"Release|AddressReserve)", re.I)
_LAUNCH_CALL = re.compile(r"LaunchKernel|LaunchCooperativeKernel|GraphLaunch|^cuLaunch|ModuleLaunchKernel")
LAZY_LOAD_NS = 1_000_000  #: a kernel launch call this slow is loading its module (first call), not launching


def _init_and_allocator_calls(calls: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one-time initialization calls, blocking allocator calls) among a rank's runtime and driver
    calls.  The first cudaFree/hipFree is the context-creation idiom (``cudaFree(0)``), so it is
    initialization; first-call launches over :data:`LAZY_LOAD_NS` load their module lazily."""
    kind = kernel_kinds.per_name(calls["name"], _call_kind, default="")  # once per distinct name
    init = kind == "init"
    free = kind == "free"
    if free.any():  # the earliest (the first of equals)
        init[np.flatnonzero(free)[np.argmin(calls["ts_ns"].to_numpy()[free])]] = True
    init |= (kind == "launch") & (calls["dur_ns"].to_numpy() > LAZY_LOAD_NS)
    return calls[init], calls[((kind == "alloc") | free) & ~init]


def _call_kind(name: str) -> str:
    """init, free (an allocator call that frees), alloc (the other allocator calls), launch, or ''."""
    if _INIT_CALL.search(name):
        return "init"
    if _ALLOCATOR_CALL.search(name):
        return "free" if "Free" in name else "alloc"
    return "launch" if _LAUNCH_CALL.search(name) else ""


def blocked_in_comm(events: pd.DataFrame) -> pd.Series:
    """Which training-thread events are the thread blocked in communication: mfuscope's call
    and wait labels, and c10d / gloo / nccl operators (``name`` and ``kind`` as strings)."""
    name = events["name"]
    return name.str.match(labels.COMM_RE) | (name.str.match(_COMM_OP) & events["kind"].isin(["cpu_op", "annotation"]))


def _cpu_plan(rdf: pd.DataFrame, steps: pd.DataFrame):
    main = rdf[rdf["lane"] == steps["lane"].iloc[0]]
    name = main["name"]
    label = name.str.extract(labels.COMM_RE)
    labelled = main[label["dim"].notna()]
    raw_comm = main[blocked_in_comm(main) & label["dim"].isna()]
    categories = []
    if len(labelled):
        lab = label.loc[labelled.index]
        leaves = [_comm_leaf(d, o) for d, o in zip(lab["dim"], lab["op"])]
        categories += _sets(labelled, pd.Series(leaves, index=labelled.index))
    if len(raw_comm):
        categories += _sets(raw_comm, pd.Series("comm/unknown/unknown", index=raw_comm.index))
    optimizer = main[name.str.startswith("Optimizer.step#")]
    if len(optimizer):
        categories += _sets(optimizer, pd.Series("compute/optimizer", index=optimizer.index))
    simulated = name.str.startswith(labels.SIMULATED)
    ops = main[(main["kind"] == "cpu_op") | simulated]
    if len(ops):
        kind_of = {n: ("other" if n.startswith(labels.NAMESPACE) else op_kind(n)) for n in ops["name"].unique()}
        keys = np.array(ops["name"].map(kind_of), dtype=object)  # a copy: pandas may hand out a read-only view
        keys[_dispatches_a_subclass(ops)] = "other"
        by_kind = dict(_sets(ops, pd.Series(keys, index=ops.index)))
        categories += [(f"compute/{k}", by_kind[k]) for k in COMPUTE_KINDS if k in by_kind]
    loading = main[name.str.contains("DataLoader", regex=False)]
    idle_split = _sets(loading, pd.Series("data_loading", index=loading.index)) if len(loading) else []
    # Blocked where nothing shows: the thread is idle while its collective is in flight on a gloo
    # thread (DDP waits for its gradient all-reduce inside C++, with no operator to see).
    inflight = rdf[(rdf["kind"] == "comm") & (rdf["lane"] != steps["lane"].iloc[0])]
    if len(inflight):
        leaves = [_comm_leaf(d, o) for d, o in zip(inflight["dim"], inflight["op"])]
        idle_split += _sets(inflight, pd.Series(leaves, index=inflight.index))
    return categories, idle_split


#: The profiler's region for a tensor subclass's Python dispatch (DTensor's ``__torch_dispatch__``):
#: it sits inside the operator called on the subclass and holds the operators run on its local tensors.
SUBCLASS_DISPATCH = "PythonSubclass"


def _dispatches_a_subclass(ops: pd.DataFrame) -> np.ndarray:
    """Which of one thread's operators hold a subclass's Python dispatch (:data:`SUBCLASS_DISPATCH`)
    at any depth: an ``aten::add`` on DTensors spans DTensor's sharding propagation and the
    ``aten::add`` of the local shards, so booked by its name its whole span would be elementwise
    work (on a tp=2 CPU rank, 3x the elementwise and 1.3x the GEMM time the same ops take on plain
    tensors).  Such an operator is booked as ``other`` (host work): its compute is the local
    operators inside it, booked by their own names, which outrank it."""
    name = ops["name"].to_numpy(dtype=object)
    dispatch = name == SUBCLASS_DISPATCH
    if not dispatch.any():
        return dispatch
    start = ops["ts_ns"].to_numpy()
    end = start + ops["dur_ns"].to_numpy()
    order = np.argsort(start[dispatch], kind="stable")
    begins, ends = start[dispatch][order], end[dispatch][order]
    # one thread's operators nest: the first dispatch that begins inside an operator lies inside it
    # (unless it began at the same instant and holds the operator: a local operator of its own)
    first = np.minimum(np.searchsorted(begins, start, side="left"), len(begins) - 1)
    inside = (begins[first] >= start) & (begins[first] < end) & (ends[first] <= end)
    return inside & ~dispatch


def tree(leaves: pd.DataFrame) -> dict[str, Any]:
    """The breakdown as a tree of {name, seconds, children}: mean seconds per (rank, step)."""
    if leaves.empty:
        return {"name": "step", "seconds": 0.0, "children": []}
    n = leaves.groupby(["rank", "step"]).ngroups
    return tree_of((leaves.groupby("leaf")["seconds"].sum() / n).items())


def tree_of(totals: Iterable[tuple[str, float]]) -> dict[str, Any]:
    """{name, seconds, children} from (leaf, seconds) pairs: ``comm/tp/all_gather`` becomes a leaf
    under ``comm/tp`` under ``comm``; children sorted by time, largest first.  (The cost model
    builds its predicted tree with this too, so the two compare node by node.)"""
    root: dict[str, Any] = {"name": "step", "seconds": 0.0, "children": []}
    for leaf, seconds in totals:
        node = root
        node["seconds"] += seconds
        parts = leaf.split("/")
        for depth in range(len(parts)):
            name = "/".join(parts[:depth + 1])
            child = next((c for c in node["children"] if c["name"] == name), None)
            if child is None:
                child = {"name": name, "seconds": 0.0, "children": []}
                node["children"].append(child)
            child["seconds"] += seconds
            node = child
    _sort(root)
    return root


def _sort(node: dict) -> None:
    node["children"].sort(key=lambda c: -c["seconds"])
    for c in node["children"]:
        _sort(c)


def per_rank_step(leaves: pd.DataFrame) -> pd.DataFrame:
    """Columns: rank, step, step_s, wait_s (exposed communication + bubble), busy_s (the rest)."""
    if leaves.empty:
        return pd.DataFrame(columns=["rank", "step", "step_s", "wait_s", "busy_s"])
    wait = leaves["leaf"].str.startswith("comm/") | (leaves["leaf"] == "bubble")
    out = grouped({"rank": leaves["rank"], "step": leaves["step"], "seconds": leaves["seconds"],
                   "wait": leaves["seconds"].where(wait, 0.0)}, ["rank", "step"],
                  step_s=("seconds", "sum"), wait_s=("wait", "sum"))
    out["busy_s"] = out["step_s"] - out["wait_s"]
    return out
