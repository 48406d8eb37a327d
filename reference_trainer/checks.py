"""Every check of a training run's settings, made once, before any rank builds a model.

``mfuscope train`` runs these in the launching process, so a bad combination
is one line and exit code 2 instead of a traceback from every rank; each rank
runs them again first thing (the torchrun entry point can be started by hand).
A combination is refused when the trainer would otherwise train it wrongly or
silently ignore part of it.
"""
from __future__ import annotations

from pathlib import Path

from mfuscope.errors import UserInputError
from mfuscope.layout import INTERLEAVED, SCHEDULES, ZERO_BUBBLE, Degrees, virtual_stages
from mfuscope.trainer_options import TrainerOptions, parse_checkpoint

from .checkpoint_files import latest
from .config import TrainConfig


def reshard_after_forward(dims: Degrees, requested: bool | None) -> bool:
    """FSDP2's reshard-after-forward, defaulting as torchtitan does: on without pipeline parallelism
    (frees the gathered weights between forward and backward), off with it (a pipeline runs many
    microbatch forwards per step; resharding would re-gather the weights for every one)."""
    return dims.pp == 1 if requested is None else requested


def check_run(cfg: TrainConfig, dims: Degrees, opts: TrainerOptions) -> None:
    """Raise :class:`UserInputError` naming the first thing that cannot work as asked."""
    m = cfg.model
    schedule, dp_mode, stage_layers = opts.schedule, opts.dp_mode, opts.stage_layers
    reshard = opts.reshard_after_forward
    prefetch = opts.prefetch or opts.keep_last_gathered
    ddp_buckets, bucket_mb = opts.ddp_bucket_mb is not None or opts.grad_as_bucket_view, opts.ddp_bucket_mb
    if schedule not in SCHEDULES:
        raise UserInputError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if opts.checkpoint or opts.resume:
        if opts.checkpoint:
            parse_checkpoint(opts.checkpoint)
        if opts.resume:
            if not Path(opts.resume).is_dir():
                raise UserInputError("--resume: no such checkpoint directory", opts.resume)
            latest(opts.resume)  # a folder with no complete save fails here, once
    if dp_mode not in ("fsdp", "ddp"):
        raise UserInputError(f"dp_mode must be fsdp or ddp, not {dp_mode!r}")
    if dp_mode == "ddp" and (dims.tp > 1 or dims.pp > 1 or dims.ep > 1):
        raise UserInputError(f"layout {dims.text()}: DDP is for pure data (+context) parallelism; "
                             "use --dp-mode fsdp with tp, pp or ep")
    if dims.tp > 1:
        for what, n in (("attention heads", m.n_heads), ("KV heads", m.n_kv_heads),
                        ("vocab entries", m.vocab_size)) + ((("FFN columns", m.ffn_dim),) if not m.n_experts else ()):
            if n % dims.tp:
                raise UserInputError(f"layout tp={dims.tp}: the model's {n} {what} do not split over tp "
                                     f"(tp must divide n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}, "
                                     f"vocab_size={m.vocab_size}{'' if m.n_experts else f', ffn_dim={m.ffn_dim}'})")
        if not cfg.sequence_parallel and m.n_experts:
            raise UserInputError(f"layout tp={dims.tp} with sequence_parallel=false: the MoE layers run on each tp "
                                 "rank's sequence shard, which only sequence parallelism gives; keep it on")
        local_seq = cfg.seq_len // dims.cp
        if cfg.sequence_parallel and local_seq % dims.tp:
            raise UserInputError(f"layout tp={dims.tp}: sequence parallelism splits each rank's {local_seq} tokens "
                                 "over tp, which must divide them")
    if dims.cp > 1 and cfg.seq_len % (2 * dims.cp):
        raise UserInputError(f"layout cp={dims.cp}: seq_len {cfg.seq_len} must be divisible by 2*cp = {2 * dims.cp} "
                             "(each context rank holds an early and a late chunk)")
    if dims.ep > 1:
        if not m.n_experts:
            raise UserInputError(f"layout ep={dims.ep}: the model is dense (no experts to shard); use an MoE "
                                 "config such as tiny_moe, or drop ep")
        if m.n_experts % dims.ep:
            raise UserInputError(f"layout ep={dims.ep}: {m.n_experts} experts do not split over ep={dims.ep}")
    if prefetch and (dp_mode != "fsdp" or dims.grad_ranks == 1):
        raise UserInputError("--prefetch and --keep-last-gathered order FSDP's parameter gathers; the layout has no "
                             f"FSDP (dp_mode={dp_mode}, {dims.grad_ranks} data ranks)")
    if ddp_buckets and (dp_mode != "ddp" or dims.grad_ranks == 1):
        raise UserInputError("--ddp-bucket-mb and --grad-as-bucket-view set DDP's gradient buckets; "
                             f"the run has no DDP (dp_mode={dp_mode}, {dims.grad_ranks} data ranks)")
    if bucket_mb is not None and bucket_mb <= 0:
        raise UserInputError(f"--ddp-bucket-mb {bucket_mb:g}: a bucket holds a positive number of MiB")
    if opts.async_tp and (dims.tp == 1 or not cfg.compile):
        raise UserInputError("--async-tp overlaps tensor-parallel collectives with their GEMMs inside "
                             f"torch.compile: it needs tp > 1 (layout tp={dims.tp}) and --set compile=true")
    if cfg.cuda_graphs:
        if not cfg.compile:
            raise UserInputError("cuda_graphs replays each block compiled by torch.compile as a CUDA graph: "
                                 "add --set compile=true")
        if not _cuda_available():
            raise UserInputError("cuda_graphs captures CUDA graphs; this machine has no CUDA GPU")
        if dims.grad_ranks > 1 and dp_mode == "fsdp":
            raise UserInputError("cuda_graphs with FSDP: FSDP gathers each block's parameters into new buffers "
                                 "every step, so a graph would be recorded again each step; use --dp-mode ddp "
                                 "or drop cuda_graphs")
        if m.n_experts:
            raise UserInputError("cuda_graphs with MoE blocks: their per-expert split sizes are read to the host, "
                                 "which a CUDA graph cannot capture")
    if opts.async_tp and not _cuda_available():
        raise UserInputError("--async-tp runs on CUDA symmetric memory; this machine has no CUDA GPU")
    if stage_layers is not None and dims.pp == 1:
        raise UserInputError("--stage-layers splits the layers over pipeline stages; the layout has no pp")
    if opts.virtual_stages is not None:
        if schedule not in INTERLEAVED or dims.pp == 1:
            raise UserInputError(f"--virtual-stages sets the model chunks per rank of {' and '.join(INTERLEAVED)} "
                                 f"pipelines; {'the layout has no pp' if dims.pp == 1 else f'{schedule} has none'}")
        if opts.virtual_stages < 2:
            raise UserInputError(f"--virtual-stages {opts.virtual_stages}: an interleaved schedule runs at least 2 "
                                 "chunks per rank")
    if dims.pp > 1:
        stages = dims.pp * virtual_stages(schedule, opts.virtual_stages)
        if m.n_layers < stages:
            raise UserInputError(f"layout pp={dims.pp} with {schedule}: {stages} pipeline stages need at least "
                                 f"{stages} layers; the model has {m.n_layers}")
        if stage_layers is not None and (len(stage_layers) != stages or sum(stage_layers) != m.n_layers):
            raise UserInputError(f"--stage-layers {','.join(map(str, stage_layers))}: layout pp={dims.pp} with "
                                 f"{schedule} has {stages} stages; give {stages} counts that add up to the "
                                 f"model's {m.n_layers} layers")
        if cfg.grad_accum > 1:
            raise UserInputError("grad_accum with pipeline parallelism: the schedule's microbatches are the "
                                 "accumulation; raise --microbatches instead")
        if cfg.microbatches < 1:
            raise UserInputError(f"microbatches must be at least 1, not {cfg.microbatches}")
        if (schedule in ZERO_BUBBLE and dims.grad_ranks > 1 and dp_mode == "fsdp"
                and reshard_after_forward(dims, reshard)):
            raise UserInputError(f"schedule {schedule} with FSDP and --reshard-after-forward trains wrong (the "
                                 "weight-gradient passes run after FSDP has resharded and reduced); use "
                                 "--no-reshard-after-forward (the default with pp)")
    if cfg.grad_accum < 1:
        raise UserInputError(f"grad_accum must be at least 1, not {cfg.grad_accum}")
    chunks = cfg.microbatches if dims.pp > 1 else cfg.grad_accum
    data_ranks = dims.dp_replicate * dims.dp_shard
    if cfg.global_batch % (data_ranks * chunks):
        what = "pipeline microbatches" if dims.pp > 1 else "accumulation steps"
        raise UserInputError(f"global_batch {cfg.global_batch} does not split into {chunks} {what} x "
                             f"{data_ranks} data ranks (dp_replicate*dp_shard); set --set global_batch=N with N "
                             f"a multiple of {data_ranks * chunks}")


def _cuda_available() -> bool:
    """Asked only of the settings that need CUDA, so that checking any other run (``mfuscope train``
    checks in the launching process) does not import torch."""
    import torch

    return torch.cuda.is_available()
