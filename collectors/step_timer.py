"""The always-on step timer: one row per step of this rank.

A step runs from the end of the previous one (or the first forward) to the
next ``prof.step()`` / optimizer step, so data loading and host stalls count
as the step's time, as the user experiences them.  On GPU a CUDA event at each
boundary also gives the device's view of the step; events are converted when
rows are flushed, never on the critical path.  Loss tensors are kept as they
are and read at flush time for the same reason (``.item()`` would sync).

Each row also carries the training thread's run-queue delay over the step (``cpu_wait_ns``): time
it was ready to run but waited for a CPU.  A rank that is slow because its host is oversubscribed
(data-loader workers, too many threads, another job on the node) shows it there, which is how the
health analysis tells such a rank from one whose device or work is slow.
"""
from __future__ import annotations

import os
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


class RunQueueDelay:
    """The cumulative run-queue delay (ns) of the thread that created it -- the training thread,
    which builds the profiling session -- from ``/proc/thread-self/schedstat`` (its second field;
    the descriptor stays bound to that thread whichever thread reads it); ``read()`` is None where
    the kernel has no such file.  One descriptor, read in a few microseconds a step."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return None


class StepTimer:
    def __init__(self, rank: int, clock: DeviceClock | None = None):
        self.rank = rank
        self.clock = clock
        self.step = 0
        self._start_ns: int | None = None
        self._start_event = None
        self._run_queue = RunQueueDelay()
        self._start_wait: int | None = None
        self._collector_ns = 0
        self.rows: list[dict] = []

    @property
    def started(self) -> bool:
        return self._start_ns is not None

    def begin(self) -> None:
        """Mark the start of the current step (the first one only; later steps start where the
        previous one ended)."""
        self._start_ns = time.time_ns()
        self._start_event = self.clock.event() if self.clock else None
        self._start_wait = self._run_queue.read()

    def end(self, tokens: int | None = None, loss: Any = None) -> int:
        """Close the current step; returns its index."""
        now = time.time_ns()
        wait = self._run_queue.read()
        if self._start_ns is None:  # nobody marked the start: an empty first step, not a made-up one
            self._start_ns, self._start_wait = now, wait
        if hasattr(loss, "to_local"):  # a replicated DTensor loss (loss parallel): its local value is the loss
            loss = loss.to_local()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        end_event = self.clock.event() if self.clock else None
        self.rows.append({"rank": self.rank, "step": self.step, "start_ns": self._start_ns, "end_ns": now,
                          "tokens": tokens, "loss": loss, "events": (self._start_event, end_event),
                          "cpu_wait_ns": (wait - self._start_wait if wait is not None and self._start_wait is not None
                                          else None),
                          "collector_ns": self._collector_ns})
        self.step += 1
        self._collector_ns = 0
        self._start_ns, self._start_event, self._start_wait = now, end_event, wait
        return self.step - 1

    def add_collector_time(self, ns: int) -> None:
        """The collectors worked ``ns`` on the training thread inside the current step."""
        self._collector_ns += ns

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
