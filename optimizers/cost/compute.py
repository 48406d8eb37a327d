"""Compute time of one microbatch on one GPU of a pipeline stage, by kernel kind.

Three kinds, three ceilings:

- **GEMMs** (``compute/gemm``): FLOPs / (MAMF x ``profile.gemm`` x shape
  efficiency).  MAMF is the measured maximum matmul rate of the device
  (``optimizers.system``).  A GEMM dimension ``d`` runs at ``d / (d + knee)``
  of a large one's rate, per dimension, normalised at 8192: tensor
  parallelism's narrow slices and MoE's few tokens per expert run below peak,
  as tile quantisation and short K loops make them.  Backward is two GEMMs of
  the same shapes per forward GEMM (input and weight gradients).
- **Attention core** (``compute/attention``): flash attention does 4 s_q s_kv d
  FLOPs forward (halved when causal: masked tiles are skipped) and 2.5x that
  in backward (it recomputes the scores: five matmuls against two), at
  ``profile.attention`` of its kernel's published rate on the device (FA2, or
  FA3 / cuDNN on Hopper and later), times the rate of its calls' key length
  against 16k (``attention_efficiency``: a context-parallel ring's blocks are
  short; a causal split without load balance waits for its last rank).  Unfused attention (Megatron before 2022)
  runs the full s x s matmuls at the GEMM rate and moves the scores through
  HBM: softmax and dropout read and write them (6 passes forward, 8 backward).
- **Memory-bound work** (``compute/norm_elementwise``): elements moved per
  token and layer over ``profile.memory`` of HBM bandwidth; counted below,
  eager and fused (torch.compile).  float8 training adds its recipe's casts
  (``FP8_CAST_BYTES``).

Recomputation: full re-runs the whole forward in backward; selective re-runs
the attention core, which flash attention already does inside its backward
(plus, with torchtitan's op-level policy, half the GEMMs and the elementwise
work: ``Training.selective_gemm_fraction``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..spec import Layout, ModelSpec, Training
from ..system import ATTENTION_KNEE, ATTENTION_NORMALISED_AT, FA2_BACKWARD, Profile, System

NORMALISE_AT = 8192.0


@dataclass(frozen=True)
class Gemm:
    name: str
    m: float
    k: float
    n: float
    count: float = 1.0  # how many such GEMMs (experts on this GPU)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


def shape_efficiency(g: Gemm, knee: float) -> float:
    f = lambda d: d / (d + knee)  # noqa: E731
    return min(1.0, f(g.m) * f(g.k) * f(g.n) / f(NORMALISE_AT) ** 3)


def layer_gemms(model: ModelSpec, layout: Layout, tokens: float, expert_load: float = 1.0) -> list[Gemm]:
    """Forward GEMMs of one transformer layer for ``tokens`` tokens on one GPU of a TP group
    (sequence parallelism gathers the full microbatch before each column-parallel GEMM).
    ``expert_load``: the busiest expert-parallel rank's routed tokens over the mean."""
    h, t, hd = model.dim, layout.tp, model.head_dim
    kv = model.kv_heads * hd
    out = [Gemm("qkv", tokens, h, (h + 2 * kv) / t), Gemm("attn_out", tokens, h / t, h)]
    up = 1 if model.mlp == "gelu" else 2
    if model.n_experts:
        out.append(Gemm("router", tokens, h, model.n_experts))
        # Experts are not split over tp (expert tensor parallelism 1, Megatron-Core's default), so
        # the tp ranks split the tokens instead: each routes its own 1/tp of them.  ep ranks exchange
        # tokens, so with balanced routing each GPU's E/ep experts see tokens/tp x top_k rows in
        # all, tokens/tp x top_k x ep / E each.
        per_expert = tokens / t * model.top_k * layout.ep / model.n_experts * expert_load
        local = model.n_experts / layout.ep
        out += [Gemm("expert_up", per_expert, h, up * model.ffn_dim, local),
                Gemm("expert_down", per_expert, model.ffn_dim, h, local)]
        if model.shared_ffn_dim:  # every token, split over tp like a dense MLP
            out += [Gemm("shared_up", tokens, h, up * model.shared_ffn_dim / t),
                    Gemm("shared_down", tokens, model.shared_ffn_dim / t, h)]
    else:
        out += [Gemm("mlp_up", tokens, h, up * model.ffn_dim / t), Gemm("mlp_down", tokens, model.ffn_dim / t, h)]
    return out


