"""Sampling: argument checks, determinism under a seeded generator, greedy decoding, context cropping, KV cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.models import Transformer, build_model, get_model_config
from gaudi3_scale.models.generate import GREEDY_BELOW_TEMPERATURE, generate, sample_next_token


@pytest.fixture(scope="module")
def model() -> Transformer:
    cfg = get_model_config("llama-tiny").resolve_vocab(65)
    cfg.context_length = 16
    return build_model(cfg, seed=0).eval()


def _prompt(length: int = 4) -> torch.Tensor:
    return torch.arange(length, dtype=torch.long)[None] % 65


def _greedy_by_hand(model: Transformer, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = prompt
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(tokens[:, -16:])[:, -1, :65].argmax(-1, keepdim=True)
            tokens = torch.cat((tokens, next_id), dim=1)
    return tokens


def test_seeded_sampling_is_deterministic(model: Transformer) -> None:
    def sample(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return generate(model, _prompt(), max_new_tokens=20, temperature=1.0, top_k=10, generator=gen)

    first, again, other = sample(7), sample(7), sample(8)
    assert first.shape == (1, 24)
    assert torch.equal(first[:, :4], _prompt())
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_temperature_zero_is_greedy_and_top_k_one_matches_it(model: Transformer) -> None:
    # 30 new tokens from a 4-token prompt also runs past context_length (16), exercising the crop.
    expected = _greedy_by_hand(model, _prompt(), 30)
    assert torch.equal(generate(model, _prompt(), max_new_tokens=30, temperature=0.0), expected)
    sampled = generate(
        model, _prompt(), max_new_tokens=30, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(sampled, expected)


def test_every_temperature_and_top_p_in_range_gives_a_token() -> None:
    """Denormal temperatures and top_p (valid requests of `gaudi3 serve`) once made NaN probabilities. Below the
    greedy threshold, and with a top_p below the top token's probability, the draw is the argmax; huge logits
    divided by the smallest sampled temperature do not overflow."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 65, generator=generator) * 10
    logits[3] *= 1e30
    greedy = logits.argmax(-1, keepdim=True)
    below = GREEDY_BELOW_TEMPERATURE * 0.999
    for temperature, top_p in [(5e-324, None), (1e-300, 0.5), (1e-44, None), (below, None), (1.0, 1e-300),
                               (2.0, 5e-324)]:  # fmt: skip
        assert torch.equal(sample_next_token(logits, temperature, None, generator, top_p=top_p), greedy)
    for temperature, top_p, top_k in [(GREEDY_BELOW_TEMPERATURE, None, None), (2.0, 1.0, None), (2.0, None, 1),
                                      (2.0, 0.999999999, 2**31)]:  # fmt: skip
        ids = sample_next_token(logits, temperature, top_k, generator, top_p=top_p)
        assert ids.shape == (4, 1) and int(ids.min()) >= 0 and int(ids.max()) < 65
        assert int(ids[3]) == int(greedy[3])  # logits 1e30 apart: the top one, at any temperature


@pytest.mark.parametrize(
    ("name", "kv_heads"), [("shakespeare-char", None), ("llama-tiny", 1)]
)  # gpt2; llama GQA
def test_kv_cache_gives_the_tokens_of_recomputing(name: str, kv_heads: int | None) -> None:
    """Greedy and seeded: 2 prompts of 5 tokens, 20 new ones, context 16 (the last 9 steps run past it)."""
    cfg = replace(get_model_config(name).resolve_vocab(65), context_length=16, num_kv_heads=kv_heads)
    model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(0, 65, (2, 5), generator=torch.Generator().manual_seed(1))
    for temperature in (0.0, 1.0):
        out = {use_cache: generate(model, prompt, max_new_tokens=20, temperature=temperature, use_cache=use_cache,
                                   generator=torch.Generator().manual_seed(3)) for use_cache in (True, False)}  # fmt: skip
        assert torch.equal(out[True], out[False]), temperature
    assert not torch.equal(out[True][0], out[True][1])  # the rows are two different sequences


