"""One rank of the reference trainer: build, parallelize, train, write the run directory.

Order of parallelization (as torchtitan does): check the settings (checks.py),
build this rank's pipeline stages on the meta device -> tensor parallel -> context parallel
-> expert parallel (all still on meta) -> allocate and initialize only this rank's part (each
parameter seeded from its name, so the values are the full model's) -> activation
recomputation -> torch.compile ->
FSDP/DDP.  Every rank sees the same global batch of a step and takes its own
rows (data ranks) and sequence chunks (context ranks).

Run as a torchrun entry point (``python -m mfuscope.reference_trainer.train``)
or through :func:`run_rank` from the fork launcher.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a rank launched by torchrun: mfuscope's own process, imports kept lean
    from mfuscope.lean_imports import jsonschema_without_iri
    jsonschema_without_iri()

import torch
import torch.distributed as dist

from mfuscope import labels
from mfuscope.collectors.session import ProfileSession
from mfuscope.errors import UserInputError
from mfuscope.layout import virtual_stages
from mfuscope.pacing import parse_paced
from mfuscope.trainer_options import TrainerOptions, add_arguments, parse_checkpoint

from . import checkpointing, context_parallel, data_parallel, expert_parallel, pipeline_parallel, tensor_parallel
from .checks import check_run, reshard_after_forward
from .config import TrainConfig, load_config
from .data import global_batch, shard_rows
from .faults import parse_faults
from .inject import Injector, apply_paced
from .model import Experts, attention_backend, cross_entropy
from .optimizers import PartOptimizers
from .parallel_dims import ParallelDims


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _strip(name: str) -> str:
    """Parameter name without the wrappers' additions (DDP, torch.compile, checkpointing)."""
    name = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
    return name.removeprefix("module.")


