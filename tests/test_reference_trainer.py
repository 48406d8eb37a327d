"""The reference trainer: every accepted layout computes the gradients one process computes.

Reference: the same config, seed and data in a single process (for MoE with
pipeline microbatches, single-process gradient accumulation over the same
microbatches, since routing statistics are per forward pass).  Every run uses
plain SGD, so an update is ``lr x gradient`` and nothing amplifies a rounding
difference the way Adam's division by sqrt(v) does for near-zero gradients.
For each of 3 steps (2 with the fused kernels), the loss and every parameter's full gradient must match
the reference within :func:`fp32_tolerance`, norm-wise per tensor.  Ranks are
real gloo processes, forked.

The comparison must also fail: deliberately wrong layouts (a missing gradient
reduction, a dropped sequence chunk, expert gradients scaled or averaged over
the wrong ranks, pipeline gradients unscaled, norm gradients doubled, RoPE
positions broadcast from rank 0) are run through the same check and must miss
by far more than the tolerance.
"""
from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

from mfuscope.layout import SCHEDULES  # noqa: E402
from mfuscope.reference_trainer import context_parallel, data_parallel, expert_parallel, tensor_parallel  # noqa: E402
from mfuscope.reference_trainer import model as model_mod  # noqa: E402
from mfuscope.reference_trainer.config import load_config  # noqa: E402
from mfuscope.reference_trainer.launch import fork_ranks  # noqa: E402
from mfuscope.reference_trainer.train import run_rank  # noqa: E402
from mfuscope.trainer_options import TrainerOptions  # noqa: E402

from .helpers import micro_config  # noqa: E402

STEPS = 3
SGD = {"optimizer": "sgd", "lr": 1.0}


def fp32_tolerance(config: str, **overrides) -> float:
    """Norm-wise relative tolerance between two float32 computations of one gradient that differ
    only in the order of their sums.

    A sum of n float32 terms taken in any order is within gamma_n = n*u/(1 - n*u) of the exact sum,
    relative to the sum of the terms' magnitudes (Higham, Accuracy and Stability of Numerical
    Algorithms, 2002, sec. 4.2), with u = 2**-24.  A weight gradient sums over every token of the
    step (n = global_batch * seq_len), and the error compounds through each block's forward and
    backward reductions and the head's (depth = 2 * (n_layers + 1)).  Sharding changes exactly
    these orders (another CPU's SIMD kernels, too), nothing else; any real bug below moves a
    gradient by percents.
    """
    cfg = load_config(config, **overrides)
    u = 2.0 ** -24
    n = cfg.global_batch * cfg.seq_len
    depth = 2 * (cfg.model.n_layers + 1)
    return depth * n * u / (1 - n * u)


def _run(tmp_path, world, name, steps=STEPS, **kw):
    out = tmp_path / name
    kw["overrides"] = {**SGD, **kw.get("overrides", {})}
    fork_ranks(run_rank, world, TrainerOptions(steps=steps, result=str(out), **kw))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    grads: list[dict[str, torch.Tensor]] = [{} for _ in range(steps)]
    for res in ranks:
        for step, g in enumerate(res["grads"]):
            grads[step].update(g)
    return ranks[0]["losses"], [_merge_experts(g) for g in grads]


_reference_cache: dict = {}


def _reference(tmp_path_factory, config, grad_accum=1, **shape):
    """One process training ``config`` (``shape``: its batch and sequence overrides, as the run
    compared with it has them)."""
    key = (config, grad_accum, tuple(sorted(shape.items())))
    if key not in _reference_cache:
        _reference_cache[key] = _run(tmp_path_factory.mktemp("ref"), 1, "single", config=config,
                                     overrides={"grad_accum": grad_accum, **shape})
    return _reference_cache[key]


def _shape(opts: dict) -> dict:
    """The batch and sequence overrides of a run's options: its reference takes the same."""
    return {k: v for k, v in opts.get("overrides", {}).items() if k in ("global_batch", "seq_len")}


