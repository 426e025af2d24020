"""Checkpoints in any fsspec store: the URL check, the remote layout, read-back verification, fetching back.

The remote layout mirrors the local one (`URL/step-00000500/…`, `URL/step-00000500/manifest.json`, `URL/latest`),
so a copied directory verifies with the same manifest. Opening a URL (protocol check, lazy fsspec and backend
imports) and streaming with a digest live in `gaudi3_scale.storage`, shared with remote datasets; `copy_stream` and
`is_local_filesystem` are re-exported here.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale import storage
from gaudi3_scale.checkpoint.manager import LATEST_NAME, _set_aside
from gaudi3_scale.checkpoint.manifest import (
    MANIFEST_NAME,
    ManifestError,
    fsync_directory,
    parse_manifest,
    verify_checkpoint,
)
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.storage import copy_stream, is_local_filesystem

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "LATEST_NAME",
    "REMOTE_URL_FIELD",
    "STEP_NAME",
    "Warn",
    "copy_stream",
    "default_warn",
    "fetch_latest",
    "is_local_filesystem",
    "open_remote",
    "read_remote_bytes",
    "read_remote_pointer",
    "remote_manifest",
    "remote_problems",
]

REMOTE_URL_FIELD = "checkpoint.remote_url"
STEP_NAME = re.compile(r"step-(\d+)")

Warn = Callable[[str], None]


def default_warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def open_remote(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and root path of `url`; anything wrong is one `ConfigError` line naming
    `checkpoint.remote_url`."""
    return storage.open_remote(url, storage_options, field=REMOTE_URL_FIELD)


def read_remote_bytes(fs: AbstractFileSystem, path: str) -> bytes | None:
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None


def read_remote_pointer(fs: AbstractFileSystem, root: str) -> str | None:
    data = read_remote_bytes(fs, f"{root}/{LATEST_NAME}")
    return None if data is None else data.decode(errors="replace").strip()


def _entry_problem(name: str, entry: dict[str, Any], size_bytes: int, sha256: str) -> str | None:
    if size_bytes != entry["size_bytes"]:
        return f"{name}: {size_bytes} bytes, the manifest says {entry['size_bytes']}"
    if sha256 != entry["sha256"]:
        return f"{name}: SHA-256 does not match the manifest (corrupt)"
    return None


def remote_problems(fs: AbstractFileSystem, remote_dir: str, files: dict[str, Any]) -> list[str]:
    """What is wrong with a remote copy: sizes from the store's listing, then SHA-256 of every byte read back."""
    fs.invalidate_cache(remote_dir)
    problems = []
    for name, entry in sorted(files.items()):
        path = f"{remote_dir}/{name}"
        try:
            listed_bytes = fs.size(path)
            if listed_bytes != entry["size_bytes"]:  # cheap: no download for a truncated object
                problems.append(
                    f"{name}: the store lists {listed_bytes} bytes, the manifest says {entry['size_bytes']}"
                )
                continue
            with fs.open(path, "rb") as f:
                problem = _entry_problem(name, entry, *copy_stream(f, None))
        except FileNotFoundError:
            problem = f"{name}: missing"
        if problem is not None:
            problems.append(problem)
    return problems


def _step_of(name: str) -> int:
    match = STEP_NAME.fullmatch(name)
    assert match is not None, name  # _remote_step_names lists step names only
    return int(match.group(1))