def run_rank(opts: TrainerOptions, instrument: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Train on this rank; returns {'losses': [...], 'step_times': [...]} (rank-local).
    ``instrument`` (benchmarks): rank -> a context manager with ``.step(tokens, loss)``, used
    instead of the collectors."""
    cfg: TrainConfig = load_config(opts.config, steps=opts.steps, microbatches=opts.microbatches, **opts.overrides)
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    dims = ParallelDims.parse(opts.layout, world)
    check_run(cfg, dims, opts)
    device = _device()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    if device.type == "cpu":
        torch.set_num_threads(1)  # many ranks share few cores
    coords = dims.coords(rank)
    mesh = dims.mesh

    # --- this rank's pipeline stages (the whole model without pp), built on meta; sharded there by
    # tensor and expert parallelism, then materialized: a rank allocates only its part
    if dims.pp > 1:
        ids = pipeline_parallel.stage_ids(opts.schedule, dims.pp, coords["pp"], opts.virtual_stages)
        n_stages = dims.pp * len(ids)
    else:
        ids, n_stages = [0], 1
    modules = [pipeline_parallel.build_stage(cfg.model, cfg.seq_len, cfg.seed, s, n_stages, "meta", opts.stage_layers)
               for s in ids]

    injector = Injector(parse_faults(opts.inject), rank, cfg.seed)
    paced = parse_paced(opts.paced)
    local_experts: list = []  # experts no other rank holds: outside FSDP, averaged by the trainer
    expert_mesh = None         # where other ranks hold the same experts: FSDP shards them over these
    extra_groups = {}
    if cfg.model.n_experts and dims.grad_ranks * dims.tp > 1:
        # The balance loss counts the tokens of every rank that routes different ones: data, context
        # and (each on its own sequence shard) tensor-parallel ranks.  Labelled as what it is.
        extra_groups["moe_aux"] = mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("moe_aux").get_group()
    if dims.cp > 1:
        extra_groups["cp"] = context_parallel.kv_group(mesh, dims)
    for m in modules:
        if dims.tp > 1:
            tensor_parallel.apply_tp(m, dims, cfg.sequence_parallel)
        if dims.cp > 1:
            context_parallel.apply_cp(m, extra_groups["cp"], dims.cp, coords["cp"], cfg.seq_len)
        m.balance_group = extra_groups.get("moe_aux")
    if cfg.model.n_experts and dims.ep > 1:
        ep_group, ep_rank, edp_group = expert_parallel.expert_groups(dims, rank)
        for m in modules:
            expert_parallel.apply_ep(m, ep_group, dims.ep, ep_rank)
        expert_mesh = expert_parallel.expert_mesh(edp_group, device.type)
        extra_groups.update(ep=ep_group, ep_dp=edp_group)
    for m in modules:
        pipeline_parallel.materialize(m, device)
    if cfg.model.n_experts and dims.ep > 1 and expert_mesh is None:
        local_experts = expert_parallel.expert_parameters(modules)
    if opts.kernels == "fused":
        from mfuscope.kernels import apply as fuse
        from mfuscope.kernels.apply import OPS
        for m in modules:
            fuse(m, ops=OPS)
    injector.attach_modules(modules, ids)
    if paced:
        apply_paced(modules, paced)
    if cfg.recompute != "none":
        _apply_recompute(modules, cfg.recompute)
    if opts.async_tp:
        tensor_parallel.enable_async_tp(mesh["tp"].get_group(), device)
    if cfg.compile:
        # MoE layers read their rows per expert to the host (split sizes): traced into the graph as
        # data-dependent sizes instead of breaking it at every element.
        torch._dynamo.config.capture_scalar_outputs = True
        # cuda_graphs: inductor's CUDA graph trees replay each block's kernels with one launch.
        mode = "reduce-overhead" if cfg.cuda_graphs else None
        for m in modules:
            for name, block in list(m.layers.items()):
                m.layers[name] = torch.compile(block, mode=mode)
    param_dtype = torch.bfloat16 if cfg.dtype == "bf16" else None
    if dims.grad_ranks > 1:
        if opts.dp_mode == "ddp":
            modules = [data_parallel.apply_ddp(m, dims, bucket_mb=opts.ddp_bucket_mb,
                                               as_bucket_view=opts.grad_as_bucket_view) for m in modules]
            if injector.of("link"):  # DDP reduces in C++; its Python hook makes the slow link reachable
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
                modules[0].register_comm_hook(modules[0].process_group, allreduce_hook)
        else:
            reshard = reshard_after_forward(dims, opts.reshard_after_forward)
            modules = [data_parallel.apply_fsdp(m, dims, reshard_after_forward=reshard, param_dtype=param_dtype,
                                                ignored_params=set(local_experts) or None, expert_mesh=expert_mesh,
                                                prefetch=opts.prefetch, keep_last_gathered=opts.keep_last_gathered)
                       for m in modules]
    # MoE weights replicated over tp (each tp rank routes its own sequence shard): gradients summed over tp.
    tp_moe_params = tensor_parallel.moe_params(modules) if dims.tp > 1 and cfg.model.n_experts else []

    params = [p for m in modules for p in m.parameters()]
    opt = PartOptimizers(modules, lambda part: torch.optim.SGD(part, lr=cfg.lr) if cfg.optimizer == "sgd"
                         else torch.optim.AdamW(part, lr=cfg.lr, weight_decay=0.0))
    first_step = 0
    if opts.resume:  # before the injector wraps the optimizer: making its state is not a training step
        first_step, save = checkpointing.resume(opts.resume, modules, opt, cfg.global_batch)
        if rank == 0:
            print(f"resumed from {save}: {first_step} steps done", flush=True)
    injector.attach_optimizer(opt)
    injector.slow_links(_groups_by_dim(dims, extra_groups))  # before the collectors wrap the same calls

    if dims.tp > 1:  # vocab-sharded logits: forward and backward of the loss under loss_parallel
        from torch.distributed.tensor.parallel import loss_parallel as loss_context
    else:
        from contextlib import nullcontext as loss_context
    loss_fn = cross_entropy
    # bf16 on GPU: FSDP casts sharded parameters itself; autocast covers the matmuls in every case.
    bf16 = cfg.dtype == "bf16" and device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    schedule = None
    if dims.pp > 1:
        stages = pipeline_parallel.pipeline_stages(modules, ids, dims, device)
        schedule = pipeline_parallel.build_schedule(stages, opts.schedule, cfg.microbatches, loss_fn)
    has_first, has_last = 0 in ids, n_stages - 1 in ids

    dp_rows = dims.dp_replicate * dims.dp_shard
    dp_index = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"]
    # Microbatch m of every data rank comes from chunk m of the global batch, so MoE routing
    # statistics (taken per microbatch) are those of single-process gradient accumulation.
    chunks = cfg.microbatches if dims.pp > 1 else cfg.grad_accum
    losses, step_times = [], []
    tokens_per_step = cfg.global_batch * cfg.seq_len
    session = (instrument(rank) if instrument else
               _session(opts, cfg, dims, modules[0], extra_groups, tokens_per_step))
    loop_starts, grads = [], []
    if opts.collective_timeout:
        _set_collective_timeout(opts.collective_timeout)
    saver = None
    if opts.checkpoint:
        saver = checkpointing.Checkpointer(parse_checkpoint(opts.checkpoint), rank, world,
                                           on_background=lambda done, s: session.checkpoint_background(done - 1, s))
    with session:
        for step in range(first_step, cfg.steps):
            loop_starts.append(time.perf_counter())
            tokens = shard_rows(global_batch(cfg, step), chunks, dp_rows, dp_index)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            if dims.cp > 1:
                inputs = context_parallel.shard_sequence(inputs, dims.cp, coords["cp"])
                targets = context_parallel.shard_sequence(targets, dims.cp, coords["cp"])
            inputs, targets = inputs.to(device), targets.to(device)
            _sync(device)  # step times are the device's: the host only enqueues work on a GPU
            start = time.time_ns()
            if cfg.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # a new iteration: last step's graph outputs are free
            with torch.profiler.record_function(labels.step_label(step)), loss_context(), autocast():
                injector.begin_step(step)
                opt.zero_grad(set_to_none=True)
                if schedule is not None:
                    mb_losses: list = []
                    kwargs = {"target": targets, "losses": mb_losses} if has_last else {}
                    if has_first:
                        schedule.step(inputs, **kwargs)
                    else:
                        schedule.step(**kwargs)
                    local = torch.stack([mb_loss.detach() for mb_loss in mb_losses]).mean() if has_last else None
                else:
                    local = torch.zeros((), device=device)
                    micro = cfg.grad_accum
                    for i, (chunk_in, chunk_t) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro))):
                        # DDP all-reduces once, after the last accumulation step.
                        no_sync = getattr(modules[0], "no_sync", None) if i < micro - 1 else None
                        with no_sync() if no_sync else contextlib.nullcontext(), _nvtx(f"microbatch {i}"):
                            loss = modules[0](chunk_in, chunk_t)  # the model's own loss: a fused head needs it
                            loss.backward()
                        local = local + loss.detach() / micro
                    if micro > 1:  # as the pipeline schedules do: the MoE balance-loss gradient scales too
                        for p in params:
                            if p.grad is not None:
                                p.grad.div_(micro)
                if local_experts:
                    expert_parallel.scale_local_expert_grads(local_experts, dims.grad_ranks)
                if tp_moe_params:
                    tensor_parallel.reduce_moe_grads(tp_moe_params, mesh["tp"].get_group())
                if dims.tp > 1:
                    tensor_parallel.replicate_partial_grads(params)
                if opts.result:
                    grads.append(_full_grads(modules))
                opt.step()
                if saver is not None and saver.due(step + 1):
                    with session.checkpoint(saver.spec.mode):
                        saver.save(step + 1, modules, opt, samples=(step + 1) * cfg.global_batch, layout=dims.text(),
                                   before_commit=injector.in_checkpoint)
                # inside the step's marker: on a GPU the marker then spans the device's work, not
                # only the host's enqueueing (an H200 run's markers held two thirds of each step)
                _sync(device)
            end = time.time_ns()
            loss_value = _step_loss(local, device, dims, mesh)
            losses.append(loss_value)
            step_times.append((end - start) / 1e9)
            if loss_value is not None and _prints_loss(coords):
                print(f"step {step}  loss {loss_value:.6f}  {(end - start) / 1e6:.1f} ms", flush=True)
            session.step(tokens=tokens_per_step, loss=loss_value)
        if saver is not None:
            saver.wait()  # the last async save written and committed before the run ends
    if dims.pp > 1:
        losses = _share_losses(losses, device, coords if has_last else None)

    loop_starts.append(time.perf_counter())
    # step_times: the training step itself; loop_times: the whole iteration, instrumentation included
    result = {"losses": losses, "step_times": step_times,
              "loop_times": [b - a for a, b in zip(loop_starts, loop_starts[1:])]}
    if opts.result:
        Path(opts.result).mkdir(parents=True, exist_ok=True)
        torch.save({"grads": grads, **result}, Path(opts.result) / f"rank{rank}.pt")
    dist.barrier()
    return result


def _session(opts: TrainerOptions, cfg: TrainConfig, dims: ParallelDims, model, extra_groups: dict,
             tokens_per_step: int):
    """The collectors' session for a run with ``--out``; otherwise a stand-in that does nothing."""
    if not opts.out:
        return _NoSession()
    return ProfileSession(opts.out, model=model, mesh=dims, window=opts.window, profile_memory=opts.profile_memory,
                          tokens_per_step=tokens_per_step,
                          extra_groups=extra_groups, dtype=cfg.dtype, force=opts.force,
                          manifest=manifest_sections(opts, cfg, dims))


def manifest_sections(opts: TrainerOptions, cfg: TrainConfig, dims: ParallelDims) -> dict[str, Any]:
    """What the run manifest records of the trainer's run beside what the collectors record: the
    model spec, the schedule as built, the resolved train settings, the launch options and each
    rank's coordinates -- what ``mfuscope optimize`` reads back to know what a run ran."""
    train = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"}
    m = cfg.model
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    attention = attention_backend(max(1, m.n_heads // dims.tp), max(1, m.n_kv_heads // dims.tp), m.head_dim,
                                  max(1, cfg.seq_len // dims.cp), dtype, _device())
    schedule = ({"name": opts.schedule, "microbatches": cfg.microbatches,
                 "virtual_stages": virtual_stages(opts.schedule, opts.virtual_stages)} if dims.pp > 1 else None)
    return {"model": cfg.model.spec(), "schedule": schedule, "train": train, "trainer": opts.to_manifest(),
            "kernels": {"attention": attention},
            "rank_coords": {str(r): dims.coords(r) for r in range(dims.world_size)}}


def _set_collective_timeout(seconds: float) -> None:
    """Every process group's collectives fail after ``seconds`` (set after the rendezvous and the
    groups' creation, which may take longer): a hung job then ends instead of waiting forever."""
    timeout = datetime.timedelta(seconds=seconds)
    for pg in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, pg)


def _groups_by_dim(dims: ParallelDims, extra_groups: dict) -> dict[str, list]:
    """The process groups of each dimension a slow link can be injected on (--inject link:dim=...)."""
    def group(name):
        try:
            return dims.mesh[name].get_group()
        except (KeyError, RuntimeError, ValueError):
            return None
    return {"dp": [group(n) for n in ("dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp")]
                  + [extra_groups.get("ep_dp")],
            "pp": [group("pp")], "cp": [extra_groups.get("cp")], "ep": [extra_groups.get("ep")]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nvtx(name: str):
    """An NVTX range on GPU (Nsight Systems shows microbatches); nothing on CPU."""
    return torch.cuda.nvtx.range(name) if torch.cuda.is_available() else contextlib.nullcontext()


class _NoSession(contextlib.nullcontext):
    def step(self, tokens=None, loss=None) -> int:
        return -1

    def checkpoint(self, mode: str = "sync"):
        return contextlib.nullcontext()

    def checkpoint_background(self, step: int, seconds: float, mode: str = "async") -> None:
        pass


def _step_loss(local: torch.Tensor | None, device, dims: ParallelDims, mesh) -> float | None:
    """The loss of the global batch, on the ranks that hold one (None elsewhere).

    Without a pipeline every rank holds one: their mean over the world.  With one, only the last
    stage's ranks do, and they average it over their data ranks alone.  A world all-reduce here
    would hold the other stages after their step's marker until the first stage finished its last
    backward: the last stage's drain, a pipeline's own bubble, waited outside every step's window
    (on a 2-stage CPU run its windows were 131 ms a step against the first stage's 160).  As
    Megatron-LM and torchtitan do, nothing crosses the stages to report a step's loss."""
    if dims.pp > 1 and local is None:
        return None
    value = local.full_tensor() if hasattr(local, "full_tensor") else local
    buf = torch.tensor([float(value), 1.0], device=device, dtype=torch.float64)
    if dims.pp == 1:
        dist.all_reduce(buf)  # every rank holds it
    elif dims.dp_replicate * dims.dp_shard * dims.cp > 1:
        dist.all_reduce(buf, group=mesh["dp_cp"].get_group())  # the last stage's data ranks
    return float(buf[0] / buf[1])


def _prints_loss(coords: dict[str, int]) -> bool:
    """Of the ranks that hold the loss, the one that prints it: rank 0, or with a pipeline the first
    rank of the stage that computes the loss."""
    return all(coords[d] == 0 for d in ("dp_replicate", "dp_shard", "cp", "tp"))


def _share_losses(losses: list[float | None], device, coords: dict[str, int] | None) -> list[float]:
    """Every rank's copy of the run's losses, from the rank that printed them (``coords``: this
    rank's, where it holds the loss): one all-reduce after the last step, outside every window."""
    buf = torch.zeros(len(losses), 2, device=device, dtype=torch.float64)
    if coords is not None and _prints_loss(coords):
        buf[:, 0] = torch.tensor(losses, dtype=torch.float64)
        buf[:, 1] = 1.0
    dist.all_reduce(buf)
    return (buf[:, 0] / buf[:, 1]).tolist()


def _apply_recompute(modules, mode: str) -> None:
    """full: every block's activations are recomputed in backward; selective: the attention core only
    (scores, softmax and the weighted sum, Korthikanti et al. 2022), which is what ``flops.py`` counts
    for HFU.  Under context parallelism the core includes the K/V all-gathers, which run again."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    def recomputed(fn):
        return lambda q, k, v: checkpoint(fn, q, k, v, use_reentrant=False, preserve_rng_state=False)

    for m in modules:
        for name, block in list(m.layers.items()):
            if mode == "full":
                m.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
            else:
                block.attention.attention_fn = recomputed(block.attention.attention_fn)


def _full_grads(modules) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor, by parameter name (DTensors gathered; expert
    weights, of which a rank may hold a slice, keyed ``name@first_expert``).  Every rank of a stage
    calls this: the gathers are collectives."""
    out = {}
    for m in modules:
        offsets = {_strip(n): mod.offset for n, mod in m.named_modules() if isinstance(mod, Experts)}
        for name, p in m.named_parameters():
            value = p.grad
            if value is None:
                continue
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            key = _strip(name)
            owner = key.rsplit(".", 1)[0]
            if owner in offsets:
                key = f"{key}@{offsets[owner]}"
            out[key] = value.detach().cpu().clone()
    return out


def parse_args(argv: list[str] | None = None) -> TrainerOptions:
    p = argparse.ArgumentParser(prog="mfuscope.reference_trainer.train", description=__doc__.split("\n")[0])
    add_arguments(p)
    return TrainerOptions.from_args(p.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    try:
        run_rank(parse_args(argv))
    except UserInputError as e:
        print(f"mfuscope train: error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
