"""Pretrained checkpoint directories (`model.init_from`, serving an export): what one is, checked before use.

A checkpoint directory is a Hugging Face one (`config.json` + `model.safetensors`, or shards listed in
`model.safetensors.index.json`; Llama, Mixtral, GPT-2 or BertForMaskedLM) or a `gaudi3 ckpt export` one (`--format safetensors`:
`model_config.json` + our names; `--format hf` is a Hugging Face Llama directory). `open_pretrained` checks it —
configs (no quantization), every shard a file of the directory, present and readable, every tensor there with
the right shape and a floating-point dtype, and no tensor the config's model does not have — reading only headers;
`pretrained_model_fields` is the model section `model.init_from` decides. Filling a model built from the config,
each rank reading only its blocks of any layout, is `models.pretrained_reader.load_pretrained`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.counting import check_parameter_count, parameter_shapes
from gaudi3_scale.models.hf import Source, hf_model_config, hf_sources, ignored_tensor, iter_stored_shapes

__all__ = [
    "FLOAT_DTYPES",
    "HF_CONFIG_NAME",
    "INDEX_NAME",
    "MODEL_CONFIG_NAME",
    "SHAPE_FIELDS",
    "WEIGHTS_NAME",
    "PretrainedCheckpoint",
    "import_safe_open",
    "open_pretrained",
    "pretrained_model_fields",
    "read_pretrained_config",
    "tokenizer_beside",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"  # sharded: {"weight_map": {tensor name: shard file}}
MODEL_CONFIG_NAME = "model_config.json"  # `gaudi3 ckpt export --format safetensors`: our ModelConfig
HF_CONFIG_NAME = "config.json"  # Hugging Face (and `gaudi3 ckpt export --format hf`)
_INSTALL = "pip install 'gaudi3-scale[export]'"
# safetensors dtype → torch's: the weights a checkpoint may hold. Any other (I8, U8, F8_E4M3, BOOL, ...) is a
# quantized code or not a weight at all, and cast to float it would load as a wrong value without a word.
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


@dataclass(frozen=True)
class PretrainedCheckpoint:
    """A checked checkpoint directory: its model shape, format and where each tensor is."""

    directory: Path
    config: ModelConfig  # the checkpoint's shape (vocab = its embedding rows)
    model_type: str  # "llama" / "gpt2" (Hugging Face names) or "gaudi3" (ours)
    files: dict[str, Path] = field(repr=False)  # stored tensor name → file
    sources: dict[str, Source] = field(repr=False)  # our parameter name → where it is stored


def tokenizer_beside(directory: str | Path) -> Path | None:
    """The tokenizer.json beside a checkpoint's weights: Hugging Face's at the top, else our export's tokenizer/."""
    for path in (Path(directory) / "tokenizer.json", Path(directory) / "tokenizer" / "tokenizer.json"):
        if path.is_file():
            return path
    return None


def open_pretrained(directory: str | Path, *, field_name: str = "model.init_from") -> PretrainedCheckpoint:
    """Check `directory` and describe it; one line naming `field_name`, the path and what is wrong otherwise.

    Reads the config and each safetensors header (not the weights): the config's shape is bounded first, then each
    tensor it implies (listed without building the model, `models.counting.parameter_shapes`) must be in the files
    with its shape.
    """
    path = Path(directory)
    config, model_type = read_pretrained_config(path, field_name=field_name)
    files = _tensor_files(path, field_name)
    # GPT-2 names start with `transformer.` as transformers saves them; not in the original OpenAI conversion.
    prefix = "transformer." if model_type == "gpt2" and "wte.weight" not in files else ""
    expected: Iterable[tuple[str, tuple[int, ...]]]
    if model_type == "gaudi3":
        shapes = parameter_shapes(config)
        sources, expected = {name: Source(name) for name in shapes}, shapes.items()
    else:
        sources = hf_sources(config, model_type, prefix=prefix)
        expected = iter_stored_shapes(config, model_type, prefix=prefix)
    _check_tensors(path, files, expected, field_name, config)
    return PretrainedCheckpoint(path, config, model_type, files, sources)


