"""Known faults, injected on purpose, so tests can check that analysis finds exactly them.

The faults ``--inject`` names, and how a spec is read, are :mod:`.faults`'s; this module makes
them happen in a running rank.

``--paced fwd_ms=20,bwd_ms=40[,w_ms=20][,per=sample][,scope=layer]`` makes every stage's
forward, input-gradient backward and weight-gradient pass take a fixed time (a
sleep that dominates the tiny model's compute): 16 ranks on 2 cores then keep
the timing of dedicated devices, which pipeline-bubble tests need.  ``w_ms``
sleeps in a node that only the weight gradients depend on, so zero-bubble
schedules run it in their W pass (others in the backward); with ``per=sample``
the times are per sample of the microbatch, so more microbatches mean less
work each, as on a real device; with ``scope=layer`` they are per transformer
layer of the stage, so an uneven ``--stage-layers`` split makes uneven stages.
"""
from __future__ import annotations

import functools
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from mfuscope import labels
from mfuscope.pacing import Pacing

from .faults import Fault

# The c10d entry points data, pipeline, context and expert parallelism reach the process group by.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
                "send", "recv", "batch_isend_irecv")


class Injector:
    """This rank's faults while it trains: which apply, and how long each occurrence lasts.

    The training loop tells it the step (:meth:`begin_step`); hooks ask :meth:`seconds`, which is
    zero on steps an intermittent fault skips and draws the jitter.
    """

    def __init__(self, faults: list[Fault], rank: int, seed: int = 0):
        self.rank = rank
        self.faults = [f for f in faults if f.hits(rank) or f.kind in ("stage", "link")]
        self.step = 0
        self._rng = random.Random(seed * 1_000_003 + rank)

    def of(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind]

    def seconds(self, f: Fault) -> float:
        if not f.on(self.step):
            return 0.0
        ms = f.ms + (self._rng.uniform(-f.jitter_ms, f.jitter_ms) if f.jitter_ms else 0.0)
        return max(ms, 0.0) / 1e3

    def begin_step(self, step: int) -> None:
        """Called first thing inside each step: the step-level stalls happen here."""
        self.step = step
        for f in self.of("die"):
            if f.step == step and f.at == "step":
                print(f"mfuscope: injected fault: rank {self.rank} dies (SIG{f.signal}) at step {step}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{f.signal}"))
        for f in self.of("hang"):
            if f.step == step:
                print(f"mfuscope: injected fault: rank {self.rank} hangs at step {step}", file=sys.stderr, flush=True)
                while True:  # until killed: a rank stuck on the host, as most real hangs are
                    time.sleep(1)
        for f in self.of("desync"):
            if f.step == step:
                _one_wrong_size_all_reduce()
        for f in self.of("loader"):
            if seconds := self.seconds(f):
                with record_function(f"enumerate(DataLoader)#{labels.inject_label('loader')}"):
                    time.sleep(seconds)
        for f in self.of("gc"):
            time.sleep(self.seconds(f))  # no region: a collector pass shows as a gap between operators

    def in_checkpoint(self, steps_done: int) -> None:
        """Called inside a checkpoint save, between its write and its commit (``die ... at=checkpoint``)."""
        for f in self.of("die"):
            if f.at == "checkpoint" and f.step == steps_done - 1:
                print(f"mfuscope: injected fault: rank {self.rank} dies (SIG{f.signal}) saving the checkpoint of "
                      f"step {steps_done - 1}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{f.signal}"))

    def attach_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for f in self.of("optimizer"):
            opt.register_step_pre_hook(lambda o, args, kwargs, f=f: time.sleep(self.seconds(f)))

    def attach_modules(self, modules: list[nn.Module], stage_ids: list[int]) -> None:
        for f in self.faults:
            if f.kind == "compute":
                for m in modules:
                    _delay(m, f.phase, lambda f=f: self.seconds(f), labels.inject_label("compute"))
            elif f.kind == "stage":
                for m, sid in zip(modules, stage_ids):
                    if sid == f.stage:
                        _delay(m, f.phase, lambda f=f: self.seconds(f), labels.inject_label("stage"))
            elif f.kind == "comm":
                # Late to the sequence-parallel all-gathers in front of attention and MLP: the sleep
                # runs before tensor parallelism's own input hook (prepend), which starts the gather.
                # The late rank is busy elsewhere (compute/other); its peers wait in the collective.
                for m in modules:
                    for block in m.layers.values():
                        for part in (block.attention, block.feed_forward):
                            late = _sleep_hook(lambda f=f: self.seconds(f), labels.inject_label("late"))
                            part.register_forward_pre_hook(late, prepend=True)
            elif f.kind == "sync":
                for m in modules:
                    for block in m.layers.values():
                        block.register_forward_hook(_host_sync)

    def slow_links(self, groups_by_dim: dict[str, list]) -> None:
        """Wrap the c10d collectives so calls on a slow dimension's groups take bytes/bandwidth longer
        (before the collectors wrap them, so their timing and labels include the delay).  A fault
        with a rank slows only the groups holding that rank: every member holds its calls there, so
        the group sees long collectives and nobody in it arrives late."""
        slow = {}  # group name -> fault
        for f in self.of("link"):
            for g in groups_by_dim.get(f.dim) or []:
                if g is not None and dist.get_world_size(g) > 1 and (
                        f.rank is None or f.rank in dist.get_process_group_ranks(g)):
                    slow[g.group_name] = f
        if not slow:
            return
        deadlines: dict[int, tuple[float, str, str]] = {}
        for name in _COLLECTIVES:
            if hasattr(dist, name):  # all_gather_single (FSDP2's since torch 2.12) is newer than others
                setattr(dist, name, _slowed(getattr(dist, name), slow, self, deadlines))
        _hold_works(deadlines)


