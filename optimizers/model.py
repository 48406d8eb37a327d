"""The step-time model: a layout's predicted breakdown tree, with the analyzers' leaf names.

``predict(model, layout, training, system, profile)`` assembles the parts:

1. **A microbatch on the busiest stage** (``cost/compute.py``): forward F and
   backward B per kernel kind, plus the exposed part of the collectives that
   sit inside the layers -- tensor parallelism (2 all-gathers and 2
   reduce-scatters per layer and direction with sequence parallelism, else 2
   all-reduces; full recomputation repeats the forward's), context
   parallelism by its implementation (K/V gathered forward, gathered again
   and their gradients reduce-scattered backward, hidden behind the attention
   core; a ring's per-step sends hidden behind its steps; Ulysses'
   all-to-alls, exposed), expert parallelism (dispatch and combine
   all-to-alls, and forward's exchange of token counts before them, exposed).
   Async TP hides TP behind the layer's GEMMs.
2. **The pipeline**: m microbatches of F + B, plus the schedule's bubble from
   ``analyzers.bubbles.theory`` (GPipe/1F1B (p-1)T, interleaved (p-1)T/v,
   zero-bubble with W = the weight-gradient GEMMs); GPipe's and 1F1B's fill
   and drain pass through every other stage at its own pace, sum over
   r != busiest of T_r (which is (p-1)T for equal stages; the LM head makes
   its rank the busiest where the layers are cut evenly), plus the point-to-point
   sends: with overlap only the fill and drain's 2(p-1) are exposed, without
   it every microbatch's 2v.  The analyzers book pipeline waits, sends
   included, as ``bubble``; so does the model.
3. **Data parallelism**, once per step or per microbatch: DDP's all-reduce or
   ZeRO-1/2's reduce-scatter + all-gather of the parameters; FSDP's gathers
   per microbatch (forward, and again in backward when it reshards after
   forward) and its gradient reduce-scatter -- once a step under a pipeline
   schedule, which syncs only the last microbatch; HSDP's all-reduce across
   replicas.  Overlap hides the gradient reduction behind the last
   microbatch's backward and FSDP's gathers behind the neighbouring layers.
4. **The optimizer step**, memory-bound, over this GPU's shard.

Hidden communication is not free: the compute it hides behind is slowed by
``profile.overlap_slowdown`` x the hidden time (SM and HBM sharing), booked to
``compute/gemm`` -- except known (paced) compute, a sleep nothing slows.  Each prediction lists
the assumptions it made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mfuscope.analyzers.breakdown import tree_of
from mfuscope.analyzers.bubbles import theory
from mfuscope.flops import train_flops_per_token

from .cost import memory as memory_model
from .cost.comm import Links
from .cost.compute import StageCompute, optimizer_seconds, stage_compute
from .spec import Layout, ModelSpec, Training
from .system import Profile, System


@dataclass
class Prediction:
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float | None
    memory: memory_model.Memory
    leaves: dict[str, float]                       # leaf -> seconds per step on the busiest GPU
    assumptions: list[str] = field(default_factory=list)
    bubble_fraction: float = 0.0                   # of the pipeline's time, as the analyzers state it

    @property
    def tree(self) -> dict[str, Any]:
        """``{name, seconds, children}`` as the analyzers write it, from the leaves."""
        return tree_of((leaf, s) for leaf, s in self.leaves.items() if s > 0)

    def summary(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction,
                "memory_gib": self.memory.total_bytes / memory_model.GiB, "fits": self.memory.fits,
                "leaves": {k: v for k, v in self.leaves.items() if v > 0}, "assumptions": self.assumptions}


def spec_dict(model: ModelSpec, causal: bool) -> dict[str, Any]:
    """The model as ``mfuscope.flops`` reads it."""
    return {"dim": model.dim, "n_layers": model.n_layers, "n_heads": model.n_heads, "n_kv_heads": model.kv_heads,
            "ffn_dim": model.ffn_dim, "vocab_size": model.vocab_size, "n_experts": model.n_experts,
            "top_k": model.top_k, "mlp": model.mlp, "shared_ffn_dim": model.shared_ffn_dim, "causal_flops": causal}


class _Ledger:
    """Leaves in seconds, with exposure split over a dimension's ops in proportion to their time."""

    def __init__(self) -> None:
        self.leaves: dict[str, float] = {}
        self.hidden_s = 0.0

    def add(self, leaf: str, seconds: float) -> None:
        self.leaves[leaf] = self.leaves.get(leaf, 0.0) + seconds

    def expose(self, dim: str, ops: dict[str, float], window_s: float, times: float = 1.0) -> float:
        """``ops`` (op -> seconds) run hidden behind ``window_s`` of compute; book what sticks
        out, ``times`` over; return the exposed seconds of one occurrence."""
        total = sum(ops.values())
        exposed = max(0.0, total - window_s)
        self.hidden_s += (total - exposed) * times
        for op, seconds in ops.items():
            if total > 0:
                self.add(f"comm/{dim}/{op}", exposed * seconds / total * times)
        return exposed