def _merge_experts(grads):
    """Expert slices ``name@first`` from several ranks -> the full expert tensor ``name``."""
    merged, parts = {}, {}
    for key, value in grads.items():
        if "@" in key:
            name, first = key.split("@")
            parts.setdefault(name, {})[int(first)] = value
        else:
            merged[key] = value
    for name, slices in parts.items():
        merged[name] = torch.cat([slices[k] for k in sorted(slices)])
    return merged


def _worst_miss(ref, got, tol) -> tuple[float, str]:
    """The largest (error / allowed error) over every step's loss and every gradient, and where."""
    ref_losses, ref_grads = ref
    losses, grads = got
    worst, where = 0.0, ""
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        ratio = abs(a - b) / (tol * abs(a))
        if ratio > worst:
            worst, where = ratio, f"step {step} loss {b} vs {a}"
    for step, (r, g) in enumerate(zip(ref_grads, grads)):
        assert set(g) == set(r), (step, sorted(set(g) ^ set(r)))
        for name, value in r.items():
            ratio = float((g[name] - value).norm() / (tol * value.norm() + 1e-30))
            if ratio > worst:
                worst, where = ratio, f"step {step} gradient of {name}"
    return worst, where


def _assert_equivalent(ref, got, config, **shape):
    tol = fp32_tolerance(config, **shape)
    worst, where = _worst_miss(ref, got, tol)
    assert worst <= 1.0, f"{where}: {worst:.2f}x the float32 tolerance {tol:.2e}"


def _moe_reference(tmp_path_factory, layout: str, **shape):
    pipelined = "pp=" in layout
    return _reference(tmp_path_factory, "tiny_moe", grad_accum=load_config("tiny_moe").microbatches if pipelined else 1,
                      **shape)


#: The runs with the fused kernels compare two steps, not STEPS, of 4 sequences of 16 tokens, not 8 of
#: 32, against a reference of the same shape: Triton's interpreter runs each kernel's programs one
#: after another (a token's MoE unpermute took 2 ms), and the second step already trains on updated
#: weights.
FUSED = {"steps": 2, "overrides": {"global_batch": 4, "seq_len": 16}}
DENSE = [
    # (id, world, layout, options)
    ("ddp", 2, "dp_shard=2", {"dp_mode": "ddp"}),
    ("ddp_accumulate", 2, "dp_shard=2", {"dp_mode": "ddp", "overrides": {"grad_accum": 2}}),
    ("ddp_cp2", 4, "dp_shard=2,cp=2", {"dp_mode": "ddp"}),
    ("ddp_small_buckets_view", 2, "dp_shard=2", {"dp_mode": "ddp", "ddp_bucket_mb": 0.05, "grad_as_bucket_view": True}),
    ("fsdp2", 2, "dp_shard=2", {}),
    ("fsdp2_no_reshard", 2, "dp_shard=2", {"reshard_after_forward": False}),
    ("fsdp2_prefetch", 2, "dp_shard=2", {"prefetch": True}),
    ("fsdp2_keep_last_gathered", 2, "dp_shard=2", {"keep_last_gathered": True}),
    # mfuscope's fused RMSNorm and SwiGLU (Triton through the interpreter on CPU): one rank, and tp=2,
    # where the norms run sequence parallel on DTensor shards.  Two steps (FUSED): the kernels' forward
    # and backward, before and after an update; the interpreter makes each step seconds.
    ("fused_kernels_1rank", 1, "", {"kernels": "fused", **FUSED}),
    ("fused_kernels_tp2", 2, "tp=2", {"kernels": "fused", **FUSED}),
    ("fused_kernels_fsdp2", 2, "dp_shard=2", {"kernels": "fused", **FUSED}),  # the fused head on FSDP's gathered weight
    ("hsdp_prefetch_accumulate", 4, "dp_replicate=2,dp_shard=2", {"prefetch": True, "overrides": {"grad_accum": 2}}),
    ("fsdp2_recompute_full", 2, "dp_shard=2", {"overrides": {"recompute": "full"}}),
    ("fsdp2_recompute_selective", 2, "dp_shard=2", {"overrides": {"recompute": "selective"}}),
    ("hsdp", 4, "dp_replicate=2,dp_shard=2", {}),
    ("tp2_sp", 2, "tp=2", {}),
    ("tp2_no_sp", 2, "tp=2", {"overrides": {"sequence_parallel": False}}),
    ("cp2", 2, "cp=2", {}),
    ("cp2_tp2", 4, "cp=2,tp=2", {}),
    ("3d_8ranks", 8, "dp_shard=2,tp=2,pp=2", {}),
    # An uneven cut (optimize's rebalance_stages): stage 0 holds 3 layers and the embedding.
    ("pp2_split31_fsdp", 4, "pp=2,dp_shard=2", {"stage_layers": (3, 1)}),
    ("pp2_split13_gpipe", 2, "pp=2", {"schedule": "gpipe", "stage_layers": (1, 3)}),
]
# Every schedule with every dimension it can be combined with (DDP is refused with pp).
PIPELINED = [(f"{sched}_{dim}", world, f"pp=2,{extra}", {"schedule": sched})
             for sched in SCHEDULES
             for dim, world, extra in (("fsdp", 4, "dp_shard=2"), ("hsdp", 8, "dp_replicate=2,dp_shard=2"),
                                       ("cp", 4, "cp=2"), ("tp", 4, "tp=2"))]
