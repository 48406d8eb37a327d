"""Llama-style decoder with an optional MoE feed-forward.

Embedding, RMSNorm, RoPE, grouped-query attention through
``scaled_dot_product_attention`` (causal), SwiGLU MLP or top-k routed experts,
untied LM head.  The structure is what the parallel plans expect:
``tok_embeddings``, ``layers`` (a ModuleDict, so pipeline stages can drop the
layers they do not own), ``norm``, ``output``; a stage without an embedding
takes hidden states as input.  Each parameter's initial value is drawn from a
generator seeded with the seed and the parameter's name, so a model built on
the meta device and cut to a pipeline stage initializes just its own
parameters, to the values the full model has.

The experts run without a host synchronization per expert: rows are sorted by
expert once and each expert multiplies its contiguous slice, so the host needs
one copy of all the experts' row counts per layer (under expert parallelism
the dispatch's copy, which gives the all-to-all its split sizes).  The
load-balancing loss needs token counts summed over the ranks that route
different tokens; each MoE layer records its counts and the model reduces
those of all its layers in one all-reduce after its last layer.

Hooks the parallel dimensions use, and nothing else does:
- ``Attention.attention_fn`` -- context parallel swaps in its all-gather
  attention; it receives K and V with the model's KV heads (before any GQA
  repeat), so a gather moves only those;
- ``Transformer.positions`` -- context parallel sets the global positions of
  the tokens this rank holds.  A plain attribute, not a buffer: DDP broadcasts
  buffers from rank 0, which would give every context rank rank 0's positions;
- ``MoE.dispatch`` -- expert parallel swaps in all-to-all dispatch/combine;
- ``MoE.permute`` and ``MoE.unpermute`` -- the routed rows out in expert order and back, weighted
  (:func:`permute`, :func:`unpermute`); ``mfuscope.kernels`` swaps in its fused ones;
- ``MoE.experts`` -- the expert weights in a module of their own, which expert parallel cuts to
  this rank's slice and FSDP shards over the ranks holding the same slice;
- ``Transformer.balance_group`` -- the group whose token counts the
  load-balancing loss uses, so the loss equals the single-process one;
- ``Transformer.aux_scale`` -- tensor parallelism runs the MoE on each rank's
  own sequence shard and sums the MoE gradients over tp, so each rank's share
  of the balance loss is 1/tp.
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_table(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Each position's rotation, ``cos + i sin`` of position x theta^(-2j/head_dim) for each pair j:
    (seq, head_dim / 2), complex64.  Made once a forward and handed to every layer.  Made inside
    each layer, a block compiled by torch.compile fuses the angles' trigonometry into its RoPE
    kernel and computes it again for every batch row and head (on an H200: 38.5 of the 567 ms of
    a gpu_dense_1b step).  Complex, as torchtitan's ``freqs_cis``: FSDP's mixed precision casts
    a block's floating-point inputs to bf16, never a complex one."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.complex(angles.cos(), angles.sin())


def rope(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (batch, seq, heads, head_dim), pairs interleaved, by ``rotary``
    (:func:`rotary_table`)."""
    table = torch.view_as_real(rotary)
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (batch, heads, seq, head_dim), k/v (batch, kv_heads, seq, head_dim) -> like q; causal.

    ``enable_gqa`` lets the kernel share each KV head over its query heads instead of
    materializing the repeat (and keeps the flash / ``is_causal`` kernels eligible on GPU)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


#: PyTorch's SDPA backends by the names the run manifest records (``kernels.attention``).
_SDPA_NAMES = {"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
               "MATH": "math"}


