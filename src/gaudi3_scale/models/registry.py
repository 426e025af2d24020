"""The model zoo: named `ModelConfig` presets in a plain dict.

The presets are data (one dict each, with its source); `register_model` adds more at import time of a plugin.
Published parameter counts are pinned by tests/unit/test_models_counting.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.models.config import ModelConfig

__all__ = ["get_model_config", "list_models", "register_model"]

_GPT2: dict[str, Any] = dict(
    arch="gpt2",
    vocab_size=50257,
    context_length=1024,
    dropout=0.0,
    bias=True,
    tie_embeddings=True,
    norm_eps=1e-5,
)
_LLAMA3: dict[str, Any] = dict(
    arch="llama",
    vocab_size=128256,
    context_length=8192,
    num_kv_heads=8,
    rope_theta=500000.0,
    norm_eps=1e-5,
    dropout=0.0,
    bias=False,
    tie_embeddings=False,
)

PRESETS: list[dict[str, Any]] = [
    # nanoGPT README, "I only have a macbook": config/train_shakespeare_char.py shrunk for CPU
    # (--n_layer=4 --n_head=4 --n_embd=128 --block_size=64 --dropout=0.0; train.py default bias=False);
    # vocab comes from the char dataset.
    dict(name="shakespeare-char", arch="gpt2", num_layers=4, num_heads=4, dim=128, context_length=64,
         dropout=0.0, bias=False, tie_embeddings=True, vocab_size=None),
    # GPT-2 sizes: Radford et al. 2019 Table 2 and HF openai-community/gpt2{,-medium,-large,-xl} config.json
    # (n_layer, n_head, n_embd). Dropout 0 as nanoGPT uses for pretraining.
    dict(name="gpt2-124m", num_layers=12, num_heads=12, dim=768, **_GPT2),
    dict(name="gpt2-350m", num_layers=24, num_heads=16, dim=1024, **_GPT2),
    dict(name="gpt2-774m", num_layers=36, num_heads=20, dim=1280, **_GPT2),
    dict(name="gpt2-1.5b", num_layers=48, num_heads=25, dim=1600, **_GPT2),
    # Meta-Llama-3-8B / -70B params.json (meta-llama/llama3, 2024-04-18): ffn_dim is what `FeedForward` derives
    # from ffn_dim_multiplier=1.3 and multiple_of=1024 / 4096; context 8192 from the model card.
    dict(name="llama3-8b", num_layers=32, num_heads=32, dim=4096, ffn_dim=14336, **_LLAMA3),
    dict(name="llama3-70b", num_layers=80, num_heads=64, dim=8192, ffn_dim=28672, **_LLAMA3),
    # Llama 3 405B: Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783) Table 3: 126 layers, model
    # dimension 16,384, FFN dimension 53,248, 128 attention heads, 8 key/value heads, vocabulary 128K, RoPE θ 500,000;
    # exact vocab (128,256) from HF meta-llama/Llama-3.1-405B config.json (2024-07-23). Context 8192, the paper's
    # pre-training context (§3.4.1) and the config's original_max_position_embeddings: its llama3 rope_scaling (for
    # the 128K context of continued pre-training) is not modelled, as for the 3.2 presets.
    dict(name="llama3-405b", num_layers=126, num_heads=128, dim=16384, ffn_dim=53248, **_LLAMA3),
    # meta-llama/Llama-3.2-1B config.json (2024-09-25): hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate
    # 8192, tied embeddings. Its rope_scaling (llama3 type, factor 32, for 128k contexts) is not modelled: the
    # context here is its original_max_position_embeddings, 8192, where that scaling does not apply.
    dict(name="llama3.2-1b", num_layers=16, num_heads=32, dim=2048, ffn_dim=8192,
         **{**_LLAMA3, "tie_embeddings": True}),
    # meta-llama/Llama-3.2-3B config.json (2024-09-25): hidden 3072, 28 layers, 24 heads, 8 kv heads, intermediate
    # 8192, tied embeddings; the same context note as the 1B.
    dict(name="llama3.2-3b", num_layers=28, num_heads=24, dim=3072, ffn_dim=8192,
         **{**_LLAMA3, "tie_embeddings": True}),
    # Not a published model: the smallest Llama-shaped net that still exercises GQA (2 query heads per kv head)
    # and RoPE, for tests and smoke runs. ffn_dim = 3·dim, near Llama's 8/3·dim.
    dict(name="llama-tiny", arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, dim=64, ffn_dim=192,
         context_length=64, vocab_size=None, dropout=0.0, bias=False, tie_embeddings=False),
    # BERT-base: Devlin et al. 2018 (arXiv:1810.04805) §3, "L=12, H=768, A=12, Total Parameters=110M", feed-forward
    # 4H, dropout 0.1 on all layers (§A.2); vocab 30522, 512 positions, 2 token types and LayerNorm eps 1e-12 from
    # HF google-bert/bert-base-uncased config.json. Counted with its MLM head and without the NSP pooler:
    # 109,514,298, HF BertForMaskedLM's count (tests/unit/test_models_encoder.py).
    dict(name="bert-base", arch="bert", num_layers=12, num_heads=12, dim=768, ffn_dim=3072, vocab_size=30522,
         context_length=512, type_vocab_size=2, dropout=0.1, bias=True, tie_embeddings=True, norm_eps=1e-12),
    # The shape of BERT-Tiny (Turc et al. 2019, arXiv:1908.08962, L=2, H=128, A=2) with a short context and the
    # vocabulary of the data: the encoder for CPU tests and smoke runs.
    dict(name="bert-tiny", arch="bert", num_layers=2, num_heads=2, dim=128, ffn_dim=512, vocab_size=None,
         context_length=64, dropout=0.0, bias=True, tie_embeddings=True, norm_eps=1e-12),
    # Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088) Table 1 and mistralai/Mixtral-8x7B-v0.1
    # config.json (rope_theta 1e6, rms_norm_eps 1e-5, router_aux_loss_coef 0.02, untied). 46.7 B parameters in total,
    # 12.9 B used per token (Mistral AI, "Mixtral of experts", 2023-12-11); pinned by tests/unit/test_moe.py.
    dict(name="mixtral-8x7b", arch="llama", num_layers=32, num_heads=32, num_kv_heads=8, dim=4096, ffn_dim=14336,
         num_experts=8, experts_per_token=2, vocab_size=32000, context_length=32768, rope_theta=1e6, norm_eps=1e-5,
         dropout=0.0, bias=False, tie_embeddings=False),
    # Not a published model: llama-tiny's shape with 8 experts of half its MLP width, top-2, so a token uses as many
    # expert parameters as llama-tiny's MLP has (2 × 96 = 192); for tests and benchmarks.
    dict(name="moe-tiny", arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, dim=64, ffn_dim=96,
         num_experts=8, experts_per_token=2, context_length=64, vocab_size=None, dropout=0.0, bias=False,
         tie_embeddings=False),
]  # fmt: skip

_MODELS: dict[str, ModelConfig] = {}


def register_model(cfg: ModelConfig) -> None:
    """Add a preset under `cfg.name`; names are unique."""
    if cfg.name in _MODELS:
        raise ValueError(f"model {cfg.name!r} is already registered")
    _MODELS[cfg.name] = replace(cfg)


def get_model_config(name: str) -> ModelConfig:
    """A copy of the preset called `name` (safe to modify)."""
    if name not in _MODELS:
        raise UserInputError(f"unknown model {name!r}; valid: {', '.join(list_models())}")
    return replace(_MODELS[name])


def list_models() -> list[str]:
    return sorted(_MODELS)


for _preset in PRESETS:
    register_model(ModelConfig(**_preset))
