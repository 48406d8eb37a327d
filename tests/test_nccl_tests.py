"""Bus bandwidth against what the links deliver, and against nccl-tests (issue 27, part 5).

The nccl-tests fixtures are real outputs quoted in public threads and files (each names its source
on its first line); the expected figures are read off them by hand.  The ratios are hand
computations: busbw = bytes / time x 2(n-1)/n for an all-reduce of n ranks; the link carries half
the hardware table's bidirectional figure a direction (H100: 900 / 2 = 450 GB/s NVLink, 100 / 2 =
50 GB/s NIC).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from mfuscope import cli
from mfuscope.analyzers import comm_stats, nccl_tests, overview, trace_set
from mfuscope.errors import UserInputError
from mfuscope.tests.helpers import write_trace

FIXTURES = Path(__file__).parent / "fixtures" / "nccl_tests"
H100_2X8 = FIXTURES / "all_reduce_perf_h100_2x8.txt"
H100 = "NVIDIA H100 80GB HBM3"
MIB = 1 << 20


@pytest.mark.parametrize("name, test, op, ranks, n_sizes, size, busbw", [
    # 16 MiB row: out-of-place 32.18, in-place 33.06 -> the better, 33.06
    ("all_reduce_perf_h100_2x8.txt", "all_reduce_perf", "all_reduce", 16, 31, 16777216, 33.06),
    ("all_reduce_perf_h100_2x8.txt", "all_reduce_perf", "all_reduce", 16, 31, 8589934592, 338.82),
    # nccl-tests 2.8 era: no root column, "N/A" errors; 64 MiB: 50.28 out-of-place, 44.35 in-place
    ("nccl_tests_78_all_reduce_256gpu.txt", "all_reduce_perf", "all_reduce", None, 6, 67108864, 50.28),
    # a blank redop column; the op from the file's name only
    ("nccl_tests_78_alltoall_8x8_v100.txt", "alltoall_perf", "all_to_all", None, 2, 268435456, 0.51),
    ("nccl_1411_all_reduce_4gpus_per_node.txt", "all_reduce_perf", "all_reduce", None, 7, 16777216, 120.88),
    # the op from "# Collective test starting: all_reduce_perf" (the file's name names none)
    ("dgx_spark_playbooks_103_gb10.txt", "all_reduce_perf", "all_reduce", 2, 4, 65536, 1.01),
])
def test_fixtures_read_as_printed(name, test, op, ranks, n_sizes, size, busbw):
    [table] = nccl_tests.read(FIXTURES / name)
    assert (table.test, table.op, table.ranks, len(table.sizes)) == (test, op, ranks, n_sizes)
    assert table.busbw_at(size) == pytest.approx(busbw)
    assert table.path.endswith(name)


def test_bus_bandwidth_is_interpolated_in_log_size():
    [t] = nccl_tests.read(H100_2X8)
    # 24 MiB between 16 MiB (33.06) and 32 MiB (59.69): log2(24/16) = 0.585 of the way
    assert t.busbw_at(24 * MIB) == pytest.approx(33.06 + math.log2(1.5) * (59.69 - 33.06))
    assert t.busbw_at(24 * MIB) == pytest.approx(48.64, abs=0.01)
    assert t.busbw_at(16 * 2**30) == pytest.approx(338.82)  # past the largest size: its figure
    assert t.busbw_at(4) is None  # under the smallest: none


def test_a_file_with_several_tests_gives_a_table_each(tmp_path):
    """nccl-tests 2.17+ writes '# Collective test starting: X' before each test of a run."""
    spark = (FIXTURES / "dgx_spark_playbooks_103_gb10.txt").read_text()
    body = spark.split("# Collective test starting: all_reduce_perf", 1)[1]
    both = tmp_path / "two.log"
    both.write_text(f"# Collective test starting: all_reduce_perf{body}"
                    f"# Collective test starting: all_gather_perf{body.replace(' sum ', 'none')}")
    tables = nccl_tests.read(both)
    assert [(t.test, t.op) for t in tables] == [("all_reduce_perf", "all_reduce"), ("all_gather_perf", "all_gather")]


@pytest.mark.parametrize("text, message", [
    ("no table here\njust words\n", "no nccl-tests result table"),
    ("", "no nccl-tests result table"),
])
def test_a_file_without_a_table_is_refused_by_name(tmp_path, text, message):
    bad = tmp_path / "all_reduce_perf.txt"
    bad.write_text(text)
    with pytest.raises(UserInputError, match=message) as e:
        nccl_tests.read(bad)
    assert str(bad) in str(e.value)


def test_a_table_that_names_no_collective_is_refused(tmp_path):
    bad = tmp_path / "results.txt"
    bad.write_text("\n".join(line for line in (FIXTURES / "nccl_1411_all_reduce_4gpus_per_node.txt")
                             .read_text().splitlines() if not line.startswith("# source")))
    with pytest.raises(UserInputError, match="cannot tell which collective") as e:
        nccl_tests.read(bad)
    assert str(bad) in str(e.value)


def test_rows_meet_the_table_of_their_group_size():
    tables = nccl_tests.read_all([FIXTURES / "nccl_1411_all_reduce_4gpus_per_node.txt", H100_2X8])
    rows = [{"op": "all_reduce", "group_size": 16, "busbw_gbps": 16.53, "median_bytes": 16 * MIB},
            {"op": "all_reduce", "group_size": 8, "busbw_gbps": 60.44, "median_bytes": 16 * MIB},
            {"op": "all_gather", "group_size": 8, "busbw_gbps": 10.0, "median_bytes": 16 * MIB},
            {"op": "all_reduce", "group_size": 8, "busbw_gbps": 1.0, "median_bytes": MIB}]  # under the sizes run
    nccl_tests.compare(rows, tables)
    # 16 ranks: the 16-rank H100 run, 33.06 at 16 MiB -> 50%
    assert rows[0]["nccl_tests_file"] == str(H100_2X8) and rows[0]["busbw_of_nccl_tests"] == pytest.approx(0.5)
    # 8 ranks: none has 8; the run whose ranks are unknown before the 16-rank one; 120.88 -> 50%
    assert rows[1]["nccl_tests_file"].endswith("nccl_1411_all_reduce_4gpus_per_node.txt")
    assert rows[1]["busbw_of_nccl_tests"] == pytest.approx(0.5)
    assert rows[2]["busbw_of_nccl_tests"] is None and rows[2]["nccl_tests_file"] is None  # no all_gather run
    assert rows[3]["busbw_of_nccl_tests"] is None  # 1 MiB: under that file's 2 MiB


def _calls(rows):
    """A calls frame as the collectors give it: dim, op, bytes, ns, group size and ranks."""
    return pd.DataFrame([{"rank": 0, "dim": d, "op": "all_reduce", "bytes": float(b), "dur_ns": float(ns),
                          "exposed_ns": 0.0, "group_size": n, "group_ranks": ranks} for d, b, ns, n, ranks in rows])


def test_rows_far_below_the_link_are_flagged():
    """An 8-rank all-reduce of 64 MiB on one H100 node: in 1 ms busbw = 67.1 GB/s x 1.75 = 117.4 GB/s,
    26% of NVLink's 450 a direction: fine; in 20 ms 5.87 GB/s, 1.3%: flagged.  256 KiB in 1 ms
    (0.46 GB/s, 0.1%) is latency-bound: not judged."""
    eight = ",".join(map(str, range(8)))
    links = comm_stats.Links.of(H100, 8)
    rows = {r["dim"]: r for r in comm_stats.summarize(_calls([
        ("tp", 64 * MIB, 1e6, 8, eight), ("dp", 64 * MIB, 20e6, 8, eight), ("pp", 256 << 10, 1e6, 8, eight)]), links)}
    assert rows["tp"]["busbw_gbps"] == pytest.approx(64 * MIB / 1e-3 * 1.75 / 1e9)
    assert rows["tp"]["attainable_busbw_gbps"] == 450 and rows["tp"]["tier"] == "scale-up"
    assert rows["tp"]["busbw_of_attainable"] == pytest.approx(0.261, abs=1e-3)
    assert rows["tp"]["flag"] is False
    assert rows["dp"]["busbw_of_attainable"] == pytest.approx(5.872 / 450, rel=1e-3)
    assert rows["dp"]["flag"] is True and "under 10%" in rows["dp"]["link_note"]
    assert rows["pp"]["busbw_of_attainable"] == pytest.approx(0.4588 / 450, rel=1e-3)
    assert rows["pp"]["flag"] is None and "latency-bound" in rows["pp"]["link_note"]


def test_a_group_across_nodes_is_held_to_the_nic():
    """64 MiB in 20 ms over 16 ranks of two nodes: 3.36 GB/s x 2(15)/16 = 6.29 GB/s, 12.6% of the H100
    reference system's 400 Gb/s NIC (50 GB/s a direction): not flagged.  In 10 ms between ranks 0 and
    8 (two nodes): 6.71 GB/s x 2(1)/2, 13.4%: not flagged; between 0 and 7 (one node): 1.5% of NVLink."""
    links = comm_stats.Links.of(H100, 16)
    [wide] = comm_stats.summarize(_calls([("dp", 64 * MIB, 20e6, 16, ",".join(map(str, range(16))))]), links)
    [pair] = comm_stats.summarize(_calls([("dp", 64 * MIB, 10e6, 2, "0,8")]), links)  # 64 MiB / 10 ms x 1
    [inside] = comm_stats.summarize(_calls([("dp", 64 * MIB, 10e6, 2, "0,7")]), links)
    assert (wide["tier"], wide["attainable_busbw_gbps"], wide["flag"]) == ("scale-out", 50, False)
    assert wide["busbw_of_attainable"] == pytest.approx(64 * MIB / 0.02 * 1.875 / 1e9 / 50)
    assert wide["busbw_of_attainable"] == pytest.approx(0.126, abs=1e-3)
    assert (pair["tier"], pair["flag"]) == ("scale-out", False)
    assert pair["busbw_of_attainable"] == pytest.approx(0.134, abs=1e-3)
    assert (inside["tier"], inside["flag"]) == ("scale-up", True)  # 6.7 GB/s of NVLink's 450: 1.5%
    # ranks not known: a group of a node's size in a job larger than a node is held to the lower figure
    [unknown] = comm_stats.summarize(_calls([("dp", 64 * MIB, 20e6, 8, None)]), links)
    assert unknown["tier"] == "scale-out" and "not known" in unknown["tier_source"]


def test_no_figure_no_judgement():
    """MI300X: no NIC in the table, so a cross-node row is not judged; an unknown device gets no
    figures at all (and no warning: the MFU's lookup warns)."""
    links = comm_stats.Links.of("AMD Instinct MI300X VF", 16)
    [row] = comm_stats.summarize(_calls([("dp", 64 * MIB, 20e6, 16, None)]), links)
    assert row["attainable_busbw_gbps"] is None and row["flag"] is None and "no scale-out" in row["link_note"]
    assert comm_stats.Links.of("x86_64", 4) is None
    [plain] = comm_stats.summarize(_calls([("dp", 64 * MIB, 20e6, 8, None)]))
    assert "flag" not in plain and plain["busbw_gbps"] is not None


def _allreduce_trace(path: Path, *, nbytes: int, dur_us: float) -> Path:
    """Rank 0 of an 8-rank H100 job: one step with a float all-reduce of ``nbytes`` over all 8 ranks,
    its NCCL kernel ``dur_us`` long (the shapes Kineto writes: record_param_comms around the launch)."""
    def op(name, ts, dur, cat="cpu_op", **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}
    events = [
        op("ProfilerStep#2", 0.0, dur_us + 1000.0, "user_annotation"),
        op("record_param_comms", 10.0, 30.0, **{"Collective name": "allreduce", "dtype": "Float",
                                                  "In msg nelems": nbytes // 4, "Out msg nelems": nbytes // 4,
                                                  "Group size": 8, "Process Group Name": "0",
                                                  "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]"}),
        op("cudaLaunchKernel", 20.0, 5.0, "cuda_runtime", correlation=11),
        {"ph": "X", "cat": "kernel", "pid": 0,
         "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "tid": 20, "ts": 100.0, "dur": dur_us, "args": {"correlation": 11, "device": 0, "stream": 20}},
        op("aten::empty", dur_us + 990.0, 10.0),
    ]
    return write_trace(path, events, distributedInfo={"rank": 0, "world_size": 8, "backend": "nccl"},
                       deviceProperties=[{"id": 0, "name": H100}])


def test_a_trace_s_slow_all_reduce_is_flagged_in_the_report(tmp_path):
    """64 MiB in 20 ms on 8 H100s: 5.87 GB/s bus bandwidth, 1.3% of NVLink; against the 16-rank
    nccl-tests run at 64 MiB (99.74 out-of-place, 99.06 in-place): 5.9%."""
    path = _allreduce_trace(tmp_path / "slow.json", nbytes=64 * MIB, dur_us=20000.0)
    events = trace_set.load(path, use_cache=False).events
    report = overview.build_report(events, source=str(path), files=[str(path)],
                                   nccl_tests=nccl_tests.read(H100_2X8))
    [row] = [c for c in report["comm"] if c["op"] == "all_reduce"]
    busbw = 64 * MIB / 0.02 * 1.75 / 1e9
    assert row["busbw_gbps"] == pytest.approx(busbw)
    assert row["flag"] is True and row["tier"] == "scale-up"
    assert row["busbw_of_nccl_tests"] == pytest.approx(busbw / 99.74)
    text = overview.format_text(report)
    assert "of link" in text and "! " in text and f"{busbw / 99.74:.1%}" in text
    fast = _allreduce_trace(tmp_path / "fast.json", nbytes=64 * MIB, dur_us=400.0)  # 293.6 GB/s: 65%
    [quick] = [c for c in overview.build_report(trace_set.load(fast, use_cache=False).events, source="f",
                                                files=[])["comm"] if c["op"] == "all_reduce"]
    assert quick["flag"] is False and quick["busbw_of_attainable"] == pytest.approx(0.652, abs=1e-3)


def test_analyze_with_nccl_tests_end_to_end(tmp_path):
    path = _allreduce_trace(tmp_path / "trace.json", nbytes=64 * MIB, dur_us=20000.0)
    out = subprocess.run([sys.executable, "-m", "mfuscope", "analyze", str(path), "--no-cache",
                          "--out", str(tmp_path / "report.json"), "--nccl-tests", str(H100_2X8)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "of nccl-tests" in out.stdout and "5.9%" in out.stdout and str(H100_2X8) in out.stdout
    [row] = [c for c in json.loads((tmp_path / "report.json").read_text())["comm"] if c["op"] == "all_reduce"]
    assert row["nccl_tests_file"] == str(H100_2X8) and row["nccl_tests_ranks"] == 16


def test_a_bad_nccl_tests_file_is_exit_2_naming_it(tmp_path, capsys):
    path = _allreduce_trace(tmp_path / "trace.json", nbytes=64 * MIB, dur_us=20000.0)
    bad = tmp_path / "all_reduce_perf.log"
    bad.write_bytes(b"\x00\x01 binary junk \xff")
    code = cli.main(["analyze", str(path), "--no-cache", "--out", str(tmp_path / "r.json"), "--nccl-tests", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()
    missing = tmp_path / "nope.txt"
    assert cli.main(["analyze", str(path), "--out", str(tmp_path / "r.json"), "--nccl-tests", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
