"""BERT encoder for one device (`arch="bert"`): Devlin et al. 2018, "BERT: Pre-training of Deep Bidirectional
Transformers for Language Understanding", arXiv:1810.04805.

    embeddings  word + learned absolute position + token type (segment), then LayerNorm and dropout
    block       post-LayerNorm, as the original (Vaswani et al. 2017 §3.1): x = norm(x + attention(x)), then
                x = norm(x + feed_forward(x)); attention is bidirectional (no causal mask), the MLP is GELU
    MLM head    dense (dim → dim) + GELU + LayerNorm, then the decoder: the word-embedding matrix (tied) plus a
                per-token bias — the `cls.predictions` head of Google's checkpoints and HF's `BertForMaskedLM`

There is no pooler (the [CLS] dense + tanh that feeds next-sentence prediction): the objective here is MLM only,
as RoBERTa (Liu et al. 2019, arXiv:1907.11692) found NSP unnecessary, and HF's `BertForMaskedLM` has none either.

`Encoder` subclasses `Transformer` so that everything written for the registry models — weight tying that
survives `to_empty`, the layout-independent seeded init, FSDP / activation checkpointing over `layers`, pretrained
loading, counting — applies unchanged; only the modules and the forward differ. Its `output` is the MLM decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gaudi3_scale.models.common import Attention, GeluMLP, build_dropout, build_norm
from gaudi3_scale.models.common.init import Embedding
from gaudi3_scale.models.common.kv_cache import CacheStep
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.transformer import Transformer

__all__ = ["Encoder", "EncoderBlock", "MlmHead"]


class EncoderBlock(nn.Module):
    """Post-norm block (HF `BertLayer`): LayerNorm after each residual sum, not before each sublayer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg, causal=False)
        self.attention_norm = build_norm(cfg)
        self.feed_forward = GeluMLP(cfg)
        self.ffn_norm = build_norm(cfg)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x))
        return self.ffn_norm(x + self.feed_forward(x))

    def residual_projections(self) -> list[nn.Linear]:
        """None: BERT initialises every linear with N(0, 0.02) (its `initializer_range`), with no depth scaling —
        post-norm re-normalises the residual stream after each sublayer."""
        return []


class MlmHead(nn.Module):
    """The transform before the decoder (HF `BertPredictionHeadTransform`): dense, GELU, LayerNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.norm = build_norm(cfg)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x), approximate=self.approximate))


class Encoder(Transformer):
    """Token ids (and optional token types) → MLM logits [batch, seq, padded_vocab_size] for every position."""

    pos_embeddings: Embedding  # always learned positions (optional in Transformer)

    def __init__(self, cfg: ModelConfig) -> None:
        # Not Transformer.__init__: the modules differ; the methods inherited only read the attributes set here.
        nn.Module.__init__(self)
        self.config = cfg
        vocab = cfg.padded_vocab_size  # raises ValueError while vocab_size is unresolved
        self.tok_embeddings = Embedding(vocab, cfg.dim)
        self.pos_embeddings = Embedding(cfg.context_length, cfg.dim)
        self.type_embeddings = Embedding(cfg.type_vocab_size, cfg.dim)
        self.embedding_norm = build_norm(cfg)
        self.dropout = build_dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))
        self.mlm_head = MlmHead(cfg)
        # The decoder's bias is per token (HF `cls.predictions.bias`); its weight is the word embedding when tied.
        self.output = nn.Linear(cfg.dim, vocab, bias=True)
        self._tie_weights()
        self.register_buffer("rope_cache", None, persistent=False)  # learned positions: no rotary cache

    def forward(
        self, tokens: torch.Tensor, cache: CacheStep | None = None, *, token_types: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (and token_types, default all 0): int64 [batch, seq] → logits [batch, seq, padded_vocab_size], the
        padding columns masked as `Transformer.forward`'s.
        An encoder reads the whole sequence at once: there is no KV cache to pass."""
        if cache is not None:
            raise ValueError(
                "an encoder (arch bert) has no KV cache: it attends both ways over the whole sequence"
            )
        seq_len = tokens.shape[1]
        if seq_len > self.config.context_length:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds context_length {self.config.context_length}"
            )
        h = self.tok_embeddings(tokens) + self.pos_embeddings.weight[:seq_len]
        # Type 0 is one row added everywhere: no gather of a zeros tensor for single-segment text.
        h = h + (self.type_embeddings.weight[0] if token_types is None else self.type_embeddings(token_types))
        h = self.dropout(self.embedding_norm(h))
        for layer in self.layers:
            h = layer(h)
        return self._mask_padding(self.output(self.mlm_head(h)))

    @torch.no_grad()
    def init_weights(
        self,
        seed: torch.Generator | int | None = None,
        *,
        gathered: Callable[[list[nn.Parameter]], AbstractContextManager[Any]] | None = None,
    ) -> None:
        """`Transformer.init_weights` (N(0, 0.02) linears and embeddings, zero biases, unit norms), plus the tied
        decoder's bias, which that method skips with the tied head."""
        super().init_weights(seed, gathered=gathered)
        with gathered([self.output.bias]) if gathered else nullcontext():
            nn.init.zeros_(self.output.bias)
