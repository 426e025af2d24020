"""Prepare: text → tokenizer → sharded ``train-*.bin`` / ``val-*.bin`` + ``manifest.json``, done once, offline.

Split rule: the sources are cut into pieces of about ``data.shard_mb`` MiB of text (see `pieces`; a piece never
spans two files), and piece i becomes shard i of both splits: its first ``int(n * (1 - val_fraction))`` tokens
go to ``train-<i>.bin``, the rest to ``val-<i>.bin``. A source that fits one piece (the bundled tinyshakespeare)
therefore gives exactly nanoGPT's ``data[:int(n*0.9)]`` / ``data[int(n*0.9):]``. Pieces are concatenated without a
separator token. Every piece is read, tokenized, split, written and hashed by one worker (`encode`).

Safety: a build happens in ``.partial/``; only then is the old manifest deleted, the new files renamed into place,
the manifest written last, atomically, and shard files it does not list removed. A directory with a manifest is
therefore always complete, and a build that fails (bad UTF-8, a bad setting) leaves the previous dataset as it was
(and takes back the directory and lock file it made itself). A directory holding another kind of manifest.json
(a committed checkpoint's) is refused, never rebuilt.
A re-run whose settings and sources are unchanged returns at once (see `update`). When the only change is new
source files, only they are tokenized and their pieces appended as new shard indices (existing shards are not
rewritten), if the tokenizer does not depend on the data: ``byte``, a tokenizer.json, or ``char`` when the new
text's characters are all in its vocabulary; otherwise everything is rebuilt.

``data.source: synthetic[:VOCAB]`` takes the same path (directory, lock, cache check, atomic swap) but generates
its ids instead (see `synthetic`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.progress import Progress

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.files import check_output_dir
from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.data.encode import (
    OrderedMap,
    encode_pieces,
    ordered_map,
    progress_bar,
    scan_alphabets,
    sha256_source,
    source_entries,
    tracked,
)
from gaudi3_scale.data.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    Shard,
    SourceEntry,
    save_manifest,
    split_token_counts,
    token_dtype,
    verify_prepared,
    vocab_problem,
)
from gaudi3_scale.data.pieces import Piece, piece_texts, plan_pieces
from gaudi3_scale.data.sources import (
    CHUNK_BYTES,
    MIN_VOCAB_SIZE,
    ResolvedSource,
    default_cache_dir,
    is_prepared_dir,
    is_shard_file,
    resolve_source,
    sha256_file,
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
    check_tokenizer_request,
    is_tokenizer_path,
    load_tokenizer_file,
)
from gaudi3_scale.data.update import (
    APPEND,
    CURRENT,
    PARTIAL_DIR,
    append_files,
    partial_dir,
    plan_update,
    prepared_manifest,
)

__all__ = ["SPLIT_RULE", "prepare_dataset"]

log = logging.getLogger(__name__)
SPLIT_RULE = "per shard: last val_fraction of its tokens -> val, rest -> train"
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
    check_output_dir("data.prepared_dir", target)
    _check_not_foreign(target)
    job = _Job(cfg, source, settings, fingerprint, workers or cfg.prepare_workers, progress)

    def write(partial: Path) -> Manifest:
        if vocab is not None:
            return _generate_into(partial, cfg, vocab, settings, fingerprint)
        return _tokenize_into(partial, job)

    with _claimed(target):
        stored = prepared_manifest(target)
        if out_dir or cfg.prepared_dir:
            _check_same_source(target, stored, source, settings)
        update = plan_update(target, None if force else stored, settings, fingerprint, source)
        if update.action == CURRENT:
            return target
        if update.action == APPEND and append_files(
            target, cfg, update.new_files, fingerprint, workers=job.workers, progress=job.progress
        ):
            return target
        _build(target, write)
    return target


@dataclasses.dataclass(frozen=True)
class _Job:
    """What a text build needs besides the directory it writes into."""

    cfg: DataConfig
    source: ResolvedSource
    settings: dict[str, Any]
    fingerprint: str
    workers: int
    progress: bool


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _settings(cfg: DataConfig, source: ResolvedSource) -> dict[str, Any]:
    """Everything besides the source files' content that changes the output."""
    check_tokenizer_request(cfg.tokenizer, cfg.vocab_size)
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
        "shard_mb": cfg.shard_mb,  # where pieces, hence shards and train / val cuts, end
        "text_field": cfg.text_field,  # the text of JSONL / Parquet sources
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


