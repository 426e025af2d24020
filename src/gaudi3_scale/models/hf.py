"""Hugging Face checkpoints ↔ our models: config conversion, parameter names and weight layouts, in one place.

Training (`model.init_from`, `models.pretrained`) and export (`artifacts.export`, a layer above) both need this, so
it lives with the model code it describes.

    Llama  `LlamaForCausalLM`: one HF tensor per parameter; wq / wk rows in HF's rotate-half order (see
           `permute_rope_rows`).
    Mixtral `MixtralForCausalLM` (our llama with `num_experts`): Llama's attention and norms; the MLP is
           `block_sparse_moe.gate` (our router) and one Linear per expert and projection,
           `block_sparse_moe.experts.{e}.w1/w2/w3.weight` [out, in], the layout on the Hub and the one
           transformers 5 `save_pretrained` writes (it fuses them to `gate_up_proj` / `down_proj` in memory only);
           each is one [in, out] slice of our batched expert weights, transposed.
    GPT-2  `GPT2LMHeadModel`: Conv1D weights stored transposed ([in, out]); `c_attn` fuses q, k and v along its
           output dimension; learned positions `wpe`; the head is tied to `wte`; `gelu_new` is GELU's tanh form.
    BERT   `BertForMaskedLM`: one tensor per parameter under `bert.` and `cls.predictions.`; the decoder weight is
           tied to the word embeddings, its bias stored once as `cls.predictions.bias`; no pooler.

A `Source` says where one of our parameters is in a checkpoint, so a rank can read just the rectangle it holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.counting import parameter_shapes
from gaudi3_scale.models.hf_common import check_ints, check_supported, gpt2_activation, split_layer, typed
from gaudi3_scale.models.transformer import INIT_STD

__all__ = [
    "HF_MODEL_TYPES",
    "Source",
    "hf_llama_config",
    "hf_model_config",
    "hf_sources",
    "ignored_tensor",
    "iter_stored_shapes",
    "permute_rope_rows",
    "stored_shapes",
    "to_hf_llama",
]

HF_MODEL_TYPES = ("llama", "mixtral", "gpt2", "bert")  # config.json model_type values we can compute exactly

# Our block's modules → HF LlamaDecoderLayer's (transformers models/llama/modeling_llama.py); the parameter names
# inside each (`weight`, `bias`) are the same. SwiGLU: our w1 is silu's input (gate), w3 the linear one (up).
_LLAMA_LAYER = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_LLAMA_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
# MixtralDecoderLayer (transformers models/mixtral): the MoE feed-forward; our experts' w1 / w3 / w2 keep the names.
_MIXTRAL_ROUTER = {"feed_forward.router": "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = "feed_forward.experts"
_LLAMA_INT_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size",
                   "max_position_embeddings")  # fmt: skip

# GPT2Block (transformers models/gpt2/modeling_gpt2.py): module → (HF module, Conv1D stored [in, out]).
_GPT2_LAYER = {
    "attention_norm": ("ln_1", False),
    "attention.wo": ("attn.c_proj", True),
    "ffn_norm": ("ln_2", False),
    "feed_forward.w1": ("mlp.c_fc", True),
    "feed_forward.w2": ("mlp.c_proj", True),
}
_GPT2_QKV = ("attention.wq", "attention.wk", "attention.wv")  # c_attn's output columns, in this order
_GPT2_TOP = {"tok_embeddings": "wte", "pos_embeddings": "wpe", "norm": "ln_f"}
_GPT2_INT_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")
# HF activation names → ours: gelu_new / gelu_pytorch_tanh are the tanh approximation GPT-2 was trained with.


@dataclass(frozen=True)
class Source:
    """Where one of our parameters is stored: our rows r are the stored tensor's output rows `offset + r` (its
    columns when `transposed`, GPT-2's Conv1D [in, out]); `rope_heads` > 0 means the rows of each of that many heads
    are in HF's rotate-half order and need `permute_rope_rows(..., to_hf=False)`.

    `experts` > 0: our parameter stacks that many experts on dim 0 and expert e is its own stored tensor,
    `name.format(expert=e)`, a Linear weight [out, in] whose transpose is our slice [e] (Mixtral)."""

    name: str
    transposed: bool = False
    offset: int = 0
    rope_heads: int = 0
    experts: int = 0

    def expert_names(self) -> list[str]:
        return [self.name.format(expert=e) for e in range(self.experts)]


def hf_sources(cfg: ModelConfig, model_type: str, *, prefix: str = "") -> dict[str, Source]:
    """Our parameter name → its `Source` in a `model_type` checkpoint (`llama` or `gpt2`) of shape `cfg`.

    `prefix` is what GPT-2 names start with (`transformer.` as transformers saves them; "" in the original OpenAI
    conversion). A tied head has no entry: it is the embedding.
    """
    from gaudi3_scale.models.hf_bert import bert_name

    params = parameter_shapes(cfg)
    sources: dict[str, Source] = {}
    for name in params:
        module, param = name.rsplit(".", 1)
        index, inner = split_layer(module)
        if model_type == "bert":
            sources[name] = Source(bert_name(name, tied=cfg.tie_embeddings))
        elif model_type == "llama" and inner == _MIXTRAL_EXPERTS:
            hf_name = f"model.layers.{index}.block_sparse_moe.experts.{{expert}}.{param}.weight"
            sources[name] = Source(hf_name, transposed=True, experts=params[name][0])
        elif model_type == "llama":
            layer = {**_LLAMA_LAYER, **_MIXTRAL_ROUTER}
            hf_module = f"model.layers.{index}.{layer[inner]}" if index else _LLAMA_TOP[inner]
            heads = {"attention.wq": cfg.num_heads, "attention.wk": cfg.kv_heads}.get(inner, 0)
            sources[name] = Source(f"{hf_module}.{param}", rope_heads=heads)
        elif inner in _GPT2_QKV:
            offset = _GPT2_QKV.index(inner) * cfg.dim
            sources[name] = Source(f"{prefix}h.{index}.attn.c_attn.{param}", transposed=True, offset=offset)
        elif index:
            hf, transposed = _GPT2_LAYER[inner]
            sources[name] = Source(
                f"{prefix}h.{index}.{hf}.{param}", transposed=transposed and param == "weight"
            )
        elif inner == "output":
            sources[name] = Source("lm_head.weight")  # an untied GPT-2 head (tie_word_embeddings false)
        else:
            sources[name] = Source(f"{prefix}{_GPT2_TOP[inner]}.{param}")
    return sources


def stored_shapes(cfg: ModelConfig, model_type: str, *, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a `model_type` checkpoint of shape `cfg` holds (what `hf_sources` points at)."""
    return dict(iter_stored_shapes(cfg, model_type, prefix=prefix))


