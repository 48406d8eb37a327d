"""JSON Schema validation of mfuscope's JSON contracts, with file-naming errors."""
from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mfuscope.errors import UserInputError

if TYPE_CHECKING:
    import jsonschema


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    import jsonschema  # 25 MB and a second of imports, only where a document is validated

    text = resources.files("mfuscope").joinpath("schemas", f"{name}.schema.json").read_text()
    return jsonschema.Draft202012Validator(json.loads(text))


def validate(name: str, obj: Any, path: str | Path | None = None) -> None:
    """Raise UserInputError naming ``path`` and the first schema violation."""
    errors = sorted(_validator(name).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise UserInputError(f"invalid {name}: at {where}: {e.message}", path)


def read_json(name: str, path: Path) -> dict:
    """Read and validate one of mfuscope's JSON files."""
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserInputError(f"no {path.name} here", path.parent) from None
    except (OSError, ValueError) as e:
        raise UserInputError(f"cannot read {name}: {e}", path) from None
    validate(name, obj, path)
    return obj
