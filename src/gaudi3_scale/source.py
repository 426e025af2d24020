"""Which code is running: the git commit of the source tree the package was imported from, when it is a checkout.

The package version (`gaudi3_scale.__version__`) names a release; a run from a clone or an editable install is
told apart only by its commit. Recorded with every benchmark result (`monitor.environment`) and every checkpoint
(`checkpoint.manifest`), so a result or a checkpoint says which code made it. No torch import here.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

__all__ = ["git_commit", "git_dirty", "source_revision"]


def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_commit() -> str | None:
    """The commit checked out where this package lives; None when it is not a git checkout of this package (a
    wheel, or an install inside another project's repository, whose commit says nothing of this code) or git is
    missing."""
    tracked = _git("ls-files", "--error-unmatch", Path(__file__).name)  # this file is in the checkout's tree
    if tracked is None or tracked.returncode != 0:
        return None
    out = _git("rev-parse", "HEAD")
    return (out.stdout.strip() or None) if out and out.returncode == 0 else None


def git_dirty() -> bool | None:
    """Whether the tree had uncommitted changes to tracked files (a result measured then ran code that its
    `git_commit` does not hold); None when git could not tell (not a checkout, no git)."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    if out is None or out.returncode != 0:
        return None
    return bool(out.stdout.strip())


@functools.cache
def source_revision() -> str | None:
    """`git_commit`, with `+dirty` when tracked files had uncommitted changes; None outside a checkout. Asked once
    per process (the code does not change under a running process)."""
    commit = git_commit()
    if commit is None:
        return None
    return commit + ("+dirty" if git_dirty() else "")
