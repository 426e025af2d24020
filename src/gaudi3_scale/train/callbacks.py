"""Callbacks that observe a run: step metrics to metrics.jsonl, the terminal progress bar, periodic checkpoints.

They only read training state; nothing here changes the math. Each optimizer step is detected as the end of the
last micro-batch of an accumulation group (`module.pending_micro_steps == 0`).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.distributed.checkpoint.api import CheckpointException

from gaudi3_scale.checkpoint.manager import (
    META_KEY,
    STATE_NAME,
    CheckpointManager,
    CheckpointSaveError,
    prepare_directory,
)
from gaudi3_scale.checkpoint.manifest import write_manifest
from gaudi3_scale.checkpoint.remote import RemoteMirror
from gaudi3_scale.distributed.strategies import saves_sharded
from gaudi3_scale.monitor.perf import mfu, peak_memory_bytes

__all__ = [
    "PREEMPTION_SIGNALS",
    "GracefulInterrupt",
    "RichStepProgress",
    "RunMetrics",
    "StepCheckpoint",
    "preemption_exit_code",
]


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
        self.sources: list[Callable[[], dict[str, Any]]] = []  # more fields for every record (e.g. uploads)
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
        self.latest["val_loss_step"] = record["step"]
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
        for source in self.sources:
            record.update(source())
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


class StepCheckpoint(pl.Callback):
    """Save a committed `step-XXXXXXXX/` checkpoint every N optimizer steps and at the end; apply retention.

    Single-file checkpoints: the checkpoint IO (`VerifiedCheckpointIO`, rank 0) writes the state, then the
    manifest, then calls its `on_commit` hook, which moves `latest` and applies retention — in the background when
    the IO is asynchronous. Sharded checkpoints (FSDP, DCP): every rank writes its shards, and once all are past a
    barrier rank 0 writes the manifest and moves `latest`. `blocking_s` lists how long each save stopped training.

    A periodic save that fails (disk full, storage gone) is never committed and is cleaned up; the run continues
    with a warning naming it. The final or emergency save failing stops the run with that one line instead.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        every_steps: int,
        val_every_steps: int = 0,
        metrics: RunMetrics | None = None,
        warn: Callable[[str], None] | None = None,
        config_sha256: str | None = None,
        mirror: RemoteMirror | None = None,
        enabled: bool = True,
    ) -> None:
        self.manager = manager
        self.enabled = enabled  # False: never save (a stop request still stops after the agreed step)
        self.mirror = mirror
        self.warn = warn
        self.config_sha256 = config_sha256
        self.every_steps = every_steps
        self.val_every_steps = val_every_steps
        self.metrics = metrics
        self._after_validation = False
        self.committed_at = 0.0
        self.last_path: Path | None = None
        self._last_step = -1
        self._meta: dict[str, Any] = {}
        self.save_requested = False
        self.blocking_s: list[float] = []
        self._uncommitted = False  # a save may still be in flight (asynchronous IO)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if trainer.is_global_zero and hasattr(io, "on_commit"):
            io.on_commit = self.commit

    def commit(self, directory: Path) -> None:
        """After a checkpoint's manifest is written (rank 0): queue its upload, move `latest`, apply retention.

        The upload is queued first, so remote deletions that retention queues run after it, when the remote
        `latest` already names the new checkpoint.
        """
        if self.mirror is not None:
            self.mirror.submit(directory)
        self.manager.mark_latest(directory)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # never re-save the checkpoint we resumed from

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not _at_step_boundary(pl_module):
            return
        step = trainer.global_step
        if self.save_requested:
            self.save(trainer, wait=True)  # an emergency save returns only once committed
            trainer.should_stop = True
        elif self.periodic_due(step):
            if self.val_every_steps and step % self.val_every_steps == 0:
                self._after_validation = True  # validation runs right after this hook: record its loss too
            else:
                self.save(trainer)

    def periodic_due(self, step: int) -> bool:
        """Whether a periodic checkpoint falls on optimizer step `step` (a checkpoint boundary)."""
        return bool(self.enabled and self.every_steps and step % self.every_steps == 0)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._after_validation and not trainer.sanity_checking:
            self._after_validation = False
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save(trainer, wait=True)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # What the manifest records about this checkpoint, next to the files' checksums; other callbacks may
        # have added entries of their own (LiveCost: the accrued cost).
        tokens_per_step = getattr(pl_module, "tokens_per_step", 0)
        self._meta = checkpoint[META_KEY] = {
            **checkpoint.get(META_KEY, {}),
            "tokens_seen": trainer.global_step * tokens_per_step if tokens_per_step else None,
            "world_size": trainer.world_size,
            "strategy": getattr(pl_module, "strategy_name", type(trainer.strategy).__name__),
            "layout": "sharded" if saves_sharded(trainer.strategy) else "single-file",
            "config_sha256": self.config_sha256,
            # The newest validation so far (it may have run a few steps before this checkpoint).
            "val_loss": self.metrics.latest.get("val_loss") if self.metrics is not None else None,
            "val_loss_step": self.metrics.latest.get("val_loss_step") if self.metrics is not None else None,
        }

    def save(self, trainer: pl.Trainer, *, wait: bool = False) -> None:
        step = trainer.global_step
        if not self.enabled:
            return
        if step != self._last_step:
            if self.metrics is not None:
                self.metrics.pause()
            self._wait_for_commit(trainer, final=False)  # the previous save's outcome, before a new one
            started = time.perf_counter()
            path = self.manager.path_for(step)
            failure: CheckpointSaveError | None = None
            try:
                if saves_sharded(trainer.strategy):
                    self._save_sharded(trainer, path)
                else:
                    trainer.save_checkpoint(path / STATE_NAME, weights_only=False)
            except CheckpointSaveError as exc:
                failure = exc
            self.blocking_s.append(time.perf_counter() - started)
            # Single-file checkpoints are written by rank 0 alone: its outcome decides for every rank.
            if trainer.strategy.broadcast(failure is None, src=0):
                self.last_path = path
                self._last_step = step  # a failed step is tried again at the end of training
                self._uncommitted = True
            elif failure is not None:
                self._failed(failure, final=wait)
            if self.metrics is not None:
                self.metrics.resume()
        if wait and self._uncommitted:
            self._wait_for_commit(trainer, final=True)
            self.committed_at = time.perf_counter()

    def _wait_for_commit(self, trainer: pl.Trainer, *, final: bool) -> None:
        """Wait for an asynchronous save in flight (rank 0 writes it); warn or raise if it failed."""
        if not self._uncommitted:
            return
        self._uncommitted = False
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if trainer.is_global_zero and wait is not None:
            try:
                wait()
            except CheckpointSaveError as exc:
                self._failed(exc, final=final)
        trainer.strategy.barrier("gaudi3_checkpoint_committed")

    def _failed(self, error: CheckpointSaveError, *, final: bool) -> None:
        if final:
            raise error
        committed = self.manager.committed()
        newest = committed[-1][1].name if committed else "none yet"
        message = f"{error}; training continues (newest committed checkpoint: {newest})"
        if self.warn is not None:
            self.warn(message)
        else:
            warnings.warn(message, stacklevel=2)

    def _save_sharded(self, trainer: pl.Trainer, path: Path) -> None:
        if trainer.is_global_zero:
            prepare_directory(path)
        trainer.strategy.barrier("gaudi3_checkpoint_prepare")
        try:
            trainer.save_checkpoint(path, weights_only=False)  # every rank: its shards; rank 0 also meta.pt
        except (OSError, CheckpointException) as exc:  # DCP raises the same CheckpointException on every rank
            if trainer.is_global_zero:
                shutil.rmtree(path, ignore_errors=True)
            raise CheckpointSaveError(path, exc) from exc
        trainer.strategy.barrier("gaudi3_checkpoint_shards")
        if trainer.is_global_zero:
            write_manifest(path, {"step": trainer.global_step, "epoch": trainer.current_epoch, **self._meta})
            self.commit(path)


