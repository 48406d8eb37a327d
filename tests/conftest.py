"""Shared fixtures.  Helpers live in :mod:`mfuscope.tests.helpers`."""
from __future__ import annotations

import contextlib
import json
import os
import time

import pytest

from mfuscope.tests import devices, lanes, native_crash

# The Triton kernels run through Triton's interpreter on a machine without a GPU, compiled on one
# with a GPU.  Set before anything imports mfuscope.kernels: the kernels are built as interpreted
# or compiled at import (tests/devices.py).
CUDA = devices.cuda_visible()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
KERNEL_DEVICES = devices.kernel_devices(CUDA, devices.interpreting())


@pytest.fixture(params=KERNEL_DEVICES or [pytest.param(None, marks=pytest.mark.skip(reason=devices.NO_DEVICE))])
def device(request) -> str:
    """Each device whose tensors take the Triton kernels in this session: ``cpu`` through the
    interpreter, ``cuda`` where a GPU is visible."""
    return request.param


def pytest_configure(config):
    """A test whose rank crashed in native code runs once more (tests/native_crash.py)."""
    if not config.pluginmanager.is_registered(native_crash):
        config.pluginmanager.register(native_crash, "mfuscope-native-crash")


def pytest_runtestloop(session):
    """make test's rest lane shares its test files with its tail (tests/lanes.py, ``run_claimed``)."""
    return lanes.run_claimed(session)


_QUIET_WAITS: list[float] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """The paced lane says when it has reached its dashboards, their runs made (after the first's
    setup): the rest lane's tail may run beside them (tests/lanes.py)."""
    lanes.reached_paced_last(item)


def pytest_runtest_setup(item):
    """make test's rest lane holds each test back while a paced test has the machine to itself
    (tests/lanes.py, ``quiet``); its summary says how long, in all."""
    waited = lanes.wait_while_quiet()
    if waited >= 0.5:
        _QUIET_WAITS.append(waited)


# --------------------------------------------------------------------------- CPU seconds a test
# The suite's budget is CPU on 2 cores, and wall times in make test's lanes are mostly each other's
# contention: each test's CPU seconds (this process and the children it reaped, which is every
# rank and subprocess a test waits for) say what it really costs.
_CPU: dict[str, float] = {}
#: When each test ran (seconds since the epoch, start and end): beside a sampler of the machine's idle
#: time, which tests left a core idle (docs/contributing.md).
_SPAN: dict[str, tuple[float, float]] = {}


def _cpu_now() -> float:
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, began = _cpu_now(), time.time()
    yield
    _CPU[item.nodeid] = _cpu_now() - start
    _SPAN[item.nodeid] = (round(began, 2), round(time.time(), 2))


def pytest_terminal_summary(terminalreporter):
    if _QUIET_WAITS:
        terminalreporter.write_line(f"held back {sum(_QUIET_WAITS):.0f} s in all, {len(_QUIET_WAITS)} times, "
                                    "while a paced test had the machine alone (tests/lanes.py, quiet)")
    if not _CPU:
        return
    worst = sorted(_CPU.items(), key=lambda kv: -kv[1])[:20]
    terminalreporter.write_sep("=", f"most CPU seconds (this process and its children; {sum(_CPU.values()):.0f} s "
                                    f"in all)")
    for nodeid, cpu in worst:
        terminalreporter.write_line(f"{cpu:7.1f} s  {nodeid}")
    # every test's, for whoever trims the suite next: artifacts/tests/cpu-<lane>.json
    lane = "-".join(filter(None, (os.environ.get(lanes.LANE, "pytest"), os.environ.get(lanes.CLAIM_FROM))))
    out = lanes.LOGS / f"cpu-{lane}.json"
    with contextlib.suppress(OSError):  # an installed copy's tests may not write beside themselves
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({k: round(v, 2) for k, v in sorted(_CPU.items(), key=lambda kv: -kv[1])},
                                  indent=0))
        out.with_name(f"spans-{lane}.json").write_text(json.dumps(_SPAN, indent=0))


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests never read or write the user's real cache."""
    old = os.environ.get("MFUSCOPE_CACHE_DIR")
    os.environ["MFUSCOPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("mfuscope-cache"))
    yield
    if old is None:
        os.environ.pop("MFUSCOPE_CACHE_DIR", None)
    else:
        os.environ["MFUSCOPE_CACHE_DIR"] = old


# --------------------------------------------------------------------------- runs several modules read
# Made once per session, the first time a test asks (tests/shared_runs.py says what each is).
SHARED = {"run_3d", "torchrun_run", "optimized_gpipe", "health_run", "paced_pipelines"}


def pytest_collection_modifyitems(config, items):
    """Every reader of a shared run is in make test's paced lane, as the runs' paced readers are, so
    that two lanes never make the same run (tests/lanes.py); that lane runs its dashboards last."""
    lanes.paced_last(items)
    unmarked = [item.nodeid for item in items
                if SHARED & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("paced") is None]
    if unmarked:
        raise pytest.UsageError("these tests read a shared run (tests/shared_runs.py) but are not marked paced, so "
                                "make test would make the run twice: " + ", ".join(unmarked))


@pytest.fixture(scope="session")
def shared_runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-runs")


@pytest.fixture(scope="session")
def run_3d(shared_runs_dir):
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.tests import shared_runs
    return shared_runs.run_3d(shared_runs_dir)


@pytest.fixture(scope="session")
def torchrun_run(shared_runs_dir):
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.tests import shared_runs
    return shared_runs.torchrun_run(shared_runs_dir)


@pytest.fixture(scope="session")
def optimized_gpipe(shared_runs_dir):
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.tests import shared_runs
    return shared_runs.optimized_gpipe(shared_runs_dir / "optimize")


@pytest.fixture(scope="session")
def paced_pipelines(shared_runs_dir):
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.tests import shared_runs
    return shared_runs.paced_pipelines(shared_runs_dir / "pipelines")


@pytest.fixture(scope="session")
def health_run(shared_runs_dir):
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    from mfuscope.tests import shared_runs
    return shared_runs.health_run(shared_runs_dir / "health")
