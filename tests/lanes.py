"""``make test``: the whole suite in two lanes at once, so that it fits its budget on 2 cores.

Most of the suite's time is multi-rank runs of the reference trainer, and the runs whose wall time
the tests assert (the ``paced`` marker: paced sleeps, injected delays, predicted against measured
steps, a browser over paced runs) spend most of theirs asleep.  So:

- the **paced lane** runs ``pytest -m paced`` at normal priority, one test at a time, as the suite
  always ran;
- the **rest lane** runs ``pytest -m "not paced"`` beside it under Linux's ``SCHED_IDLE`` policy
  (inherited by every process it starts), on the cores the paced lane leaves idle.  The scheduler
  gives such a process a core only when no normal process wants it, and takes it back the moment
  one wakes, so the paced lane's timings are those of the machine alone, not of a loaded one
  (``nice`` is not enough: ten nice-10 ranks together still take a third of a contended core).
  Nothing in the rest lane asserts a duration.
- a paced test that measures **real compute** (unpaced runs whose step the cost model predicts)
  asks for the machine alone with :func:`quiet`: while it holds the flag, the rest lane starts no
  new test (:func:`wait_while_quiet`, at each test's setup).  ``SCHED_IDLE`` keeps the rest lane off
  a busy core, not off the caches, the memory bus or the disk, nor off a core a rank leaves for a
  moment to wait in gloo: a fresh-clone CI measured ddp=2's median step at 2.5x its quiet value,
  with single steps of 13 and 24 s, while the rest lane ran beside it.

A second rest process (the **tail**) shares the rest of the work, a test file at a time -- each
claims a file before it runs it (:func:`run_claimed`), the first from the top of the list
(:data:`HEAVY_FIRST` at its head), the tail from the bottom, until they meet -- so that both cores
are used where one rest process left one idle.  A file's tests stay in one process, so its module
fixtures run once.  Two rest processes beside the paced lane's timed runs slowed them and cost its
fail-slow run an episode, so the tail starts only when those are done: the paced lane runs the
dashboard's files last (:data:`PACED_LAST`: browsers over runs made before them, their page times
reported and not asserted; every shared run is made by an earlier file), and the tail starts,
also at idle priority, when the first of their tests runs, its fixtures made (:data:`TAIL_FLAG`),
or when the paced lane ends.

The paced lane streams its output; the rest lane's goes to ``artifacts/tests/rest.log`` (the tail's
to ``rest-tail.log``) and is printed when it ends.  The last line totals the lanes.  ``pytest``
alone still runs every test in one process (slower, same tests), and ``pytest FILE`` runs a file,
whatever its lane.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOGS = REPO / "artifacts" / "tests"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=20"]
#: The file a paced test holds while it wants the machine alone (its pid inside), named to both
#: lanes by make test; the rest lane's own processes carry :data:`LANE` = ``rest``.
QUIET, LANE = "MFUSCOPE_TEST_QUIET", "MFUSCOPE_TEST_LANE"
#: The directory in which the two rest processes claim test files, and which end of the list each
#: starts from (``top`` or ``bottom``).
CLAIMS, CLAIM_FROM = "MFUSCOPE_TEST_CLAIMS", "MFUSCOPE_TEST_CLAIM_FROM"
#: The rest lane's heaviest files (CPU seconds in a fresh-clone CI, 2026-12-04), run first, so that
#: what is left when the paced lane ends is small files, which the tail can share (it never splits a file).
HEAVY_FIRST = ("test_reference_trainer.py", "test_optimize.py", "test_map_reduce.py", "test_collectors.py",
               "test_kernel_linear_cross_entropy.py", "test_gpu_check.py", "test_first_findings.py",
               "test_gloo_traces.py", "test_cluster.py", "test_demo.py", "test_memory.py", "test_checkpoint.py")
#: The paced lane's files that run last, with the rest lane's tail beside them (see above).
PACED_LAST = ("test_dashboard.py", "test_dashboard_scale.py")
#: The file the paced lane makes when it reaches :data:`PACED_LAST`: the tail may start.
TAIL_FLAG = "MFUSCOPE_TEST_TAIL_FLAG"
#: The longest the rest lane waits for one quiet spell: a paced test that dies holding the flag
#: leaves a dead pid, which ends the wait at once; this bounds the rest.
QUIET_WAIT_S = 20 * 60
#: pytest's closing line: "3 failed, 550 passed, 2 skipped in 612.34s (0:10:12)"
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def _counts(log: str) -> dict[str, int]:
    lines = [ln for ln in log.splitlines() if " in " in ln and COUNTS.search(ln)]
    if not lines:
        return {}
    found = {}
    for n, what in COUNTS.findall(lines[-1]):
        found["error" if what.startswith("error") else what] = int(n)
    return found


def _idle_priority() -> None:
    """This process and its children run only on otherwise idle cores (``nice`` 19 where the
    platform has no SCHED_IDLE)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


