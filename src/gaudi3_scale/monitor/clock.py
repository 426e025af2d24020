"""The clock every throughput number is read from: the device is synchronised before each reading.

Used by the run's step metrics (metrics.jsonl, summary.json, the terminal table, Prometheus, trackers), so also by
tuner trials and benchmark cells, which read those records, and by the benchmarks' plain-PyTorch loops. A reading
costs one device synchronise: take it at measurement boundaries (the end of a logging window, the end of warm-up,
before and after a pause), never per kernel.

The warm-up rule lives here too, so the summary, the benchmark cells and the tuner leave out the same steps.
"""

from __future__ import annotations

import time

import torch

from gaudi3_scale.device.sync import synchronize

__all__ = ["DeviceClock", "default_throughput_warmup_steps"]

# Steps left out of steady-state throughput when the run does not say: the first steps pay for allocator growth,
# thread-pool and kernel autotuning start-up (2 steps); with torch.compile step 1 also compiles forward and backward
# and steps 2-3 may recompile (e.g. once a shape turns dynamic) or warm up and record CUDA graphs (3 more).
EAGER_WARMUP_STEPS = 2
COMPILE_WARMUP_STEPS = 3


def default_throughput_warmup_steps(*, compile: bool) -> int:
    return EAGER_WARMUP_STEPS + (COMPILE_WARMUP_STEPS if compile else 0)


class DeviceClock:
    """`now()` = `time.perf_counter()` read after `device` finished everything queued so far."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()
