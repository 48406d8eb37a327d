"""The map on a Dask cluster: ``mfuscope analyze PATH --scheduler tcp://HOST:PORT``.

When one machine's cores are too few and the traces sit on shared storage, the ranks are mapped
by Dask's workers instead of the local pool -- through ``distributed.Client.get_executor()``, a
``concurrent.futures`` executor, so :mod:`.map_reduce` runs the very same map and reduce (the
summaries come back to this process; the workers write the ranks' views and cache entries where
this process would).  Nsight Systems' multi-report recipes run the same way, on Dask.

What a cluster needs: mfuscope installed on every worker (``pip install mfuscope[cluster]``), the
traces (and the views directory, and the cache directory) at the same paths on every worker
(shared storage), and workers of one thread each: the map holds the GIL, so threads in one
worker would take turns.  From a shell::

    dask scheduler --port 8786
    DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON='{}' DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False \
        dask worker tcp://HOST:8786 --nworkers 8 --nthreads 1 --local-directory /scratch/dask
    mfuscope analyze /shared/traces --scheduler tcp://HOST:8786

(The two settings are what ``--scheduler local`` gives its own workers, :data:`LOCAL_WORKER_CONFIG`:
Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` in its workers, which made a rank's map 15%
slower -- the map gives its memory back itself -- and its profiler samples every thread's stack
every 10 ms.)

``--scheduler local`` starts a ``LocalCluster`` on this machine (one single-threaded worker
process per ``--workers``, default the CPU count) with its scratch space in the mfuscope cache
directory, never ``/tmp/dask-scratch-space`` by surprise.  ``DASK_SCHEDULER_ADDRESS`` is read
when ``--scheduler`` is not given, as Dask's own tools do.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Executor, Future
from pathlib import Path

from mfuscope.errors import UserInputError

from . import trace_cache

#: The environment variable Dask's tools read for the scheduler's address.
ENV_SCHEDULER = "DASK_SCHEDULER_ADDRESS"
#: Seconds to wait for a scheduler before saying it cannot be reached.
CONNECT_TIMEOUT_S = 10
#: ``--scheduler`` value that starts a LocalCluster here.
LOCAL = "local"
#: Dask settings of the workers ``--scheduler local`` starts: no stack-sampling profiler (every 10 ms,
#: holding the GIL the map needs), and none of the environment the nanny sets by default, whose
#: ``MALLOC_TRIM_THRESHOLD_=65536`` made a 54 MB rank's map 0.83 CPU s against the local pool's 0.72.
LOCAL_WORKER_CONFIG = {"distributed.worker.profile.enabled": False, "distributed.nanny.pre-spawn-environ": {}}


def scheduler_address(asked: str | None) -> str | None:
    """The scheduler to map on: ``--scheduler``, else ``DASK_SCHEDULER_ADDRESS``, else None (the local pool)."""
    return asked or os.environ.get(ENV_SCHEDULER) or None


class ClusterPool(Executor):
    """A Dask client's executor, and the client (and the LocalCluster, if it started one) to close.

    ``workers`` is the cluster's thread count: the map keeps twice that many tasks in flight (each a
    batch of small ranks or one large rank: map_reduce.batches).
    """

    def __init__(self, address: str, workers: int | None = None, local_directory: str | Path | None = None):
        distributed = _import_distributed()
        import dask
        self.address, self._cluster = address, None
        try:
            if address == LOCAL:
                scratch = Path(local_directory or trace_cache.cache_dir() / "dask-scratch")
                scratch.mkdir(parents=True, exist_ok=True)
                with dask.config.set(LOCAL_WORKER_CONFIG):  # handed to the worker processes by their nannies
                    self._cluster = distributed.LocalCluster(
                        n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                        local_directory=str(scratch), dashboard_address=None, silence_logs=logging.ERROR)
                self._client = distributed.Client(self._cluster, timeout=CONNECT_TIMEOUT_S)
            else:
                self._client = _connect(distributed, address)
        except (OSError, TimeoutError) as e:
            self.shutdown()
            raise UserInputError(f"cannot reach the Dask scheduler ({_first_line(e)}); start one with `dask "
                                 "scheduler` and its workers with `dask worker ADDRESS`, or leave out --scheduler "
                                 "to use this machine's cores", address) from None
        threads = sum(self._client.nthreads().values())
        if threads == 0:
            self.shutdown()
            raise UserInputError("the Dask scheduler has no workers: start some with `dask worker ADDRESS "
                                 "--nthreads 1`", address)
        self.workers = threads
        self._executor = self._client.get_executor(pure=False)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self._executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        client, cluster = getattr(self, "_client", None), self._cluster
        self._client = self._cluster = None
        if client is not None:
            if cancel_futures and hasattr(self, "_executor"):
                self._executor.shutdown(wait=False)
            client.close()
        if cluster is not None:
            cluster.close()


def is_worker_death(error: BaseException) -> bool:
    """Dask gave up on a task whose workers kept dying (``distributed.KilledWorker``)."""
    return type(error).__name__ == "KilledWorker"


def _connect(distributed, address: str):
    """A client of the scheduler at ``address``, or TimeoutError after ``2 * CONNECT_TIMEOUT_S``.

    ``Client(timeout=...)`` bounds the TCP connection, not the handshake after it: a port that
    accepts and never answers (another service, a stuck scheduler) would hang the analysis.  So
    the client is made on a helper thread, waited for with a deadline, and left behind if late.
    """
    made: dict = {}

    def attempt() -> None:
        try:
            made["client"] = distributed.Client(address, timeout=CONNECT_TIMEOUT_S)
        except BaseException as e:  # handed to the caller's thread
            made["error"] = e

    helper = threading.Thread(target=attempt, name="mfuscope-dask-connect", daemon=True)
    helper.start()
    helper.join(2 * CONNECT_TIMEOUT_S)
    if "client" in made:
        return made["client"]
    if "error" in made:
        raise made["error"]
    raise TimeoutError(f"no answer in {2 * CONNECT_TIMEOUT_S} s")


def _import_distributed():
    try:
        import distributed
    except ImportError:
        raise UserInputError("--scheduler needs Dask distributed: pip install 'mfuscope[cluster]'") from None
    return distributed


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
