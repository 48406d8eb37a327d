"""Shared fixtures.  Helpers live in :mod:`mfuscope.tests.helpers`."""
from __future__ import annotations

import os

import pytest

# The Triton kernels run through Triton's interpreter on a machine without a GPU.  Set before
# anything imports mfuscope.kernels: the kernels are built as interpreted or compiled at import.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests never read or write the user's real cache."""
    old = os.environ.get("MFUSCOPE_CACHE_DIR")
    os.environ["MFUSCOPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("mfuscope-cache"))
    yield
    if old is None:
        os.environ.pop("MFUSCOPE_CACHE_DIR", None)
    else:
        os.environ["MFUSCOPE_CACHE_DIR"] = old
