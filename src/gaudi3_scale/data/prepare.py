"""Prepare: text → tokenizer → ``train.bin`` / ``val.bin`` + ``manifest.json``, done once, offline (as nanoGPT).

Split rule: every source file is a *document*; the last ``val_fraction`` of each document's tokens go to val and
the rest to train (``int(n * (1 - val_fraction))`` train tokens — with one document and 0.1 this is exactly
nanoGPT's ``data[:int(n*0.9)]`` / ``data[int(n*0.9):]``). When there are several documents, their train parts are
concatenated in an order shuffled by ``split_seed``; val parts keep source order. Documents are concatenated
without a separator token.

Layout: one flat shard per split (no ``train-00000.bin`` sharding): ``np.memmap`` handles files of any size on
64-bit systems and one shard keeps windows from ever straddling a file boundary.

Safety: everything is built in ``.partial/``; only then is the old manifest deleted, the new files renamed into
place and the manifest written last, atomically. A directory with a manifest is therefore always complete, and a
build that fails (bad UTF-8, a bad setting) leaves the previous dataset as it was. A re-run whose settings and
source paths, sizes and mtimes are unchanged returns at once; if only mtimes moved, the sources are rehashed.

Tokenizing in worker processes and writing the shards live in `encode`. ``data.source: synthetic[:VOCAB]`` takes
the same path (directory, lock, cache check, atomic swap) but generates its ids instead (see `synthetic`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.progress import (
    Progress,
)

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.data.encode import (
    EncodeTask,
    OrderedMap,
    chunk_alphabet,
    encode_chunk,
    ordered_map,
    progress_bar,
    tracked,
    write_splits,
)
from gaudi3_scale.data.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    Shard,
    SourceEntry,
    save_manifest,
    token_dtype,
    verify_prepared,
    vocab_problem,
)
from gaudi3_scale.data.sources import (
    CHUNK_BYTES,
    MIN_VOCAB_SIZE,
    Chunk,
    ResolvedSource,
    default_cache_dir,
    is_prepared_dir,
    read_chunk,
    resolve_source,
    sha256_file,
    split_into_chunks,
    synthetic_vocab,
)
from gaudi3_scale.data.synthetic import (
    SYNTHETIC_SPLIT_RULE,
    synthetic_settings,
    synthetic_split_sizes,
    write_synthetic_splits,
)
from gaudi3_scale.data.tokenizers import (
    TOKENIZER_FILE,
    SyntheticTokenizer,
    Tokenizer,
    build_tokenizer,
    is_tokenizer_path,
    load_tokenizer_file,
)

__all__ = ["SPLIT_RULE", "prepare_dataset"]

log = logging.getLogger(__name__)
SPLIT_RULE = "per document: last val_fraction of its tokens -> val, rest -> train; train documents shuffled by split_seed"
_PARTIAL_DIR = ".partial"
_LOCK_FILE = ".prepare.lock"


def prepare_dataset(
    cfg: DataConfig,
    out_dir: Path | None = None,
    *,
    workers: int | None = None,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Tokenize `cfg.source` into a prepared directory and return it; a no-op when it is already up to date.

    `out_dir` overrides `cfg.prepared_dir` (None: the cache directory); `workers` overrides
    `cfg.prepare_workers`; `force` rebuilds even when up to date. A `cfg.source` that already is a prepared
    directory is checked (sizes) and returned as it is; ``synthetic[:VOCAB]`` is generated, not tokenized.
    """
    vocab = synthetic_vocab(cfg.source)
    if vocab is None and is_prepared_dir(cfg.source):
        # The source already is a prepared dataset: sizes are checked here, checksums when it is loaded.
        verify_prepared(Path(cfg.source), checksums=False)
        return Path(cfg.source)
    if vocab is None:
        source = resolve_source(cfg.source)
        settings = _settings(cfg, source)
    else:
        source = ResolvedSource(
            spec=cfg.source, key=f"synthetic:{vocab}", name=f"synthetic-{vocab}", files=()
        )
        settings = synthetic_settings(cfg, vocab)
    target = Path(out_dir or cfg.prepared_dir or _default_dir(cfg, source, settings)).expanduser()
    fingerprint = _sha256_json(
        {"settings": settings, "files": [[str(f.path), f.size_bytes, f.mtime_ns] for f in source.files]}
    )
    target.mkdir(parents=True, exist_ok=True)
    num_workers = workers or cfg.prepare_workers

    def write(partial: Path) -> Manifest:
        if vocab is not None:
            return _generate_into(partial, cfg, vocab, settings, fingerprint)
        return _tokenize_into(partial, cfg, source, settings, fingerprint, num_workers, progress)

    with _locked(target / _LOCK_FILE):
        if force or not _is_up_to_date(target, settings, fingerprint, source):
            _build(target, write)
    return target


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _settings(cfg: DataConfig, source: ResolvedSource) -> dict[str, Any]:
    """Everything besides the source files' content that changes the output."""
    tokenizer_file = Path(cfg.tokenizer) if is_tokenizer_path(cfg.tokenizer) else None
    if tokenizer_file is not None:
        # Read and checked here, before any directory is touched or progress bar drawn: a missing, binary or
        # malformed tokenizer.json is one line (the workers read it again; a second read is cheap next to tokenizing).
        load_tokenizer_file(tokenizer_file)
    return {
        "source": source.key,
        "tokenizer": str(tokenizer_file.resolve()) if tokenizer_file else cfg.tokenizer,
        "tokenizer_sha256": sha256_file(tokenizer_file) if tokenizer_file else None,
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "split_seed": cfg.split_seed,
        "chunk_bytes": CHUNK_BYTES,  # BPE tokens at chunk cuts depend on it
        "format_version": FORMAT_VERSION,
    }


