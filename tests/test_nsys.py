"""The Nsight Systems SQLite reader against `nsys stats` golden output."""
from __future__ import annotations

import csv

from mfuscope.analyzers import trace_set
from mfuscope.analyzers.nsys_sqlite import load_nsys_sqlite
from mfuscope.tests.helpers import CORPUS, needs_corpus

NSYS = CORPUS / "nsys"
SQLITE = NSYS / "nvfuser_64ee035_report1.sqlite"
GOLDEN = NSYS / "reference_stats_nsys2024.2.3"


@needs_corpus(SQLITE)
def test_kernel_summary_equals_nsys_stats():
    df = load_nsys_sqlite(SQLITE).to_pandas()
    k = df[df["kind"].astype(str).isin(["kernel", "comm"])]
    ours = k.groupby(k["name"].astype(str))["dur_ns"].agg(["count", "sum", "mean", "min", "max"])
    with open(next(GOLDEN.glob("*cuda_gpu_kern_sum.csv"))) as f:
        golden = list(csv.DictReader(f))
    assert len(ours) == len(golden)
    for row in golden:
        got = ours.loc[row["Name"]]
        assert int(got["count"]) == int(row["Instances"])
        assert int(got["sum"]) == int(row["Total Time (ns)"])
        assert int(got["min"]) == int(row["Min (ns)"]) and int(got["max"]) == int(row["Max (ns)"])
        assert abs(got["mean"] - float(row["Avg (ns)"])) <= 0.1


@needs_corpus(SQLITE)
def test_runtime_and_nvtx_counts_equal_nsys_stats():
    df = load_nsys_sqlite(SQLITE).to_pandas()
    name, kind = df["name"].astype(str), df["kind"].astype(str)
    with open(next(GOLDEN.glob("*cuda_api_sum.csv"))) as f:
        for row in csv.DictReader(f):
            rows = df[(kind == "runtime") & (name == row["Name"])]
            assert len(rows) == int(row["Num Calls"]) and int(rows["dur_ns"].sum()) == int(row["Total Time (ns)"])
    with open(next(GOLDEN.glob("*nvtx_sum.csv"))) as f:
        for row in csv.DictReader(f):
            rows = df[(kind == "nvtx") & (name == row["Range"])]
            assert len(rows) == int(row["Instances"]), row["Range"]
            assert int(rows["dur_ns"].sum()) == int(row["Total Time (ns)"]), row["Range"]


@needs_corpus(SQLITE)
def test_device_and_clock_from_the_export():
    events = trace_set.load(SQLITE, use_cache=False).events
    meta = events.ranks[0]
    assert meta["device_name"] == "NVIDIA H200"
    assert meta["export_schema"].startswith("3.")
    assert events.column("ts_ns").min() > 1_600_000_000 * 10**9  # epoch ns, not session-relative
