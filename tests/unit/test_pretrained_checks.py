"""What `models.pretrained.open_pretrained` and `models.hf.hf_model_config` refuse in a Hugging Face checkpoint, each
as one line: quantized or integer weights, tensors the config's model does not have, integer fields written as
floats, activations that are not names, sizes too large to build, too many experts, too long a context, and shards
outside the directory. The checkpoints are written here with safetensors (config.json + the tensors
`models.hf.stored_shapes` names), so no transformers is needed; tests/integration/test_init_from.py loads real ones.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.models.config import MAX_CONTEXT_LENGTH, MAX_NUM_EXPERTS, MAX_PARAMETERS, ModelConfig
from gaudi3_scale.models.hf import hf_model_config, stored_shapes
from gaudi3_scale.models.pretrained import open_pretrained, read_pretrained_config

GPT2 = dict(model_type="gpt2", n_positions=16, n_embd=16, n_layer=2, n_head=2, vocab_size=96)
LLAMA = dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=16, vocab_size=96)  # fmt: skip
MIXTRAL = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
BERT = dict(model_type="bert", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16, type_vocab_size=2, vocab_size=96)  # fmt: skip
WHERE = "config.json"


def _tensors(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Random weights of every tensor a checkpoint of `config` holds, under transformers' names."""
    cfg = hf_model_config(config, name="x", where=WHERE)
    prefix = "transformer." if cfg.arch == "gpt2" else ""
    generator = torch.Generator().manual_seed(0)
    return {
        n: torch.randn(s, generator=generator) for n, s in stored_shapes(cfg, cfg.arch, prefix=prefix).items()
    }


def _checkpoint(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None = None,
    **extra: torch.Tensor,
) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {**(_tensors(config) if tensors is None else tensors), **extra}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _refused(directory: Path) -> str:
    with pytest.raises(UserInputError) as raised:
        open_pretrained(directory)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("model.init_from"), message
    return message


def _config_refused(config: dict[str, Any]) -> str:
    with pytest.raises(UserInputError) as raised:
        hf_model_config(config, name="x", where=WHERE)
    assert "\n" not in str(raised.value)
    return str(raised.value)


# 1. Quantized checkpoints: the config says so, or a weight is not a float.


def test_a_quantized_checkpoint_is_refused_by_its_config() -> None:
    message = _config_refused(dict(MIXTRAL, quantization_config={"quant_method": "fp8"}))
    assert message == (
        "config.json: quantization_config is {'quant_method': 'fp8'}; quantized checkpoints are not supported; "
        "allowed: an unquantized checkpoint (BF16, F16, F32 or F64 weights, no quantization_config)"
    )


@pytest.mark.parametrize(
    ("dtype", "stored"), [(torch.int8, "I8"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.bool, "BOOL")]
)
def test_a_weight_that_is_not_a_float_is_refused(tmp_path: Path, dtype: torch.dtype, stored: str) -> None:
    """Cast to float, an int8 code or an fp8 one would load as a wrong weight without a word."""
    tensors = _tensors(GPT2)
    name = "transformer.h.0.mlp.c_fc.weight"
    tensors[name] = tensors[name].to(dtype)
    message = _refused(_checkpoint(tmp_path / "ck", GPT2, tensors))
    assert f"tensor '{name}' in {tmp_path / 'ck' / 'model.safetensors'} has dtype {stored}; " in message
    assert message.endswith("allowed: floating-point weights (BF16, F16, F32, F64), not quantized ones")


def test_half_precision_weights_load(tmp_path: Path) -> None:
    tensors = {
        name: t.to(torch.bfloat16 if i % 2 else torch.float16)
        for i, (name, t) in enumerate(_tensors(LLAMA).items())
    }
    assert open_pretrained(_checkpoint(tmp_path / "ck", LLAMA, tensors)).config.num_layers == 2


# 2. Stored tensors the config's model does not have.


def test_weights_of_more_layers_than_the_config_are_refused(tmp_path: Path) -> None:
    """Weights of 4 layers under a config of 2 (a config copied from a smaller model): 12 tensors per GPT-2 block."""
    directory = _checkpoint(tmp_path / "ck", GPT2, _tensors(dict(GPT2, n_layer=4)))
    assert _refused(directory) == (
        f"model.init_from: {directory} holds 24 tensor(s) that its config's model does not have, such as "
        "'transformer.h.2.attn.c_attn.bias' and 'transformer.h.2.attn.c_attn.weight'; allowed: a config that "
        "describes every stored weight (its layer count, no quantization scales)"
    )