def _default_dir(cfg: DataConfig, source: ResolvedSource, settings: dict[str, Any]) -> Path:
    """``<cache>/datasets/<source>-<tokenizer>[-<vocab>]-<hash of source spec, tokenizer, split settings>``;
    ``<cache>/datasets/synthetic-<vocab>-<hash of vocab, sizes and seed>`` for synthetic data."""
    if synthetic_vocab(cfg.source) is not None:
        key = {k: settings[k] for k in ("source", "synthetic_tokens", "val_fraction", "split_seed")}
        return default_cache_dir() / "datasets" / f"{source.name}-{_sha256_json(key)[:10]}"
    key = {k: settings[k] for k in ("source", "tokenizer", "vocab_size", "val_fraction", "split_seed")}
    label = "custom" if is_tokenizer_path(cfg.tokenizer) else cfg.tokenizer
    vocab = f"-{cfg.vocab_size}" if cfg.vocab_size is not None else ""
    return default_cache_dir() / "datasets" / f"{source.name}-{label}{vocab}-{_sha256_json(key)[:10]}"


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Two `prepare` runs on the same directory take turns instead of interleaving their renames."""
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _is_up_to_date(target: Path, settings: dict[str, Any], fingerprint: str, source: ResolvedSource) -> bool:
    if not (target / MANIFEST_FILE).is_file():
        return False
    try:
        manifest = verify_prepared(target, checksums=False)
    except UserInputError as exc:
        log.warning("rebuilding %s: %s", target, exc)
        return False
    if manifest.fingerprint == fingerprint:
        return True
    same_files = [(e.path, e.size_bytes) for e in manifest.sources] == [
        (str(f.path), f.size_bytes) for f in source.files
    ]
    if manifest.settings != settings or not same_files:
        return False
    # Only mtimes moved (a fresh checkout, a copy): the content decides, and the new fingerprint is recorded.
    if [e.sha256 for e in manifest.sources] != [sha256_file(f.path) for f in source.files]:
        return False
    save_manifest(target, dataclasses.replace(manifest, fingerprint=fingerprint))
    return True


# ---- the build --------------------------------------------------------------------------------------------


def _build(target: Path, write: Callable[[Path], Manifest]) -> None:
    """Run `write` (shards + tokenizer into the directory it is given, returning their manifest), then swap in."""
    partial = target / _PARTIAL_DIR
    if partial.exists():
        shutil.rmtree(partial)  # left by a killed run
    partial.mkdir()
    try:
        manifest = write(partial)
        # Swap in. From the unlink until the new manifest lands, the directory does not look prepared; a build
        # that failed before this point left the previous dataset untouched (and consistent with its manifest).
        (target / MANIFEST_FILE).unlink(missing_ok=True)
        for name in [s.file for s in manifest.shards] + [manifest.tokenizer_file]:
            os.replace(partial / name, target / name)
        save_manifest(target, manifest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # chunk files, or whatever a failed build left behind


def _tokenize_into(
    partial: Path,
    cfg: DataConfig,
    source: ResolvedSource,
    settings: dict[str, Any],
    fingerprint: str,
    workers: int,
    progress: bool,
) -> Manifest:
    chunks = [
        c for i, f in enumerate(source.files) for c in split_into_chunks(i, f.path, f.size_bytes, CHUNK_BYTES)
    ]
    workers = max(1, min(workers, len(chunks)))
    with ordered_map(workers) as pmap, ThreadPoolExecutor(1) as hasher, progress_bar(progress) as bar:
        # SHA-256 of the sources runs in a thread (hashlib releases the GIL) while the workers tokenize.
        source_hashes = hasher.submit(lambda: [sha256_file(f.path) for f in source.files])
        tokenizer = _make_tokenizer(cfg, chunks, pmap, bar)
        tok_path = tokenizer.save(partial)
        dtype = token_dtype(tokenizer.vocab_size)
        tok_key = sha256_file(tok_path)
        (partial / "chunks").mkdir()
        tasks = [
            EncodeTask(c, str(tok_path), tok_key, dtype, str(partial / "chunks" / f"{i:08d}.bin"))
            for i, c in enumerate(chunks)
        ]
        counts = list(tracked(pmap(encode_chunk, tasks), chunks, bar, f"tokenize ({workers} worker(s))"))
        shards = write_splits(partial, tasks, counts, len(source.files), cfg.val_fraction, cfg.split_seed)
        hashes = source_hashes.result()
    sources = [
        SourceEntry(path=str(f.path), size_bytes=f.size_bytes, sha256=h)
        for f, h in zip(source.files, hashes, strict=True)
    ]
    return _manifest(cfg, tokenizer, shards, SPLIT_RULE, sources, settings, fingerprint)


def _generate_into(
    partial: Path, cfg: DataConfig, vocab_size: int, settings: dict[str, Any], fingerprint: str
) -> Manifest:
    tokenizer = SyntheticTokenizer(vocab_size)
    tokenizer.save(partial)
    sizes = synthetic_split_sizes(cfg.synthetic_tokens, cfg.val_fraction)
    shards = write_synthetic_splits(partial, vocab_size, sizes, cfg.split_seed)
    return _manifest(cfg, tokenizer, shards, SYNTHETIC_SPLIT_RULE, [], settings, fingerprint)


def _manifest(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    shards: list[Shard],
    split_rule: str,
    sources: list[SourceEntry],
    settings: dict[str, Any],
    fingerprint: str,
) -> Manifest:
    if (
        tokenizer.vocab_size < MIN_VOCAB_SIZE
    ):  # e.g. one character repeated: refused before anything is swapped in
        raise UserInputError(f"data.source: {cfg.source!r} gives {vocab_problem(tokenizer.vocab_size)}")
    return Manifest(
        tokenizer_kind=tokenizer.kind,
        tokenizer_file=TOKENIZER_FILE,
        vocab_size=tokenizer.vocab_size,
        dtype=token_dtype(tokenizer.vocab_size),
        num_tokens={s.split: s.num_tokens for s in shards},
        val_fraction=cfg.val_fraction,
        split_seed=cfg.split_seed,
        split_rule=split_rule,
        source_spec=cfg.source,
        sources=sources,
        shards=shards,
        settings=settings,
        fingerprint=fingerprint,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        library_version=_library_version(),
    )


def _make_tokenizer(
    cfg: DataConfig, chunks: Sequence[Chunk], pmap: OrderedMap[Any, Any], bar: Progress
) -> Tokenizer:
    texts: Iterable[str]
    if cfg.tokenizer == "char":
        # The char vocabulary only depends on which characters occur: workers send back each chunk's alphabet.
        texts = tracked(pmap(chunk_alphabet, chunks), chunks, bar, "scan characters")
    else:
        texts = tracked(map(read_chunk, chunks), chunks, bar, f"read text for {cfg.tokenizer}")
    # Lazy: kinds that need no data (byte, a tokenizer.json) never read the text.
    return build_tokenizer(cfg.tokenizer, texts, cfg.vocab_size)


def _library_version() -> str | None:
    try:
        return metadata.version("gaudi3-scale")
    except metadata.PackageNotFoundError:
        return None
