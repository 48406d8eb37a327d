"""The cost model's inputs: what is trained (:class:`ModelSpec`) and how it is laid out (:class:`Layout`).

Two small frozen records, so a planner varies only the layout and every formula
reads named fields.  Counts are plain integers; sizes in the cost model carry
their unit in their name (``_bytes``, ``_s``).  The model spec uses the names of
the run manifest's ``model`` section (``dim``, ``n_layers``, ``ffn_dim``, ...,
see ``mfuscope/flops.py``), so a measured run can be predicted as it was run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from mfuscope.layout import SCHEDULES
from mfuscope.trainer_options import TrainerOptions

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: GQA attention, SwiGLU (or GELU) MLP, optional routed experts."""

    n_layers: int
    dim: int
    n_heads: int
    ffn_dim: int
    vocab_size: int
    n_kv_heads: int | None = None
    n_experts: int = 0
    top_k: int = 1
    mlp: str = "swiglu"             # "gelu": two d x ffn matrices (GPT, Megatron's papers)
    tied_embeddings: bool = False
    shared_ffn_dim: int = 0         # a shared expert every token passes through (Qwen2-MoE, DeepSeek)
    router_groups: int = 1          # node-limited routing: experts in this many groups (DeepSeek-V3's n_group)
    router_group_topk: int = 1      # ... each token's experts from this many of them (its topk_group)

    @classmethod
    def from_manifest(cls, spec: dict[str, Any]) -> ModelSpec:
        """From a run manifest's ``model`` section (unknown keys, such as ``max_seq_len``, ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in spec.items() if k in names and v is not None})

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def attention_params(self) -> int:
        """q and o: d x d; k and v: d x (kv_heads x head_dim) each.  No biases."""
        return 2 * self.dim * self.dim + 2 * self.dim * self.kv_heads * self.head_dim

    def mlp_params(self) -> int:
        """One dense MLP (or one expert): three d x ffn matrices for SwiGLU, two for GELU."""
        return (2 if self.mlp == "gelu" else 3) * self.dim * self.ffn_dim

    def shared_mlp_params(self) -> int:
        """The shared expert's matrices (split over tp as a dense MLP is)."""
        return (2 if self.mlp == "gelu" else 3) * self.dim * self.shared_ffn_dim

    def layer_params(self) -> tuple[int, int]:
        """(parameters every rank of a tensor-parallel group splits, expert parameters) of one layer;
        the two RMSNorm weights are counted with the first, the router and a shared expert too."""
        norms = 2 * self.dim
        if self.n_experts:
            return (self.attention_params() + norms + self.dim * self.n_experts + self.shared_mlp_params(),
                    self.n_experts * self.mlp_params())
        return self.attention_params() + self.mlp_params() + norms, 0

    def parameter_tensors(self, layers: float, first: bool = True, last: bool = True) -> float:
        """Parameter tensors of ``layers`` layers (attention's 4 projections, the MLP's 2 or 3, two
        norms; a MoE layer's router, its experts' stacked projections and a shared expert's) and of the
        embedding (``first``) or the head and final norm (``last``): what an optimizer loops over."""
        matrices = 2 if self.mlp == "gelu" else 3
        per_layer = 4 + 2 + ((1 + matrices + (matrices if self.shared_ffn_dim else 0)) if self.n_experts else
                             matrices)
        return layers * per_layer + (1 if first else 0) + ((1 if self.tied_embeddings else 2) if last else 0)

    def embedding_params(self) -> int:
        """Token embedding, plus the LM head unless tied; the final norm."""
        return self.vocab_size * self.dim * (1 if self.tied_embeddings else 2) + self.dim

    def total_params(self) -> int:
        dense, experts = self.layer_params()
        return self.n_layers * (dense + experts) + self.embedding_params()