def _remote_step_names(fs: AbstractFileSystem, root: str) -> list[str]:
    """Remote checkpoint names to try: the `latest` pointer's target first, then newest step first."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError as e:
        if storage.is_missing_bucket(e):  # a wrong bucket is one line, not a run that silently starts over
            raise
        return []
    steps = {}
    for entry in entries:
        name = posixpath.basename(str(entry).rstrip("/"))
        if match := STEP_NAME.fullmatch(name):
            steps[name] = int(match.group(1))
    names = sorted(steps, key=steps.__getitem__, reverse=True)
    pointer = read_remote_pointer(fs, root)
    if pointer in steps:
        names.remove(pointer)
        names.insert(0, pointer)
    return names


def _download(fs: AbstractFileSystem, remote_dir: str, target: Path) -> str | None:
    """Copy one remote checkpoint to `target` (via a temporary directory, verified); the problem, or None."""
    manifest_bytes = read_remote_bytes(fs, f"{remote_dir}/{MANIFEST_NAME}")
    if manifest_bytes is None:
        return f"no committed manifest ({MANIFEST_NAME} missing)"
    try:
        files: dict[str, Any] = parse_manifest(manifest_bytes)["files"]
    except ManifestError as e:
        return str(e)
    tmp = target.with_name(f".{target.name}.download")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name, entry in sorted(files.items()):  # names are safe relative paths (parse_manifest)
            dest = tmp / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                with fs.open(f"{remote_dir}/{name}", "rb") as src, dest.open("wb") as dst:
                    size_bytes, sha256 = copy_stream(src, dst)
                    os.fsync(dst.fileno())
            except FileNotFoundError:
                return f"{name}: missing"
            if problem := _entry_problem(name, entry, size_bytes, sha256):
                return problem
        with (tmp / MANIFEST_NAME).open("wb") as f:  # the local commit, last
            f.write(manifest_bytes)
            os.fsync(f.fileno())
        fsync_directory(tmp)
        if target.exists():
            _set_aside(target)  # a damaged local copy of the same step: kept for inspection
        tmp.rename(target)
        fsync_directory(target.parent)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a failure; gone already after the rename


def remote_manifest(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The manifest of the first remote checkpoint `fetch_latest` would try that has a well-formed one (the `latest`
    pointer's target, then newest step first), read without its files: what a run about to resume from the remote
    copy alone predicts from. None when the remote holds none, or cannot be read: `fetch_latest` then says why."""
    try:
        fs, root = open_remote(url, storage_options)
        for name in _remote_step_names(fs, root):
            data = read_remote_bytes(fs, f"{root}/{name}/{MANIFEST_NAME}")
            if data is None:  # never committed
                continue
            try:
                return parse_manifest(data)
            except ManifestError:
                continue
    except UserInputError:  # a URL `open_remote` refuses
        return None
    except Exception as exc:
        if storage.is_storage_error(exc):
            return None
        raise
    return None


def fetch_latest(
    url: str,
    local_checkpoints_dir: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    warn: Warn | None = None,
    newer_than: int | None = None,
) -> Path | None:
    """Download the newest remote checkpoint that is committed and verifies into `local_checkpoints_dir/step-N`.

    Tries the remote `latest` target first, then newest step first; every damaged one is skipped with a warning
    naming it. A local copy that already verifies is used as it is. None when the remote holds no usable
    checkpoint (`newer_than`: the one the remote `latest` names, when its step is above it, else None); a storage
    error (unreachable, credentials) is one
    `UserInputError` line, so a resume never silently starts over. The local `latest` pointer is left to the caller
    (`CheckpointManager.mark_latest`).
    """
    warn = warn or default_warn
    fs, root = open_remote(url, storage_options)
    local_dir = Path(local_checkpoints_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    try:
        names = _remote_step_names(fs, root)
        if newer_than is not None:
            # only what the remote `latest` names: a higher step beside it may be of a line of training that a
            # rollback abandoned
            pointer = read_remote_pointer(fs, root)
            names = [pointer] if pointer in names and _step_of(pointer) > newer_than else []
        for name in names:
            target = local_dir / name
            if target.is_dir() and not verify_checkpoint(target):
                return target
            problem = _download(fs, f"{root}/{name}", target)
            if problem is None:
                return target
            warn(f"skipping remote checkpoint {url.rstrip('/')}/{name}: {problem}")
    except Exception as exc:
        if not storage.is_storage_error(exc):
            raise
        raise UserInputError(
            f"{REMOTE_URL_FIELD}: cannot fetch a checkpoint to resume from {url!r} ({type(exc).__name__}: "
            f"{exc}); fix the store or its credentials, or start without it: --train.resume never"
        ) from None
    return None
