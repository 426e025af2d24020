"""``manifest.json``: what a prepared dataset holds, and the checks that it still holds it.

The manifest is written last (temp file + ``os.replace``), so a directory with a manifest is complete. Shards are
flat little-endian ``uint16`` (vocab ≤ 65536) or ``uint32`` token ids, read with ``np.memmap``. Format version 2
(written now) has one or more shards per split, ``train-00000.bin``, ``train-00001.bin``, …, ``val-00000.bin``, …
(shard i of both splits comes from the same piece of source text; a shard may hold 0 tokens); format version 1
(still read) has exactly ``train.bin`` and ``val.bin``. The manifest carries no context length: windows are cut at
load time, so one prepared dataset serves every model size.

A manifest published to a URL (`gaudi3 prepare --out s3://…`) also names `objects_dir` and `tokenizer_sha256`: its
files are stored by content, `<objects_dir>/<sha256>-<file>` (`object_name`), so publishing another dataset to the
same URL never overwrites a file the manifest there lists. Local directories keep the plain layout (both keys
absent).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gaudi3_scale.config.atomic import write_text_atomic
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
    "object_name",
    "save_manifest",
    "shard_file",
    "split_token_counts",
    "token_dtype",
    "tokens_sha256",
    "verify_prepared",
    "vocab_problem",
]

FORMAT_NAME = "gaudi3-scale/prepared-tokens"
FORMAT_VERSION = 2
SPLITS = ("train", "val")
_V1_FILES = {split: f"{split}.bin" for split in SPLITS}
_V2_FILE = re.compile(r"(train|val)-[0-9]{5,}\.bin")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # a file or directory name: no separator, no ".."
# Explicit little-endian so a dataset prepared on one machine reads the same on any other.
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_FIX = "re-run `gaudi3 prepare --force`"
# A manifest lists every shard (~300 bytes each): 256 MiB holds ~900,000, hundreds of TB of tokens at the default
# shard size; the 1 MiB of a config file refused one of 3,500 shards, which `prepare` itself had just written.
MAX_MANIFEST_BYTES = 256 << 20


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
    shards: list[int] = field(
        default_factory=list
    )  # the shard indices made from it (format 2; [] in format 1)


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
    # A published copy's content-addressed layout (see the module docstring); None in a local directory.
    objects_dir: str | None = None
    tokenizer_sha256: str | None = None

    def shard(self, split: str) -> Shard:
        """The split's only shard (format 1, or a format-2 dataset made of one piece)."""
        (shard,) = self.shards_of(split)
        return shard

    def shards_of(self, split: str) -> list[Shard]:
        """The split's shards in stream order (one in format 1, `train-00000.bin`, … in format 2)."""
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in _OPTIONAL:  # absent, not null, in a local directory: its manifest reads as it always did
            if data[key] is None:
                del data[key]
        return data


_OPTIONAL = ("objects_dir", "tokenizer_sha256")


def object_name(manifest: Manifest, file: str, sha256: str) -> str:
    """Where `file` (a shard or the tokenizer, of SHA-256 `sha256`) is stored relative to the dataset's root: itself
    in a local directory, `<objects_dir>/<sha256>-<file>` in a published one (named by content: it never clashes
    with a file of another dataset published to the same URL)."""
    return file if manifest.objects_dir is None else f"{manifest.objects_dir}/{sha256}-{file}"


def tokens_sha256(manifest: Manifest) -> str:
    """The identity of the token streams a dataset holds: SHA-256 over its shards' SHA-256s (split by split).

    Checkpoints record it (`data_sha256`), so that a resume on data whose content changed since (its source text
    edited and the cache rebuilt, or new files appended) is refused instead of silently continuing on other
    tokens. Unlike `fingerprint` it depends only on content, not on paths or mtimes. A split of one shard hashes
    as that shard's SHA-256 (as format 1 always did, so its checkpoints still match), several as their list.
    """
    shards: dict[str, str | list[str]] = {}
    for split in SPLITS:
        digests = [s.sha256 for s in manifest.shards_of(split)]
        shards[split] = digests[0] if len(digests) == 1 else digests
    return hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()


def split_token_counts(shards: list[Shard]) -> dict[str, int]:
    """`Manifest.num_tokens` of a list of shards: tokens per split."""
    return {split: sum(s.num_tokens for s in shards if s.split == split) for split in SPLITS}


def shard_file(split: str, index: int) -> str:
    """Format 2's name of shard `index` of `split`: ``train-00000.bin``."""
    return f"{split}-{index:05d}.bin"


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
    write_text_atomic(path, json.dumps(manifest.to_json(), indent=2) + "\n")
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
    missing = [f.name for f in dataclasses.fields(Manifest) if f.name not in data and f.name not in _OPTIONAL]
    if missing:
        raise UserInputError(f"{path}: missing key(s) {', '.join(missing)}; {_FIX}")
    fields: dict[str, Any] = {f.name: data.get(f.name) for f in dataclasses.fields(Manifest)}
    for key, kind in (("vocab_size", int), ("dtype", str), ("num_tokens", dict), ("tokenizer_file", str)):
        _require(data, key, kind, path)
    if fields["vocab_size"] < MIN_VOCAB_SIZE:
        raise UserInputError(f"{path}: {vocab_problem(fields['vocab_size'])}")
    if fields["dtype"] not in _DTYPES:
        raise UserInputError(f"{path}: dtype {fields['dtype']!r} is not one of {', '.join(_DTYPES)}; {_FIX}")
    if not _PLAIN_NAME.fullmatch(fields["tokenizer_file"]):
        raise UserInputError(
            f"{path}: tokenizer_file {fields['tokenizer_file'][:80]!r} is not a plain file name; {_FIX}"
        )
    itemsize = _DTYPES[fields["dtype"]].itemsize
    fields["shards"] = [
        _shard(s, i, itemsize, path) for i, s in enumerate(_require(data, "shards", list, path))
    ]
    try:
        fields["sources"] = [SourceEntry(**s) for s in _require(data, "sources", list, path)]
    except (KeyError, TypeError) as exc:
        raise UserInputError(f"{path}: malformed entry ({type(exc).__name__}: {exc}); {_FIX}") from None
    _check_layout(fields, path)
    _check_shard_names(fields["shards"], version, path)
    return Manifest(**fields)


