"""Test helpers: where the real-trace corpus is, raw-JSON readers, synthetic trace writers.

The corpus lives beside the repository (``../shared/corpus``) or wherever
``MFUSCOPE_CORPUS`` points; tests that need it skip with that reason when it
is absent.  Nothing from the corpus is copied into the repository.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
TRACES = CORPUS / "traces"
DLRM = TRACES / "param/et_replay/tests/inputs/dlrm_kineto"
HTA_DATA = TRACES / "HolisticTraceAnalysis/tests/data"

NO_CORPUS = f"the real-trace corpus is not at {CORPUS} (set MFUSCOPE_CORPUS to its folder)"


def corpus_trace_files() -> list[Path]:
    if not TRACES.is_dir():
        return []
    return sorted(p for p in TRACES.rglob("*") if p.name.endswith((".json", ".json.gz")))


def needs_corpus(path: Path = TRACES):
    return pytest.mark.skipif(not path.exists(), reason=NO_CORPUS)


def read_raw(path: Path) -> dict:
    """The trace as plain JSON, read with the standard library (independent of mfuscope)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def write_trace(path: Path, events: list[dict], **top) -> Path:
    """Write a small synthetic Kineto trace (gzip if the name ends in .gz)."""
    doc = {"schemaVersion": 1, **top, "traceEvents": events}
    data = json.dumps(doc).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path
