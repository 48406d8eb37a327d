"""Starting ranks: ``torchrun``, or a fork launcher (``mfuscope train --launcher fork``, and tests).

The fork launcher imports torch once in the parent and forks the ranks, which
keeps multi-rank runs quick to start on a small machine (no per-rank interpreter
start and torch import: 7-8 CPU s less for a 2-rank run here).  Each child gets
the env:// variables torchrun would set.  One node only, and no elastic restarts.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import queue
import re
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world: int, port: int, args: tuple, queue, crash_log: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    # A rank that dies in native code cannot report; its Python stacks at the fatal signal go to a
    # file of its own (the file object must outlive the rank's work), read back into the parent's error.
    faulthandler.enable(file=open(crash_log, "w"), all_threads=True)  # noqa: SIM115
    try:
        import torch
        torch.set_num_threads(1)
        queue.put((rank, fn(*args), None))
    except BaseException:  # report, do not hang the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


#: A rank that fails because a peer went away says so in one of these words; the peer holds the cause.
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
                        r"Socket Timeout|recvBytes|NCCL communicator was aborted", re.I)
_GRACE_S = 15.0  # after a rank fails, how long to wait for the others' reports (the cause may come later)


def fork_ranks(fn: Callable, world: int, *args: Any, timeout: float | None = 600) -> list[Any]:
    """Run ``fn(*args)`` in ``world`` forked ranks; return each rank's result, rank order.
    ``timeout``: seconds the ranks may take together (None: no limit).

    When ranks fail, the error raised puts the cause first: a rank that raised on its own before
    the ranks that lost their peer because of it, and a rank killed by a signal (the kernel's OOM
    killer sends 9) by its exit code, since it could not report."""
    with tempfile.TemporaryDirectory(prefix="mfuscope-ranks-") as logs:
        crash_logs = [os.path.join(logs, f"rank{r}.fatal") for r in range(world)]
        return _fork_and_collect(fn, world, args, timeout, crash_logs)


def _import_for_the_ranks() -> None:
    """Import, once in the parent, what every rank would otherwise import on its own at first use:
    torch's ``_disable_dynamo`` wrappers (an optimizer's step, meta-device initialisation) import
    ``torch._dynamo`` at their first call, and the pipeline ranks import
    ``torch.distributed.pipelining``.  Measured on 2 cores: 0.5 CPU s a rank of an 8-rank,
    3-step run of tiny_dense (6.4 CPU s for the run, 2.3 s with these imports inherited).

    Also what every rank's collectors import: pandas and pyarrow's parquet writer
    (:func:`~mfuscope.run_dir.warm_parquet_writer`), and jsonschema for the run directory's
    manifest, imported as mfuscope's own processes import it (:mod:`mfuscope.lean_imports`:
    without the ``iri`` grammar, unless the parent has jsonschema already).  Measured on 2 cores,
    the 8-rank 3D run of tests/shared_runs.py forked from a fresh process, three runs each: 27-36
    CPU s (median 32), 23-25 (median 23) with them inherited."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    from mfuscope import run_dir
    from mfuscope.lean_imports import jsonschema_without_iri

    jsonschema_without_iri()
    run_dir.warm_parquet_writer()


def _fork_and_collect(fn: Callable, world: int, args: tuple, timeout: float, crash_logs: list[str]) -> list[Any]:
    _import_for_the_ranks()
    ctx = multiprocessing.get_context("fork")
    reports = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, reports, crash_logs[r]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    start = time.monotonic()
    first_failure: float | None = None
    try:
        while len(results) + len(errors) < world:
            now = time.monotonic()
            if first_failure is not None and now - first_failure > _GRACE_S:
                break
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"{world - len(results) - len(errors)} of {world} ranks did not finish in "
                                   f"{timeout:.0f} s")
            try:
                rank, value, error = reports.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode is not None and p.exitcode < 0 and r not in results and r not in errors:
                        oom = " (SIGKILL: out of memory?)" if p.exitcode == -9 else ""
                        stacks = _fatal_stacks(crash_logs[r]) or _fatal_stacks(_session_stacks(args, r))
                        errors[r] = f"killed by signal {-p.exitcode}{oom}{stacks}"
                        first_failure = first_failure or time.monotonic()
                continue
            if error:
                errors[rank] = error
                first_failure = first_failure or time.monotonic()
            else:
                results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RanksFailed(errors, world)
    return [results[r] for r in range(world)]


class RanksFailed(RuntimeError):
    """Forked ranks failed: the message's first line names the first cause, each rank's report
    follows (:func:`_failure_report`).  ``first``: the rank that failed first, ``failed`` of ``world``."""

    def __init__(self, errors: dict[int, str], world: int):
        super().__init__(_failure_report(errors, world))
        self.first = _causes_first(errors)[0]
        self.failed, self.world = len(errors), world


def _fatal_stacks(path: str, lines: int = 80) -> str:
    """What faulthandler wrote when the rank died of a fatal signal (its threads' Python stacks)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    if not text:
        return ""
    kept = text.splitlines()[:lines]
    return "; faulthandler's stacks at the signal:\n" + "\n".join(kept)


def _session_stacks(args: tuple, rank: int) -> str:
    """Where a trainer rank's collectors put its stacks at a fatal signal (they take faulthandler over
    while they run: collectors/fatal_stacks.py): ``fatal/rank<N>.txt`` in the run directory."""
    from mfuscope.collectors import fatal_stacks

    out = getattr(args[0], "out", None) if args else None
    return str(fatal_stacks.path(out, rank)) if out else ""


def _causes_first(errors: dict[int, str]) -> list[int]:
    """The failed ranks, a rank that failed on its own before those that lost their peer."""
    return sorted(errors, key=lambda r: (bool(_PEER_LOST.search(errors[r])), r))


def _failure_report(errors: dict[int, str], world: int) -> str:
    """The failed ranks' reports, causes first: a rank that lost its peer is a consequence."""
    order = _causes_first(errors)
    head = f"{len(errors)} of {world} ranks failed; rank {order[0]} first (the others may have failed because of it)"
    return head + "".join(f"\n--- rank {r} ---\n{errors[r]}" for r in order)


def torchrun_command(nproc: int, train_args: list[str], nnodes: int = 1, rdzv_endpoint: str | None = None) -> list[str]:
    """The torchrun command line for the trainer (standalone on one machine unless told otherwise)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    return cmd + ["-m", "mfuscope.reference_trainer.train", *train_args]
