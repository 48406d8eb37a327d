"""Run directory, report.json and EventTable contracts: validated on write and on read."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mfuscope import run_dir
from mfuscope.errors import UserInputError
from mfuscope.event_table import (
    COLUMNS,
    KINDS,
    EventTable,
    SchemaMismatch,
    build_table,
    is_kind,
    kind_codes,
    kind_column,
)
from mfuscope.report import new_report, read_report, write_report


def _manifest(**over):
    m = run_dir.new_manifest("run-1", 8, layout={"pp": 2, "dp_shard": 2, "tp": 2},
                             hardware={"device_name": "NVIDIA H200", "device_count": 8, "peak_flops": 989.4e12},
                             process_groups=[{"name": "1", "dim": "tp", "ranks": [0, 1]}])
    m.update(over)
    return m


def test_manifest_round_trip(tmp_path):
    run_dir.write_manifest(tmp_path, _manifest())
    assert run_dir.is_run_dir(tmp_path)
    assert run_dir.read_manifest(tmp_path)["layout"] == {"pp": 2, "dp_shard": 2, "tp": 2}


@pytest.mark.parametrize("bad, where", [
    ({"world_size": 0}, "world_size"),
    ({"status": "exploded"}, "status"),
    ({"layout": {"tp": "two"}}, "layout/tp"),
])
def test_invalid_manifest_is_never_written(tmp_path, bad, where):
    with pytest.raises(UserInputError, match=where):
        run_dir.write_manifest(tmp_path, _manifest(**bad))
    assert list(tmp_path.iterdir()) == []


def test_invalid_manifest_on_disk_is_named(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 1, "run_id": "x"}))
    with pytest.raises(UserInputError) as e:
        run_dir.read_manifest(tmp_path)
    assert "manifest.json" in str(e.value) and "start_time" in str(e.value)


def test_overwrite_keeps_old_file_when_new_one_is_invalid(tmp_path):
    run_dir.write_manifest(tmp_path, _manifest())
    with pytest.raises(UserInputError):
        run_dir.write_manifest(tmp_path, _manifest(world_size=-1))
    assert run_dir.read_manifest(tmp_path)["world_size"] == 8
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp file left behind


def test_run_tables_cast_to_contract(tmp_path):
    steps = pa.table({"rank": [0, 1], "step": [3, 3], "start_ns": [10, 11], "end_ns": [20, 22],
                      "tokens": [4096, 4096], "loss": [2.5, 2.5], "device_time_ns": [None, None]})
    run_dir.write_table(tmp_path, run_dir.STEPS, steps)
    back = run_dir.read_table(tmp_path, run_dir.STEPS)
    assert back.schema == run_dir.STEPS_SCHEMA and back.column("end_ns").to_pylist() == [20, 22]
    # a column added after the first release (cpu_wait_ns) reads as null from a run written without it
    assert back.column("cpu_wait_ns").to_pylist() == [None, None]
    (tmp_path / "old").mkdir()
    pq.write_table(steps, tmp_path / "old" / run_dir.STEPS)
    assert run_dir.read_table(tmp_path / "old", run_dir.STEPS).column("cpu_wait_ns").null_count == 2
    with pytest.raises(ValueError, match="steps.parquet"):
        run_dir.write_table(tmp_path, run_dir.STEPS, pa.table({"rank": [0]}))


def test_report_schema(tmp_path):
    summary = {"mfu": 0.41, "hfu": 0.47, "step_time_s": 1.5, "tokens_per_s": 1e5}
    report = new_report("runs/x", ["a"], summary, breakdown={"name": "step", "seconds": 1.5, "children": [
        {"name": "compute", "seconds": 1.0}, {"name": "exposed comm", "seconds": 0.5}]},
        stragglers=[{"rank": 3, "cost_s": 0.05}])
    path = write_report(tmp_path / "report.json", report)
    assert read_report(path)["summary"]["mfu"] == 0.41
    report["stragglers"] = [{"rank": 3}]
    with pytest.raises(UserInputError, match="cost_s"):
        write_report(tmp_path / "bad.json", report)
    assert not (tmp_path / "bad.json").exists()


def test_event_table_rejects_wrong_columns():
    good = build_table({c: [] for c in COLUMNS})
    EventTable(good)
    with pytest.raises(SchemaMismatch):
        EventTable(good.drop_columns(["peer"]))
    with pytest.raises(SchemaMismatch):
        EventTable(good.set_column(COLUMNS.index("ts_ns"), "ts_ns", pa.array([], type=pa.float64())))


def test_kind_codes_round_trip_to_the_kind_column():
    """The loaders' int8 kind codes give the same column as the kind names themselves, and select
    the rows a string comparison selects (the oracle: numpy and Arrow on the names)."""
    import numpy as np

    names = np.array(["cpu_op", "kernel", "runtime", "cpu_op", "comm", "step", "kernel", "nvtx"], dtype=object)
    codes = kind_codes(names)
    column = kind_column(codes)
    assert column.to_pylist() == names.tolist()
    assert column.dictionary.to_pylist() == [k for k in KINDS if k in set(names)]  # present kinds, contract order
    for chosen in (("kernel",), ("runtime", "driver"), ("kernel", "comm", "memcpy", "memset")):
        assert is_kind(codes, *chosen).tolist() == np.isin(names, chosen).tolist()
    with pytest.raises(KeyError):
        kind_codes(["gpu_kernel"])  # not a kind of the contract
