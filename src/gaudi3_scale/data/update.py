"""What a `prepare` re-run has to do: nothing, append new source files, or rebuild everything.

A directory is *current* when its manifest's fingerprint (settings + source paths, sizes, mtimes) matches, or when
only mtimes moved and the files' SHA-256 still match (the new fingerprint is then recorded). When the settings are
the same and every file the dataset was built from is still there with the same size and SHA-256, new files are
*appended* (if the tokenizer allows: see `prepare`). Anything else (a setting, a changed or removed file) rebuilds.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.manifest import MANIFEST_FILE, Manifest, save_manifest, verify_prepared
from gaudi3_scale.data.sources import ResolvedSource, SourceFile, sha256_file

__all__ = ["APPEND", "CURRENT", "REBUILD", "Update", "plan_update", "prepared_manifest"]

log = logging.getLogger(__name__)
CURRENT, APPEND, REBUILD = "current", "append", "rebuild"


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
