"""Model FLOPs of a Llama-style decoder (dense or MoE), per token of training.

Counted as 2 FLOPs per multiply-accumulate, forward only, then x3 for
forward + backward (MFU) or x4 with full activation recomputation (HFU).
Per layer and token:

- attention projections: q and o are d x (h*hd); k and v are d x (kv*hd)  (GQA);
- attention scores and weighted values: 2 * s * (h*hd) each, halved when causal
  (a token attends to half the sequence on average);
- feed-forward: SwiGLU has three d x ffn matrices (a GPT-style ``mlp: "gelu"``
  spec has two); MoE adds the router (d x E) and runs only the top-k experts a
  token is routed to, and a shared expert (``shared_ffn_dim``) where the model has one;
plus the LM head, d x vocab, once per token.  Embedding lookups are free.

Megatron's convention (Narayanan et al. 2021; Korthikanti et al. 2022) counts
attention over the full sequence (``causal=False``, or ``"causal_flops": false``
in the spec): with a GELU MLP of 4h it
gives their 72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)) per iteration exactly.
Selective recomputation re-runs the attention core (scores and weighted
values), full recomputation the whole forward.
"""
from __future__ import annotations

from typing import Any


def forward_flops_per_token(spec: dict[str, Any], seq_len: int, causal: bool | None = None) -> float:
    """Forward FLOPs per token (see the module docstring for what is counted)."""
    causal = spec.get("causal_flops", True) if causal is None else causal
    d, layers = spec["dim"], spec["n_layers"]
    heads, kv = spec["n_heads"], spec.get("n_kv_heads") or spec["n_heads"]
    hd = d // heads
    ffn, vocab = spec["ffn_dim"], spec["vocab_size"]
    experts, top_k = spec.get("n_experts") or 0, spec.get("top_k") or 1
    proj = 2 * (d * heads * hd * 2 + d * kv * hd * 2)
    scores = _attention_core(spec, seq_len, causal)
    matrices = 2 if spec.get("mlp") == "gelu" else 3
    mlp = 2 * matrices * d * ffn
    if experts:
        mlp = 2 * d * experts + top_k * mlp + 2 * matrices * d * (spec.get("shared_ffn_dim") or 0)
    return layers * (proj + scores + mlp) + 2 * d * vocab


def _attention_core(spec: dict[str, Any], seq_len: int, causal: bool) -> float:
    heads, hd = spec["n_heads"], spec["dim"] // spec["n_heads"]
    return 2 * 2 * seq_len * heads * hd * (0.5 if causal else 1.0)


def train_flops_per_token(spec: dict[str, Any], seq_len: int, recompute: str = "none",
                          causal: bool | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token: x3 for forward + backward; hardware FLOPs add
    what recomputation runs again (full: one more forward; selective: the attention core, as
    Korthikanti et al. count it, once more in forward and backward)."""
    causal = spec.get("causal_flops", True) if causal is None else causal
    fwd = forward_flops_per_token(spec, seq_len, causal)
    model = 3 * fwd
    if recompute == "full":
        return model, 4 * fwd
    if recompute == "selective":
        return model, model + 3 * spec["n_layers"] * _attention_core(spec, seq_len, causal)
    return model, model
