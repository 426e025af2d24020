"""Where prepare's text comes from: a bundled corpus, a file, a glob, a directory, or ``hf:NAME``.

Every source resolves to a sorted list of files: UTF-8 text, or JSONL / Parquet tables (see `formats`). Files are
read in chunks cut just after a newline, so workers can tokenize them independently and in order.

``synthetic[:VOCAB]`` is parsed here too, being a `data.source`, but it has no files: prepare generates it (see
`synthetic`).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data.formats import TEXT, source_format

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_SYNTHETIC_VOCAB",
    "MANIFEST_FILE",
    "MIN_VOCAB_SIZE",
    "Chunk",
    "ResolvedSource",
    "SourceFile",
    "bundled_corpora",
    "default_cache_dir",
    "is_prepared_dir",
    "is_shard_file",
    "read_chunk",
    "resolve_source",
    "sha256_file",
    "split_into_chunks",
    "synthetic_vocab",
]

MANIFEST_FILE = "manifest.json"
# ~2 MiB per task: large enough that pickling and scheduling are noise, small enough to balance 2-16 workers.
CHUNK_BYTES = 2 << 20
_SNIFF_BYTES = 8192
_GLOB_CHARS = re.compile(r"[*?\[]")
# `data.source: synthetic[:VOCAB]` is generated, never read (see `synthetic`); the name is reserved, so a file
# that happens to be called "synthetic" must be given as ./synthetic.
_SYNTHETIC = "synthetic"
DEFAULT_SYNTHETIC_VOCAB = 50257  # GPT-2's vocabulary (Radford et al. 2019), the usual benchmark size
_MAX_SYNTHETIC_VOCAB = 1 << 32  # ids must fit the widest token dtype, uint32
# One token type leaves nothing to predict (the loss is 0 from the first step): refused at prepare and at load.
MIN_VOCAB_SIZE = 2


@dataclass(frozen=True)
class SourceFile:
    path: Path
    size_bytes: int
    mtime_ns: int


@dataclass(frozen=True)
class ResolvedSource:
    spec: str  # as the user wrote it
    key: str  # absolute form, part of the cache-directory hash
    name: str  # short, filesystem-safe label for the cache directory
    files: tuple[SourceFile, ...]


@dataclass(frozen=True)
class Chunk:
    doc_index: int
    path: str
    offset_bytes: int
    length_bytes: int


def default_cache_dir() -> Path:
    return Path(os.environ.get("GAUDI3_CACHE") or Path.home() / ".cache" / "gaudi3-scale")


def bundled_corpora() -> dict[str, Path]:
    root = resources.files("gaudi3_scale.data") / "corpora"
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".txt")}


def is_prepared_dir(spec: str) -> bool:
    return Path(spec).is_dir() and (Path(spec) / MANIFEST_FILE).is_file()


def synthetic_vocab(spec: str) -> int | None:
    """The vocabulary size of a ``synthetic`` / ``synthetic:VOCAB`` source; None for every other source."""
    if spec == _SYNTHETIC:
        return DEFAULT_SYNTHETIC_VOCAB
    if not spec.startswith(_SYNTHETIC + ":"):
        return None
    digits = spec[len(_SYNTHETIC) + 1 :]
    vocab = int(digits) if re.fullmatch(r"[0-9]{1,12}", digits) else 0
    if not MIN_VOCAB_SIZE <= vocab <= _MAX_SYNTHETIC_VOCAB:
        raise ConfigError(
            "source",
            f"{spec!r}: expected synthetic or synthetic:VOCAB with VOCAB an integer from {MIN_VOCAB_SIZE} to "
            f"{_MAX_SYNTHETIC_VOCAB}",
        )
    return vocab


def _label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text).strip("_.")[:40] or "source"


def _stat(path: Path) -> SourceFile:
    st = path.stat()
    return SourceFile(path=path.resolve(), size_bytes=st.st_size, mtime_ns=st.st_mtime_ns)


def _not_text(path: Path) -> str | None:
    """Why `path` is not UTF-8 text, judged from its first 8 KiB (a multi-byte character may be cut at the end),
    or None: a NUL byte (binary data, or UTF-16 / UTF-32 text, whose ASCII is valid UTF-8 with a NUL between
    characters) or an invalid byte; the reason names the offset."""
    with path.open("rb") as fh:
        head = fh.read(_SNIFF_BYTES)
    if (nul := head.find(b"\0")) >= 0:
        return _nul_reason(nul)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        truncated = len(head) == _SNIFF_BYTES and exc.reason == "unexpected end of data"
        if not (truncated and exc.start >= len(head) - 3):
            return f"invalid byte at offset {exc.start}"
    return None


def _nul_reason(offset: int) -> str:
    return f"a NUL byte at offset {offset}: binary, or UTF-16/UTF-32 text"


def _refuse_unless_text(path: Path) -> None:
    """A file named as a source (itself, or matched by a glob) must be text, where a directory skips binary files:
    one line naming it, at once, not garbage trained on (UTF-16 ASCII decodes as UTF-8 with NULs between)."""
    if source_format(path) == TEXT and (reason := _not_text(path)) is not None:
        raise UserInputError(_not_utf8(str(path), reason))


def _not_utf8(path: str, reason: str) -> str:
    return f"{path}: not UTF-8 text ({reason}); convert it to UTF-8 or leave it out of data.source"


# What `prepare` writes beside manifest.json: format 1 train.bin / val.bin, format 2 train-00000.bin, ...
_SHARD_NAME = re.compile(r"(train|val)(-[0-9]{5,})?\.bin")


def is_shard_file(name: str) -> bool:
    """Whether a file name is one `prepare` gives shards (of any format version)."""
    return _SHARD_NAME.fullmatch(name) is not None


def _refuse_prepared_without_manifest(directory: Path) -> None:
    """A prepared dataset that lost its manifest is not a text corpus (its tokenizer.json would be read as text)."""
    shards = sorted(p.name for p in directory.iterdir() if is_shard_file(p.name) and p.is_file())
    found = (
        shards[:2]
        + (["..."] if len(shards) > 2 else [])
        + ["tokenizer.json"] * (directory / "tokenizer.json").is_file()
    )
    if shards:
        raise ConfigError(
            "source",
            f"{str(directory)!r} looks like a prepared dataset ({', '.join(found)}) but has no {MANIFEST_FILE}, so "
            "it cannot be checked; prepare it again from its text (gaudi3 prepare TEXT --out DIR --force)",
        )


def _walk_directory(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        if MANIFEST_FILE in filenames:  # a prepared dataset inside the corpus (e.g. prepared_dir under it)
            dirnames.clear()
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .cache, ...
        for name in filenames:
            path = Path(dirpath) / name
            table = source_format(path) != TEXT  # Parquet is binary: read by pyarrow, not sniffed as text
            if not name.startswith(".") and path.is_file() and (table or _not_text(path) is None):
                found.append(path)
    return sorted(found)


def resolve_source(spec: str) -> ResolvedSource:
    """Turn `data.source` into files; hf:NAME is materialized to a text file in the cache first.

    Several sources may be given comma-separated (``gaudi3 prepare a.txt docs/``): their files are used in the
    order given, each file once.
    """
    if synthetic_vocab(spec) is not None:  # prepare generates it; resolved here only as part of a list
        raise ConfigError(
            "source", f"{spec!r}: synthetic data has no files and cannot be combined with other sources"
        )
    if "," in spec and not Path(spec).expanduser().exists():
        parts = [resolve_source(p.strip()) for p in spec.split(",") if p.strip()]
        merged = tuple(dict.fromkeys(f for part in parts for f in part.files))
        label = _label("+".join(p.name for p in parts))
        return ResolvedSource(spec=spec, key=",".join(p.key for p in parts), name=label, files=merged)
    if spec.startswith("hf:"):
        path = _materialize_hf(spec[3:])
        return ResolvedSource(spec=spec, key=spec, name=_label(spec[3:]), files=(_stat(path),))
    bundled = bundled_corpora()
    path = Path(spec).expanduser()
    if spec in bundled and not path.exists():
        files = [bundled[spec]]
        key, name = f"bundled:{spec}", spec
    elif path.is_file():
        files, key, name = [path], str(path.resolve()), path.stem
    elif path.is_dir():
        _refuse_prepared_without_manifest(path)
        files, key, name = _walk_directory(path), str(path.resolve()), path.resolve().name
        if not files:
            raise ConfigError(
                "source", f"directory {spec!r} holds no text files (hidden and binary files are skipped)"
            )
    elif _GLOB_CHARS.search(spec):
        files = sorted(
            Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file()
        )
        key, name = os.path.abspath(os.path.expanduser(spec)), _label(Path(spec.split("*")[0]).name or "glob")
        if not files:
            raise ConfigError("source", f"glob {spec!r} matches no files")
    else:
        raise ConfigError(
            "source",
            f"{spec!r} is not a bundled corpus ({', '.join(sorted(bundled))}), an existing file or directory, "
            "a glob that matches files, hf:NAME, or synthetic[:VOCAB]",
        )
    if not path.is_dir():  # a directory's files were sniffed, binary ones skipped
        for file in files:
            _refuse_unless_text(file)
    stats = tuple(_stat(p) for p in files)
    if sum(f.size_bytes for f in stats) == 0:
        raise ConfigError("source", f"{spec!r} is empty (0 bytes of text)")
    return ResolvedSource(spec=spec, key=key, name=_label(name), files=stats)


def _materialize_hf(name: str) -> Path:
    """Write a Hugging Face dataset's ``text`` column to one cached file (rows joined by blank lines)."""
    hint = f"hf:{name}: the Hugging Face dataset could not be loaded"
    try:
        import datasets  # optional: not a dependency of gaudi3-scale
    except ImportError:
        raise UserInputError(
            f"{hint} (`datasets` is not installed: pip install datasets); pass local text files instead"
        ) from None
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as exc:  # network, auth, missing dataset: all are "cannot load" for the user
        raise UserInputError(
            f"{hint} (no network or unknown dataset: {type(exc).__name__}); pass local text files instead"
        ) from None
    if "text" not in ds.column_names:
        raise UserInputError(f"hf:{name}: has no 'text' column (columns: {', '.join(ds.column_names)})")
    path = default_cache_dir() / "hf-text" / f"{_label(name)}-{ds._fingerprint}.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with tmp.open("w", encoding="utf-8") as fh:
            for row in ds:
                fh.write(row["text"].rstrip("\n") + "\n\n")
        os.replace(tmp, path)
    return path


