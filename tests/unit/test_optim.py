"""Learning-rate schedule and optimizer parameter groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gaudi3_scale.train.optim import build_optimizer, lr_at_step
from gaudi3_scale.train.optim_config import OptimConfig


def test_warmup_then_cosine_to_min_lr() -> None:
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100)
    assert lr_at_step(0, cfg, 2000) == pytest.approx(1e-5)
    assert lr_at_step(99, cfg, 2000) == pytest.approx(1e-3)
    assert lr_at_step(100, cfg, 2000) == pytest.approx(1e-3)
    mid = 100 + (2000 - 100) // 2
    assert lr_at_step(mid, cfg, 2000) == pytest.approx(
        1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * 0.5))
    )
    assert lr_at_step(2000, cfg, 2000) == pytest.approx(1e-4)
    assert lr_at_step(5000, cfg, 2000) == pytest.approx(1e-4)


def test_linear_and_constant() -> None:
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear")
    assert lr_at_step(50, lin, 100) == pytest.approx(0.5)
    const = OptimConfig(lr=0.3, min_lr=0.0, warmup_steps=0, schedule="constant")
    assert lr_at_step(77, const, 100) == 0.3


def test_weight_decay_only_on_matrices() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2} and {p.dim() for p in no_decay["params"]} == {1}
    assert len(decay["params"]) == 2 and len(no_decay["params"]) == 3
    assert opt.defaults["fused"] is True  # torch has a fused AdamW for CPU
    loss = model[2](model[1](model[0](torch.tensor([1, 2])))).sum()
    loss.backward()
    opt.step()