# ep2_fused_kernels: every data rank in the one expert group (experts outside FSDP), with mfuscope's
# MoE permute and unpermute kernels (and the others) around the all-to-all -- the other
# expert-parallel layouts run the trainer's own; ep2_edp2 and hsdp_ep2: two ranks hold each half of
# the experts and FSDP shards it over them (over the replicas too in HSDP).
MOE = [("ep2_fused_kernels", 2, "dp_shard=2,ep=2", {"kernels": "fused", **FUSED}),
       ("ep2_edp2", 4, "dp_shard=4,ep=2", {}),
       ("hsdp_ep2", 4, "dp_replicate=2,dp_shard=2,ep=2", {}), ("tp2", 2, "tp=2", {})] + [
    (f"{sched}_ep2", 4, "pp=2,dp_shard=2,ep=2", {"schedule": sched}) for sched in SCHEDULES]


@pytest.mark.parametrize("name, world, layout, opts", DENSE + PIPELINED, ids=[x[0] for x in DENSE + PIPELINED])
def test_dense_layout_matches_single_process(tmp_path, tmp_path_factory, name, world, layout, opts):
    ref = _reference(tmp_path_factory, "tiny_dense", **_shape(opts))
    _assert_equivalent(ref, _run(tmp_path, world, name, config="tiny_dense", layout=layout, **opts), "tiny_dense",
                       **_shape(opts))


@pytest.mark.parametrize("name, world, layout, opts", MOE, ids=[x[0] for x in MOE])
def test_moe_layout_matches_single_process(tmp_path, tmp_path_factory, name, world, layout, opts):
    ref = _moe_reference(tmp_path_factory, layout, **_shape(opts))
    _assert_equivalent(ref, _run(tmp_path, world, name, config="tiny_moe", layout=layout, **opts), "tiny_moe",
                       **_shape(opts))


def test_four_chunks_per_rank_train_like_one_process(tmp_path, tmp_path_factory):
    """``--virtual-stages 4``: an interleaved 1F1B pipeline of 2 ranks x 4 chunks (8 stages of one
    layer) over an 8-layer model, against one process accumulating the same 4 microbatches."""
    config = tmp_path / "eight.toml"
    config.write_text(micro_config(n_layers=8, global_batch=8, grad_accum=1, microbatches=4))
    ref = _reference(tmp_path_factory, str(config), grad_accum=4)
    got = _run(tmp_path, 2, "v4", config=str(config), layout="pp=2", schedule="interleaved_1f1b", virtual_stages=4)
    _assert_equivalent(ref, got, str(config))


