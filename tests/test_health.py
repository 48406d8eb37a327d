"""Whole-run health (analyzers/health.py): slow episodes with their onset, class, ranks and cost,
and the rank scores -- on jobs built by hand, where each fault's size and start are known, and on
real gloo runs of the reference trainer with injected fail-slow faults.

The hand-built job (:func:`_job`): 4 ranks, tensor-parallel pairs A = {0, 1} and B = {2, 3}, and a
data-parallel all-reduce over all four.  Each step a rank computes 10 ms, joins its pair's
collective (1 ms once the pair is there), computes 5 ms more, joins the all-reduce (1 ms), and the
step ends 1 ms later; each compute draws a seeded +-0.5 ms.  A step is then ~18 ms, so the
analysis' floor (10% of the median step) is ~1.8 ms and every fault below is several times it.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from mfuscope import run_dir
from mfuscope.analyzers import health
from mfuscope.tests.helpers import micro_config
from mfuscope.tests.shared_runs import HEALTH_COMPUTE, HEALTH_LINK, mfuscope, train_forked

MS = 1e-3
PAIRS = {0: ("A", "0,1"), 1: ("A", "0,1"), 2: ("B", "2,3"), 3: ("B", "2,3")}


def _job(steps: int = 100, compute=None, link=None, host=None, seed: int = 0, spikes=()):
    """(steps table, comm table) of the job in the module docstring.  ``compute``: rank -> step ->
    extra seconds of its first compute; ``link``: pair name -> step -> extra transfer seconds;
    ``host``: step -> seconds every rank stalls at the step's start; ``spikes``: (rank, step,
    seconds) one-off stalls of one rank."""
    compute, link, host = compute or {}, link or {}, host or {}
    rng = np.random.default_rng(seed)
    srows, crows = [], []
    seq = {"A": 0, "B": 0, "W": 0}
    t = 0.0
    for s in range(steps):
        start = t
        stall = host.get(s, 0.0)
        first = {r: start + stall + 10 * MS + compute.get(r, {}).get(s, 0.0) + rng.uniform(-0.5, 0.5) * MS
                 + sum(x for (rr, ss, x) in spikes if (rr, ss) == (r, s)) for r in range(4)}
        ends = {}
        for pair, ranks in (("A", (0, 1)), ("B", (2, 3))):
            done = max(first[r] for r in ranks) + 1 * MS + link.get(pair, {}).get(s, 0.0)
            for r in ranks:
                crows.append((r, s, "all_gather", "tp", pair, PAIRS[r][1], seq[pair], first[r], done))
                ends[r] = done
            seq[pair] += 1
        second = {r: ends[r] + 5 * MS + rng.uniform(-0.5, 0.5) * MS for r in range(4)}
        done = max(second.values()) + 1 * MS
        for r in range(4):
            crows.append((r, s, "all_reduce", "dp", "W", "0,1,2,3", seq["W"], second[r], done))
        seq["W"] += 1
        t = done + 1 * MS
        srows += [(r, s, start, t) for r in range(4)]
    ns = lambda x: int(round(x * 1e9))  # noqa: E731
    steps_t = pd.DataFrame([(r, s, ns(a), ns(b)) for r, s, a, b in srows],
                           columns=["rank", "step", "start_ns", "end_ns"])
    comm = pd.DataFrame([(r, s, op, d, pg, gr, q, ns(a), ns(b)) for r, s, op, d, pg, gr, q, a, b in crows],
                        columns=["rank", "step", "op", "dim", "pg", "group_ranks", "seq", "enqueue_ns", "end_ns"])
    return steps_t, comm[health._COMM_COLUMNS]


def _only(episodes, cls, **match):
    found = [e for e in episodes if e["class"] == cls and all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (cls, match, episodes)
    return found[0]


def test_each_fault_is_one_episode_with_its_onset_class_ranks_and_cost():
    """Rank 2 computes 30 ms more from step 40; pair A's link adds 20 ms from step 20 (so ranks 0
    and 1 then reach the all-reduce 20 ms late -- held by their link, not by their work: not
    compute-slow); every rank stalls 15 ms at the start of steps 60-95 (host); rank 1 computes 25 ms
    more every 9th step from 18 (intermittent).  Expected costs: the fault's size times its steps."""
    steps, comm = _job(compute={2: {s: 30 * MS for s in range(40, 100)},
                                1: {s: 25 * MS for s in range(18, 100, 9)}},
                       link={"A": {s: 20 * MS for s in range(20, 100)}},
                       host={s: 15 * MS for s in range(60, 96)})
    h = health.of_tables(steps, comm)
    slow2 = _only(h["episodes"], "compute_slow", ranks=[2])
    assert (slow2["onset_step"], slow2["end_step"], slow2["dim"], slow2["period"]) == (40, 99, "tp", None)
    assert slow2["ongoing"]
    assert slow2["cost_s"] == pytest.approx(60 * 30 * MS, rel=0.1)
    link = _only(h["episodes"], "comm_slow")
    assert (link["onset_step"], link["end_step"], link["ranks"], link["dim"]) == (20, 99, [0, 1], "tp")
    assert [g["ranks"] for g in link["groups"]] == [[0, 1]]
    assert link["cost_s"] == pytest.approx(80 * 20 * MS, rel=0.1)
    stall = _only(h["episodes"], "host")
    assert (stall["onset_step"], stall["end_step"], stall["ranks"]) == (60, 95, [0, 1, 2, 3])
    assert stall["cost_s"] == pytest.approx(36 * 15 * MS, rel=0.1)
    every = _only(h["episodes"], "compute_slow", ranks=[1])
    assert (every["onset_step"], every["period"], every["slow_steps"]) == (18, 9, len(range(18, 100, 9)))
    assert len(h["episodes"]) == 4
    # the rank scores over the last 20 steps (80-99, 16 of them stalled): rank 2 is busy (its step
    # less its waits) 10 + 1 + 5 + 1 + 1 = 18 ms at best, now 18 + 30 + 15 = 63 ms; +-0.5 ms draws
    worst = h["rank_scores"][0]
    assert worst["rank"] == 2 and worst["individual"] == pytest.approx(18 / 63, abs=0.01)


