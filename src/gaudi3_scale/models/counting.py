"""Parameter counts and training FLOPs per token, from the config alone (the model is built on meta).

FLOPs convention — PaLM (Chowdhery et al. 2022, arXiv:2204.02311) Appendix B, as implemented by nanoGPT
`GPT.estimate_mfu` and torchtitan `get_num_flop_per_token`:

    training FLOPs per token = 6·N + 12·L·H·Q·T

* 6·N: each parameter does one multiply-add (2 FLOPs) per token forward and two backward (Kaplan et al. 2020 §2.1).
  N counts only parameters that take part in a matmul: all parameters minus the lookup-only embedding tables
  (nanoGPT `get_num_params(non_embedding=True)`). So GPT-2's position table is excluded but its tied token
  embedding stays in, because it is also the output head; Llama's untied `tok_embeddings` is excluded and its
  `output` head stays in (torchtitan subtracts `tok_embeddings`). Norm weights and biases are included (≪ 1%).
  Note this N is *not* Kaplan's "non-embedding" N, which also drops the tied head.
  For a mixture of experts N is the *active* count: a token passes through k of the E experts of each block, so
  the experts' weights count k/E (router included in full); this is what MFU and the cost planner use. Weights,
  gradients and optimizer state are the *total* count (`count_parameters(cfg)`, the memory estimator's).
* 12·L·H·Q·T: the attention score (QKᵀ) and weighted-sum (AV) matmuls, 2 matmuls × 2 FLOPs × 3 (fwd + bwd),
  with L layers, H query heads, Q head dim, T sequence length. Causal masking is *not* discounted (PaLM counts
  the full T×T product), grouped kv heads do not reduce it, and activation recomputation is not added.
"""

from __future__ import annotations

import torch

from gaudi3_scale.models.build import build_model
from gaudi3_scale.models.common.moe import GroupedExperts
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.transformer import Transformer
from gaudi3_scale.models.vocab import VOCAB_TABLES

__all__ = ["count_parameters", "flops_per_token", "forward_flops_per_token"]


def _build_on_meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return build_model(cfg)


def _lookup_only_embeddings(model: Transformer) -> list[torch.Tensor]:
    tables = [] if model.pos_embeddings is None else [model.pos_embeddings.weight]
    if (types := getattr(model, "type_embeddings", None)) is not None:  # bert's segment table
        tables.append(types.weight)
    if model.output.weight is not model.tok_embeddings.weight:
        tables.append(model.tok_embeddings.weight)
    return tables


def count_parameters(
    cfg: ModelConfig, *, trainable_only: bool = True, exclude_embeddings: bool = False, active: bool = False
) -> int:
    """Parameters of the model `cfg` describes; tied weights are counted once, vocabulary padding rows not at all
    (they are never sampled, so a padded GPT-2 still counts its published 124 M).

    exclude_embeddings drops the lookup-only tables (see the module docstring), leaving the matmul parameters.
    active counts what one token uses: experts_per_token of num_experts experts (Mixtral 8x7B: 12.9 B of 46.7 B).
    """
    model = _build_on_meta(cfg)
    params = [
        p for p in model.parameters() if p.requires_grad or not trainable_only
    ]  # parameters() dedups ties
    if exclude_embeddings:
        lookup = {id(p) for p in _lookup_only_embeddings(model)}
        params = [p for p in params if id(p) not in lookup]
    assert cfg.vocab_size is not None  # build_model refused an unresolved vocabulary
    padding_rows = cfg.padded_vocab_size - cfg.vocab_size
    vocab_tables = {id(p) for name, p in model.named_parameters() if name in VOCAB_TABLES}
    total = sum(p.numel() - (padding_rows * p[0].numel() if id(p) in vocab_tables else 0) for p in params)
    if active and cfg.num_experts:
        counted = {id(p) for p in params}
        experts = [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
        idle = cfg.num_experts - cfg.experts_per_token
        total -= sum(p.numel() // cfg.num_experts * idle for p in experts if id(p) in counted)
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training (forward + backward) FLOPs per token at `seq_len` (default: the full context)."""
    seq_len = cfg.context_length if seq_len is None else seq_len
    if not 0 < seq_len <= cfg.context_length:
        raise ValueError(f"seq_len must be in 1..{cfg.context_length} (context_length), got {seq_len}")
    n = count_parameters(cfg, trainable_only=False, exclude_embeddings=True, active=True)
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return float(6 * n + attention)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Forward-only FLOPs per token: one third of the training figure (backward costs twice the forward)."""
    return flops_per_token(cfg, seq_len) / 3.0
