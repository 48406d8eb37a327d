"""Test helpers: where the real-trace corpus is, raw-JSON readers, synthetic trace writers.

The corpus lives beside the repository (``../shared/corpus``) or wherever
``MFUSCOPE_CORPUS`` points; tests that need it skip with that reason when it
is absent.  Nothing from the corpus is copied into the repository.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import re
from pathlib import Path

import pytest

from mfuscope.analyzers.duration_sketch import RELATIVE_ERROR

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
TRACES = CORPUS / "traces"
DLRM = TRACES / "param/et_replay/tests/inputs/dlrm_kineto"
HTA_DATA = TRACES / "HolisticTraceAnalysis/tests/data"

#: The in-memory analysis's reports of real sets, frozen before the map/reduce existed.
FROZEN_REPORTS = Path(__file__).parent / "fixtures" / "frozen_reports"

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


#: The rest of a complete event of the trainer's step annotation as Kineto writes it, from its name
#: on, a field a line: ``"name": "mfuscope.step#3",`` ``"pid": 1,`` ``"tid": 1,`` ``"ts": ...,``
#: ``"dur": ...``.
_STEP_SPAN = re.compile(r'"name": "(mfuscope\.step#\d+)",\s*"pid": -?\d+,\s*"tid": -?\d+,\s*'
                        r'"ts": ([-\d.e+]+),\s*"dur": ([-\d.e+]+)')
_STEP_NAME = '"name": "mfuscope.step#'


def step_spans(path: Path) -> list[dict]:
    """The trainer's step spans (``mfuscope.step#N`` complete events: name, ts, dur) of a Kineto
    trace, read with the standard library (independent of mfuscope): each span found by its name
    in the text and read there, a fraction of what :func:`read_raw`'s whole parse costs on a trace of
    tens of MB; that parse where a span does not read so (another writer's layout)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    spans, at = [], text.find(_STEP_NAME)
    while at >= 0:
        m = _STEP_SPAN.match(text, at)
        if not m or '"ph": "X"' not in text[text.rfind("{", 0, at):at]:
            return [{k: e[k] for k in ("name", "ts", "dur")} for e in json.loads(text)["traceEvents"]
                    if e.get("ph") == "X" and e["name"].startswith("mfuscope.step#")]
        spans.append({"name": m[1], "ts": float(m[2]), "dur": float(m[3])})
        at = text.find(_STEP_NAME, m.end())
    return spans


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


#: Sums of the same numbers in another order differ in the last bits: relative 1e-9 is ~10^6 ulps.
REL = 1e-9
#: Figures that are medians of a mergeable sketch (or proportional to one).
SKETCHED = ("median_us", "algbw_gbps", "busbw_gbps", "busbw_of_attainable", "busbw_of_nccl_tests")


#: Report fields added after the frozen reports were written (each checked by its own tests): a
#: frozen report without one is not a difference.
ADDED_SINCE_FROZEN = {"/summary/goodput", "/steady_breakdown"}


def report_differences(old, new, path: str = "") -> list[str]:
    """Where two reports differ: exactly up to float summation order (``REL``), sketched medians
    within the sketch's stated error; provenance and the per-rank lists' bookkeeping are skipped."""
    out: list[str] = []
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            if k in ("_about", "provenance", "rank_lists") or (k not in old and f"{path}/{k}" in ADDED_SINCE_FROZEN):
                continue
            if k not in old or k not in new:
                out.append(f"{path}/{k}: only in {'new' if k not in old else 'frozen'}")
            else:
                out += report_differences(old[k], new[k], f"{path}/{k}")
    elif isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            out.append(f"{path}: {len(old)} entries frozen, {len(new)} now")
        for i, (a, b) in enumerate(zip(old, new)):
            out += report_differences(a, b, f"{path}[{i}]")
    elif isinstance(old, float) or isinstance(new, float):
        # a median from the sketch (kernel durations, bandwidths and what is read off them): within
        # its relative error
        rel = RELATIVE_ERROR * 1.001 if path.endswith(SKETCHED) else REL
        if old is None or new is None or not math.isclose(old, new, rel_tol=rel, abs_tol=1e-15):
            out.append(f"{path}: frozen {old}, now {new}")
    elif old != new:
        out.append(f"{path}: frozen {old!r}, now {new!r}")
    return out


def synthetic_job(root: Path, world: int, steps: int = 3, slow_rank: int = 0, slow_step: int = 2,
                  slow_us: float = 400.0) -> Path:
    """``world`` ranks of a data-parallel job, one small Kineto trace each: per step a 600 us GEMM, then
    an all-reduce over every rank (numbered by ``Seq``, its rank list cut at 30 as the profiler
    writes it) that ends 200 us after the last rank's GEMM.  ``slow_rank``'s GEMM of ``slow_step``
    takes ``slow_us`` longer, so every rank waits that long for it in that step's all-reduce."""
    root.mkdir(parents=True, exist_ok=True)
    shown = ", ".join(str(r) for r in range(min(world, 30))) + (", ..." if world > 30 else "")
    step_us = 1000.0 + slow_us
    for rank in range(world):
        events: list[dict] = []
        for s in range(1, steps + 1):
            t0 = s * step_us
            gemm = 600.0 + (slow_us if (rank, s) == (slow_rank, slow_step) else 0.0)
            last = 600.0 + (slow_us if s == slow_step else 0.0)
            arrive, leave = t0 + 20 + gemm, t0 + 20 + last + 200
            c = 2 * s
            events += [
                {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": t0,
                 "dur": step_us - 1},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t0 + 5,
                 "dur": 4.0, "args": {"correlation": c}},
                {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "pid": 0, "tid": 7,
                 "ts": t0 + 20, "dur": gemm, "args": {"correlation": c, "device": 0, "stream": 7}},
                {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": t0 + 10,
                 "dur": 8.0, "args": {"Collective name": "allreduce", "dtype": "BFloat16", "In msg nelems": 1 << 20,
                                      "Out msg nelems": 1 << 20, "Group size": world, "Process Group Name": "0",
                                      "Process Group Description": "default_pg", "Process Group Ranks": f"[{shown}]",
                                      "Rank": rank, "Seq": s}},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t0 + 12,
                 "dur": 4.0, "args": {"correlation": c + 1}},
                {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "pid": 0, "tid": 20,
                 "ts": arrive, "dur": leave - arrive, "args": {"correlation": c + 1, "device": 0, "stream": 20}},
            ]
        write_trace(root / f"rank{rank}.json", events,
                    distributedInfo={"backend": "nccl", "rank": rank, "world_size": world})
    return root
