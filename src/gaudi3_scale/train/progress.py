"""The terminal progress bar of a run: optimizer steps done, loss, tokens/s and ETA, from the latest record of its
step metrics (`train.step_metrics.RunMetrics`). Rank 0 only; `train.after_step.AfterStep` calls it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gaudi3_scale.train.step_metrics import RunMetrics

__all__ = ["RichStepProgress"]


class RichStepProgress:
    """One progress bar over optimizer steps with loss, tokens/s and ETA (rank 0 only)."""

    def __init__(self, metrics: RunMetrics, *, console: Console | None = None) -> None:
        self.metrics = metrics
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task: Any = None

    def start(self, trainer: pl.Trainer) -> None:
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

    def after_step(self, trainer: pl.Trainer) -> None:
        if self._progress is None:
            return
        latest = self.metrics.latest
        fields: dict[str, Any] = {}
        if "train_loss" in latest and latest["train_loss"] is not None:
            fields = {"loss": f"{latest['train_loss']:.4f}", "tps": f"{latest['tokens_per_s']:,.0f}"}
        self._progress.update(self._task, completed=trainer.global_step, **fields)

    def stop(self) -> None:
        """End the bar (the end of training, or an exception)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
