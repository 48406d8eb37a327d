"""``mfuscope train``'s launcher: torchrun's agent, its ranks forked from it (forked_torchrun.py).

What is checked is what a rank started by torchrun has and a careless fork would not: its
output reaches the user as it is written, a SIGTERM kills it as it kills a fresh interpreter
(the agent's own handler is not inherited), and the agent names that death.  Expected values
come from the outside: the processes' command lines and parents (/proc, through psutil), the
signal sent, and the run directory's manifest."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil", reason="psutil is in the [dev] extra; not installed")
pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")

from mfuscope import run_dir  # noqa: E402


def test_ranks_are_forked_print_as_they_go_and_die_of_sigterm_as_torchruns_do(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mfuscope", "train", "--config", "tiny_dense", "--nproc", "2", "--steps", "500",
           "--paced", "fwd_ms=5,bwd_ms=10", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # rank 0's step lines, read while the run goes on (not at its exit)
        if line.startswith("step 3 "):
            break
        assert time.monotonic() < deadline, "no 'step 3' line from a running job"
    else:
        pytest.fail(f"the job ended before step 3:\n{proc.stderr.read()[-3000:]}")
    (agent,) = psutil.Process(proc.pid).children()
    ranks = agent.children()
    assert len(ranks) == 2
    # forked, not exec'd: each rank runs the agent's own command line, as the agent's child
    assert all(r.cmdline() == agent.cmdline() for r in ranks)
    assert "mfuscope.reference_trainer.forked_torchrun" in agent.cmdline()
    max(ranks, key=lambda r: r.pid).send_signal(signal.SIGTERM)  # either rank would do
    rest_out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.wait(timeout=120) != 0
    said = f"stdout: {rest_out[-2000:]}\nstderr: {err[-4000:]}"
    # The rank died of the signal: the collectors marked the run, then let SIGTERM do what it does
    # to a fresh interpreter.  The agent's handler, had the rank inherited it, would have raised in
    # the rank instead, and the rank would have printed the exception.
    assert "SignalException" not in err, said
    assert err.strip().splitlines()[-1].startswith("mfuscope: error: "), said
    manifest = run_dir.read_manifest(out)
    assert manifest["status"] == "ended_early" and "SIGTERM" in manifest["ended_reason"], said


def test_it_launches_only_the_reference_trainer():
    proc = subprocess.run([sys.executable, "-m", "mfuscope.reference_trainer.forked_torchrun", "--standalone",
                           "--nproc-per-node", "1", "train.py"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "launches only `-m mfuscope.reference_trainer.train`" in proc.stderr and "Traceback" not in proc.stderr
