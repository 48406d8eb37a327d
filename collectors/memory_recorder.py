"""``--profile-memory``: the model states this rank holds, and the profiled window's memory files.

The profiler's memory categorizer files FSDP2's sharded gradients and optimizer state as parameters,
so the states are counted here from the tensors themselves: at every optimizer step (a global step
hook, so any optimizer is seen however the model is wrapped), the local shards of the parameters it
steps, of their gradients (alive at the step, whenever the loop zeroes them) and of its state.  The
model's parameters no optimizer steps (frozen ones) count as parameters too.  On a GPU each step's
row also has the caching allocator's peaks over the step (``max_memory_allocated``/``reserved``,
reset at each step start) -- null on the CPU, whose allocator keeps no such statistics.

At the window's end (:meth:`MemoryRecorder.write_window`): the memory timeline of the window
(``memory/rank<N>.raw.json.gz``, every tensor's life with its category, the tensors alive before
the window included) and on a GPU the allocator's snapshot with its recorded history
(``memory/rank<N>.snapshot.pickle``, readable at pytorch.org/memory_viz and by ``mfuscope memory``).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from mfuscope import run_dir

#: Allocator actions kept for the snapshot: enough for a window of a few steps of a large model.
HISTORY_ENTRIES = 200_000


class MemoryRecorder:
    def __init__(self, out: str | os.PathLike, rank: int, model: Any = None):
        self.dir = Path(out) / run_dir.MEMORY_FILES
        self.rank, self.model = rank, model
        self.cuda = torch.cuda.is_available()
        self._by_optimizer: dict[int, tuple[set[int], int, int, int]] = {}
        self._rows: list[dict] = []
        self._hook = None
        self._history = False

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self._hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            try:  # the history the window's snapshot replays its peaks from
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
                self._history = True
            except (RuntimeError, AttributeError, TypeError) as e:
                print(f"mfuscope: rank {self.rank}: no allocator history for the memory snapshot ({e})")

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._stop_history()

    @torch.no_grad()
    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        params: set[int] = set()
        param_bytes = grad_bytes = state_bytes = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in params:
                    continue
                params.add(id(p))
                param_bytes += _local_bytes(p)
                if p.grad is not None:
                    grad_bytes += _local_bytes(p.grad)
                for value in optimizer.state.get(p, {}).values():
                    if torch.is_tensor(value):
                        state_bytes += _local_bytes(value)
        self._by_optimizer[id(optimizer)] = (params, param_bytes, grad_bytes, state_bytes)

    def end_step(self, step: int) -> None:
        """The step ended: its row (nothing when no optimizer stepped and there is no GPU peak)."""
        counted = list(self._by_optimizer.values())
        self._by_optimizer.clear()
        row: dict[str, Any] = {"rank": self.rank, "step": step, "parameter_bytes": None, "gradient_bytes": None,
                               "optimizer_state_bytes": None, "peak_allocated_bytes": None,
                               "peak_reserved_bytes": None}
        if counted:
            stepped = set().union(*(c[0] for c in counted))
            with torch.no_grad():
                frozen = sum(_local_bytes(p) for p in _parameters(self.model) if id(p) not in stepped)
            row.update(parameter_bytes=sum(c[1] for c in counted) + frozen,
                       gradient_bytes=sum(c[2] for c in counted), optimizer_state_bytes=sum(c[3] for c in counted))
        if self.cuda:
            row.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                       peak_reserved_bytes=torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        if counted or self.cuda:
            self._rows.append(row)

    def take_rows(self) -> list[dict]:
        rows, self._rows = self._rows, []
        return rows

    def write_window(self, prof) -> None:
        """The window's memory timeline (and on a GPU the allocator's snapshot), each written to a
        hidden name and renamed, so a reader never sees half a file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        device = f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"
        timeline = self.dir / f"rank{self.rank}.raw.json.gz"
        partial = self.dir / f".rank{self.rank}.{os.getpid()}.partial.raw.json.gz"  # the suffix picks the raw form
        try:
            with warnings.catch_warnings():  # deprecated for CUDA snapshots; the only source on the CPU
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(str(partial), device=device)
            os.replace(partial, timeline)
        finally:
            partial.unlink(missing_ok=True)
        if self._history:
            snapshot = self.dir / f"rank{self.rank}.snapshot.pickle"
            partial = self.dir / f".rank{self.rank}.{os.getpid()}.partial.pickle"
            try:
                torch.cuda.memory._dump_snapshot(str(partial))
                os.replace(partial, snapshot)
            finally:
                partial.unlink(missing_ok=True)
            self._stop_history()

    def _stop_history(self) -> None:
        if self._history:
            self._history = False
            torch.cuda.memory._record_memory_history(enabled=None)


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local shard; a plain tensor whole)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _parameters(model: Any) -> list:
    if isinstance(model, torch.nn.Module):
        return list(model.parameters())
    return []
