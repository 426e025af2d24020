"""Shared fixtures: an isolated cache directory so tests never touch ~/.cache."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
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


CliResult = tuple[int, str, str]


def missing_system_tool(reason: str) -> None:
    """A system program a test needs is absent: skip saying so, or fail under GAUDI3_REQUIRE_SYSTEM_TOOLS=1 (CI,
    which installs them in .ci/run), so CI can never pass by skipping."""
    if os.environ.get("GAUDI3_REQUIRE_SYSTEM_TOOLS") == "1":
        pytest.fail(f"GAUDI3_REQUIRE_SYSTEM_TOOLS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def gaudi3_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `gaudi3 ARGS…` in this process: (exit code, stdout, stderr)."""
    from gaudi3_scale.cli.main import main

    def run(*args: str) -> CliResult:
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run