def _check_same_source(
    target: Path, stored: Manifest | None, source: ResolvedSource, settings: dict[str, Any]
) -> None:
    """A directory named for the prepared tokens (data.prepared_dir, `prepare --out`) that holds those of another
    source is refused, not rebuilt from this one: its text may be gone (the cache directory's names carry their
    source, so only a named directory can meet another's). Its files changing, or the settings, still rebuild."""
    if stored is None or stored.settings.get("source") in (None, settings["source"]):
        return
    raise ConfigError(
        "data.prepared_dir",
        f"{str(target)!r} holds the prepared tokens of {stored.source_spec!r}, not of {source.spec!r}; train on "
        f"them with --data.source {target}, or prepare into another directory (delete this one to rebuild it)",
    )


def _check_not_foreign(target: Path) -> None:
    """Refuse a directory that `prepare` never built (no prepared-tokens manifest, no lock file of ours) holding
    files a build would replace or delete: a manifest.json of another kind (a committed checkpoint's, whose
    replacement would leave the checkpoint uncommitted), a tokenizer.json (a Hugging Face model's, say), files
    named like shards, a `.partial` (the build's scratch directory, which it empties; one left by a killed build
    sits beside our lock file)."""
    if not target.is_dir():
        return
    _check_manifest_is_ours(target)
    if (target / MANIFEST_FILE).exists() or (target / _LOCK_FILE).exists():
        return
    clash = next(
        (
            p.name
            for p in sorted(target.iterdir())
            if p.name in (TOKENIZER_FILE, PARTIAL_DIR) or is_shard_file(p.name)
        ),
        None,
    )
    if clash is not None:
        raise ConfigError(
            "data.prepared_dir",
            f"{str(target)!r} is not a prepared dataset but holds {clash}, which preparing would replace or delete; "
            "pass a new directory",
        )


def _check_manifest_is_ours(target: Path) -> None:
    """A manifest.json that is not a prepared-tokens one (a checkpoint's, anything else's) is not ours to replace.
    One that is not JSON at all counts as ours only beside our lock file (a damaged dataset is rebuilt)."""
    path = target / MANIFEST_FILE
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_bytes())
        kind = data.get("format") if isinstance(data, dict) else None
    except (OSError, ValueError):
        if (target / _LOCK_FILE).exists():
            return
        kind = None
    if kind == FORMAT_NAME:
        return
    what = f"a {kind!r} manifest.json" if isinstance(kind, str) else "a manifest.json that is not a dataset's"
    raise ConfigError(
        "data.prepared_dir",
        f"{str(target)!r} is not a prepared dataset but holds {what}, which preparing would replace; "
        "pass a new directory (or one `gaudi3 prepare` wrote)",
    )


@contextmanager
def _claimed(target: Path) -> Iterator[None]:
    """Create `target` if needed and hold its lock; when the body fails (bad input found while tokenizing), take
    back what this call made: the lock file when it was new, the directories when they are empty again. A
    directory that existed before is left as it was; a dataset already there is the build's to keep."""
    made = [d for d in (target, *target.parents) if not d.exists()]
    lock_path = target / _LOCK_FILE
    lock_is_new = not lock_path.exists()
    target.mkdir(parents=True, exist_ok=True)
    try:
        with _locked(lock_path, remove_on_error=lock_is_new):
            yield
    except BaseException:
        for directory in made:  # deepest first; one another process wrote into meanwhile is kept
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


