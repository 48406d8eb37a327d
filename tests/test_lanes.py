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


def test_the_rest_lane_and_its_tail_run_each_test_file_once_and_whole(tmp_path):
    """Two pytest processes claiming files as make test's rest lane and its tail do, started at
    once over six files of three tests each (a module fixture in each): every test runs exactly
    once, a file's tests all in one process with its module fixture set up once, and both
    processes take part (each claims a file, and the next, before any test runs)."""
    runs = tmp_path / "ran.txt"
    # both sessions start before either runs a test (a loaded machine may start one seconds late)
    (tmp_path / "conftest.py").write_text(
        "import os, pathlib, time\n"
        "from mfuscope.tests import lanes\n\n"
        "def pytest_runtestloop(session):\n"
        "    here = pathlib.Path(os.environ[lanes.CLAIMS])\n"
        "    (here / (os.environ[lanes.CLAIM_FROM] + '.started')).touch()\n"
        "    deadline = time.monotonic() + 60\n"
        "    while len(list(here.glob('*.started'))) < 2 and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    return lanes.run_claimed(session)\n\n"
        "def pytest_runtest_setup(item):  # each process has claimed its first two files before a test runs\n"
        "    here, deadline = pathlib.Path(os.environ[lanes.CLAIMS]), time.monotonic() + 60\n"
        "    while len(list(here.glob('*.claim'))) < 4 and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n")
    for f in range(6):
        (tmp_path / f"test_f{f}.py").write_text(
            "import os, time, pytest\n\n"
            "@pytest.fixture(scope='module')\n"
            "def once():\n"
            f"    open({str(runs)!r}, 'a').write(f'setup f{f} {{os.getpid()}}\\n')\n\n"
            + "".join(f"def test_{t}(once):\n"
                      f"    time.sleep(0.15)\n"
                      f"    open({str(runs)!r}, 'a').write(f'test f{f}::{t} {{os.getpid()}}\\n')\n\n"
                      for t in range(3)))
    claims = tmp_path.parent / f"{tmp_path.name}-claims"
    claims.mkdir()
    env = {**os.environ, lanes.CLAIMS: str(claims)}
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                              cwd=tmp_path, env={**env, lanes.CLAIM_FROM: end}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for end in ("top", "bottom")]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    lines = [line.split() for line in runs.read_text().splitlines()]
    tests = [(what, pid) for kind, what, pid in lines if kind == "test"]
    assert sorted(what for what, _ in tests) == sorted(f"f{f}::{t}" for f in range(6) for t in range(3))
    by_file = {}
    for what, pid in tests:
        by_file.setdefault(what.split("::")[0], set()).add(pid)
    assert all(len(pids) == 1 for pids in by_file.values()), by_file
    setups = sorted(what for kind, what, _ in lines if kind == "setup")
    assert setups == [f"f{f}" for f in range(6)]
    assert len({pid for pids in by_file.values() for pid in pids}) == 2, by_file  # both took part


def test_the_paced_lane_runs_its_dashboards_last_and_says_when_it_reaches_them(tmp_path):
    """A pytest run as make test's paced lane over three files, a dashboard's among them in the
    middle of the alphabet: the dashboard's tests run last, and the tail's flag appears as they run,
    not before (each test records whether it saw the flag)."""
    flag, ran = tmp_path / "tail-may-start", tmp_path / "ran.txt"
    (tmp_path / "conftest.py").write_text(
        "from mfuscope.tests import lanes\n\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    lanes.paced_last(items)\n\n"
        "def pytest_runtest_call(item):\n"
        "    lanes.reached_paced_last(item)\n")
    for name in ("test_analyzers", lanes.PACED_LAST[0][:-3], "test_optimize"):
        (tmp_path / f"{name}.py").write_text(
            "import os, pathlib\n\n"
            + "".join(f"def test_{i}():\n"
                      f"    seen = pathlib.Path(os.environ['{lanes.TAIL_FLAG}']).exists()\n"
                      f"    with open({str(ran)!r}, 'a') as f:\n"
                      f"        f.write(f'{name} {{seen}}\\n')\n\n" for i in range(2)))
    env = {**os.environ, lanes.LANE: "paced", lanes.TAIL_FLAG: str(flag)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert ran.read_text().split("\n")[:-1] == ["test_analyzers False"] * 2 + ["test_optimize False"] * 2 + [
        f"{lanes.PACED_LAST[0][:-3]} True"] * 2
