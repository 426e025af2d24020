"""The clock every throughput number is read from: a reading is taken after the device finished the work before it.

Used by the run's step metrics (metrics.jsonl, summary.json, the terminal table, Prometheus, trackers), so also by
tuner trials and benchmark cells, which read those records, and by the benchmarks' plain-PyTorch loops. Take
readings at measurement boundaries (the end of a logging window, the end of warm-up, before and after a pause),
never per kernel.

Two kinds of reading:
- `now()` synchronises the device, then reads `time.perf_counter()`.
- `mark()` records where the device's queue stands and returns `when()`, to be called later: it waits until the
  device has reached the mark and returns the `perf_counter` time at which it did. Where the device has timing
  events (CUDA) that time comes from the device's own timestamps, and marking costs no wait, so the queue never
  drains at a window boundary; elsewhere (CPU, Gaudi) `mark()` synchronises at once and `when()` returns that
  reading.

The warm-up rule lives here too, so the summary, the benchmark cells and the tuner leave out the same steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gaudi3_scale.device.sync import TimingEvent, record_timing_event, synchronize

__all__ = ["DeviceClock", "default_throughput_warmup_steps"]

# Steps left out of steady-state throughput when the run does not say: the first steps pay for allocator growth,
# thread-pool and kernel autotuning start-up (2 steps); with torch.compile step 1 also compiles forward and backward
# and steps 2-3 may recompile (e.g. once a shape turns dynamic) or warm up and record CUDA graphs (3 more).
EAGER_WARMUP_STEPS = 2
COMPILE_WARMUP_STEPS = 3


def default_throughput_warmup_steps(*, compile: bool) -> int:
    return EAGER_WARMUP_STEPS + (COMPILE_WARMUP_STEPS if compile else 0)


class DeviceClock:
    """`now()`: `time.perf_counter()` read after `device` finished everything queued so far; `mark()`: the same
    reading, resolved later (see the module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        # A timing event and the host time at which the device reached it, taken at the last `now()`: device
        # timestamps of later marks are offsets from it (re-taken at every `now()`, so clock drift cannot add up).
        self._reference: tuple[TimingEvent, float] | None = None

    def now(self) -> float:
        synchronize(self.device)
        event = record_timing_event(self.device)
        if event is None:
            return time.perf_counter()
        event.synchronize()  # the queue was empty: reached at once
        reading = time.perf_counter()
        self._reference = (event, reading)
        return reading

    def mark(self) -> Callable[[], float]:
        # Without timing events, or before the first `now()` has set the reference: a synchronised reading now.
        if self._reference is None or (event := record_timing_event(self.device)) is None:
            reading = self.now()
            return lambda: reading
        reference, reference_s = self._reference

        def when() -> float:
            event.synchronize()
            return reference_s + reference.elapsed_time(event) / 1e3

        return when
