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

Activations per layer and microbatch, for b sequences of s tokens (s/cp under context
parallelism), hidden h, a heads, t = tp, e bytes an element (2 in 16-bit, 4 in fp32):

- a GPT block (``mlp="gelu"``: Korthikanti et al. 2022, Table 2, with dropout masks; their bytes
  are 16-bit, scaled by e/2):

  ==============================  ================================
  no tensor parallelism           s b h (34 + 5 a s / h)
  tensor parallel                 s b h (10 + 24/t + 5 a s / (h t))
  tensor + sequence parallel      s b h / t (34 + 5 a s / h)
  selective recompute             the 5 a s / h term dropped (so does flash attention,
                                  the default: it keeps no s x s scores)
  full recompute                  2 s b h (/t with sequence parallel): the layer input
  ==============================  ================================

- a Llama block (SwiGLU, GQA with k = kv heads x head dim, RMSNorm, RoPE, no dropout; counted
  from the tensors autograd keeps, flash attention): per token, e x (6h + 2h + 2k + 4f) plus
  4 x (a + 2) bytes.  The 6h are replicated over tp unless sequence parallel (the block input,
  the normalized and weighted input of attention, the residual sum, the same two of the MLP);
  the rest is split over tp: the rotated q (h), k and v (2k), attention's output (h), the MLP's
  three f-wide tensors and their product (4f), attention's fp32 log-sum-exp (a) and the norms'
  fp32 inverse RMS (2).  Selective recompute drops attention's output and log-sum-exp (the core
  is re-run); full recompute keeps the block input, e h (/t with sequence parallel), and holds
  one layer's activations again while that layer's backward runs.
