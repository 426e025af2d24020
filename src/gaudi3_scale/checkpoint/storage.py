"""Checkpoints in any fsspec store: the URL check, the remote layout, read-back verification, fetching back.

The remote layout mirrors the local one (`URL/step-00000500/…`, `URL/step-00000500/manifest.json`, `URL/latest`),
so a copied directory verifies with the same manifest. fsspec and the backend for a protocol (s3fs for `s3://`,
gcsfs for `gs://`, adlfs for `az://`) are optional: imported here, lazily, and named in the error when missing.
`file://` and `memory://` need nothing beyond fsspec.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from gaudi3_scale.checkpoint.manager import LATEST_NAME, _set_aside
from gaudi3_scale.checkpoint.manifest import (
    MANIFEST_NAME,
    ManifestError,
    fsync_directory,
    parse_manifest,
    verify_checkpoint,
)
from gaudi3_scale.config.errors import ConfigError

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
    "remote_problems",
]

REMOTE_URL_FIELD = "checkpoint.remote_url"
STEP_NAME = re.compile(r"step-(\d+)")
_CHUNK_BYTES = 8 * 2**20
_EXAMPLES = "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///abs/path, memory://name"
_INSTALL = "pip install 'gaudi3-scale[remote]'"

Warn = Callable[[str], None]


def default_warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def _private_retry_jitter() -> None:
    """Give botocore's retry backoff a random generator of its own (s3:// goes through botocore).

    botocore draws the jitter of every retry delay from the global `random` (legacy mode:
    `botocore.retryhandler.delay_exponential`; standard and adaptive modes: `ExponentialBackoff`'s default
    `random=random.random`). Drawn on the mirror's thread, that moved the Python RNG state that checkpoints record
    (`gaudi3_rng`), so a run whose storage had an outage was no longer bitwise identical to one without. The jitter
    needs no reproducibility: its own generator, seeded from the OS, leaves the global one alone.
    """
    try:
        import botocore.retries.standard as standard
        import botocore.retryhandler as legacy
    except ImportError:
        return
    jitter = random.Random()
    if legacy.random is random:  # the module-level `random.random()` call: route it to our generator
        legacy.random = jitter
    init = standard.ExponentialBackoff.__init__
    if init.__defaults__ is not None:
        init.__defaults__ = tuple(jitter.random if d == random.random else d for d in init.__defaults__)


def open_remote(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and root path of `url`; anything wrong with the URL is one `ConfigError` line."""
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry
    except ImportError as e:
        raise ConfigError(
            REMOTE_URL_FIELD, f"{url!r} needs fsspec, which is not installed; {_INSTALL}"
        ) from e
    protocol, _ = fsspec.core.split_protocol(url)
    _private_retry_jitter()
    if protocol is None:
        raise ConfigError(REMOTE_URL_FIELD, f"{url!r} has no protocol; use a URL such as {_EXAMPLES}")
    if protocol not in known_implementations and protocol not in registry:
        raise ConfigError(
            REMOTE_URL_FIELD,
            f"unknown protocol {protocol!r} in {url!r}; allowed: any fsspec protocol, e.g. {_EXAMPLES}",
        )
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        hint = known_implementations.get(protocol, {}).get("err") or str(e)
        raise ConfigError(
            REMOTE_URL_FIELD,
            f"{url!r} needs a package that is not installed ({hint}); s3:// comes with {_INSTALL}",
        ) from e
    except (TypeError, ValueError) as e:
        raise ConfigError(REMOTE_URL_FIELD, f"{url!r} with storage options {storage_options}: {e}") from e
    return fs, root.rstrip("/")


def is_local_filesystem(fs: AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "file" in protocols


def copy_stream(
    src: BinaryIO, dst: BinaryIO | None, progress: Callable[[int], None] | None = None
) -> tuple[int, str]:
    """Stream `src` into `dst` (None: only read) and return (size_bytes, SHA-256 of the bytes read)."""
    digest, size_bytes = hashlib.sha256(), 0
    while chunk := src.read(_CHUNK_BYTES):
        if dst is not None:
            dst.write(chunk)
        digest.update(chunk)
        size_bytes += len(chunk)
        if progress is not None:
            progress(len(chunk))
    return size_bytes, digest.hexdigest()


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


def _remote_step_names(fs: AbstractFileSystem, root: str) -> list[str]:
    """Remote checkpoint names to try: the `latest` pointer's target first, then newest step first."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
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


def fetch_latest(
    url: str,
    local_checkpoints_dir: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    warn: Warn | None = None,
) -> Path | None:
    """Download the newest remote checkpoint that is committed and verifies into `local_checkpoints_dir/step-N`.

    Tries the remote `latest` target first, then newest step first; every damaged one is skipped with a warning
    naming it. A local copy that already verifies is used as it is. None when the remote holds no usable
    checkpoint; storage errors (unreachable, credentials) propagate, so a resume never silently starts over.
    The local `latest` pointer is left to the caller (`CheckpointManager.mark_latest`).
    """
    warn = warn or default_warn
    fs, root = open_remote(url, storage_options)
    local_dir = Path(local_checkpoints_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    for name in _remote_step_names(fs, root):
        target = local_dir / name
        if target.is_dir() and not verify_checkpoint(target):
            return target
        problem = _download(fs, f"{root}/{name}", target)
        if problem is None:
            return target
        warn(f"skipping remote checkpoint {url.rstrip('/')}/{name}: {problem}")
    return None
