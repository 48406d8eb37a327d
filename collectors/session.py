"""A profiling session: what ``mfuscope.profile(...)`` returns, one per rank.

::

    with mfuscope.profile("runs/exp1", model=model, mesh=mesh, window="5:3") as prof:
        for batch in loader:
            loss = train_step(batch)
            prof.step(tokens=batch.numel(), loss=loss)

Always on (cheap): the step timer, the communication timer, the NVML sampler.
In the window: ``torch.profiler`` writes ``traces/rank<N>.pt.trace.json.gz``.
Rank 0 writes the manifest; every rank writes its own table parts, flushed
every ``flush_every`` steps and at the end, so a crash loses at most those
steps.  Ctrl-C, an exception or SIGTERM ends the session early: files are
flushed, the window's trace is exported as far as it got, and the manifest
says ``ended_early`` with the reason.

All ranks agree on one run directory: the path is the same on every rank;
rank 0 checks it may be used (``force`` to replace an earlier run) and, when
the process group is up, tells the others, so a refusal stops every rank with
the same message.
"""
from __future__ import annotations

import contextlib
import os
import platform
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mfuscope import hardware, labels, run_dir
from mfuscope.errors import UserInputError
from mfuscope.run_dir import ENV_PREPARED
from mfuscope.window import parse_window

from . import flight_recorder
from .collective_journal import CollectiveJournal
from .comm_timer import COLUMNS as COMM_COLUMNS
from .comm_timer import CommTimer
from .cpu_peak import measured_matmul_peak
from .fatal_stacks import FatalStacks
from .group_dims import GroupDims, mesh_groups
from .kineto_window import KinetoWindow
from .memory_recorder import MemoryRecorder
from .nvml_sampler import NvmlSampler
from .pipeline_labels import PipelineLabels
from .step_timer import DeviceClock, StepTimer

# Set by ``mfuscope profile`` for the ranks it launches: the directory is already checked.


