"""The fix catalogue: for each fix id, the concrete changes to try on a measured run.

A fix is one small function from a measured run to the changes it proposes.  When it applies
(its evidence and threshold), what it changes and its frameworks' switches are the fix's record
in :data:`mfuscope.fix_registry.FIXES`, which the findings read too; here each change is made
concrete: a new layout and training setup (what the cost model predicts), the reference trainer's
options that make it real (:meth:`TrainerOptions.change`), and the torchtitan, Megatron-Core and
plain PyTorch flags with this run's numbers.  Whether a change is worth making is the cost
model's call (``optimizers.optimize``): its gain is the predicted step of the run as it is minus
the predicted step with the change, both with the profile calibrated on the run itself.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from mfuscope.analyzers.findings import host_wait_s
from mfuscope.fix_registry import FIXES
from mfuscope.layout import INTERLEAVED, Degrees
from mfuscope.trainer_options import TrainerOptions, parse_checkpoint

from . import planner
from .cost import memory as memory_model
from .measured import UNEVEN, MeasuredRun
from .model import ddp_last_bucket_bytes
from .spec import Layout, Training


@dataclass(frozen=True)
class Change:
    fix: str
    summary: str
    layout: Layout
    training: Training
    trainer: dict[str, str] = field(default_factory=dict)   # reference-trainer options that differ
    flags: dict[str, str] = field(default_factory=dict)     # torchtitan / megatron / pytorch equivalents


def _applies(run: MeasuredRun, fix: str, prefix: str) -> bool:
    """The measured leaves under ``prefix`` reach the fix's threshold (a share of the step)."""
    share = sum(v for k, v in run.leaves.items() if k.startswith(prefix)) / run.step_s if run.step_s else 0.0
    return FIXES[fix].applies(share)