def test_kv_cache_of_fp32_weights_under_bf16_autocast_gives_the_tokens_of_recomputing() -> None:
    """Autocast makes the keys and values bf16 while the cache is in the weights' fp32: stored in its dtype."""
    cfg = replace(get_model_config("llama-tiny").resolve_vocab(65), context_length=16, num_layers=1)
    model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(0, 65, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = {use_cache: generate(model, prompt, max_new_tokens=8, temperature=0.0, use_cache=use_cache)
               for use_cache in (True, False)}  # fmt: skip
    assert torch.equal(out[True], out[False])


def test_padding_rows_are_never_sampled() -> None:
    cfg = get_model_config("llama-tiny").resolve_vocab(65)
    cfg.pad_vocab_to_multiple = 64
    model = build_model(cfg, seed=0)
    # make every padding logit the largest: a real forward hook, not a mock
    model.output.register_forward_hook(
        lambda _m, _i, out: torch.cat((out[..., :65], out[..., 65:] + 1e4), -1)
    )
    out = generate(model, _prompt(), max_new_tokens=10, temperature=0.0)
    assert int(out.max()) < 65


def test_ids_past_the_tokenizers_vocabulary_are_never_sampled(model: Transformer) -> None:
    """`vocab_size` below the model's (a Hugging Face model fine-tuned with a smaller tokenizer): the rows past it
    are left out however likely, as padding rows are."""
    handle = model.output.register_forward_hook(
        lambda _m, _i, out: torch.cat((out[..., :60], out[..., 60:] + 1e4), -1)
    )
    try:
        for temperature in (0.0, 1.0):
            out = generate(model, _prompt(), max_new_tokens=10, temperature=temperature, vocab_size=60,
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
            assert int(out[:, 4:].max()) < 60, temperature
    finally:
        handle.remove()


def test_restores_training_mode_and_allows_zero_new_tokens(model: Transformer) -> None:
    model.train()
    try:
        assert torch.equal(generate(model, _prompt(), max_new_tokens=0), _prompt())
        assert model.training
    finally:
        model.eval()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": -1}, r"^max_new_tokens must be an integer >= 0, got -1$"),
        ({"max_new_tokens": 2.5}, r"^max_new_tokens must be an integer >= 0, got 2.5$"),
        ({"max_new_tokens": "3"}, r"^max_new_tokens must be an integer >= 0, got '3'$"),
        ({"max_new_tokens": True}, r"^max_new_tokens must be an integer >= 0, got True$"),
        (
            {"max_new_tokens": 1, "temperature": -0.5},
            r"^temperature must be a finite number >= 0 \(0 = greedy\)",
        ),
        (
            {"max_new_tokens": 1, "temperature": float("nan")},
            r"^temperature must be a finite number >= 0 .*got nan$",
        ),
        (
            {"max_new_tokens": 1, "temperature": float("inf")},
            r"^temperature must be a finite number >= 0 .*got inf$",
        ),
        (
            {"max_new_tokens": 1, "temperature": None},
            r"^temperature must be a finite number >= 0 .*got None$",
        ),
        ({"max_new_tokens": 1, "top_k": 0}, r"^top_k must be an integer >= 1 or None, got 0$"),
        ({"max_new_tokens": 1, "top_k": 2.5}, r"^top_k must be an integer >= 1 or None, got 2.5$"),
    ],
)
def test_rejects_bad_arguments(model: Transformer, kwargs: dict, message: str) -> None:
    # one line naming the argument and what it takes, before any forward pass (not torch's error from deep inside)
    with pytest.raises(UserInputError, match=message):
        generate(model, _prompt(), **kwargs)


def test_rejects_bad_prompt(model: Transformer) -> None:
    with pytest.raises(ValueError, match="prompt"):
        generate(model, torch.zeros(4, dtype=torch.long), max_new_tokens=1)


def test_rejects_a_model_without_config() -> None:
    with pytest.raises(TypeError, match="build_model"):
        generate(torch.nn.Linear(2, 2), _prompt(), max_new_tokens=1)
