"""Where the map of an analysis runs: any ``concurrent.futures.Executor``, fed a bounded number of tasks.

The map (:mod:`.map_reduce`) only calls ``submit`` and reads futures, so the local process pool
here and a cluster's executor (``distributed.Client(...).get_executor()``) take the same path.
:func:`bounded_map` keeps at most ``in_flight`` tasks submitted at a time: results come back
as they finish and are folded at once, so neither the parent nor the executor's queue holds a
thousand ranks' results.

The local pool (:class:`RecyclingPool`) forks its workers from the parent -- they start in
milliseconds with everything imported, where spawned ones would import pandas and pyarrow
again -- and replaces them all after :data:`TASKS_PER_WORKER` ranks each: a parser's heap keeps
the high-water mark of the largest trace it has read, so a long-lived worker's memory only grows.
(``max_tasks_per_child`` would do it per worker, but Python refuses it for forked workers.)
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

#: Ranks a local worker analyzes before the pool's workers are replaced by fresh ones.
TASKS_PER_WORKER = 16


class RecyclingPool(Executor):
    """A forked process pool of ``workers`` whose workers are all replaced after
    ``workers * tasks_per_worker`` tasks: the pool finishes what it was given, then a new one
    takes the next tasks (a short drain, one task long, every few dozen ranks)."""

    def __init__(self, workers: int, tasks_per_worker: int = TASKS_PER_WORKER):
        self.workers, self.limit = workers, workers * tasks_per_worker
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        self._ctx = multiprocessing.get_context(method)
        self._pool: ProcessPoolExecutor | None = None
        self._given = 0

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._pool is not None and self._given >= self.limit:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._pool is not None:
            self._given += 1
            return self._pool.submit(fn, *args, **kwargs)
        # pyarrow imports pandas at its first conversion of an array: imported before the fork, it
        # is shared by the workers, not imported again in each (0.9 CPU s and ~45 MB apiece).
        import pandas  # noqa: F401

        self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=self._ctx)
        self._given = 1
        # The workers fork on this first submit.  Frozen, the parent's objects are left out of the
        # workers' garbage collections, which would otherwise write to every page holding one (its
        # header) and so copy the parent's whole heap into each worker: at 1,024 ranks a worker
        # grew by the parent's growth.
        gc.collect()
        gc.freeze()
        try:
            return self._pool.submit(fn, *args, **kwargs)
        finally:
            gc.unfreeze()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
            self._pool = None


def local_pool(workers: int) -> Executor:
    """The local process pool of ``workers`` (see :class:`RecyclingPool`)."""
    return RecyclingPool(workers)


def default_workers(jobs: int, asked: int | None = None) -> int:
    """The pool size: what was asked, else the CPU count, never more than there are jobs."""
    return max(1, min(asked or os.cpu_count() or 1, jobs))


def bounded_map(executor: Executor, fn: Callable[[T], Any], jobs: Iterable[T],
                in_flight: int) -> Iterator[tuple[T, Future]]:
    """(job, its finished future) for every job, in the order they finish, with at most
    ``in_flight`` submitted and unfinished at any time.  A future's exception is the caller's
    to read (``future.result()`` raises it)."""
    pending: dict[Future, T] = {}
    todo = iter(jobs)
    for job in todo:
        pending[executor.submit(fn, job)] = job
        if len(pending) >= in_flight:
            break
    while pending:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for fut in done:
            job = pending.pop(fut)
            nxt = next(todo, None)
            if nxt is not None:
                pending[executor.submit(fn, nxt)] = nxt
            yield job, fut
