"""AdamW with decoupled weight decay on matrices only, and a warmup + decay learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gaudi3_scale.device.optim import GaudiOptimizer
from gaudi3_scale.models.common.init import logical_shape
from gaudi3_scale.train.optim_config import OptimConfig

__all__ = ["build_lr_lambda", "build_optimizer", "lr_at_step"]


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, device_type: str) -> torch.optim.Optimizer:
    """AdamW; weight decay only on tensors with ≥ 2 dims (matmuls, embeddings), as in GPT-2/nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    # the model's shapes, also for parameters ZeRO-3 partitioned as they were built (models.common.init)
    decay = [p for p in params if len(logical_shape(p)) >= 2]
    no_decay = [p for p in params if len(logical_shape(p)) < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if device_type == "hpu" and cfg.implementation in ("auto", "fused"):
        # torch's fused AdamW has no HPU kernel; Habana ships one (device/optim.py). Not yet validated on Gaudi.
        return GaudiOptimizer.FusedAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    kernel: dict[str, bool] = {}
    impl = cfg.implementation
    if impl == "auto":
        # torch ships a fused AdamW kernel for CPU and CUDA (torch >= 2.4); it is one kernel for all tensors.
        impl = "fused" if device_type in ("cpu", "cuda") else "foreach"
    if impl == "fused":
        kernel["fused"] = True
    elif impl == "foreach":
        kernel["foreach"] = True
    else:
        kernel["foreach"] = False
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


def lr_at_step(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup reaching lr on its last step, then
    cosine/linear decay from lr to min_lr at step `max_steps`, one past the last step trained (the convention of
    transformers' get_cosine_schedule_with_warmup: the last step's rate is one decay step above min_lr)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    coeff = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def build_lr_lambda(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Multiplier form for `torch.optim.lr_scheduler.LambdaLR` (its base lr is cfg.lr)."""
    return lambda step: lr_at_step(step, cfg, max_steps) / cfg.lr
