"""The range labels mfuscope writes into traces, and how they read back: one grammar, in one place.

The collectors and the reference trainer name ``record_function`` ranges (NVTX ranges on GPU); the
analyzers find steps, collectives, pipeline actions and simulated compute in a trace by those names.
A writer formats a label with a function here and a reader parses it with the one beside it, so the
two cannot drift apart (they did: two readers' regexes disagreed on the wait form).

=====================================  ================================================  ==========================
label                                  marks                                             written by
=====================================  ================================================  ==========================
``mfuscope.step#<N>``                  training step N                                   trainer; session (NVTX)
``mfuscope.comm/<dim>/<op>``           a collective call on parallel dimension <dim>     comm timer; slow-link fault
``mfuscope.wait/<dim>/<op>``           the thread waiting for such a call's work         comm timer
``mfuscope.pp/<stage><F|B|W><mb>``     a pipeline stage's chunk of microbatch <mb>       pipeline labels
``mfuscope.paced/<what>``              the trainer's paced compute (a sleep)             trainer
``mfuscope.inject/<what>``             an injected fault's compute (a sleep)             trainer
``mfuscope.checkpoint/<mode>``         the training thread blocked saving a checkpoint   session (``checkpoint``)
=====================================  ================================================  ==========================

``<dim>`` and ``<op>`` are single path segments (no ``/``): the comm timer's dimension names
(``tp``, ``dp_shard_cp``, ``world``, ...) and the op as the caller named it.  Readers also accept
PyTorch's own names for the same things: ``ProfilerStep#<N>``, the pipelining schedules' actions
``PP:<stage><F|I|B|W><mb>`` (I: the backward of the input) and GPipe's ``Forward <mb>`` /
``Backward <mb>``.

Torch-free and free of mfuscope's other modules: the collectors (with torch) and the analyzers
(without) both import it.
"""
from __future__ import annotations

import re
from typing import NamedTuple

#: Every label mfuscope writes starts with this (the analyzers' own rows too: ``mfuscope.whole_trace``).
NAMESPACE = "mfuscope."

STEP = "mfuscope.step"
PROFILER_STEP = "ProfilerStep"  # torch.profiler's step marker
COMM = "mfuscope.comm/"
WAIT = "mfuscope.wait/"
PP = "mfuscope.pp/"
PACED = "mfuscope.paced/"
INJECT = "mfuscope.inject/"
CHECKPOINT = "mfuscope.checkpoint/"
#: Sleeps standing in for compute: the breakdown counts them as compute, not idle.
SIMULATED = (PACED, INJECT)

_STEP_RE = re.compile(rf"^({re.escape(STEP)}|{re.escape(PROFILER_STEP)})#(\d+)$")
#: Both communication forms, for vectorized readers (``Series.str.extract``): groups kind, dim, op.
COMM_RE = re.compile(rf"^(?P<kind>{re.escape(COMM)}|{re.escape(WAIT)})(?P<dim>[^/]+)/(?P<op>[^/]+)$")
_PP_RE = re.compile(rf"^(?:PP:|{re.escape(PP)})(\d+)([FBIW])(\d+)$")
_GPIPE_RE = re.compile(r"^(Forward|Backward) (\d+)$")


def checkpoint_label(mode: str) -> str:
    """``mfuscope.checkpoint/<mode>``: the training thread blocked in a checkpoint save (all of a
    sync save; the staging of an async one)."""
    return f"{CHECKPOINT}{mode}"


def step_label(step: int) -> str:
    """``mfuscope.step#<step>``: the span of one training step, numbered as the trainer counts."""
    return f"{STEP}#{step}"


def parse_step(name: str) -> tuple[str, int] | None:
    """(source, step) of a step marker -- source ``mfuscope.step`` or ``ProfilerStep`` -- else None.
    The source matters: a trace can hold both, and mfuscope's numbering is the training step."""
    m = _STEP_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


class CommLabel(NamedTuple):
    dim: str
    op: str
    wait: bool  # the wait form: the thread blocked on an earlier call's work, not a call of its own


def comm_label(dim: str, op: str) -> str:
    """``mfuscope.comm/<dim>/<op>``: one collective call, from issue to return."""
    return f"{COMM}{dim}/{op}"


def wait_label(dim: str, op: str) -> str:
    """``mfuscope.wait/<dim>/<op>``: waiting (``Work.wait``, ``wait_tensor``) for an async call's work.
    A label of its own, not a second call: a reader that counts calls must skip it."""
    return f"{WAIT}{dim}/{op}"


def parse_comm(name: str) -> CommLabel | None:
    """The call or wait label's dimension and op (``wait`` tells which form), else None."""
    m = COMM_RE.match(name)
    return CommLabel(m.group("dim"), m.group("op"), m.group("kind") == WAIT) if m else None


class PipelineAction(NamedTuple):
    stage: int | None  # None: GPipe's labels do not name the stage
    action: str           # F, B, W, or I (PyTorch's backward of the input)
    microbatch: int


def pp_label(stage: int, action: str, microbatch: int) -> str:
    """``mfuscope.pp/<stage><action><microbatch>``, PyTorch's action string (``1B3``: stage 1's
    backward of microbatch 3) under our prefix, since only its multi-stage schedules label actions."""
    return f"{PP}{stage}{action}{microbatch}"


def parse_pp(name: str) -> PipelineAction | None:
    """The pipeline action a label names, ours or PyTorch's (``PP:0F1``, ``Forward 3``), else None."""
    m = _PP_RE.match(name)
    if m:
        return PipelineAction(int(m.group(1)), m.group(2), int(m.group(3)))
    m = _GPIPE_RE.match(name)
    return PipelineAction(None, m.group(1)[0], int(m.group(2))) if m else None


def paced_label(what: str) -> str:
    """``mfuscope.paced/<what>``: a paced pass's sleep (``forward``, ``backward``, ``weight``)."""
    return f"{PACED}{what}"


def inject_label(what: str) -> str:
    """``mfuscope.inject/<what>``: an injected fault's sleep (``compute``, ``stage``, ``late``).  The
    loader stall's region is ``enumerate(DataLoader)#mfuscope.inject/loader``, named as PyTorch names
    a DataLoader's, so that it reads as data loading, not as compute."""
    return f"{INJECT}{what}"
