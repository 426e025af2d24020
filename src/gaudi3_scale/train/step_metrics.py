"""What a run measures at every optimizer step: `RunMetrics` (records → metrics.jsonl and listeners) and the
terminal progress bar. Both only read training state.

Both read the step contract (`train.step.StepState`): an optimizer step ends with the last micro-batch of its
accumulation group (`StepState.at_boundary`), and the step's loss, gradient norm and learning rate are there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gaudi3_scale.monitor.clock import DeviceClock
from gaudi3_scale.monitor.perf import mfu, peak_memory_bytes
from gaudi3_scale.train.step import StepState, at_step_boundary

__all__ = ["RichStepProgress", "RunMetrics"]


def _batch_size(batch: Any) -> int | None:
    """Sequences in a micro-batch: the first dimension of its first tensor (tuple, list or dict batches)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple) and batch:
        return _batch_size(batch[0])
    return None  # a batch type we cannot count: samples/s is unknown


class RunMetrics(pl.Callback):
    """Step time, tokens/s, MFU, loss, lr and peak memory → `metrics.jsonl` every `log_every_steps` steps.

    train_loss is the mean over the steps since the previous record (as Lightning's epoch-level logging does),
    not the last step's noisy value.

    Time is read from a `DeviceClock`: the device is synchronised at every reading, so on an accelerator a window
    measures finished work, not kernel launches. Readings are taken only at boundaries — the end of a logging
    window, the end of the warm-up, and around pauses (validation, checkpoint saves), whose time is left out — so
    the steps in between stay asynchronous. tokens/s in a record is its window's (raw: the first window includes
    warm-up and compilation); `steady_state()` is over the steps after the first `warmup_steps` of this process.

    samples/s counts the sequences of this rank's micro-batches times the world size (ranks get equal batches).

    data_wait_s is the mean host time per step this rank spent between the end of one micro-batch and the start of
    the next: mostly the data loader's `next()`, plus the other callbacks' per-batch hooks; validation and
    checkpoint saves (paused time) are not counted.

    `listeners` are called with every record (train and validation) on every rank, e.g. the Prometheus exporter.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        log_every_steps: int,
        state: StepState,
        peak_flops_per_device: float | None,
        warmup_steps: int = 0,
    ) -> None:
        self.path = path
        self.log_every_steps = log_every_steps
        self.state = state  # the step contract: what the step produced, tokens per step, FLOPs per token
        self.tokens_per_step = state.tokens_per_step
        self.flops_per_token = state.flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self.warmup_steps = warmup_steps  # first steps of this process left out of steady_state()
        self.latest: dict[str, Any] = {}
        self.sources: list[Callable[[], dict[str, Any]]] = []  # more fields for every record (e.g. uploads)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # called with every record, on every rank
        self.history: list[dict[str, Any]] = []
        self._is_writer = False
        self._loss_sum: Any = None
        self._clock: DeviceClock | None = None
        self._mark = 0.0  # the last clock reading
        self._paused_since_mark = 0.0
        self._pause_start = 0.0
        self._paused_total_s = 0.0  # never reset: data-wait gaps subtract the pauses inside them
        self._session_steps = 0  # optimizer steps this process has run
        self._segment_steps = 0  # ... since the last reading
        self._window_s = 0.0
        self._window_steps = 0
        self._batch_end: float | None = None
        self._paused_at_batch_end = 0.0
        self._window_wait_s = 0.0
        self._window_samples: int | None = 0
        self.warmup_s = 0.0  # active time of the warm-up steps (compilation included)
        self.warmup_steps_done = 0
        self.train_s = 0.0  # active time of the measured steps after warm-up
        self.train_steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._is_writer = self.path is not None and trainer.is_global_zero
        if self._is_writer:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = DeviceClock(pl_module.device)
        self._mark = self._clock.now()

    def _now(self) -> float:
        assert self._clock is not None, "on_train_start() starts the clock"
        return self._clock.now()

    def _read(self) -> float:
        """Active (unpaused) seconds since the previous reading, booked to the warm-up or to the measured steps.

        A reading is taken at the end of the warm-up, so a segment never straddles it.
        """
        now = self._now()
        active = max(0.0, now - self._mark - self._paused_since_mark)
        self._mark, self._paused_since_mark = now, 0.0
        if self._session_steps <= self.warmup_steps:
            self.warmup_s += active
            self.warmup_steps_done += self._segment_steps
        else:
            self.train_s += active
            self.train_steps += self._segment_steps
        self._segment_steps = 0
        self._window_s += active
        return active

    def pause(self) -> None:
        """Stop the throughput clock (validation, checkpointing); `resume` restarts it. Both synchronise: the
        training work queued before the pause counts as training, the paused work does not."""
        self._pause_start = self._now()

    def resume(self) -> None:
        paused = self._now() - self._pause_start
        self._paused_since_mark += paused
        self._paused_total_s += paused

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is not None:  # not for a validation outside fit
            self.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is not None:
            self.resume()
        val = trainer.callback_metrics.get("val/loss")
        if val is None or trainer.sanity_checking:
            return
        record = {"step": trainer.global_step, "val_loss": float(val)}
        accuracy = trainer.callback_metrics.get("val/mlm_accuracy")  # arch bert
        if accuracy is not None:
            record["val_mlm_accuracy"] = float(accuracy)
        self.latest["val_loss"] = record["val_loss"]
        self.latest["val_loss_step"] = record["step"]
        self._write(trainer, record)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_end is not None:
            gap = time.perf_counter() - self._batch_end - (self._paused_total_s - self._paused_at_batch_end)
            self._window_wait_s += max(0.0, gap)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        size = _batch_size(batch)
        self._window_samples = (
            None if size is None or self._window_samples is None else self._window_samples + size
        )
        if self.state.at_boundary:
            self._step_end(trainer, pl_module)
        self._batch_end, self._paused_at_batch_end = time.perf_counter(), self._paused_total_s

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._segment_steps:  # steps after the last record (a stop between records): book their time
            self._read()

    def _step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window_steps += 1
        self._segment_steps += 1
        self._session_steps += 1
        state = self.state
        loss = state.loss
        if loss is not None:  # summed on device: no host sync until the record is written
            self._loss_sum = loss if self._window_steps == 1 else self._loss_sum + loss
        if self._session_steps == self.warmup_steps:
            self._read()  # the end of the warm-up
        step = trainer.global_step
        if step % self.log_every_steps and step != trainer.max_steps:
            return
        if self._segment_steps:
            self._read()
        elapsed = self._window_s
        tokens_per_s = self.tokens_per_step * self._window_steps / elapsed if elapsed > 0 else 0.0
        grad_norm = state.grad_norm
        record: dict[str, Any] = {
            "step": step,
            "train_loss": self._global_mean_loss(trainer) if loss is not None else None,
            "lr": state.lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": self._samples_per_s(trainer.world_size, elapsed),
            "step_time_s": elapsed / self._window_steps,
            "data_wait_s": self._window_wait_s / self._window_steps,
            "window_steps": self._window_steps,  # the steps the means above are over
            "mfu": None,
        }
        record.update({name: float(value) for name, value in state.extra.items()})
        record.update(self._peak_memory(trainer, pl_module))
        for source in self.sources:
            record.update(source())
        if self.flops_per_token is not None:
            record["mfu"] = mfu(
                tokens_per_s, self.flops_per_token, self.peak_flops_per_device, trainer.world_size
            )
        self.latest.update(record)
        self._write(trainer, record)
        self._window_s, self._window_steps = 0.0, 0
        self._window_wait_s, self._window_samples = 0.0, 0

    def _samples_per_s(self, world_size: int, elapsed: float) -> float | None:
        if self._window_samples is None:
            return None
        return self._window_samples * world_size / elapsed if elapsed > 0 else 0.0

    def _peak_memory(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Peak memory of every rank (all-gathered: every rank reaches this at the same step) and their maximum."""
        mine = torch.tensor(
            [float(peak_memory_bytes(pl_module.device))], dtype=torch.float64, device=pl_module.device
        )
        gathered = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # The list form of all_gather: gloo and NCCL both have it (Lightning's wrapper warns on torch 2.13).
            gathered = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(gathered, mine)
        per_rank = [int(t.item()) for t in gathered]
        return {"peak_memory_bytes": max(per_rank), "peak_memory_bytes_per_rank": per_rank}

    def _global_mean_loss(self, trainer: pl.Trainer) -> float:
        """Mean over the window's steps and over all ranks (every rank reaches this at the same step)."""
        mean = self._loss_sum.detach().float() / self._window_steps
        return float(trainer.strategy.reduce(mean, reduce_op="mean"))

    def steady_state(self) -> dict[str, Any]:
        """Throughput over the measured steps of this process (after its first `warmup_steps`): `tokens_per_s`,
        `step_time_s` (consistent: tokens/s = tokens per step / step time), `measured_steps`, and the warm-up on
        its own (`warmup_steps`, `warmup_s`, compilation included).

        When this process ran no step past the warm-up (e.g. a resume close to the end), the warm-up steps are
        measured instead and `includes_warmup` says so; with no step at all the figures are None.
        """
        steps, seconds, includes_warmup = self.train_steps, self.train_s, False
        if not steps:
            steps, seconds, includes_warmup = self.warmup_steps_done, self.warmup_s, True
        step_time_s = seconds / steps if steps and seconds > 0 else None
        return {
            "tokens_per_s": self.tokens_per_step / step_time_s if step_time_s else None,
            "step_time_s": step_time_s,
            "measured_steps": steps,
            "warmup_steps": self.warmup_steps_done,
            "warmup_s": self.warmup_s,
            "includes_warmup": includes_warmup and steps > 0,
        }

    def _write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        self.history.append(record)
        for listener in self.listeners:
            listener(record)
        if self._is_writer and self.path is not None:
            # Opened per record (every log_every_steps): survives a crash, and the final validation after fit.
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


class RichStepProgress(pl.Callback):
    """One progress bar over optimizer steps with loss, tokens/s and ETA (rank 0 only)."""

    def __init__(self, metrics: RunMetrics, *, console: Console | None = None) -> None:
        self.metrics = metrics
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
            # Each redraw renders the whole bar (~0.7 ms of CPU, holding the GIL) on rich's refresh thread; at its
            # default 10 Hz that is ~0.7 % of a core taken from training. The numbers change every log_every_steps.
            refresh_per_second=2,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=trainer.max_steps, completed=trainer.global_step, loss="-", tps="-"
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._progress is None or not at_step_boundary(pl_module):
            return
        latest = self.metrics.latest
        fields: dict[str, Any] = {}
        if "train_loss" in latest and latest["train_loss"] is not None:
            fields = {"loss": f"{latest['train_loss']:.4f}", "tps": f"{latest['tokens_per_s']:,.0f}"}
        self._progress.update(self._task, completed=trainer.global_step, **fields)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
