"""Whole-run health: when a job that was fine turned slow, which ranks or groups did it, and what
it cost.

The traced window is a handful of steps; a GPU that throttles, a NIC that degrades or a host that
starts swapping at step 12,000 is outside it.  The always-on collectors time every step
(``steps.parquet``) and every collective (``comm.parquet``) of the whole run, which is enough to
find such episodes and say who caused them:

- **compute-slow**: a rank works longer than its peers before its collectives -- its *own delay*
  at a collective is how much longer it worked, since its previous collective (in any group)
  completed, than the group's other members did, summed over the step's collectives.  Its peers
  wait for it; a rank held late by another group's slow collective is not charged.
- **comm-slow**: a group's collectives are long with nobody late -- a collective's *transfer* is the
  time from the last member's arrival to its completion, summed per group and step.  Groups that
  slow down together are one episode, and the ranks they share name the culprit: every dp group
  holding rank 6 slowed, and only those, is rank 6's link.
- **cpu-contention**: a compute-slow rank whose training thread, in those steps, waited for a CPU
  (the kernel's run-queue delay, ``cpu_wait_ns`` in the step table) longer than its peers did, by
  at least half the episode's cost: its host is oversubscribed (data-loader workers, too many
  threads, another job on the node), not its device or its share of the work.
- **host**: the step got longer for every rank and neither explains it (a checkpoint save, a shared
  loader, a synchronized GC).  A stall on one rank only makes its peers wait for it, so it reads as
  that rank compute-slow; the traces' findings tell a loader or GC stall from compute where the
  profiled window covers it.

Each signal is a matrix of entities (ranks, groups, or the job) by steps.  A step is slow for an
entity when the signal exceeds its reference -- the lower of the entity's own best steps (10th
percentile) and its peers' median that step (the other ranks of the job; the other groups of the
same dimension and size), so a fault present from the first step still stands out against the
peers and one every peer shares against the entity's past -- by more than ``max(6 x the entity's
step-to-step noise, min_share of the median step)``.  An **episode** is a run of at least five
slow steps (one quiet step between two allowed, four in five slow; two such runs with a quiet
stretch under a tenth of their span between them are one) or at least four slow steps
at one period (an intermittent fault, ``every=N``: one episode with its period, not N), lasting
a second or more from onset to end.  Other slow steps are noise -- a loaded host's scheduling,
whose bursts pass within a second -- and are not reported.  The onset is the
first step of the episode at its level: a run whose first (or last) slow steps exceed by under
half its median excess is a lesser slowdown running into the fault (or out of it) and is split
there.  Its what-if **cost** sums, over its slow steps, the part of the
job's step-time excess that the episode's own signal accounts for: the run's time had it not
happened.

Per rank, two scores as nvidia-resiliency-ext's straggler detection reports them, both in (0, 1]
(1 is best): *individual* = the rank's best rolling-median busy time over its current one (busy =
its step time less the time it waited in collectives for others); *relative* = the best rank's
current busy time over this rank's.  "Current" is the median over the run's last ``window`` steps.

The first :data:`WARMUP_STEPS` steps (allocation, communicator set-up, autotuning: slower on every
job) are left out of everything.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mfuscope import run_dir

from . import step_rows
from .stragglers import leave_one_out_median

MIN_SHARE = 0.10      # a slowdown under this share of the median step is not an episode
NOISE_K = 6.0         # ... nor one within this many times the entity's step-to-step noise
MIN_RUN = 5           # slow steps (one quiet step allowed between) that make an episode: a loaded
                      # host's scheduling bursts make three in a row now and then
MAX_QUIET_SHARE = 0.1  # two runs of slow steps this close (quiet steps over their span) are one episode
MIN_SECONDS = 1.0     # ... and that last, onset to end, at least this long
MIN_PERIODIC = 4      # isolated slow steps at one period that make an intermittent episode
MAX_BEATS = 3         # ... each at most this many periods after the one before (some beats may read fast)
WARMUP_STEPS = 5      # steps 0-4 left out: allocator growth, communicator set-up, autotuning settle
SCORE_WINDOW = 20     # steps of the "current" busy time in the rank scores
KEEP_SCORES = 64      # rank scores kept in the report: the worst (every rank's are in the views)

_COMM_COLUMNS = ["rank", "step", "dim", "pg", "group_ranks", "seq", "enqueue_ns", "end_ns"]


def analyze(run: str | Path) -> dict[str, Any] | None:
    """The health section of a run directory's report; None where the run has no step table."""
    run = Path(run)
    if not (run / run_dir.STEPS).exists():
        return None
    steps = run_dir.read_table(run, run_dir.STEPS).select(["rank", "step", "start_ns", "end_ns",
                                                           "cpu_wait_ns", "collector_ns"]).to_pandas()
    comm = None
    if (run / run_dir.COMM).exists():
        comm = run_dir.read_table(run, run_dir.COMM).select(_COMM_COLUMNS).to_pandas()
    return of_tables(steps, comm)


