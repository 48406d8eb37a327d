"""The real-world cases the Kineto loader must get right, on small hand-made traces.

Each expected value is written out by hand from the trace text.
"""
from __future__ import annotations

import numpy as np
import pytest

from mfuscope.analyzers import trace_set
from mfuscope.analyzers.kineto_json import load_kineto_file, peek_header
from mfuscope.analyzers.steps import WHOLE_TRACE_MARKER
from mfuscope.errors import UserInputError
from mfuscope.tests.helpers import write_trace

EPOCH_US = 1_700_000_000_000_000  # 2023-11-14, in us


def _x(name, ts, dur, cat="cpu_op", pid=1, tid=1, **args):
    e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        e["args"] = args
    return e


def _df(events):
    """The trace's own events (without the marker a trace with no step markers gets)."""
    df = events.to_pandas()
    df["kind"] = df["kind"].astype(str)
    df["name"] = df["name"].astype(str)
    return df[df["name"] != WHOLE_TRACE_MARKER].reset_index(drop=True)


def test_epoch_and_base_relative_ranks_land_on_one_clock(tmp_path):
    # rank 0: absolute epoch us.  rank 1: relative to baseTimeNanoseconds.  Same instant.
    write_trace(tmp_path / "rank0.json", [_x("ProfilerStep#1", EPOCH_US + 1000.5, 10.0, cat="user_annotation")],
                distributedInfo={"rank": 0, "world_size": 2})
    base = (EPOCH_US - 5_000_000) * 1000
    write_trace(tmp_path / "rank1.json", [_x("ProfilerStep#1", 5_000_000 + 1000.5, 10.0, cat="user_annotation")],
                distributedInfo={"rank": 1, "world_size": 2}, baseTimeNanoseconds=base)
    df = _df(trace_set.load(tmp_path, use_cache=False).events)
    ts = df.set_index("rank")["ts_ns"]
    assert ts[0] == ts[1] == (EPOCH_US + 1000) * 1000 + 500


def test_fractional_us_keep_ns_and_never_go_negative(tmp_path):
    f = write_trace(tmp_path / "t.json", [
        _x("a", 100.0004, 0.0003),      # 100000.4 ns -> 100000 ns; end 100000.7 -> 100001 ns
        _x("b", 200.123456, 1.000001),  # start 200123.456 ns -> 200123; end 201123.457 -> 201123
        _x("c", 300.0, -0.002),         # a negative duration in the file
    ])
    df = _df(load_kineto_file(f, rank=0)).set_index("name")
    assert df.loc["a", "ts_ns"] == 100_000 and df.loc["a", "dur_ns"] == 1
    assert df.loc["b", "ts_ns"] == 200_123 and df.loc["b", "dur_ns"] == 1_000
    assert df.loc["c", "dur_ns"] == 0


def test_string_pid_and_tid(tmp_path):
    f = write_trace(tmp_path / "t.json", [_x("aten::add", 10.0, 1.0, pid="1234", tid="worker thread")])
    df = _df(load_kineto_file(f, rank=0))
    assert df.loc[0, "lane"] == "cpu/worker thread"
    assert df.loc[0, "tid"] == -1


def test_device_work_belongs_to_the_step_that_launched_it(tmp_path):
    f = write_trace(tmp_path / "t.json", [
        _x("ProfilerStep#7", 0.0, 100.0, cat="user_annotation"),
        _x("ProfilerStep#8", 100.0, 100.0, cat="user_annotation"),
        _x("cudaLaunchKernel", 90.0, 5.0, cat="cuda_runtime", correlation=42),
        # Runs on the GPU after step 7's CPU span has ended.
        _x("gemm_kernel", 150.0, 30.0, cat="kernel", pid=0, tid=7, device=0, stream=7, correlation=42),
    ])
    df = _df(load_kineto_file(f, rank=0)).set_index("name")
    assert df.loc["gemm_kernel", "step"] == 7
    assert df.loc["gemm_kernel", "lane"] == "gpu0/stream7"
    assert df.loc["cudaLaunchKernel", "step"] == 7