def test_a_quantization_scale_is_refused(tmp_path: Path) -> None:
    directory = _checkpoint(
        tmp_path / "ck", LLAMA, **{"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(1)}
    )
    assert f"{directory} holds 1 tensor(s) that its config's model does not have, such as " in _refused(
        directory
    )
    assert "'model.layers.0.self_attn.o_proj.weight_scale'; allowed: " in _refused(directory)


def test_buffers_poolers_and_tied_heads_a_checkpoint_may_hold_are_skipped(tmp_path: Path) -> None:
    """What transformers saved in older versions, or other heads of the same model: nothing our model computes."""
    mask = {
        f"transformer.h.{i}.attn.{b}": torch.ones(1, 1, 16, 16)
        for i in (0, 1)
        for b in ("bias", "masked_bias")
    }
    tied_head = {"lm_head.weight": _tensors(GPT2)["transformer.wte.weight"].clone()}
    assert open_pretrained(_checkpoint(tmp_path / "gpt2", GPT2, **mask, **tied_head)).config.num_layers == 2
    llama = dict(LLAMA, tie_word_embeddings=True)
    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in (0, 1)}
    tied_head = {"lm_head.weight": _tensors(llama)["model.embed_tokens.weight"].clone()}
    assert open_pretrained(
        _checkpoint(tmp_path / "llama", llama, **inv_freq, **tied_head)
    ).config.tie_embeddings
    bert = _tensors(BERT)
    extra = {"bert.embeddings.position_ids": torch.arange(16)[None], "bert.pooler.dense.weight": torch.ones(16, 16),
             "bert.pooler.dense.bias": torch.ones(16), "cls.seq_relationship.weight": torch.ones(2, 16),
             "cls.seq_relationship.bias": torch.ones(2),
             "cls.predictions.decoder.bias": bert["cls.predictions.bias"].clone(),
             "cls.predictions.decoder.weight": bert["bert.embeddings.word_embeddings.weight"].clone()}  # fmt: skip
    assert open_pretrained(_checkpoint(tmp_path / "bert", BERT, **extra)).config.arch == "bert"
    untied = dict(
        BERT, tie_word_embeddings=False
    )  # reads cls.predictions.decoder.bias; the copy under the old name
    bias = {"cls.predictions.bias": _tensors(untied)["cls.predictions.decoder.bias"].clone()}
    assert not open_pretrained(_checkpoint(tmp_path / "bert-untied", untied, **bias)).config.tie_embeddings


# 3. Integer fields written as floats; 4. activations that are not names.


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(GPT2, n_inner=64.0), "n_inner is 64.0; a GPT2LMHeadModel config needs an integer or null there"),
        (dict(LLAMA, num_key_value_heads=1.0), "num_key_value_heads is 1.0; a LlamaForCausalLM config needs an integer or null"),
        (dict(MIXTRAL, num_key_value_heads=2.0), "num_key_value_heads is 2.0; a LlamaForCausalLM config"),
        (dict(GPT2, n_embd=16.0), "n_embd is 16.0; a GPT2LMHeadModel config needs an integer there"),
    ],
)  # fmt: skip
def test_an_integer_field_written_as_a_float_is_one_line(config: dict[str, Any], message: str) -> None:
    assert _config_refused(config).startswith(f"{WHERE}: {message}")


def test_integer_fields_that_may_be_null_still_take_an_integer_or_null() -> None:
    assert hf_model_config(dict(GPT2, n_inner=None), name="x", where=WHERE).hidden_dim == 64
    assert hf_model_config(dict(GPT2, n_inner=48), name="x", where=WHERE).hidden_dim == 48
    assert hf_model_config(dict(LLAMA, num_key_value_heads=None), name="x", where=WHERE).kv_heads == 2


@pytest.mark.parametrize(
    "field", ["dim", "ffn_dim", "num_kv_heads", "vocab_size", "context_length", "num_layers"]
)
def test_model_config_refuses_a_size_that_is_not_an_integer(field: str) -> None:
    """From the Python API too: torch takes sizes as ints, and a float failed only when the model was built."""
    with pytest.raises(ConfigError, match=rf"^{field}: expected an integer, got 4\.0$"):
        ModelConfig(**{field: 4.0})


@pytest.mark.parametrize(
    ("config", "key", "value"),
    [
        (GPT2, "activation_function", ["gelu"]),
        (BERT, "hidden_act", {"a": 1}),
        (GPT2, "activation_function", 1),
    ],
)
def test_an_activation_that_is_not_a_name_is_one_line(
    config: dict[str, Any], key: str, value: object
) -> None:
    assert _config_refused(dict(config, **{key: value})) == (
        f"{WHERE}: {key} {value!r} is not supported; allowed: gelu_new, gelu_pytorch_tanh, gelu"
    )


