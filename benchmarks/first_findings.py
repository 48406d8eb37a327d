"""mfuscope's first finding on every corpus trace against an expert's (EXPECTED_FINDINGS.md).

    python benchmarks/first_findings.py

Prints, per section of the key: the key's cause and size, mfuscope's first finding and its size,
and whether they match (the same cause; the size within 10% or 1 ms).  The key's table is the one
``tests/test_first_findings.py`` checks (transcribed there from the key); this is its readable
scoreboard, and how a rule change is judged before it lands.
"""
from __future__ import annotations

import sys
import time

from mfuscope.analyzers import overview, trace_set
from mfuscope.analyzers.context import Context
from mfuscope.tests.test_first_findings import FIRST, NONE, matches


def main() -> int:
    rows, matched = [], 0
    for section in sorted({**FIRST, **NONE}):
        path, causes, key_ms, key_share = FIRST[section] if section in FIRST else (NONE[section], set(), None, None)
        if not path.exists():
            print(f"{section}: {path} not found (set MFUSCOPE_CORPUS)", file=sys.stderr)
            return 2
        t = time.perf_counter()
        loaded = trace_set.load(path)
        report = overview.build_report(Context.of(loaded.events), source=str(path), files=[])
        per_step = [f for f in report["findings"] if f["per_step"]]
        first = per_step[0] if per_step else None
        got = f"{first['fix']} {first['gain_s'] * 1e3:,.1f} ms, {first['gain_fraction']:.0%}" if first else "none"
        if section in NONE:
            ok = first is None
            want = "none"
        else:
            ok = first is not None and matches(first, causes, key_ms, key_share)
            want = "/".join(sorted(causes)) + (f" {key_ms:,.1f} ms" if key_ms else "") + (
                f" or {key_share:.0%}" if key_share else "")
        matched += ok
        rows.append((section, path.name, want, got, "yes" if ok else "NO", time.perf_counter() - t))
    width = max(len(r[2]) for r in rows)
    print(f"{'key':>3}  {'trace':<42} {'expected':<{width}}  {'mfuscope first':<40} match  seconds")
    for section, name, want, got, ok, secs in rows:
        print(f"{section:>3}  {name[:42]:<42} {want:<{width}}  {got:<40} {ok:<5}  {secs:6.1f}")
    print(f"\n{matched} of {len(rows)} match (section 9, the memory-timeline file, is refused: "
          "tests/test_corpus_load.py)")
    return 0 if matched == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
