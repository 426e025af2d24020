"""What a run measures at every optimizer step: `RunMetrics` (records → metrics.jsonl and listeners; the terminal
progress bar, `train.progress`, shows its latest). It only reads training state; `train.after_step.AfterStep` calls it.

It reads the step contract (`train.step.StepState`): an optimizer step ends with the last micro-batch of its
accumulation group (`StepState.at_boundary`), and the step's loss, gradient norm and learning rate are there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from gaudi3_scale.config import strict_json
from gaudi3_scale.health.stragglers import StragglerDetector
from gaudi3_scale.monitor.clock import DeviceClock
from gaudi3_scale.monitor.perf import mfu, peak_memory_bytes
from gaudi3_scale.monitor.trackers import warn_on_stderr
from gaudi3_scale.train.step import StepState

__all__ = ["RunMetrics"]


def _batch_size(batch: Any) -> int | None:
    """Sequences in a micro-batch: the first dimension of its first tensor (tuple, list or dict batches)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple) and batch:
        return _batch_size(batch[0])
    return None  # a batch type we cannot count: samples/s is unknown


_BookedTo = Literal["warmup", "profiled", "measured"]


@dataclass(frozen=True)
class _Segment:
    """Optimizer steps that ended at a clock mark, and what their time is booked to: "warmup", "profiled" (run under
    the profiler) or "measured"."""

    when: Callable[[], float]
    steps: int
    booked_to: _BookedTo


@dataclass(frozen=True, kw_only=True)
class _Window:
    """A logging window that ended at `step`: what its record needs besides its time, the device values as host
    copies that are complete once the mark after them resolves."""

    step: int
    steps: int
    wait_s: float
    samples: int | None
    lr: float | None
    world_size: int
    values: dict[str, Any]
    per_rank: list[Any]  # by rank: [peak memory bytes, own compute seconds per step (< 0: not measured)]
    sourced: dict[str, Any]  # the `sources`' fields, read at the window's end (e.g. the cost up to `step`)


