"""Learning rate, warmup and length of a run when the tuner changes its global batch.

A global batch k times larger takes k times fewer optimizer steps over the same tokens, so the step size must grow
to keep the progress per token. Two cited rules:

- ``linear``: lr × k. Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
  arXiv:1706.02677, §2.1 ("when the minibatch size is multiplied by k, multiply the learning rate by k"), for SGD.
- ``sqrt``: lr × √k, and nothing else. Krizhevsky 2014, "One weird trick for parallelizing convolutional neural
  networks", arXiv:1404.5997, §5. For adaptive optimizers (Adam/AdamW) Malladi et al. 2022, "On the SDEs and
  Scaling Rules for Adaptive Gradient Algorithms", arXiv:2205.10287, derive a square-root scaling rule whose
  learning-rate part this is; their rule also changes Adam's other hyperparameters (1 − β₁ and 1 − β₂ times k,
  ε over √k), which we leave unchanged: the winner keeps the config's betas and eps. Our default, since we train
  with AdamW.
- ``none``: keep the learning rate.

Warmup and run length keep their token counts: warmup_steps × 1/k (Goyal et al. warm up over a fixed number of
epochs, i.e. samples) and max_steps × 1/k, both rounded up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["LR_RULES", "LrRule", "RescaledSchedule", "rescale_schedule"]

LrRule = Literal["sqrt", "linear", "none"]
LR_RULES: dict[str, str] = {
    "sqrt": "lr × √k, betas and eps kept (the learning-rate part of Malladi et al. 2022's square-root rule, "
    "arXiv:2205.10287; Krizhevsky 2014, arXiv:1404.5997)",
    "linear": "lr × k (Goyal et al. 2017, arXiv:1706.02677)",
    "none": "keep lr",
}


@dataclass(frozen=True)
class RescaledSchedule:
    lr: float
    min_lr: float
    warmup_steps: int
    max_steps: int
    factor: float  # new global batch / old global batch

    def describe(self, rule: str, *, max_epochs: int | None = None) -> str:
        """What changed, for the tuner's note; `max_epochs`: the run's length in epochs (its steps not rescaled)."""
        if self.factor == 1:
            return "global batch unchanged: learning rate, warmup and steps kept"
        length = (
            f"warmup {self.warmup_steps} steps keeps its token count; max_epochs {max_epochs} sets the length"
            if max_epochs is not None
            else f"warmup {self.warmup_steps} and max_steps {self.max_steps} steps keep their token counts"
        )
        return f"global batch ×{self.factor:g}: lr {self.lr:.3g}, min_lr {self.min_lr:.3g} ({LR_RULES[rule]}); {length}"


def rescale_schedule(
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    from_batch: int,
    to_batch: int,
    rule: LrRule,
) -> RescaledSchedule:
    """The schedule for a global batch of `to_batch` sequences, given one tuned for `from_batch`."""
    if from_batch < 1 or to_batch < 1:
        raise ValueError(f"global batches must be positive, got {from_batch} → {to_batch}")
    if rule not in LR_RULES:
        raise ValueError(f"unknown learning-rate rule {rule!r}; choose one of {', '.join(LR_RULES)}")
    k = to_batch / from_batch
    scale = {"sqrt": math.sqrt(k), "linear": k, "none": 1.0}[rule]
    return RescaledSchedule(
        lr=lr * scale,
        min_lr=min_lr * scale,
        warmup_steps=math.ceil(warmup_steps / k),
        max_steps=max(1, math.ceil(max_steps / k)),
        factor=k,
    )
