"""What a measurement ran on: hardware, software versions, git commit. Saved with every benchmark result."""

from __future__ import annotations

import os
import platform
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from gaudi3_scale.device.select import cpu_model_name
from gaudi3_scale.source import git_commit, git_dirty

__all__ = ["environment_info"]

_PACKAGES = ("gaudi3-scale", "torch", "lightning", "numpy", "tokenizers", "torchao", "triton", "deepspeed")


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
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        info["cuda"] = {
            "device": torch.cuda.get_device_name(),
            "count": torch.cuda.device_count(),
            "runtime": torch.version.cuda,
        }
    return info
