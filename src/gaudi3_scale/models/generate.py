"""Autoregressive sampling, nanoGPT's `GPT.generate` with argument checks, a seedable generator and a KV cache.

With the cache (the default) the prompt runs once and each new token is one position wide. Past `context_length`
the model sees only the last `context_length` tokens, at positions 0.. again, so every hidden state changes and no
cached key is valid any more: from there each token recomputes that cropped window, exactly as `use_cache=False`
does at every step. The policy keeps the two paths equal (greedy tokens are the same) at the price of the cache's
speed once a sequence outgrows the context; a sliding window that kept old keys would be faster but would give
other tokens than the model was trained to give.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.config.numbers import is_number
from gaudi3_scale.models.common.kv_cache import KVCache
from gaudi3_scale.models.config import ModelConfig

__all__ = ["GREEDY_BELOW_TEMPERATURE", "generate", "sample_next_token"]

# Temperatures below this sample greedily: vLLM's `_SAMPLING_EPS` (vllm/sampling_params.py), which treats them as 0.
# Dividing logits by a smaller one overflows float32 (5e-324 is 0 there, 1e-44 leaves a NaN after softmax), and at
# 1e-5 a logit gap of 1e-3 already weighs e^100 : 1, so the draw is the argmax in all but ties.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _check_args(prompt: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if prompt.ndim != 2 or prompt.shape[1] == 0 or prompt.dtype != torch.long:
        raise ValueError(
            f"prompt must be a non-empty int64 tensor [batch, tokens], got {prompt.dtype} {tuple(prompt.shape)}"
        )
    # bool is an int to Python but never a count; NaN compares False with everything, so "finite" is checked first.
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise UserInputError(f"max_new_tokens must be an integer >= 0, got {brief(max_new_tokens)}")
    if not is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise UserInputError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {brief(temperature)}"
        )
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise UserInputError(f"top_k must be an integer >= 1 or None, got {brief(top_k)}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _model_config(model: nn.Module) -> ModelConfig:
    # Read through wrappers too: torch.compile's OptimizedModule forwards attribute lookups to the model.
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig) or cfg.vocab_size is None:
        raise TypeError(
            f"generate needs a model made by build_model (with .config), got {type(model).__name__}"
        )
    return cfg


def sample_next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    *,
    top_p: float | None = None,
) -> torch.Tensor:
    """logits [batch, vocab] → next token ids [batch, 1]; temperature 0 (or below `GREEDY_BELOW_TEMPERATURE`) =
    greedy.

    Filters apply in the order of transformers' samplers: temperature, then top_k, then top_p (nucleus sampling,
    Holtzman et al. 2020, arXiv:1904.09751: the fewest most likely tokens whose probability reaches top_p; the most
    likely token always stays, however small top_p, as transformers' `min_tokens_to_keep`). Any temperature and
    top_p of their ranges gives finite probabilities for finite logits.
    """
    if temperature < GREEDY_BELOW_TEMPERATURE:
        return logits.argmax(dim=-1, keepdim=True)
    # Shifted so that the largest is 0 before the division: softmax does not change, and nothing overflows to +inf.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_best = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # The probability mass of the more likely tokens. A top_p below float32's smallest number compares as 0,
        # so the most likely token is kept explicitly.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Extend `prompt` [batch, T0] by `max_new_tokens` sampled tokens; returns [batch, T0 + max_new_tokens].

    temperature 0 is greedy (argmax); top_k keeps only the k most likely tokens. The model runs in eval mode
    (restored afterwards) and sees at most its last `context_length` tokens. Padding rows of the vocabulary are
    never sampled, nor ids from `vocab_size` on (a tokenizer with fewer tokens than the model's embedding rows, as a
    Hugging Face model fine-tuned on bytes: those ids decode to nothing). `use_cache=False` re-runs the (cropped)
    context for every token: the reference the cache is tested against.
    """
    _check_args(prompt, max_new_tokens, temperature, top_k)
    cfg = _model_config(model)
    assert cfg.vocab_size is not None  # _model_config refused an unresolved vocabulary
    sampled_vocab = cfg.vocab_size if vocab_size is None else min(cfg.vocab_size, vocab_size)
    was_training = model.training
    model.eval()
    tokens = prompt
    # The longest sequence fed with a cache is prompt + max_new_tokens - 1 tokens, and never past the context.
    capacity = min(cfg.context_length, prompt.shape[1] + max_new_tokens - 1)
    use_cache = use_cache and prompt.shape[1] < capacity
    cache = KVCache.for_model(model, prompt.shape[0], capacity=capacity) if use_cache else None
    cached = 0  # leading tokens whose keys and values the cache holds
    try:
        for _ in range(max_new_tokens):
            logits = _next_logits(model, tokens, cache, cached, cfg.context_length)[:, :sampled_vocab].float()
            cached = tokens.shape[1]
            tokens = torch.cat((tokens, sample_next_token(logits, temperature, top_k, generator)), dim=1)
    finally:
        model.train(was_training)
    return tokens


def _next_logits(
    model: nn.Module, tokens: torch.Tensor, cache: KVCache | None, cached: int, context_length: int
) -> torch.Tensor:
    """Logits [batch, vocab] after `tokens`; with a cache only the tokens it does not hold yet run (see the
    module docstring for what happens past the context)."""
    length = tokens.shape[1]
    if cache is None or length > context_length:
        return model(tokens[:, -context_length:])[:, -1]
    positions = torch.arange(cached, length, device=tokens.device).expand(tokens.shape[0], -1)
    return model(tokens[:, cached:], cache.step(positions, key_length=length))[:, -1]
