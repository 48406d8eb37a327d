"""What each finding's fix is in the frameworks people train with, for a job mfuscope cannot rerun.

A trace directory or a foreign job's run has no model spec for the cost model
and no launch command to change, so ``mfuscope optimize`` proposes the report's
findings as they stand -- the evidence and the analyzers' estimate of the
seconds at stake -- with the switches that act on each in torchtitan,
Megatron-Core and plain PyTorch.  The reference trainer's own changes, with
gains predicted by the cost model, are in :mod:`fixes`.

Sources: torchtitan's job config (``torchtitan/config``), Megatron-LM's
``arguments.py``, PyTorch's FSDP2 / DDP / pipelining / inductor documentation.
"""
from __future__ import annotations

from typing import Any

FLAGS: dict[str, dict[str, str]] = {
    "overlap_dp_grads": {
        "torchtitan": "--parallelism.fsdp_reshard_after_forward never (weights stay gathered into backward, "
                      "memory permitting); HSDP: --parallelism.data_parallel_replicate_degree R to shard inside a node",
        "megatron": "--overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer",
        "pytorch": "fully_shard: block.set_modules_to_forward_prefetch([next_block]) and "
                   "set_modules_to_backward_prefetch([prev_block]); DDP(bucket_cap_mb=..., gradient_as_bucket_view=True)",
    },
    "overlap_tp_comm": {
        "torchtitan": "--parallelism.enable_async_tensor_parallel --compile.enable",
        "megatron": "--tp-comm-overlap (Transformer Engine userbuffers) with --sequence-parallel",
        "pytorch": "torch._inductor.config._micro_pipeline_tp = True; enable_symm_mem_for_group(tp_group); torch.compile",
    },
    "more_microbatches": {
        "torchtitan": "a smaller --parallelism.pipeline_parallel_microbatch_size (more microbatches per step)",
        "megatron": "a smaller --micro-batch-size at the same --global-batch-size",
        "pytorch": "Schedule*(stage, n_microbatches=<larger>)",
    },
    "interleaved_schedule": {
        "torchtitan": "--parallelism.pipeline_parallel_schedule Interleaved1F1B (or ZBVZeroBubble)",
        "megatron": "--num-layers-per-virtual-pipeline-stage N",
        "pytorch": "ScheduleInterleaved1F1B(stages, n_microbatches) with 2+ stages per rank",
    },
    "rebalance_stages": {
        "torchtitan": "--parallelism.pipeline_parallel_split_points layers.N,... (fewer layers on the busiest stage)",
        "megatron": "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, "
                    "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
        "pytorch": "cut the PipelineStage modules at other layer boundaries",
    },
    "fuse_elementwise": {
        "torchtitan": "--compile.enable",
        "megatron": "keep the fusions on (drop --no-bias-swiglu-fusion, --no-masked-softmax-fusion); --apply-rope-fusion",
        "pytorch": "torch.compile(block) per transformer block",
    },
    "cuda_graphs": {
        "torchtitan": "--compile.enable (inductor's cudagraph trees need static shapes)",
        "megatron": "--enable-cuda-graph",
        "pytorch": "torch.compile(mode='reduce-overhead') or torch.cuda.graphs around the step",
    },
    "reduce_host_overhead": {
        "torchtitan": "--compile.enable; a larger local batch",
        "megatron": "--enable-cuda-graph; a larger --micro-batch-size",
        "pytorch": "no .item()/.cpu() inside the step, pin_memory=True and non_blocking copies, torch.compile",
    },
    "straggler_rank": {
        "torchtitan": "(no flag) check the rank's GPU clocks, thermals and NIC; exclude the node",
        "megatron": "(no flag) --log-straggler to track it; exclude the node",
        "pytorch": "(no flag) nvidia-smi -q -d PERFORMANCE,CLOCK on the rank's host",
    },
}


def proposals_from_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's findings as proposals in ``optimize.json``'s shape: nothing predicted by the
    cost model (no model spec), the analyzers' estimate of the step it could save instead."""
    step = (report.get("summary") or {}).get("step_time_s")
    out = []
    for f in report.get("findings") or []:
        out.append({"fix": f["fix"], "summary": f["title"], "change": {}, "flags": FLAGS.get(f["fix"], {}),
                    "predicted_step_s": step - f["gain_s"] if step else None,
                    "predicted_gain": f.get("gain_fraction"), "basis": "analyzer estimate from the trace "
                    "(no model spec: the cost model cannot predict)", "fits": None, "memory_gib": None,
                    "measured_step_s": None, "run": None, "note": "", "evidence": f.get("evidence")})
    return out
