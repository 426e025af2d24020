"""``manifest.json``: what a prepared dataset holds, and the checks that it still holds it.

The manifest is written last (temp file + ``os.replace``), so a directory with a manifest is complete. Format
version 1 has exactly one shard per split: ``train.bin`` and ``val.bin``, flat little-endian ``uint16`` (vocab ≤
65536) or ``uint32`` token ids, read with ``np.memmap``. The manifest carries no context length: windows are cut at
load time, so one prepared dataset serves every model size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.config.files import load_json_file
from gaudi3_scale.data.sources import MANIFEST_FILE, MIN_VOCAB_SIZE, sha256_file

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "SPLITS",
    "Manifest",
    "Shard",
    "SourceEntry",
    "load_manifest",
    "numpy_dtype",
    "save_manifest",
    "token_dtype",
    "tokens_sha256",
    "verify_prepared",
    "vocab_problem",
]

FORMAT_NAME = "gaudi3-scale/prepared-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
# Explicit little-endian so a dataset prepared on one machine reads the same on any other.
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_FIX = "re-run `gaudi3 prepare --force`"


@dataclass(frozen=True, kw_only=True)
class Shard:
    split: str
    file: str  # relative to the dataset directory
    num_tokens: int
    size_bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class SourceEntry:
    path: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    tokenizer_kind: str
    tokenizer_file: str
    vocab_size: int
    dtype: str
    num_tokens: dict[str, int]
    val_fraction: float
    split_seed: int
    split_rule: str
    source_spec: str
    sources: list[SourceEntry]
    shards: list[Shard]
    settings: dict[str, Any]  # what the dataset was built from; compared to decide if a re-run is a no-op
    fingerprint: str  # hash of settings + source paths, sizes and mtimes
    created_at: str
    library_version: str | None  # None when the package metadata is not installed

    def shard(self, split: str) -> Shard:
        return next(s for s in self.shards if s.split == split)

    def shards_of(self, split: str) -> list[Shard]:
        """The split's shards in stream order (one in format 1, `train-00000.bin`, … in format 2)."""
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tokens_sha256(manifest: Manifest) -> str:
    """The identity of the token streams a dataset holds: SHA-256 over its shards' SHA-256s (split by split).

    Checkpoints record it (`data_sha256`), so that a resume on data whose content changed since (its source text
    edited and the cache rebuilt) is refused instead of silently continuing on other tokens. Unlike `fingerprint`
    it depends only on content, not on paths or mtimes.
    """
    shards = {s.split: s.sha256 for s in manifest.shards}
    return hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()


def vocab_problem(vocab_size: int) -> str:
    return (
        f"a vocabulary of {vocab_size} token type(s) leaves a language model nothing to predict (at least "
        f"{MIN_VOCAB_SIZE} are needed); use more varied text or another tokenizer"
    )


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype name that holds ids 0..vocab_size-1 (uint16 up to 65536 ids, as GPT-2's 50257 fits)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def numpy_dtype(name: str) -> np.dtype[Any]:
    return _DTYPES[name]


def save_manifest(directory: Path, manifest: Manifest) -> Path:
    """Atomic: readers see the old manifest or the new one, never half of one."""
    path = Path(directory) / MANIFEST_FILE
    tmp = path.with_name(f".{MANIFEST_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _require(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: Path) -> Any:
    if key not in data:
        raise UserInputError(f"{where}: missing key {key!r}; {_FIX}")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise UserInputError(f"{where}: key {key!r} has the wrong type ({type(value).__name__}); {_FIX}")
    return value


def _parse(data: Any, path: Path) -> Manifest:
    if not isinstance(data, dict):
        raise UserInputError(f"{path}: expected a JSON object; {_FIX}")
    if data.get("format") != FORMAT_NAME:
        raise UserInputError(f"{path}: format {data.get('format')!r} is not {FORMAT_NAME!r}; {_FIX}")
    version = data.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UserInputError(
            f"{path}: unknown format_version {version!r} (this gaudi3-scale reads 1..{FORMAT_VERSION})"
        )
    if version > FORMAT_VERSION:
        raise UserInputError(
            f"{path}: format_version {version} is newer than this gaudi3-scale reads ({FORMAT_VERSION}); "
            f"upgrade gaudi3-scale or {_FIX}"
        )
    missing = [f.name for f in dataclasses.fields(Manifest) if f.name not in data]
    if missing:
        raise UserInputError(f"{path}: missing key(s) {', '.join(missing)}; {_FIX}")
    fields = {f.name: data[f.name] for f in dataclasses.fields(Manifest)}
    try:
        fields["shards"] = [Shard(**s) for s in _require(data, "shards", list, path)]
        fields["sources"] = [SourceEntry(**s) for s in _require(data, "sources", list, path)]
    except (KeyError, TypeError) as exc:
        raise UserInputError(f"{path}: malformed entry ({type(exc).__name__}: {exc}); {_FIX}") from None
    for key, kind in (("vocab_size", int), ("dtype", str), ("num_tokens", dict), ("tokenizer_file", str)):
        _require(data, key, kind, path)
    if fields["vocab_size"] < MIN_VOCAB_SIZE:
        raise UserInputError(f"{path}: {vocab_problem(fields['vocab_size'])}")
    if fields["dtype"] not in _DTYPES:
        raise UserInputError(f"{path}: dtype {fields['dtype']!r} is not one of {', '.join(_DTYPES)}; {_FIX}")
    splits = sorted(s.split for s in fields["shards"])
    if splits != sorted(SPLITS):
        raise UserInputError(f"{path}: expected one shard per split {SPLITS}, got {splits}; {_FIX}")
    return Manifest(**fields)


def load_manifest(directory: Path) -> Manifest:
    """Read and validate the schema of ``<directory>/manifest.json`` (no shard checks; see `verify_prepared`)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise UserInputError(
            f"{directory}: not a prepared dataset (no {MANIFEST_FILE}); run `gaudi3 prepare` first"
        )
    try:
        data = load_json_file(path, what="dataset manifest", expect=None)
    except UserInputError as exc:
        raise UserInputError(f"{exc}; {_FIX}") from None
    return _parse(data, path)


def verify_prepared(directory: Path, *, checksums: bool = True) -> Manifest:
    """Check every shard against the manifest: presence and size always (cheap), SHA-256 when `checksums`."""
    directory = Path(directory)
    manifest = load_manifest(directory)
    itemsize = _DTYPES[manifest.dtype].itemsize
    for shard in manifest.shards:
        path = directory / shard.file
        if not path.is_file():
            raise UserInputError(f"{path}: missing (listed in {MANIFEST_FILE}); {_FIX}")
        size = path.stat().st_size
        if size != shard.size_bytes or shard.size_bytes != shard.num_tokens * itemsize:
            raise UserInputError(
                f"{path}: size {size} bytes disagrees with {MANIFEST_FILE} (expected {shard.size_bytes} = "
                f"{shard.num_tokens} {manifest.dtype} tokens); {_FIX}"
            )
        if checksums:
            digest = sha256_file(path)
            if digest != shard.sha256:
                raise UserInputError(
                    f"{path}: SHA-256 mismatch with {MANIFEST_FILE} (expected {shard.sha256[:12]}…, "
                    f"got {digest[:12]}…); {_FIX}"
                )
    if not (directory / manifest.tokenizer_file).is_file():
        raise UserInputError(
            f"{directory / manifest.tokenizer_file}: missing (listed in {MANIFEST_FILE}); {_FIX}"
        )
    return manifest
