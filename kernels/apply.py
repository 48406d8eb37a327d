"""Swap a model's norms, SwiGLU feed-forwards, RoPE, LM head and MoE routing for the fused kernels, in place, undoably.

Modules are recognized by what they are, not imported by class, so this works
on the reference trainer's model and on Hugging Face Llama-family models
alike without either being a dependency:

=============  ================================================  ======================================
op             module                                            becomes
=============  ================================================  ======================================
rms_norm       a class named ``*RMSNorm`` with ``weight`` and    ``rms_norm(x, weight, eps)``
               ``eps`` (reference trainer) or
               ``variance_epsilon`` (Hugging Face)
swiglu         ``w1``/``w2``/``w3`` (reference trainer: w2(silu  ``w2(swiglu(w1 x, w3 x))``
               (w1 x) * w3 x)) or ``gate_proj``/``up_proj``/
               ``down_proj`` with a SiLU ``act_fn`` (Hugging Face)
rope           an attention with ``rope_fn`` (the reference      ``apply_rope``'s kernel, interleaved
               trainer's: ``rope_fn(x, rotary)``)                pairs as the trainer's RoPE
               an attention with ``q_proj`` whose module has     ``apply_rope``'s kernel, rotate-half
               ``apply_rotary_pos_emb`` (Hugging Face Llama,     (that module's function is swapped:
               Mistral, Qwen2/3, ...)                            every model of the family uses it)
linear_ce      a model with ``head_loss`` and ``output`` (the    ``fused_linear_cross_entropy`` when
               reference trainer's, called with targets)          the model is given targets
               a model with a bias-free ``lm_head`` and a        the same when called with ``labels``
               ``loss_function`` (Hugging Face ``*ForCausalLM``)  (its output's ``logits`` is then None)
moe_permute    a module with ``permute`` and ``unpermute``        ``moe_permute`` / ``moe_unpermute``
               and ``n_experts`` (the reference trainer's MoE;   (its dispatch, local or all-to-all,
               Hugging Face's MoE blocks loop over experts       is kept)
               with masks instead, and are left alone)
=============  ================================================  ======================================

Each swapped module gets an instance ``forward`` (or ``rope_fn``);
:meth:`Applied.undo` puts back what was there, so the class's own forward is
back.  Under tensor parallelism a norm's
input and weight are DTensors (sequence parallel): the kernel runs on the
local shard and the replicated weight's gradient is marked partial, summed
over the tensor-parallel ranks as DTensor would.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from torch import nn

from .linear_cross_entropy import fused_linear_cross_entropy
from .moe_routing import moe_permute, moe_unpermute
from .rms_norm import rms_norm
from .swiglu import swiglu

OPS = ("rms_norm", "swiglu", "rope", "linear_ce", "moe_permute")
_MISSING = object()


@dataclass
class Applied:
    """What :func:`apply` swapped; ``undo()`` puts the modules' own attributes back."""

    ops: tuple[str, ...]
    swaps: list[tuple[nn.Module, str, object]] = field(default_factory=list)  # (module, attribute, before)

    @property
    def modules(self) -> list[nn.Module]:
        return [m for m, _, _ in self.swaps]

    def swap(self, m, name: str, value) -> None:
        self.swaps.append((m, name, m.__dict__.get(name, _MISSING)))
        m.__dict__[name] = value

    def undo(self) -> None:
        for m, name, before in reversed(self.swaps):
            if before is _MISSING:
                m.__dict__.pop(name, None)
            else:
                m.__dict__[name] = before
        self.swaps.clear()


def apply(model: nn.Module, ops=("rms_norm", "swiglu", "rope", "linear_ce")) -> Applied:
    """Swap ``model``'s modules for the fused ``ops``; returns what was swapped (``.undo()``)."""
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"kernels.apply: unknown ops {sorted(unknown)}; known: {', '.join(OPS)}")
    applied = Applied(tuple(op for op in OPS if op in ops))
    for m in model.modules():
        if "rms_norm" in applied.ops and _is_rms_norm(m):
            applied.swap(m, "forward", _fused_norm(m))
        elif "swiglu" in applied.ops and _swiglu_parts(m):
            applied.swap(m, "forward", _fused_mlp(m, *_swiglu_parts(m)))
        elif "rope" in applied.ops and callable(m.__dict__.get("rope_fn")):
            applied.swap(m, "rope_fn", _fused_rope)
        elif "rope" in applied.ops and isinstance(getattr(m, "q_proj", None), nn.Module):
            module = sys.modules.get(type(m).__module__)
            if module is not None and callable(getattr(module, "apply_rotary_pos_emb", None)) \
                    and module not in applied.modules:
                applied.swap(module, "apply_rotary_pos_emb", _fused_hf_rope(module.apply_rotary_pos_emb))
        if "moe_permute" in applied.ops and callable(m.__dict__.get("permute")) \
                and callable(m.__dict__.get("unpermute")) and hasattr(m, "n_experts"):
            applied.swap(m, "permute", moe_permute)
            applied.swap(m, "unpermute", moe_unpermute)
        if "linear_ce" in applied.ops and "head_loss" in m.__dict__ and getattr(m, "output", None) is not None:
            applied.swap(m, "head_loss", fused_linear_cross_entropy)
        elif "linear_ce" in applied.ops and _is_hf_causal_lm(m):
            applied.swap(m, "forward", _fused_hf_head(m, m.forward))
    return applied