@pytest.mark.parametrize("kernel, op", [
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclSymkDevKernel_AllReduce_sum_bf16_LL(ncclSymkDevWorkArgs4K)", "all_reduce"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "send_recv"),
])
def test_nccl_kernels_of_every_era_are_communication(tmp_path, kernel, op):
    f = write_trace(tmp_path / "t.json", [_x(kernel, 10.0, 5.0, cat="kernel", pid=0, tid=7, device=0, stream=7)])
    df = _df(load_kineto_file(f, rank=0))
    assert df.loc[0, "kind"] == "comm" and df.loc[0, "op"] == op


def test_generic_rccl_kernel_takes_its_fields_from_record_param_comms(tmp_path):
    f = write_trace(tmp_path / "t.json", [
        _x("record_param_comms", 10.0, 20.0, tid=5, **{
            "Collective name": "allgather", "Process Group Name": "3", "Process Group Description": "mesh_tp",
            "Process Group Ranks": "[0, 2]", "In msg nelems": 1024, "dtype": "BFloat16", "Seq": 17}),
        _x("hipLaunchKernel", 12.0, 2.0, cat="cuda_runtime", tid=5, correlation=9),
        _x("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", 40.0, 8.0, cat="kernel",
           pid=2, tid=3, device="2", stream="3", correlation=9),
    ])
    df = _df(load_kineto_file(f, rank=0))
    k = df[df["kind"] == "comm"].iloc[0]
    assert (k["op"], k["dim"], k["pg"], k["group_ranks"], k["bytes"], k["seq"]) == (
        "all_gather", "tp", "3", "0,2", 2048, 17)
    assert k["lane"] == "gpu2/stream3"


def test_old_record_param_comms_without_fields_use_the_annotation_shapes(tmp_path):
    # DLRM-era traces: record_param_comms carries nothing; nccl:all_reduce carries the tensor.
    f = write_trace(tmp_path / "t.json", [
        _x("nccl:all_reduce", 10.0, 30.0, cat="user_annotation", tid=5,
           **{"Input Dims": [[394241]], "Input type": ["float"]}),
        _x("record_param_comms", 11.0, 28.0, tid=5, **{"Input Dims": [[]], "Input type": ["TensorList"]}),
        _x("cudaLaunchKernel", 12.0, 2.0, cat="cuda_runtime", tid=5, correlation=3),
        _x("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", 50.0, 8.0,
           cat="kernel", pid=0, tid=84, device=0, stream=84, correlation=3),
    ])
    df = _df(load_kineto_file(f, rank=0))
    k = df[df["kind"] == "comm"].iloc[0]
    assert k["op"] == "all_reduce" and k["bytes"] == 394241 * 4


def test_gloo_work_on_its_own_thread_is_cpu_communication(tmp_path):
    f = write_trace(tmp_path / "t.json", [
        _x("ProfilerStep#3", 0.0, 1000.0, cat="user_annotation", tid=1),
        _x("gloo:all_reduce", 100.0, 400.0, cat="user_annotation", tid=9,
           **{"Input Dims": [[1000]], "Input type": ["float"]}),
    ])
    df = _df(load_kineto_file(f, rank=0))
    g = df[df["name"] == "gloo:all_reduce"].iloc[0]
    assert (g["kind"], g["op"], g["bytes"], g["step"], g["device"]) == ("comm", "all_reduce", 4000, 3, -1)


