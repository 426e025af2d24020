"""The resource monitor: this host's CPU and memory now (psutil) and each run's Prometheus endpoints."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psutil

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.dashboard.files import OutsideRuns, real_file

__all__ = ["host_snapshot", "metrics_endpoints"]


def host_snapshot() -> dict[str, Any]:
    """CPU utilisation since the previous call (psutil's non-blocking form: the first call reads 0) and memory."""
    memory = psutil.virtual_memory()
    return {
        "time_unix": time.time(),
        "cpu_percent": psutil.cpu_percent(interval=None),
        "cpu_count": psutil.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory_total_bytes": memory.total,
        "memory_used_bytes": memory.total - memory.available,
        "memory_available_bytes": memory.available,
        "memory_percent": memory.percent,
    }


def _urls(data: Any) -> list[str]:
    """The http(s) URLs in an endpoints file: a URL, a {"url": …}, or a list / mapping of those."""
    if isinstance(data, str):
        return [data] if data.startswith(("http://", "https://")) else []
    if isinstance(data, dict):
        if "url" in data:
            return _urls(data["url"])
        if "host" in data and "port" in data:
            return [f"http://{data['host']}:{data['port']}/metrics"]
        return [u for value in data.values() for u in _urls(value)]
    if isinstance(data, list):
        return [u for value in data for u in _urls(value)]
    return []


def metrics_endpoints(root: Path, run_dir: Path) -> list[str]:
    """Prometheus /metrics URLs a run's exporter wrote down (`metrics_endpoints.json` or
    `metrics_endpoints/rank-*.json`); unreadable files, and links out of the runs directory `root`, are skipped
    (the exporter may be writing them)."""
    files = [*sorted((run_dir / "metrics_endpoints").glob("rank-*.json")), run_dir / "metrics_endpoints.json"]
    urls: list[str] = []
    for path in files:
        try:
            real = real_file(root, path)
            urls += _urls(load_json_file(real, what="endpoint file", expect=None)) if real is not None else []
        except (OSError, ValueError, UserInputError, OutsideRuns):
            continue
    return list(dict.fromkeys(urls))
