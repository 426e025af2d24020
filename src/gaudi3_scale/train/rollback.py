"""A rollback (`health.spike_policy rollback`, PaLM's remedy for a loss spike): which checkpoint to restore and
which batches of the data stream to skip from there, decided after the fit that spiked has ended.

The step guard (`health.guard.StepGuard`) finds the spike at optimizer step K on every rank alike, drops that
update and ends the fit (`train.step_health.StepHealth`); `GaudiTrainer` then plans the rollback here, once every
save of that fit has committed, and fits again from the plan's checkpoint with the plan's batches skipped.

The checkpoint is the newest one that verifies whose step is at most K: a checkpoint of step S holds the state after
S updates, before step S's own, so one saved at K itself precedes the spiking update. Its data step (the sampler's
`samples_consumed` / the global batch) is the first batch a resume from it would load; the plan skips
`health.rollback_skip_batches` data steps from there, and at least through the spiking batch (K's, at or after it),
so it is never loaded again: from a checkpoint further back than that many steps, a replay of the spiking batch
would spike again and roll back to the same checkpoint until `health.max_rollbacks` stopped the run. Without a
checkpoint that old the run starts over from its initial weights.

A spike after `health.max_rollbacks` rollbacks is not rolled back: the run stops (`guard_stop`), as it does after
`health.max_dropped_in_a_row` updates dropped in a row. Neither stop saves, and neither exit code is restartable: a
restart from the newest checkpoint would replay the same batches on the same weights and meet the same spike (the
stop's batch is not skipped: its update ended no fit that saved the skip).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaudi3_scale.checkpoint.contents import DATAMODULE_KEY
from gaudi3_scale.checkpoint.manager import CheckpointManager, state_path
from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.data.skips import BatchSkips
from gaudi3_scale.health.guard import HEALTH_STOP_EXIT_CODE, StepGuard

__all__ = ["Rollback", "guard_stop", "plan_rollback"]


@dataclass(frozen=True)
class Rollback:
    spike_step: int  # the optimizer step whose update was dropped
    to_step: int  # the restored checkpoint's step (0 and no checkpoint: the initial weights)
    checkpoint: Path | None  # what Lightning's ckpt_path names (`checkpoint.manager.state_path`)
    skipped: range  # data steps never loaded again
    lr_scale: float  # the run's learning-rate factor from here on

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl record of this rollback (a health event)."""
        return {
            "step": self.spike_step,
            "health_event": "rollback",
            "health_action": "rollback",
            "from_step": self.spike_step,
            "to_step": self.to_step,
            "checkpoint": self.checkpoint.parent.name if self.checkpoint is not None else None,
            "skipped_batches": [self.skipped.start, self.skipped.stop - 1],
            "lr_scale": self.lr_scale,
            "detail": self.describe(),
        }

    def describe(self) -> str:
        where = f"checkpoint step {self.to_step}" if self.checkpoint is not None else "the initial weights"
        lr = f"; learning rate × {self.lr_scale:g}" if self.lr_scale != 1.0 else ""
        return (
            f"rolled back from step {self.spike_step} to {where}; data batches {self.skipped.start}–"
            f"{self.skipped.stop - 1} skipped{lr}"
        )

    def line(self) -> str:
        return f"health: step {self.spike_step}: {self.describe()}"


def plan_rollback(
    manager: CheckpointManager,
    *,
    spike_step: int,
    skips: BatchSkips,
    global_batch_size: int,
    skip_batches: int,
    lr_scale: float,
    warn: Callable[[str], None] | None = None,
) -> Rollback:
    """The rollback from a spike at `spike_step`: the newest checkpoint at or before it that verifies (each
    damaged one passed over is named via `warn`), and the `skip_batches` data steps from the one it resumes at, at
    least through the spiking batch. `skips` is the spiking fit's (the spiking update's batch; for the
    no-checkpoint case, the first batch of the stream not already skipped); `lr_scale` the factor after this
    rollback."""
    older = {path: step for step, path in reversed(manager.committed()) if step <= spike_step}  # newest first
    # each verified: a damaged one (even one this run's resume skipped) is named and passed over
    directory = manager.first_valid(list(older), warn=warn)
    if directory is not None:
        to_step = older[directory]
        ckpt: Path | None = state_path(directory)
        state = read_checkpoint(directory, tensors=False, verify=False)  # verified just now
        first = int(state[DATAMODULE_KEY]["samples_consumed"]) // global_batch_size
    else:
        to_step, ckpt = 0, None
        first = BatchSkips(skips.skipped).data_step_of_load(0)
    # the spiking update's batch (a rolled-back update is dropped without a skip, so the batch is still its own)
    spiked = skips.next_data_step(spike_step)
    return Rollback(spike_step, to_step, ckpt, range(first, max(first + skip_batches, spiked + 1)), lr_scale)


def guard_stop(guard: StepGuard) -> dict[str, Any]:
    """The summary's stop fields of a run the step guard stopped at `guard.stop_at` (`gaudi3 train` ends with their
    one line): past health.max_rollbacks, or after health.max_dropped_in_a_row updates dropped in a row."""
    step, cfg = guard.stop_at, guard.cfg
    assert step is not None, "the guard asked for the stop"
    if guard.stop_kind == "rollback":
        # the spiking update's batch: not dropped (no fit saved after it), so a restart loads it again
        batch = guard.skips.next_data_step(step)
        reason = (f"a loss spike at step {step} (data batch {batch}) after health.max_rollbacks "
                  f"({cfg.max_rollbacks}) rollbacks")  # fmt: skip
        hint = (f"look at data batch {batch}, then add it to health.skip_batches, raise health.max_rollbacks, "
                "or lower optim.lr")  # fmt: skip
    else:
        n = guard.dropped_in_a_row
        batches = guard.skips.dropped[-n:]
        what = {
            "nonfinite": "non-finite losses or gradient norms",
            "grad_norm_spike": "gradient norm spikes",
        }.get(guard.stop_kind, "loss spikes")
        # a dropped update does not move the step: all of them were step `step`'s
        reason = (f"{n} updates in a row dropped at step {step} for {what} (health.max_dropped_in_a_row), "
                  f"data batches {batches[0]}–{batches[-1]}")  # fmt: skip
        hint = (
            "the run has diverged: lower optim.lr (or set optim.grad_clip_norm) and start again from a "
            "checkpoint before the divergence, or from scratch"
            if guard.stop_kind == "nonfinite"
            else "the loss no longer fits the spike detector's history: look at those batches, raise "
            "health.spike_threshold_mads or health.spike_window_steps, or set health.spike_policy warn"
        )
    return {
        "interrupted": True,
        "stop_reason": reason,
        "stop_exit_code": HEALTH_STOP_EXIT_CODE,
        "stop_hint": hint,
    }
