"""Measuring a run: MFU, memory, the environment, the Prometheus endpoint and experiment trackers.

`mfu` and `peak_memory_bytes` load on first access (they need torch), so the `monitor` config section resolves
without it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gaudi3_scale.monitor.perf import mfu, peak_memory_bytes

__all__ = ["mfu", "peak_memory_bytes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gaudi3_scale.monitor import perf

        return getattr(perf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
