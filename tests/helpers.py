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


def micro_config(n_layers: int = 4, global_batch: int = 16, grad_accum: int = 2, microbatches: int = 4) -> str:
    """A micro dense model's config (d=32, 2 heads, vocab 64, 16-token sequences): small enough
    that paced sleeps, not CPU sharing, decide the timing of 8 ranks on 2 cores."""
    return f"""
[model]
vocab_size = 64
dim = 32
n_layers = {n_layers}
n_heads = 2
n_kv_heads = 2
ffn_dim = 64
max_seq_len = 16
[train]
seq_len = 16
global_batch = {global_batch}
grad_accum = {grad_accum}
microbatches = {microbatches}
"""


#: How long a process on a loaded 2-core host can wait for a core: the slack of timing checks.
WAKE_S = 0.015


def replicated_set(out: Path, sources: list[Path], copies: int, shift_us: float = 10.0) -> Path:
    """A larger job made of real ranks: ``sources`` (rank files of one job, ranks 0..n-1) copied
    ``copies`` times as ranks ``k*n + r`` of a world of ``copies*n``, copy k's clock shifted by
    ``k * shift_us`` (so matched collectives have known arrival lags).  Written gzip'ed."""
    out.mkdir(parents=True, exist_ok=True)
    docs = [read_raw(p) for p in sources]
    n = len(docs)
    for k in range(copies):
        for r, doc in enumerate(docs):
            events = [dict(e, ts=e["ts"] + k * shift_us) if "ts" in e else e for e in doc["traceEvents"]]
            info = dict(doc.get("distributedInfo") or {}, rank=k * n + r, world_size=copies * n)
            top = {key: v for key, v in doc.items() if key not in ("traceEvents", "distributedInfo")}
            write_trace(out / f"rank{k * n + r}.json.gz", events, **top, distributedInfo=info)
    return out
