"""Atomic file writes: a reader sees the old file or the new one, never half.

Everything mfuscope writes (manifests, parquet tables, reports, caches) goes
through here, so a crash or Ctrl-C mid-write never destroys what the user had.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _write_via_temp(path: Path, write: Callable[[str], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    def _w(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    _write_via_temp(Path(path), _w)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    # Strict JSON (no NaN/Infinity, which JSON.parse and most readers reject): callers write null.
    text = json.dumps(obj, indent=2, sort_keys=False, default=_json_default, allow_nan=False) + "\n"
    write_bytes(path, text.encode())


def write_parquet(path: str | os.PathLike, table: Any, **options: Any) -> None:
    """Write a pyarrow Table as parquet (zstd unless ``options`` say otherwise) atomically."""
    import pyarrow.parquet as pq

    options.setdefault("compression", "zstd")
    _write_via_temp(Path(path), lambda tmp: pq.write_table(table, tmp, **options))


def _json_default(o: Any) -> Any:
    # numpy scalars and arrays appear in analysis results; JSON has no such types.
    if hasattr(o, "item") and callable(o.item) and getattr(o, "ndim", 1) == 0:
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
