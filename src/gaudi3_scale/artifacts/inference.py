"""Load a trained checkpoint for sampling, and turn a prompt into text."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from gaudi3_scale.checkpoint.contents import (
    STATE_DICT_KEY,
    model_weights,
    run_config,
    trained_tokenizer_sha256,
)
from gaudi3_scale.checkpoint.manager import checkpoint_directory, resolve_checkpoint
from gaudi3_scale.checkpoint.manifest import read_manifest
from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data import Tokenizer, load_tokenizer
from gaudi3_scale.data.tokenizers import tokenizer_sha256
from gaudi3_scale.models import ModelConfig, build_model
from gaudi3_scale.models.generate import generate

__all__ = [
    "check_tokenizer_fits",
    "check_trained_tokenizer",
    "generate_text",
    "load_for_generation",
    "read_model_state",
    "refuse_encoder",
    "run_tokenizer_dir",
    "trained_tokenizer",
]


def read_model_state(path: Path, *, mmap: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model's config and weights (keys as in `Transformer.state_dict()`) from a `gaudi3 train` checkpoint."""
    ckpt = read_checkpoint(path, mmap=mmap)
    config = run_config(ckpt)
    if config is None or STATE_DICT_KEY not in ckpt:
        raise UserInputError(f"{path}: not a gaudi3-scale checkpoint (no run config inside)")
    return from_dict(ModelConfig, config["model"]), model_weights(ckpt)


def refuse_encoder(cfg: ModelConfig, where: str | Path) -> None:
    """One line for an encoder: generating and serving continue text, which a masked-language model cannot."""
    if cfg.arch == "bert":
        raise UserInputError(
            f"{where}: model {cfg.name!r} is a bert encoder (masked-language model) and cannot generate text; "
            "generate and serve take a decoder checkpoint (arch gpt2 or llama)"
        )


def check_tokenizer_fits(tokenizer: Tokenizer, cfg: ModelConfig) -> None:
    """One line for a tokenizer with more ids than the model has embedding rows: its ids would index past them
    (generate, serve and export ship or use a model with the tokenizer it names)."""
    if cfg.vocab_size is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise UserInputError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model {cfg.name!r} only {cfg.vocab_size}; "
            "pass the tokenizer it was trained with (--tokenizer DIR)"
        )


def trained_tokenizer(checkpoint: Path) -> str | None:
    """The identity of the tokenizer `checkpoint` (`step-X/` or its `state.ckpt`) was trained with, from its manifest
    (`data.tokenizers.tokenizer_sha256`); None for a checkpoint that predates the record, or a plain file (no
    manifest)."""
    directory = checkpoint_directory(checkpoint)
    return trained_tokenizer_sha256(read_manifest(directory) if directory.is_dir() else None)


def check_trained_tokenizer(
    tokenizer: Tokenizer, trained_sha256: str | None, *, tokenizer_dir: Path, model: str | Path, given: bool
) -> None:
    """One line for a tokenizer other than the one `model` was trained with (`trained_sha256`, recorded by its
    checkpoint or its export): its ids would stand for other text however many it has, and generation would
    silently run on the wrong alphabet. `given`: the user named `tokenizer_dir` (--tokenizer). A model that
    predates the record (None) has nothing to compare it with and is served as before."""
    if trained_sha256 is None:
        return
    got = tokenizer_sha256(tokenizer)
    if got == trained_sha256:
        return
    fix = (
        "pass the run's own tokenizer directory or leave --tokenizer unset"
        if given
        else "it was replaced since; pass the tokenizer directory the run trained with (--tokenizer DIR)"
    )
    raise UserInputError(
        f"tokenizer {str(tokenizer_dir)!r} is not the one {str(model)!r} was trained with (sha256 {got[:12]}… vs "
        f"{trained_sha256[:12]}…); {fix}"
    )


def run_tokenizer_dir(checkpoint: Path) -> Path:
    """Where `gaudi3 train` keeps the tokenizer of `checkpoint`: `<run>/tokenizer/` beside `<run>/checkpoints/`."""
    return checkpoint_directory(Path(checkpoint)).parent.parent / "tokenizer"


def load_for_generation(
    checkpoint: str | Path, tokenizer_dir: str | Path | None = None
) -> tuple[nn.Module, Tokenizer]:
    """Model (eval mode, CPU) and tokenizer from a checkpoint written by `gaudi3 train`, or from a run directory
    (its newest checkpoint that verifies: `checkpoint.manager.resolve_checkpoint`).

    The tokenizer is read from `<run>/tokenizer/` next to `<run>/checkpoints/` unless `tokenizer_dir` is given; one
    other than the run trained with is refused (`check_trained_tokenizer`).
    """
    path = resolve_checkpoint(checkpoint)
    # Memory-mapped: the optimizer's state (twice the weights under AdamW) is never read into memory, and the
    # weights' pages are dropped once copied into the model (gpt2-124m's sample: 1.71 → 1.26 GiB peak RSS).
    model_cfg, state = read_model_state(path, mmap=True)
    refuse_encoder(model_cfg, path)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else run_tokenizer_dir(path)
    if not tok_dir.is_dir():
        raise UserInputError(f"tokenizer directory {str(tok_dir)!r} does not exist; pass --tokenizer DIR")
    tokenizer = load_tokenizer(tok_dir, flag="--tokenizer" if tokenizer_dir else None)
    check_tokenizer_fits(tokenizer, model_cfg)
    check_trained_tokenizer(tokenizer, trained_tokenizer(path), tokenizer_dir=tok_dir, model=path,
                            given=bool(tokenizer_dir))  # fmt: skip
    model = build_model(model_cfg)
    model.load_state_dict(state)
    del state
    model.eval()
    return model, tokenizer


@torch.no_grad()
def generate_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int = 0,
) -> str:
    """Prompt + sampled continuation, decoded. An empty prompt starts from a newline; only ids the tokenizer can
    decode are sampled (the model may have more rows, as a Hugging Face one fine-tuned with the byte tokenizer)."""
    ids = tokenizer.encode(prompt or "\n")
    if not ids:
        raise UserInputError("--prompt encodes to no tokens with this tokenizer")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        out = generate(
            model,
            tokens,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            generator=generator,
            vocab_size=tokenizer.vocab_size,
        )
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0].tolist())
