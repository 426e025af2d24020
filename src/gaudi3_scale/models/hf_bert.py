"""Hugging Face `BertForMaskedLM` ↔ our encoder (`models.encoder`): names, config both ways.

Every parameter is one HF tensor in the same layout (`nn.Linear` [out, in], no fused or permuted rows), so the
mapping is names only. Tied (BERT's own setting), the decoder weight is the word embedding (HF saves it once, as we
do) and its bias is `cls.predictions.bias`, which HF ties `cls.predictions.decoder.bias` to. Untied
(`tie_word_embeddings` false), transformers 5 unties that bias too and its forward adds `cls.predictions.decoder.bias`
(checked with transformers 5.23): we read that one, and export the bias under both names. HF's pooler and NSP head
have no counterpart here (BertForMaskedLM has neither).
"""

from __future__ import annotations

from typing import Any

import torch

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.hf_common import check_ints, check_supported, gpt2_activation, split_layer, typed
from gaudi3_scale.models.transformer import INIT_STD

__all__ = ["bert_fields", "bert_name", "hf_bert_config", "to_hf_bert"]

# Our block (models/encoder.py EncoderBlock) → HF BertLayer (transformers models/bert/modeling_bert.py).
_LAYER = {
    "attention.wq": "attention.self.query",
    "attention.wk": "attention.self.key",
    "attention.wv": "attention.self.value",
    "attention.wo": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "feed_forward.w1": "intermediate.dense",
    "feed_forward.w2": "output.dense",
    "ffn_norm": "output.LayerNorm",
}
_TOP = {
    "tok_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "pos_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "type_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "embedding_norm.weight": "bert.embeddings.LayerNorm.weight",
    "embedding_norm.bias": "bert.embeddings.LayerNorm.bias",
    "mlm_head.dense.weight": "cls.predictions.transform.dense.weight",
    "mlm_head.dense.bias": "cls.predictions.transform.dense.bias",
    "mlm_head.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "mlm_head.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "output.bias": "cls.predictions.bias",
    "output.weight": "cls.predictions.decoder.weight",  # an untied decoder (tie_word_embeddings false)
}
_UNTIED_BIAS = "cls.predictions.decoder.bias"
_INT_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size",
             "max_position_embeddings", "type_vocab_size")  # fmt: skip
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}  # ours → the name BertConfig takes


def bert_name(name: str, *, tied: bool) -> str:
    """The HF tensor name of our encoder parameter `name` (`layers.0.attention.wq.weight` →
    `bert.encoder.layer.0.attention.self.query.weight`) in a model with `tie_word_embeddings` = `tied`."""
    if name == "output.bias" and not tied:
        return _UNTIED_BIAS
    module, param = name.rsplit(".", 1)
    index, inner = split_layer(module)
    return f"bert.encoder.layer.{index}.{_LAYER[inner]}.{param}" if index else _TOP[name]


def to_hf_bert(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our encoder's weights (tied alias removed) under `BertForMaskedLM` names."""
    out = {bert_name(name, tied=cfg.tie_embeddings): tensor.contiguous() for name, tensor in state.items()}
    if (
        not cfg.tie_embeddings
    ):  # HF still has `cls.predictions.bias`; a copy (safetensors refuses shared storage)
        out[_TOP["output.bias"]] = out[_UNTIED_BIAS].clone()
    return out


def hf_bert_config(cfg: ModelConfig, *, dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` of a `BertForMaskedLM` with our encoder's shape."""
    assert cfg.arch == "bert", cfg.arch
    if not cfg.bias:
        raise UserInputError(f"model {cfg.name!r} has bias false; BertForMaskedLM always has biases")
    return {
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": cfg.padded_vocab_size,  # the embedding's rows (an export drops the padding: models.vocab)
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "hidden_act": _HF_ACTIVATIONS[cfg.activation],
        "max_position_embeddings": cfg.context_length,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.0,  # an exported model is for inference
        "attention_probs_dropout_prob": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Special token ids are the tokenizer's (data.mlm), not the model's; BertConfig's default 0 would be invented.
        "pad_token_id": None,
        "initializer_range": INIT_STD,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def bert_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model fields for a `BertForMaskedLM` config.json; one line for what our encoder cannot compute."""
    activation = gpt2_activation(where, config, "hidden_act", "gelu")
    check_supported(
        where,
        {
            "position_embedding_type": (config.get("position_embedding_type", "absolute"), "absolute"),
            "is_decoder": (config.get("is_decoder", False), False),
            "add_cross_attention": (config.get("add_cross_attention", False), False),
        },
    )
    check_ints(where, config, _INT_KEYS, "BertForMaskedLM")
    return {
        "arch": "bert",
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "dim": config["hidden_size"],
        "ffn_dim": config["intermediate_size"],
        "activation": activation,
        "vocab_size": config["vocab_size"],
        "context_length": config["max_position_embeddings"],
        "type_vocab_size": config["type_vocab_size"],
        "bias": True,
        "norm_eps": typed(where, config, "layer_norm_eps", 1e-12, float),
        "tie_embeddings": typed(where, config, "tie_word_embeddings", True, bool),
    }
