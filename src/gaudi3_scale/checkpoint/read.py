"""Read a checkpoint written by `gaudi3 train` into memory: the one reader of the trainer's resume checks, the
artifact tools (export, register, sampling) and the verify tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.checkpoint.manager import STATE_NAME, checkpoint_directory
from gaudi3_scale.checkpoint.manifest import read_manifest, verify_checkpoint
from gaudi3_scale.checkpoint.sharded import consolidate, is_sharded, read_sharded_meta
from gaudi3_scale.config.errors import UserInputError

__all__ = ["read_checkpoint"]


def read_checkpoint(
    path: Path, *, mmap: bool = False, verify: bool = True, tensors: bool = True
) -> dict[str, Any]:
    """A checkpoint as a dict (weights_only load), or one line saying why it cannot be read.

    `path` is a checkpoint directory (`step-X/`), its `state.ckpt`, or a plain Lightning checkpoint file. A
    directory is read only if its manifest commits it and (with `verify`) every checksum matches. A sharded
    checkpoint is consolidated into full tensors; with `tensors=False` only its non-tensor state is read.
    """
    path = Path(path)
    directory = checkpoint_directory(path)
    if directory.is_dir():
        if verify or read_manifest(directory) is None:
            problems = verify_checkpoint(directory)
            if problems:
                raise UserInputError(f"checkpoint {str(directory)!r} is not usable: {problems[0]}")
        if is_sharded(directory):
            return consolidate(directory) if tensors else read_sharded_meta(directory)
        path = directory / STATE_NAME
    if not path.is_file():
        raise UserInputError(f"checkpoint {str(path)!r} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises many types for a damaged file; all mean the same to the user
        raise UserInputError(
            f"{path}: not a readable checkpoint ({type(exc).__name__}); pick another one"
        ) from None
    if not isinstance(ckpt, dict):
        raise UserInputError(f"{path}: not a Lightning checkpoint (a {type(ckpt).__name__}, not a mapping)")
    return ckpt
