"""Kernels classified by what launched them, not by name alone (issue 26, class 4).

Expected values are hand counts: on traces built from real event shapes (Kineto's cpu_op /
cuda_runtime / kernel events, linked by correlation id, with kernel names as real traces print
them), and on HTA's ns_resolution trace against the answer key's hand count
(/work/shared/corpus/EXPECTED_FINDINGS.md, section 12).
"""
from __future__ import annotations

import pytest

from mfuscope.analyzers import breakdown, kernel_kinds, overview, trace_set
from mfuscope.tests.helpers import HTA_DATA, needs_corpus, write_trace

SGEMM = "volta_sgemm_128x64_nn"  # cuDNN's implicit-GEMM convolutions and cuBLAS's GEMMs both print this
SOFTMAX = ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>"
           "(float*, float const*, int, int, int, bool const*, int, bool)")
REDUCE = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
          "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
          "unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
          "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
          "unsigned int, float, 4>)")


class _Trace:
    """A Kineto trace of one thread: operators (nested by their spans) launching kernels onto one
    stream, each kernel linked to its cudaLaunchKernel by correlation id."""

    def __init__(self):
        self.events: list[dict] = []
        self.corr = 0
        self.gpu_ts = 5000.0  # the device runs behind the host, as it does in a GPU-bound job

    def op(self, name: str, ts: float, dur: float, cat: str = "cpu_op") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur})

    def launch(self, ts: float, kernel: str, dur: float) -> None:
        self.corr += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                            "ts": ts, "dur": 4.0, "args": {"correlation": self.corr}})
        self.events.append({"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7, "ts": self.gpu_ts,
                            "dur": dur, "args": {"correlation": self.corr, "device": 0, "stream": 7}})
        self.gpu_ts += dur + 10.0

    def write(self, path):
        self.events.insert(0, {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
                               "ts": 0.0, "dur": self.gpu_ts + 100.0})
        self.op("aten::empty", self.gpu_ts + 90.0, 10.0)  # the step's last host call, at its end
        return write_trace(path, self.events, distributedInfo={"rank": 0, "world_size": 1},
                           deviceProperties=[{"id": 0, "name": "Tesla V100-SXM2-32GB"}])


def _compute_leaves(path) -> dict[str, float]:
    leaves = breakdown.step_leaves(trace_set.load(path, use_cache=False).events)
    out = leaves[leaves["leaf"].str.startswith("compute/")].groupby("leaf")["seconds"].sum() * 1e6
    return {k.removeprefix("compute/"): round(v, 3) for k, v in out.items()}


def test_the_launching_operator_decides_conv_gemm_and_attention(tmp_path):
    t = _Trace()
    # A convolution: cuDNN's implicit GEMM, named like a cuBLAS GEMM, 400 us.
    t.op("aten::conv2d", 10, 60)
    t.op("aten::convolution", 12, 56)
    t.op("aten::_convolution", 14, 52)
    t.op("aten::cudnn_convolution", 16, 48)
    t.launch(20, SGEMM, 400)
    # Its backward: the input/weight gradients (the same name, 300 us) and, in a child operator,
    # the bias gradient's reduction (50 us): the innermost operator decides.
    t.op("autograd::engine::evaluate_function: ConvolutionBackward0", 80, 60)
    t.op("ConvolutionBackward0", 82, 56)
    t.op("aten::convolution_backward", 84, 52)
    t.launch(88, SGEMM, 300)
    t.op("aten::sum", 100, 20)
    t.launch(104, REDUCE, 50)
    # A linear layer's GEMM: the same name under aten::mm, 200 us.
    t.op("aten::linear", 150, 40)
    t.op("aten::t", 152, 4)
    t.op("aten::matmul", 158, 30)
    t.op("aten::mm", 160, 26)
    t.launch(164, SGEMM, 200)
    # A classifier's softmax after its mm: norm (the next GEMM is a bmm, the one before is not).
    t.op("aten::softmax", 200, 20)
    t.op("aten::_softmax", 202, 16)
    t.launch(206, SOFTMAX, 30)
    # Eager attention: scores = q @ k^T (bmm, 100 us), softmax (60 us), scores @ v (bmm, 100 us).
    t.op("aten::matmul", 250, 30)
    t.op("aten::bmm", 254, 24)
    t.launch(258, SGEMM, 100)
    t.op("aten::softmax", 290, 20)
    t.op("aten::_softmax", 292, 16)
    t.launch(296, SOFTMAX, 60)
    t.op("aten::matmul", 320, 30)
    t.op("aten::bmm", 324, 24)
    t.launch(328, SGEMM, 100)
    # SDPA's math path: its bmm (80 us) and softmax (40 us) are attention.
    t.op("aten::scaled_dot_product_attention", 400, 100)
    t.op("aten::_scaled_dot_product_attention_math", 402, 96)
    t.op("aten::bmm", 410, 20)
    t.launch(414, SGEMM, 80)
    t.op("aten::_softmax", 440, 20)
    t.launch(444, SOFTMAX, 40)
    leaves = _compute_leaves(t.write(tmp_path / "launch.json"))
    assert leaves == {"conv": 400 + 300, "norm_elementwise": 50 + 30, "gemm": 200 + 100 + 100,
                      "attention": 60 + 80 + 40}


