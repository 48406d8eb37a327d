"""The fix catalogue's rules, on measured runs built by hand: when each fix applies, what it
changes, and how a change becomes trainer options (``optimize.trainer_command``)."""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest

from mfuscope.manifest import Manifest
from mfuscope.optimizers import fixes, measured
from mfuscope.optimizers.measured import MeasuredRun, cpu_system
from mfuscope.optimizers.optimize import changed_options, ran_otherwise, trainer_command
from mfuscope.optimizers.spec import Layout, ModelSpec, Training
from mfuscope.optimizers.system import system
from mfuscope.trainer_options import TrainerOptions

MODEL = ModelSpec(n_layers=8, dim=64, n_heads=4, ffn_dim=128, vocab_size=256)


def _run(layout: Layout, leaves: dict[str, float], step_s: float = 1.0, stage_compute=(), on_gpu=False,
         training: Training | None = None, dp_mode: str = "fsdp", checkpoint: str | None = None) -> MeasuredRun:
    sys_ = system("H100") if on_gpu else cpu_system(1e11, layout.gpus)
    return MeasuredRun(Path("run"), MODEL, layout, training or Training(seq_len=32, dtype="fp32"), sys_, None, None,
                       leaves, step_s, None, None, tuple(stage_compute), dp_mode=dp_mode, checkpoint=checkpoint)


def test_async_checkpoint_keeps_the_staging_of_parameters_and_optimizer_state():
    """Sync saves every 4 steps holding the thread 20% of the step: async, into its own folder; what
    stays on the thread is the staging copy of the FSDP shard's fp32 weights and AdamW's two moments,
    12 bytes a parameter over dp_shard=2, at 10 GB/s, once every 4 steps."""
    lay = Layout(dp_shard=2, micro_batch=4)
    run = _run(lay, {"checkpoint": 0.2}, checkpoint="every=4,mode=sync,dir=/ckpt")
    (change,) = fixes.async_checkpoint(run)
    assert change.trainer == {"checkpoint": "every=4,mode=async,dir=/ckpt/async"}
    params = MODEL.total_params()  # no pipeline: every parameter, sharded over 2
    assert change.training.checkpoint_s == pytest.approx(12 * params / 2 / 10e9 / 4)
    assert fixes.async_checkpoint(replace(run, checkpoint="every=4,mode=async,dir=/ckpt")) == []  # already async
    assert fixes.async_checkpoint(replace(run, leaves={"checkpoint": 0.01})) == []  # 1%: under the threshold


def test_rebalance_moves_layers_off_the_busiest_stage():
    lay = Layout(pp=2, micro_batch=4, microbatches=2, schedule="gpipe", split=(7, 1))
    # Layers cost the same everywhere: the even cut.
    even = fixes.rebalance_stages(_run(lay, {"compute/other": 1.0}, stage_compute=(0.7, 0.1)))
    assert [c.layout.split for c in even] == [(4, 4)] and even[0].trainer == {"stage_layers": "4,4"}
    # Stage 1 carries 0.2 s besides its layer (the head, say): it keeps fewer layers.
    heavy = fixes.rebalance_stages(_run(replace(lay, split=(4, 4)), {}, stage_compute=(0.4, 0.6)))
    assert heavy[0].layout.split == (5, 3)  # a layer is 0.1 s: 5 x 0.1 against 0.2 + 3 x 0.1
    assert fixes.rebalance_stages(_run(replace(lay, split=(4, 4)), {}, stage_compute=(0.4, 0.41))) == []  # balanced


def test_async_tp_is_a_gpu_change_and_turns_compile_on():
    lay = Layout(tp=2, micro_batch=8)
    leaves = {"compute/gemm": 0.8, "comm/tp/all_gather": 0.1, "comm/tp/reduce_scatter": 0.1}
    (change,) = fixes.overlap_tp_comm(_run(lay, leaves, on_gpu=True))
    assert change.training.async_tp and change.training.compiled
    assert change.trainer == {"async_tp": "true", "set.compile": "true"}
    assert fixes.overlap_tp_comm(_run(lay, leaves)) == []  # a CPU run: symmetric memory needs CUDA
    assert fixes.overlap_tp_comm(_run(lay, {"compute/gemm": 1.0}, on_gpu=True)) == []  # nothing exposed


