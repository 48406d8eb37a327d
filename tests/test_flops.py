"""FLOPs per token against a parameter count of the real model (an independent route)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

from mfuscope.flops import forward_flops_per_token, train_flops_per_token  # noqa: E402
from mfuscope.reference_trainer.config import load_config  # noqa: E402
from mfuscope.reference_trainer.model import Transformer  # noqa: E402


def _matmul_params(cfg, active_experts=None):
    with torch.device("meta"):
        model = Transformer(cfg, 8)
    total = 0
    for name, p in model.named_parameters():
        if "tok_embeddings" in name or name.endswith("norm.weight"):
            continue  # lookups and elementwise scales are not matmuls
        if name.split(".")[-1] in ("w1", "w2", "w3") and p.dim() == 3:  # MoE experts: only top-k run
            total += p.numel() // cfg.n_experts * active_experts
        else:
            total += p.numel()
    return total


@pytest.mark.parametrize("config", ["tiny_dense", "gpu_dense_1b", "tiny_moe", "gpu_moe"])
def test_flops_are_two_per_weight_plus_causal_attention(config):
    cfg = load_config(config)
    m, s = cfg.model, cfg.seq_len
    attention = m.n_layers * 2 * 2 * s * m.dim * 0.5  # QK^T and AV, causal
    expected = 2 * _matmul_params(m, active_experts=m.top_k) + attention
    assert forward_flops_per_token(m.spec(), s) == pytest.approx(expected, rel=1e-12)
    mfu, hfu = train_flops_per_token(m.spec(), s, recompute="full")
    assert mfu == pytest.approx(3 * expected) and hfu == pytest.approx(4 * expected)
