"""Published runs as cost-model inputs: rows with the columns of ``corpus/published/calibration.csv``.

Each row becomes a :class:`Case` -- model, layout, training switches, system,
and the measured tokens/s per GPU -- or a reason it cannot be modelled (a
parallel split or a batch the source does not state).  Empty cells mean "not
stated" and take the defaults below, each the practice of the row's source:

======================  ==========================================================
not stated              default
======================  ==========================================================
ffn_hidden              4 x hidden (GPT); MLP is GELU for GPT/MT-NLG, SwiGLU for Llama
kv_heads                heads (no GQA)
vocab                   128,256 for Llama 3 (its tokenizer)
seq_len                 8,192 for torchtitan (its llama3 train configs)
vpp, cp, ep             1
recompute               full for Narayanan et al. (their FLOP count includes it), else none
dp                      GPUs / (tp x pp x cp)
micro_batch             1 under pipeline parallelism; else the local batch
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
through their 72 B s l h^2 (1 + s/6h + V/12hl) at 312 TFLOP/s.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from mfuscope.errors import UserInputError

from .spec import Layout, ModelSpec, Training
from .system import System, system

LLAMA3_VOCAB = 128_256
A100_PEAK = 312e12
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
    """The three calibration sources by name; any other source by its first word."""
    s = source.lower()
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
    llama = name.lower().startswith("llama")
    h, heads = _int(row, "hidden"), _int(row, "heads")
    layers = _int(row, "layers")
    if not (h and heads and layers):
        raise ValueError("layers, hidden or heads not stated")
    vocab = _int(row, "vocab") or (LLAMA3_VOCAB if "llama 3" in name.lower() else None)
    if vocab is None:
        raise ValueError("vocabulary not stated")
    model = ModelSpec(n_layers=layers, dim=h, n_heads=heads, ffn_dim=_int(row, "ffn_hidden") or 4 * h,
                      vocab_size=vocab, n_kv_heads=_int(row, "kv_heads"),
                      n_experts=_int(row, "moe_experts") or 0, top_k=_int(row, "moe_topk") or 1,
                      mlp="swiglu" if llama else "gelu")
    seq = _int(row, "seq_len") or (8192 if family == "torchtitan" else None)
    if seq is None:
        raise ValueError("sequence length not stated")

    gpus = _int(row, "num_gpus")
    tp, pp = _int(row, "tp"), _int(row, "pp")
    if tp is None or pp is None:
        raise ValueError("tensor/pipeline split not stated")
    cp, ep, vpp = _int(row, "cp") or 1, _int(row, "ep") or 1, _int(row, "vpp") or 1
    dp = _int(row, "dp") or (gpus // (tp * pp * cp) if gpus else None)
    if not dp or (gpus and tp * pp * cp * dp != gpus):
        raise ValueError(f"tp x pp x cp x dp does not make the {gpus} GPUs")
    micro = _int(row, "micro_batch")
    local = re.search(r"local batch size (\d+)", notes)
    glob = _int(row, "global_batch")
    if glob is None and family == "torchtitan":
        per_rank = int(local.group(1)) if local else micro
        glob = per_rank * dp if per_rank else None
    if glob is None:
        raise ValueError("global batch not stated")
    if micro is None:
        micro = 1 if pp > 1 else glob // dp
    if glob % (dp * micro):
        raise ValueError(f"global batch {glob} is not a multiple of dp x micro_batch = {dp * micro}")
    zero_text = row.get("zero_stage", "").strip()
    zero = 3 if "fsdp" in zero_text.lower() else _int(row, "zero_stage") or 0
    fsdp = family == "torchtitan" or zero == 3
    deepspeed = zero == 3 and "deepspeed" in notes.lower()
    megatron = family in ("narayanan", "korthikanti")
    sp = (row.get("sp", "").strip().lower() == "yes") if megatron else True
    schedule = "interleaved_1f1b" if vpp > 1 else "1f1b"
    layout = Layout(tp=tp, pp=pp, vpp=vpp, dp_shard=dp if fsdp else 1, dp_replicate=1 if fsdp else dp,
                    cp=cp, ep=ep, micro_batch=micro, microbatches=glob // (dp * micro), schedule=schedule,
                    recompute=_recompute(row, family), sequence_parallel=sp and tp > 1,
                    zero=0 if fsdp else min(zero, 2))
    dtype = row["dtype_key"] or "bf16"
    training = Training(
        seq_len=seq, dtype="bf16" if dtype == "fp16" else dtype,
        flash_attention=not megatron, causal=not megatron,
        compiled=megatron or "compile" in notes.lower(),
        async_tp=bool(re.search(r"async ?tp", notes, re.IGNORECASE)),
        overlap_grad_reduce=not megatron, overlap_p2p=not megatron, scatter_gather_sends=megatron,
        grad_reduce_bytes=2 if megatron or deepspeed else 4,
        selective_gemm_fraction=0.5 if family == "torchtitan" else 0.0,
        fp8_recipe="rowwise" if "rowwise" in row.get("dtype", "").lower() else "tensorwise",
        fp8_gather=bool(re.search(r"fp8 fsdp all-gather|float8 all-gather", f"{row.get('dtype', '')} {notes}",
                                  re.IGNORECASE)),
        **(DEEPSPEED_ZERO3 if deepspeed else {}))
    memory = re.search(r"(\d+)\s*GB", row.get("gpu", ""))
    watts = re.search(r"(\d+)\s*W\b", row.get("gpu", ""))
    sys = system(row["gpu_key"], memory_gb=float(memory.group(1)) if memory else None,
                 power_limit_w=float(watts.group(1)) if watts else None)
    problems = layout.problems(model, seq)
    if problems:
        raise ValueError("; ".join(problems))
    return Case(index, family, name, model, layout, training, sys, measured_tps(row, family))


def _recompute(row: dict[str, str], family: str) -> str:
    """The normalised key; where the source leaves it blank, Narayanan et al.'s runs recompute in
    full (their eq. 3, which converts every TFLOP/s they report, counts the recompute pass)."""
    if not row.get("recompute", "").strip() and family == "narayanan":
        return "full"
    return row.get("recompute_key") or "none"


def measured_tps(row: dict[str, str], family: str) -> float | None:
    """Tokens/s per GPU as measured (see the module docstring for the two derived sources)."""
    stated = _float(row, "measured_tokens_per_s_per_gpu")
    if stated:
        return stated
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
