"""Bad input: one line naming the file and the problem, exit code 2, no traceback."""
from __future__ import annotations

import gzip
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from mfuscope import cli
from mfuscope.tests.helpers import CORPUS, NO_CORPUS, write_trace

GOOD_EVENTS = [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 100.0, "dur": 50.0},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 110.0, "dur": 10.0},
]


def _run(capsys, *argv):
    rc = cli.main(["info", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc, err, *fragments):
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mfuscope: error: ")
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "Traceback" not in err


def test_truncated_gzip(tmp_path, capsys):
    good = write_trace(tmp_path / "good.json.gz", GOOD_EVENTS * 200)
    bad = tmp_path / "rank0.json.gz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    rc, _, err = _run(capsys, bad)
    _assert_one_line_error(rc, err, str(bad), "truncated or corrupt gzip")


def test_invalid_json(tmp_path, capsys):
    bad = tmp_path / "rank0.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": ')
    rc, _, err = _run(capsys, bad)
    _assert_one_line_error(rc, err, str(bad), "invalid JSON")


@pytest.mark.parametrize("doc, message", [
    ([1, 2, 3], "the top level is not a JSON object"),
    ({"schemaVersion": 1, "deviceProperties": []}, "no 'traceEvents' list"),
])
def test_json_that_is_not_a_trace(tmp_path, capsys, doc, message):
    bad = tmp_path / "rank0.json"
    bad.write_text(json.dumps(doc))
    rc, _, err = _run(capsys, bad)
    _assert_one_line_error(rc, err, str(bad), message)


def test_empty_trace_events(tmp_path, capsys):
    bad = write_trace(tmp_path / "rank0.json", [])
    rc, _, err = _run(capsys, bad)
    _assert_one_line_error(rc, err, str(bad), "'traceEvents' is empty")


def test_two_files_claim_the_same_rank(tmp_path, capsys):
    for name in ("a.json", "b.json"):
        write_trace(tmp_path / name, GOOD_EVENTS, distributedInfo={"rank": 3, "world_size": 4})
    rc, _, err = _run(capsys, tmp_path)
    _assert_one_line_error(rc, err, str(tmp_path), "two files claim rank 3", "a.json", "b.json")


def test_directory_without_traces(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    rc, _, err = _run(capsys, tmp_path)
    _assert_one_line_error(rc, err, str(tmp_path), "no trace files")


def test_missing_path(tmp_path, capsys):
    rc, _, err = _run(capsys, tmp_path / "nope")
    _assert_one_line_error(rc, err, "nope", "no such file or directory")


def test_rank_unknown_in_a_multi_file_set(tmp_path, capsys):
    write_trace(tmp_path / "rank0.json", GOOD_EVENTS)
    anonymous = write_trace(tmp_path / "trace.json", GOOD_EVENTS)
    rc, _, err = _run(capsys, tmp_path)
    _assert_one_line_error(rc, err, str(anonymous), "--rank")


def test_nsys_export_of_unknown_schema(tmp_path, capsys):
    db = tmp_path / "report.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
    con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', '2.7.1')")
    con.commit()
    con.close()
    rc, _, err = _run(capsys, db)
    _assert_one_line_error(rc, err, str(db), "schema version 2.7.1 is not supported")


def test_nsys_rep_asks_for_an_export(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no nsys on PATH
    rep = tmp_path / "report1.nsys-rep"
    rep.write_bytes(b"\x00binary")
    rc, _, err = _run(capsys, rep)
    _assert_one_line_error(rc, err, str(rep), "nsys is not on PATH", "nsys export --type sqlite")


def test_nsys_rep_is_exported_when_nsys_is_installed(tmp_path, capsys, monkeypatch):
    """A stand-in `nsys` that copies a known SQLite export proves the call and its arguments."""
    src = CORPUS / "nsys" / "nvfuser_64ee035_report1.sqlite"
    if not src.exists():
        pytest.skip(NO_CORPUS)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nsys"
    fake.write_text("#!/bin/sh\n# nsys export --type sqlite --force-overwrite true --output OUT REPORT\n"
                    f'[ "$1 $2 $3" = "export --type sqlite" ] || exit 3\ncp "{src}" "$7"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    rep = tmp_path / "report1.nsys-rep"
    rep.write_bytes(b"\x00binary")
    assert cli.main(["info", str(rep), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["devices"] == ["NVIDIA H200"] and info["events_by_kind"]["kernel"] == 19
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".sqlite"] == []  # nothing written beside it


def test_skip_bad_loads_the_good_ranks_and_lists_the_rest(tmp_path, capsys):
    write_trace(tmp_path / "rank0.json", GOOD_EVENTS, distributedInfo={"rank": 0, "world_size": 2})
    bad = tmp_path / "rank1.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": [')[:20])
    rc, out, err = _run(capsys, tmp_path)
    _assert_one_line_error(rc, err, str(bad))
    rc = cli.main(["info", str(tmp_path), "--skip-bad", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    info = json.loads(out)
    assert info["ranks"] == [0]
    assert [s["file"] for s in info["skipped"]] == [str(bad)]
    assert "truncated or corrupt gzip" in err


def test_real_process_exit_code_and_no_traceback(tmp_path):
    bad = tmp_path / "rank0.json"
    bad.write_text("not json at all")
    proc = subprocess.run([sys.executable, "-m", "mfuscope", "info", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "invalid JSON" in proc.stderr and str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """The system's own refusal (here: a folder asked for where a file is) names the path, in one line."""
    trace = write_trace(tmp_path / "rank0.json", GOOD_EVENTS)
    rc = cli.main(["analyze", str(trace), "--out", str(trace / "report.json")])
    _assert_one_line_error(rc, capsys.readouterr().err, str(trace), "File exists")


def test_a_run_not_yet_analyzed_is_named_with_the_command_that_analyzes_it(tmp_path, capsys):
    """calibrate and predict read a run's report.json: a run that has traces and no report was
    trained and not analyzed, and the line says how to make its report."""
    run = tmp_path / "run"
    write_trace(run / "traces" / "rank0.pt.trace.json", GOOD_EVENTS)
    rc = cli.main(["calibrate", str(run), "--out", str(tmp_path / "hw.json")])
    _assert_one_line_error(rc, capsys.readouterr().err, str(run / "report.json"), "no such file",
                           f"mfuscope analyze {run}")
    assert not (tmp_path / "hw.json").exists()
