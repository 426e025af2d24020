"""Measuring a run: MFU, memory, the environment, the Prometheus endpoint and experiment trackers.

`mfu` and `peak_memory_bytes` load on first access (they need torch), so the `monitor` config section resolves
without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.lazy import lazy_exports

if TYPE_CHECKING:
    from gaudi3_scale.monitor.perf import mfu, peak_memory_bytes

__all__ = ["mfu", "peak_memory_bytes"]

_LAZY = {"mfu": "gaudi3_scale.monitor.perf", "peak_memory_bytes": "gaudi3_scale.monitor.perf"}

__getattr__ = lazy_exports(__name__, _LAZY)