def iter_stored_shapes(
    cfg: ModelConfig, model_type: str, *, prefix: str = ""
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """`stored_shapes` one tensor at a time, the experts' last: a Mixtral stores a tensor per expert, projection and
    block, so a check that finds the router's shape wrong stops before a name is made for each expert the config
    claims."""
    params = parameter_shapes(cfg)
    experts: list[tuple[Source, tuple[int, int]]] = []
    for name, source in hf_sources(cfg, model_type, prefix=prefix).items():
        shape = list(params[name])
        if source.experts:
            experts.append((source, (shape[2], shape[1])))
            continue
        if source.name.endswith("c_attn.weight") or source.name.endswith("c_attn.bias"):
            shape[0] *= 3  # q, k and v side by side
        yield source.name, tuple(reversed(shape)) if source.transposed else tuple(shape)
    for source, expert_shape in experts:
        for expert in range(source.experts):
            yield source.name.format(expert=expert), expert_shape


# Stored tensors our model has no use for and a checkpoint may hold anyway, skipped as transformers skips them:
# buffers older transformers saved (GPT-2's causal mask `attn.bias` / `attn.masked_bias`, Llama's
# `rotary_emb.inv_freq`, BERT's `position_ids`), and BERT parts BertForMaskedLM has no use for (the pooler and the
# next-sentence head of a BertForPreTraining checkpoint such as bert-base-uncased) or stores twice (the MLM bias is
# both `cls.predictions.bias` and `cls.predictions.decoder.bias`; `models.hf_bert` reads one).
_IGNORED = re.compile(
    r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq|position_ids)$"
    r"|^bert\.pooler\.|^cls\.seq_relationship\.|^cls\.predictions\.(decoder\.)?bias$"
)
# A tied head saved beside the embedding it equals (HF Llama / GPT-2, BERT, our export's alias).
_TIED_HEADS = ("lm_head.weight", "cls.predictions.decoder.weight", "output.weight")


