"""Memory per GPU: parameters, gradients, optimizer state, activations in flight, and whether it fits.

Model states, mixed precision with Adam (Rajbhandari et al. 2020, ZeRO; the
18 bytes per parameter Megatron-LM counts): a 16-bit weight (2 B), an fp32
gradient (4 B), fp32 master weight and Adam's two moments (12 B).  Sharding:

==========================  ===========================================
layout                      bytes per parameter on a GPU
==========================  ===========================================
DDP (``zero=0``)            2 + 4 + 12
ZeRO-1 (``zero=1``)         2 + 4 + 12/dp   (Megatron's distributed optimizer)
ZeRO-2 (``zero=2``)         2 + (4 + 12)/dp
FSDP (``dp_shard`` > 1)     (4 + 4 + 8)/dp_shard: the sharded fp32 weight is the
                            master; plus the 16-bit copies of the layers gathered
                            for compute (every layer of the stage under pp, where
                            FSDP does not reshard after forward; else two)
==========================  ===========================================

fp32 training has no separate master: 4 + 4 + 8 bytes.  Which parameters a GPU
holds: its pipeline stage's layers (the first stage also the embedding, the
last the LM head and final norm), attention and dense MLPs split over tp, the
experts split over ep (experts are not split over tp, as in the reference
trainer), norms and router replicated.

Activations per layer and microbatch (Korthikanti et al. 2022, Table 2), for b
sequences of s tokens (s/cp under context parallelism), hidden h, a heads, t =
tp, in 16-bit with dropout masks:

==============================  ================================
no tensor parallelism           s b h (34 + 5 a s / h)
tensor parallel                 s b h (10 + 24/t + 5 a s / (h t))
tensor + sequence parallel      s b h / t (34 + 5 a s / h)
selective recompute             the 5 a s / h term dropped (so does flash attention,
                                the default: it keeps no s x s scores)
full recompute                  2 s b h (/t with sequence parallel): the layer input
==============================  ================================

In flight on the first (busiest) pipeline stage: GPipe keeps all m
microbatches, 1F1B and the zero-bubble schedules min(p, m), interleaved
schedules that times (1 + (p-1)/(p v)) (Korthikanti et al., section 4.2.3).
Plus the fp32 logits the loss keeps, s b V / t x 4 bytes on the last stage.
What is not modelled is listed in each result's ``assumptions``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import Layout, ModelSpec

GiB = 2**30


@dataclass(frozen=True)
class Memory:
    """Bytes on the busiest GPU (the pipeline stage with the most)."""

    params: int             # parameters held (count)
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    gathered_bytes: float   # FSDP: 16-bit copies of the layers being computed
    activations_bytes: float
    logits_bytes: float
    device_bytes: float | None
    assumptions: tuple[str, ...]

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.gathered_bytes
                + self.activations_bytes + self.logits_bytes)

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.total_bytes <= self.device_bytes


def params_per_gpu(model: ModelSpec, layout: Layout) -> int:
    """Parameters of the busiest pipeline stage's GPU: its layers, and the embedding or head."""
    dense, experts = model.layer_params()
    replicated = 2 * model.dim + (model.dim * model.n_experts if model.n_experts else 0)
    per_layer = (dense - replicated) // layout.tp + replicated + experts // layout.ep
    layers = layout.stage_layers(model)
    embedding = model.vocab_size * model.dim // layout.tp
    head = 0 if model.tied_embeddings else model.vocab_size * model.dim // layout.tp
    first = layers * per_layer + embedding
    last = layers * per_layer + head + model.dim
    return max(first, last) if layout.pp > 1 else layers * per_layer + embedding + head + model.dim


def activation_bytes_per_layer(model: ModelSpec, layout: Layout, seq_len: int, flash_attention: bool = True) -> float:
    """One layer, one microbatch (Korthikanti et al. 2022, Table 2).  Flash attention stores no
    s x s scores (it recomputes them in backward), which drops the 5 a s / h term exactly as
    selective recomputation does."""
    s, b, h, a, t = seq_len / layout.cp, layout.micro_batch, model.dim, model.n_heads, layout.tp
    sp = layout.sequence_parallel and t > 1
    if layout.recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attention = 0.0 if layout.recompute == "selective" or flash_attention else 5 * a * s / h
    if t == 1:
        return s * b * h * (34 + attention)
    if sp:
        return s * b * h / t * (34 + attention)
    return s * b * h * (10 + 24 / t + attention / t)


def microbatches_in_flight(layout: Layout) -> float:
    """Microbatches whose activations the first pipeline stage holds at its peak."""
    p, m = layout.pp, layout.microbatches
    if p == 1:
        return 1.0  # gradient accumulation: one microbatch at a time
    if layout.schedule == "gpipe":
        return float(m)
    held = float(min(p, m))
    if layout.vpp > 1 and layout.schedule != "zbv":
        held *= 1 + (p - 1) / (p * layout.vpp)
    return held


def estimate(model: ModelSpec, layout: Layout, seq_len: int, *, dtype: str = "bf16",
             device_bytes: float | None = None, reshard_after_forward: bool | None = None,
             flash_attention: bool = True) -> Memory:
    """Memory on the busiest GPU.  ``device_bytes``: the device's memory, for the ``fits`` verdict."""
    problems = layout.problems(model, seq_len)
    if problems:
        raise ValueError("; ".join(problems))
    n = params_per_gpu(model, layout)
    mixed = dtype in ("bf16", "fp16", "fp8")
    weight_b, grad_b, opt_b = (2, 4, 12) if mixed else (4, 4, 8)
    assumptions = ["Adam with fp32 master weights and moments" if mixed else "fp32 training with Adam",
                   "activations: Korthikanti et al. Table 2 (GPT block with dropout, 16-bit); SwiGLU and "
                   "GQA differences not modelled",
                   "no allocator fragmentation, CUDA context or communication buffers"]
    gathered = 0.0
    if layout.dp_shard > 1:
        # FSDP: the sharded fp32 weight is the master, with its fp32 gradient and Adam's moments;
        # compute uses 16-bit copies of the layers it gathers.
        weights, grads, optimizer = 4 * n / layout.dp_shard, 4 * n / layout.dp_shard, 8 * n / layout.dp_shard
        layers = layout.stage_layers(model)
        keep_all = (layout.pp > 1) if reshard_after_forward is None else not reshard_after_forward
        gathered = (2 if mixed else 4) * n / max(layers, 1) * (layers if keep_all else min(2, layers))
        assumptions.append("FSDP keeps " + ("every layer of the stage gathered (no resharding after forward)"
                                            if keep_all else "two layers gathered (one computing, one prefetched)"))
    else:
        dp = layout.data_ranks
        weights = weight_b * n
        grads = grad_b * n / (dp if layout.zero >= 2 else 1)
        optimizer = opt_b * n / (dp if layout.zero >= 1 else 1)
    layers = layout.stage_layers(model)
    activations = (activation_bytes_per_layer(model, layout, seq_len, flash_attention) * layers
                   * microbatches_in_flight(layout))
    logits = 4 * seq_len / layout.cp * layout.micro_batch * model.vocab_size / layout.tp
    return Memory(params=n, weights_bytes=weights, grads_bytes=grads, optimizer_bytes=optimizer,
                  gathered_bytes=gathered, activations_bytes=activations, logits_bytes=logits,
                  device_bytes=device_bytes, assumptions=tuple(assumptions))