def attention_block_efficiency(keys: float) -> float:
    """Flash attention's rate on calls over ``keys`` keys a query, against 16k (``ATTENTION_KNEE``);
    not extrapolated past the measured 16k."""
    f = lambda n: n / (n + ATTENTION_KNEE)  # noqa: E731
    return min(1.0, f(keys) / f(ATTENTION_NORMALISED_AT))


def attention_efficiency(cp: int, seq_len: int, training: Training) -> float:
    """The attention core's rate for ``cp``-way context parallelism against one call over the
    whole sequence at 16k.  An all-gather or Ulysses call sees every key.  A ring runs cp steps,
    each 1/cp of the work: the diagonal over the local two chunks (s/cp keys), the others over one
    chunk (s/2cp keys) on the rank that waits longest (its queries take the other rank's first
    chunk each step).  Causal attention split without load balance: the last rank's queries see
    every key, (2cp - 1)/cp of the even share, and everyone waits for it (a ring's steps, an
    all-gather's next collective)."""
    s = float(seq_len)
    if cp <= 1 or training.cp_comm in ("all_gather", "a2a"):
        eff = attention_block_efficiency(s)
    else:
        eff = cp / (1 / attention_block_efficiency(s / cp) + (cp - 1) / attention_block_efficiency(s / (2 * cp)))
    if cp > 1 and training.causal and not training.cp_load_balance and training.cp_comm != "a2a":
        eff *= cp / (2 * cp - 1)
    return eff


def gemm_seconds(gemms: list[Gemm], system: System, profile: Profile, dtype: str) -> float:
    if not gemms:
        return 0.0
    rate = system.matmul_flops(dtype if dtype != "fp32" else "bf16") * profile.gemm
    return sum(g.flops / (rate * shape_efficiency(g, profile.gemm_knee)) for g in gemms)


def elementwise_elements(model: ModelSpec, layout: Layout, training: Training) -> float:
    """Elements moved (each read or write once) per token and layer in forward, on one GPU.

    Eager PyTorch, per token: RMSNorm x2 at 7h (square, mean, rsqrt-scale, weight), residual
    adds x2 at 3h, RoPE on q and k at 6 passes, SDPA's layout copies of q, k, v at 2 passes,
    SwiGLU at 5 x ffn (silu read/write, multiply 2 reads + 1 write; GELU: 2 x ffn).  Fused
    (torch.compile): norm with its residual 3h each, RoPE 2 passes, no copies, SwiGLU 3 x ffn.
    Norms and residuals act on h per token, on 1/tp of the tokens under sequence parallelism;
    the rest on tp's slice.  MoE adds routing's gather and scatter of each token's top-k copies;
    the busiest expert-parallel rank's experts activate ``expert_load`` times the mean rows.
    """
    h, t, hd = model.dim, layout.tp, model.head_dim
    qk = (h + model.kv_heads * hd) / t
    qkv = (h + 2 * model.kv_heads * hd) / t
    load = training.expert_load if layout.ep > 1 else 1.0
    ffn = (model.ffn_dim * model.top_k * load + model.shared_ffn_dim) / t if model.n_experts else model.ffn_dim / t
    per_norm_token = 1.0 / t if layout.sequence_parallel and t > 1 else 1.0
    if training.compiled:
        norms = 2 * 3 * h * per_norm_token
        rest = 2 * qk + (2 if model.mlp == "gelu" else 3) * ffn
    elif training.fused_kernels:
        # the norm kernel reads and writes once (the residual adds stay eager); RoPE's kernel 2
        # passes; SDPA's layout copies stay; the SwiGLU kernel reads two and writes one
        norms = (2 * 2 * h + 2 * 3 * h) * per_norm_token
        rest = 2 * qk + 2 * qkv + (2 if model.mlp == "gelu" else 3) * ffn
    else:
        norms = (2 * 7 * h + 2 * 3 * h) * per_norm_token
        rest = 6 * qk + 2 * qkv + (2 if model.mlp == "gelu" else 5) * ffn
    if model.n_experts:
        rest += moe_routing_elements(model, training, load) / t
    return norms + rest


