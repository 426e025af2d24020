"""`gaudi3_scale.source`: the commit of the checkout the package runs from, recorded in every checkpoint's manifest
(`gaudi3-scale-commit`) and benchmark result. An install inside another project's repository (a .venv that project
ignores) is no checkout of this package: its commit would name the other project's code."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gaudi3_scale.source

GIT = shutil.which("git")


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "HOME": str(cwd)}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _commit_seen_by(module_dir: Path) -> str:
    code = "import source; print(source.git_commit())"
    return subprocess.run([sys.executable, "-c", code], cwd=module_dir, capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(module_dir)}).stdout.strip()  # fmt: skip


@pytest.mark.skipif(GIT is None, reason="git is not installed")
def test_the_commit_is_the_packages_own_checkouts_not_a_surrounding_repositorys(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / ".venv" / "site").mkdir(parents=True)
    _git(project, "init", "-q")
    (project / ".gitignore").write_text(".venv/\n")
    _git(project, "add", ".gitignore")
    _git(project, "commit", "-qm", "another project")
    installed = project / ".venv" / "site"
    shutil.copy(gaudi3_scale.source.__file__, installed / "source.py")
    assert _commit_seen_by(installed) == "None"  # was the other project's commit
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    _git(checkout, "init", "-q")
    shutil.copy(gaudi3_scale.source.__file__, checkout / "source.py")
    _git(checkout, "add", "source.py")
    _git(checkout, "commit", "-qm", "this package")
    assert _commit_seen_by(checkout) == _git(checkout, "rev-parse", "HEAD").strip()
