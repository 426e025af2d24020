"""The step guard: before an optimizer update, whether to apply it (`health.nonfinite_guard`, `health.spike_policy`).

Every rank calls `StepGuard.check` at the same point of the same step, and the verdict must be the same on every
rank. When only the gradient norm decides the update — it is computed (`optim.grad_clip_norm` > 0) and a spike is
at most warned of (`health.spike_policy warn` or `off`, the default) — the guard adds no collective: the norm is of
the gradients the step already synchronised, so it is the same on every rank, and a NaN/Inf loss on any rank makes
it non-finite everywhere (that rank's gradients are in the sum) — the logical OR rides on the gradient all-reduce.
Each rank then watches its own loss for spikes (rank 0 reports them). Otherwise (spikes that drop or roll back an
update, no gradient norm, or `health.rerun_check`, which re-runs a flagged step on every rank) the verdict is taken
from one all-reduce of three numbers: the loss summed over ranks, the norm, and a count of ranks whose own loss or
norm is not finite. A dropped update is recorded in the data stream's `BatchSkips` (so a resume passes the same
batch) and as an event the `AfterStep` health part reports. Under `health.spike_policy rollback` a spike's update is
dropped too, and `rollback_at` asks `GaudiTrainer` to end the fit and restore a checkpoint (`train.rollback`); past
`health.max_rollbacks`, `stop_at` asks it to stop. So does the `health.max_dropped_in_a_row`-th update dropped in a
row: a diverged run (every loss NaN) or a spike detector whose history no longer fits the loss would otherwise take
batch after batch for ever, its update count never moving. Both stops save nothing and exit
`HEALTH_STOP_EXIT_CODE`, not a restartable code: a restart from the newest checkpoint would meet the same thing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gaudi3_scale.data.skips import BatchSkips
from gaudi3_scale.health.config import HealthConfig
from gaudi3_scale.health.spike import Spike, SpikeDetector

__all__ = ["HEALTH_STOP_EXIT_CODE", "HealthEvent", "StepGuard"]

# The exit code of a run the guard stopped (module docstring). Not 128 + a signal, which launchers and Kubeflow
# restart (as the cost stops' 3 and 4 are not: metering.live); 2 is taken by bad input.
HEALTH_STOP_EXIT_CODE = 5


@dataclass(frozen=True)
class HealthEvent:
    """One thing the guard saw at optimizer step `step` (the update count before it)."""

    kind: str  # nonfinite | loss_spike | grad_norm_spike
    step: int
    action: (
        str  # skip (the update was dropped) | warn (applied) | rollback | stop (dropped, then the fit ends)
    )
    loss: float
    grad_norm: float | None
    data_step: int | None  # the dropped batch (skip)
    detail: str
    rerun: dict[str, Any] | None = None  # what the re-run check showed (health.rerun), when it ran

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl record of this event."""
        return {
            "step": self.step,
            "health_event": self.kind,
            "health_action": self.action,
            "event_loss": self.loss,
            "event_grad_norm": self.grad_norm,
            "data_step": self.data_step,
            "detail": self.detail,
            **({"rerun": self.rerun} if self.rerun is not None else {}),
        }

    def line(self) -> str:
        what = {
            "warn": "update applied",
            "rollback": "update dropped; rolling back to the newest checkpoint before it",
            "stop": "update dropped; health.max_rollbacks reached: the run stops",
        }.get(self.action, "update dropped")
        batch = f", data batch {self.data_step} skipped on resume" if self.data_step is not None else ""
        rerun = f"; {self.rerun['verdict']}" if self.rerun is not None else ""
        return f"health: step {self.step}: {self.detail}; {what}{batch}{rerun}"