def test_16_rank_5d_moe(tmp_path, tmp_path_factory):
    """pp=2 x dp_shard=2 x cp=2 x tp=2 with MoE over ep=2: the gradients of one process
    accumulating the same 2 microbatches."""
    layout = "pp=2,dp_shard=2,cp=2,tp=2,ep=2"
    ref = _moe_reference(tmp_path_factory, layout)
    _assert_equivalent(ref, _run(tmp_path, 16, "5d", config="tiny_moe", layout=layout), "tiny_moe")


# ----------------------------------------------------------------------------- the check must fail

def _doubled_norm_grads(monkeypatch):
    def forward(self, x):  # the same value, twice the weight gradient
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return normed * (2 * self.weight - self.weight.detach())
    monkeypatch.setattr(model_mod.RMSNorm, "forward", forward)


def _expert_grads_quartered(monkeypatch):
    original = expert_parallel.scale_local_expert_grads
    monkeypatch.setattr(expert_parallel, "scale_local_expert_grads", lambda params, dp: original(params, 4 * dp))


def _sharded_expert_grads_averaged_over_their_group(monkeypatch):
    # FSDP's default: the mean over the ranks holding the experts, not the sum over them / all data ranks.
    from torch.distributed.fsdp import FSDPModule
    monkeypatch.setattr(FSDPModule, "set_gradient_divide_factor", lambda self, factor: None)


def _pipeline_grads_unscaled(monkeypatch):
    from torch.distributed import pipelining as pl
    monkeypatch.setattr(pl.Schedule1F1B, "__init__",
                        _with_kwargs(pl.Schedule1F1B.__init__, scale_grads=False))


def _with_kwargs(fn, **extra):
    def wrapped(*args, **kwargs):
        return fn(*args, **{**kwargs, **extra})
    return wrapped


def _no_ddp_reduction(monkeypatch):
    monkeypatch.setattr(data_parallel, "apply_ddp", lambda model, dims, **kw: model)


def _dropped_cp_chunk(monkeypatch):
    original = context_parallel._global_order

    def drop(gathered, cp):  # the other rank's K/V never arrives: zeros in its place
        return original(torch.cat([gathered[:1], torch.zeros_like(gathered[1:])]), cp)
    monkeypatch.setattr(context_parallel, "_global_order", drop)


def _positions_broadcast(monkeypatch):
    original = data_parallel.apply_ddp

    def ddp(model, dims, **kw):  # positions as a buffer: DDP copies rank 0's to every rank
        model.register_buffer("positions", model.__dict__.pop("positions"), persistent=False)
        return original(model, dims, **kw)
    monkeypatch.setattr(data_parallel, "apply_ddp", ddp)


def _no_tp_moe_reduction(monkeypatch):
    monkeypatch.setattr(tensor_parallel, "reduce_moe_grads", lambda params, group: None)


MUTANTS = [
    # (id, break it, config, world, layout, options)
    ("norm_grads_doubled", _doubled_norm_grads, "tiny_dense", 2, "tp=2", {}),
    ("ddp_without_reduction", _no_ddp_reduction, "tiny_dense", 2, "dp_shard=2", {"dp_mode": "ddp"}),
    ("cp_chunk_dropped", _dropped_cp_chunk, "tiny_dense", 2, "cp=2", {}),
    ("ddp_cp_positions_broadcast", _positions_broadcast, "tiny_dense", 4, "dp_shard=2,cp=2", {"dp_mode": "ddp"}),
    ("pipeline_grads_unscaled", _pipeline_grads_unscaled, "tiny_dense", 2, "pp=2", {"schedule": "1f1b"}),
    ("expert_grads_quartered", _expert_grads_quartered, "tiny_moe", 2, "dp_shard=2,ep=2", {}),
    ("sharded_expert_grads_averaged_over_their_group", _sharded_expert_grads_averaged_over_their_group,
     "tiny_moe", 4, "dp_shard=4,ep=2", {}),
    ("tp_moe_grads_not_summed", _no_tp_moe_reduction, "tiny_moe", 2, "tp=2", {}),
]


