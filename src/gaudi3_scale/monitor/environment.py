"""What a measurement ran on: hardware, software versions, git commit. Saved with every benchmark result."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.device.select import cpu_model_name

__all__ = ["environment_info"]

_PACKAGES = ("gaudi3-scale", "torch", "lightning", "numpy", "tokenizers", "torchao", "triton", "deepspeed")


def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def _git_commit() -> str | None:
    out = _git("rev-parse", "HEAD")
    return (out.stdout.strip() or None) if out else None


def _git_dirty() -> bool | None:
    """Whether the tree had uncommitted changes to tracked files (a result measured then ran code that its
    `git_commit` does not hold); None when git could not tell (not a checkout, no git)."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    if out is None or out.returncode != 0:
        return None
    return bool(out.stdout.strip())


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def environment_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "packages": _versions(),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        info["cuda"] = {
            "device": torch.cuda.get_device_name(),
            "count": torch.cuda.device_count(),
            "runtime": torch.version.cuda,
        }
    return info
