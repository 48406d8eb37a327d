"""``mfuscope.kernels.apply`` on a Hugging Face Llama: norms, SwiGLU MLPs, RoPE and the LM head
with its loss swapped by class, the model training exactly as before (loss and every gradient,
float32 tolerances), and undone, on each device that runs the kernels (CPU through the interpreter,
CUDA where a GPU is visible).  transformers is optional: the test skips without it."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is optional (pip install transformers); "
                                                          "the Hugging Face swaps are tested where it is installed")

from mfuscope.kernels import apply  # noqa: E402


def _model(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).float()


def _tolerance(model, tokens: int) -> float:
    """Float32 computations that differ only in the order of their sums: each sum of n terms is
    within n u / (1 - n u) of the exact one (Higham 2002, sec. 4.2; u = 2**-24), n the widest
    reduction (the step's tokens, the FFN width or the vocabulary), compounding through each
    layer's and the head's forward and backward (depth 2 (layers + 1))."""
    c = model.config
    n = max(tokens, c.intermediate_size, c.vocab_size, c.hidden_size)
    u = 2.0 ** -24
    return 2 * (c.num_hidden_layers + 1) * n * u / (1 - n * u)


def _step(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_hugging_face_llama_trains_the_same_with_the_fused_kernels(device):
    model = _model().to(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 24), generator=g).to(device)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that is not trained on
    ref, ref_grads = _step(model, ids, labels)
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits

    applied = apply(model)
    kinds = {type(m).__name__ for m in applied.modules}
    assert {"LlamaRMSNorm", "LlamaMLP", "module", "LlamaForCausalLM"} <= kinds, kinds
    out, grads = _step(model, ids, labels)
    assert out.logits is None  # the fused head never makes them
    tol = _tolerance(model, ids.numel())
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=tol)
    for name, r in ref_grads.items():
        err = float((grads[name] - r).norm() / r.norm())
        assert err < tol, (name, err, tol)
    with torch.no_grad():  # without labels, the logits, through the fused norms, MLPs and RoPE
        logits = model(input_ids=ids).logits
    err = float((logits - ref_logits).norm() / ref_logits.norm())
    assert err < tol, (err, tol)

    applied.undo()
    import transformers.models.llama.modeling_llama as hf_llama
    assert "apply_rotary_pos_emb" in hf_llama.__dict__
    assert hf_llama.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"
    assert not any("forward" in m.__dict__ for m in model.modules())
    again, _ = _step(model, ids, labels)
    assert again.logits is not None and again.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)


def test_packed_positions_fall_back_to_hugging_faces_rope():
    """Per-row positions (packed sequences) give per-row angles: the original function takes them.
    Decided from the angles' shape before any kernel, and no fused op runs: on the CPU on any machine."""
    model = _model()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    pos = torch.stack([torch.arange(16), torch.cat([torch.arange(8), torch.arange(8)])])
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
        applied = apply(model, ops=("rope",))
        got = model(input_ids=ids, position_ids=pos).logits
        applied.undo()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
