"""Model behaviour: shapes, causality, weight tying, GQA, RoPE, meta-device init, and that it can learn."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gaudi3_scale.models import ModelConfig, Transformer, build_model, get_model_config
from gaudi3_scale.models.common import apply_rope, build_rope_cache

ARCHS = ["shakespeare-char", "llama-tiny"]


def _cfg(name: str, vocab_size: int = 65, **changes: object) -> ModelConfig:
    cfg = get_model_config(name).resolve_vocab(vocab_size)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def _tokens(batch: int, seq_len: int, vocab_size: int = 65, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ARCHS)
def test_logits_shape_uses_padded_vocab(name: str) -> None:
    model = build_model(_cfg(name, pad_vocab_to_multiple=64), seed=0)
    logits = model(_tokens(3, 17))
    assert logits.shape == (3, 17, 128)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("name", ARCHS)
def test_future_tokens_do_not_change_past_logits(name: str) -> None:
    model = build_model(_cfg(name), seed=0).eval()
    tokens = _tokens(2, 32)
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 65
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=0)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_gpt2_ties_embedding_and_head_even_after_meta_materialization() -> None:
    model = build_model(_cfg("shakespeare-char"), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.device("meta"):
        meta_model = build_model(_cfg("shakespeare-char"))
    meta_model.to_empty(device="cpu")
    assert meta_model.output.weight.data_ptr() == meta_model.tok_embeddings.weight.data_ptr()
    llama = build_model(_cfg("llama-tiny"), seed=0)
    assert llama.output.weight.data_ptr() != llama.tok_embeddings.weight.data_ptr()


@pytest.mark.parametrize("name", ARCHS)
def test_meta_build_then_init_matches_direct_build_bitwise(name: str) -> None:
    direct = build_model(_cfg(name), seed=123)
    with torch.device("meta"):
        lazy = build_model(_cfg(name))
    with pytest.raises(ValueError, match="to_empty"):
        lazy.init_weights(123)
    lazy.to_empty(device="cpu")
    lazy.init_weights(123)
    for (key, expected), (_, actual) in zip(
        direct.state_dict().items(), lazy.state_dict().items(), strict=True
    ):
        assert torch.equal(expected, actual), key
    if direct.rope_cache is not None:
        assert lazy.rope_cache is not None and torch.equal(direct.rope_cache, lazy.rope_cache)


def test_init_draws_on_the_host_under_any_default_device() -> None:
    """`with torch.device("cuda"): build_model(...)` must not move the seeded draws off the host generator (on CUDA
    that raised "Expected a 'cuda' device type for generator"; under meta the draws were silently never made)."""
    expected = build_model(_cfg("llama-tiny"), seed=7)
    model = build_model(_cfg("llama-tiny"), seed=0)
    with torch.device("meta"):
        model.init_weights(7)
    for key, value in expected.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


def test_init_follows_gpt2_scheme() -> None:
    model = build_model(_cfg("shakespeare-char", bias=True), seed=0)
    residual_std = 0.02 / math.sqrt(2 * 4)
    block = model.layers[0]
    assert isinstance(block, torch.nn.Module)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(block.attention.wq.bias) == 0
    assert torch.equal(model.norm.weight, torch.ones(128))


def test_gqa_equals_multi_head_attention_with_repeated_kv_weights() -> None:
    gqa = build_model(_cfg("llama-tiny"), seed=0).eval()
    mha = build_model(_cfg("llama-tiny", num_kv_heads=4), seed=1).eval()
    state = gqa.state_dict()
    head_dim, group = 16, 2
    for key, value in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # query head h reads kv head h // group, so repeat each kv head's rows `group` times in order
            state[key] = value.view(-1, head_dim, 64).repeat_interleave(group, dim=0).reshape(-1, 64)
    mha.load_state_dict(state)
    assert gqa.layers[0].attention.wk.weight.shape == (2 * head_dim, 64)
    tokens = _tokens(2, 24)
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position() -> None:
    cache = build_rope_cache(head_dim=8, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        return (apply_rope(q, cache[q_pos : q_pos + 1]) * apply_rope(k, cache[k_pos : k_pos + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(25, 22))
    assert not torch.allclose(score(5, 2), score(5, 4))
    torch.testing.assert_close(apply_rope(q, cache[:1]), q)  # position 0 is the identity


def test_rejects_too_long_sequences_and_unresolved_vocab() -> None:
    model = build_model(_cfg("llama-tiny"), seed=0)
    with pytest.raises(ValueError, match="context_length 64"):
        model(_tokens(1, 65))
    with pytest.raises(ValueError, match="vocab_size"):
        build_model(get_model_config("shakespeare-char"))


@pytest.mark.parametrize("name", ARCHS)
def test_tiny_model_overfits_one_batch(name: str) -> None:
    torch.manual_seed(0)
    model: Transformer = build_model(_cfg(name, vocab_size=32), seed=0)
    batch = _tokens(4, 33, vocab_size=32)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(60):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(32), abs=0.3)  # small init ⇒ near-uniform predictions
    assert losses[-1] < 0.1