def predict(model: ModelSpec, layout: Layout, training: Training, system: System,
            profile: Profile | None = None, known_phases: tuple[float, float, float] | None = None,
            stage_work: tuple[float, ...] | None = None,
            memory: memory_model.Memory | None = None) -> Prediction:
    """The predicted step of ``layout`` (see the module docstring).  Raises ``ValueError`` listing
    the layout's broken rules when it is not legal for ``model``.

    ``known_phases``: (F, B, W) seconds of one microbatch on one pipeline rank, when compute time
    is known rather than modelled (the reference trainer's paced mode); booked as
    ``compute/other``, as the analyzers book the paced sleeps.  ``stage_work``: each pipeline
    rank's compute relative to the busiest; by default its share of the layers.  ``memory``: the
    layout's memory estimate where the caller already made it (the planner)."""
    profile = profile or Profile()
    problems = layout.problems(model, training.seq_len) + training.layout_problems(model, layout)
    if problems:
        raise ValueError("; ".join(problems))
    links = Links(layout, system, profile)
    ledger = _Ledger()
    assumptions = [f"link tiers: {', '.join(f'{d}={t}' for d, t in links.tier_of.items() if links.size(d) > 1)}"
                   or "single GPU: no communication"]
    p, v, m = layout.pp, layout.vpp, layout.microbatches
    layers, rank_work = layout.stage_layers(model), None
    if layout.ep > 1:
        assumptions.append(f"expert load: the busiest expert-parallel rank gets {training.expert_load:.3g} x the mean "
                           "routed rows" + (" (balanced)" if training.expert_load == 1 else ""))
    if known_phases:
        f, b, w = known_phases
        stage = StageCompute(fwd={"other": f}, bwd={"other": b + w}, w=w)
        assumptions.append(f"compute known (paced): F={f:.4g} s, B={b:.4g} s, W={w:.4g} s per microbatch")
    else:
        stage, layers, rank_work = busiest_stage(model, layout, training, system, profile)

    # Host time per pass of each of the rank's chunks and of each of its layers; CUDA graphs launch a
    # block's kernels at once (all of it removed: an upper bound, since the embedding, head and loss
    # stay eager).
    per_layer = profile.layer_overhead_s + (profile.tp_overhead_s if layout.tp > 1 else 0.0)
    host = 0.0 if training.cuda_graphs else v * profile.microbatch_overhead_s + layers * per_layer
    if host:
        stage.fwd["other"] = stage.fwd.get("other", 0.0) + host
        stage.bwd["other"] = stage.bwd.get("other", 0.0) + host
    f_exposed, b_exposed = _layer_collectives(model, layout, training, links, stage, ledger, layers, m)
    fwd = stage.total("fwd") + f_exposed
    bwd = stage.total("bwd") + b_exposed
    for kind in stage.fwd:
        ledger.add(f"compute/{kind}", m * (stage.fwd[kind] + stage.bwd[kind]))

    # Pipeline: bubble per schedule, sends.
    pipeline_s = m * (fwd + bwd)
    if p > 1:
        rank_layers = layout.rank_layers(model)
        work = stage_work or rank_work or (tuple(n / max(rank_layers) for n in rank_layers) if layout.split
                                           else (1.0,) * p)
        if v == 1 and max(work) - min(work) > 1e-9:
            # Fill and drain through each other stage at its own pace; the host time per pass
            # does not shrink with a stage's layers.
            per_mb = fwd + bwd
            ledger.add("bubble", sum(r * (per_mb - 2 * host) + 2 * host for r in work) - per_mb)
            assumptions.append("uneven stages: " + ", ".join(f"{r:.2f}" for r in work) + " of the busiest's work")
        else:
            w = stage.w if layout.schedule in ("zero_bubble", "zbv") else 0.0
            frac = theory(p, m, v, layout.schedule, (fwd, bwd - w, w))
            ledger.add("bubble", frac / (1 - frac) * pipeline_s if frac < 1 else 0.0)
        tokens = layout.micro_batch * training.seq_len / layout.cp
        send = tokens * model.dim * training.activation_bytes / (
            layout.tp if layout.sequence_parallel or training.scatter_gather_sends else 1)
        t_send = links.seconds("pp", "send_recv", send, n=2)
        ledger.add("bubble", 2 * ((p - 1) if training.overlap_p2p else (m * v + p - 1)) * t_send)
        assumptions.append(f"pipeline: {layout.schedule}, p={p}, v={v}, m={m}")

    # Data parallelism and the optimizer.
    params = memory_model.params_per_gpu(model, layout)
    _data_parallel(layout, training, links, ledger, params, memory_model.expert_params_per_gpu(model, layout),
                   stage, m, _first_gathers(model, layout, layers), units=layers,
                   hook_calls=fsdp_hook_calls(model, layout, training, units=layers))
    _amax_reductions(layout, training, links, ledger, stage, m)
    _tensor_parallel_reductions(model, layout, training, links, ledger, layers, m)
    ledger.add("compute/optimizer", optimizer_seconds(memory_model.state_params_per_gpu(model, layout), system,
                                                      profile))
    if dtensor_params(layout):
        tensors = model.parameter_tensors(layout.stage_layers(model), first=layout.pp == 1, last=True)
        ledger.add("compute/optimizer", tensors * profile.dtensor_param_s)
    if known_phases is None:  # known (paced) compute sleeps: what runs beside it slows nothing
        ledger.add("compute/gemm", profile.overlap_slowdown * ledger.hidden_s)
    if training.checkpoint_s:
        ledger.add("checkpoint", training.checkpoint_s)

    step = sum(ledger.leaves.values())
    bubble = ledger.leaves.get("bubble", 0.0)
    global_tokens = layout.data_ranks * layout.micro_batch * m * training.seq_len
    tps = global_tokens / step / layout.gpus
    model_flops, _ = train_flops_per_token(spec_dict(model, training.causal), training.seq_len, layout.recompute)
    peak = system.accelerator.peak_flops("bf16")
    mem = memory or memory_model.estimate(model, layout, training.seq_len, dtype=training.dtype,
                                          device_bytes=system.device_bytes, flash_attention=training.flash_attention,
                                          compiled=training.compiled, expert_load=training.expert_load)
    assumptions += list(mem.assumptions)
    return Prediction(step_s=step, tokens_per_s_per_gpu=tps, mfu=model_flops * tps / peak if peak else None,
                      memory=mem, leaves=ledger.leaves, assumptions=assumptions,
                      bubble_fraction=bubble / (pipeline_s + bubble) if p > 1 else 0.0)


