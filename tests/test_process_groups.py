"""Process groups of jobs mfuscope did not launch (issue 27, part 4): Kineto's cut rank lists, the
group names of Megatron-Core and torchtitan, unnamed groups (DeepSpeed's, plain ``new_group``)
placed by ``--layout`` / ``--rank-order``, and matching across ranks at any group size.

The traces are built from real event shapes: ``record_param_comms`` with the args PyTorch's
profiler writes (``Process Group Ranks`` as the string Kineto prints, cut after 30 entries with
``, ...``; ``Group size``; ``Seq``), its ``cudaLaunchKernel`` and the NCCL kernel it launched.
Expected values are counted by hand from those timestamps.
"""
from __future__ import annotations

import pandas as pd
import pytest

from mfuscope import cli
from mfuscope.analyzers import collective_match, collectives, comm_stats, overview, trace_set
from mfuscope.analyzers.group_dims import RankLayout
from mfuscope.errors import UserInputError
from mfuscope.tests.helpers import HTA_DATA, needs_corpus, write_trace

ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
ALLTOALL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


def _x(name, ts, dur, cat="cpu_op", pid=1, tid=1, **args):
    e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        e["args"] = args
    return e


def _cut(ranks: list[int]) -> str:
    """Process Group Ranks as PyTorch's profiler prints it: whole up to 30 ranks, else the first 30
    and ``...`` (``format_list`` with ``kTruncatLength = 30``)."""
    shown = ", ".join(str(r) for r in ranks[:30])
    return f"[{shown}, ...]" if len(ranks) > 30 else f"[{shown}]"


def _call(ts, corr, kernel_ts, kernel_end, *, pg, ranks, size, seq, rank, desc="undefined", coll="allreduce",
          kernel=ALLREDUCE, nelems=1 << 20, **extra):
    """A collective as a GPU rank's trace holds it: the c10d call's ``record_param_comms``, the launch
    inside it, the kernel (which starts when the rank arrives and ends when the group is done)."""
    args = {"Collective name": coll, "dtype": "BFloat16", "In msg nelems": nelems, "Out msg nelems": nelems,
            "In split size": "[]", "Out split size": "[]", "Group size": size, "Process Group Name": pg,
            "Process Group Description": desc, "Process Group Ranks": _cut(ranks), "Rank": rank, **extra}
    if seq is not None:
        args["Seq"] = seq
    return [_x("record_param_comms", ts, 40.0, **args),
            _x("cudaLaunchKernel", ts + 5.0, 10.0, cat="cuda_runtime", correlation=corr),
            _x(kernel, kernel_ts, kernel_end - kernel_ts, cat="kernel", pid=0, tid=7,
               correlation=corr, device=0, stream=7)]


def _rank_trace(tmp_path, rank, world, calls, name=None, **dist):
    events = [_x("ProfilerStep#5", 0.0, 2000.0, cat="user_annotation")]
    for c in calls:
        events += c
    return write_trace(tmp_path / (name or f"rank{rank}.json"), events,
                       distributedInfo={"backend": "nccl", "rank": rank, "world_size": world, **dist})


# --------------------------------------------------------------------------- cut rank lists

#: Arrival (kernel start, us) of ranks 0, 1, 2 at the two all-reduces (Seq 7 and 8) of a 64-rank group.
ARRIVALS = {0: (200.0, 1150.0), 1: (230.0, 1100.0), 2: (280.0, 1120.0)}
#: A 64-rank group that is not evenly strided (PyTorch then records no Global rank start/stride).
GROUP64 = list(range(0, 30)) + list(range(31, 64)) + [64]


def _cut_group_set(tmp_path, **extra):
    for rank, (a7, a8) in ARRIVALS.items():
        _rank_trace(tmp_path, rank, 128, [
            _call(100.0 + rank, 1, a7, 700.0, pg="5", ranks=GROUP64, size=64, seq=7, rank=rank, **extra),
            _call(1000.0 + rank, 2, a8, 1500.0, pg="5", ranks=GROUP64, size=64, seq=8, rank=rank, **extra)])
    return trace_set.load(tmp_path, use_cache=False, workers=1).events


