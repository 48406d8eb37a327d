"""The C scanner (analyzers/_kineto_scan.c) gives the table msgspec's typed decoder gives.

The oracle is the msgspec path, kept as the scanner's fallback: every Kineto trace of the corpus is
loaded both ways and must come out identical, column by column and in its metadata.  Hand-written
batches cover what real traces rarely hold (escapes, exponents, 17-digit epoch timestamps, nulls,
duplicate keys) and what the scanner hands back to msgspec (string thread ids, malformed JSON).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mfuscope.analyzers import kineto_json as k
from mfuscope.errors import UserInputError
from mfuscope.tests.helpers import TRACES, needs_corpus

pytestmark = pytest.mark.skipif(k._scan is None, reason="the C scanner was not compiled (no C compiler at "
                                                        "install); the loader decodes with msgspec")


def _load(path, monkeypatch, native: bool):
    with monkeypatch.context() as m:
        if not native:
            m.setattr(k, "_scan", None)
        try:
            return k.load_kineto_file(path, rank=0)
        except UserInputError as e:
            return str(e)


def _same_tables(a, b) -> None:
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    assert a.ranks == b.ranks
    assert a.table.schema == b.table.schema
    for name in a.table.column_names:
        assert a.table.column(name).equals(b.table.column(name)), name


def _corpus_traces():
    if not TRACES.is_dir():
        return []
    return sorted(p for p in TRACES.rglob("*") if p.name.endswith((".json", ".json.gz")))


@needs_corpus()
def test_every_corpus_trace_loads_the_same_with_and_without_the_scanner(monkeypatch):
    paths = _corpus_traces()
    assert len(paths) >= 20, paths
    loaded = 0
    for path in paths:
        native, oracle = _load(path, monkeypatch, True), _load(path, monkeypatch, False)
        try:
            _same_tables(native, oracle)
        except AssertionError as e:
            raise AssertionError(f"{path}: {e}") from None
        loaded += not isinstance(oracle, str)
    assert loaded >= 20


def _event(**fields):
    base = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 10.5, "dur": 2.25,
            "args": {"External id": 7, "Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not _DROP}


_DROP = object()


def _both(events: list | bytes):
    data = events if isinstance(events, bytes) else json.dumps(events).encode()
    native = k._native_part(data, {})
    oracle, count = k._msgspec_part(data, {}, 0, k.Path("batch.json"))
    return native, oracle, count


def _same_parts(native, oracle) -> None:
    part, _ = native
    for field in k._Part._fields:
        a, b = getattr(part, field), getattr(oracle, field)
        if field == "allocator":
            assert all(np.array_equal(x, y) for x, y in zip(a, b)), a
        elif field == "args":  # the scanner keeps the decoded args (their own buffer); msgspec's are copied out
            assert {row: k._kept(x) for row, x in a.items()} == b
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b), field
        elif hasattr(a, "to_pylist"):
            assert a.to_pylist() == b.to_pylist(), field
        else:
            assert a == b, field


def test_hand_written_events_match_the_msgspec_decoder():
    events = [
        _event(),
        # escapes of every kind in a name, raw UTF-8, an astral character by surrogate pair
        _event(name='say "hi"\\ /\b\f\n\r\t é ∑ \U0001F600', cat="user_annotation"),
        # 17 significant digits (past the exact fast path), exponents, negative zero, integers as floats
        _event(ts=1669783687352244.125, dur=1.5e-3), _event(ts=1e3, dur=0), _event(ts=-0.0, dur=12),
        _event(ts=123456789012.34567),
        # nulls and absences: no ts (not work), args null, no args, no cat, no name
        _event(ts=None), _event(args=None), _event(args=_DROP), _event(cat=_DROP), _event(name=_DROP),
        # ids in args, with nulls; nested values the scanner skips
        _event(cat="kernel", name="nccl:all_reduce", args={"device": 0, "stream": 7, "correlation": 99,
               "External id": None, "Seq": 4, "Process Group Ranks": [0, 1], "nested": {"a": [1, {"b": None}]},
                                                                      "flag": True, "Collective name": "allreduce"}),
        # flows and metadata are not work; a thread name is kept
        _event(ph="f", cat="ac2g"), _event(ph="s", cat="ac2g"), _event(ph="i", cat="cpu_instant_event"),
        _event(ph="M", name="thread_name", cat=_DROP, ts=_DROP, dur=_DROP, tid=5, args={"name": "trainer"}),
        # an allocator sample
        _event(ph="i", cat="cpu_instant_event", name="[memory]",
               args={"Total Allocated": 4096, "Total Reserved": 8192, "Device Type": 1, "Device Id": 0,
                     "Bytes": -512, "Addr": 140000}),
        # keys the loader does not read, and a duplicated key (the last one counts)
        _event(id=3, bp="e", s="t"),
    ]
    raw = json.dumps(events).encode().replace(b'"ts": 10.5', b'"ts": 1.05e1', 1)
    raw = raw.replace(b'"tid": 2, ', b'"tid": 9, "tid": 2, ', 1)
    native, oracle, count = _both(raw)
    assert native is not None
    assert count == native[1] == len(events)
    _same_parts(native, oracle)
    assert oracle.thread_names == {5: "trainer"} and len(oracle.allocator.rows) == 1
    assert oracle.names.to_pylist()[1] == 'say "hi"\\ /\b\f\n\r\t é ∑ \U0001F600'


def test_every_float_rounds_as_msgspec_rounds_it():
    """Timestamps are compared exactly: random decimals of 1 to 19 digits, fractions of 0 to 25 digits."""
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(4000):
        whole = int(rng.integers(0, 10 ** int(rng.integers(1, 19))))
        frac = "".join(map(str, rng.integers(0, 10, int(rng.integers(0, 26)))))
        texts.append(f"{whole}.{frac}" if frac else str(whole))
    raw = ("[" + ",".join(f'{{"ph":"X","cat":"cpu_op","name":"a","ts":{t},"dur":{t}}}' for t in texts) + "]").encode()
    native, oracle, _ = _both(raw)
    assert native is not None
    expected = np.array([float(t) for t in texts])  # CPython's correctly rounded parse: a third opinion
    assert np.array_equal(native[0].ts, expected) and np.array_equal(oracle.ts, expected)
    assert not any(math.isnan(x) for x in native[0].dur)


@pytest.mark.parametrize("raw", [
    b'[{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "pid": 1, "tid": "PyTorch Profiler"}]',  # string tid
    b'[{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "args": {"stream": "hip stream 0"}}]',  # ROCm stream
    b'[{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "args": {"External id": 1.5}}]',  # a float id
    b'[{"ph": "X", "cat": "cpu_op", "name": "\\ud800", "ts": 1}]',  # a lone surrogate
    b'[{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1}',  # no end of the array
    b'[{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1,}]',  # a trailing comma
    b'[{"ph": "X", "cat": "cpu_op", "name": "a", "ts": "1"}]',  # a string timestamp
])
def test_what_the_scanner_does_not_handle_goes_to_msgspec(raw):
    """None sends the batch to the msgspec path, which decodes it or words the error."""
    assert k._native_part(raw, {}) is None


def test_string_thread_ids_load_through_the_fallback(tmp_path):
    events = [_event(tid="PyTorch Profiler"), _event(tid=3, ts=20.0)]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}, indent=1))
    table = k.load_kineto_file(path)
    assert sorted(set(table.column("lane"))) == ["cpu/3", "cpu/PyTorch Profiler"]