def of_tables(steps: pd.DataFrame, comm: pd.DataFrame | None, min_share: float = MIN_SHARE) -> dict[str, Any]:
    """Episodes and rank scores from the step rows (rank, step, start_ns, end_ns, and cpu_wait_ns
    and collector_ns where the run recorded them) and the collective rows (:data:`_COMM_COLUMNS`)
    of a run."""
    steps, theirs = _without_collectors(steps[steps["step"] >= WARMUP_STEPS])
    if steps["step"].nunique() < MIN_RUN:
        return _empty(f"fewer than {MIN_RUN} steps after the first {WARMUP_STEPS} (warm-up)")
    rank_step = steps.assign(seconds=(steps["end_ns"] - steps["start_ns"]) / 1e9).pivot_table(
        index="rank", columns="step", values="seconds", aggfunc="max")
    job = rank_step.max(axis=0)                            # the job's step time: its slowest rank's
    step_ids = job.index.to_numpy()
    floor = min_share * float(job.median())
    instances, calls = _instances(comm, set(step_ids)) if comm is not None and len(comm) else (None, None)

    episodes: list[dict[str, Any]] = []
    if instances is not None and len(instances):
        late = _matrix(calls, "rank", "own_s", rank_step.index, step_ids)
        late_excess, late_slow = _slow(late, np.zeros(len(late)), floor)
        episodes += _rank_episodes(late_excess, late_slow, calls, step_ids)
        groups = instances.drop_duplicates("pg").set_index("pg")
        xfer = _matrix(instances, "pg", "transfer_s", groups.index, step_ids)
        peers = groups["dim"].astype(str) + "/" + groups["size"].astype(str)
        xfer_excess, xfer_slow = _slow(xfer, peers.reindex(xfer.index).to_numpy(), floor)
        episodes += _group_episodes(xfer_excess, xfer_slow, groups, step_ids)
        explained = _explained(late_excess * late_slow, xfer_excess * xfer_slow, groups, rank_step.index)
    else:
        explained = pd.Series(0.0, index=step_ids)
    job_excess, _ = _slow(job.to_frame().T, np.zeros(1), floor)
    unexplained = (job_excess.iloc[0] - explained.reindex(step_ids, fill_value=0.0)).clip(lower=0.0)
    host_slow = unexplained.to_numpy() > _threshold(job.to_numpy()[None, :], floor)[0, 0]
    episodes += _host_episodes(unexplained, host_slow, step_ids, rank_step)

    # A slowdown that passes within a second is a scheduling burst, not a job turning slow (it
    # matters only where steps are a few ms: five steps of a real job already take seconds).
    episodes = [e for e in episodes if float(job.loc[e["onset_step"]:e["end_step"]].sum()) >= MIN_SECONDS]
    flagged = np.isin(step_ids, np.concatenate([e["_steps"] for e in episodes] or [step_ids[:0]]))
    healthy = job[~flagged]
    if len(healthy):
        baseline = float(healthy.median())
        step_excess = (job - baseline).clip(lower=0.0)
    else:  # slow from the first step to the last: no healthy step to measure against; the signals are the cost
        baseline = None
        step_excess = pd.Series(np.inf, index=job.index)
    for e in episodes:
        signal = e.pop("_signal")
        e["cost_s"] = float(np.minimum(step_excess.reindex(e["_steps"]).to_numpy(), signal).sum())
        e["slow_steps"] = len(e.pop("_steps"))
        e["cost_per_step_s"] = e["cost_s"] / e["slow_steps"]
    _name_cpu_contention(episodes, steps, step_ids)
    episodes.sort(key=lambda e: -e["cost_s"])
    return {
        "episodes": episodes,
        "rank_scores": _scores(rank_step, calls),
        "steps": int(len(step_ids)), "flagged_steps": int(flagged.sum()), "collectors_steps": theirs,
        "baseline_step_s": baseline,
        "method": (f"slow = over its reference by more than max({NOISE_K:g} x its step-to-step noise, "
                   f"{min_share:.0%} of the median step); an episode = {MIN_RUN}+ slow steps in a run or "
                   f"{MIN_PERIODIC}+ at one period, over {MIN_SECONDS:g} s or more; "
                   f"steps 0-{WARMUP_STEPS - 1} (warm-up) and the collectors' own steps left out"),
        "source": "steps.parquet" + (" and comm.parquet" if instances is not None else ""),
    }


