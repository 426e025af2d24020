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
epochs, i.e. samples) and max_steps × 1/k, both rounded up; so does every other field counted in steps
(`STEP_FIELDS`: checkpoint, validation, logging, profiling and spike intervals, `rescale_step_fields`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from gaudi3_scale.health.config import MIN_SPIKE_WARMUP_STEPS

__all__ = ["LR_RULES", "STEP_FIELDS", "LrRule", "RescaledSchedule", "rescale_schedule", "rescale_step_fields"]

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


# Every run-config field counted in optimizer steps, by section, besides optim.warmup_steps and train.max_steps (their
# rescale is tune.lr.rescale_schedule's). A global batch k times larger takes k times fewer steps over the same tokens,
# so each keeps its token count at 1/k of its steps; otherwise a run tuned to 8× the batch checkpoints, validates and
# watches for spikes 8× less often per token, and one shorter than checkpoint.every_steps never checkpoints at all.
STEP_FIELDS: dict[str, tuple[str, ...]] = {
    "train": ("val_every_steps", "log_every_steps", "throughput_warmup_steps", "profile_start_step",
              "profile_num_steps"),
    "checkpoint": ("every_steps", "keep_every_steps", "light_every_steps"),
    # rollback_skip_batches: data steps a rollback skips (batches of the global batch)
    "health": ("spike_window_steps", "spike_warmup_steps", "rollback_skip_batches"),
    "benchmark": ("warmup_steps",),
}  # fmt: skip


def _steps_at(steps: int | None, k: float) -> int | None:
    """`steps` at 1/k, rounded half up; None and 0 (off, or step 0) stay, any other count stays at least 1."""
    if not steps:
        return steps
    return max(1, math.floor(steps / k + 0.5))


def _keep_within_the_run(train: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    """What rounding each field on its own may push past the rescaled run (`train.max_steps`, rounded up) or onto
    another field, put back where the config takes it: the throughput warm-up leaves a measured step, the profile
    window ends by the last step (its length kept where it fits), light checkpoints that would all fall on full
    ones are off (the full checkpoint wins at such a step: none would be written)."""
    max_steps = train["max_steps"]
    warmup = train["throughput_warmup_steps"]
    if warmup is not None and warmup >= max_steps:
        train["throughput_warmup_steps"] = max(0, max_steps - 1)
    start, length = train["profile_start_step"], train["profile_num_steps"]
    if start is not None and start + length > max_steps:
        train["profile_num_steps"] = length = max(1, min(length, max_steps))
        train["profile_start_step"] = max(0, max_steps - length)
    light, full = checkpoint["light_every_steps"], checkpoint["every_steps"]
    if light and full and light % full == 0:
        checkpoint["light_every_steps"] = 0


def rescale_step_fields(raw: dict[str, Any], k: float) -> list[str]:
    """`STEP_FIELDS` of `raw` (a run config as `to_dict` gives it) for a global batch k times larger; returns the
    fields that changed, as "section.field old → new"."""
    before = {(sec, name): raw[sec][name] for sec, names in STEP_FIELDS.items() for name in names}
    for (sec, name), steps in before.items():
        raw[sec][name] = _steps_at(steps, k)
    # checkpoints kept at multiples of keep_every_steps are the ones written every every_steps: it stays a multiple
    every, keep = before["checkpoint", "every_steps"], before["checkpoint", "keep_every_steps"]
    if every and keep and keep % every == 0:
        raw["checkpoint"]["keep_every_steps"] = raw["checkpoint"]["every_steps"] * (keep // every)
    # the fewest steps a spike is judged against, and a window that holds them (health.config)
    health = raw["health"]
    health["spike_warmup_steps"] = max(MIN_SPIKE_WARMUP_STEPS, health["spike_warmup_steps"])
    health["spike_window_steps"] = max(health["spike_warmup_steps"], health["spike_window_steps"])
    _keep_within_the_run(raw["train"], raw["checkpoint"])
    return [
        f"{sec}.{name} {old} → {raw[sec][name]}"
        for (sec, name), old in before.items()
        if raw[sec][name] != old
    ]