def compute_bound_s(model: ModelSpec, layout: Layout, training: Training, system: System,
                    profile: Profile | None = None) -> float:
    """A lower bound on :func:`predict`'s step: every microbatch's compute on the busiest pipeline
    rank and its expert all-to-alls (when nothing hides them), with no host time, no other
    communication and no bubble (each of which only adds to the step).  The planner ranks by it
    first and predicts only the layouts it cannot rule out."""
    profile = profile or Profile()
    stage, layers, _ = busiest_stage(model, layout, training, system, profile)
    per_microbatch = stage.total("fwd") + stage.total("bwd")
    if layout.ep > 1 and training.moe_overlap == "none":  # hidden all-to-alls bound nothing
        per_microbatch += 2 * layers * expert_exchange_s(model, layout, training, Links(layout, system, profile))
    return layout.microbatches * per_microbatch


#: The schedules whose fill and drain pass through each stage at its own pace (model step 2).
PACED_FILL = ("gpipe", "1f1b")


def busiest_stage(model: ModelSpec, layout: Layout, training: Training, system: System,
                  profile: Profile) -> tuple[StageCompute, int, tuple[float, ...] | None]:
    """One microbatch on the busiest pipeline rank, its layers, and under GPipe or 1F1B (one chunk
    a rank) each rank's compute relative to it, else None.

    The LM head is on the rank that holds the last stage, so an even cut of the layers still
    leaves that rank the slowest (a 2-stage CPU run of the reference trainer: 52 against 45 ms of
    compute a microbatch) and the others fill and drain at their own pace; where a split gives the
    head's rank fewer layers, the busiest may be another.  Other schedules are predicted as
    before: the rank with the most layers, with the head."""
    layers = layout.stage_layers(model)
    if layout.pp == 1 or layout.vpp > 1 or layout.schedule not in PACED_FILL:
        return stage_compute(model, layout, training, system, profile, layers=layers, with_head=True), layers, None
    per_rank = layout.rank_layers(model)
    made: dict[tuple[int, bool], StageCompute] = {}  # ranks alike computed once (the planner's thousands)
    for r, n in enumerate(per_rank):
        key = (n, r == layout.pp - 1)
        if key not in made:
            made[key] = stage_compute(model, layout, training, system, profile, layers=n, with_head=key[1])
    totals = [made[(n, r == layout.pp - 1)] for r, n in enumerate(per_rank)]
    seconds = [s.total("fwd") + s.total("bwd") for s in totals]
    busiest = max(range(layout.pp), key=seconds.__getitem__)
    return totals[busiest], per_rank[busiest], tuple(t / seconds[busiest] for t in seconds)


