"""Decoder-only transformer for one device: GPT-2 (`arch="gpt2"`) and Llama 3 (`arch="llama"`) shapes.

Reads like nanoGPT's `model.py` and torchtitan's `llama/model.py`: a stack of identical blocks in `model.layers`
(activation checkpointing and FSDP wrap each one from the outside), plus `tok_embeddings`, `norm` and `output`.
Build on `torch.device("meta")` to get shapes without memory, then `to_empty(device=...)` and `init_weights()`.

    GPT-2: learned positions, LayerNorm, GELU MLP, tied embedding/head   (Radford et al. 2019)
    Llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, untied    (Llama 3 herd paper, arXiv:2407.21783)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch import nn

from gaudi3_scale.models.common import Attention, GeluMLP, SwiGLU, build_dropout, build_norm, build_rope_cache
from gaudi3_scale.models.common.init import Embedding, fill_normal
from gaudi3_scale.models.common.kv_cache import CacheStep, LayerCache
from gaudi3_scale.models.common.moe import GroupedExperts, MoEFeedForward, run_experts_eagerly_under_compile
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.vocab import mask_vocab_padding

__all__ = ["Transformer", "TransformerBlock"]

# nanoGPT `_init_weights` / GPT-2 paper §2.3: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2·L).
INIT_STD = 0.02

_MLPS: dict[str, type[GeluMLP | SwiGLU]] = {"gpt2": GeluMLP, "llama": SwiGLU}


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = build_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = build_norm(cfg)
        # Mixtral: a Llama block whose MLP is routed experts (config validation keeps MoE to llama).
        self.feed_forward = MoEFeedForward(cfg) if cfg.num_experts else _MLPS[cfg.arch](cfg)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor | None = None, kv_cache: LayerCache | None = None
    ) -> torch.Tensor:
        # kv_cache by keyword: tensor parallel's PrepareModuleInput lays out the positional inputs (x, rope) only
        x = x + self.attention(self.attention_norm(x), rope_cache, kv_cache=kv_cache)
        return x + self.feed_forward(self.ffn_norm(x))

    def residual_projections(self) -> list[nn.Linear]:
        """The linears that write into the residual stream; their init std is scaled down with depth (the experts'
        batched w2 too, in `Transformer.init_weights`)."""
        ffn = self.feed_forward
        return [self.attention.wo] if isinstance(ffn, MoEFeedForward) else [self.attention.wo, ffn.w2]


class Transformer(nn.Module):
    """Token ids → logits. `config` is kept on the model so sampling and counting can read its shape."""

    rope_cache: torch.Tensor | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        vocab = cfg.padded_vocab_size  # raises ValueError while vocab_size is unresolved
        self.tok_embeddings = Embedding(vocab, cfg.dim)
        self.pos_embeddings = Embedding(cfg.context_length, cfg.dim) if cfg.arch == "gpt2" else None
        self.dropout = build_dropout(cfg.dropout)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = build_norm(cfg)
        self.output = nn.Linear(cfg.dim, vocab, bias=False)
        self._tie_weights()
        # Non-persistent: derived from the config, so it is neither checkpointed nor sharded.
        rope = (
            build_rope_cache(cfg.head_dim, cfg.context_length, cfg.rope_theta)
            if cfg.arch == "llama"
            else None
        )
        self.register_buffer("rope_cache", rope, persistent=False)

    def forward(self, tokens: torch.Tensor, cache: CacheStep | None = None) -> torch.Tensor:
        """tokens: int64 [batch, seq] → logits [batch, seq, padded_vocab_size]; the padding columns hold the lowest
        finite value of the dtype, so they get no probability (`models.vocab`).

        With `cache` (models/common/kv_cache.py) the tokens are the NEW ones of each row, at `cache.positions`; they
        attend to the row's cached keys too, and their own keys/values are stored. Without it (training) the
        positions are 0..seq-1 and nothing else is done."""
        seq_len = tokens.shape[1]
        if seq_len > self.config.context_length:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds context_length {self.config.context_length}"
            )
        where = (
            slice(seq_len) if cache is None else cache.positions
        )  # a slice, not an arange + gather per step
        h = tokens  # a later pipeline stage (no embeddings: distributed.pipeline) gets hidden states
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings.weight[where]
            h = self.dropout(h)
        # Training passes the whole table and attention takes its first rows: a stage's input may be a sequence
        # shard (sequence parallel), whose length is not the sequence's.
        rope = self.rope_cache
        if rope is not None and cache is not None:
            rope = rope[where]
        for index, layer in enumerate(self.layers):  # decoding (a cache) runs on a whole model only
            h = layer(h, rope) if cache is None else layer(h, rope, cache.layer(index))
        if self.output is None:  # a pipeline stage before the last
            return h
        return self._mask_padding(self.output(self.norm(h)))

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        vocab_size = self.config.vocab_size
        assert vocab_size is not None, "the model is built with its vocabulary resolved"
        # A head swapped for another linear (torchao's Float8Linear, train.fp8_head) returns a view made inside its
        # custom Function, which may not be written in place.
        return mask_vocab_padding(logits, vocab_size, copy=type(self.output) is not nn.Linear)

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            # Press & Wolf 2017 weight tying, as in GPT-2: one matrix embeds tokens and produces logits.
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Transformer:
        # Moving off meta gives every module a fresh Parameter, which would silently untie embedding and head.
        super().to_empty(device=device, recurse=recurse)
        self._tie_weights()
        if self.config.num_experts and self._device().type != "meta":
            run_experts_eagerly_under_compile()  # before anything can compile the blocks (models.common.moe)
        return self

    @torch.no_grad()
    def init_weights(
        self,
        seed: torch.Generator | int | None = None,
        *,
        gathered: Callable[[list[nn.Parameter]], AbstractContextManager[Any]] | None = None,
    ) -> None:
        """(Re)initialize every parameter and buffer in place; call after `to_empty()` when built on meta.

        `seed` is an int, a torch.Generator to draw one from, or None to draw one from the global RNG. Values depend
        only on the seed and each parameter's name (`models.common.init.fill_normal`): the same seed gives bitwise
        the same weights whether the model was built on meta or directly, whole or as FSDP/TP shards on any number
        of ranks.

        `gathered(params)` is entered around each module's initialisation when its parameters are partitioned in a
        way `fill_normal` cannot see (DeepSpeed ZeRO-3's `zero.Init`): under it they are whole, and what is written
        is kept when it exits. One module is gathered at a time.
        """
        device = self._device()
        if device.type == "meta":
            raise ValueError("init_weights needs real storage; call model.to_empty(device=...) first")
        if not isinstance(seed, int):
            device_of = seed.device if isinstance(seed, torch.Generator) else "cpu"
            seed = int(torch.randint(0, 2**62, (1,), generator=seed, device=device_of))
        self._tie_weights()  # idempotent; guards against any other path that replaced the parameters
        residual_std = INIT_STD / math.sqrt(2 * self.config.num_layers)
        blocks = cast(list[TransformerBlock], list(self.layers))
        residual = {id(m) for block in blocks for m in block.residual_projections()}
        for name, module in self.named_modules():
            if module is self.output and self.config.tie_embeddings:
                continue  # shares tok_embeddings.weight, initialized once
            if not isinstance(module, nn.Linear | nn.Embedding | nn.LayerNorm | nn.RMSNorm | GroupedExperts):
                continue
            with gathered(list(module.parameters(recurse=False))) if gathered else nullcontext():
                if isinstance(module, GroupedExperts):
                    for part, param in module.named_parameters(recurse=False):
                        std = residual_std if part == "w2" else INIT_STD
                        fill_normal(param, std, seed=seed, name=f"{name}.{part}")
                elif isinstance(module, nn.Linear):
                    std = residual_std if id(module) in residual else INIT_STD
                    fill_normal(module.weight, std, seed=seed, name=f"{name}.weight")
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, nn.Embedding):
                    fill_normal(module.weight, INIT_STD, seed=seed, name=f"{name}.weight")
                else:
                    module.reset_parameters()
        self.init_buffers()

    def _device(self) -> torch.device:
        """Where the parameters are (a pipeline stage may have no embeddings, but always has a layer)."""
        return next(self.parameters()).device

    def init_buffers(self) -> None:
        """Rebuild the non-persistent buffers (the RoPE cache) on the parameters' device: after `to_empty()` they
        hold garbage, and no checkpoint carries them."""
        if self.rope_cache is not None:
            cfg = self.config
            device = self._device()
            self.rope_cache = build_rope_cache(
                cfg.head_dim, cfg.context_length, cfg.rope_theta, device=device
            )