@pytest.mark.parametrize("name, breaker, config, world, layout, opts", MUTANTS, ids=[x[0] for x in MUTANTS])
def test_a_wrong_layout_fails_the_check(tmp_path, tmp_path_factory, monkeypatch, name, breaker, config, world,
                                        layout, opts):
    ref = _moe_reference(tmp_path_factory, layout) if config == "tiny_moe" else _reference(tmp_path_factory, config)
    breaker(monkeypatch)  # after the reference: the forked ranks inherit the broken code
    worst, where = _worst_miss(ref, _run(tmp_path, world, name, config=config, layout=layout, **opts),
                               fp32_tolerance(config))
    assert worst > 10, f"the check let {name} through: worst miss {worst:.2f}x the tolerance ({where})"


# ----------------------------------------------------------------------------- other properties

def test_torch_compile_trains_like_eager(tmp_path, tmp_path_factory):
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
        pytest.skip("torch.compile's C++ backend does not build under ATEN_CPU_CAPABILITY=default (inductor emits "
                    "at::vec code that level leaves undeclared); eager numerics are checked at this level")
    ref_losses, ref_grads = _reference(tmp_path_factory, "tiny_dense")
    worst, where = _worst_miss((ref_losses, ref_grads), _run(tmp_path, 1, "compiled", config="tiny_dense",
                                                             overrides={"compile": True}), fp32_tolerance("tiny_dense"))
    assert worst <= 1.0, where


def test_default_data_is_learnable(tmp_path):
    """The shipped text has structure: 12 AdamW steps take the loss well below ln(vocab), where
    uniform tokens would keep it."""
    out = tmp_path / "learn"
    fork_ranks(run_rank, 1, TrainerOptions(config="tiny_dense", steps=12, result=str(out),
                                       overrides={"lr": 1e-2}))
    losses = torch.load(out / "rank0.pt")["losses"]
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)
    assert losses[-1] < 0.8 * losses[0], losses