@contextmanager
def _locked(lock_path: Path, *, remove_on_error: bool = False) -> Iterator[None]:
    """Two `prepare` runs on the same directory take turns instead of interleaving their renames. The lock file
    may be removed by a failed run holding it (`remove_on_error`), so a waiter that wakes up holding a removed
    file takes the lock again on the one at the path now."""
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)  # a failed first run may have removed it
        fh = lock_path.open("a")
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fh.close()
    with fh:
        try:
            yield
        except BaseException:
            if remove_on_error:
                lock_path.unlink(missing_ok=True)  # still held: a waiter sees it gone and retries
            raise


# ---- the build --------------------------------------------------------------------------------------------


def _build(target: Path, write: Callable[[Path], Manifest]) -> None:
    """Run `write` (shards + tokenizer into the directory it is given, returning their manifest), then swap in."""
    with partial_dir(target) as partial:
        manifest = write(partial)
        # Swap in. From the unlink until the new manifest lands, the directory does not look prepared; a build
        # that failed before this point left the previous dataset untouched (and consistent with its manifest).
        (target / MANIFEST_FILE).unlink(missing_ok=True)
        for name in [s.file for s in manifest.shards] + [manifest.tokenizer_file]:
            os.replace(partial / name, target / name)
        save_manifest(target, manifest)
    # Only now that the new dataset is in place: shards of the old one (more shards, or format 1) that it lacks.
    listed = {s.file for s in manifest.shards}
    for stale in [p for p in target.iterdir() if is_shard_file(p.name) and p.name not in listed]:
        stale.unlink()


def _tokenize_into(partial: Path, job: _Job) -> Manifest:
    cfg = job.cfg
    pieces = plan_pieces(job.source.files, cfg.shard_mb, cfg.text_field)
    workers = max(1, min(job.workers, len(pieces)))
    with ordered_map(workers) as pmap, progress_bar(job.progress) as bar:
        tokenizer = _make_tokenizer(cfg, pieces, pmap, bar)
        tok_path = tokenizer.save(partial)
        shards = encode_pieces(pieces, partial, tok_path, cfg.text_field, cfg.val_fraction, pmap, bar)
        hashes = list(pmap(sha256_source, [str(f.path) for f in job.source.files]))
    if not any(s.num_tokens for s in shards):  # rows whose text is all empty or null: as an empty text file
        raise ConfigError(
            "data.source",
            f"{cfg.source!r} holds no text (0 tokens; JSONL / Parquet rows are read from the column "
            f"data.text_field={cfg.text_field!r}); allowed: a source with some text",
        )
    sources = source_entries(job.source.files, hashes, pieces)
    return _manifest(cfg, tokenizer, shards, SPLIT_RULE, sources, job.settings, job.fingerprint)


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
        raise UserInputError(f"data.source: {cfg.source!r}: {vocab_problem(tokenizer.vocab_size)}")
    return Manifest(
        tokenizer_kind=tokenizer.kind,
        tokenizer_file=TOKENIZER_FILE,
        vocab_size=tokenizer.vocab_size,
        dtype=token_dtype(tokenizer.vocab_size),
        num_tokens=split_token_counts(shards),
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
    cfg: DataConfig, pieces: Sequence[Piece], pmap: OrderedMap[Any, Any], bar: Progress
) -> Tokenizer:
    texts: Iterable[str]
    sizes = [p.size_bytes for p in pieces]
    if cfg.tokenizer == "char":
        # The char vocabulary only depends on which characters occur: workers send back each piece's alphabet.
        texts = scan_alphabets(pieces, cfg.text_field, pmap, bar)
    else:
        texts = (
            text
            for texts_of_piece in tracked(
                (piece_texts(p, cfg.text_field) for p in pieces), sizes, bar, f"read text for {cfg.tokenizer}"
            )
            for text in texts_of_piece
        )
    # Lazy: kinds that need no data (byte, a tokenizer.json) never read the text.
    return build_tokenizer(cfg.tokenizer, texts, cfg.vocab_size)


def _library_version() -> str | None:
    try:
        return metadata.version("gaudi3-scale")
    except metadata.PackageNotFoundError:
        return None
