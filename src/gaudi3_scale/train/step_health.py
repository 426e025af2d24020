"""The `health` part of `AfterStep`: what the step guard (`health.guard.StepGuard`) saw at this step, reported —
a `health_event` record in metrics.jsonl (and so to Prometheus, the trackers and the dashboard), one line for the
user, and the run's counts and events for summary.json. A spike that asks for a rollback (or, past
health.max_rollbacks, for the stop) ends the fit here: `GaudiTrainer` restores the checkpoint and fits again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from gaudi3_scale.health.guard import StepGuard
from gaudi3_scale.train.step_metrics import RunMetrics

__all__ = ["StepHealth"]


class StepHealth:
    def __init__(self, guard: StepGuard, metrics: RunMetrics, *, warn: Callable[[str], None]) -> None:
        self.guard, self.metrics, self.warn = guard, metrics, warn
        self.events: list[dict[str, Any]] = []  # this process's event records
        self.queued: list[tuple[dict[str, Any], str]] = []  # reported at the next step (a rollback's record)

    @property
    def ends_fit(self) -> bool:
        """A rollback or the stop was asked for: the fit ends after this step, without its final checkpoint
        (the step's update was dropped; a rollback restores an older one, the stop keeps the newest)."""
        return self.guard.rollback_at is not None or self.guard.stop_at is not None

    def after_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.queued:  # the metrics file is written once the fit runs: reported at its first step
            for record, line in self.queued:
                self.report(record, line, global_zero=trainer.is_global_zero)
            self.queued.clear()
        if not self.guard.pending:
            return
        for event in self.guard.take_events():
            self.report(event.record(), event.line(), global_zero=trainer.is_global_zero)
        if self.ends_fit:
            trainer.should_stop = True
            trainer.limit_val_batches = 0  # no validation on the way out: the state is about to be replaced

    def report(self, record: dict[str, Any], line: str, *, global_zero: bool) -> None:
        """One event: its record (metrics.jsonl and the listeners), summary.json's list, one line on rank 0."""
        self.events.append(record)
        self.metrics.event(record)
        if global_zero:
            self.warn(line)

    def summary(self) -> dict[str, Any]:
        """summary.json's `health`: the run's counts (restored on resume) and this process's events."""
        return {**self.guard.counts, "events": self.events, "skipped_batches": list(self.guard.skips.skipped),
                "dropped_batches": list(self.guard.skips.dropped)}  # fmt: skip
