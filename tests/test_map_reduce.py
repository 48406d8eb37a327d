"""The analysis as a map over ranks and a reduce: the same report as the in-memory analysis, a
parent whose memory does not hold the events, a dying worker named, groups over 30 ranks, and
per-rank lists cut to the worst ranks with the rest in a view.

The oracle for "the same report" is frozen: the in-memory analysis's reports of two real sets,
made before the map/reduce existed (tests/fixtures/frozen_reports, with the commit named
inside).  Figures compare exactly up to float summation order (relative 1e-9: sums of the same
numbers in another order), kernel-duration and bandwidth medians within the sketch's stated error.
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mfuscope.analyzers import (
    analysis,
    duration_sketch,
    executor,
    map_reduce,
    overview,
    rank_lists,
    rank_summary,
    trace_set,
)
from mfuscope.errors import UserInputError
from mfuscope.event_table import EventTable
from mfuscope.tests.helpers import (
    DLRM,
    FROZEN_REPORTS,
    HTA_DATA,
    TRACES,
    needs_corpus,
    replicated_set,
    report_differences,
    synthetic_job,
    write_trace,
)

TRACE_FILTER = HTA_DATA / "trace_filter"
QWEN_H100 = TRACES / "TraceLens/tests/traces/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"  # [memory] events
def _analyze(path: Path, out: Path, **options) -> dict:
    report, _ = analysis.analyze(path, out / "report.json", out / "views", use_cache=False, progress=False,
                                 **options)
    return report


@needs_corpus(DLRM)
def test_dlrm_8_ranks_report_is_the_in_memory_analysis(tmp_path):
    frozen = json.loads((FROZEN_REPORTS / "dlrm_8_ranks.json").read_text())
    report = _analyze(DLRM, tmp_path, workers=2)
    assert report_differences(frozen, report) == []
    # the ranks' views: one part a rank, read as one dataset
    calls = pd.read_parquet(tmp_path / "views" / "comm_calls.parquet")
    assert sorted(calls["rank"].unique()) == list(range(8)) and calls["exposed_ns"].notna().any()
    segments, _ = analysis.read_views(tmp_path / "views")
    assert sorted(segments["rank"].unique()) == list(range(8))


def _views(views: Path) -> dict[str, pa.Table]:
    return {str(f.relative_to(views)): pq.read_table(f) for f in sorted(views.rglob("*.parquet")) if f.is_file()}


def _batched_and_alone(path: Path, tmp_path: Path, monkeypatch) -> tuple[dict, dict, dict, dict]:
    """(report, views) of ``path`` with every file in one map task, then with each file a task."""
    out = []
    for name, cut in (("together", lambda jobs, workers: [tuple(jobs)]),
                      ("alone", lambda jobs, workers: [(job,) for job in jobs])):
        monkeypatch.setattr(map_reduce, "batches", cut)
        report, *_ = map_reduce.analyze_ranks(path, views_dir=tmp_path / name, use_cache=False, workers=1,
                                              progress=False)
        out += [report, _views(tmp_path / name)]
    return tuple(out)


@needs_corpus(DLRM)
def test_ranks_summarized_in_one_task_give_the_frozen_report_and_each_ranks_views(tmp_path, monkeypatch):
    """The 8 DLRM ranks summarized together (rank_summary.summarize_ranks: one pass over their
    events) give the frozen in-memory report, and the views each rank summarized alone writes:
    the same files, schemas and rows."""
    together, views, alone, alone_views = _batched_and_alone(DLRM, tmp_path, monkeypatch)
    assert report_differences(json.loads((FROZEN_REPORTS / "dlrm_8_ranks.json").read_text()), together) == []
    assert report_differences(alone, together) == []
    assert list(views) == list(alone_views) and len(views) == 2 * 8 + 1  # timeline, calls a rank; microbatches
    for name, table in views.items():
        assert table.schema == alone_views[name].schema and table.equals(alone_views[name]), name


@pytest.mark.paced  # reads the session's 3D run, as the dashboard's paced tests do
def test_a_3d_runs_ranks_summarized_in_one_task_are_each_ranks_alone(run_3d, tmp_path, monkeypatch):
    """The same on a real 8-rank run (dp_shard x tp x pp, the collectors' communication rows, a
    pipeline's microbatches): one task of all ranks against a task a rank."""
    together, views, alone, alone_views = _batched_and_alone(run_3d, tmp_path, monkeypatch)
    assert report_differences(alone, together) == [] and together["summary"]["ranks"] == 8
    assert list(views) == list(alone_views)
    for name, table in views.items():
        assert table.schema == alone_views[name].schema and table.equals(alone_views[name]), name


def test_ranks_of_two_devices_summarized_together_keep_their_own_links(tmp_path):
    """A 16-rank all-reduce seen from rank 0 on an H100 (8 GPUs a node: the group spans two nodes,
    scale-out) and rank 1 on a GB200 (72 in one NVLink domain: scale-up), summarized in one call:
    each rank keeps its device's tier, as it does summarized alone (a mixed job, --allow-mixed)."""
    synthetic_job(tmp_path / "job", 16)
    parts = []
    for rank, device in ((0, "NVIDIA H100 80GB HBM3"), (1, "NVIDIA GB200")):
        path = tmp_path / "job" / f"rank{rank}.json"
        doc = json.loads(path.read_text())
        path.write_text(json.dumps({**doc, "deviceProperties": [{"id": 0, "name": device}]}))
        events, error, *_ = trace_set.load_file(path, None, None, False, None)
        assert error is None and events.ranks[rank]["device_name"] == device
        parts.append(events)
    together = rank_summary.summarize_ranks(EventTable.concat(parts), world=16)
    assert [s.rank for s in together] == [0, 1]
    apart = [rank_summary.summarize(part, world=16) for part in parts]
    for s, alone, tier in zip(together, apart, ("scale-out", "scale-up")):
        assert s.comm_parts["tier"]["tier"].tolist() == [tier]
        assert s.comm_parts["tier"].equals(alone.comm_parts["tier"]) and s.row == alone.row


def test_small_files_share_a_task_and_a_large_one_is_alone(tmp_path):
    """By hand: 100 files of 1 KB on 2 workers go 100 // (2 x 2) = 25 to a task (4 tasks); 1,000
    files 32 to a task (BATCH_FILES: 31 tasks of 32 and the last 8); a file over BATCH_BYTES
    closes the task before it and is one alone -- a gzip file by its decompressed size, not its
    size on disk; with 3 files and 2 workers every file is a task (3 // 4 = 0: one)."""
    def files(sizes, big=None):
        for i, n in enumerate(sizes):
            (tmp_path / f"rank{i}.json").write_bytes(b" " * n)
        names = [f"rank{i}.json" for i in range(len(sizes))]
        if big is not None:  # a gzip file small on disk whose trace is over the batch's bytes
            names[big] = f"rank{big}.json.gz"
            with gzip.open(tmp_path / names[big], "wb") as f:
                f.write(b" " * (map_reduce.BATCH_BYTES + 1))
            assert (tmp_path / names[big]).stat().st_size < map_reduce.BATCH_BYTES // 100
        return [map_reduce.RankJob(tmp_path / n, None, None, False, None, None, None, None, None, None, None, ())
                for n in names]

    def cut(jobs, workers):
        return [[int(j.file.name.split(".")[0][4:]) for j in unit] for unit in map_reduce.batches(jobs, workers)]

    assert [len(u) for u in cut(files([1024] * 100), 2)] == [25] * 4
    assert [len(u) for u in cut(files([1] * 1000), 2)] == [32] * 31 + [8]
    units = cut(files([1024] * 100, big=30), 2)
    assert units[:3] == [list(range(25)), list(range(25, 30)), [30]] and units[3][0] == 31
    assert sorted(r for u in units for r in u) == list(range(100))
    assert cut(files([1024] * 3), 2) == [[0], [1], [2]]


@needs_corpus(TRACE_FILTER)
def test_32_replicated_ranks_report_is_the_in_memory_analysis(tmp_path):
    """The trace_filter pair as 16 copies (ranks 0..31, each copy 10 us later than the one before)."""
    frozen = json.loads((FROZEN_REPORTS / "trace_filter_x16.json").read_text())
    traces = replicated_set(tmp_path / "set", sorted(TRACE_FILTER.glob("*.json.gz")), 16)
    assert report_differences(frozen, _analyze(traces, tmp_path, workers=2)) == []


@pytest.mark.paced  # reads the session's 3D run, as the dashboard's paced tests do
def test_a_run_directory_gets_the_same_report_from_workers_and_in_one_process(run_3d, tmp_path):
    """The worker path (each rank loaded, summarized and its communication rows read apart) and the
    in-process one (every rank in one table, split here) agree on a real 8-rank run."""
    events = trace_set.load(run_3d, use_cache=False, progress=False).events
    in_memory = overview.build_report(events, source=str(run_3d), files=[], run=run_3d)
    report, _ = analysis.analyze(run_3d, tmp_path / "report.json", tmp_path / "views", workers=2, progress=False)
    assert report_differences(in_memory, report) == []
    assert report["summary"]["ranks"] == 8 and report["findings"]


@needs_corpus(QWEN_H100)
def test_the_parent_holds_summaries_not_events(tmp_path):
    """The parent's traced memory (numpy and Python allocations) over 8 and 24 ranks of a real
    trace: its growth a rank stays under the issue's 100 KB.  One rank's events are 1.8 MB as an
    EventTable, so a parent that kept them would grow 18x past it; and the trace's allocator events
    fold into a 600-point series, 127 KB of Python objects a rank in a parent that kept them."""
    one = trace_set.load(QWEN_H100, use_cache=False).events
    assert one.table.nbytes > 1_000_000  # the events a leaking parent would hold
    assert sum(len(a["series"]) for a in one.ranks[0]["memory"].values()) == 600  # and the allocator's series
    big = replicated_set(tmp_path / "set24", [QWEN_H100], 24)
    small = tmp_path / "set8"  # its first 8 ranks: the same files, so the same cache entries
    small.mkdir()
    for r in range(8):
        (small / f"rank{r}.json.gz").symlink_to(big / f"rank{r}.json.gz")
    peaks = {}  # the workers parse (the 24 ranks' first 8 from the cache the 8 filled): the parent never does
    for n, traces in ((8, small), (24, big)):
        # The workers forked before tracing starts (no fork while tracemalloc holds its hooks), and
        # kept for the whole run: the parent's own memory is what is traced.
        with executor.RecyclingPool(2, tasks_per_worker=1000) as pool:
            list(pool.map(abs, [-1, -2]))
            tracemalloc.start()
            map_reduce.analyze_ranks(traces, pool=pool, progress=False)
            peaks[n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    slope = (peaks[24] - peaks[8]) / 16
    assert slope < 100_000, f"{slope / 1e3:.0f} KB a rank ({peaks})"
    print(f"parent: {slope / 1e3:.1f} KB a rank ({peaks})")


def _group_set(root: Path, world: int, group: int) -> Path:
    """``world`` ranks; ranks 0..group-1 form one process group (its rank list cut at 30 in the
    traces, as PyTorch's profiler writes it) and run two all-reduces in it.  Rank r arrives at the
    first at 100 + r us and at the second at 1100 us, except rank 5, 40 us late; every rank leaves
    at 700 and 1700 us.  The other ranks run no collective."""
    shown = ", ".join(str(r) for r in range(30)) + ", ..."
    for rank in range(world):
        events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
                   "ts": 0.0, "dur": 2000.0}]
        if rank < group:
            for corr, (arrive, leave, seq) in enumerate(((100.0 + rank, 700.0, 1),
                                                         (1100.0 + (40.0 if rank == 5 else 0.0), 1700.0, 2)), 1):
                events += [
                    {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": arrive - 20,
                     "dur": 10.0, "args": {"Collective name": "allreduce", "dtype": "BFloat16",
                                           "In msg nelems": 1 << 20, "Out msg nelems": 1 << 20, "Group size": group,
                                           "Process Group Name": "7", "Process Group Description": "undefined",
                                           "Process Group Ranks": f"[{shown}]", "Rank": rank, "Seq": seq}},
                    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                     "ts": arrive - 15, "dur": 5.0, "args": {"correlation": corr}},
                    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "pid": 0,
                     "tid": 7, "ts": arrive, "dur": leave - arrive,
                     "args": {"correlation": corr, "device": 0, "stream": 7}}]
        write_trace(root / f"rank{rank}.json", events,
                    distributedInfo={"backend": "nccl", "rank": rank, "world_size": world})
    return root


