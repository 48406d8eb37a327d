"""A built wheel (not the source tree) imports every subpackage."""
from __future__ import annotations

import subprocess
import sys
import zipfile

from mfuscope.tests.helpers import REPO

SUBPACKAGES = ["collectors", "analyzers", "optimizers", "optimizers.cost", "kernels", "dashboard",
               "reference_trainer", "benchmarks", "tests"]


def test_wheel_imports_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(REPO)], check=True)
    wheel = next((tmp_path / "dist").glob("mfuscope-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    assert "mfuscope/schemas/manifest.schema.json" in names
    assert "mfuscope/collectors/_site/sitecustomize.py" in names  # the no-code wrap needs it installed
    code = (
        "import sys, importlib; sys.path.insert(0, sys.argv[1]);"
        "import mfuscope; assert mfuscope.__file__.startswith(sys.argv[1]), mfuscope.__file__;"
        f"[importlib.import_module('mfuscope.' + m) for m in {SUBPACKAGES!r}];"
        "import mfuscope.analyzers.kineto_json, mfuscope.cli, mfuscope.optimizers.cost.memory,"
        " mfuscope.schema_check as s;"
        "s._validator('manifest'); s._validator('report');"
        "print(importlib.import_module('mfuscope.analyzers').__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(site)], check=True, capture_output=True, text=True,
                         cwd=tmp_path).stdout
    assert out.strip().startswith(str(site))


def test_the_kernels_folder_imported_by_its_own_name_is_the_package():
    """From a checkout's root ``import kernels`` finds the top-level folder (Hugging Face's
    transformers imports that name to look for its own ``kernels`` package): it must hand back
    ``mfuscope.kernels``, not a second copy that registers every custom op again."""
    code = ("import mfuscope.kernels, kernels, sys; assert kernels is mfuscope.kernels; "
            "assert not [m for m in sys.modules if m.startswith('kernels.')]")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
