"""What `gaudi3 serve MODEL_OR_CHECKPOINT` can serve, and loading it with its tokenizer.

    run directory            its newest checkpoint that verifies (`<run>/checkpoints/`), tokenizer `<run>/tokenizer/`
    step-X/ or its state.ckpt a `gaudi3 train` checkpoint (`artifacts.inference.load_for_generation`)
    export                   `gaudi3 ckpt export` (either format: model_config.json or a Llama config.json, plus
                             model.safetensors), tokenizer `<export>/tokenizer/`, else an HF tokenizer.json at the top

`resolve_source` only looks at the file system, so a bad path fails before the port is bound or torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.tokenizers import TOKENIZER_FILE
from gaudi3_scale.models.config import ModelConfig

if TYPE_CHECKING:
    from torch import nn

    from gaudi3_scale.data.tokenizers import Tokenizer

__all__ = ["ModelSource", "ServedModel", "load_served_model", "resolve_source"]

# = artifacts.export.MODEL_CONFIG_NAME / HF_CONFIG_NAME / TOKENIZER_DIR, spelled out so that resolving a path does not
# import torch (a test checks they agree)
EXPORT_CONFIG = "model_config.json"
HF_CONFIG = "config.json"
EXPORT_TOKENIZER_DIR = "tokenizer"
_WHAT = (
    "pass a `gaudi3 train` run directory, a checkpoint (step-X/ or its state.ckpt) or a "
    "`gaudi3 ckpt export` directory"
)


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["checkpoint", "export"]
    path: Path  # the checkpoint (step dir or file) or the export directory


@dataclass(frozen=True)
class ServedModel:
    model: nn.Module  # eval mode
    tokenizer: Tokenizer
    config: ModelConfig
    name: str  # what clients send as `model`
    num_parameters: int
    source: ModelSource


def resolve_source(path: Path) -> ModelSource:
    """Which kind of model `path` holds; one line naming what to pass instead when it is none of them."""
    path = Path(path)
    if not path.exists():
        raise UserInputError(f"{str(path)!r} does not exist; {_WHAT}")
    if path.is_dir() and ((path / EXPORT_CONFIG).is_file() or (path / HF_CONFIG).is_file()):
        return ModelSource("export", path)
    if (path / "checkpoints").is_dir() or (
        path.is_dir() and any(path.glob("step-*"))
    ):  # a run, its checkpoints/
        return ModelSource("checkpoint", _newest_checkpoint(path))
    return ModelSource("checkpoint", path)


def _newest_checkpoint(path: Path) -> Path:
    from gaudi3_scale.checkpoint.manager import resolve_checkpoint  # the resolver generate and ckpt use too

    try:
        return resolve_checkpoint(path, warn=lambda message: None)
    except UserInputError as exc:
        raise UserInputError(f"{exc}; {_WHAT}") from None


def load_served_model(
    source: ModelSource, *, tokenizer_dir: Path | None = None, name: str | None = None
) -> ServedModel:
    """The model (eval mode; on the GPU when there is one) and its tokenizer, checked against each other."""
    import torch

    from gaudi3_scale.data import load_tokenizer
    from gaudi3_scale.models import count_parameters

    if source.kind == "export":
        from gaudi3_scale.artifacts.export import exported_tokenizer_sha256, load_exported
        from gaudi3_scale.artifacts.inference import (
            check_tokenizer_fits,
            check_trained_tokenizer,
            refuse_encoder,
        )
        from gaudi3_scale.models.pretrained import read_pretrained_config

        refuse_encoder(read_pretrained_config(source.path, field_name="export")[0], source.path)
        exported = load_exported(source.path)
        tok_dir = _export_tokenizer_dir(source.path, tokenizer_dir)
        tokenizer = load_tokenizer(tok_dir, flag="--tokenizer" if tokenizer_dir else None)
        check_tokenizer_fits(tokenizer, exported.config)
        # and the identity the export carries from its checkpoint, as load_for_generation checks a checkpoint's
        check_trained_tokenizer(tokenizer, exported_tokenizer_sha256(source.path), tokenizer_dir=tok_dir,
                                model=source.path, given=tokenizer_dir is not None)  # fmt: skip
        model: nn.Module = exported
    else:
        from gaudi3_scale.artifacts.inference import load_for_generation

        model, tokenizer = load_for_generation(source.path, tokenizer_dir)  # checked as above
    cfg = model.config
    assert isinstance(cfg, ModelConfig) and cfg.vocab_size is not None, "loaders build with build_model"
    if torch.cuda.is_available():
        model = model.to("cuda")
    return ServedModel(model.eval(), tokenizer, cfg, name or cfg.name, count_parameters(cfg), source)


def _export_tokenizer_dir(export: Path, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is not None:
        return Path(tokenizer_dir)
    for directory in (export / EXPORT_TOKENIZER_DIR, export):  # ours, else a Hugging Face tokenizer.json
        if (directory / TOKENIZER_FILE).is_file():
            return directory
    raise UserInputError(
        f"{str(export)!r} has no tokenizer (tokenizer/ or tokenizer.json); pass --tokenizer DIR (a directory "
        "with tokenizer.json, e.g. the run's tokenizer/) or re-export the checkpoint from its run directory"
    )