@contextlib.contextmanager
def quiet():
    """The rest lane starts no new test while this lasts (under make test; elsewhere nothing
    changes).  Tests already running finish at their idle priority."""
    flag = os.environ.get(QUIET)
    if not flag or os.environ.get(LANE) == "rest":
        yield
        return
    tmp = Path(f"{flag}.{os.getpid()}.tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(flag)
    try:
        yield
    finally:
        Path(flag).unlink(missing_ok=True)


def wait_while_quiet() -> float:
    """In the rest lane: wait while a paced test holds :func:`quiet`'s flag; the seconds waited."""
    flag = os.environ.get(QUIET)
    if not flag or os.environ.get(LANE) != "rest":
        return 0.0
    start = time.monotonic()
    while time.monotonic() - start < QUIET_WAIT_S and _holder_alive(Path(flag)):
        time.sleep(0.5)
    return time.monotonic() - start


def _holder_alive(flag: Path) -> bool:
    try:
        os.kill(int(flag.read_text()), 0)
    except (OSError, ValueError):  # no flag, a torn one, or its holder is gone
        return False
    return True


def run_claimed(session) -> bool | None:
    """pytest's test loop for a rest process that shares its work (conftest's
    ``pytest_runtestloop``): each test file is run by whichever process claims it first (an
    exclusive create in :data:`CLAIMS`); None (pytest's own loop) outside make test's rest lane.
    The next file is claimed before the current one's last test, so that its fixtures are torn
    down knowing what runs next, as pytest's own loop does."""
    claims = os.environ.get(CLAIMS)
    if not claims or session.config.option.collectonly:
        return None
    files: dict[str, list] = {}
    for item in session.items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files.items(), key=lambda kv: _weight(kv[0]))  # stable: the rest in pytest's order
    if os.environ.get(CLAIM_FROM) == "bottom":
        order.reverse()
    mine = (items for name, items in order if _claim(Path(claims), name))
    current = next(mine, None)
    while current is not None:
        following = next(mine, None)
        for i, item in enumerate(current):
            nextitem = current[i + 1] if i + 1 < len(current) else (following[0] if following else None)
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = following
    return True


def _weight(nodeid_file: str) -> int:
    name = Path(nodeid_file).name
    return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)


