"""The one way the dashboard reaches a file: its real path (every symlink resolved) must lie inside the runs directory.

Run directories are written by training jobs and by anyone who may write there. A symlink planted in one
(`runs/x/config.yaml → /etc/…`, a `checkpoints/` or `cells/` linked elsewhere) must not turn the dashboard into a
reader of the rest of the machine: whatever resolves outside the runs directory is never opened, stat'ed for a
page or hashed; the view says so instead (`OutsideRuns`'s message). Links that stay inside are followed.

Callers open the *resolved* path, so a link swapped for another between the check and the read is not followed
at its last component.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["OutsideRuns", "first_escape", "has_file", "real_file", "real_path"]


class OutsideRuns(Exception):
    """A path whose real location is outside the runs directory (a symlink out of it): never read."""

    def __init__(self, shown: str) -> None:
        super().__init__(f"{shown} links outside the runs directory; not read")


def _shown(root: Path, path: Path) -> str:
    """`path` as the views name it: relative to the runs directory (it was built from it), else its name."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def real_path(root: Path, path: Path) -> Path | None:
    """`path` with every symlink resolved, or None when it does not exist (or is a symlink loop).

    `root` is the resolved runs directory; `OutsideRuns` when the real path is not inside it."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, a dangling link, a loop (RuntimeError before Python 3.13)
        return None
    if not real.is_relative_to(root):
        raise OutsideRuns(_shown(root, path))
    return real


def real_file(root: Path, path: Path) -> Path | None:
    """The real path of a regular file inside `root`; None when there is none; `OutsideRuns` as `real_path`."""
    real = real_path(root, path)
    return real if real is not None and real.is_file() else None


def has_file(root: Path, path: Path) -> bool:
    """Whether `path` is a regular file inside `root` (a link out of it counts as no file)."""
    try:
        return real_file(root, path) is not None
    except OutsideRuns:
        return False


def first_escape(root: Path, directory: Path) -> OutsideRuns | None:
    """The first entry of the tree at `directory` (itself included, walked without following links) whose real path
    is outside `root`, as the error to show; None when the whole tree stays inside."""
    try:
        real_path(root, directory)
        for parent, dirs, files in os.walk(directory):
            dirs.sort()  # walked in name order: the same entry is named every time
            for name in sorted([*dirs, *files]):
                entry = Path(parent) / name
                if entry.is_symlink():
                    real_path(root, entry)
    except OutsideRuns as exc:
        return exc
    return None
