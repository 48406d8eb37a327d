"""``mfuscope.kernels.apply``: the reference trainer's and Hugging Face-style modules swapped for
the fused kernels in place (same outputs and gradients), and put back by ``undo``.  On each device
that runs the kernels: CPU through the interpreter, CUDA where a GPU is visible."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
pytest.importorskip("triton", reason="the kernels need triton (in the [torch] extra); not installed")

from torch import nn  # noqa: E402

from mfuscope import kernels  # noqa: E402
from mfuscope.tests.kernel_checks import assert_close, tolerance  # noqa: E402


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_trainers_model_runs_the_kernels_and_trains_alike(device):
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.pipeline_parallel import build_stage

    cfg = load_config("tiny_dense")
    model = build_stage(cfg.model, cfg.seq_len, cfg.seed, 0, 1, device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.seq_len), generator=g).to(device)
    eager_out, eager_grads = _grads(model, tokens)
    applied = kernels.apply(model)
    assert applied.ops == ("rms_norm", "swiglu", "rope", "linear_ce")
    kinds = {type(m).__name__ for m in applied.modules}
    assert kinds == {"RMSNorm", "FeedForward", "Attention", "Transformer"}
    assert len(applied.modules) == 4 * cfg.model.n_layers + 2
    fused_out, fused_grads = _grads(model, tokens)
    assert_close(fused_out, eager_out, tolerance(torch.float32, cfg.model.dim * cfg.model.n_layers), "logits")
    # A weight's gradient sums over the batch's tokens, through every layer's FFN width: float32 over that many
    reduced = tokens.numel() * cfg.model.ffn_dim * cfg.model.n_layers
    for name, g in eager_grads.items():
        assert_close(fused_grads[name], g, tolerance(torch.float32, reduced), name)
    # With targets, the model's loss through the fused head: the logits never exist.
    targets = tokens.roll(-1, dims=1)
    model.zero_grad(set_to_none=True)
    fused_loss = model(tokens, targets)
    fused_loss.backward()
    head_grad = model.output.weight.grad.clone()
    applied.undo()
    assert model.head_loss is None
    model.zero_grad(set_to_none=True)
    eager_loss = model(tokens, targets)
    eager_loss.backward()
    assert_close(fused_loss, eager_loss.detach(), tolerance(torch.float32, cfg.model.vocab_size), "loss")
    assert_close(head_grad, model.output.weight.grad, tolerance(torch.float32, reduced), "dhead")
    assert not any("forward" in m.__dict__ for m in model.modules())
    from mfuscope.reference_trainer.model import rope
    assert all(m.rope_fn is rope for m in model.modules() if hasattr(m, "rope_fn"))
    assert torch.equal(_grads(model, tokens)[0], eager_out)


def test_the_trainers_moe_routes_through_the_permute_kernels_and_trains_alike(device):
    from mfuscope.kernels.apply import OPS
    from mfuscope.reference_trainer import model as trainer_model
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.pipeline_parallel import build_stage

    cfg = load_config("tiny_moe")
    model = build_stage(cfg.model, cfg.seq_len, cfg.seed, 0, 1, device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.seq_len), generator=g).to(device)
    eager_out, eager_grads = _grads(model, tokens)
    applied = kernels.apply(model, ops=("moe_permute",))
    moes = [m for m in model.modules() if isinstance(m, trainer_model.MoE)]
    assert len(moes) == cfg.model.n_layers and set(applied.ops) == {"moe_permute"}
    assert all(m.permute is kernels.moe_permute and m.unpermute is kernels.moe_unpermute for m in moes)
    fused_out, fused_grads = _grads(model, tokens)
    # The kernels sum a token's k weighted expert outputs in float32, eager in the rows' dtype (here
    # float32 too): the sums reassociate over k terms per layer.
    assert_close(fused_out, eager_out, tolerance(torch.float32, cfg.model.dim * cfg.model.n_layers), "logits")
    reduced = tokens.numel() * cfg.model.ffn_dim * cfg.model.n_layers
    for name, g in eager_grads.items():
        assert_close(fused_grads[name], g, tolerance(torch.float32, reduced), name)
    applied.undo()
    assert all(m.permute is trainer_model.permute for m in moes)
    assert OPS[-1] == "moe_permute"  # the trainer's --kernels fused applies every op


class LlamaRMSNorm(nn.Module):  # the shape of Hugging Face's, without transformers installed
    def __init__(self, d):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(1 + 0.1 * torch.randn(d)), 1e-5

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj, self.act_fn = nn.Linear(f, d, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_hugging_face_style_modules_are_swapped_by_what_they_are(device):
    torch.manual_seed(0)
    model = nn.Sequential(LlamaRMSNorm(48), LlamaMLP(48, 96), LlamaRMSNorm(48)).to(device)
    x = torch.randn(3, 5, 48).to(device)
    eager_out, eager_grads = _grads(model, x)
    applied = kernels.apply(model, ops=("rms_norm", "swiglu"))
    assert len(applied.modules) == 3
    fused_out, fused_grads = _grads(model, x)
    assert_close(fused_out, eager_out, tolerance(torch.float32, 96), "out")
    for name, g in eager_grads.items():
        assert_close(fused_grads[name], g, tolerance(torch.float32, 15 * 96), name)


def test_unknown_ops_are_refused():
    with pytest.raises(ValueError, match="unknown ops"):  # (HF models have no head_loss: linear_ce skips them)
        kernels.apply(nn.Linear(2, 2), ops=("rms_norm", "flash"))


def test_a_swapped_block_compiles_as_one_graph(device):
    """torch.compile(fullgraph=True) around a swapped transformer block: the custom ops trace, no
    graph break, and the compiled block computes what the eager one does."""
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.pipeline_parallel import build_stage

    cfg = load_config("tiny_dense")
    model = build_stage(cfg.model, cfg.seq_len, cfg.seed, 0, 1, device)
    kernels.apply(model)
    block = model.layers["0"]
    x = torch.randn(2, cfg.seq_len, cfg.model.dim).to(device).requires_grad_()
    from mfuscope.reference_trainer.model import rotary_table

    rotary = rotary_table(torch.arange(cfg.seq_len, device=device), cfg.model.head_dim, cfg.model.rope_theta)
    eager = block(x, rotary)
    eager.square().sum().backward()
    dx = x.grad.clone()
    x.grad = None
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, rotary)
    out.square().sum().backward()
    assert_close(out, eager.detach(), tolerance(torch.float32, cfg.model.ffn_dim), "block")
    assert_close(x.grad, dx, tolerance(torch.float32, cfg.model.ffn_dim * cfg.seq_len), "dx")
