"""make test's two lanes (tests/lanes.py): a paced test that measures real compute holds the rest
lane back, and a holder that died holds nothing."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from mfuscope.tests import lanes


def _waiting(result: list) -> threading.Thread:
    """The rest lane's side, as conftest's test setup runs it, in a thread of this process."""
    thread = threading.Thread(target=lambda: result.append(lanes.wait_while_quiet()), daemon=True)
    thread.start()
    return thread


def test_the_rest_lane_starts_nothing_while_a_paced_test_holds_the_machine(tmp_path, monkeypatch):
    flag = tmp_path / "quiet"
    monkeypatch.setenv(lanes.QUIET, str(flag))
    monkeypatch.setenv(lanes.LANE, "paced")
    with lanes.quiet():
        assert flag.read_text() == str(os.getpid())  # held, by this process
    assert not flag.exists()  # and let go

    flag.write_text(str(os.getpid()))  # held by a live process (this one) ...
    monkeypatch.setenv(lanes.LANE, "rest")
    result: list[float] = []
    waiting = _waiting(result)
    time.sleep(1.0)
    assert waiting.is_alive()  # ... the rest lane waits
    with lanes.quiet():  # the rest lane's own processes never hold it
        assert flag.read_text() == str(os.getpid())
    flag.unlink()
    waiting.join(timeout=30)
    assert not waiting.is_alive() and result[0] >= 0.0


def test_a_flag_whose_holder_died_holds_nothing(tmp_path, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    flag = tmp_path / "quiet"
    flag.write_text(dead.stdout.strip())
    monkeypatch.setenv(lanes.QUIET, str(flag))
    monkeypatch.setenv(lanes.LANE, "rest")
    result: list[float] = []
    _waiting(result).join(timeout=30)
    assert result and result[0] < lanes.QUIET_WAIT_S  # one look at the pid, not the cap

    monkeypatch.delenv(lanes.LANE)  # outside make test's rest lane: never waits
    flag.write_text(str(os.getpid()))
    assert lanes.wait_while_quiet() == 0.0