#: All-reduces over tp of a vocabulary-parallel cross-entropy, per microbatch: the logits' max,
#: the sum of their exponentials and the target's logit (Megatron-LM's _VocabParallelCrossEntropy;
#: PyTorch's loss_parallel the same three).
LOSS_PARALLEL_ALL_REDUCES = 3


def _tensor_parallel_reductions(model: ModelSpec, layout: Layout, training: Training, links: Links,
                                ledger: _Ledger, layers: float, m: int) -> None:
    """What tensor parallelism all-reduces besides its layers' collectives, each exposed and
    latency-bound: the vocabulary-parallel loss's three all-reduces of one fp32 value a token, each
    microbatch; and, under sequence parallelism, once a step, the norms' weight gradients, which
    each rank computed on its own sequence shard (Megatron-LM's all-reduce of its layer-norm
    gradients over tp; the reference trainer's ``replicate_partial_grads``), in one call."""
    if layout.tp == 1:
        return
    tokens = layout.micro_batch * training.seq_len / layout.cp
    ledger.add("comm/tp/all_reduce", m * LOSS_PARALLEL_ALL_REDUCES * links.seconds("tp", "all_reduce", tokens * 4))
    if layout.sequence_parallel:
        norms = 2 * layers + 1  # two a layer and the final norm (on the last stage: an upper bound elsewhere)
        grads = norms * model.dim * training.grad_reduce_bytes
        ledger.add("comm/tp/all_reduce", links.seconds("tp", "all_reduce", grads))


def dtensor_params(layout: Layout) -> bool:
    """The parameters the optimizer updates are sharded tensors (DTensors in PyTorch): tensor
    parallelism's, or FSDP's (a DDP or ZeRO replica holds plain ones).  ``Profile.dtensor_param_s``
    prices each; it is zero unless a measured run fitted it."""
    return layout.tp > 1 or layout.shard_ranks > 1


def _layer_collectives(model: ModelSpec, layout: Layout, training: Training, links: Links,
                       stage: StageCompute, ledger: _Ledger, layers: float, m: int) -> tuple[float, float]:
    """Exposed seconds of tp, cp and ep collectives per microbatch (forward, backward); books them."""
    tokens = layout.micro_batch * training.seq_len / layout.cp
    act = training.activation_bytes
    f_total = b_total = 0.0
    if layout.tp > 1:
        buf = tokens * model.dim * act
        if layout.sequence_parallel:
            # torchao's float8 tensor parallelism (tensor-wise scaling) casts a column-parallel
            # linear's input before the sequence-parallel all-gather, and the row-parallel one's
            # output gradient before backward's: those gathers move 1 byte an element; the
            # reduce-scatters stay 16-bit (torchtitan docs/float8.md: "float8 all-gather ... for
            # TP (by default for Float8Linear)").
            gathered = tokens * model.dim * (1 if _fp8_tensor_parallel(training) else act)
            f_ops = {"all_gather": 2 * links.seconds("tp", "all_gather", gathered),
                     "reduce_scatter": 2 * links.seconds("tp", "reduce_scatter", buf)}
        else:
            f_ops = {"all_reduce": 2 * links.seconds("tp", "all_reduce", buf)}
        b_ops = {op: s * (2 if layout.recompute == "full" else 1) for op, s in f_ops.items()}
        if training.async_tp and layout.sequence_parallel and stage.tp_linear_s:
            f, b = _async_tp_exposed(f_ops, stage.tp_linear_s, layout, ledger, layers * m)
            f_total += layers * f
            b_total += layers * b
        else:
            window = stage.layer_fwd_gemm_s if training.async_tp else 0.0
            f_total += layers * ledger.expose("tp", f_ops, window, layers * m)
            b_total += layers * ledger.expose("tp", b_ops, 2 * window, layers * m)
    if layout.cp > 1:
        (f_ops, f_window), (b_ops, b_window) = _context_parallel(model, layout, training, links, stage, tokens)
        f_total += layers * ledger.expose("cp", f_ops, f_window, layers * m)
        b_total += layers * ledger.expose("cp", b_ops, b_window, layers * m)
    if layout.ep > 1:
        exchange = expert_exchange_s(model, layout, training, links)
        f_ops = {"all_to_all": exchange + expert_counts_s(model, links)}
        f_window, b_window = _expert_overlap_windows(stage, training)
        f_total += layers * ledger.expose("ep", f_ops, f_window, layers * m)
        b_total += layers * ledger.expose("ep", {"all_to_all": exchange}, b_window, layers * m)
    return f_total, b_total


