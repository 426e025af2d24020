#!/usr/bin/env python3
"""Quick start: set up `.venv` (idempotent) and run the main job or the test suite.

    python3 run.py train [gaudi3 train options]   # train shakespeare-char on the bundled corpus, print a sample
    python3 run.py test  [pytest options]         # ruff, mypy, then the whole pytest suite (2 workers)
    python3 run.py docs  [--generate]             # build the documentation site into site/ (mkdocs --strict);
                                                  # --generate first rewrites the generated reference pages

Needs only Python >= 3.11 with pip and venv. The install is skipped when pyproject.toml and the pinned
constraints are unchanged since the last one (a stamp file in .venv records their hash). transformers, the tests'
reference for Hugging Face checkpoints, goes to .venv/oracles, on the path of the test process and of the commands
that load such checkpoints only: gaudi3-scale never imports it, and Lightning's torchmetrics imports it wherever it is
installed: 1.0 s of each of the suite's ~330 training processes (2026-11-29). `test` also sets up
`.venv-tools` (checkov, pinned in requirements/tools.txt) the same way: a venv of its own, because its pins clash
with ours.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".gaudi3-install"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
# tests/conftest.py puts ORACLES on sys.path, and `oracles_env` on the PYTHONPATH of a subprocess that needs it
ORACLES = VENV / "oracles"
ORACLE_PINS = ("transformers",)  # each installed at its version in requirements/constraints.txt
TOOLS = ROOT / ".venv-tools"  # the tests find checkov at .venv-tools/bin/checkov (tests/conftest.py)
TOOLS_PINS = ROOT / "requirements/tools.txt"
EXTRAS = "test,deepspeed,docs"  # part of the install fingerprint: another set of extras installs again


def _install_fingerprint(*files: str, extras: str = "") -> str:
    h = hashlib.sha256(sys.version.encode() + extras.encode())
    for rel in files:
        h.update((ROOT / rel).read_bytes())
    return h.hexdigest()


def ensure_venv() -> Path:
    python = BIN / "python"
    fingerprint = _install_fingerprint("pyproject.toml", "requirements/constraints.txt", extras=EXTRAS)
    if python.exists() and STAMP.is_file() and STAMP.read_text().strip() == fingerprint:
        return python
    if not python.exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print("installing gaudi3-scale and its pinned dependencies (first run only)", flush=True)
    _pip_install(python, "-e", f"{ROOT}[{EXTRAS}]")
    # transformers alone: its dependencies are in the `test` extra, so in .venv already
    _pip_install(python, "--no-deps", "--upgrade", "--target", str(ORACLES), *ORACLE_PINS)
    STAMP.write_text(fingerprint + "\n")
    return python


def _pip_install(python: Path, *args: str) -> None:
    """`pip install` into `python`'s environment, at the versions requirements/constraints.txt pins."""
    constraints = str(ROOT / "requirements/constraints.txt")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c", constraints, *args], check=True)


def ensure_tools() -> None:
    """`.venv-tools` with requirements/tools.txt, skipped when that file is unchanged since the last install."""
    python = TOOLS / ("Scripts" if os.name == "nt" else "bin") / "python"
    stamp = TOOLS / ".gaudi3-install"
    fingerprint = _install_fingerprint(str(TOOLS_PINS.relative_to(ROOT)))
    if python.exists() and stamp.is_file() and stamp.read_text().strip() == fingerprint:
        return
    if not python.exists():
        print(f"creating the tools' virtual environment in {TOOLS}", flush=True)
        venv.EnvBuilder(with_pip=True).create(TOOLS)
    print("installing the test tools (checkov) and their pinned dependencies", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(TOOLS_PINS)], check=True)
    stamp.write_text(fingerprint + "\n")


def precompile(python: Path) -> None:
    """Byte-compile our own sources once, here: every `gaudi3` process the suite starts (~680) would otherwise
    compile the ~180 modules it imports again whenever PYTHONDONTWRITEBYTECODE is set, as it is on our CI machine
    (pip compiled the installed packages already). Python reads a cached file even then; it only stops writing."""
    _run([str(python), "-m", "compileall", "-q", "-j", "0", "src", "tests", "benchmarks"])


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=ROOT).returncode
    if code:
        sys.exit(code)


def docs(python: Path, rest: list[str]) -> None:
    """The site into site/: `mkdocs build --strict` (a warning, e.g. a broken link, fails it)."""
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # mkdocs-material's end-of-life banner, once per build
    if rest:
        _run([str(python), "-m", "gaudi3_scale.cli.reference", "--write"])
    _run([str(python), "-m", "mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site")])


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("train", "test", "docs"):
        sys.exit(__doc__)
    if argv[0] == "docs" and argv[1:] not in ([], ["--generate"]):
        sys.exit("usage: python3 run.py docs [--generate]")
    python = ensure_venv()
    verb, rest = argv[0], argv[1:]
    if verb == "train":
        os.execv(str(BIN / "gaudi3"), [str(BIN / "gaudi3"), "train", *rest])
    if verb == "docs":
        docs(python, rest)
        return
    ensure_tools()
    _run([str(BIN / "ruff"), "check", "src", "tests", "benchmarks", "run.py"])
    _run([str(BIN / "ruff"), "format", "--check", "src", "tests", "benchmarks", "run.py"])
    _run([str(BIN / "mypy")])
    precompile(python)
    # Two workers, each test file on one of them (its module-scoped fixtures then run once): 27 min -> 21-25 min
    # for the whole suite on 2 cores (2026-11-25). GAUDI3_TEST_WORKERS=0 runs in this process; `-n K` in the options wins.
    workers = os.environ.get("GAUDI3_TEST_WORKERS", "2")
    _run([str(python), "-m", "pytest", "-n", workers, "--dist", "loadfile", *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
