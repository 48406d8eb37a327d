"""Write-ahead records of every collective: on disk before the call is issued, completed after.

A rank killed by SIGKILL (the OOM killer, a launcher) or SIGABRT (gloo's size check, NCCL's
abort) runs no handler and flushes nothing: its Flight Recorder buffer dies with it.  So each
wrapped collective appends one JSON line to ``RUN/collectives/rank<N>.jsonl`` *before* it is
issued -- group, per-group sequence number, op, dimension, bytes, dtype and shapes, step -- and
one when it completes.  Each line is a single ``write()`` on a file opened ``O_APPEND``: whatever
the kernel took is in the file when the process dies, and lines from the gloo thread that
completes async work never interleave with the training thread's.  ``mfuscope hang RUN`` reads
them (analyzers/hang.py).  Cost: one small write a collective (a few microseconds).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

FOLDER = "collectives"


class CollectiveJournal:
    def __init__(self, run: str | os.PathLike, rank: int):
        path = Path(run) / FOLDER / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)

    def enqueued(self, pg: str, seq: int, op: str, dim: str | None, nbytes: int, step: int, value: Any) -> None:
        self._write({"e": "enq", "pg": pg, "seq": seq, "op": op, "dim": dim, "bytes": nbytes, "step": step,
                     "dtype": _dtype(value), "shapes": _shapes(value), "t": time.time_ns()})

    def completed(self, pg: str, seq: int) -> None:
        self._write({"e": "end", "pg": pg, "seq": seq, "t": time.time_ns()})

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _write(self, record: dict) -> None:
        fd = self._fd
        if fd is not None:
            os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out += _tensors(getattr(v, "tensor", v))  # a P2POp carries its tensor
        return out
    return []


def _dtype(value: Any) -> str | None:
    ts = _tensors(value)
    return str(ts[0].dtype).removeprefix("torch.") if ts else None


def _shapes(value: Any) -> list[list[int]]:
    return [list(t.shape) for t in _tensors(value)]