def read_pretrained_config(
    directory: str | Path, *, field_name: str = "model.init_from"
) -> tuple[ModelConfig, str]:
    """The checkpoint's `ModelConfig` and model type ("llama", "gpt2" or "gaudi3"), from its config file only; its
    shape is bounded (`models.config.MAX_NUM_LAYERS`, `MAX_PARAMETERS`) before anything is built from it."""
    path = Path(directory)
    if not path.is_dir():
        raise UserInputError(
            f"{field_name}: {str(path)!r} is not a directory; allowed: a Hugging Face checkpoint directory "
            "(config.json + *.safetensors) or one written by `gaudi3 ckpt export`"
        )
    if (path / MODEL_CONFIG_NAME).is_file():
        where = f"{field_name} {path / MODEL_CONFIG_NAME}"
        raw = load_json_file(path / MODEL_CONFIG_NAME, what=f"{field_name} model config")
        try:
            config, model_type = from_dict(ModelConfig, raw), "gaudi3"
        except UserInputError as exc:
            raise UserInputError(f"{where}: {exc}") from None
        if config.vocab_size is None:  # `gaudi3 ckpt export` writes the embedding's rows there
            raise UserInputError(
                f"{where}: vocab_size is {'null' if 'vocab_size' in raw else 'missing'}; allowed: a positive "
                f"integer, the rows of tok_embeddings.weight in its {WEIGHTS_NAME}"
            )
    elif (path / HF_CONFIG_NAME).is_file():
        where = f"{field_name} {path / HF_CONFIG_NAME}"
        raw = load_json_file(path / HF_CONFIG_NAME, what=f"{field_name} config")
        config = hf_model_config(raw, name=path.name, where=where)
        model_type = config.arch
    else:
        raise UserInputError(
            f"{field_name}: {str(path)!r} has neither config.json (Hugging Face) nor model_config.json "
            "(`gaudi3 ckpt export`); allowed: a directory holding one of them beside its safetensors"
        )
    check_parameter_count(config, where)
    return config, model_type


# What the checkpoint decides; the rest of the model section (name, dropout, vocabulary padding) is the run's.
SHAPE_FIELDS = ("arch", "num_layers", "num_heads", "num_kv_heads", "activation", "dim", "ffn_dim", "num_experts",
                "experts_per_token", "vocab_size", "bias", "norm_eps", "rope_theta", "tie_embeddings",
                "type_vocab_size")  # fmt: skip


def pretrained_model_fields(init_from: str, explicit: Mapping[str, Any]) -> dict[str, Any]:
    """The model fields `model.init_from` decides: its config's shape, and its context_length unless `explicit`
    (the fields the user set) asks for a shorter one. A set field that disagrees is one line (`ConfigError`).

    A longer context than the checkpoint's is refused: GPT-2 has no learned positions beyond it, and Llama's RoPE
    was not trained there (scaled RoPE is not implemented).
    """
    config, _ = read_pretrained_config(init_from)
    fields = {name: getattr(config, name) for name in SHAPE_FIELDS}
    # Compare what the model computes with: num_kv_heads null means num_heads, ffn_dim null means 4 * dim.
    effective = {"num_kv_heads": lambda v: v or config.num_heads, "ffn_dim": lambda v: v or 4 * config.dim}
    wanted = {"num_kv_heads": config.kv_heads, "ffn_dim": config.hidden_dim}
    for name in SHAPE_FIELDS:
        if name not in explicit or (name == "activation" and config.arch == "llama"):
            continue
        value = effective.get(name, lambda v: v)(explicit[name])
        if value != wanted.get(name, fields[name]):
            raise ConfigError(
                f"model.{name}",
                f"{explicit[name]!r} disagrees with model.init_from {init_from} ({fields[name]!r}); leave it unset",
            )
    context = explicit.get("context_length", config.context_length)
    if isinstance(context, int) and context > config.context_length:
        raise ConfigError(
            "model.context_length",
            f"{context} exceeds model.init_from {init_from}'s {config.context_length} positions; allowed: at most "
            f"{config.context_length}, or unset",
        )
    return {**fields, "context_length": context}