def _fused_rope(x, rotary):
    """The reference trainer's ``rope(x, rotary)`` for x (batch, seq, heads, head_dim) and its
    complex (seq, head_dim/2) rotations: the kernel reads x transposed in place and writes (batch,
    heads, seq, head_dim)."""
    import torch

    table = torch.view_as_real(rotary)
    cos, sin = table[..., 0].contiguous(), table[..., 1].contiguous()
    return torch.ops.mfuscope.rope(x.transpose(1, 2), cos, sin, True, 1.0).transpose(1, 2)


def _fused_hf_rope(original):
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: q, k (batch, heads,
    seq, head_dim), cos/sin (1, seq, head_dim) of repeated halves.  Angles that differ per batch
    row (packed sequences) or another layout go to the original."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if kwargs or unsqueeze_dim != 1 or cos.dim() != 3 or cos.shape[0] != 1:
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, **kwargs)
        from .rope import apply_rope
        return apply_rope(q, k, cos[0], sin[0])
    return apply_rotary_pos_emb


def _is_hf_causal_lm(m: nn.Module) -> bool:
    head = getattr(m, "lm_head", None)
    return (isinstance(head, nn.Linear) and head.bias is None and hasattr(type(m), "loss_function")
            and getattr(getattr(m, "config", None), "vocab_size", None) == head.out_features)


def _fused_hf_head(model: nn.Module, original):
    """``*ForCausalLM.forward`` with ``labels``: its own forward runs with the head deferred (the
    hidden states pass through ``lm_head``) and a loss that is the fused linear cross-entropy
    over them, shifted as Hugging Face's causal-LM loss shifts the labels; the logits are never
    made.  Without labels (generation, evaluation of logits) it is the original forward."""
    import torch
    import torch.nn.functional as F

    head = model.lm_head

    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
        hidden = logits  # the deferred head passed the hidden states through
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        flat, target = hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device)
        if num_items_in_batch is None:
            return fused_linear_cross_entropy(flat, head.weight, target, ignore_index, "mean")
        total = fused_linear_cross_entropy(flat, head.weight, target, ignore_index, "sum")
        return total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch)
                        else num_items_in_batch)

    def forward(*args, **kwargs):
        if kwargs.get("labels") is None:
            return original(*args, **kwargs)
        before = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name in ((head, "forward"),
                                                                                  (model, "_loss_function"))]
        head.__dict__["forward"] = lambda hidden: hidden
        model.__dict__["_loss_function"] = loss
        try:
            out = original(*args, **kwargs)
        finally:
            for obj, name, value in before:
                if value is _MISSING:
                    obj.__dict__.pop(name, None)
                else:
                    obj.__dict__[name] = value
        out.logits = None
        return out
    return forward


def _is_rms_norm(m: nn.Module) -> bool:
    return (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)
            and (hasattr(m, "eps") or hasattr(m, "variance_epsilon")))


def _swiglu_parts(m: nn.Module) -> tuple[str, str, str] | None:
    """(gate, up, down) attribute names of a SwiGLU feed-forward, or None."""
    if type(m).__name__ == "FeedForward" and all(isinstance(getattr(m, a, None), nn.Module)
                                                for a in ("w1", "w2", "w3")):
        return "w1", "w3", "w2"
    act = getattr(m, "act_fn", None)
    if all(isinstance(getattr(m, a, None), nn.Module) for a in ("gate_proj", "up_proj", "down_proj")) and (
            isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")):
        return "gate_proj", "up_proj", "down_proj"
    return None


def _fused_norm(m: nn.Module):
    eps = float(getattr(m, "eps", getattr(m, "variance_epsilon", 1e-6)))

    def forward(x):
        from torch.distributed.tensor import DTensor, Partial

        w = m.weight
        if isinstance(x, DTensor):  # sequence parallel: the local shard, a replicated weight
            local_w = w.to_local(grad_placements=[Partial()] * w.device_mesh.ndim) if isinstance(w, DTensor) else w
            y = rms_norm(x.to_local(), local_w, eps)
            return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False)
        return rms_norm(x, w, eps)
    return forward


def _fused_mlp(m: nn.Module, gate: str, up: str, down: str):
    g, u, d = getattr(m, gate), getattr(m, up), getattr(m, down)

    def forward(x):
        return d(swiglu(g(x), u(x)))
    return forward