def _async_tp_exposed(f_ops: dict[str, float], linear_s: dict[str, float], layout: Layout, ledger: _Ledger,
                      times: float) -> tuple[float, float]:
    """Async tensor parallelism (PyTorch's micro-pipelined TP, torchtitan's async TP): each
    sequence-parallel collective is cut into tp chunks and runs beside the one linear it is fused
    with -- the gather before qkv and before the MLP's up projection, the reduce-scatter after the
    attention's output projection and after the MLP's down projection -- and only beside (tp - 1)/tp
    of it: the GEMM of the gather's last piece runs after every transfer, and the reduce-scatter's
    first piece is computed before there is anything to send.  Backward pairs each collective with
    the dgrad GEMM of the same linear (the same shape), once more under full recompute.  Returns
    one layer's exposed seconds, forward and backward."""
    share = (layout.tp - 1) / layout.tp
    pairs = (("all_gather", "qkv"), ("all_gather", "mlp_up"), ("reduce_scatter", "attn_out"),
             ("reduce_scatter", "mlp_down"))
    forward = sum(ledger.expose("tp", {op: f_ops[op] / 2}, share * linear_s[name], times) for op, name in pairs)
    passes = 2 if layout.recompute == "full" else 1
    backward = passes * sum(ledger.expose("tp", {op: f_ops[op] / 2}, share * linear_s[name], passes * times)
                            for op, name in pairs)
    return forward, backward


def _fp8_tensor_parallel(training: Training) -> bool:
    """Whether the tensor-parallel linears gather float8 (torchao's tensor-wise float8 linears)."""
    return training.dtype == "fp8" and training.fp8_recipe == "tensorwise" and training.fp8_scope != "experts"


def _context_parallel(model: ModelSpec, layout: Layout, training: Training, links: Links, stage: StageCompute,
                      tokens: float) -> tuple[tuple[dict[str, float], float], tuple[dict[str, float], float]]:
    """One layer's context-parallel collectives per microbatch, ((forward ops, the compute they
    may hide behind), (backward ...)), by ``training.cp_comm``; a tp rank moves its own heads.

    - ``all_gather``: K and V gathered (one collective each) forward, hidden behind the attention
      core; their gradients back by ``cp_grad_collective``; gathered again backward unless the
      implementation keeps them (``cp_regather``) -- always under recomputation.
    - ``p2p`` (a ring): cp - 1 steps a pass send the local K and V to the next rank while a step's
      attention (1/cp of it) runs; backward sends K, V and their gradients' partial sums (twice
      the bytes) behind the backward's steps.  Full recomputation runs the forward's ring again.
    - ``a2a`` (Ulysses): before the core, an all-to-all of Q, K and V from the sequence split to a
      head split (K and V heads repeated up to cp when fewer), after it one of the output; in
      backward the same two for the gradients.  Nothing overlaps them.

    Without ``training.cp_overlap`` (K and V gathered before any attention runs, and waited for)
    the ring and the gathers hide behind nothing either."""
    act, cp, t = training.activation_bytes, layout.cp, layout.tp
    kv_heads, hd = model.kv_heads / t, model.head_dim
    attn_f = stage.attention_fwd_s if training.cp_overlap else 0.0
    recomputed = layout.recompute != "none"
    if training.cp_comm == "p2p":
        step = links.seconds("cp", "send_recv", 2 * tokens * kv_heads * hd * act, n=2)
        f_ops, f_window = {"send_recv": (cp - 1) * step}, (cp - 1) / cp * attn_f
        b_ops, b_window = {"send_recv": 2 * (cp - 1) * step}, (cp - 1) / cp * 2.5 * attn_f
        if layout.recompute == "full":
            b_ops, b_window = {"send_recv": 3 * (cp - 1) * step}, b_window + f_window
        return (f_ops, f_window), (b_ops, b_window)
    if training.cp_comm == "a2a":
        q_heads, kv_moved = model.n_heads / t, max(kv_heads, cp)
        qkv = links.seconds("cp", "all_to_all", tokens * (q_heads + 2 * kv_moved) * hd * act)
        out = links.seconds("cp", "all_to_all", tokens * q_heads * hd * act)
        f_ops = {"all_to_all": qkv + out}
        b_ops = {"all_to_all": (2 if layout.recompute == "full" else 1) * (qkv + out)}
        return (f_ops, 0.0), (b_ops, 0.0)
    gathered = tokens * kv_heads * hd * act * cp  # K (or V) of the whole sequence
    gather = links.seconds("cp", "all_gather", gathered, calls=2)
    b_ops = {training.cp_grad_collective: links.seconds("cp", training.cp_grad_collective, gathered, calls=2)}
    if training.cp_regather or recomputed:
        b_ops["all_gather"] = gather
    return ({"all_gather": gather}, attn_f), (b_ops, 2.5 * attn_f)


