"""Normalization and dropout constructors that pick the variant an architecture uses."""

from __future__ import annotations

from torch import nn

from gaudi3_scale.models.config import ModelConfig

__all__ = ["build_dropout", "build_norm"]


def build_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm for GPT-2 (Radford et al. 2019) and BERT (Devlin et al. 2018), RMSNorm for Llama (Zhang & Sennrich
    2019; Touvron et al. 2023)."""
    if cfg.arch in ("gpt2", "bert"):
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)
    return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)


def build_dropout(p: float) -> nn.Module:
    # Identity when disabled: the default CPU run uses dropout 0 and should not pay for a no-op call per layer.
    return nn.Dropout(p) if p > 0 else nn.Identity()
