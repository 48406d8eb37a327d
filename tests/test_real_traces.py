"""The analyses on traces as they come: without step markers, with partial rank sets, with figures
that cannot be defined.  Expected values are hand counts on traces built from real event shapes,
or invariants between loading ranks together and alone.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mfuscope import hardware
from mfuscope.analyzers import breakdown, overview, trace_set
from mfuscope.report import read_report, write_report
from mfuscope.tests.helpers import DLRM, corpus_trace_files, needs_corpus, write_trace

A100 = "NVIDIA A100-SXM4-80GB"


def _strict(text: str):
    def reject(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=reject)


def _gpu_trace(path, *, device=A100, world=8, rank=0, marker=True, mm=(64, 128, 256)):
    """One step of a GPU rank: an aten::mm of shape M x K @ K x N launching a 400 us kernel, then
    idle; a ProfilerStep marker around it (and the step's last host call, at its end: a marker
    is clipped to the trace's last event) unless ``marker`` is False."""
    m, k, n = mm
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 20.0,
         "args": {"Input Dims": [[m, k], [k, n]], "Input type": ["float", "float"], "External id": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 15.0, "dur": 5.0,
         "args": {"correlation": 7, "External id": 1}},
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7, "ts": 40.0, "dur": 400.0,
         "args": {"correlation": 7, "device": 0, "stream": 7, "External id": 1}},
    ]
    if marker:
        events.insert(0, {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1,
                          "ts": 0.0, "dur": 1000.0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": 995.0, "dur": 5.0})
    dist = {"rank": rank, "world_size": world} if world else {"rank": rank}
    return write_trace(path, events, distributedInfo=dist,
                       deviceProperties=[{"id": 0, "name": device, "computeMajor": 8, "computeMinor": 0}])


def test_a_trace_without_step_markers_gets_the_full_analysis(tmp_path):
    path = _gpu_trace(tmp_path / "nomarker.json", marker=False, world=1)
    events = trace_set.load(path, use_cache=False).events
    assert events.ranks[0]["steps_source"] == "device span"
    report = overview.build_report(events, source=str(path), files=[str(path)])
    # The window: the device span, the kernel's start (40 us) to its end (440 us), all of it one
    # step; the host's mm before it (from 10 us) is outside (start-up, in a real trace).
    assert report["summary"]["steps"] == 1
    assert report["summary"]["step_time_source"].startswith("the device span")
    assert report["summary"]["step_time_s"] == pytest.approx(400e-6)
    assert report["breakdown"]["seconds"] == pytest.approx(400e-6)
    leaves = {r["leaf"]: r["seconds"] for r in report["breakdown_by_rank"]}
    assert leaves == pytest.approx({"compute/gemm": 400e-6})  # the kernel


def test_a_step_that_outlives_the_trace_is_clipped_to_its_last_event(tmp_path):
    """The profiler stopped inside a step (as in HTA's triton_example: a ProfilerStep of 13 s in a
    trace of 355 ms): the step ends at the trace's last event."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0,
               "dur": 13e6},
              {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 100.0, "dur": 50.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 1400.0, "dur": 130.0}]
    path = write_trace(tmp_path / "open.json", events, distributedInfo={"rank": 0, "world_size": 1})
    report = overview.build_report(trace_set.load(path, use_cache=False).events, source="o", files=[])
    assert report["summary"]["step_time_s"] == pytest.approx(1530e-6)


def test_undefined_figures_are_written_as_null_and_compare_says_not_comparable(tmp_path):
    path = _gpu_trace(tmp_path / "t.json")
    report = overview.build_report(trace_set.load(path, use_cache=False).events, source=str(path), files=[])
    report["summary"].update(step_time_s=float("nan"), hfu=float("nan"), mfu=None, tflops_per_device=float("inf"))
    for name in ("a", "b"):
        write_report(tmp_path / name / "report.json", report)
    text = (tmp_path / "a" / "report.json").read_text()
    doc = _strict(text)  # strict JSON: no NaN or Infinity tokens
    assert doc["summary"]["hfu"] is None and doc["summary"]["step_time_s"] is None
    assert set(doc["provenance"]["undefined"]) == {"/summary/step_time_s", "/summary/hfu", "/summary/tflops_per_device"}
    assert read_report(tmp_path / "a" / "report.json")["summary"]["hfu"] is None
    out = subprocess.run([sys.executable, "-m", "mfuscope", "compare", str(tmp_path / "a" / "report.json"),
                          str(tmp_path / "b" / "report.json"), "--fail-on-mfu-drop", "0.05"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "not comparable" in out.stderr and "nan" not in out.stdout.lower() and "Traceback" not in out.stderr


def test_shape_flops_are_shared_over_the_ranks_loaded_not_the_world(tmp_path):
    """One rank of an 8-rank job: its GEMM is one device's work.  By hand: 2*M*N*K FLOPs in a
    1000 us step on one A100, against its FP32 peak (19.5 TF/s: the inputs are float and the
    kernel an FP32 SIMT sgemm)."""
    m, k, n = 64, 128, 256
    path = _gpu_trace(tmp_path / "rank0.json", world=8)
    report = overview.build_report(trace_set.load(path, use_cache=False).events, source=str(path), files=[])
    peak = hardware.lookup(A100).peak_flops("fp32")
    assert peak == 19.5e12
    s = report["summary"]
    assert s["hfu"] == pytest.approx(2 * m * n * k / (1000e-6 * peak), rel=1e-9)
    assert s["ranks"] == 1 and s["world_size"] == 8


@needs_corpus(DLRM)
def test_dlrm_ranks_alone_add_up_to_the_set():
    """Each DLRM rank loaded alone carries its own FLOPs over its own step; together the eight
    share theirs over eight devices and the slowest step: sum_r hfu_r * step_r = 8 * hfu * step."""
    files = sorted(DLRM.glob("*.json"))
    alone = []
    for f in files:
        events = trace_set.load(f).events
        s = overview.build_report(events, source=str(f), files=[])["summary"]
        alone.append(s["hfu"] * s["step_time_s"])
    s = overview.build_report(trace_set.load(DLRM).events, source=str(DLRM), files=[])["summary"]
    assert sum(alone) == pytest.approx(8 * s["hfu"] * s["step_time_s"], rel=1e-9)


def test_mfu_note_names_what_is_missing(tmp_path):
    unknown = _gpu_trace(tmp_path / "u.json", device="Imaginary Accelerator X1", world=1)
    s = overview.build_report(trace_set.load(unknown, use_cache=False).events, source="u", files=[])["summary"]
    assert s["hfu"] is None and "'Imaginary Accelerator X1'" in s["mfu_note"] and "hardware table" in s["mfu_note"]
    import pandas as pd

    from mfuscope.analyzers import mfu
    spec = {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 256, "vocab_size": 100}
    got = mfu.compute(pd.Series([1.0]), pd.Series([1024]), {"model": spec, "train": {"seq_len": 128},
                                                            "hardware": {"peak_flops": 1e12}})
    assert got["mfu"] is None and got["mfu_note"].startswith("world size unknown")


@pytest.mark.slow
@needs_corpus()
def test_every_corpus_trace_gets_a_breakdown_that_adds_up_and_a_strict_report(tmp_path):
    for path in [p for p in corpus_trace_files() if "memory_analysis" not in str(p)]:
        events = trace_set.load(path, rank=0).events
        report = overview.build_report(events, source=str(path), files=[str(path)])
        spans = events.to_pandas(["kind", "dur_ns"])
        spans = spans[spans["kind"].astype(str) == "step"]
        assert report["summary"]["steps"] >= 1 and len(spans) >= 1, path.name
        leaves = breakdown.step_leaves(events)
        assert leaves["seconds"].sum() == pytest.approx(spans["dur_ns"].sum() / 1e9, rel=1e-9), path.name
        s = report["summary"]
        assert (s["hfu"] is None) == bool(s["mfu_note"]) or s["mfu_note"].startswith("estimated"), (path.name, s)
        out = write_report(tmp_path / "report.json", report)
        _strict(out.read_text())
        # Communication can never be exposed (or in flight) longer than the steps it is counted in.
        wall = spans["dur_ns"].sum() / 1e9
        assert sum(c["exposed_s"] or 0.0 for c in report["comm"]) <= wall * (1 + 1e-9), path.name
        assert sum(c["total_s"] for c in report["comm"]) <= wall * (1 + 1e-9), path.name


# Real kernel names, as public traces and profiler dumps print them (cuBLAS/cuBLASLt across
# Volta..Hopper, CUTLASS, hipBLASLt/Tensile, cuDNN and MIOpen convolutions and batch norm,
# flash-attention 2 and 3, PyTorch's memory-efficient attention, cuDNN fused attention (as
# Transformer Engine calls it), TE's own norm kernels, Triton (Inductor), PyTorch's
# elementwise/reduction/optimizer kernels, NCCL/RCCL, DeepEP).
KERNEL_NAMES = [
    ("volta_sgemm_128x64_nt", "gemm"),
    ("ampere_sgemm_128x64_nn", "gemm"),
    ("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_nn", "gemm"),
    ("sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x32_stage4_warpsize2x2x1_tensor16x8x16_kernel", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_"
     "execute_segment_k_off_kernel__5x_cublas", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>"
     "(cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4::Params)", "gemm"),
    ("Cijk_Ailk_Bljk_BBS_BH_MT128x128x64_MI16x16x16x1_SN_1LDSB0_AFC1_AFEM1_ASEM1_CLR1", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("void cudnn::cnn::implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int, "
     "float const*, int, float*, float const*, kernel_conv_params, unsigned long long, int, float, float, int, "
     "float const*, float const*, bool, int, int)", "conv"),
    ("sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x16_stage4_warpsize2x2x1_g1_"
     "tensor16x8x8_kernel", "conv"),
    ("sm86_xmma_dgrad_implicit_gemm_indexed_f16f16_f16f32_f32_nhwckrsc_nchw_tilesize64x32x64_stage5_warpsize2x2x1_g1_"
     "tensor16x8x16_kernel", "conv"),
    ("void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>"
     "(cudnn::winograd_nonfused::WinogradDataParams<float, float>)", "conv"),
    ("void cudnn::detail::wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>(int, int, int, float const*, int, "
     "float*, float const*, kernel_grad_params, unsigned long long, int, float, int, int, int, int)", "conv"),
    ("miopenSp3AsmConv_v21_1_3_gfx9_fp32_stride1", "conv"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>(cudnnTensorStruct, float const*, "
     "cudnnTensorStruct, float*, float const*, float const*, float, float, float*, float*, float*, float*, float, "
     "float)", "norm_elementwise"),
    ("void at::native::batch_norm_collect_statistics_kernel<at::native::InvStd, float, float, float, "
     "int>(at::GenericPackedTensorAccessor<float const, 3ul, at::RestrictPtrTraits, int>, float, float, "
     "at::GenericPackedTensorAccessor<float, 1ul, at::RestrictPtrTraits, int>, at::GenericPackedTensorAccessor<float, "
     "1ul, at::RestrictPtrTraits, int>)", "norm_elementwise"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
     "false>(Flash_fwd_params)", "attention"),
    ("void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, "
     "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, false, true, false, "
     "false, false, false, false>(Flash_bwd_params)", "attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
     "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
     "cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
     "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false, false, true, false, false, false, true, true, "
     "false, false, false>, flash::CollectiveEpilogueFwd<cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
     "cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cutlass::bfloat16_t, cutlass::arch::Sm90, 256, true, false, "
     "false, false>, flash::VarlenDynamicPersistentTileScheduler<128, 256, 128, false, false, true>, "
     "false> > >(flash::FlashAttnFwdSm90<>::Params)", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, "
     "float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, "
     "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)"
     "::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<float, "
     "float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1})", "norm_elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, "
     "1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)", "norm_elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, "
     "unsigned int, float, 4>)", "norm_elementwise"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_elementwise"),
    ("triton_poi_fused_add_mul_silu_0", "norm_elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, bool*, float*, float, float, float, float, float, bool, float*, "
     "float*>(at::native::(anonymous namespace)::TensorListMetadata<4>, "
     "at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, bool*, "
     "float*, float, float, float, float, float, bool, float*, float*)", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "collective"),
    ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "collective"),  # RCCL
    # Issue 26, class 4.  Expert-parallel dispatch/combine in the builds that rename DeepEP's namespace.
    ("void dpsk::ep::internode::dispatch<false, 8, 4, 2, 24>(int4*, float*, long*, float*, void*, int const*, int, "
     "int, int)", "collective"),
    ("void dpsk::ep::internode::notify_dispatch<false, 8>(int const*, int*, int, int const*, int*, int, int, int)",
     "collective"),
    ("void dpsk::ep::intranode::combine<__nv_bfloat16, 8, 768>(__nv_bfloat16*, float*, __nv_bfloat16 const*, "
     "float const*, int const*, int const*, int, int, int, int, void**, int, int, int, int)", "collective"),
    ("void dpsk::ep::internode::cached_notify<true>(int, int, int, int, int, int*, int*, int*, int*, void*, int*, "
     "int, void**, int, int, int, bool)", "collective"),
    # Custom all-reduce kernels (vLLM, SGLang, PyTorch symmetric memory, TensorRT-LLM, FlashInfer, AITER).
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, "
     "__nv_bfloat16*, int, int)", "collective"),
    ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 4>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, "
     "__nv_bfloat16*, int, int)", "collective"),
    ("void sglang::cross_device_reduce_1stage<__half, 8>(sglang::RankData*, sglang::RankSignals, sglang::Signal*, "
     "__half*, int, int)", "collective"),
    ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long, "
     "unsigned int**, unsigned long, unsigned long)", "collective"),
    ("two_shot_all_reduce_kernel_inplace", "collective"),
    ("void tensorrt_llm::kernels::oneShotAllReduceKernel<__nv_bfloat16, 8, true, false>"
     "(tensorrt_llm::kernels::AllReduceParams)", "collective"),
    ("void tensorrt_llm::kernels::twoShotAllReduceKernel<__nv_bfloat16, 8, true, false>"
     "(tensorrt_llm::kernels::AllReduceParams)", "collective"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<"
     "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, false, false>"
     "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)", "collective"),
    ("aiter::allreduce_fusion_kernel_1stage", "collective"),
    # "conv" inside a word is not a convolution: vLLM's _typeConvert (a cast in its enable_if), Inductor's
    # convert_element_type and its pointwise kernels fused after an extern convolution; cuDNN's scudnn engines are.
    ("std::enable_if<(((8)>(0)))&&_typeConvert<c10::BFloat16>::exists, void>::type "
     "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long, c10::BFloat16*, c10::BFloat16 const*, "
     "float, int, int)", "norm_elementwise"),
    ("triton_poi_fused_convert_element_type_0", "norm_elementwise"),
    ("triton_poi_fused__to_copy_convert_element_type_mul_1", "norm_elementwise"),
    ("triton_poi_fused_convolution_relu_3", "norm_elementwise"),
    ("triton_for_fused_1", "optimizer"),
    ("cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1", "conv"),
    ("cudnn_train_volta_scudnn_128x128_stridedB_splitK_medium_nn_v1", "conv"),
    ("cudnn_volta_scudnn_winograd_128x128_ldg1_ldg4_relu_tile148t_nt_v1", "conv"),
    ("void fft2d_r2c_32x32<float, false, 0u, false>(float2*, float const*, int, int, int, int, int, int, int, int, "
     "int, cudnn::reduced_divisor, bool, int2, int, int)", "conv"),
    ("cask_cudnn::computeWgradSplitKOffsetsKernel(cask_cudnn::ComputeSplitKOffsetsParams)", "conv"),
    # fbgemm is not a GEMM (HTA's trace_filter set): its embedding lookups are other, its casts elementwise;
    # its Triton FP8 GEMM is a GEMM.
    ("void split_embedding_codegen_forward_unweighted_kernel<c10::Half, c10::Half, float, false, long, 2ul, 32ul>("
     "at::GenericPackedTensorAccessor<c10::Half, 1ul, at::RestrictPtrTraits, long>, fbgemm_gpu::FixedDivisor, "
     "at::GenericPackedTensorAccessor<float, 2ul, at::RestrictPtrTraits, long>)", "other"),
    ("void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1<c10::Half, float, "
     "c10::Half, 2ul, 32>(at::GenericPackedTensorAccessor<float, 2ul, at::RestrictPtrTraits, long>, bool, "
     "at::PhiloxCudaState, fbgemm_gpu::FixedDivisor, float, float, float, long)", "other"),
    ("fbgemm_gpu::split_embedding_codegen_forward_unweighted_kernel", "other"),
    ("void bounds_check_indices_kernel<long, false>(at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, "
     "int>)", "other"),
    ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int, decltype(nullptr)>(int, int, int, int const*, "
     "decltype(nullptr) const*, int const*, int const*, int const*, int*, decltype(nullptr)*)", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, fbgemm_gpu::_float_to_hfp8_gpu(at::Tensor const&, long, long, "
     "double)::{lambda(float)#1}, at::detail::Array<char*, 2> >(int, fbgemm_gpu::_float_to_hfp8_gpu(at::Tensor "
     "const&, long, long, double)::{lambda(float)#1}, at::detail::Array<char*, 2>)", "norm_elementwise"),
    ("_kernel_matmul_fp8_row", "gemm"),
    # MTIA fused-compute graphs: not GEMMs (no public MTIA trace: the pattern).
    ("fc-matmul_add_0", "other"),
    # By name an eager softmax is norm and cuDNN's implicit GEMM a GEMM: their launching operator
    # decides (tests/test_kernel_kinds.py).
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*, float const*, "
     "int, int, int, bool const*, int, bool)", "norm_elementwise"),
    ("volta_sgemm_128x64_nn", "gemm"),
    ("void transformer_engine::rmsnorm::rmsnorm_fwd_tuned_kernel<"
     "transformer_engine::rmsnorm::Kernel_traits<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, unsigned int, "
     "4096u, 1u, 1u, 4u, 16u, transformer_engine::rmsnorm::Kernel_traits_base<4096u, __nv_bfloat16, __nv_bfloat16, "
     "__nv_bfloat16, float, unsigned int, 128u> > >(transformer_engine::layer_norm::FwdParams)", "norm_elementwise"),
    ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*, int4 const*, "
     "float const*, long const*, float const*, bool const*, int const*, int, int, int, int, int, int, int, int, int, "
     "int, void**, int, int, int)", "collective"),
    ("void deep_ep::internode::combine<false, 2, 4, 8, 4, 2>(int4*, float*, bool const*, int4 const*, float const*, "
     "int const*, int const*, int const*, deep_ep::internode::SourceMeta const*, int const*, int const*, int, int, "
     "void*, int, int, void**, int, int, int, int)", "collective"),
]


@pytest.mark.parametrize("name, kind", KERNEL_NAMES, ids=[k[:48] for k, _ in KERNEL_NAMES])
def test_real_kernel_names_are_classified(name, kind):
    assert breakdown.kernel_kind(name) == kind


def test_deepep_kernels_are_expert_parallel_communication(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 5.0, "dur": 5.0,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": KERNEL_NAMES[-2][0], "pid": 0, "tid": 7, "ts": 20.0, "dur": 300.0,
         "args": {"correlation": 1, "device": 0, "stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 12.0, "dur": 5.0,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": KERNEL_NAMES[-1][0], "pid": 0, "tid": 7, "ts": 400.0, "dur": 200.0,
         "args": {"correlation": 2, "device": 0, "stream": 7}},
    ]
    path = write_trace(tmp_path / "ep.json", events, distributedInfo={"rank": 0, "world_size": 1})
    ev = trace_set.load(path, use_cache=False).events
    df = ev.to_pandas(["kind", "op", "dim", "name"])
    deep = df[df["name"].astype(str).str.contains("deep_ep")]
    assert (deep["kind"].astype(str) == "comm").all()
    assert set(deep["dim"]) == {"ep"} and set(deep["op"]) == {"all_to_all"}
    leaves = {r["leaf"]: r["seconds"] for r in overview.build_report(ev, source="ep", files=[])["breakdown_by_rank"]}
    assert leaves["comm/ep/all_to_all"] == pytest.approx(500e-6)  # dispatch 300 us + combine 200 us, nothing else runs
    assert not any(k.startswith("compute/") for k in leaves)


def test_collectives_of_unknown_size_are_kept_out_of_the_bandwidths():
    import pandas as pd

    from mfuscope.analyzers import comm_stats
    calls = pd.DataFrame({"dim": ["dp"] * 3, "op": ["all_reduce"] * 3, "bytes": [float("nan"), float("nan"), 2.0**20],
                          "dur_ns": [1e6, 1e6, 1e6], "exposed_ns": [0.0, 0.0, 0.0], "group_size": [8, 8, 8]})
    rows = {r["size"]: r for r in comm_stats.summarize(calls)}
    assert set(rows) == {"unknown size", "1-16MiB"}
    assert rows["unknown size"]["count"] == 2 and rows["unknown size"]["bytes"] is None
    assert rows["unknown size"]["algbw_gbps"] is None
    assert rows["1-16MiB"]["algbw_gbps"] == pytest.approx(2**20 / 1e-3 / 1e9)  # 1 MiB in 1 ms


def test_ranks_are_found_when_distributed_info_follows_the_events(tmp_path):
    """Written after ``traceEvents`` and beyond the head that is peeked (the files are > 256 KiB)."""
    for rank in (0, 1):
        events = [{"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 5}", "pid": 1, "tid": 1, "ts": float(i),
                   "dur": 0.5} for i in range(4000)]
        doc = json.dumps({"schemaVersion": 1, "traceEvents": events,
                          "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}})
        assert len(doc) > 1 << 18
        (tmp_path / f"trace_{'ab'[rank]}.json").write_text(doc)
    from mfuscope.analyzers.kineto_json import peek_header
    assert peek_header(tmp_path / "trace_b.json") == {"rank": 1, "world_size": 2}
    assert trace_set.load(tmp_path, use_cache=False).events.rank_ids == [0, 1]


def test_nsight_api_names_lose_any_version_tag():
    from mfuscope.analyzers.nsys_sqlite import _api_name
    assert _api_name("cudaStreamIsCapturing_v10000") == "cudaStreamIsCapturing"
    assert _api_name("cudaLaunchKernel_v7000") == "cudaLaunchKernel"
    assert _api_name("cuLaunchKernelEx") == "cuLaunchKernelEx"
    assert _api_name("cuGetProcAddress_v2") == "cuGetProcAddress_v2"  # an API of its own, not a tag
    assert _api_name("cudaGetDeviceProperties_v2_v12000") == "cudaGetDeviceProperties_v2"


def test_accelerator_work_that_is_not_a_gpu_kernel_is_device_work(tmp_path):
    """An MTIA trace: runtime launches (mtia_runtime) and device events (mtia_ccp_events), linked by
    correlation.  The device's 300 us of work is compute on the device, not host operators."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 40.0},
        {"ph": "X", "cat": "mtia_runtime", "name": "runFunction", "pid": 1, "tid": 1, "ts": 20.0, "dur": 10.0,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "mtia_ccp_events", "name": "fc_matmul_fused", "pid": 2, "tid": 3, "ts": 100.0, "dur": 300.0,
         "args": {"correlation": 5, "device": 0, "stream": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": 990.0, "dur": 10.0},
    ]
    path = write_trace(tmp_path / "mtia.json", events, distributedInfo={"rank": 0, "world_size": 1})
    ev = trace_set.load(path, use_cache=False).events
    leaves = {r["leaf"]: r["seconds"] for r in overview.build_report(ev, source="m", files=[])["breakdown_by_rank"]}
    compute = sum(v for k, v in leaves.items() if k.startswith("compute/"))
    assert compute == pytest.approx(300e-6)  # the device event, not the host's aten::mm
    assert sum(leaves.values()) == pytest.approx(1000e-6)


def test_ranks_of_two_jobs_are_refused_unless_mixing_is_asked_for(tmp_path, capsys):
    from mfuscope.errors import UserInputError
    _gpu_trace(tmp_path / "mixed" / "rank0.json", device=A100, world=2, rank=0)
    _gpu_trace(tmp_path / "mixed" / "rank1.json", device="NVIDIA H100 80GB HBM3", world=8, rank=1)
    with pytest.raises(UserInputError, match=r"not ranks of one job \(world sizes 2, 8; devices NVIDIA A100"):
        trace_set.load(tmp_path / "mixed", use_cache=False)
    assert trace_set.load(tmp_path / "mixed", use_cache=False, allow_mixed=True).events.rank_ids == [0, 1]
    assert "--allow-mixed" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "mfuscope", "info", str(tmp_path / "mixed"), "--no-cache"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not ranks of one job" in out.stderr and "Traceback" not in out.stderr
    _gpu_trace(tmp_path / "outside" / "rank0.json", world=2, rank=0)
    _gpu_trace(tmp_path / "outside" / "rank5.json", world=2, rank=5)
    with pytest.raises(UserInputError, match="rank 5 in a world of 2"):
        trace_set.load(tmp_path / "outside", use_cache=False)


def test_a_step_that_captures_cuda_graphs_is_not_called_host_bound(tmp_path):
    """Capture: the host records 40 launches into a graph (device idle), then replays it once; the
    device then runs 40 short kernels.  Without the capture, a host-bound finding would follow."""
    def trace(path, capture):
        events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0.0,
                   "dur": 3000.0}]
        if capture:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamBeginCapture", "pid": 1, "tid": 1,
                           "ts": 1.0, "dur": 2.0})
        for i in range(40):
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 10.0 + 40 * i,
                           "dur": 35.0})
        if capture:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamEndCapture", "pid": 1, "tid": 1,
                           "ts": 1700.0, "dur": 5.0})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1, "ts": 1710.0,
                       "dur": 5.0, "args": {"correlation": 1}})
        for i in range(40):  # 1.2 ms of device work: a step, not a fixture
            events.append({"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4>()",
                           "pid": 0, "tid": 7, "ts": 1720.0 + 31 * i, "dur": 30.0,
                           "args": {"correlation": 1, "device": 0, "stream": 7}})
        return write_trace(path, events, distributedInfo={"rank": 0, "world_size": 1})

    for capture in (True, False):
        path = trace(tmp_path / f"graph{capture}.json", capture)
        report = overview.build_report(trace_set.load(path, use_cache=False).events, source="g", files=[])
        assert report["summary"]["cuda_graphs"] == {"captures": 2 if capture else 0, "replays": 1}
        fixes = {f["fix"] for f in report["findings"]}
        assert ("reduce_host_overhead" in fixes) is (not capture), fixes
        assert "cuda_graphs" not in fixes  # it replays graphs already
    graphs = trace_set.load(tmp_path / "graphTrue.json", use_cache=False).events
    text = overview.format_text(overview.build_report(graphs, source="g", files=[]))
    assert "CUDA graphs   2 capture call(s)" in text
