"""A pytest plugin: a test whose rank crashed in native code runs once more.

A multi-rank test's rank killed by SIGSEGV, SIGBUS or SIGABRT died inside native code (gloo, the
allocator, a kernel), not in anything the test asserts; ``fork_ranks`` reports it as "killed by
signal N" followed by the rank's Python stacks at the signal.  Seen once in hundreds of suite runs (a
tp=2 gloo run: rank 0, SIGSEGV in backward, not reproduced in isolation), it must not fail the whole
suite, and it must not disappear either: such a test runs once more, the crash and its stacks are
printed in the terminal summary, and a second crash fails the test.  The same holds for a rank
started by ``mfuscope train`` (torchrun or ``--launcher fork``), known by the command's one-line
error in the test's failure.  Anything else -- an assertion, an exception, a rank that raised,
SIGKILL from the OOM killer -- fails at once as before.

``tests/conftest.py`` registers it; ``-p mfuscope.tests.native_crash`` loads it elsewhere.
"""
from __future__ import annotations

import re

import pytest

NATIVE_CRASH = re.compile(r"killed by signal (6|7|11)\b")
#: ``mfuscope train``'s one line when a rank (torchrun's or forked) died of such a signal (cli.py,
#: ``_why_training_failed``; tests/test_hang.py holds a real crashed run's line to it).  A tp=2 gloo
#: run beside two busy cores once ended so: rank 0, SIGABRT inside gloo's reduce-scatter in backward.
TRAIN_CRASH = re.compile(r"training failed \((torchrun exit \d+|\d+ of \d+ forked ranks failed, rank \d+ first)\): "
                         r"rank \d+ died of SIG(SEGV|BUS|ABRT)\b")
#: fork_ranks' error, as pytest names it (a RuntimeError subclass)
FORK_FAILED = re.compile(r"^(RuntimeError|(\w+\.)*RanksFailed): ")
_CRASHES: list[tuple[str, str]] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    from _pytest.runner import runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    crash = next((r for r in reports if r.failed and _ranks_crashed(r)), None)
    if crash is not None:
        _CRASHES.append((item.nodeid, crash.longreprtext))
        _forget_failed_fixtures(item)
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _ranks_crashed(report) -> bool:
    """The test failed with fork_ranks' own error, and a rank in it died of a native crash (not an
    assertion about such an error, as in a test that crashes a rank on purpose); or its failure
    carries ``mfuscope train``'s line for a rank that died so (a test that checks a training
    command's exit code, with its stderr in the message)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else ""
    forked = bool(FORK_FAILED.match(message)) and " ranks failed; " in message and \
        bool(NATIVE_CRASH.search(report.longreprtext))
    return forked or bool(TRAIN_CRASH.search(message))


def _forget_failed_fixtures(item) -> None:
    """A wider-scoped fixture whose setup crashed caches its error; the second run makes it again."""
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            cached = fixturedef.cached_result
            if cached is not None and cached[2] is not None:
                fixturedef.cached_result = None


def summary(terminalreporter) -> None:
    """Each crash that was run again, with what the rank's faulthandler wrote."""
    for nodeid, text in _CRASHES:
        terminalreporter.write_sep("=", f"a rank crashed in native code, so this test ran again: {nodeid}")
        terminalreporter.write_line(text[-6000:])


def pytest_terminal_summary(terminalreporter):
    summary(terminalreporter)
