"""How a checkpoint directory is written: one writer per layout, each called only by `Checkpointer.save`.

    single file  one process, DDP, DeepSpeed  Lightning's checkpoint dict → the run's IO plugin (rank 0): the state,
                                              then the manifest, then the commit (in the background when async)
    sharded      FSDP (torch.distributed.checkpoint)  every rank writes its shards; after a barrier rank 0 writes
                                              the manifest and commits
    light        rank 0: the weights, counters and the tier's entries → the IO plugin, into the light tier

A writer raises `CheckpointSaveError` for a save that failed and left nothing committed.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.distributed.checkpoint.api import CheckpointException

from gaudi3_scale.checkpoint.manager import STATE_NAME, CheckpointSaveError, prepare_directory
from gaudi3_scale.checkpoint.manifest import write_manifest

__all__ = ["write_light", "write_sharded", "write_single_file"]


def write_single_file(trainer: pl.Trainer, path: Path) -> None:
    """Lightning's whole checkpoint dict as `path/state.ckpt`, committed by the IO plugin (rank 0 writes)."""
    trainer.save_checkpoint(path / STATE_NAME, weights_only=False)


def write_light(trainer: pl.Trainer, path: Path, state: dict[str, Any]) -> None:
    """`state` (weights, counters, the light tier's entries) as `path/state.ckpt`, through the same IO plugin."""
    trainer.strategy.save_checkpoint(state, path / STATE_NAME)


def write_sharded(
    trainer: pl.Trainer, path: Path, meta: Callable[[], dict[str, Any]], commit: Callable[[Path], None]
) -> None:
    """Every rank writes its shards (DCP) into `path`; once all have, rank 0 writes the manifest with `meta()` and
    commits. A failure on any rank (DCP raises it on every rank) removes the directory."""
    if trainer.is_global_zero:
        prepare_directory(path)
    trainer.strategy.barrier("gaudi3_checkpoint_prepare")
    try:
        trainer.save_checkpoint(path, weights_only=False)  # every rank: its shards; rank 0 also meta.pt
    except (OSError, CheckpointException) as exc:
        if trainer.is_global_zero:
            shutil.rmtree(path, ignore_errors=True)
        raise CheckpointSaveError(path, exc) from exc
    trainer.strategy.barrier("gaudi3_checkpoint_shards")
    if trainer.is_global_zero:
        write_manifest(path, {"step": trainer.global_step, "epoch": trainer.current_epoch, **meta()})
        commit(path)