def attention_backend(heads: int, kv_heads: int, head_dim: int, seq_len: int, dtype: torch.dtype,
                      device: torch.device) -> str | None:
    """The kernel :func:`causal_attention` runs at one rank's shape on ``device``, as PyTorch's
    dispatcher picks it (``cudnn``, ``flash``, ``efficient`` or ``math``), or None where this torch
    cannot say.  The cost model's attention rate follows it: recent PyTorch prefers cuDNN's
    attention on Hopper and datacenter Blackwell (``check_prefer_cudnn_attention`` in
    ``sdp_utils.cpp``), an FA3-class kernel near twice FlashAttention-2's rate -- on an H200 the
    trainer's attention took 104 ms a step where FA2's rate predicted 238."""
    try:
        from torch.nn.attention import SDPBackend

        q = torch.empty(1, heads, seq_len, head_dim, dtype=dtype, device=device)
        kv = torch.empty(1, kv_heads, seq_len, head_dim, dtype=dtype, device=device)
        choice = int(torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=True))
        del q, kv
    except (AttributeError, ImportError, RuntimeError, TypeError):
        return None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's buffers are not kept reserved
    name = next((n for n, v in SDPBackend.__members__.items() if int(v) == choice), None)
    return _SDPA_NAMES.get(name or "", None)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.attention_fn = causal_attention
        self.rope_fn = rope  # mfuscope.kernels.apply swaps in the fused kernel

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = self.rope_fn(q, rotary), self.rope_fn(k, rotary)
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _AuxLoss(torch.autograd.Function):
    """Adds d(aux)/d(params) to the backward pass without changing the forward value.

    The load-balancing loss is produced deep inside the model (in any pipeline
    stage); attaching its gradient to the activations lets every schedule
    train with it while the reported loss stays the cross-entropy.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        # A copy, not ``x`` itself (which autograd would return as a view of it): this can be a
        # pipeline stage's output, which the zero-bubble schedules detach in place.
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def expert_counts(expert: torch.Tensor, n: int) -> torch.Tensor:
    """Rows per expert, on the device.  Not ``torch.bincount``: on CUDA it reads the indices' max
    back to the host first, a synchronization."""
    return torch.zeros(n, dtype=torch.long, device=expert.device).index_add_(0, expert, torch.ones_like(expert))


def unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``rows`` (in the order ``x[order]`` took) back in the order of ``x``."""
    return torch.empty_like(rows).index_copy_(0, order, rows)  # in place: out of place clones the empty tensor first


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked (expert, in, out).

    A module of their own, not parameters of :class:`MoE`: FSDP shards every direct parameter of
    the module it wraps over one mesh, and under expert parallelism the experts are sharded over
    other ranks (those holding the same experts) than the rest of the block.
    """

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.offset = 0  # first expert held here (expert parallel keeps a slice)

    def forward(self, tokens: torch.Tensor, local_expert: torch.Tensor,
                counts: list[int] | None = None) -> torch.Tensor:
        """Run tokens through the experts held here; ``local_expert`` indexes them.

        One sort groups the rows by expert and each expert runs on its contiguous slice; the slice
        sizes are the only values the host needs: ``counts`` (rows per local expert) when the
        caller has them on the host already, else one copy of all of them.  An expert without rows
        multiplies an empty slice, so every expert's weights get a gradient (zero) on every rank,
        and the output depends on ``tokens`` even when no row arrives, so the backward all-to-all
        runs on every expert-parallel rank.
        """
        if counts is None:
            counts = expert_counts(local_expert, self.w1.shape[0]).tolist()
        order = torch.argsort(local_expert, stable=True)
        slices = tokens.index_select(0, order).split(counts)
        out = torch.cat([(F.silu(t @ w1) * (t @ w3)) @ w2 for t, w1, w3, w2
                         in zip(slices, self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0))])
        return unsort(out, order)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts.

    During a forward of the model that holds it, each layer appends its routing (rows per expert,
    mean router probability per expert) to ``routing``, a list the model hands out for that
    forward and takes the balance loss of.  Outside it (a recomputation in backward, a layer run
    alone) ``routing`` is None and nothing is kept.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, h = cfg.n_experts, cfg.dim, cfg.ffn_dim
        self.n_experts, self.top_k = e, cfg.top_k
        self.router = nn.Linear(d, e, bias=False)
        self.experts = Experts(e, d, h)
        self.dispatch = local_dispatch  # expert parallel swaps in all-to-all dispatch
        self.permute, self.unpermute = permute, unpermute  # mfuscope.kernels swaps in fused ones
        self.routing: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weight, expert = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(-1, keepdim=True)).type_as(x)
        # Each (token, choice) becomes one row routed to one expert; the rows go out grouped by
        # expert (row positions[t, j] is choice j of token t) and come back in that order.
        order, positions = route(expert)
        rows = self.permute(tokens, positions)
        routed = self.dispatch(self, rows, expert.reshape(-1)[order])
        out = self.unpermute(routed, positions, weight)
        if self.routing is not None:
            self.routing.append((expert_counts(expert.reshape(-1), self.n_experts), probs.mean(0)))
        return out.view(b, s, d)


def route(expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, positions) for ``expert`` (tokens, k): ``order`` sorts the flattened (token, choice)
    rows by expert, stably (an expert's rows keep their token order); ``positions`` (tokens, k) is
    where each row lands, its inverse."""
    order = torch.argsort(expert.reshape(-1), stable=True)
    slots = torch.arange(order.numel(), device=expert.device)
    return order, torch.empty_like(order).scatter_(0, order, slots).view(expert.shape)


