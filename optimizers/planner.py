"""The layout planner: every legal layout for a model on N GPUs, pruned by memory, ranked by the model.

Generators of legal values, cheapest test first (calculon's and DeepSpeed's
autotuner's order): divisibility rules, then the memory model, and only then
the step-time model -- in order of each layout's compute bound (its compute
alone, which no communication or bubble can shorten), stopping where the bound
falls below the top layouts' predictions (branch and bound: the same ranking,
a third of the predictions for a MoE model at 1,024 GPUs).  Every layout that
loses is counted under the reason it lost, with one example, so a user sees why
the planner did not pick what they expected.

What is searched:

- tp in powers of two up to the GPUs of one node (a TP group spanning nodes is
  tried only when no layout fits otherwise, and said so);
- cp in powers of two up to 8 (for sequences of 16k tokens and more);
- pp dividing the rest, up to the layer count and 64; schedules 1F1B,
  interleaved 1F1B with v = 2 and 4, and ZB-V, when pp > 1;
- the data ranks as FSDP (dp_shard), HSDP (shards within a node, replicas
  across), or DDP with ZeRO-1 (Megatron's distributed optimizer);
- ep in powers of two dividing the experts and the data x context ranks (MoE), and, folded over
  tp x cp x data ranks (Megatron-Core's MoE Parallel Folding), dividing those when tp > 1;
- micro-batch sizes 1, 2, 4, 8 that divide the global batch; recompute none,
  selective, full.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from .cost import memory as memory_model
from .model import Prediction, compute_bound_s, predict
from .spec import Layout, ModelSpec, Training
from .system import Profile, System

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
MAX_PP = 64


def _pow2(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


@dataclass
class Plan:
    ranked: list[tuple[Layout, Prediction]]
    rejected: Counter = field(default_factory=Counter)        # reason family -> layouts
    examples: dict[str, str] = field(default_factory=dict)     # reason family -> one layout and its detail
    considered: int = 0
    tp_across_nodes: bool = False


def describe(layout: Layout) -> str:
    parts = [f"tp={layout.tp}" + ("+sp" if layout.sequence_parallel and layout.tp > 1 else "")]
    if layout.cp > 1:
        parts.append(f"cp={layout.cp}")
    if layout.pp > 1:
        parts.append(f"pp={layout.pp}" + (f"x{layout.vpp}" if layout.vpp > 1 else "") + f" {layout.schedule}")
    if layout.dp_shard > 1 and layout.dp_replicate > 1:
        parts.append(f"hsdp={layout.dp_replicate}x{layout.dp_shard}")
    elif layout.dp_shard > 1:
        parts.append(f"fsdp={layout.dp_shard}")
    elif layout.dp_replicate > 1:
        parts.append(f"ddp={layout.dp_replicate}" + (f" zero{layout.zero}" if layout.zero else ""))
    if layout.ep > 1:
        parts.append(f"ep={layout.ep}" + (" folded" if layout.expert_folding else ""))
    parts.append(f"mbs={layout.micro_batch}x{layout.microbatches}")
    parts.append(f"recompute={layout.recompute}")
    return " ".join(parts)


def candidates(model: ModelSpec, gpus: int, gpus_per_node: int, global_batch: int, training: Training,
               tp_limit: int) -> Iterator[Layout]:
    seq_len = training.seq_len
    cps = [c for c in _pow2(8) if c == 1 or seq_len >= 16384]
    # With flash attention, Megatron's selective recompute (the attention core) costs and saves
    # nothing more than flash attention already does: the same layout as "none".
    recompute = RECOMPUTE if (training.selective_gemm_fraction or not training.flash_attention) else ("none", "full")
    for tp, cp in itertools.product(_pow2(tp_limit), cps):
        if gpus % (tp * cp):
            continue
        for pp in _divisors(gpus // (tp * cp), min(MAX_PP, model.n_layers)):
            dp = gpus // (tp * cp * pp)
            schedules = [("1f1b", 1)] + ([("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zbv", 2)]
                                         if pp > 1 else [])
            in_node = max(1, gpus_per_node // (tp * cp))
            shards = [(1, 1, 0)]  # (replicate, shard, zero)
            if dp > 1:
                shards = [(1, dp, 0), (dp, 1, 1)]  # FSDP; DDP with ZeRO-1
                if dp > in_node and dp % in_node == 0 and in_node > 1:
                    shards.append((dp // in_node, in_node, 0))
            eps = [(e, False) for e in _pow2(dp * cp) if model.n_experts and model.n_experts % e == 0] or [(1, False)]
            if model.n_experts and tp > 1:
                # Folded groups start inside tp: only where that is a new layout (more experts' groups
                # than the data ranks hold) or another placement (the unfolded group leaves the node,
                # the folded one stays) is it a different plan.
                eps += [(e, True) for e in _pow2(tp * cp * dp) if model.n_experts % e == 0
                        and (e > dp * cp or tp * e > gpus_per_node >= e)]
            for (sched, v), (rep, shard, zero), (ep, folded), mb, rc in itertools.product(
                    schedules, shards, eps, MICRO_BATCHES, recompute):
                if global_batch % (dp * mb):
                    continue
                yield Layout(tp=tp, pp=pp, vpp=v, dp_replicate=rep, dp_shard=shard, cp=cp, ep=ep, micro_batch=mb,
                             microbatches=global_batch // (dp * mb), schedule=sched, recompute=rc,
                             sequence_parallel=tp > 1, zero=zero, expert_folding=folded)


def plan(model: ModelSpec, gpus: int, system: System, global_batch: int, training: Training,
         profile: Profile | None = None, top: int = 10) -> Plan:
    """Rank the legal layouts that fit by predicted tokens/s per GPU; see the module docstring."""
    result = _search(model, gpus, system, global_batch, training, profile, top, system.gpus_per_node)
    if not result.ranked and system.gpus_per_node < gpus:
        wider = _search(model, gpus, system, global_batch, training, profile, top, gpus)
        if wider.ranked:
            wider.tp_across_nodes = True
            return wider
    return result


def _search(model: ModelSpec, gpus: int, system: System, global_batch: int, training: Training,
            profile: Profile | None, top: int, tp_limit: int) -> Plan:
    """Every candidate through the rules and the memory model; the ones that fit in order of their
    compute bound (:func:`compute_bound_s`), each predicted until the bound of the next is below
    the ``top``-th prediction -- it and all after it cannot rank (a bound is never below its step)."""
    out = Plan(ranked=[])
    fitting: list[tuple[float, int, Layout, memory_model.Memory]] = []
    bounds: dict[tuple, float] = {}  # the bound depends on the compute's shape and the ep group's only
    for layout in candidates(model, gpus, system.gpus_per_node, global_batch, training,
                             min(tp_limit, model.n_heads)):
        out.considered += 1
        problems = layout.problems(model, training.seq_len) + training.layout_problems(model, layout)
        if problems:
            _reject(out, "breaks a divisibility rule", layout, problems[0])
            continue
        if layout.pp > 1 and layout.microbatches < layout.pp:
            _reject(out, "fewer microbatches than pipeline stages", layout, f"m={layout.microbatches} < pp={layout.pp}")
            continue
        mem = memory_model.estimate(model, layout, training.seq_len, dtype=training.dtype,
                                    device_bytes=system.device_bytes, flash_attention=training.flash_attention,
                                    compiled=training.compiled, expert_load=training.expert_load)
        if mem.fits is False:
            _reject(out, "does not fit in memory", layout,
                    f"{mem.total_bytes / memory_model.GiB:.0f} GiB > {system.device_bytes / memory_model.GiB:.0f} GiB")
            continue
        key = (layout.tp, layout.cp, layout.ep, layout.expert_folding, layout.sequence_parallel, layout.micro_batch,
               layout.recompute, layout.stage_layers(model))
        if key not in bounds:
            bounds[key] = compute_bound_s(model, replace(layout, microbatches=1), training, system, profile)
        best_tps = layout.data_ranks * layout.micro_batch * training.seq_len / bounds[key] / layout.gpus
        fitting.append((best_tps, out.considered, layout, mem))
    fitting.sort(key=lambda f: -f[0])
    # a min-heap of the top predictions; of equal ones the earlier candidate ranks first
    scored: list[tuple[float, int, Layout, Prediction]] = []
    for i, (best_tps, order, layout, mem) in enumerate(fitting):
        if len(scored) == top and best_tps < scored[0][0]:
            for worse_tps, _, worse, _ in fitting[i:]:
                _reject(out, "fits but is slower than the top layouts", worse,
                        f"at most {worse_tps:,.0f} tokens/s/GPU")
            break
        prediction = predict(model, layout, training, system, profile, memory=mem)
        entry = (prediction.tokens_per_s_per_gpu, -order, layout, prediction)
        if len(scored) < top:
            heapq.heappush(scored, entry)
            continue
        _, _, loser, lost = heapq.heappushpop(scored, entry)
        _reject(out, "fits but is slower than the top layouts", loser, f"{lost.tokens_per_s_per_gpu:,.0f} tokens/s/GPU")
    out.ranked = [(layout, pred) for _, _, layout, pred in sorted(scored, key=lambda s: (-s[0], -s[1]))]
    return out


def _reject(out: Plan, family: str, layout: Layout, detail: str) -> None:
    out.rejected[family] += 1
    if family not in out.examples:
        out.examples[family] = f"{describe(layout)}: {detail}"