def test_a_64_rank_group_matches_and_the_per_rank_lists_keep_the_worst(tmp_path):
    """72 ranks, a 64-rank group.  By hand: the first all-reduce's arrivals span 0..63 us (skew 63 us,
    rank 63 last, 1 us after rank 62), the second's only rank 5 is late, by 40 us (skew 40 us);
    median skew 51.5 us.  72 ranks > the report's 64: the per-rank lists keep the worst 64 and the
    views hold all 72."""
    traces = _group_set(tmp_path / "set", 72, 64)
    report, _ = analysis.analyze(traces, tmp_path / "out" / "report.json", None, workers=2, use_cache=False,
                                 progress=False)
    (skew,) = report["comm_skew"]
    assert skew["instances"] == 2
    assert skew["median_skew_s"] == pytest.approx(51.5e-6, abs=1e-9)
    assert skew["waited_for"] == [{"rank": 5, "seconds": pytest.approx(40e-6)},
                                  {"rank": 63, "seconds": pytest.approx(1e-6)}]
    lists = report["rank_lists"]
    assert lists["ranks"] == {"ranks": 72, "kept": 64, "worst_by": lists["ranks"]["worst_by"],
                              "view": "ranks/ranks.parquet"}
    assert len(report["ranks"]) == 64
    views = tmp_path / "out" / "report.views"  # a trace set this large gets its views beside the report
    assert len(pd.read_parquet(views / "ranks" / "ranks.parquet")) == 72
    # arrival lags, the median of a rank's two: rank r's are r and 0 us, rank 5's 5 and 40 us; the
    # 8 ranks without a collective are not listed
    lags = {r["rank"]: r["median_lag_s"] for r in report["comm_arrival"]}
    assert set(lags) == set(range(64))
    assert lags[5] == pytest.approx(22.5e-6) and lags[63] == pytest.approx(31.5e-6) and lags[0] == 0
    assert lists["comm_arrival"]["ranks"] == 64 and lists["comm_arrival"]["view"] is None


