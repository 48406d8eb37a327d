"""Model FLOPs of a Llama-style decoder (dense or MoE), per token of training.

Counted as 2 FLOPs per multiply-accumulate, forward only, then x3 for
forward + backward (MFU) or x4 with full activation recomputation (HFU).
Per layer and token:

- attention projections: q and o are d x (h*hd); k and v are d x (kv*hd)  (GQA);
- attention scores and weighted values: 2 * s * (h*hd) each, halved when causal
  (a token attends to half the sequence on average);
- feed-forward: SwiGLU has three d x ffn matrices; MoE adds the router (d x E)
  and runs only the top-k experts a token is routed to;
plus the LM head, d x vocab, once per token.  Embedding lookups are free.
"""
from __future__ import annotations

from typing import Any


def forward_flops_per_token(spec: dict[str, Any], seq_len: int, causal: bool = True) -> float:
    d, layers = spec["dim"], spec["n_layers"]
    heads, kv = spec["n_heads"], spec.get("n_kv_heads") or spec["n_heads"]
    hd = d // heads
    ffn, vocab = spec["ffn_dim"], spec["vocab_size"]
    experts, top_k = spec.get("n_experts") or 0, spec.get("top_k") or 1
    proj = 2 * (d * heads * hd * 2 + d * kv * hd * 2)
    scores = 2 * 2 * seq_len * heads * hd * (0.5 if causal else 1.0)
    mlp = 2 * 3 * d * ffn
    if experts:
        mlp = 2 * d * experts + top_k * mlp
    return layers * (proj + scores + mlp) + 2 * d * vocab


def train_flops_per_token(spec: dict[str, Any], seq_len: int, recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token: x3 for fwd+bwd; full recompute adds one more forward."""
    fwd = forward_flops_per_token(spec, seq_len)
    return 3 * fwd, (4 if recompute == "full" else 3) * fwd