def test_a_compiled_block_takes_the_rotations_not_their_trigonometry():
    """Every layer's RoPE reads the rotations the model makes once a forward (``rotary_table``): a
    block as torch.compile captures it holds no cos or sin.  Made inside each block, Inductor fused
    the trigonometry into every layer's per-element RoPE kernel (on an H200: 38.5 of 567 ms a
    step).  Captured by a backend that records the graph and runs it as captured (no Inductor in
    the test process: docs/contributing.md), which must give the eager block's output."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cfg = load_config("tiny_dense")
    block = model_mod.Transformer(cfg.model, cfg.seq_len).layers["0"]
    h = torch.randn(2, cfg.seq_len, cfg.model.dim)
    rotary = model_mod.rotary_table(torch.arange(cfg.seq_len), cfg.model.head_dim, cfg.model.rope_theta)
    out = torch.compile(block, backend=record, fullgraph=True)(h, rotary)
    ops = {getattr(n.target, "__name__", str(n.target)) for g in graphs for n in g.graph.nodes
           if n.op in ("call_function", "call_method")}
    assert graphs and not ops & {"cos", "sin"}, sorted(ops)
    assert torch.equal(out, block(h, rotary))


#: The aten op each backend of ``scaled_dot_product_attention`` dispatches to (PyTorch's op names).
SDPA_OPS = {"flash": "aten::_scaled_dot_product_flash_attention", "cudnn": "aten::_scaled_dot_product_cudnn_attention",
            "efficient": "aten::_scaled_dot_product_efficient_attention",
            "math": "aten::_scaled_dot_product_attention_math"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_backend_recorded_is_the_kernel_that_runs(dtype):
    """The manifest's ``kernels.attention`` (the cost model's attention rate follows it)
    names the op the profiler sees the trainer's attention dispatch to, at one rank's shape, on each
    device here (on a GPU: cuDNN's on Hopper with a recent PyTorch, FlashAttention-2's before)."""
    from torch.profiler import profile

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        q = torch.randn(2, 4, 64, 16, dtype=dtype, device=device)
        kv = torch.randn(2, 2, 64, 16, dtype=dtype, device=device)
        with profile() as prof:
            try:
                model_mod.causal_attention(q, kv, kv)
            except RuntimeError as e:  # ATEN_CPU_CAPABILITY=default: "pack_vnni2 is only supported when avx512 ..."
                if device == "cpu" and dtype == torch.bfloat16:
                    pytest.skip(f"this CPU build of PyTorch cannot run bf16 attention here: {e}")
                raise
        ran = {e.name for e in prof.events()}
        recorded = model_mod.attention_backend(4, 2, 16, 64, dtype, torch.device(device))
        assert recorded in SDPA_OPS, recorded
        assert any(name.startswith(SDPA_OPS[recorded]) for name in ran), (device, recorded, sorted(ran))


def test_text_data_is_the_shipped_text():
    from mfuscope.reference_trainer.data import TEXT, global_batch

    cfg = load_config("tiny_dense")
    batch = global_batch(cfg, 0)
    text = TEXT.read_bytes()
    assert cfg.data == "text"
    assert batch.shape == (cfg.global_batch, cfg.seq_len + 1)
    for row in batch.tolist():
        assert bytes(row) in text  # every row is a contiguous slice of the file
    assert torch.equal(batch, global_batch(cfg, 0)) and not torch.equal(batch, global_batch(cfg, 1))



@pytest.mark.parametrize("name", ["gpu_dense_1b", "gpu_moe"])
def test_rows_longer_than_the_text_wrap_around_it(name):
    """The GPU configs' rows (4,097 tokens) are longer than the shipped text (1,803 bytes): each row is
    the text read on past its end from where it starts, as a loader cycling over a small corpus reads it."""
    from mfuscope.reference_trainer.data import TEXT, global_batch

    cfg = load_config(name)
    text = TEXT.read_bytes()
    assert cfg.seq_len + 1 > len(text)
    batch = global_batch(cfg, 0)
    assert batch.shape == (cfg.global_batch, cfg.seq_len + 1)
    looped = text * (-(-(cfg.seq_len + 1) // len(text)) + 1)  # long enough for a row from any start
    starts = []
    for row in batch.tolist():
        starts.append(looped.find(bytes(row[:64])))
        assert bytes(row) == looped[starts[-1]:starts[-1] + len(row)]
    assert len(set(starts)) > 1  # not every row the same window

# ----------------------------------------------------------------------------- refused up front

REFUSED = [
    # (id, config, world, layout, options, words the message must have)
    ("ep_on_dense", "tiny_dense", 2, "dp_shard=2,ep=2", {}, "dense"),
    ("tp_over_kv_heads", "tiny_dense", 4, "tp=4", {}, "KV heads"),
    ("ddp_with_tp", "tiny_dense", 4, "dp_shard=2,tp=2", {"dp_mode": "ddp"}, "DDP"),
    ("grad_accum_with_pp", "tiny_dense", 2, "pp=2", {"overrides": {"grad_accum": 2}}, "--microbatches"),
    ("zbv_fsdp_reshard", "tiny_dense", 4, "pp=2,dp_shard=2", {"schedule": "zbv", "reshard": True}, "trains wrong"),
    ("batch_over_data_ranks", "tiny_dense", 16, "dp_shard=16", {}, "global_batch 8"),
    ("cp_chunks", "tiny_dense", 3, "cp=3", {}, "2*cp"),
    ("stages_over_layers", "tiny_dense", 4, "pp=4", {"schedule": "interleaved_1f1b"}, "8 pipeline stages"),
    ("experts_over_ep", "tiny_moe", 3, "dp_shard=3,ep=3", {}, "4 experts"),
    ("split_not_the_layers", "tiny_dense", 2, "pp=2", {"stage_layers": (3, 2)}, "add up to the model's 4 layers"),
    ("split_not_the_stages", "tiny_dense", 2, "pp=2", {"schedule": "interleaved_1f1b", "stage_layers": (2, 2)},
     "has 4 stages"),
    ("split_without_pp", "tiny_dense", 2, "dp_shard=2", {"stage_layers": (2, 2)}, "no pp"),
    ("chunks_without_interleaving", "tiny_dense", 2, "pp=2", {"virtual_stages": 2}, "1f1b has none"),
    ("one_chunk_interleaved", "tiny_dense", 2, "pp=2", {"schedule": "interleaved_1f1b", "virtual_stages": 1},
     "at least 2"),
    ("prefetch_without_fsdp", "tiny_dense", 2, "dp_shard=2", {"dp_mode": "ddp", "prefetch": True}, "no FSDP"),
    ("buckets_without_ddp", "tiny_dense", 2, "dp_shard=2", {"ddp_buckets": True}, "no DDP"),
    ("moe_tp_without_sp", "tiny_moe", 2, "tp=2", {"overrides": {"sequence_parallel": False}}, "sequence shard"),
    ("async_tp_without_compile", "tiny_dense", 2, "tp=2", {"async_tp": True}, "compile=true"),
]


@pytest.mark.parametrize("name, config, world, layout, opts, words", REFUSED, ids=[x[0] for x in REFUSED])
def test_a_combination_that_cannot_work_is_refused(name, config, world, layout, opts, words):
    from mfuscope.errors import UserInputError
    from mfuscope.reference_trainer.checks import check_run
    from mfuscope.reference_trainer.parallel_dims import ParallelDims

    cfg = load_config(config, **opts.get("overrides", {}))
    with pytest.raises(UserInputError, match=words.replace("*", r"\*")):
        # the table's "reshard" is --reshard-after-forward; "ddp_buckets" any DDP bucket switch
        check_run(cfg, ParallelDims.parse(layout, world), TrainerOptions(
            schedule=opts.get("schedule", "1f1b"), dp_mode=opts.get("dp_mode", "fsdp"),
            reshard_after_forward=opts.get("reshard"), stage_layers=opts.get("stage_layers"),
            prefetch=opts.get("prefetch", False), grad_as_bucket_view=opts.get("ddp_buckets", False),
            async_tp=opts.get("async_tp", False), virtual_stages=opts.get("virtual_stages")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")
def test_async_tp_without_a_gpu_is_refused():
    from mfuscope.errors import UserInputError
    from mfuscope.reference_trainer.checks import check_run
    from mfuscope.reference_trainer.parallel_dims import ParallelDims

    with pytest.raises(UserInputError, match="no CUDA GPU"):
        check_run(load_config("tiny_dense", compile=True), ParallelDims.parse("tp=2", 2), TrainerOptions(async_tp=True))


@pytest.mark.parametrize("args, says", [
    (["--layout", "dp_shard=2,ep=2"], "ep=2"),
    (["--launcher", "fork", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "this node only"),
], ids=["ep_on_dense", "fork_over_nodes"])
def test_mfuscope_train_refuses_in_one_line_before_starting_ranks(tmp_path, args, says):
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "mfuscope", "train", "--config", "tiny_dense", "--nproc", "2",
                           *args, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists()  # nothing was started or written


def test_stage_layers_cut_the_model_where_asked():
    from mfuscope.reference_trainer.pipeline_parallel import build_stage
    from mfuscope.trainer_options import parse_stage_layers

    cfg = load_config("tiny_dense")
    split = parse_stage_layers("3,1")
    held = [sorted(int(n) for n in build_stage(cfg.model, cfg.seq_len, cfg.seed, s, 2, "meta", split).layers)
            for s in range(2)]
    assert held == [[0, 1, 2], [3]]
    assert [sorted(int(n) for n in build_stage(cfg.model, cfg.seq_len, cfg.seed, s, 2, "meta").layers)
            for s in range(2)] == [[0, 1], [2, 3]]