def test_mfuscope_comm_labels_give_the_dimension(tmp_path):
    f = write_trace(tmp_path / "t.json", [
        _x("mfuscope.comm/cp/all_gather", 10.0, 50.0, cat="user_annotation", tid=5),
        _x("record_param_comms", 11.0, 40.0, tid=5, **{"Collective name": "allgather", "In msg nelems": 8,
                                                        "dtype": "Float"}),
        _x("cudaLaunchKernel", 12.0, 2.0, cat="cuda_runtime", tid=5, correlation=4),
        _x("ncclDevKernel_AllGather_RING_LL(x)", 60.0, 5.0, cat="kernel", pid=0, tid=7, device=0, stream=7,
           correlation=4),
    ])
    df = _df(load_kineto_file(f, rank=0))
    k = df[df["kind"] == "comm"].iloc[0]
    assert (k["dim"], k["op"], k["bytes"]) == ("cp", "all_gather", 32)


def test_steps_from_a_named_annotation_and_whole_trace_window(tmp_path):
    events = [_x("train_step", 0.0, 10.0, cat="user_annotation"), _x("aten::mm", 2.0, 1.0),
              _x("train_step", 20.0, 10.0, cat="user_annotation"), _x("aten::mm", 22.0, 1.0)]
    f = write_trace(tmp_path / "t.json", events)
    whole = load_kineto_file(f, rank=0)
    meta = next(iter(whole.ranks.values()))
    assert meta["steps_source"] == "whole trace" and meta["steps"] == [0]
    assert (whole.column("step") == 0).all()
    named = load_kineto_file(f, rank=0, step_annotation=r"^train_step$")
    df = _df(named)
    assert df[df["name"] == "aten::mm"]["step"].tolist() == [0, 1]
    with pytest.raises(UserInputError, match="no annotation matches"):
        load_kineto_file(f, rank=0, step_annotation="^nothing$")


def test_rank_from_head_then_file_name(tmp_path):
    a = write_trace(tmp_path / "x.json", [_x("a", 1.0, 1.0)], distributedInfo={"rank": 5, "world_size": 8})
    assert peek_header(a) == {"rank": 5, "world_size": 8}
    b = write_trace(tmp_path / "worker3_step_12.json", [_x("a", 1.0, 1.0)])
    assert peek_header(b) == {}
    assert list(load_kineto_file(b).ranks) == [3]


def test_amd_style_string_streams(tmp_path):
    f = write_trace(tmp_path / "t.json", [
        _x("hipLaunchKernel", 1.0, 1.0, cat="cuda_runtime", correlation=1),
        _x("Cijk_Ailk_Bljk_BBS", 5.0, 3.0, cat="kernel", pid=2, tid=1, device="2", stream="1", correlation=1),
    ], deviceProperties=[{"id": 2, "name": "AMD Instinct MI300X VF"}])
    events = load_kineto_file(f, rank=0)
    df = _df(events)
    k = df[df["kind"] == "kernel"].iloc[0]
    assert (k["device"], k["stream"], k["lane"]) == (2, 1, "gpu2/stream1")
    assert next(iter(events.ranks.values()))["device_name"] == "AMD Instinct MI300X VF"
    assert np.all(df["dur_ns"] >= 0)


def test_mfuscope_step_markers_win_over_profiler_steps(tmp_path):
    # The trainer marks mfuscope.step#N inside torch.profiler's ProfilerStep#M: one set of steps, the trainer's.
    f = write_trace(tmp_path / "t.json", [
        _x("ProfilerStep#11", 0.0, 100.0, cat="user_annotation"),
        _x("mfuscope.step#4", 1.0, 98.0, cat="user_annotation"),
        _x("ProfilerStep#12", 100.0, 100.0, cat="user_annotation"),
        _x("mfuscope.step#5", 101.0, 98.0, cat="user_annotation"),
        _x("aten::mm", 150.0, 1.0),
    ])
    events = load_kineto_file(f, rank=0)
    meta = events.ranks[0]
    assert meta["steps"] == [4, 5] and meta["steps_source"] == "mfuscope.step"
    df = _df(events)
    assert df.loc[df["name"] == "aten::mm", "step"].tolist() == [5]
