"""The one reader of checkpoints: resolve what a user names, verify the manifest, `torch.load(weights_only=True)`.

Resuming (`VerifiedCheckpointIO.load_checkpoint`), `generate`, `serve`, export, registering, `ckpt diff`, `repro`
and the resume checks all read here, so every reader refuses a damaged checkpoint with the same one line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.checkpoint.manager import STATE_NAME, checkpoint_directory, resolve_checkpoint
from gaudi3_scale.checkpoint.manifest import read_manifest, verify_checkpoint
from gaudi3_scale.checkpoint.sharded import consolidate, is_sharded, read_sharded_meta
from gaudi3_scale.config.errors import UserInputError

__all__ = ["load_committed", "read_checkpoint"]


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    mmap: bool = False,
    verify: bool = True,
    tensors: bool = True,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """A checkpoint as a dict (weights_only load, on CPU), or one line saying why it cannot be read.

    `path` is anything `resolve_checkpoint` takes: a run directory or its `checkpoints/` (the newest checkpoint
    that verifies; each damaged one skipped is named via `warn`), a `latest` pointer, a checkpoint directory
    (`step-X/`), its `state.ckpt`, or a plain Lightning checkpoint file. A directory is read only if its manifest
    commits it and (with `verify`) every checksum matches. A sharded checkpoint is consolidated into full tensors;
    with `tensors=False` only its non-tensor state is read.
    """
    directory = resolve_checkpoint(path, warn=warn)
    if not directory.is_dir():  # a plain Lightning checkpoint file: nothing to verify it against
        return _load(directory, mmap=mmap, tensors=tensors)
    if verify or read_manifest(directory) is None:
        _refuse_unverified(directory)
    return _load(directory, mmap=mmap, tensors=tensors)


def load_committed(path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
    """The checkpoint at `path` (`step-X/` or its `state.ckpt`), only if committed and verified: what a resume
    loads. Unlike `read_checkpoint` nothing is resolved, and a plain file (no manifest) is refused."""
    directory = checkpoint_directory(path)
    _refuse_unverified(directory)
    return _load(directory, weights_only=weights_only)


def _refuse_unverified(directory: Path) -> None:
    problems = verify_checkpoint(directory)
    if problems:
        raise UserInputError(f"checkpoint {str(directory)!r} is not usable: {problems[0]}")


def _load(
    target: Path, *, mmap: bool = False, tensors: bool = True, weights_only: bool = True
) -> dict[str, Any]:
    """Load a checkpoint directory (single-file or sharded) or a plain checkpoint file; nothing is verified here."""
    if target.is_dir():
        if is_sharded(target):  # written by FSDP, read by one process
            try:
                return consolidate(target) if tensors else read_sharded_meta(target)
            except (
                Exception
            ) as exc:  # DCP and torch.load raise many types for a damaged shard; one line for all
                raise UserInputError(
                    f"{target}: not a readable sharded checkpoint ({type(exc).__name__}); pick another one"
                ) from None
        target = target / STATE_NAME
    if not target.is_file():
        raise UserInputError(f"checkpoint {str(target)!r} does not exist")
    try:
        # weights_only=False only when Lightning's caller asks for it (`trainer.fit(weights_only=False)`).
        ckpt = torch.load(target, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except Exception as exc:  # torch raises many types for a damaged file; all mean the same to the user
        raise UserInputError(
            f"{target}: not a readable checkpoint ({type(exc).__name__}); pick another one"
        ) from None
    if not isinstance(ckpt, dict):
        raise UserInputError(f"{target}: not a Lightning checkpoint (a {type(ckpt).__name__}, not a mapping)")
    return ckpt
