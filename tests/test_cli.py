"""`mfuscope info` and `mfuscope analyze` end to end, on the real 8-rank DLRM set."""
from __future__ import annotations

import json

import pytest

from mfuscope import cli
from mfuscope.report import read_report
from mfuscope.tests.helpers import DLRM, needs_corpus, read_raw


@needs_corpus(DLRM)
def test_info_json_on_dlrm(capsys):
    assert cli.main(["info", str(DLRM), "--json", "--no-cache"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ranks"] == list(range(8)) and info["world_size"] == 8
    assert info["devices"] == ["Tesla V100-SXM2-32GB"]
    assert info["steps"] == [10]
    raw = [read_raw(f) for f in sorted(DLRM.glob("*.json"))]
    kernels = sum(1 for d in raw for e in d["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X")
    assert info["events_by_kind"]["kernel"] + info["events_by_kind"]["comm"] == kernels
    starts = [e["ts"] for d in raw for e in d["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    ends = [e["ts"] + e["dur"] for d in raw for e in d["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    assert info["time_span"]["seconds"] == pytest.approx((max(ends) - min(starts)) / 1e6, abs=1e-6)


@needs_corpus(DLRM)
def test_analyze_writes_a_valid_report_and_never_clobbers(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli.main(["analyze", str(DLRM), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "report written to" in text and "all_reduce" in text
    report = read_report(out)
    assert report["summary"]["ranks"] == 8
    # Step time: the slowest rank's ProfilerStep#10, read straight from the JSON.
    slowest = max(e["dur"] for f in DLRM.glob("*.json") for e in read_raw(f)["traceEvents"]
                  if e.get("name") == "ProfilerStep#10")
    assert report["summary"]["step_time_s"] == pytest.approx(slowest / 1e6)
    assert cli.main(["analyze", str(DLRM), "--out", str(out)]) == 0  # an earlier report may be replaced
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "data"}')
    assert cli.main(["analyze", str(DLRM), "--out", str(mine)]) == 2
    assert "not an mfuscope report" in capsys.readouterr().err
    assert mine.read_text() == '{"my": "data"}'


def test_help_on_every_subcommand(capsys):
    for sub in ("info", "analyze"):
        with pytest.raises(SystemExit) as e:
            cli.main([sub, "--help"])
        assert e.value.code == 0
        assert "--json" in capsys.readouterr().out
