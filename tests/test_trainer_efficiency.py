"""The reference trainer avoids the GPU performance traps of MoE training and model building.

Measured on CPU, by what a GPU would pay for: the host reads of device values
an MoE layer makes (each one a synchronization on a GPU: ``nonzero``,
``item``, ``bincount``'s max, ``tolist``), the all-reduces after backward
and in the balance loss (profiled ``c10d::allreduce_`` calls), the
graph breaks of a compiled MoE block, the expert weights a rank stores under
expert parallelism, and what building a pipeline stage allocates and
initializes.  That the results stay right is
test_reference_trainer's job; these tests pin the costs.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from mfuscope.reference_trainer import expert_parallel, tensor_parallel  # noqa: E402
from mfuscope.reference_trainer.config import load_config  # noqa: E402
from mfuscope.reference_trainer.data_parallel import apply_fsdp  # noqa: E402
from mfuscope.reference_trainer.launch import fork_ranks  # noqa: E402
from mfuscope.reference_trainer.model import Experts, Transformer, cross_entropy, rotary_table  # noqa: E402
from mfuscope.reference_trainer.parallel_dims import ParallelDims  # noqa: E402
from mfuscope.reference_trainer.pipeline_parallel import build_stage, layer_ranges  # noqa: E402

# Ops that read a device value on the host, so a GPU run waits there for everything queued before.
HOST_READS = ("aten::nonzero", "aten::item", "aten::_local_scalar_dense", "aten::bincount")
LAYERS = 3


def _moe_config(n_experts: int):
    cfg = load_config("tiny_moe")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_experts=n_experts, n_layers=LAYERS))


class _Costs:
    """Profiles a region; counts host reads (profiled ops and ``Tensor.tolist`` calls, which the
    profiler does not show on CPU) and collectives."""

    def __init__(self):
        self.tolist = 0

    def __enter__(self):
        self._original = torch.Tensor.tolist

        def tolist(tensor):
            self.tolist += 1
            return self._original(tensor)
        torch.Tensor.tolist = tolist
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        torch.Tensor.tolist = self._original
        self.names = [e.name for e in self._prof.events()]

    def host_reads(self) -> int:
        return sum(self.names.count(n) for n in HOST_READS) + self.tolist

    def count(self, name: str) -> int:
        return self.names.count(name)


def _step(model, cfg) -> None:
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()


@pytest.mark.parametrize("n_experts", [4, 16])
def test_an_moe_layer_reads_the_host_once_whatever_the_number_of_experts(n_experts):
    """One copy of the rows per expert per layer (the split sizes), none per expert; backward none."""
    cfg = _moe_config(n_experts)
    model = Transformer(cfg.model, cfg.seq_len)
    with _Costs() as costs:
        _step(model, cfg)
    assert costs.host_reads() == LAYERS, (costs.tolist, [n for n in costs.names if n in HOST_READS])


def _ep_rank(n_experts: int) -> dict:
    dist.init_process_group("gloo")
    cfg = _moe_config(n_experts)
    model = Transformer(cfg.model, cfg.seq_len)
    expert_parallel.apply_ep(model, dist.group.WORLD, 2, dist.get_rank())
    model.balance_group = dist.group.WORLD
    with _Costs() as forward:
        tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.seq_len + 1),
                               generator=torch.Generator().manual_seed(dist.get_rank()))
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    return {"host_reads": forward.host_reads(), "all_to_all": forward.count("c10d::alltoall_base_"),
            "balance_all_reduce": forward.count("c10d::allreduce_")}


@pytest.mark.parametrize("n_experts", [4, 8])
def test_expert_parallel_moe_costs_do_not_grow_with_layers_or_experts_where_they_need_not(n_experts):
    """Under ep=2: per layer one host read and three all-to-alls (counts, rows out, rows back); one
    balance-loss all-reduce for all the layers."""
    for rank, costs in enumerate(fork_ranks(_ep_rank, 2, n_experts)):
        assert costs == {"host_reads": LAYERS, "all_to_all": 3 * LAYERS, "balance_all_reduce": 1}, (rank, costs)


def _sharded_experts_rank() -> dict:
    dist.init_process_group("gloo")
    cfg = _moe_config(4)
    dims = ParallelDims.parse("dp_shard=4,ep=2", 4)
    model = Transformer(cfg.model, cfg.seq_len)
    ep_group, ep_rank, edp_group = expert_parallel.expert_groups(dims, dist.get_rank())
    expert_parallel.apply_ep(model, ep_group, dims.ep, ep_rank)
    held = sorted(p.numel() for p in expert_parallel.expert_parameters([model]))
    model.balance_group = dist.group.WORLD
    apply_fsdp(model, dims, expert_mesh=expert_parallel.expert_mesh(edp_group, "cpu"))
    _step(model, cfg)
    experts = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    # Lists, not tensors: tensors would travel to the parent through this rank's shared memory.
    return {"held": held, "stored": sorted(p.to_local().numel() for p in experts),
            "grads": sorted(p.grad.to_local().numel() for p in experts),
            "mesh": sorted(experts[0].device_mesh.mesh.tolist()),
            "edp": sorted(dist.get_process_group_ranks(edp_group))}


def test_experts_are_sharded_over_the_ranks_that_hold_the_same_ones():
    """dp_shard=4, ep=2: two ranks hold each half of the experts; each stores, and gets the
    gradient of, half of that half (FSDP over those two ranks), not a replica of it."""
    for rank, got in enumerate(fork_ranks(_sharded_experts_rank, 4)):
        assert got["mesh"] == got["edp"] and len(got["edp"]) == 2, (rank, got)
        assert got["stored"] == got["grads"] == [n // 2 for n in got["held"]], (rank, got)


SHAPES = [((4, 3, 2), torch.float32), ((4, 2, 3), torch.float32), ((5,), torch.float32), ((3,), torch.float64)]


def _reduce_rank() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in SHAPES]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, (rank + 1.0) * (i + 1))
    with _Costs() as costs:
        tensor_parallel.reduce_moe_grads(params, dist.group.WORLD)
    # Lists, not tensors: tensors would travel to the parent through this rank's shared memory.
    return costs.count("c10d::allreduce_"), [p.grad.tolist() for p in params]


def test_gradient_reductions_are_one_all_reduce_per_dtype():
    """tp MoE gradients (summed over tp): four tensors of two dtypes take two all-reduces, and each
    tensor gets its own values back."""
    for calls, grads in fork_ranks(_reduce_rank, 2):
        assert calls == 2, calls
        for i, (g, (shape, dtype)) in enumerate(zip(grads, SHAPES)):
            g = torch.tensor(g, dtype=dtype)
            assert torch.equal(g, torch.full(shape, (1 + 2) * (i + 1), dtype=dtype)), i


def test_a_compiled_moe_block_is_one_graph():
    """With the trainer's setting for torch.compile (the host-read split sizes traced as
    data-dependent sizes), an MoE block, routing record included, has no graph break."""
    cfg = _moe_config(4)
    model = Transformer(cfg.model, cfg.seq_len)
    block = model.layers["0"]
    block.feed_forward.routing = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        rotary = rotary_table(model.positions, cfg.model.head_dim, cfg.model.rope_theta)
        explained = torch._dynamo.explain(block)(torch.randn(2, cfg.seq_len, cfg.model.dim), rotary)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert len(block.feed_forward.routing) == 1


@pytest.mark.parametrize("n_stages", [2, 4])
def test_a_stage_built_on_meta_is_its_slice_of_the_full_model(monkeypatch, n_stages):
    """Only the stage's parameters are allocated and drawn, and they equal the full model's bit for bit."""
    cfg = load_config("tiny_moe")
    full = dict(build_stage(cfg.model, cfg.seq_len, cfg.seed, 0, 1, "cpu").named_parameters())
    drawn = []
    normal_ = torch.Tensor.normal_

    def counted(tensor, *args, **kwargs):
        if not tensor.is_meta:  # the modules' own init on meta draws nothing
            drawn.append(tensor.numel())
        return normal_(tensor, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "normal_", counted)
    for stage, layers in enumerate(layer_ranges(cfg.model.n_layers, n_stages)):
        drawn.clear()
        part = build_stage(cfg.model, cfg.seq_len, cfg.seed, stage, n_stages, "cpu")
        assert list(part.layers) == [str(i) for i in layers]
        assert (part.tok_embeddings is not None, part.output is not None) == (stage == 0, stage == n_stages - 1)
        params = dict(part.named_parameters())
        expected = {n for n in full
                    if (n.startswith("layers.") and int(n.split(".")[1]) in layers)
                    or (n.startswith("tok_embeddings.") and stage == 0)
                    or (n.startswith(("norm.", "output.")) and stage == n_stages - 1)}
        assert set(params) == expected
        for name, p in params.items():
            assert p.device.type == "cpu" and torch.equal(p, full[name]), name
        assert sum(drawn) == sum(p.numel() for n, p in params.items() if not n.endswith("norm.weight"))


def test_initial_values_depend_on_the_seed_not_on_the_global_random_state():
    cfg = load_config("tiny_moe")

    def weights(seed, global_seed):
        torch.manual_seed(global_seed)
        return Transformer(cfg.model, cfg.seq_len, seed=seed).state_dict()

    a, b, c = weights(0, 1), weights(0, 2), weights(1, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.feed_forward.experts.w1"], c["layers.0.feed_forward.experts.w1"])
    # Each parameter has its own stream: same shapes, different values.
    assert not torch.equal(a["layers.0.attention.wk.weight"], a["layers.0.attention.wv.weight"])


def test_the_balance_loss_taken_once_for_all_layers_is_the_switch_loss_of_each():
    """The model reduces every layer's counts together and attaches one loss; its gradient must be
    that of coef * E * sum over layers and experts of f (share of rows, constant) * P (mean router
    probability), written out here from the routers' outputs."""
    cfg = _moe_config(4)
    model = Transformer(cfg.model, cfg.seq_len)
    logits = []
    for block in model.layers.values():
        block.feed_forward.router.register_forward_hook(lambda mod, args, out: logits.append(out))
    routers = [block.feed_forward.router.weight for block in model.layers.values()]
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))

    def router_grads(coef):
        model.cfg = dataclasses.replace(cfg.model, aux_loss_coef=coef)
        logits.clear()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        return torch.autograd.grad(loss, routers, retain_graph=True), logits[:]

    with_aux, layer_logits = router_grads(cfg.model.aux_loss_coef)
    without, _ = router_grads(0.0)
    e = cfg.model.n_experts
    switch = 0
    for out in layer_logits:
        probs = out.float().softmax(-1)
        counts = torch.bincount(probs.topk(cfg.model.top_k, -1).indices.reshape(-1), minlength=e).float()
        switch = switch + cfg.model.aux_loss_coef * e * (counts / counts.sum() * probs.mean(0)).sum()
    expected = torch.autograd.grad(switch, routers)
    for got_with, got_without, want in zip(with_aux, without, expected):
        assert want.norm() > 0
        torch.testing.assert_close(got_with - got_without, want, rtol=1e-4, atol=1e-9)