# 5. Sizes too large for torch to build, even on meta.


@pytest.mark.parametrize(
    "config",
    [dict(GPT2, vocab_size=2**62), dict(GPT2, n_embd=2**40, n_head=1), dict(GPT2, n_inner=2**62),
     dict(BERT, type_vocab_size=2**62), dict(MIXTRAL, intermediate_size=2**60)],
)  # fmt: skip
def test_sizes_too_large_to_build_get_the_parameter_limit_line(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError) as raised:
        read_pretrained_config(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"model.init_from {tmp_path / 'config.json'}: the shape (dim "), message
    assert f" parameters, over the limit of {MAX_PARAMETERS:,} (models.config.MAX_PARAMETERS" in message
    assert " has at least " in message and message.endswith("allowed: a smaller shape")


# 6. Experts: bounded, and a checkpoint's router is checked before a name is made for each expert.


def test_num_experts_is_bounded() -> None:
    assert ModelConfig(arch="llama", bias=False, num_experts=MAX_NUM_EXPERTS).num_experts == MAX_NUM_EXPERTS
    with pytest.raises(ConfigError, match=r"^num_experts: 65537 is over the limit of 65,536 experts"):
        ModelConfig(arch="llama", bias=False, num_experts=MAX_NUM_EXPERTS + 1)
    assert _config_refused(dict(MIXTRAL, num_local_experts=10**9)) == (
        f"{WHERE}: num_local_experts 1000000000 is over the limit of 65,536 experts (models.config.MAX_NUM_EXPERTS); "
        "allowed: 1 to 65,536, or null"
    )


def test_a_router_of_fewer_experts_is_refused_before_every_expert_is_listed(tmp_path: Path) -> None:
    """A config of 65,536 experts beside weights of 4: one line about the router, without first making the 393,216
    names the config implies (3 projections × 2 blocks per expert; 10**9 experts took 4 GB before they were
    bounded)."""
    directory = _checkpoint(
        tmp_path / "ck", dict(MIXTRAL, num_local_experts=MAX_NUM_EXPERTS), _tensors(MIXTRAL)
    )
    tracemalloc.start()
    try:
        message = _refused(directory)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "tensor 'model.layers.0.block_sparse_moe.gate.weight' in " in message
    assert "has shape [4, 16], but the checkpoint's config implies [65536, 16]" in message
    assert peak < 8 << 20, f"{peak:,} bytes"


# 7. Context length: bounded, so that the RoPE cache fits.


def test_context_length_is_bounded() -> None:
    assert ModelConfig(context_length=MAX_CONTEXT_LENGTH).context_length == 2**24
    with pytest.raises(
        ConfigError, match=r"^context_length: 16777217 is over the limit of 16,777,216 tokens"
    ):
        ModelConfig(context_length=MAX_CONTEXT_LENGTH + 1)
    assert _config_refused(dict(MIXTRAL, max_position_embeddings=10**11)).startswith(
        f"{WHERE}: max_position_embeddings 100000000000 is over the limit of 16,777,216 tokens "
        "(models.config.MAX_CONTEXT_LENGTH"
    )
    assert _config_refused(dict(GPT2, n_positions=2**62)).startswith(
        f"{WHERE}: n_positions {2**62} is over the limit"
    )


# 8. Index entries that are not file names in the checkpoint directory.


def test_a_shard_outside_the_directory_is_named_as_the_index_names_it(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "ck", GPT2)
    (directory / "model.safetensors").rename(directory / "a.safetensors")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.safetensors").write_bytes((directory / "a.safetensors").read_bytes())
    (directory / "sub").mkdir()
    (directory / "sub" / "a.safetensors").write_bytes((directory / "a.safetensors").read_bytes())
    index = directory / "model.safetensors.index.json"
    for entry, what in [("../ok/a.safetensors", "a path that leaves"), ("/etc/passwd", "a path that leaves"),
                        ("sub/a.safetensors", "not a file name in")]:  # fmt: skip
        index.write_text(json.dumps({"weight_map": dict.fromkeys(_tensors(GPT2), entry)}))
        assert _refused(directory) == (
            f"model.init_from: {index} lists shard {entry!r}, {what} {directory}; allowed: file names in the "
            "checkpoint directory"
        )
    index.write_text(json.dumps({"weight_map": dict.fromkeys(_tensors(GPT2), "a.safetensors")}))
    assert open_pretrained(directory).files["transformer.wte.weight"] == directory / "a.safetensors"
