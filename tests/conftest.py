"""Shared fixtures.  Helpers live in :mod:`mfuscope.tests.helpers`."""
from __future__ import annotations

import os

import pytest


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
