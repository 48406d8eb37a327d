"""One record per fix: when it applies, what it is estimated to save, what it changes, and the
switches that make it in the frameworks people train with.

Findings (:mod:`mfuscope.analyzers.findings`) and the optimize catalogue
(:mod:`mfuscope.optimizers.fixes`) both read these records, so a fix's threshold is one number:
the analyzers raise a finding where the optimizer would propose a change.  How much a change
would really gain is the cost model's call (optimize); the ``gain`` here is the analyzers' quick
estimate from the trace alone, for jobs with no model spec.

Thresholds are shares of the step (the evidence's seconds over the step time) unless the record's
``evidence`` says otherwise.  Where it said so, a threshold that findings and the catalogue held
apart was set to the catalogue's (``fuse_elementwise`` 15% -> 10%; ``cuda_graphs`` 10% -> 5%) or
the findings' (exposed data-, tensor-, context- and expert-parallel communication, 1% -> 5%).

Sources of the flags: torchtitan's job config (``torchtitan/config``), Megatron-LM's
``arguments.py``, PyTorch's FSDP2 / DDP / pipelining / inductor documentation.  Torch-free.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fix:
    id: str
    evidence: str                    # what in the report it reads
    threshold: float | None          # the evidence's level from which it applies; None: no threshold of its own
    gain: str                        # how the analyzers estimate the seconds it saves
    gain_share: float | None         # that estimate as a share of the evidence's seconds, where it is one
    changes: str                     # what it changes in the reference trainer (trainer options, settings)
    flags: Mapping[str, str] = field(default_factory=dict)   # torchtitan / megatron / pytorch

    def applies(self, share: float) -> bool:
        """The evidence reaches this fix's threshold."""
        return self.threshold is None or share >= self.threshold