def moe_routing_elements(model: ModelSpec, training: Training, load: float = 1.0) -> float:
    """Elements a token's routing moves in forward (each read or write once), by ``training.moe_routing``.

    ``gather`` (Megatron-Core, torchtitan): each of the k routed copies gathered into expert order
    and scattered back, weighted: read and written twice, 4 k h.  ``copies`` (the reference
    trainer's eager code, counted from it and from the operators it dispatches): its permute
    repeats each token k times (h read, k h written) and places the rows (``index_copy_``, k h read
    and written); its unpermute picks them back (``index_select``, 2 k h), multiplies by the
    weights (2 k h) and sums the k (k h read, h written): 8 k h + 2 h, or with its fused kernels
    (one read of the token, one write per copy, and back) 2 k h + 2 h.  The experts sort the rows
    they receive, concatenate their outputs and unsort them: 2 k h each, at the busiest
    expert-parallel rank's ``load``.  Compiled, the copies fuse into gathers (``gather``)."""
    h, k = model.dim, model.top_k
    if training.moe_routing == "gather" or training.compiled:
        return 4 * k * h
    ends = 2 * k * h + 2 * h if training.fused_kernels else 8 * k * h + 2 * h
    return ends + 6 * k * load * h


#: Bytes a float8 recipe's casts move per element of each GEMM operand, per pass: (forward: the
#: input X and the weight W; backward: the output gradient dY, X again and W again).
#:
#: - ``delayed`` (Transformer Engine's default): the scale comes from the amax history, so a cast is
#:   one read of 16 bits and the write of the 8-bit copy and its transpose (cast-transpose), the
#:   amax taken in the same pass: 4 bytes; dY likewise in backward.
#: - ``current`` (TE's current scaling): an amax pass first, then the cast-transpose: 6 bytes.
#: - ``tensorwise`` and ``rowwise`` (torchao's dynamic scaling): an amax read, then a cast (5
#:   bytes); dY cast twice in backward, once per layout its two GEMMs take; W once per pass.
#: - ``mxfp8`` and ``blockwise``: each block's scale (32 elements for MXFP8; 1x128 and 128x128 for
#:   blockwise) is computed inside the cast (3 bytes, the scale bytes negligible), along one
#:   dimension: X and W in forward; dY along both,
#:   X and W along the other in backward (torchao's MXFP8 kernel breakdown of the grouped GEMMs).
FP8_CAST_BYTES = {
    "delayed": ((4, 4), (4, 0, 0)),
    "current": ((6, 6), (6, 0, 0)),
    "tensorwise": ((5, 5), (10, 0, 5)),
    "rowwise": ((5, 5), (10, 0, 5)),
    "mxfp8": ((3, 3), (6, 3, 3)),
    "blockwise": ((3, 3), (6, 3, 3)),
}
#: Recipes whose GEMMs run at the float8 rate.  Row-wise scaled float8 GEMMs ran through a CUTLASS
#: kernel slower than cuBLAS's tensor-wise one (pytorch/pytorch#147971), their backward through
#: cuBLAS plus a rescale (pytorch/ao#1325): measured no faster than bf16 (pytorch/torchtitan#1207:
#: Llama 3 8B on 4 H100s, 5189 against bf16's 5378 tokens/s), so they run at the bf16 rate.
FP8_RATE_RECIPES = ("delayed", "current", "tensorwise", "mxfp8", "blockwise")
#: GEMMs that stay in 16 bits whatever the recipe: the router (torchtitan's and TE's too small and
#: too sensitive) -- and the LM head, modelled with the loss.
BF16_ALWAYS = ("router",)
#: Passes over the logits of a vocabulary-parallel cross-entropy (tensor parallel > 1) against the
#: plain one's, counted the same way.  Plain (fused ``log_softmax``, ``nll_loss``): forward reads the
#: logits for the max, for the sum of exponentials and for the output it writes (4); backward
#: writes the zeroed gradient and reads the gradient and the output for the one it writes (4).
#: Vocabulary-parallel (torch.distributed.tensor.parallel's ``loss_parallel``, as torchtitan and the
#: reference trainer run it), its decomposition op by op over the local shard, an all-reduce between:
#: amax (1 read), subtract the max (2), exp (2), sum (1), subtract the log-sum (2) forward; zeros,
#: exp, add, multiply (1 + 2 + 3 + 2) backward: 16 against 8 (Megatron's own makes about 12).  On
#: a CPU core, where exp is not memory-bound, the real-compute tp=2 run's loss took 3.2x the one-rank
#: run's time per element of logits (11.9 ms a step over 0.5M logits against 7.4 over 1M).
VOCAB_PARALLEL_LOSS_PASSES = 16 / 8