def _one_wrong_size_all_reduce() -> None:
    """The next ``dist.all_reduce`` of this rank sends one element more than its peers expect.
    Wrapped around what is there now -- the collectors' wrapper, while a session runs -- so the
    records of the call carry the size actually sent."""
    issued = dist.all_reduce

    def wrong_size(tensor, *args, **kwargs):
        dist.all_reduce = issued  # once
        print("mfuscope: injected fault: this rank's all-reduce sends one element more", file=sys.stderr, flush=True)
        return issued(torch.cat([tensor.reshape(-1), tensor.new_zeros(1)]), *args, **kwargs)

    dist.all_reduce = wrong_size


def _host_sync(module, args, out) -> None:
    """Read one element back to the host: on a GPU the thread waits for everything queued."""
    (out.to_local() if hasattr(out, "to_local") else out).detach().reshape(-1)[0].item()


def _sleep_hook(seconds, label: str, per_sample: bool = False):
    # Labelled, so the breakdown counts the sleep as the compute it stands for.
    def hook(module, args):
        rows = args[0].shape[0] if per_sample else 1
        with record_function(label):
            time.sleep(seconds() * rows)
    return hook


def _delay(module: nn.Module, phase: str, seconds, label: str, per_sample: bool = False) -> None:
    if phase == "fwd":
        module.register_forward_pre_hook(_sleep_hook(seconds, label, per_sample))
    else:
        def hook(mod, args, out):
            rows = args[0].shape[0] if per_sample else 1
            return _SleepInBackward.apply(out, seconds() * rows, label)
        module.register_forward_hook(hook)


class _SleepInBackward(torch.autograd.Function):
    """Identity on the activations; its backward (the input-gradient pass) sleeps."""

    @staticmethod
    def forward(ctx, x, seconds, label):
        ctx.seconds, ctx.label = seconds, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with record_function(ctx.label):
            time.sleep(ctx.seconds)
        return grad, None, None


class _SleepInWeightGrad(torch.autograd.Function):
    """A zero added to the output from a parameter of its own: only that parameter's gradient
    depends on this node, so a zero-bubble schedule runs its sleep in the weight-gradient pass."""

    @staticmethod
    def forward(ctx, anchor, seconds):
        ctx.seconds, ctx.shape = seconds, anchor.shape
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        with record_function(labels.paced_label("weight")):
            time.sleep(ctx.seconds)
        return grad.new_zeros(ctx.shape), None