def _to_host(value: Any) -> Any:
    """A device scalar as a host tensor, copied without waiting (read it only after a later mark resolves);
    numbers and None as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "full_tensor"):  # a DTensor (FSDP2 gradient norm): the global value
        value = value.full_tensor()
    return value.detach().to("cpu", non_blocking=True)


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean over all ranks, as `strategy.reduce(value, "mean")` but without the barrier Lightning issues before
    its all-reduce: on NCCL a barrier holds the host until the device has run everything queued, once every
    logging window (what the window's queued copies avoid)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    world_size = torch.distributed.get_world_size()
    if world_size == 1:
        return value
    total = value.clone()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)  # gloo has no AVG
    return total / world_size


class RunMetrics:
    """Step time, tokens/s, MFU, loss, lr and peak memory → `metrics.jsonl` every `log_every_steps` steps.

    train_loss is the mean over the steps since the previous record (as Lightning's epoch-level logging does),
    not the last step's noisy value.

    Time is read from a `DeviceClock` at boundaries only — the end of a logging window, the end of the warm-up, and
    around pauses (validation, checkpoint saves), whose time is left out — so on an accelerator a window measures
    finished work, not kernel launches, and the steps in between stay asynchronous. Window ends and the end of the
    warm-up are *marks*, resolved one optimizer step later (or at the next pause, or the end of training): by then
    the device has the next step queued behind the mark, so it does not drain at a window boundary and wait for
    the host to write the record. The window's loss, gradient norm, extra metrics and peak memory are reduced
    across ranks and copied to the host at the mark, queued behind the step, and read once it resolves: a record
    is written one step after its window ends. tokens/s in a record is its window's (raw: the first window includes
    warm-up and compilation); `steady_state()` is over the steps after the first `warmup_steps` of this process,
    less the steps run under the profiler (`book_profiled`), which its overhead slows.

    samples/s counts the sequences of this rank's micro-batches times `data_parallel_size`, the ranks that read
    different batches (`distributed.plan.ParallelPlan.data_parallel_size`: the ranks of a tensor-parallel group read
    the same one), which get equal batches. MFU divides by every rank's device (the world size).

    data_wait_s is the mean host time per step this rank spent between the end of one micro-batch (its after-step
    work included) and the start of the next: the data loader's `next()` and Lightning's own bookkeeping;
    validation and checkpoint saves (paused time) are not counted.

    compute_s_per_rank is each rank's own compute per step in the window (`StepState.compute_s`: host time of its
    forwards), the median over the window's steps — a step the OS preempted, or a garbage-collector pause, does not
    make a rank slow; a rank slow on most steps is — gathered with the peak memory; `stragglers` names the ranks
    `health.stragglers` finds slow.

    `listeners` are called with every record (train and validation) on every rank, e.g. the Prometheus exporter,
    after the record is in metrics.jsonl; one that raises is `warn`ed about once and dropped (monitoring never
    stops training).

    With `started_s` set (the trainer's start on the `perf_counter` clock, the origin of summary.json's `wall_s`),
    a train record also says when its window ended: `wall_s` since that start and `time_unix`, the progress over
    time that the dashboard draws beside the run's forecast (plan.json).
    """

    def __init__(
        self,
        path: Path | None,
        *,
        log_every_steps: int,
        state: StepState,
        peak_flops_per_device: float | None,
        data_parallel_size: int,
        warmup_steps: int = 0,
        stragglers: StragglerDetector | None = None,
        warn: Callable[[str], None] = warn_on_stderr,
    ) -> None:
        self.path = path
        self.log_every_steps = log_every_steps
        self.state = state  # the step contract: what the step produced, tokens per step, FLOPs per token
        self.tokens_per_step = state.tokens_per_step
        self.flops_per_token = state.flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self.data_parallel_size = data_parallel_size  # ranks that read different batches (samples/s)
        self.warmup_steps = warmup_steps  # first steps of this process left out of steady_state()
        self.stragglers = stragglers  # names slow ranks from each window's compute_s_per_rank
        self.warn = warn  # a listener that fails: one line, on the rank it failed on
        self.latest: dict[str, Any] = {}
        self.sources: list[Callable[[], dict[str, Any]]] = []  # more fields for every record (e.g. uploads)
        self.started_s: float | None = None  # the trainer's start (perf_counter): records say when from it
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # called with every record, on every rank
        self._is_writer = False
        self._loss_sum: Any = None
        self._clock: DeviceClock | None = None
        self._pending: list[_Segment | _Window] = []  # marked, not yet resolved (in the order they were made)
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
        self._window_compute_s: list[float] = []  # this rank's own compute of each step in the window
        self.warmup_s = 0.0  # active time of the warm-up steps (compilation included)
        self.warmup_steps_done = 0
        self.train_s = 0.0  # active time of the measured steps after warm-up
        self.train_steps = 0
        self._profiled = False  # the steps now run under the profiler (`book_profiled`)
        self.profiled_steps = 0  # steps after warm-up run under the profiler

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._is_writer = self.path is not None and trainer.is_global_zero
        if self._is_writer:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = DeviceClock(pl_module.device)
        self._mark = self._clock.now()

    def _now(self) -> float:
        assert self._clock is not None, "start() starts the clock"
        return self._clock.now()

    def _end_segment(self, *, always: bool = False) -> None:
        """Mark the end of the steps since the last mark (`always`: even with none, to cover copies just queued)."""
        if self._segment_steps or always:
            assert self._clock is not None, "start() starts the clock"
            warmup = self._session_steps <= self.warmup_steps
            booked_to: _BookedTo = "warmup" if warmup else "profiled" if self._profiled else "measured"
            self._pending.append(_Segment(self._clock.mark(), self._segment_steps, booked_to))
            self._segment_steps = 0

    def _resolve(self) -> None:
        """Wait for the pending marks in order: book each segment's active (unpaused) time to the warm-up, the
        profiled or the measured steps, and write each window's record. The end of the warm-up and each start and
        end of profiling are marks of their own, so a segment never straddles them."""
        if not self._pending:  # most steps
            return
        pending, self._pending = self._pending, []
        for item in pending:
            if isinstance(item, _Window):
                self._write_window(item)
                continue
            now = item.when()
            active = max(0.0, now - self._mark - self._paused_since_mark)
            self._mark, self._paused_since_mark = now, 0.0
            if item.booked_to == "warmup":
                self.warmup_s += active
                self.warmup_steps_done += item.steps
            elif item.booked_to == "profiled":
                self.profiled_steps += item.steps
            else:
                self.train_s += active
                self.train_steps += item.steps
            self._window_s += active

    def pause(self) -> None:
        """Stop the throughput clock (validation, checkpointing); `resume` restarts it. Both synchronise: the
        training work queued before the pause counts as training, the paused work does not."""
        self._resolve()
        self._pause_start = self._now()

    def resume(self) -> None:
        paused = self._now() - self._pause_start
        self._paused_since_mark += paused
        self._paused_total_s += paused

    def book_profiled(self, profiled: bool) -> None:
        """From the next step on, book steps as run under the profiler (`profiled`): timed in the records as they
        ran, but left out of `steady_state()`, whose throughput the profiler's overhead would lower; or, with
        False, as measured steps again."""
        self._end_segment()  # the steps so far keep what they were booked to
        self._profiled = profiled

    def validation_start(self) -> None:
        if self._clock is not None:  # not for a validation outside fit
            self.pause()

    def validation_end(self, trainer: pl.Trainer) -> None:
        """Resume the clock; the validation's loss (and bert's accuracy) as a record."""
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
        self._write(record)

    def batch_start(self) -> None:
        """A micro-batch starts: the host time since the last one ended is data wait."""
        if self._batch_end is not None:
            gap = time.perf_counter() - self._batch_end - (self._paused_total_s - self._paused_at_batch_end)
            self._window_wait_s += max(0.0, gap)

    def batch_end(self, batch: Any) -> None:
        """A micro-batch ended: count its sequences."""
        size = _batch_size(batch)
        self._window_samples = (
            None if size is None or self._window_samples is None else self._window_samples + size
        )

    def batch_done(self) -> None:
        """Everything after a micro-batch (and after its step) is done: data wait counts from here."""
        self._batch_end, self._paused_at_batch_end = time.perf_counter(), self._paused_total_s

    def flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A stop between records (budget, spot pause, signal; every rank alike, before `end`): the steps since the
        last record get a last, partial window's record, as the last step of `max_steps` does."""
        if self._window_steps:
            self._close_window(trainer, pl_module, trainer.global_step, with_loss=self._loss_sum is not None)

    def end(self) -> None:
        self._end_segment()  # steps after the last record (a stop between records): book their time
        self._resolve()

    def after_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """An optimizer step ended: book it; at a logging window's end, capture the window's record."""
        # Marks of earlier steps: this step's work is queued behind them, so the device stays busy meanwhile.
        self._resolve()
        self._window_steps += 1
        self._segment_steps += 1
        self._session_steps += 1
        if self.state.compute_s is not None:
            self._window_compute_s.append(self.state.compute_s)
            self.state.compute_s = 0.0
        loss = self.state.loss
        if loss is not None:  # summed on device: no host sync until the record is written
            self._loss_sum = loss if self._window_steps == 1 else self._loss_sum + loss
        if self._session_steps == self.warmup_steps:
            self._end_segment()  # the end of the warm-up
        step = trainer.global_step
        last = step == trainer.max_steps
        if step % self.log_every_steps and not last:
            return
        self._close_window(trainer, pl_module, step, with_loss=loss is not None)
        if last:  # no step follows to resolve it behind
            self._resolve()

    def _close_window(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, *, with_loss: bool
    ) -> None:
        """End the logging window at `step`: capture its record, written once the mark after it resolves."""
        window = self._capture(trainer, pl_module, step, with_loss=with_loss)
        self._end_segment(always=True)  # marked after the capture's copies: resolving it covers them
        self._pending.append(window)
        self._window_steps, self._window_wait_s, self._window_samples = 0, 0.0, 0
        self._window_compute_s = []

    def _capture(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, *, with_loss: bool
    ) -> _Window:
        """The window's record inputs: host values now, device values reduced across ranks (every rank reaches
        this at the same step) and queued for copying to the host."""
        state = self.state
        values: dict[str, Any] = {}
        if with_loss:
            mean = self._loss_sum.detach().float() / self._window_steps
            values["train_loss"] = _mean_over_ranks(mean)
        values["grad_norm"] = state.grad_norm
        values.update(state.extra)
        compute = self._window_compute_s
        compute_s = (
            statistics.median(compute) if compute else -1.0
        )  # < 0: not measured (a module of the user's)
        own = torch.tensor(
            [float(peak_memory_bytes(pl_module.device)), compute_s],
            dtype=torch.float64,
            device=pl_module.device,
        )
        gathered = [own]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # The list form of all_gather: gloo and NCCL both have it (Lightning's wrapper warns on torch 2.13).
            gathered = [torch.empty_like(own) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(gathered, own)
        sourced: dict[str, Any] = {}
        for source in self.sources:  # now, not when the record is written a step later
            sourced.update(source())
        return _Window(
            step=step,
            steps=self._window_steps,
            wait_s=self._window_wait_s,
            samples=self._window_samples,
            lr=state.lr,
            world_size=trainer.world_size,
            values={name: _to_host(value) for name, value in values.items()},
            per_rank=[_to_host(t) for t in gathered],
            sourced=sourced,
        )

    def _write_window(self, window: _Window) -> None:
        elapsed, steps = self._window_s, window.steps
        tokens_per_s = self.tokens_per_step * steps / elapsed if elapsed > 0 else 0.0
        values = {name: None if value is None else float(value) for name, value in window.values.items()}
        samples_per_s = None
        if window.samples is not None:
            samples_per_s = window.samples * self.data_parallel_size / elapsed if elapsed > 0 else 0.0
        record: dict[str, Any] = {
            "step": window.step,
            "train_loss": values.pop("train_loss", None),
            "lr": window.lr,
            "grad_norm": values.pop("grad_norm"),
            "tokens_per_s": tokens_per_s,
            "samples_per_s": samples_per_s,
            "step_time_s": elapsed / steps,
            "data_wait_s": window.wait_s / steps,
            "window_steps": steps,  # the steps the means above are over
            "mfu": None,
        }
        record.update(values)
        peak, compute = zip(*(t.tolist() for t in window.per_rank), strict=True)
        per_rank = [int(p) for p in peak]
        record.update({"peak_memory_bytes": max(per_rank), "peak_memory_bytes_per_rank": per_rank})
        if min(compute) >= 0:  # every rank measured it
            record["compute_s_per_rank"] = list(compute)
            if self.stragglers is not None and (named := self.stragglers.observe(window.step, compute)):
                record["stragglers"] = named
        if self.started_s is not None:
            # `_mark` is the window's end: the mark resolved just before this window (`_resolve`).
            record["wall_s"] = self._mark - self.started_s
            record["time_unix"] = time.time() - (time.perf_counter() - self._mark)
        record.update(window.sourced)
        if self.flops_per_token is not None:
            record["mfu"] = mfu(
                tokens_per_s, self.flops_per_token, self.peak_flops_per_device, window.world_size
            )
        self.latest.update(record)
        self._write(record)
        self._window_s = 0.0

    def steady_state(self) -> dict[str, Any]:
        """Throughput over the measured steps of this process (after its first `warmup_steps`, less the
        `profiled_steps` run under the profiler): `tokens_per_s`, `step_time_s` (consistent: tokens/s = tokens per
        step / step time), `measured_steps`, and the warm-up on its own (`warmup_steps`, `warmup_s`, compilation
        included).

        When this process ran no step past the warm-up (e.g. a resume close to the end), the warm-up steps are
        measured instead and `includes_warmup` says so; with no step at all the figures are None.
        """
        self._resolve()
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
            "profiled_steps": self.profiled_steps,
        }

    def event(self, record: dict[str, Any]) -> None:
        """A record of something that happened at a step (a health event), not a window's measurements: written
        and passed to the listeners as it comes."""
        self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        # Not kept here: a run of a million steps would hold every record on every rank (~1 KiB each; readers of
        # the whole series read metrics.jsonl, listeners get each record as it comes).
        if self._is_writer and self.path is not None:
            # Opened per record (every log_every_steps): survives a crash, and the final validation after fit.
            # Written before the listeners are called: the record is kept whatever they do.
            with self.path.open("a") as f:
                f.write(strict_json.dumps(record) + "\n")
        for listener in list(self.listeners):
            try:
                listener(record)
            except (
                Exception
            ) as exc:  # monitoring never stops training: the listener is dropped, the run goes on
                self.listeners.remove(listener)
                name = getattr(listener, "__qualname__", type(listener).__name__)
                detail = (str(exc).strip().splitlines() or [""])[0]
                self.warn(
                    f"metrics listener {name} failed ({type(exc).__name__}: {detail}); it gets no more records "
                    "this run, training goes on"
                )
