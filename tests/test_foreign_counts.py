"""Foreign jobs counted right (issue 27): the device tail of a one-step trace, operation names the
trace states, HFU from the shapes and dtypes the trace states.  Expected values are hand counts
over traces built from real event shapes (Kineto's categories, names and args as PyTorch writes
them), or formulas from the trace's dims.
"""
from __future__ import annotations

import pytest

from mfuscope.analyzers import overview, trace_set
from mfuscope.tests.helpers import write_trace

SENDRECV = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"


def _op(name, ts, dur, cat="cpu_op", tid=1, **args):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    if args:
        e["args"] = args
    return e


def _launch(ts, corr):
    return _op("cudaLaunchKernel", ts, 5.0, "cuda_runtime", correlation=corr)


def _kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "device": 0, "stream": stream}}


def _report(tmp_path, name, events, world=2):
    path = write_trace(tmp_path / name, events, distributedInfo={"rank": 0, "world_size": world})
    events = trace_set.load(path, use_cache=False).events
    return overview.build_report(events, source=name, files=[]), events


def test_a_one_step_trace_keeps_the_device_work_its_step_launched(tmp_path):
    """The marker ends at 1,000 us; a kernel it launched at 900 us runs 950-1,450 us (the host did
    not wait).  By hand: the step is 1,450 us, the kernel's 500 us all in it."""
    events = [_op("ProfilerStep#3", 0.0, 1000.0, "user_annotation"), _op("aten::mm", 850.0, 60.0),
              _launch(900.0, 1), _kernel("ampere_sgemm_128x64_nn", 950.0, 500.0, 1),
              _launch(100.0, 2), _kernel("ampere_sgemm_128x64_nn", 120.0, 300.0, 2)]
    report, _ = _report(tmp_path, "tail.json", events)
    assert report["breakdown"]["seconds"] == pytest.approx(1450e-6)
    leaves = {r["leaf"]: r["seconds"] for r in report["breakdown_by_rank"]}
    assert leaves["compute/gemm"] == pytest.approx(800e-6)


def test_with_more_steps_the_windows_stay_on_the_markers(tmp_path):
    """Two steps; the second's kernel runs past its marker.  Each CPU window holds a step's worth of
    device work in the steady state, so the last is not stretched: 2 x 1,000 us."""
    events = [_op("ProfilerStep#3", 0.0, 1000.0, "user_annotation"), _launch(100.0, 1),
              _kernel("ampere_sgemm_128x64_nn", 120.0, 300.0, 1),
              _op("ProfilerStep#4", 1000.0, 1000.0, "user_annotation"), _launch(1900.0, 2),
              _kernel("ampere_sgemm_128x64_nn", 1950.0, 500.0, 2)]
    report, _ = _report(tmp_path, "two.json", events)
    assert report["breakdown"]["seconds"] == pytest.approx(1000e-6)  # the mean of two 1,000 us steps


def test_the_operation_the_trace_states_wins_over_the_kernel_name(tmp_path):
    """NCCL runs an all-to-all as SendRecv kernels; Kineto's ``nccl:all_to_all`` around the launch
    says what it is (and so which bus factor applies).  A collective launched before the trace
    (its launch call is not in it) keeps the operation its kernel names."""
    events = [_op("ProfilerStep#3", 0.0, 2000.0, "user_annotation"),
              _op("nccl:all_to_all", 100.0, 50.0), _op("record_param_comms", 105.0, 30.0),
              _launch(110.0, 2), _kernel(SENDRECV, 200.0, 300.0, 2, stream=20),
              _kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 600.0, 100.0,
                      1, stream=20),
              _op("aten::empty", 1990.0, 10.0)]
    _, loaded = _report(tmp_path, "a2a.json", events)
    df = loaded.to_pandas(["kind", "name", "op"])
    ops = dict(zip(df[df["kind"] == "comm"]["name"].astype(str).str[:10], df[df["kind"] == "comm"]["op"]))
    assert ops == {"ncclKernel": "all_to_all", "ncclDevKer": "all_reduce"}
