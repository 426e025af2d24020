"""Checkpoint directories, the `latest` pointer and retention; what a user names resolved to one checkpoint.

Layout of a run's `checkpoints/`:

    step-00000500/state.ckpt      everything Lightning saves (+ RNG, sampler, config); sharded: see `sharded`
    step-00000500/manifest.json   written last: the commit (sizes, SHA-256, step, tokens, world size, …)
    latest                        "step-00000500", replaced atomically after the commit

Light checkpoints (`checkpoint.light_every_steps`: weights only, tagged `"tier": "light"` in the manifest) live in
`<run>/light_checkpoints/` beside `checkpoints/`, with the same layout, commit, pointer and their own retention. A
resume looks only in `checkpoints/`; `<run>/light_checkpoints` (or one of its `step-X/`) can be named wherever a
checkpoint is read for its weights (export, serve, generate), and the run's `tokenizer/` is found the same way.

A directory without a committed manifest is never loaded; the pointer moves only after the commit; retention
deletes only committed checkpoints that a newer committed one supersedes. `resolve_checkpoint` turns whatever a
user names (a run directory, its checkpoints/, a step directory or its state.ckpt) into one checkpoint.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gaudi3_scale.checkpoint.config import CheckpointConfig
from gaudi3_scale.checkpoint.contents import META_KEY
from gaudi3_scale.checkpoint.manifest import (
    STATE_NAME,
    fsync_directory,
    has_manifest,
    read_manifest,
    read_pointer,
    verify_checkpoint,
)
from gaudi3_scale.checkpoint.sharded import is_sharded
from gaudi3_scale.config.errors import UserInputError

__all__ = [
    "LATEST_NAME",
    "LIGHT_DIR_NAME",
    "META_KEY",
    "STATE_NAME",
    "CheckpointManager",
    "CheckpointSaveError",
    "RetentionPolicy",
    "checkpoint_directory",
    "prepare_directory",
    "resolve_checkpoint",
    "state_path",
]

LATEST_NAME = "latest"  # the pointer file: the name of the newest committed checkpoint directory
LIGHT_DIR_NAME = (
    "light_checkpoints"  # beside checkpoints/, so <checkpoint>/../../tokenizer is the run's for both
)
_PREFIX = "step-"


class CheckpointSaveError(UserInputError):
    """A save failed (disk full, storage gone): nothing of it was committed, earlier checkpoints are intact."""

    def __init__(self, directory: Path, cause: BaseException) -> None:
        super().__init__(f"checkpoint {directory} was not saved ({cause}); earlier checkpoints are intact")
        self.directory = directory


def checkpoint_directory(path: str | os.PathLike[str]) -> Path:
    """`step-X/` for either the directory or its `state.ckpt`."""
    path = Path(path)
    return path.parent if path.name == STATE_NAME else path


def state_path(directory: Path) -> Path:
    """What Lightning's `ckpt_path` names: the directory itself when sharded, else its `state.ckpt`."""
    return directory if is_sharded(directory) else directory / STATE_NAME


def prepare_directory(directory: Path) -> None:
    """Make `directory` empty and ready for a new save, without ever touching an intact committed checkpoint.

    A damaged committed one (a resume skipped it; its manifest malformed included) is renamed to
    `step-X.damaged-N` and kept for inspection; an uncommitted one (the leftover of a save that crashed) is removed.
    """
    if has_manifest(directory):
        if not verify_checkpoint(directory):
            raise FileExistsError(f"{directory} is a committed checkpoint; it is never overwritten")
        _set_aside(directory)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def _set_aside(directory: Path) -> Path:
    for n in range(1, 1000):
        target = directory.with_name(f"{directory.name}.damaged-{n}")
        if not target.exists():
            directory.rename(target)
            return target
    raise FileExistsError(f"too many damaged copies of {directory}")


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 3  # the newest N committed checkpoints
    keep_every_steps: int = 0  # also every checkpoint whose step is a multiple of K (0 = none)
    keep_best: int = 0  # also the N with the lowest validation loss (from the manifests)

    @classmethod
    def from_config(cls, config: CheckpointConfig) -> RetentionPolicy:
        return cls(
            keep_last=config.keep_last, keep_every_steps=config.keep_every_steps, keep_best=config.keep_best
        )