def test_fuse_elementwise_applies_past_a_tenth_of_the_step():
    lay = Layout(dp_shard=2, micro_batch=4)
    assert fixes.fuse_elementwise(_run(lay, {"compute/norm_elementwise": 0.09, "compute/gemm": 0.91})) == []
    leaves = {"compute/norm_elementwise": 0.2, "compute/gemm": 0.8}
    kernels, compiled = fixes.fuse_elementwise(_run(lay, leaves, on_gpu=True))
    assert kernels.trainer == {"kernels": "fused"} and compiled.trainer == {"set.compile": "true"}
    # each its own term: the kernels fuse the norms, SwiGLU, RoPE and the loss; compile every chain
    assert kernels.training.fused_kernels and not kernels.training.compiled and compiled.training.compiled
    # A CPU runs the kernels' PyTorch references: only torch.compile is proposed there.
    (only,) = fixes.fuse_elementwise(_run(lay, leaves))
    assert only.trainer == {"set.compile": "true"}


def test_cuda_graphs_are_proposed_for_a_host_bound_gpu_run_without_fsdp():
    lay = Layout(dp_replicate=2, micro_batch=4)
    leaves = {"compute/gemm": 0.8, "host_bound": 0.2}
    (change,) = fixes.cuda_graphs(_run(lay, leaves, on_gpu=True, dp_mode="ddp"))
    assert change.trainer == {"set.compile": "true", "set.cuda_graphs": "true"}
    assert change.training.cuda_graphs and change.training.compiled
    (alone,) = fixes.cuda_graphs(_run(Layout(micro_batch=4), leaves, on_gpu=True))  # one GPU: no data ranks
    assert alone.training.cuda_graphs
    assert fixes.cuda_graphs(_run(lay, leaves, dp_mode="ddp")) == []  # a CPU run has no CUDA graphs to capture
    # The trainer shards data ranks with FSDP unless told --dp-mode ddp, replicas (HSDP) included.
    assert fixes.cuda_graphs(_run(lay, leaves, on_gpu=True)) == []
    assert fixes.cuda_graphs(_run(Layout(dp_shard=2, micro_batch=4), leaves, on_gpu=True)) == []
    assert fixes.cuda_graphs(_run(lay, {"compute/gemm": 0.97, "host_bound": 0.03}, on_gpu=True, dp_mode="ddp")) == []
    moe = replace(_run(lay, leaves, on_gpu=True, dp_mode="ddp"), model=replace(MODEL, n_experts=4, top_k=2))
    assert fixes.cuda_graphs(moe) == []  # per-expert split sizes go to the host


def test_cuda_graphs_take_the_measured_host_time_out_of_the_predicted_step():
    """A GPU run whose device waits 0.2 s of its 1 s step on the host's launches: calibrated on
    that run, the cost model predicts the CUDA-graphs change (which replays each block without
    launches) to gain exactly the measured host time."""
    from mfuscope.optimizers.calibrate import fit_runs

    lay = Layout(dp_replicate=2, micro_batch=2, microbatches=4)
    run = _run(lay, {"compute/gemm": 0.8, "host_bound": 0.2}, on_gpu=True, dp_mode="ddp")
    profile = fit_runs([run])
    (change,) = fixes.cuda_graphs(run)
    eager = run.predict(profile)
    graphs = run.predict(profile, change.layout, replace(change.training, compiled=False))
    assert eager.step_s - graphs.step_s == pytest.approx(0.2, rel=1e-3)


def test_the_trainer_refuses_cuda_graphs_it_cannot_capture():
    from mfuscope.errors import UserInputError
    from mfuscope.reference_trainer.checks import check_run
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.parallel_dims import ParallelDims
    from mfuscope.trainer_options import TrainerOptions

    dims = ParallelDims.parse("dp_replicate=2", 2)
    ddp = TrainerOptions(dp_mode="ddp")
    with pytest.raises(UserInputError, match="compile=true"):
        check_run(load_config("tiny_dense", cuda_graphs=True), dims, ddp)
    import torch
    graphs = load_config("tiny_dense", cuda_graphs=True, compile=True)
    if torch.cuda.is_available():
        with pytest.raises(UserInputError, match="FSDP"):
            check_run(graphs, ParallelDims.parse("dp_shard=2", 2), TrainerOptions(dp_mode="fsdp"))
    else:
        with pytest.raises(UserInputError, match="no CUDA GPU"):
            check_run(graphs, dims, ddp)


