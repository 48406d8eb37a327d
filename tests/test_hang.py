"""``mfuscope hang`` on real Flight Recorder dumps of a real hang: four gloo ranks run three all-reduces
in a data-parallel group, then rank 2 calls a broadcast where the others call the fourth all-reduce
(a desync) and rank 3 calls nothing (it never enters); with a 2 s collective timeout the waiting ranks
fail, and every rank writes its dump as a job's ranks would (``_dump_fr_trace``).  Expected values
are the injected faults: group "dp" stuck at all_reduce #4, rank 2 desynced (broadcast against
all_reduce, both sizes), rank 3 never entered it (its last all_reduce #3), and a rank whose dump is
gone reported missing.  Bad dumps are one line and exit code 2.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mfuscope.analyzers import hang

from . import native_crash

torch = pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")


def _rank_main(out: str) -> None:
    import torch.distributed as dist

    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    dp = dist.new_group(list(range(4)), group_desc="dp")
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2), dp)
    x = torch.ones(16)
    for _ in range(3):
        dist.all_reduce(x, group=dp)
    try:
        if rank == 2:
            dist.broadcast(x, src=0, group=dp)  # the desync: another collective at the same number
        elif rank != 3:  # rank 3 never enters
            dist.all_reduce(x, group=dp)
    except RuntimeError:  # gloo's timeout: what a watchdog would turn into a dump
        pass
    Path(out, f"nccl_trace_rank_{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    json_dump = torch._C._distributed_c10d._dump_fr_trace_json()
    Path(out, f"nccl_trace_rank_{rank}.json").write_bytes(json_dump if isinstance(json_dump, bytes)
                                                            else json_dump.encode())
    deadline = time.monotonic() + 60  # stay until every rank dumped (leaving would reset their sockets)
    while len(list(Path(out).glob("nccl_trace_rank_?"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    from mfuscope.reference_trainer.launch import fork_ranks

    out = tmp_path_factory.mktemp("fr")
    fork_ranks(_rank_main, 4, str(out), timeout=120)
    return out


def _hang_cli(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mfuscope", "hang", str(path), *extra], capture_output=True,
                          text=True, timeout=120)


def test_a_hang_and_a_desync_are_named_from_the_dumps(dumps):
    cli = _hang_cli(dumps, "--json")
    assert cli.returncode == 0, cli.stderr
    result = json.loads(cli.stdout)
    assert result["ranks"] == [0, 1, 2, 3] and result["missing"] == []
    stuck = [g for g in result["groups"] if g["state"] == "hung"]
    assert len(stuck) == 1
    g = stuck[0]
    assert (g["desc"], g["dim"], g["op"], g["seq"], g["members"]) == ("dp", "dp", "all_reduce", 4, [0, 1, 2, 3])
    by_rank = {c["rank"]: c for c in g["culprits"]}
    assert sorted(by_rank) == [2, 3]
    assert by_rank[2]["class"] == "desync"
    assert (by_rank[2]["got"]["op"], by_rank[2]["expected"]["op"]) == ("broadcast", "all_reduce")
    assert by_rank[2]["got"]["sizes"] == by_rank[2]["expected"]["sizes"] == [[16]]
    assert by_rank[2]["expected_from"] == [0, 1]
    assert by_rank[3]["class"] == "never_entered"
    assert (by_rank[3]["last_entered"]["op"], by_rank[3]["last_entered"]["seq"]) == ("all_reduce", 3)
    # the text says it first, with the caller's line (not c10d's)
    text = _hang_cli(dumps).stdout.splitlines()
    assert text[0] == 'group 1 "dp" (dp, ranks 0-3): stuck at all_reduce #4'
    assert text[1].startswith("  rank 2 desynced: entered #4 as broadcast") and "test_hang.py" in text[1]
    assert text[2].startswith("  rank 3 never entered it; its last: all_reduce #3, called at ")


def test_the_json_dumps_say_the_same_and_a_lost_rank_is_missing(dumps, tmp_path):
    only_json = tmp_path / "json"
    only_json.mkdir()
    for f in dumps.glob("*.json"):
        shutil.copy(f, only_json)
    result = hang.diagnose(*hang.read_dumps(only_json))
    g = next(g for g in result["groups"] if g["state"] == "hung")
    assert {c["rank"]: c["class"] for c in g["culprits"]} == {2: "desync", 3: "never_entered"}
    (only_json / "nccl_trace_rank_1.json").unlink()  # rank 1 died without a dump
    result = hang.diagnose(*hang.read_dumps(only_json))
    g = next(g for g in result["groups"] if g["state"] == "hung")
    assert result["missing"] == [1]
    assert {c["rank"]: c["class"] for c in g["culprits"]} == {1: "missing", 2: "desync", 3: "never_entered"}
    # rank 2 still desynced against rank 0 alone, the one left that entered all_reduce #4
    assert next(c for c in g["culprits"] if c["rank"] == 2)["expected_from"] == [0]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b'{"version": "2.10"}', "no 'entries'"),
    (b'{"entries": [{"profiling_name": "nccl:all_reduce"}]}', "without its group or sequence number"),
    (b'{"entries": [', "invalid JSON"),
    (pickle.dumps({"entries": []})[:-5], "not a readable Flight Recorder dump"),
    (pickle.dumps(_Evil()), "refusing to load"),
], ids=["empty", "no-entries", "entry-without-seq", "cut-json", "cut-pickle", "pickle-with-code"])
def test_a_bad_dump_is_one_line_and_exit_2(tmp_path, content, message):
    (tmp_path / "nccl_trace_rank_0").write_bytes(content)
    cli = _hang_cli(tmp_path)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and message in cli.stderr, cli.stderr
    assert "nccl_trace_rank_0" in cli.stderr and "pwned" not in cli.stdout


def test_a_directory_without_dumps_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("no dump here")
    cli = _hang_cli(tmp_path)
    assert cli.returncode == 2 and "no Flight Recorder dump here" in cli.stderr


def _train(out: Path, inject: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mfuscope", "train", "--config", "tiny_dense", "--nproc", "4",
                           "--layout", "dp_shard=4", "--steps", "6", "--inject", inject, "--collective-timeout", "5",
                           *extra, "--out", str(out)], capture_output=True, text=True, timeout=300)


@pytest.mark.paced  # a collective timeout of 5 s: run where the machine is not loaded by the other lane
def test_a_trainer_run_that_hangs_ends_in_its_timeout_and_says_where(tmp_path):
    """``--inject hang:rank=3:step=4 --collective-timeout 5``: rank 3 stops before its step-4
    collectives; its peers time out, every rank (rank 3 on the launcher's SIGTERM) writes its Flight
    Recorder dump, and the launcher's one line names rank 3.  PyTorch's own reader (fr_trace) on the
    same dumps is the independent check."""
    run = tmp_path / "hung"
    started = time.monotonic()
    cli = _train(run, "hang:rank=3:step=4")
    took = time.monotonic() - started
    assert cli.returncode != 0
    last = cli.stderr.strip().splitlines()[-1]
    assert last.startswith("mfuscope: error: the job hung (a collective timed out): group ") and \
        "rank 3 never entered it" in last, cli.stderr[-3000:]
    assert took < 240, took  # ended by the timeout, not by the test's own limit
    # the records carry the stack Flight Recorder kept for the same call: the trainer's line
    assert "called at " in last and "reference_trainer/train.py" in last, last
    result = json.loads(_hang_cli(run, "--json").stdout)
    stuck = [g for g in result["groups"] if g["state"] == "hung"]
    assert [c["rank"] for g in stuck for c in g["culprits"]] == [3]
    assert stuck[0]["culprits"][0]["class"] == "never_entered" and stuck[0]["dim"].startswith("dp")
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                         str(run / hang.FOLDER)], capture_output=True, text=True, timeout=120)
    said = fr.stdout + fr.stderr  # its report goes through logging
    assert f"sequence number: {stuck[0]['seq']}" in said and "missing ranks: {3}" in said, said[:3000]


@pytest.mark.paced
def test_a_killed_rank_is_read_from_its_records_and_missing_without_them(tmp_path):
    """``die:rank=1:step=3``: SIGKILL, no handler, no dump -- but its write-ahead records say how far
    it got (step 2's collectives, all completed).  Without its records it is missing.  Started by
    the fork launcher (``--launcher fork``; the records are the ranks' own, whatever started them):
    the ranks' reports come first, rank 1's signal named, then the command's one line."""
    run = tmp_path / "died"
    cli = _train(run, "die:rank=1:step=3", "--launcher", "fork")
    assert cli.returncode != 0
    assert "--- rank 1 ---\nkilled by signal 9" in cli.stderr, cli.stderr[-3000:]
    last = cli.stderr.strip().splitlines()[-1]
    assert last.startswith("mfuscope: error: the job ") and "rank 1 never entered it (it died" in last, last
    assert not (run / hang.FOLDER / "nccl_trace_rank_1").exists()
    result = json.loads(_hang_cli(run, "--json").stdout)
    stuck = [g for g in result["groups"] if g["state"] == "hung"]
    assert stuck and all([c["rank"] for c in g["culprits"]] == [1] for g in stuck)
    c = stuck[0]["culprits"][0]
    assert (c["class"], c["died"], c["last_entered"]["step"], c["last_entered"]["state"]) == \
        ("never_entered", True, 2, "completed")
    (run / hang.RECORDS / "rank1.jsonl").unlink()
    result = json.loads(_hang_cli(run, "--json").stdout)
    assert result["missing"] == [1] and result["ranks"] == [0, 2, 3]
    stuck = [g for g in result["groups"] if g["state"] == "hung"]
    assert stuck and all({c["rank"]: c["class"] for c in g["culprits"]} == {1: "missing"} for g in stuck)


@pytest.mark.paced
def test_a_size_desync_is_named_with_both_sizes_from_the_records(tmp_path):
    """``desync:rank=2:step=3``: rank 2's loss all-reduce of step 3 sends 3 float64 where its peers
    send 2; gloo stops a receiving rank (an error here; SIGABRT in some versions, before any handler),
    so only the write-ahead records, written before the call, can say it.  (Forked ranks: what is
    read is the records, not the launcher's doing.)"""
    run = tmp_path / "desync"
    cli = _train(run, "desync:rank=2:step=3", "--launcher", "fork")
    assert cli.returncode != 0
    result = json.loads(_hang_cli(run, "--json").stdout)
    stuck = [g for g in result["groups"] if g["state"] == "hung"]
    culprits = {c["rank"]: c for g in stuck for c in g["culprits"]}
    assert list(culprits) == [2] and culprits[2]["class"] == "desync", result
    assert (culprits[2]["got"]["op"], culprits[2]["got"]["sizes"], culprits[2]["expected"]["sizes"]) == \
        ("all_reduce", [[3]], [[2]])
    assert culprits[2]["got"]["dtypes"] == culprits[2]["expected"]["dtypes"] == ["float64"]
    assert culprits[2]["expected_from"] == [0, 1, 3]
    assert any("inject.py" in frame for frame in culprits[2]["stack"])  # where the wrong size was sent


def test_a_rank_that_segfaults_is_named_with_its_stack(tmp_path):
    """``die:rank=1:step=2:signal=SEGV``: rank 1 dies of SIGSEGV at the start of step 2, in the
    injector's ``begin_step``; its peer is left in a collective.  `mfuscope hang` says so first, with
    the frame the signal hit, from the stacks faulthandler wrote into ``fatal/rank1.txt`` (the
    collectors take faulthandler over from the fork launcher, as from torch elastic's ``@record``);
    the rank that ended normally left no file."""
    from mfuscope.reference_trainer.launch import fork_ranks
    from mfuscope.reference_trainer.train import run_rank
    from mfuscope.tests.helpers import micro_config
    from mfuscope.trainer_options import TrainerOptions

    config = tmp_path / "micro.toml"
    config.write_text(micro_config(n_layers=1))
    run = tmp_path / "segv"
    # the launcher's error carries the same stacks, read from the run directory
    with pytest.raises(RuntimeError, match=r"rank 1 first(?s:.*)--- rank 1 ---\nkilled by signal 11; faulthandler's "
                                           r"stacks at the signal:\nFatal Python error: Segmentation fault"):
        fork_ranks(run_rank, 2, TrainerOptions(config=str(config), layout="dp_shard=2", steps=4,
                                               inject="die:rank=1:step=2:signal=SEGV", out=str(run)))
    assert sorted(p.name for p in (run / hang.FATAL).iterdir()) == ["rank1.txt"]
    result = json.loads(_hang_cli(run, "--json").stdout)
    fatal = result["fatal"]["1"]
    assert (fatal["signal"], fatal["error"]) == ("SIGSEGV", "Segmentation fault")
    assert hang.fatal_frames(fatal)[0].split("/")[-1].startswith("inject.py:") and \
        hang.fatal_frames(fatal)[0].endswith(" in begin_step"), fatal
    text = _hang_cli(run).stdout.splitlines()
    assert text[0].startswith("rank 1 died of SIGSEGV (Segmentation fault) in ") and "inject.py" in text[0], text
    from mfuscope.analyzers import run_info  # mfuscope info RUN, and the dashboard's run section
    assert "crashed      rank 1: SIGSEGV" in run_info.format_text(run_info.summarize(run))
    from mfuscope.cli import _why_training_failed  # mfuscope train's last line when torchrun fails
    why = _why_training_failed(run, "torchrun exit 1")
    assert why.startswith("training failed (torchrun exit 1): rank 1 died of SIGSEGV")
    assert native_crash.TRAIN_CRASH.search(why)  # what reruns a test whose torchrun rank crashed


def test_records_cut_by_a_death_are_read_and_a_broken_one_is_named(tmp_path):
    """Write-ahead records written by hand: the last line of a killed rank may be cut off (the lines
    before it stand); a broken line elsewhere is one error line naming the file and line."""
    run = tmp_path / "run"
    (run / hang.RECORDS).mkdir(parents=True)

    def enq(seq, op="all_reduce", shapes=((4,),)):
        return json.dumps({"e": "enq", "pg": "0", "seq": seq, "op": op, "dim": "dp", "bytes": 16, "step": seq,
                           "dtype": "float32", "shapes": [list(s) for s in shapes], "t": seq})

    def end(seq):
        return json.dumps({"e": "end", "pg": "0", "seq": seq, "t": seq})

    (run / hang.RECORDS / "rank0.jsonl").write_text("\n".join([enq(0), end(0), enq(1)]) + "\n")
    (run / hang.RECORDS / "rank1.jsonl").write_text("\n".join([enq(0), end(0), '{"e": "enq", "pg"']))
    result = hang.diagnose(*hang.read_dumps(run))
    g = result["groups"][0]
    assert (g["state"], g["seq"], g["dim"]) == ("hung", 2, "dp")
    assert [(c["rank"], c["class"], c["last_entered"]["state"]) for c in g["culprits"]] == \
        [(1, "never_entered", "completed")]
    (run / hang.RECORDS / "rank1.jsonl").write_text("\n".join([enq(0), "not json", end(0)]) + "\n")
    cli = _hang_cli(run)
    assert cli.returncode == 2 and "rank1.jsonl: line 2 is not a collective record" in cli.stderr


def _aborted_stacks(path: Path) -> None:
    """What faulthandler really writes when a process aborts (a C++ check failing, as gloo's and
    NCCL's size checks do), in a process of its own."""
    code = ("import faulthandler, os, sys; f = open(sys.argv[1], 'w'); faulthandler.enable(file=f, all_threads=True)\n"
            "def send_the_wrong_size():\n    os.abort()\nsend_the_wrong_size()")
    path.parent.mkdir(parents=True, exist_ok=True)
    assert subprocess.run([sys.executable, "-c", code, str(path)], timeout=60).returncode == -6


def test_an_abort_after_a_desync_comes_after_it_and_one_without_comes_first(tmp_path):
    """Records by hand -- rank 1 enters all_reduce #1 with 3 elements where rank 0 has 2 -- and rank 0's
    real faulthandler output of an abort: the desync is the cause, so it is named first and the abort
    after it; the same abort with matching sizes is the first line, with the frame it hit."""
    run = tmp_path / "run"
    (run / hang.RECORDS).mkdir(parents=True)

    def enq(n):
        return json.dumps({"e": "enq", "pg": "0", "seq": 0, "op": "all_reduce", "dim": "dp", "bytes": 8 * n,
                           "step": 3, "dtype": "float64", "shapes": [[n]], "t": 0}) + "\n"

    (run / hang.RECORDS / "rank0.jsonl").write_text(enq(2))
    (run / hang.RECORDS / "rank1.jsonl").write_text(enq(3))
    _aborted_stacks(run / hang.FATAL / "rank0.txt")
    text = _hang_cli(run).stdout
    assert text.index("rank 1 desynced") < text.index("rank 0 died of SIGABRT (Aborted)"), text
    assert "most likely the desync above" in text and "in send_the_wrong_size" in text, text
    (run / hang.RECORDS / "rank1.jsonl").write_text(enq(2))
    first = _hang_cli(run).stdout.splitlines()[0]
    assert first.startswith("rank 0 died of SIGABRT (Aborted) in <string>:3 in send_the_wrong_size: a crash"), first
