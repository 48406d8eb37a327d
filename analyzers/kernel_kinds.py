"""What a device kernel is: gemm, conv, attention, norm_elementwise, optimizer or other (and
``collective`` for communication), from its name and, where the trace has them, from the CPU
operators that launched it.

Names alone mislead in a few well-known ways, so :func:`classify` reads the launch too: the
innermost CPU operator (``cpu_op``) on the launching thread whose span holds the runtime call
(``cudaLaunchKernel`` ...) that has the kernel's correlation id, and every operator around it:

- cuDNN runs convolutions as implicit GEMMs named like GEMMs (``volta_sgemm_128x64_nn``): launched
  from ``aten::cudnn_convolution`` / ``aten::convolution_backward`` they are convolutions;
- SDPA's math path runs batched matmuls, a softmax and elementwise kernels: under
  ``aten::scaled_dot_product_attention`` (or any SDPA / flash / efficient-attention operator) every
  kernel is attention;
- an eager attention's softmax (``aten::_softmax`` between the two batched matmuls, or inside an
  attention module) is attention, not norm;
- a kernel of unknown name launched by ``aten::mm`` and its kin is a GEMM.

Name rules (:data:`FAMILIES`, checked by ``tests/test_real_traces.py::KERNEL_NAMES``) match on
words: a name is lower-cased once as written and once with its camelCase split (``typeConvert`` ->
``type_convert``), and a word is a run of letters, so ``lambda`` is not LAMB, ``convert`` is not
``conv`` and ``MIOpenConvUni`` is a convolution.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import pandas as pd

from . import collectives
from . import intervals as iv

#: The kernel families the name rules know, in the order they are tried: (kind, family, real names
#: as traces print them, shortened to what decides).  Documentation and test table in one
#: (``tests/test_kernel_kinds.py`` checks every example); the rules below are what decides.
FAMILIES: list[tuple[str, str, tuple[str, ...]]] = [
    ("collective", "NCCL / RCCL kernels, every naming generation",
     ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
      "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
      "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)")),
    ("collective", "expert-parallel dispatch / combine: DeepEP (deep_ep::, its dpsk::ep:: builds), NVSHMEM "
                   "-> ep all_to_all",
     ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*)",
      "void dpsk::ep::internode::notify_dispatch<false, 8>(int const*, int*, int)",
      "void dpsk::ep::intranode::cached_notify_combine<8>(void**, int*, int, int)")),
    ("collective", "custom all-reduce: vLLM / SGLang / AITER cross_device_reduce, PyTorch symmetric memory, "
                   "TensorRT-LLM and FlashInfer one/two-shot and fused -> all_reduce",
     ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, "
      "__nv_bfloat16*, int, int)",
      "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long, "
      "unsigned int**, unsigned long, unsigned long)",
      "void tensorrt_llm::kernels::oneShotAllReduceKernel<__nv_bfloat16, 8, true>"
      "(tensorrt_llm::kernels::AllReduceParams)",
      "void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<"
      "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, false, false>"
      "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)")),
    ("attention", "attention: flash-attention 2/3, memory-efficient (fmha), cuDNN SDPA, Triton attn",
     ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>"
      "(Flash_fwd_params)",
      "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t>::Params)",
      "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attn_fwd")),
    ("other", "embedding lookups: fbgemm's split / batched tables (also their fused-optimizer backward), "
              "EmbeddingBag",
     ("void split_embedding_codegen_forward_unweighted_kernel<c10::Half, c10::Half, float, false, long, 2ul, 32ul>"
      "(fbgemm_gpu::FixedDivisor)",
      "void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1<c10::Half, float, "
      "c10::Half, 2ul, 32>(fbgemm_gpu::FixedDivisor)",
      "void bounds_check_indices_kernel<long, false>(at::GenericPackedTensorAccessor<long, 1ul>)")),
    ("conv", "convolutions: conv / convolution / convolve words, fprop / dgrad / wgrad, winograd, implicit "
             "GEMM over NHWC / NCHW, cuDNN's scudnn / h1688cudnn engines, MIOpen, im2col",
     ("void cudnn::cnn::implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>()",
      "cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1",
      "void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>()",
      "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x16_stage4",
      "miopenSp3AsmConv_v21_1_3_gfx9_fp32_stride1")),
    ("gemm", "GEMMs: cuBLAS / cuBLASLt (sgemm, xmma, nvjet, splitKreduce), CUTLASS, hipBLASLt (Cijk_), fbgemm's "
             "f8f8bf16 (fbgemm itself is not a GEMM)",
     ("volta_sgemm_128x64_nt", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",
      "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>()",
      "Cijk_Ailk_Bljk_BBS_BH_MT128x128x64_MI16x16x16x1_SN_1LDSB0_AFC1_AFEM1_ASEM1_CLR1")),
    ("optimizer", "optimizers: fused / multi-tensor Adam, SGD, LAMB, Adagrad, foreach",
     ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
      "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>()",)),
    ("norm_elementwise", "norms, elementwise, reductions, softmax, activations, RoPE, copies and casts",
     ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>(cudnnTensorStruct)",
      "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>()",
      "std::enable_if<(((8)>(0)))&&_typeConvert<c10::BFloat16>::exists, void>::type "
      "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long, c10::BFloat16*)")),
    # Inductor names a kernel triton_<poi|red|per|tem|for>_fused_<its origin ops>_<n>: the ops it fuses
    # do not make a pointwise kernel a convolution or a GEMM.
    ("norm_elementwise", "Inductor pointwise / reductions (poi, red, per), whatever ops they fuse",
     ("triton_poi_fused_convert_element_type_0", "triton_poi_fused_convolution_relu_3",
      "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0")),
    ("gemm", "Inductor GEMM templates (tem: mm, addmm, bmm; convolution templates are conv)",
     ("triton_tem_fused_mm_0", "triton_tem_fused_addmm_relu_1")),
    ("optimizer", "Inductor foreach kernels (for): compiled torch.optim steps", ("triton_for_fused_1",)),
    # No public MTIA trace to take names from: the pattern as the issue gives it.
    ("other", "MTIA fused-compute graphs (fc-*): the rest of the name decides, a GEMM word counts as "
              "other; MTIA's dma_request is a copy (memory, at load)", ("fc-matmul_add_0",)),
]

_W = r"(?<![a-z])"  # a word starts here
_E = r"(?![a-z])"   # a word ends here

_ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa|" + _W + r"mha" + _E + r"|softmax_warp_forward.*causal")
_EMBEDDING = re.compile(r"split_embedding|(batched|dense|pooled)_embedding|" + _W
                        + r"embedding_(codegen|forward|backward|bag|inplace|lookup|dense)|bounds_check_indices|"
                          r"linearize_index|transpose_embedding_input")
_CONV = re.compile(r"(?:" + _W + r"|(?<=[0-9]d))(de)?conv(olution|olve|olutional)?" + _E + "|"
                   + _W + r"(fprop|dgrad|wgrad)" + _E + r"|winograd|implicit_?gemm.*(nhwc|nchw|ndhwc)|"
                   + _W + r"([sh]\d*cudnn|igemm_(fwd|bwd|wrw))|im2col|col2im|vol2col|col2vol|fft2d_(r2c|c2r)")
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|matmul|" + _W + r"cijk_|"
                   + _W + r"(mm|bmm|addmm|baddbmm)" + _E + r"|split_?k_?reduce|(f8|i8|bf16)(f8|i4|i8|bf16)bf16")
_OPTIMIZER = re.compile(r"adam|multi_tensor_apply|foreach|optimizer|"
                        + _W + r"(sgd|lamb|lars|adagrad|rmsprop)" + _E)
_NORM_ELEMENTWISE = re.compile(r"norm|" + _W + r"bn_|elementwise|vectorized|reduce|softmax|soft_max|silu|gelu|"
                               r"relu|swiglu|rope|rotary|triton_|unrolled|index|cat|copy|fill|where|"
                               r"cross_entropy|type_?convert")
_RULES = (("attention", _ATTENTION), ("other", _EMBEDDING), ("conv", _CONV), ("gemm", _GEMM),
          ("optimizer", _OPTIMIZER), ("norm_elementwise", _NORM_ELEMENTWISE))

_INDUCTOR = re.compile(r"^triton_(poi|red|per|tem|for|mix|unk)_(.*)$")
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def _text(name: str) -> str:
    """The name lower-cased as written and with its camelCase split, so rules see both."""
    return name.lower() + " " + _CAMEL.sub("_", name).lower()


def _by_rules(text: str) -> str:
    for kind, rule in _RULES:
        # fbgemm is a library, not a GEMM: its name (in namespaces and argument types) says nothing
        if rule.search(text.replace("fbgemm", "fb_lib") if kind == "gemm" else text):
            return kind
    return "other"


def _inductor(kind_code: str, fused: str) -> str:
    """Inductor's kernels by what they fuse: templates are GEMMs, convolutions or flex attention;
    pointwise and reductions stay elementwise whatever their origin ops are called."""
    if kind_code == "tem":
        if _ATTENTION.search(fused):
            return "attention"
        return "conv" if _CONV.search(fused) else "gemm"
    if kind_code == "for":
        return "optimizer"  # foreach: Inductor lowers torch.optim's multi-tensor steps to these
    if _ATTENTION.search(fused):
        return "attention"
    return "optimizer" if _OPTIMIZER.search(fused) else "norm_elementwise"


@lru_cache(maxsize=1 << 16)
def kernel_kind(name: str) -> str:
    """Kind of a device kernel by its name alone (``collective`` for communication kernels)."""
    if collectives.is_comm_kernel(name):
        return "collective"
    if name[:3].lower() == "fc-":  # MTIA fused-compute graph: what the rest says, but not a GEMM
        kind = kernel_kind(name[3:])
        return "other" if kind in ("gemm", "collective") else kind
    low = name.lower()
    m = _INDUCTOR.match(low)
    if m:
        return _inductor(m.group(1), m.group(2))
    return _by_rules(_text(name))


#: FP32 math without tensor cores, as cuBLAS and cuDNN name it: SIMT single-precision GEMMs
#: (``volta_sgemm_*``, ``ampere_sgemm_*``), cuDNN's ``scudnn`` engines and implicit-GEMM / Winograd
#: / dgrad / wgrad templates instantiated on ``float``.
_FP32_MATH = re.compile(r"sgemm|scudnn|_fp32_|(engine|winograd\w*|sgemm|conv\w*)<float,")
#: Tensor-core math in any precision: HMMA/IMMA tile names, xmma / wgmma / nvjet / CUTLASS
#: tensorop, and the input types of the kernel (TF32 included: it runs on tensor cores).
_TENSOR_CORES = re.compile(r"h884|h1688|h16816|s1688|s16816|i8816|hmma|imma|tensorop|xmma|wgmma|nvjet|tf32|bf16|"
                           r"f16|fp16|half|e4m3|e5m2|tensor\d")


def is_fp32_simt(name: str) -> bool:
    """A GEMM or convolution kernel that computes in FP32 on the CUDA cores (no tensor cores):
    mixed precision (and TF32) would run it on tensor cores, several times faster."""
    text = name.lower()
    return bool(_FP32_MATH.search(text)) and not _TENSOR_CORES.search(text)


#: Kernels that already fuse a chain of elementwise work: Inductor's (``triton_poi_fused_...``: every
#: kernel torch.compile generates is one), any library kernel that says so (apex's, Megatron's,
#: Transformer Engine's ``fused``), and the norm/activation/RoPE kernels of mfuscope and Liger.
_FUSED = re.compile(r"^triton_|fused|^_(add_)?(rms_norm|layer_norm|swiglu|geglu|rope)\w*_kernel$|^_triton_rope", re.I)


def is_fused_kernel(name: str) -> bool:
    """Whether ``name`` is a kernel that already fuses elementwise work: fusing it again gains
    nothing (an Inductor-compiled H200 run had 87 of its 105 ms of elementwise time in them)."""
    return bool(_FUSED.search(name))


# --- operators around the launch -------------------------------------------------------------

_CONV_OP = re.compile(r"(?:" + _W + r"|(?<=[0-9]d))(de)?conv(olution)?" + _E + r"|" + _W + r"conv_?tbc" + _E)
_ATTENTION_OP = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|flash_?attn|"
                           r"flex_attention|fmha|xformers|" + _W + r"mha_(fwd|bwd|varlen)" + _E)
#: Scopes an eager attention's softmax may sit in: modules and annotations named for attention.
_ATTENTION_SCOPE = re.compile(r"attention|attn|" + _W + r"mha" + _E)
_GEMM_OPS = frozenset(f"aten::{op}" for op in ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul",
                                              "linear", "_scaled_mm", "addmv", "mv", "_addmm_activation",
                                              "_grouped_mm", "_scaled_grouped_mm"))
_BATCHED_OPS = frozenset(("aten::bmm", "aten::baddbmm", "aten::baddbmm_"))
_SOFTMAX_OPS = frozenset(("aten::_softmax", "aten::softmax", "aten::_safe_softmax", "aten::_masked_softmax",
                          "aten::_softmax_backward_data", "aten::_masked_softmax_backward"))
_LAUNCH_KINDS = ("runtime", "driver")
_NEEDED = ("kind", "name", "ts_ns", "dur_ns", "tid", "correlation")


def classify(rdf: pd.DataFrame, kernels: pd.DataFrame) -> pd.Series:
    """Kind of each of one rank's ``kernels`` (rows of its EventTable frame ``rdf``: columns
    kind, name, ts_ns, dur_ns, tid, correlation), by name and by the operators that launched it;
    see the module docstring.  Without launches or operators in ``rdf``, by name alone."""
    base = per_name(kernels["name"], kernel_kind)
    out = pd.Series(base, index=kernels.index, dtype=object)
    if kernels.empty or not set(_NEEDED) <= set(rdf.columns) or "correlation" not in kernels.columns:
        return out
    kinds = rdf["kind"]
    ops = rdf[(kinds == "cpu_op") & (rdf["dur_ns"] > 0)]
    if ops.empty:  # before the launches are looked up: without operators they decide nothing
        return out
    launch = _launches(rdf, kernels["correlation"].to_numpy())
    has = launch["row"] >= 0
    if not has.any():
        return out
    scopes = rdf[kinds.isin(["cpu_op", "annotation", "python"]) & (rdf["dur_ns"] > 0)]
    n = len(kernels)
    inner = np.full(n, -1, np.int64)        # row in ``ops`` of the innermost operator, -1 none
    in_attention_op = np.zeros(n, bool)     # inside an SDPA / flash / efficient-attention operator
    in_attention_scope = np.zeros(n, bool)  # inside anything named for attention (modules too)
    t_all, tid_all = launch["ts"], launch["tid"]
    attention_op = per_name(ops["name"], lambda s: bool(_ATTENTION_OP.search(_text(s))), default=False)
    attention_scope = per_name(scopes["name"], lambda s: bool(_ATTENTION_SCOPE.search(_text(s))), default=False)
    op_tid = ops["tid"].to_numpy()
    op_start = ops["ts_ns"].to_numpy()
    op_end = op_start + ops["dur_ns"].to_numpy()
    sc_tid = scopes["tid"].to_numpy()
    sc_start = scopes["ts_ns"].to_numpy()
    sc_end = sc_start + scopes["dur_ns"].to_numpy()
    for tid in np.unique(tid_all[has]):
        q = np.flatnonzero(has & (tid_all == tid))
        t = t_all[q]
        rows = np.flatnonzero(op_tid == tid)
        if len(rows):
            found = _innermost(op_start[rows], op_end[rows], t)
            inner[q] = np.where(found >= 0, rows[np.maximum(found, 0)], -1)
            a = rows[attention_op[rows]]
            if len(a):
                in_attention_op[q] = _covered(iv.union(op_start[a], op_end[a]), t)
        s = np.flatnonzero((sc_tid == tid) & attention_scope)
        if len(s):
            in_attention_scope[q] = _covered(iv.union(sc_start[s], sc_end[s]), t)
    if not (inner >= 0).any():
        return out
    op_name = np.full(n, None, dtype=object)
    known = inner >= 0
    op_name[known] = per_name(ops["name"], str)[inner[known]]

    def op_is(predicate: Callable[[str], bool]) -> np.ndarray:
        res = np.zeros(n, bool)
        if known.any():
            names = pd.Series(op_name[known], dtype="category")
            res[known] = per_name(names, predicate, default=False)
        return res

    conv = op_is(lambda s: bool(_CONV_OP.search(_text(s))))
    gemm_op = op_is(lambda s: s in _GEMM_OPS)
    batched = op_is(lambda s: s in _BATCHED_OPS)
    softmax = op_is(lambda s: s in _SOFTMAX_OPS)
    bracketed = _between_batched_matmuls(softmax, gemm_op, batched, t_all, tid_all)
    kind = out.to_numpy(dtype=object).copy()
    compute = kind != "collective"
    kind[compute & (kind == "other") & gemm_op] = "gemm"
    kind[compute & softmax & (in_attention_scope | bracketed)] = "attention"
    kind[compute & conv] = "conv"
    kind[compute & in_attention_op] = "attention"
    return pd.Series(kind, index=kernels.index, dtype=object)


def per_name(names: pd.Series, fn: Callable[[str], object], default: object = "other") -> np.ndarray:
    """``fn`` of each row's name, evaluated once per distinct name (names are categoricals)."""
    cat = names if isinstance(names.dtype, pd.CategoricalDtype) else names.astype("category")
    codes = cat.cat.codes.to_numpy()
    if codes.size == 0:
        return np.empty(0, dtype=object if not isinstance(default, bool) else bool)
    used, inverse = np.unique(codes, return_inverse=True)
    categories = cat.cat.categories
    values = [fn(str(categories[c])) if c >= 0 else default for c in used]
    return np.array(values, dtype=bool if isinstance(default, bool) else object)[inverse]