def fp8_gemms(gemms: list[Gemm], training: Training) -> tuple[list[Gemm], list[Gemm]]:
    """(float8, 16-bit) GEMMs of a layer under ``training``'s format and ``fp8_scope``: ``all``
    linear layers, the dense ``linears`` only, or the routed ``experts``' grouped GEMMs only."""
    if training.dtype != "fp8":
        return [], gemms
    expert = lambda g: g.name.startswith("expert_")  # noqa: E731
    take = {"all": lambda g: True, "linears": lambda g: not expert(g), "experts": expert}[training.fp8_scope]
    low = [g for g in gemms if g.name not in BF16_ALWAYS and take(g)]
    return low, [g for g in gemms if g not in low]


def fp8_cast_bytes(gemms: list[Gemm], recipe: str, weight_share: float = 1.0) -> tuple[float, float]:
    """(forward, backward) bytes the float8 casts of ``gemms`` move (``FP8_CAST_BYTES``);
    ``weight_share``: the part of each weight a GPU casts itself (a float8 all-gather casts the
    local shard before it gathers: 1 / the FSDP degree)."""
    inputs = sum(g.m * g.k * g.count for g in gemms)
    outputs = sum(g.m * g.n * g.count for g in gemms)
    weights = weight_share * sum(g.k * g.n * g.count for g in gemms)
    (fx, fw), (bdy, bx, bw) = FP8_CAST_BYTES[recipe]
    return fx * inputs + fw * weights, bdy * outputs + bx * inputs + bw * weights


@dataclass
class StageCompute:
    """Seconds of one microbatch on one GPU of a stage, per phase and kind.  ``w`` is the part of
    backward that only weight gradients need (what zero-bubble schedules defer)."""

    fwd: dict[str, float] = field(default_factory=dict)
    bwd: dict[str, float] = field(default_factory=dict)
    w: float = 0.0
    layer_fwd_gemm_s: float = 0.0     # one layer's forward GEMMs
    #: One layer's forward GEMM seconds of each tensor-parallel linear (qkv, attn_out, mlp_up,
    #: mlp_down) of a dense model: under async TP each sequence-parallel collective hides behind
    #: the one linear it feeds or is fed by.
    tp_linear_s: dict[str, float] = field(default_factory=dict)
    attention_fwd_s: float = 0.0      # one layer's forward attention core (context parallelism)
    shared_expert_fwd_s: float = 0.0  # one layer's shared-expert GEMMs forward (MoE overlap)
    fp8_gemms: float = 0.0            # float8 GEMMs on the stage (each expert's own): their amaxes

    def total(self, phase: str) -> float:
        return sum(getattr(self, phase).values())