def expert_exchange_s(model: ModelSpec, layout: Layout, training: Training, links: Links) -> float:
    """One layer's expert dispatch and combine for one microbatch and pass: each tp rank sends its
    own 1/tp of the tokens (experts are not split over tp) to their top-k experts -- a copy each
    over NCCL's all-to-all, a copy a node with the two-level dispatch (``moe_dispatch``); the
    busiest rank receives ``expert_load`` times the mean, and the exchange ends with it."""
    tokens = layout.micro_batch * training.seq_len / layout.cp / layout.tp
    token_bytes = tokens * model.dim * training.activation_bytes
    one = links.expert_dispatch_seconds(token_bytes, model.top_k, model.n_experts, model.router_groups,
                                        model.router_group_topk, training.moe_dispatch == "deepep")
    return 2 * training.expert_load * one


def expert_counts_s(model: ModelSpec, links: Links) -> float:
    """The exchange of token counts before each forward dispatch: every rank learns how many rows
    each expert-parallel peer sends it -- the all-to-all's split sizes -- from one int64 count per
    expert, and copies them to the host: an all-to-all in torchtitan's token dispatch and the
    reference trainer's ``expert_parallel.dispatch``, a gather in Megatron-Core's all-to-all
    dispatcher, modelled as the all-to-all.  A few hundred bytes: latency-bound, once a layer and
    microbatch; backward reuses the split sizes."""
    return links.seconds("ep", "all_to_all", 8 * model.n_experts)


def _amax_reductions(layout: Layout, training: Training, links: Links, ledger: _Ledger, stage: StageCompute,
                     m: int) -> None:
    """Delayed scaling's amax all-reduces: Transformer Engine reduces the float8 tensors' amaxes
    over the data, context and tensor-parallel ranks where each microbatch's forward autocast
    ends (an input's and a weight's a GEMM) and where its backward reaches the first float8
    module (each output gradient's); a few KB, so their latency, on the critical path."""
    group = layout.data_ranks * layout.cp * layout.tp
    if training.dtype != "fp8" or training.fp8_recipe != "delayed" or group <= 1 or not stage.fp8_gemms:
        return
    amax = (links.seconds("dp", "all_reduce", 4 * 2 * stage.fp8_gemms, n=group)
            + links.seconds("dp", "all_reduce", 4 * stage.fp8_gemms, n=group))
    ledger.add("comm/dp/all_reduce", m * amax)


def _expert_overlap_windows(stage: StageCompute, training: Training) -> tuple[float, float]:
    """The compute one layer's expert all-to-alls may hide behind, (forward, backward): nothing;
    the layer's shared expert (twice its forward in backward); or, with another microbatch in
    flight, that microbatch's attention and GEMMs of the layer (2x and 2.5x in backward)."""
    if training.moe_overlap == "shared_experts":
        return stage.shared_expert_fwd_s, 2 * stage.shared_expert_fwd_s
    if training.moe_overlap == "microbatches":
        return (stage.layer_fwd_gemm_s + stage.attention_fwd_s,
                2 * stage.layer_fwd_gemm_s + 2.5 * stage.attention_fwd_s)
    return 0.0, 0.0


#: A CUDA kernel launch's host cost, about 5 us.
KERNEL_LAUNCH_S = 5e-6
#: DDP's default gradient bucket (``bucket_cap_mb=25``).
DDP_BUCKET_BYTES = 25 * 2**20
#: Under the default cap DDP closes its first bucket -- the last layers' gradients, ready first --
#: at 1 MiB (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), so that reducing starts early.
DDP_FIRST_BUCKET_BYTES = 2**20


def ddp_last_bucket_bytes(grads: float, bucket: float | None, first_bucket: bool = True) -> float:
    """The bytes of DDP's last bucket, the first layers' gradients, which nothing after the backward
    hides: a full bucket, or what the earlier buckets leave.  With PyTorch DDP's default cap
    (``bucket`` None, ``first_bucket``) the first bucket holds 1 MiB, so a model of a few MiB of
    gradients is reduced in two buckets, not one (a measured 7.9 MB: 1.18 MB, then 6.69 MB after
    the backward); Megatron-LM's distributed optimizer has no such first bucket."""
    if bucket or not first_bucket:
        return min(bucket or DDP_BUCKET_BYTES, grads)
    rest = grads - DDP_FIRST_BUCKET_BYTES
    return grads if rest <= 0 else min(DDP_BUCKET_BYTES, rest)