def more_microbatches(run: MeasuredRun) -> list[Change]:
    lay = run.layout
    if lay.pp == 1:
        return []
    out = []
    for k in (2, 4):
        if lay.micro_batch % k:
            continue
        new = replace(lay, micro_batch=lay.micro_batch // k, microbatches=lay.microbatches * k)
        out.append(Change("more_microbatches", f"microbatches {lay.microbatches} -> {new.microbatches} "
                          f"(micro-batch {lay.micro_batch} -> {new.micro_batch})", new, run.training,
                          TrainerOptions.change(microbatches=new.microbatches),
                          {"torchtitan": f"--parallelism.pipeline_parallel_microbatch_size {new.micro_batch}",
                           "megatron": f"--micro-batch-size {new.micro_batch}",
                           "pytorch": f"Schedule*(stage, n_microbatches={new.microbatches})"}))
    return out


def interleaved_schedule(run: MeasuredRun) -> list[Change]:
    lay = run.layout
    if lay.pp == 1 or lay.schedule not in ("gpipe", "1f1b") or run.model.n_layers < 2 * lay.pp:
        return []
    per_chunk = run.model.n_layers // (2 * lay.pp)
    out = []
    for schedule, titan, torch_name in (("interleaved_1f1b", "Interleaved1F1B", "ScheduleInterleaved1F1B"),
                                        ("zbv", "ZBVZeroBubble", "ScheduleZBVZeroBubble")):
        new = replace(lay, vpp=2, schedule=schedule, split=())  # v chunks cut evenly
        out.append(Change("interleaved_schedule", f"schedule {lay.schedule} -> {schedule} (v=2)", new, run.training,
                          TrainerOptions.change(schedule=schedule),
                          {"torchtitan": f"--parallelism.pipeline_parallel_schedule {titan}",
                           "megatron": f"--num-layers-per-virtual-pipeline-stage {per_chunk}"
                                       + (" (no ZB-V schedule in Megatron-Core)" if schedule == "zbv" else ""),
                           "pytorch": f"{torch_name}(stages, n_microbatches={lay.microbatches})"}))
    return out


def rebalance_stages(run: MeasuredRun) -> list[Change]:
    """Move layers off the pipeline rank that computes longest.

    Each rank's measured compute is taken as a fixed part plus its layers at one per-layer cost,
    the cost of the leanest rank (whose time is all layers): t_r = c_r + a n_r.  Layers then go,
    one at a time, to the stage whose time grows least, which minimises the slowest stage.  The
    cost model predicts the new split from its layer counts (it does not model c_r: a stage made
    heavy by something other than layers is predicted less well)."""
    lay, t = run.layout, run.stage_compute_s
    if lay.pp == 1 or lay.vpp > 1 or len(t) != lay.pp or max(t) <= UNEVEN * min(t):
        return []
    current = lay.rank_layers(run.model)
    per_layer = min(s / n for s, n in zip(t, current))
    fixed = [s - per_layer * n for s, n in zip(t, current)]
    split = [1] * lay.pp
    for _ in range(run.model.n_layers - lay.pp):
        split[min(range(lay.pp), key=lambda r: (fixed[r] + per_layer * (split[r] + 1), -r))] += 1
    if split == current:
        return []
    text = ",".join(map(str, split))
    first = [sum(split[:r + 1]) for r in range(lay.pp - 1)]
    return [Change("rebalance_stages", f"stage layers {','.join(map(str, current))} -> {text} "
                   f"(stage compute {', '.join(f'{s:.3g}' for s in t)} s)", replace(lay, split=tuple(split)),
                   run.training, TrainerOptions.change(stage_layers=split),
                   {"torchtitan": "--parallelism.pipeline_parallel_split_points "
                                  + ",".join(f"layers.{n}" for n in first),
                    "megatron": f"--decoder-first-pipeline-num-layers {split[0]} "
                                f"--decoder-last-pipeline-num-layers {split[-1]}",
                    "pytorch": "PipelineStage per layer range " + ", ".join(
                        f"[{a}, {b})" for a, b in zip([0] + first, first + [run.model.n_layers]))})]


def less_recompute(run: MeasuredRun) -> list[Change]:
    lay = run.layout
    targets = {"full": ("selective", "none"), "selective": ("none",)}.get(lay.recompute, ())
    flags = {"none": {"torchtitan": "--activation_checkpoint.mode none", "megatron": "(drop --recompute-granularity)",
                      "pytorch": "(no checkpoint_wrapper)"},
             "selective": {"torchtitan": "--activation_checkpoint.mode selective",
                           "megatron": "--recompute-granularity selective",
                           "pytorch": "checkpoint_wrapper with a selective policy"}}
    return [Change("less_recompute", f"recompute {lay.recompute} -> {t}", replace(lay, recompute=t), run.training,
                   TrainerOptions.change(overrides={"recompute": t}), flags[t]) for t in targets]


def overlap_dp_grads(run: MeasuredRun) -> list[Change]:
    """Data-parallel communication waits in the open.  FSDP: gather each block's weights while the
    block before it computes (explicit prefetch), so only what outlasts that compute stays
    exposed.  DDP: gradients in one or two buckets are reduced after the backward; a bucket a
    layer starts reducing the last layers' gradients while the first layers' are computed."""
    lay = run.layout
    if lay.shard_ranks == 1:
        return _smaller_buckets(run)
    if run.training.overlap_param_gather or not _applies(run, "overlap_dp_grads", "comm/dp/all_gather"):
        return []
    return [Change("overlap_dp_grads", "FSDP prefetches the next block's weights (async gathers)", lay,
                   replace(run.training, overlap_param_gather=True), TrainerOptions.change(prefetch=True),
                   {"torchtitan": "(FSDP2 prefetches one block ahead by default on GPU; check that "
                                  "--parallelism.fsdp_reshard_after_forward is not forcing extra gathers)",
                    "megatron": "--overlap-param-gather --overlap-grad-reduce (distributed optimizer)",
                    "pytorch": "block.set_modules_to_forward_prefetch([next_block]); "
                               "block.set_modules_to_backward_prefetch([prev_block])"})]


def _smaller_buckets(run: MeasuredRun) -> list[Change]:
    lay, training = run.layout, run.training
    if lay.dp_replicate == 1 or lay.zero or not _applies(run, "overlap_dp_grads", "comm/dp/all_reduce"):
        return []
    grads = memory_model.params_per_gpu(run.model, lay) * training.grad_reduce_bytes
    last = ddp_last_bucket_bytes(grads, training.grad_bucket_bytes)
    if last < grads / 2:
        return []  # already reducing most of them during the backward
    mib = max(round(grads / run.model.n_layers / 2**20, 3), 0.001)
    return [Change("overlap_dp_grads", f"DDP buckets of {mib:g} MiB (one layer's gradients; the last bucket, "
                   f"reduced after the backward, held {last / 2**20:.3g} of {grads / 2**20:.3g} MiB)", lay,
                   replace(training, overlap_grad_reduce=True, grad_bucket_bytes=mib * 2**20),
                   TrainerOptions.change(ddp_bucket_mb=mib),
                   {"torchtitan": "(torchtitan's data-parallel replicas are FSDP2/HSDP: see its prefetch)",
                    "megatron": "--overlap-grad-reduce --ddp-bucket-size "
                                f"{int(mib * 2**20 / training.grad_reduce_bytes)}",
                    "pytorch": f"DistributedDataParallel(model, bucket_cap_mb={mib:g}, gradient_as_bucket_view=True)"})]


def overlap_tp_comm(run: MeasuredRun) -> list[Change]:
    """Tensor-parallel collectives wait in the open: micro-pipelined (async) TP splits each
    all-gather / reduce-scatter into per-rank chunks that overlap the GEMM they feed.  It runs
    on symmetric memory under torch.compile, so it is a GPU change; a CPU run gets none."""
    lay, training = run.layout, run.training
    if lay.tp == 1 or training.async_tp or run.system.key == "CPU" or not _applies(run, "overlap_tp_comm", "comm/tp"):
        return []
    trainer = TrainerOptions.change(async_tp=True, overrides=None if training.compiled else {"compile": True})
    return [Change("overlap_tp_comm", "async TP: tensor-parallel collectives overlap their GEMMs (torch.compile)",
                   lay, replace(training, async_tp=True, compiled=True), trainer,
                   {"torchtitan": "--parallelism.enable_async_tensor_parallel --compile.enable",
                    "megatron": "--tp-comm-overlap (Transformer Engine userbuffers)",
                    "pytorch": "torch._inductor.config._micro_pipeline_tp = True; "
                               "enable_symm_mem_for_group(tp_group.group_name); torch.compile"})]


def fuse_elementwise(run: MeasuredRun) -> list[Change]:
    """Norms, activations and residual adds run as separate memory-bound kernels: torch.compile
    fuses each chain into one read and one write; the fused Triton kernels of ``kernels/`` are the
    other route, on a GPU (a CPU runs their PyTorch references: nothing to gain there)."""
    if run.training.compiled or not _applies(run, "fuse_elementwise", "compute/norm_elementwise"):
        return []
    out = []
    if run.system.key != "CPU" and not run.training.fused_kernels:  # on a CPU they run their PyTorch path
        out.append(Change("fuse_elementwise", "mfuscope's fused RMSNorm, SwiGLU, RoPE and LM-head loss kernels",
                          run.layout, replace(run.training, fused_kernels=True), TrainerOptions.change(kernels="fused"),
                          {"torchtitan": "(Liger-style kernels: swap the norms and MLPs with "
                                         "mfuscope.kernels.apply(model))",
                           "megatron": "--normalization RMSNorm with Transformer Engine, --bias-swiglu-fusion",
                           "pytorch": "mfuscope.kernels.apply(model)"}))
    fused = replace(run.training, compiled=True)
    return out + [Change("fuse_elementwise", "torch.compile each transformer block (elementwise chains fused)",
                   run.layout, fused, TrainerOptions.change(overrides={"compile": True}),
                   {"torchtitan": "--compile.enable", "megatron": "keep the fusions on (drop --no-bias-swiglu-fusion, "
                    "--no-masked-softmax-fusion); --apply-rope-fusion", "pytorch": "torch.compile(block) per block"})]


def cuda_graphs(run: MeasuredRun) -> list[Change]:
    """The device waits on the host's launches (``host_bound`` at least 5% of the step on a GPU):
    compiled with ``mode="reduce-overhead"``, each block's kernels replay as one CUDA graph.  Not
    under FSDP, which gathers each block's weights into new buffers every step (a graph would be
    recorded again each time), nor for MoE blocks, whose per-expert split sizes are read to the
    host (inductor runs such graphs eagerly)."""
    lay, training = run.layout, run.training
    fsdp = lay.data_ranks * lay.cp > 1 and run.dp_mode != "ddp"
    if training.cuda_graphs or run.system.key == "CPU" or fsdp or run.model.n_experts:
        return []
    if not run.step_s or not FIXES["cuda_graphs"].applies(host_wait_s(run.leaves) / run.step_s):
        return []
    return [Change("cuda_graphs", "compile each block and replay it as a CUDA graph (mode=reduce-overhead)", lay,
                   replace(training, compiled=True, cuda_graphs=True),
                   TrainerOptions.change(overrides={"compile": True, "cuda_graphs": True}),
                   {"torchtitan": "(no switch) torch.compile(block, mode='reduce-overhead') in its apply_compile",
                    "megatron": "--enable-cuda-graph (Transformer Engine's per-layer graphs)",
                    "pytorch": "torch.compile(block, mode='reduce-overhead'); "
                               "torch.compiler.cudagraph_mark_step_begin() before each step"})]


def keep_weights_gathered(run: MeasuredRun) -> list[Change]:
    """FSDP reshards after forward and gathers every block again for backward: keep the last
    block gathered (its backward comes next; torchtitan's default), or every block, memory
    permitting (the memory check decides)."""
    lay, training = run.layout, run.training
    if lay.shard_ranks == 1 or lay.pp > 1 or training.reshard_after_forward is False:
        return []
    if not _applies(run, "keep_weights_gathered", "comm/dp/all_gather"):
        return []
    out = []
    if not training.keep_last_gathered:
        out.append(Change("keep_weights_gathered", "FSDP keeps the last block gathered after forward", lay,
                          replace(training, keep_last_gathered=True), TrainerOptions.change(keep_last_gathered=True),
                          {"torchtitan": "(its default: the last block is not resharded after forward)",
                           "megatron": "(distributed optimizer: --overlap-param-gather)",
                           "pytorch": "fully_shard(blocks[-1], reshard_after_forward=False)"}))
    out.append(Change("keep_weights_gathered", "FSDP keeps weights gathered from forward to backward",
                      lay, replace(training, reshard_after_forward=False),
                      TrainerOptions.change(reshard_after_forward=False),
                      {"torchtitan": "--parallelism.fsdp_reshard_after_forward never",
                       "megatron": "(distributed optimizer: --overlap-param-gather)",
                       "pytorch": "fully_shard(block, reshard_after_forward=False)"}))
    return out


def better_layout(run: MeasuredRun, profile=None) -> list[Change]:
    """The planner's fastest layouts for the same model, GPUs and global batch that the reference
    trainer can run (FSDP, HSDP or plain DDP: it has no ZeRO-1)."""
    lay = run.layout
    global_batch = lay.data_ranks * lay.micro_batch * lay.microbatches
    result = planner.plan(run.model, lay.gpus, run.system, global_batch, run.training, profile, top=20)
    out = []
    for new, _ in result.ranked:
        if new.zero or _same(new, lay):
            continue
        out.append(Change("better_layout", f"layout {planner.describe(lay)} -> {planner.describe(new)}",
                          new, run.training, trainer_change(new, lay),
                          {"torchtitan": _titan_flags(new), "megatron": _megatron_flags(new),
                           "pytorch": "init_device_mesh with " + trainer_layout(new)}))
        if len(out) == 3:
            break
    return out


def trainer_change(new: Layout, old: Layout) -> dict[str, str]:
    """The reference trainer's options that run ``new`` exactly as the model predicts it: the mesh,
    the schedule and its chunks per rank, the microbatches (the pipeline's, or gradient
    accumulation steps without one), and the recompute policy."""
    values: dict = {"layout": trainer_layout(new), "schedule": new.schedule}
    if new.schedule in INTERLEAVED:
        values["virtual_stages"] = new.vpp
    overrides: dict = {}
    if new.pp > 1:
        values["microbatches"] = new.microbatches
        if old.pp == 1 and old.microbatches > 1:
            overrides["grad_accum"] = 1
    else:
        overrides["grad_accum"] = new.microbatches
    if new.recompute != old.recompute:
        overrides["recompute"] = new.recompute
    return TrainerOptions.change(overrides=overrides or None, **values)


def _same(a: Layout, b: Layout) -> bool:
    keys = ("tp", "pp", "vpp", "dp_replicate", "dp_shard", "cp", "ep", "micro_batch", "schedule", "recompute")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def trainer_layout(lay: Layout) -> str:
    """The cost model's layout in the text form the trainer's ``--layout`` takes."""
    return Degrees(pp=lay.pp, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, cp=lay.cp, tp=lay.tp,
                   ep=lay.ep).text()


def _titan_flags(lay: Layout) -> str:
    flags = (f"--parallelism.tensor_parallel_degree {lay.tp} --parallelism.context_parallel_degree {lay.cp} "
             f"--parallelism.pipeline_parallel_degree {lay.pp} --parallelism.data_parallel_shard_degree {lay.dp_shard} "
             f"--parallelism.data_parallel_replicate_degree {lay.dp_replicate} "
             f"--parallelism.expert_parallel_degree {lay.ep}")
    if lay.pp > 1:
        flags += (f" --parallelism.pipeline_parallel_schedule {_TITAN_SCHEDULES[lay.schedule]}"
                  f" --parallelism.pipeline_parallel_microbatch_size {lay.micro_batch}")
    return flags + f" --activation_checkpoint.mode {lay.recompute}"


def _megatron_flags(lay: Layout) -> str:
    flags = (f"--tensor-model-parallel-size {lay.tp} --pipeline-model-parallel-size {lay.pp} "
             f"--context-parallel-size {lay.cp} --expert-model-parallel-size {lay.ep} "
             f"--micro-batch-size {lay.micro_batch}")
    if lay.vpp > 1:
        flags += f" --num-virtual-stages-per-pipeline-rank {lay.vpp}"
    if lay.recompute != "none":
        flags += f" --recompute-granularity {lay.recompute}"
    return flags


#: The host-memory copy rate an async save's staging is taken at: DCP's default stager copies each
#: tensor into pageable host memory (device-to-host over PCIe on a GPU, a memcpy on a CPU; about
#: 10 GB/s is the order of both).  An assumption; a save's fixed costs (planning, the hand-off to the
#: background thread) are not in it, and the measurement shows them on small models.
STAGING_BYTES_PER_S = 10e9


def async_checkpoint(run: MeasuredRun) -> list[Change]:
    """The training thread is blocked in synchronous checkpoint saves: save asynchronously -- the
    call stages the state (parameters and optimizer state) into host memory and the shards are
    written in the background -- into a folder of its own under the run's checkpoint folder (the
    base run's saves are left as they are)."""
    if not run.checkpoint:
        return []
    spec = parse_checkpoint(run.checkpoint)
    if spec.mode != "sync" or not _applies(run, "async_checkpoint", "checkpoint"):
        return []
    mem = memory_model.estimate(run.model, run.layout, run.training.seq_len, dtype=run.training.dtype)
    staging_s = (mem.weights_bytes + mem.optimizer_bytes) / STAGING_BYTES_PER_S / spec.every
    async_spec = f"every={spec.every},mode=async,dir={Path(spec.dir) / 'async'}"
    return [Change("async_checkpoint", f"save checkpoints asynchronously (every {spec.every} steps: staged, then "
                   "written in the background)", run.layout, replace(run.training, checkpoint_s=staging_s),
                   TrainerOptions.change(checkpoint=async_spec), dict(FIXES["async_checkpoint"].flags))]


_TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                    "zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}


CATALOGUE: dict[str, Callable[..., list[Change]]] = {
    "more_microbatches": more_microbatches,
    "interleaved_schedule": interleaved_schedule,
    "rebalance_stages": rebalance_stages,
    "less_recompute": less_recompute,
    "overlap_dp_grads": overlap_dp_grads,
    "overlap_tp_comm": overlap_tp_comm,
    "fuse_elementwise": fuse_elementwise,
    "cuda_graphs": cuda_graphs,
    "keep_weights_gathered": keep_weights_gathered,
    "better_layout": better_layout,
    "async_checkpoint": async_checkpoint,
}
