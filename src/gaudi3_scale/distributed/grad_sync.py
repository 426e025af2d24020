"""What a data-parallel strategy does around the micro-steps of one optimizer step, so the training step has no
distribution logic: it asks `GradientSync` to run the forward pass, whether to divide the loss by the
accumulation, whether to clip, and tells it where the accumulation boundary is.

- No wrapper (one process, FSDP2): nothing to do; gradients are reduced by FSDP's own hooks at every backward.
- DDP all-reduces gradients only on the last micro-batch of an optimizer step (what `no_sync` does).
- DeepSpeed's engine runs the forward pass (its hooks, bf16 casts), divides the loss by the accumulation itself,
  reduces gradients at the boundary it is told, and clips inside its own step (gradients live in its partitions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DDPSync", "DeepSpeedSync", "GradientSync", "gradient_sync"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GradientSync:
    """One process or FSDP2: the step runs the loss function as is and clips the gradients itself."""

    divides_loss = False  # the strategy divides the loss by the accumulation itself
    clips = False  # the strategy clips gradients inside its optimizer step

    def begin_micro_step(self, last: bool) -> None:
        """Called before each micro-batch's forward pass; `last` = it ends an optimizer step."""

    def forward(self, loss_fn: LossFn, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(tokens, targets)

    def grad_norm(self) -> torch.Tensor | None:
        """The gradient norm the strategy clipped to, when it clips (`clips`)."""
        return None


class DDPSync(GradientSync):
    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        self.ddp = ddp

    def begin_micro_step(self, last: bool) -> None:
        # Read by DDP's forward, which Lightning runs training_step inside: set before it.
        self.ddp.require_backward_grad_sync = last


class DeepSpeedSync(GradientSync):
    divides_loss = True
    clips = True

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def begin_micro_step(self, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)

    def forward(self, loss_fn: LossFn, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.engine(tokens, targets)  # the engine calls the module's forward, which runs loss_fn

    def grad_norm(self) -> torch.Tensor | None:
        return torch.tensor(float(self.engine.get_global_grad_norm()))


def gradient_sync(wrapped: Any) -> GradientSync:
    """The sync for the module as the strategy wrapped it (`trainer.strategy.model`)."""
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return DDPSync(wrapped)
    if hasattr(wrapped, "set_gradient_accumulation_boundary"):  # a DeepSpeedEngine (deepspeed is optional)
        return DeepSpeedSync(wrapped)
    return GradientSync()
