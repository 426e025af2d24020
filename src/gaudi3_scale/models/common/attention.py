"""Self-attention with grouped-query heads (Ainslie et al. 2023, arXiv:2305.13245) and optional RoPE; causal for the
decoders, bidirectional (`causal=False`) for the BERT encoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gaudi3_scale.models.common.kv_cache import LayerCache
from gaudi3_scale.models.common.norms import build_dropout
from gaudi3_scale.models.common.rope import apply_rope
from gaudi3_scale.models.config import ModelConfig

__all__ = ["Attention"]


class Attention(nn.Module):
    """Multi-head attention, causal unless `causal=False`; `num_kv_heads < num_heads` shares each key/value head across
    a query group.

    Separate `wq` / `wk` / `wv` projections (torchtitan's layout) rather than one fused matrix, so tensor parallel
    can shard each column-wise and Meta/HF checkpoints map one-to-one. `wo` is the residual output projection.
    """

    def __init__(self, cfg: ModelConfig, *, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=cfg.bias)
        self.attn_dropout_p = cfg.dropout
        self.resid_dropout = build_dropout(cfg.dropout)
        self.enable_gqa = cfg.kv_heads != cfg.num_heads

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor | None = None, kv_cache: LayerCache | None = None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: after tensor parallel shards wq/wk/wv, each rank holds only its local heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        if rope_cache is not None:
            # In training the model passes its whole [context, …] table: this sequence's rows.
            if rope_cache.dim() == 3:
                rope_cache = rope_cache[:seq_len]
            q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        if (
            kv_cache is not None
        ):  # decoding: attend to this sequence's cached keys too (models/common/kv_cache.py)
            keys, values = kv_cache.update(k, v)
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=kv_cache.mask, enable_gqa=self.enable_gqa
            )
            return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(batch, seq_len, -1)))
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=self.attn_dropout_p if self.training else 0.0,
            is_causal=self.causal,
            enable_gqa=self.enable_gqa,
        )
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(batch, seq_len, -1)))