def _without_collectors(steps: pd.DataFrame) -> tuple[pd.DataFrame, list[int]]:
    """The step rows less the steps the collectors took over, and those steps: where their own work
    on the training thread (a flush of their tables, a trace export: ``collector_ns``) passed
    :data:`.step_rows.COLLECTOR_SHARE` of the median step, as the step statistics leave them out.
    A flush is no job turning slow, yet where steps are short it recurs at its period, which
    is what an intermittent episode looks for (measured: a 2-rank run of 18 ms median steps
    flushed every 50 steps in 5-7 ms, those steps 24-36 ms)."""
    if "collector_ns" not in steps or steps.empty:
        return steps, []
    rows = pd.DataFrame({"step": steps["step"], "seconds": (steps["end_ns"] - steps["start_ns"]) / 1e9,
                         "collector_s": steps["collector_ns"].fillna(0) / 1e9})
    theirs = sorted(step_rows.collectors_steps(rows))
    return (steps[~steps["step"].isin(theirs)] if theirs else steps), theirs


def _empty(note: str) -> dict[str, Any]:
    return {"episodes": [], "rank_scores": [], "steps": 0, "flagged_steps": 0, "collectors_steps": [],
            "baseline_step_s": None,
            "note": note}


# ---------------------------------------------------------------- the signals

