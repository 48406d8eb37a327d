"""Foreign jobs counted right (issue 27): the device tail of a one-step trace, operation names the
trace states, HFU from the shapes and dtypes the trace states.  Expected values are hand counts
over traces built from real event shapes (Kineto's categories, names and args as PyTorch writes
them), or formulas from the trace's dims.
"""
from __future__ import annotations

import pytest

from mfuscope.analyzers import overview, trace_set
from mfuscope.tests.helpers import TRACES, needs_corpus, read_raw, write_trace

QWEN_H100 = TRACES / "TraceLens/tests/traces/h100"

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
    """Two steps on markers that follow one another, the host running ahead: the first step's
    kernel (900-1,300 us) spills into the second's window, and the second's (1,950-2,450 us) runs
    past its marker.  The second window holds a step's worth of device work (the first's tail in
    place of its own), so it is not stretched: 2 x 1,000 us."""
    events = [_op("ProfilerStep#3", 0.0, 1000.0, "user_annotation"), _launch(850.0, 1),
              _kernel("ampere_sgemm_128x64_nn", 900.0, 400.0, 1),
              _op("ProfilerStep#4", 1000.0, 1000.0, "user_annotation"), _launch(1900.0, 2),
              _kernel("ampere_sgemm_128x64_nn", 1950.0, 500.0, 2)]
    report, _ = _report(tmp_path, "two.json", events)
    assert report["breakdown"]["seconds"] == pytest.approx(1000e-6)  # the mean of two 1,000 us steps


def test_the_last_step_keeps_its_tail_when_nothing_spilled_into_it(tmp_path):
    """As above, but the first step's work (120-420 us) ended before the second began: the second
    window holds only its own work, so it runs to its kernel's end.  By hand: 1,000 and 1,450 us."""
    events = [_op("ProfilerStep#3", 0.0, 1000.0, "user_annotation"), _launch(100.0, 1),
              _kernel("ampere_sgemm_128x64_nn", 120.0, 300.0, 1),
              _op("ProfilerStep#4", 1000.0, 1000.0, "user_annotation"), _launch(1900.0, 2),
              _kernel("ampere_sgemm_128x64_nn", 1950.0, 500.0, 2)]
    report, _ = _report(tmp_path, "two.json", events)
    assert report["breakdown"]["seconds"] == pytest.approx((1000e-6 + 1450e-6) / 2)


def test_markers_with_host_time_between_them_keep_each_steps_device_tail(tmp_path):
    """Markers that end before the step's synchronization (the reference trainer's, until an H200
    run lost a third of each step to it): 0-400 us and 800-1,200 us, each launching a kernel that
    runs past its marker (120-700 us, 920-1,500 us).  By hand: each window runs to its kernel's end,
    700 us, not past the next marker; each step's 580 us of GEMM all in it."""
    events = [_op("ProfilerStep#3", 0.0, 400.0, "user_annotation"), _launch(100.0, 1),
              _kernel("ampere_sgemm_128x64_nn", 120.0, 580.0, 1),
              _op("ProfilerStep#4", 800.0, 400.0, "user_annotation"), _launch(900.0, 2),
              _kernel("ampere_sgemm_128x64_nn", 920.0, 580.0, 2)]
    report, _ = _report(tmp_path, "gaps.json", events)
    assert report["breakdown"]["seconds"] == pytest.approx(700e-6)  # the mean of two 700 us steps
    leaves = {r["leaf"]: r["seconds"] for r in report["breakdown_by_rank"]}
    assert leaves["compute/gemm"] == pytest.approx(580e-6)


def test_a_stretched_window_stops_at_the_next_marker(tmp_path):
    """The first step's kernel (100-1,000 us) runs on past the next marker's start (800 us): its
    window ends at 800 us, where the second step's begins.  By hand: windows 800 and 400 us."""
    events = [_op("ProfilerStep#3", 0.0, 400.0, "user_annotation"), _launch(90.0, 1),
              _kernel("ampere_sgemm_128x64_nn", 100.0, 900.0, 1),
              _op("ProfilerStep#4", 800.0, 400.0, "user_annotation"), _launch(900.0, 2),
              _kernel("ampere_sgemm_128x64_nn", 1010.0, 100.0, 2), _op("aten::empty", 1190.0, 10.0)]
    report, _ = _report(tmp_path, "cap.json", events)
    assert report["breakdown"]["seconds"] == pytest.approx((800e-6 + 400e-6) / 2)


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


# ----------------------------------------------------------------------------- HFU from shapes and dtypes
V100, H100, B200 = "Tesla V100-SXM2-32GB", "NVIDIA H100 80GB HBM3", "NVIDIA B200"


