"""The `optim` section of the run config: AdamW and its learning-rate schedule (built by `train.optim`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gaudi3_scale.config.core import check_positive, check_range
from gaudi3_scale.config.errors import ConfigError

__all__ = ["OptimConfig"]


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate after warmup"})
    min_lr: float = field(
        default=1e-4,
        metadata={
            "help": "learning rate the decay reaches at max_steps: the last step trained runs one decay step above "
            "it, as Hugging Face's get_cosine_schedule_with_warmup does"
        },
    )
    warmup_steps: int = field(default=100, metadata={"help": "linear warmup, in optimizer steps"})
    schedule: Literal["cosine", "linear", "constant"] = field(
        default="cosine",
        metadata={"help": "decay from lr (the step after warmup's) to min_lr (reached at max_steps)"},
    )
    weight_decay: float = field(
        default=0.1, metadata={"help": "AdamW decoupled weight decay (not on norms/biases)"}
    )
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.99, metadata={"help": "AdamW beta2"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    grad_clip_norm: float = field(default=1.0, metadata={"help": "clip the global gradient L2 norm; 0 = off"})
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = field(
        default="auto", metadata={"help": "AdamW kernel: auto picks fused where torch has it for the device"}
    )

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ConfigError("min_lr", f"must be <= lr ({self.lr}), got {self.min_lr}")
        check_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_range("beta1", self.beta1, 0.0, 0.999999)
        check_range("beta2", self.beta2, 0.0, 0.999999)
        check_positive("eps", self.eps)
        check_positive("grad_clip_norm", self.grad_clip_norm, allow_zero=True)
