"""The no-code wrap: a profiling session in every rank of an unmodified training script.

``mfuscope profile --out RUN -- torchrun ... train.py`` puts ``_site/`` on
``PYTHONPATH``; its ``sitecustomize`` calls :func:`arm` at interpreter start.
Then, in each process that should profile:

1. when the program has imported torch, DDP constructors are noted (their
   gradient all-reduces happen in C++; the session gives them a Python comm
   hook it can time) and two hooks are registered;
2. the first forward pass of any module starts the session -- late enough
   that the script has chosen its CUDA device and set up its process group,
   so nothing here touches GPU 0 on behalf of every rank;
3. every optimizer step (``register_optimizer_step_post_hook``) ends a step;
   with several optimizers, the first one to step drives the count;
4. the session closes at exit; an uncaught exception or SIGTERM marks the run
   as ended early.

Which processes profile: under a launcher (torchrun), its workers -- those
with ``LOCAL_RANK`` -- and not the launcher itself; otherwise the first
process.  Processes these start (DataLoader workers) inherit an owner mark
and stay out.
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import weakref
from typing import Any

ENV_RUN_DIR = "MFUSCOPE_RUN_DIR"
ENV_WINDOW = "MFUSCOPE_WINDOW"
ENV_TOKENS = "MFUSCOPE_TOKENS_PER_STEP"
ENV_NVML = "MFUSCOPE_NVML"
ENV_TRACE_EXTRAS = "MFUSCOPE_TRACE_EXTRAS"  # comma-separated: stack, memory
ENV_LAUNCHER = "MFUSCOPE_LAUNCHER"       # "1": the command is a launcher; profile its workers only
ENV_COMMAND = "MFUSCOPE_COMMAND"         # the user's command line, as JSON
ENV_OWNER = "MFUSCOPE_SESSION_OWNER"     # pid of the process that profiles; children stay out

_state: dict[str, Any] = {"session": None, "optimizer": None, "handles": [], "ddp": weakref.WeakSet(),
                          "exit_reason": None}


def should_profile(env: dict[str, str] = os.environ) -> bool:
    if not env.get(ENV_RUN_DIR) or env.get(ENV_OWNER):
        return False
    if env.get(ENV_LAUNCHER) == "1":
        return "LOCAL_RANK" in env
    return True


def arm() -> None:
    """Called from sitecustomize: wait for torch, then hook in."""
    if not should_profile():
        return
    os.environ[ENV_OWNER] = str(os.getpid())
    if "torch" in sys.modules:
        _on_torch_imported()
    else:
        sys.meta_path.insert(0, _AfterImport("torch", _on_torch_imported))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once module ``name`` has finished importing."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_hook(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_hook
        return spec


def _on_torch_imported() -> None:
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook

    init = DistributedDataParallel.__init__

    def noting_init(module, *args, **kwargs):
        init(module, *args, **kwargs)
        _state["ddp"].add(module)

    DistributedDataParallel.__init__ = noting_init
    _state["handles"] = [register_module_forward_pre_hook(_first_forward),
                         register_optimizer_step_post_hook(_optimizer_stepped)]
    _install_exit_hooks()
    del torch


def _first_forward(module, args) -> None:
    _state["handles"][0].remove()
    _start_session()


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    session = _state["session"] or _start_session()
    if session is None:
        return
    if _state["optimizer"] is None:
        _state["optimizer"] = weakref.ref(optimizer)
    if _state["optimizer"]() is optimizer:
        session.step()


def _start_session():
    if _state["session"] is not None:
        return _state["session"]
    from mfuscope.errors import UserInputError

    from .session import ProfileSession

    tokens = os.environ.get(ENV_TOKENS)
    extras = os.environ.get(ENV_TRACE_EXTRAS, "").split(",")
    command = os.environ.get(ENV_COMMAND)
    try:
        session = ProfileSession(os.environ[ENV_RUN_DIR], window=os.environ.get(ENV_WINDOW, "5:3"),
                                 tokens_per_step=int(tokens) if tokens else None,
                                 nvml=os.environ.get(ENV_NVML, "1") == "1",
                                 with_stack="stack" in extras, profile_memory="memory" in extras,
                                 manifest={"command": json.loads(command)} if command else None)
        session.start()
    except UserInputError as e:
        print(f"mfuscope: not profiling: {e}", file=sys.stderr)
        _state["session"] = False
        return None
    for ddp in list(_state["ddp"]):
        session.comm.watch_ddp(ddp, now=True)
    _state["session"] = session
    return session


def _install_exit_hooks() -> None:
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        from .session import _reason
        _state["exit_reason"] = _reason(exc_type, exc)
        _close()
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    atexit.register(_close)


def _close() -> None:
    session = _state["session"]
    if session:
        session.close(ended_early=_state["exit_reason"])


def run_next_sitecustomize(our_file: str) -> None:
    """Run the sitecustomize that ours hides, if the environment has one."""
    ours = os.path.dirname(os.path.abspath(our_file))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != ours]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(our_file):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
