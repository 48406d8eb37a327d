"""Real CPU-only gloo traces made here by torch.profiler on a 4-rank DDP job."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

from mfuscope.analyzers import trace_set  # noqa: E402
from mfuscope.reference_trainer import demo_workload  # noqa: E402

HIDDEN = 64
RANKS = 4
STEPS = 5


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo")
    demo_workload.run(out, ranks=RANKS, steps=STEPS, hidden=HIDDEN)
    return out


def test_every_rank_and_profiled_step_is_found(gloo_run):
    events = trace_set.load(gloo_run / "traces", use_cache=False).events
    assert events.rank_ids == list(range(RANKS))
    for meta in events.ranks.values():
        assert meta["world_size"] == RANKS and meta["backend"] == "gloo"
        assert meta["steps"] == [2, 3, 4]  # schedule(wait=1, warmup=1, active=3)


def test_gradient_all_reduce_bytes_equal_the_model_size(gloo_run):
    # DDP all-reduces every gradient once per step: Linear(H, 4H) + Linear(4H, H), fp32.
    params = (HIDDEN * 4 * HIDDEN + 4 * HIDDEN) + (4 * HIDDEN * HIDDEN + HIDDEN)
    df = trace_set.load(gloo_run / "traces", use_cache=False).events.to_pandas()
    comm = df[(df["kind"].astype(str) == "comm") & (df["step"] >= 0)]
    assert set(comm["op"]) == {"all_reduce"}
    assert (comm["device"] == -1).all()  # CPU work on gloo threads
    per_step = comm.groupby(["rank", "step"])["bytes"].sum()
    assert len(per_step) == RANKS * 3
    assert (per_step == params * 4).all()