def test_scattered_pairs_of_slow_steps_are_noise_not_an_intermittent_fault():
    """Rank 1 is 25 ms slow in pairs of steps one quiet step apart (10 and 12, 38 and 40, 70 and 72,
    94 and 96), as a co-tenant's bursts make them: every gap between them is even, so all are
    multiples of a 2-step "period", which once made them one intermittent episode (a fresh-clone CI
    flagged 8 steps of a healthy 500-step run so).  No beat spaces them: no episode.  The same
    rank slow every 9th step with two beats missed (18, 27, 45, 54, 72, 81, 99) is one, period 9."""
    pairs = {s: 25 * MS for first in (10, 38, 70, 94) for s in (first, first + 2)}
    h = health.of_tables(*_job(compute={1: pairs}))
    assert h["episodes"] == [] and h["flagged_steps"] == 0, h["episodes"]
    beats = {s: 25 * MS for s in (18, 27, 45, 54, 72, 81, 99)}
    every = _only(health.of_tables(*_job(compute={1: beats}))["episodes"], "compute_slow", ranks=[1])
    assert (every["onset_step"], every["period"], every["slow_steps"]) == (18, 9, 7)


def test_the_collectors_own_flushes_are_left_out_not_a_host_stall():
    """Every rank's steps 24, 49, 74 and 99 take 15 ms more (about 20 ms steps): a host stall every
    25 steps, one intermittent episode.  When the step rows say the collectors worked those 15 ms
    on the training thread (``collector_ns``: a flush of their tables, as a session with
    ``flush_every=25`` makes), the steps are theirs, left out as the step statistics leave them out
    (over 10% of the median step): no episode, and the report names them."""
    flushes = (24, 49, 74, 99)
    steps, comm = _job(host={s: 15 * MS for s in flushes})
    stall = _only(health.of_tables(steps, comm)["episodes"], "host")
    assert (stall["onset_step"], stall["period"], stall["slow_steps"]) == (24, 25, 4)
    steps["collector_ns"] = np.where(steps["step"].isin(flushes), 15 * MS * 1e9, 0).astype(np.int64)
    h = health.of_tables(steps, comm)
    assert h["episodes"] == [] and h["collectors_steps"] == list(flushes)
    assert h["steps"] == 100 - health.WARMUP_STEPS - len(flushes)