@dataclass(frozen=True)
class Layout:
    """How the job is split.  ``dp_shard`` > 1 shards parameters, gradients and optimizer state
    over those ranks (FSDP / ZeRO-3); with ``dp_shard`` = 1, ``zero`` picks what the data ranks
    shard (0: nothing, plain DDP; 1: optimizer state, Megatron's distributed optimizer; 2: and
    gradients).  ``vpp``: model chunks per pipeline rank (interleaved schedules).  ``split``: layers
    per pipeline stage in stage order (pp x vpp of them), as ``--stage-layers`` gives them; empty
    for an even cut.  ``expert_folding``: MoE Parallel Folding (Megatron-Core; Liu et al. 2025): the
    expert-parallel groups are carved out of the tp x cp x data ranks, innermost first, instead of
    out of the data ranks -- so ``ep`` may exceed dp x cp and an ep group fills the NVLink domain."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = True
    zero: int = 0
    split: tuple[int, ...] = ()
    expert_folding: bool = False

    @property
    def data_ranks(self) -> int:
        """Ranks that take different rows of the batch (dp_replicate x dp_shard; context ranks
        split the same rows' tokens: :attr:`mfuscope.layout.Degrees.data_ranks`)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP shards the parameters over, 1 without FSDP: ``dp_shard`` x ``cp``.  Context
        ranks hold the same parameters and compute gradients of other tokens, so the shard group
        spans them too (torchtitan's and the reference trainer's ``dp_shard_cp`` mesh); FSDP runs
        on them alone when the layout has context ranks and nothing else replicates."""
        if self.dp_shard > 1 or (self.cp > 1 and self.dp_replicate == 1 and self.zero == 0):
            return self.dp_shard * self.cp
        return 1

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are reduced together: the data ranks x the context ranks (each
        context rank's gradient covers its share of the tokens: Megatron's data-parallel group
        with context parallelism, torchtitan's ``dp_cp``)."""
        return self.data_ranks * self.cp

    @property
    def expert_grad_ranks(self) -> int:
        """Ranks that hold the same routed experts and reduce their gradients together: the expert
        data-parallel group, ``tp x grad_ranks / ep``.  Each expert is whole on a rank (expert
        tensor parallelism 1, as :func:`cost.compute.layer_gemms` computes them), so the tp ranks
        beside it hold the same ones: Megatron-Core's EDP, tp x cp x dp / (etp x ep); the reference
        trainer reduces them over tp, then over its ``ep_dp`` mesh.  ``grad_ranks`` without expert
        parallelism."""
        if self.ep == 1:
            return self.grad_ranks
        ranks = self.tp * self.grad_ranks
        return ranks // self.ep if ranks % self.ep == 0 else 1

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks of FSDP's shard group (:attr:`shard_ranks`, one tp coordinate) that hold the same
        routed experts, over which FSDP shards them: ``shard_ranks / ep`` where the expert groups
        are cut from the data ranks (torchtitan's ``dp_shard_mod_ep``, the reference trainer's
        ``ep_dp`` mesh); folded, where an expert group spans tp ranks too, ``shard_ranks`` over the
        ``ep / gcd(tp, ep)`` experts' slots the group's members take.  1 where every member's
        experts are its own (FSDP moves none of them)."""
        if self.shard_ranks == 1 or self.ep == 1:
            return self.shard_ranks
        slots = self.ep // math.gcd(self.tp, self.ep) if self.expert_folding else self.ep
        return self.shard_ranks // slots if self.shard_ranks % slots == 0 else 1

    def stage_layers(self, model: ModelSpec) -> int:
        """Layers on the busiest pipeline rank: with an explicit ``split`` the most any rank holds;
        else chunks of ceil(L / (pp x vpp)) layers, vpp of them (an even cut that does not divide,
        as torchtitan makes for 126 layers over 8 stages, loads one rank more)."""
        if self.split:
            return max(self.rank_layers(model))
        return -(-model.n_layers // (self.pp * self.vpp)) * self.vpp

    def rank_layers(self, model: ModelSpec) -> list[int]:
        """Layers each pipeline rank holds, over its chunks: stages r, r + pp, ... (looped
        schedules) or r and 2pp - 1 - r (ZB-V's V shape)."""
        n = self.pp * self.vpp
        if self.split:
            split = self.split
        else:
            base, extra = divmod(model.n_layers, n)
            split = tuple(base + (1 if s < extra else 0) for s in range(n))
        if self.schedule == "zbv":
            return [split[r] + split[2 * self.pp - 1 - r] for r in range(self.pp)]
        return [sum(split[r::self.pp]) for r in range(self.pp)]

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.data_ranks * self.cp

    def problems(self, model: ModelSpec, seq_len: int) -> list[str]:
        """Every rule the layout breaks for ``model`` (empty when it is legal)."""
        out = []
        for name in ("tp", "pp", "vpp", "dp_replicate", "dp_shard", "cp", "ep", "micro_batch", "microbatches"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)} must be at least 1")
        if out:
            return out
        if model.n_heads % self.tp or model.kv_heads % self.tp:
            out.append(f"tp={self.tp} must divide the {model.n_heads} heads and {model.kv_heads} KV heads")
        if model.ffn_dim % self.tp:
            out.append(f"tp={self.tp} must divide ffn_dim={model.ffn_dim}")
        if self.pp * self.vpp > model.n_layers:
            out.append(f"pp x vpp = {self.pp * self.vpp} exceeds the {model.n_layers} layers")
        if self.split and (len(self.split) != self.pp * self.vpp or sum(self.split) != model.n_layers
                           or min(self.split) < 1):
            out.append(f"stage split {','.join(map(str, self.split))} must give each of the pp x vpp = "
                       f"{self.pp * self.vpp} stages at least one layer, {model.n_layers} in all")
        if seq_len % (self.cp * (self.tp if self.sequence_parallel else 1)):
            out.append(f"the sequence ({seq_len}) must split over cp={self.cp}"
                       + (f" x tp={self.tp} (sequence parallel)" if self.sequence_parallel else ""))
        if self.ep > 1 and not model.n_experts:
            out.append(f"ep={self.ep} on a dense model")
        if model.n_experts and model.n_experts % self.ep:
            out.append(f"ep={self.ep} must divide the {model.n_experts} experts")
        if self.expert_folding:
            if (self.tp * self.cp * self.data_ranks) % self.ep:
                out.append(f"ep={self.ep} must divide the tensor x context x data ranks "
                           f"({self.tp * self.cp * self.data_ranks}) it is folded over")
        elif (self.data_ranks * self.cp) % self.ep:
            out.append(f"ep={self.ep} must divide the data x context ranks ({self.data_ranks * self.cp}); "
                       "expert folding (Megatron-Core's MoE Parallel Folding) lifts that")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        elif (self.vpp > 1) != (self.schedule in ("interleaved_1f1b", "zero_bubble", "zbv")):
            out.append(f"schedule {self.schedule} with vpp={self.vpp}: interleaved and zero-bubble schedules "
                       "take vpp > 1, the others vpp = 1")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.zero not in (0, 1, 2):
            out.append(f"zero={self.zero}: 0, 1 or 2 (ZeRO-3 is dp_shard > 1)")
        if self.zero and self.dp_shard > 1:
            out.append("zero applies to replicated data ranks (dp_shard = 1); dp_shard > 1 already shards all")
        return out


FP8_RECIPES = ("tensorwise", "rowwise", "delayed", "current", "mxfp8", "blockwise")
FP8_SCOPES = ("all", "linears", "experts")
#: How context parallelism moves K and V (Megatron-Core's ``--cp-comm-type`` names): ``all_gather``
#: the whole sequence's K and V before the attention core (PyTorch's ``context_parallel`` with its
#: all-gather rotation, the reference trainer's); ``p2p`` a ring: cp steps, each the attention of
#: the local queries against one rank's K and V while the next block travels (Megatron-Core's and
#: Transformer Engine's default); ``a2a`` Ulysses: all-to-alls trade the sequence split for a head
#: split around the attention core (DeepSpeed-Ulysses).
CP_COMMS = ("all_gather", "p2p", "a2a")
#: Flash-attention kernels with their own rates: ``fa2`` (FlashAttention-2, PyTorch's SDPA flash
#: backend) and ``fa3`` (FlashAttention-3 and cuDNN's fused attention, which Transformer Engine
#: runs: Hopper's asynchronous tensor cores; FA2's rate on GPUs before Hopper).
ATTENTION_KERNELS = ("fa2", "fa3")
#: What a MoE layer's dispatch and combine all-to-alls may hide behind: ``none``; the layer's
#: ``shared_experts`` (Megatron-Core's ``--moe-shared-expert-overlap``: the shared expert runs
#: while the tokens travel); another microbatch's compute (``microbatches``: Megatron-Core's
#: ``--overlap-moe-expert-parallel-comm`` in interleaved 1F1B, DeepSeek-V3's DualPipe: one
#: microbatch's all-to-all behind the other's attention and GEMMs).
MOE_OVERLAPS = ("none", "shared_experts", "microbatches")
#: How tokens reach their experts across nodes: NCCL's ``all_to_all`` (Megatron-Core's
#: ``alltoall`` dispatcher, torchtitan's) or DeepEP's two-level ``deepep`` dispatch (Megatron-Core's
#: ``flex`` dispatcher with ``--moe-enable-deepep``).
MOE_DISPATCHES = ("all_to_all", "deepep")
#: How a MoE layer moves its routed copies on the device (``cost.compute.moe_routing_elements``):
#: ``gather`` -- one gather of each copy into expert order and one weighted scatter back
#: (Megatron-Core's and torchtitan's token permutation); ``copies`` -- the reference trainer's eager
#: PyTorch, which copies each routed row several times on the way (its permute, the experts' sort,
#: their outputs' concatenation and unsort, its unpermute).
MOE_ROUTINGS = ("gather", "copies")


@dataclass(frozen=True)
class Training:
    """What a step runs besides the layout: the sequence, the number formats, the switches.

    ``dtype`` is the GEMMs' format (``fp8``: the linear layers in float8, the rest in bf16).
    ``compiled``: torch.compile fuses each elementwise chain into one read and one write.
    ``fused_kernels``: hand-fused kernels (mfuscope's, Liger's) replace the norms, SwiGLU, RoPE
    and the LM head with its loss: each of those one read and one write, the rest eager, and the
    head's logits never stored -- recomputed in backward, 8 N V H FLOPs instead of 6.  The overlap
    switches say what communication may hide behind compute: the data-parallel gradient
    reduction behind backward, FSDP's parameter gathers behind the previous layer (prefetch),
    tensor-parallel collectives behind their GEMMs (async TP), and pipeline sends behind the next
    microbatch.  ``scatter_gather_sends``: each tensor-parallel rank sends only its 1/tp slice of
    a pipeline activation over its own NIC and the receiver all-gathers it over NVLink
    (Megatron-LM's scatter/gather, Narayanan et al. 2021 sec. 4.1; on by default there); sequence
    parallelism slices the activation anyway.  ``grad_reduce_bytes``: 4 for fp32 gradient
    reductions (Megatron's and torchtitan's default), 2 for bf16.  ``selective_gemm_fraction``:
    what "selective" recomputation re-runs besides the attention core -- 0 in Megatron-LM
    (Korthikanti et al.: the attention core only); torchtitan's op-level policy saves every other
    matmul's output, so it re-runs half the forward GEMMs (0.5) and all elementwise work.
    ``reshard_after_forward``: FSDP frees gathered weights after forward (and gathers them again
    for backward); None is FSDP2's default as torchtitan and the reference trainer set it -- on
    without a pipeline, off with one.  ``overlap_reduce_scatter``: FSDP's gradient reduce-scatter
    hides behind the backward; None: whenever its gathers do (``overlap_param_gather``), as on a
    GPU's separate stream.  ``grad_bucket_bytes``: DDP's (or the distributed optimizer's) gradient
    bucket; None is DDP's 25 MiB.  The last bucket is reduced after the backward ends, whatever the
    overlap.  ``ddp_bucket_copies``: PyTorch DDP without ``gradient_as_bucket_view`` copies each
    gradient into its bucket and the reduced bucket back (its reducer's two copies: a read and a
    write of the gradients each); Megatron-LM's buffers and a bucket view hold the gradients in
    place.  ``keep_last_gathered``: FSDP does not reshard the last block after forward (its
    backward is next), so backward gathers one block fewer.  ``cuda_graphs``: each compiled block
    replays as one CUDA graph launch, so the host's per-kernel launch time leaves the step.
    ``shard_calls_per_layer``: FSDP's all-gathers (and gradient reduce-scatters) per layer and pass,
    each paying a collective's latency: 1 for FSDP and FSDP2 (a block is one unit); a block's
    parameter tensors for DeepSpeed's ZeRO-3 of 2021, which gathered and reduced each parameter on
    its own.  ``list_collectives``: FSDP's collectives take a list of per-rank tensors (DeepSpeed's
    ZeRO-3 of 2021 passed its partitions as a list), which PyTorch's NCCL process group copies
    one rank at a time: a kernel launch per rank and call, on the host thread that launches the
    compute.  ``recompute_regathers``: under full recomputation FSDP gathers each block again for
    the recomputed forward and once more for its backward (per-module hooks, DeepSpeed's ZeRO-3);
    FSDP2 gathers a block once for both.  ``fp8_gather``: under float8 training FSDP gathers the
    linear weights already cast to float8, 1 byte each (torchao's float8 all-gather).
    ``fp8_recipe``: how float8 GEMMs are scaled (``FP8_RECIPES``): Transformer Engine's ``delayed``
    or ``current`` per-tensor scaling, torchao's dynamic ``tensorwise`` or ``rowwise``, ``mxfp8``
    (32-element blocks, Blackwell's tensor cores) or ``blockwise`` (1x128 / 128x128, DeepSeek-V3's);
    each its own GEMM rate and casts (``cost.compute.FP8_CAST_BYTES``).  ``fp8_scope``: which GEMMs
    run in float8 -- ``all`` linear layers, the dense ``linears`` only, or the routed ``experts``'
    grouped GEMMs only (the router and the LM head stay 16-bit).  ``cp_regather``:
    context parallelism sends K and V again in backward (a ring does; an all-gather that keeps
    them does not, unless the forward is recomputed); ``cp_grad_collective``: what carries their
    gradients back (the reference trainer's all-gather is undone by an all-to-all) -- both for
    ``cp_comm`` ``all_gather`` (``CP_COMMS``: or a ``p2p`` ring, or ``a2a`` Ulysses).
    ``cp_overlap``: the K/V exchange runs behind attention that does not need it yet (a ring's next
    step, an all-gather issued while the local chunk's attention runs); an implementation that
    gathers before any attention and waits for it (the reference trainer's) exposes all of it.
    ``cp_load_balance``: each context-parallel rank holds two chunks of the sequence, i and
    2cp-1-i, so causal attention's work is even (Megatron-Core's and torchtitan's); without it the
    last rank's queries see every key and the ring waits for it.  ``attention_kernel``: the flash
    attention kernel's rate (``ATTENTION_KERNELS``).  ``moe_overlap``: what the expert all-to-alls
    hide behind (``MOE_OVERLAPS``).  ``moe_imbalance``: the busiest expert-parallel rank's routed
    tokens over the mean (1: balanced routing); the all-to-all and that rank's expert GEMMs wait
    for it, unless ``moe_capacity_factor`` drops the tokens past that multiple of the mean
    (Megatron-Core's ``--moe-expert-capacity-factor``, GShard's capacity).  ``moe_dispatch``: NCCL's
    ``all_to_all`` (a copy of a token per expert) or ``deepep``'s two-level dispatch (a copy per
    remote node over the NIC, forwarded over NVLink: ``cost.comm``).  ``moe_routing``: how the
    routed copies are moved on the device (``MOE_ROUTINGS``).  ``checkpoint_s``:
    seconds a step the training thread is blocked saving checkpoints -- a measured run's
    ``checkpoint`` leaf, carried as measured (the model has no storage term); the async-save fix
    replaces it by the staging an async save keeps."""

    seq_len: int
    dtype: str = "bf16"
    flash_attention: bool = True
    causal: bool = True
    compiled: bool = False
    fused_kernels: bool = False
    async_tp: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    overlap_p2p: bool = True
    grad_reduce_bytes: int = 4
    selective_gemm_fraction: float = 0.0
    reshard_after_forward: bool | None = None
    overlap_reduce_scatter: bool | None = None
    grad_bucket_bytes: float | None = None
    ddp_bucket_copies: bool = False
    keep_last_gathered: bool = False
    cuda_graphs: bool = False
    shard_calls_per_layer: int = 1
    list_collectives: bool = False
    recompute_regathers: bool = False
    fp8_gather: bool = False
    fp8_recipe: str = "tensorwise"
    fp8_scope: str = "all"
    cp_regather: bool = True
    cp_grad_collective: str = "reduce_scatter"
    cp_comm: str = "all_gather"
    cp_overlap: bool = True
    cp_load_balance: bool = True
    attention_kernel: str = "fa2"
    moe_overlap: str = "none"
    moe_imbalance: float = 1.0
    moe_capacity_factor: float | None = None
    moe_dispatch: str = "all_to_all"
    moe_routing: str = "gather"
    scatter_gather_sends: bool = False
    checkpoint_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"float8 recipe {self.fp8_recipe!r}: one of {', '.join(FP8_RECIPES)}")
        if self.fp8_scope not in FP8_SCOPES:
            raise ValueError(f"float8 scope {self.fp8_scope!r}: one of {', '.join(FP8_SCOPES)}")
        if self.cp_comm not in CP_COMMS:
            raise ValueError(f"context-parallel communication {self.cp_comm!r}: one of {', '.join(CP_COMMS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {self.attention_kernel!r}: one of {', '.join(ATTENTION_KERNELS)}")
        if self.moe_overlap not in MOE_OVERLAPS:
            raise ValueError(f"MoE overlap {self.moe_overlap!r}: one of {', '.join(MOE_OVERLAPS)}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"MoE dispatch {self.moe_dispatch!r}: one of {', '.join(MOE_DISPATCHES)}")
        if self.moe_routing not in MOE_ROUTINGS:
            raise ValueError(f"MoE routing {self.moe_routing!r}: one of {', '.join(MOE_ROUTINGS)}")
        if self.moe_imbalance < 1 or (self.moe_capacity_factor is not None and self.moe_capacity_factor < 1):
            raise ValueError("the MoE imbalance and capacity factor are multiples of the mean load: 1 or more")

    @property
    def expert_load(self) -> float:
        """The busiest expert-parallel rank's routed tokens over the mean: the imbalance, capped
        by the capacity factor (tokens past capacity are dropped, not computed)."""
        return min(self.moe_imbalance, self.moe_capacity_factor or self.moe_imbalance)

    def layout_problems(self, model: ModelSpec, layout: Layout) -> list[str]:
        """What makes ``layout`` impossible for this training beyond the layout's own rules:
        Ulysses splits each tensor-parallel rank's query heads over the cp ranks."""
        if self.cp_comm == "a2a" and layout.cp > 1 and (model.n_heads // layout.tp) % layout.cp:
            return [f"Ulysses (cp_comm a2a) splits the {model.n_heads // layout.tp} query heads of a tp rank "
                    f"over cp={layout.cp}: cp must divide them"]
        return []

    @classmethod
    def of_run(cls, opts: TrainerOptions, train: dict[str, Any], on_gpu: bool, attention: str | None = None
               ) -> Training:
        """What a reference-trainer run ran: its options and resolved train settings.  ``--kernels
        fused`` fuses on a GPU; on a CPU the kernels run their PyTorch reference (nothing fused).

        The reference trainer's pipeline (torch.distributed.pipelining) waits for each receive
        before the microbatch's compute: every hop is on the critical path.  On a CPU, gloo's
        collectives block the calling thread and share its cores: nothing overlaps, except FSDP's
        gathers with prefetch, which are issued async a block ahead (their reduce-scatters still
        block), and DDP's bucket all-reduces, which run async on gloo's worker threads (all but the
        last bucket can overlap the backward).  ``attention``: the SDPA backend the trainer recorded
        PyTorch picking (the manifest's ``kernels.attention``): cuDNN's runs at the FA3-class rate,
        any other (or none recorded) at FlashAttention-2's.  Its MoE layers move their routed copies
        as eager PyTorch does (``copies``)."""
        ddp = opts.dp_mode == "ddp"
        return cls(seq_len=int(train["seq_len"]), dtype=train.get("dtype", "bf16"),
                   compiled=bool(train.get("compile")), fused_kernels=opts.kernels == "fused" and on_gpu,
                   overlap_p2p=False,
                   overlap_grad_reduce=on_gpu or ddp, overlap_param_gather=on_gpu or opts.prefetch,
                   overlap_reduce_scatter=None if on_gpu else False,
                   reshard_after_forward=opts.reshard_after_forward,
                   grad_bucket_bytes=opts.ddp_bucket_mb * 2**20 if opts.ddp_bucket_mb else None,
                   ddp_bucket_copies=ddp and not opts.grad_as_bucket_view,
                   keep_last_gathered=opts.keep_last_gathered, cuda_graphs=bool(train.get("cuda_graphs")),
                   async_tp=opts.async_tp, cp_regather=False, cp_grad_collective="all_to_all",
                   cp_overlap=False, attention_kernel="fa3" if attention == "cudnn" else "fa2",
                   moe_routing="copies")

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element: 16-bit for bf16/fp16/fp8 training, 4 in fp32."""
        return 4 if self.dtype == "fp32" else 2