def _shaped(name, ts, dims, types, concrete=None, corr=None, kernel="volta_scudnn_128x64_relu_interior_nn_v1",
            kernel_ran=True):
    """A shaped operator as record_shapes writes it, launching one 100 us kernel (or a launch
    whose kernel never ran in the window, as inside a CUDA graph capture)."""
    args = {"Input Dims": dims, "Input type": types}
    if concrete is not None:
        args["Concrete Inputs"] = concrete
    out = [_op(name, ts, 50.0, **args), _launch(ts + 10.0, corr)]
    if kernel_ran:
        out.append(_kernel(kernel, ts + 20.0, 100.0, corr))
    return out


def _hfu(tmp_path, name, device, ops, step_us=10_000.0):
    events = [_op("ProfilerStep#1", 0.0, step_us, "user_annotation")] + ops + [_op("aten::empty", step_us - 5, 5.0)]
    path = write_trace(tmp_path / name, events, distributedInfo={"rank": 0, "world_size": 1},
                       deviceProperties=[{"id": 0, "name": device}])
    return overview.build_report(trace_set.load(path, use_cache=False).events, source=name, files=[])["summary"]


def test_convolution_flops_from_the_traces_dims_stride_and_padding(tmp_path):
    """A ResNet stem and a 3x3 block conv, forward and backward, FP32 on a V100.  By hand:
    stem 7x7 stride 2 padding 3 on 224x224 -> 112x112: 2*32*64*3*49*112*112 = 7.55 GFLOP;
    3x3 stride 1 padding 1 on 56x56 -> 56x56: 2*32*64*64*9*56*56 = 7.40 GFLOP forward, and its
    backward with both gradients asked twice that.  HFU against the V100's FP32 peak (15.7 TF/s,
    not its 125 TF/s fp16 tensor peak) over a 10 ms step."""
    stem = 2 * 32 * 64 * 3 * 49 * 112 * 112
    block = 2 * 32 * 64 * 64 * 9 * 56 * 56
    conv = ["", "", "", "[2, 2]", "[3, 3]", "[1, 1]", "False", "[0, 0]", "1"]
    block_args = ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"]
    ops = (_shaped("aten::convolution", 100.0, [[32, 3, 224, 224], [64, 3, 7, 7], [], [], [], [], [], [], []],
                   ["float", "float", "", "", "", "", "", "", ""], conv, corr=1)
           + _shaped("aten::convolution", 1000.0, [[32, 64, 56, 56], [64, 64, 3, 3], [], [], [], [], [], [], []],
                     ["float", "float"], block_args, corr=2)
           + _shaped("aten::convolution_backward", 2000.0,
                     [[32, 64, 56, 56], [32, 64, 56, 56], [64, 64, 3, 3], [], [], [], [], [], [], [], []],
                     ["float", "float", "float"],
                     ["", "", "", "[0]", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1", "[True, True, False]"],
                     corr=3))
    s = _hfu(tmp_path, "conv.json", V100, ops)
    flops = stem + block + 2 * block
    assert s["hfu"] == pytest.approx(flops / (10e-3 * 15.7e12), rel=1e-9)
    assert "fp32 100%" in s["peak_source"]


def test_each_operator_is_held_to_its_dtypes_peak(tmp_path):
    """On an H100: a bf16 GEMM (4096^3: 137.4 GFLOP) against 989.4 TF/s and an FP8 _scaled_mm of the
    same shape against 1,978.9 TF/s.  By hand the step's time at peak is the sum of the two."""
    g = 2.0 * 4096 ** 3
    ops = (_shaped("aten::mm", 100.0, [[4096, 4096], [4096, 4096]], ["c10::BFloat16", "c10::BFloat16"], corr=1,
                   kernel="sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64")
           + _shaped("aten::_scaled_mm", 1000.0, [[4096, 4096], [4096, 4096], [], []],
                     ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn", "float", "float"], corr=2,
                     kernel="sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n"))
    s = _hfu(tmp_path, "mixed.json", H100, ops)
    assert s["hfu"] == pytest.approx((g / 989.4e12 + g / 1978.9e12) / 10e-3, rel=1e-9)


def test_operators_whose_work_did_not_run_in_the_window_count_nothing(tmp_path):
    """Two bf16 GEMMs; the second was recorded while a CUDA graph was captured (its launch made no
    kernel in the trace).  Only the first counts."""
    g = 2.0 * 1024 ** 3
    ops = (_shaped("aten::mm", 100.0, [[1024, 1024], [1024, 1024]], ["c10::BFloat16", "c10::BFloat16"], corr=1,
                   kernel="sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n")
           + _shaped("aten::mm", 1000.0, [[1024, 1024], [1024, 1024]], ["c10::BFloat16", "c10::BFloat16"], corr=2,
                     kernel_ran=False))
    s = _hfu(tmp_path, "graph.json", H100, ops)
    assert s["hfu"] == pytest.approx(g / (10e-3 * 989.4e12), rel=1e-9)


def test_no_hfu_where_a_dtype_that_ran_has_no_peak(tmp_path):
    """FP32 GEMMs on a B200: the table has no FP32 peak for it, so no HFU, and the note says why."""
    ops = _shaped("aten::mm", 100.0, [[1024, 1024], [1024, 1024]], ["float", "float"], corr=1,
                  kernel="sm100_sgemm_128x64")
    s = _hfu(tmp_path, "b200.json", B200, ops)
    assert s["hfu"] is None and "no fp32 peak" in s["mfu_note"]


@needs_corpus(QWEN_H100)
def test_hfu_of_a_real_inference_trace_is_the_hand_count_of_its_shapes():
    """Qwen1.5-0.5B on an H100 (TraceLens corpus): every aten::mm/addmm/bmm (2*M*N*K) and flash
    attention forward (4*B*H*Sq*Sk*D) counted by hand over the trace's JSON with the standard
    library, bf16, over the report's step (the device-side ProfilerStep#6, 34.9 ms) against the
    H100's 989.4 TF/s."""
    folder = QWEN_H100
    flops = 0.0
    for e in read_raw(next(folder.glob("*.json.gz")))["traceEvents"]:
        dims = (e.get("args") or {}).get("Input Dims")
        if e.get("cat") != "cpu_op" or not dims:
            continue
        if e["name"] in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"):
            a, b = (dims[1], dims[2]) if e["name"] in ("aten::addmm", "aten::baddbmm") else (dims[0], dims[1])
            batch = 1
            for x in a[:-2]:
                batch *= x
            flops += 2.0 * batch * a[-2] * a[-1] * b[-1]
        elif e["name"] == "aten::_scaled_dot_product_flash_attention":
            q, k = dims[0], dims[1]
            flops += 4.0 * q[0] * q[1] * q[2] * k[2] * q[3]
    s = overview.build_report(trace_set.load(folder).events, source="qwen", files=[])["summary"]
    assert s["hfu"] == pytest.approx(flops / (s["step_time_s"] * 989.4e12), rel=1e-6)
    assert s["step_time_s"] == pytest.approx(34.892421e-3)  # the trace's gpu_user_annotation
    assert s["hfu"] == pytest.approx(0.174, abs=0.002)


# ----------------------------------------------------------------------------- elementwise already fused
def _elementwise_step(tmp_path, name, kernels):
    """One 100 ms step, three steps traced (the first is warm-up); ``kernels`` (name, ms) run back to
    back from 1 ms, each launched by its own call."""
    events = []
    for step in range(3):
        t0 = step * 100_000.0
        events.append(_op(f"ProfilerStep#{step}", t0, 100_000.0, "user_annotation"))
        at = t0 + 1000.0
        for i, (kernel, ms) in enumerate(kernels):
            corr = step * 100 + i + 1
            events += [_launch(t0 + 10.0 * (i + 1), corr), _kernel(kernel, at, ms * 1000.0, corr)]
            at += ms * 1000.0
        events.append(_op("aten::empty", t0 + 99_990.0, 10.0))  # the trace runs to the step's end
    report, _ = _report(tmp_path, name, events, world=1)
    return {f["id"]: f for f in report["findings"]}


EAGER_ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, float*)"