def test_a_cut_rank_list_is_not_the_group(tmp_path):
    events = _cut_group_set(tmp_path)
    df = events.to_pandas(["rank", "kind", "group_ranks", "pg", "seq"])
    comm = df[df["kind"] == "comm"]
    assert len(comm) == 6 and comm["group_ranks"].isna().all()  # not the 30 ranks it shows
    group = events.ranks[0]["comm_groups"][0]
    assert (group["name"], group["size"], group["ranks"]) == ("5", 64, None)
    assert group["ranks_head"] == ",".join(str(r) for r in range(30))
    calls = comm_stats.calls_from_trace(events)
    assert (calls["group_size"] == 64).all()  # from the call's Group size, not ~31 from the cut list


def test_a_cut_rank_list_is_rebuilt_from_the_global_rank_start_and_stride(tmp_path):
    """An evenly strided group (a DeviceMesh dimension): PyTorch records its first rank and stride,
    and with Group size the whole list follows: 0, 2, ..., 126."""
    strided = list(range(0, 128, 2))
    f = _rank_trace(tmp_path, 0, 128, [_call(100.0, 1, 200.0, 700.0, pg="9", ranks=strided, size=64, seq=1, rank=0,
                                             **{"Global rank start": 0, "Global rank stride": 2})])
    df = trace_set.load(f, use_cache=False).events.to_pandas(["kind", "group_ranks"])
    assert df[df["kind"] == "comm"]["group_ranks"].tolist() == [",".join(map(str, strided))]
    # a start/stride the shown ranks contradict rebuilds nothing
    assert collectives.full_group_ranks([0, 1, 2], 64, 0, 2) is None


def test_a_64_rank_group_matches_across_the_ranks_loaded(tmp_path):
    """Three ranks of a 64-rank group (a world of 128), two all-reduces.  By hand, from the kernel
    starts: Seq 7 arrivals 200/230/280 us, lags 0/30/80, skew 80 us, the last (rank 2) 50 us after
    the second-last; Seq 8 arrivals 1150/1100/1120, lags 50/0/20, skew 50 us, rank 0 30 us late.
    Median skew 65 us, p90 50 + 0.9 x 30 = 77 us.  Every rank leaves at 700 and 1500 us: offsets 0."""
    events = _cut_group_set(tmp_path)
    calls = comm_stats.calls_from_trace(events)
    matched = collective_match.match_calls(calls)
    skew, offsets = matched.skew, matched.offsets
    assert len(skew) == 1 and skew[0]["instances"] == 2
    assert skew[0]["median_skew_s"] == pytest.approx(65e-6) and skew[0]["p90_skew_s"] == pytest.approx(77e-6)
    assert skew[0]["waited_for"] == [{"rank": 2, "seconds": pytest.approx(50e-6)},
                                     {"rank": 0, "seconds": pytest.approx(30e-6)}]
    assert [o["offset_s"] for o in offsets] == [0.0, 0.0, 0.0]
    lags = {r["rank"]: r["median_lag_s"] for r in matched.arrival}
    assert lags == {0: pytest.approx(25e-6), 1: pytest.approx(15e-6), 2: pytest.approx(50e-6)}


def test_a_call_some_loaded_member_did_not_record_is_not_matched(tmp_path):
    """Rank 2's trace lacks Seq 8 (its window ended): Seq 8 is not matched; Seq 7 still is."""
    for rank, (a7, a8) in ARRIVALS.items():
        calls = [_call(100.0 + rank, 1, a7, 700.0, pg="5", ranks=GROUP64, size=64, seq=7, rank=rank)]
        if rank != 2:
            calls.append(_call(1000.0 + rank, 2, a8, 1500.0, pg="5", ranks=GROUP64, size=64, seq=8, rank=rank))
        _rank_trace(tmp_path, rank, 128, calls)
    calls = comm_stats.calls_from_trace(trace_set.load(tmp_path, use_cache=False, workers=1).events)
    skew = collective_match.match_calls(calls).skew
    assert skew[0]["instances"] == 1 and skew[0]["median_skew_s"] == pytest.approx(80e-6)


# --------------------------------------------------------------------------- names frameworks give


