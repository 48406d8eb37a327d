"""Where the reference trainer's checkpoints lie, torch-free (``mfuscope train`` checks ``--resume``
before any rank starts): ``DIR/step_000005/`` committed saves with their ``mfuscope.json``, and
``DIR/step_000005.partial/`` saves that never finished (reference_trainer/checkpointing.py).
"""
from __future__ import annotations

from pathlib import Path

from mfuscope.errors import UserInputError

INFO = "mfuscope.json"
PARTIAL = ".partial"


def name(steps_done: int) -> str:
    return f"step_{steps_done:06d}"


def latest(path: str | Path) -> Path:
    """The save ``--resume`` takes: ``path`` itself when it is one, else its committed save with the
    most steps (``.partial`` folders are saves that never finished)."""
    path = Path(path)
    if (path / INFO).is_file() and not path.name.endswith(PARTIAL):
        return path
    saves = sorted(p for p in path.glob("step_*") if p.is_dir() and not p.name.endswith(PARTIAL)
                   and (p / INFO).is_file()) if path.is_dir() else []
    if not saves:
        partial = sorted(path.glob(f"step_*{PARTIAL}")) if path.is_dir() else []
        raise UserInputError("no complete checkpoint here" + (f" (only {partial[-1].name}, a save that did not "
                                                               "finish)" if partial else ""), path)
    return saves[-1]