def _claim(claims: Path, name: str) -> bool:
    try:
        os.close(os.open(claims / (name.replace("/", "__") + ".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def paced_last(items: list) -> None:
    """In the paced lane: :data:`PACED_LAST`'s tests moved to the end (in place, the rest in
    pytest's order); elsewhere nothing changes."""
    if os.environ.get(LANE) != "paced":
        return
    items.sort(key=lambda item: Path(item.nodeid.split("::")[0]).name in PACED_LAST)


def reached_paced_last(item) -> None:
    """In the paced lane, as a :data:`PACED_LAST` test runs (its fixtures, the dashboard's own paced
    run among them, already made): say so (:data:`TAIL_FLAG`)."""
    flag = os.environ.get(TAIL_FLAG)
    if flag and os.environ.get(LANE) == "paced" and Path(item.nodeid.split("::")[0]).name in PACED_LAST:
        Path(flag).touch()


def _lane_seconds(log: str) -> str:
    """The duration pytest's closing line gives ("in 612.34s"), or "?"."""
    found = re.findall(r" in (\d+(?:\.\d+)?)s", log)
    return f"{float(found[-1]):.0f} s" if found else "?"


def main(argv: list[str]) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    rest_log, tail_log, flag, claims = LOGS / "rest.log", LOGS / "rest-tail.log", LOGS / "quiet", LOGS / "claims"
    tail_flag = LOGS / "tail-may-start"
    flag.unlink(missing_ok=True)
    tail_flag.unlink(missing_ok=True)
    shutil.rmtree(claims, ignore_errors=True)
    claims.mkdir()
    tail_log.write_text("")
    env = {**os.environ, QUIET: str(flag)}
    rest_cmd = [*PYTEST, "-m", "not paced", *argv]
    started: list[subprocess.Popen] = []
    try:
        with open(rest_log, "w") as out:
            rest = subprocess.Popen(rest_cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_idle_priority,
                                    env={**env, LANE: "rest", CLAIMS: str(claims), CLAIM_FROM: "top"})
        started.append(rest)
        print(f"make test: the rest lane runs beside this one on idle cores only; its log: {rest_log}", flush=True)
        paced_out: list[bytes] = []
        paced = subprocess.Popen([*PYTEST, "-m", "paced", *argv], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT,
                                 env={**env, LANE: "paced", TAIL_FLAG: str(tail_flag), "PYTHONUNBUFFERED": "1"})
        started.append(paced)
        tail = None

        def start_tail(why: str) -> subprocess.Popen | None:
            if rest.poll() is not None:
                return None
            print(f"\nmake test: {why}; the rest lane's tail shares what is left (log: {tail_log})", flush=True)
            with open(tail_log, "w") as out:
                proc = subprocess.Popen(rest_cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                        preexec_fn=_idle_priority,
                                        env={**env, LANE: "rest", CLAIMS: str(claims), CLAIM_FROM: "bottom"})
            started.append(proc)
            return proc

        while chunk := os.read(paced.stdout.fileno(), 4096):  # each test's dot as it passes
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            paced_out.append(chunk)
            if tail is None and tail_flag.exists():
                tail = start_tail("the paced lane's timed runs are done (its dashboards are left)")
        paced_rc = paced.wait()
        if tail is None:
            tail = start_tail("the paced lane is done")
        tail_rc = tail.wait() if tail is not None else 0
        rest_rc = rest.wait()
    finally:  # interrupted: no lane goes on alone
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
    paced_text = b"".join(paced_out).decode(errors="replace")
    rest_text, tail_text = rest_log.read_text(errors="replace"), tail_log.read_text(errors="replace")
    for what, log, text in (("the rest lane", rest_log, rest_text), ("its tail", tail_log, tail_text)):
        if text:
            print(f"---------- {what} ({log}) ----------")
            print(text, end="" if text.endswith("\n") else "\n")
    total: dict[str, int] = {}
    for lane in (_counts(paced_text), _counts(rest_text), _counts(tail_text)):
        for k, v in lane.items():
            total[k] = total.get(k, 0) + v
    summary = f"{total.get('passed', 0)} passed, {total.get('failed', 0) + total.get('error', 0)} failed"
    if total.get("skipped"):
        summary += f", {total['skipped']} skipped"
    tail_note = f", its tail {_lane_seconds(tail_text)} (exit {tail_rc})" if tail_text else ""
    print(f"lanes: paced {_lane_seconds(paced_text)} (exit {paced_rc}), rest {_lane_seconds(rest_text)} "
          f"(exit {rest_rc}){tail_note}")
    print(summary)
    return 0 if paced_rc == 0 and rest_rc == 0 and tail_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