def _sharded_build_rank(layout: str) -> dict:
    """Build as the trainer does -- stage on meta, tensor/expert parallel on meta, then allocate and
    draw -- and compare each local part with the full model's values, sliced here by hand."""
    from mfuscope.reference_trainer.pipeline_parallel import materialize

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = load_config("tiny_moe")
    dims = ParallelDims.parse(layout, dist.get_world_size())
    model = build_stage(cfg.model, cfg.seq_len, cfg.seed, 0, 1, "meta")
    if dims.tp > 1:
        tensor_parallel.apply_tp(model, dims)
    if dims.ep > 1:
        ep_group, ep_rank, _ = expert_parallel.expert_groups(dims, rank)
        expert_parallel.apply_ep(model, ep_group, dims.ep, ep_rank)
    drawn = []
    normal_ = torch.Tensor.normal_

    def counted(tensor, *args, **kwargs):
        drawn.append(tensor.numel())
        return normal_(tensor, *args, **kwargs)
    torch.Tensor.normal_ = counted
    try:
        materialize(model, "cpu")
    finally:
        torch.Tensor.normal_ = normal_
    full = dict(Transformer(cfg.model, cfg.seq_len, seed=cfg.seed).named_parameters())
    mismatched, local_numel = [], 0
    for name, p in model.named_parameters():
        expected = full[name].detach()
        if ".experts." in name:  # rows offset.. of the experts: this rank's expert-parallel slice
            held = p.shape[0]
            expected = expected[held * (rank % dims.ep):held * (rank % dims.ep + 1)]
        if hasattr(p, "to_local"):
            for mesh_dim, placement in enumerate(p.placements):
                if placement.is_shard():
                    coord = p.device_mesh.get_coordinate()[mesh_dim]
                    expected = expected.chunk(p.device_mesh.size(mesh_dim), dim=placement.dim)[coord]
            p = p.to_local()
        local_numel += p.numel()
        if not torch.equal(p.detach(), expected):
            mismatched.append(name)
    return {"mismatched": mismatched, "largest_draw": max(drawn),
            "largest_param": max(x.numel() for x in full.values()), "local": local_numel,
            "full": sum(x.numel() for x in full.values())}


@pytest.mark.parametrize("layout", ["tp=2", "dp_shard=2,ep=2"])
def test_tensor_and_expert_parallel_parts_are_drawn_as_slices_of_the_full_model(layout):
    """Each rank allocates its shard (not the stage) and it equals that slice of the full model bit
    for bit; no draw is larger than one full parameter."""
    for rank, got in enumerate(fork_ranks(_sharded_build_rank, 2, layout)):
        assert got["mismatched"] == [], (rank, got)
        assert got["largest_draw"] <= got["largest_param"], (rank, got)
        assert got["local"] < got["full"], (rank, got)
