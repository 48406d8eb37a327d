"""Each thread's Python stack when a rank dies of a fatal signal, kept in the run directory.

A rank that dies in native code -- SIGSEGV or SIGBUS in a kernel, a collective library or the
allocator, SIGABRT from gloo's size check or a failed C++ assertion -- runs no Python handler and
flushes nothing; the launcher says only "Signal 11 received by PID".  While the collectors run,
Python's ``faulthandler`` writes every thread's stack at such a signal (SIGSEGV, SIGFPE, SIGABRT,
SIGBUS, SIGILL) to ``RUN/fatal/rank<N>.txt``, from inside the signal handler, before the process
dies; ``mfuscope hang RUN`` reads it (analyzers/hang.py).  A rank that ends normally removes its
empty file.  SIGKILL (the OOM killer) cannot be caught: its file stays empty.

Where faulthandler was already on (torch elastic's ``@record``, which torchtitan's main wears,
``python -X faulthandler``, ``PYTHONFAULTHANDLER``) it is turned on again for ``sys.stderr`` when the
collectors stop, where those send it; while they run, the stacks go to the run directory (faulthandler
writes to one file).
"""
from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import IO

from mfuscope import run_dir


def path(run: str | os.PathLike, rank: int) -> Path:
    return Path(run) / run_dir.FATAL / f"rank{rank}.txt"


class FatalStacks:
    def __init__(self, run: str | os.PathLike, rank: int):
        self.path = path(run, rank)
        self._file: IO[str] | None = None
        self._was_enabled = False

    def install(self) -> None:
        """Send faulthandler's output to this rank's file."""
        self._was_enabled = faulthandler.is_enabled()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")  # noqa: SIM115 -- must stay open until the rank ends
        faulthandler.enable(file=self._file, all_threads=True)

    def uninstall(self) -> None:
        if self._file is None:
            return
        faulthandler.disable()
        if self._was_enabled:
            faulthandler.enable(all_threads=True)
        self._file.close()
        self._file = None
        if self.path.stat().st_size == 0:  # nothing fatal happened
            self.path.unlink()
            try:
                self.path.parent.rmdir()
            except OSError:  # another rank's file is still there
                pass
