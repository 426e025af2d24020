"""A fake asynchronous device for CPU tests of the measurement boundaries.

Work "launched" on it runs on a worker thread, one item after another, as kernels run on a CUDA stream; only
`synchronize` waits for it, as `torch.cuda.synchronize` does. Registered as the synchronizer of the `cpu` device
type, it makes a CPU run behave like an accelerator run: a clock read without a synchronise sees only the host's
time, and reads a throughput the device never reached.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch


class FakeAsyncDevice:
    def __init__(self) -> None:
        self._work: queue.Queue[float] = queue.Queue()
        self._done = threading.Condition()
        self._launched = 0
        self._finished_at: list[float] = []  # perf_counter time at which each launched item finished
        self.syncs = 0
        threading.Thread(target=self._run, daemon=True, name="fake-device").start()

    def _run(self) -> None:
        while True:
            seconds = self._work.get()
            time.sleep(seconds)
            with self._done:
                self._finished_at.append(time.perf_counter())
                self._done.notify_all()
            self._work.task_done()

    def launch(self, seconds: float) -> None:
        """Queue `seconds` of device work; returns at once."""
        self._launched += 1
        self._work.put(seconds)

    def synchronize(self, device: torch.device | None = None) -> None:
        self.syncs += 1
        self._work.join()

    def record_event(self, device: torch.device | None = None) -> FakeEvent:
        """A timing event after the work launched so far (as `torch.cuda.Event(enable_timing=True).record()`)."""
        return FakeEvent(self, self._launched, time.perf_counter())


class FakeEvent:
    def __init__(self, device: FakeAsyncDevice, after: int, recorded_at: float) -> None:
        self.device, self.after, self.recorded_at = device, after, recorded_at

    def synchronize(self) -> None:
        with self.device._done:
            self.device._done.wait_for(lambda: len(self.device._finished_at) >= self.after)

    def reached_at(self) -> float:
        """When the device got to this event: after the work before it, and not before it was recorded."""
        finished = self.device._finished_at[self.after - 1] if self.after else 0.0
        return max(self.recorded_at, finished)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        return (end_event.reached_at() - self.reached_at()) * 1e3


class LaunchPerStep(pl.Callback):
    """Queues `seconds_per_micro_batch(pl_module)` of fake device work in every training micro-batch (after its
    backward, inside the training step, where a real step queues its kernels); a validation reads its loss back,
    which (as `.item()` on a device tensor) waits for the device."""

    def __init__(self, device: FakeAsyncDevice, seconds_per_micro_batch: Callable[[Any], float]) -> None:
        self.device = device
        self.seconds = seconds_per_micro_batch

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device.launch(self.seconds(pl_module))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device.synchronize()