# Exit codes after a preemption checkpoint: 128 + the signal number, the shell convention. Kubeflow's ExitCode
# restart policy retries 143 (training-operator, pkg/util/train IsRetryableExitCode: 130, 137, 143 retryable), and
# torchrun's --max-restarts restarts on any non-zero exit. Ctrl-C is a person stopping the run: exit 0.
PREEMPTION_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1", signal.SIGINT: "SIGINT"}


def preemption_exit_code(signal_name: str | None) -> int:
    if signal_name in (None, "SIGINT"):
        return 0
    return 128 + int(getattr(signal, str(signal_name)))


class GracefulInterrupt(pl.Callback):
    """SIGTERM, SIGUSR1 or Ctrl-C: finish the current optimizer step, save a checkpoint on every rank, stop.

    A signal may reach only some ranks (a preempted node, `kill` of one process); at every step boundary the ranks
    agree by all-reducing the signal number (max), so all of them stop after the same step and save together.
    A second Ctrl-C aborts at once. `signal_name` and `signal_to_checkpoint_s` say what happened and how long the
    emergency checkpoint took from the signal to its commit.

    `request(reason, exit_code=N)` stops the same way for a reason of the run's own (LiveCost: budget spent, spot
    price too high); the exit code is agreed like the signal (max over ranks) and lands in `exit_code`.
    """

    def __init__(self, checkpoint: StepCheckpoint, console: Console | None = None) -> None:
        self.checkpoint = checkpoint
        self.console = console or Console(stderr=True)
        self._previous: dict[int, Any] = {}
        self._received = 0  # signal number seen by this process, 0 = none
        self._received_at: float | None = None
        self.signal_name: str | None = None
        self.reason: str | None = None  # the signal's name, or what requested the stop
        self.signal_to_checkpoint_s: float | None = None
        self._exit_code = 0  # requested by this process, 0 = none
        self.exit_code: int | None = None  # agreed by all ranks; None: the signal's convention applies

    @property
    def interrupted(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: abort now
            return
        self._received, self._received_at = signum, time.perf_counter()
        self.reason = PREEMPTION_SIGNALS[signal.Signals(signum)]
        self.console.print(
            f"\n[yellow]{self.reason}: saving a checkpoint after this step (Ctrl-C again aborts)"
        )

    def request(self, reason: str, signum: int = signal.SIGTERM, *, exit_code: int | None = None) -> None:
        """Stop as if `signum` had arrived, for `reason` (callable from another thread, e.g. a spot watcher).

        With `exit_code` the process should end with that code instead of the signal's (see `exit_code`).
        """
        if self._received:
            return
        self.reason = reason
        self._exit_code = exit_code or 0
        self._received, self._received_at = signum, time.perf_counter()
        self.console.print(
            f"\n[yellow]{reason}: saving a checkpoint after this step", highlight=False, soft_wrap=True
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for signum in PREEMPTION_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                return

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not _at_step_boundary(pl_module) or self.signal_name is not None:
            return
        agreed, exit_code = self._received, self._exit_code
        if trainer.world_size > 1:
            flags = torch.tensor([self._received, self._exit_code], device=pl_module.device)
            agreed, exit_code = (int(v) for v in trainer.strategy.reduce(flags, reduce_op="max"))
        if agreed:
            self.signal_name = PREEMPTION_SIGNALS[signal.Signals(agreed)]
            self.exit_code = exit_code or None
            if self._received_at is None:  # the signal reached another rank
                self._received_at = time.perf_counter()
            self.checkpoint.save_requested = True  # StepCheckpoint (after us) saves now and stops the run

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.signal_name is not None and self._received_at is not None:
            self.signal_to_checkpoint_s = self.checkpoint.committed_at - self._received_at
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)