def test_elementwise_kernels_torch_compile_already_fused_are_no_finding(tmp_path):
    """A compiled job: 30 ms of Inductor kernels and 5 ms of an eager add in a 100 ms step.  By
    hand: 5 ms (5%) is left to fuse, under the 10% threshold -- no finding, where counting the
    Inductor kernels too would name 35% of the step."""
    found = _elementwise_step(tmp_path, "compiled.json", [
        ("triton_poi_fused_add_mul_silu_0", 15.0), ("triton_red_fused__to_copy_mean_pow_rsqrt_1", 15.0),
        (EAGER_ADD, 5.0), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 60.0)])
    assert "fuse_elementwise" not in found


def test_only_the_unfused_elementwise_time_is_the_gain(tmp_path):
    """20 ms of eager elementwise kernels beside 10 ms of a fused norm in a 100 ms step: by hand the
    gain is the 20 ms (20% of the step), and a third of that kind's time is already fused."""
    found = _elementwise_step(tmp_path, "mixed.json", [
        (EAGER_ADD, 20.0), ("fused_rms_norm_kernel", 10.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 60.0)])
    finding = found["fuse_elementwise"]
    assert finding["gain_s"] == pytest.approx(20e-3, rel=1e-6)
    assert finding["evidence"]["already_fused_share"] == pytest.approx(1 / 3)
    assert finding["title"].startswith("unfused norm/elementwise kernels take 20% of the step")