def test_a_softmax_inside_an_attention_module_is_attention(tmp_path):
    """An eager attention whose matmuls the profiler did not record as bmm (4-d matmul through
    another path): the module's name still says attention."""
    t = _Trace()
    t.op("nn.Module: LlamaAttention_0", 10, 100, cat="python_function")
    t.op("aten::softmax", 40, 20)
    t.op("aten::_softmax", 42, 16)
    t.launch(46, SOFTMAX, 60)
    t.op("aten::softmax", 200, 20)  # outside the module: a loss's softmax
    t.op("aten::_softmax", 202, 16)
    t.launch(206, SOFTMAX, 30)
    assert _compute_leaves(t.write(tmp_path / "module.json")) == {"attention": 60, "norm_elementwise": 30}


def test_without_launches_the_name_decides(tmp_path):
    """A trace whose kernels' launches are not in it (a device-only export): names alone."""
    t = _Trace()
    t.launch(10, SGEMM, 100)
    t.launch(20, SOFTMAX, 50)
    t.events = [e for e in t.events if e["cat"] != "cuda_runtime"]
    assert _compute_leaves(t.write(tmp_path / "names.json")) == {"gemm": 100, "norm_elementwise": 50}


def test_custom_all_reduce_and_dpsk_ep_kernels_are_communication(tmp_path):
    """vLLM's custom all-reduce (300 us) and DeepEP's dispatch under its dpsk::ep namespace
    (200 us): communication, so the comm table of a TP or EP job is not empty."""
    t = _Trace()
    t.launch(10, "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, "
                 "vllm::Signal*, __nv_bfloat16*, int, int)", 300)
    t.launch(20, "void dpsk::ep::internode::dispatch<false, 8, 4, 2, 24>(int4*, float*, long*, float*, void*, "
                 "int const*, int, int, int)", 200)
    path = t.write(tmp_path / "comm.json")
    report = overview.build_report(trace_set.load(path, use_cache=False).events, source="c", files=[])
    leaves = {r["leaf"]: r["seconds"] * 1e6 for r in report["breakdown_by_rank"]}
    assert leaves["comm/unknown/all_reduce"] == pytest.approx(300)
    assert leaves["comm/ep/all_to_all"] == pytest.approx(200)
    assert not any(k.startswith("compute/") for k in leaves)
    assert {(c["dim"], c["op"]) for c in report["comm"]} == {("unknown", "all_reduce"), ("ep", "all_to_all")}


def test_mtia_dma_requests_are_copies(tmp_path):
    """MTIA's device events (mtia_ccp_events) launched by mtia_runtime calls: a dma_request is a
    copy (memory, 100 us); a fused-compute graph fc-* is not a GEMM (200 us of other)."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "mtia_runtime", "name": "runFunction", "pid": 1, "tid": 1, "ts": 20.0, "dur": 10.0,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "mtia_ccp_events", "name": "fc-matmul_add_0", "pid": 2, "tid": 3, "ts": 100.0,
         "dur": 200.0, "args": {"correlation": 5, "device": 0, "stream": 3}},
        {"ph": "X", "cat": "mtia_runtime", "name": "copyToDevice", "pid": 1, "tid": 1, "ts": 40.0, "dur": 10.0,
         "args": {"correlation": 6}},
        {"ph": "X", "cat": "mtia_ccp_events", "name": "dma_request", "pid": 2, "tid": 3, "ts": 400.0, "dur": 100.0,
         "args": {"correlation": 6, "device": 0, "stream": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": 990.0, "dur": 10.0},
    ]
    path = write_trace(tmp_path / "mtia.json", events, distributedInfo={"rank": 0, "world_size": 1})
    leaves = breakdown.step_leaves(trace_set.load(path, use_cache=False).events)
    got = dict(zip(leaves["leaf"], leaves["seconds"] * 1e6))
    assert got["memory"] == pytest.approx(100) and got["compute/other"] == pytest.approx(200)
    assert "compute/gemm" not in got


@pytest.mark.parametrize("kind, family, name", [(k, f, n) for k, f, names in kernel_kinds.FAMILIES for n in names],
                         ids=lambda v: v[:40] if isinstance(v, str) else None)
def test_every_family_example_is_its_kind(kind, family, name):
    assert kernel_kinds.kernel_kind(name) == kind, family


NS_TRACE = HTA_DATA / "ns_resolution_trace"
# EXPECTED_FINDINGS.md section 12 (hand count, innermost enclosing aten op for conv): ms per
# ProfilerStep#101..105.
NS_CONV_MS = [17.35, 45.29, 60.25, 60.18, 60.26]
NS_GEMM_MS = [0.00, 0.08, 0.08, 0.08, 0.08]


@needs_corpus(NS_TRACE)
def test_ns_resolution_cudnn_implicit_gemms_are_convolutions():
    """A ResNet's FP32 cuDNN convolutions, many of them volta_sgemm_* launched from
    aten::cudnn_convolution / aten::convolution_backward: conv 48.67 ms and GEMM 0.06 ms per step
    over the five steps (the key's mean); by name alone they came out GEMM 19 ms, conv 13 ms."""
    leaves = breakdown.step_leaves(trace_set.load(NS_TRACE, use_cache=False).events)
    per_step = leaves.pivot_table(index="step", columns="leaf", values="seconds", aggfunc="sum").fillna(0.0) * 1e3
    assert list(per_step.index) == [101, 102, 103, 104, 105]
    assert per_step["compute/conv"].mean() == pytest.approx(48.67, rel=0.10)
    assert per_step["compute/gemm"].mean() == pytest.approx(0.06, rel=0.10, abs=0.01)  # the key rounds to 0.01 ms
    for step, conv, gemm in zip(per_step.index, NS_CONV_MS, NS_GEMM_MS):
        assert per_step.loc[step, "compute/conv"] == pytest.approx(conv, rel=0.10), step
        assert per_step.loc[step, "compute/gemm"] == pytest.approx(gemm, abs=0.01), step
