"""Every corpus trace loads, and its counts match counts taken straight from the raw JSON."""
from __future__ import annotations

import collections

import pytest

from mfuscope.analyzers.kineto_json import load_kineto_file
from mfuscope.tests.helpers import TRACES, corpus_trace_files, needs_corpus, read_raw

FILES = [p for p in corpus_trace_files() if "memory_analysis" not in str(p)]


def _expected_counts(raw: dict) -> dict:
    """Independent count: categories and names as the profiler wrote them."""
    c = collections.Counter()
    for e in raw["traceEvents"]:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), e.get("name", "")
        if cat == "kernel":
            low = name.lower()
            c["comm_kernels" if ("nccl" in low or "rccl" in low) else "kernels"] += 1
        elif cat == "cpu_op":
            c["cpu_ops"] += 1
        elif cat == "user_annotation" and name.startswith("ProfilerStep#"):
            c["steps"] += 1
    c["steps"] = c["steps"] or 1  # no step markers: the whole trace is one window
    return c


@needs_corpus()
@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(TRACES)))
def test_corpus_trace_loads_with_exact_counts(path):
    events = load_kineto_file(path, rank=0)
    raw = _expected_counts(read_raw(path))
    kinds = collections.Counter(events.column("kind"))
    meta = next(iter(events.ranks.values()))
    # Every kernel is either compute or communication; gloo annotations are CPU comm.
    device_comm = int(((events.column("kind") == "comm") & (events.column("device") >= 0)).sum())
    assert kinds["kernel"] == raw["kernels"]
    assert device_comm == raw["comm_kernels"]
    assert kinds["cpu_op"] == raw["cpu_ops"]
    assert meta["n_steps"] == raw["steps"]
    assert (events.column("dur_ns") >= 0).all()


@needs_corpus()
def test_every_corpus_trace_is_covered():
    assert len(FILES) >= 25, "expected the whole corpus trace set"
