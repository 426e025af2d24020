"""The model zoo: every preset builds, names resolve, unknown names list the valid ones."""

from __future__ import annotations

import pytest
import torch

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.models import ModelConfig, build_model, get_model_config, list_models, register_model
from gaudi3_scale.models.registry import _MODELS

PRESET_NAMES = [
    "bert-base",
    "bert-tiny",
    "gpt2-1.5b",
    "gpt2-124m",
    "gpt2-350m",
    "gpt2-774m",
    "llama-tiny",
    "llama3-405b",
    "llama3-70b",
    "llama3-8b",
    "llama3.2-1b",
    "llama3.2-3b",
    "mixtral-8x7b",
    "moe-tiny",
    "shakespeare-char",
]


def test_list_models_is_sorted_and_holds_every_preset() -> None:
    assert list_models() == PRESET_NAMES


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_builds_on_meta(name: str) -> None:
    cfg = get_model_config(name)
    assert cfg.name == name
    cfg = cfg.resolve_vocab(65)
    with torch.device("meta"):
        model = build_model(cfg)
    assert len(model.layers) == cfg.num_layers
    assert model.output.weight.shape == (cfg.padded_vocab_size, cfg.dim)


def test_get_model_config_returns_a_copy() -> None:
    cfg = get_model_config("gpt2-124m")
    cfg.num_layers = 1
    assert get_model_config("gpt2-124m").num_layers == 12


def test_unknown_name_lists_valid_names_on_one_line() -> None:
    with pytest.raises(UserInputError) as info:
        get_model_config("gpt5")
    message = str(info.value)
    assert "\n" not in message
    assert "'gpt5'" in message
    assert all(name in message for name in PRESET_NAMES)


def test_register_model_adds_and_rejects_duplicates() -> None:
    cfg = ModelConfig(name="test-register-tiny", num_layers=1, dim=32, num_heads=2)
    register_model(cfg)
    try:
        assert get_model_config("test-register-tiny") == cfg
        with pytest.raises(ValueError, match="already registered"):
            register_model(cfg)
    finally:
        del _MODELS["test-register-tiny"]


def test_shakespeare_char_is_nanogpts_cpu_setting() -> None:
    cfg = get_model_config("shakespeare-char")
    shape = (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.dim, cfg.context_length, cfg.dropout, cfg.bias)
    assert shape == ("gpt2", 4, 4, 128, 64, 0.0, False)  # nanoGPT train.py: bias = False
    assert cfg.vocab_size is None and cfg.tie_embeddings


@pytest.mark.parametrize(("name", "ffn_dim"), [("llama3-8b", 14336), ("llama3-70b", 28672)])
def test_llama3_presets(name: str, ffn_dim: int) -> None:
    cfg = get_model_config(name)
    assert (cfg.vocab_size, cfg.context_length, cfg.rope_theta, cfg.norm_eps) == (
        128256,
        8192,
        500000.0,
        1e-5,
    )
    assert (cfg.kv_heads, cfg.hidden_dim, cfg.tie_embeddings, cfg.bias) == (8, ffn_dim, False, False)


def test_resolve_vocab_fills_null_and_rejects_too_small() -> None:
    assert get_model_config("shakespeare-char").resolve_vocab(65).vocab_size == 65
    assert get_model_config("gpt2-124m").resolve_vocab(65).vocab_size == 50257
    with pytest.raises(ConfigError, match=r"^vocab_size: 50257 is smaller"):
        get_model_config("gpt2-124m").resolve_vocab(100_000)