def permute(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each token copied to its k rows, in expert order: ``rows[positions[t, j]] = tokens[t]``."""
    rows = tokens.repeat_interleave(positions.shape[1], dim=0)
    return torch.empty_like(rows).index_copy_(0, positions.reshape(-1), rows)


def unpermute(routed: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each token the sum of its k expert outputs times its router weights."""
    t, k = positions.shape
    return (routed.index_select(0, positions.reshape(-1)).view(t, k, -1) * weight.unsqueeze(-1)).sum(1)


def local_dispatch(moe: MoE, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """No expert parallelism: every expert is here.  ``rows`` come grouped by ``expert``."""
    return moe.experts(rows, expert)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.n_experts else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotary)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, seq_len: int, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # (hidden, head weight, targets) -> loss without the logits; mfuscope.kernels.apply sets it
        self.head_loss = None
        # Not a buffer (see the module docstring); on the CPU even when the model is built on meta.
        self.positions = torch.arange(seq_len, device="cpu")
        self.balance_group = None  # process group whose tokens the balance loss counts
        self.aux_scale = 1.0       # this rank's share of the balance loss (1/tp under tensor parallel)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every parameter from its own generator, seeded with ``seed`` and the parameter's name.

        A pipeline stage holds some of the layers under the full model's names, so it draws the
        values the full model has without drawing the rest.  A parameter that holds part of the
        full one -- an expert-parallel slice of the experts, a tensor-parallel shard (a DTensor)
        -- gets that part of the full parameter's values, drawn one parameter at a time: a rank
        never holds more than one full parameter beyond its own part.  Drawn on the CPU: every
        device starts from the same values.  Parameters on the meta device have no values to set
        (materialize them with ``to_empty`` and call this again).
        """
        for module_name, module in self.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if p.is_meta:
                    continue
                name = f"{module_name}.{pname}" if module_name else pname
                full = tuple(p.shape)
                if isinstance(module, Experts):  # this rank's experts: rows offset.. of all of them
                    full = (self.cfg.n_experts, *full[1:])
                value = self._initial_value(name, full)
                if isinstance(module, Experts):
                    value = value[module.offset:module.offset + p.shape[0]]
                local = p
                if hasattr(p, "to_local"):  # a DTensor: this rank's shard of the value
                    local = p.to_local()
                    value = value[_shard_slices(p)]
                with torch.no_grad():
                    local.copy_(value)

    def _initial_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        value = torch.empty(shape, dtype=torch.float32, device="cpu")
        if name.endswith("norm.weight"):
            return value.fill_(1.0)
        std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight", "w2")) else 0.02
        return value.normal_(0.0, std, generator=torch.Generator().manual_seed(_name_seed(self.seed, name)))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (or, for a stage without the head, hidden states); with ``targets``, the mean
        cross-entropy -- through ``head_loss`` when one is set and the head's weight is a plain
        tensor here (FSDP gathers it for the forward; a tensor-parallel head stays sharded and
        takes the eager loss)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if self.positions.device != h.device:  # once: Module.to() moves buffers, not this
            self.positions = self.positions.to(h.device)
        # Wrapped blocks (checkpointing, torch.compile, FSDP) still hold their MoE as a submodule.
        moes = [m for m in self.modules() if isinstance(m, MoE)]
        routing: list = []
        for moe in moes:
            moe.routing = routing
        rotary = rotary_table(self.positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers.values():
            h = layer(h, rotary)
        for moe in moes:  # a recomputation in backward records nothing
            moe.routing = None
        if routing:
            h = _AuxLoss.apply(h, self._balance_loss(routing))
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if targets is not None and self.head_loss is not None and type(self.output.weight) in (
                torch.Tensor, nn.Parameter):
            return self.head_loss(h, self.output.weight, targets)
        logits = self.output(h)
        return logits if targets is None else cross_entropy(logits, targets)

    def _balance_loss(self, routing: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Switch-style: per layer E * sum_e f_e * P_e, f from token counts over ``balance_group``
        (constant), P local.  One all-reduce for every layer held here, not one per layer."""
        counts = torch.stack([c for c, _ in routing]).float()
        if self.balance_group is not None:
            import torch.distributed as dist
            dist.all_reduce(counts, group=self.balance_group)
        f = counts / counts.sum(-1, keepdim=True)
        mean_probs = torch.stack([p for _, p in routing])
        return self.cfg.aux_loss_coef * self.aux_scale * self.cfg.n_experts * (f * mean_probs).sum()


def _shard_slices(p) -> tuple[slice, ...]:
    """Where a DTensor's local shard sits in the full tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _name_seed(seed: int, name: str) -> int:
    """A 64-bit seed from the run's seed and a parameter name (not ``hash()``: it differs per process)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
