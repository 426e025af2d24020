"""Lightning's `CheckpointIO` that commits every save with a manifest and verifies every load.

Works with plain Lightning too: `pl.Trainer(plugins=[VerifiedCheckpointIO()])`. The asynchronous variant is in
`async_save`; `Checkpointer` builds the one a run's config asks for.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from gaudi3_scale.checkpoint.contents import EPOCH_KEY, GLOBAL_STEP_KEY, META_KEY
from gaudi3_scale.checkpoint.manager import (
    STATE_NAME,
    CheckpointSaveError,
    checkpoint_directory,
    prepare_directory,
)
from gaudi3_scale.checkpoint.manifest import fsync_directory, write_manifest
from gaudi3_scale.checkpoint.reader import load_committed

__all__ = ["VerifiedCheckpointIO"]


class VerifiedCheckpointIO(CheckpointIO):
    """Every save is a directory committed by a manifest; every load verifies sizes and checksums first.

    A committed checkpoint is never overwritten; a damaged one at the same path is renamed to `step-X.damaged-N`
    and kept; an uncommitted directory (a save that crashed) is replaced. `on_commit(directory)` runs after each
    commit (`Checkpointer.commit`: queue the upload, move `latest`, apply retention).
    """

    def __init__(self, on_commit: Callable[[Path], None] | None = None) -> None:
        self.on_commit = on_commit

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        directory = checkpoint_directory(path)
        prepare_directory(directory)
        tmp = directory / (STATE_NAME + ".tmp")
        try:
            with tmp.open("wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(directory / STATE_NAME)
            meta = {"step": checkpoint.get(GLOBAL_STEP_KEY), "epoch": checkpoint.get(EPOCH_KEY)}
            write_manifest(directory, {**meta, **checkpoint.get(META_KEY, {})})
        except BaseException as exc:
            shutil.rmtree(directory, ignore_errors=True)  # never leave a half-written checkpoint behind
            if isinstance(exc, OSError):
                raise CheckpointSaveError(directory, exc) from exc
            raise
        fsync_directory(directory.parent)
        if self.on_commit is not None:
            self.on_commit(directory)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        # Tensors load on the CPU; Lightning moves them to the device when it restores the state.
        return load_committed(path, weights_only=True if weights_only is None else weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        shutil.rmtree(checkpoint_directory(path), ignore_errors=True)
