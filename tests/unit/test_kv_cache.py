"""KV cache: prefill + one-token decode steps give the full forward's logits, per-row positions, masks, GQA shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gaudi3_scale.models import Transformer, build_model, get_model_config
from gaudi3_scale.models.common.kv_cache import KVCache

CONTEXT = 24
SHAPES = {"gpt2": ("shakespeare-char", None), "llama": ("llama-tiny", None), "llama-gqa": ("llama-tiny", 1)}


def _model(shape: str) -> Transformer:
    name, kv_heads = SHAPES[shape]
    cfg = replace(get_model_config(name), vocab_size=97, context_length=CONTEXT, num_layers=2)
    if kv_heads is not None:
        cfg = replace(cfg, num_kv_heads=kv_heads)
    return build_model(cfg, seed=0).eval()


def _tokens(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", list(SHAPES))  # learned positions, RoPE, RoPE + shared key/value heads
def test_prefill_then_decode_steps_give_the_full_forwards_logits(shape: str) -> None:
    model, tokens = _model(shape), _tokens(3, CONTEXT)
    cfg = model.config
    cache = KVCache.for_model(model, 3)
    # grouped-query attention caches its kv_heads, not num_heads
    assert cache.keys.shape == (cfg.num_layers, 3, cfg.kv_heads, CONTEXT, cfg.head_dim)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :10], cache.step(torch.arange(10).expand(3, -1), key_length=10))]
        for t in range(10, CONTEXT):  # positions offset by what the cache holds
            steps.append(model(tokens[:, t : t + 1], cache.step(torch.full((3, 1), t), key_length=t + 1)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=0)  # float rounding, ~5e-7 here
    assert torch.equal(torch.cat(steps, dim=1).argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_rows_at_different_positions_see_only_their_own_positions(shape: str) -> None:
    """One decode step for two slots holding 5 and 17 tokens, with garbage past each slot's end (a reused slot)."""
    model, tokens = _model(shape), _tokens(2, 18, seed=1)
    cache = KVCache.for_model(model, 2)
    cache.keys.normal_(generator=torch.Generator().manual_seed(2))  # stale keys and values: must stay unread
    cache.values.normal_(generator=torch.Generator().manual_seed(3))
    lengths = (5, 17)
    with torch.no_grad():
        for slot, length in enumerate(lengths):
            positions = torch.arange(length)[None]
            model(tokens[slot : slot + 1, :length], cache.step(positions, first_slot=slot, key_length=length))
        new = torch.stack([tokens[slot, length] for slot, length in enumerate(lengths)])[:, None]
        step = model(new, cache.step(torch.tensor(lengths)[:, None], key_length=max(lengths) + 1))
        alone = [model(tokens[slot : slot + 1, : length + 1])[:, -1] for slot, length in enumerate(lengths)]
    torch.testing.assert_close(step[:, -1], torch.cat(alone), atol=2e-5, rtol=0)


def test_moving_a_slot_keeps_its_sequence() -> None:
    model, tokens = _model("llama"), _tokens(1, 9, seed=4)
    cache = KVCache.for_model(model, 3)
    with torch.no_grad():
        model(tokens[:, :8], cache.step(torch.arange(8)[None], first_slot=2, key_length=8))
        cache.move_slot(2, 0, 8)
        moved = model(tokens[:, 8:], cache.step(torch.tensor([[8]]), key_length=9))
        assert torch.equal(
            moved, model(tokens[:, 8:], cache.step(torch.tensor([[8]]), first_slot=2, key_length=9))
        )