def test_ddp_buckets_are_proposed_only_when_everything_waits_for_the_end():
    """MODEL's 1.44 MB of float32 gradients in one bucket (a 25 MiB cap set by hand) wait for the
    end of the backward.  Under DDP's default cap they do not: its first bucket closes at 1 MiB,
    so 73% of them are reduced during the backward and 0.39 MB after it."""
    lay = Layout(dp_replicate=2, micro_batch=4)
    leaves = {"compute/gemm": 0.9, "comm/dp/all_reduce": 0.1}
    grads = 4 * MODEL.total_params()
    assert 2**20 < grads < 2 * 2**20
    one = replace(Training(seq_len=32, dtype="fp32"), grad_bucket_bytes=25 * 2**20)
    (change,) = fixes.overlap_dp_grads(_run(lay, leaves, training=one))
    assert set(change.trainer) == {"ddp_bucket_mb"}
    assert f"held {grads / 2**20:.3g} of {grads / 2**20:.3g} MiB" in change.summary
    bucket = change.training.grad_bucket_bytes
    small = replace(Training(seq_len=32, dtype="fp32"), grad_bucket_bytes=bucket)
    assert fixes.overlap_dp_grads(_run(lay, leaves, training=small)) == []  # already a bucket a layer
    assert fixes.overlap_dp_grads(_run(lay, leaves)) == []  # the default cap's first bucket


MANIFEST = {"world_size": 4, "layout": {"pp": 2, "dp_shard": 2},
            "schedule": {"name": "1f1b", "microbatches": 4, "virtual_stages": 1},
            "trainer": {"dp_mode": "fsdp", "schedule": "1f1b", "stage_layers": [3, 1], "prefetch": True,
                        "window": "1:"}}


def test_trainer_command_carries_the_run_and_drops_what_a_new_layout_cannot_take():
    cmd = trainer_command(MANIFEST, Path("c.toml"), Path("out"), {"set.recompute": "none", "microbatches": "8"})
    assert cmd[cmd.index("--layout") + 1] == "pp=2,dp_shard=2" and cmd[cmd.index("--microbatches") + 1] == "8"
    assert cmd[cmd.index("--stage-layers") + 1] == "3,1" and "--prefetch" in cmd
    assert cmd[cmd.index("--set") + 1] == "recompute=none"
    # A new layout: the old split has the wrong stages, and without FSDP there is nothing to prefetch.
    moved = trainer_command(MANIFEST, Path("c.toml"), Path("out"), {"layout": "tp=4", "schedule": "1f1b"})
    assert "--stage-layers" not in moved and "--prefetch" not in moved
    interleaved = trainer_command(MANIFEST, Path("c.toml"), Path("out"), {"schedule": "interleaved_1f1b"})
    assert "--stage-layers" not in interleaved
    # A run that saved checkpoints: a rerun saves its own beside them, never over them.
    saving = {**MANIFEST, "trainer": {**MANIFEST["trainer"], "checkpoint": "every=2,mode=sync,dir=/ck"}}
    cmd = trainer_command(saving, Path("c.toml"), Path("runs/r1"), {"microbatches": "8"})
    assert cmd[cmd.index("--checkpoint") + 1] == "every=2,mode=sync,dir=/ck/r1"


@pytest.mark.parametrize("fix", sorted(fixes.CATALOGUE))
def test_every_fix_names_the_flags_of_three_frameworks(fix):
    runs = [_run(Layout(pp=2, micro_batch=4, microbatches=2, schedule="gpipe", split=(7, 1)),
                 {"compute/norm_elementwise": 0.3, "bubble": 0.3}, stage_compute=(0.7, 0.1)),
            _run(Layout(dp_shard=2, micro_batch=4, recompute="full"), {"comm/dp/all_gather": 0.2},
                 training=Training(seq_len=32, dtype="fp32", overlap_param_gather=False)),
            _run(Layout(tp=2, micro_batch=8), {"comm/tp/all_gather": 0.2, "host_bound": 0.2}, on_gpu=True),
            _run(Layout(dp_shard=2, micro_batch=4), {"checkpoint": 0.2}, checkpoint="every=2,mode=sync,dir=c")]
    changes = [c for r in runs for c in (fixes.CATALOGUE[fix](r, None) if fix == "better_layout"
                                         else fixes.CATALOGUE[fix](r))]
    assert changes, fix
    for c in changes:
        assert set(c.flags) == {"torchtitan", "megatron", "pytorch"} and all(c.flags.values()), c
        assert c.trainer, c


# ----------------------------------------------------------------------------- what each fix runs