class CheckpointManager:
    """Names, commits the `latest` pointer, finds the newest valid checkpoint, applies retention."""

    def __init__(
        self,
        directory: Path,
        policy: RetentionPolicy | None = None,
        *,
        can_delete: Callable[[Path], bool] | None = None,
        on_delete: Callable[[Path], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.policy = policy or RetentionPolicy()
        # Remote mirroring: a checkpoint is deleted only once `can_delete` allows it (its upload is verified);
        # `on_delete` hears of every deletion.
        self._can_delete = can_delete
        self._on_delete = on_delete

    def path_for(self, step: int) -> Path:
        return self.directory / f"{_PREFIX}{step:08d}"

    def steps(self) -> list[tuple[int, Path]]:
        """Every `step-X` directory, committed or not, oldest first."""
        found = []
        if self.directory.is_dir():
            for path in self.directory.glob(f"{_PREFIX}*"):
                suffix = path.name[len(_PREFIX) :]
                if path.is_dir() and suffix.isdigit():
                    found.append((int(suffix), path))
        return sorted(found)

    def committed(self) -> list[tuple[int, Path]]:
        """Committed checkpoints whose manifest is well formed and of the directory's step (their files are not
        checked), oldest first."""
        return [(step, path) for step, path in self.steps()
                if (manifest := read_manifest(path)) is not None and manifest.get("step", step) == step]  # fmt: skip

    def pointed(self) -> Path | None:
        """The `step-X` directory the `latest` pointer names; None when it is missing, unreadable (not UTF-8) or
        names no `step-X` directory here."""
        name = read_pointer(self.directory / LATEST_NAME)
        return next((path for _, path in self.steps() if path.name == name), None)

    def mark_latest(self, directory: Path) -> None:
        """Point `latest` at a committed checkpoint (atomic rename), then apply retention."""
        assert read_manifest(directory) is not None, f"{directory} is not committed"
        tmp = self.directory / f"{LATEST_NAME}.tmp"
        tmp.write_text(directory.name + "\n")
        tmp.replace(self.directory / LATEST_NAME)
        fsync_directory(self.directory)
        self.apply_retention()

    def resume_order(self) -> list[Path]:
        """Every `step-X` directory in the order a resume tries them: the `latest` pointer's target, then the
        others newest first."""
        candidates = [path for _, path in reversed(self.steps())]
        named = self.pointed()
        if named is not None:
            candidates.remove(named)
            candidates.insert(0, named)
        return candidates

    def latest_valid(self, warn: Callable[[str], None] | None = None) -> Path | None:
        """The newest checkpoint that verifies (the pointer's target first); every skipped one is named."""
        return self.first_valid(self.resume_order(), warn=warn)

    @staticmethod
    def first_valid(candidates: list[Path], warn: Callable[[str], None] | None = None) -> Path | None:
        """The first of `candidates` that verifies; every one skipped is named via `warn`."""
        for path in candidates:
            problems = verify_checkpoint(path)
            if not problems:
                return path
            message = f"skipping checkpoint {path}: {problems[0]}"
            if warn is not None:
                warn(message)
            else:
                warnings.warn(message, stacklevel=2)
        return None

    def apply_retention(self) -> list[Path]:
        """Delete committed checkpoints that no rule keeps, and uncommitted leftovers older than the newest commit.

        The rules rank the checkpoints up to the `latest` pointer's target, which is always kept: those of a
        higher step belong to a trajectory the run has left (it resumed from an older checkpoint, or skipped them
        as damaged) and are neither counted nor deleted.
        """
        committed = self.committed()
        latest = self.pointed()
        latest_step = next((step for step, path in committed if path == latest), None)
        if latest_step is not None:
            committed = [(step, path) for step, path in committed if step <= latest_step]
        if not committed:
            return []
        policy = self.policy
        keep = {path for _, path in committed[-policy.keep_last :]} if policy.keep_last else set()
        if policy.keep_every_steps:
            keep |= {path for step, path in committed if step % policy.keep_every_steps == 0}
        if policy.keep_best:
            scored = [(m["val_loss"], path) for _, path in committed
                      if (m := read_manifest(path)) and m.get("val_loss") is not None]  # fmt: skip
            keep |= {path for _, path in sorted(scored, key=lambda x: x[0])[: policy.keep_best]}
        if (
            latest is not None and latest_step is not None
        ):  # `latest` names one of them: kept, whatever the rules
            keep.add(latest)
        newest = committed[-1][0]
        allowed = self._can_delete or (lambda path: True)
        removed = [path for _, path in committed if path not in keep and allowed(path)]
        # Leftovers of crashed saves; a damaged manifest is not a leftover: kept, like any damaged checkpoint.
        removed += [path for step, path in self.steps() if step < newest and not has_manifest(path)]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
            if self._on_delete is not None:
                self._on_delete(path)
        return removed


def resolve_checkpoint(path: str | os.PathLike[str], warn: Callable[[str], None] | None = None) -> Path:
    """The checkpoint a user names: for a run directory (or its `checkpoints/`), its newest checkpoint that verifies
    (the `latest` pointer's target first; each damaged one skipped is named via `warn`); for a `latest` pointer,
    the directory it names; for a `step-X/` directory or its `state.ckpt`, that directory; any other file (a plain
    Lightning checkpoint), itself.

    The one resolver behind `generate`, `serve`, the `ckpt` commands and `--train.resume PATH`; it does not verify
    a checkpoint named directly, so that the caller's own check can refuse it with its own words.
    """
    path = Path(path)
    if not path.exists():
        raise UserInputError(f"checkpoint {str(path)!r} does not exist")
    if path.name == LATEST_NAME and path.is_file():
        named = CheckpointManager(path.parent).pointed()
        if named is None:
            raise UserInputError(
                f"{str(path)!r} names no checkpoint directory beside it; name a step-X directory or the run instead"
            )
        return named
    checkpoints = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    manager = CheckpointManager(checkpoints)
    if checkpoints != path or (path.is_dir() and not has_manifest(path) and manager.steps()):
        skipped: list[str] = []
        found = manager.latest_valid(warn=skipped.append)
        if found is None:
            reason = f" ({skipped[0]})" if skipped else ""
            raise UserInputError(f"{str(path)!r} holds no checkpoint that verifies{reason}")
        for message in skipped:
            (warn or _warn_default)(message)
        return found
    return checkpoint_directory(path)


def _warn_default(message: str) -> None:
    warnings.warn(message, stacklevel=3)