def _instances(comm: pd.DataFrame, steps: set) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per collective instance -- group and sequence number -- every member completed: its
    step, dimension, size, ranks and transfer, from the last arrival to the last completion;
    one row per member's call: its own delay and its wait).

    A member's *own delay* is how much longer it worked before arriving -- since its previous
    collective, in any group, completed -- than the other members did (the other's time in a group
    of two, the group's median in larger ones): the lateness it caused.  A rank that arrives late
    because it was held in another group's slow collective worked no longer than its peers, and is
    not charged.  Its *wait* is how long it stood in the collective for the last arrival."""
    c = comm.dropna(subset=["end_ns"])
    c = c.assign(size=c["group_ranks"].map(_size_of(c["group_ranks"].unique())))
    c = c.sort_values(["rank", "enqueue_ns"], kind="stable")
    before = c.groupby("rank", sort=False)["end_ns"].cummax().groupby(c["rank"], sort=False).shift(1)
    c = c.assign(gap=((c["enqueue_ns"] - before).clip(lower=0) / 1e9).fillna(0.0))
    c = c[c["size"] > 1]
    key = [c["pg"], c["seq"]]
    c = c[c.groupby(key)["rank"].transform("size") == c["size"]]  # some member never finished: not judged
    key = [c["pg"], c["seq"]]
    g = c.groupby(key, sort=False)
    last_arrival = g["enqueue_ns"].transform("max")
    others = np.where(c["size"] == 2, g["gap"].transform("sum") - c["gap"], g["gap"].transform("median"))
    calls = pd.DataFrame({"rank": c["rank"], "step": c["step"], "dim": c["dim"],
                          "own_s": (c["gap"] - others).clip(lower=0.0),
                          "wait_s": (last_arrival - c["enqueue_ns"]) / 1e9})
    first = g.head(1).set_index(["pg", "seq"])
    instances = pd.DataFrame({
        "step": g["step"].max(), "dim": first["dim"], "size": first["size"], "group_ranks": first["group_ranks"],
        "transfer_s": (g["end_ns"].max() - g["enqueue_ns"].max()) / 1e9,
    }).reset_index()
    return (instances[instances["step"].isin(steps)].reset_index(drop=True),
            calls[calls["step"].isin(steps)].reset_index(drop=True))


def _size_of(lists) -> dict[str, int]:
    return {s: len(str(s).split(",")) for s in lists}


def _matrix(rows: pd.DataFrame, entity: str, value: str, index, step_ids: np.ndarray) -> pd.DataFrame:
    m = rows.groupby([entity, "step"])[value].sum().unstack("step")
    return m.reindex(index=index, columns=step_ids).fillna(0.0)


def _threshold(values: np.ndarray, floor: float) -> np.ndarray:
    """Per entity (a row of ``values``, steps across): the excess that makes a step slow.  The
    spread is that of step-to-step differences (their scaled MAD over sqrt 2), which a level shift
    -- the very episode sought, however long -- does not inflate, where the values' own MAD would."""
    diffs = np.diff(values, axis=1)
    noise = np.median(np.abs(diffs - np.median(diffs, axis=1, keepdims=True)), axis=1) * 1.4826 / np.sqrt(2)
    return np.maximum(NOISE_K * noise, floor)[:, None]


def _slow(m: pd.DataFrame, cohort: np.ndarray, floor: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(excess over the reference, slow or not) of each entity and step (see the module docstring)."""
    values = m.to_numpy(dtype=float)
    own = np.percentile(values, 10, axis=1)[:, None]
    ref = np.repeat(own, values.shape[1], axis=1)
    for c in pd.unique(cohort):
        rows = np.flatnonzero(cohort == c)
        if len(rows) > 1:
            ref[rows] = np.minimum(ref[rows], leave_one_out_median(values[rows]))
    excess = values - ref
    return (pd.DataFrame(excess, index=m.index, columns=m.columns),
            pd.DataFrame(excess > _threshold(values, floor), index=m.index, columns=m.columns))


def _explained(late: pd.DataFrame, xfer: pd.DataFrame, groups: pd.DataFrame, ranks) -> pd.Series:
    """Per step: the most any rank's slowness explains -- its own lateness plus the extra transfer of
    the slow groups it is in."""
    members = {pg: [int(r) for r in str(gr).split(",")] for pg, gr in groups["group_ranks"].items()}
    per_rank = late.reindex(ranks, fill_value=0.0).copy()
    for pg, row in xfer.iterrows():
        for r in members.get(pg, []):
            if r in per_rank.index:
                per_rank.loc[r] += row
    return per_rank.max(axis=0)


# ---------------------------------------------------------------- episodes

def _spans(slow: np.ndarray, excess: np.ndarray, step_ids: np.ndarray) -> list[tuple[np.ndarray, int | None]]:
    """(the slow steps' positions, period or None) of each episode in one entity's slow mask
    (``excess``: its excess over the reference, each step)."""
    hits = np.flatnonzero(slow)
    if len(hits) == 0:
        return []
    runs, current = [], [hits[0]]
    for i in hits[1:]:
        if step_ids[i] - step_ids[current[-1]] <= 2:  # one quiet step inside a run is allowed
            current.append(i)
        else:
            runs.append(current)
            current = [i]
    runs.append(current)
    # A run: MIN_RUN slow steps, four in five of its steps slow (scattered noise chains otherwise).
    held = [len(r) >= MIN_RUN and len(r) >= 0.8 * (step_ids[r[-1]] - step_ids[r[0]] + 1) for r in runs]
    out = [(part, None) for r in _joined([r for r, ok in zip(runs, held) if ok], step_ids)
           for part in _level_parts(np.arange(r[0], r[-1] + 1), excess)]
    isolated = np.array([i for r, ok in zip(runs, held) if not ok for i in r])
    if len(isolated) >= MIN_PERIODIC:
        gaps = np.diff(step_ids[isolated])
        period = int(pd.Series(gaps).mode().iloc[0])
        # On the beat: a whole number of periods after the slow step before, and few enough that the
        # period is what spaces them -- any gap is a multiple of a period of 2, and scattered bursts
        # of two slow steps a co-tenant makes (gap 2 inside each) once read as "every 2 steps".
        on_beat = (gaps % period == 0) & (gaps <= MAX_BEATS * period)
        regular = isolated[np.r_[True, on_beat]] if period >= 2 else isolated[:0]
        if len(regular) >= MIN_PERIODIC and on_beat.mean() >= 0.75:
            out.append((regular, period))
    return out


def _level_parts(span: np.ndarray, excess: np.ndarray) -> list[np.ndarray]:
    """A run made of two levels end to end is two causes -- a loaded host's lesser slowdown running
    into a link fault, say: the fault begins where its level does, not at the first slow step.  The
    run is cut where two flat levels fit it best (least squares), when the lower is under half the
    higher and the signal jumps there (by half the levels' difference, over three steps each side:
    a slowdown that ramps up is one episode), and each part is cut again the same way.  A lesser
    part shorter than an episode (:data:`MIN_RUN` steps) is dropped; a greater one that short is no
    level: the run stays whole."""
    x = excess[span]
    n = len(x)
    if n < 2:
        return [span]
    k = np.arange(1, n)
    c, c2 = np.cumsum(x), np.cumsum(x * x)
    sse = (c2[k - 1] - c[k - 1] ** 2 / k) + ((c2[-1] - c2[k - 1]) - (c[-1] - c[k - 1]) ** 2 / (n - k))
    cut = int(k[np.argmin(sse)])
    left, right = span[:cut], span[cut:]
    low, high = sorted((left, right), key=lambda p: float(np.mean(excess[p])))
    gap = float(np.mean(excess[high]) - np.mean(excess[low]))
    jump = abs(float(np.median(x[cut:cut + 3]) - np.median(x[max(cut - 3, 0):cut])))
    if gap <= float(np.mean(excess[high])) / 2 or jump < gap / 2 or len(high) < MIN_RUN:
        return [span]
    return [q for p in (left, right) if p is high or len(p) >= MIN_RUN for q in _level_parts(p, excess)]


def _joined(runs: list[list[int]], step_ids: np.ndarray) -> list[list[int]]:
    """Consecutive runs of one entity that a short quiet stretch separates -- at most
    :data:`MAX_QUIET_SHARE` of the two runs' span -- are one fault: a link held slow for 70 steps
    reads fast for two when its slow rank happens to arrive first and starts its transfer while the
    others are still computing."""
    out: list[list[int]] = []
    for r in runs:
        if out:
            first, last = step_ids[out[-1][0]], step_ids[r[-1]]
            quiet = step_ids[r[0]] - step_ids[out[-1][-1]] - 1
            if quiet <= MAX_QUIET_SHARE * (last - first + 1):
                out[-1] = out[-1] + r
                continue
        out.append(list(r))
    return out


def _episode(cls: str, positions: np.ndarray, period: int | None, step_ids: np.ndarray, signal: np.ndarray,
             **fields: Any) -> dict[str, Any]:
    steps = step_ids[positions]
    return {"onset_step": int(steps[0]), "end_step": int(steps[-1]), "class": cls, **fields,
            "period": period, "ongoing": bool(steps[-1] == step_ids[-1]),
            "_steps": steps, "_signal": signal[positions]}


def _family(dims) -> str:
    """The parallel dimension a set of group dimensions belongs to (dp_shard_cp, dp_replicate -> dp)."""
    names = sorted({("dp" if str(d).startswith("dp") else str(d)) for d in dims})
    return names[0] if len(names) == 1 else "+".join(names)


def _rank_episodes(excess: pd.DataFrame, slow: pd.DataFrame, calls: pd.DataFrame,
                   step_ids: np.ndarray) -> list[dict[str, Any]]:
    out = []
    for rank in slow.index[slow.to_numpy().any(axis=1)]:
        for positions, period in _spans(slow.loc[rank].to_numpy(), excess.loc[rank].to_numpy(), step_ids):
            steps = set(step_ids[positions].tolist())
            mine = calls[(calls["rank"] == rank) & calls["step"].isin(steps)]
            by_dim = mine.groupby("dim")["own_s"].sum().sort_values(ascending=False)
            out.append(_episode("compute_slow", positions, period, step_ids, excess.loc[rank].to_numpy(),
                                ranks=[int(rank)], dim=_family(by_dim.index[:1]),
                                own_delay_s_by_dim={str(d): float(s) for d, s in by_dim.items()},
                                why=f"rank {int(rank)} works longer than its peers before its collectives; "
                                    "they wait for it"))
    return _merge(out)


def _group_episodes(excess: pd.DataFrame, slow: pd.DataFrame, groups: pd.DataFrame,
                    step_ids: np.ndarray) -> list[dict[str, Any]]:
    found = []
    for pg in slow.index[slow.to_numpy().any(axis=1)]:
        members = [int(r) for r in str(groups.at[pg, "group_ranks"]).split(",")]
        for positions, period in _spans(slow.loc[pg].to_numpy(), excess.loc[pg].to_numpy(), step_ids):
            found.append(_episode("comm_slow", positions, period, step_ids, excess.loc[pg].to_numpy(),
                                  groups=[{"pg": str(pg), "dim": str(groups.at[pg, "dim"]), "ranks": members}]))
    merged = _merge(found)
    for e in merged:
        sets = [set(g["ranks"]) for g in e["groups"]]
        shared = set.intersection(*sets)
        e["ranks"] = sorted(shared if shared and len(sets) > 1 else set.union(*sets))
        e["dim"] = _family(g["dim"] for g in e["groups"])
        e["why"] = ("collectives of " + ("the groups holding rank(s) " + ", ".join(map(str, e["ranks"]))
                                         if shared and len(sets) > 1 else "these groups")
                    + " take longer with nobody late: a slow link or NIC")
    return merged


def _host_episodes(unexplained: pd.Series, slow: np.ndarray, step_ids: np.ndarray,
                   rank_step: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for positions, period in _spans(slow, unexplained.to_numpy(), step_ids):
        out.append(_episode("host", positions, period, step_ids, unexplained.to_numpy(),
                            ranks=[int(r) for r in rank_step.index], dim=None,
                            why="every rank's step got longer with nobody late and no collective slower: "
                                "a host-side stall (checkpoint save, data loading, garbage collection)"))
    return _merge(out)


def _merge(episodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Episodes of one class that start within two steps of each other and recur alike are one:
    their ranks (and groups) together, their signals added."""
    out: list[dict[str, Any]] = []
    for e in sorted(episodes, key=lambda e: e["onset_step"]):
        same = next((o for o in out if o["class"] == e["class"] and abs(o["onset_step"] - e["onset_step"]) <= 2
                     and o["period"] == e["period"]), None)
        if same is None:
            out.append(e)
            continue
        steps = np.union1d(same["_steps"], e["_steps"])
        signal = (pd.Series(same["_signal"], index=same["_steps"]).reindex(steps, fill_value=0.0)
                  + pd.Series(e["_signal"], index=e["_steps"]).reindex(steps, fill_value=0.0))
        same.update(_steps=steps, _signal=signal.to_numpy(), end_step=int(max(same["end_step"], e["end_step"])),
                    ongoing=same["ongoing"] or e["ongoing"])
        if "groups" in e:
            same["groups"] += e["groups"]
        else:
            same["ranks"] = sorted(set(same["ranks"]) | set(e["ranks"]))
            for d, s in (e.get("own_delay_s_by_dim") or {}).items():
                same["own_delay_s_by_dim"][d] = same["own_delay_s_by_dim"].get(d, 0.0) + s
    return out


def _name_cpu_contention(episodes: list[dict[str, Any]], steps: pd.DataFrame, step_ids: np.ndarray) -> None:
    """Give each compute-slow episode the CPU wait its ranks had beyond their peers' median in its
    steps (``cpu_wait_s``), and re-class it ``cpu_contention`` where that covers half its cost."""
    if "cpu_wait_ns" not in steps or steps["cpu_wait_ns"].isna().all():
        return
    wait = steps.pivot_table(index="rank", columns="step", values="cpu_wait_ns", aggfunc="max") / 1e9
    wait = wait.reindex(columns=step_ids).fillna(0.0)
    extra = (wait - leave_one_out_median(wait.to_numpy())).clip(lower=0.0)
    for e in episodes:
        if e["class"] != "compute_slow":
            continue
        in_steps = [s for s in range(e["onset_step"], e["end_step"] + 1) if s in extra.columns]
        e["cpu_wait_s"] = float(extra.loc[extra.index.isin(e["ranks"]), in_steps].to_numpy().sum())
        if e["cost_s"] > 0 and e["cpu_wait_s"] >= 0.5 * e["cost_s"]:
            e["class"] = "cpu_contention"
            e["why"] = (f"rank(s) {', '.join(map(str, e['ranks']))}: the training thread waited "
                        f"{e['cpu_wait_s']:.2f} s for a CPU in these steps beyond its peers (the kernel's run "
                        "queue): the host is oversubscribed -- data-loader workers, too many threads, another "
                        "process on its cores -- not the device")


# ---------------------------------------------------------------- rank scores

def _scores(rank_step: pd.DataFrame, calls: pd.DataFrame | None) -> list[dict[str, Any]]:
    busy = rank_step.copy()
    if calls is not None and len(calls):
        wait = _matrix(calls, "rank", "wait_s", busy.index, busy.columns.to_numpy())
        busy = (busy - wait).clip(lower=0.0)
    n = busy.shape[1]
    window = max(1, min(SCORE_WINDOW, n // 5 or 1))
    rolling = busy.T.rolling(window, min_periods=window).median().T
    current = busy.iloc[:, -window:].median(axis=1)
    best_own = rolling.min(axis=1).fillna(current)
    best_rank = float(current.min())
    rows = [{"rank": int(r), "individual": _ratio(best_own[r], current[r]), "relative": _ratio(best_rank, current[r]),
             "busy_s": float(current[r]), "best_busy_s": float(best_own[r])} for r in busy.index]
    rows.sort(key=lambda x: (min(x["individual"], x["relative"]), x["rank"]))
    return rows[:KEEP_SCORES]


def _ratio(best: float, now: float) -> float:
    return 1.0 if now <= 0 else float(min(1.0, best / now))