def _shard(entry: Any, index: int, itemsize: int, path: Path) -> Shard:
    """`shards[index]` type-checked, its SHA-256 64 hex digits (it names files) and its size its tokens' bytes."""
    where = f"{path}: shards[{index}]"
    if not isinstance(entry, dict) or set(entry) != {f.name for f in dataclasses.fields(Shard)}:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise UserInputError(
            f"{where} must hold exactly split, file, num_tokens, size_bytes, sha256, got {keys}; {_FIX}"
        )
    kinds: tuple[tuple[str, type], ...] = (
        ("split", str),
        ("file", str),
        ("sha256", str),
        ("num_tokens", int),
        ("size_bytes", int),
    )
    for key, kind in kinds:
        value = entry[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and entry[key] < 0):
            allowed = "an integer >= 0" if kind is int else "a string"
            raise UserInputError(f"{where}: {key} is {value!r}; allowed: {allowed}; {_FIX}")
    if not _SHA256.fullmatch(entry["sha256"]):
        raise UserInputError(
            f"{where}: sha256 {entry['sha256'][:80]!r} is not 64 lowercase hex digits; {_FIX}"
        )
    if not _PLAIN_NAME.fullmatch(entry["file"]):
        raise UserInputError(f"{where}: file {entry['file'][:80]!r} is not a plain file name; {_FIX}")
    if entry["size_bytes"] != entry["num_tokens"] * itemsize:
        raise UserInputError(
            f"{where}: size_bytes {entry['size_bytes']} disagrees with num_tokens {entry['num_tokens']} × "
            f"{itemsize} bytes per token; {_FIX}"
        )
    return Shard(**entry)


def _check_layout(fields: dict[str, Any], path: Path) -> None:
    """A published manifest's `objects_dir` (a plain directory name) and `tokenizer_sha256` come together."""
    objects_dir, tokenizer_sha256 = fields["objects_dir"], fields["tokenizer_sha256"]
    if objects_dir is None and tokenizer_sha256 is None:
        return
    if not isinstance(objects_dir, str) or not _PLAIN_NAME.fullmatch(objects_dir):
        raise UserInputError(f"{path}: objects_dir {objects_dir!r} is not a plain directory name; {_FIX}")
    if not isinstance(tokenizer_sha256, str) or not _SHA256.fullmatch(tokenizer_sha256):
        raise UserInputError(
            f"{path}: tokenizer_sha256 {tokenizer_sha256!r} is not 64 lowercase hex digits; {_FIX}"
        )


def _check_shard_names(shards: list[Shard], version: int, path: Path) -> None:
    splits = sorted(s.split for s in shards)
    if version == 1:
        if splits != sorted(SPLITS) or any(s.file != _V1_FILES[s.split] for s in shards):
            files = ", ".join(s.file for s in shards)
            raise UserInputError(
                f"{path}: format 1 has exactly train.bin and val.bin, got {files or 'no shards'}; {_FIX}"
            )
        return
    missing = [split for split in SPLITS if split not in splits]
    if missing or set(splits) != set(SPLITS):
        raise UserInputError(
            f"{path}: expected at least one shard per split {SPLITS}, got splits {sorted(set(splits))}; {_FIX}"
        )
    names = [s.file for s in shards]
    for shard in shards:
        match = _V2_FILE.fullmatch(shard.file)
        if match is None or match.group(1) != shard.split:
            raise UserInputError(
                f"{path}: shard file {shard.file!r} of split {shard.split!r} is not named "
                f"{shard.split}-NNNNN.bin; {_FIX}"
            )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UserInputError(f"{path}: shard file(s) {', '.join(duplicates)} listed twice; {_FIX}")


def load_manifest(directory: Path) -> Manifest:
    """Read and validate the schema of ``<directory>/manifest.json`` (no shard checks; see `verify_prepared`)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise UserInputError(
            f"{directory}: not a prepared dataset (no {MANIFEST_FILE}); run `gaudi3 prepare` first"
        )
    try:
        data = load_json_file(path, what="dataset manifest", expect=None, max_bytes=MAX_MANIFEST_BYTES)
    except UserInputError as exc:
        raise UserInputError(f"{exc}; {_FIX}") from None
    return _parse(data, path)


def verify_prepared(directory: Path, *, checksums: bool = True) -> Manifest:
    """Check every shard against the manifest: presence and size always (cheap), SHA-256 when `checksums`."""
    directory = Path(directory)
    manifest = load_manifest(directory)
    for shard in manifest.shards:
        path = directory / shard.file
        if not path.is_file():
            raise UserInputError(f"{path}: missing (listed in {MANIFEST_FILE}); {_FIX}")
        size = path.stat().st_size
        if size != shard.size_bytes:  # size_bytes == num_tokens × itemsize: checked at load
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
