"""Parameter counts pinned to published numbers; FLOPs per token checked against hand arithmetic; names and shapes
from one block checked against the whole model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.models import (
    build_model,
    count_parameters,
    flops_per_token,
    forward_flops_per_token,
    get_model_config,
)
from gaudi3_scale.models.config import MAX_PARAMETERS, ModelConfig
from gaudi3_scale.models.counting import _parameters_at_least, check_parameter_count, parameter_shapes


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2-124m", 124_439_808),  # HF openai-community/gpt2 model card / `model.num_parameters()`
        ("gpt2-350m", 354_823_168),  # HF gpt2-medium
        ("llama3-8b", 8_030_261_248),  # HF meta-llama/Meta-Llama-3-8B safetensors metadata
        ("llama3-70b", 70_553_706_496),  # HF meta-llama/Meta-Llama-3-70B safetensors metadata
        ("llama3-405b", 405_853_388_800),  # HF meta-llama/Llama-3.1-405B safetensors metadata (405.85B)
        (
            "llama3.2-1b",
            1_235_814_400,
        ),  # the config.json shapes summed; HF meta-llama/Llama-3.2-1B page: 1.24B
        (
            "llama3.2-3b",
            3_212_749_824,
        ),  # the config.json shapes summed; HF meta-llama/Llama-3.2-3B page: 3.21B
    ],
)
def test_published_parameter_counts(name: str, expected: int) -> None:
    assert count_parameters(get_model_config(name)) == expected


def _shakespeare_char() -> ModelConfig:
    return get_model_config("shakespeare-char").resolve_vocab(65)  # tinyshakespeare has 65 distinct chars


def test_shakespeare_char_counts_by_hand() -> None:
    d, layers = 128, 4
    per_layer = 12 * d * d + 2 * d  # qkv+proj 4d², MLP 8d²; no biases (nanoGPT bias=False); two LayerNorms 2d
    total = 65 * d + 64 * d + layers * per_layer + d  # tied token table, positions, blocks, final norm
    assert total == 804_096
    assert count_parameters(_shakespeare_char()) == total
    assert count_parameters(_shakespeare_char(), exclude_embeddings=True) == total - 64 * d


def test_exclude_embeddings_keeps_tied_head_and_drops_untied_table() -> None:
    # gpt2: only the position table is lookup-only; llama: the untied token table is.
    assert (
        count_parameters(get_model_config("gpt2-124m"), exclude_embeddings=True) == 124_439_808 - 1024 * 768
    )
    llama = get_model_config("llama3-8b")
    assert count_parameters(llama, exclude_embeddings=True) == 8_030_261_248 - 128256 * 4096


def test_tied_head_is_counted_once() -> None:
    cfg = get_model_config("gpt2-124m")
    cfg.tie_embeddings = False
    assert count_parameters(cfg) == 124_439_808 + 50257 * 768


def test_flops_per_token_shakespeare_char() -> None:
    n = 804_096 - 64 * 128
    attention = 12 * 4 * 4 * 32 * 64  # 12·L·H·Q·T
    assert flops_per_token(_shakespeare_char()) == 6 * n + attention == 5_168_640
    assert forward_flops_per_token(_shakespeare_char()) == pytest.approx(5_168_640 / 3)


def test_flops_per_token_gpt2_124m() -> None:
    cfg = get_model_config("gpt2-124m")
    assert flops_per_token(cfg) == 6 * 123_653_376 + 12 * 12 * 12 * 64 * 1024 == 855_166_464
    assert flops_per_token(cfg, seq_len=512) == 6 * 123_653_376 + 12 * 12 * 12 * 64 * 512


def test_flops_rejects_bad_seq_len_and_unresolved_vocab() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(get_model_config("gpt2-124m"), seq_len=2048)
    with pytest.raises(ValueError, match="vocab_size"):
        count_parameters(get_model_config("shakespeare-char"))


@pytest.mark.parametrize("name", ["gpt2-124m", "llama-tiny", "moe-tiny", "bert-tiny"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_shapes_of_one_block_are_those_of_the_whole_model(name: str, tied: bool) -> None:
    """`parameter_shapes` builds one block whatever num_layers (the counts above are extrapolated from one and two
    blocks): the same names in the same order, and shapes, as the whole model built on meta."""
    cfg = replace(get_model_config(name), num_layers=5, tie_embeddings=tied, pad_vocab_to_multiple=64)
    cfg = cfg if cfg.vocab_size else cfg.resolve_vocab(100)
    with torch.device("meta"):
        model = build_model(cfg)
    assert list(parameter_shapes(cfg).items()) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize(
    "shape",
    [dict(dim=2**40, num_heads=1), dict(vocab_size=2**62), dict(ffn_dim=2**62),
     dict(arch="bert", type_vocab_size=2**62), dict(arch="llama", bias=False, num_experts=2**16, ffn_dim=2**50)],
)  # fmt: skip
def test_widths_too_large_to_build_are_refused_from_the_config(shape: dict[str, int]) -> None:
    """torch refuses a tensor past 2**63 bytes even on meta ("Storage size calculation overflowed"): such a shape is
    over MAX_PARAMETERS by its config alone, at every entry that counts or lists parameters (train, plan, serve)."""
    cfg = ModelConfig(**{"vocab_size": 256, **shape})
    for call in (lambda: check_parameter_count(cfg, "model"), lambda: count_parameters(cfg),
                 lambda: parameter_shapes(cfg)):  # fmt: skip
        with pytest.raises(UserInputError) as raised:
            call()
        message = str(raised.value)
        assert message.startswith(f"model: the shape (dim {cfg.dim}, ffn_dim {cfg.hidden_dim}, "), message
        assert (
            f" has at least {_parameters_at_least(cfg):,} parameters, over the limit of {MAX_PARAMETERS:,}"
            in message
        )


def test_vocabulary_padding_too_large_to_build_is_one_line() -> None:
    cfg = ModelConfig(vocab_size=100, pad_vocab_to_multiple=2**62)
    with pytest.raises(
        UserInputError, match=r"^model: pad_vocab_to_multiple 4611686018427387904 pads the embedding"
    ):
        count_parameters(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_vocabulary_padding_that_builds_on_meta_but_is_over_the_limit_is_one_line(tied: bool) -> None:
    """2**40 rows of 64: buildable on meta and no parameters (the count leaves padding out), yet 2**46 elements
    per table that no machine allocates; the limit holds the padding as well."""
    cfg = ModelConfig(vocab_size=100, dim=64, pad_vocab_to_multiple=2**40, tie_embeddings=tied)
    assert count_parameters(cfg) < MAX_PARAMETERS
    with pytest.raises(
        UserInputError, match=r"^model: pad_vocab_to_multiple 1099511627776 pads the embedding"
    ):
        check_parameter_count(cfg, "model")
    check_parameter_count(replace(cfg, pad_vocab_to_multiple=2**16), "model")  # 65,536 rows: fine


@pytest.mark.parametrize("name", ["gpt2-124m", "llama3-8b", "mixtral-8x7b", "bert-base", "shakespeare-char"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_count_from_the_config_alone_is_a_lower_bound(name: str, tied: bool) -> None:
    cfg = replace(get_model_config(name), tie_embeddings=tied, pad_vocab_to_multiple=64)
    cfg = cfg if cfg.vocab_size else cfg.resolve_vocab(100)
    assert 0 < _parameters_at_least(cfg) <= count_parameters(cfg)