def stage_compute(model: ModelSpec, layout: Layout, training: Training, system: System,
                  profile: Profile, *, layers: float, with_head: bool) -> StageCompute:
    """One microbatch through ``layers`` layers (and the LM head when ``with_head``)."""
    b, s, c, t = layout.micro_batch, training.seq_len, layout.cp, layout.tp
    tokens = b * s / c
    gemms = layer_gemms(model, layout, tokens, training.expert_load if layout.ep > 1 else 1.0)
    low, high = fp8_gemms(gemms, training)
    low_dtype = "fp8" if training.fp8_recipe in FP8_RATE_RECIPES else "bf16"
    high_dtype = "bf16" if training.dtype == "fp8" else training.dtype
    fwd_gemm = gemm_seconds(low, system, profile, low_dtype) + gemm_seconds(high, system, profile, high_dtype)
    named = lambda gs, pick: [g for g in gs if pick(g.name)]  # noqa: E731
    seconds = lambda pick: (gemm_seconds(named(low, pick), system, profile, low_dtype)  # noqa: E731
                            + gemm_seconds(named(high, pick), system, profile, high_dtype))
    shared_s = seconds(lambda name: name.startswith("shared_"))
    tp_linear_s = {} if model.n_experts else {
        name: seconds(lambda n, name=name: n == name) for name in ("qkv", "attn_out", "mlp_up", "mlp_down")}
    hbm = system.hbm_Bps * profile.memory
    act = training.activation_bytes

    # Attention core, one layer.
    heads_dim = model.dim / t
    if training.flash_attention:
        flops = 4 * tokens * s * heads_dim * (0.5 if training.causal else 1.0)
        rate = system.attention_ceiling(training.attention_kernel) * profile.attention
        attn_f = flops / (rate * attention_efficiency(c, s, training))
        attn_b = 2.5 * attn_f / FA2_BACKWARD
    else:
        # Batched s x s matmuls at the GEMM rate (head_dim is their short side), and the scores
        # through HBM: 6 passes forward, 8 backward.
        bmm = [Gemm("scores", s / c, model.head_dim, s, b * model.n_heads / t),
               Gemm("context", s / c, s, model.head_dim, b * model.n_heads / t)]
        attn_gemm = gemm_seconds(bmm, system, profile, "bf16")
        scores = tokens * s * model.n_heads / t * act
        attn_f = attn_gemm + 6 * scores / hbm
        attn_b = 2 * attn_gemm + 8 * scores / hbm

    ew_f = elementwise_elements(model, layout, training) * tokens * act / hbm
    # torchao's float8 all-gather casts each weight shard once, before FSDP gathers it (forward and
    # backward gather float8 copies), not the gathered weight at each GEMM.
    own = 1 / layout.shard_ranks if training.fp8_gather and layout.shard_ranks > 1 else 1.0
    cast_f, cast_b = fp8_cast_bytes(low, training.fp8_recipe, own)
    ew_f, ew_b = ew_f + cast_f / hbm, 2 * ew_f + cast_b / hbm

    out = StageCompute(layer_fwd_gemm_s=fwd_gemm, tp_linear_s=tp_linear_s, attention_fwd_s=attn_f,
                       shared_expert_fwd_s=shared_s, fp8_gemms=layers * sum(g.count for g in low))
    out.fwd = {"gemm": layers * fwd_gemm, "attention": layers * attn_f, "norm_elementwise": layers * ew_f}
    re_gemm = re_attn = re_ew = 0.0
    if layout.recompute == "full":
        re_gemm, re_attn, re_ew = fwd_gemm, attn_f, ew_f
    elif layout.recompute == "selective":
        re_attn = 0.0 if training.flash_attention else attn_f
        if training.selective_gemm_fraction:
            re_gemm, re_ew = training.selective_gemm_fraction * fwd_gemm, ew_f
    out.bwd = {"gemm": layers * (2 * fwd_gemm + re_gemm), "attention": layers * (attn_b + re_attn),
               "norm_elementwise": layers * (ew_b + re_ew)}
    out.w = layers * fwd_gemm  # the weight-gradient GEMMs: half of backward's GEMMs
    if with_head:
        head = [Gemm("lm_head", tokens, model.dim, model.vocab_size / t)]
        head_s = gemm_seconds(head, system, profile, "bf16")  # the head stays in bf16 under float8
        # Cross-entropy over the vocabulary: fp32 logits written, read for softmax, gradient written;
        # a fused linear cross-entropy stores none (chunked), and recomputes the logits in backward.
        # Over a vocabulary sharded by tensor parallelism, the loss's decomposition moves them more.
        passes = 3 * (VOCAB_PARALLEL_LOSS_PASSES if t > 1 else 1.0)
        ce = 0.0 if training.fused_kernels else passes * tokens * model.vocab_size / t * 4 / hbm
        if training.fused_kernels:
            out.bwd["gemm"] += head_s
        out.fwd["gemm"] += head_s
        out.fwd["norm_elementwise"] += ce / 3
        out.bwd["gemm"] += 2 * head_s
        out.bwd["norm_elementwise"] += 2 * ce / 3
        out.w += head_s
    return out


def optimizer_seconds(params_on_gpu: float, system: System, profile: Profile) -> float:
    """AdamW over this GPU's (sharded) parameters: reads fp32 weight, gradient and two moments,
    writes weight and moments and the 16-bit copy -- 30 bytes a parameter, memory-bound, at the
    profile's optimizer fraction of HBM bandwidth."""
    return 30.0 * params_on_gpu / (system.hbm_Bps * profile.optimizer)