def _covered(spans: tuple[np.ndarray, np.ndarray], t: np.ndarray) -> np.ndarray:
    """Which times lie in a sorted disjoint interval set [start, end)."""
    s, e = spans
    i = np.searchsorted(s, t, side="right") - 1
    return (i >= 0) & (t < e[np.maximum(i, 0)])


def _launches(rdf: pd.DataFrame, correlation: np.ndarray) -> dict[str, np.ndarray]:
    """For each kernel correlation id: the row, start and thread of its launch call (row -1: none)."""
    calls = rdf[rdf["kind"].isin(_LAUNCH_KINDS) & (rdf["correlation"] >= 0)]
    if "device" in calls.columns:
        calls = calls[calls["device"] < 0]
    calls = calls.drop_duplicates("correlation")
    at = pd.Index(calls["correlation"].to_numpy()).get_indexer(correlation)
    at[correlation < 0] = -1
    ok = at >= 0
    ts = np.zeros(len(correlation), np.int64)
    tid = np.full(len(correlation), -1, np.int64)
    ts[ok] = calls["ts_ns"].to_numpy()[at[ok]]
    tid[ok] = calls["tid"].to_numpy()[at[ok]]
    return {"row": at, "ts": ts, "tid": tid}


def _innermost(start: np.ndarray, end: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Index of the innermost of one thread's nested spans [start, end) holding each time ``t``
    (-1 where none does), without a loop over the spans.

    Spans sorted by (start, longest first) are a preorder of their nesting tree; a span's depth is
    the number of spans open when it starts.  At time t, D spans are open, the innermost of them
    is at depth D-1, and of the spans at that depth (disjoint) it is the last to start by t.
    """
    order = np.lexsort((-end, start))
    s, e = start[order], end[order]
    n = len(s)
    times = np.concatenate([s, e])
    is_start = np.concatenate([np.ones(n, bool), np.zeros(n, bool)])
    pos = np.concatenate([np.arange(n), np.arange(n)])
    seq = np.lexsort((pos, is_start, times))  # at equal times, ends first: [a, b) and [b, c) do not nest
    open_after = np.cumsum(np.where(is_start[seq], 1, -1))
    depth = np.empty(n, np.int64)
    starts = is_start[seq]
    depth[pos[seq][starts]] = open_after[starts] - 1
    open_at = np.searchsorted(s, t, side="right") - np.searchsorted(np.sort(e), t, side="right")
    found = np.full(len(t), -1, np.int64)
    for d in np.unique(open_at[open_at > 0] - 1):
        q = np.flatnonzero(open_at - 1 == d)
        at_depth = np.flatnonzero(depth == d)  # in start order
        j = np.searchsorted(s[at_depth], t[q], side="right") - 1
        cand = at_depth[np.maximum(j, 0)]
        ok = (j >= 0) & (e[cand] > t[q])
        found[q[ok]] = order[cand[ok]]
    return found


def _between_batched_matmuls(softmax: np.ndarray, gemm_op: np.ndarray, batched: np.ndarray, t: np.ndarray,
                             tid: np.ndarray) -> np.ndarray:
    """Softmax launches whose nearest GEMM launches on their thread, before and after, are both
    batched matmuls: an eager attention's scores and its weighted sum of values (forward, or the
    same two in backward), not a classifier's softmax after its ``mm``."""
    out = np.zeros(len(t), bool)
    for th in np.unique(tid[softmax]):
        g = np.flatnonzero(gemm_op & (tid == th))
        if len(g) < 2:
            continue
        g = g[np.argsort(t[g], kind="stable")]
        q = np.flatnonzero(softmax & (tid == th))
        before = np.searchsorted(t[g], t[q], side="left") - 1
        after = np.searchsorted(t[g], t[q], side="right")
        ok = (before >= 0) & (after < len(g))
        qq, b, a = q[ok], g[before[ok]], g[after[ok]]
        out[qq] = batched[b] & batched[a]
    return out
