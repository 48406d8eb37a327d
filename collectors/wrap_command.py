"""``mfuscope profile -- CMD``: run a training command with every rank profiled, no code change.

The run directory is checked here, once, before any rank starts.  The
command's processes get ``collectors/_site`` on ``PYTHONPATH`` (see
:mod:`.autowrap`) and the session settings in the environment.  With
``--nsys`` the command runs under ``nsys profile``, recording only the Kineto
window's steps (the session opens a CUDA profiler range there), and the
report is exported to SQLite for ``mfuscope analyze``.

Exit code: the command's own.  If it failed, or a rank never finished, the
manifest says the run ended early.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

from mfuscope import run_dir
from mfuscope.errors import UserInputError
from mfuscope.window import parse_window

from . import autowrap
from .session import ENV_PREPARED

SITE_DIR = Path(__file__).parent / "_site"
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def is_launcher(command: list[str]) -> bool:
    """True for torchrun and ``python -m torch.distributed.run`` style commands."""
    words = [os.path.basename(w) for w in command[:3]]
    return any(w in LAUNCHERS for w in words)


def run(command: list[str], out: Path, *, window: str | None = "5:3", force: bool = False,
        tokens_per_step: int | None = None, nvml: bool = True, nsys: bool = False, with_stack: bool = False,
        profile_memory: bool = False) -> int:
    if not command:
        raise UserInputError("no command to profile; e.g. mfuscope profile --out runs/a -- torchrun train.py")
    parse_window(window)
    nsys_exe = shutil.which("nsys") if nsys else None
    if nsys and nsys_exe is None:
        raise UserInputError("--nsys: nsys (Nsight Systems) is not on PATH")
    out = run_dir.prepare(out, force).resolve()
    env = dict(os.environ)
    env.update({
        autowrap.ENV_RUN_DIR: str(out), ENV_PREPARED: str(out), autowrap.ENV_WINDOW: window or "none",
        autowrap.ENV_NVML: "1" if nvml else "0", autowrap.ENV_COMMAND: json.dumps(command),
        autowrap.ENV_LAUNCHER: "1" if is_launcher(command) else "0",
        autowrap.ENV_TRACE_EXTRAS: ",".join(x for x, on in (("stack", with_stack), ("memory", profile_memory)) if on),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE_DIR), env.get("PYTHONPATH")])),
    })
    env.pop(autowrap.ENV_OWNER, None)
    if tokens_per_step:
        env[autowrap.ENV_TOKENS] = str(tokens_per_step)
    if nsys_exe:
        (out / "nsys").mkdir(exist_ok=True)
        env["MFUSCOPE_NSYS"] = "1"
        command = [nsys_exe, "profile", "--trace=cuda,nvtx,osrt", "--capture-range=cudaProfilerApi",
                   "--capture-range-end=stop", "--force-overwrite=true", "-o", str(out / "nsys" / "profile"), *command]

    try:
        proc = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        raise UserInputError(f"command not found: {command[0]}") from None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        rc = _wait(proc)
    finally:
        signal.signal(signal.SIGTERM, previous)

    if not run_dir.is_run_dir(out):
        raise UserInputError("the command ran, but no process started profiling: it must import torch and "
                             f"run a forward pass (command exit code {rc})", out)
    if rc != 0:
        run_dir.mark_ended_early(out, f"command exited with code {rc}")
    if nsys_exe and (out / "nsys" / "profile.nsys-rep").exists():
        subprocess.call([nsys_exe, "export", "--type", "sqlite", "--force-overwrite", "true",
                         "-o", str(out / "nsys" / "profile.sqlite"), str(out / "nsys" / "profile.nsys-rep")])
    return rc


def _wait(proc: subprocess.Popen) -> int:
    interrupts = 0
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the child got Ctrl-C too: let it write its files; twice kills it
            interrupts += 1
            if interrupts > 1:
                proc.kill()
