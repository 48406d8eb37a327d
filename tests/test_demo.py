"""``make demo``, the README's first command: the module it runs (``python -m mfuscope.demo``),
end to end on a small layout -- train through torchrun, profile, info, analyze, and the closing
"where to look" lines naming files that exist."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the demo trains the reference trainer: torch is in the [dev] extra")


def test_the_demo_trains_analyzes_and_names_where_to_look(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mfuscope.demo", "--out", str(tmp_path), "--nproc", "2",
                           "--layout", "tp=2", "--microbatches", "1", "--steps", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for banner in ("=== mfuscope train", "=== mfuscope info", "=== mfuscope analyze", "=== where to look"):
        assert banner in out, out[-3000:]
    report = tmp_path / "runs" / "tiny-llama-2ranks" / "report.json"
    assert re.search(rf"report:\s+{re.escape(str(report))}", out), out[-2000:]
    data = json.loads(report.read_text())
    # the run it made: 2 ranks of tp=2, its profiled steps in the report
    assert [r["rank"] for r in data["ranks"]] == [0, 1], data["ranks"]
    assert data["findings"], "the analysis names findings"
    assert f"dashboard {tmp_path / 'runs'}" in out
