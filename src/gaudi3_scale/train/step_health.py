"""The `health` part of `AfterStep`: what the step guard (`health.guard.StepGuard`) saw at this step, reported —
a `health_event` record in metrics.jsonl (and so to Prometheus, the trackers and the dashboard), one line for the
user, and the run's counts and events for summary.json."""

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

    def after_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.guard.pending:
            return
        for event in self.guard.take_events():
            record = event.record()
            self.events.append(record)
            self.metrics.event(record)
            if trainer.is_global_zero:
                self.warn(event.line())

    def summary(self) -> dict[str, Any]:
        """summary.json's `health`: the run's counts (restored on resume) and this process's events."""
        return {**self.guard.counts, "events": self.events, "skipped_batches": list(self.guard.skips.skipped),
                "dropped_batches": list(self.guard.skips.dropped)}  # fmt: skip
