"""The report.json contract: the schema-versioned result of analysis.

Readers (dashboard, ``mfuscope compare``, optimizers) read only this.  See
docs/report.md for every field; ``schemas/report.schema.json`` is the law.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mfuscope import __version__, atomic
from mfuscope.run_dir import now_iso
from mfuscope.schema_check import read_json, validate

SCHEMA_VERSION = 1


def new_report(source: str, files: list[str], summary: dict[str, Any], **sections: Any) -> dict[str, Any]:
    report = {
        "schema_version": SCHEMA_VERSION,
        "summary": summary,
        "breakdown": sections.pop("breakdown", None),
        "bubbles": sections.pop("bubbles", []),
        "comm": sections.pop("comm", []),
        "stragglers": sections.pop("stragglers", []),
        "kernels": sections.pop("kernels", []),
        "findings": sections.pop("findings", []),
        "provenance": {"mfuscope_version": __version__, "source": source, "created": now_iso(), "files": files},
    }
    report.update(sections)
    return report


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Validate and write strict JSON: a figure that came out undefined (0/0, inf) is written as
    null and its place listed in ``provenance.undefined``, never as the non-JSON ``NaN``."""
    path = Path(path)
    undefined: list[str] = []
    report = _finite(report, "", undefined)
    if undefined:
        report["provenance"]["undefined"] = undefined
    validate("report", report, path)
    atomic.write_json(path, report)
    return path


def _finite(value: Any, where: str, undefined: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        undefined.append(where or "/")
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{where}/{k}", undefined) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v, f"{where}/{i}", undefined) for i, v in enumerate(value)]
    return value


def read_report(path: str | Path) -> dict[str, Any]:
    return read_json("report", Path(path))