def ignored_tensor(name: str, cfg: ModelConfig) -> bool:
    """Whether a stored tensor our model of shape `cfg` does not read is one a checkpoint may hold harmlessly."""
    return bool(_IGNORED.search(name)) or (cfg.tie_embeddings and name in _TIED_HEADS)


def permute_rope_rows(weight: torch.Tensor, num_heads: int, *, to_hf: bool) -> torch.Tensor:
    """Rows of wq / wk (weight or bias, `num_heads` whole heads) between our RoPE layout and HF Llama's.

    We rotate interleaved channel pairs (2i, 2i+1) of each head (Meta's layout, models/common/rope.py); HF
    rotates (i, i + head_dim/2). Reordering each head's output rows from (i, pair) to (pair, i) in both q and k
    makes HF's rotation act on the same pairs and leaves q·k unchanged: the `permute` of transformers'
    models/llama/convert_llama_weights_to_hf.py. `to_hf=False` is the inverse, (pair, i) back to (i, pair).
    """
    head_dim = weight.shape[0] // num_heads
    rows = (head_dim // 2, 2) if to_hf else (2, head_dim // 2)
    return weight.reshape(num_heads, *rows, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def to_hf_llama(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our Llama weights (tied alias removed) under `LlamaForCausalLM` names and its RoPE layout (`MixtralForCausalLM`
    names with experts)."""
    sources = hf_sources(cfg, "llama")
    out = {}
    for name, tensor in state.items():
        source = sources[name]
        if source.experts:
            out.update(
                {
                    hf: expert.t().contiguous()
                    for hf, expert in zip(source.expert_names(), tensor, strict=True)
                }
            )
            continue
        if source.rope_heads:
            tensor = permute_rope_rows(tensor, source.rope_heads, to_hf=True)
        out[source.name] = tensor.contiguous()
    return out


def hf_llama_config(cfg: ModelConfig, *, dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` of a `LlamaForCausalLM` with our model's shape (`MixtralForCausalLM` with experts)."""
    assert cfg.arch == "llama", cfg.arch
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.padded_vocab_size,  # the embedding's rows (an export drops the padding: models.vocab)
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # read by transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers >= 5
        "attention_bias": cfg.bias,  # our `bias` puts a bias on every linear but the head
        "mlp_bias": cfg.bias,
        # HF Llama has attention dropout only, no residual dropout: an exported model is for inference.
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Our tokenizers have no special tokens; LlamaConfig's defaults (1, 2) would be invented.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "initializer_range": INIT_STD,
        "torch_dtype": str(dtype).removeprefix("torch."),  # transformers 5 also reads this (as `dtype`)
    }
    if cfg.num_experts:
        for key in ("attention_bias", "mlp_bias"):  # not MixtralConfig fields (a MoE config has no bias)
            del config[key]
        config.update({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.moe_aux_loss_coef,
            "router_jitter_noise": 0.0,
            "sliding_window": None,  # full causal attention, as ours
        })  # fmt: skip
    return config


_LLAMA_KEYS = {"num_layers": "num_hidden_layers", "context_length": "max_position_embeddings"}
_CONFIG_KEYS = {  # model_type → our field → its config.json key, for the fields ModelConfig bounds
    "llama": _LLAMA_KEYS,
    "mixtral": {**_LLAMA_KEYS, "num_experts": "num_local_experts"},
    "bert": _LLAMA_KEYS,
    "gpt2": {"num_layers": "n_layer", "context_length": "n_positions"},
}


def hf_model_config(config: dict[str, Any], *, name: str, where: str) -> ModelConfig:
    """Our `ModelConfig` for a Hugging Face `config.json` (Llama or GPT-2); one line naming the field when the
    checkpoint is something our model cannot compute exactly (another architecture, scaled RoPE, ...).

    The vocabulary is the embedding's rows, padding included (`pad_vocab_to_multiple` 1).
    """
    from gaudi3_scale.models.hf_bert import bert_fields

    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UserInputError(
            f"{where}: model_type {model_type!r} is not supported; allowed: Llama (LlamaForCausalLM, model_type "
            "'llama'), Mixtral (MixtralForCausalLM, 'mixtral'), GPT-2 (GPT2LMHeadModel, model_type 'gpt2') and BERT "
            "(BertForMaskedLM, model_type 'bert')"
        )
    if (quantization := config.get("quantization_config")) is not None:
        # Quantized weights (fp8, int8, 4-bit) are codes that need their scales (more tensors, each method its own
        # layout): read as plain weights they are off by orders of magnitude.
        raise UserInputError(
            f"{where}: quantization_config is {brief(quantization)}; quantized checkpoints are not supported; "
            "allowed: an unquantized checkpoint (BF16, F16, F32 or F64 weights, no quantization_config)"
        )
    if model_type == "gpt2":
        fields = _gpt2_fields(config, where)
    elif model_type == "bert":
        fields = bert_fields(config, where)
    else:
        fields = _llama_fields(config, where)
        if model_type == "mixtral":
            fields.update(_mixtral_fields(config, where))
    try:
        return ModelConfig(name=name, pad_vocab_to_multiple=1, dropout=0.0, **fields)
    except (ConfigError, TypeError) as exc:
        # A field ModelConfig bounds (num_layers, context_length, num_experts), named as config.json names it.
        key = _CONFIG_KEYS[model_type].get(exc.field) if isinstance(exc, ConfigError) else None
        if isinstance(exc, ConfigError) and key is not None:
            raise UserInputError(f"{where}: {key} {exc.problem}") from None
        raise UserInputError(f"{where}: not a model this project can build ({exc})") from None


def _llama_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    rope = typed(
        where, config, "rope_parameters", {}, dict
    )  # transformers >= 5; 4.x: rope_theta + rope_scaling
    scaled = [
        r.get("rope_type", r.get("type")) for r in (rope, typed(where, config, "rope_scaling", {}, dict)) if r
    ]
    bias = typed(where, config, "attention_bias", False, bool)
    differences = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "rope type": (next((t for t in scaled if t != "default"), "default"), "default"),
        "mlp_bias": (typed(where, config, "mlp_bias", False, bool), bias),
    }
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        differences["head_dim"] = (config.get("head_dim") or hidden // heads, hidden // heads)
    check_supported(where, differences)
    check_ints(where, config, _LLAMA_INT_KEYS, "LlamaForCausalLM", optional=("num_key_value_heads",))
    return {
        "arch": "llama",
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config.get("num_key_value_heads"),
        "dim": config["hidden_size"],
        "ffn_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "context_length": config["max_position_embeddings"],
        "bias": bias,
        "norm_eps": typed(where, config, "rms_norm_eps", 1e-6, float),
        "rope_theta": typed(
            where, rope, "rope_theta", typed(where, config, "rope_theta", 10000.0, float), float
        ),
        "tie_embeddings": typed(where, config, "tie_word_embeddings", False, bool),
    }


def _mixtral_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """What MixtralConfig adds to Llama's: the experts. A sliding window shorter than the context would mask keys
    our full causal attention sees; router jitter (training-time noise) is not implemented."""
    window, positions = config.get("sliding_window"), config.get("max_position_embeddings")
    if window is not None and not (
        isinstance(positions, int) and isinstance(window, int) and window >= positions
    ):
        raise UserInputError(
            f"{where}: sliding_window {window!r} is not supported (only null, or at least max_position_embeddings)"
        )
    check_supported(where, {"router_jitter_noise": (config.get("router_jitter_noise", 0.0), 0.0)})
    check_ints(where, config, ("num_local_experts", "num_experts_per_tok"), "MixtralForCausalLM")
    return {"num_experts": config["num_local_experts"], "experts_per_token": config["num_experts_per_tok"]}


def _gpt2_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    activation = gpt2_activation(where, config, "activation_function", "gelu_new")
    # Attention scaled by 1/sqrt(head_dim), as ours, and nothing else (GPT2Attention's other options).
    check_supported(
        where,
        {
            "scale_attn_weights": (config.get("scale_attn_weights", True), True),
            "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), False),
            "add_cross_attention": (config.get("add_cross_attention", False), False),
        },
    )
    check_ints(where, config, _GPT2_INT_KEYS, "GPT2LMHeadModel", optional=("n_inner",))
    return {
        "arch": "gpt2",
        "num_layers": config["n_layer"],
        "num_heads": config["n_head"],
        "dim": config["n_embd"],
        "ffn_dim": config.get("n_inner"),  # null = 4 * dim, as HF's
        "activation": activation,
        "vocab_size": config["vocab_size"],
        "context_length": config["n_positions"],
        "bias": True,
        "norm_eps": typed(where, config, "layer_norm_epsilon", 1e-5, float),
        "tie_embeddings": typed(where, config, "tie_word_embeddings", True, bool),
    }