@pytest.mark.parametrize("desc, dim", [
    # Megatron-Core (megatron/core/parallel_state.py, create_group(group_desc=...))
    ("TENSOR_MODEL_PARALLEL_GROUP", "tp"), ("PIPELINE_MODEL_PARALLEL_GROUP", "pp"),
    ("CONTEXT_PARALLEL_GROUP", "cp"), ("DATA_PARALLEL_GROUP", "dp"), ("DATA_PARALLEL_GROUP_GLOO", "dp"),
    ("DATA_PARALLEL_GROUP_WITH_CP", "dp_cp"), ("DATA_PARALLEL_GROUP_WITH_CP_AG", "dp_cp"),
    ("EXPERT_MODEL_PARALLEL_GROUP", "ep"), ("EXPERT_TENSOR_PARALLEL_GROUP", "tp"),
    ("EXPERT_DATA_PARALLEL_GROUP", "dp_expert"), ("HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1", "dp_expert"),
    ("HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L0", "cp"), ("EMBEDDING_GROUP", "pp"),
    ("TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "tp_dp_cp"), ("HYBRID_DP_CP_GROUP_4", "dp_cp"),
    # torchtitan's DeviceMesh dimensions (ParallelDims.build_mesh), as DeviceMesh describes them
    ("mesh_tp", "tp"), ("mesh_dp_replicate", "dp_replicate"), ("mesh_fsdp", "fsdp"), ("mesh_dp_shard", "dp_shard"),
    ("mesh_dp_shard_cp", "dp_shard_cp"), ("mesh_loss_mesh", "dp_cp"), ("mesh_efsdp", "dp_expert"),
    ("mesh_ep", "ep"), ("mesh_default", "world"), ("default_pg", "world"),
    # nothing said: DeepSpeed's new_group, an unnamed mesh, a split group
    ("undefined", None), ("mesh_dim_0", None), ("default_pg:split:0", None),
])
def test_group_descriptions_map_to_dimensions(desc, dim):
    assert collectives.dim_from_group_desc(desc) == dim


def test_a_megatron_tensor_parallel_group_is_tp(tmp_path):
    """Megatron names its tensor-parallel group TENSOR_MODEL_PARALLEL_GROUP: the all-reduce's exposed
    time is tp's in the breakdown."""
    f = _rank_trace(tmp_path, 0, 8, [_call(100.0, 1, 200.0, 700.0, pg="3", ranks=[0, 1], size=2, seq=4, rank=0,
                                           desc="TENSOR_MODEL_PARALLEL_GROUP")])
    events = trace_set.load(f, use_cache=False).events
    df = events.to_pandas(["kind", "dim", "group_ranks"])
    assert df[df["kind"] == "comm"][["dim", "group_ranks"]].values.tolist() == [["tp", "0,1"]]
    report = overview.build_report(events, source="tp", files=[])
    assert [r["dim"] for r in report["comm"]] == ["tp"]


def test_torchtitan_and_pg_config_names(tmp_path):
    """torchtitan's FSDP mesh (``mesh_fsdp``) on the call; a call whose event has no description
    takes it from ``distributedInfo.pg_config`` by group name, with the whole rank list there."""
    f = _rank_trace(tmp_path, 0, 8, [
        _call(100.0, 1, 200.0, 700.0, pg="2", ranks=[0, 2, 4, 6], size=4, seq=1, rank=0, desc="mesh_fsdp"),
        _call(1000.0, 2, 1100.0, 1500.0, pg="4", ranks=[], size=2, seq=1, rank=0, desc=None)],
        pg_config=[{"pg_name": "4", "pg_desc": "mesh_tp", "backend_config": "cuda:nccl", "pg_size": 2,
                    "ranks": [0, 1]}])
    df = trace_set.load(f, use_cache=False).events.to_pandas(["kind", "dim", "group_ranks"])
    assert df[df["kind"] == "comm"][["dim", "group_ranks"]].values.tolist() == [["fsdp", "0,2,4,6"], ["tp", "0,1"]]


# --------------------------------------------------------------------------- --layout / --rank-order


def test_rank_order_places_groups_by_hand():
    """tp=2, pp=2, dp=2 in Megatron's order tp-cp-ep-dp-pp: rank = tp + 2 dp + 4 pp, so {0,1} is a
    tensor-parallel group, {0,2} data-parallel, {0,4} pipeline; {0,3} is no group of the layout."""
    layout = RankLayout.parse("tp=2,pp=2,dp=2").resolve(8)
    assert [layout.dim_of(g) for g in ([0, 1], [0, 2], [0, 4], [5, 7], [0, 1, 2, 3], [0, 3], range(8))] == [
        "tp", "dp", "pp", "dp", "tp_dp", None, "world"]
    # Megatron's other order, tp-pp-dp: rank = tp + 2 pp + 4 dp
    other = RankLayout.parse("tp=2,pp=2,dp=2", "tp-pp-dp").resolve(8)
    assert [other.dim_of(g) for g in ([0, 1], [0, 2], [0, 4])] == ["tp", "pp", "dp"]
    # dp left out: what the world leaves (16 / (2 x 2) = 4); cp beside dp is dp_cp
    wide = RankLayout.parse("tp=2,cp=2").resolve(16)
    assert wide.sizes["dp"] == 4 and wide.dim_of([0, 2, 4, 6, 8, 10, 12, 14]) == "dp_cp"
    # ep borrows cp x dp ranks: with tp=2, cp=2, ep=4 (16 ranks, pp=2), ranks 0,2,4,6 are both the dense
    # dp_cp group and the expert-parallel one; an all-to-all there is ep's
    moe = RankLayout.parse("tp=2,cp=2,pp=2,ep=4").resolve(16)
    assert moe.dim_of([0, 2, 4, 6]) == "dp_cp" and moe.dim_of([0, 2, 4, 6], op="all_to_all") == "ep"
    # a cut list: 30 ranks of a 64-rank group, stride 2 -> dp of tp=2, dp=64
    assert RankLayout.parse("tp=2").resolve(128).dim_of(range(0, 60, 2), size=64) == "dp"


def test_layout_text_round_trips():
    for text, order in [("tp=8,pp=4", None), ("tp=2,cp=2,ep=4,dp=4,pp=2,etp=1", "tp-cp-ep-dp-pp"),
                        ("dp_replicate=2,dp_shard=4,tp=2", "tp-dp-pp")]:
        layout = RankLayout.parse(text, order)
        assert RankLayout.parse(layout.text(), layout.order_text()) == layout


def test_unnamed_groups_take_their_dimension_from_the_layout(tmp_path):
    """DeepSpeed's groups come from plain new_group calls (description ``undefined``); its pipeline
    topology numbers ranks model (tp) fastest, then data, then pipe: tp-dp-pp.  Rank 0 of 8 with
    tp=2, dp=2, pp=2: its groups {0,1}, {0,2}, {0,4} are tp, dp, pp; a named group keeps its name's."""
    f = _rank_trace(tmp_path, 0, 8, [
        _call(100.0, 1, 150.0, 200.0, pg="1", ranks=[0, 1], size=2, seq=1, rank=0),
        _call(300.0, 2, 350.0, 400.0, pg="2", ranks=[0, 2], size=2, seq=1, rank=0),
        _call(500.0, 3, 550.0, 600.0, pg="3", ranks=[0, 4], size=2, seq=1, rank=0),
        _call(700.0, 4, 750.0, 800.0, pg="4", ranks=[0, 4], size=2, seq=1, rank=0, desc="DATA_PARALLEL_GROUP")])

    def dims(**flags):
        df = trace_set.load(f, use_cache=False, **flags).events.to_pandas(["kind", "dim"])
        return df[df["kind"] == "comm"]["dim"].fillna("none").tolist()

    assert dims() == ["none", "none", "none", "dp"]
    assert dims(layout="tp=2,dp=2,pp=2", rank_order="tp-dp-pp") == ["tp", "dp", "pp", "dp"]
    assert dims(layout="tp=2,pp=2", rank_order="tp-pp-dp") == ["tp", "pp", "dp", "dp"]


@pytest.mark.parametrize("flags, named", [
    (["--layout", "tp=x"], "--layout"),
    (["--layout", "tp=2,tp=4"], "--layout"),
    (["--layout", "zz=2"], "--layout"),
    (["--layout", "tp=3"], "--layout"),  # does not divide the world of 8
    (["--layout", "tp=2,pp=2,dp=4"], "--layout"),  # 16 ranks, the traces' world is 8
    (["--layout", "tp=2", "--rank-order", "tp-zz-pp"], "--rank-order"),
    (["--layout", "tp=2,cp=2", "--rank-order", "tp-dp-pp"], "--rank-order"),  # leaves out cp
    (["--rank-order", "tp-dp-pp"], "--layout"),  # an order of nothing
])
def test_bad_layout_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, named):
    f = _rank_trace(tmp_path, 0, 8, [_call(100.0, 1, 150.0, 200.0, pg="1", ranks=[0, 1], size=2, seq=1, rank=0)])
    assert cli.main(["analyze", str(f), "--no-cache", "--out", str(tmp_path / "r.json"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mfuscope: error: ") and named in err and "Traceback" not in err
    with pytest.raises(UserInputError, match=named):
        trace_set.load(f, use_cache=False, **dict(zip(
            [a.lstrip("-").replace("-", "_") for a in flags[::2]], flags[1::2])))


def test_analyze_takes_the_layout_flags(tmp_path, capsys):
    f = _rank_trace(tmp_path, 0, 8, [_call(100.0, 1, 150.0, 200.0, pg="1", ranks=[0, 1], size=2, seq=1, rank=0)])
    out = tmp_path / "r.json"
    assert cli.main(["analyze", str(f), "--no-cache", "--json", "--out", str(out), "--layout", "tp=2,pp=2"]) == 0
    assert '"dim": "tp"' in capsys.readouterr().out


# --------------------------------------------------------------------------- the corpus pair


@needs_corpus(HTA_DATA / "trace_filter")
def test_trace_filter_pair_gets_skew_and_arrival():
    """Two ranks of a 128-rank job, no process-group fields and no sequence numbers (PyTorch 2.0):
    the collectives every rank calls with the same payload are known by step, op and payload.  Four
    are on both ranks (rank 0's and rank 1's kernel starts, us after ...898 s, read from the files):
    step 551's 78,473,228 B all-reduce 295,662 / 298,964 (lag 3,302) and 16,777,216 B all-gather
    585,321 / 585,405 (84); step 552's 22,866,616 B all-reduce 1,146,327 / 1,168,655 (22,328) and
    all-gather 1,185,890 / 1,187,182 (1,292).  Median skew (1,292 + 3,302) / 2 = 2,297 us; rank 1
    arrives last at all four.  The all-to-alls (uneven splits) and the k-th kernels are not matched;
    the ends of the four agree within 0.4 ms, so the clock offsets are under 0.1 ms."""
    events = trace_set.load(HTA_DATA / "trace_filter", use_cache=False, workers=1).events
    report = overview.build_report(events, source="trace_filter", files=[])
    (skew,) = report["comm_skew"]
    assert skew["instances"] == 4 and skew["median_skew_s"] == pytest.approx(2.297e-3, abs=1e-6)
    assert [w["rank"] for w in skew["waited_for"]] == [1]
    assert skew["waited_for"][0]["seconds"] == pytest.approx((3302 + 84 + 22328 + 1292) * 1e-6, abs=1e-6)
    arrival = {(a["rank"], a["collective"]): a for a in report["comm_arrival"]}
    assert set(arrival) == {(r, f"unknown/{op}") for r in (0, 1) for op in ("all_reduce", "all_gather")}
    assert arrival[(1, "unknown/all_reduce")]["median_lag_s"] == pytest.approx((3302 + 22328) / 2 * 1e-6, abs=1e-6)
    assert all(abs(o["offset_s"]) < 1e-4 for o in report["clock_offsets"])


def test_the_expert_load_is_the_busiest_ranks_share_of_each_uneven_exchange():
    """Two expert-parallel ranks, one layer's forward in each of two steps: the counts exchange
    (8 bytes each), the dispatch (each rank's 1000 routed rows' bytes: even by construction) and
    the combine, whose payload is the rows routed to the rank's experts: 1200 against 800 (max
    over mean 1.2), then 1500 against 500 (1.5).  Hand count: the mean of 1.2 and 1.5, 1.35, over
    the two uneven exchanges of six; a tensor-parallel all-to-all (cp, not ep) is no exchange of
    experts and changes nothing, and without steady steps' calls there is no section."""
    payloads = [(8, 8), (1000, 1000), (1200, 800), (8, 8), (1000, 1000), (1500, 500)]
    rows = []
    for seq, sizes in enumerate(payloads):
        for rank, size in enumerate(sizes):
            rows.append({"rank": rank, "step": seq // 3, "dim": "ep", "op": "all_to_all", "bytes": size,
                         "group_size": 2, "group_ranks": "0,1", "pg": "7", "seq": seq,
                         "enqueue_ns": 1000 * seq + rank, "end_ns": 1000 * seq + 500})
            rows.append({"rank": rank, "step": seq // 3, "dim": "cp", "op": "all_to_all", "bytes": 100 + 300 * rank,
                         "group_size": 2, "group_ranks": "0,1", "pg": "8", "seq": seq,
                         "enqueue_ns": 1000 * seq + rank, "end_ns": 1000 * seq + 500})
    calls = pd.DataFrame(rows)
    moe = collective_match.match_calls(calls, steady_steps={0, 1}).moe
    assert moe == {"expert_load": pytest.approx(1.35), "exchanges": 6, "uneven": 2}
    assert collective_match.match_calls(calls, steady_steps={1}).moe["expert_load"] == pytest.approx(1.5)
    assert collective_match.match_calls(calls, steady_steps={5}).moe is None
    assert collective_match.match_calls(calls[calls["dim"] == "cp"]).moe is None
