"""Position-wise feed-forward blocks. Both name their residual output projection `w2` (init scales it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gaudi3_scale.models.common.norms import build_dropout
from gaudi3_scale.models.config import ModelConfig

__all__ = ["GeluMLP", "SwiGLU"]


class GeluMLP(nn.Module):
    """GPT-2 MLP: w2(gelu(w1 x)) with hidden width 4·dim by default."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.bias)
        self.dropout = build_dropout(cfg.dropout)
        # GPT-2 used the tanh approximation (openai/gpt-2 src/model.py `gelu`); nanoGPT and most reproductions
        # use the exact erf form, whose CPU kernel is an order of magnitude faster in torch 2.13.
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate=self.approximate)))


class SwiGLU(nn.Module):
    """Llama MLP: w2(silu(w1 x) · w3 x) (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.bias)
        self.dropout = build_dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))
