"""The run history: one JSON Lines file per workload, one record per line, append-only.

A record is what a later check needs and nothing it cannot use: the commit,
branch and time; the environment fingerprint; the measured metrics with their
per-step samples (after warm-up); the deterministic counters; and the
breakdown leaves (to say which leaf moved).  About 2 KB a record, so a
history of 10,000 runs is 20 MB, and a diff of the file shows the new run on
one line: it can live in a git branch (``perf-history``) or a CI cache.

Only records with the same fingerprint are compared: the device, world
size, mesh layout, torch and triton versions and the hardware (for a CPU run,
the host's CPU model).  The model and
train settings are not in it -- they are the code under test, and a change
to them is what the deterministic gate reports.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfuscope.analyzers.compare import leaves
from mfuscope.errors import UserInputError
from mfuscope.manifest import Manifest

RECORD_SCHEMA = 1
SUFFIX = ".jsonl"


def fingerprint(report: dict[str, Any], manifest: dict[str, Any] | None) -> dict[str, Any]:
    """What must be equal for two runs' timings to be comparable."""
    m = Manifest.of(manifest)
    s = report.get("summary") or {}
    hw = m.hardware
    sw = m.raw.get("software") or {}
    peak_measured = "measured" in str(hw.get("peak_source") or s.get("peak_source") or "")
    return {
        "device": hw.get("device_name") or s.get("device"),
        "device_count": hw.get("device_count"),
        # CPU runs: the host's model (runners of one label mix them); GPU runs: their device says it
        "host_cpu": hw.get("host_cpu") if peak_measured else None,
        "world_size": m.raw.get("world_size") or s.get("world_size"),
        "layout": {k: v for k, v in m.layout.items() if v != 1},
        "torch": sw.get("torch"),
        "triton": sw.get("triton"),
        # A table peak names the hardware; a measured (CPU) peak varies run to run and is not part
        # of it -- the gate compares MFU at one reference peak instead (see gate.py).
        "peak_flops": None if peak_measured else s.get("peak_flops"),
    }


def fingerprint_id(fp: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


def make_record(report: dict[str, Any], manifest: dict[str, Any] | None, *, workload: str, commit: str | None,
                branch: str | None, time: str, source: str) -> dict[str, Any]:
    s = report.get("summary") or {}
    per_step = report.get("per_step") or []
    fp = fingerprint(report, manifest)
    return {
        "schema": RECORD_SCHEMA, "workload": workload, "commit": commit, "branch": branch, "time": time,
        "fingerprint": fp, "fingerprint_id": fingerprint_id(fp),
        "run": {"source": source, "id": Manifest.of(manifest).raw.get("run_id"),
                "report_created": (report.get("provenance") or {}).get("created")},
        "metrics": {k: s.get(k) for k in ("mfu", "hfu", "step_time_s", "tokens_per_s", "peak_flops")},
        "samples": {"step_time_s": [r["step_time_s"] for r in per_step if r.get("step_time_s") is not None],
                    "mfu": [r["mfu"] for r in per_step if r.get("mfu") is not None]},
        "counters": report.get("counters"),
        "leaves": leaves(report.get("breakdown")),
    }


def workload_file(history: Path, workload: str) -> Path:
    return history / f"{workload}{SUFFIX}"


def check_workload_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise UserInputError(f"workload name {name!r}: use letters, digits, '.', '_' and '-' (it names the "
                             "history file)")
    return name


def append(history: Path, record: dict[str, Any]) -> Path:
    """One line at the end of the workload's file: never rewrites what is there."""
    history.mkdir(parents=True, exist_ok=True)
    path = workload_file(history, record["workload"])
    line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
    # A file whose last line lacks its newline (an interrupted append) gets one first, so the new
    # record is never glued onto it.
    prefix = ""
    if path.exists() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            prefix = "" if f.read(1) == b"\n" else "\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(prefix + line)
        f.flush()
        os.fsync(f.fileno())
    return path


@dataclass
class History:
    path: Path
    records: list[dict[str, Any]]
    skipped: list[str]          # "file:line: why" for lines that are not records

    def matching(self, fp_id: str, branch: str | None) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("fingerprint_id") == fp_id
                and (branch is None or r.get("branch") == branch)]


def read(history: Path, workload: str) -> History:
    """The workload's records in the order they were appended.  A torn last line (a job killed
    while appending) is skipped with a warning; any other bad line is an error naming it."""
    path = workload_file(history, workload)
    if history.exists() and not history.is_dir():
        raise UserInputError("--history must be a directory (one .jsonl file per workload)", history)
    if not path.exists():
        return History(path, [], [])
    lines = path.read_text(encoding="utf-8").splitlines()
    records, skipped = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or rec.get("schema") != RECORD_SCHEMA or "fingerprint_id" not in rec:
                raise ValueError(f"not an mfuscope history record (schema {RECORD_SCHEMA})")
        except ValueError as e:
            if i == len(lines):
                skipped.append(f"{path}:{i}: {e}")
                continue
            raise UserInputError(f"line {i} is not a history record ({e})", path) from None
        records.append(rec)
    return History(path, records, skipped)


def workloads(history: Path) -> Iterator[str]:
    if history.is_dir():
        for p in sorted(history.glob(f"*{SUFFIX}")):
            yield p.name[:-len(SUFFIX)]