def _tensor_files(directory: Path, field_name: str) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (the index's weight map, or the single file's keys)."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        index = load_json_file(index_path, what=f"{field_name} safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserInputError(
                f"{field_name}: {index_path} has no weight_map of tensor name → file; allowed: the index "
                "transformers' save_pretrained writes"
            )
        for entry in sorted(set(weight_map.values())):
            _check_shard(directory, index_path, entry, field_name)
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_NAME
    if not single.is_file():
        raise UserInputError(
            f"{field_name}: {str(directory)!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}; allowed: one "
            "safetensors file, or shards listed by an index"
        )
    return dict.fromkeys(_header(single, field_name), single)


def _check_shard(directory: Path, index_path: Path, entry: str, field_name: str) -> None:
    """A shard the index lists is a file name in `directory` (save_pretrained writes no other), and is there."""
    if Path(entry).name != entry or entry in ("", ".", ".."):
        inside = (directory / entry).resolve().is_relative_to(directory.resolve())
        where = f"not a file name in {directory}" if inside else f"a path that leaves {directory}"
        raise UserInputError(
            f"{field_name}: {index_path} lists shard {brief(entry)}, {where}; allowed: file names in the "
            "checkpoint directory"
        )
    if not (directory / entry).is_file():
        raise UserInputError(
            f"{field_name}: {index_path} lists shard {brief(entry)}, which is missing from {directory}; allowed: an "
            "index whose every shard file is present"
        )


def _header(path: Path, field_name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name → (dtype, shape) from a safetensors header; one line for a file that is not one."""
    safe_open = import_safe_open()
    import safetensors

    try:
        with safe_open(str(path), framework="pt") as handle:
            out = {}
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                sliced = handle.get_slice(name)
                out[name] = (sliced.get_dtype(), tuple(sliced.get_shape()))
            return out
    except (safetensors.SafetensorError, OSError, ValueError) as exc:  # truncated, garbage header
        raise UserInputError(
            f"{field_name}: {path} is not a readable safetensors file ({str(exc).splitlines()[0]}); allowed: a "
            "complete file as save_pretrained or `gaudi3 ckpt export` writes it"
        ) from None


def _check_tensors(
    directory: Path,
    files: dict[str, Path],
    expected: Iterable[tuple[str, tuple[int, ...]]],
    field_name: str,
    config: ModelConfig,
) -> None:
    """Every tensor the model needs is in the file the index names, a floating-point one with the shape its config
    implies; and the files hold no weight the model does not have (but the harmless ones, `models.hf.ignored_tensor`).

    `expected` is consumed one tensor at a time: the first one wrong ends the check before the rest are listed.
    """
    headers = {file: _header(file, field_name) for file in sorted(set(files.values()))}
    used: set[str] = set()
    for name, shape in expected:
        file = files.get(name)
        if file is None or name not in headers[file]:
            where = file.name if file is not None else "any file"
            raise UserInputError(
                f"{field_name}: tensor {name!r} is missing from {where} in {directory}; allowed: a checkpoint "
                "holding every weight of its config's model"
            )
        dtype, stored = headers[file][name]
        if dtype not in FLOAT_DTYPES:
            raise UserInputError(
                f"{field_name}: tensor {name!r} in {file} has dtype {dtype}; allowed: floating-point weights "
                f"({', '.join(FLOAT_DTYPES)}), not quantized ones"
            )
        if stored != shape:
            raise UserInputError(
                f"{field_name}: tensor {name!r} in {file} has shape {list(stored)}, but the checkpoint's config "
                f"implies {list(shape)}; allowed: weights that match their config"
            )
        used.add(name)
    unused = [name for header in headers.values() for name in header if name not in used]
    unused = [name for name in unused if not ignored_tensor(name, config)]
    if unused:
        examples = " and ".join(brief(name) for name in unused[:2])
        raise UserInputError(
            f"{field_name}: {directory} holds {len(unused)} tensor(s) that its config's model does not have, such as "
            f"{examples}; allowed: a config that describes every stored weight (its layer count, no quantization "
            "scales)"
        )


def import_safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise UserInputError(
            f"reading safetensors checkpoints needs the safetensors package: {_INSTALL}"
        ) from None
    return safe_open
