"""Parity with HTA (the reference analyzer) on the corpus GPU traces.

HTA parses the same files; per rank we compare total device time per stream
and communication / computation / memory kernel time.  Tolerance 0.5%.
"""
from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from mfuscope.analyzers import trace_set
from mfuscope.analyzers.kernel_time import device_time
from mfuscope.tests.helpers import DLRM, HTA_DATA, TRACES, needs_corpus

hta = pytest.importorskip("hta.trace_analysis",
                          reason="HTA (holistictraceanalysis) is in the [dev] extra; not installed")

TOL = 0.005

# Single-rank GPU traces that HTA itself can parse (HTA needs distributedInfo.rank).
SINGLE = [
    HTA_DATA / "df_index_resolver/df_index_resolver.json.gz",
    HTA_DATA / "nccl_parser_config/nccl_data.json.gz",
    HTA_DATA / "negative_queue_length_values_check/rank0.json.gz",
    HTA_DATA / "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    HTA_DATA / "critical_path/alexnet/benchmark_result_2869224_1695835535_trace.json.gz",
    HTA_DATA / "critical_path/cuda_event_sync_multi_stream/event_sync_trace.json.gz",
]


def _hta(trace_dir, monkeypatch):
    # HTA floors ns-resolution times to whole us by default (ceil start, floor
    # end: pytorch/pytorch#122425); keep its exact times so both sides agree.
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    logging.getLogger("hta").setLevel(logging.ERROR)
    # HTA drops kernels launched in the last ProfilerStep by default (it may be
    # cut short); mfuscope keeps every event, so ask HTA to keep them too.
    return hta.TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)


def _close(a, b):
    return abs(a - b) <= TOL * max(abs(a), abs(b), 1.0)


def _hta_population(events):
    """The device events HTA analyzes, chosen with our own columns.

    With more than one ProfilerStep, HTA keeps only kernels whose CPU launch
    is in the trace and starts no later than the end of the last step
    (``Trace._filter_irrelevant_gpu_kernels``); mfuscope keeps every event.
    """
    df = events.to_pandas(["rank", "kind", "correlation", "ts_ns", "dur_ns"])
    kind = df["kind"].astype(str)
    keep = np.ones(len(df), dtype=bool)
    for rank in events.rank_ids:
        mine = (df["rank"] == rank).to_numpy()
        steps = df[mine & (kind == "step").to_numpy()]
        if len(steps) < 2:
            continue
        last_end = (steps["ts_ns"] + steps["dur_ns"]).max()
        launch = df[mine & kind.isin(["runtime", "driver"]).to_numpy() & (df["ts_ns"] <= last_end).to_numpy()]
        device = mine & kind.isin(["kernel", "comm", "memcpy", "memset", "gpu_annotation"]).to_numpy()
        keep &= ~device | df["correlation"].isin(launch["correlation"]).to_numpy()
    return events.filter(keep)


def _compare(analysis, events):
    ours = device_time(_hta_population(events))
    breakdown = analysis.get_gpu_kernel_breakdown(visualize=False, num_kernels=10**9, include_memory_kernels=True)[1]
    symbols = analysis.t.symbol_table.get_sym_table()
    for rank in events.rank_ids:
        mine = ours[ours["rank"] == rank]
        # Per stream: HTA's parsed trace, its kernel, memcpy and memset events.
        trace = analysis.t.get_trace(rank)
        cat = trace["cat"].map(lambda i: symbols[i])
        work = trace[(trace["stream"] >= 0) & cat.isin(["kernel", "gpu_memcpy", "gpu_memset"])]
        hta_streams = work.groupby("stream")["dur"].sum().to_dict()
        my_streams = (mine.groupby("stream")["total_ns"].sum() / 1e3).to_dict()
        assert set(hta_streams) == set(my_streams), f"rank {rank}: streams differ"
        for s, v in hta_streams.items():
            assert _close(my_streams[s], v), f"rank {rank} stream {s}: {my_streams[s]} us vs HTA {v} us"
        # Communication vs computation vs memory, as HTA's kernel breakdown types them.
        # HTA types CUDA sync records on a stream as COMPUTATION; they are not kernels, so leave them out.
        sync_names = {symbols[i] for i in trace.loc[cat == "cuda_sync", "name"].unique()}
        kb = breakdown[(breakdown["rank"] == rank) & ~breakdown["name"].isin(sync_names)]
        kb = kb.groupby("kernel_type")["sum (us)"].sum().to_dict()
        by_kind = (mine.groupby("kind")["total_ns"].sum() / 1e3).to_dict()
        assert _close(by_kind.get("comm", 0), kb.get("COMMUNICATION", 0)), (rank, by_kind, kb)
        assert _close(by_kind.get("kernel", 0), kb.get("COMPUTATION", 0)), (rank, by_kind, kb)
        assert _close(by_kind.get("memcpy", 0) + by_kind.get("memset", 0), kb.get("MEMORY", 0)), (rank, by_kind, kb)


@needs_corpus(DLRM)
def test_dlrm_8_ranks_match_hta(monkeypatch):
    events = trace_set.load(DLRM, use_cache=False).events
    assert events.rank_ids == list(range(8))
    _compare(_hta(DLRM, monkeypatch), events)


@needs_corpus(TRACES)
@pytest.mark.parametrize("path", SINGLE, ids=lambda p: p.parent.name)
def test_single_rank_trace_matches_hta(path, tmp_path, monkeypatch):
    shutil.copy(path, tmp_path / path.name)
    events = trace_set.load(tmp_path, use_cache=False).events
    _compare(_hta(tmp_path, monkeypatch), events)
