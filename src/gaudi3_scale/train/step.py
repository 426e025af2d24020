"""The step contract: what one optimizer step needs and what it produces, in one typed object.

The module writes a `StepState` at every micro-step; the callbacks (metrics, checkpoints, interrupts, cost,
profiler) are handed the same object when the trainer builds them and only read it. Nothing travels by attribute
lookups on the LightningModule.

    needs     batch plan (tokens per step, accumulation), FLOPs per token
    produces  micro_step (0 = an optimizer step just ended), loss, grad_norm, lr, extra metrics, compute time
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gaudi3_scale.distributed.plan import BatchPlan

__all__ = ["StepState", "SteppedModule", "at_step_boundary", "step_state_of"]


@dataclass(slots=True, kw_only=True, eq=False)
class StepState:
    """Written by the training step, read by callbacks.

    `loss` and `grad_norm` are detached device tensors (no host sync on steps nobody logs); `loss` is the mean over
    the step's micro-batches. `lr` is the learning rate the last optimizer step used.
    """

    tokens_per_step: int = 0  # global batch × context length; 0 = unknown (no tokens/s)
    flops_per_token: float | None = None  # training FLOPs per token (forward + backward), for MFU
    accumulation: int = 1  # micro-steps per optimizer step on each rank
    micro_step: int = 0  # micro-batches done in the current optimizer step
    loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    lr: float | None = None
    update_dropped: bool = False  # the health guard dropped this step's update (global_step did not advance)
    # Host seconds of this rank's own compute in the current optimizer step (train.module: its forwards, before it
    # can wait for other ranks); None: the module does not measure it. RunMetrics reads and resets it every step.
    compute_s: float | None = None
    # More scalars of the last micro-step, by metrics-record field (e.g. `train/moe_aux_loss`); detached tensors.
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def for_plan(cls, plan: BatchPlan, *, flops_per_token: float | None) -> StepState:
        return cls(
            tokens_per_step=plan.tokens_per_step,
            flops_per_token=flops_per_token,
            accumulation=plan.accumulation,
        )

    @property
    def at_boundary(self) -> bool:
        """An optimizer step just ended (or none has started): the last micro-batch of its group is done."""
        return self.micro_step == 0


class SteppedModule:
    """Base of LightningModules that keep the step contract (ours: `train.module.LanguageModel`): they own a
    `step_state` and write it in their training step. A plain class, not a Protocol: callbacks test for it on
    every batch, and a plain isinstance is ~0.1 µs where a runtime Protocol check is several µs."""

    step_state: StepState


def step_state_of(module: object) -> StepState:
    """The module's `StepState`; a LightningModule of the user's own gets one from what it declares.

    A user module may set `tokens_per_step` and `flops_per_token` (then it gets tokens/s and MFU). Lightning does
    its accumulation, so every batch it hands our callbacks counts as a boundary (`micro_step` stays 0).
    """
    if isinstance(module, SteppedModule):
        return module.step_state
    return StepState(
        tokens_per_step=int(getattr(module, "tokens_per_step", 0) or 0),
        flops_per_token=getattr(module, "flops_per_token", None),
    )


def at_step_boundary(module: object) -> bool:
    """Whether the batch that just ended finished an optimizer step (always, for a module of the user's own)."""
    return not isinstance(module, SteppedModule) or module.step_state.micro_step == 0
