"""Publish a local prepared dataset to an fsspec URL (`gaudi3 prepare --out s3://…`, `data.prepared_dir: s3://…`).

Object stores have no atomic directory rename, so the commit point is the manifest, as for checkpoints: every
shard and the tokenizer are uploaded first (each one read back by size and SHA-256 against the manifest), and
`manifest.json` is written last. A reader that finds a manifest therefore finds every file it lists. A shard
already at the URL with the manifest's size and SHA-256 is not uploaded again, so publishing an appended dataset
uploads only its new shards; a file that differs is replaced. Nothing is deleted at the URL.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.manifest import MANIFEST_FILE, verify_prepared
from gaudi3_scale.data.sources import sha256_file
from gaudi3_scale.storage import copy_stream, is_storage_error, open_remote

__all__ = ["check_publish_target", "publish_prepared"]

log = logging.getLogger(__name__)


def _remote_sha256(fs: object, path: str) -> str | None:
    try:
        with fs.open(path, "rb") as fh:  # type: ignore[attr-defined]
            return copy_stream(fh, None)[1]
    except FileNotFoundError:
        return None


def check_publish_target(url: str, *, field: str) -> None:
    """Open `url` and ask the store whether it is there, before any tokenizing: an unreachable store, missing
    credentials or a missing bucket are one line naming `field` now, not after the work."""
    fs, root = open_remote(url, field=field)
    try:
        fs.exists(root)
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        raise UserInputError(f"{field}: cannot publish to {url}: {type(exc).__name__}: {exc}") from None


def publish_prepared(directory: Path, url: str, *, field: str = "data.prepared_dir") -> str:
    """Upload `directory` (a verified prepared dataset) to `url`; returns the URL. Idempotent."""
    manifest = verify_prepared(directory, checksums=True)
    fs, root = open_remote(url, field=field)
    try:
        fs.makedirs(root, exist_ok=True)
        files = [(s.file, s.size_bytes, s.sha256) for s in manifest.shards]
        tokenizer = directory / manifest.tokenizer_file
        files.append((manifest.tokenizer_file, tokenizer.stat().st_size, sha256_file(tokenizer)))
        for name, size_bytes, sha256 in files:
            remote = f"{root}/{name}"
            if _same(fs, remote, size_bytes, sha256):
                continue
            fs.put_file(str(directory / name), remote)
            if _remote_sha256(fs, remote) != sha256:
                raise UserInputError(
                    f"{url}/{name}: read back with another SHA-256 after upload; not published"
                )
        fs.put_file(str(directory / MANIFEST_FILE), f"{root}/{MANIFEST_FILE}")  # the commit point
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        raise UserInputError(f"{field}: cannot publish to {url}: {type(exc).__name__}: {exc}") from None
    log.info("published %s to %s", directory, url)
    return url.rstrip("/")


def _same(fs: object, path: str, size_bytes: int, sha256: str) -> bool:
    try:
        info = fs.info(path)  # type: ignore[attr-defined]
    except FileNotFoundError:
        return False
    return int(info.get("size", -1)) == size_bytes and _remote_sha256(fs, path) == sha256
