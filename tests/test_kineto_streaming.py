"""The streaming decoder and the whole-buffer decoder give the same EventTable.

Pretty-printed traces (Kineto's layout) are decoded while they decompress;
anything else falls back to decoding the whole buffer.
"""
from __future__ import annotations

import gzip
import json

import pytest

from mfuscope.analyzers import kineto_json as k
from mfuscope.tests.helpers import DLRM, needs_corpus


def _events(n):
    out = []
    for i in range(n):
        out.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 5}", "pid": 1, "tid": 1, "ts": 10.0 * i,
                    "dur": 5.0, "args": {"External id": i, "Input Dims": [[2, 3], []], "note": "a},\n  {b"}})
    out.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "pid": 1, "tid": 1, "ts": 0.0,
                "dur": 10.0 * n})
    return out


def _doc(n):
    # Keys after the events, nested objects at the events' indentation, a base time at the end.
    return {"schemaVersion": 1, "traceEvents": _events(n),
            "distributedInfo": {"rank": 3, "world_size": 4, "pg_config": [{"pg_name": "0", "ranks": [0, 1]}]},
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
            "baseTimeNanoseconds": 1_700_000_000_000_000_000}


@pytest.mark.parametrize("indent", [2, 4])
def test_pretty_printed_trace_streams_and_matches(tmp_path, indent):
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_doc(50_000), indent=indent).encode()))
    trace_s, work_s = k._load_streaming(path)
    trace_w, work_w = k._load_whole(path)
    assert work_s.n == work_w.n == 50_001
    assert trace_s.distributedInfo.rank == trace_w.distributedInfo.rank == 3
    assert trace_s.baseTimeNanoseconds == trace_w.baseTimeNanoseconds
    assert trace_s.deviceProperties[0].name == "NVIDIA H100 80GB HBM3"
    assert work_s.names.to_pylist() == work_w.names.to_pylist()
    assert (work_s.ts_us == work_w.ts_us).all() and (work_s.external_id == work_w.external_id).all()


def test_minified_trace_takes_the_whole_buffer_path(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_doc(100)))
    with pytest.raises(k._NotStreamable):
        k._load_streaming(path)
    assert k.load_kineto_file(path).ranks[3]["n_steps"] == 1


@needs_corpus(DLRM)
def test_corpus_trace_identical_either_way():
    path = next(DLRM.glob("worker0_*.json"))
    _, s = k._load_streaming(path)
    _, w = k._load_whole(path)
    assert s.n == w.n and s.names.to_pylist() == w.names.to_pylist()
    assert (s.correlation == w.correlation).all() and (s.dur_us == w.dur_us).all()
