"""One object for a run's checkpoints: directory and retention, Lightning's checkpoint IO, the remote mirror, and
`save`, the one call that writes a checkpoint (with the writer of its layout, `checkpoint.writers`).

    with Checkpointer(run.checkpoint, out / "checkpoints", rank=rank, warn=warn) as checkpointer:
        trainer = pl.Trainer(plugins=[checkpointer.io], ...)   # saves commit through checkpointer.commit
        ...
    # leaving: uploads drained (up to checkpoint.remote_drain_timeout_s), retention applied, mirror closed

`start()` (which `with` calls) starts the mirror on rank 0 and re-submits every committed checkpoint, so uploads a
crash interrupted resume (verified ones only cost a read-back). `commit(directory)` is what happens after a
manifest is written: queue the upload first, then move `latest` and apply retention, so remote deletions that
retention queues run after the upload, when the remote `latest` already names the new checkpoint. A checkpoint
waiting for its upload to be verified is never deleted locally.

Reading back: a resume is Lightning's `fit(ckpt_path=…)`, which reads through `io` (a single file is verified
against its manifest before it is loaded; a sharded one is read by DCP into the sharded model) and restores the
weights, optimizer, scheduler, counters and sampler; `load` then hands our entries to their owners.
The tools read checkpoints with `checkpoint.reader.read_checkpoint`.

Light checkpoints (`config.light_every_steps`) go through the same IO and commit: `commit` sees a directory of
`light_manager` (`<run>/light_checkpoints/`) and moves that tier's `latest` and applies its retention
(`config.light_keep_last`) instead. They are not uploaded: the remote mirror is what a fresh machine resumes from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.checkpoint.async_save import AsyncVerifiedCheckpointIO
from gaudi3_scale.checkpoint.config import CheckpointConfig
from gaudi3_scale.checkpoint.contents import (
    EPOCH_KEY,
    GLOBAL_STEP_KEY,
    META_KEY,
    STATE_DICT_KEY,
    CheckpointContents,
)
from gaudi3_scale.checkpoint.manager import (
    LIGHT_DIR_NAME,
    CheckpointManager,
    CheckpointSaveError,
    RetentionPolicy,
)
from gaudi3_scale.checkpoint.verified_io import VerifiedCheckpointIO
from gaudi3_scale.checkpoint.writers import write_light, write_sharded, write_single_file

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from gaudi3_scale.checkpoint.remote import RemoteMirror

__all__ = ["Checkpointer"]


class Checkpointer:
    """Owns a run's `CheckpointManager` (retention from `config`), its Lightning checkpoint IO (asynchronous with
    `config.async_save`) and, from `start()` to `close()`, the remote mirror of `config.remote_url`.

    `rank` is the process's global rank: rank 0 alone commits single-file checkpoints and uploads. `warn`
    receives the mirror's outage and recovery lines. `storage_options` go to fsspec (`RemoteMirror`). Light
    checkpoints go to `light_directory` (default: `light_checkpoints/` beside `directory`).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        directory: Path,
        *,
        rank: int = 0,
        warn: Callable[[str], None] | None = None,
        storage_options: dict[str, object] | None = None,
        light_directory: Path | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self._warn = warn
        self._storage_options = storage_options
        self.mirror: RemoteMirror | None = None
        self._started = self._closed = False
        self.manager = CheckpointManager(
            directory,
            RetentionPolicy.from_config(config),
            can_delete=self._uploaded,
            on_delete=self._deleted,
        )
        self.light_manager = CheckpointManager(
            light_directory or Path(directory).with_name(LIGHT_DIR_NAME),
            RetentionPolicy(keep_last=config.light_keep_last),
        )
        self.contents = CheckpointContents()  # our entries, registered by their owners (checkpoint.contents)
        io_type = AsyncVerifiedCheckpointIO if config.async_save else VerifiedCheckpointIO
        # Lightning writes single-file checkpoints on rank 0 only; other ranks never commit.
        self.io: VerifiedCheckpointIO = io_type(on_commit=self.commit if rank == 0 else None)

    def start(self) -> Checkpointer:
        """Rank 0: start mirroring to `config.remote_url` and queue every committed checkpoint not yet verified."""
        assert not self._started, "Checkpointer.start() called twice"
        self._started = True
        if not self.config.remote_url or self.rank != 0:
            return self
        from gaudi3_scale.checkpoint.remote import RemoteMirror

        self.mirror = mirror = RemoteMirror(
            self.config.remote_url,
            storage_options=self._storage_options,
            # the first retry after 1 s, or sooner when the longest wait is shorter
            initial_backoff_s=min(1.0, self.config.remote_max_backoff_s),
            max_backoff_s=self.config.remote_max_backoff_s,
            warn=self._warn,
        )
        for _, path in self.manager.committed():  # uploads a crash interrupted; cheap for verified ones
            mirror.submit(path)
        return self

    def commit(self, directory: Path) -> None:
        """After a checkpoint's manifest is written (rank 0): queue its upload, move `latest`, apply retention;
        a light checkpoint: move its tier's `latest` and apply that tier's retention."""
        if directory.parent == self.light_manager.directory:
            self.light_manager.mark_latest(directory)
            return
        if self.mirror is not None:
            self.mirror.submit(directory)
        self.manager.mark_latest(directory)

    def save(
        self,
        trainer: pl.Trainer,
        *,
        light: bool = False,
        sharded: bool = False,
    ) -> tuple[Path, bool, CheckpointSaveError | None]:
        """Write the checkpoint of `trainer.global_step` with the writer of its layout (`checkpoint.writers`):
        `light` into the light tier, else `sharded` (FSDP: every rank) or single-file; `contents` adds our entries.
        On every rank: (its directory, whether the save went through — rank 0's outcome for a single file, which
        rank 0 alone writes — and this rank's own error, if any)."""
        manager = self.light_manager if light else self.manager
        path = manager.path_for(trainer.global_step)
        failure: CheckpointSaveError | None = None
        try:
            if light:
                write_light(trainer, path, self._light_state(trainer))
            elif sharded:  # the manifest gets the META_KEY entries this very save wrote
                write_sharded(trainer, path, lambda: self.contents.written.get(META_KEY, {}), self.commit)
            else:
                write_single_file(trainer, path)
        except CheckpointSaveError as exc:
            failure = exc
        return path, bool(trainer.strategy.broadcast(failure is None, src=0)), failure

    def load(self, checkpoint: Mapping[str, Any]) -> None:
        """Hand our entries of a checkpoint back to their owners (a resume). Lightning's `fit(ckpt_path=…)` reads
        the checkpoint through `io` (verified against its manifest; DCP for a sharded one) and restores the weights,
        optimizer, scheduler, counters and sampler; this restores the rest, from the one place both meet."""
        self.contents.load_from(checkpoint)

    def _light_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        """What a light checkpoint holds: the weights, the counters and our entries of the light tier (the run
        config, the manifest fields), tagged light; no optimizer, RNG or sampler state."""
        checkpoint: dict[str, Any] = {
            EPOCH_KEY: trainer.current_epoch,
            GLOBAL_STEP_KEY: trainer.global_step,
            STATE_DICT_KEY: trainer.strategy.lightning_module_state_dict(),  # ZeRO-3: gathered on every rank
        }
        self.contents.save_into(checkpoint, light=True)
        return checkpoint

    def wait_for_commit(self, trainer: pl.Trainer) -> CheckpointSaveError | None:
        """Wait for the asynchronous save in flight (rank 0 writes it), then meet every rank at a barrier; the
        save's error, if it failed."""
        error: CheckpointSaveError | None = None
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if trainer.is_global_zero and wait is not None:
            try:
                wait()
            except CheckpointSaveError as exc:
                error = exc
        trainer.strategy.barrier("gaudi3_checkpoint_committed")
        return error

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the save in flight is committed (raising its `CheckpointSaveError`) and every queued upload
        is verified; False when uploads are still pending after `timeout_s` (None: no limit)."""
        if isinstance(self.io, AsyncVerifiedCheckpointIO):
            self.io.wait()
        return self.mirror.wait(timeout_s) if self.mirror is not None else True

    def close(self) -> None:
        """End of the run: wait up to `config.remote_drain_timeout_s` for uploads; if all were verified, apply the
        retention that waited on them; stop the mirror (what is left unmirrored is named in a warning).

        A save in flight is not waited for here: Lightning's teardown does (`AsyncVerifiedCheckpointIO.teardown`),
        and raising its error from a `finally` would hide the exception that ended training.
        """
        if self._closed:
            return
        self._closed = True
        mirror = self.mirror
        if mirror is None:
            return
        timeout_s = self.config.remote_drain_timeout_s
        if mirror.wait(timeout_s):
            self.manager.apply_retention()  # what waited for its upload to be verified
        mirror.close(timeout_s=timeout_s)

    def __enter__(self) -> Checkpointer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _uploaded(self, path: Path) -> bool:
        """Retention may delete `path`: no mirror, or its remote copy is verified."""
        return self.mirror is None or self.mirror.is_verified(path)

    def _deleted(self, path: Path) -> None:
        if self.mirror is not None:
            self.mirror.delete_remote(path.name)