def apply_paced(modules: list[nn.Module], pacing: Pacing) -> None:
    """Each stage module's forward takes ``fwd_ms`` more, its backward ``bwd_ms`` and its weight
    gradients ``w_ms`` (times the microbatch's samples with ``per_sample``); with ``per_layer``
    each transformer block of the stage does."""
    targets = [block for m in modules for block in m.layers.values()] if pacing.per_layer else modules
    for m in targets:
        _delay(m, "fwd", lambda: pacing.fwd_ms / 1e3, labels.paced_label("forward"), pacing.per_sample)
        _delay(m, "bwd", lambda: pacing.bwd_ms / 1e3, labels.paced_label("backward"), pacing.per_sample)
        if pacing.w_ms:
            # Registered before data parallelism wraps the module, so it is sharded and reduced like
            # any weight; its gradient is zero, so training is unchanged.
            m.pace_weight = nn.Parameter(torch.zeros(1))

            def add_weight_pass(mod, args, out):
                rows = args[0].shape[0] if pacing.per_sample else 1
                return out + _SleepInWeightGrad.apply(mod.pace_weight, pacing.w_ms / 1e3 * rows)
            m.register_forward_hook(add_weight_pass)


def _slowed(fn, slow: dict, injector: Injector, deadlines: dict[int, tuple[float, str, str]]):
    """``fn`` on a slow link: its call completes no sooner than bytes/bandwidth after it was issued.
    A blocking call sleeps out the rest before it returns; an async call returns at once and its
    ``Work`` is held to the deadline when waited on or through its future (:func:`_hold_works`), so
    work issued early (prefetch, DDP's buckets) hides the link as it would on a real one."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if fn.__name__ == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            group = ops[0].group if ops else None
            nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        else:
            group = kwargs.get("group") if "group" in kwargs else next(
                (a for a in args if isinstance(a, dist.ProcessGroup)), None)
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        fault = slow.get(getattr(group, "group_name", None))
        issued = time.monotonic()
        out = fn(*args, **kwargs)
        if fault is None or not fault.on(injector.step):
            return out
        ms = fault.jitter_ms and injector._rng.uniform(-fault.jitter_ms, fault.jitter_ms)
        deadline = issued + max(nbytes * 8 / (fault.gbps * 1e9) + ms / 1e3, 0.0)
        works = [w for w in (out if isinstance(out, list) else [out]) if isinstance(w, dist.Work)]
        if not works:
            time.sleep(max(deadline - time.monotonic(), 0.0))
        if len(deadlines) > 4096:  # works nobody waited for (futures only): forget the old ones
            for key in [k for k, held in deadlines.items() if held[0] < issued - 60]:
                del deadlines[key]
        for w in works:
            deadlines[id(w)] = (deadline, fault.dim, fn.__name__)
        return out
    return call


def _hold_works(deadlines: dict[int, tuple[float, str, str]]) -> None:
    """``Work.wait`` and ``Work.get_future`` of a slow link's async calls end at their deadline
    (installed before the collectors wrap ``Work.wait``, so their labels include the delay).

    A future's delay runs in the callback gloo's worker thread calls when the transfer completes
    (the trace shows it inside that collective, in flight).  A transfer already complete when its
    future is asked for would run that callback inline, in the caller: it sleeps there, labelled
    as the link's communication (blocking, as a small message on a loaded host can)."""
    wait, get_future = dist.Work.wait, dist.Work.get_future

    @functools.wraps(wait)
    def held_wait(work, *args, **kwargs):
        out = wait(work, *args, **kwargs)
        held = deadlines.pop(id(work), None)
        if held is not None:
            time.sleep(max(held[0] - time.monotonic(), 0.0))
        return out

    @functools.wraps(get_future)
    def held_future(work):
        fut = get_future(work)
        held = deadlines.get(id(work))
        if held is None:
            return fut
        deadline, dim, name = held
        if fut.done():
            with record_function(labels.comm_label(dim, name)):
                time.sleep(max(deadline - time.monotonic(), 0.0))
            return fut

        def at_deadline(done):
            time.sleep(max(deadline - time.monotonic(), 0.0))
            return done.value()
        return fut.then(at_deadline)

    dist.Work.wait, dist.Work.get_future = held_wait, held_future