def test_a_worker_that_dies_is_named_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    traces = _group_set(tmp_path / "set", 4, 4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"before": true}')
    monkeypatch.setenv(map_reduce.ENV_KILL_WORKER, "rank2.json")  # its worker kills itself, every time
    with pytest.raises(UserInputError) as e:
        analysis.analyze(traces, out / "report.json", out / "views", workers=2, use_cache=True, progress=False)
    assert "rank2.json" in str(e.value) and "died" in str(e.value)
    assert (out / "report.json").read_text() == '{"before": true}'  # the old report stands
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]  # no views, no staging folder
    # From the command line: one line, exit code 2, no traceback; --skip-bad analyzes the other ranks.
    cli = subprocess.run([sys.executable, "-m", "mfuscope", "analyze", str(traces), "--out", str(out / "r.json"),
                          "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr and "rank2.json" in cli.stderr
    report, loaded = analysis.analyze(traces, out / "r.json", None, workers=2, skip_bad=True, progress=False)
    assert report["summary"]["ranks"] == 3 and [Path(f).name for f, _ in loaded.skipped] == ["rank2.json"]


def test_the_duration_sketch_median_is_within_its_stated_error():
    import numpy as np

    rng = np.random.default_rng(0)
    for values in (rng.lognormal(9, 2, 1001), rng.integers(1, 50, 10), np.array([0, 0, 5]), np.array([7])):
        b = duration_sketch.buckets(values)
        ids, counts = np.unique(b, return_counts=True)
        got, exact = duration_sketch.median(ids, counts), float(np.median(values))
        assert abs(got - exact) <= duration_sketch.RELATIVE_ERROR * exact + 1e-12


def test_report_lists_of_few_ranks_are_whole():
    report = {"ranks": [{"rank": r, "step_time_s": 1.0} for r in range(3)]}
    assert rank_lists.cap(report)["rank_lists"]["ranks"] == {
        "ranks": 3, "kept": 3, "worst_by": "slowest median step", "view": None}
    assert len(report["ranks"]) == 3


def test_two_files_claiming_one_rank_fail_before_the_map(tmp_path):
    for name in ("a.json", "b.json"):
        write_trace(tmp_path / name, [], distributedInfo={"rank": 0, "world_size": 2})
    with pytest.raises(UserInputError, match="two files claim rank 0"):
        map_reduce.analyze_ranks(tmp_path, progress=False)
