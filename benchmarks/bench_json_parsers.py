"""Which JSON parser should the Kineto loader use?  Measured, not guessed.

On one large trace (the corpus's 54 MB ``df_index_resolver``), each candidate
turns the file into the columns the loader needs (name, category, ts, dur,
correlation):

  gzip        stdlib gzip.decompress
  isal        ISA-L igzip.decompress
  orjson      orjson.loads, then Python loops over dicts
  msgspec     msgspec.json.decode into dicts, then loops
  msgspec-typed   msgspec decode into typed Structs (unknown keys skipped in C), then loops
  scanner     mfuscope's C scanner (analyzers/_kineto_scan.c) over the loader's batches: the columns
              straight from the bytes, as numpy buffers and Arrow strings (no Python object an event),
              over the loader's batches (splitting included); the one batch it hands back (string
              thread ids) decoded as msgspec-typed does
  simdjson    pysimdjson parse (lazy), then element access from Python
  duckdb      read_json with an explicit column schema, unnest to columns

Median of ``--runs`` runs; prints seconds and peak RSS delta per candidate.

    python benchmarks/bench_json_parsers.py [--runs 5]
"""
from __future__ import annotations

import argparse
import gzip
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("MFUSCOPE_CORPUS", REPO.parent / "shared" / "corpus"))
TRACE = CORPUS / "traces/HolisticTraceAnalysis/tests/data/df_index_resolver/df_index_resolver.json.gz"
CANDIDATES = ("gzip", "isal", "orjson", "msgspec", "msgspec-typed", "scanner", "simdjson", "duckdb")


class _Args(msgspec.Struct, gc=False):
    correlation: int | None = None


class _Event(msgspec.Struct, gc=False):
    name: str = ""
    cat: str = ""
    ts: float | None = None
    dur: float = 0.0
    pid: int | str = 0
    args: _Args | None = None


class _Trace(msgspec.Struct, gc=False):
    traceEvents: list[_Event] = []


def _columns_from_dicts(events):
    names = [e.get("name") for e in events]
    cats = [e.get("cat") for e in events]
    ts = [e.get("ts") for e in events]
    dur = [e.get("dur", 0) for e in events]
    corr = [(e.get("args") or {}).get("correlation") for e in events]
    return names, cats, ts, dur, corr


def run_candidate(name: str, raw_path: str) -> float:
    data = Path(raw_path).read_bytes() if name not in ("gzip", "isal") else Path(TRACE).read_bytes()
    if name == "scanner":  # mfuscope's modules take a second to import: not the parser's time
        import msgspec
        import numpy as np
        import pyarrow as pa

        from mfuscope.analyzers import kineto_json as kj
    t0 = time.perf_counter()
    if name == "gzip":
        gzip.decompress(data)
    elif name == "isal":
        from isal import igzip
        igzip.decompress(data)
    elif name == "orjson":
        import orjson
        _columns_from_dicts(orjson.loads(data)["traceEvents"])
    elif name == "msgspec":
        import msgspec
        _columns_from_dicts(msgspec.json.decode(data)["traceEvents"])
    elif name == "msgspec-typed":
        import msgspec
        ev = msgspec.json.decode(data, type=_Trace).traceEvents
        [e.name for e in ev], [e.cat for e in ev], [e.ts for e in ev], [e.dur for e in ev]
        [e.args.correlation if e.args else None for e in ev]
    elif name == "scanner":
        chunks = (data[i:i + (1 << 21)] for i in range(0, len(data), 1 << 21))  # as the loader inflates them
        for batch in kj._stream_batches(chunks, {}):
            try:
                c = kj._scan.scan(batch)
            except kj._scan.Unsupported:  # the loader's fallback: the last batch holds string tids
                ev = msgspec.json.decode(batch, type=list[_Event])
                [e.name for e in ev], [e.cat for e in ev], [e.ts for e in ev], [e.dur for e in ev]
                [e.args.correlation if e.args else None for e in ev]
                continue
            n = c["n"]
            pa.StringArray.from_buffers(n, pa.py_buffer(c["name_offsets"]), pa.py_buffer(c["name_data"]))
            pa.StringArray.from_buffers(n, pa.py_buffer(c["cat_offsets"]), pa.py_buffer(c["cat_data"]))
            np.frombuffer(c["ts"]), np.frombuffer(c["dur"]), np.frombuffer(c["correlation"], np.int64)
    elif name == "simdjson":
        import simdjson
        doc = simdjson.Parser().parse(data)
        events = doc["traceEvents"]
        for e in events:
            e.get("name"), e.get("cat"), e.get("ts"), e.get("dur")
            a = e.get("args")
            if a is not None:
                a.get("correlation")
    elif name == "duckdb":
        import duckdb
        con = duckdb.connect()
        con.sql(
            "SELECT e.name, e.cat, e.ts, e.dur, e.args.correlation FROM (SELECT unnest(traceEvents) AS e FROM "
            f"read_json('{raw_path}', maximum_object_size=1000000000, columns={{'traceEvents': "
            "'STRUCT(name VARCHAR, cat VARCHAR, ts DOUBLE, dur DOUBLE, args STRUCT(correlation BIGINT))[]'}))"
        ).fetchnumpy()
    return time.perf_counter() - t0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        seconds = run_candidate(sys.argv[2], sys.argv[3])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(f"{seconds} {peak * 1024}")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    if not TRACE.exists():
        raise SystemExit(f"the corpus is not at {CORPUS}; set MFUSCOPE_CORPUS")
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "trace.json"
        raw_path.write_bytes(gzip.decompress(TRACE.read_bytes()))
        print(f"{TRACE.name}: {raw_path.stat().st_size / 1e6:.0f} MB of JSON; median of {args.runs} runs")
        print(f"  {'candidate':<14} {'seconds':>8} {'peak MB':>8}")
        for name in CANDIDATES:
            runs = []
            for _ in range(args.runs):
                out = subprocess.run([sys.executable, __file__, "--child", name, str(raw_path)],
                                     capture_output=True, text=True, check=True).stdout.split()
                runs.append((float(out[0]), int(out[1])))
            print(f"  {name:<14} {statistics.median(r[0] for r in runs):8.3f} "
                  f"{statistics.median(r[1] for r in runs) / 2**20:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