#: A base run for every fix, as the reference trainer would launch and record it: (config, ranks,
#: the base's trainer options, its train-setting overrides, the measured leaves, on a GPU).  Each
#: base is one the fix applies to (its leaves over the fix's threshold).
EIGHT_LAYERS = "[model]\nvocab_size = 256\ndim = 64\nn_layers = 8\nn_heads = 4\nn_kv_heads = 2\nffn_dim = 128\n" \
               "max_seq_len = 64\n[train]\nseq_len = 32\nglobal_batch = 8\nmicrobatches = 2\ndtype = \"fp32\"\n"
BASES = {
    "more_microbatches": (2, {"layout": "pp=2", "schedule": "gpipe"}, {}, {"bubble": 0.4, "compute/gemm": 0.6}, False),
    "interleaved_schedule": (2, {"layout": "pp=2"}, {}, {"bubble": 0.4, "compute/gemm": 0.6}, False),
    "rebalance_stages": (2, {"layout": "pp=2", "schedule": "gpipe", "stage_layers": (7, 1)}, {},
                         {"compute/gemm": 0.8, "bubble": 0.2}, False),
    "less_recompute": (2, {"layout": "dp_shard=2"}, {"recompute": "full"}, {"compute/gemm": 1.0}, False),
    "overlap_dp_grads": (2, {"layout": "dp_shard=2"}, {}, {"compute/gemm": 0.7, "comm/dp_shard/all_gather": 0.3},
                         False),
    "overlap_tp_comm": (2, {"layout": "tp=2"}, {}, {"compute/gemm": 0.7, "comm/tp/all_gather": 0.3}, True),
    "fuse_elementwise": (1, {}, {}, {"compute/gemm": 0.6, "compute/norm_elementwise": 0.4}, True),
    "cuda_graphs": (2, {"layout": "dp_shard=2", "dp_mode": "ddp"}, {}, {"compute/gemm": 0.7, "host_bound": 0.3}, True),
    "keep_weights_gathered": (2, {"layout": "dp_shard=2"}, {}, {"compute/gemm": 0.6, "comm/dp_shard/all_gather": 0.4},
                              False),
    "better_layout": (2, {"layout": "tp=2"}, {"recompute": "full"},
                      {"compute/gemm": 0.5, "comm/tp/all_gather": 0.5}, False),
    "async_checkpoint": (2, {"layout": "dp_shard=2", "checkpoint": "every=2,mode=sync,dir=/ckpt"}, {},
                         {"compute/gemm": 0.7, "checkpoint": 0.3}, False),
}


def _trainer_manifest(config: Path, world: int, options: dict, overrides: dict, on_gpu: bool) -> dict:
    """The manifest a run of the reference trainer with these options records, made by the trainer's
    own code (its config resolution, its checks, the sections it writes) short of training."""
    from mfuscope.errors import UserInputError
    from mfuscope.reference_trainer.checks import check_run
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.parallel_dims import ParallelDims
    from mfuscope.reference_trainer.train import manifest_sections

    opts = TrainerOptions(config=str(config), **options, overrides={**options.get("overrides", {}), **overrides})
    cfg = load_config(opts.config, steps=opts.steps, microbatches=opts.microbatches, **opts.overrides)
    dims = ParallelDims.parse(opts.layout, world)
    try:
        check_run(cfg, dims, opts)
    except UserInputError as e:  # what only a GPU can run, the trainer refuses here: the rest must pass
        assert on_gpu and ("CUDA" in str(e) or "GPU" in str(e)), e
    return {"world_size": world, "layout": dims.sizes(), "hardware": {"device_name": "H100" if on_gpu else "x86_64"},
            **manifest_sections(opts, cfg, dims)}


