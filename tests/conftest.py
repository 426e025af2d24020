"""Shared fixtures: an isolated cache directory so tests never touch ~/.cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Session scope, so module-scoped fixtures (which are set up before function-scoped ones) see it too.
    cache = tmp_path_factory.getbasetemp() / "gaudi3-cache"
    previous = os.environ.get("GAUDI3_CACHE")
    os.environ["GAUDI3_CACHE"] = str(cache)
    yield cache
    if previous is None:
        del os.environ["GAUDI3_CACHE"]
    else:
        os.environ["GAUDI3_CACHE"] = previous