class ProfileSession:
    def __init__(self, out_dir: str | os.PathLike, *, model: Any = None, mesh: Any = None,
                 window: str | tuple[int, int] | None = "5:3", tokens_per_step: int | None = None,
                 extra_groups: dict | None = None, manifest: dict | None = None, dtype: str = "bf16",
                 nvml: bool = True,
                 nvml_period_s: float = 0.1, with_stack: bool = False, profile_memory: bool = False,
                 force: bool = False, flush_every: int = 50, handle_signals: bool = True):
        self.out = Path(out_dir)
        self.model, self.mesh = model, mesh
        self.window = window if isinstance(window, tuple) or window is None else parse_window(window)
        self.tokens_per_step = tokens_per_step
        self.extra_groups = extra_groups or {}
        self.manifest_fields = dict(manifest or {})
        self.dtype = dtype  # which peak the hardware table gives for MFU
        self.nvml_enabled, self.nvml_period_s = nvml, nvml_period_s
        self.with_stack, self.profile_memory = with_stack, profile_memory
        self.force, self.flush_every, self.handle_signals = force, flush_every, handle_signals
        self.rank, self.world = _identity()
        self.running = False
        self._parts = {name: 0 for name in run_dir.TABLE_SCHEMAS}
        self._checkpoints: list[dict] = []
        self._previous_handlers: dict[int, Any] = {}
        self._lock = threading.RLock()  # a signal may arrive while close() runs
        self._closing = False
        self._pending_signal: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ProfileSession:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close(ended_early=_reason(exc_type, exc))

    def start(self) -> ProfileSession:
        self._agree_on_run_dir()
        cuda = torch.cuda.is_available()
        self.clock = DeviceClock() if cuda else None
        self.steps = StepTimer(self.rank, self.clock)
        self.groups = GroupDims(mesh_groups(self.mesh, self.extra_groups) if self.mesh is not None else None)
        self.journal = CollectiveJournal(self.out, self.rank)
        self.fatal = FatalStacks(self.out, self.rank)
        self.fatal.install()
        self.comm = CommTimer(self.groups, lambda: self.steps.step, self.clock, self.journal)
        if self.rank == 0:
            run_dir.write_manifest(self.out, self._manifest("running"))
        run_dir.warm_parquet_writer()  # else the first flush, 50 steps in, stalls that step
        self.comm.install()
        self.pipeline_labels = PipelineLabels()
        self.pipeline_labels.install()
        if self.model is not None:
            self.comm.watch_ddp(self.model)
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.nvml = NvmlSampler(self.rank, torch.cuda.current_device() if cuda else local, self.nvml_period_s,
                                announce=local == 0)
        if self.nvml_enabled:
            self.nvml.start()
        self.memory = None
        if self.profile_memory:
            self.memory = MemoryRecorder(self.out, self.rank, self.model)
            self.memory.install()
        self.kineto = None
        if self.window is not None:
            self.kineto = KinetoWindow(self.out / run_dir.TRACES, self.rank, *self.window,
                                       with_stack=self.with_stack, profile_memory=self.profile_memory,
                                       cuda_range=os.environ.get("MFUSCOPE_NSYS") == "1",
                                       also_export=self.memory.write_window if self.memory else None)
            self.kineto.start()
        if self.handle_signals:
            self._install_signal_handlers()
        self.running = True
        self.steps.begin()
        if cuda:
            torch.cuda.nvtx.range_push(labels.step_label(0))
        return self

    def step(self, tokens: int | None = None, loss: Any = None) -> int:
        """End the current step (call after the optimizer step); returns its index."""
        if not self.running:
            return -1
        index = self.steps.end(tokens if tokens is not None else self.tokens_per_step, loss)
        began = time.perf_counter_ns()  # what follows is the collectors' work, inside the next step's span
        if self.memory is not None:
            self.memory.end_step(index)
        if self.kineto is not None:
            self.kineto.step()
        if self.clock is not None:
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_push(labels.step_label(index + 1))
        if (index + 1) % self.flush_every == 0:
            self.flush(upto_step=index + 1)
        self.steps.add_collector_time(time.perf_counter_ns() - began)
        return index

    @contextlib.contextmanager
    def checkpoint(self, mode: str = "sync"):
        """Around a checkpoint save on the training thread: its blocking time is recorded
        (``checkpoints.parquet``) and marked in the trace (``mfuscope.checkpoint/<mode>``: the
        breakdown's ``checkpoint`` leaf)::

            with prof.checkpoint("async"):
                dcp.async_save(state, checkpoint_id=path, process_group=group)
        """
        if not self.running:
            yield
            return
        with torch.profiler.record_function(labels.checkpoint_label(mode)):  # the clock inside the region
            start = time.time_ns()
            yield
            end = time.time_ns()
        row = {"rank": self.rank, "step": self.steps.step, "mode": mode, "start_ns": start,
               "blocking_ns": end - start, "background_ns": None}
        with self._lock:
            self._checkpoints.append(row)

    def checkpoint_background(self, step: int, seconds: float, mode: str = "async") -> None:
        """An async save's background part (writing, metadata, commit) ended after ``seconds``;
        ``step``: the step whose save it was.  Callable from any thread."""
        with self._lock:
            self._checkpoints.append({"rank": self.rank, "step": step, "mode": mode, "start_ns": None,
                                      "blocking_ns": None, "background_ns": int(seconds * 1e9)})

    def _take_checkpoints(self) -> list[dict]:
        with self._lock:
            rows, self._checkpoints = self._checkpoints, []
        return rows

    def mark_step_start(self) -> None:
        """Restart the current step's clock here (the no-code wrap calls it at the first forward,
        so start-up is not counted as part of step 0)."""
        if self.running:
            self.steps.begin()

    def close(self, ended_early: str | None = None) -> None:
        """Stop every collector, write what was captured, finish the manifest.  Idempotent."""
        with self._lock:
            if not self.running:
                return
            self.running = False
            self._closing = True
        try:
            # Each stop on its own: the rows already captured are written even if one collector
            # fails to stop (a signal can land anywhere, e.g. inside a DDP comm hook).
            stops = [self.nvml.stop, self.comm.uninstall, self.pipeline_labels.uninstall, self.journal.close,
                     self.fatal.uninstall]
            stops += [self.memory.uninstall] if self.memory is not None else []
            for stop in ([self.kineto.stop] if self.kineto is not None else []) + stops:
                _warn_on_failure(stop, f"rank {self.rank}: stopping {stop.__qualname__}")
            self.flush()
            if ended_early:  # what the job's collectives were doing, for `mfuscope hang`
                _warn_on_failure(lambda: flight_recorder.dump(self.out, self.rank),
                                 f"rank {self.rank}: writing its Flight Recorder dump")
        finally:
            if ended_early:
                run_dir.mark_ended_early(self.out, f"rank {self.rank}: {ended_early}")
            elif self.rank == 0:
                run_dir.update_manifest(self.out, self._finish_manifest)
            # Only now: a launcher's SIGTERM (sent to every rank once one fails) that lands while this
            # rank writes what it has would otherwise kill it half-way; it was held, and is delivered.
            self._closing = False
            self._restore_signal_handlers()
            pending, self._pending_signal = self._pending_signal, None
            if pending is not None:
                os.kill(os.getpid(), pending)

    def flush(self, upto_step: int | None = None) -> None:
        """Write this rank's finished rows as new table parts; a table that cannot be taken or
        written is named on stderr and does not cost the others their rows."""
        tables = ((run_dir.STEPS, self.steps.take_rows),
                  (run_dir.COMM, lambda: [dict(zip(("rank", *COMM_COLUMNS), (self.rank, *row)))
                                          for row in self.comm.take_rows(upto_step)]),
                  (run_dir.NVML, self.nvml.take_rows))
        if self.memory is not None:
            tables += ((run_dir.MEMORY, self.memory.take_rows),)
        tables += ((run_dir.CHECKPOINTS, self._take_checkpoints),)
        for name, take in tables:
            _warn_on_failure(lambda name=name, take=take: self._write_part(name, take()),
                             f"rank {self.rank}: writing {name}")

    def _write_part(self, name: str, rows: list[dict]) -> None:
        if rows:
            run_dir.write_rank_table(self.out, name, self.rank, self._parts[name], rows)
            self._parts[name] += 1

    # ------------------------------------------------------------------ run directory
    def _agree_on_run_dir(self) -> None:
        if os.environ.get(ENV_PREPARED) == str(self.out.resolve()):
            self.out.mkdir(parents=True, exist_ok=True)
            return  # the launcher checked it, once, for every rank
        error = None
        if self.rank == 0:
            try:
                run_dir.prepare(self.out, self.force)
            except UserInputError as e:
                error = str(e)
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise UserInputError(error)
        self.out.mkdir(parents=True, exist_ok=True)

    def _manifest(self, status: str) -> dict:
        cuda = torch.cuda.is_available()
        device = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine() or "cpu")
        acc = hardware.lookup(device) if cuda else None
        peak_dtype = self.dtype if self.dtype in ("bf16", "fp16", "fp8") else "bf16"  # fp32 runs: vs bf16 peak
        if cuda:
            peak, source = (acc.peak_flops(peak_dtype), acc.source) if acc else (None, None)
        else:
            peak, source = measured_matmul_peak()
        fields = {
            "command": sys.argv, "hosts": [socket.gethostname()],
            "hardware": {"device_name": device, "device_count": self.world, "peak_flops": peak,
                         "peak_source": source, "host_cpu": _host_cpu()},
            "software": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": _installed_version("triton"),
                         "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None},
            "model": _model_spec(self.model),
            "layout": _layout(self.mesh),
            "process_groups": _merge_groups([], self.groups.seen()),
            "window": ({"start_step": self.window[0], "num_steps": self.window[1]}
                       if self.window and self.window[1] else {"start_step": self.window[0]} if self.window else None),
        }
        fields.update(self.manifest_fields)
        run_id = os.environ.get("MFUSCOPE_RUN_ID") or self.out.resolve().name
        return run_dir.new_manifest(run_id, self.world, status=status, **fields)

    def _finish_manifest(self, current: dict | None) -> dict | None:
        if current is not None and current["status"] == "ended_early":
            return None  # another rank ended it early: keep that
        manifest = current or self._manifest("running")
        return {**manifest, "status": "complete", "end_time": run_dir.now_iso(),
                "process_groups": _merge_groups(manifest.get("process_groups") or [], self.groups.seen())}

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM,):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._closing:  # delivered when close() is done
            self._pending_signal = signum
            return
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        self.close(ended_early=signal.Signals(signum).name)
        # Then do what would have happened without us.
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _warn_on_failure(action: Any, what: str) -> bool:
    """Run ``action``; on an error say what failed on stderr and go on (True when it worked)."""
    try:
        action()
        return True
    except Exception as e:  # noqa: BLE001 - the profiler must never lose the rest of a rank's rows
        print(f"mfuscope: {what} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return False


def _identity() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _reason(exc_type, exc) -> str:
    if exc_type is KeyboardInterrupt:
        return "interrupted (Ctrl-C)"
    text = str(exc).strip().splitlines()
    return f"{exc_type.__name__}: {text[0]}" if text else exc_type.__name__


def _model_spec(model: Any) -> dict | None:
    if model is None or isinstance(model, dict):
        return model
    if isinstance(model, torch.nn.Module):
        total = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        return {"class": type(getattr(model, "module", model)).__name__, "parameters_on_rank": total}
    raise UserInputError(f"model= takes a spec dict or a torch.nn.Module, not {type(model).__name__}")


def _layout(mesh: Any) -> dict | None:
    if mesh is None:
        return None
    if hasattr(mesh, "sizes"):  # the reference trainer's ParallelDims
        return dict(mesh.sizes())
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {n: int(s) for n, s in zip(names, mesh.shape)}


def _merge_groups(known: list[dict], seen: list[dict]) -> list[dict]:
    merged = {g["name"]: {k: g[k] for k in ("name", "dim", "ranks")} for g in known}
    for g in seen:
        merged.setdefault(g["name"], {k: g[k] for k in ("name", "dim", "ranks")})
    return list(merged.values())


def _installed_version(dist_name: str) -> str | None:
    """A package's installed version without importing it (triton's import is slow, and CUDA-bound)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def _host_cpu() -> str | None:
    """The host's CPU model: CI runners of one label mix models, and CPU step times differ by them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
