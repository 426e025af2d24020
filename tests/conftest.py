"""Shared fixtures: an isolated cache directory so tests never touch ~/.cache; passive OpenMP waits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# libgomp (torch's OpenMP) keeps idle threads spinning between parallel regions unless OMP_WAIT_POLICY is PASSIVE.
# The suite runs 2 pytest workers on 2 cores, each often with a multi-threaded torch process of its own, and the
# spinning threads of one take the cores the other's need: two 100-step `gaudi3 train` runs side by side took 42 s
# each by default, 14-15 s each with PASSIVE (one alone: 13-17 s; this machine, 2026-11-26). The same kernels run in
# the same order, so no number a test checks changes. Set before anything loads torch, so it holds in this process
# and in every process a test starts; a value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# transformers, the reference the tests hold Hugging Face checkpoints against, is installed apart (run.py, ORACLES):
# on this process's path, and on a subprocess's only through `oracles_env`, so that the training processes the tests
# start import what a user's `pip install gaudi3-scale` has (torchmetrics imports transformers whenever it can).
ORACLES = Path(sys.prefix) / "oracles"
if ORACLES.is_dir() and str(ORACLES) not in sys.path:
    sys.path.append(str(ORACLES))


def oracles_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with .venv/oracles on PYTHONPATH: for a subprocess that imports transformers itself."""
    paths = [p for p in (env.get("PYTHONPATH"), str(ORACLES) if ORACLES.is_dir() else None) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)} if paths else dict(env)


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


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON (RFC 8259 has no NaN or Infinity)")


def strict_json_loads(text: str | bytes) -> Any:
    """JSON as a browser's JSON.parse reads it: NaN, Infinity and -Infinity are an error, not numbers."""
    return json.loads(text, parse_constant=_not_json)


def summary_table(stderr: str) -> dict[str, str]:
    """The rows of the run table `gaudi3 train` prints on stderr at the end (train.report.print_summary): label →
    value."""
    rows = [line.split("│") for line in stderr.splitlines() if line.count("│") == 3]
    return {row[1].strip(): row[2].strip() for row in rows}


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


# checkov lives in its own venv (its pins clash with ours); `python3 run.py test` creates it from
# requirements/tools.txt.
CHECKOV = Path(__file__).resolve().parents[1] / ".venv-tools" / "bin" / "checkov"
# No network: --skip-download keeps it off the Prisma Cloud platform, BC_SKIP_MAPPING off the policy-id mapping
# download, CKV_SKIP_PACKAGE_UPDATE_CHECK off PyPI's "newer version" check (made at import time).
CHECKOV_OFFLINE_ENV = {"BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "True"}


@pytest.fixture(scope="session")
def checkov() -> Callable[..., dict[str, Any]]:
    """Run checkov on a directory: `checkov(path, framework="terraform"|"kubernetes"|"dockerfile"|…)` → its JSON
    report (`results.failed_checks` / `skipped_checks` / `passed_checks`, each with `check_id`; `summary`). Fails
    when checkov could not parse a file or scanned nothing. Missing .venv-tools: skip (fail under CI)."""
    if not CHECKOV.exists():
        missing_system_tool(f"checkov is not installed at {CHECKOV} (`python3 run.py test` installs it)")

    def run(directory: Path, *, framework: str) -> dict[str, Any]:
        cmd = [str(CHECKOV), "--directory", str(directory), "--framework", framework, "--compact", "--quiet",
               "--skip-download", "-o", "json"]  # fmt: skip
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **CHECKOV_OFFLINE_ENV}
        )
        try:
            report = json.loads(done.stdout)
        except json.JSONDecodeError:
            pytest.fail(f"checkov printed no JSON (exit {done.returncode}): {done.stderr[-2000:]}")
        if not isinstance(report, dict) or "results" not in report:
            pytest.fail(f"checkov scanned nothing in {directory} with --framework {framework}: {report}")
        errors = report["results"].get("parsing_errors")
        assert not errors, f"checkov could not parse {errors}"
        return report

    return run
