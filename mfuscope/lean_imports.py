"""Imports kept lean in mfuscope's own processes (the CLI, the reference trainer's ranks).

jsonschema imports ``rfc3987_syntax`` at import time when it is installed (to check the
``iri`` format), and that compiles a grammar: 1.4 s of CPU in every process that validates
mfuscope's JSON -- every rank of every run.  No schema of mfuscope's uses a format (its
validators check none).  So its own entry points import jsonschema with that module held
out; a user's process that imports mfuscope as a library is left as it is.
"""
from __future__ import annotations

import sys


def jsonschema_without_iri() -> None:
    """Import jsonschema without ``rfc3987_syntax`` (no ``iri`` format checks in this process),
    unless either is imported already."""
    if "jsonschema" in sys.modules or "rfc3987_syntax" in sys.modules:
        return
    sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]  (importing it raises ImportError)
    try:
        import jsonschema  # noqa: F401
    finally:
        del sys.modules["rfc3987_syntax"]