def _reshards(layout: Layout, training: Training) -> bool:
    """FSDP frees a unit's gathered parameters after its forward (and gathers them again for its
    backward): by default without a pipeline, not under one."""
    return layout.pp == 1 if training.reshard_after_forward is None else training.reshard_after_forward


def fsdp_passes(layout: Layout, training: Training) -> tuple[int, int]:
    """(gathers, reduce-scatters) each FSDP unit issues in a step.  Without a pipeline FSDP gathers
    every microbatch's forward and, resharded after it, again for its backward, and
    reduce-scatters every microbatch's gradients.  Under a pipeline schedule
    (torch.distributed.pipelining, as torchtitan and the reference trainer run it) only the last
    microbatch's backward syncs and reshards: one gather, one reduce-scatter a step."""
    m, reshard = layout.microbatches, _reshards(layout, training)
    gathers = (m * (2 if reshard else 1)) if layout.pp == 1 else (2 * m if reshard else 1)
    return gathers, (m if layout.pp == 1 else 1)


def fsdp_hook_calls(model: ModelSpec, layout: Layout, training: Training, units: float | None = None) -> float:
    """FSDP's hooks run on the host once per unit and collective (each the host time of
    ``Profile.fsdp_hook_layer_passes`` layer passes), on the busiest rank in one step: every gather
    and reduce-scatter of the stage's blocks (``units``, by default the layout's even cut) and of
    the root, and of each block's experts where they are a unit of their own (sharded over the
    ranks that hold them).  Zero without sharded parameters."""
    if layout.shard_ranks <= 1:
        return 0.0
    units = layout.stage_layers(model) if units is None else units
    sharded_experts = bool(model.n_experts) and layout.ep > 1 and layout.expert_shard_ranks > 1
    gathers, scatters = fsdp_passes(layout, training)
    return (units * (2 if sharded_experts else 1) + 1) * (gathers + scatters)


def _first_gathers(model: ModelSpec, layout: Layout, layers: float) -> tuple[float, float]:
    """The shares of a stage's FSDP gather that no compute can hide, (forward, backward): a pass's
    first unit has nothing before it to overlap -- in forward the root (embedding, and the head,
    gathered together) and the first block, whose gather starts when the root's does, since the
    embedding is only a lookup; in backward the first block (the root stays gathered)."""
    layer = sum(model.layer_params())
    root = model.embedding_params() * (1.0 if layout.pp == 1 else 0.5)
    stage = layers * layer + root
    return min((layer + root) / stage, 1.0), min(layer / stage, 1.0)


