"""Collectives matched across ranks from the spool, partition by partition (analyzers/collective_match.py).

The expected values are counted by hand from the arrivals written below; the spool is forced to
spread them over several partitions, flushes and rank partitions, as a job of thousands of ranks
would, so a key split across partitions, or a rank's lags split across rank partitions, would
show as a wrong count or median."""
from __future__ import annotations

import tempfile

import pandas as pd
import pytest

from mfuscope.analyzers import collective_match, comm_stats

US = 1_000  # ns


def _call(rank: int, group: str, arrive_us: float, end_us: float, op: str = "all_reduce", seq=None, pg=None):
    return {"rank": rank, "step": 1, "dim": "dp", "op": op, "bytes": 1 << 20, "group_size": 2, "group_ranks": group,
            "pg": pg, "seq": seq, "enqueue_ns": arrive_us * US, "end_ns": end_us * US}


#: Two groups of two ranks; no call is numbered (a trace from PyTorch before ``Seq``), so each
#: all-reduce is known by its group, step, op, payload and place.  Arrivals, us:
#:   ranks 0,1: 1st 100/130 (rank 1 last, 30 after rank 0), 2nd 500/480 (rank 0 last, 20 after)
#:   ranks 2,3: 1st 200/260 (rank 3, 60), 2nd 600/610 (rank 3, 10)
#: and an all-to-all per rank (uneven splits: never matched by payload).
CALLS = pd.DataFrame([
    _call(0, "0,1", 100, 300), _call(0, "0,1", 500, 700),
    _call(1, "0,1", 130, 300), _call(1, "0,1", 480, 700),
    _call(2, "2,3", 200, 400), _call(2, "2,3", 600, 800),
    _call(3, "2,3", 260, 402), _call(3, "2,3", 610, 800),
    *[_call(r, "0,1" if r < 2 else "2,3", 900 + r, 950, op="all_to_all") for r in range(4)],
])


@pytest.fixture
def small_partitions(monkeypatch, tmp_path):
    """Every rank its own partition, a flush every 3 calls, a rank partition every 2 rows, and the
    spool's directory in ``tmp_path`` (to see it removed)."""
    monkeypatch.setattr(collective_match, "PARTITION_RANKS", 1)
    monkeypatch.setattr(collective_match, "FLUSH_ROWS", 3)
    monkeypatch.setattr(collective_match, "RANK_PARTITION_ROWS", 2)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_payload_matched_keys_across_partitions(small_partitions):
    spool = collective_match.CallSpool(4)
    assert spool.partitions == 4
    for rank in (2, 0, 3, 1):  # in the order workers might finish
        spool.add(comm_stats.matchable(CALLS[CALLS["rank"] == rank]))
    m = spool.match()
    # per instance, last minus first arrival: 30, 20, 60, 10 us -> median 25, p90 30 + 0.7 x 30 = 51
    (skew,) = m.skew
    assert skew["dim"] == "dp" and skew["instances"] == 4
    assert skew["median_skew_s"] == pytest.approx(25e-6) and skew["p90_skew_s"] == pytest.approx(51e-6)
    # the last arrival's lead over the second-last: rank 3 60 + 10, rank 1 30, rank 0 20
    assert skew["waited_for"] == [{"rank": 3, "seconds": pytest.approx(70e-6)},
                                  {"rank": 1, "seconds": pytest.approx(30e-6)},
                                  {"rank": 0, "seconds": pytest.approx(20e-6)}]
    # lags behind the first arrival: rank 0 0 and 20 -> median 10; rank 1 30, 0 -> 15; rank 2 0; rank 3 60, 10 -> 35
    assert {a["rank"]: a["median_lag_s"] for a in m.arrival} == pytest.approx(
        {0: 10e-6, 1: 15e-6, 2: 0.0, 3: 35e-6})
    assert {a["collective"] for a in m.arrival} == {"dp/all_reduce"}
    # ends: equal but for ranks 2,3's first (400 and 402 us: 1 us either side of their median)
    offsets = {o["rank"]: o["offset_s"] for o in m.offsets}
    assert offsets == pytest.approx({0: 0.0, 1: 0.0, 2: -0.5e-6, 3: 0.5e-6})
    # one row per instance for the late ranks: the late rank, its lead, the others' wait
    late = m.late.sort_values("late_from_ns")
    assert late["late_rank"].tolist() == [1, 3, 0, 3]
    assert (late["gap_ns"] / US).tolist() == [30, 60, 20, 10]
    assert (late["waited_ns"] / US).tolist() == [30, 60, 20, 10]  # two members: the one waiting waits the gap
    assert list(small_partitions.iterdir()) == []  # the spool is gone


def test_a_numbered_key_needs_every_member_and_never_more_than_the_group(small_partitions):
    """Numbered calls of process group "5": Seq 1 recorded by ranks 0 and 1, Seq 2 by rank 0 only
    (rank 1's window ended): only Seq 1 matches.  Group "9" names a size of 2 but three ranks hold
    its Seq 1 (a mislabelled trace): not matched."""
    rows = [_call(0, None, 100, 200, seq=1, pg="5"), _call(1, None, 110, 200, seq=1, pg="5"),
            _call(0, None, 300, 400, seq=2, pg="5"),
            *[_call(r, None, 100 + r, 200, seq=1, pg="9") for r in range(3)]]
    spool = collective_match.CallSpool(3)
    for r in range(3):
        spool.add(comm_stats.matchable(pd.DataFrame([x for x in rows if x["rank"] == r])))
    (skew,) = spool.match().skew
    assert skew["instances"] == 1 and skew["median_skew_s"] == pytest.approx(10e-6)


def test_a_spool_closed_before_matching_leaves_nothing(small_partitions):
    spool = collective_match.CallSpool(4)
    spool.add(comm_stats.matchable(CALLS))
    spool.close()
    assert list(small_partitions.iterdir()) == []