def test_a_fault_from_the_first_step_stands_out_against_its_peers():
    """Pair B's link is 12 ms slower for the whole run: no change point in time, but B against its
    peer A (same dimension and size) is slow every step."""
    steps, comm = _job(link={"B": {s: 12 * MS for s in range(100)}})
    h = health.of_tables(steps, comm)
    e = _only(h["episodes"], "comm_slow")
    assert (e["onset_step"], e["end_step"], e["ranks"]) == (health.WARMUP_STEPS, 99, [2, 3])
    # no healthy step to compare with: the cost is the group's own excess, 12 ms a step
    assert e["cost_s"] == pytest.approx((100 - health.WARMUP_STEPS) * 12 * MS, rel=0.1)


def test_a_fault_with_a_short_reprieve_is_one_episode_and_two_faults_apart_are_two():
    """Pair A's link adds 20 ms from step 30 to the end but reads fast at steps 53-54 (its slow
    member arrived first and moved its bytes while the other still computed -- seen on a loaded CI
    runner): one episode, 30-99, costing its 68 slow steps.  Pair B's link adds 20 ms in steps 10-44
    and again in 65-99: two faults 20 quiet steps apart, two episodes."""
    a = {s: 20 * MS for s in range(30, 100) if s not in (53, 54)}
    b = {s: 20 * MS for s in [*range(10, 45), *range(65, 100)]}
    h = health.of_tables(*_job(link={"A": a}))
    link = _only(h["episodes"], "comm_slow")
    assert (link["onset_step"], link["end_step"], link["ranks"]) == (30, 99, [0, 1])
    assert link["cost_s"] == pytest.approx(68 * 20 * MS, rel=0.1)
    h = health.of_tables(*_job(link={"B": b}))
    assert [(e["onset_step"], e["end_step"]) for e in h["episodes"]] == [(10, 44), (65, 99)], h["episodes"]


def test_a_lesser_slowdown_running_into_a_fault_does_not_move_its_onset():
    """Pair A's link adds 4 ms in steps 25-29 (a loaded host, as a CI runner once did just before
    the shared run's injected fault) and 40 ms from step 30: both are slow steps end to end, but the
    fault starts at 30 -- one comm-slow episode 30-99, costing 70 x 40 ms; the five lesser steps
    (0.1 s) are no episode.  Pair B's link adds 6 ms in steps 10-59 (1.2 s: an episode's length) and 40 ms from 60:
    two faults of their own, two episodes (10-59, costing 50 x 6 ms; 60-99)."""
    lead_in = {s: 4 * MS for s in range(25, 30)} | {s: 40 * MS for s in range(30, 100)}
    h = health.of_tables(*_job(link={"A": lead_in}))
    link = _only(h["episodes"], "comm_slow")
    assert (link["onset_step"], link["end_step"], link["ranks"]) == (30, 99, [0, 1])
    assert link["cost_s"] == pytest.approx(70 * 40 * MS, rel=0.1)
    two = {s: 6 * MS for s in range(10, 60)} | {s: 40 * MS for s in range(60, 100)}
    h = health.of_tables(*_job(link={"B": two}))
    assert [(e["onset_step"], e["end_step"]) for e in sorted(h["episodes"], key=lambda e: e["onset_step"])] == [
        (10, 59), (60, 99)], h["episodes"]
    lesser = min(h["episodes"], key=lambda e: e["onset_step"])
    assert lesser["cost_s"] == pytest.approx(50 * 6 * MS, rel=0.1)
    # a link that degrades steadily, 0 to 40 ms over steps 20-99, is one episode (no level shift),
    # from where its excess passes the floor (~2 ms, 10% of a ~19 ms step: step 24) +- the draws
    ramp = {s: (s - 20) / 80 * 40 * MS for s in range(20, 100)}
    h = health.of_tables(*_job(link={"A": ramp}))
    e = _only(h["episodes"], "comm_slow")
    assert 22 <= e["onset_step"] <= 30 and e["end_step"] == 99, e


