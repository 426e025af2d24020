"""`gaudi3 ckpt export`: a checkpoint's model as one safetensors file, or as a Hugging Face Llama / BERT directory.

    safetensors  `model.safetensors` under our parameter names (`Transformer.state_dict()` keys) and
                 `model_config.json` (the `ModelConfig`); `load_exported(dir)` builds the model back.
    hf           `config.json` + `model.safetensors` that `transformers.LlamaForCausalLM.from_pretrained(dir)`
                 loads with the same logits (Llama-arch models; bert ones as `BertForMaskedLM`, `models.hf_bert`;
                 the mapping is `models.hf`); `load_exported` reads it back too, as does `model.init_from`.
                 Without the vocabulary padding (`models.vocab`): its `vocab_size` is the tokenizer's.

The weights' safetensors metadata carries the identity of the tokenizer the checkpoint was trained with
(`exported_tokenizer_sha256`), so that serving the export refuses another one as generating from the checkpoint does.

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

import torch

from gaudi3_scale.artifacts.inference import (
    check_tokenizer_fits,
    check_trained_tokenizer,
    read_model_state,
    run_tokenizer_dir,
    trained_tokenizer,
)
from gaudi3_scale.checkpoint.contents import TOKENIZER_SHA256_KEY
from gaudi3_scale.checkpoint.manager import resolve_checkpoint
from gaudi3_scale.checkpoint.manifest import MANIFEST_NAME, fsync_directory, read_manifest
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.tokenizers import TOKENIZER_FILE, HFTokenizer, Tokenizer, load_tokenizer
from gaudi3_scale.models import ModelConfig, Transformer, build_model
from gaudi3_scale.models.build import model_class
from gaudi3_scale.models.hf import hf_llama_config, to_hf_llama
from gaudi3_scale.models.hf_bert import hf_bert_config, to_hf_bert
from gaudi3_scale.models.pretrained import (
    HF_CONFIG_NAME,  # format hf: transformers' LlamaConfig
    MODEL_CONFIG_NAME,  # format safetensors: our ModelConfig
    WEIGHTS_NAME,
    import_safe_open,
    open_pretrained,
)
from gaudi3_scale.models.pretrained_reader import load_pretrained
from gaudi3_scale.models.vocab import drop_vocab_padding

__all__ = [
    "EXPORT_FORMATS",
    "export_checkpoint",
    "exported_tokenizer_sha256",
    "load_exported",
]

EXPORT_FORMATS = ("safetensors", "hf")
TOKENIZER_DIR = "tokenizer"  # our tokenizer.json, as in <run>/tokenizer/ (read by gaudi3 serve and generate)
# format hf with a Hugging Face tokenizer: tokenizer.json at the top plus this, which AutoTokenizer reads
HF_TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
TIED_ALIAS = "output.weight"  # the head shares tok_embeddings.weight when model.tie_embeddings is set
_INSTALL = "pip install 'gaudi3-scale[export]'"


def export_checkpoint(
    checkpoint: Path,
    out_dir: Path,
    *,
    fmt: str = "safetensors",
    force: bool = False,
    tokenizer_dir: Path | None = None,
) -> list[Path]:
    """Write the model of `checkpoint` (a run directory: its newest checkpoint that verifies) to `out_dir` in format
    `fmt`; returns the files written.

    The tokenizer (`tokenizer_dir`, default the run's `<run>/tokenizer/`) is copied to `<out>/tokenizer/` when
    there is one; with `hf` and a Hugging Face tokenizer (bpe or a tokenizer.json) it is also written at the top as
    transformers, vLLM and TGI expect. `out_dir` must be absent or empty unless `force`; it is written under a
    temporary name beside it and renamed into place, so it is never left half-written.
    """
    # A run directory resolves to its newest checkpoint that verifies, as for `gaudi3 ckpt export` and
    # `load_for_generation`: the run's tokenizer is found from the checkpoint's place in the run, not from the name.
    checkpoint, out_dir = resolve_checkpoint(checkpoint), Path(out_dir)
    if fmt not in EXPORT_FORMATS:
        raise UserInputError(f"--format {fmt!r} is not known; valid: {', '.join(EXPORT_FORMATS)}")
    _check_destination(checkpoint, out_dir, force=force)
    safetensors_torch = _import_safetensors()
    cfg, state = read_model_state(checkpoint, mmap=True)
    trained = trained_tokenizer(checkpoint)
    tokenizer = _run_tokenizer(checkpoint, tokenizer_dir, cfg, trained)
    state = _untied(cfg, _checked_state(cfg, state, checkpoint))
    if fmt == "hf":
        if cfg.arch not in ("llama", "bert"):
            raise UserInputError(
                f"{checkpoint}: --format hf writes LlamaForCausalLM or BertForMaskedLM, but model {cfg.name!r} has "
                f"arch {cfg.arch!r}; use --format safetensors"
            )
        dtype, config_name = state["tok_embeddings.weight"].dtype, HF_CONFIG_NAME
        cfg, state = drop_vocab_padding(cfg, state)  # transformers would sample the padding rows
        if cfg.arch == "bert":
            tensors, config = to_hf_bert(cfg, state), hf_bert_config(cfg, dtype=dtype)
        else:
            tensors, config = to_hf_llama(cfg, state), hf_llama_config(cfg, dtype=dtype)
    else:
        tensors, config_name, config = state, MODEL_CONFIG_NAME, to_dict(cfg)
    with _staged_directory(out_dir, force=force) as staging:
        (staging / config_name).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        # "format": "pt" is what transformers' loader expects in the safetensors header; the trained tokenizer's
        # identity travels with the weights, so that serving the export refuses another (`exported_tokenizer_sha256`).
        metadata = {"format": "pt", **({TOKENIZER_SHA256_KEY: trained} if trained is not None else {})}
        safetensors_torch.save_file(tensors, str(staging / WEIGHTS_NAME), metadata=metadata)
        # safetensors writes through a private temp file (mode 0600); give the weights the umask's mode instead.
        (staging / WEIGHTS_NAME).chmod((staging / config_name).stat().st_mode)
        written = [WEIGHTS_NAME, config_name]
        if tokenizer is not None:
            (staging / TOKENIZER_DIR).mkdir()
            written.append(tokenizer.save(staging / TOKENIZER_DIR).relative_to(staging).as_posix())
            if fmt == "hf" and isinstance(tokenizer, HFTokenizer):
                written += _write_hf_tokenizer(tokenizer, staging)
    return [out_dir / name for name in written]


def _run_tokenizer(
    checkpoint: Path, tokenizer_dir: Path | None, cfg: ModelConfig, trained: str | None
) -> Tokenizer | None:
    """The tokenizer to ship with the export: `tokenizer_dir` (must exist), else the run's if it has one. An export
    that pairs them must generate: it must fit model `cfg` and be the one the checkpoint was trained with
    (`trained`, its identity)."""
    directory = Path(tokenizer_dir) if tokenizer_dir else run_tokenizer_dir(checkpoint)
    if tokenizer_dir is None and not (directory / TOKENIZER_FILE).is_file():
        return None  # a bare checkpoint file, not inside a run directory
    tokenizer = load_tokenizer(directory, flag="--tokenizer" if tokenizer_dir else None)
    check_tokenizer_fits(tokenizer, cfg)
    check_trained_tokenizer(tokenizer, trained, tokenizer_dir=directory, model=checkpoint,
                            given=tokenizer_dir is not None)  # fmt: skip
    return tokenizer


def exported_tokenizer_sha256(directory: Path) -> str | None:
    """The identity of the tokenizer an export's model was trained with (`data.tokenizers.tokenizer_sha256`), from
    its weights' safetensors metadata; None for an export of a checkpoint that predates the record, or a Hugging
    Face directory not written here (no single model.safetensors)."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        return None
    with import_safe_open()(str(path), framework="pt") as handle:
        saved = (handle.metadata() or {}).get(TOKENIZER_SHA256_KEY)
    return saved if isinstance(saved, str) else None


def _write_hf_tokenizer(tokenizer: HFTokenizer, directory: Path) -> list[str]:
    (directory / TOKENIZER_FILE).write_text(tokenizer.to_json(), encoding="utf-8")
    # No special tokens: our models are trained on raw text, with no BOS/EOS added.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False}
    (directory / HF_TOKENIZER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [TOKENIZER_FILE, HF_TOKENIZER_CONFIG_NAME]


def load_exported(directory: Path) -> Transformer:
    """The model (eval mode, CPU) from a `gaudi3 ckpt export` directory of either format (or any Hugging Face Llama
    or GPT-2 directory): read by `models.pretrained`, the reader `model.init_from` uses, so the export registered
    in a model registry serves and generates like its checkpoint."""
    checkpoint = open_pretrained(directory, field_name="export")
    with torch.device("meta"):
        model = build_model(checkpoint.config)
    model.to_empty(device="cpu")
    load_pretrained(model, checkpoint)
    return model.eval()


def _checked_state(
    cfg: ModelConfig, state: dict[str, torch.Tensor], checkpoint: Path
) -> dict[str, torch.Tensor]:
    """`state` if its names and shapes are those of `cfg`'s model, else one line naming the first mismatch."""
    with torch.device("meta"):  # shapes only: no memory, even for llama3-70b
        expected = {k: tuple(v.shape) for k, v in model_class(cfg)(cfg).state_dict().items()}
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
    """Refuse an --out that is a file, non-empty without --force, or holds what a run keeps: the checkpoint itself,
    any committed checkpoint (one that holds or lies inside one), a run's tokenizer."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserInputError(f"--out {str(out_dir)!r} is a file; pass a directory")
    resolved = out_dir.resolve()
    # replaced by a rename, the current directory would leave this process nowhere
    if Path.cwd().resolve().is_relative_to(resolved):
        raise UserInputError(
            f"--out {str(out_dir)!r} is the current directory or holds it; pass a new directory"
        )
    if inside := next((d for d in resolved.parents if read_manifest(d) is not None), None):
        raise UserInputError(f"--out {str(out_dir)!r} lies inside the committed checkpoint {str(inside)!r}")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise UserInputError(
                f"--out {str(out_dir)!r} exists and is not empty; pick a new directory or pass --force to replace it"
            )
        if checkpoint.resolve().is_relative_to(resolved):
            raise UserInputError(f"--out {str(out_dir)!r} contains the checkpoint; --force would delete it")
        committed = (m.parent for m in resolved.rglob(MANIFEST_NAME) if read_manifest(m.parent) is not None)
        if held := next(committed, None):
            raise UserInputError(f"--out {str(out_dir)!r} holds the committed checkpoint {str(held)!r}; --force "
                                 "would delete it")  # fmt: skip
        if resolved.name == TOKENIZER_DIR and (resolved.parent / "checkpoints").is_dir():
            raise UserInputError(f"--out {str(out_dir)!r} is a run's tokenizer; --force would replace it")


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
