"""Published runs as cost-model inputs: rows with the columns of ``corpus/published/calibration.csv``.

Each row becomes a :class:`Case` -- model, layout, training switches, system,
and the measured tokens/s per GPU -- or a reason it cannot be modelled (a
parallel split or a batch the source does not state).  Empty cells mean "not
stated" and take the defaults below, each the practice of the row's source:

======================  ==========================================================
not stated              default
======================  ==========================================================
ffn_hidden              4 x hidden (GPT); the MLP is GELU for the GPT-style families
                        (GPT, MT-NLG, MPT, BLOOM, OPT), SwiGLU for every other model
                        (Llama, Mixtral, Qwen, DeepSeek); a MoE row's ``ffn_hidden``
                        is one expert's, its shared expert read from the notes
                        ("shared expert of N", "K shared experts, each SwiGLU N");
                        a MoE row without its top-k is refused, and so is a row of
                        power-limited GPUs whose limit is not stated
kv_heads                heads (no GQA)
vocab                   128,256 for Llama 3 (its tokenizer)
seq_len                 8,192 for torchtitan (its llama3 train configs)
vpp, cp, ep             1; vpp 2 for torchtitan's interleaved schedules ("Interleaved
                        1F1B" in the notes: two stages a rank without split points)
recompute               full for Narayanan et al. (their FLOP count includes it), else none
dp                      GPUs / (tp x pp x cp)
micro_batch             1 under pipeline parallelism; else the local batch; torchtitan
                        under pipeline parallelism: the local batch over pp (its
                        default microbatch count at its Dec-2024 benchmarks)
global_batch            torchtitan: local batch x dp ("local batch size N" in the
                        notes, else micro_batch), one microbatch per step unless pipelined
======================  ==========================================================

Switches by source: Megatron-LM's papers (Narayanan 2021, Korthikanti 2022)
ran unfused attention over the full (non-causal) score matrix with Megatron's
fused elementwise kernels, 16-bit gradient all-reduce not overlapped with
backward, and blocking pipeline sends of each TP rank's slice (scatter/gather);
torchtitan runs flash attention (SDPA, causal), sequence parallelism with TP,
FSDP2 with prefetch and fp32 gradient reduce-scatter, torch.compile and async
TP where its notes say so, float8 all-gather where the row says so, the float8
recipe its dtype names, and its "selective" is op-level activation
checkpointing, which recomputes every other matmul and all elementwise work.
DeepSpeed ZeRO-3 rows shard everything over the data ranks (``dp_shard``) and
run as DeepSpeed did in 2021 (``DEEPSPEED_ZERO3``).

Measured throughput: ``measured_tokens_per_s_per_gpu`` where the source gives
it; else from the source's own FLOP count -- Narayanan's TFLOP/s through their
eq. 3 (96 B s l h^2 (1 + s/6h + V/16lh) per iteration), Korthikanti's MFU
through their 72 B s l h^2 (1 + s/6h + V/12hl) at 312 TFLOP/s, and Megatron-Core
runs' (notes starting "MCore") TFLOP/s or MFU at H100's 989.5 TFLOP/s through
Megatron-LM's ``num_floating_point_operations`` (:func:`megatron_flops_per_token`).
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from mfuscope.errors import UserInputError

from .spec import Layout, ModelSpec, Training
from .system import MICROSCALING, System, system

LLAMA3_VOCAB = 128_256
A100_PEAK = 312e12
#: The H100 bf16 peak Megatron-Core's MoE papers divide by (Liu et al. 2025, Sec 4.1).
MCORE_H100_PEAK = 989.5e12
#: Megatron pads the vocabulary to a multiple of this times tp (``--make-vocab-size-divisible-by``).
MEGATRON_VOCAB_DIVISOR = 128
#: Model families with a GPT-style GELU MLP; every other family's rows run SwiGLU.
GELU_FAMILIES = re.compile(r"^(gpt|mt-nlg|mpt|bloom|opt)\b", re.IGNORECASE)
#: Parameter tensors of a GPT block, each gathered on its own by DeepSpeed's ZeRO-3 of 2021
#: (``_all_gather`` issued one ``_allgather_param`` per parameter): two LayerNorms' weight and
#: bias, the QKV and output projections and the two MLP matrices, each with a bias.
DEEPSPEED_GPT_TENSORS = 12
#: DeepSpeed's ZeRO-3 as of 2021 (Narayanan et al.'s comparison): a collective per parameter
#: tensor, each over a list of per-rank partitions (``torch.distributed.all_gather(partitions,
#: ...)``), the gradient reduction not overlapped with backward (``overlap_comm`` defaults to
#: false in DeepSpeed's configuration), and per-module fetch hooks, which the recomputed forward
#: of activation checkpointing fires again.
DEEPSPEED_ZERO3 = {"shard_calls_per_layer": DEEPSPEED_GPT_TENSORS, "list_collectives": True,
                   "overlap_reduce_scatter": False, "recompute_regathers": True}
REQUIRED = ("model", "layers", "hidden", "heads", "gpu_key", "num_gpus", "dtype_key")


@dataclass(frozen=True)
class Case:
    row: int
    source: str          # narayanan | korthikanti | torchtitan | another source's first word
    name: str
    model: ModelSpec
    layout: Layout
    training: Training
    system: System
    measured_tps: float | None


def source_family(source: str) -> str:
    """The calibration sources by name (torchao's READMEs, which report torchtitan runs, apart from
    torchtitan's own tables); any other source by its first word."""
    s = source.lower()
    if s.startswith("pytorch/ao"):
        return "torchao"
    for key in ("narayanan", "korthikanti", "torchtitan"):
        if key in s:
            return key
    words = re.findall(r"[a-z0-9]+", s)
    return words[0] if words else "other"


def read_rows(path: str | Path) -> list[dict[str, str]]:
    p = Path(path)
    try:
        with p.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise UserInputError("no such file", p) from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserInputError(f"not a CSV file ({e})", p) from None
    if not rows:
        raise UserInputError("no rows", p)
    missing = [c for c in REQUIRED if c not in rows[0]]
    if missing:
        raise UserInputError(f"missing columns {', '.join(missing)} (the columns of calibration.csv)", p)
    return rows


def _int(row: dict, key: str) -> int | None:
    value = (row.get(key) or "").strip()
    if not value:
        return None
    return int(float(value))


def _float(row: dict, key: str) -> float | None:
    value = (row.get(key) or "").strip()
    return float(value) if value else None


def case(index: int, row: dict[str, str]) -> Case:
    """The row as a cost-model case; ``ValueError`` with the reason when it cannot be modelled."""
    family = source_family(row.get("source", ""))
    notes = row.get("notes", "")
    name = row["model"]
    h, heads = _int(row, "hidden"), _int(row, "heads")
    layers = _int(row, "layers")
    if not (h and heads and layers):
        raise ValueError("layers, hidden or heads not stated")
    vocab = _int(row, "vocab") or (LLAMA3_VOCAB if "llama 3" in name.lower() else None)
    if vocab is None:
        raise ValueError("vocabulary not stated")
    experts = _int(row, "moe_experts") or 0
    if experts and not _int(row, "moe_topk"):
        raise ValueError("a mixture of experts without its top-k")
    model = ModelSpec(n_layers=layers, dim=h, n_heads=heads, ffn_dim=_int(row, "ffn_hidden") or 4 * h,
                      vocab_size=vocab, n_kv_heads=_int(row, "kv_heads"),
                      n_experts=experts, top_k=_int(row, "moe_topk") or 1,
                      mlp="gelu" if GELU_FAMILIES.match(name) else "swiglu", shared_ffn_dim=_shared_expert(notes))
    titan = family in ("torchtitan", "torchao")  # torchao's READMEs report torchtitan runs
    seq = _int(row, "seq_len") or (8192 if titan else None)
    if seq is None:
        raise ValueError("sequence length not stated")

    gpus = _int(row, "num_gpus")
    tp, pp = _int(row, "tp"), _int(row, "pp")
    if tp is None or pp is None:
        raise ValueError("tensor/pipeline split not stated")
    # torchtitan names its schedule in the notes; a multi-stage one without split points runs two
    # stages a rank (its generate_split_points)
    interleaved = titan and pp > 1 and bool(re.search(r"interleaved ?1f1b", notes, re.IGNORECASE))
    cp, ep, vpp = _int(row, "cp") or 1, _int(row, "ep") or 1, _int(row, "vpp") or (2 if interleaved else 1)
    dp = _int(row, "dp") or (gpus // (tp * pp * cp) if gpus else None)
    if not dp or (gpus and tp * pp * cp * dp != gpus):
        raise ValueError(f"tp x pp x cp x dp does not make the {gpus} GPUs")
    micro = _int(row, "micro_batch")
    local = re.search(r"local batch size (\d+)", notes)
    glob = _int(row, "global_batch")
    if glob is None and titan:
        per_rank = int(local.group(1)) if local else micro
        glob = per_rank * dp if per_rank else None
    if glob is None:
        raise ValueError("global batch not stated")
    if micro is None and pp > 1 and titan:
        # torchtitan's pipeline benchmarks (commit 9dec370, 2024-12-26) ran its default microbatch
        # count then: pipeline_parallel_degree, whatever the schedule (pytorch/torchtitan#781 made it
        # pp x stages a rank on 2025-01-07; later versions split into microbatches of 1)
        micro = max(1, glob // (dp * pp))
    if micro is None:
        micro = 1 if pp > 1 else glob // dp
    if glob % (dp * micro):
        raise ValueError(f"global batch {glob} is not a multiple of dp x micro_batch = {dp * micro}")
    zero_text = row.get("zero_stage", "").strip()
    zero = 3 if "fsdp" in zero_text.lower() else _int(row, "zero_stage") or 0
    fsdp = titan or zero == 3
    deepspeed = zero == 3 and "deepspeed" in notes.lower()
    megatron = family in ("narayanan", "korthikanti")
    # Megatron-Core runs Transformer Engine: cuDNN's fused attention (FlashAttention-3-class on
    # Hopper) and, for context parallelism, TE's ring of point-to-point sends (cp_comm_type p2p,
    # its default)
    mcore = bool(re.search(r"\bmcore\b|megatron-core", notes, re.IGNORECASE))
    sp = (row.get("sp", "").strip().lower() == "yes") if megatron else True
    schedule = "interleaved_1f1b" if vpp > 1 else "1f1b"
    layout = Layout(tp=tp, pp=pp, vpp=vpp, dp_shard=dp if fsdp else 1, dp_replicate=1 if fsdp else dp,
                    cp=cp, ep=ep, micro_batch=micro, microbatches=glob // (dp * micro), schedule=schedule,
                    recompute=_recompute(row, family), sequence_parallel=sp and tp > 1,
                    zero=0 if fsdp else min(zero, 2), expert_folding="w/ folding" in notes.lower())
    dtype = row["dtype_key"] or "bf16"
    training = Training(
        seq_len=seq, dtype="bf16" if dtype == "fp16" else dtype,
        flash_attention=not megatron, causal=not megatron,
        attention_kernel="fa3" if mcore else "fa2", cp_comm="p2p" if mcore else "all_gather",
        compiled=megatron or "compile" in notes.lower(),
        async_tp=bool(re.search(r"async ?tp", notes, re.IGNORECASE)),
        overlap_grad_reduce=not megatron, overlap_p2p=not megatron, scatter_gather_sends=megatron,
        grad_reduce_bytes=2 if megatron or deepspeed else 4,
        selective_gemm_fraction=0.5 if titan else 0.0,
        fp8_recipe=fp8_recipe(row.get("dtype", "")), fp8_scope=fp8_scope(row.get("dtype", "")),
        fp8_gather=bool(re.search(r"fp8 fsdp all-gather|float8 all-gather", f"{row.get('dtype', '')} {notes}",
                                  re.IGNORECASE)),
        **(DEEPSPEED_ZERO3 if deepspeed else {}))
    if "limit not stated" in row.get("gpu", "").lower():
        raise ValueError("power-limited GPUs whose limit the source does not state")
    memory = re.search(r"(\d+)\s*GB", row.get("gpu", ""))
    watts = re.search(r"(\d+)\s*W\b", row.get("gpu", ""))
    sys = system(row["gpu_key"], memory_gb=float(memory.group(1)) if memory else None,
                 power_limit_w=float(watts.group(1)) if watts else None)
    if training.dtype == "fp8" and training.fp8_recipe == "mxfp8" and sys.key not in MICROSCALING:
        raise ValueError(f"MXFP8 on {sys.key}, which has no MX GEMMs")
    problems = layout.problems(model, seq)
    if problems:
        raise ValueError("; ".join(problems))
    return Case(index, family, name, model, layout, training, sys, measured_tps(row, family, model, tp))


def fp8_recipe(dtype: str) -> str:
    """The float8 recipe a row's dtype names: Transformer Engine's (Megatron's "FP8 delayed
    scaling", llm-foundry's ``amp_fp8``, whose TE recipe is delayed scaling by default) or
    torchao's (tensorwise unless it says rowwise or MXFP8)."""
    text = dtype.lower()
    for word, recipe in (("mxfp8", "mxfp8"), ("rowwise", "rowwise"), ("current scaling", "current"),
                         ("block", "blockwise"), ("delayed", "delayed"), ("amp_fp8", "delayed")):
        if word in text:
            return recipe
    return "tensorwise"


def fp8_scope(dtype: str) -> str:
    """Which GEMMs a row runs in float8: all linear layers unless it says only the linears or only
    the (routed-expert) grouped GEMMs."""
    text = dtype.lower()
    if re.search(r"grouped gemms only", text):
        return "experts"
    if re.search(r"linears only", text):
        return "linears"
    return "all"


def _shared_expert(notes: str) -> int:
    """The shared experts' FFN size in all, as the notes state it: "shared expert of 20480" (Qwen2),
    "1 shared expert, each SwiGLU 8192" (Llama 4)."""
    found = re.search(r"shared expert of (\d+)", notes)
    if found:
        return int(found.group(1))
    found = re.search(r"(\d+) shared experts?, each SwiGLU (\d+)", notes)
    return int(found.group(1)) * int(found.group(2)) if found else 0


def megatron_flops_per_token(model: ModelSpec, seq_len: int, tp: int = 1) -> float:
    """Training FLOPs per token as Megatron-LM counts them (``num_floating_point_operations``:
    12 L h^2 [(1 + g/a + s/h) q/h + (f/h) k r + (f_s/h) r + V/(2 L h)] per token, with q the query
    projection size, g/a the key-value groups per head, k the routed top-k, r = 3/2 for a gated
    (SwiGLU) MLP, f_s the shared expert's size and V the vocabulary padded to a multiple of 128 x tp):
    attention over the full sequence, the router not counted, no recompute."""
    h, layers = model.dim, model.n_layers
    q = model.n_heads * model.head_dim
    gated = 1.5 if model.mlp == "swiglu" else 1.0
    routed = model.top_k if model.n_experts else 1
    multiple = MEGATRON_VOCAB_DIVISOR * tp
    vocab = -(-model.vocab_size // multiple) * multiple
    return 12 * layers * h * h * (
        (1 + model.kv_heads / model.n_heads + seq_len / h) * q / h
        + model.ffn_dim / h * routed * gated
        + model.shared_ffn_dim / h * gated
        + vocab / (2 * layers * h))


def _recompute(row: dict[str, str], family: str) -> str:
    """The normalised key; where the source leaves it blank, Narayanan et al.'s runs recompute in
    full (their eq. 3, which converts every TFLOP/s they report, counts the recompute pass)."""
    if not row.get("recompute", "").strip() and family == "narayanan":
        return "full"
    return row.get("recompute_key") or "none"


def measured_tps(row: dict[str, str], family: str, model: ModelSpec | None = None, tp: int = 1) -> float | None:
    """Tokens/s per GPU as measured (see the module docstring for the derived sources)."""
    stated = _float(row, "measured_tokens_per_s_per_gpu")
    if stated:
        return stated
    if model is not None and row.get("notes", "").startswith("MCore") and _int(row, "seq_len"):
        tflops, mfu = _float(row, "measured_tflops_per_gpu"), _float(row, "measured_mfu")
        achieved = tflops * 1e12 if tflops else mfu * MCORE_H100_PEAK if mfu else None
        return achieved / megatron_flops_per_token(model, _int(row, "seq_len"), tp) if achieved else None
    layers, h, s, v = (_int(row, k) for k in ("layers", "hidden", "seq_len", "vocab"))
    if not (layers and h and s and v):
        return None
    tflops, mfu = _float(row, "measured_tflops_per_gpu"), _float(row, "measured_mfu")
    if family == "narayanan" and tflops:
        return tflops * 1e12 / (96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))
    if family == "korthikanti" and mfu:
        return mfu * A100_PEAK / (72 * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers)))
    return None


def load_cases(path: str | Path) -> tuple[list[Case], dict[int, str]]:
    """Modellable cases and, by row index, the reason for each row that is not."""
    cases, skipped = [], {}
    for i, row in enumerate(read_rows(path)):
        try:
            cases.append(case(i, row))
        except (ValueError, UserInputError) as e:
            skipped[i] = str(e)
    return cases, skipped