def split_into_chunks(
    doc_index: int,
    path: Path,
    size_bytes: int,
    chunk_bytes: int = CHUNK_BYTES,
    *,
    whole_lines: bool = False,
) -> list[Chunk]:
    """Cut a file into ~`chunk_bytes` pieces, each ending just after a newline (or, in a file without newlines,
    on a UTF-8 character boundary; never with `whole_lines`, as JSON lines must stay whole). b'\\n' never occurs
    inside a multi-byte UTF-8 sequence, so cuts are safe."""
    chunks: list[Chunk] = []
    start = 0
    with path.open("rb") as fh:
        while start < size_bytes:
            end = min(start + chunk_bytes, size_bytes)
            if end < size_bytes:
                end = _next_boundary(fh, end, size_bytes, whole_lines)
            chunks.append(Chunk(doc_index, str(path), start, end - start))
            start = end
    return chunks


_SCAN_BYTES = 64 << 10  # read near a cut in small steps: planning must not read the whole corpus


def _next_boundary(fh: BinaryIO, offset: int, size_bytes: int, whole_lines: bool) -> int:
    """Just after the first newline at or after `offset` within CHUNK_BYTES (anywhere with `whole_lines`)."""
    limit = size_bytes if whole_lines else min(offset + CHUNK_BYTES, size_bytes)
    fh.seek(offset)
    position = offset
    while position < limit:
        window = fh.read(min(_SCAN_BYTES, limit - position))
        newline = window.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(window)
    if whole_lines:
        return size_bytes
    fh.seek(offset)
    for i, byte in enumerate(fh.read(4)):  # no newline nearby: first byte that starts a character
        if byte & 0xC0 != 0x80:
            return offset + i
    return size_bytes


def read_chunk(chunk: Chunk) -> str:
    with open(chunk.path, "rb") as fh:
        fh.seek(chunk.offset_bytes)
        raw = fh.read(chunk.length_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"invalid byte at offset {chunk.offset_bytes + exc.start}"
        raise UserInputError(_not_utf8(chunk.path, reason)) from None
    if (nul := raw.find(b"\0")) >= 0:  # past the first 8 KiB that resolve_source sniffed
        raise UserInputError(_not_utf8(chunk.path, _nul_reason(chunk.offset_bytes + nul)))
    return text


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
