"""The always-on communication timer: one row per collective call.

PyTorch's data, tensor and pipeline parallelism all reach the process group
through a few Python entry points: the c10d functions (``dist.all_reduce``,
``all_gather_into_tensor``, ... -- FSDP2, DDP's Python comm hooks, the
trainer's own context and expert parallelism), the functional collectives
(``funcol.*`` -- DTensor, so tensor and sequence parallelism) and pipelining's
``_batch_p2p`` (isend/irecv batches).  While the timer is installed each of
those is wrapped; every call records rank, step, op, parallel dimension,
process group, group ranks, bytes, a per-group sequence number, and
enqueue/start/end times.

When does a call end?  A synchronous call ends when it returns.  An async
c10d call returns a ``Work``: it ends when its future completes (gloo
completes it on its own thread) or, for work without a future (gloo
send/recv), when ``Work.wait`` returns.  While profiling, waits run under
``record_function("mfuscope.wait/<dim>/<op>")`` so the trace shows what the
training thread is blocked on.  A functional collective returns an
``AsyncCollectiveTensor``: it ends when ``wait_tensor`` returns for it.  On
GPU the end is a CUDA event recorded on the compute stream at that point,
read back at the next flush, off the critical path.

Bytes follow the nccl-tests convention, the full message of the collective:
all_reduce/broadcast/send/recv the tensor, all_gather the gathered output
(input x group size), reduce_scatter the input before scattering,
all_to_all the input, a send/recv batch the sum of its tensors.

While ``torch.profiler`` records, each call also runs under
``record_function("mfuscope.comm/<dim>/<op>")`` so traces carry the label; on
GPU an NVTX range of the same name marks it for Nsight Systems.

DDP reduces gradients in C++ with no Python call to wrap; the timer
registers torch's own default all-reduce comm hook (``allreduce_hook``, the
same arithmetic) at a DDP model's first forward, unless the script registered
a hook of its own.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from mfuscope import labels

from .collective_journal import CollectiveJournal
from .group_dims import GroupDims
from .step_timer import DeviceClock

# name -> (op, tensor argument, how the bytes follow from it)
#   one: that tensor; list: sum of a tensor list; gather: tensor (or list) x group size; ops: P2POps
_C10D = {
    "all_reduce": ("all_reduce", "tensor", "one"),
    "all_gather": ("all_gather", "tensor_list", "list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "one"),
    "all_gather_single": ("all_gather", "output_tensor", "one"),
    "reduce_scatter": ("reduce_scatter", "input_list", "list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "one"),
    "reduce_scatter_single": ("reduce_scatter", "input", "one"),
    "all_to_all": ("all_to_all", "input_tensor_list", "list"),
    "all_to_all_single": ("all_to_all", "input", "one"),
    "broadcast": ("broadcast", "tensor", "one"),
    "send": ("send", "tensor", "one"),
    "recv": ("recv", "tensor", "one"),
    "batch_isend_irecv": ("send_recv", "p2p_op_list", "ops"),
    "barrier": ("barrier", None, "none"),
}
_FUNCOL = {
    "all_reduce": ("all_reduce", "self", "one"),
    "all_reduce_coalesced": ("all_reduce", "self", "list"),
    "all_gather_tensor": ("all_gather", "self", "gather"),
    "all_gather_tensor_autograd": ("all_gather", "self", "gather"),
    "all_gather_single": ("all_gather", "self", "gather"),
    "all_gather_single_autograd": ("all_gather", "self", "gather"),
    "all_gather_into_tensor_coalesced": ("all_gather", "self", "gather"),
    "reduce_scatter_tensor": ("reduce_scatter", "self", "one"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", "self", "one"),
    "reduce_scatter_single": ("reduce_scatter", "self", "one"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", "list"),
    "all_to_all_single": ("all_to_all", "self", "one"),
    "all_to_all_single_autograd": ("all_to_all", "self", "one"),
    "broadcast": ("broadcast", "self", "one"),
    "permute_tensor": ("send_recv", "self", "one"),
}

# Row layout (a list, so completion callbacks can fill in the end later).
STEP, OP, DIM, PG, RANKS, BYTES, SEQ, ENQUEUE, START, END = range(10)
COLUMNS = ("step", "op", "dim", "pg", "group_ranks", "bytes", "seq", "enqueue_ns", "start_ns", "end_ns")


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _message_bytes(value: Any, how: str, group_size: int) -> int:
    if how == "ops":
        return sum(_nbytes(op.tensor) for op in value)
    if how == "gather":
        return _nbytes(value) * group_size
    if how == "none":
        return 0
    return _nbytes(value)


class CommTimer:
    """Wraps the collectives while installed; ``rows`` holds what they did."""

    def __init__(self, dims: GroupDims, current_step: Callable[[], int], clock: DeviceClock | None = None,
                 journal: CollectiveJournal | None = None):
        self.dims = dims
        self.journal = journal           # write-ahead records of every call (collective_journal)
        self.current_step = current_step
        self.clock = clock               # set on GPU: ends are CUDA events, converted at flush
        self.cuda = clock is not None
        self.rows: list[list] = []
        self._seq: dict[str, int] = {}
        self._waiting: dict[int, tuple[Any, list]] = {}   # id(work or tensor) -> (object, row)
        self._batch_rows: set[int] = set()                # rows of p2p batches (several works)
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self._ddp_hooks: dict[int, Any] = {}   # id(DDP module) -> its first-forward hook

    # ---------------------------------------------------------------- install
    def install(self) -> None:
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        for module, table in ((dist, _C10D), (c10d, _C10D), (funcol, _FUNCOL)):
            for name, spec in table.items():
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                original = getattr(fn, "__mfuscope_original__", fn)
                self._patch(module, name, self._wrap(original, *spec))
        self._patch(funcol, "wait_tensor", self._wrap_wait_tensor(funcol.wait_tensor))
        self._patch(dist.Work, "wait", self._wrap_work_wait(dist.Work.wait))
        try:
            from torch.distributed.pipelining import schedules
        except ImportError:  # pipelining is absent from some builds
            schedules = None
        if schedules is not None and hasattr(schedules, "_batch_p2p"):
            self._patch(schedules, "_batch_p2p", self._wrap_batch_p2p(schedules._batch_p2p))
        from torch.nn.parallel import DistributedDataParallel
        self._patch(DistributedDataParallel, "__init__", self._wrap_ddp_init(DistributedDataParallel.__init__))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        for handle in self._ddp_hooks.values():
            handle.remove()
        self._ddp_hooks.clear()

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def watch_ddp(self, module: Any, now: bool = False) -> None:
        """Time a DDP model's gradient all-reduces (see the module docstring): at its first forward,
        or ``now`` (just before its first forward, when a script's own hook would be there already)."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(module, DistributedDataParallel):
            return
        if now:
            self._give_ddp_a_timed_hook(module)
        elif id(module) not in self._ddp_hooks:
            self._ddp_hooks[id(module)] = module.register_forward_pre_hook(self._ddp_first_forward)

    # ---------------------------------------------------------------- wrappers
    def _wrap(self, fn: Callable, op: str, arg: str | None, how: str) -> Callable:
        params = list(inspect.signature(fn).parameters)
        group_pos = params.index("group") if "group" in params else None
        arg_pos = params.index(arg) if arg else None
        timer = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            local = timer._local
            if getattr(local, "busy", False):  # a wrapped function calling another: count once
                return fn(*args, **kwargs)
            local.busy = True
            try:
                if op == "send_recv" and how == "ops":
                    group = args[0][0].group if args and args[0] else kwargs.get("group")
                else:
                    group = kwargs["group"] if "group" in kwargs else (
                        args[group_pos] if group_pos is not None and group_pos < len(args) else None)
                value = None
                if arg is not None:
                    value = kwargs[arg] if arg in kwargs else (args[arg_pos] if arg_pos < len(args) else None)
                return timer._timed_call(fn, args, kwargs, op, group, value, how)
            finally:
                local.busy = False

        timed.__mfuscope_original__ = fn
        return timed

    def _timed_call(self, fn, args, kwargs, op, group, value, how):
        info = self.dims.resolve(group)
        pg = info["name"]
        seq = self._seq.get(pg, 0)
        self._seq[pg] = seq + 1
        row = [self.current_step(), op, info["dim"], pg, info.get("ranks_text") or _ranks_text(info),
               _message_bytes(value, how, len(info["ranks"])), seq, 0, None, None]
        labelled = _profiler_enabled()
        if labelled:
            region = record_function(labels.comm_label(info["dim"], op))
            region.__enter__()
        if self.cuda:
            torch.cuda.nvtx.range_push(labels.comm_label(info["dim"], op))
            row[START] = self.clock.event()
        row[ENQUEUE] = time.time_ns()
        if self.journal is not None:  # on disk before the call: a rank that dies in it is still read
            self.journal.enqueued(pg, seq, op, info["dim"], row[BYTES], row[STEP], value)
        try:
            result = fn(*args, **kwargs)
        finally:
            if self.cuda:
                torch.cuda.nvtx.range_pop()
            if labelled:
                region.__exit__(None, None, None)
        returned = time.time_ns()
        if not self.cuda:
            row[START] = row[ENQUEUE]
        self.rows.append(row)
        self._track_end(result, row, returned)
        return result

    def _track_end(self, result: Any, row: list, returned: int) -> None:
        if isinstance(result, dist.Work):
            self._await_work(result, row)
        elif isinstance(result, list) and result and all(isinstance(w, dist.Work) for w in result):
            # A batch ends when its last op does; each op's wait is labelled.
            self._batch_rows.add(id(row))
            for work in result:
                self._waiting[id(work)] = (work, row)
        elif type(result).__name__ == "AsyncCollectiveTensor" and not result.completed:
            # Waited on later, maybe through a view of it (AsyncCollectiveTensor re-wraps views):
            # known by its storage.
            self._waiting[_storage_key(result.elem)] = (None, row)
        else:
            self._ended(row, self.clock.event() if self.cuda else returned)

    def _ended(self, row: list, end: Any) -> None:
        row[END] = end
        if self.journal is not None:
            self.journal.completed(row[PG], row[SEQ])

    def _await_work(self, work: Any, row: list) -> None:
        # Known by id until waited on, so the wait can carry the call's label (see _labelled_wait).
        self._waiting[id(work)] = (work, row)
        if not self.cuda:
            try:
                work.get_future().then(lambda _f, row=row: self._ended(row, time.time_ns()))
            except RuntimeError:  # Work::getFuture not implemented (gloo send/recv): ends at wait
                pass

    def _finish(self, key: Any, obj: Any = None) -> None:
        entry = self._waiting.pop(key, None)
        if entry is None or entry[0] is not obj:
            return
        row = entry[1]
        if row[END] is None or id(row) in self._batch_rows:
            self._ended(row, self.clock.event() if self.cuda else time.time_ns())

    def _labelled_wait(self, wait: Callable, key: Any, obj: Any, *args, **kwargs):
        """Run a wait; while profiling, under ``mfuscope.wait/<dim>/<op>`` of the call it waits for,
        so traces show which dimension the training thread is blocked on."""
        entry = self._waiting.get(key)
        if entry is None:
            return wait(*args, **kwargs)
        row = entry[1]
        if _profiler_enabled():
            with record_function(labels.wait_label(row[DIM], row[OP])):
                out = wait(*args, **kwargs)
        else:
            out = wait(*args, **kwargs)
        self._finish(key, obj)
        return out

    def _wrap_work_wait(self, wait: Callable) -> Callable:
        timer = self

        @functools.wraps(wait)
        def timed_wait(work, *args, **kwargs):
            if not timer._waiting:
                return wait(work, *args, **kwargs)
            return timer._labelled_wait(wait, id(work), work, work, *args, **kwargs)

        return timed_wait

    def _wrap_wait_tensor(self, wait_tensor: Callable) -> Callable:
        timer = self

        @functools.wraps(wait_tensor)
        def timed_wait_tensor(tensor):
            if not timer._waiting:
                return wait_tensor(tensor)
            return timer._labelled_wait(wait_tensor, _storage_key(tensor), None, tensor)

        return timed_wait_tensor

    def _wrap_batch_p2p(self, batch_p2p: Callable) -> Callable:
        # Pipelining issues isend/irecv directly here (P2POp insists on the original functions).
        timer = self

        @functools.wraps(batch_p2p)
        def timed_batch_p2p(p2p_ops, *args, **kwargs):
            if not p2p_ops or getattr(timer._local, "busy", False):
                return batch_p2p(p2p_ops, *args, **kwargs)
            kinds = {op.op.__name__ for op in p2p_ops}
            op = "send" if kinds == {"isend"} else "recv" if kinds == {"irecv"} else "send_recv"
            timer._local.busy = True
            try:
                return timer._timed_call(batch_p2p, (p2p_ops, *args), kwargs, op, p2p_ops[0].group, p2p_ops, "ops")
            finally:
                timer._local.busy = False

        timed_batch_p2p.__mfuscope_original__ = batch_p2p
        return timed_batch_p2p

    def _wrap_ddp_init(self, init: Callable) -> Callable:
        timer = self

        @functools.wraps(init)
        def ddp_init(module, *args, **kwargs):
            init(module, *args, **kwargs)
            timer.watch_ddp(module)

        return ddp_init

    def _ddp_first_forward(self, module, args) -> None:
        self._ddp_hooks.pop(id(module)).remove()
        self._give_ddp_a_timed_hook(module)

    @staticmethod
    def _give_ddp_a_timed_hook(module) -> None:
        if module._comm_hooks or getattr(module, "process_group", None) is None:
            return  # the script's own hook runs; if it calls dist.*, it is timed anyway
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        try:
            module.register_comm_hook(module.process_group, allreduce_hook)
        except RuntimeError as e:  # e.g. a hook registered in C++ (register_builtin_comm_hook)
            print(f"mfuscope: DDP's gradient all-reduces are not timed: {e}", file=sys.stderr)

    # ---------------------------------------------------------------- output
    def take_rows(self, upto_step: int | None = None) -> list[list]:
        """Remove and return the rows of steps before ``upto_step`` (all rows if None), with CUDA
        events turned into epoch nanoseconds.  A call still in flight from the step just before
        ``upto_step`` waits for the next take."""
        if upto_step is None:
            taken, self.rows = self.rows, []
            self._waiting.clear()
            self._batch_rows.clear()
        else:
            done = [r for r in self.rows if r[STEP] < upto_step - 1 or (r[STEP] < upto_step and r[END] is not None)]
            kept = {id(r) for r in done}
            self.rows = [r for r in self.rows if id(r) not in kept]
            taken = done
            # Work nobody waits for from Python (DDP's hook futures) must not pile up.
            self._waiting = {k: v for k, v in self._waiting.items() if v[1][STEP] >= upto_step - 1}
            self._batch_rows &= {id(v[1]) for v in self._waiting.values()}
        if self.cuda:
            for r in taken:
                r[START], r[END] = self.clock.to_ns(r[START]), self.clock.to_ns(r[END])
        return taken


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return ("storage", tensor.untyped_storage().data_ptr())


def _ranks_text(info: dict) -> str:
    info["ranks_text"] = ",".join(map(str, info["ranks"]))
    return info["ranks_text"]