@pytest.mark.parametrize("fix", list(fixes.CATALOGUE))
def test_every_fix_runs_what_it_predicted(fix, tmp_path):
    """For every fix: each change it proposes, launched as ``optimize --apply`` launches it
    (``changed_options``), resolved and recorded by the trainer's own code, reads back (as
    ``measured.load`` reads a manifest) as exactly the layout and training the cost model
    predicted -- the interleaving degree, the recompute policy, the microbatches included."""
    pytest.importorskip("torch", reason="the trainer's config and checks need torch ([dev] extra)")
    world, options, overrides, leaves, on_gpu = BASES[fix]
    config = tmp_path / "eight.toml"
    config.write_text(EIGHT_LAYERS)
    manifest = _trainer_manifest(config, world, options, overrides, on_gpu)
    tree = {"name": "step", "seconds": 1.0, "children": [{"name": k, "seconds": v} for k, v in leaves.items()]}
    rows = [{"rank": r, "leaf": "compute/gemm", "seconds": 0.7 if r == 0 else 0.1} for r in range(world)]
    report = {"summary": {"step_time_s": 1.0, "peak_flops": 1e11}, "breakdown": tree, "breakdown_by_rank": rows}
    base = measured.from_documents(report, manifest, tmp_path / "base")
    changes = fixes.CATALOGUE[fix](base, None) if fix == "better_layout" else fixes.CATALOGUE[fix](base)
    assert changes, f"{fix} does not apply to its base"
    for change in changes:
        opts = changed_options(Manifest.of(manifest), config, tmp_path / "new", change.trainer)
        launched = {f.name: getattr(opts, f.name) for f in fields(opts)
                    if f.name not in ("config", "overrides", "out", "force", "result")}
        new = Manifest.of(_trainer_manifest(config, world, launched, opts.overrides, on_gpu))
        recorded = TrainerOptions.from_manifest(new, config=str(config))
        layout = measured.run_layout(new, recorded, tmp_path / "new" / "manifest.json")
        training = replace(Training.of_run(recorded, new.train, on_gpu, new.kernels.get("attention")),
                           checkpoint_s=change.training.checkpoint_s)
        assert ran_otherwise(change, layout, training) == [], (change.summary, change.trainer)


def test_a_fix_is_judged_on_the_steady_steps(tmp_path):
    """One eager rank whose first traced step spent 0.33 s more in norm/elementwise kernels (first
    calls, say) than its three steady steps' 0.06 s of 1 s: over the four traced steps the leaf is
    (0.39 + 3 x 0.06) / 4 = 0.1425 s, 14% of the 1 s steady step, over fuse_elementwise's 10%; over
    the steady steps, the step's basis, it is 6% and nothing is proposed.  A report from before
    ``steady_breakdown`` has only the four-step tree, and is judged on it."""
    pytest.importorskip("torch", reason="the trainer's config and checks need torch ([dev] extra)")
    config = tmp_path / "eight.toml"
    config.write_text(EIGHT_LAYERS)
    manifest = _trainer_manifest(config, 1, {}, {}, True)

    def tree(elementwise, other):
        return {"name": "step", "seconds": elementwise + other, "children": [
            {"name": "compute/norm_elementwise", "seconds": elementwise}, {"name": "compute/gemm", "seconds": other}]}

    traced = tree((0.39 + 3 * 0.06) / 4, (1.27 + 3 * 0.94) / 4)
    report = {"summary": {"step_time_s": 1.0}, "breakdown": traced, "steady_breakdown": tree(0.06, 0.94)}
    assert fixes.fuse_elementwise(measured.from_documents(report, manifest, tmp_path / "run")) == []
    older = {k: v for k, v in report.items() if k != "steady_breakdown"}
    assert fixes.fuse_elementwise(measured.from_documents(older, manifest, tmp_path / "run"))


def test_the_attention_rate_follows_the_kernel_the_run_recorded(tmp_path):
    """A GPU run whose trainer recorded PyTorch choosing cuDNN's attention (as SDPA does on Hopper
    with cuDNN 9.15+: measured on an H200, 104 ms a step where FlashAttention-2's rate predicted
    238) is predicted at the FA3-class rate: its attention leaf is FA2's over the published rates'
    ratio, 620.7 / 335 TFLOP/s on H100 (Shah et al. 2024); every other leaf is unchanged."""
    pytest.importorskip("torch", reason="the trainer's config and checks need torch ([dev] extra)")
    config = tmp_path / "eight.toml"
    config.write_text(EIGHT_LAYERS.replace('dtype = "fp32"', 'dtype = "bf16"'))
    manifest = _trainer_manifest(config, 1, {}, {}, True)
    assert manifest["kernels"]["attention"] in ("flash", "cudnn", "efficient", "math")  # what this torch picks
    report = {"summary": {"step_time_s": 1.0}, "breakdown": {"name": "step", "seconds": 1.0, "children": []}}
    leaves = {}
    for backend in ("flash", "cudnn"):
        manifest["kernels"]["attention"] = backend
        leaves[backend] = measured.from_documents(report, manifest, tmp_path / backend).predict(None).leaves
    flash, cudnn = leaves["flash"], leaves["cudnn"]
    assert flash["compute/attention"] / cudnn["compute/attention"] == pytest.approx(620.7 / 335, rel=1e-6)
    assert {k: v for k, v in flash.items() if k != "compute/attention"} == pytest.approx(
        {k: v for k, v in cudnn.items() if k != "compute/attention"}, rel=1e-9)