def test_noise_and_isolated_spikes_make_no_episode():
    """A healthy job with one-off 40 ms stalls of single ranks at scattered steps (a loaded host):
    no episode, no flagged step."""
    spikes = [(1, 17, 0.04), (3, 44, 0.04), (0, 45, 0.04), (2, 83, 0.04)]
    for seed in range(3):
        h = health.of_tables(*_job(seed=seed, spikes=spikes))
        assert h["episodes"] == [] and h["flagged_steps"] == 0, h["episodes"]


def test_a_slowdown_that_passes_within_a_second_is_not_an_episode():
    """Rank 3 computes 30 ms more in steps 50-55: six slow steps of ~48 ms, 0.3 s -- a scheduling
    burst's length, not a job turning slow (health.MIN_SECONDS)."""
    h = health.of_tables(*_job(compute={3: {s: 30 * MS for s in range(50, 56)}}))
    assert h["episodes"] == []
    long = health.of_tables(*_job(compute={3: {s: 30 * MS for s in range(50, 75)}}))  # 25 steps, 1.2 s
    assert [(e["class"], e["ranks"], e["onset_step"], e["end_step"]) for e in long["episodes"]] == [
        ("compute_slow", [3], 50, 74)]


def test_a_rank_slow_from_waiting_for_a_cpu_is_named_cpu_contention():
    """Rank 2 computes 30 ms more from step 40 and its training thread waited 28 ms of each of
    those steps for a CPU (its run-queue delay; peers ~0.2 ms): cpu-contention, the wait summed in
    the episode.  Rank 1 computes 25 ms more from step 20 with no such wait: compute-slow."""
    steps, comm = _job(compute={2: {s: 30 * MS for s in range(40, 100)},
                                1: {s: 25 * MS for s in range(20, 100)}})
    rng = np.random.default_rng(1)
    wait = rng.uniform(0.1, 0.3, len(steps)) * MS
    wait[(steps["rank"] == 2).to_numpy() & (steps["step"] >= 40).to_numpy()] += 28 * MS
    h = health.of_tables(steps.assign(cpu_wait_ns=(wait * 1e9).astype("int64")), comm)
    contention = _only(h["episodes"], "cpu_contention", ranks=[2])
    assert (contention["onset_step"], contention["end_step"]) == (40, 99)
    # 60 steps x 28 ms, less the peers' median wait (<= 0.3 ms a step)
    assert contention["cpu_wait_s"] == pytest.approx(60 * 28 * MS, rel=0.02)
    assert "CPU" in contention["why"]
    own = _only(h["episodes"], "compute_slow", ranks=[1])
    assert own["onset_step"] == 20 and own["cpu_wait_s"] < 0.05 * own["cost_s"]
    # a run written before the column: the same job, both ranks compute-slow
    plain = health.of_tables(steps, comm)
    assert sorted(e["ranks"][0] for e in plain["episodes"] if e["class"] == "compute_slow") == [1, 2]


def test_too_few_steps_say_why():
    h = health.of_tables(*_job(steps=6))
    assert h["episodes"] == [] and "warm-up" in h["note"]


