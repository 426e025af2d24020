"""Publish a local prepared dataset to an fsspec URL (`gaudi3 prepare --out s3://…`, `data.prepared_dir: s3://…`).

Object stores have no atomic directory rename, so the commit point is the manifest, as for checkpoints: every
shard and the tokenizer are uploaded first (each one read back by size and SHA-256), and `manifest.json` is written
last. The files are stored by content, `objects/<sha256>-<name>` (`manifest.object_name`; the published manifest
names `objects_dir` and the tokenizer's SHA-256): publishing another dataset to the same URL therefore never
overwrites a file the manifest already there lists, and a publish that fails part-way leaves that dataset whole and
readable. A reader that finds a manifest finds every file it lists. A file already at the URL with the right size
and SHA-256 is not uploaded again, so publishing an appended dataset uploads only its new shards. Nothing is
deleted at the URL (the files of a dataset published there before stay, unlisted). http(s):// is read-only in fsspec:
refused as a target before any work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data.manifest import MANIFEST_FILE, object_name, verify_prepared
from gaudi3_scale.data.sources import sha256_file
from gaudi3_scale.storage import (
    URL_EXAMPLES,
    copy_stream,
    is_local_filesystem,
    is_storage_error,
    is_transient_error,
    open_remote,
    url_protocol,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["OBJECTS_DIR", "check_publish_target", "publish_prepared"]

log = logging.getLogger(__name__)
OBJECTS_DIR = "objects"


def _remote_sha256(fs: object, path: str) -> str | None:
    try:
        with fs.open(path, "rb") as fh:  # type: ignore[attr-defined]
            return copy_stream(fh, None)[1]
    except FileNotFoundError as e:
        if is_transient_error(e):  # fsspec's http backend wraps a 5xx so: not "absent"
            raise
        return None


# fsspec's HTTPFileSystem reads only (no put_file / pipe_file), and its `exists` answers False for a server that
# refuses the connection: refused by name, before any tokenizing, rather than failing at the first upload.
_READ_ONLY_PROTOCOLS = ("http", "https")


def _check_writable_protocol(url: str, *, field: str) -> None:
    protocol = url_protocol(url)
    if protocol in _READ_ONLY_PROTOCOLS:
        raise ConfigError(
            field,
            f"cannot publish to {url}: {protocol}:// is read-only (datasets are read from it, not written); "
            f"allowed: a local directory or a writable store such as {URL_EXAMPLES}",
        )


def check_publish_target(url: str, *, field: str) -> None:
    """Open `url` and ask the store whether it is there, before any tokenizing: a read-only protocol, an
    unreachable store, missing credentials or a missing bucket are one line naming `field` now, not after the
    work."""
    _check_writable_protocol(url, field=field)
    fs, root = open_remote(url, field=field)
    try:
        fs.exists(root)
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        raise UserInputError(f"{field}: cannot publish to {url}: {type(exc).__name__}: {exc}") from None


def publish_prepared(directory: Path, url: str, *, field: str = "data.prepared_dir") -> str:
    """Upload `directory` (a verified prepared dataset) to `url`; returns the URL. Idempotent."""
    _check_writable_protocol(url, field=field)
    manifest = verify_prepared(directory, checksums=True)
    tokenizer = directory / manifest.tokenizer_file
    published = dataclasses.replace(
        manifest, objects_dir=OBJECTS_DIR, tokenizer_sha256=sha256_file(tokenizer)
    )
    fs, root = open_remote(url, field=field)
    try:
        fs.makedirs(f"{root}/{OBJECTS_DIR}", exist_ok=True)
        files = [(s.file, s.size_bytes, s.sha256) for s in manifest.shards]
        files.append((manifest.tokenizer_file, tokenizer.stat().st_size, published.tokenizer_sha256 or ""))
        for name, size_bytes, sha256 in files:
            remote = f"{root}/{object_name(published, name, sha256)}"
            if _same(fs, remote, size_bytes, sha256):
                continue
            fs.put_file(str(directory / name), remote)
            if _remote_sha256(fs, remote) != sha256:
                raise UserInputError(f"{url}/{object_name(published, name, sha256)}: read back with another "
                                     "SHA-256 after upload; not published")  # fmt: skip
        _commit(fs, root, json.dumps(published.to_json(), indent=2) + "\n")
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        raise UserInputError(f"{field}: cannot publish to {url}: {type(exc).__name__}: {exc}") from None
    log.info("published %s to %s", directory, url)
    return url.rstrip("/")


def _commit(fs: AbstractFileSystem, root: str, text: str) -> None:
    """Write `manifest.json`, the commit point, whole or not at all: an object store's PUT is atomic; a local
    directory gets a temporary file renamed over it."""
    target = f"{root}/{MANIFEST_FILE}"
    if is_local_filesystem(fs):
        tmp = f"{root}/.{MANIFEST_FILE}.tmp{os.getpid()}"
        fs.pipe_file(tmp, text.encode())
        os.replace(tmp, target)
    else:
        fs.pipe_file(target, text.encode())


def _same(fs: object, path: str, size_bytes: int, sha256: str) -> bool:
    try:
        info = fs.info(path)  # type: ignore[attr-defined]
    except FileNotFoundError as e:
        if is_transient_error(e):
            raise
        return False
    return int(info.get("size", -1)) == size_bytes and _remote_sha256(fs, path) == sha256
