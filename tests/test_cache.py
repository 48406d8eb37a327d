"""The parquet cache: keyed by content, bypassable, equal to a fresh parse."""
from __future__ import annotations

import os

from mfuscope.analyzers import trace_cache, trace_set
from mfuscope.tests.helpers import write_trace


def _events(n):
    """n operators and a step marker around them (len(events) == n + 1)."""
    return [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0.0,
             "dur": float(n)}] + [{"ph": "X", "cat": "cpu_op", "name": f"op{i % 7}", "pid": 1, "tid": 1,
                                   "ts": float(i), "dur": 0.5} for i in range(n)]


def test_second_load_is_served_from_cache_and_equal(tmp_path):
    for r in range(3):
        write_trace(tmp_path / f"rank{r}.json.gz", _events(500 + r), distributedInfo={"rank": r, "world_size": 3})
    first = trace_set.load(tmp_path, workers=1)
    second = trace_set.load(tmp_path, workers=1)
    assert first.cached == 0 and second.cached == 3
    assert second.events.table.equals(first.events.table)
    assert second.events.ranks == first.events.ranks


def test_changed_content_misses_and_no_cache_writes_nothing(tmp_path):
    f = write_trace(tmp_path / "rank0.json", _events(10))
    assert trace_set.load(f).cached == 0
    assert trace_set.load(f).cached == 1
    write_trace(f, _events(11))  # same name, new content
    result = trace_set.load(f)
    assert result.cached == 0 and len(result.events) == 12

    g = write_trace(tmp_path / "other" / "rank0.json", _events(12))
    before = set(os.listdir(trace_cache.cache_dir()))
    assert trace_set.load(g, use_cache=False).cached == 0
    assert set(os.listdir(trace_cache.cache_dir())) == before


def test_damaged_cache_entry_is_reparsed(tmp_path):
    f = write_trace(tmp_path / "rank0.json", _events(20))
    trace_set.load(f)
    key = trace_cache.cache_key(f, 0, None)
    (trace_cache.cache_dir() / f"{key}.parquet").write_bytes(b"garbage")
    result = trace_set.load(f)
    assert result.cached == 0 and len(result.events) == 21
    assert trace_set.load(f).cached == 1
