"""Small random Hugging Face checkpoints made locally with transformers, and our model loaded from one (shared by
tests/integration/test_init_from.py and tests/distributed/test_init_from_sharded.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from gaudi3_scale.models import Transformer, build_model
from gaudi3_scale.models.pretrained import open_pretrained
from gaudi3_scale.models.pretrained_reader import load_pretrained


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights and biases away from 1 / 0, so a swapped norm or a dropped bias changes the logits."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def save_hf_checkpoints(root: Path) -> dict[str, Path]:
    """Five small random HF checkpoints: Llama and GPT-2, each sharded (several files + index) and as one file, and a
    sharded Mixtral (4 experts, top-2; one safetensors tensor per expert and projection)."""
    torch.manual_seed(0)
    llama = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    tied_bias = dict(attention_bias=True, mlp_bias=True, **llama,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # fmt: skip
    gpt2 = dict(n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    models: dict[str, Any] = {
        "llama-sharded": LlamaForCausalLM(LlamaConfig(vocab_size=257, **llama)),
        "llama-tied-bias": LlamaForCausalLM(
            LlamaConfig(vocab_size=97, tie_word_embeddings=True, **tied_bias)
        ),
        "gpt2-sharded": GPT2LMHeadModel(GPT2Config(vocab_size=97, **gpt2)),
        "gpt2-untied": GPT2LMHeadModel(GPT2Config(vocab_size=97, tie_word_embeddings=False, **gpt2)),
        "mixtral-sharded": MixtralForCausalLM(
            MixtralConfig(vocab_size=97, num_local_experts=4, num_experts_per_tok=2, **llama)
        ),
    }
    out = {}
    for name, model in models.items():
        out[name] = root / name
        shard = "20KB" if name.endswith("sharded") else "10GB"
        _randomized(model).save_pretrained(out[name], max_shard_size=shard)
    return out


def hf_model(directory: Path) -> torch.nn.Module:
    config = json.loads((directory / "config.json").read_text())
    classes = {"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM, "gpt2": GPT2LMHeadModel}
    cls = classes[config["model_type"]]
    return cls.from_pretrained(directory, local_files_only=True).eval()


def load_ours(directory: Path, **changes: Any) -> Transformer:
    """Our model of the checkpoint's shape (with `changes`), built on meta and filled by `load_pretrained`."""
    checkpoint = open_pretrained(directory)
    with torch.device("meta"):
        model = build_model(replace(checkpoint.config, **changes))
    model.to_empty(device="cpu")
    load_pretrained(model, checkpoint, seed=3)
    return model.eval()


def save_tokenizer(directory: Path, text: str) -> None:
    """A byte-level BPE tokenizer.json trained on `text` beside the checkpoint (fewer tokens than its 257-row
    embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
