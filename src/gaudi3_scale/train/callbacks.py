"""Callbacks that observe a run: step metrics to metrics.jsonl, the terminal progress bar, periodic checkpoints.

They only read training state; nothing here changes the math. Each optimizer step is detected as the end of the
last micro-batch of an accumulation group (`module.pending_micro_steps == 0`).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gaudi3_scale.monitor.perf import mfu, peak_memory_bytes

__all__ = ["GracefulInterrupt", "RichStepProgress", "RunMetrics", "StepCheckpoint", "latest_checkpoint"]


def _at_step_boundary(pl_module: pl.LightningModule) -> bool:
    return getattr(pl_module, "_micro_step", 0) == 0


class RunMetrics(pl.Callback):
    """Step time, tokens/s, MFU, loss, lr and peak memory → `metrics.jsonl` every `log_every_steps` steps.

    train_loss is the mean over the steps since the previous record (as Lightning's epoch-level logging does),
    not the last step's noisy value.

    tokens/s is measured over the steps since the previous record with validation and checkpoint time excluded,
    so the figure is training throughput, not wall-clock average.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        log_every_steps: int,
        tokens_per_step: int,
        flops_per_token: float | None,
        peak_flops_per_device: float | None,
    ) -> None:
        self.path = path
        self.log_every_steps = log_every_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self.latest: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self._is_writer = False
        self._loss_sum: Any = None
        self._window_start = 0.0
        self._window_steps = 0
        self._paused_s = 0.0
        self._pause_start = 0.0
        self.train_s = 0.0
        self.train_steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._is_writer = self.path is not None and trainer.is_global_zero
        if self._is_writer:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._window_start = time.perf_counter()

    def pause(self) -> None:
        """Stop the throughput clock (validation, checkpointing); `resume` restarts it."""
        self._pause_start = time.perf_counter()

    def resume(self) -> None:
        self._paused_s += time.perf_counter() - self._pause_start

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resume()
        val = trainer.callback_metrics.get("val/loss")
        if val is None or trainer.sanity_checking:
            return
        record = {"step": trainer.global_step, "val_loss": float(val)}
        self.latest["val_loss"] = record["val_loss"]
        self._write(trainer, record)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not _at_step_boundary(pl_module):
            return
        self._window_steps += 1
        loss = getattr(pl_module, "last_loss", None)
        if loss is not None:  # summed on device: no host sync until the record is written
            self._loss_sum = loss if self._window_steps == 1 else self._loss_sum + loss
        step = trainer.global_step
        if step % self.log_every_steps and step != trainer.max_steps:
            return
        now = time.perf_counter()
        elapsed = now - self._window_start - self._paused_s
        self.train_s += elapsed
        self.train_steps += self._window_steps
        tokens_per_s = self.tokens_per_step * self._window_steps / elapsed if elapsed > 0 else 0.0
        grad_norm = getattr(pl_module, "last_grad_norm", None)
        record: dict[str, Any] = {
            "step": step,
            "train_loss": self._global_mean_loss(trainer) if loss is not None else None,
            "lr": current_lr() if callable(current_lr := getattr(pl_module, "current_lr", None)) else None,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed / self._window_steps,
            "mfu": None,
        }
        record.update(self._peak_memory(trainer, pl_module))
        if self.flops_per_token is not None:
            record["mfu"] = mfu(
                tokens_per_s, self.flops_per_token, self.peak_flops_per_device, trainer.world_size
            )
        self.latest.update(record)
        self._write(trainer, record)
        self._window_start, self._window_steps, self._paused_s = time.perf_counter(), 0, 0.0

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

    def mean_tokens_per_s(self) -> float:
        return self.tokens_per_step * self.train_steps / self.train_s if self.train_s > 0 else 0.0

    def _write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        self.history.append(record)
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
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=trainer.max_steps, completed=trainer.global_step, loss="-", tps="-"
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._progress is None or not _at_step_boundary(pl_module):
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


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint the `latest` pointer names, else the newest `step-*.ckpt`, else None."""
    pointer = directory / "latest"
    if pointer.is_file():
        target = directory / pointer.read_text().strip()
        if target.is_file():
            return target
    candidates = sorted(directory.glob("step-*.ckpt"))
    return candidates[-1] if candidates else None


class StepCheckpoint(pl.Callback):
    """Save `step-XXXXXXXX.ckpt` every N optimizer steps and at the end; keep the last `keep`.

    The `latest` pointer is replaced atomically only after the checkpoint file is complete (Lightning writes
    non-distributed checkpoints to a temporary file and renames it).
    """

    def __init__(
        self, directory: Path, *, every_steps: int, keep: int, metrics: RunMetrics | None = None
    ) -> None:
        self.directory = directory
        self.every_steps = every_steps
        self.keep = keep
        self.metrics = metrics
        self.last_path: Path | None = None
        self._last_step = -1
        self.save_requested = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # never re-save the checkpoint we resumed from

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not _at_step_boundary(pl_module):
            return
        step = trainer.global_step
        if self.save_requested or (self.every_steps and step % self.every_steps == 0):
            self.save(trainer)
        if self.save_requested:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save(trainer)

    def save(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return
        if self.metrics is not None:
            self.metrics.pause()
        path = self.directory / f"step-{step:08d}.ckpt"
        trainer.save_checkpoint(path, weights_only=False)
        if trainer.is_global_zero:
            tmp = self.directory / "latest.tmp"
            tmp.write_text(path.name + "\n")
            tmp.replace(self.directory / "latest")
            for old in sorted(self.directory.glob("step-*.ckpt"))[: -self.keep]:
                old.unlink()
        trainer.strategy.barrier("gaudi3_checkpoint")
        self.last_path = path
        self._last_step = step
        if self.metrics is not None:
            self.metrics.resume()


class GracefulInterrupt(pl.Callback):
    """First Ctrl-C: finish the current optimizer step, save a checkpoint, stop. Second Ctrl-C: abort at once."""

    def __init__(self, checkpoint: StepCheckpoint, console: Console | None = None) -> None:
        self.checkpoint = checkpoint
        self.console = console or Console(stderr=True)
        self._previous: Any = None
        self.interrupted = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.interrupted = True
        self.checkpoint.save_requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
        self.console.print("\n[yellow]Ctrl-C: saving a checkpoint after this step (press again to abort)")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._previous is not None and not self.interrupted:
            signal.signal(signal.SIGINT, self._previous)
