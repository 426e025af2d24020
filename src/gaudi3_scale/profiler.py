"""`from gaudi3_scale.profiler import GaudiProfiler` (the public name): the profiler lives in `monitor.profiler`."""

from gaudi3_scale.monitor.profiler import ACTIVITIES, GaudiProfiler

__all__ = ["ACTIVITIES", "GaudiProfiler"]