_FIXES = (
    Fix("overlap_dp_grads", "an exposed data-parallel communication leaf (dp*, fsdp), share of the step", 0.05,
        "the exposed time", 1.0,
        "FSDP: --prefetch (async gathers a block ahead); DDP: --ddp-bucket-mb of one layer's gradients",
        {"torchtitan": "--parallelism.fsdp_reshard_after_forward never (weights stay gathered into backward, memory "
                       "permitting); HSDP: --parallelism.data_parallel_replicate_degree R to shard inside a node",
         "megatron": "--overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer",
         "pytorch": "fully_shard: block.set_modules_to_forward_prefetch([next_block]) and "
                    "set_modules_to_backward_prefetch([prev_block]); "
                    "DDP(bucket_cap_mb=..., gradient_as_bucket_view=True)"}),
    Fix("keep_weights_gathered", "exposed FSDP all-gathers (comm/dp/all_gather) without a pipeline, share of the "
        "step", 0.05, "the backward's gathers it saves (the cost model's)", None,
        "--keep-last-gathered, or --no-reshard-after-forward (memory permitting)",
        {"torchtitan": "--parallelism.fsdp_reshard_after_forward never",
         "megatron": "(distributed optimizer: --overlap-param-gather)",
         "pytorch": "fully_shard(block, reshard_after_forward=False)"}),
    Fix("overlap_tp_comm", "an exposed tensor-, context- or expert-parallel communication leaf, share of the "
        "step", 0.05, "half the exposed time (async TP overlaps about that much)", 0.5,
        "--async-tp with --set compile=true (GPU runs)",
        {"torchtitan": "--parallelism.enable_async_tensor_parallel --compile.enable",
         "megatron": "--tp-comm-overlap (Transformer Engine userbuffers) with --sequence-parallel",
         "pytorch": "torch._inductor.config._micro_pipeline_tp = True; enable_symm_mem_for_group(tp_group); "
                    "torch.compile"}),
    Fix("more_microbatches", "the pipeline bubble, share of the step", 0.05,
        "the bubble minus the theory's at twice the microbatches (both over the pipeline's time)", None,
        "--microbatches m x 2, m x 4 (the micro-batch / 2, / 4)",
        {"torchtitan": "a smaller --parallelism.pipeline_parallel_microbatch_size (more microbatches per step)",
         "megatron": "a smaller --micro-batch-size at the same --global-batch-size",
         "pytorch": "Schedule*(stage, n_microbatches=<larger>)"}),
    Fix("interleaved_schedule", "the pipeline bubble of GPipe or 1F1B, share of the step", 0.05,
        "half the bubble", 0.5, "--schedule interleaved_1f1b or zbv (two chunks a rank)",
        {"torchtitan": "--parallelism.pipeline_parallel_schedule Interleaved1F1B (or ZBVZeroBubble)",
         "megatron": "--num-layers-per-virtual-pipeline-stage N",
         "pytorch": "ScheduleInterleaved1F1B(stages, n_microbatches) with 2+ stages per rank"}),
    Fix("rebalance_stages", "pipeline stage imbalance: the busiest stage's excess over the mean (findings) or "
        "the lightest (the catalogue's measured compute)", 0.10, "the busiest stage's excess", None,
        "--stage-layers: layers moved off the busiest stage",
        {"torchtitan": "--parallelism.pipeline_parallel_split_points layers.N,... (fewer layers on the busiest stage)",
         "megatron": "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, "
                     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
         "pytorch": "cut the PipelineStage modules at other layer boundaries"}),
    Fix("less_recompute", "activation recomputation on (the layout)", None, "the recomputed forward (the cost "
        "model's)", None, "--set recompute=selective or none",
        {"torchtitan": "--activation_checkpoint.mode selective (or none)",
         "megatron": "--recompute-granularity selective (or drop it)",
         "pytorch": "checkpoint_wrapper with a selective policy (or none)"}),
    Fix("straggler_rank", "a rank whose steps hold the others up (stragglers' cost)", None, "its cost", 1.0,
        "none: a machine's problem, not the job's",
        {"torchtitan": "(no flag) check the rank's GPU clocks, thermals and NIC; exclude the node",
         "megatron": "(no flag) --log-straggler to track it; exclude the node",
         "pytorch": "(no flag) nvidia-smi -q -d PERFORMANCE,CLOCK on the rank's host"}),
    Fix("fuse_elementwise", "compute/norm_elementwise of an eager job, share of the step", 0.10,
        "half of it (fused kernels read memory once)", 0.5, "--kernels fused, or --set compile=true",
        {"torchtitan": "--compile.enable",
         "megatron": "keep the fusions on (drop --no-bias-swiglu-fusion, --no-masked-softmax-fusion); "
                     "--apply-rope-fusion",
         "pytorch": "torch.compile(block) per transformer block"}),
    Fix("reduce_host_overhead", "host_bound + idle: the device idle with nothing queued while the host works or "
        "runs Python, share of the step (not in steps that capture CUDA graphs)", 0.10, "that time", 1.0,
        "none of its own: cuda_graphs, compile",
        {"torchtitan": "--compile.enable; a larger local batch",
         "megatron": "--enable-cuda-graph; a larger --micro-batch-size",
         "pytorch": "no .item()/.cpu() inside the step, pin_memory=True and non_blocking copies, torch.compile"}),
    Fix("cuda_graphs", "host_bound + idle, share of the step, on launch-bound ranks (most kernels under 10 us, "
        "their launches at least a quarter of the host-bound time) of a job that replays no graphs yet", 0.05,
        "the host-bound time (graphs launch once)", 1.0,
        "--set compile=true --set cuda_graphs=true (no FSDP, no MoE)",
        {"torchtitan": "--compile.enable (inductor's cudagraph trees need static shapes)",
         "megatron": "--enable-cuda-graph",
         "pytorch": "torch.compile(mode='reduce-overhead') or torch.cuda.graphs around the step"}),
    Fix("wait_on_dependency", "queued: the device idle with work already queued (a stream, event or peer "
        "dependency), share of the step", 0.10, "that time (what removing the wait could give back)", 1.0,
        "none of its own: find what the queued work waits for (the other ranks' traces; the host's blocking call)",
        {"torchtitan": "(no flag) look at the peer ranks' traces for the collective or copy the stream waits on",
         "megatron": "(no flag) --timing-log-level 2 shows which collective or copy the step waits in",
         "pytorch": "no .item()/.cpu()/.tolist() or DtoH copy into pageable memory inside the step; "
                    "copy(non_blocking=True) into pinned memory; record events instead of synchronizing"}),
    Fix("faster_data_loading", "data_loading: the device idle while the loop waits in its DataLoader, share of "
        "the step", 0.05, "that time", 1.0, "none in the reference trainer (its batches are synthetic)",
        {"torchtitan": "--training.dataset_path on fast local storage; more dataloader workers in the dataset "
                       "builder",
         "megatron": "--num-workers N; a preprocessed (indexed) dataset",
         "pytorch": "DataLoader(num_workers=N, pin_memory=True, persistent_workers=True, prefetch_factor=4)"}),
    Fix("async_checkpoint", "checkpoint: the training thread blocked in checkpoint saves, share of the step", 0.05,
        "that time (an async save still stages the state into host memory, usually a small part of it)", 1.0,
        "--checkpoint every=N,mode=async,dir=DIR (reference_trainer/checkpointing.py)",
        {"torchtitan": "--checkpoint.async_mode async_with_pinned_mem",
         "megatron": "--async-save (with --ckpt-format torch_dist)",
         "pytorch": "torch.distributed.checkpoint.async_save(state_dict, checkpoint_id=..., "
                    "process_group=dist.new_group(backend='gloo'))"}),
    Fix("fewer_copies", "memory: the device only copying or filling, share of the step", 0.05, "that time", 1.0,
        "none in the reference trainer",
        {"torchtitan": "(no flag) keep tensors on the device; pinned, non-blocking input copies",
         "megatron": "(no flag) --use-distributed-optimizer keeps optimizer state off the copy path",
         "pytorch": "pin_memory=True and .to(device, non_blocking=True); no .cpu() or .contiguous() copies in the "
                    "step; DtoD copies of views (cat, contiguous) fused by torch.compile"}),
    Fix("caching_allocator", "allocator: the device idle while the host is in cudaMalloc/cudaFree/hipFree, share "
        "of the step", 0.05, "that time", 1.0, "none in the reference trainer",
        {"torchtitan": "(no flag) no torch.cuda.empty_cache() in the loop",
         "megatron": "(no flag) no torch.cuda.empty_cache() in the loop",
         "pytorch": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; no empty_cache() in the loop; "
                    "preallocate buffers"}),
    Fix("overlap_comm", "an exposed communication leaf whose parallel dimension is unknown (no process-group "
        "names in the trace), share of the step", 0.05,
        "the exposed time, at most the compute it could hide behind", 1.0,
        "name the process groups (DeviceMesh) so the dimension is known; then the dimension's own fix",
        {"torchtitan": "(dimension's fix) FSDP prefetch or async TP once the dimension is known",
         "megatron": "--overlap-grad-reduce --overlap-param-gather; --tp-comm-overlap",
         "pytorch": "DDP(bucket_cap_mb=25) buckets per-parameter all-reduces; comm hooks on a side stream; "
                    "init_device_mesh(..., mesh_dim_names=...) names the groups"}),
    Fix("mixed_precision", "compute/conv + compute/gemm in FP32 kernels without tensor cores (cuBLAS sgemm, cuDNN "
        "scudnn / float engines), share of the step", 0.10,
        "their time (what-if: on tensor cores; bf16/fp16 or TF32 math runs several times faster)", 1.0,
        "none: the reference trainer computes in bf16 on GPUs",
        {"torchtitan": "--training.mixed_precision_param bfloat16",
         "megatron": "--bf16 (or --fp16)",
         "pytorch": "torch.autocast('cuda', dtype=torch.bfloat16); convolutions in channels_last; "
                    "torch.backends.cuda.matmul.allow_tf32 = True and torch.backends.cudnn.allow_tf32 = True"}),
    Fix("fused_optimizer", "compute/optimizer: the optimizer step, share of the step", 0.10,
        "the optimizer step's time (a fused step on the device takes a fraction of it)", 1.0,
        "none: the reference trainer steps foreach already",
        {"torchtitan": "--optimizer.implementation fused",
         "megatron": "--use-distributed-optimizer (the optimizer step sharded over data-parallel ranks)",
         "pytorch": "torch.optim.AdamW(params, fused=True) (or foreach=True); the step on the device"}),
    Fix("one_time_init", "one_time_init: the device idle while the host initializes (context, module loads, "
        "streams), seconds in the window", None, "none: start-up is paid once, never per step", None,
        "none: profile steady-state steps (a later --window)",
        {"torchtitan": "--profiling.profile_freq past the first steps",
         "megatron": "--profile-step-start past the warm-up",
         "pytorch": "torch.profiler.schedule(wait=1, warmup=2, active=3): trace steady steps only; "
                    "CUDA_MODULE_LOADING=EAGER moves lazy loads to start-up"}),
    Fix("balance_experts", "the expert-parallel routing's imbalance: report.json's moe.expert_load, the busiest "
        "rank's routed rows over the mean, less 1 (not a share of the step)", 0.10,
        "the exposed expert-parallel communication times (1 - 1 / load): what the exchanges wait for the busiest "
        "rank's experts beyond the mean", None,
        "(not in the reference trainer: its router's balance loss, moe_aux, is what it has; a capacity factor "
        "would drop tokens)",
        {"torchtitan": "the MoE args' load_balance_coeff (DeepSeek-V3's auxiliary-loss-free expert bias, updated "
                       "from the tokens each expert got)",
         "megatron": "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3, or --moe-aux-loss-coeff; "
                     "--moe-expert-capacity-factor 1.0 --moe-token-drop-policy probs caps the busiest expert",
         "pytorch": "a balance loss on the router's probabilities (Switch Transformer's), or a per-expert bias "
                    "on its scores that falls for the experts that got more tokens"}),
    Fix("better_layout", "the planner finds a faster layout that fits (model spec, GPUs, global batch)", None,
        "the cost model's", None, "--layout, --schedule, --microbatches",
        {"torchtitan": "the --parallelism.* degrees of the layout",
         "megatron": "the --*-model-parallel-size of the layout",
         "pytorch": "init_device_mesh with the layout"}),
)

#: Every fix, by id.
FIXES: dict[str, Fix] = {f.id: f for f in _FIXES}