def _data_parallel(layout: Layout, training: Training, links: Links, ledger: _Ledger, params: float,
                   experts: float, stage: StageCompute, m: int, first: tuple[float, float], units: float,
                   hook_calls: float) -> None:
    """Book the exposed data-parallel communication of one step; ``params``: the GPU's
    parameters, ``experts`` of them its routed experts', which only the ranks holding the same
    experts gather and reduce (:attr:`Layout.expert_shard_ranks`, :attr:`Layout.expert_grad_ranks`);
    ``first``: the shares of FSDP's gather each pass exposes whatever the prefetch
    (:func:`_first_gathers`); ``units``: the blocks on the stage, each FSDP's own gather and
    reduce-scatter (the root one more); ``hook_calls``: :func:`fsdp_hook_calls`."""
    if layout.ep == 1:  # every rank holds every expert: they are the block's, in its unit
        experts = 0.0
    dense = params - experts
    weight_bytes = training.activation_bytes
    if training.fp8_gather:
        # float8 all-gather: the blocks' linear weights travel as 1 byte; the root (embedding and
        # head, first[0] - first[1] of the stage) stays 16-bit.
        root = (first[0] - first[1]) * params / dense if dense else 0.0
        weight_bytes = (1 - root) + root * training.activation_bytes
    grads, weights = dense * training.grad_reduce_bytes, dense * weight_bytes
    expert_grads, expert_weights = experts * training.grad_reduce_bytes, experts * (
        1 if training.fp8_gather else training.activation_bytes)
    bwd_window = stage.total("bwd") if training.overlap_grad_reduce else 0.0
    if layout.shard_ranks > 1:
        calls = units * training.shard_calls_per_layer + 1
        # A block's experts are a unit of their own, over their own group (none moved where it is
        # the rank alone).
        gather = (links.seconds("dp_shard", "all_gather", weights, calls=calls)
                  + links.seconds("dp_expert_shard", "all_gather", expert_weights, calls=units))
        scatter = (links.seconds("dp_shard", "reduce_scatter", grads, calls=calls)
                   + links.seconds("dp_expert_shard", "reduce_scatter", expert_grads, calls=units))
        if layout.expert_shard_ranks > 1:
            weights, grads = weights + expert_weights, grads + expert_grads  # what FSDP copies
        prefetch = training.overlap_param_gather
        reshard = _reshards(layout, training)
        # FSDP2 copies each block's shard into the gather's buffer and the gathered block out of it
        # into its parameters, and each block's gradients into the reduce-scatter's buffer: a read
        # and a write of the bytes moved.
        gathers, scatters = fsdp_passes(layout, training)
        copies = 2 * (gathers * weights * (1 + 1 / layout.shard_ranks) + scatters * grads)
        ledger.add("compute/norm_elementwise", copies / (links.system.hbm_Bps * links.profile.memory))
        if hook_s := links.profile.fsdp_hook_layer_passes * links.profile.layer_overhead_s:
            ledger.add("compute/other", hook_calls * hook_s)
        # Prefetch hides a pass's gathers behind its compute, all but the first unit's.
        fwd_w = min(stage.total("fwd"), gather * (1 - first[0])) if prefetch else 0.0
        bwd_w = stage.total("bwd") if prefetch else 0.0
        # Backward gathers every block again; a last block kept gathered is one fewer, and the first
        # gather backward then prefetches behind that block.
        keep_last = training.keep_last_gathered
        bwd_gather = gather * (1 - first[1]) if keep_last else gather
        # A recomputed forward that gathers again (per-module hooks, as DeepSpeed's) doubles
        # backward's gathers.
        regather = training.recompute_regathers and layout.recompute == "full"
        bwd_gather *= 2 if regather else 1
        if training.list_collectives:
            # A list collective's per-rank copies are launched by the one host thread that also
            # launches the compute: host time, never hidden.  The forward gather and the
            # reduce-scatter, and backward's gathers, per microbatch.
            passes = 2 + ((2 if regather else 1) if reshard else 0)
            ledger.add("host_bound", passes * m * calls * layout.shard_ranks * KERNEL_LAUNCH_S)
        bwd_gather_w = min(bwd_w, bwd_gather if keep_last else bwd_gather * (1 - first[1])) if reshard else bwd_w
        hide_scatter = prefetch if training.overlap_reduce_scatter is None else training.overlap_reduce_scatter
        # Each unit's gradients are reduce-scattered once its backward is done, behind the units
        # still to compute; the last unit's (the first block's, with the root's) has nothing after
        # it: at most the others' share of the reduce-scatter hides.
        scatter_w = min(stage.total("bwd"), scatter * (1 - 1 / calls)) if hide_scatter else 0.0
        if layout.pp == 1:
            ledger.expose("dp", {"all_gather": gather}, fwd_w, m)
            if hide_scatter == prefetch:
                ledger.expose("dp", {"all_gather": bwd_gather if reshard else 0.0, "reduce_scatter": scatter},
                              min(bwd_w, scatter_w + (bwd_gather_w if reshard else 0.0)), m)
            else:
                ledger.expose("dp", {"all_gather": bwd_gather if reshard else 0.0}, bwd_gather_w, m)
                ledger.expose("dp", {"reduce_scatter": scatter}, scatter_w, m)
        else:
            ledger.expose("dp", {"all_gather": gather}, fwd_w, m if reshard else 1)
            if reshard:
                ledger.expose("dp", {"all_gather": bwd_gather}, bwd_gather_w, m)
            ledger.expose("dp", {"reduce_scatter": scatter}, scatter_w, 1)
        if layout.dp_replicate > 1:
            reduce = links.seconds("dp_replicate", "all_reduce", dense * training.grad_reduce_bytes / layout.shard_ranks
                                   + expert_grads / layout.expert_shard_ranks)
            ledger.expose("dp", {"all_reduce": reduce}, bwd_window)
    elif layout.grad_ranks > 1:
        # Buckets are reduced as their gradients are ready: all but the last can hide behind the
        # rest of the backward; the last (the first layers' gradients) is reduced after it.
        total = grads + expert_grads
        last = ddp_last_bucket_bytes(total, training.grad_bucket_bytes, layout.zero == 0) / total if total else 1.0
        op = "all_reduce" if layout.zero == 0 else "reduce_scatter"
        if training.ddp_bucket_copies and layout.zero == 0:
            # into the buckets and back: each a read and a write of every gradient
            ledger.add("compute/norm_elementwise", 4 * total / (links.system.hbm_Bps * links.profile.memory))
        t = links.seconds("dp", op, grads) + links.seconds("dp_expert", op, expert_grads)
        ledger.expose("dp", {op: t}, min(bwd_window, t * (1 - last)))
        if layout.zero >= 1:
            gather = links.seconds("dp", "all_gather", weights) + links.seconds("dp_expert", "all_gather",
                                                                              expert_weights)
            ledger.expose("dp", {"all_gather": gather}, 0.0)