class StepGuard:
    """The run's non-finite guard and spike detectors, with the stream's `skips`; a `Stateful` of checkpoints."""

    def __init__(self, cfg: HealthConfig, skips: BatchSkips) -> None:
        self.cfg, self.skips = cfg, skips
        self.loss_spikes, self.norm_spikes = _spike_detector(cfg), _spike_detector(cfg)
        self.pending: list[HealthEvent] = []  # this step's events, taken by the AfterStep part
        self.counts: dict[str, int] = {
            "nonfinite": 0, "loss_spike": 0, "grad_norm_spike": 0, "dropped": 0, "rollback": 0
        }  # fmt: skip
        # Rollback (health.spike_policy rollback): the learning rate's factor (checkpointed; exactly 1.0 until a
        # rollback with health.rollback_lr_scale < 1), and the spike step that asked for one or for the stop.
        self.lr_scale = 1.0
        self.rollback_at: int | None = None
        self.stop_at: int | None = None
        self.dropped_in_a_row = 0  # updates dropped since the last applied one (health.max_dropped_in_a_row)
        # What stopped the run at `stop_at`: "rollback" (health.max_rollbacks), or the kind of the last of
        # health.max_dropped_in_a_row updates dropped in a row (nonfinite, loss_spike, grad_norm_spike).
        self.stop_kind = "rollback"
        # What a rollback carries past the checkpoint it restores (`carry_from`): the counts and the lr factor.
        self._carried: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.cfg.nonfinite_guard or self.cfg.spike_policy != "off"

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Whether the update of optimizer step `step` is applied (the same answer on every rank)."""
        applied = self._verdict(step, loss, grad_norm)
        if applied:
            self.dropped_in_a_row = 0
        elif self.rollback_at is None and self.stop_at is None:  # dropped, and the run goes on
            self.dropped_in_a_row += 1
            if self.dropped_in_a_row >= self.cfg.max_dropped_in_a_row:
                self.stop_at = step  # the run's last line says why (`train.rollback.guard_stop`)
                self.stop_kind = self.pending[-1].kind
        return applied

    def _verdict(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        if (
            grad_norm is not None
            and self.cfg.spike_policy in ("off", "warn")
            and not self.cfg.rerun_check
            and (_world() > 1)
        ):
            return self._check_without_collective(step, loss, grad_norm)
        loss_sum, bad_ranks, norm, world = self._agree(loss, grad_norm)
        mean_loss = loss_sum / world
        if bad_ranks > 0:
            if not self.cfg.nonfinite_guard:
                return True
            detail = f"non-finite loss or gradient norm on {int(bad_ranks)} of {world} rank(s)"
            return self._event("nonfinite", step, "skip", math.nan, None, detail)
        return self._spikes(step, mean_loss, norm)

    def _check_without_collective(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """`check` with no collective of its own, when nothing but the gradient norm decides the update: the norm is
        of the gradients the step already synchronised, so it is the same on every rank, and a non-finite loss on any
        rank makes it non-finite everywhere (its gradients are in the sum). A spike is only warned of here, so each
        rank may watch its own loss (rank 0 reports)."""
        values = torch.stack(
            [_plain(loss).float().reshape(()), _plain(grad_norm).float().reshape(()).to(loss.device)]
        )
        local_loss, norm = values.tolist()  # the one host sync of the step
        if not math.isfinite(norm):
            if not self.cfg.nonfinite_guard:
                return True
            detail = (
                "non-finite loss or gradient norm on some rank (the synchronised gradient norm is not finite)"
            )
            return self._event("nonfinite", step, "skip", math.nan, None, detail)
        if not math.isfinite(local_loss):  # its gradients are finite: every rank applies the update alike
            return True
        return self._spikes(step, local_loss, norm)

    def _spikes(self, step: int, mean_loss: float, norm: float | None) -> bool:
        if self.cfg.spike_policy == "off":
            return True
        spike: tuple[str, Spike] | None = None
        found = self.loss_spikes.check(mean_loss)
        if found is not None:
            spike = ("loss", found)
        if self.cfg.spike_on_grad_norm and norm is not None and math.isfinite(norm):
            found = self.norm_spikes.check(norm)
            if spike is None and found is not None:
                spike = ("grad_norm", found)
        if spike is None:
            return True
        what, found = spike
        action = self._spike_action(step)
        return self._event(
            f"{what}_spike", step, action, mean_loss, norm, found.describe(what.replace("_", " "))
        )

    def _spike_action(self, step: int) -> str:
        policy = self.cfg.spike_policy
        if policy != "rollback":
            return policy  # skip | warn
        if self.counts["rollback"] >= self.cfg.max_rollbacks:
            self.stop_at = step
            return "stop"
        self.rollback_at = step
        return "rollback"

    def carry_from(self, previous: StepGuard, *, lr_scale: float) -> None:
        """This guard continues `previous`'s run after a rollback: the checkpoint it restores predates the spike,
        so the run's counts (one more rollback) and the learning-rate factor (× `lr_scale`) come from `previous`,
        applied over the checkpoint's when it loads; the spike histories and dropped batches are the checkpoint's."""
        counts = {**previous.counts, "rollback": previous.counts["rollback"] + 1}
        self._carried = {"counts": counts, "lr_scale": previous.lr_scale * lr_scale}
        self._apply_carried()

    def _apply_carried(self) -> None:
        if self._carried is not None:
            self.counts.update(self._carried["counts"])
            self.lr_scale = float(self._carried["lr_scale"])

    def _event(self, kind: str, step: int, action: str, loss: float, norm: float | None, detail: str) -> bool:
        data_step = self.skips.drop(step) if action == "skip" else None
        self.counts[kind] += 1
        if action == "skip":
            self.counts["dropped"] += 1
        self.pending.append(HealthEvent(kind, step, action, loss, norm, data_step, detail))
        return action not in ("skip", "rollback", "stop")

    @staticmethod
    def _agree(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> tuple[float, float, float | None, int]:
        """(loss summed over ranks, ranks whose loss or norm is not finite, the norm, ranks): one all-reduce."""
        local = _plain(loss).float().reshape(())
        values = [local]
        if grad_norm is not None:
            values.append(_plain(grad_norm).float().reshape(()).to(local.device))
        stacked = torch.stack(values)
        bad = (~torch.isfinite(stacked)).any().float().reshape(1)
        # [loss, norm?, bad]: non-finite values are zeroed so the sum stays finite; `bad` counts those ranks
        packed = torch.cat([torch.nan_to_num(stacked, nan=0.0, posinf=0.0, neginf=0.0), bad])
        world = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            if world > 1:
                torch.distributed.all_reduce(packed)
        summed = packed.tolist()  # the one host sync of the step
        norm = summed[1] / world if grad_norm is not None else None  # the same on every rank: its mean is it
        return summed[0], summed[-1], norm, world

    def add_rerun(self, record: dict[str, Any]) -> None:
        """The re-run check's verdict on this step's events (`health.rerun`)."""
        self.pending = [dataclasses.replace(event, rerun=record) for event in self.pending]

    def take_events(self) -> list[HealthEvent]:
        events, self.pending = self.pending, []
        return events

    def state_dict(self) -> dict[str, Any]:
        return {
            "skips": self.skips.state_dict(),
            "loss_history": self.loss_spikes.state_dict(),
            "grad_norm_history": self.norm_spikes.state_dict(),
            "counts": dict(self.counts),
            "lr_scale": self.lr_scale,
            "dropped_in_a_row": self.dropped_in_a_row,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skips.load_state_dict(state.get("skips", {}))
        self.loss_spikes.load_state_dict(state.get("loss_history", {}))
        self.norm_spikes.load_state_dict(state.get("grad_norm_history", {}))
        self.counts.update({k: int(v) for k, v in state.get("counts", {}).items() if k in self.counts})
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.dropped_in_a_row = int(state.get("dropped_in_a_row", 0))
        self._apply_carried()


def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return 1


def _spike_detector(cfg: HealthConfig) -> SpikeDetector:
    return SpikeDetector(
        window=cfg.spike_window_steps, warmup=cfg.spike_warmup_steps, threshold_mads=cfg.spike_threshold_mads
    )


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A plain local tensor of a value that may be a DTensor (FSDP's gradient norm is one, already reduced)."""
    full = getattr(value, "full_tensor", None)
    return (full() if full is not None else value).detach()
