"""What follows an optimizer step, in one place: `AfterStep` is the one callback that hooks the training loop for
the run's own work, and the lines of `AfterStep.after_step` are the order.

    cost        train.cost_callback.LiveCost      accrue this step's cost; ask for a stop when the budget is spent
                                                  or the spot policy pauses; once the ranks agreed on that stop,
                                                  its line names this step and cost (what the checkpoint holds)
    metrics     train.step_metrics.RunMetrics     book the step; at a window's end, its record (with that cost)
    stop        train.callbacks.GracefulInterrupt the ranks agree on a stop (signal, spot notice, budget)
    health      train.step_health.StepHealth      reports what the step guard saw (health.guard decided, in
                                                  the step, whether the update was applied), before any save
    checkpoint  train.callbacks.StepCheckpoint    the checkpoint this step is due (now, or after its validation)
    profiler    train.profile_callback.StepProfiler  the profiler's window: its steps booked apart from the
                                                  measured ones, its outputs written on paused time
    progress    train.progress.RichStepProgress      the terminal bar

A step whose update the guard dropped made no step (global_step did not move): only its cost, the stop agreement,
its health report and, when a stop was agreed, the stop's checkpoint run (a run whose updates are all dropped still
stops on a signal, a spot notice or the budget). Validation runs where Lightning's loop puts it, right after this
step's hooks; a checkpoint due at a validated step is saved after the validation, so it records that loss. What
the run reports (metrics.jsonl, the trackers, Prometheus, the dashboard) is what `RunMetrics` writes and passes to
its listeners; none of them hooks the step.
The other hooks (start, validation, end) go to the same parts, in the order written here; what a checkpoint holds
beyond Lightning's own entries is the run's `CheckpointContents` (`checkpoint.contents`). The hang watchdog
(`health.watchdog`) gets a beat before those lines, and the section the loop is in from the other hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import lightning.pytorch as pl

from gaudi3_scale.train.callbacks import GracefulInterrupt, StepCheckpoint
from gaudi3_scale.train.cost_callback import LiveCost
from gaudi3_scale.train.profile_callback import StepProfiler
from gaudi3_scale.train.progress import RichStepProgress
from gaudi3_scale.train.step import StepState, at_step_boundary
from gaudi3_scale.train.step_metrics import RunMetrics

if TYPE_CHECKING:
    from gaudi3_scale.health.watchdog import Watchdog

__all__ = ["AfterStep", "StepCheck"]


class StepCheck(Protocol):
    """A check of an optimizer step's outcome, run after the ranks agreed on a stop and before the checkpoint."""

    def after_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None: ...

    @property
    def ends_fit(self) -> bool:
        """The check ended the fit (a rollback): no final checkpoint."""
        ...


class AfterStep(pl.Callback):
    """The parts of the run that act after each optimizer step (module docstring), called in one order."""

    def __init__(
        self,
        *,
        metrics: RunMetrics,
        stop: GracefulInterrupt,
        checkpoint: StepCheckpoint,
        cost: LiveCost | None = None,
        health: StepCheck | None = None,
        profiler: StepProfiler | None = None,
        progress: RichStepProgress | None = None,
        state: StepState | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.cost, self.metrics, self.stop, self.health = cost, metrics, stop, health
        self.state = state  # the module's step contract: a step whose update was dropped is only reported
        self.checkpoint, self.profiler, self.progress = checkpoint, profiler, progress
        # The hang watchdog (health.watchdog): a beat per step, and the section the loop is in. StepCheckpoint
        # enters `checkpoint` itself, around each save.
        self.watchdog = watchdog

    def after_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """An optimizer step ended (the last micro-batch of its accumulation): these lines are the order."""
        if self.cost is not None:
            self.cost.after_step(trainer)  # time spent costs, update or not
        dropped = self.state is not None and self.state.update_dropped  # no step was made: no record of one
        if not dropped:
            self.metrics.after_step(trainer, pl_module)
        self.stop.after_step(trainer, pl_module)  # at every boundary: a run dropping updates must still stop
        if self.cost is not None and self.checkpoint.save_requested:  # a budget or spot stop's line names the
            self.cost.stop_agreed(trainer)  # step and cost its checkpoint holds
        if self.health is not None:
            self.health.after_step(trainer, pl_module)
        if dropped:
            # only a stop's checkpoint (its batch is in the skips), and none when the guard ended the fit
            if self.checkpoint.save_requested and not (self.health is not None and self.health.ends_fit):
                self.checkpoint.after_step(trainer)
            return
        self.checkpoint.after_step(trainer)
        if self.profiler is not None:
            self.profiler.after_step(trainer)
        if self.progress is not None:
            self.progress.after_step(trainer)

    # ---- Lightning's hooks, dispatched to the parts -------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.cost is not None:
            self.cost.start(trainer)
        self.metrics.start(trainer, pl_module)
        self.stop.start()
        self.checkpoint.start(trainer)
        if self.profiler is not None:
            self.profiler.start(trainer)
        if self.progress is not None:
            self.progress.start(trainer)
        if self.watchdog is not None:
            self.watchdog.enter("step")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.metrics.batch_start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.metrics.batch_end(batch)
        if at_step_boundary(pl_module):
            if self.watchdog is not None:
                self.watchdog.beat(trainer.global_step)
            self.after_step(trainer, pl_module)
        self.metrics.batch_done()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.watchdog is not None:
            self.watchdog.enter("validation")
        self.metrics.validation_start()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The validation's record first: the checkpoint after it records it.
        self.metrics.validation_end(trainer)
        self.checkpoint.validation_end(trainer)
        if self.watchdog is not None:
            self.watchdog.enter("step")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stop.interrupted:
            self.metrics.flush(trainer, pl_module)  # the steps since the last record, up to the stop's
        self.metrics.end()
        self.stop.settle()
        if not (
            self.health is not None and self.health.ends_fit
        ):  # a rollback or the stop saves nothing more
            self.checkpoint.end(trainer)  # the final checkpoint, committed
        self.stop.end()  # the signal handlers stay the run's until that commit
        if self.progress is not None:
            self.progress.stop()
        if self.profiler is not None:
            self.profiler.end(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self.progress is not None:
            self.progress.stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.stop.restore()  # after on_train_end (nothing left to restore), or after an exception
        if self.profiler is not None:  # an exception ended training: stop profiling, write nothing
            self.profiler.abort()
        self.checkpoint.release()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.checkpoint.checkpointer.contents.save_into(checkpoint)  # our entries, by their owners

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.checkpoint.checkpointer.load(checkpoint)  # our entries back to their owners
