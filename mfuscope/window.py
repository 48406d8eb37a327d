"""The profiled window's text form, ``START:STEPS``: which steps ``--window`` traces.

Read by the collectors (``mfuscope profile``, the profile session) and by ``mfuscope train``'s
up-front check, which runs before any rank imports torch.  Torch-free.
"""
from __future__ import annotations

from mfuscope.errors import UserInputError


def parse_window(text: str | None) -> tuple[int, int | None] | None:
    """"START:STEPS" -> (start, steps); "START:" -> (start, None), to the end of the run;
    "none"/"" -> None."""
    if text is None or str(text).strip().lower() in ("", "none", "off"):
        return None
    try:
        start_text, colon, count_text = str(text).partition(":")
        start = int(start_text)
        count = int(count_text) if count_text else (None if colon else 1)
    except ValueError:
        raise UserInputError(f"--window: cannot read {text!r}; write START:STEPS, e.g. 5:3 "
                             "(START: for every step from START on, none for no trace)") from None
    if start < 0 or (count is not None and count < 1):
        raise UserInputError(f"--window {text!r}: START must be >= 0 and STEPS >= 1")
    return start, count