- the same block under torch.compile (``compiled=True``, no recompute, dense: a MoE block's
  compiled graph is not measured and keeps eager's count), counted from what its
  graph keeps (``python benchmarks/saved_activations.py``: one ``gpu_dense_1b`` block under bf16
  autocast on the CPU, 66,632 bytes a token against eager's 110,664): the partitioner keeps the
  block input (in the residual stream's dtype, r bytes: 4 under autocast over fp32 weights, else
  e) and recomputes the two norms' weighted outputs and the residual sum from it; it keeps the
  normalized inputs of attention and the MLP (2h), the rotated q, attention's output and its copy
  laid out for the output projection (3h), k and v (2k), the MLP's gate, up and product (3f,
  SwiGLU itself recomputed), the log-sum-exp (4a) and the two norms' fp32 inverse RMS: per token
  r h + e (2h + 3h + 2k + 3f) + 4 a + 8 bytes (the RoPE rotations are the model's, made once a
  forward).  The 2h and r h are replicated over tp unless
  sequence parallel.  An H200 run of ``gpu_dense_1b`` (one GPU, bf16 autocast, torch.compile)
  peaked at 77.6 GiB (``torch.cuda.max_memory_allocated``): the compiled count gives 87.6 GiB,
  eager's 99.2.

The last stage also holds, while the loss is computed, the logits (e bytes each, s b V / t of
them), their fp32 copy in 16-bit training and the fp32 log-probabilities the loss keeps; in
backward the gradients of the log-probabilities and of the logits (4 bytes each) as temporaries;
and the final norm's three h-wide tensors.

In flight on pipeline stage s (the first, the busiest, by default): GPipe keeps all m
microbatches, 1F1B and the zero-bubble schedules min(p - s, m), interleaved
schedules that times (1 + (p-1)/(p v)) (Korthikanti et al., section 4.2.3); the
last stage keeps each in-flight microbatch's log-probabilities.
Zero-bubble schedules defer each microbatch's weight gradients (W) past its input gradients (B):
until W runs, the linear layers' inputs and their outputs' gradients stay, about the stage's
activations of one microbatch for each W in flight (p - 1 of them at the steady state of ZB-H1 and
ZB-V; Qi et al. 2023 bound ZB-H1's memory at 1F1B's plus this).

Headroom (``fits``): the allocator's fragmentation, taken as 10% of what is allocated, and the CUDA
context with NCCL's buffers, taken as 1 GiB a GPU (each process's context is hundreds of MB; NCCL
keeps buffers per channel and peer); a run's measured peak replaces the estimate where there is one
(``optimize``'s memory check).  What is not modelled is listed in each result's ``assumptions``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mfuscope.layout import ZERO_BUBBLE

from ..spec import Layout, ModelSpec

GiB = 2**30
#: Headroom: fragmentation as a share of what is allocated, and the CUDA context with NCCL's buffers.
FRAGMENTATION = 0.10
CONTEXT_BYTES = 1 * GiB


@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU: the busiest (the pipeline stage with the most), or the stage asked for."""

    params: int             # parameters held (count)
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    gathered_bytes: float   # FSDP: 16-bit copies of the layers being computed
    activations_bytes: float
    logits_bytes: float     # the logits and the loss's fp32 log-probabilities (last stage only)
    temporary_bytes: float  # the loss's gradients in backward, or a recomputed layer's activations
    device_bytes: float | None
    assumptions: tuple[str, ...]

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.gathered_bytes
                + self.activations_bytes + self.logits_bytes + self.temporary_bytes)

    @property
    def headroom_bytes(self) -> float:
        """Fragmentation and the CUDA context with NCCL's buffers (module docstring)."""
        return FRAGMENTATION * self.total_bytes + CONTEXT_BYTES

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.total_bytes + self.headroom_bytes <= self.device_bytes

    def categories(self) -> dict[str, float]:
        """In the measured report's categories (``memory.per_rank[].predicted``)."""
        return {"parameter": self.weights_bytes, "gradient": self.grads_bytes, "optimizer_state": self.optimizer_bytes,
                "activation": self.activations_bytes + self.logits_bytes, "temporary": self.temporary_bytes,
                "other": self.gathered_bytes}


def params_per_gpu(model: ModelSpec, layout: Layout, stage: int | None = None) -> int:
    """Parameters on a GPU of pipeline rank ``stage`` (None: the busiest): its layers, and the
    embedding (first stage) or the head and final norm (last)."""
    dense, experts = model.layer_params()
    replicated = 2 * model.dim + (model.dim * model.n_experts if model.n_experts else 0)
    per_layer = (dense - replicated) // layout.tp + replicated + experts // layout.ep
    embedding = model.vocab_size * model.dim // layout.tp
    head = (0 if model.tied_embeddings else model.vocab_size * model.dim // layout.tp) + model.dim
    if layout.pp == 1:
        return layout.stage_layers(model) * per_layer + embedding + head
    if stage is None:
        layers = layout.stage_layers(model)
        return max(layers * per_layer + embedding, layers * per_layer + head)
    layers = layout.rank_layers(model)[stage]
    return layers * per_layer + (embedding if stage == 0 else 0) + (head if stage == layout.pp - 1 else 0)


def expert_params_per_gpu(model: ModelSpec, layout: Layout, stage: int | None = None) -> int:
    """The routed experts' parameters among :func:`params_per_gpu`'s: its layers' ``1/ep`` of them."""
    _, experts = model.layer_params()
    if not experts:
        return 0
    layers = layout.rank_layers(model)[stage] if stage is not None and layout.pp > 1 else layout.stage_layers(model)
    return layers * (experts // layout.ep)


def state_params_per_gpu(model: ModelSpec, layout: Layout, stage: int | None = None) -> float:
    """Parameters a GPU keeps the optimizer state of: FSDP's shard of the dense ones over
    :attr:`Layout.shard_ranks` and of its experts over :attr:`Layout.expert_shard_ranks`; ZeRO's
    over the gradient ranks and the expert data-parallel ones; all of them otherwise."""
    n, experts = params_per_gpu(model, layout, stage), expert_params_per_gpu(model, layout, stage)
    if layout.shard_ranks > 1:
        return (n - experts) / layout.shard_ranks + experts / layout.expert_shard_ranks
    if layout.zero >= 1:
        return (n - experts) / layout.grad_ranks + experts / layout.expert_grad_ranks
    return float(n)


def activation_bytes_per_layer(model: ModelSpec, layout: Layout, seq_len: int, flash_attention: bool = True,
                               element_bytes: int = 2, compiled: bool = False,
                               residual_bytes: int | None = None, expert_load: float = 1.0) -> float:
    """One layer, one microbatch (module docstring: Korthikanti et al.'s GPT block, or the Llama
    block counted tensor by tensor, eager or compiled).  Flash attention stores no s x s scores (it
    recomputes them in backward), which drops the 5 a s / h term exactly as selective
    recomputation does.  ``residual_bytes``: the residual stream's element size (the compiled
    count keeps it; default ``element_bytes``).  ``expert_load``: the busiest expert-parallel
    rank's routed rows over the mean (:func:`_moe_bytes_per_token`)."""
    s, b, h, a, t = seq_len / layout.cp, layout.micro_batch, model.dim, model.n_heads, layout.tp
    sp = layout.sequence_parallel and t > 1
    e = element_bytes
    if layout.recompute == "full":
        return e * s * b * h / (t if sp else 1)
    if compiled and model.mlp != "gelu" and not model.n_experts and layout.recompute == "none":
        k, f, r = model.kv_heads * model.head_dim, model.ffn_dim, residual_bytes or e
        replicated = r * h + e * 2 * h + 8
        split = e * (3 * h + 2 * k + 3 * f) + 4 * a
        return s * b * (replicated / (t if sp else 1) + split / t)
    if model.mlp == "gelu":
        scale = e / 2
        attention = 0.0 if layout.recompute == "selective" or flash_attention else 5 * a * s / h
        if t == 1:
            return scale * s * b * h * (34 + attention)
        if sp:
            return scale * s * b * h / t * (34 + attention)
        return scale * s * b * h * (10 + 24 / t + attention / t)
    k, f = model.kv_heads * model.head_dim, model.ffn_dim
    replicated = e * 6 * h + 4 * 2
    mlp = _moe_bytes_per_token(model, e, expert_load) if model.n_experts else e * 4 * f
    split = e * (2 * h + 2 * k) + mlp + 4 * a
    if layout.recompute == "selective":  # attention's output and log-sum-exp are not kept
        split -= e * h + 4 * a
    return s * b * (replicated / (t if sp else 1) + split / t)


def _moe_bytes_per_token(model: ModelSpec, e: int, expert_load: float) -> float:
    """What a MoE layer's backward keeps per token (a tp rank routes its 1/tp of them): the shared
    expert's four f-wide tensors; per routed copy (k a token; ``expert_load`` times the mean
    on the busiest expert-parallel rank, where they are computed) the expert's input row, SwiGLU's
    four f-wide tensors and the int64 index that sorted the rows by expert; per copy back home the
    gathered output row the router weight multiplies, its int64 position and top-k index and the
    fp32 weight; the router's fp32 probabilities.  Counted on the reference trainer's MoE
    (reference_trainer/model.py); Megatron-Core and torchtitan keep the same rows (the permuted
    input, the experts' activations, the unpermuted output) and the router's probabilities."""
    h, f, k = model.dim, model.ffn_dim, model.top_k
    shared = e * 4 * model.shared_ffn_dim
    routed = k * expert_load * (e * (h + 4 * f) + 8)
    home = k * (e * h + 8 + 8 + 4) + 4
    return shared + routed + home + 4 * model.n_experts


def microbatches_in_flight(layout: Layout, stage: int | None = None) -> float:
    """Microbatches whose activations pipeline rank ``stage`` holds at its peak (None: the first,
    the busiest).  GPipe: all m on every stage.  1F1B and the others: stage s runs p - s forwards
    before its first backward, min(p - s, m) (the last stage one at a time); interleaved schedules
    that times (1 + (p-1)/(p v)) (Korthikanti et al., section 4.2.3)."""
    p, m = layout.pp, layout.microbatches
    if p == 1:
        return 1.0  # gradient accumulation: one microbatch at a time
    if layout.schedule == "gpipe":
        return float(m)
    held = float(min(p - (stage or 0), m))
    if layout.vpp > 1 and layout.schedule != "zbv":
        held *= 1 + (p - 1) / (p * layout.vpp)
    return held


def deferred_weight_grads(layout: Layout) -> float:
    """Microbatches whose weight-gradient (W) pass is pending at the peak under a zero-bubble
    schedule (each holds about one microbatch's activations of the stage); 0 otherwise."""
    if layout.schedule not in ZERO_BUBBLE or layout.pp == 1:
        return 0.0
    return float(min(layout.pp - 1, layout.microbatches))


def estimate(model: ModelSpec, layout: Layout, seq_len: int, *, dtype: str = "bf16",
             device_bytes: float | None = None, reshard_after_forward: bool | None = None,
             flash_attention: bool = True, stage: int | None = None, optimizer_states: int = 2,
             compiled: bool = False, expert_load: float = 1.0) -> Memory:
    """Memory on the busiest GPU, or on a GPU of pipeline rank ``stage``.  ``device_bytes``: the
    device's memory, for the ``fits`` verdict; ``optimizer_states``: fp32 tensors the optimizer
    keeps per parameter (Adam 2, SGD without momentum 0); ``compiled``: torch.compile's blocks
    (the activations their graphs keep); ``expert_load``: the busiest expert-parallel rank's
    routed rows over the mean (``Training.expert_load``)."""
    problems = layout.problems(model, seq_len)
    if problems:
        raise ValueError("; ".join(problems))
    n = params_per_gpu(model, layout, stage)
    mixed = dtype in ("bf16", "fp16", "fp8")
    e = 2 if mixed else 4
    weight_b, grad_b, opt_b = (2, 4, 4 + 4 * optimizer_states) if mixed else (4, 4, 4 * optimizer_states)
    assumptions = [("Adam" if optimizer_states == 2 else f"{optimizer_states} optimizer state(s) a parameter")
                   + (" with fp32 master weights and moments" if mixed else ", fp32 training"),
                   "activations: " + ("Korthikanti et al. Table 2 (GPT block with dropout)" if model.mlp == "gelu"
                                      else "the Llama block's saved tensors (SwiGLU, GQA, RMSNorm, RoPE)"),
                   "gradients alive at the activation peak (a trainer that frees them before forward peaks lower)",
                   f"headroom: {FRAGMENTATION:.0%} fragmentation and {CONTEXT_BYTES / GiB:.0f} GiB of CUDA context "
                   "and NCCL buffers"]
    gathered = 0.0
    layers = layout.rank_layers(model)[stage] if stage is not None and layout.pp > 1 else layout.stage_layers(model)
    own = state_params_per_gpu(model, layout, stage)
    if layout.shard_ranks > 1:
        # FSDP: the sharded fp32 weight is the master, with its fp32 gradient and the optimizer's
        # states; compute uses 16-bit copies of the layers it gathers.
        weights, grads = 4 * own, 4 * own
        optimizer = 4 * optimizer_states * own
        keep_all = (layout.pp > 1) if reshard_after_forward is None else not reshard_after_forward
        gathered = (2 if mixed else 4) * n / max(layers, 1) * (layers if keep_all else min(2, layers))
        assumptions.append("FSDP keeps " + ("every layer of the stage gathered (no resharding after forward)"
                                            if keep_all else "two layers gathered (one computing, one prefetched)"))
    else:
        weights = weight_b * n
        grads = grad_b * (own if layout.zero >= 2 else n)
        optimizer = opt_b * own
    # Under autocast the weights stay fp32 unless FSDP casts them, and so does the residual stream.
    residual = 4 if mixed and layout.shard_ranks == 1 else e
    per_layer = activation_bytes_per_layer(model, layout, seq_len, flash_attention, e, compiled, residual,
                                           expert_load if layout.ep > 1 else 1.0)
    if compiled and model.mlp != "gelu" and not model.n_experts and layout.recompute == "none":
        assumptions[1] = "activations: what torch.compile's Llama block keeps (benchmarks/saved_activations.py)"
    tokens = seq_len / layout.cp * layout.micro_batch
    sp = layout.sequence_parallel and layout.tp > 1
    activations = per_layer * layers * (microbatches_in_flight(layout, stage) + deferred_weight_grads(layout))
    last = stage is None or stage == layout.pp - 1
    # While the loss is computed: the logits, their fp32 copy (16-bit training) and the fp32
    # log-probabilities the loss keeps -- one microbatch's, and the log-probabilities of the others
    # the last stage holds (GPipe: all m); in backward the gradients of the last two.
    logit_elements = tokens * model.vocab_size / layout.tp if last else 0.0
    held = microbatches_in_flight(layout, layout.pp - 1) if layout.pp > 1 else 1.0
    logits = (e + (4 if e < 4 else 0) + 4 * held) * logit_elements
    if last:  # the final norm's input, normalized input and output, and its fp32 inverse RMS
        activations += (e * 3 * model.dim + 4) * tokens / (layout.tp if sp else 1)
    temporary = 2 * 4 * logit_elements
    if layout.recompute == "full":  # the layer whose backward runs holds its activations again
        whole = activation_bytes_per_layer(model, replace(layout, recompute="none"), seq_len, flash_attention, e)
        temporary = max(temporary, whole)
    if deferred_weight_grads(layout):
        assumptions.append("zero-bubble: a stage's activations of one microbatch for each deferred W pass")
    return Memory(params=n, weights_bytes=weights, grads_bytes=grads, optimizer_bytes=optimizer,
                  gathered_bytes=gathered, activations_bytes=activations, logits_bytes=logits,
                  temporary_bytes=temporary, device_bytes=device_bytes, assumptions=tuple(assumptions))
