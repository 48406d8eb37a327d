"""Errors that are the user's to fix, not bugs.

The CLI turns a :class:`UserInputError` into one line on stderr naming the
file and the problem, and exit code 2, with no traceback.  Anything else that
escapes is a bug in mfuscope and keeps its traceback.
"""
from __future__ import annotations

import os


class UserInputError(Exception):
    """Bad input (a file, a flag, a directory): one clear line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.message = message
        self.path = os.fspath(path) if path is not None else None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message
