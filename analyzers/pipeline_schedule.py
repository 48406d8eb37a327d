"""The theoretical pipeline schedule: when each stage would run each microbatch on a perfect machine.

Each stage runs its actions in the schedule's order; an action starts when
its stage is free and its inputs exist (forward i on stage s after forward i on
s-1; backward i on s after backward i on s+1 and its own forward i).  Sends
cost nothing and every forward takes ``t_f``, every backward ``t_b``.  Orders:

- ``gpipe``: all forwards, then all backwards;
- ``1f1b`` (PipeDream-Flush): stage s runs p-1-s warm-up forwards, then
  alternates one forward and one backward, then drains the backwards.

The resulting bubble is (p-1)/(m+p-1) of the step for both (Narayanan et
al. 2021) -- :mod:`bubbles` uses that closed form; the tests check this
simulation against it.  Interleaved and zero-bubble schedules are drawn as
1F1B; :mod:`bubbles` holds their own theory.
"""
from __future__ import annotations

import pandas as pd


def order(schedule: str, p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The (action, microbatch) sequence one stage runs."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - 1 - stage, m)
    seq = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            seq.append(("F", f))
            f += 1
        seq.append(("B", b))
        b += 1
    return seq


def simulate(schedule: str, p: int, m: int, t_f: float = 1.0, t_b: float = 2.0) -> pd.DataFrame:
    """Columns: stage, action (F/B), microbatch, start, end -- in the units of t_f and t_b."""
    if schedule not in ("gpipe", "1f1b"):
        schedule = "1f1b"
    queues = {s: order(schedule, p, m, s) for s in range(p)}
    done: dict[tuple[int, str, int], float] = {}
    free = {s: 0.0 for s in range(p)}
    rows = []
    while any(queues.values()):
        progressed = False
        for s in range(p):
            while queues[s]:
                action, i = queues[s][0]
                needs = ([(s - 1, "F", i)] if action == "F" and s > 0 else []) + \
                        ([(s, "F", i)] + ([(s + 1, "B", i)] if s < p - 1 else []) if action == "B" else [])
                if not all(n in done for n in needs):
                    break
                start = max([free[s]] + [done[n] for n in needs])
                end = start + (t_f if action == "F" else t_b)
                done[(s, action, i)] = free[s] = end
                rows.append((s, action, i, start, end))
                queues[s].pop(0)
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks for p={p}, m={m}")
    return pd.DataFrame(rows, columns=["stage", "action", "microbatch", "start", "end"])


def bubble_fraction(sim: pd.DataFrame) -> float:
    """Mean over stages of the time a stage is not working, over the whole schedule's length."""
    span = sim["end"].max() - sim["start"].min()
    busy = (sim["end"] - sim["start"]).groupby(sim["stage"]).sum()
    return float((1 - busy / span).mean())
