"""The reference trainer: every layout trains exactly like one process.

Reference: the same config, seed and data in a single process (for MoE with
pipeline microbatches, single-process gradient accumulation over the same
microbatches, since routing statistics are per forward pass).  Losses of the
first 3 steps must agree within 1e-5 relative and every parameter after one
optimizer step within 1e-5.  Ranks are real gloo processes, forked.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

from mfuscope.reference_trainer.launch import fork_ranks  # noqa: E402
from mfuscope.reference_trainer.train import RunOptions, run_rank  # noqa: E402

TOL = 1e-5
STEPS = 3


def _run(tmp_path, world, name, **kw):
    out = tmp_path / name
    fork_ranks(run_rank, world, RunOptions(steps=STEPS, result=str(out), snapshot_step=1, **kw))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    params: dict[str, torch.Tensor] = {}
    for res in ranks:
        params.update(res["params"])
    return ranks[0]["losses"], params


_reference_cache: dict = {}


def _reference(tmp_path_factory, config, grad_accum=1):
    key = (config, grad_accum)
    if key not in _reference_cache:
        _reference_cache[key] = _run(tmp_path_factory.mktemp("ref"), 1, "single", config=config,
                                     overrides={"grad_accum": grad_accum})
    return _reference_cache[key]


def _merge_experts(params):
    """Expert slices ``name@first`` from several ranks -> the full expert tensor ``name``."""
    merged, parts = {}, {}
    for key, value in params.items():
        if "@" in key:
            name, first = key.split("@")
            parts.setdefault(name, {})[int(first)] = value
        else:
            merged[key] = value
    for name, slices in parts.items():
        merged[name] = torch.cat([slices[k] for k in sorted(slices)])
    return merged


def _assert_equivalent(ref, got):
    ref_losses, ref_params = ref
    losses, params = got
    for a, b in zip(ref_losses, losses):
        assert math.isclose(a, b, rel_tol=TOL), (ref_losses, losses)
    params = _merge_experts(params)
    assert set(params) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=TOL, atol=TOL, msg=name)


LAYOUTS = [
    # (id, world, layout, options)
    ("ddp", 2, "dp_shard=2", {"dp_mode": "ddp"}),
    ("ddp_accumulate", 2, "dp_shard=2", {"dp_mode": "ddp", "overrides": {"grad_accum": 2}}),
    ("fsdp2", 2, "dp_shard=2", {}),
    ("fsdp2_no_reshard", 2, "dp_shard=2", {"reshard_after_forward": False}),
    ("fsdp2_recompute_full", 2, "dp_shard=2", {"overrides": {"recompute": "full"}}),
    ("fsdp2_recompute_selective", 2, "dp_shard=2", {"overrides": {"recompute": "selective"}}),
    ("hsdp", 4, "dp_replicate=2,dp_shard=2", {}),
    ("tp2_sp", 2, "tp=2", {}),
    ("cp2", 2, "cp=2", {}),
    ("pp2_gpipe", 2, "pp=2", {"schedule": "gpipe"}),
    ("pp2_1f1b", 2, "pp=2", {"schedule": "1f1b"}),
    ("pp2_interleaved", 2, "pp=2", {"schedule": "interleaved_1f1b"}),
    ("pp2_zero_bubble", 2, "pp=2", {"schedule": "zero_bubble"}),
    ("pp2_zbv", 2, "pp=2", {"schedule": "zbv"}),
    ("3d_8ranks", 8, "dp_shard=2,tp=2,pp=2", {}),
]


@pytest.mark.parametrize("name, world, layout, opts", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_dense_layout_matches_single_process(tmp_path, tmp_path_factory, name, world, layout, opts):
    ref = _reference(tmp_path_factory, "tiny_dense")
    _assert_equivalent(ref, _run(tmp_path, world, name, config="tiny_dense", layout=layout, **opts))


def test_moe_expert_parallel_matches_single_process(tmp_path, tmp_path_factory):
    ref = _reference(tmp_path_factory, "tiny_moe")
    _assert_equivalent(ref, _run(tmp_path, 2, "ep2", config="tiny_moe", layout="dp_shard=2,ep=2"))


def test_16_rank_5d_moe_smoke(tmp_path, tmp_path_factory):
    """pp=2 x dp_shard=2 x cp=2 x tp=2 with MoE over ep=2: trains like one process
    accumulating the same 2 microbatches."""
    ref = _reference(tmp_path_factory, "tiny_moe", grad_accum=2)
    _assert_equivalent(ref, _run(tmp_path, 16, "5d", config="tiny_moe", layout="pp=2,dp_shard=2,cp=2,tp=2,ep=2"))


def test_torch_compile_trains_like_eager(tmp_path, tmp_path_factory):
    ref_losses, _ = _reference(tmp_path_factory, "tiny_dense")
    losses, _ = _run(tmp_path, 1, "compiled", config="tiny_dense", overrides={"compile": True})
    for a, b in zip(ref_losses, losses):
        assert math.isclose(a, b, rel_tol=TOL), (ref_losses, losses)


def test_text_data_is_the_shipped_text():
    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.data import TEXT, global_batch

    cfg = load_config("tiny_dense", data="text")
    batch = global_batch(cfg, 0)
    text = TEXT.read_bytes()
    assert batch.shape == (cfg.global_batch, cfg.seq_len + 1)
    for row in batch.tolist():
        assert bytes(row) in text  # every row is a contiguous slice of the file
    assert torch.equal(batch, global_batch(cfg, 0)) and not torch.equal(batch, global_batch(cfg, 1))
