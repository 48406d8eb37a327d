"""``make lint`` bites: the import contracts and ruff's rules fail on a deliberate violation.

import-linter reads the tree ``make lint-tree`` builds (links with the installed layout, since it
cannot follow pyproject's package-dir mapping); each test here builds that tree in ``tmp_path``,
swaps one linked folder for a copy with one bad module in it, and runs ``lint-imports`` on it.
Seconds in all: no test imports torch, the graph is built by grimp's Rust core.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = REPO / "pyproject.toml"
BIN = Path(sys.executable).parent
LAYERS = "Layers: nothing below imports anything above"
TORCH_FREE = "The analysis side never imports torch, triton or pynvml"


def _contracts() -> dict[str, dict]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _lint_tree(dest: Path) -> Path:
    """``make lint-tree`` into ``dest``; returns the ``mfuscope`` folder of the tree."""
    subprocess.run(["make", "-s", "--no-print-directory", "lint-tree", f"LINT_TREE={dest}"], cwd=REPO, check=True,
                   timeout=60)
    return dest / "mfuscope"


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` as ``make lint`` runs it: in the tree, with the repository's contracts."""
    return subprocess.run([str(BIN / "lint-imports"), "--no-logo", "--no-cache", str(PYPROJECT)], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                          timeout=120)


def _with_module(pkg: Path, folder: str, name: str, source: str) -> None:
    """Replace the tree's link ``pkg/folder`` with a copy of the folder holding one more module."""
    target = (pkg / folder).resolve()
    (pkg / folder).unlink()
    shutil.copytree(target, pkg / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / folder / name).write_text(source)


def test_tree_links_every_mapped_folder(tmp_path):
    pkg = _lint_tree(tmp_path / "tree")
    mapping = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    folders = {name.split(".")[1] for name, path in mapping.items() if name.count(".") == 1 and "/" not in path}
    assert folders and all((pkg / f).is_symlink() and (pkg / f).resolve() == REPO / f for f in folders)
    assert (pkg / "__init__.py").resolve() == REPO / "mfuscope" / "__init__.py"


def test_torch_free_contract_names_every_core_module():
    """The core layer (bottom of "layers") and the torch-free contract's sources list the same core."""
    contracts = _contracts()
    core = {f"mfuscope.{m.strip()}" for m in contracts["layers"]["layers"][-1].split(":")}
    sources = set(contracts["torch-free"]["source_modules"])
    assert core - sources == set(), "add these core modules to the torch-free contract's source_modules"
    assert {"mfuscope.analyzers", "mfuscope.optimizers", "mfuscope.regression", "mfuscope.dashboard"} <= sources


def test_real_tree_keeps_the_contracts(tmp_path):
    result = _lint_imports(_lint_tree(tmp_path / "tree").parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{LAYERS} KEPT" in result.stdout and f"{TORCH_FREE} KEPT" in result.stdout


@pytest.mark.parametrize("folder, source, contract, message", [
    ("analyzers", "import torch\n", TORCH_FREE, "mfuscope.analyzers is not allowed to import torch"),
    # indirectly too: the dashboard reaching triton through the kernels
    ("dashboard", "from mfuscope.kernels import rms_norm\n", TORCH_FREE,
     "mfuscope.dashboard is not allowed to import triton"),
    ("collectors", "from mfuscope.dashboard import app\n", LAYERS,
     "mfuscope.collectors is not allowed to import mfuscope.dashboard"),
    ("analyzers", "from mfuscope.collectors import session\n", LAYERS,
     "mfuscope.analyzers is not allowed to import mfuscope.collectors"),
], ids=["analyzers-torch", "dashboard-triton-indirect", "collectors-up-to-dashboard", "analyzers-to-collectors"])
def test_contract_breaks_on_an_injected_import(tmp_path, folder, source, contract, message):
    pkg = _lint_tree(tmp_path / "tree")
    _with_module(pkg, folder, "_layering_probe.py", source)
    result = _lint_imports(pkg.parent)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout, result.stdout + result.stderr
    assert message in result.stdout and f"mfuscope.{folder}._layering_probe" in result.stdout


def test_new_core_module_must_be_given_a_layer(tmp_path):
    pkg = _lint_tree(tmp_path / "tree")
    (pkg / "unplaced.py").write_text("")
    result = _lint_imports(pkg.parent)
    assert result.returncode != 0 and "mfuscope.unplaced" in result.stdout + result.stderr


def _ruff(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ruff"), "check", "--no-cache", "--config", str(PYPROJECT),
                           "--output-format", "concise", str(path)], capture_output=True, text=True, timeout=60)


def test_ruff_fails_a_bad_snippet_under_the_repo_config(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\nfrom typing import Optional\n\n\n"
                   "def f(x: Optional[int], acc=[]) -> str:\n"
                   f"    return {'x' * 121!r}\n")
    result = _ruff(bad)
    assert result.returncode == 1
    for code in ("I001", "F401", "UP045", "B006", "E501"):
        assert code in result.stdout, (code, result.stdout)


def test_ruff_line_length_is_120(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text(f"X = {'x' * 114!r}\n")  # 120 columns
    assert len(ok.read_text().splitlines()[0]) == 120
    result = _ruff(ok)
    assert result.returncode == 0, result.stdout
    ok.write_text(f"X = {'x' * 115!r}\n")
    assert "E501" in _ruff(ok).stdout
