"""The always-on step timer: one row per step of this rank.

A step runs from the end of the previous one (or the first forward) to the
next ``prof.step()`` / optimizer step, so data loading and host stalls count
as the step's time, as the user experiences them.  On GPU a CUDA event at each
boundary also gives the device's view of the step; events are converted when
rows are flushed, never on the critical path.  Loss tensors are kept as they
are and read at flush time for the same reason (``.item()`` would sync).
"""
from __future__ import annotations

import time
from typing import Any

import torch


class DeviceClock:
    """CUDA events placed on the epoch-nanosecond clock through one reference event."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self._ref = self.event()
        self._ref.synchronize()
        self._ref_ns = time.time_ns()

    @staticmethod
    def event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def to_ns(self, event: Any) -> int | None:
        if event is None:
            return None
        event.synchronize()
        return self._ref_ns + int(self._ref.elapsed_time(event) * 1e6)


class StepTimer:
    def __init__(self, rank: int, clock: DeviceClock | None = None):
        self.rank = rank
        self.clock = clock
        self.step = 0
        self._start_ns: int | None = None
        self._start_event = None
        self.rows: list[dict] = []

    @property
    def started(self) -> bool:
        return self._start_ns is not None

    def begin(self) -> None:
        """Mark the start of the current step (the first one only; later steps start where the
        previous one ended)."""
        self._start_ns = time.time_ns()
        self._start_event = self.clock.event() if self.clock else None

    def end(self, tokens: int | None = None, loss: Any = None) -> int:
        """Close the current step; returns its index."""
        now = time.time_ns()
        if self._start_ns is None:  # nobody marked the start: an empty first step, not a made-up one
            self._start_ns = now
        if hasattr(loss, "to_local"):  # a replicated DTensor loss (loss parallel): its local value is the loss
            loss = loss.to_local()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        end_event = self.clock.event() if self.clock else None
        self.rows.append({"rank": self.rank, "step": self.step, "start_ns": self._start_ns, "end_ns": now,
                          "tokens": tokens, "loss": loss, "events": (self._start_event, end_event)})
        self.step += 1
        self._start_ns, self._start_event = now, end_event
        return self.step - 1

    def take_rows(self) -> list[dict]:
        """Remove and return the finished rows in the run-directory schema."""
        taken, self.rows = self.rows, []
        for row in taken:
            start, end = row.pop("events")
            row["device_time_ns"] = (self.clock.to_ns(end) - self.clock.to_ns(start)
                                     if self.clock and start is not None else None)
            row["loss"] = _number(row["loss"])
            row["tokens"] = None if row["tokens"] is None else int(row["tokens"])
        return taken


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.float().mean())
    return float(value)