# ------------------------------------------------------------------ real runs of the reference trainer
@pytest.mark.paced
def test_fail_slow_faults_in_a_trainer_run_are_found_from_its_tables(health_run):
    """8 ranks x 100 steps (tests/shared_runs.health_run): rank 5 computes 50 ms more from step 60;
    the dp groups holding rank 6 ({4,5,6,7} and {2,6}) move their bytes at 0.01 Gb/s from step 30.
    ``mfuscope analyze`` reads the run's tables (it has no trace window) and its report names one
    compute-slow episode of rank 5 from step 60 +- 2 and one comm-slow episode of rank 6's groups
    from step 30 +- 2, the two costliest.  Anything else it finds is a real slowdown of the shared
    machine (a loaded CI runner once held group {4,5,6,7} for steps 10-23, before the fault), which
    must stay small beside them: under a quarter of the link's episode."""
    proc = mfuscope("analyze", str(health_run), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    h = report["health"]
    rank, start = HEALTH_COMPUTE
    compute = [e for e in h["episodes"] if e["class"] == "compute_slow" and e["ranks"] == [rank]
               and abs(e["onset_step"] - start) <= 2]
    assert len(compute) == 1, h["episodes"]
    compute = compute[0]
    assert compute["end_step"] == 99 and compute["dim"] == "dp"
    # 50 ms a step for the 40 steps from 60 (minus what the threshold leaves out on the edges)
    assert 0.5 * 40 * 0.050 <= compute["cost_s"] <= 1.5 * 40 * 0.050, compute
    slow_rank, link_start = HEALTH_LINK
    link = [e for e in h["episodes"] if e["class"] == "comm_slow" and abs(e["onset_step"] - link_start) <= 2]
    assert len(link) == 1, h["episodes"]
    link = link[0]
    assert link["dim"] == "dp" and link["end_step"] == 99, link
    assert link["groups"] and all(slow_rank in g["ranks"] for g in link["groups"]), link
    others = [e for e in h["episodes"] if e is not compute and e is not link]
    assert all(e["cost_s"] < 0.25 * min(link["cost_s"], compute["cost_s"]) for e in others), h["episodes"]
    assert h["rank_scores"][0]["rank"] == rank  # the rank furthest below its best and its peers
    assert report["summary"]["ranks"] == 8
    text = mfuscope("analyze", str(health_run), "--out", str(health_run.parent / "again.json")).stdout
    assert "compute-slow  rank(s) 5" in text and "comm-slow" in text


@pytest.mark.paced
def test_a_healthy_run_of_500_steps_flags_under_one_percent(tmp_path):
    """2 ranks x 500 paced steps, no fault: fewer than 5 steps in episodes (the issue's 1%), on a
    machine the other lane may load."""
    config = tmp_path / "micro.toml"
    config.write_text(micro_config(n_layers=2, global_batch=8, grad_accum=1))
    # DDP: two collectives a step, so the 500 steps cost little more than their pacing (~15 ms each)
    run = train_forked(tmp_path / "healthy", 2, config=str(config), layout="dp_replicate=2", dp_mode="ddp",
                       steps=500, paced="fwd_ms=3,bwd_ms=6")
    h = health.analyze(run)
    assert h["steps"] + len(h["collectors_steps"]) == 500 - health.WARMUP_STEPS
    # The test's own co-tenants (the other lane of ``make test``) can hold a rank off its core for
    # seconds: that is a real slowdown, which the kernel's run-queue delay shows and the analysis
    # names cpu-contention.  Everything else flagged is a false positive.
    contention = [e for e in h["episodes"] if e["class"] == "cpu_contention"]
    flagged = h["flagged_steps"] - sum(e["slow_steps"] for e in contention)
    assert flagged < 5, h["episodes"]
    steps = run_dir.read_table(run, run_dir.STEPS).to_pandas()
    # the run-queue delay was recorded, and is time within the run (a wait can straddle two steps)
    assert steps["cpu_wait_ns"].notna().all() and (steps["cpu_wait_ns"] >= 0).all()
    assert steps["cpu_wait_ns"].sum() <= (steps["end_ns"] - steps["start_ns"]).sum()
