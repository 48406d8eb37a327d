"""This rank's PyTorch Flight Recorder dump, written into the run directory when a run ends early.

Flight Recorder keeps each rank's last collectives (group, sequence number, op, sizes, dtypes, stack):
what ``mfuscope hang`` reads across ranks.  NCCL's watchdog dumps it on a timeout when told to; gloo
never dumps on its own and leaves the dump's ``pg_config`` empty, which PyTorch's own reader
(``python -m torch.distributed.flight_recorder.fr_trace``) refuses.  So when a session ends early --
a collective timed out, SIGTERM from the launcher after a peer failed -- every rank writes
``RUN/flight_recorder/nccl_trace_rank_<rank>`` (fr_trace's default prefix) itself, with
``pg_config`` filled in from c10d's own groups: name, description, ranks.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from mfuscope import atomic

FOLDER = "flight_recorder"
PREFIX = "nccl_trace_rank_"


def dump(run: Path, rank: int) -> Path | None:
    """Write this rank's dump; None where this torch has no Flight Recorder."""
    take = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if take is None:
        return None
    doc = pickle.loads(take())  # this process's own dump: plain dicts, lists, strings and numbers
    doc["pg_config"] = _pg_config() or doc.get("pg_config") or {}
    doc.setdefault("rank", rank)
    path = Path(run) / FOLDER / f"{PREFIX}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, pickle.dumps(doc))
    return path


def _pg_config() -> dict:
    """c10d's groups as Flight Recorder's ``pg_config`` lists them (keyed by group name)."""
    out = {}
    world = getattr(dist.distributed_c10d, "_world", None)
    for pg in list(getattr(world, "pg_map", {}) or {}):
        try:
            ranks = dist.get_process_group_ranks(pg)
        except (RuntimeError, ValueError):
            continue
        name = str(getattr(pg, "group_name", ""))
        out[name] = {"name": name, "desc": str(getattr(pg, "group_desc", "") or ""), "ranks": json.dumps(ranks)}
    return out
