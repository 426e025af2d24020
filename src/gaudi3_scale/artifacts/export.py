"""`gaudi3 ckpt export`: a checkpoint's model as one safetensors file, or as a Hugging Face Llama directory.

    safetensors  `model.safetensors` under our parameter names (`Transformer.state_dict()` keys) and
                 `model_config.json` (the `ModelConfig`); `load_exported(dir)` builds the model back.
    hf           `config.json` + `model.safetensors` that `transformers.LlamaForCausalLM.from_pretrained(dir)`
                 loads with the same logits (Llama-arch models only); `load_exported` reads it back too.

Tied embeddings are written once, as Hugging Face does (`lm_head.weight` / our `output.weight` alias left out):
safetensors refuses two names for one storage. It lives in `train/` because it reads checkpoints through
`artifacts.inference.read_model_state`, which also consolidates sharded checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gaudi3_scale.artifacts.inference import read_model_state, run_tokenizer_dir
from gaudi3_scale.checkpoint.manifest import fsync_directory
from gaudi3_scale.config.core import from_dict, to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.data.tokenizers import TOKENIZER_FILE, HFTokenizer, Tokenizer, load_tokenizer
from gaudi3_scale.models import ModelConfig, Transformer, build_model
from gaudi3_scale.models.transformer import INIT_STD

__all__ = [
    "EXPORT_FORMATS",
    "export_checkpoint",
    "from_hf_llama",
    "hf_llama_config",
    "hf_llama_model_config",
    "load_exported",
    "to_hf_llama",
]

EXPORT_FORMATS = ("safetensors", "hf")
WEIGHTS_NAME = "model.safetensors"
MODEL_CONFIG_NAME = "model_config.json"  # format safetensors: our ModelConfig
HF_CONFIG_NAME = "config.json"  # format hf: transformers' LlamaConfig
TOKENIZER_DIR = "tokenizer"  # our tokenizer.json, as in <run>/tokenizer/ (read by gaudi3 serve and generate)
# format hf with a Hugging Face tokenizer: tokenizer.json at the top plus this, which AutoTokenizer reads
HF_TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
TIED_ALIAS = "output.weight"  # the head shares tok_embeddings.weight when model.tie_embeddings is set
_INSTALL = "pip install 'gaudi3-scale[export]'"

# Our block's modules → HF LlamaDecoderLayer's (transformers models/llama/modeling_llama.py); the parameter names
# inside each (`weight`, `bias`) are the same. SwiGLU: our w1 is silu's input (gate), w3 the linear one (up).
_HF_LAYER_NAMES = {
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
_HF_INT_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size",
                "max_position_embeddings")  # fmt: skip
_HF_TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def export_checkpoint(
    checkpoint: Path,
    out_dir: Path,
    *,
    fmt: str = "safetensors",
    force: bool = False,
    tokenizer_dir: Path | None = None,
) -> list[Path]:
    """Write the model of `checkpoint` to `out_dir` in format `fmt`; returns the files written.

    The tokenizer (`tokenizer_dir`, default the run's `<run>/tokenizer/`) is copied to `<out>/tokenizer/` when
    there is one; with `hf` and a Hugging Face tokenizer (bpe or a tokenizer.json) it is also written at the top as
    transformers, vLLM and TGI expect. `out_dir` must be absent or empty unless `force`; it is written under a
    temporary name beside it and renamed into place, so it is never left half-written.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if fmt not in EXPORT_FORMATS:
        raise UserInputError(f"--format {fmt!r} is not known; valid: {', '.join(EXPORT_FORMATS)}")
    _check_destination(checkpoint, out_dir, force=force)
    safetensors_torch = _import_safetensors()
    cfg, state = read_model_state(checkpoint, mmap=True)
    tokenizer = _run_tokenizer(checkpoint, tokenizer_dir)
    state = _untied(cfg, _checked_state(cfg, state, checkpoint))
    if fmt == "hf":
        if cfg.arch != "llama":
            raise UserInputError(
                f"{checkpoint}: --format hf writes LlamaForCausalLM, but model {cfg.name!r} has arch "
                f"{cfg.arch!r}; use --format safetensors"
            )
        tensors, config_name = to_hf_llama(cfg, state), HF_CONFIG_NAME
        config = hf_llama_config(cfg, dtype=state["tok_embeddings.weight"].dtype)
    else:
        tensors, config_name, config = state, MODEL_CONFIG_NAME, to_dict(cfg)
    with _staged_directory(out_dir, force=force) as staging:
        (staging / config_name).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        # "format": "pt" is what transformers' loader expects in the safetensors header.
        safetensors_torch.save_file(tensors, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        # safetensors writes through a private temp file (mode 0600); give the weights the umask's mode instead.
        (staging / WEIGHTS_NAME).chmod((staging / config_name).stat().st_mode)
        written = [WEIGHTS_NAME, config_name]
        if tokenizer is not None:
            (staging / TOKENIZER_DIR).mkdir()
            written.append(tokenizer.save(staging / TOKENIZER_DIR).relative_to(staging).as_posix())
            if fmt == "hf" and isinstance(tokenizer, HFTokenizer):
                written += _write_hf_tokenizer(tokenizer, staging)
    return [out_dir / name for name in written]


def _run_tokenizer(checkpoint: Path, tokenizer_dir: Path | None) -> Tokenizer | None:
    """The tokenizer to ship with the export: `tokenizer_dir` (must exist), else the run's if it has one."""
    directory = Path(tokenizer_dir) if tokenizer_dir else run_tokenizer_dir(checkpoint)
    if tokenizer_dir is None and not (directory / TOKENIZER_FILE).is_file():
        return None  # a bare checkpoint file, not inside a run directory
    return load_tokenizer(directory)


def _write_hf_tokenizer(tokenizer: HFTokenizer, directory: Path) -> list[str]:
    (directory / TOKENIZER_FILE).write_text(tokenizer.to_json(), encoding="utf-8")
    # No special tokens: our models are trained on raw text, with no BOS/EOS added.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False}
    (directory / HF_TOKENIZER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [TOKENIZER_FILE, HF_TOKENIZER_CONFIG_NAME]


def load_exported(directory: Path) -> Transformer:
    """The model (eval mode, CPU) from a `gaudi3 ckpt export` directory of either format.

    A `--format hf` directory (`config.json` of a `LlamaForCausalLM`) is mapped back to our names and RoPE layout
    (`from_hf_llama`), so the export registered in a model registry serves and generates like its checkpoint.
    """
    directory = Path(directory)
    weights_path = directory / WEIGHTS_NAME
    config_name = MODEL_CONFIG_NAME if (directory / MODEL_CONFIG_NAME).is_file() else HF_CONFIG_NAME
    config_path = directory / config_name
    for path in (config_path, weights_path):
        if not path.is_file():
            raise UserInputError(
                f"{str(path)!r} does not exist; pass a directory written by `gaudi3 ckpt export`"
            )
    config = load_json_file(config_path, what="model config")
    if config_name == HF_CONFIG_NAME:
        cfg = hf_llama_model_config(config, name=directory.name, where=str(config_path))
    else:
        cfg = from_dict(ModelConfig, config)
    safetensors_torch = _import_safetensors()
    import safetensors

    try:
        tensors = safetensors_torch.load_file(str(weights_path))
    except (safetensors.SafetensorError, OSError) as exc:  # a truncated or foreign file
        raise UserInputError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    if config_name == HF_CONFIG_NAME:
        tensors = from_hf_llama(cfg, tensors)
    model = build_model(cfg)
    result = model.load_state_dict(tensors, strict=False)
    allowed_missing = {TIED_ALIAS} if cfg.tie_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - allowed_missing:
        raise UserInputError(
            f"{weights_path}: does not match {config_name} (missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys})"
        )
    return model.eval()


def to_hf_llama(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our Llama weights (tied alias removed) under `LlamaForCausalLM` names and its RoPE layout."""
    out = {}
    for name, tensor in state.items():
        module, param = name.rsplit(".", 1)
        if module.startswith("layers."):
            _, index, inner = module.split(".", 2)
            hf_name = f"model.layers.{index}.{_HF_LAYER_NAMES[inner]}.{param}"
        else:
            hf_name = f"{_HF_TOP_NAMES[module]}.{param}"
            inner = module
        out[hf_name] = _permute_rope_rows(inner, tensor, cfg, to_hf=True).contiguous()
    return out


def hf_llama_config(cfg: ModelConfig, *, dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` of a `LlamaForCausalLM` with our model's shape."""
    assert cfg.arch == "llama", cfg.arch
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.padded_vocab_size,  # the embedding's rows, padding included, so logits line up
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


def hf_llama_model_config(config: dict[str, Any], *, name: str, where: str) -> ModelConfig:
    """Our `ModelConfig` for a `LlamaForCausalLM` `config.json` (the inverse of `hf_llama_config`); one line when
    the checkpoint is something our Llama cannot compute exactly (another architecture, scaled RoPE, ...)."""
    if config.get("model_type") != "llama":
        raise UserInputError(
            f"{where}: model_type {config.get('model_type')!r}; only Llama (LlamaForCausalLM) exports are served"
        )
    rope = config.get("rope_parameters") or {}  # transformers >= 5; 4.x: rope_theta + rope_scaling
    scaled = [r.get("rope_type", r.get("type")) for r in (rope, config.get("rope_scaling") or {}) if r]
    differences = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "rope type": (next((t for t in scaled if t != "default"), "default"), "default"),
        "mlp_bias": (config.get("mlp_bias", False), config.get("attention_bias", False)),
    }
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        differences["head_dim"] = (config.get("head_dim") or hidden // heads, hidden // heads)
    for key, (got, supported) in differences.items():
        if got != supported:
            raise UserInputError(f"{where}: {key} {got!r} is not supported (only {supported!r})")
    for key in _HF_INT_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserInputError(
                f"{where}: {key} is {value!r}; a LlamaForCausalLM config needs an integer there"
            )
    try:
        return ModelConfig(
            name=name,
            arch="llama",
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads"),
            dim=config["hidden_size"],
            ffn_dim=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            pad_vocab_to_multiple=1,  # config.json holds the embedding's rows, padding included
            context_length=config["max_position_embeddings"],
            dropout=0.0,
            bias=bool(config.get("attention_bias", False)),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (ConfigError, TypeError) as exc:
        raise UserInputError(f"{where}: not a model this project can build ({exc})") from None


def from_hf_llama(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` weights under our names and RoPE layout (the inverse of `to_hf_llama`)."""
    layer = {hf: inner for inner, hf in _HF_LAYER_NAMES.items()}
    top = {hf: inner for inner, hf in _HF_TOP_NAMES.items()}
    out = {}
    for hf_name, tensor in tensors.items():
        module, param = hf_name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, index, rest = module.split(".", 3)
            inner = layer.get(rest)
            name = f"layers.{index}.{inner}.{param}"
        else:
            inner = top.get(module)
            name = f"{inner}.{param}"
        if inner is None:
            out[hf_name] = tensor  # load_state_dict reports it as unexpected
            continue
        out[name] = _permute_rope_rows(inner, tensor, cfg, to_hf=False).contiguous()
    return out


def _permute_rope_rows(inner: str, weight: torch.Tensor, cfg: ModelConfig, *, to_hf: bool) -> torch.Tensor:
    """Rows of wq / wk (weight or bias) between our RoPE layout and the one HF Llama's `rotate_half` expects; any
    other tensor unchanged.

    We rotate interleaved channel pairs (2i, 2i+1) of each head (Meta's layout, models/common/rope.py); HF
    rotates (i, i + head_dim/2). Reordering each head's output rows from (i, pair) to (pair, i) in both q and k
    makes HF's rotation act on the same pairs and leaves q·k unchanged: the `permute` of transformers'
    models/llama/convert_llama_weights_to_hf.py. `to_hf=False` is the inverse, (pair, i) back to (i, pair).
    """
    num_heads = {"attention.wq": cfg.num_heads, "attention.wk": cfg.kv_heads}.get(inner)
    if num_heads is None:
        return weight
    head_dim = weight.shape[0] // num_heads
    rows = (head_dim // 2, 2) if to_hf else (2, head_dim // 2)
    return weight.reshape(num_heads, *rows, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _checked_state(
    cfg: ModelConfig, state: dict[str, torch.Tensor], checkpoint: Path
) -> dict[str, torch.Tensor]:
    """`state` if its names and shapes are those of `cfg`'s model, else one line naming the first mismatch."""
    with torch.device("meta"):  # shapes only: no memory, even for llama3-70b
        expected = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if cfg.tie_embeddings:  # a consolidated checkpoint may carry the alias or not; it is dropped anyway
        expected.pop(TIED_ALIAS, None)
        got.pop(TIED_ALIAS, None)
    if got != expected:
        name = sorted(set(got) ^ set(expected)) or sorted(k for k in got if got[k] != expected[k])
        raise UserInputError(
            f"{checkpoint}: its weights do not fit its model config {cfg.name!r} (first mismatch: {name[0]}: "
            f"{got.get(name[0])} vs {expected.get(name[0])})"
        )
    return state


def _untied(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not cfg.tie_embeddings:
        return state
    return {k: v for k, v in state.items() if k != TIED_ALIAS}


def _import_safetensors() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError:
        raise UserInputError(f"checkpoint export needs the safetensors package: {_INSTALL}") from None
    return safetensors.torch


def _check_destination(checkpoint: Path, out_dir: Path, *, force: bool) -> None:
    """Refuse an --out that is a file, non-empty without --force, or would delete the checkpoint itself."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserInputError(f"--out {str(out_dir)!r} is a file; pass a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise UserInputError(
                f"--out {str(out_dir)!r} exists and is not empty; pick a new directory or pass --force to replace it"
            )
        if checkpoint.resolve().is_relative_to(out_dir.resolve()):
            raise UserInputError(f"--out {str(out_dir)!r} contains the checkpoint; --force would delete it")


@contextmanager
def _staged_directory(out_dir: Path, *, force: bool) -> Iterator[Path]:
    """A fresh directory beside `out_dir` to write into; renamed to `out_dir` when the block succeeds."""
    staging = out_dir.with_name(f".{out_dir.name}.export-{os.getpid()}")
    if staging.exists():  # left by a killed export that had the same pid
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
        for path in sorted(staging.rglob("*")):
            if path.is_file():
                with path.open("rb") as fh:
                    os.fsync(fh.fileno())
            else:
                fsync_directory(path)
        fsync_directory(staging)
        _replace_directory(staging, out_dir, force=force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # the error that got us here is re-raised
        raise


def _replace_directory(staging: Path, out_dir: Path, *, force: bool) -> None:
    previous = None
    if out_dir.is_dir() and any(out_dir.iterdir()):  # again: it may have been filled while we wrote
        if not force:
            raise UserInputError(f"--out {str(out_dir)!r} was filled while exporting; nothing was replaced")
        previous = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
        out_dir.rename(previous)
    os.replace(staging, out_dir)  # POSIX rename(2): atomic, and it may replace an empty directory
    fsync_directory(out_dir.parent)
    if previous is not None:
        shutil.rmtree(previous)
