"""Measuring a run: MFU, memory, metric records."""

from gaudi3_scale.monitor.perf import mfu, peak_memory_bytes

__all__ = ["mfu", "peak_memory_bytes"]
