"""The map on Dask: the same report from a LocalCluster and from a scheduler and workers started as a
user would start them from a shell, and one clear line when the scheduler or a trace cannot be reached.

The expected reports are the frozen in-memory analyses (tests/fixtures/frozen_reports), the oracle
the local pool is held to in test_map_reduce.py -- so the cluster, the local pool and the analysis
from before the map/reduce all give one report.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mfuscope.analyzers import analysis, cluster, map_reduce
from mfuscope.errors import UserInputError
from mfuscope.tests.helpers import (
    DLRM,
    FROZEN_REPORTS,
    HTA_DATA,
    needs_corpus,
    replicated_set,
    report_differences,
)

distributed = pytest.importorskip("distributed", reason="Dask distributed is not installed: "
                                  "pip install 'mfuscope[cluster]' (make test installs it)")
DASK = Path(sys.executable).parent / "dask"


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """A LocalCluster of two single-threaded worker processes (one a core), as ``--scheduler local``
    starts it; its scratch space in the test's folder.  A worker that dies fails its task at once
    (no retries), so the dying-worker test does not wait for three restarts."""
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        scratch = tmp_path_factory.mktemp("scratch")
        pool = cluster.ClusterPool(cluster.LOCAL, workers=2, local_directory=scratch)
    pool.scratch = scratch
    yield pool
    pool.shutdown()


def _frozen(name: str) -> dict:
    return json.loads((FROZEN_REPORTS / name).read_text())


@needs_corpus(DLRM)
def test_a_local_cluster_gives_the_local_pools_report(local_cluster, tmp_path):
    assert local_cluster.workers == 2
    report, _ = analysis.analyze(DLRM, tmp_path / "dask.json", tmp_path / "views", pool=local_cluster,
                                 use_cache=False, progress=False)
    assert report_differences(_frozen("dlrm_8_ranks.json"), report) == []
    local, _ = analysis.analyze(DLRM, tmp_path / "local.json", None, workers=2, use_cache=False, progress=False)
    assert report_differences(local, report) == []
    assert sorted(p.name for p in (tmp_path / "views").iterdir())  # the workers wrote the views here
    assert any(local_cluster.scratch.iterdir())  # the workers' scratch space is where it was put


@needs_corpus(HTA_DATA / "trace_filter")
def test_32_ranks_on_a_local_cluster(local_cluster, tmp_path):
    traces = replicated_set(tmp_path / "set", sorted((HTA_DATA / "trace_filter").glob("*.json.gz")), 16)
    report, _ = analysis.analyze(traces, tmp_path / "r.json", tmp_path / "views", pool=local_cluster,
                                 use_cache=False, progress=False)
    assert report_differences(_frozen("trace_filter_x16.json"), report) == []


@needs_corpus(DLRM)
def test_a_worker_that_dies_on_the_cluster_is_named(local_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(map_reduce.ENV_KILL_WORKER, "worker3_")  # its worker kills itself
    with pytest.raises(UserInputError) as e:
        analysis.analyze(DLRM, tmp_path / "r.json", None, pool=local_cluster, use_cache=False, progress=False)
    assert "worker3_" in str(e.value) and "died again when it ran alone" in str(e.value)
    assert not (tmp_path / "r.json").exists()


@pytest.fixture
def shell_cluster(tmp_path):
    """``dask scheduler`` and ``dask worker`` (two one-thread processes) started as subprocesses, each
    in a session of its own so that it goes with its children at the end (a graceful close takes
    seconds, and the test has what it needs)."""
    sched_file = tmp_path / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    procs = [subprocess.Popen([str(DASK), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(sched_file)], **quiet)]
    try:
        procs.append(subprocess.Popen([str(DASK), "worker", "--scheduler-file", str(sched_file), "--nworkers", "2",
                                       "--nthreads", "1", "--no-dashboard", "--local-directory",
                                       str(tmp_path / "worker-scratch")], **quiet))
        address = _wait_for_workers(sched_file, 2)
        yield address
    finally:
        for p in reversed(procs):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _wait_for_workers(sched_file: Path, n: int, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while not sched_file.exists():
        assert time.monotonic() < deadline, "the dask scheduler did not start"
        time.sleep(0.2)
    address = json.loads(sched_file.read_text())["address"]
    with distributed.Client(address, timeout=30) as client:
        client.wait_for_workers(n, timeout=max(deadline - time.monotonic(), 1))
    return address


@needs_corpus(DLRM)
def test_analyze_on_a_scheduler_started_from_the_shell(shell_cluster, tmp_path):
    out = tmp_path / "report.json"
    cli = subprocess.run([sys.executable, "-m", "mfuscope", "analyze", str(DLRM), "--scheduler", shell_cluster,
                          "--no-cache", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    report = json.loads(out.read_text())
    assert report_differences(_frozen("dlrm_8_ranks.json"), report) == []
    assert report["provenance"]["timings"]["scheduler"] == shell_cluster
    assert report["provenance"]["timings"]["workers"] == 2
    # DASK_SCHEDULER_ADDRESS instead of the flag
    env_out = tmp_path / "env.json"
    cli = subprocess.run([sys.executable, "-m", "mfuscope", "analyze", str(DLRM), "--out", str(env_out)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, cluster.ENV_SCHEDULER: shell_cluster})
    assert cli.returncode == 0, cli.stderr
    assert json.loads(env_out.read_text())["provenance"]["timings"]["scheduler"] == shell_cluster
    # A trace the workers cannot read (here: gone; on a cluster: not on shared storage): one error naming it.
    files = [(f, None) for f in sorted(DLRM.glob("*.json"))]
    missing = tmp_path / "worker9_missing.json"
    with pytest.raises(UserInputError) as e:
        map_reduce.analyze_ranks(DLRM, files=([files[0], (missing, None)], []), scheduler=shell_cluster,
                                 use_cache=False, progress=False)
    assert str(missing) in str(e.value) and "cannot be read on host" in str(e.value)


@needs_corpus(DLRM)
def test_an_unreachable_scheduler_is_one_line(tmp_path, monkeypatch, capsys):
    from mfuscope import cli

    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 1)
    with socket_bound() as port:  # a port that is open but speaks no Dask
        rc = cli.main(["analyze", str(DLRM), "--out", str(tmp_path / "r.json"), "--scheduler",
                       f"tcp://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot reach the Dask scheduler" in err
    assert not (tmp_path / "r.json").exists()


class socket_bound:
    """A listening TCP socket on a free port of this host that never answers."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()
