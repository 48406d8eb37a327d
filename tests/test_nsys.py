"""The Nsight Systems SQLite reader against `nsys stats` golden output."""
from __future__ import annotations

import csv
import re

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
    # nsys stats keeps 5-digit ABI tags (cudaStreamIsCapturing_v10000); mfuscope drops every tag of
    # 4+ digits, so the golden rows are summed under the untagged name first.
    golden: dict[str, list[int]] = {}
    with open(next(GOLDEN.glob("*cuda_api_sum.csv"))) as f:
        for row in csv.DictReader(f):
            counts = golden.setdefault(re.sub(r"_v\d{4,}$", "", row["Name"]), [0, 0])
            counts[0] += int(row["Num Calls"])
            counts[1] += int(row["Total Time (ns)"])
    assert "cudaStreamIsCapturing" in golden and "cuGetProcAddress_v2" in golden
    for api, (calls, total_ns) in golden.items():
        rows = df[(kind == "runtime") & (name == api)]
        assert len(rows) == calls and int(rows["dur_ns"].sum()) == total_ns, api
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
