"""Every collective the 3D-parallel trainer issues runs under its dimension's label.

8 ranks (dp_shard=2 x tp=2 x pp=2) train under torch.profiler; in each rank's
trace, every c10d operator on the training thread must sit inside an
``mfuscope.comm/<dim>/<op>`` region of the dimension that issues it: FSDP's
gathers and reduce-scatters are data parallel, DTensor's coalesced
collectives tensor parallel, send/recv pipeline parallel.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
#: Reads the session's shared 3D run, which the dashboard's paced lane reads too (tests/lanes.py).
pytestmark = pytest.mark.paced

from mfuscope import run_dir  # noqa: E402
from mfuscope.analyzers import trace_set  # noqa: E402

# Who issues which c10d operator in this layout (from how FSDP2, DTensor and pipelining work).
EXPECTED_DIM = {
    "c10d::_allgather_base_": {"dp_shard_cp"},                 # FSDP2 parameter all-gather
    "c10d::_reduce_scatter_base_": {"dp_shard_cp"},            # FSDP2 gradient reduce-scatter
    "c10d::allgather_into_tensor_coalesced_": {"tp"},          # DTensor (sequence parallel)
    "c10d::reduce_scatter_tensor_coalesced_": {"tp"},          # DTensor (row-parallel outputs)
    "c10d::allreduce_": {"tp", "dp_cp"},                       # loss-parallel softmax; the logged loss
    "c10d::send": {"pp"}, "c10d::recv_": {"pp"},               # pipeline activations and gradients
}


@pytest.fixture(scope="module")
def profiled_run(run_3d):
    """The session's shared 3D run (tests/shared_runs.py), traced from step 1."""
    return run_3d


def test_every_collective_is_inside_its_dimension_label(profiled_run):
    df = trace_set.load(profiled_run / "traces", use_cache=False).events.to_pandas()
    df["name"] = df["name"].astype(str)
    seen = set()
    for rank, events in df.groupby("rank"):
        labels = events[events["name"].str.startswith("mfuscope.comm/")]
        ops = events[events["name"].isin(EXPECTED_DIM.keys())]
        assert len(ops) > 0
        for op in ops.itertuples():
            same = labels[(labels["lane"] == op.lane) & (labels["ts_ns"] <= op.ts_ns)
                          & (labels["ts_ns"] + labels["dur_ns"] >= op.ts_ns + op.dur_ns)]
            assert len(same), f"rank {rank}: {op.name} at {op.ts_ns} has no mfuscope.comm label"
            innermost = same.iloc[np.argmax(same["ts_ns"].to_numpy())]
            dim = innermost["name"].split("/")[1]
            assert dim in EXPECTED_DIM[op.name], (rank, op.name, innermost["name"])
            seen.add(op.name)
    assert seen == set(EXPECTED_DIM)


def test_manifest_maps_every_group_to_its_dimension(profiled_run):
    manifest = run_dir.read_manifest(profiled_run)
    groups = {g["dim"]: g["ranks"] for g in manifest["process_groups"]}  # rank 0's groups
    assert groups["tp"] == [0, 1] and groups["pp"] == [0, 4] and groups["dp_shard"] == [0, 2]
    assert groups["dp_shard_cp"] == [0, 2]
    assert manifest["rank_coords"]["5"] == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}


def test_every_label_in_the_traces_parses(profiled_run):
    """The labels a real run writes (trainer, comm timer, pipeline labels) are the grammar of
    mfuscope/labels.py: every ``mfuscope.*`` name in a first- and a last-stage rank's trace parses, and
    the run has each kind: training steps, collective calls, waits on async calls, pipeline actions."""
    from mfuscope import labels

    from .helpers import read_raw

    for rank in (0, 7):
        raw = read_raw(profiled_run / "traces" / f"rank{rank}.pt.trace.json.gz")
        names = {e["name"] for e in raw["traceEvents"] if str(e.get("name", "")).startswith(labels.NAMESPACE)}
        steps = {labels.parse_step(n) for n in names} - {None}
        comm = {labels.parse_comm(n) for n in names} - {None}
        actions = {labels.parse_pp(n) for n in names} - {None}
        assert len(steps) + len(comm) + len(actions) == len(names), (rank, sorted(names))
        assert {source for source, _ in steps} == {labels.STEP}
        assert {c.wait for c in comm} == {False, True}, (rank, sorted(comm))
        assert {a.stage for a in actions} == {rank // 4} and {a.action for a in actions} >= {"F", "B"}
