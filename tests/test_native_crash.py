"""A rank that dies of a fatal signal: its stacks reach the error, and its test runs once more
(tests/native_crash.py).  Real forked ranks, one of them killed by a real SIGSEGV, in a pytest run
of its own."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TESTS = textwrap.dedent('''
    import os, signal, pathlib
    import pytest
    import torch  # here, once: the forked ranks would each import it (fork_ranks' children use it)
    from mfuscope.reference_trainer.launch import fork_ranks

    def _segfault_in_rank_0(times, tally):
        """Rank 0 dies of SIGSEGV the first ``times`` runs (counted in ``tally``)."""
        if int(os.environ["RANK"]) == 0:
            tally = pathlib.Path(tally)
            runs = int(tally.read_text()) if tally.exists() else 0
            tally.write_text(str(runs + 1))
            if runs < times:
                os.kill(os.getpid(), signal.SIGSEGV)
        return int(os.environ["RANK"])

    def test_crashes_once(tmp_path_factory):
        tally = tmp_path_factory.getbasetemp() / "once"
        assert fork_ranks(_segfault_in_rank_0, 2, 1, str(tally)) == [0, 1]
        assert tally.read_text() == "2"

    def test_crashes_every_time(tmp_path_factory):
        fork_ranks(_segfault_in_rank_0, 2, 99, str(tmp_path_factory.getbasetemp() / "always"))

    LAUNCHED = {"train": "torchrun exit 1", "train-forked": "2 of 2 forked ranks failed, rank 0 first"}

    @pytest.mark.parametrize("name", LAUNCHED)
    def test_training_crashes_once(tmp_path_factory, name):
        """As a test sees ``mfuscope train`` fail (through torchrun, or forked): its stderr's last
        line in the assertion."""
        tally = tmp_path_factory.getbasetemp() / name
        runs = int(tally.read_text()) if tally.exists() else 0
        tally.write_text(str(runs + 1))
        stderr = f"mfuscope: error: training failed ({LAUNCHED[name]}): rank 0 died of SIGABRT (Aborted) in x.py:3"
        assert runs > 0, "mfuscope train failed:\\n" + stderr

    def test_fails_plainly(tmp_path_factory):
        tally = tmp_path_factory.getbasetemp() / "plain"
        tally.write_text(tally.read_text() + "x" if tally.exists() else "x")
        assert False, "an assertion: runs " + tally.read_text()
''')


@pytest.mark.slow
def test_a_native_crash_runs_once_more_with_its_stacks_and_nothing_else_does(tmp_path):
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    (tmp_path / "test_ranks.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    base = tmp_path / "basetemp"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "mfuscope.tests.native_crash", "-rA", "--basetemp", str(base), str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300).stdout
    assert "PASSED test_ranks.py::test_crashes_once" in out, out
    assert "PASSED test_ranks.py::test_training_crashes_once[train]" in out, out
    assert "PASSED test_ranks.py::test_training_crashes_once[train-forked]" in out, out
    assert "FAILED test_ranks.py::test_crashes_every_time" in out, out
    assert "FAILED test_ranks.py::test_fails_plainly" in out, out
    # how many times rank 0 ran in each: once more after a crash, never a third time or after an assertion
    assert [(base / name).read_text() for name in ("once", "always", "plain", "train", "train-forked")] == \
        ["2", "2", "x", "2", "2"]
    # the crashed tests are in the summary once each, with what faulthandler wrote in rank 0
    assert out.count("a rank crashed in native code, so this test ran again") == 4, out
    assert "killed by signal 11; faulthandler's stacks at the signal:" in out, out
    assert "in _segfault_in_rank_0" in out, out
    assert "2 failed, 3 passed" in out, out
