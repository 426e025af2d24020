"""What a `prepare` re-run has to do: nothing, append new source files, or rebuild everything.

A directory is *current* when its manifest's fingerprint (settings + source paths, sizes, mtimes) matches, or when
only mtimes moved and the files' SHA-256 still match (the new fingerprint is then recorded). When the settings are
the same and every file the dataset was built from is still there with the same size and SHA-256, new files are
*appended* (if the tokenizer allows: see `prepare`). Anything else (a setting, a changed or removed file) rebuilds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.config import DataConfig
from gaudi3_scale.data.encode import (
    encode_pieces,
    ordered_map,
    progress_bar,
    scan_alphabets,
    sha256_source,
    source_entries,
)
from gaudi3_scale.data.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    save_manifest,
    split_token_counts,
    verify_prepared,
)
from gaudi3_scale.data.pieces import plan_pieces
from gaudi3_scale.data.sources import ResolvedSource, SourceFile, sha256_file
from gaudi3_scale.data.tokenizers import CharTokenizer, is_tokenizer_path, load_tokenizer_file

__all__ = [
    "APPEND",
    "CURRENT",
    "PARTIAL_DIR",
    "REBUILD",
    "Update",
    "append_files",
    "partial_dir",
    "plan_update",
    "prepared_manifest",
]

log = logging.getLogger("gaudi3_scale.data.prepare")  # what a user of prepare sees, under one logger name
CURRENT, APPEND, REBUILD = "current", "append", "rebuild"
PARTIAL_DIR = ".partial"  # where a build writes before it swaps in (`partial_dir`)


@dataclass(frozen=True)
class Update:
    action: str  # CURRENT, APPEND or REBUILD
    new_files: tuple[SourceFile, ...] = ()  # APPEND: the files to tokenize, in source order


def prepared_manifest(target: Path) -> Manifest | None:
    """The manifest of a complete prepared directory (shards present, sizes right); None when there is none."""
    if not (target / MANIFEST_FILE).is_file():
        return None
    try:
        return verify_prepared(target, checksums=False)
    except UserInputError as exc:
        log.warning("rebuilding %s: %s", target, exc)
        return None


def plan_update(
    target: Path,
    manifest: Manifest | None,
    settings: dict[str, Any],
    fingerprint: str,
    source: ResolvedSource,
) -> Update:
    if manifest is None:
        return Update(REBUILD)
    if manifest.format_version != FORMAT_VERSION:  # an older layout is rebuilt as the new
        log.warning(
            "rebuilding %s: prepared in layout %s by another gaudi3-scale version, this one reads layout %s",
            target, manifest.format_version, FORMAT_VERSION,
        )  # fmt: skip
        return Update(REBUILD)
    if manifest.fingerprint == fingerprint:
        return Update(CURRENT)
    if manifest.settings != settings:
        return Update(REBUILD)
    current = {str(f.path): f for f in source.files}
    old = manifest.sources
    if any(e.path not in current or current[e.path].size_bytes != e.size_bytes for e in old):
        return Update(REBUILD)  # a file was removed or changed size
    # Same paths and sizes: the content decides (mtimes move on a fresh checkout or a copy).
    if any(sha256_file(Path(e.path)) != e.sha256 for e in old):
        return Update(REBUILD)
    known = {e.path for e in old}
    new_files = tuple(f for f in source.files if str(f.path) not in known)
    if new_files:
        return Update(APPEND, new_files)
    save_manifest(target, dataclasses.replace(manifest, fingerprint=fingerprint))
    return Update(CURRENT)


@contextmanager
def partial_dir(target: Path) -> Iterator[Path]:
    """A fresh ``<target>/.partial/`` to build in, removed afterwards whatever happens. One found there is a
    killed build's: `prepare_dataset` refuses a directory it never built that holds one (`_check_not_foreign`)."""
    partial = target / PARTIAL_DIR
    if partial.exists():
        shutil.rmtree(partial)  # left by a killed run
    partial.mkdir()
    try:
        yield partial
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # whatever a failed build left behind


def append_files(
    target: Path,
    cfg: DataConfig,
    new_files: Sequence[SourceFile],
    fingerprint: str,
    *,
    workers: int,
    progress: bool,
) -> bool:
    """Tokenize only `new_files` into new shard indices; False (nothing written) when the tokenizer cannot take
    them (trained on the data, or new characters for `char`) and the caller must rebuild."""
    if cfg.tokenizer not in ("char", "byte") and not is_tokenizer_path(cfg.tokenizer):
        log.info(
            "rebuilding %s: new source files, and tokenizer=%s is trained on the data", target, cfg.tokenizer
        )
        return False
    manifest = prepared_manifest(target)
    assert manifest is not None  # plan_update found it complete, under the same lock
    tok_path = target / manifest.tokenizer_file
    tokenizer = load_tokenizer_file(tok_path)
    first_index = len(manifest.shards_of("train"))
    pieces = plan_pieces(
        new_files, cfg.shard_mb, cfg.text_field, first_index=first_index, first_source=len(manifest.sources)
    )
    with ordered_map(max(1, min(workers, len(pieces)))) as pmap, progress_bar(progress) as bar:
        if isinstance(tokenizer, CharTokenizer):
            unknown = sorted(
                set("".join(scan_alphabets(pieces, cfg.text_field, pmap, bar))) - set(tokenizer.chars)
            )
            if unknown:
                log.info(
                    "rebuilding %s: the new source files hold %d character(s) outside the char vocabulary (%r)",
                    target,
                    len(unknown),
                    "".join(unknown[:10]),
                )
                return False
        with partial_dir(target) as partial:
            shards = encode_pieces(pieces, partial, tok_path, cfg.text_field, cfg.val_fraction, pmap, bar)
            hashes = list(pmap(sha256_source, [str(f.path) for f in new_files]))
            # The old manifest stays valid while the new shards (new names) are moved in; the new one lands last.
            for shard in shards:
                os.replace(partial / shard.file, target / shard.file)
    shards = [*manifest.shards, *shards]
    updated = dataclasses.replace(
        manifest,
        shards=[*(s for s in shards if s.split == "train"), *(s for s in shards if s.split == "val")],
        num_tokens=split_token_counts(shards),
        sources=[*manifest.sources, *source_entries(new_files, hashes, pieces)],
        fingerprint=fingerprint,
        source_spec=cfg.source,
    )
    save_manifest(target, updated)
    log.info("appended %d shard(s) for %d new source file(s) to %s", len(pieces), len(new_files), target)
    return True
